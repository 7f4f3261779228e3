"""The peer protocol: what a sampler asks of the partitions that hold the rest of the
graph (:class:`Remote`: draws, node rows, edge rows, original IDs, edge tests), answered
by their samplers. :class:`~sampling_server.sampler.InProcessPeers` is the
:class:`Remote` of samplers in one process; :class:`~sampling_server.peer_client.PeerRemote`
the one over gRPC."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch

from partitioner.graph import EdgeType
from sampling_server.sampler.types import HopSample

#: Per owner partition ID: the tensors asked of (or answered by) that partition.
ByPartition = Mapping[int, torch.Tensor]
#: Features (or None) and labels (or None) of some nodes.
NodeRows = tuple[torch.Tensor | None, torch.Tensor | None]
#: Original edge IDs (or None) and edge features (or None) of some edges.
EdgeRows = tuple[torch.Tensor | None, torch.Tensor | None]
#: Per partition, ``(src, dst)`` pairs of global IDs (every ``dst`` owned there).
Pairs = Mapping[int, tuple[np.ndarray, np.ndarray]]


class Remote(Protocol):
    """What a sampler asks of the partitions owning the rest of the graph.

    Every method gets, per partition, CPU tensors of the IDs (global node IDs of the type
    the call names, or internal edge IDs) and returns, per partition, what that
    partition's own sampler answers for them: its ``sample_relation``, ``gather_local``,
    ``orig_ids_local``, ``has_edges_local`` and ``edge_rows_local``. One call per relation
    or type carries every peer's IDs, so an implementation can ask the peers concurrently.
    """

    def sample(self, edge_type: EdgeType, nodes_by_partition: ByPartition, fanout: int,
               key: int, hop: int, edges: bool = False) -> Mapping[int, HopSample]:
        """With ``edges``, each answer's :attr:`HopSample.edges` too."""
        ...

    def node_data(self, node_type: str, nodes_by_partition: ByPartition, features: bool,
                  labels: bool) -> Mapping[int, NodeRows]: ...

    def orig_ids(self, node_type: str, nodes_by_partition: ByPartition) -> Mapping[int, torch.Tensor]: ...

    def has_edges(self, edge_type: EdgeType, pairs_by_partition: Pairs) -> Mapping[int, np.ndarray]: ...

    def edge_data(self, edge_type: EdgeType, edges_by_partition: ByPartition, ids: bool, features: bool,
                  dtype: torch.dtype | None) -> Mapping[int, EdgeRows]:
        """Features in ``dtype`` (None: as stored)."""
        ...


def edges_of(drawn: HopSample, who: str) -> torch.Tensor:
    """``drawn.edges``, asked for of ``who``; a ``RuntimeError`` naming it if it answered
    without them."""
    if drawn.edges is None:
        raise RuntimeError(f"{who} answered without the edge IDs asked for")
    if drawn.edges.shape != drawn.neighbors.shape:
        raise RuntimeError(f"{who} answered {list(drawn.edges.shape)} edge IDs for "
                           f"{drawn.neighbors.numel()} neighbors")
    return drawn.edges
