"""Multi-hop neighbor samplers over one partition: Numba CPU and Numba CUDA kernels
behind one :class:`NeighborSampler` interface (see ``docs/sampling.md``).

:func:`create_sampler` picks the implementation. The CUDA sampler is imported only when
it is chosen, and :func:`~sampling_server.sampler.convert.to_pyg_data` (which imports
PyG) only when it is first used.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal

import torch

from partitioner.format import Partition
from sampling_server.sampler.base import (
    NeighborSampler,
    Relabeler,
    RemoteNeighbors,
    RemoteNodeData,
    RemoteOrigIds,
    check_fanouts,
)
from sampling_server.sampler.cpu_sampler import CpuNeighborSampler, CpuRelabeler
from sampling_server.sampler.rng import batch_key
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


def create_sampler(
    partition: Partition, device: Device | str = "auto", *, replace: bool = False,
    weighted: bool = False, topology: Topology | str = "device",
) -> NeighborSampler:
    """The sampler of ``partition`` on ``device``.

    ``device='auto'`` picks CUDA when :func:`cuda_usable`, else the CPU. ``topology``
    places the CUDA sampler's graph: ``'device'`` copies it to GPU memory, ``'uva'``
    keeps it in pinned host memory read over UVA (for graphs bigger than the GPU). The
    CPU sampler reads the partition where it is and ignores ``topology``.
    """
    if device not in DEVICES:
        raise ValueError(f"device: expected one of {list(DEVICES)}, got {device!r}")
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology: expected one of {list(TOPOLOGIES)}, got {topology!r}")
    if device == "cuda" or (device == "auto" and cuda_usable()):
        from sampling_server.sampler.cuda_sampler import CudaNeighborSampler

        return CudaNeighborSampler(partition, replace=replace, weighted=weighted,
                                   topology=topology)
    return CpuNeighborSampler(partition, replace=replace, weighted=weighted)


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
    "Minibatch",
    "NeighborSampler",
    "Relabeler",
    "RemoteNeighbors",
    "RemoteNodeData",
    "RemoteOrigIds",
    "SamplerOutput",
    "batch_key",
    "check_fanouts",
    "create_sampler",
    "cuda_usable",
    "to_pyg_data",
]
