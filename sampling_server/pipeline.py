"""One epoch stream: plan -> sample (ahead, bounded) -> gather -> encode -> send.

A validated :class:`EpochJob` lists this server's batches of one rank. The
:class:`SamplingPipeline` samples them on a thread pool shared by every stream, at
most ``prefetch`` batches ahead of the one being sent: the generator submits the next
batch only when the client takes the current one, so a slow client holds back its own
stream (gRPC flow control) and nothing queues without bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from partitioner.hetero import EdgeType
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


@dataclass(frozen=True)
class TypedJob:
    """What a typed epoch request adds (``EpochRequest.typed``)."""

    #: Node type of the seeds.
    seed_type: str
    #: Fanouts per edge type and hop (every edge type of the graph, PyG's semantics).
    fanouts: dict[EdgeType, list[int]]


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
        self._closed = threading.Event()

    def stage(self, name: str) -> AbstractContextManager[None]:
        return self.metrics.stage(name) if self.metrics is not None else nullcontext()

    def close(self) -> None:
        """Stop the workers (queued batches are dropped; a stream still running ends
        with :class:`~sampling_server.store.Stopping`)."""
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.lookups.shutdown(wait=False, cancel_futures=True)

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
    ) -> Iterator[list[bytes]]:
        """The serialized messages of ``job``'s batches, batch by batch, in order. Setting
        ``stop`` (the client went away) skips batches not started yet; closing the
        generator drops them."""
        stop = stop or threading.Event()
        refs = iter(job.batches)
        pending: deque[tuple[BatchRef, Future[list[bytes]]]] = deque()

        def submit_next() -> None:
            ref = next(refs, None)
            if ref is not None:
                pending.append((ref, self._pool.submit(self._produce_unless, stop, job, ref)))

        try:
            with self._open():
                for _ in range(self.prefetch):
                    submit_next()
            while pending:
                ref, future = pending.popleft()
                with self._open():
                    messages = future.result()  # bounded: peer calls carry deadlines
                    submit_next()  # keeps `prefetch` batches sampling while this one is sent
                if self.metrics is not None and messages:
                    self.metrics.sent(messages, len(job.seeds_of(ref, self.store.partition_id)))
                yield messages
        finally:
            for _, future in pending:
                future.cancel()

    def _produce_unless(
        self, stop: threading.Event, job: EpochJob, ref: BatchRef
    ) -> list[bytes]:
        if stop.is_set():
            return []
        return self.produce(job, ref)

    def _gather(self, job: EpochJob, sampler: NeighborSampler, n_id: torch.Tensor,
                bound: BoundPeers | None) -> dict[str, codec.TensorLike]:
        """The batch's "x" and "y" as the job asks; with a cache plan, "x" holds only the
        rows the trainer lacks and "x_cached" marks the others."""
        remote = bound.node_data if bound else None
        named: dict[str, codec.TensorLike] = {}
        wire = codec.dtype_to_torch(job.feature_dtype)  # x is gathered in it
        if job.features and job.cache_counts:
            # every node's label but only the missing rows: two gathers, side by side
            labels = None
            if job.labels:
                gather_labels = partial(sampler.gather, n_id, features=False, labels=True,
                                        remote=remote)
                labels = begin(gather_labels, sampler.overlap_peers, pool=self.lookups)
            cached = self.hot.cached_mask(n_id, job.cache_counts)
            missing = torch.nonzero(~cached.to(n_id.device)).flatten()
            x, _ = sampler.gather(n_id[missing], features=True, labels=False, remote=remote,
                                  dtype=wire)
            named["x_cached"] = compact.pack_mask(cached) if job.compact else cached
            y = labels.result()[1] if labels is not None else None  # bounded: peer deadlines
        else:
            x, y = sampler.gather(n_id, features=job.features, labels=job.labels, remote=remote,
                                  dtype=wire)
        if x is not None:
            named["x"] = x  # already in the wire dtype
        if y is not None:
            named["y"] = compact.narrowest(y.cpu(), compact.LABEL_DTYPES) if job.compact else y
        return named

    def produce(self, job: EpochJob, ref: BatchRef) -> list[bytes]:
        """Sample one batch, gather its rows and encode it as stream messages."""
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
        if job.features or job.labels:
            with self.stage("gather"):
                named.update(self._gather(job, sampler, out.n_id, bound))
        if orig_ids is not None:
            orig = orig_ids.result()  # bounded: peer calls carry deadlines
            named["orig_id"] = compact.narrowest(orig.cpu(), compact.INDEX_DTYPES) if job.compact else orig
        header = pb.MinibatchHeader(
            num_batches=job.num_batches, num_seed_nodes=out.batch_size,
            num_sampled_nodes=out.num_sampled_nodes, num_sampled_edges=out.num_sampled_edges)
        messages = self.encode(ref, header, named)
        log.debug("partition=%d client=%s rank=%d epoch=%d batch=%d: %d seeds, %d nodes, "
                  "%d edges, %d messages in %.1f ms", self.store.partition_id,
                  printable(job.client_id),
                  job.rank, job.epoch, ref.index, out.batch_size, out.n_id.numel(),
                  out.row.numel(), len(messages), 1e3 * (time.perf_counter() - started))
        return messages

    def encode(self, ref: BatchRef, header: pb.MinibatchHeader,
               named: dict[str, codec.TensorLike]) -> list[bytes]:
        """One batch's stream messages: ``header`` on chunk 0, ``named`` split in chunks."""
        def head(i: int, n: int) -> pb.MinibatchChunk:
            msg = pb.MinibatchChunk(batch_index=ref.index, chunk_index=i, num_chunks=n)
            if i == 0:
                msg.header.CopyFrom(header)
            return msg

        with self.stage("encode"):
            return fastwire.encode_chunks(head, named, self.chunk_bytes)
