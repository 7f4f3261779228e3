"""The graph model that readers produce and the partition writer consumes: one model for
plain and typed graphs.

A :class:`TypedGraphData` has node types with per-type counts, relations
``(src_type, relation, dst_type)`` whose edges use per-type **local** IDs, features per
node type (some types may have none, as in ogbn-mag where only papers do), optional edge
weights per relation, and labels and splits on one target node type. A plain
:class:`GraphData` is the typed graph of one node type and one edge type
(:func:`plain_view`, ``typed=False``). Arrays may be ``np.memmap`` views of ``.npy``
files, so graphs larger than memory pass through the streaming partitioner without being
loaded; nothing here copies them.

The homogeneous view of a typed graph numbers nodes type after type (global ID = the
type's offset + local ID, types in :attr:`TypedGraphData.node_types` order); METIS
partitions that view.

**Edge IDs.** The original ID of an edge is its column in the ``edge_index`` of its type
that a reader hands to the partition writer (PyG's ``e_id``); edge weights and edge
features (``edge_attr``) are aligned with those columns. What reorders or adds edges keeps
them aligned and says what the columns become: :meth:`TypedGraphData.add_reverse` gives a
reverse relation ``(d, rev_r, s)`` its own IDs ``0 .. E-1``, edge ``i`` being the reverse
of edge ``i`` of ``(s, r, d)`` with a copy of its features, as PyG's ``ToUndirected``
does; :func:`make_undirected` (a same-type relation, OGB's ``to_undirected``) numbers the
coalesced edges in (source, target) order, each with the features of its first
occurrence among the edges followed by their reverses. A plain graph made undirected by
appending the reversed edges (the synthetic presets) has edge ``E + i`` the reverse of
edge ``i``. A relation with ``edge_ids`` (what :func:`~partitioner.links.random_link_split`
leaves: the kept edges' columns in the graph it was given) has those as its edges'
original IDs instead of its columns; they follow their edges as weights do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from partitioner.npyio import iter_edge_chunks

log = logging.getLogger(__name__)

#: The split names every part of graphfeed uses, in this order.
SPLITS: tuple[str, ...] = ("train", "val", "test")

#: A relation: ``(source node type, relation name, destination node type)``.
EdgeType = tuple[str, str, str]

#: The one node type and the one edge type of a plain graph, which every layer below the
#: user's API handles as a typed graph (users never see these names: a plain graph's
#: files, wire tensors and batches name no type).
PLAIN_NODE_TYPE = "_N"
PLAIN_EDGE_TYPE: EdgeType = ("_N", "_E", "_N")


def edge_type_name(edge_type: EdgeType) -> str:
    """``src__rel__dst``: the edge type as one string (file names, manifest keys)."""
    return "__".join(edge_type)


def parse_edge_type(name: str) -> EdgeType:
    """Inverse of :func:`edge_type_name`."""
    parts = name.split("__")
    if len(parts) != 3 or not all(parts):
        raise GraphDataError(
            f"edge type: expected 'src__relation__dst' (three non-empty names), got {name!r}"
        )
    return parts[0], parts[1], parts[2]


def sorted_unique(keys: np.ndarray) -> np.ndarray:
    """Sorted distinct values (sort + mask; far faster than ``np.unique`` on large int64)."""
    s = np.sort(keys)
    if s.size == 0:
        return s
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


class GraphDataError(ValueError):
    """A source graph is malformed; the message names the field."""


def labels_to_int64(labels: np.ndarray, field: str) -> np.ndarray:
    """``[N]`` or ``[N, 1]`` labels as ``[N]`` int64: integers as they are; floats (as OGB
    stores papers100M's, and PyG's ``Data.y`` then holds them) NaN for unlabeled, which
    becomes ``-1``, and whole numbers otherwise. ``field`` names the array in errors."""
    raw = labels[:, 0] if labels.ndim == 2 and labels.shape[1] == 1 else labels
    if raw.ndim != 1:
        raise GraphDataError(f"{field}: expected shape [N] or [N, 1], got {list(labels.shape)}")
    if np.issubdtype(raw.dtype, np.integer):
        return raw.astype(np.int64, copy=False)
    if not np.issubdtype(raw.dtype, np.floating):
        raise GraphDataError(f"{field}: expected integer labels (-1 for unlabeled) or float "
                             f"labels (NaN for unlabeled), got {raw.dtype}")
    unlabeled = np.isnan(raw)
    with np.errstate(invalid="ignore"):  # infinities and overflows are refused just below
        out = np.where(unlabeled, -1, raw).astype(np.int64)
    if not np.array_equal(out[~unlabeled], raw[~unlabeled]):
        raise GraphDataError(f"{field}: expected whole-number labels (or NaN for unlabeled), got "
                             f"fractions, infinities or values past int64")
    return out


def check_link_split_name(name: object) -> str:
    """A link split's name as files and manifests use it: letters, digits, ``_`` and ``-``."""
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-" for c in name) \
            or not name.isascii():
        raise GraphDataError(f"link_splits: expected split names of ASCII letters, digits, '_' and "
                             f"'-' (e.g. 'train', 'val_neg'), got {name!r}")
    return name


@dataclass(frozen=True)
class LinkSplit:
    """The edges of one link split before partitioning (``train``, ``val``, ``test``, or
    another such as OGB collab's ``val_neg``), in the **original** IDs of their types."""

    #: The relation the edges belong to (:data:`PLAIN_EDGE_TYPE` on a plain graph).
    edge_type: EdgeType
    #: int64 ``[E]`` source IDs (of the edge type's source node type).
    src: np.ndarray
    #: int64 ``[E]`` destination IDs (of the edge type's destination node type).
    dst: np.ndarray
    #: Optional ``[E, ...]`` numeric labels, one row per edge.
    label: np.ndarray | None = None
    #: Optional int64 ``[E, K]``: ``K`` given negative destinations per edge (OGB
    #: citation2's evaluation protocol).
    neg_dst: np.ndarray | None = None

    @property
    def num_edges(self) -> int:
        return int(self.src.shape[0])

    @property
    def num_negatives(self) -> int:
        """``K`` (0 without given negatives)."""
        return 0 if self.neg_dst is None else int(self.neg_dst.shape[1])

    def check(self, name: str, graph: TypedGraphData, check_values: bool = True) -> None:
        """Raise :class:`GraphDataError` naming the field when the split does not fit ``graph``."""
        check_link_split_name(name)
        what = f"link_splits[{name!r}]"
        if self.edge_type not in graph.edge_index:
            want = list(graph.edge_index) if graph.typed else [PLAIN_EDGE_TYPE]
            raise GraphDataError(f"{what}.edge_type: expected one of {want}, got {self.edge_type!r}")
        for end in ("src", "dst"):
            ids = getattr(self, end)
            if ids.ndim != 1 or ids.dtype != np.int64:
                raise GraphDataError(f"{what}.{end}: expected 1-D int64, got {ids.dtype} of shape "
                                     f"{list(ids.shape)}")
        e = self.num_edges
        if self.dst.shape != (e,):
            raise GraphDataError(f"{what}.dst: expected shape [{e}] (as src), got {list(self.dst.shape)}")
        if self.label is not None and (self.label.ndim < 1 or self.label.shape[0] != e
                                       or self.label.dtype.kind not in _EDGE_ATTR_KINDS):
            raise GraphDataError(f"{what}.label: expected numbers of shape [{e}, ...] (one row per "
                                 f"edge), got {self.label.dtype} of shape {list(self.label.shape)}")
        neg = self.neg_dst
        if neg is not None and (neg.ndim != 2 or neg.shape[0] != e or neg.dtype != np.int64):
            raise GraphDataError(f"{what}.neg_dst: expected int64 of shape [{e}, K], got {neg.dtype} "
                                 f"of shape {list(neg.shape)}")
        if check_values:
            s, _, d = self.edge_type
            for field_name, ids, t in (("src", self.src, s), ("dst", self.dst, d), ("neg_dst", neg, d)):
                n = graph.num_nodes[t]
                if ids is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
                    of = f"{t!r} IDs" if graph.typed else "node IDs"
                    raise GraphDataError(f"{what}.{field_name}: expected {of} in [0, {n}), got values "
                                         f"in [{int(ids.min())}, {int(ids.max())}]")


@dataclass
class GraphData:
    """A homogeneous node-classification graph before partitioning: below the user's API,
    the typed graph of one node type and one edge type (:func:`plain_view`)."""

    #: Name of the graph (dataset name or preset), recorded in the partition manifest.
    name: str
    #: Number of nodes ``N``; node IDs are ``0 .. N-1``.
    num_nodes: int
    #: ``[2, E]`` int64, row 0 the source and row 1 the target of each directed edge.
    edge_index: np.ndarray
    #: ``[N, F]`` node features (float32, float16 or float64); None: the nodes have none
    #: (a trainer gives them learnable embeddings).
    x: np.ndarray | None
    #: ``[N]`` int64 class labels; ``-1`` marks an unlabeled node.
    y: np.ndarray
    #: Number of classes (labels lie in ``0 .. num_classes-1``).
    num_classes: int
    #: Split name (``train``/``val``/``test``) to the int64 IDs of its nodes.
    splits: dict[str, np.ndarray] = field(default_factory=dict)
    #: Optional ``[E]`` float32 positive edge weights, aligned with ``edge_index``.
    edge_weight: np.ndarray | None = None
    #: Optional ``[E]`` or ``[E, F_e]`` edge features of any numeric dtype, aligned with
    #: ``edge_index`` (an edge's original ID is its column there, see the module doc).
    edge_attr: np.ndarray | None = None
    #: Link split name (``train``/``val``/``test``, ``val_neg`` ...) to its edges, of
    #: :data:`PLAIN_EDGE_TYPE` (:mod:`partitioner.links`).
    link_splits: dict[str, LinkSplit] = field(default_factory=dict)
    #: Optional ``[E]`` int64 original IDs of the edges, aligned with ``edge_index``, where
    #: they are not its columns (after :func:`~partitioner.links.random_link_split`: the
    #: kept edges' columns in the graph it was given).
    edge_ids: np.ndarray | None = None

    @property
    def num_edges(self) -> int:
        return int(self.edge_index.shape[1])

    @property
    def feature_dim(self) -> int:
        return 0 if self.x is None else int(self.x.shape[1])

    def validate(self, check_values: bool = True) -> None:
        """:meth:`TypedGraphData.validate` of its one-type view."""
        plain_view(self).validate(check_values)


#: Prefix of the relations :meth:`TypedGraphData.add_reverse` adds (as PyG's ``ToUndirected``).
REVERSE_PREFIX = "rev_"

_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
#: numpy dtype kinds edge features may have: booleans, integers and floats.
_EDGE_ATTR_KINDS = "biuf"


def plain_view(graph: GraphData) -> TypedGraphData:
    """A plain graph as the typed graph of one node type and one edge type
    (:data:`PLAIN_NODE_TYPE`, :data:`PLAIN_EDGE_TYPE`; ``typed=False``), sharing its
    arrays (memory maps stay memory maps)."""
    t, et = PLAIN_NODE_TYPE, PLAIN_EDGE_TYPE
    return TypedGraphData(
        name=graph.name, num_nodes={t: graph.num_nodes}, edge_index={et: graph.edge_index},
        x={} if graph.x is None else {t: graph.x}, target_type=t, y=graph.y, num_classes=graph.num_classes,
        splits=dict(graph.splits),
        edge_weight={} if graph.edge_weight is None else {et: graph.edge_weight}, typed=False,
        edge_attr={} if graph.edge_attr is None else {et: graph.edge_attr},
        link_splits=dict(graph.link_splits),
        edge_ids={} if graph.edge_ids is None else {et: graph.edge_ids})


def _check_type_name(what: str, name: str) -> None:
    if not name or "__" in name or "/" in name or name != name.strip():
        raise GraphDataError(
            f"{what}: expected a non-empty name without '__', '/' or surrounding spaces, "
            f"got {name!r}"
        )


@dataclass
class TypedGraphData:
    """A typed node-classification graph before partitioning (see the module doc)."""

    #: Name of the graph (dataset name or preset), recorded in the partition manifest.
    name: str
    #: Node type to its number of nodes ``N_t`` (local IDs ``0 .. N_t-1``); the dict's
    #: order is the node-type order of the homogeneous view and of partition files.
    num_nodes: dict[str, int]
    #: Edge type ``(src, rel, dst)`` to ``[2, E_r]`` int64: row 0 local source IDs of type
    #: ``src``, row 1 local destination IDs of type ``dst``.
    edge_index: dict[EdgeType, np.ndarray]
    #: Node type to ``[N_t, F_t]`` float features; types without features are absent.
    x: dict[str, np.ndarray]
    #: The node type that carries labels and splits (``paper`` in ogbn-mag).
    target_type: str
    #: ``[N_target]`` int64 class labels of the target type; ``-1`` marks unlabeled nodes.
    y: np.ndarray
    #: Number of classes (labels lie in ``0 .. num_classes-1``).
    num_classes: int
    #: Split name (``train``/``val``/``test``) to int64 local IDs of target-type nodes.
    splits: dict[str, np.ndarray] = field(default_factory=dict)
    #: Edge type to ``[E_r]`` float32 positive weights, for the weighted relations.
    edge_weight: dict[EdgeType, np.ndarray] = field(default_factory=dict)
    #: Whether users see the graph typed (``HeteroData``, partition format v2); False for a
    #: plain graph's one-type view (``Data``, format v1).
    typed: bool = True
    #: Edge type to ``[E_r]`` or ``[E_r, F_r]`` edge features of any numeric dtype, aligned
    #: with that relation's ``edge_index``; relations without features are absent.
    edge_attr: dict[EdgeType, np.ndarray] = field(default_factory=dict)
    #: Link split name (``train``/``val``/``test``, ``val_neg`` ...) to its edges
    #: (:mod:`partitioner.links`); empty for a node-classification graph.
    link_splits: dict[str, LinkSplit] = field(default_factory=dict)
    #: Edge type to ``[E_r]`` int64 original IDs of its edges, aligned with its
    #: ``edge_index``, for the relations whose IDs are not their columns (see the module doc).
    edge_ids: dict[EdgeType, np.ndarray] = field(default_factory=dict)

    @property
    def node_types(self) -> tuple[str, ...]:
        return tuple(self.num_nodes)

    @property
    def edge_types(self) -> tuple[EdgeType, ...]:
        return tuple(self.edge_index)

    @property
    def total_nodes(self) -> int:
        return int(sum(self.num_nodes.values()))

    def num_edges(self, edge_type: EdgeType | None = None) -> int:
        """Edges of one type, or of all types when ``edge_type`` is None."""
        if edge_type is not None:
            return int(self.edge_index[edge_type].shape[1])
        return int(sum(ei.shape[1] for ei in self.edge_index.values()))

    def feature_dim(self, node_type: str) -> int:
        """``F_t`` of a node type; 0 for a type without features."""
        feats = self.x.get(node_type)
        return 0 if feats is None else int(feats.shape[1])

    def node_offsets(self) -> dict[str, int]:
        """Node type to the first ID of its block in the homogeneous view."""
        offsets, start = {}, 0
        for t, n in self.num_nodes.items():
            offsets[t] = start
            start += n
        return offsets

    def _name(self, what: str, key: object) -> str:
        """A field as errors name it: with its type in a typed graph (``x['paper']``)."""
        return f"{what}[{key!r}]" if self.typed else what

    def validate(self, check_values: bool = True) -> None:
        """Raise :class:`GraphDataError` naming the first malformed field.

        ``check_values`` also scans the arrays' values (ID ranges, labels, splits), which
        reads every edge once.
        """
        if not self.num_nodes:
            raise GraphDataError("num_nodes: expected at least one node type, got none")
        for t, n in self.num_nodes.items():
            _check_type_name("num_nodes", t)
            if not isinstance(n, int | np.integer) or n <= 0:
                raise GraphDataError(f"{self._name('num_nodes', t)}: expected a positive integer, got {n!r}")
        if self.target_type not in self.num_nodes:
            raise GraphDataError(
                f"target_type: expected one of the node types {list(self.num_nodes)}, "
                f"got {self.target_type!r}"
            )
        self._validate_edges()
        self._validate_features()
        self._validate_labels()
        for name, split in self.link_splits.items():
            split.check(name, self, check_values)
        if check_values:
            self._validate_values()

    def _validate_edges(self) -> None:
        if not self.edge_index:
            raise GraphDataError("edge_index: expected at least one edge type, got none")
        for et, ei in self.edge_index.items():
            if not isinstance(et, tuple) or len(et) != 3:
                raise GraphDataError(
                    f"edge_index: expected keys (src_type, relation, dst_type), got {et!r}"
                )
            _check_type_name(f"edge_index[{et!r}] relation", et[1])
            name = self._name("edge_index", et)
            for end in (et[0], et[2]):
                if end not in self.num_nodes:
                    raise GraphDataError(
                        f"{name}: expected node types among {list(self.num_nodes)}, got {end!r}"
                    )
            if ei.ndim != 2 or ei.shape[0] != 2:
                raise GraphDataError(f"{name}: expected shape [2, E], got {list(ei.shape)}")
            if ei.dtype != np.int64:
                raise GraphDataError(f"{name}: expected dtype int64, got {ei.dtype}")
        for field_name, arrays, dtype in (("edge_weight", self.edge_weight, np.float32),
                                          ("edge_ids", self.edge_ids, np.int64),
                                          ("edge_attr", self.edge_attr, None)):
            for et, a in arrays.items():
                if et not in self.edge_index:
                    raise GraphDataError(f"{field_name}: expected edge types among "
                                         f"{list(self.edge_index)}, got {et!r}")
                e, name = self.num_edges(et), self._name(field_name, et)
                if dtype is None and (a.ndim not in (1, 2) or a.shape[0] != e
                                      or a.dtype.kind not in _EDGE_ATTR_KINDS):
                    raise GraphDataError(f"{name}: expected numbers of shape [{e}] or [{e}, F] (one row per "
                                         f"edge), got {a.dtype} of shape {list(a.shape)}")
                if dtype is not None and (a.shape != (e,) or a.dtype != dtype):
                    raise GraphDataError(f"{name}: expected {np.dtype(dtype)} of shape [{e}], got {a.dtype} "
                                         f"of shape {list(a.shape)}")

    def _validate_features(self) -> None:
        for t, feats in self.x.items():
            if t not in self.num_nodes:
                raise GraphDataError(
                    f"x: expected node types among {list(self.num_nodes)}, got {t!r}"
                )
            n = self.num_nodes[t]
            if feats.ndim != 2 or feats.shape[0] != n:
                raise GraphDataError(
                    f"{self._name('x', t)}: expected shape [{n}, F], got {list(feats.shape)}"
                )
            if feats.dtype not in _FLOAT_DTYPES:
                raise GraphDataError(f"{self._name('x', t)}: expected a float dtype, got {feats.dtype}")

    def _validate_labels(self) -> None:
        n = self.num_nodes[self.target_type]
        if self.y.shape != (n,) or self.y.dtype != np.int64:
            per = f" (one label per {self.target_type!r} node)" if self.typed else ""
            raise GraphDataError(f"y: expected int64 of shape [{n}]{per}, got {self.y.dtype} of "
                                 f"shape {list(self.y.shape)}")
        if self.num_classes <= 0:
            raise GraphDataError(f"num_classes: expected a positive integer, got {self.num_classes}")
        for name, idx in self.splits.items():
            if name not in SPLITS:
                raise GraphDataError(f"splits: expected names among {SPLITS}, got {name!r}")
            if idx.ndim != 1 or idx.dtype != np.int64:
                raise GraphDataError(
                    f"splits[{name!r}]: expected 1-D int64, got {idx.dtype} of shape {list(idx.shape)}"
                )

    def _validate_values(self) -> None:
        for et, ei in self.edge_index.items():
            if not ei.shape[1]:
                continue
            ranges = _id_ranges(ei)
            for row, t in ((0, et[0]), (1, et[2])):
                (lo, hi), n = ranges[row], self.num_nodes[t]
                if lo < 0 or hi >= n:
                    what = f"{('source', 'destination')[row]} IDs of {t!r}" if self.typed else "node IDs"
                    raise GraphDataError(f"{self._name('edge_index', et)}: expected {what} in "
                                         f"[0, {n}), got values in [{lo}, {hi}]")
        y, n = self.y, self.num_nodes[self.target_type]
        if y.size and (int(y.min()) < -1 or int(y.max()) >= self.num_classes):
            raise GraphDataError(
                f"y: expected labels in [-1, {self.num_classes}), "
                f"got values in [{int(y.min())}, {int(y.max())}]"
            )
        for name, idx in self.splits.items():
            if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
                what = f"{self.target_type!r} IDs" if self.typed else "node IDs"
                raise GraphDataError(f"splits[{name!r}]: expected {what} in [0, {n}), got "
                                     f"values in [{int(idx.min())}, {int(idx.max())}]")
            if sorted_unique(idx).size != idx.size:
                raise GraphDataError(f"splits[{name!r}]: node IDs repeat")
        for et, ids in self.edge_ids.items():
            if ids.size and int(ids.min()) < 0:
                raise GraphDataError(f"{self._name('edge_ids', et)}: expected IDs >= 0, got {int(ids.min())}")
        for et, w in self.edge_weight.items():
            if w.size and not bool((w > 0).all()):
                raise GraphDataError(f"{self._name('edge_weight', et)}: expected positive weights")

    def add_reverse(self) -> TypedGraphData:
        """A copy with reverse edges, as PyG's ``ToUndirected`` does for ogbn-mag.

        A relation between two types ``(s, r, d)`` gains ``(d, rev_r, s)``, whose edge ``i``
        is the reverse of edge ``i`` of ``(s, r, d)``; a relation within one type (``paper
        cites paper``) gets every edge's reverse added to it and repeated edges dropped
        (:func:`make_undirected`). Relations whose reverse is already present are kept as
        they are. Arrays of the input are shared, not copied, where unchanged. Edge weights
        and edge features follow their edges (a reverse copies its edge's; a repeated edge
        keeps its first occurrence's).
        """
        edges: dict[EdgeType, np.ndarray] = {}
        per_edge: dict[str, dict[EdgeType, np.ndarray]] = {"edge_weight": {}, "edge_attr": {}, "edge_ids": {}}
        given = {"edge_weight": self.edge_weight, "edge_attr": self.edge_attr, "edge_ids": self.edge_ids}
        for (s, r, d), ei in self.edge_index.items():
            et, take = (s, r, d), None
            if s == d and not any(et in arrays for arrays in given.values()):
                edges[et] = make_undirected(ei, self.num_nodes[s])[0]
            elif s == d:
                edges[et], take = undirected_columns(ei, self.num_nodes[s])
            else:
                edges[et] = ei
            for kind, arrays in given.items():  # each edge's rows follow it
                if et in arrays:
                    per_edge[kind][et] = arrays[et] if take is None else np.asarray(arrays[et])[take]
        for (s, r, d), ei in self.edge_index.items():
            rev = (d, REVERSE_PREFIX + r, s)
            has_reverse = r.startswith(REVERSE_PREFIX) and (d, r[len(REVERSE_PREFIX):], s) in edges
            if s == d or rev in edges or has_reverse:
                continue
            edges[rev] = np.ascontiguousarray(ei[::-1])
            for kind, arrays in given.items():
                if (s, r, d) in arrays:
                    per_edge[kind][rev] = arrays[(s, r, d)]
        log.info("added reverse relations: %d -> %d edge types, %d -> %d edges",
                 len(self.edge_index), len(edges), self.num_edges(),
                 sum(e.shape[1] for e in edges.values()))
        return TypedGraphData(
            name=self.name, num_nodes=dict(self.num_nodes), edge_index=edges, x=dict(self.x),
            target_type=self.target_type, y=self.y, num_classes=self.num_classes,
            splits=dict(self.splits), edge_weight=per_edge["edge_weight"],
            edge_attr=per_edge["edge_attr"], link_splits=dict(self.link_splits),
            edge_ids=per_edge["edge_ids"],
        )

    def to_homogeneous(self) -> GraphData:
        """The homogeneous view METIS partitions: global ID = type offset + local ID.

        Edges of all types are concatenated in :attr:`edge_types` order; ``x`` has zero
        columns (features stay typed); ``y`` and the splits are those of the target type
        shifted by its offset, ``-1`` elsewhere.
        """
        offsets = self.node_offsets()
        total = self.total_nodes
        edge_index = np.empty((2, self.num_edges()), dtype=np.int64)
        pos = 0
        for (s, _r, d), ei in self.edge_index.items():
            e = int(ei.shape[1])
            np.add(ei[0], offsets[s], out=edge_index[0, pos:pos + e])
            np.add(ei[1], offsets[d], out=edge_index[1, pos:pos + e])
            pos += e
        y = np.full(total, -1, dtype=np.int64)
        off = offsets[self.target_type]
        y[off:off + self.num_nodes[self.target_type]] = self.y
        return GraphData(
            name=self.name, num_nodes=total, edge_index=edge_index,
            x=np.zeros((total, 0), dtype=np.float32), y=y, num_classes=self.num_classes,
            splits={k: np.asarray(v, dtype=np.int64) + off for k, v in self.splits.items()},
        )

    def summary(self) -> str:
        """One line per node type and per edge type."""
        lines = [f"{self.name}: {len(self.num_nodes)} node types, {len(self.edge_index)} "
                 f"edge types, target {self.target_type!r} ({self.num_classes} classes)"]
        for t, n in self.num_nodes.items():
            lines.append(f"  node {t}: {n:,} nodes, {self.feature_dim(t)} features")
        for et in self.edge_index:
            attr = self.edge_attr.get(et)
            feats = "" if attr is None else f", edge features {list(attr.shape[1:])} {attr.dtype}"
            lines.append(f"  edge {'/'.join(et)}: {self.num_edges(et):,} edges{feats}")
        return "\n".join(lines)


def _id_ranges(edge_index: np.ndarray) -> list[tuple[int, int]]:
    """Smallest and largest ID of each row of non-empty ``[2, E]`` edges, read in chunks
    (``pread`` for a memory map, whose pages then never count towards the process's
    resident memory)."""
    ranges: list[tuple[int, int]] = []
    for _, src, dst in iter_edge_chunks(edge_index, 1 << 24):
        found = [(int(ids.min()), int(ids.max())) for ids in (src, dst)]
        ranges = found if not ranges else [(min(a, c), max(b, d))
                                           for (a, b), (c, d) in zip(ranges, found, strict=True)]
    return ranges


def make_undirected(edge_index: np.ndarray, num_nodes: int, weight: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray | None]:
    """``edge_index`` with every edge's reverse added and repeats dropped, as ``[2, E']``
    int64 sorted by (source, target) (self-loops kept once); with ``weight`` (``[E]``),
    also the weight of each kept edge (its first occurrence's, a reverse taking its edge's).
    Other per-edge arrays follow with :func:`undirected_columns`."""
    if weight is None and num_nodes <= _MAX_KEYED_NODES:  # the cheap path: sort keys, no permutation
        both = np.concatenate([edge_index, edge_index[::-1]], axis=1).astype(np.int64, copy=False)
        keys = sorted_unique(both[0] * np.int64(num_nodes) + both[1])
        return np.stack([keys // num_nodes, keys % num_nodes]), None
    edges, take = undirected_columns(edge_index, num_nodes)
    return edges, None if weight is None else np.asarray(weight)[take]


#: Largest node count whose (source, target) pairs fit one int64 key.
_MAX_KEYED_NODES = 3_037_000_499


def undirected_columns(edge_index: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`make_undirected`'s edges and, for each, the column of ``edge_index`` it comes
    from (``[E']`` int64 in ``0 .. E-1``): the first occurrence of the edge among the
    edges followed by their reverses, so a reverse points at its edge. A per-edge array
    ``a`` (weights, features) of the input is ``a[columns]`` on the output."""
    e = int(edge_index.shape[1])
    both = np.concatenate([edge_index, edge_index[::-1]], axis=1).astype(np.int64, copy=False)
    if num_nodes > _MAX_KEYED_NODES:  # num_nodes**2 overflows int64: unique columns instead of keys
        edges, first = np.unique(both, axis=1, return_index=True)
        edges = np.ascontiguousarray(edges)
    else:
        keys, first = np.unique(both[0] * np.int64(num_nodes) + both[1], return_index=True)
        edges = np.stack([keys // num_nodes, keys % num_nodes])
    columns = np.asarray(first, dtype=np.int64)
    if e:
        columns %= e
    return edges, columns
