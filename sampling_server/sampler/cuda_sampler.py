"""The CUDA sampler: :class:`NeighborSampler` over Numba ``@cuda.jit`` kernels, run per relation.

Per relation and hop: a count kernel, an exclusive prefix sum (``torch.cumsum`` on the
device), a fill kernel, and the dedup/relabel kernels of a device hash table per node
type; three host synchronisations per hop (the frontier's ID range, the number of draws
and the number of new nodes, each one read), none per node. Tensors are torch CUDA
tensors on the current device and reach the kernels without copies; kernels run on
PyTorch's current stream. No kernel is specific to typed graphs: a relation is drawn as a
plain graph is, with its destination type's original IDs and first ID.

``topology='device'`` copies the CSC of every relation (the partition's, or the whole
graph's when the server holds it: ``structure``) and the labels to GPU memory;
``topology='uva'`` keeps them in pinned, device-mapped host memory that the kernels read
over UVA, for partitions larger than the GPU. Each node type's features are placed on
their own (``gpu_cache_size``, see :mod:`cuda_features`): the hottest rows (by in-degree)
in GPU memory, the others in mapped host memory; the partition's rows, or every node's
(``node_data``, with a structure over them all). Under Numba's CUDA simulator the same
code runs on CPU tensors (see :mod:`cuda_kernels`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from partitioner.graph import EdgeType
from partitioner.partition import NodeData, Partition, Structure
from sampling_server.feature_placement import parse_gpu_cache_size
from sampling_server.sampler import cpu_kernels
from sampling_server.sampler import cuda_kernels as K
from sampling_server.sampler.base import NeighborSampler, Relabeler
from sampling_server.sampler.cuda_features import FeatureTable
from sampling_server.sampler.cuda_launch import SIMULATOR, host_mapped, kernel_arg, torch_device
from sampling_server.sampler.hot_order import in_degree_order
from sampling_server.sampler.peers import NodeRows
from sampling_server.sampler.types import HopSample

TOPOLOGIES: tuple[str, ...] = ("device", "uva")


class CudaRelabeler(Relabeler):
    """Dedup and relabel of one batch's nodes of one type in a device hash table
    (global ID -> local ID), kept at least twice as large as the nodes it could hold."""

    def __init__(self, seeds: torch.Tensor):
        self.table = K.NodeTable(K.table_capacity(int(seeds.numel())), seeds.device)
        K.table_insert_seeds(self.table, seeds)

    def add(self, neighbors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if neighbors.dtype != torch.int64:
            raise ValueError(f"neighbors: expected int64 node IDs, got {neighbors.dtype}")
        ids = neighbors.to(self.table.keys.device).contiguous()
        needed = K.table_capacity(self.table.size + int(ids.numel()))
        if needed > self.table.capacity:
            K.table_grow(self.table, needed)
        return K.table_add(self.table, ids)


class CudaNeighborSampler(NeighborSampler):
    """Neighbor sampling of one partition on the GPU (one thread per frontier node within
    each relation).

    Draws the same neighbors as :class:`~sampling_server.sampler.cpu_sampler.CpuNeighborSampler`
    for the same batch key: both follow :mod:`rng` and the algorithms of
    ``docs/sampling.md`` step by step.

    ``topology`` places the graph structure and labels; ``gpu_cache_size`` (default
    ``"auto"``) the features, or ``feature_tables`` gives another sampler's tables of the
    same partition to share (one or the other).
    """

    #: Peer requests overlap this sampler's kernels, except under the CUDA simulator,
    #: whose launches are not thread-safe (each swaps module globals while it runs).
    overlap_peers = not SIMULATOR

    def __init__(self, partition: Partition, *, replace: bool = False, weighted: bool = False,
                 topology: str = "device", gpu_cache_size: str | float | None = None,
                 feature_tables: dict[str, FeatureTable] | None = None,
                 structure: Structure | None = None, node_data: NodeData | None = None):
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology: expected one of {list(TOPOLOGIES)}, got {topology!r}")
        if feature_tables is not None and gpu_cache_size is not None:
            raise ValueError("gpu_cache_size, feature_tables: expected one or neither, got both")
        size = parse_gpu_cache_size("auto" if gpu_cache_size is None else gpu_cache_size)
        super().__init__(partition, replace=replace, weighted=weighted, structure=structure,
                         node_data=node_data)
        for t in self.node_types:
            if self.hold[t] != self.own[t] and not (
                    self.draw[t][0] <= self.hold[t][0] and self.hold[t][1] <= self.draw[t][1]):
                raise ValueError(f"node_data: the CUDA sampler orders its feature table by in-degree, "
                                 f"so it needs the in-edges of the nodes whose rows it holds: expected "
                                 f"a structure over [{self.hold[t][0]}, {self.hold[t][1]}), got one "
                                 f"over [{self.draw[t][0]}, {self.draw[t][1]})")
        self.topology = topology
        self.device = torch_device()
        self._keep: list[torch.Tensor] = []  # device tensors behind kernel arguments
        csc = self.structure
        orig = {t: self._place(csc.orig_ids[t], np.int64) for t in self.node_types}
        self.csc = {et: self._csc_args(et, orig[et[2]]) for et in self.edge_types}
        self._y = self._place(self.node_data.y, np.int64)
        if feature_tables is None:  # after the structure, so "auto" sees what it left free
            feature_tables = {t: FeatureTable(x, self._hot_rows(t), self.hold[t][0], self.device, size)
                              for t, x in self.node_data.x.items()}
        for t, table in feature_tables.items():
            start, stop = self.hold[t]
            if table.node_start != start or table.num_rows != stop - start:
                raise ValueError(f"feature_tables[{t!r}]: expected the table of the rows held here "
                                 f"({stop - start} rows from node {start}), got one of {table.num_rows} "
                                 f"rows from node {table.node_start}")
        #: Node type to its features held here (GPU cache and mapped host rows).
        self.feature_tables = feature_tables

    def _csc_args(self, et: EdgeType, orig_ids: Any) -> K.CscArgs:
        """One relation's CSC as kernel arguments (with its weights when weighted)."""
        csc = self.structure
        weight = cum = None
        if self.weighted:
            weight = np.ascontiguousarray(csc.edge_weight[et], dtype=np.float32)
            if self.replace:  # the CPU sampler's own sums, so both draw the same
                with cpu_kernels.parallel_guard():
                    cum = cpu_kernels.segmented_cumsum(np.asarray(csc.indptr[et]), weight)
                weight = None
        return K.CscArgs(indptr=self._place(csc.indptr[et], np.int64),
                         indices=self._place(csc.indices[et], np.int64),
                         orig_ids=orig_ids, node_start=self.draw[et[2]][0], edge_start=self.edge_start[et],
                         weight=None if weight is None else self._place(weight, np.float32),
                         cumweight=None if cum is None else self._place(cum, np.float64))

    def _hot_rows(self, node_type: str) -> np.ndarray:
        """The held nodes of ``node_type``, hottest first: in-degree over every relation
        ending at the type (the feature table's order)."""
        start, stop = self.hold[node_type]
        first = start - self.draw[node_type][0]
        indptrs = [np.asarray(self.structure.indptr[et])[first:first + stop - start + 1]
                   for et in self.edge_types if et[2] == node_type]
        return in_degree_order(indptrs, start, stop - start)

    def _place(self, a: np.ndarray, dtype: Any) -> Any:
        """``a`` as a kernel argument in device memory, or mapped host memory for UVA."""
        host = np.ascontiguousarray(a, dtype=dtype)
        if self.topology == "uva":
            return host_mapped(host)
        t = torch.from_numpy(host if host.flags.writeable else host.copy()).to(self.device)
        self._keep.append(t)
        return kernel_arg(t)

    def node_ids(self, nodes: torch.Tensor, field: str) -> torch.Tensor:
        if not isinstance(nodes, torch.Tensor) or nodes.dtype != torch.int64 or nodes.dim() != 1:
            got = (f"{nodes.dtype} of shape {list(nodes.shape)}"
                   if isinstance(nodes, torch.Tensor) else type(nodes).__name__)
            raise ValueError(f"{field}: expected a 1-D int64 tensor of node IDs, got {got}")
        return nodes.to(self.device).contiguous()

    def sample_owned(self, edge_type: EdgeType, nodes: torch.Tensor, fanout: int, key: int,
                     hop: int, edges: bool = False) -> HopSample:
        if int(fanout) < -1:
            raise ValueError(f"fanout: expected an integer >= 0, or -1 for all; got {fanout}")
        ids = self.node_ids(nodes, "nodes")
        csc = self.csc[edge_type]
        counts = K.count_draws(ids, csc.indptr, csc.node_start, int(fanout), self.replace)
        neighbors, edge_ids = K.fill_draws(ids, counts, csc, int(fanout), self.draw_key(key, edge_type),
                                           int(hop), replace=self.replace, weighted=self.weighted,
                                           edges=edges)
        return HopSample(counts=counts, neighbors=neighbors, edges=edge_ids)

    def new_relabeler(self, node_type: str, seeds: torch.Tensor) -> Relabeler:
        return CudaRelabeler(self.node_ids(seeds, "seeds"))

    def gather_owned(self, node_type: str, nodes: torch.Tensor, features: bool, labels: bool) -> NodeRows:
        ids = self.node_ids(nodes, "nodes")
        table = self.feature_tables.get(node_type) if features else None
        x = table.gather(ids) if table is not None else None
        y = K.gather_labels(ids, self.hold[node_type][0], self._y) \
            if labels and node_type == self.target_type else None
        return x, y
