"""Requests into jobs: an ``EpochRequest`` validated against the partition into the
:class:`EpochJob` one stream samples and sends (its plan, seeds, fanouts per relation,
cache plans per node type), and the answers of ``LookupNodes``. One path for plain and
typed graphs: a plain graph's request names no type (``EpochRequest.typed`` absent) and
resolves to its one node and edge type. Every refusal is a
:class:`~sampling_server.errors.RequestError` naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from partitioner.graph import SPLITS, EdgeType
from protos import codec
from protos import sampling_pb2 as pb
from protos.codec import encode_tensor
from protos.plan import BatchRef, EpochPlan, GlobalPlan, plan_epoch, plan_global_epoch, shuffled_seeds
from sampling_server.errors import RequestError, printable
from sampling_server.fields import decode_node_ids, wire_feature_dtype
from sampling_server.limits import check_epoch_limits
from sampling_server.link_jobs import LinkJob, link_job
from sampling_server.sampler import normalize_num_neighbors
from sampling_server.store import PartitionStore

_FIELD = "EpochRequest"
_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
#: Most nodes one ``LookupNodesRequest.owned_range`` may ask for (16 bytes each in the reply).
MAX_NODE_RANGE = 1 << 21


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
    #: Node type of the seeds.
    seed_type: str
    #: Fanouts per edge type and hop (every edge type of the graph, PyG's semantics).
    fanouts: dict[EdgeType, list[int]]
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
    #: Wire dtype of ``x`` as requested (DTYPE_UNSPECIFIED: each type's stored dtype).
    feature_dtype: codec.WireDType
    #: Whether the batches take the typed wire form (``n_id/<type>`` ...).
    typed: bool = False
    #: The caller, for logs.
    client_id: str = ""
    #: Send the nodes' original IDs ("orig_id").
    original_ids: bool = False
    #: The trainer's feature cache plan per node type (one count per partition); types
    #: left out are not cached.
    cache_counts: dict[str, tuple[int, ...]] | None = None
    #: Send the structure in compact form (``EpochRequest.compact_indices``, protos/compact.py).
    compact: bool = False
    #: Send the sampled edges' original IDs ("e_id") / features ("edge_attr").
    edge_ids: bool = False
    edge_features: bool = False
    #: A link epoch's seed edges and negatives (EpochRequest.links); None: seed nodes.
    links: LinkJob | None = None
    #: The node tensors whose rows each batch carries (EpochRequest.node_tensors).
    node_tensors: tuple[str, ...] = ()

    @property
    def edges(self) -> bool:
        """Whether the batches need the sampled edges' internal IDs."""
        return self.edge_ids or self.edge_features

    def seeds_of(self, ref: BatchRef, partition: int) -> np.ndarray:
        """The seeds of one of this server's batches, in batch order (a link epoch's:
        the positions of its seed edges)."""
        if self.links is not None:
            assert isinstance(self.plan, GlobalPlan)
            return self.plan.positions(ref.part_batch)
        if isinstance(self.plan, GlobalPlan):
            return self.seeds[self.plan.positions(ref.part_batch)]
        return self.plan.seeds_of(partition, ref.part_batch, self.seeds)

    @property
    def num_batches(self) -> int:
        """Batches of the rank's whole epoch (across all servers), as in the header."""
        return self.plan.batches_per_rank


def _require(ok: bool, field: str, expected: str, got: object) -> None:
    if not ok:
        raise RequestError(f"{_FIELD}.{field}: expected {expected}, got {got}")


def check_epoch_request(request: pb.EpochRequest) -> None:
    """Field checks that need no partition: sizes, rank, epoch, resume."""
    _require(request.batch_size > 0, "batch_size", "> 0", request.batch_size)
    _require(request.world_size > 0, "world_size", "> 0", request.world_size)
    _require(0 <= request.rank < request.world_size, "rank", f"an integer in [0, {request.world_size})",
             request.rank)
    for name in ("epoch", "resume_from", "steps_done", "seeds_done"):
        _require(getattr(request, name) >= 0, name, ">= 0", getattr(request, name))


def epoch_job(request: pb.EpochRequest, store: PartitionStore) -> EpochJob:
    """Validate ``request`` against the partition and plan this server's share of the
    rank's epoch. Raises :class:`RequestError` naming the field."""
    m = store.manifest
    seed_type = _seed_type(request, store)
    hops = max([len(request.fanouts), *(len(e.fanouts) for e in request.typed.edge_fanouts)])
    check_epoch_limits(store.config, hops, None, request.batch_size, m.num_nodes, m.num_edges)
    fanouts = _fanouts(request, store)
    check_epoch_request(request)
    links = link_job(request.links, store) if request.WhichOneof("seeds_source") == "links" else None
    if links is not None:
        seed_type = links.options.edge_type[0]
    seed_nodes = request.batch_size if links is None else links.seed_nodes_bound(request.batch_size)
    check_epoch_limits(store.config, len(next(iter(fanouts.values()))), None, seed_nodes, m.num_nodes,
                       m.num_edges)
    wire_feature_dtype(request.feature_dtype, store.feature_dtype, f"{_FIELD}.feature_dtype")
    if request.sampling.weighted and not store.weighted:
        raise RequestError(f"{_FIELD}.sampling.weighted: expected false, the graph has no edge "
                           "weights (ClusterInfo.has_edge_weights)", _PRECONDITION)
    cache = _cache_plan(request, store)
    _check_edge_rows(request, store)
    if request.WhichOneof("seeds_source") == "split" and seed_type != m.target_type:
        raise RequestError(f"{_FIELD}.typed.seed_type: expected the target type {m.target_type!r} with "
                           f"a split (splits are of the target type), got {seed_type!r}")
    plan, seeds, refs = _plan_batches(request, store, seed_type, links)
    check_epoch_limits(store.config, len(next(iter(fanouts.values()))), summed_fanouts(fanouts),
                       seed_nodes, m.num_nodes, m.num_edges, request.sampling.replace,
                       first_hop=_first_hop_edges(store, plan, seeds, seed_type, fanouts)
                       if not request.sampling.replace else None)
    return EpochJob(plan=plan, batches=refs, seeds=seeds, seed_type=seed_type, fanouts=fanouts,
                    seed=request.seed, epoch=request.epoch, rank=request.rank,
                    replace=request.sampling.replace, weighted=request.sampling.weighted,
                    features=request.include_features, labels=request.include_labels,
                    feature_dtype=request.feature_dtype, typed=store.typed,
                    client_id=request.client_id, original_ids=request.include_original_ids,
                    cache_counts=cache, compact=request.compact_indices,
                    edge_ids=request.include_edge_ids, edge_features=request.include_edge_features,
                    links=links, node_tensors=_node_tensor_names(request))


#: Most node tensors one epoch request may name.
MAX_NODE_TENSORS = 16


def _node_tensor_names(request: pb.EpochRequest) -> tuple[str, ...]:
    """The node tensors whose rows the batches carry: at most :data:`MAX_NODE_TENSORS`,
    each once (whether this server holds them is the stream's first check)."""
    names = tuple(request.node_tensors)
    _require(len(names) <= MAX_NODE_TENSORS, "node_tensors", f"at most {MAX_NODE_TENSORS} names",
             len(names))
    _require(len(set(names)) == len(names), "node_tensors", "each name once",
             [printable(n, 100) for n in names][:MAX_NODE_TENSORS])
    return names


def _first_hop_edges(store: PartitionStore, plan: EpochPlan | GlobalPlan, seeds: np.ndarray, seed_type: str,
                     fanouts: dict[EdgeType, list[int]]) -> int | None:
    """The most edges the first hop of one of this partition's batches draws, when its
    seeds are its own (batches per partition): their in-degrees here, each capped by its
    relation's fanout, summed per batch. None where the seeds may be anyone's."""
    if not isinstance(plan, EpochPlan) or seeds.size == 0:
        return None if not isinstance(plan, EpochPlan) else 0
    part, start = store.partition, store.type_range(seed_type)[0]
    local = seeds - start
    degrees = np.zeros(seeds.size, dtype=np.int64)
    for et, hops in fanouts.items():
        if et[2] == seed_type and hops[0] != 0:
            counts = np.diff(np.asarray(part.indptr[et], dtype=np.int64))[local]
            degrees += counts if hops[0] < 0 else np.minimum(counts, hops[0])
    sizes = np.asarray(plan.sizes[store.partition_id], dtype=np.int64)
    ends = np.cumsum(sizes)
    summed = np.concatenate([[0], np.cumsum(degrees)])
    return int((summed[ends] - summed[ends - sizes]).max(initial=0))


def _check_edge_rows(request: pb.EpochRequest, store: PartitionStore) -> None:
    """Edge IDs and features only from partitions that store them."""
    if not (request.include_edge_ids or request.include_edge_features):
        return
    asked = "include_edge_ids" if request.include_edge_ids else "include_edge_features"
    if not store.has_edge_ids:
        raise RequestError(f"{_FIELD}.{asked}: expected false, the graph's partitions were written "
                           "without edge IDs (ClusterInfo.has_edge_ids); partition it again to "
                           "sample edge IDs and features", _PRECONDITION)
    if request.include_edge_features and not store.edge_feature_dtypes:
        raise RequestError(f"{_FIELD}.include_edge_features: expected false, the graph has no edge "
                           "features (ClusterInfo.edge_features)", _PRECONDITION)


def _seed_type(request: pb.EpochRequest, store: PartitionStore) -> str:
    """The seeds' node type; a request's typed options exactly when the graph is typed."""
    if store.typed:
        if not request.HasField("typed"):
            raise RequestError(f"{_FIELD}.typed: expected typed sampling options, the server holds a "
                               "typed graph (ClusterInfo.typed); this client reads homogeneous "
                               "batches only", _PRECONDITION)
        return store.node_type_of(request.typed.seed_type, f"{_FIELD}.typed.seed_type")
    if request.HasField("typed"):
        raise RequestError(f"{_FIELD}.typed: expected none, the graph is homogeneous "
                           "(ClusterInfo.typed is absent)")
    if request.typed_cache_counts:
        raise RequestError(f"{_FIELD}.typed_cache_counts: expected none, the graph is homogeneous "
                           f"(its cache plan is {_FIELD}.cache_counts)")
    return store.manifest.target_type


def _fanouts(request: pb.EpochRequest, store: PartitionStore) -> dict[EdgeType, list[int]]:
    """The request's fanouts per edge type (PyG's list or dict semantics)."""
    edge_types = tuple(store.manifest.edge_types)
    given = request.typed.edge_fanouts
    if not given:
        fanouts = list(request.fanouts)
        _require(bool(fanouts), "fanouts", "at least one hop", "[]")
        _require(all(f >= -1 for f in fanouts), "fanouts", "integers >= 0, or -1 for all neighbors", fanouts)
        return normalize_num_neighbors(fanouts, edge_types)
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
        return normalize_num_neighbors(per_type, edge_types)
    except ValueError as exc:
        raise RequestError(f"{field}: {exc}") from exc


def summed_fanouts(fanouts: dict[EdgeType, list[int]]) -> list[int]:
    """Per hop, the sum of the edge types' fanouts (-1 when any is -1): a bound on the
    draws of one node at that hop, for the server's limits."""
    hops = len(next(iter(fanouts.values())))
    return [-1 if any(f[h] == -1 for f in fanouts.values()) else sum(f[h] for f in fanouts.values())
            for h in range(hops)]


def check_counts(counts: Sequence[int], book: np.ndarray, field: str) -> tuple[int, ...]:
    """A cache plan's counts, checked against the partition book (empty: no cache)."""
    counts = tuple(int(c) for c in counts)
    if not counts:
        return counts
    sizes = np.diff(book)
    if len(counts) != sizes.size:
        raise RequestError(f"{field}: expected {sizes.size} entries (one per partition) or none, "
                           f"got {len(counts)}")
    for p, c in enumerate(counts):
        if not 0 <= c <= sizes[p]:
            raise RequestError(f"{field}[{p}]: expected 0 .. {int(sizes[p])} (the partition's nodes), "
                               f"got {c}")
    return counts


def _cache_plan(request: pb.EpochRequest, store: PartitionStore) -> dict[str, tuple[int, ...]]:
    """The trainer's cache plan per node type: ``cache_counts`` of a plain graph's one
    type, or ``typed_cache_counts`` (node types with features, each once)."""
    if not store.typed:
        target = store.manifest.target_type
        counts = check_counts(request.cache_counts, store.books[target], f"{_FIELD}.cache_counts")
        return {target: counts} if counts else {}
    if request.cache_counts:
        raise RequestError(f"{_FIELD}.cache_counts: expected none on a typed graph (its cache plan "
                           f"is {_FIELD}.typed_cache_counts, per node type)")
    plan: dict[str, tuple[int, ...]] = {}
    for i, entry in enumerate(request.typed_cache_counts):
        field = f"typed_cache_counts[{i}]"
        _require(entry.name in store.feature_dtypes, f"{field}.name",
                 f"a node type with features {sorted(store.feature_dtypes)}",
                 repr(printable(entry.name, 100)))
        _require(entry.name not in plan, f"{field}.name", "each node type once", repr(entry.name))
        _require(bool(entry.counts), f"{field}.counts",
                 f"{store.manifest.num_partitions} entries (one per partition)", "none")
        plan[entry.name] = check_counts(entry.counts, store.books[entry.name], f"{_FIELD}.{field}.counts")
    return plan


def explicit_seeds(request: pb.EpochRequest, store: PartitionStore, node_type: str) -> np.ndarray:
    """The request's explicit seeds, checked: global IDs of ``node_type``, each once."""
    seeds = decode_node_ids(request.seeds, f"{_FIELD}.seeds")
    n = store.manifest.node_types[node_type].num_nodes
    _require(seeds.size > 0, "seeds", "at least one node ID", "an empty tensor")
    lo, hi = int(seeds.min()), int(seeds.max())
    _require(lo >= 0 and hi < n, "seeds", f"global node IDs in [0, {n})", f"values in [{lo}, {hi}]")
    uniq, counts = np.unique(seeds, return_counts=True)
    if uniq.size != seeds.size:
        raise RequestError(f"{_FIELD}.seeds: expected each node ID once, got "
                           f"{seeds.size - uniq.size} repeats (e.g. {int(uniq[counts > 1][0])})")
    return seeds


def seeds_by_partition(request: pb.EpochRequest, store: PartitionStore, node_type: str
                       ) -> tuple[list[int], np.ndarray]:
    """Seeds per partition (counts every server agrees on) and this partition's seeds.

    A split's counts come from the manifest; explicit seeds (global IDs anywhere in the
    graph, each once) are split by owner through the partition book, keeping their
    order, so every server given the same seeds computes the same plan.
    """
    source = request.WhichOneof("seeds_source")
    if source is None:
        raise RequestError(f"{_FIELD}.seeds_source: expected a split name, explicit seeds or every_node, "
                           "got none")
    if source == "every_node":  # every partition's owned range of the type
        start, stop = store.type_range(node_type)
        return [int(c) for c in np.diff(store.books[node_type])], np.arange(start, stop, dtype=np.int64)
    if source == "split":
        split = request.split
        _require(split in SPLITS, "split", f"one of {list(SPLITS)}", repr(split))
        if not any(split in p.split_sizes for p in store.manifest.partitions):
            raise RequestError(f"{_FIELD}.split: the graph has no {split!r} split", _PRECONDITION)
        return store.manifest.split_counts(split), store.split_seeds(split)
    seeds = explicit_seeds(request, store, node_type)
    owner = np.searchsorted(store.books[node_type], seeds, side="right") - 1
    per_part = np.bincount(owner, minlength=store.manifest.num_partitions)
    return [int(c) for c in per_part], seeds[owner == store.partition_id]


def _plan_batches(request: pb.EpochRequest, store: PartitionStore, node_type: str,
                  links: LinkJob | None = None
                  ) -> tuple[EpochPlan | GlobalPlan, np.ndarray, tuple[BatchRef, ...]]:
    """The epoch's plan, the seeds it cuts (none for a link epoch: its plan cuts seed
    edges), and this server's batches of the rank."""
    plan: EpochPlan | GlobalPlan
    if links is not None and not request.global_batches:
        raise RequestError(f"{_FIELD}.global_batches: expected true with links (seed edges are "
                           "batched from one ordering across partitions), got false")
    if request.global_batches:
        if links is None and request.WhichOneof("seeds_source") != "seeds":
            raise RequestError(f"{_FIELD}.seeds_source: expected explicit seeds with global_batches (a "
                               "server knows only its own partition's split; LookupNodes lists every "
                               f"partition's), got {request.WhichOneof('seeds_source') or 'neither'}")
        seeds = explicit_seeds(request, store, node_type) if links is None else np.empty(0, dtype=np.int64)
        try:
            total = seeds.size if links is None else links.num_edges
            plan = plan_global_epoch(total, request.batch_size, request.world_size,
                                     store.manifest.num_partitions, shuffle=request.shuffle,
                                     seed=request.seed, epoch=request.epoch, drop_last=request.drop_last,
                                     steps_done=request.steps_done, seeds_done=request.seeds_done)
        except ValueError as exc:
            seeds_are = " seeds" if links is None else " seed edges"  # a link epoch's plan cuts seed edges
            raise RequestError(f"{_FIELD}.{exc}".replace(" seeds", seeds_are)) from exc
    else:
        _require(not (request.steps_done or request.seeds_done), "steps_done, seeds_done",
                 "0 without global_batches (per-partition batches resume whole epochs)",
                 f"{request.steps_done}, {request.seeds_done}")
        counts, mine = seeds_by_partition(request, store, node_type)
        try:
            plan = plan_epoch(counts, request.batch_size, request.world_size, shuffle=request.shuffle,
                              seed=request.seed, epoch=request.epoch, drop_last=request.drop_last)
        except ValueError as exc:
            raise RequestError(f"{_FIELD}.{exc}") from exc
        seeds = shuffled_seeds(mine, shuffle=request.shuffle, seed=request.seed, epoch=request.epoch,
                               partition=store.partition_id)
    if request.resume_from > plan.batches_per_rank:
        raise RequestError(f"{_FIELD}.resume_from: expected at most {plan.batches_per_rank} (the "
                           f"batches per rank of this epoch), got {request.resume_from}", _PRECONDITION)
    refs = tuple(b for b in plan.rank_batches(request.rank)
                 if b.partition == store.partition_id and b.index >= request.resume_from)
    return plan, seeds, refs


def hot_node_type(request: pb.HotNodesRequest, store: PartitionStore) -> str:
    """The node type whose hot order ``StreamHotNodes`` is asked for: a plain graph's one;
    on a typed one the type named (empty: the target type), one with features when they
    are asked for."""
    field = "HotNodesRequest.node_type"
    node_type = store.node_type_of(request.node_type, field)
    if store.typed and request.include_features and node_type not in store.feature_dtypes:
        raise RequestError(f"{field}: expected a node type with features {sorted(store.feature_dtypes)} "
                           f"(include_features is set), got {node_type!r}")
    return node_type


def lookup_nodes(request: pb.LookupNodesRequest, store: PartitionStore) -> pb.LookupNodesReply:
    """Answer LookupNodes (see sampling.proto); raises :class:`RequestError` naming the field."""
    field = "LookupNodesRequest"
    query = request.WhichOneof("query")
    node_type = store.node_type_of(request.node_type, f"{field}.node_type")
    if query == "split":
        if request.split not in SPLITS:
            raise RequestError(f"{field}.split: expected one of {list(SPLITS)}, got {request.split!r}")
        nodes = store.split_seeds(request.split)  # (of the target type)
        orig = store.original_ids_of(nodes, store.manifest.target_type)
        return pb.LookupNodesReply(global_ids=encode_tensor(nodes), original_ids=encode_tensor(orig))
    if query == "owned_range":
        return _owned_range(request.owned_range, store, f"{field}.owned_range", node_type)
    if query != "original_ids":
        raise RequestError(f"{field}.query: expected a split name, original_ids or owned_range, got none")
    original = decode_node_ids(request.original_ids, f"{field}.original_ids")
    n = store.manifest.node_types[node_type].num_nodes
    if original.size and (int(original.min()) < 0 or int(original.max()) >= n):
        raise RequestError(f"{field}.original_ids: expected original node IDs in [0, {n}), got "
                           f"values in [{int(original.min())}, {int(original.max())}]")
    return pb.LookupNodesReply(global_ids=encode_tensor(store.global_ids_of(original, node_type)))


def _owned_range(query: pb.NodeRange, store: PartitionStore, field: str,
                 node_type: str) -> pb.LookupNodesReply:
    """The original IDs and labels of a range of this partition's nodes of ``node_type``
    (labels are the target type's, -1 for the other types)."""
    first, count = int(query.first), int(query.count)
    if not 0 <= count <= MAX_NODE_RANGE:
        raise RequestError(f"{field}.count: expected 0 .. {MAX_NODE_RANGE}, got {count}")
    part = store.partition
    start, stop = store.type_range(node_type)
    if count and not start <= first <= first + count <= stop:
        raise RequestError(f"{field}: expected {store.ids_of(node_type)} owned by partition "
                           f"{store.partition_id} ({start} .. {stop - 1}), got {first} .. "
                           f"{first + count - 1}")
    local = slice(first - start, first - start + count) if count else slice(0, 0)
    y = part.y if node_type == part.target_type else None
    labels = np.asarray(y[local], dtype=np.int64) if y is not None else np.full(count, -1, np.int64)
    return pb.LookupNodesReply(original_ids=encode_tensor(np.asarray(part.orig_ids[node_type][local],
                                                                     dtype=np.int64)),
                               labels=encode_tensor(labels))
