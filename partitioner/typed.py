"""Typed node-classification graphs: typed nodes, typed relations; the one graph model
the partition writer takes.

A :class:`TypedGraphData` has node types with per-type counts, relations
``(src_type, relation, dst_type)`` whose edges use per-type **local** IDs, features per
node type (some types may have none, as in ogbn-mag where only papers do), optional edge
weights per relation, and labels and splits on one target node type. A plain
:class:`~partitioner.graph.GraphData` is the typed graph of one node type and one edge
type (:func:`plain_view`, ``typed=False``).

Its homogeneous view numbers nodes type after type (global ID = the type's offset + local
ID, types in :attr:`TypedGraphData.node_types` order); METIS partitions that view.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from partitioner.graph import (
    PLAIN_EDGE_TYPE,
    PLAIN_NODE_TYPE,
    EdgeType,
    GraphData,
    GraphDataError,
    check_classes_and_splits,
    edge_type_name,
    parse_edge_type,
    sorted_unique,
)

__all__ = ["REVERSE_PREFIX", "EdgeType", "TypedGraphData", "edge_type_name", "parse_edge_type", "plain_view"]

log = logging.getLogger(__name__)

#: Prefix of the relations :meth:`TypedGraphData.add_reverse` adds (as PyG's ``ToUndirected``).
REVERSE_PREFIX = "rev_"

_FLOAT_DTYPES = (np.float16, np.float32, np.float64)


def plain_view(graph: GraphData) -> TypedGraphData:
    """A plain graph as the typed graph of one node type and one edge type
    (:data:`~partitioner.graph.PLAIN_NODE_TYPE`, :data:`~partitioner.graph.PLAIN_EDGE_TYPE`;
    ``typed=False``), sharing its arrays (memory maps stay memory maps)."""
    t, et = PLAIN_NODE_TYPE, PLAIN_EDGE_TYPE
    return TypedGraphData(
        name=graph.name, num_nodes={t: graph.num_nodes}, edge_index={et: graph.edge_index},
        x={t: graph.x}, target_type=t, y=graph.y, num_classes=graph.num_classes,
        splits=dict(graph.splits),
        edge_weight={} if graph.edge_weight is None else {et: graph.edge_weight}, typed=False)


def _check_type_name(what: str, name: str) -> None:
    if not name or "__" in name or "/" in name or name != name.strip():
        raise GraphDataError(
            f"{what}: expected a non-empty name without '__', '/' or surrounding spaces, "
            f"got {name!r}"
        )


@dataclass
class TypedGraphData:
    """A typed node-classification graph before partitioning.

    Arrays may be ``np.memmap`` views; nothing here copies them.
    """

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

    def validate(self, check_values: bool = True) -> None:
        """Raise :class:`GraphDataError` naming the first malformed field.

        ``check_values`` also scans the arrays' values (ID ranges, labels, splits).
        """
        if not self.num_nodes:
            raise GraphDataError("num_nodes: expected at least one node type, got none")
        for t, n in self.num_nodes.items():
            _check_type_name("num_nodes", t)
            if not isinstance(n, int | np.integer) or n <= 0:
                raise GraphDataError(f"num_nodes[{t!r}]: expected a positive integer, got {n!r}")
        if self.target_type not in self.num_nodes:
            raise GraphDataError(
                f"target_type: expected one of the node types {list(self.num_nodes)}, "
                f"got {self.target_type!r}"
            )
        self._validate_edges()
        self._validate_features()
        self._validate_labels()
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
            for end in (et[0], et[2]):
                if end not in self.num_nodes:
                    raise GraphDataError(
                        f"edge_index[{et!r}]: expected node types among {list(self.num_nodes)}, "
                        f"got {end!r}"
                    )
            if ei.ndim != 2 or ei.shape[0] != 2:
                raise GraphDataError(
                    f"edge_index[{et!r}]: expected shape [2, E], got {list(ei.shape)}"
                )
            if ei.dtype != np.int64:
                raise GraphDataError(f"edge_index[{et!r}]: expected dtype int64, got {ei.dtype}")
        for et, w in self.edge_weight.items():
            if et not in self.edge_index:
                raise GraphDataError(f"edge_weight: expected edge types among "
                                     f"{list(self.edge_index)}, got {et!r}")
            if w.shape != (self.num_edges(et),) or w.dtype != np.float32:
                raise GraphDataError(f"edge_weight[{et!r}]: expected float32 of shape "
                                     f"[{self.num_edges(et)}], got {w.dtype} of shape {list(w.shape)}")

    def _validate_features(self) -> None:
        for t, feats in self.x.items():
            if t not in self.num_nodes:
                raise GraphDataError(
                    f"x: expected node types among {list(self.num_nodes)}, got {t!r}"
                )
            n = self.num_nodes[t]
            if feats.ndim != 2 or feats.shape[0] != n:
                raise GraphDataError(
                    f"x[{t!r}]: expected shape [{n}, F], got {list(feats.shape)}"
                )
            if feats.dtype not in _FLOAT_DTYPES:
                raise GraphDataError(f"x[{t!r}]: expected a float dtype, got {feats.dtype}")

    def _validate_labels(self) -> None:
        n = self.num_nodes[self.target_type]
        if self.y.shape != (n,) or self.y.dtype != np.int64:
            raise GraphDataError(
                f"y: expected int64 of shape [{n}] (one label per {self.target_type!r} node), "
                f"got {self.y.dtype} of shape {list(self.y.shape)}"
            )
        check_classes_and_splits(self.num_classes, self.splits)

    def _validate_values(self) -> None:
        for (s, r, d), ei in self.edge_index.items():
            if not ei.shape[1]:
                continue
            for row, t in ((0, s), (1, d)):
                lo, hi, n = int(ei[row].min()), int(ei[row].max()), self.num_nodes[t]
                if lo < 0 or hi >= n:
                    end = "source" if row == 0 else "destination"
                    raise GraphDataError(
                        f"edge_index[{(s, r, d)!r}]: expected {end} IDs of {t!r} in [0, {n}), "
                        f"got values in [{lo}, {hi}]"
                    )
        y, n = self.y, self.num_nodes[self.target_type]
        if y.size and (int(y.min()) < -1 or int(y.max()) >= self.num_classes):
            raise GraphDataError(
                f"y: expected labels in [-1, {self.num_classes}), "
                f"got values in [{int(y.min())}, {int(y.max())}]"
            )
        for name, idx in self.splits.items():
            if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
                raise GraphDataError(
                    f"splits[{name!r}]: expected {self.target_type!r} IDs in [0, {n}), got "
                    f"values in [{int(idx.min())}, {int(idx.max())}]"
                )
            if sorted_unique(idx).size != idx.size:
                raise GraphDataError(f"splits[{name!r}]: node IDs repeat")
        for et, w in self.edge_weight.items():
            if w.size and not bool((w > 0).all()):
                raise GraphDataError(f"edge_weight[{et!r}]: expected positive weights")

    def add_reverse(self) -> TypedGraphData:
        """A copy with reverse edges, as PyG's ``ToUndirected`` does for ogbn-mag.

        A relation between two types ``(s, r, d)`` gains ``(d, rev_r, s)``; a relation
        within one type (``paper cites paper``) gets every edge's reverse added to it and
        repeated edges dropped. Relations whose reverse is already present are kept as
        they are. Arrays of the input are shared, not copied, where unchanged. Edge weights
        follow their edges (a repeated edge keeps its first weight).
        """
        edges: dict[EdgeType, np.ndarray] = {}
        weights: dict[EdgeType, np.ndarray] = {}
        for (s, r, d), ei in self.edge_index.items():
            w = self.edge_weight.get((s, r, d))
            if s == d:
                edges[(s, r, d)], kept = _symmetric(ei, self.num_nodes[s], w is not None)
                if w is not None and kept is not None:
                    weights[(s, r, d)] = np.concatenate([w, w])[kept]
            else:
                edges[(s, r, d)] = ei
                if w is not None:
                    weights[(s, r, d)] = w
        for (s, r, d), ei in self.edge_index.items():
            rev = (d, REVERSE_PREFIX + r, s)
            has_reverse = r.startswith(REVERSE_PREFIX) and (d, r[len(REVERSE_PREFIX):], s) in edges
            if s == d or rev in edges or has_reverse:
                continue
            edges[rev] = np.ascontiguousarray(ei[::-1])
            if (s, r, d) in self.edge_weight:
                weights[rev] = self.edge_weight[(s, r, d)]
        log.info("added reverse relations: %d -> %d edge types, %d -> %d edges",
                 len(self.edge_index), len(edges), self.num_edges(),
                 sum(e.shape[1] for e in edges.values()))
        return TypedGraphData(
            name=self.name, num_nodes=dict(self.num_nodes), edge_index=edges, x=dict(self.x),
            target_type=self.target_type, y=self.y, num_classes=self.num_classes,
            splits=dict(self.splits), edge_weight=weights,
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
            lines.append(f"  edge {'/'.join(et)}: {self.num_edges(et):,} edges")
        return "\n".join(lines)


def _symmetric(edge_index: np.ndarray, num_nodes: int,
               positions: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Edges plus their reverses, repeats dropped, sorted by (source, target); with
    ``positions``, also the position of each kept edge among the edges followed by their
    reverses (its first occurrence; for carrying edge weights along)."""
    both = np.concatenate([edge_index, edge_index[::-1]], axis=1)
    all_keys = both[0] * np.int64(num_nodes) + both[1]
    first = None
    if positions:
        keys, first = np.unique(all_keys, return_index=True)
    else:
        keys = sorted_unique(all_keys)
    return np.stack([keys // num_nodes, keys % num_nodes]), first
