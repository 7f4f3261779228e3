"""One epoch of minibatches for one rank, streamed from every server that owns some.

Each server streams only its own batches of this rank (``StreamMinibatches``), in
increasing batch index; the epoch plan (:func:`protos.plan.plan_epoch`) says which
server owns batch ``i``. :class:`EpochStream` runs one reader thread per server: it
decodes batches (:class:`~trainer_client.decode.BatchAssembler`) and hands them over
through a bounded prefetch window, and the consumer takes them in batch-index order.

Prefetch is a window over batch indices: a reader may hand over batch ``j`` only while
``j < next + prefetch``, where ``next`` is the batch the consumer waits for. So at most
``prefetch`` decoded batches wait (plus one in each reader's hands), and the reader that
owns ``next`` is never held back, so the merge cannot deadlock. Each batch that joins the
window is acknowledged to its server (:class:`~protos.epoch_call.EpochCall`), which
produces only a few batches past what was acknowledged: a consumer that stops taking
batches stops its servers' sampling for it too.

Failures never hang the trainer:

* a stream that breaks (``UNAVAILABLE``, connection reset, its deadline passing) or that
  stalls (no message for ``stall`` seconds while the reader waits on it: a watchdog
  cancels the call) is called again with ``resume_from`` = the next batch index not yet
  received from that server, with exponential backoff;
* when a server cannot be resumed within ``reconnect`` seconds of the failure, the
  reader fails with :class:`~protos.channel.ServerUnavailable` naming the server, and
  the consumer raises it;
* a malformed batch (:class:`~protos.channel.ProtocolError`) or a rejected request
  (e.g. :class:`~protos.channel.InvalidRequest`, or a ``RESOURCE_EXHAUSTED`` that no free
  stream slot cures: :func:`resumable`) is raised at once;
* every wait of the consumer is bounded, with a safety net beyond the readers' own
  deadlines.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import grpc

from protos import fastwire
from protos import sampling_pb2 as pb
from protos.channel import (
    Backoff,
    DeadlineExceeded,
    GraphfeedError,
    ProtocolError,
    RetryFailure,
    ServerUnavailable,
    error_from_rpc,
    retry,
    retryable_exhaustion,
)
from protos.codec import CodecError
from protos.epoch_call import EpochCall
from trainer_client.decode import BatchAssembler, BatchSpec, DecodedBatch, pin_batch

log = logging.getLogger(__name__)

#: Status codes after which a stream is called again from its next batch. The stream's
#: own deadline passing, a server going away (CANCELLED, ABORTED) and a server without
#: a stream slot for this rank (RESOURCE_EXHAUSTED: at its stream limit, e.g. while it
#: still counts the broken stream, or ending this stream to serve a client below its
#: fair share while this one was not read) are resumable too: the batches are pure
#: functions of the request, so resuming loses nothing, and ``reconnect`` bounds the
#: retries.
RESUMABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
})


def resumable(code: grpc.StatusCode | None, details: str | None) -> bool:
    """Whether a stream that failed with ``code`` is called again from its next batch:
    a code of :data:`RESUMABLE_CODES`, except a ``RESOURCE_EXHAUSTED`` that no free slot
    cures (a message over the size limit, a server out of memory for this request:
    the same call would fail again), which is raised at once."""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return retryable_exhaustion(details)
    return code in RESUMABLE_CODES


@dataclass(frozen=True)
class StreamTimeouts:
    """How long an epoch stream waits before it resumes, and before it gives up."""

    #: Seconds without a message, while a reader waits on its stream, before the stream
    #: counts as stalled and is resumed.
    stall: float = 60.0
    #: Seconds after a stream broke during which it is called again; then the server
    #: counts as gone (ServerUnavailable naming it). A server restarted within this
    #: time is rejoined and its stream resumed from the next batch this rank lacks.
    reconnect: float = 15.0
    #: gRPC deadline of one StreamMinibatches call; when it passes mid-epoch, the stream
    #: is resumed (so it only bounds a call, never the epoch).
    call_deadline: float = 3600.0
    #: First pause between reconnect attempts, doubled after each failure.
    backoff_initial: float = 0.1
    #: Longest pause between reconnect attempts.
    backoff_max: float = 2.0

    def __post_init__(self) -> None:
        for name in ("stall", "reconnect", "call_deadline", "backoff_initial", "backoff_max"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name}: expected seconds > 0, got {value}")

    @property
    def give_up_after(self) -> float:
        """Longest the consumer waits for a reader that shows no sign of life."""
        return self.stall + self.reconnect + self.backoff_max + 10.0


@dataclass(frozen=True)
class ServerStream:
    """What one server streams to this rank in one epoch."""

    #: Partition the server holds.
    partition: int
    #: ``host:port`` of the server.
    address: str
    #: Stub on the server's channel.
    stub: fastwire.MinibatchStreamStub
    #: The epoch request (``resume_from`` is set per call).
    request: pb.EpochRequest
    #: This rank's batch indices the server owns, increasing.
    indices: tuple[int, ...]
    #: What the job read of this server (set as ``request.expect`` on every call, so a
    #: server restarted with another graph refuses the resume); None: not checked.
    expect: pb.ServerExpectation | None = None


@dataclass
class StreamStats:
    """Counters of one epoch stream."""

    #: Batches handed to the consumer.
    batches: int = 0
    #: Bytes received (serialized messages of complete batches).
    bytes: int = 0
    #: Streams called again after a break or stall.
    resumes: int = 0
    #: Seconds the consumer waited for batches that were not there yet.
    wait_seconds: float = 0.0
    #: Feature rows of the batches handed to the consumer, and how many of them came
    #: from the feature cache (counted with their bytes, so that the two agree).
    rows: int = 0
    cached_rows: int = 0

    def count_rows(self, rows: int, cached: int) -> None:
        """Add a batch's feature rows (``cached`` of them from the cache), in the
        consumer's thread when it takes the batch."""
        self.rows += rows
        self.cached_rows += cached

    @property
    def hit_rate(self) -> float:
        """Share of the feature rows served from the trainer's feature cache."""
        return self.cached_rows / self.rows if self.rows else 0.0


class _State(enum.Enum):
    IDLE = "idle"  # between calls (backoff) or not started
    RECEIVING = "receiving"  # waiting on the stream: stall time counts
    HOLDING = "holding"  # holding a batch outside the prefetch window
    DONE = "done"


@dataclass(eq=False)
class _Reader:
    """Per-server state, shared by its reader thread, the watchdog and the consumer
    (under the stream's lock)."""

    server: ServerStream
    position: int = 0
    state: _State = _State.IDLE
    last_activity: float = field(default_factory=time.monotonic)
    call: EpochCall | None = None
    stalled: bool = False
    error: BaseException | None = None
    thread: threading.Thread | None = None

    @property
    def next_index(self) -> int:
        """The next batch index not yet received from this server."""
        return self.server.indices[self.position]

    @property
    def finished(self) -> bool:
        return self.position >= len(self.server.indices)

    def describe(self) -> str:
        return f"server {self.server.address} (partition {self.server.partition})"


class EpochStream:
    """Merges the servers' streams of one epoch into batches in index order.

    Use as a context manager (or call :meth:`close`) so the reader threads stop::

        with EpochStream(servers, num_batches, spec) as stream:
            for batch in stream:   # DecodedBatch, index 0, 1, ...
                ...
    """

    def __init__(
        self,
        servers: Sequence[ServerStream],
        num_batches: int,
        spec: BatchSpec,
        *,
        prefetch: int = 4,
        timeouts: StreamTimeouts | None = None,
        pin_memory: bool = False,
        finish: Callable[[DecodedBatch], DecodedBatch] | None = None,
    ) -> None:
        """``finish``, when given, runs in the reader threads on each decoded batch before
        it joins the prefetch window (the loader completes a CPU batch there: cached feature
        rows, casts), so that this work overlaps the consumer's step; an error it raises
        reaches the consumer as the reader's error."""
        if prefetch < 1:
            raise ValueError(f"prefetch: expected >= 1, got {prefetch}")
        self._spec = spec
        self._num_batches = num_batches
        self._prefetch = prefetch
        self._timeouts = timeouts or StreamTimeouts()
        self._pin = pin_memory
        self._finish = finish
        self._readers = [_Reader(s) for s in servers if s.indices]
        self._owner = self._owners(self._readers, num_batches)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._ready: dict[int, DecodedBatch] = {}
        self._next = 0
        self._started = False
        self._watchdog: threading.Thread | None = None
        #: Counters of this epoch (read them after the epoch).
        self.stats = StreamStats()

    @staticmethod
    def _owners(readers: list[_Reader], num_batches: int) -> list[_Reader]:
        """``owner[i]``: the reader of batch ``i``; check the indices cover the epoch once."""
        owner: list[_Reader | None] = [None] * num_batches
        for r in readers:
            indices = r.server.indices
            if list(indices) != sorted(set(indices)):
                raise ValueError(f"indices of {r.describe()}: expected increasing, got {list(indices)}")
            for i in indices:
                if not 0 <= i < num_batches or owner[i] is not None:
                    raise ValueError(f"indices: batch {i} of {r.describe()} is out of range or owned twice")
                owner[i] = r
        missing = [i for i, r in enumerate(owner) if r is None]
        if missing:
            raise ValueError(f"indices: expected every batch 0 .. {num_batches - 1} owned, missing {missing}")
        return [r for r in owner if r is not None]

    # ---- consumer side ------------------------------------------------------------------

    def __len__(self) -> int:
        return self._num_batches

    def __enter__(self) -> EpochStream:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def start(self) -> None:
        """Start the reader threads and the watchdog (idempotent)."""
        if self._started:
            return
        self._started = True
        for r in self._readers:
            r.thread = threading.Thread(
                target=self._run, args=(r,), daemon=True,
                name=f"graphfeed-stream-p{r.server.partition}",
            )
            r.thread.start()
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="graphfeed-watchdog")
        self._watchdog.start()

    def __iter__(self) -> Iterator[DecodedBatch]:
        self.start()
        return self

    def __next__(self) -> DecodedBatch:
        if self._next >= self._num_batches:
            self.close()
            raise StopIteration
        try:
            return self._take(self._next)
        except BaseException:
            self.close()
            raise

    def _take(self, index: int) -> DecodedBatch:
        """Wait (bounded) for batch ``index``; raise a reader's error at once."""
        owner = self._owner[index]
        started = time.monotonic()
        with self._cond:
            while index not in self._ready:
                self._raise_errors()
                if self._stop.is_set():
                    raise GraphfeedError("epoch stream: expected an open stream, got a closed one")
                silent = time.monotonic() - owner.last_activity
                if silent > self._timeouts.give_up_after:
                    raise DeadlineExceeded(
                        f"epoch stream: no sign of life from {owner.describe()} for {silent:.1f} s "
                        f"while waiting for batch {index}",
                        what="StreamMinibatches", address=owner.server.address,
                    )
                self._cond.wait(0.25)
            batch = self._ready.pop(index)
            self._next = index + 1
            self._cond.notify_all()
        self.stats.wait_seconds += time.monotonic() - started
        self.stats.batches += 1
        self.stats.bytes += batch.nbytes
        return batch

    def _raise_errors(self) -> None:
        for r in self._readers:
            if r.error is not None:
                raise r.error

    def close(self) -> None:
        """Stop the readers (cancelling their calls) and wait for them (bounded)."""
        with self._cond:
            self._stop.set()
            calls = [r.call for r in self._readers if r.call is not None]
            self._cond.notify_all()
        for call in calls:
            call.cancel()
        threads = [r.thread for r in self._readers] + [self._watchdog]
        for thread in threads:
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5.0)
                if thread.is_alive():
                    log.warning("thread %s did not stop within 5 s", thread.name)
        self._ready.clear()

    # ---- reader side --------------------------------------------------------------------

    def _run(self, r: _Reader) -> None:
        """Reader thread: stream the server's batches; hand any failure to the consumer."""
        try:
            self._read_all(r)
        except BaseException as exc:  # handed over, raised in the consumer's thread
            with self._cond:
                r.error = exc
                self._cond.notify_all()
        finally:
            with self._cond:
                r.state = _State.DONE
                r.call = None

    def _read_all(self, r: _Reader) -> None:
        """Call the server until every batch it owns arrived, resuming after breaks
        (:func:`protos.channel.retry`: pauses from ``backoff_initial`` doubling to
        ``backoff_max``, for up to ``reconnect`` seconds after a break; a stream that
        delivered batches before it broke starts that count again)."""
        t = self._timeouts
        assembler = BatchAssembler(self._spec, pinned=self._pin)
        request = pb.EpochRequest()
        request.CopyFrom(r.server.request)
        if r.server.expect is not None:
            request.expect.CopyFrom(r.server.expect)
        start = [r.position]  # where the current call began

        def attempt(_: float) -> None:
            # The first call asks from 0 (the same thing: the server sends only its own
            # batches), so that resume_from > 0 in the server's log means a resume.
            request.resume_from, start[0] = (r.next_index if r.position else 0), r.position
            self._read_call(r, request, assembler)

        def broke(f: RetryFailure) -> None:
            log.warning("%s: stream broke at batch %d (%s); resuming in %.2f s", r.describe(), r.next_index,
                        self._reason(r, f.error), f.pause)
            r.last_activity = time.monotonic()
            self.stats.resumes += 1

        try:
            retry(attempt, backoff=Backoff(t.backoff_initial, 2.0, t.backoff_max), window=t.reconnect,
                  retryable=lambda err: not (self._stop.is_set() or r.finished) and (
                      r.stalled or (isinstance(err, grpc.Call) and resumable(err.code(), err.details()))),
                  progressed=lambda: r.position > start[0], on_failure=broke,
                  on_give_up=lambda f: self._gone(r, request, f), sleep=self._stop.wait)
        except grpc.RpcError as err:
            if not (self._stop.is_set() or r.finished):
                raise error_from_rpc(err, "StreamMinibatches", r.server.address) from err

    def _reason(self, r: _Reader, err: BaseException) -> str:
        """Why a stream broke, for messages."""
        return f"stalled for {self._timeouts.stall:g} s" if r.stalled else \
            f"{err.code().name}: {err.details()}"  # type: ignore[attr-defined]

    def _gone(self, r: _Reader, request: pb.EpochRequest, f: RetryFailure) -> ServerUnavailable:
        """The error of a stream that could not be resumed in time."""
        why = self._reason(r, f.error)
        return ServerUnavailable(
            f"{r.describe()}: stream of rank {request.rank}, epoch {request.epoch} broke at batch "
            f"{r.next_index} and could not be resumed within {self._timeouts.reconnect:g} s "
            f"({f.attempts} attempts); last error: {why}", what="StreamMinibatches", address=r.server.address,
            code=f.error.code(), details=why)  # type: ignore[attr-defined]

    def _read_call(self, r: _Reader, request: pb.EpochRequest, assembler: BatchAssembler) -> None:
        """One StreamMinibatches call: receive, check and hand over batches until it ends
        (a half-received batch is dropped when it breaks)."""
        call = r.server.stub.StreamMinibatches(request, timeout=self._timeouts.call_deadline)
        taken = 0  # batches of this call in the prefetch window: what it acknowledges
        with self._cond:
            if self._stop.is_set():
                call.cancel()
                return
            r.call, r.stalled = call, False
            r.state, r.last_activity = _State.RECEIVING, time.monotonic()
        try:
            for msg in call:
                r.last_activity = time.monotonic()
                try:
                    batch = assembler.add(msg)
                except CodecError as exc:
                    raise ProtocolError(
                        f"StreamMinibatches at {r.server.address}: malformed reply: {exc}",
                        what="StreamMinibatches", address=r.server.address, details=str(exc),
                    ) from exc
                if batch is not None and self._hand_over(r, batch):
                    taken += 1
                    call.taken(taken)
        except grpc.RpcError:
            assembler.reset()
            raise
        finally:
            with self._cond:
                r.call, r.state = None, _State.IDLE
            call.cancel()  # no-op once the call ended
        if not r.finished and not self._stop.is_set():
            raise ProtocolError(f"StreamMinibatches at {r.server.address}: stream ended before batch "
                                f"{r.next_index} (expected batches {list(r.server.indices[r.position:])})",
                                what="StreamMinibatches", address=r.server.address)

    def _hand_over(self, r: _Reader, batch: DecodedBatch) -> bool:
        """Check a batch's index, then wait (bounded steps) for room in the window;
        whether the batch joined it (not when the stream was closed meanwhile)."""
        if r.finished or batch.index != r.next_index:
            expected = "no more batches" if r.finished else f"batch {r.next_index}"
            raise ProtocolError(
                f"StreamMinibatches at {r.server.address}: batch_index: expected {expected} "
                f"(this rank's batches of partition {r.server.partition} by the epoch plan), "
                f"got {batch.index}",
                what="StreamMinibatches", address=r.server.address,
            )
        if self._finish is not None:
            batch = self._finish(batch)
        if self._pin:
            pin_batch(batch.data)
        with self._cond:
            r.state = _State.HOLDING
            while batch.index >= self._next + self._prefetch and not self._stop.is_set():
                self._cond.wait(0.5)
            if self._stop.is_set():
                return False
            self._ready[batch.index] = batch
            r.position += 1
            r.state, r.last_activity = _State.RECEIVING, time.monotonic()
            self._cond.notify_all()
            return True

    def _watch(self) -> None:
        """Watchdog thread: cancel calls that sent nothing for ``stall`` seconds."""
        stall = self._timeouts.stall
        interval = min(0.5, stall / 4)
        last_tick = time.monotonic()
        while not self._stop.wait(interval):
            now = time.monotonic()
            late = now - last_tick - interval
            last_tick = now
            with self._cond:
                if late > stall / 2:
                    # This process itself was not scheduled (a busy host, a long GIL hold):
                    # the readers could not read either, so silence says nothing of the
                    # servers. Give each waiting stream a fresh window instead of a resume.
                    log.info("stream watchdog woke %.1f s late; not judging streams this round", late)
                    for r in self._readers:
                        if r.state is _State.RECEIVING:
                            r.last_activity = now
                    continue
                for r in self._readers:
                    if (r.state is _State.RECEIVING and r.call is not None and not r.stalled
                            and now - r.last_activity > stall):
                        log.warning("%s: no message for %.1f s; resuming its stream", r.describe(), stall)
                        r.stalled = True
                        r.call.cancel()
            if all(r.state is _State.DONE for r in self._readers):
                return
