"""A batch's stream messages: :class:`Prepared` holds one batch's tensor pieces and
encodes them a message at a time; :func:`encode_ahead` encodes a stream's messages on
worker threads just ahead of the one gRPC sends (:data:`ENCODE_AHEAD_BYTES`), so that
gRPC's copy of a message reads bytes still in the CPU's cache rather than from memory, as
it would were whole batches encoded ``prefetch`` ahead. A batch's features, where they
span several messages, are the exception: they are gathered straight into the messages
that carry them (:class:`protos.fastwire.RowMessages`), saving the copy an encode would
make of the batch's largest tensor.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future
from typing import TypeVar

from google.protobuf.message import Message

from protos import codec, fastwire
from protos import sampling_pb2 as pb

T = TypeVar("T")


#: Bytes of tensor data a stream keeps encoded ahead of the message being sent: enough
#: that the sender does not wait on an encode, few enough that they are still in the CPU's
#: cache when gRPC copies them (two messages of the default size).
ENCODE_AHEAD_BYTES = 2 * codec.DEFAULT_CHUNK_BYTES
#: One encode task covers consecutive messages of a batch up to this many bytes of tensor
#: data (at least one message), so that small messages do not each pay a thread handoff.
ENCODE_TASK_BYTES = 1 << 20


class Prepared:
    """One batch ready to send: the tensor pieces of each of its messages
    (:func:`protos.codec.iter_pieces`, already on the host), encoded a message at a time
    by :meth:`message` (:func:`protos.fastwire.encode_message`), then the messages its
    features were gathered into (:class:`protos.fastwire.RowMessages`), if any."""

    __slots__ = ("_built", "_groups", "_head", "encode_seconds", "seeds", "sizes")

    def __init__(self, make_head: Callable[[int, int], Message],
                 groups: list[list[codec.Piece]], seeds: int = 0,
                 built: Sequence[bytes] = (), built_sizes: Sequence[int] = ()) -> None:
        """Message ``i`` of ``n`` is ``make_head(i, n)`` plus group ``i``'s pieces, then
        come the messages ``built`` already (numbered after the groups', e.g.
        :meth:`protos.fastwire.RowMessages.finish`), ``built_sizes`` bytes of tensor
        data each."""
        if len(built) != len(built_sizes):
            raise ValueError(f"built_sizes: expected one per built message ({len(built)}), "
                             f"got {len(built_sizes)}")
        self._head = make_head
        self._groups = groups
        self._built = list(built)
        #: Bytes of tensor data of each message.
        self.sizes = [sum(len(piece.data) for piece in group) for group in groups] + list(built_sizes)
        #: Seeds of the batch (for the server's metrics).
        self.seeds = seeds
        #: Seconds spent encoding (appended by the encode threads).
        self.encode_seconds: list[float] = []

    @classmethod
    def of(cls, make_head: Callable[[int, int], Message], named: dict[str, codec.TensorLike],
           chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES, seeds: int = 0,
           rows: Sequence[fastwire.RowMessages] = ()) -> Prepared:
        """``named`` split into messages of ``chunk_bytes`` of tensor data, then the
        messages of each of ``rows`` (made with the same ``make_head``); message ``i`` of
        ``n`` is ``make_head(i, n)`` plus its pieces."""
        started = time.perf_counter()
        groups = list(codec.iter_pieces(named, chunk_bytes))
        total = len(groups) + sum(len(r) for r in rows)
        built: list[bytes] = []
        sizes: list[int] = []
        for r in rows:
            sizes.extend(r.nbytes)
            built.extend(r.finish(len(groups) + len(built), total))
        prepared = cls(make_head, groups, seeds, built, sizes)
        prepared.encode_seconds.append(time.perf_counter() - started)  # a GPU's copy, if any
        return prepared

    def __len__(self) -> int:
        return len(self._groups) + len(self._built)

    def message(self, index: int) -> bytes:
        """Message ``index``, serialized (its tensor bytes copied once, into it, unless
        they were gathered into it)."""
        if index >= len(self._groups):
            return self._built[index - len(self._groups)]
        return fastwire.encode_message(self._head(index, len(self)), self._groups[index])

    def encode(self, start: int, stop: int) -> list[bytes]:
        """Messages ``start`` to ``stop`` (excluded), serialized; the time is counted."""
        started = time.perf_counter()
        out = [self.message(i) for i in range(start, stop)]
        self.encode_seconds.append(time.perf_counter() - started)
        return out

    def messages(self) -> list[bytes]:
        """Every message, encoded here and now."""
        return self.encode(0, len(self))


def chunk_head(index: int, header: pb.MinibatchHeader) -> Callable[[int, int], pb.MinibatchChunk]:
    """The head of message ``i`` of ``n`` of batch ``index``: ``header`` on chunk 0."""
    def head(i: int, n: int) -> pb.MinibatchChunk:
        msg = pb.MinibatchChunk(batch_index=index, chunk_index=i, num_chunks=n)
        if i == 0:
            msg.header.CopyFrom(header)
        return msg

    return head


def taken_in_order(pending: deque[Future[T]], submit_next: Callable[[], None]
                   ) -> Iterator[Future[T]]:
    """The futures of ``pending`` in order, each left in ``pending`` until the consumer
    asks for the next one, then removed and replaced by ``submit_next()``: a batch counts
    among the ``prefetch`` ahead until it is taken (its messages encoded and sent)."""
    while pending:
        yield pending[0]
        pending.popleft()
        submit_next()


def _produced(future: Future[Prepared]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def encode_ahead(
    batches: Iterator[Future[Prepared]], pool: Executor, ahead_bytes: int = ENCODE_AHEAD_BYTES,
    task_bytes: int = ENCODE_TASK_BYTES,
) -> Iterator[tuple[bytes, Prepared | None]]:
    """The messages of ``batches`` in order, each with its batch when it is the batch's
    last (else None), encoded on ``pool`` ahead of the one yielded: tasks of consecutive
    messages of up to ``task_bytes`` of tensor data (at least one message), queued while
    fewer than two are or they hold less than ``ahead_bytes``. At most two batches are
    held (the one being sent and the next), however small they are, so that taking a
    batch from ``batches`` (which lets its producer start another) stays paced by the
    consumer. The next batch is taken as soon as it is produced, and waited for (or its
    error raised) only when no message is ready to send."""
    for name, value in (("ahead_bytes", ahead_bytes), ("task_bytes", task_bytes)):
        if value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {value}")
    queued: deque[tuple[Future[list[bytes]], Prepared | None, int]] = deque()
    queued_bytes = 0
    batch: Prepared | None = None
    index = 0
    held = 0  # batches taken whose last message was not yielded yet
    upcoming = next(batches, None)
    try:
        while True:
            while len(queued) < 2 or queued_bytes < ahead_bytes:
                if batch is None or index == len(batch):
                    if upcoming is None or held >= 2 or (queued and not _produced(upcoming)):
                        break  # send what is ready first (a failed batch too: its error waits)
                    batch, index = upcoming.result(), 0  # bounded: peer calls carry deadlines
                    held += len(batch) > 0  # a skipped batch has no message to wait for
                    upcoming = next(batches, None)
                    continue
                stop, size = index + 1, batch.sizes[index]
                while stop < len(batch) and size + batch.sizes[stop] <= task_bytes:
                    size += batch.sizes[stop]
                    stop += 1
                queued.append((pool.submit(batch.encode, index, stop),
                               batch if stop == len(batch) else None, size))
                queued_bytes += size
                index = stop
            if not queued:
                return
            future, done, size = queued.popleft()
            messages = future.result()  # local copies of a few MiB: no peer, no wait
            queued_bytes -= size
            for k, message in enumerate(messages):
                yield message, done if k == len(messages) - 1 else None
            held -= done is not None
    finally:
        for future, _, _ in queued:
            future.cancel()
