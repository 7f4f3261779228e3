"""One loaded partition (:func:`~partitioner.format.load_partition`), plain or typed, and
the :class:`Structure`, :class:`NodeData` and :class:`EdgeData` a sampler draws and
gathers from: a partition's own, or every partition's joined (:mod:`partitioner.joins`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from partitioner.graph import EdgeType
from partitioner.manifest import Manifest


@dataclass(frozen=True)
class Structure:
    """In-edges (CSC per edge type) of one contiguous range of global IDs per node type:
    the nodes a sampler can draw from without asking another server. A partition's own
    ranges (:attr:`Partition.structure`), or every node of the graph
    (:func:`~partitioner.joins.load_structure`)."""

    #: Edge type to int64 ``[n_dst+1]`` CSC offsets over its destination type's range.
    indptr: dict[EdgeType, np.ndarray]
    #: Edge type to int64 ``[e]`` global source IDs (of the source type) of the in-edges.
    indices: dict[EdgeType, np.ndarray]
    #: Node type to int64 ``[n_t]`` original IDs of its range (draws are keyed by them).
    orig_ids: dict[str, np.ndarray]
    #: Node type to the global ID of the first node of its range.
    node_start: dict[str, int]
    #: Edge type to float32 ``[e]`` edge weights aligned with ``indices`` (weighted types only).
    edge_weight: dict[EdgeType, np.ndarray] = field(default_factory=dict)
    #: Edge type to the internal edge ID of its first in-edge held here (the position in
    #: ``indices`` plus this is the edge's internal ID, :meth:`Manifest.edge_book`); 0 if absent.
    edge_start: dict[EdgeType, int] = field(default_factory=dict)

    def node_range(self, node_type: str) -> tuple[int, int]:
        """``[start, stop)`` of the global IDs of ``node_type`` whose in-edges this holds."""
        start = self.node_start[node_type]
        return start, start + int(self.orig_ids[node_type].shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (memory maps included)."""
        arrays = [*self.indptr.values(), *self.indices.values(), *self.orig_ids.values(),
                  *self.edge_weight.values()]
        return sum(int(a.nbytes) for a in arrays)


@dataclass(frozen=True)
class NodeData:
    """Features and labels of one contiguous range of global IDs per node type: the rows
    a server gathers without asking another. A partition's own (:attr:`Partition.node_data`),
    or every node's (:func:`~partitioner.joins.load_node_data`)."""

    #: Node type to ``[n_t, F_t]`` features of its range (types with features only).
    x: dict[str, np.ndarray]
    #: int64 ``[n_target]`` labels of the target type's range, ``-1`` = unlabeled.
    y: np.ndarray
    #: Node type to the global ID of the first node of its range.
    node_start: dict[str, int]
    #: Node type to the number of nodes of its range.
    num_nodes: dict[str, int]
    #: The labelled node type.
    target_type: str

    def node_range(self, node_type: str) -> tuple[int, int]:
        """``[start, stop)`` of the global IDs of ``node_type`` whose rows this holds."""
        start = self.node_start[node_type]
        return start, start + self.num_nodes[node_type]

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (memory maps included)."""
        return sum(int(a.nbytes) for a in self.x.values()) + int(self.y.nbytes)


@dataclass(frozen=True)
class EdgeData:
    """Original edge IDs and edge features of one contiguous range of internal edge IDs
    per edge type (:meth:`Manifest.edge_book`): the edge rows a server gathers without
    asking another. A partition's own (:attr:`Partition.edge_data`), or every edge's
    (:func:`~partitioner.joins.load_edge_data`)."""

    #: Edge type to int64 ``[e]`` original edge IDs (the edge's column in the input's
    #: ``edge_index`` of its type), in internal-ID order.
    e_id: dict[EdgeType, np.ndarray]
    #: Edge type to ``[e, *F_e]`` edge features in internal-ID order (types with them only).
    edge_attr: dict[EdgeType, np.ndarray]
    #: Edge type to the internal ID of the range's first edge.
    edge_start: dict[EdgeType, int]

    def edge_range(self, edge_type: EdgeType) -> tuple[int, int]:
        """``[start, stop)`` of the internal edge IDs of ``edge_type`` held here."""
        start = self.edge_start[edge_type]
        return start, start + int(self.e_id[edge_type].shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (memory maps included)."""
        return sum(int(a.nbytes) for a in [*self.e_id.values(), *self.edge_attr.values()])


@dataclass
class Partition:
    """One loaded partition of a graph (see the module doc)."""

    #: The whole manifest (graph facts, partition books, every partition's sizes).
    manifest: Manifest
    #: This partition's ID ``p``.
    partition_id: int
    #: Node type to its int64 ``[P+1]`` offsets.
    partition_book: dict[str, np.ndarray]
    #: Edge type to int64 ``[n_pd+1]`` CSC offsets over the owned destination nodes.
    indptr: dict[EdgeType, np.ndarray]
    #: Edge type to int64 ``[e_pr]`` global source IDs (of the source type).
    indices: dict[EdgeType, np.ndarray]
    #: Node type to ``[n_pt, F_t]`` features of the owned nodes (types with features only).
    x: dict[str, np.ndarray]
    #: Node type to int64 ``[n_pt]`` original IDs of the owned nodes.
    orig_ids: dict[str, np.ndarray]
    #: int64 ``[n_p,target]`` labels of the owned target nodes, ``-1`` = unlabeled.
    y: np.ndarray
    #: Split name to the int64 global IDs of the owned target nodes in it.
    splits: dict[str, np.ndarray]
    #: Edge type to float32 ``[e_pr]`` edge weights aligned with ``indices`` (weighted types).
    edge_weight: dict[EdgeType, np.ndarray] = field(default_factory=dict)
    #: Edge type to int64 ``[e_pr]`` original edge IDs aligned with ``indices`` (empty for
    #: partitions written without them).
    e_id: dict[EdgeType, np.ndarray] = field(default_factory=dict)
    #: Edge type to ``[e_pr, *F_e]`` edge features aligned with ``indices`` (types with them).
    edge_attr: dict[EdgeType, np.ndarray] = field(default_factory=dict)

    @property
    def target_type(self) -> str:
        return self.manifest.target_type

    @property
    def node_types(self) -> tuple[str, ...]:
        return tuple(self.manifest.node_types)

    @property
    def edge_types(self) -> tuple[EdgeType, ...]:
        return tuple(self.manifest.edge_types)

    def node_range(self, node_type: str) -> tuple[int, int]:
        """``[start, stop)`` of the global IDs of ``node_type`` this partition owns."""
        book, p = self.partition_book[node_type], self.partition_id
        return int(book[p]), int(book[p + 1])

    def num_nodes(self, node_type: str) -> int:
        start, stop = self.node_range(node_type)
        return stop - start

    def num_edges(self, edge_type: EdgeType) -> int:
        return int(self.indices[edge_type].shape[0])

    @property
    def structure(self) -> Structure:
        """The in-edges of the owned nodes, as a :class:`Structure`."""
        return Structure(indptr=self.indptr, indices=self.indices, orig_ids=self.orig_ids,
                         node_start={t: self.node_range(t)[0] for t in self.node_types},
                         edge_weight=self.edge_weight, edge_start=self.edge_start)

    @property
    def edge_start(self) -> dict[EdgeType, int]:
        """Edge type to the internal ID of this partition's first in-edge of it."""
        return {et: self.manifest.edge_book(et)[self.partition_id] for et in self.edge_types}

    @property
    def edge_data(self) -> EdgeData:
        """The original IDs and features of this partition's in-edges, as an :class:`EdgeData`."""
        return EdgeData(e_id=self.e_id, edge_attr=self.edge_attr, edge_start=self.edge_start)

    @property
    def node_data(self) -> NodeData:
        """The features and labels of the owned nodes, as a :class:`NodeData`."""
        return NodeData(x=self.x, y=self.y, node_start={t: self.node_range(t)[0] for t in self.node_types},
                        num_nodes={t: self.num_nodes(t) for t in self.node_types},
                        target_type=self.target_type)
