"""The CPU heterogeneous sampler: :class:`HeteroNeighborSampler` over the homogeneous
Numba ``@njit`` kernels, run per relation.

Each relation's CSC (over the owned destination nodes, sources as global IDs of the
source type) goes to :func:`cpu_kernels.sample_uniform` with the destination type's
original IDs and first owned ID, so a relation is sampled exactly as a homogeneous graph
would be; dedup/relabel uses one homogeneous relabeler per node type. Nothing is copied
at start-up: the partition's arrays stay read-only memory maps.
"""

from __future__ import annotations

import numpy as np
import torch

from partitioner.hetero import EdgeType
from partitioner.hetero_format import HeteroPartition
from sampling_server.sampler import cpu_kernels as K
from sampling_server.sampler.base import Relabeler
from sampling_server.sampler.cpu_sampler import (
    DENSE_RELABEL_MAX_NODES,
    CpuRelabeler,
    DenseRelabeler,
    _as_ids,
    _DenseMapPool,
)
from sampling_server.sampler.hetero_base import HeteroNeighborSampler, relation_key
from sampling_server.sampler.types import HopSample


class CpuHeteroSampler(HeteroNeighborSampler):
    """Typed neighbor sampling of one partition on the CPU (parallel over frontier nodes
    within each relation)."""

    device = torch.device("cpu")

    def __init__(self, partition: HeteroPartition, *, replace: bool = False):
        super().__init__(partition, replace=replace)
        self._indptr = {et: np.asarray(partition.indptr[et]) for et in self.edge_types}
        self._indices = {et: np.asarray(partition.indices[et]) for et in self.edge_types}
        #: int64 original IDs of the owned nodes per type: the keys of their draws.
        self._orig_ids = {t: np.ascontiguousarray(partition.orig_ids[t], dtype=np.int64)
                          for t in self.node_types}
        counts = {t: i.num_nodes for t, i in partition.manifest.node_types.items()}
        self._dense_maps = {t: _DenseMapPool(n) for t, n in counts.items()
                            if n <= DENSE_RELABEL_MAX_NODES}

    def sample_relation(self, edge_type: EdgeType, nodes: torch.Tensor, fanout: int, key: int,
                        hop: int) -> HopSample:
        if tuple(edge_type) not in self._indptr:
            raise ValueError(f"edge_type: expected one of {list(self.edge_types)}, got {edge_type!r}")
        if int(fanout) < -1:
            raise ValueError(f"fanout: expected an integer >= 0, or -1 for all; got {fanout}")
        et: EdgeType = (edge_type[0], edge_type[1], edge_type[2])
        ids = _as_ids(nodes, "nodes")
        self.check_owned(et[2], torch.from_numpy(ids), "nodes")
        start = self.node_range(et[2])[0]
        offsets, out = K.sample_uniform(
            self._indptr[et], self._indices[et], self._orig_ids[et[2]], start, ids, int(fanout),
            np.uint64(relation_key(key, et)), int(hop), self.replace)
        return HopSample(counts=torch.from_numpy(np.diff(offsets)), neighbors=torch.from_numpy(out))

    def new_relabeler(self, node_type: str, seeds: torch.Tensor) -> Relabeler:
        ids = _as_ids(seeds, "seeds")
        pool = self._dense_maps.get(node_type)
        return DenseRelabeler(ids, pool) if pool is not None else CpuRelabeler(ids)

    def gather_local(self, node_type: str, nodes: torch.Tensor, features: bool,
                     labels: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self.check_node_type(node_type, "node_type")
        ids = _as_ids(nodes, "nodes")
        self.check_owned(node_type, torch.from_numpy(ids), "nodes")
        start = self.node_range(node_type)[0]
        x_src = self.partition.x.get(node_type) if features else None
        want_y = labels and node_type == self.target_type
        if x_src is not None and want_y:
            xs, ys = K.gather_with_labels(x_src, self.partition.y, ids, start)
            return torch.from_numpy(xs), torch.from_numpy(ys)
        x = None if x_src is None else torch.from_numpy(K.gather(x_src, ids, start))
        y = torch.from_numpy(K.gather(self.partition.y, ids, start)) if want_y else None
        return x, y
