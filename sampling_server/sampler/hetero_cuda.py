"""The CUDA heterogeneous sampler: :class:`HeteroNeighborSampler` over the homogeneous
Numba ``@cuda.jit`` kernels, run per relation.

Per relation and hop: the count kernel, a prefix sum and the fill kernel of
:mod:`cuda_kernels` on that relation's CSC (with the destination type's original IDs
and first owned ID); dedup/relabel in one device hash table per node type. No kernel is
specific to typed graphs, so every kernel used here is already compiled for sm_90 by
``ptx_check``. It draws the same batches as
:class:`~sampling_server.sampler.hetero_cpu.CpuHeteroSampler`.
"""

from __future__ import annotations

import numpy as np
import torch

from partitioner.hetero import EdgeType
from partitioner.hetero_format import HeteroPartition
from sampling_server.sampler import cuda_kernels as K
from sampling_server.sampler.base import Relabeler, torch_dtype
from sampling_server.sampler.cuda_sampler import TOPOLOGIES, CudaRelabeler, DeviceArrays
from sampling_server.sampler.hetero_base import HeteroNeighborSampler, relation_key
from sampling_server.sampler.types import HopSample

_MASK64 = (1 << 64) - 1


class CudaHeteroSampler(DeviceArrays, HeteroNeighborSampler):
    """Typed neighbor sampling of one partition on the GPU (one thread per frontier node
    within each relation). ``topology`` as for the homogeneous CUDA sampler."""

    def __init__(self, partition: HeteroPartition, *, replace: bool = False,
                 topology: str = "device"):
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology: expected one of {list(TOPOLOGIES)}, got {topology!r}")
        super().__init__(partition, replace=replace)
        self.topology = topology
        self.device = K.torch_device()
        self._keep: list[torch.Tensor] = []  # device tensors behind kernel arguments
        orig = {t: self._place(partition.orig_ids[t], np.int64) for t in self.node_types}
        self.csc = {et: K.CscArgs(indptr=self._place(partition.indptr[et], np.int64),
                                  indices=self._place(partition.indices[et], np.int64),
                                  orig_ids=orig[et[2]], node_start=self.node_range(et[2])[0])
                    for et in self.edge_types}
        self._x = {t: (self._place(x, x.dtype), torch_dtype(x.dtype))
                   for t, x in partition.x.items()}
        self._y = self._place(partition.y, np.int64)

    def sample_relation(self, edge_type: EdgeType, nodes: torch.Tensor, fanout: int, key: int,
                        hop: int) -> HopSample:
        csc = self.csc.get((edge_type[0], edge_type[1], edge_type[2]))
        if csc is None:
            raise ValueError(f"edge_type: expected one of {list(self.edge_types)}, got {edge_type!r}")
        if int(fanout) < -1:
            raise ValueError(f"fanout: expected an integer >= 0, or -1 for all; got {fanout}")
        ids = self._ids(nodes, "nodes")
        self.check_owned(edge_type[2], ids, "nodes")
        counts = K.count_draws(ids, csc.indptr, csc.node_start, int(fanout), self.replace)
        neighbors = K.fill_draws(ids, counts, csc, int(fanout), relation_key(key, edge_type) & _MASK64,
                                 int(hop), replace=self.replace, weighted=False)
        return HopSample(counts=counts, neighbors=neighbors)

    def new_relabeler(self, node_type: str, seeds: torch.Tensor) -> Relabeler:
        return CudaRelabeler(self._ids(seeds, "seeds"))

    def gather_local(self, node_type: str, nodes: torch.Tensor, features: bool,
                     labels: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self.check_node_type(node_type, "node_type")
        ids = self._ids(nodes, "nodes")
        self.check_owned(node_type, ids, "nodes")
        start = self.node_range(node_type)[0]
        placed = self._x.get(node_type) if features else None
        x = None if placed is None else K.gather_rows(ids, start, placed[0], placed[1])
        want_y = labels and node_type == self.target_type
        y = K.gather_labels(ids, start, self._y) if want_y else None
        return x, y
