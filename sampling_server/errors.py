"""Failures a server answers with, in one place: the project's request error (a status
and a message naming the field), requests whose bytes do not parse, the states of a
server that cannot serve yet or any more, the one function that turns every failure
inside a handler into a gRPC status, and the bounds on client text in replies and logs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from protos.channel import PeerError

log = logging.getLogger(__name__)

#: Longest status details a server sends (the rest is cut, saying how much).
MAX_DETAILS_CHARS = 1000
#: Longest client string (client_id, names) a log line quotes.
MAX_LOGGED_CHARS = 100


class RequestError(Exception):
    """A request cannot be served; ``code`` is the gRPC status to answer with and the
    message names the field, what was expected and what was received."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


class NotLoaded(RuntimeError):
    """The partition is not loaded (yet, or its load failed)."""


class Stopping(RuntimeError):
    """The server is stopping: its worker pools are closed, so a call still running
    cannot finish here (the client retries on the restarted server)."""


class MalformedRequest:
    """What the lenient deserializer hands over for bytes that do not parse."""

    def __init__(self, message_type: str, error: Exception):
        self.message_type = message_type
        self.error = error

    def describe(self) -> str:
        """The refusal's text: the message expected and what was received."""
        return (f"{self.message_type}: expected a serialized {self.message_type} message, got "
                f"bytes that do not parse ({self.error})")


def lenient(message_type: Any) -> Callable[[bytes], Any]:
    """A request deserializer that turns unparsable bytes into :class:`MalformedRequest`
    (answered INVALID_ARGUMENT), where gRPC would answer INTERNAL."""
    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except Exception as exc:  # protobuf's DecodeError, or anything else it raises
            return MalformedRequest(message_type.DESCRIPTOR.name, exc)
    return parse


def bounded(text: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def printable(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """A client string safe for one log line: control characters and non-ASCII escaped
    (a newline cannot forge a line), cut to ``limit`` characters."""
    escaped = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return bounded(escaped, limit) if escaped else "-"


@contextmanager
def abort_on_error(context: grpc.ServicerContext, what: str, partition: int,
                   rejected: Callable[[str], None] | None = None) -> Iterator[None]:
    """Answer a failure inside the block with the right status, naming the problem:
    a bad request its own code, a partition not loaded or a server stopping UNAVAILABLE,
    a lost peer UNAVAILABLE, a peer refusing for want of a precondition (e.g. serving
    another graph) FAILED_PRECONDITION, anything else INTERNAL (logged with its traceback). The
    server goes on serving other calls."""
    try:
        yield
    except RequestError as exc:
        if rejected is not None:
            rejected(exc.code.name)
        log.info("%s rejected: %s: %s", what, exc.code.name, bounded(repr(str(exc)), 300))
        context.abort(exc.code, bounded(str(exc)))
    except NotLoaded as exc:
        context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    except Stopping as exc:
        log.info("%s on partition %d: %s", what, partition, exc)
        context.abort(grpc.StatusCode.UNAVAILABLE, f"{what} on partition {partition}: {exc}")
    except PeerError as exc:
        log.warning("%s failed on partition %d: %s", what, partition, exc)
        lost = exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.CANCELLED)
        # a peer on another graph, or without the node tensor asked for: as the peer said
        kept = exc.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
        code = grpc.StatusCode.UNAVAILABLE if lost else exc.code if kept and exc.code is not None \
            else grpc.StatusCode.INTERNAL
        context.abort(code, bounded(f"{what} on partition {partition}: {exc}"))
    except MemoryError:
        log.warning("%s on partition %d: out of memory", what, partition)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"{what} on partition {partition}: the server ran out of memory for this "
                      "request; ask for smaller batches or fewer neighbors")
    except Exception as exc:
        log.exception("%s failed on partition %d", what, partition)
        context.abort(grpc.StatusCode.INTERNAL, bounded(
            f"{what} on partition {partition} failed: {type(exc).__name__}: {exc}"))
