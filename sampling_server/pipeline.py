"""One epoch stream: plan -> sample (ahead, bounded) -> gather -> encode -> send.

A validated :class:`~sampling_server.jobs.EpochJob` lists this server's batches of one
rank. The :class:`SamplingPipeline` produces them (:func:`~sampling_server.produce.produce`)
on a thread pool shared by every stream and served fairly among clients
(:class:`~sampling_server.sampling_queue.FairPool`). Two windows bound what a stream produces:
at most ``prefetch`` batches ahead of the one being sent (the generator queues the next
batch only when gRPC takes the current one), and none past ``prefetch`` +
:data:`IN_TRANSIT_BATCHES` batches beyond what its client has acknowledged taking
(:class:`Pace`): a client that stops reading stops costing sampling work within that
bound, whatever its transport still accepts. A produced batch waits as tensors
(:class:`~sampling_server.messages.Prepared`), its messages encoded just before gRPC
sends them (:func:`~sampling_server.messages.encode_ahead`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext

from protos import codec
from protos import sampling_pb2 as pb
from protos.plan import BatchRef
from sampling_server.errors import Stopping
from sampling_server.hot import HotNodes
from sampling_server.jobs import EpochJob
from sampling_server.messages import Prepared, encode_ahead, taken_in_order
from sampling_server.metrics import ServerMetrics
from sampling_server.node_tensors import NodeTensors
from sampling_server.peer_client import PeerClient
from sampling_server.produce import Producer, produce
from sampling_server.sampling_queue import FairPool
from sampling_server.store import PartitionStore
from sampling_server.threads import kernel_threads, limit_kernel_threads, sampling_workers

log = logging.getLogger(__name__)

#: Batches a stream may have sent beyond what its client acknowledged, besides the
#: ``prefetch`` it produces ahead: room for the batches on the wire and in the client's
#: hands, so that a client that reads keeps its stream full.
IN_TRANSIT_BATCHES = 2


class Pace:
    """How far a stream's producer may run ahead of its client: the batch at position
    ``i`` of the stream (0: its first on this call) is started only while ``i <
    taken + ahead``, ``taken`` being the batches its client acknowledged (:meth:`took`).
    The stream's feed listens for room (:meth:`listen`); :meth:`close` (the call ended)
    tells it to give up the batches it holds back."""

    def __init__(self, ahead: int) -> None:
        if ahead < 1:
            raise ValueError(f"ahead: expected an integer >= 1, got {ahead}")
        self.ahead = ahead
        self._taken = 0
        self._closed = False
        self._lock = threading.Lock()
        self._listener: Callable[[int | None], None] | None = None

    @property
    def limit(self) -> int | None:
        """Positions below this may be started (None: closed, none may)."""
        return None if self._closed else self._taken + self.ahead

    def listen(self, listener: Callable[[int | None], None]) -> None:
        """Call ``listener(limit)`` whenever :attr:`limit` changes (None: closed)."""
        with self._lock:
            self._listener = listener

    def took(self, batches: int) -> None:
        """The client has taken ``batches`` batches in all."""
        self._changed(lambda: setattr(self, "_taken", max(self._taken, batches)))

    def close(self) -> None:
        """The stream's call ended: nothing more may start."""
        self._changed(lambda: setattr(self, "_closed", True))

    def _changed(self, change: Callable[[], None]) -> None:
        with self._lock:
            change()
            if self._listener is not None:
                self._listener(self.limit)


class Ahead:
    """How many batches a stream samples ahead of the one being sent: ``prefetch``, or,
    with ``prefetch_bytes``, as many of the last batch's size as fit in it (at least one;
    one until a batch has been produced)."""

    def __init__(self, prefetch: int, prefetch_bytes: int | None) -> None:
        self.prefetch, self.prefetch_bytes = prefetch, prefetch_bytes
        self._last: int | None = None

    def produced(self, future: Future[Prepared]) -> None:
        """A batch of the stream is done (its bytes, when it was produced, are the next
        estimate)."""
        if not future.cancelled() and future.exception() is None:
            self._last = max(1, sum(future.result().sizes))

    def batches(self) -> int:
        if self.prefetch_bytes is None:
            return self.prefetch
        if self._last is None:
            return 1
        return max(1, min(self.prefetch, self.prefetch_bytes // self._last))


class _Feed:
    """A stream's batches, each a future handed out at once (:meth:`next_future`) and
    queued for sampling once its :class:`Pace` allows, in order; the ones held back are
    cancelled when the pace closes."""

    def __init__(self, pace: Pace, start: Callable[[BatchRef, Future[Prepared]], None]) -> None:
        self._start = start
        self._held: deque[tuple[int, BatchRef, Future[Prepared]]] = deque()
        self._position = 0
        self._limit: int | None = pace.limit
        self._lock = threading.Lock()
        pace.listen(self._room)

    def next_future(self, ref: BatchRef) -> Future[Prepared]:
        future: Future[Prepared] = Future()
        with self._lock:
            self._held.append((self._position, ref, future))
            self._position += 1
            self._release()
        return future

    def _room(self, limit: int | None) -> None:
        with self._lock:
            self._limit = limit
            self._release()

    def _release(self) -> None:
        if self._limit is None:
            for _, _, future in self._held:
                future.cancel()
            self._held.clear()
            return
        while self._held and self._held[0][0] < self._limit:
            _, ref, future = self._held.popleft()
            self._start(ref, future)


class SamplingPipeline:
    """Samples, gathers and encodes the batches of every stream of one server."""

    def __init__(
        self, store: PartitionStore, peers: PeerClient | None, *, workers: int | None = None,
        prefetch: int = 4, chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
        threads: int | None = None, prefetch_bytes: int | None = None,
    ) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch: expected an integer >= 1, got {prefetch}")
        if prefetch_bytes is not None and prefetch_bytes < 1:
            raise ValueError(f"prefetch_bytes: expected bytes >= 1 or None, got {prefetch_bytes}")
        self.store = store
        self.peers = peers
        self.prefetch = prefetch
        #: Bytes of batches a stream samples ahead at most, at least one batch (None: no
        #: bound beyond :attr:`prefetch`).
        self.prefetch_bytes = prefetch_bytes
        self.chunk_bytes = chunk_bytes
        #: Where batches, bytes, seeds and stage latencies are counted (None: nowhere).
        self.metrics: ServerMetrics | None = None
        #: The node tensors whose rows batches may carry (None: none).
        self.node_tensors: NodeTensors | None = None
        #: CPU threads each parallel kernel of a sampling thread may use.
        self.threads = kernel_threads(threads)
        #: Sampling threads (None given: chosen from the CPUs, :func:`sampling_workers`).
        self.workers = workers = sampling_workers(workers)
        self._pool = FairPool(workers, thread_name_prefix="sample", initializer=limit_kernel_threads,
                              initargs=(self.threads,))
        #: Original-ID lookups, and the labels of a batch whose features are partly
        #: cached, run beside the feature gather (all wait on peers); their own threads
        #: (two per sampling thread), so a lookup never waits for a sampling thread.
        self.lookups = ThreadPoolExecutor(2 * workers, thread_name_prefix="lookup",
                                          initializer=limit_kernel_threads, initargs=(self.threads,))
        #: Encodes stream messages just before they are sent (:func:`encode_ahead`).
        self.encoders = ThreadPoolExecutor(max(2, workers), thread_name_prefix="encode")
        self._closed = threading.Event()
        self._hot: dict[str, HotNodes] = {}
        self._hot_lock = threading.Lock()

    def hot_of(self, node_type: str) -> HotNodes:
        """Every partition's hot orders of ``node_type``, for trainers' feature caches;
        made on first use."""
        with self._hot_lock:
            found = self._hot.get(node_type)
            if found is None:
                found = self._hot[node_type] = HotNodes(self.store, node_type, lambda: self.peers,
                                                        self.chunk_bytes)
            return found

    def stage(self, name: str) -> AbstractContextManager[None]:
        return self.metrics.stage(name) if self.metrics is not None else nullcontext()

    def close(self) -> None:
        """Stop the workers (queued batches are dropped; a stream still running ends
        with :class:`~sampling_server.errors.Stopping`)."""
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.lookups.shutdown(wait=False, cancel_futures=True)
        self.encoders.shutdown(wait=False, cancel_futures=True)

    @contextmanager
    def _open(self) -> Iterator[None]:
        """Once :meth:`close` was called, turn what a batch then fails with (a submit
        refused by a closed pool, a cancelled batch, a closed peer channel) into
        :class:`~sampling_server.errors.Stopping`."""
        try:
            yield
        except Exception as exc:  # a cancelled batch is a CancelledError, an Exception
            if self._closed.is_set() and not isinstance(exc, Stopping):
                raise Stopping(f"the server of partition {self.store.partition_id} is "
                               f"shutting down; retry on its restarted server (here: "
                               f"{type(exc).__name__}: {exc})") from exc
            raise

    def stream(self, job: EpochJob, stop: threading.Event | None = None, client: Hashable | None = None,
               pace: Pace | None = None, group: Hashable = None) -> Iterator[tuple[bytes, Prepared | None]]:
        """The serialized messages of ``job``'s batches, in order, each with its batch when
        it is the batch's last (:func:`encode_ahead`), sampled in turn with other
        ``client``s' batches (default: the job's ``client_id``; ``group``: the clients
        sharing one part of the threads, see :class:`FairPool`) and with this client's
        other streams', and no further ahead of what the client took than ``pace``
        allows (None: only ``prefetch`` bounds it). Setting ``stop`` (the client went
        away) skips batches not started yet; closing the generator drops them, as does
        closing ``pace``, which ends the stream."""
        stop = stop or threading.Event()
        key = job.client_id if client is None else client
        refs = iter(job.batches)
        stream = object()  # this call's own turn among the client's streams
        pending: deque[Future[Prepared]] = deque()

        def start(ref: BatchRef, future: Future[Prepared]) -> None:
            self._pool.submit(key, self._produce_unless, stop, job, ref, stream=stream, group=group,
                              future=future)

        feed = _Feed(pace or Pace(len(job.batches) + 1), start)
        ahead = Ahead(self.prefetch, self.prefetch_bytes)

        def submit_next() -> None:
            while len(pending) < ahead.batches():
                ref = next(refs, None)
                if ref is None:
                    return
                future = feed.next_future(ref)
                future.add_done_callback(ahead.produced)
                pending.append(future)

        try:
            with self._open():
                submit_next()
                for message, done in encode_ahead(taken_in_order(pending, submit_next), self.encoders):
                    if self.metrics is not None:
                        self.metrics.sent_message(len(message))
                        if done is not None:
                            self.metrics.sent_batch(done.seeds, sum(done.encode_seconds))
                    yield message, done
        except CancelledError:
            if not stop.is_set() and (pace is None or pace.limit is not None):
                raise
            return  # the call ended: its batches held back were given up
        finally:
            for future in pending:
                future.cancel()

    def _produce_unless(self, stop: threading.Event, job: EpochJob, ref: BatchRef) -> Prepared:
        if stop.is_set():
            return Prepared(lambda i, n: pb.MinibatchChunk(), [])
        return self.produce(job, ref)

    def produce(self, job: EpochJob, ref: BatchRef) -> Prepared:
        """Sample one batch and gather its rows: the batch, ready to encode and send."""
        return produce(Producer(self.store, self.peers, self.lookups, self.hot_of, self.stage,
                                self.chunk_bytes, self.node_tensors), job, ref)
