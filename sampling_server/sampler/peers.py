"""The peer protocol: what a sampler asks of the partitions that hold the rest of the
graph (:class:`Remote`) and what each partition's sampler answers (:class:`Peer`), for
draws, node rows, edge rows, original IDs and edge tests alike. A sampler groups the IDs
by owner once, asks the other owners first and does its own share while they answer
(:meth:`~sampling_server.sampler.holdings.Holdings.from_owners`).
:class:`InProcessPeers` is the :class:`Remote` of samplers of every partition in one
process; :class:`~sampling_server.peer_client.PeerRemote` the one over gRPC.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch

from partitioner.graph import EdgeType
from sampling_server.sampler.rows import on_device
from sampling_server.sampler.types import HopSample

#: Per owner partition ID: the tensors asked of (or answered by) that partition.
ByPartition = Mapping[int, torch.Tensor]
#: Features (or None) and labels (or None) of some nodes.
NodeRows = tuple[torch.Tensor | None, torch.Tensor | None]
#: Original edge IDs (or None) and edge features (or None) of some edges.
EdgeRows = tuple[torch.Tensor | None, torch.Tensor | None]
#: Per partition, ``(src, dst)`` pairs of global IDs (every ``dst`` owned there).
Pairs = Mapping[int, tuple[np.ndarray, np.ndarray]]


class Peer(Protocol):
    """What one partition's sampler answers the others (checking what it is given)."""

    device: torch.device

    def sample_relation(self, edge_type: EdgeType, nodes: torch.Tensor, fanout: int, key: int, hop: int,
                        edges: bool = False) -> HopSample: ...

    def gather_local(self, node_type: str, nodes: torch.Tensor, features: bool, labels: bool) -> NodeRows: ...

    def orig_ids_local(self, node_type: str, nodes: torch.Tensor) -> torch.Tensor: ...

    def has_edges_local(self, edge_type: EdgeType, src: np.ndarray, dst: np.ndarray) -> np.ndarray: ...

    def edge_rows_local(self, edge_type: EdgeType, edges: torch.Tensor, ids: bool, features: bool,
                        dtype: torch.dtype | None = None, field: str = "edges") -> EdgeRows: ...


class Remote(Protocol):
    """What a sampler asks of the partitions owning the rest of the graph.

    Every method gets, per partition, CPU tensors of the IDs (global node IDs of the type
    the call names, or internal edge IDs) and returns, per partition, what that
    partition's own sampler answers for them (:class:`Peer`). One call per relation or
    type carries every peer's IDs, so an implementation can ask the peers concurrently.
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


class InProcessPeers:
    """The :class:`Remote` of samplers of every partition in one process: each answers
    the others' IDs directly."""

    def __init__(self, samplers: Sequence[Peer]) -> None:
        self.samplers = list(samplers)

    def sample(self, edge_type: EdgeType, nodes_by_partition: ByPartition, fanout: int, key: int,
               hop: int, edges: bool = False) -> dict[int, HopSample]:
        return {p: self.samplers[p].sample_relation(edge_type, on_device(n, self.samplers[p].device),
                                                    fanout, key, hop, edges)
                for p, n in nodes_by_partition.items()}

    def node_data(self, node_type: str, nodes_by_partition: ByPartition, features: bool,
                  labels: bool) -> dict[int, NodeRows]:
        return {p: self.samplers[p].gather_local(node_type, on_device(n, self.samplers[p].device),
                                                 features, labels)
                for p, n in nodes_by_partition.items()}

    def orig_ids(self, node_type: str, nodes_by_partition: ByPartition) -> dict[int, torch.Tensor]:
        return {p: self.samplers[p].orig_ids_local(node_type, n) for p, n in nodes_by_partition.items()}

    def has_edges(self, edge_type: EdgeType, pairs_by_partition: Pairs) -> dict[int, np.ndarray]:
        return {p: self.samplers[p].has_edges_local(edge_type, src, dst)
                for p, (src, dst) in pairs_by_partition.items()}

    def edge_data(self, edge_type: EdgeType, edges_by_partition: ByPartition, ids: bool, features: bool,
                  dtype: torch.dtype | None) -> dict[int, EdgeRows]:
        return {p: self.samplers[p].edge_rows_local(edge_type, e, ids, features, dtype)
                for p, e in edges_by_partition.items()}


def edges_of(drawn: HopSample, who: str) -> torch.Tensor:
    """``drawn.edges``, asked for of ``who``; a ``RuntimeError`` naming it if it answered
    without them."""
    if drawn.edges is None:
        raise RuntimeError(f"{who} answered without the edge IDs asked for")
    if drawn.edges.shape != drawn.neighbors.shape:
        raise RuntimeError(f"{who} answered {list(drawn.edges.shape)} edge IDs for "
                           f"{drawn.neighbors.numel()} neighbors")
    return drawn.edges
