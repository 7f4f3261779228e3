"""A ``StreamMinibatches`` call from the client's side: the epoch request first, then an
acknowledgement (``BatchesTaken``) each time the client's application takes a batch.

The server produces a stream's batches only a bounded number ahead of what its client
has acknowledged, so a client that stops reading stops costing the server sampling work
whatever its transport still accepts (docs/wire.md "Acknowledgements"). :class:`EpochCall`
is the call: iterate it for the messages, and say what the application took with
:meth:`EpochCall.taken`, or let it acknowledge each batch as its last message is read
(``acknowledge=last_chunk``). Its requests go out from gRPC's own sending thread, fed by a
queue that ends with the call.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from protos import sampling_pb2 as pb

METHOD = "/graphfeed.v1.SamplingService/StreamMinibatches"

_END = object()


def last_chunk(message: Any) -> bool:
    """Whether ``message`` (a ``MinibatchChunk``, parsed or as a
    :class:`protos.fastwire.WireMessage`) is the last of its batch."""
    return bool(message.chunk_index == message.num_chunks - 1)


class EpochCall:
    """One ``StreamMinibatches`` call (see the module doc). Iterating it yields the
    stream's messages and raises the call's ``grpc.RpcError`` as gRPC does; ``cancel``,
    ``code``, ``details`` and ``is_active`` are the call's."""

    def __init__(self, method: grpc.StreamStreamMultiCallable, request: pb.EpochRequest, *,
                 timeout: float, acknowledge: Callable[[Any], bool] | None = None,
                 metadata: Sequence[tuple[str, str]] | None = None) -> None:
        """``acknowledge``: a test of each message read; when it holds, one more batch
        is acknowledged as taken (None: only :meth:`taken` acknowledges)."""
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._outbox.put(pb.StreamMinibatchesRequest(epoch=request))
        self._acknowledge = acknowledge
        self._count = 0
        self._lock = threading.Lock()
        self._call: Any = method(self._requests(), timeout=timeout, metadata=metadata)
        self._call.add_done_callback(lambda _: self._outbox.put(_END))

    def _requests(self) -> Iterator[pb.StreamMinibatchesRequest]:
        while (item := self._outbox.get()) is not _END:
            yield item  # type: ignore[misc]

    def taken(self, batches: int) -> None:
        """Acknowledge that the application has taken ``batches`` batches of this call
        in all (counts only grow; a smaller or equal count sends nothing)."""
        with self._lock:
            if batches <= self._count:
                return
            self._count = batches
            self._outbox.put(pb.StreamMinibatchesRequest(taken=pb.BatchesTaken(batches=batches)))

    @property
    def acknowledged(self) -> int:
        """Batches acknowledged so far."""
        return self._count

    def __iter__(self) -> EpochCall:
        return self

    def __next__(self) -> Any:
        message = next(self._call)
        if self._acknowledge is not None and self._acknowledge(message):
            self.taken(self._count + 1)
        return message

    def cancel(self) -> bool:
        return bool(self._call.cancel())

    def code(self) -> grpc.StatusCode | None:
        return self._call.code()

    def details(self) -> str | None:
        return self._call.details()

    def is_active(self) -> bool:
        return bool(self._call.is_active())


def stream_minibatches(channel: grpc.Channel, request: pb.EpochRequest, *, timeout: float,
                       metadata: Sequence[tuple[str, str]] | None = None,
                       parse: Callable[[bytes], Any] | None = pb.MinibatchChunk.FromString,
                       acknowledge: Callable[[Any], bool] | None = last_chunk) -> EpochCall:
    """A ``StreamMinibatches`` call on ``channel`` whose messages are parsed by ``parse``
    (None: the raw bytes) and acknowledged batch by batch as they are read (``acknowledge``
    None: only by :meth:`EpochCall.taken`)."""
    if parse is None and acknowledge is last_chunk:
        raise ValueError("acknowledge: expected None (acknowledge with EpochCall.taken) for messages left "
                         "as bytes (parse=None), got last_chunk, which reads parsed messages")
    method = channel.stream_stream(METHOD, request_serializer=pb.StreamMinibatchesRequest.SerializeToString,
                                   response_deserializer=parse)
    return EpochCall(method, request, timeout=timeout, acknowledge=acknowledge, metadata=metadata)
