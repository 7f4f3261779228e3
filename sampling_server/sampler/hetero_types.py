"""Typed hand-offs of the heterogeneous sampler (the typed twins of :mod:`types`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from partitioner.hetero import EdgeType


@dataclass
class HeteroSamplerOutput:
    """The structure of one typed minibatch, numbered as PyG's hetero ``NeighborLoader``
    numbers it: nodes per type, each type's seeds first, then each hop's new nodes.

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

    @property
    def batch_size(self) -> int:
        """Number of seeds: the first ``batch_size`` nodes of ``node[input_type]``."""
        return self.num_sampled_nodes[self.input_type][0]

    def edge_index(self, edge_type: EdgeType) -> torch.Tensor:
        """int64 ``[2, E_r]`` of one edge type: row 0 local sources, row 1 local targets."""
        return torch.stack([self.row[edge_type], self.col[edge_type]])


@dataclass
class HeteroMinibatch:
    """A typed structure with its node data: original IDs, features and labels."""

    #: The sampled structure.
    structure: HeteroSamplerOutput
    #: Node type to int64 ``[N_t]`` original IDs (the input graph's IDs of that type).
    orig_id: dict[str, torch.Tensor]
    #: Node type to ``[N_t, F_t]`` features, for types with features (none if not gathered).
    x: dict[str, torch.Tensor]
    #: int64 ``[N_target]`` labels of the target type's sampled nodes, ``-1`` = unlabeled
    #: (None if not gathered).
    y: torch.Tensor | None
    #: The labelled node type (the key ``y`` belongs to).
    target_type: str
