"""Multi-hop neighbor samplers over one partition: Numba CPU and Numba CUDA kernels
behind one :class:`NeighborSampler` interface, for plain and typed graphs alike (see
``docs/sampling.md``).

:func:`create_sampler` picks the implementation; :class:`InProcessPeers` lets the
samplers of every partition in one process answer each other. The CUDA sampler is
imported only when it is chosen, and :func:`~sampling_server.sampler.convert.to_pyg_data` (which imports
PyG) only when it is first used.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from partitioner.graph import EdgeType
from partitioner.partition import NodeData, Partition, Structure
from sampling_server.sampler.base import NeighborSampler, Relabeler
from sampling_server.sampler.cpu_sampler import CpuNeighborSampler, CpuRelabeler
from sampling_server.sampler.fanouts import NumNeighbors, check_fanouts, normalize_num_neighbors, relation_key
from sampling_server.sampler.peers import ByPartition, EdgeRows, NodeRows, Pairs, Remote
from sampling_server.sampler.rng import batch_key
from sampling_server.sampler.rows import on_device
from sampling_server.sampler.types import HopSample, Minibatch, SamplerOutput

if TYPE_CHECKING:
    from sampling_server.sampler.convert import to_pyg_data

Device = Literal["auto", "cpu", "cuda"]
Topology = Literal["device", "uva"]
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
TOPOLOGIES: tuple[str, ...] = ("device", "uva")


def cuda_usable() -> bool:
    """Whether a real GPU can run the CUDA sampler (torch and Numba both see one, and
    Numba's CUDA simulator is off)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or not torch.cuda.is_available():
        return False
    from numba import cuda

    return bool(cuda.is_available())


def uses_cuda(device: Device | str) -> bool:
    """Whether :func:`create_sampler` makes a CUDA sampler for ``device``."""
    return device == "cuda" or (device == "auto" and cuda_usable())


def create_sampler(
    partition: Partition, device: Device | str = "auto", *, replace: bool = False,
    weighted: bool = False, topology: Topology | str = "device",
    gpu_cache_size: str | float | None = None, share_features_of: NeighborSampler | None = None,
    structure: Structure | None = None, node_data: NodeData | None = None,
) -> NeighborSampler:
    """The sampler of ``partition`` (plain or typed) on ``device``.

    ``device='auto'`` picks CUDA when :func:`cuda_usable`, else the CPU. ``topology``
    places the CUDA sampler's graph: ``'device'`` copies it to GPU memory, ``'uva'``
    keeps it in pinned host memory read over UVA (for graphs bigger than the GPU).
    ``gpu_cache_size`` places its features on their own (``'auto'`` when None; see
    :mod:`sampling_server.feature_placement`), unless ``share_features_of`` names a CUDA
    sampler of the same partition whose feature tables to share. The CPU sampler reads
    the partition where it is and ignores all three. ``structure``: the in-edges to draw
    from (default: the partition's own; the whole graph's from
    :func:`partitioner.joins.load_structure` draws every hop here, no peer asked).
    ``node_data``: the features and labels to gather from, likewise (the CUDA sampler's
    feature tables then hold them all, their hottest rows by in-degree in GPU memory; it
    needs ``structure`` over the same nodes for that order).
    """
    if device not in DEVICES:
        raise ValueError(f"device: expected one of {list(DEVICES)}, got {device!r}")
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology: expected one of {list(TOPOLOGIES)}, got {topology!r}")
    if uses_cuda(device):
        from sampling_server.sampler.cuda_sampler import CudaNeighborSampler

        tables = share_features_of.feature_tables \
            if isinstance(share_features_of, CudaNeighborSampler) else None
        return CudaNeighborSampler(partition, replace=replace, weighted=weighted, topology=topology,
                                   gpu_cache_size=None if tables is not None else gpu_cache_size,
                                   feature_tables=tables, structure=structure, node_data=node_data)
    return CpuNeighborSampler(partition, replace=replace, weighted=weighted, structure=structure,
                              node_data=node_data)


class InProcessPeers:
    """The :class:`Remote` of samplers of every partition in one process: each answers
    the others' IDs directly."""

    def __init__(self, samplers: Sequence[NeighborSampler]) -> None:
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


def __getattr__(name: str) -> Any:
    if name == "to_pyg_data":  # imported on first use: PyG is heavy and trainer-side
        from sampling_server.sampler.convert import to_pyg_data

        return to_pyg_data
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEVICES",
    "TOPOLOGIES",
    "CpuNeighborSampler",
    "CpuRelabeler",
    "HopSample",
    "InProcessPeers",
    "Minibatch",
    "NeighborSampler",
    "NumNeighbors",
    "Relabeler",
    "Remote",
    "SamplerOutput",
    "batch_key",
    "check_fanouts",
    "create_sampler",
    "cuda_usable",
    "normalize_num_neighbors",
    "relation_key",
    "to_pyg_data",
    "uses_cuda",
]
