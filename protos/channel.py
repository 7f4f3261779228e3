"""The one place that builds gRPC channels and servers' transport options, and that
turns ``grpc.RpcError`` into graphfeed's own exceptions.

* :func:`create_channel`: message size limits (:data:`codec.MAX_MESSAGE_BYTES`),
  keepalive pings, short reconnect backoff, and **no** transparent retries (see
  :data:`RETRIES_DISABLED`);
* :func:`server_options`: the matching options for ``grpc.server`` (size limits,
  keepalive enforcement that accepts the clients' pings, no ``SO_REUSEPORT``);
* :data:`SLOT_REFUSAL`, :func:`retryable_exhaustion`: how a server says it has no stream
  slot for a caller (worth a retry), as opposed to a ``RESOURCE_EXHAUSTED`` that the same
  call would get again;
* :func:`rpc_errors`: a context manager around a call (and the iteration of its
  stream) that raises a :class:`GraphfeedError` subclass naming the method, address,
  status and details;
* :func:`wait_ready`: wait (bounded) until a channel connects;
* :func:`retry`: try something again after the failures worth another try, with growing
  pauses, within a deadline (the one retry loop of every caller that retries).

Every call site passes a deadline (``timeout=``): graphfeed never waits unbounded.

Why the channel never retries by itself: with gRPC's retry policy enabled, a streaming
call that is in flight when its server is killed and restarted on the same address can
stay blocked far past its deadline (and ``cancel()`` does not free it); with retries
off, such a call fails with ``UNAVAILABLE`` as soon as the connection drops. Callers
that want another attempt make it themselves, through :func:`retry` (the trainer resumes
a broken stream from its next batch; a peer call is retried a few times within its
deadline), and no call
waits for a channel to become ready unless it asks to (``wait_for_ready``), so a call
to a server that is down fails at once instead of sitting out its deadline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from protos import codec
from protos.security import Security, TokenClientInterceptor, default_security

#: Seconds between keepalive pings on a connection (client and server side): a peer
#: whose host vanished or whose process froze is noticed within
#: ``KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S`` even while no message is due.
KEEPALIVE_TIME_S = 5.0
#: Seconds to wait for a keepalive ping's acknowledgement before closing the connection.
KEEPALIVE_TIMEOUT_S = 5.0
#: Shortest interval between client pings that a server accepts (below the clients').
MIN_CLIENT_PING_INTERVAL_S = 4.0
#: Reconnect backoff of a channel whose server is down: start, and ceiling (gRPC's own
#: ceiling is 120 s, far too long for a restarted server to be seen again).
RECONNECT_BACKOFF_S = (0.2, 2.0)
#: The channel options that turn gRPC's transparent and policy retries off.
RETRIES_DISABLED: list[tuple[str, Any]] = [("grpc.enable_retries", 0)]


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _shared_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Message size limits and keepalive, the same on both ends of every call."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", _ms(KEEPALIVE_TIME_S)),
        ("grpc.keepalive_timeout_ms", _ms(KEEPALIVE_TIMEOUT_S)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def channel_options(max_message_bytes: int = codec.MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """The options :func:`create_channel` gives every channel."""
    return [
        *_shared_options(max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", _ms(RECONNECT_BACKOFF_S[0])),
        ("grpc.min_reconnect_backoff_ms", _ms(RECONNECT_BACKOFF_S[0])),
        ("grpc.max_reconnect_backoff_ms", _ms(RECONNECT_BACKOFF_S[1])),
        *RETRIES_DISABLED,
    ]


def create_channel(
    address: str, *, max_message_bytes: int = codec.MAX_MESSAGE_BYTES,
    security: Security | None = None,
) -> grpc.Channel:
    """A channel to ``address`` (``host:port``) with graphfeed's options: TLS when
    ``security`` (default: :func:`~protos.security.default_security`) names a CA or a
    certificate, and its bearer token on every call when it has one.

    The channel connects lazily; use :func:`wait_ready` to wait for the server, and pass
    ``timeout=`` to every call.
    """
    if not address or ":" not in address:
        raise ValueError(f"address: expected 'host:port', got {address!r}")
    sec = security if security is not None else default_security()
    options = channel_options(max_message_bytes)
    channel = (grpc.secure_channel(address, sec.channel_credentials(), options=options)
               if sec.tls else grpc.insecure_channel(address, options=options))
    if sec.token:
        channel = grpc.intercept_channel(channel, TokenClientInterceptor(sec.token))
    return channel


def server_options(max_message_bytes: int = codec.MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """Options for ``grpc.server``: size limits, keepalive (the server pings idle
    clients, so a dead trainer is noticed; it accepts the clients' pings every
    :data:`MIN_CLIENT_PING_INTERVAL_S` or more, also without calls), and no
    ``SO_REUSEPORT`` (a second server on a taken port fails instead of sharing it)."""
    return [
        *_shared_options(max_message_bytes),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(MIN_CLIENT_PING_INTERVAL_S)),
        ("grpc.so_reuseport", 0),
    ]


# ---- errors --------------------------------------------------------------------------


class GraphfeedError(Exception):
    """A graphfeed call failed. The message names what was called, where, the gRPC
    status and the server's details."""

    def __init__(
        self, message: str, *, what: str = "", address: str | None = None,
        code: grpc.StatusCode | None = None, details: str = "",
    ) -> None:
        super().__init__(message)
        #: What was called (e.g. ``"StreamMinibatches"``).
        self.what = what
        #: ``host:port`` of the server called, when known.
        self.address = address
        #: The gRPC status code (None when the error did not come from a status).
        self.code = code
        #: The status details the server sent.
        self.details = details


class ServerUnavailable(GraphfeedError):
    """The server could not be reached, is not ready yet, or a peer it needs is gone
    (``UNAVAILABLE``); worth retrying later."""


class DeadlineExceeded(GraphfeedError):
    """The call's deadline passed (``DEADLINE_EXCEEDED``)."""


class InvalidRequest(GraphfeedError):
    """The request was malformed or out of range (``INVALID_ARGUMENT``); the details
    name the field."""


class FailedPrecondition(GraphfeedError):
    """The request is well formed but the server cannot serve it in its current state
    (``FAILED_PRECONDITION``)."""


class Cancelled(GraphfeedError):
    """The call was cancelled (``CANCELLED``)."""


class ResourceExhausted(GraphfeedError):
    """The server is at a limit (``RESOURCE_EXHAUSTED``: too many streams, message too
    large)."""


class ServerError(GraphfeedError):
    """Any other failure on the server (``INTERNAL``, ``UNKNOWN``, ``UNIMPLEMENTED`` ...)."""


class ProtocolError(GraphfeedError):
    """A reply broke the wire contract (malformed tensors, missing chunks)."""


class PeerError(GraphfeedError):
    """A sampling server's call to a peer server failed; names the peer's partition and
    address. ``code`` is the status of the failed call (None for a malformed reply)."""

    def __init__(self, message: str, *, partition: int, address: str,
                 code: grpc.StatusCode | None = None, details: str = "", what: str = "") -> None:
        super().__init__(message, what=what, address=address, code=code, details=details)
        #: Partition ID of the peer.
        self.partition = partition


_ERROR_OF: dict[grpc.StatusCode, type[GraphfeedError]] = {
    grpc.StatusCode.UNAVAILABLE: ServerUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}


#: Words in the details of every ``RESOURCE_EXHAUSTED`` that a free stream slot cures: the
#: server puts them into every refusal and take-back for want of a slot
#: (``sampling_server/stream_slots.py``); a trainer resumes its stream after a
#: ``RESOURCE_EXHAUSTED`` only when :func:`retryable_exhaustion` finds them.
SLOT_REFUSAL = "no stream slot"


def retryable_exhaustion(details: str | None) -> bool:
    """Whether a ``RESOURCE_EXHAUSTED`` with these details is worth another call: a
    server without a free slot for the caller (now or after ending one of its streams
    for another client). Anything else (a message larger than the limit, a server out of
    memory for this request) would fail again the same way."""
    return SLOT_REFUSAL in (details or "")


def error_from_rpc(error: grpc.RpcError, what: str, address: str | None = None) -> GraphfeedError:
    """The :class:`GraphfeedError` subclass for a failed call, with a clear message."""
    code: grpc.StatusCode | None = error.code() if isinstance(error, grpc.Call) else None
    details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
    where = f" at {address}" if address else ""
    status = code.name if code is not None else "unknown status"
    message = f"{what}{where} failed: {status}: {details}"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        message += ("; every server and trainer of a cluster reads the same token: --token-file FILE "
                    "(or GRAPHFEED_TOKEN_FILE / GRAPHFEED_TOKEN)")
    cls = _ERROR_OF.get(code, ServerError) if code is not None else ServerError
    return cls(message, what=what, address=address, code=code, details=details)


@contextmanager
def rpc_errors(what: str, address: str | None = None) -> Iterator[None]:
    """Turn a ``grpc.RpcError`` raised inside the block into a :class:`GraphfeedError`
    (chained), and a malformed reply (:class:`codec.CodecError`) into
    :class:`ProtocolError`. Wrap both the call and the iteration of a stream::

        with rpc_errors("StreamMinibatches", address):
            for chunk in stub.StreamMinibatches(request, timeout=60):
                ...
    """
    try:
        yield
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, what, address) from exc
    except codec.CodecError as exc:
        where = f" at {address}" if address else ""
        raise ProtocolError(f"{what}{where}: malformed reply: {exc}", what=what,
                            address=address, details=str(exc)) from exc


def wait_ready(channel: grpc.Channel, timeout: float, *, address: str | None = None) -> None:
    """Wait up to ``timeout`` seconds for ``channel`` to connect; raise
    :class:`ServerUnavailable` if it does not."""
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except grpc.FutureTimeoutError:
        where = f" {address}" if address else ""
        raise ServerUnavailable(
            f"server{where} not reachable within {timeout:g} s", what="connect", address=address,
            code=grpc.StatusCode.UNAVAILABLE,
        ) from None


# ---- retrying ------------------------------------------------------------------------

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """The pauses between tries: ``first``, then each ``growth`` times the one before, at
    most ``cap`` seconds."""

    #: Seconds before the second try.
    first: float
    #: Factor from one pause to the next (1: always ``first``).
    growth: float = 2.0
    #: Longest pause.
    cap: float = math.inf

    def __post_init__(self) -> None:
        if not self.first > 0:
            raise ValueError(f"Backoff.first: expected seconds > 0, got {self.first}")
        if not self.growth >= 1:
            raise ValueError(f"Backoff.growth: expected a factor >= 1, got {self.growth}")
        if not self.cap >= self.first:
            raise ValueError(f"Backoff.cap: expected seconds >= first ({self.first}), got {self.cap}")


@dataclass(frozen=True)
class RetryFailure:
    """One failed try, as :func:`retry`'s callbacks see it."""

    #: What the try raised.
    error: BaseException
    #: Failed tries so far in this run of failures (1 at the first).
    attempts: int
    #: Seconds since the run's first failure.
    elapsed: float
    #: Seconds before the next try (0.0 when retrying ends here).
    pause: float
    #: Seconds left before retrying ends (``math.inf`` without a bound).
    left: float


def status_in(*codes: grpc.StatusCode) -> Callable[[BaseException], bool]:
    """A ``retryable`` for :func:`retry`: a failed gRPC call (``grpc.RpcError``, or a
    :class:`GraphfeedError` made of one) whose status is one of ``codes``."""
    wanted = frozenset(codes)

    def retryable(error: BaseException) -> bool:
        if isinstance(error, GraphfeedError):
            return error.code in wanted
        return isinstance(error, grpc.Call) and error.code() in wanted

    return retryable


def retry(
    attempt: Callable[[float], T],
    *,
    backoff: Backoff,
    retryable: Callable[[BaseException], bool],
    deadline: float | None = None,
    window: float | None = None,
    max_attempts: int | None = None,
    progressed: Callable[[], bool] | None = None,
    on_failure: Callable[[RetryFailure], None] | None = None,
    on_give_up: Callable[[RetryFailure], BaseException] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> T:
    """``attempt(seconds left)`` until it returns; its result.

    A failure that ``retryable`` accepts (e.g. :func:`status_in`) is tried again after a
    pause (``backoff``), any other is raised at once. Retrying ends, raising the last
    failure (or what ``on_give_up`` makes of it, chained to it), once

    * ``deadline`` (a ``clock()`` time) has come: each try is given the seconds left
      until it (``math.inf`` without one; at least a millisecond), and the last pause
      ends at it;
    * ``window`` seconds have passed since the first failure of the current run of
      failures (a run starts again, pauses from ``backoff.first``, when ``progressed()``
      says the failed try got further than the one before it: a stream that broke after
      some messages);
    * or ``max_attempts`` tries of the run have failed.

    ``on_failure`` sees each failure that is tried again, before its pause (to log it);
    ``sleep`` waits the pause: a true result (``threading.Event.wait`` of an event that
    was set) ends the retries at once, raising the last failure. ``clock`` and ``sleep``
    are there for tests.
    """
    pause = backoff.first
    run_start: float | None = None
    failed = 0
    while True:
        left = math.inf if deadline is None else deadline - clock()
        try:
            return attempt(max(left, 1e-3))
        except BaseException as error:
            if not retryable(error):
                raise
            now = clock()
            if run_start is None or (progressed is not None and progressed()):
                run_start, pause, failed = now, backoff.first, 0
            failed += 1
            end = min(math.inf if deadline is None else deadline,
                      math.inf if window is None else run_start + window)
            if now >= end or (max_attempts is not None and failed >= max_attempts):
                gave_up = RetryFailure(error, failed, now - run_start, 0.0, max(end - now, 0.0))
                if on_give_up is None:
                    raise
                raise on_give_up(gave_up) from error
            wait = min(pause, end - now)
            if on_failure is not None:
                on_failure(RetryFailure(error, failed, now - run_start, wait, end - now))
            if sleep(wait):
                raise
            pause = min(pause * backoff.growth, backoff.cap)


__all__ = [
    "RETRIES_DISABLED",
    "Backoff",
    "Cancelled",
    "DeadlineExceeded",
    "FailedPrecondition",
    "GraphfeedError",
    "InvalidRequest",
    "PeerError",
    "ProtocolError",
    "ResourceExhausted",
    "RetryFailure",
    "ServerError",
    "ServerUnavailable",
    "channel_options",
    "create_channel",
    "error_from_rpc",
    "retry",
    "rpc_errors",
    "server_options",
    "status_in",
    "wait_ready",
]
