"""The facts of the graph a trainer works on, one class for both kinds of graph.

A typed graph has node types and edge types ``(src, rel, dst)``; a plain graph is a
typed graph of one node type and one edge type, :data:`PLAIN_NODE_TYPE` and
:data:`PLAIN_EDGE_TYPE` (DGL's names for them), which differs only in its wire names
(``n_id`` rather than ``n_id/<type>``, ``ClusterInfo``'s untyped fields) and in what the
user gets: the ``Data`` PyG's ``NeighborLoader`` yields (:func:`to_plain_data`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch_geometric.data import Data, HeteroData

from partitioner.graph import PLAIN_EDGE_TYPE, PLAIN_NODE_TYPE, EdgeType, edge_type_name, parse_edge_type
from protos import codec
from protos import sampling_pb2 as pb


@dataclass(frozen=True)
class LinkSplitFacts:
    """What the servers say of one link split (``ClusterInfo.link_splits``)."""

    #: The relation its edges belong to (:data:`PLAIN_EDGE_TYPE` on a plain graph).
    edge_type: EdgeType
    #: Number of edges.
    num_edges: int
    #: Given negative destinations per edge (0: none stored).
    num_negatives: int
    #: Shape of one edge's label (``()``: one value per edge).
    label_shape: tuple[int, ...]
    #: The labels' dtype; None: the split has no labels.
    label_dtype: torch.dtype | None

    @staticmethod
    def from_info(info: pb.LinkSplitInfo) -> LinkSplitFacts:
        """Parse one ``LinkSplitInfo`` (edge type "" on a plain graph)."""
        return LinkSplitFacts(
            edge_type=parse_edge_type(info.edge_type) if info.edge_type else PLAIN_EDGE_TYPE,
            num_edges=int(info.num_edges), num_negatives=int(info.num_negatives),
            label_shape=tuple(int(d) for d in info.label_shape),
            label_dtype=None if info.label_dtype == pb.DTYPE_UNSPECIFIED
            else codec.dtype_to_torch(info.label_dtype))


@dataclass(frozen=True)
class TypedGraph:
    """The facts of a graph: its types, sizes and partition books (a plain graph as one
    node type and one edge type, ``typed`` False)."""

    #: Node types, in the graph's order.
    node_types: tuple[str, ...]
    #: Edge types ``(src, rel, dst)``, in the graph's order.
    edge_types: tuple[EdgeType, ...]
    #: The labelled node type (its splits are the loader's ``"train"``, ...).
    target_type: str
    #: Nodes per type (``n_id`` of a type lies in ``0 .. num_nodes[t]-1``).
    num_nodes: dict[str, int]
    #: Feature columns per type; 0 for featureless types (their batches carry ``n_id``
    #: only: index a learnable embedding with it).
    feature_dims: dict[str, int]
    #: Number of classes of the target type's labels.
    num_classes: int
    #: Node type to its partition book (partition ``p`` owns global IDs ``book[p] ..
    #: book[p+1]-1`` of the type); empty where the graph is not partitioned for this job.
    books: dict[str, np.ndarray] = field(default_factory=dict, compare=False)
    #: Node type to the stored feature dtype (a ``DType`` value).
    feature_dtypes: dict[str, int] = field(default_factory=dict)
    #: Whether the graph is typed; False for a plain graph (one node and one edge type,
    #: whose tensors and fields on the wire carry no type).
    typed: bool = True
    #: The graph's name.
    name: str = ""
    #: What tells this graph from any other: the SHA-256 of its partitioning's manifest
    #: (``ClusterInfo.graph_fingerprint``); "" when unknown.
    fingerprint: str = ""
    #: Whether batches can carry the sampled edges' original IDs and features
    #: (``ClusterInfo.has_edge_ids``: partitions written with edge IDs).
    has_edge_ids: bool = False
    #: Edge type to the shape of one edge's feature row (``()``: one value per edge), for
    #: the edge types with edge features.
    edge_feature_shapes: dict[EdgeType, tuple[int, ...]] = field(default_factory=dict)
    #: Edge type to its stored edge features' dtype (a ``DType`` value).
    edge_feature_dtypes: dict[EdgeType, int] = field(default_factory=dict)
    #: Link split name (``train``, ``val``, ``test``, ``val_neg`` ...) to its facts; empty
    #: for a graph without link splits.
    link_splits: dict[str, LinkSplitFacts] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.target_type not in self.node_types:
            raise ValueError(f"target_type: expected one of {list(self.node_types)}, got "
                             f"{self.target_type!r}")
        for et in self.edge_types:
            if et[0] not in self.node_types or et[2] not in self.node_types:
                raise ValueError(f"edge_types: {et!r} joins node types not among {list(self.node_types)}")
        for name, facts in self.link_splits.items():
            if facts.edge_type not in self.edge_types:
                raise ValueError(f"link_splits[{name!r}].edge_type: expected one of "
                                 f"{list(self.edge_types)}, got {facts.edge_type!r}")

    @staticmethod
    def from_info(info: pb.ClusterInfo) -> TypedGraph:
        """The graph the servers serve (``ClusterInfo``; ``typed`` absent: a plain graph)."""
        typed = info.HasField("typed")
        # a plain graph's one node type has ClusterInfo's own fields (num_nodes, feature_dim ...)
        types: dict[str, pb.NodeTypeInfo | pb.ClusterInfo] = \
            {n.name: n for n in info.typed.node_types} if typed else {PLAIN_NODE_TYPE: info}
        edge_infos: dict[EdgeType, pb.EdgeFeatureInfo] = \
            {(e.src, e.rel, e.dst): e.edge_features for e in info.typed.edge_types
             if e.HasField("edge_features")} if typed else \
            {PLAIN_EDGE_TYPE: info.edge_features} if info.HasField("edge_features") else {}
        return TypedGraph(
            node_types=tuple(types), target_type=info.typed.target_type if typed else PLAIN_NODE_TYPE,
            edge_types=tuple((e.src, e.rel, e.dst) for e in info.typed.edge_types) if typed else
            (PLAIN_EDGE_TYPE,),
            num_nodes={t: int(n.num_nodes) for t, n in types.items()},
            feature_dims={t: int(n.feature_dim) for t, n in types.items()},
            books={t: np.asarray(n.partition_book, dtype=np.int64) for t, n in types.items()},
            feature_dtypes={t: int(n.feature_dtype) for t, n in types.items()},
            num_classes=int(info.num_classes), typed=typed, name=info.graph_name,
            fingerprint=info.graph_fingerprint, has_edge_ids=info.has_edge_ids,
            edge_feature_shapes={et: tuple(int(d) for d in f.shape) for et, f in edge_infos.items()},
            edge_feature_dtypes={et: int(f.dtype) for et, f in edge_infos.items()},
            link_splits={ls.name: LinkSplitFacts.from_info(ls) for ls in info.link_splits})

    def metadata(self) -> tuple[list[str], list[EdgeType]]:
        """``(node_types, edge_types)``, as PyG's ``HeteroData.metadata()`` (for ``to_hetero``)."""
        return list(self.node_types), list(self.edge_types)

    def to_json(self) -> dict[str, object]:
        """The types and sizes as plain values (what a typed model is built from)."""
        return {"node_types": list(self.node_types),
                "edge_types": [edge_type_name(et) for et in self.edge_types],
                "num_nodes": dict(self.num_nodes), "feature_dims": dict(self.feature_dims),
                "target_type": self.target_type, "num_classes": self.num_classes}

    def identity(self) -> dict[str, str]:
        """Which graph this is, as plain values (a checkpoint records it)."""
        return {"name": self.name, "fingerprint": self.fingerprint}

    def wire_type(self, node_type: str) -> str:
        """``node_type`` as requests name it ("": a plain graph's untyped fields)."""
        return node_type if self.typed else ""

    def of_type(self, node_type: str) -> str:
        """" of 'paper'" in messages ("" on a plain graph)."""
        return f" of {node_type!r}" if self.typed else ""

    @property
    def featured_nodes(self) -> int:
        """Nodes of the types with features (each needs a slot in a feature cache's index)."""
        return sum(n for t, n in self.num_nodes.items() if self.feature_dims.get(t, 0) > 0)


def to_plain_data(batch: HeteroData) -> Data:
    """A batch of a graph of one node type and one edge type (a plain graph's, as every
    step below the loader builds it) as the ``Data`` PyG's ``NeighborLoader`` yields: the
    node type's attributes (``x``, ``y``, ``n_id``, ``num_nodes``, ``batch_size``,
    ``input_id``, ``num_sampled_nodes`` ...) and the edge type's (``edge_index``,
    ``num_sampled_edges`` ...) become the ``Data``'s own; the tensors are not copied."""
    if len(batch.node_types) != 1 or len(batch.edge_types) != 1:
        raise ValueError(f"batch: expected one node type and one edge type (a plain graph's), got "
                         f"{batch.node_types} and {batch.edge_types}")
    data = Data()
    for store in (batch[batch.node_types[0]], batch[batch.edge_types[0]]):
        for key, value in store.items():
            data[key] = value
    return data
