"""One epoch stream: plan -> sample (ahead, bounded) -> gather -> encode -> send.

A validated :class:`EpochJob` lists this server's batches of one rank. The
:class:`SamplingPipeline` samples them on a thread pool shared by every stream, at
most ``prefetch`` batches ahead of the one being sent: the generator submits the next
batch only when the client takes the current one, so a slow client holds back its own
stream (gRPC flow control) and nothing queues without bound.

A sampled batch waits as tensors (:class:`Prepared`), not as messages: its messages
are encoded on the encode threads :data:`ENCODE_AHEAD_BYTES` before gRPC sends them
(:func:`encode_ahead`), so that gRPC's copy of a message reads bytes still in the CPU's
cache rather than from memory, as it would were whole batches encoded ``prefetch`` ahead.
Its features, where they span several messages, are the exception: the gather writes
them into the messages that carry them (:class:`protos.fastwire.RowMessages`), which
saves the copy an encode would make of the batch's largest tensor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import numpy as np
import torch
from google.protobuf.message import Message

from partitioner.graph import EdgeType
from protos import codec, compact, fastwire
from protos import sampling_pb2 as pb
from protos.plan import BatchRef, EpochPlan, GlobalPlan
from sampling_server.hetero_pipeline import produce_typed
from sampling_server.hot import HotNodes
from sampling_server.limits import printable
from sampling_server.metrics import ServerMetrics
from sampling_server.peer import BoundPeers, PeerCallOptions, PeerClient
from sampling_server.sampler import NeighborSampler, batch_key
from sampling_server.sampler.base import begin
from sampling_server.store import PartitionStore, Stopping
from sampling_server.threads import kernel_threads, limit_kernel_threads, sampling_workers

log = logging.getLogger(__name__)

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
           rows: fastwire.RowMessages | None = None) -> Prepared:
        """``named`` split into messages of ``chunk_bytes`` of tensor data, then the
        messages of ``rows`` (made with the same ``make_head``); message ``i`` of ``n``
        is ``make_head(i, n)`` plus its pieces."""
        started = time.perf_counter()
        groups = list(codec.iter_pieces(named, chunk_bytes))
        built = rows.finish(len(groups), len(groups) + len(rows)) if rows is not None else []
        prepared = cls(make_head, groups, seeds, built, rows.nbytes if rows is not None else [])
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


@dataclass(frozen=True)
class TypedJob:
    """What a typed epoch request adds (``EpochRequest.typed``)."""

    #: Node type of the seeds.
    seed_type: str
    #: Fanouts per edge type and hop (every edge type of the graph, PyG's semantics).
    fanouts: dict[EdgeType, list[int]]
    #: The trainer's feature cache plan per node type (``EpochRequest.typed_cache_counts``:
    #: one count per partition); types left out are not cached.
    cache_counts: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class EpochJob:
    """A validated ``EpochRequest``: what one stream samples and sends."""

    #: The epoch's plan (every partition and rank): per-partition or global batches.
    plan: EpochPlan | GlobalPlan
    #: This server's batches of :attr:`rank`, from ``resume_from`` on, in index order.
    batches: tuple[BatchRef, ...]
    #: int64 seeds: per-partition batches: this partition's, in the order the plan cuts
    #: them (shuffled or not); global batches: all of them, in request order.
    seeds: np.ndarray
    #: Fanout per hop (-1: all neighbors).
    fanouts: tuple[int, ...]
    #: Base random seed, epoch and rank: with the batch index they key every draw.
    seed: int
    epoch: int
    rank: int
    #: Sampling options.
    replace: bool
    weighted: bool
    #: Send features / labels.
    features: bool
    labels: bool
    #: Wire dtype of ``x`` (resolved: never DTYPE_UNSPECIFIED).
    feature_dtype: codec.WireDType
    #: The caller, for logs.
    client_id: str = ""
    #: Send the nodes' original IDs ("orig_id").
    original_ids: bool = False
    #: The trainer's feature cache plan (``EpochRequest.cache_counts``); empty: none.
    cache_counts: tuple[int, ...] = ()
    #: Send the structure in compact form (``EpochRequest.compact_indices``, protos/compact.py).
    compact: bool = False
    #: Typed sampling (a typed graph); None: homogeneous. ``feature_dtype`` may then be
    #: DTYPE_UNSPECIFIED (each type's stored dtype).
    typed: TypedJob | None = None

    def seeds_of(self, ref: BatchRef, partition: int) -> np.ndarray:
        """The seeds of one of this server's batches, in batch order."""
        if isinstance(self.plan, GlobalPlan):
            return self.seeds[self.plan.positions(ref.part_batch)]
        return self.plan.seeds_of(partition, ref.part_batch, self.seeds)

    @property
    def num_batches(self) -> int:
        """Batches of the rank's whole epoch (across all servers), as in the header."""
        return self.plan.batches_per_rank


class SamplingPipeline:
    """Samples, gathers and encodes the batches of every stream of one server."""

    def __init__(
        self, store: PartitionStore, peers: PeerClient | None, *, workers: int | None = None,
        prefetch: int = 4, chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
        threads: int | None = None,
    ) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch: expected an integer >= 1, got {prefetch}")
        self.store = store
        self.peers = peers
        self.prefetch = prefetch
        self.chunk_bytes = chunk_bytes
        #: Where batches, bytes, seeds and stage latencies are counted (None: nowhere).
        self.metrics: ServerMetrics | None = None
        #: Every partition's hot order, for trainers' feature caches.
        self.hot = HotNodes(store, lambda: self.peers, chunk_bytes)
        #: CPU threads each parallel kernel of a sampling thread may use.
        self.threads = kernel_threads(threads)
        #: Sampling threads (None given: chosen from the CPUs, :func:`sampling_workers`).
        self.workers = workers = sampling_workers(workers)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="sample",
                                        initializer=limit_kernel_threads, initargs=(self.threads,))
        #: Original-ID lookups, and the labels of a batch whose features are partly
        #: cached, run beside the feature gather (all wait on peers); their own threads
        #: (two per sampling thread), so a lookup never waits for a sampling thread.
        self.lookups = ThreadPoolExecutor(2 * workers, thread_name_prefix="lookup",
                                          initializer=limit_kernel_threads, initargs=(self.threads,))
        #: Encodes stream messages just before they are sent (:func:`encode_ahead`).
        self.encoders = ThreadPoolExecutor(max(2, workers), thread_name_prefix="encode")
        self._closed = threading.Event()
        self._typed_hot: dict[str, HotNodes] = {}
        self._typed_hot_lock = threading.Lock()

    def hot_of(self, node_type: str | None) -> HotNodes:
        """The hot orders of ``node_type`` on a typed graph (made on first use), or of the
        homogeneous graph's nodes (None)."""
        if node_type is None:
            return self.hot
        with self._typed_hot_lock:
            found = self._typed_hot.get(node_type)
            if found is None:
                found = self._typed_hot[node_type] = HotNodes(
                    self.store, lambda: self.peers, self.chunk_bytes, node_type)
            return found

    def stage(self, name: str) -> AbstractContextManager[None]:
        return self.metrics.stage(name) if self.metrics is not None else nullcontext()

    def close(self) -> None:
        """Stop the workers (queued batches are dropped; a stream still running ends
        with :class:`~sampling_server.store.Stopping`)."""
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.lookups.shutdown(wait=False, cancel_futures=True)
        self.encoders.shutdown(wait=False, cancel_futures=True)

    @contextmanager
    def _open(self) -> Iterator[None]:
        """Once :meth:`close` was called, turn what a batch then fails with (a submit
        refused by a closed pool, a cancelled batch, a closed peer channel) into
        :class:`~sampling_server.store.Stopping`."""
        try:
            yield
        except Exception as exc:  # a cancelled batch is a CancelledError, an Exception
            if self._closed.is_set() and not isinstance(exc, Stopping):
                raise Stopping(f"the server of partition {self.store.partition_id} is "
                               f"shutting down; retry on its restarted server (here: "
                               f"{type(exc).__name__}: {exc})") from exc
            raise

    def stream(
        self, job: EpochJob, stop: threading.Event | None = None
    ) -> Iterator[tuple[bytes, Prepared | None]]:
        """The serialized messages of ``job``'s batches, in order, each with its batch when
        it is the batch's last (:func:`encode_ahead`). Setting ``stop`` (the client went
        away) skips batches not started yet; closing the generator drops them."""
        stop = stop or threading.Event()
        refs = iter(job.batches)
        pending: deque[Future[Prepared]] = deque()

        def submit_next() -> None:
            ref = next(refs, None)
            if ref is not None:
                pending.append(self._pool.submit(self._produce_unless, stop, job, ref))

        try:
            with self._open():
                for _ in range(self.prefetch):
                    submit_next()
                for message, done in encode_ahead(taken_in_order(pending, submit_next),
                                                  self.encoders):
                    if self.metrics is not None:
                        self.metrics.sent_message(len(message))
                        if done is not None:
                            self.metrics.sent_batch(done.seeds, sum(done.encode_seconds))
                    yield message, done
        finally:
            for future in pending:
                future.cancel()

    def _produce_unless(
        self, stop: threading.Event, job: EpochJob, ref: BatchRef
    ) -> Prepared:
        if stop.is_set():
            return Prepared(lambda i, n: pb.MinibatchChunk(), [])
        return self.produce(job, ref)

    def _rows(self, sampler: NeighborSampler, head: Callable[[int, int], Message], count: int,
              dtype: torch.dtype) -> fastwire.RowMessages | None:
        """Stream messages to gather ``count`` feature rows straight into, where they
        span more than one message (else None: the rows go in a tensor, encoded with the
        batch's others)."""
        x = getattr(sampler.partition, "x", None)
        if x is None or x.ndim < 2:
            return None
        row = tuple(x.shape[1:])
        if not fastwire.RowMessages.worth_it(dtype, row, count, self.chunk_bytes):
            return None
        return fastwire.RowMessages(head, "x", dtype, count, row, self.chunk_bytes)

    def _gather(self, job: EpochJob, sampler: NeighborSampler, n_id: torch.Tensor,
                bound: BoundPeers | None, head: Callable[[int, int], Message],
                ) -> tuple[dict[str, codec.TensorLike], fastwire.RowMessages | None]:
        """The batch's "x" and "y" as the job asks; with a cache plan, "x" holds only the
        rows the trainer lacks and "x_cached" marks the others. "x" is gathered straight
        into its stream messages where it spans several (returned apart, else None)."""
        remote = bound.node_data if bound else None
        named: dict[str, codec.TensorLike] = {}
        wire = codec.dtype_to_torch(job.feature_dtype)  # x is gathered in it
        rows = None
        if job.features and job.cache_counts:
            # every node's label but only the missing rows: two gathers, side by side
            labels = None
            if job.labels:
                gather_labels = partial(sampler.gather, n_id, features=False, labels=True,
                                        remote=remote)
                labels = begin(gather_labels, sampler.overlap_peers, pool=self.lookups)
            cached = self.hot.cached_mask(n_id, job.cache_counts)
            missing = torch.nonzero(~cached.to(n_id.device)).flatten()
            rows = self._rows(sampler, head, missing.numel(), wire)
            if rows is not None:
                x = None
                sampler.gather_to(n_id[missing], rows.blocks, labels=False, remote=remote)
            else:
                x, _ = sampler.gather(n_id[missing], features=True, labels=False, remote=remote,
                                      dtype=wire)
            named["x_cached"] = compact.pack_mask(cached) if job.compact else cached
            y = labels.result()[1] if labels is not None else None  # bounded: peer deadlines
        else:
            rows = self._rows(sampler, head, n_id.numel(), wire) if job.features else None
            if rows is not None:
                x, y = None, sampler.gather_to(n_id, rows.blocks, labels=job.labels, remote=remote)
            else:
                x, y = sampler.gather(n_id, features=job.features, labels=job.labels, remote=remote,
                                      dtype=wire)
        if x is not None:
            named["x"] = x  # already in the wire dtype
        if y is not None:
            named["y"] = compact.narrowest(y.cpu(), compact.LABEL_DTYPES) if job.compact else y
        return named, rows

    def produce(self, job: EpochJob, ref: BatchRef) -> Prepared:
        """Sample one batch and gather its rows: the batch, ready to encode and send."""
        if job.typed is not None:
            return produce_typed(self, job, job.typed, ref)
        started = time.perf_counter()
        seeds = job.seeds_of(ref, self.store.partition_id)
        key = batch_key(job.seed, job.epoch, job.rank, ref.index)
        sampler = self.store.sampler(replace=job.replace, weighted=job.weighted)
        bound = self.peers.bind(PeerCallOptions(job.replace, job.weighted, job.feature_dtype)) \
            if self.peers is not None else None
        with self.stage("sample"):
            out = sampler.sample(seeds, job.fanouts, key, bound.neighbors if bound else None)
        named: dict[str, codec.TensorLike] = dict(
            compact.compact_batch(out.n_id, out.row, out.col, out.num_sampled_nodes)) if job.compact \
            else {"n_id": out.n_id, "edge_index": out.edge_index}
        orig_ids = self.lookups.submit(sampler.orig_ids_of, out.n_id, bound.orig_ids if bound else None) \
            if job.original_ids else None
        header = pb.MinibatchHeader(
            num_batches=job.num_batches, num_seed_nodes=out.batch_size,
            num_sampled_nodes=out.num_sampled_nodes, num_sampled_edges=out.num_sampled_edges)
        rows = None
        if job.features or job.labels:
            with self.stage("gather"):
                gathered, rows = self._gather(job, sampler, out.n_id, bound, chunk_head(ref.index, header))
                named.update(gathered)
        if orig_ids is not None:
            orig = orig_ids.result()  # bounded: peer calls carry deadlines
            named["orig_id"] = compact.narrowest(orig.cpu(), compact.INDEX_DTYPES) if job.compact else orig
        prepared = self.prepare(ref, header, named, len(seeds), rows)
        log.debug("partition=%d client=%s rank=%d epoch=%d batch=%d: %d seeds, %d nodes, "
                  "%d edges, %d messages in %.1f ms", self.store.partition_id,
                  printable(job.client_id),
                  job.rank, job.epoch, ref.index, out.batch_size, out.n_id.numel(),
                  out.row.numel(), len(prepared), 1e3 * (time.perf_counter() - started))
        return prepared

    def prepare(self, ref: BatchRef, header: pb.MinibatchHeader,
                named: dict[str, codec.TensorLike], seeds: int,
                rows: fastwire.RowMessages | None = None) -> Prepared:
        """One batch's stream messages, to encode: ``header`` on chunk 0, ``named``
        split in chunks (on the host: a GPU tensor is copied here, by the sampling
        thread), then ``rows``' messages (made with :func:`chunk_head` of the same)."""
        return Prepared.of(chunk_head(ref.index, header), named, self.chunk_bytes, seeds, rows)
