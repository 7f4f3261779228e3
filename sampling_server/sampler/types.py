"""Typed hand-offs between the sampling stages (one model for plain and typed graphs: a
plain graph's batch has one node type and one edge type)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from partitioner.graph import EdgeType


@dataclass
class HopSample:
    """Neighbors drawn for one frontier: ``counts[i]`` neighbors of ``nodes[i]``, listed in
    ``neighbors`` node after node."""

    #: int64 ``[F]`` neighbors drawn per frontier node.
    counts: torch.Tensor
    #: int64 ``[sum(counts)]`` global IDs of the drawn in-neighbors (of the source type).
    neighbors: torch.Tensor
    #: int64 ``[sum(counts)]`` internal edge IDs of the drawn edges (aligned with
    #: ``neighbors``), when edges were asked for; else None.
    edges: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    """The structure of one minibatch, numbered as PyG's ``NeighborLoader`` numbers it:
    nodes per type, each type's seeds first, then each hop's new nodes in the order they
    were first drawn (relation after relation in the graph's edge-type order).

    Every node type and edge type of the graph has an entry (possibly empty). Tensors
    live on the sampler's device.
    """

    #: The node type of the seeds.
    input_type: str
    #: Node type to int64 ``[N_t]`` global IDs of that type, in local-ID order.
    node: dict[str, torch.Tensor]
    #: Edge type ``(src, rel, dst)`` to int64 ``[E_r]`` local source IDs (into ``node[src]``).
    row: dict[EdgeType, torch.Tensor]
    #: Edge type to int64 ``[E_r]`` local destination IDs (into ``node[dst]``).
    col: dict[EdgeType, torch.Tensor]
    #: Node type to the nodes added per hop (``len == hops + 1``; entry 0: the seeds).
    num_sampled_nodes: dict[str, list[int]]
    #: Edge type to the edges sampled per hop (``len == hops``).
    num_sampled_edges: dict[EdgeType, list[int]]
    #: Edge type to int64 ``[E_r]`` internal edge IDs aligned with ``row``/``col``, when
    #: edges were asked for (:meth:`~partitioner.manifest.Manifest.edge_book`); else empty.
    edge: dict[EdgeType, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        """Number of seeds: the first ``batch_size`` nodes of ``node[input_type]``."""
        return self.num_sampled_nodes[self.input_type][0]

    def edge_index(self, edge_type: EdgeType) -> torch.Tensor:
        """int64 ``[2, E_r]`` of one edge type: row 0 local sources, row 1 local targets."""
        return torch.stack([self.row[edge_type], self.col[edge_type]])


@dataclass
class Minibatch:
    """A sampled structure with its node data: original IDs, features and labels."""

    #: The sampled structure.
    structure: SamplerOutput
    #: The labelled node type (the key ``y`` belongs to).
    target_type: str
    #: Node type to ``[N_t, F_t]`` features, for types with features (empty if not gathered).
    x: dict[str, torch.Tensor] = field(default_factory=dict)
    #: int64 ``[N_target]`` labels of the target type's sampled nodes, ``-1`` = unlabeled
    #: (None if not gathered).
    y: torch.Tensor | None = None
    #: Node type to int64 ``[N_t]`` original IDs (the input graph's IDs of that type).
    orig_id: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Edge type to int64 ``[E_r]`` original edge IDs aligned with the structure's edges
    #: (PyG's ``e_id``), when asked for; else empty.
    e_id: dict[EdgeType, torch.Tensor] = field(default_factory=dict)
    #: Edge type to ``[E_r, *F_e]`` edge features aligned with the structure's edges
    #: (PyG's ``edge_attr``), when asked for; else empty.
    edge_attr: dict[EdgeType, torch.Tensor] = field(default_factory=dict)
