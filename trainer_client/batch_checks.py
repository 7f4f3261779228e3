"""Check the named tensors of one batch against its header and the request, and build it,
one path for both kinds of graph (docs/wire.md): a typed batch's tensors and counts name
their type (``n_id/<type>``, ``edge_index/<src__rel__dst>`` ..., ``typed_sampled_*``), a
plain batch's do not (``n_id``, ``edge_index`` ..., ``num_sampled_*``) and are read as a
graph of one node type and one edge type. The batch is laid out as PyG's hetero
``NeighborLoader`` lays out its batches; a plain batch's one node type and one edge type
share one store, a ``Data`` (what :func:`~trainer_client.graph.to_plain_data` makes of a
one-type ``HeteroData``, built in place).

Anything malformed raises :class:`BatchDecodeError` (a :class:`protos.codec.CodecError`,
itself a ``ValueError``) naming the tensor or field, what was expected and what was
received. The checks run on a stream's reader thread for every batch: NumPy,
single-threaded, on views of the received bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch_geometric.data import Data, HeteroData
from torch_geometric.data.storage import EdgeStorage, NodeStorage

from partitioner.graph import EdgeType, edge_type_name
from protos import sampling_pb2 as pb
from protos.codec import ROWS_PREFIX, CodecError
from protos.compact import (
    COUNT_DTYPES,
    INDEX_DTYPES,
    expand_edges,
    expand_sources,
    expand_typed_sources,
    unpack_mask,
    widen,
)
from trainer_client.graph import PLAIN_EDGE_TYPE, PLAIN_NODE_TYPE, TypedGraph

#: Feature dtypes a batch may carry.
FEATURE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: Label dtypes a batch may carry (signed: -1 marks unlabeled nodes).
LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)
#: Edge features travel in any wire dtype: floating point as node features may, others as stored.
EDGE_FEATURE_DTYPES = (*FEATURE_DTYPES, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                       torch.bool)
_INT64 = (torch.int64,)


class BatchDecodeError(CodecError):
    """A batch's messages or tensors are malformed or disagree with the request."""


@dataclass(frozen=True)
class TypedSpec:
    """The types every batch of one epoch stream has (a plain graph's: one of each, and
    no types in the tensors' names)."""

    #: Node types, in the graph's order.
    node_types: tuple[str, ...]
    #: Edge types ``(src, rel, dst)``, in the graph's order.
    edge_types: tuple[EdgeType, ...]
    #: Feature columns per node type (0: no features, no ``x``; None: any number).
    feature_dims: Mapping[str, int | None]
    #: The labelled node type.
    target_type: str
    #: The node type of the seeds.
    seed_type: str
    #: Whether tensors and header fields carry the type (``n_id/<type>``): a typed graph.
    named: bool = True
    #: Edge type to the shape of one edge's feature row, for the types with edge features
    #: (None: any edge type may carry ``edge_attr`` of any shape).
    edge_feature_shapes: Mapping[EdgeType, tuple[int, ...]] | None = None

    @staticmethod
    def of(graph: TypedGraph, seed_type: str) -> TypedSpec:
        """The spec of ``graph``'s batches whose seeds are of ``seed_type``."""
        return TypedSpec(graph.node_types, graph.edge_types, dict(graph.feature_dims),
                         graph.target_type, seed_type, graph.typed, dict(graph.edge_feature_shapes))

    def edge_featured(self, edge_type: EdgeType) -> bool:
        return self.edge_feature_shapes is None or edge_type in self.edge_feature_shapes

    def name(self, kind: str, key: str | EdgeType) -> str:
        """The wire name of tensor ``kind`` ("n_id", "edge_index" ...) of a node or edge type."""
        return f"{kind}/{key if isinstance(key, str) else edge_type_name(key)}" if self.named else kind

    def count_field(self, kind: str, key: str | EdgeType) -> str:
        """The header field of a type's per-hop counts (``kind``: "nodes" or "edges")."""
        return f"typed_sampled_{kind}[{key if isinstance(key, str) else edge_type_name(key)!r}]" \
            if self.named else f"num_sampled_{kind}"

    def featured(self, node_type: str) -> bool:
        dim = self.feature_dims.get(node_type, 0)
        return dim is None or dim > 0


@dataclass(frozen=True)
class LinkSpec:
    """What a link batch carries besides (``EpochRequest.links``; ``docs/wire.md``)."""

    #: The seed edges' type.
    edge_type: EdgeType
    #: Whether the batch's labelled edges come as ``src_index`` / ``dst_pos_index`` /
    #: ``dst_neg_index`` (TRIPLET, GIVEN), not ``edge_label_index``.
    triplet: bool = False
    #: Whether ``edge_label`` comes with ``edge_label_index``.
    labels: bool = False
    #: Negatives per positive in ``dst_neg_index`` (None: any).
    negatives: int | None = None


@dataclass(frozen=True)
class TensorRows:
    """A node tensor whose rows every batch carries (``EpochRequest.node_tensors``)."""

    #: The attribute of its node type's store the rows go in (``batch.h``, ``batch["paper"].h``).
    attr: str
    #: The tensor's name; its rows travel as ``rows:<name>``.
    name: str
    #: Its node type, the shape of one row and its dtype.
    node_type: str
    dims: tuple[int, ...]
    dtype: torch.dtype

    @property
    def wire_name(self) -> str:
        return ROWS_PREFIX + self.name


@dataclass(frozen=True)
class BatchSpec:
    """What every batch of one epoch stream must look like (from the request and the
    cluster info); ``None`` skips a check."""

    #: Number of hops (``len(fanouts)``): ``num_sampled_nodes`` has one entry more.
    num_hops: int | None = None
    #: Feature columns ``F`` of ``x`` (``ClusterInfo.feature_dim``) of a plain graph.
    feature_dim: int | None = None
    #: Whether ``x`` must be present (``EpochRequest.include_features``).
    include_features: bool = True
    #: Whether ``y`` must be present (``EpochRequest.include_labels``).
    include_labels: bool = True
    #: Batches of this rank's epoch (``MinibatchHeader.num_batches`` must match).
    num_batches: int | None = None
    #: A typed graph's batches (``EpochRequest.typed``); None: a plain graph's.
    typed: TypedSpec | None = None
    #: The request set ``compact_indices``: accept the compact forms (protos/compact.py)
    #: beside the int64 ones; the batch is the same either way.
    compact_indices: bool = False
    #: Whether ``e_id`` / ``edge_attr`` must be present (``EpochRequest.include_edge_ids``
    #: / ``include_edge_features``; ``edge_attr`` for the edge types with edge features).
    include_edge_ids: bool = False
    include_edge_features: bool = False
    #: A plain graph's edge feature row shape by edge type (``ClusterInfo.edge_features``:
    #: empty when it has none), or None: any.
    edge_feature_shapes: Mapping[EdgeType, tuple[int, ...]] | None = None
    #: A link epoch's batches (None: seed nodes).
    link: LinkSpec | None = None
    #: The node tensors whose rows every batch carries.
    node_tensors: tuple[TensorRows, ...] = ()

    @cached_property
    def layout(self) -> TypedSpec:
        """The batches' types: :attr:`typed`, or a plain graph's one node and edge type."""
        if self.typed is not None:
            return self.typed
        return TypedSpec((PLAIN_NODE_TYPE,), (PLAIN_EDGE_TYPE,), {PLAIN_NODE_TYPE: self.feature_dim},
                         PLAIN_NODE_TYPE, PLAIN_NODE_TYPE, named=False,
                         edge_feature_shapes=self.edge_feature_shapes)

    @property
    def narrow(self) -> bool:
        """Whether the compact forms are accepted: asked for, or a typed batch (which
        may always use them)."""
        return self.compact_indices or self.typed is not None

    @cached_property
    def tensor_names(self) -> tuple[str, ...]:
        """Every tensor name a batch may carry."""
        t = self.layout
        names = []
        for n in t.node_types:
            kinds = ["n_id", "orig_id"] + (["x", "x_cached"] if t.featured(n) else []) + \
                (["y"] if n == t.target_type else [])
            names += [t.name(k, n) for k in kinds]
        compact = ["edge_src", "edge_new", "edge_count"] if self.narrow else []
        names += [t.name(k, e) for e in t.edge_types
                  for k in ["edge_index", *compact, "e_id", *(["edge_attr"] if t.edge_featured(e) else [])]]
        if self.link is not None:
            names += [t.name(k, self.link.edge_type) for k in LINK_TENSORS]
        return tuple(names + [rows.wire_name for rows in self.node_tensors])

    @cached_property
    def known_names(self) -> frozenset[str]:
        return frozenset(self.tensor_names)


def build_data(header: pb.MinibatchHeader, tensors: dict[str, torch.Tensor], spec: BatchSpec,
               index: int = 0) -> Data | HeteroData:
    """Check a batch's header and tensors against each other and ``spec``; build the
    batch: a ``HeteroData`` (a ``Data`` for a plain graph).

    Per node type: ``n_id`` (original IDs when the batch carries them; graphfeed's own
    then in ``internal_n_id``), ``num_nodes``, ``x`` (types with features; with
    ``x_cached`` only the rows the trainer's cache lacks, the mask in ``x_cached``),
    ``y`` (the target type); ``batch_size`` on the seed type. Per edge type
    ``edge_index``. ``num_sampled_nodes`` / ``num_sampled_edges`` are set per type as PyG
    sets them (``batch.num_sampled_nodes_dict``) and as dicts on the batch itself.
    """
    t = spec.layout
    where = f"batch {index}"
    unknown = sorted(tensors.keys() - spec.known_names)
    if unknown:
        names = list(spec.tensor_names)
        shown = f"{names[:20]} ..." if len(names) > 20 else str(names)
        raise BatchDecodeError(f"{where}: tensor names: expected among {shown}, got {unknown[:10]}")
    if spec.num_batches is not None and header.num_batches != spec.num_batches:
        raise BatchDecodeError(f"{where}: MinibatchHeader.num_batches: expected {spec.num_batches} (this "
                               f"rank's batches by the epoch plan), got {header.num_batches}")
    nodes, edges = _counts(header, spec, where)
    # a plain batch's one node type and one edge type share one store: a Data
    data: Data | HeteroData = HeteroData() if t.named else Data()
    totals = {n: sum(nodes[n]) for n in t.node_types}
    for n in t.node_types:
        store = data[n] if isinstance(data, HeteroData) else data
        _node_store(store, n, totals[n], tensors, spec, where)
        store.num_sampled_nodes = nodes[n]
        if n == t.seed_type:
            store.batch_size = int(header.num_seed_nodes)
    sources = _marked_sources(tensors, spec, nodes, edges, where)
    for e in t.edge_types:
        store = data[e] if isinstance(data, HeteroData) else data
        store.edge_index = _edge_index(tensors, spec, e, nodes, sum(edges[e]), totals, where, sources.get(e))
        store.num_sampled_edges = edges[e]
        _edge_rows(store, e, sum(edges[e]), tensors, spec, where)
    if isinstance(data, HeteroData):
        data.num_sampled_nodes = nodes
        data.num_sampled_edges = edges
    if spec.link is not None:
        _link_tensors(data, header, tensors, spec, spec.link, {n: c[0] for n, c in nodes.items()}, where)
    for rows in spec.node_tensors:
        found = _require(tensors, rows.wire_name, where, f"node tensor {rows.name!r} was asked for")
        _check_tensor(found, rows.wire_name, [totals[rows.node_type], *rows.dims], [rows.dtype], where)
        (data[rows.node_type] if isinstance(data, HeteroData) else data)[rows.attr] = found
    return data


#: The tensors a link batch may carry (their names end in "/S__R__D" on a typed graph).
LINK_TENSORS = ("edge_label_index", "edge_label", "src_index", "dst_pos_index", "dst_neg_index")


def _link_tensors(data: Data | HeteroData, header: pb.MinibatchHeader, tensors: dict[str, torch.Tensor],
                  spec: BatchSpec, link: LinkSpec, seeds: Mapping[str, int], where: str) -> None:
    """Check a link batch's labelled edges and put them where PyG's ``LinkNeighborLoader``
    does: ``edge_label_index`` and ``edge_label`` on the seed edge type's store (the
    ``Data`` itself on a plain graph), ``src_index`` on the source type's,
    ``dst_pos_index`` and ``dst_neg_index`` on the destination type's. Local indices
    point into the batch's seed nodes of their type."""
    t = spec.layout
    src, _, dst = link.edge_type
    positives = int(header.num_seed_edges)

    def store(key: str | EdgeType) -> Data | NodeStorage | EdgeStorage:
        return data if isinstance(data, Data) else data[key]

    def indices(kind: str, shape: list[int | None], bound: int) -> torch.Tensor:
        name = t.name(kind, link.edge_type)
        found = _require(tensors, name, where, "a link batch")
        _check_tensor(found, name, shape, [torch.int64], where)
        if found.numel() and (int(found.min()) < 0 or int(found.max()) >= bound):
            raise BatchDecodeError(f"{where}: tensor {name!r}: expected local indices in 0 .. {bound - 1} "
                                   f"(the batch's seed nodes of its type), got values in "
                                   f"[{int(found.min())}, {int(found.max())}]")
        return found

    if link.triplet:
        store(src).src_index = indices("src_index", [positives], seeds[src])
        store(dst).dst_pos_index = indices("dst_pos_index", [positives], seeds[dst])
        store(dst).dst_neg_index = indices("dst_neg_index", [positives, link.negatives], seeds[dst])
        return
    label_index = _require(tensors, t.name("edge_label_index", link.edge_type), where, "a link batch")
    count = int(label_index.shape[1]) if label_index.dim() == 2 else -1
    if count < positives:
        raise BatchDecodeError(f"{where}: tensor {t.name('edge_label_index', link.edge_type)!r}: expected "
                               f"shape [2, >= {positives}] (num_seed_edges), got {list(label_index.shape)}")
    label_index = indices("edge_label_index", [2, None], max(seeds[src], seeds[dst]))
    for row, n in ((0, src), (1, dst)):
        top = int(label_index[row].max()) if count else -1
        if top >= seeds[n]:
            raise BatchDecodeError(f"{where}: tensor {t.name('edge_label_index', link.edge_type)!r}: "
                                   f"expected row {row} in 0 .. {seeds[n] - 1}, got {top}")
    store(link.edge_type).edge_label_index = label_index
    if link.labels:
        name = t.name("edge_label", link.edge_type)
        label = _require(tensors, name, where, "labelled link edges")
        if label.dim() < 1 or label.shape[0] != count:
            raise BatchDecodeError(f"{where}: tensor {name!r}: expected {count} labels (one per column of "
                                   f"edge_label_index), got shape {list(label.shape)}")
        store(link.edge_type).edge_label = label


# ---- the header ------------------------------------------------------------------------


def _typed_entries(entries: Sequence[pb.TypedCounts], names: list[str], field: str,
                   where: str) -> dict[str, list[int]]:
    """A typed header field's counts by name, one entry per name (in the header's order)."""
    got = {c.name: [int(v) for v in c.counts] for c in entries}
    if sorted(got) != sorted(names) or len(entries) != len(names):
        raise BatchDecodeError(f"{where}: MinibatchHeader.{field}: expected one entry per type {names}, "
                               f"got {[c.name for c in entries]}")
    return got


def _counts(header: pb.MinibatchHeader, spec: BatchSpec, where: str
            ) -> tuple[dict[str, list[int]], dict[EdgeType, list[int]]]:
    """The header's per-hop counts of every node and edge type, checked."""
    t = spec.layout
    if t.named:
        nodes = _typed_entries(header.typed_sampled_nodes, list(t.node_types), "typed_sampled_nodes", where)
        by_name = _typed_entries(header.typed_sampled_edges, [edge_type_name(e) for e in t.edge_types],
                                 "typed_sampled_edges", where)
        edges = {e: by_name[edge_type_name(e)] for e in t.edge_types}
    else:
        nodes = {t.node_types[0]: [int(v) for v in header.num_sampled_nodes]}
        edges = {t.edge_types[0]: [int(v) for v in header.num_sampled_edges]}
    hops = spec.num_hops
    for n, counts in nodes.items():
        if hops is not None and len(counts) != hops + 1:
            raise BatchDecodeError(f"{where}: MinibatchHeader.{t.count_field('nodes', n)}: expected "
                                   f"{hops + 1} entries (seeds + one per hop), got {len(counts)}")
    for e, counts in edges.items():
        want = max(len(nodes[e[2]]) - 1, 0)
        if len(counts) != want:
            raise BatchDecodeError(f"{where}: MinibatchHeader.{t.count_field('edges', e)}: expected {want} "
                                   f"entries (one per hop), got {len(counts)}")
    if header.num_seed_nodes < 0 or any(v < 0 for c in (*nodes.values(), *edges.values()) for v in c):
        shown = f"typed_sampled_nodes {nodes}, typed_sampled_edges {edges}" if t.named else \
            f"num_sampled_nodes {nodes[t.node_types[0]]}, num_sampled_edges {edges[t.edge_types[0]]}"
        raise BatchDecodeError(f"{where}: MinibatchHeader: expected counts >= 0, got num_seed_nodes "
                               f"{header.num_seed_nodes}, {shown}")
    ends = {spec.link.edge_type[2]} - {t.seed_type} if spec.link is not None else set()
    for n, counts in nodes.items():
        if n in ends:  # a link batch's destination type: seeds of its own
            continue
        seeds = n == t.seed_type
        want = header.num_seed_nodes if seeds else 0
        if not counts or counts[0] != want:
            why = f"num_seed_nodes ({want})" if seeds else f"0 (the seeds are of type {t.seed_type!r})"
            raise BatchDecodeError(f"{where}: MinibatchHeader.{t.count_field('nodes', n)}[0]: expected "
                                   f"{why}, got {counts[:1] or 'no entries'}")
    return nodes, edges


# ---- tensors ---------------------------------------------------------------------------


def _require(tensors: dict[str, torch.Tensor], name: str, where: str, why: str) -> torch.Tensor:
    """Return tensor ``name``; raise naming it when it is missing."""
    if name not in tensors:
        raise BatchDecodeError(f"{where}: tensor {name!r}: expected it ({why}), got {sorted(tensors)[:20]}")
    return tensors[name]


def _check_tensor(t: torch.Tensor, name: str, shape: Sequence[int | None], dtypes: Sequence[torch.dtype],
                  where: str) -> None:
    """Raise unless ``t`` has one of ``dtypes`` and ``shape`` (``None`` = any size)."""
    if t.dtype not in dtypes:
        raise BatchDecodeError(f"{where}: tensor {name!r}: expected dtype "
                               f"{' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape, strict=False))
    if not ok:
        want = ["*" if s is None else s for s in shape]
        raise BatchDecodeError(f"{where}: tensor {name!r}: expected shape {want}, got {list(t.shape)}")


def cached_mask(tensors: dict[str, torch.Tensor], name: str, num_nodes: int, where: str,
                bits: bool) -> torch.Tensor:
    """The cache mask ``name`` ("x_cached", "x_cached/<type>") as bool ``[N]``: sent as
    bools, or (``bits``: the compact forms are accepted) as packed bits."""
    cached = tensors[name]
    if bits and cached.dtype == torch.uint8:
        try:
            return unpack_mask(cached, num_nodes)
        except ValueError as exc:
            raise BatchDecodeError(f"{where}: tensor {name!r}: {exc}") from None
    _check_tensor(cached, name, [num_nodes], [torch.bool], where)
    return cached


def _node_store(store: NodeStorage | Data, n: str, num: int, tensors: dict[str, torch.Tensor],
                spec: BatchSpec, where: str) -> None:
    """Check node type ``n``'s tensors (``num`` nodes by the header); fill its ``store``."""
    t = spec.layout
    ids = INDEX_DTYPES if spec.narrow else _INT64
    name = t.name("n_id", n)
    n_id = _require(tensors, name, where, "every batch has it")
    _check_tensor(n_id, name, [None], ids, where)
    if n_id.numel() != num:
        raise BatchDecodeError(f"{where}: tensor {name!r}: expected sum({t.count_field('nodes', n)}) = "
                               f"{num} nodes, got {n_id.numel()}")
    store.num_nodes = num
    orig_name = t.name("orig_id", n)
    if orig_name in tensors:  # users see original IDs; graphfeed's own stay on the side
        _check_tensor(tensors[orig_name], orig_name, [num], ids, where)
        store.internal_n_id, store.n_id = widen(n_id), widen(tensors[orig_name])
    else:
        store.n_id = widen(n_id)
    x_name, mask_name = t.name("x", n), t.name("x_cached", n)
    if t.featured(n) and (spec.include_features or x_name in tensors or mask_name in tensors):
        rows, why = num, "include_features is set"
        if mask_name in tensors:  # x holds only the rows the trainer's cache lacks
            cached = cached_mask(tensors, mask_name, num, where, spec.narrow)
            rows = num - int(np.count_nonzero(cached.numpy()))
            why = f"the {rows} rows not marked in {mask_name!r}"
            store.x_cached = cached
        x = _require(tensors, x_name, where, why)
        _check_tensor(x, x_name, [rows, t.feature_dims.get(n)], FEATURE_DTYPES, where)
        store.x = x
    y_name = t.name("y", n)
    if n == t.target_type and (spec.include_labels or y_name in tensors):
        y = _require(tensors, y_name, where, "include_labels is set")
        _check_tensor(y, y_name, [num], LABEL_DTYPES, where)
        store.y = widen(y)


def _edge_rows(store: EdgeStorage | Data, e: EdgeType, num: int, tensors: dict[str, torch.Tensor],
               spec: BatchSpec, where: str) -> None:
    """Check edge type ``e``'s ``e_id`` and ``edge_attr`` (``num`` edges by the header);
    set them on its ``store``."""
    t = spec.layout
    name = t.name("e_id", e)
    if spec.include_edge_ids or name in tensors:
        e_id = _require(tensors, name, where, "include_edge_ids is set")
        _check_tensor(e_id, name, [num], INDEX_DTYPES if spec.narrow else _INT64, where)
        store.e_id = widen(e_id)
    name = t.name("edge_attr", e)
    if (spec.include_edge_features and t.edge_featured(e)) or name in tensors:
        attr = _require(tensors, name, where, "include_edge_features is set")
        row = t.edge_feature_shapes.get(e) if t.edge_feature_shapes is not None else None
        shape: list[int | None] = [num, *row] if row is not None else [num, *([None] * (attr.dim() - 1))]
        _check_tensor(attr, name, shape, EDGE_FEATURE_DTYPES, where)
        store.edge_attr = attr


def _marked_sources(tensors: dict[str, torch.Tensor], spec: BatchSpec, nodes: dict[str, list[int]],
                    edges: dict[EdgeType, list[int]], where: str) -> dict[EdgeType, torch.Tensor]:
    """The int64 sources of the relations sent with ``edge_new`` (compact batches: per
    source type, every relation from it or none; their new source nodes are numbered
    together, :func:`protos.compact.split_typed_sources`)."""
    t = spec.layout
    out: dict[EdgeType, torch.Tensor] = {}
    if not spec.narrow:
        return out
    for s in t.node_types:
        rels = [e for e in t.edge_types if e[0] == s]
        marked = [e for e in rels if t.name("edge_new", e) in tensors]
        if not marked:
            continue
        if marked != rels:
            raise BatchDecodeError(
                f"{where}: tensor names: expected {t.name('edge_new', '<relation>')!r} for every relation "
                f"from {s!r} ({[edge_type_name(e) for e in rels]}) or none, got it for "
                f"{[edge_type_name(e) for e in marked]}")
        rest = {}
        for e in rels:
            why = f"it comes with {t.name('edge_new', e)!r}"
            rest[e] = _require(tensors, t.name("edge_src", e), where, why)
            _check_tensor(rest[e], t.name("edge_src", e), [None], INDEX_DTYPES, where)
        seeds, num = nodes[s][0], sum(nodes[s])
        if len(rels) == 1:  # one relation numbers the new nodes: one pass (a plain graph's)
            e, name, num_edges = rels[0], t.name("edge_new", rels[0]), sum(edges[rels[0]])
            try:  # every edge that reaches a new node is marked
                out[e] = expand_sources(rest[e], tensors[name], num_edges, seeds)
            except ValueError as exc:
                raise BatchDecodeError(f"{where}: tensor {name!r}: {exc}") from None
            if num_edges - rest[e].numel() != num - seeds:
                raise BatchDecodeError(f"{where}: tensor {name!r}: expected {num - seeds} marked edges (the "
                                       f"new nodes), got {num_edges - rest[e].numel()}")
            continue
        try:
            got = expand_typed_sources({edge_type_name(e): rest[e] for e in rels},
                                       {edge_type_name(e): tensors[t.name("edge_new", e)] for e in rels},
                                       {edge_type_name(e): edges[e] for e in rels}, seeds, num)
        except ValueError as exc:
            raise BatchDecodeError(f"{where}: tensor {exc}") from exc
        out.update({e: got[edge_type_name(e)] for e in rels})
    return out


def _edge_index(tensors: dict[str, torch.Tensor], spec: BatchSpec, e: EdgeType, nodes: dict[str, list[int]],
                num_edges: int, totals: dict[str, int], where: str,
                sources: torch.Tensor | None) -> torch.Tensor:
    """Relation ``e``'s int64 ``edge_index``, from ``edge_index`` or (compact) from its
    sources (``sources``, expanded from ``edge_new``, or ``edge_src``) and
    ``edge_count``; every index checked against its node type's nodes."""
    t = spec.layout
    name = t.name("edge_index", e)
    if spec.narrow and name not in tensors:
        dst = nodes[e[2]]
        edge_index = _expanded(tensors, t, e, num_edges, sum(dst) - dst[-1], where, sources)
    else:
        edge_index = _require(tensors, name, where, "every batch has it")
        _check_tensor(edge_index, name, [2, num_edges], INDEX_DTYPES if spec.narrow else _INT64, where)
        edge_index = widen(edge_index)
    if edge_index.numel():  # every entry in 0 .. N-1: one pass over E
        # NumPy, single-threaded: torch's intra-op threads would wake for this one pass and
        # fight the trainer's own threads for the cores
        indices = edge_index.numpy()
        if e[0] == e[2]:
            low, high = int(indices.min()), int(indices.max())
            if low < 0 or high >= totals[e[0]]:
                raise BatchDecodeError(f"{where}: tensor {name!r}: expected local indices in 0 .. "
                                       f"{totals[e[0]] - 1}, got values in {low} .. {high}")
        for row, n in ((0, e[0]), (1, e[2])) if e[0] != e[2] else ():
            low, high = int(indices[row].min()), int(indices[row].max())
            if low < 0 or high >= totals[n]:
                raise BatchDecodeError(f"{where}: tensor {name!r}: expected row {row} in 0 .. "
                                       f"{totals[n] - 1} (local {n!r} IDs), got {low} .. {high}")
    return edge_index


def _expanded(tensors: dict[str, torch.Tensor], t: TypedSpec, e: EdgeType, num_edges: int, num_targets: int,
              where: str, sources: torch.Tensor | None = None) -> torch.Tensor:
    """A relation's int64 ``edge_index`` from its compact ``edge_src`` (or ``sources``,
    already expanded from ``edge_new``) and ``edge_count`` (``num_targets``: the
    destination type's nodes of every hop but the last)."""
    src_name, count_name = t.name("edge_src", e), t.name("edge_count", e)
    src = sources
    if src is None:
        src = _require(tensors, src_name, where, f"every compact batch has it or {t.name('edge_index', e)!r}")
        _check_tensor(src, src_name, [None], INDEX_DTYPES, where)
        if src.numel() != num_edges:
            raise BatchDecodeError(f"{where}: tensor {src_name!r}: expected shape [{num_edges}], got "
                                   f"{list(src.shape)}")
    counts = _require(tensors, count_name, where, f"it comes with {src_name!r}")
    _check_tensor(counts, count_name, [num_targets], COUNT_DTYPES, where)
    try:
        return expand_edges(src, counts)
    except ValueError as exc:
        raise BatchDecodeError(f"{where}: tensor {count_name!r}: {exc}") from None
