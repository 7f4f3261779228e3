"""Typed hand-offs between the sampling stages."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplerOutput:
    """The structure of one minibatch, numbered as PyG's ``NeighborLoader`` numbers it.

    All tensors live on the sampler's device.
    """

    #: int64 ``[N]`` global IDs: the seeds first, then each hop's new nodes in the order
    #: they were first sampled.
    n_id: torch.Tensor
    #: int64 ``[E]`` local source (an index into ``n_id``) of each sampled edge.
    row: torch.Tensor
    #: int64 ``[E]`` local target of each sampled edge.
    col: torch.Tensor
    #: Nodes added per hop; entry 0 is the number of seeds. ``sum == N``.
    num_sampled_nodes: list[int]
    #: Edges sampled per hop (``len == number of hops``). ``sum == E``.
    num_sampled_edges: list[int]

    @property
    def batch_size(self) -> int:
        """Number of seed nodes (the first ``batch_size`` entries of ``n_id``)."""
        return self.num_sampled_nodes[0]

    @property
    def edge_index(self) -> torch.Tensor:
        """int64 ``[2, E]``: row 0 the local source, row 1 the local target."""
        return torch.stack([self.row, self.col])


@dataclass
class Minibatch:
    """A sampled structure with the node data gathered for it."""

    #: The sampled structure.
    structure: SamplerOutput
    #: ``[N, F]`` features of ``n_id``'s nodes, in ``n_id`` order (None if not gathered).
    x: torch.Tensor | None
    #: int64 ``[N]`` labels of ``n_id``'s nodes, ``-1`` = unlabeled (None if not gathered).
    y: torch.Tensor | None


@dataclass
class HopSample:
    """Neighbors drawn for one frontier: ``counts[i]`` neighbors of ``nodes[i]``, listed in
    ``neighbors`` node after node."""

    #: int64 ``[F]`` neighbors drawn per frontier node.
    counts: torch.Tensor
    #: int64 ``[sum(counts)]`` global IDs of the drawn in-neighbors.
    neighbors: torch.Tensor
