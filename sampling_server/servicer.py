"""``SamplingService``: what trainers call. Thin: validate the request into an
:class:`~sampling_server.pipeline.EpochJob` (:func:`epoch_job`), hand it to the
pipeline, stream the messages. Every failure becomes a status naming the problem, and
the server goes on serving other calls."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np

from partitioner.graph import SPLITS
from partitioner.hetero import EdgeType
from protos import sampling_pb2 as pb
from protos.codec import encode_tensor
from protos.plan import BatchRef, EpochPlan, GlobalPlan, plan_epoch, plan_global_epoch, shuffled_seeds
from sampling_server.expectation import check_expectation
from sampling_server.fair_share import SlotLimits, StreamSlots, client_of, slot_limits
from sampling_server.hetero_store import HeteroPartitionStore
from sampling_server.hot import check_counts
from sampling_server.limits import check_epoch_limits, printable
from sampling_server.metrics import ServerMetrics
from sampling_server.pipeline import EpochJob, SamplingPipeline, TypedJob
from sampling_server.sampler import normalize_num_neighbors
from sampling_server.store import (
    PartitionStore,
    RequestError,
    abort_on_error,
    decode_node_ids,
    wire_feature_dtype,
)

log = logging.getLogger(__name__)

_FIELD = "EpochRequest"
_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def _require(ok: bool, field: str, expected: str, got: object) -> None:
    if not ok:
        raise RequestError(f"{_FIELD}.{field}: expected {expected}, got {got}")


def check_epoch_request(request: pb.EpochRequest, fanouts_field: str = "fanouts") -> None:
    """Field checks that need no partition: fanouts, sizes, rank, epoch, resume.
    ``fanouts_field``: the empty string skips the fanouts (typed per-edge-type ones)."""
    fanouts = list(request.fanouts)
    if fanouts_field:
        _require(bool(fanouts), fanouts_field, "at least one hop", "[]")
        _require(all(f >= -1 for f in fanouts), fanouts_field,
                 "integers >= 0, or -1 for all neighbors", fanouts)
    _require(request.batch_size > 0, "batch_size", "> 0", request.batch_size)
    _require(request.world_size > 0, "world_size", "> 0", request.world_size)
    _require(0 <= request.rank < request.world_size, "rank",
             f"an integer in [0, {request.world_size})", request.rank)
    _require(request.epoch >= 0, "epoch", ">= 0", request.epoch)
    _require(request.resume_from >= 0, "resume_from", ">= 0", request.resume_from)


def explicit_seeds(request: pb.EpochRequest, store: PartitionStore,
                   node_type: str | None = None) -> np.ndarray:
    """The request's explicit seeds, checked: global IDs in the graph (of ``node_type``
    on a typed graph), each once."""
    seeds = decode_node_ids(request.seeds, f"{_FIELD}.seeds")
    n = store.num_nodes_of(node_type)
    _require(seeds.size > 0, "seeds", "at least one node ID", "an empty tensor")
    lo, hi = int(seeds.min()), int(seeds.max())
    _require(lo >= 0 and hi < n, "seeds", f"global node IDs in [0, {n})",
             f"values in [{lo}, {hi}]")
    uniq, counts = np.unique(seeds, return_counts=True)
    if uniq.size != seeds.size:
        raise RequestError(f"{_FIELD}.seeds: expected each node ID once, got "
                           f"{seeds.size - uniq.size} repeats (e.g. {int(uniq[counts > 1][0])})")
    return seeds


def seeds_by_partition(request: pb.EpochRequest, store: PartitionStore,
                       node_type: str | None = None) -> tuple[list[int], np.ndarray]:
    """Seeds per partition (counts every server agrees on) and this partition's seeds.

    A split's counts come from the manifest; explicit seeds (global IDs anywhere in the
    graph, each once) are split by owner through the partition book, keeping their
    order, so every server given the same seeds computes the same plan.
    """
    source = request.WhichOneof("seeds_source")
    if source is None:
        raise RequestError(f"{_FIELD}.seeds_source: expected a split name or explicit seeds, "
                           "got neither")
    if source == "split":
        split = request.split
        _require(split in SPLITS, "split", f"one of {list(SPLITS)}", repr(split))
        if not store.has_split(split):
            raise RequestError(f"{_FIELD}.split: the graph has no {split!r} split", _PRECONDITION)
        return store.split_counts(split), store.split_seeds(split)
    seeds = explicit_seeds(request, store, node_type)
    owner = store.owner_of(seeds, node_type)
    per_part = np.bincount(owner, minlength=store.manifest.num_partitions)
    return [int(c) for c in per_part], seeds[owner == store.partition_id]


def epoch_job(request: pb.EpochRequest, store: PartitionStore) -> EpochJob:
    """Validate ``request`` against the partition and plan this server's share of the
    rank's epoch. Raises :class:`RequestError` naming the field."""
    if isinstance(store, HeteroPartitionStore):
        return typed_epoch_job(request, store)
    if request.HasField("typed"):
        raise RequestError(f"{_FIELD}.typed: expected none, the graph is homogeneous "
                           "(ClusterInfo.typed is absent)")
    if request.typed_cache_counts:
        raise RequestError(f"{_FIELD}.typed_cache_counts: expected none, the graph is homogeneous "
                           f"(its cache plan is {_FIELD}.cache_counts)")
    m = store.manifest
    check_epoch_limits(store.config, len(request.fanouts), None, request.batch_size,
                       m.num_nodes, m.num_edges)
    check_epoch_request(request)
    check_epoch_limits(store.config, len(request.fanouts), list(request.fanouts),
                       request.batch_size, m.num_nodes, m.num_edges, request.sampling.replace)
    dtype = wire_feature_dtype(request.feature_dtype, store.feature_dtype,
                               f"{_FIELD}.feature_dtype")
    opts = request.sampling
    if opts.weighted and not store.manifest.has_edge_weight:
        raise RequestError(f"{_FIELD}.sampling.weighted: expected false, the graph has no edge "
                           "weights (ClusterInfo.has_edge_weights)", _PRECONDITION)
    plan, seeds, refs = _plan_batches(request, store)
    return EpochJob(plan=plan, batches=refs, seeds=seeds, fanouts=tuple(request.fanouts),
                    seed=request.seed, epoch=request.epoch, rank=request.rank,
                    replace=opts.replace, weighted=opts.weighted,
                    features=request.include_features, labels=request.include_labels,
                    feature_dtype=dtype, client_id=request.client_id,
                    original_ids=request.include_original_ids,
                    compact=request.compact_indices,
                    cache_counts=check_counts(request.cache_counts, store.partition_book,
                                              f"{_FIELD}.cache_counts"))


def _plan_batches(request: pb.EpochRequest, store: PartitionStore, node_type: str | None = None
                  ) -> tuple[EpochPlan | GlobalPlan, np.ndarray, tuple[BatchRef, ...]]:
    """The epoch's plan, the seeds it cuts, and this server's batches of the rank."""
    plan, seeds = _global_plan(request, store, node_type) if request.global_batches else \
        _partition_plan(request, store, node_type)
    if request.resume_from > plan.batches_per_rank:
        raise RequestError(f"{_FIELD}.resume_from: expected at most {plan.batches_per_rank} (the "
                           f"batches per rank of this epoch), got {request.resume_from}",
                           _PRECONDITION)
    refs = tuple(b for b in plan.rank_batches(request.rank)
                 if b.partition == store.partition_id and b.index >= request.resume_from)
    return plan, seeds, refs


def typed_fanouts(request: pb.EpochRequest, store: HeteroPartitionStore
                  ) -> dict[EdgeType, list[int]]:
    """The typed request's fanouts per edge type (PyG's list or dict semantics)."""
    given = request.typed.edge_fanouts
    if not given:
        check_epoch_request(request)
        return normalize_num_neighbors(list(request.fanouts), tuple(store.manifest.edge_types))
    _require(not request.fanouts, "fanouts", "none when typed.edge_fanouts is set",
             list(request.fanouts)[:10])
    field = f"{_FIELD}.typed.edge_fanouts"
    per_type: dict[EdgeType | str, Sequence[int]] = {}
    for i, e in enumerate(given):
        et = store.edge_type_of(e.edge_type, f"{field}[{i}].edge_type")
        _require(et not in per_type, f"typed.edge_fanouts[{i}].edge_type", "each edge type once",
                 repr(e.edge_type))
        per_type[et] = list(e.fanouts)
    try:
        return normalize_num_neighbors(per_type, tuple(store.manifest.edge_types))
    except ValueError as exc:
        raise RequestError(f"{field}: {exc}") from exc


def typed_epoch_job(request: pb.EpochRequest, store: HeteroPartitionStore) -> EpochJob:
    """:func:`epoch_job` for a typed graph (``EpochRequest.typed``)."""
    if not request.HasField("typed"):
        raise RequestError(f"{_FIELD}.typed: expected typed sampling options, the server holds a "
                           "typed graph (ClusterInfo.typed); this client reads homogeneous "
                           "batches only", _PRECONDITION)
    m = store.manifest
    seed_type = store.node_type_of(request.typed.seed_type, f"{_FIELD}.typed.seed_type")
    check_epoch_limits(store.config, max(len(request.fanouts), max(
        (len(e.fanouts) for e in request.typed.edge_fanouts), default=0)), None,
        request.batch_size, m.num_nodes, m.num_edges)
    fanouts = typed_fanouts(request, store)
    check_epoch_request(request, fanouts_field="")
    check_epoch_limits(store.config, len(next(iter(fanouts.values()))), summed_fanouts(fanouts),
                       request.batch_size, m.num_nodes, m.num_edges, request.sampling.replace)
    wire_feature_dtype(request.feature_dtype, pb.FLOAT32, f"{_FIELD}.feature_dtype")
    if request.sampling.weighted:
        raise RequestError(f"{_FIELD}.sampling.weighted: expected false, the graph has no edge "
                           "weights (ClusterInfo.has_edge_weights)", _PRECONDITION)
    if request.cache_counts:
        raise RequestError(f"{_FIELD}.cache_counts: expected none on a typed graph (its cache plan "
                           f"is {_FIELD}.typed_cache_counts, per node type)")
    if request.WhichOneof("seeds_source") == "split" and seed_type != m.target_type:
        raise RequestError(f"{_FIELD}.typed.seed_type: expected the target type "
                           f"{m.target_type!r} with a split (splits are of the target type), got "
                           f"{seed_type!r}")
    plan, seeds, refs = _plan_batches(request, store, seed_type)
    return EpochJob(plan=plan, batches=refs, seeds=seeds, fanouts=(), seed=request.seed,
                    epoch=request.epoch, rank=request.rank, replace=request.sampling.replace,
                    weighted=False, features=request.include_features,
                    labels=request.include_labels,
                    feature_dtype=request.feature_dtype,
                    client_id=request.client_id, original_ids=request.include_original_ids,
                    compact=request.compact_indices,
                    typed=TypedJob(seed_type=seed_type, fanouts=fanouts,
                                   cache_counts=typed_cache_plan(request, store)))


def typed_cache_plan(request: pb.EpochRequest, store: HeteroPartitionStore
                     ) -> dict[str, tuple[int, ...]]:
    """``EpochRequest.typed_cache_counts`` checked: node types with features, each once,
    counts fitting each type's partition book."""
    plan: dict[str, tuple[int, ...]] = {}
    for i, entry in enumerate(request.typed_cache_counts):
        field = f"{_FIELD}.typed_cache_counts[{i}]"
        if entry.name not in store.feature_dtypes:
            raise RequestError(f"{field}.name: expected a node type with features "
                               f"{sorted(store.feature_dtypes)}, got {printable(entry.name, 100)!r}")
        _require(entry.name not in plan, f"typed_cache_counts[{i}].name", "each node type once",
                 repr(entry.name))
        if not entry.counts:
            raise RequestError(f"{field}.counts: expected {store.manifest.num_partitions} entries "
                               "(one per partition), got none")
        plan[entry.name] = check_counts(entry.counts, store.books[entry.name], f"{field}.counts")
    return plan


def hot_node_type(request: pb.HotNodesRequest, store: PartitionStore) -> str | None:
    """The node type whose hot order ``StreamHotNodes`` is asked for: None on a
    homogeneous graph; on a typed one the type named (empty: the target type), one with
    features when they are asked for."""
    field = "HotNodesRequest.node_type"
    if not isinstance(store, HeteroPartitionStore):
        if request.node_type:
            raise RequestError(f"{field}: expected none, the graph is homogeneous "
                               f"(ClusterInfo.typed is absent), got {printable(request.node_type, 100)!r}")
        return None
    node_type = store.node_type_of(request.node_type, field)
    if request.include_features and node_type not in store.feature_dtypes:
        raise RequestError(f"{field}: expected a node type with features {sorted(store.feature_dtypes)} "
                           f"(include_features is set), got {node_type!r}")
    return node_type


def summed_fanouts(fanouts: dict[EdgeType, list[int]]) -> list[int]:
    """Per hop, the sum of the edge types' fanouts (-1 when any is -1): a bound on the
    draws of one node at that hop, for the server's limits."""
    hops = len(next(iter(fanouts.values())))
    return [-1 if any(f[h] == -1 for f in fanouts.values()) else sum(f[h] for f in fanouts.values())
            for h in range(hops)]


def _partition_plan(request: pb.EpochRequest, store: PartitionStore,
                    node_type: str | None = None) -> tuple[EpochPlan, np.ndarray]:
    """Per-partition batches: the plan, and this partition's seeds in the order it cuts them."""
    counts, mine = seeds_by_partition(request, store, node_type)
    try:
        plan = plan_epoch(counts, request.batch_size, request.world_size,
                          shuffle=request.shuffle, seed=request.seed, epoch=request.epoch,
                          drop_last=request.drop_last)
    except ValueError as exc:
        raise RequestError(f"{_FIELD}.{exc}") from exc
    seeds = shuffled_seeds(mine, shuffle=request.shuffle, seed=request.seed,
                           epoch=request.epoch, partition=store.partition_id)
    return plan, seeds


def _global_plan(request: pb.EpochRequest, store: PartitionStore,
                 node_type: str | None = None) -> tuple[GlobalPlan, np.ndarray]:
    """Global batches: the plan over all the explicit seeds, and the seeds."""
    if request.WhichOneof("seeds_source") != "seeds":
        raise RequestError(f"{_FIELD}.seeds_source: expected explicit seeds with global_batches (a "
                           "server knows only its own partition's split; LookupNodes lists every "
                           f"partition's), got {request.WhichOneof('seeds_source') or 'neither'}")
    seeds = explicit_seeds(request, store, node_type)
    try:
        plan = plan_global_epoch(seeds.size, request.batch_size, request.world_size,
                                 store.manifest.num_partitions, shuffle=request.shuffle,
                                 seed=request.seed, epoch=request.epoch,
                                 drop_last=request.drop_last)
    except ValueError as exc:
        raise RequestError(f"{_FIELD}.{exc}") from exc
    return plan, seeds


#: Most nodes one ``LookupNodesRequest.owned_range`` may ask for (16 bytes each in the reply).
MAX_NODE_RANGE = 1 << 21


def lookup_nodes(request: pb.LookupNodesRequest, store: PartitionStore) -> pb.LookupNodesReply:
    """Answer LookupNodes (see sampling.proto); raises :class:`RequestError` naming the field."""
    field = "LookupNodesRequest"
    query = request.WhichOneof("query")
    node_type: str | None = None
    if isinstance(store, HeteroPartitionStore):
        node_type = store.node_type_of(request.node_type, f"{field}.node_type")
    elif request.node_type:
        raise RequestError(f"{field}.node_type: expected none, the graph is homogeneous, got "
                           f"{printable(request.node_type)!r}")
    if query == "split":
        if request.split not in SPLITS:
            raise RequestError(f"{field}.split: expected one of {list(SPLITS)}, got {request.split!r}")
        nodes = store.split_seeds(request.split)
        return pb.LookupNodesReply(global_ids=encode_tensor(nodes),
                                   original_ids=encode_tensor(store.original_ids_of(nodes)))
    if query == "owned_range":
        return _owned_range(request.owned_range, store, f"{field}.owned_range", node_type)
    if query != "original_ids":
        raise RequestError(f"{field}.query: expected a split name, original_ids or owned_range, "
                           "got none")
    original = decode_node_ids(request.original_ids, f"{field}.original_ids")
    n = store.num_nodes_of(node_type)
    if original.size and (int(original.min()) < 0 or int(original.max()) >= n):
        raise RequestError(f"{field}.original_ids: expected original node IDs in [0, {n}), got "
                           f"values in [{int(original.min())}, {int(original.max())}]")
    if node_type is not None:
        assert isinstance(store, HeteroPartitionStore)
        return pb.LookupNodesReply(global_ids=encode_tensor(store.global_ids_of(original, node_type)))
    return pb.LookupNodesReply(global_ids=encode_tensor(store.global_ids_of(original)))


def _owned_range(query: pb.NodeRange, store: PartitionStore, field: str,
                 node_type: str | None = None) -> pb.LookupNodesReply:
    """The original IDs and labels of a range of this partition's nodes (of ``node_type``
    on a typed graph: labels are the target type's, -1 for the other types)."""
    first, count = int(query.first), int(query.count)
    if not 0 <= count <= MAX_NODE_RANGE:
        raise RequestError(f"{field}.count: expected 0 .. {MAX_NODE_RANGE}, got {count}")
    y: np.ndarray | None
    if node_type is None:
        start, stop = store.node_range
        orig_ids, y, what = store.partition.orig_ids, store.partition.y, "global IDs"
    else:
        assert isinstance(store, HeteroPartitionStore)
        typed = store.typed_partition
        start, stop = store.type_range(node_type)
        orig_ids, what = typed.orig_ids[node_type], f"global {node_type!r} IDs"
        y = typed.y if node_type == typed.target_type else None
    if count and not start <= first <= first + count <= stop:
        raise RequestError(f"{field}: expected {what} owned by partition {store.partition_id} "
                           f"({start} .. {stop - 1}), got {first} .. {first + count - 1}")
    local = slice(first - start, first - start + count) if count else slice(0, 0)
    labels = np.asarray(y[local], dtype=np.int64) if y is not None else np.full(count, -1, np.int64)
    return pb.LookupNodesReply(original_ids=encode_tensor(np.asarray(orig_ids[local], dtype=np.int64)),
                               labels=encode_tensor(labels))


class SamplingServicer:
    """``SamplingService``: cluster facts and epoch streams."""

    def __init__(self, store: PartitionStore, pipeline: SamplingPipeline,
                 limits: SlotLimits | None = None):
        self.store = store
        self.pipeline = pipeline
        #: The stream slots, shared fairly among clients (sampling_server/fair_share.py).
        self.slots = StreamSlots(limits or slot_limits(store.config), self._evicted)
        #: Streams running now.
        self.active = 0
        self._active_lock = threading.Condition()
        #: Set while the server drains: new streams are refused (UNAVAILABLE).
        self.draining = threading.Event()
        #: Why the peers are the wrong ones (None when they are right): streams are
        #: refused with it (FAILED_PRECONDITION) until it is fixed.
        self.peer_problem: Callable[[], str | None] = lambda: None
        #: Where streams and rejections are counted (None: nowhere).
        self.metrics: ServerMetrics | None = None

    def _rejected(self, method: str) -> Callable[[str], None] | None:
        metrics = self.metrics
        return None if metrics is None else lambda code: metrics.rejected(method, code)

    def _evicted(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.evicted(reason)

    def _draining(self) -> str | None:
        if self.draining.is_set():
            return (f"StreamMinibatches: partition {self.store.partition_id}'s server is shutting "
                    "down; retry on its restarted server")
        return None

    def wait_streams_done(self, timeout: float, poll: float | None = None) -> bool:
        """Wait until no stream runs; False when ``timeout`` passed first. ``poll``: wake
        at least this often (the main thread must, to run signal handlers)."""
        deadline = time.monotonic() + timeout
        with self._active_lock:
            while self.active:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._active_lock.wait(remaining if poll is None else min(remaining, poll))
            return True

    def GetClusterInfo(
        self, request: pb.ClusterInfoRequest, context: grpc.ServicerContext
    ) -> pb.ClusterInfo:
        with abort_on_error(context, "GetClusterInfo", self.store.partition_id,
                            self._rejected("GetClusterInfo")):
            info = self.store.cluster_info()
        log.debug("partition=%d client=%s: cluster info", self.store.partition_id,
                  printable(request.client_id))
        return info

    def LookupNodes(
        self, request: pb.LookupNodesRequest, context: grpc.ServicerContext
    ) -> pb.LookupNodesReply:
        with abort_on_error(context, "LookupNodes", self.store.partition_id):
            self.store.partition  # noqa: B018 - raises NotLoaded (UNAVAILABLE) while loading
            return lookup_nodes(request, self.store)

    def StreamHotNodes(
        self, request: pb.HotNodesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.HotNodesChunk]:
        """The hottest nodes of this partition and their features (feature cache fill)."""
        p = self.store.partition_id
        with abort_on_error(context, "StreamHotNodes", p, self._rejected("StreamHotNodes")):
            self.store.partition  # noqa: B018 - raises NotLoaded (UNAVAILABLE) while loading
            node_type = hot_node_type(request, self.store)
            check_expectation(request, self.store, hot_order=True)
            stored = self.store.feature_dtype if node_type is None else \
                self.store.feature_dtypes.get(node_type, pb.FLOAT32)  # type: ignore[attr-defined]
            dtype = wire_feature_dtype(request.feature_dtype, stored, "HotNodesRequest.feature_dtype")
            log.info("partition=%d client=%s: hot nodes: %d%s%s", p, printable(request.client_id),
                     request.count, "" if node_type is None else f" of {node_type!r}",
                     " with features" if request.include_features else "")
            yield from self.pipeline.hot_of(node_type).blocks(request, dtype)

    def StreamMinibatches(
        self, request: pb.EpochRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        p = self.store.partition_id
        with abort_on_error(context, "StreamMinibatches", p, self._rejected("StreamMinibatches")):
            self.store.partition  # noqa: B018 - raises NotLoaded (UNAVAILABLE) while loading
            draining = self._draining()
            if draining:
                raise RequestError(draining, grpc.StatusCode.UNAVAILABLE)
            # before the peers: it is about this server
            check_expectation(request, self.store,
                              hot_order=bool(request.cache_counts or request.typed_cache_counts))
            problem = self.peer_problem()
            if problem:
                raise RequestError(f"StreamMinibatches: partition {p}'s server is NOT_SERVING: "
                                   f"{problem}", _PRECONDITION)
            job = epoch_job(request, self.store)
            client = client_of(context, job.client_id)
            fields = (f"partition={p} client={printable(job.client_id)} "
                      f"peer={printable(client.principal)} rank={job.rank}/{request.world_size} "
                      f"epoch={job.epoch}")
            slot = self.slots.admit(client, context, fields, self._draining)
        started, sent = time.perf_counter(), 0
        with self._active_lock:
            self.active += 1
        if self.metrics is not None:
            self.metrics.streams_open.inc()
        try:
            stop = threading.Event()
            if not context.add_callback(stop.set):  # the call has ended already
                stop.set()
            log.info("%s: stream start: %d of %d batches here, resume_from=%d", fields,
                     len(job.batches), job.num_batches, request.resume_from)
            # Response headers tell the trainer the stream was accepted; a stream that
            # fails after this point (a peer lost mid-epoch) is resumed by the trainer
            # from the next batch it lacks.
            context.send_initial_metadata(())
            with abort_on_error(context, f"StreamMinibatches ({fields})", p):
                for message, done in self.pipeline.stream(job, stop):
                    slot.handing(len(message))
                    yield message
                    slot.taken()
                    sent += done is not None
        finally:
            self.slots.release(slot)
            with self._active_lock:
                self.active -= 1
                self._active_lock.notify_all()
            if self.metrics is not None:
                self.metrics.streams_open.dec()
            state = "done" if sent == len(job.batches) else "ended early"
            log.info("%s: stream %s: %d batches sent in %.2f s", fields, state, sent,
                     time.perf_counter() - started)
