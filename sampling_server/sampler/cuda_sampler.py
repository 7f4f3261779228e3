"""The CUDA sampler: :class:`NeighborSampler` over Numba ``@cuda.jit`` kernels.

Per hop: a count kernel, an exclusive prefix sum (``torch.cumsum`` on the device), a fill
kernel, and the dedup/relabel kernels of a device hash table; three host synchronisations
per hop (the frontier's ID range, the number of draws and the number of new nodes, each
one read), none per node. Tensors are torch CUDA tensors on the current
device and reach the kernels without copies; kernels run on PyTorch's current stream.

``topology='device'`` copies the CSC (the partition's, or the whole graph's when the
server holds it: ``structure``) and labels to GPU memory; ``topology='uva'`` keeps
them in pinned, device-mapped host memory that the kernels read over UVA, for partitions
larger than the GPU. The features are placed on their own (``gpu_cache_size``, see
:mod:`cuda_features`): the hottest rows in GPU memory, the others in mapped host memory;
the partition's rows, or every node's (``node_data``, with a structure over them all).
Under Numba's CUDA simulator the same code runs on CPU tensors (see :mod:`cuda_kernels`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from partitioner.format import NodeData, Partition, Structure
from sampling_server.feature_placement import parse_gpu_cache_size
from sampling_server.sampler import cpu_kernels
from sampling_server.sampler import cuda_kernels as K
from sampling_server.sampler.base import NeighborSampler, Relabeler
from sampling_server.sampler.cuda_features import FeatureTable
from sampling_server.sampler.types import HopSample

_MASK64 = (1 << 64) - 1
TOPOLOGIES: tuple[str, ...] = ("device", "uva")


class CudaRelabeler(Relabeler):
    """Dedup and relabel of one batch in a device hash table (global ID -> local ID),
    kept at least twice as large as the nodes the batch could hold."""

    def __init__(self, seeds: torch.Tensor):
        self.table = K.NodeTable(K.table_capacity(int(seeds.numel())), seeds.device)
        K.table_insert_seeds(self.table, seeds)

    def __len__(self) -> int:
        """Nodes numbered so far."""
        return self.table.size

    def add(self, neighbors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if neighbors.dtype != torch.int64:
            raise ValueError(f"neighbors: expected int64 node IDs, got {neighbors.dtype}")
        ids = neighbors.to(self.table.keys.device).contiguous()
        needed = K.table_capacity(self.table.size + int(ids.numel()))
        if needed > self.table.capacity:
            K.table_grow(self.table, needed)
        return K.table_add(self.table, ids)


class DeviceArrays:
    """Placement of a partition's arrays for the CUDA kernels, shared by the homogeneous and
    the typed CUDA samplers (which set ``device``, ``topology`` and ``_keep``)."""

    device: torch.device
    topology: str
    _keep: list[torch.Tensor]
    #: Peer requests overlap this sampler's kernels, except under the CUDA simulator,
    #: whose launches are not thread-safe (each swaps module globals while it runs).
    overlap_peers = not K.SIMULATOR

    def _place(self, a: np.ndarray, dtype: Any) -> Any:
        """``a`` as a kernel argument in device memory, or mapped host memory for UVA."""
        host = np.ascontiguousarray(a, dtype=dtype)
        if self.topology == "uva":
            return K.host_mapped(host)
        t = torch.from_numpy(host if host.flags.writeable else host.copy()).to(self.device)
        self._keep.append(t)
        return K.kernel_arg(t)

    def _ids(self, nodes: torch.Tensor, field: str) -> torch.Tensor:
        if not isinstance(nodes, torch.Tensor) or nodes.dtype != torch.int64 or nodes.dim() != 1:
            got = (f"{nodes.dtype} of shape {list(nodes.shape)}"
                   if isinstance(nodes, torch.Tensor) else type(nodes).__name__)
            raise ValueError(f"{field}: expected a 1-D int64 tensor of node IDs, got {got}")
        return nodes.to(self.device).contiguous()


def _check_table(table: FeatureTable, start: int, stop: int) -> None:
    if table.node_start != start or table.num_rows != stop - start:
        raise ValueError(f"feature_table: expected the table of the rows held here ({stop - start} "
                         f"rows from node {start}), got one of {table.num_rows} rows from node "
                         f"{table.node_start}")


class CudaNeighborSampler(DeviceArrays, NeighborSampler):
    """Neighbor sampling of one partition on the GPU (one thread per frontier node).

    Draws the same neighbors as :class:`~sampling_server.sampler.cpu_sampler.CpuNeighborSampler`
    for the same batch key: both follow :mod:`rng` and the algorithms of
    ``docs/sampling.md`` step by step.

    ``topology`` places the graph structure and labels; ``gpu_cache_size`` (default
    ``"auto"``) the features, or ``feature_table`` gives the table of another sampler of
    the same partition to share (one or the other).
    """

    def __init__(self, partition: Partition, *, replace: bool = False, weighted: bool = False,
                 topology: str = "device", gpu_cache_size: str | float | None = None,
                 feature_table: FeatureTable | None = None, structure: Structure | None = None,
                 node_data: NodeData | None = None):
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology: expected one of {list(TOPOLOGIES)}, got {topology!r}")
        size = None
        if feature_table is None:
            size = parse_gpu_cache_size("auto" if gpu_cache_size is None else gpu_cache_size)
        elif gpu_cache_size is not None:
            raise ValueError("gpu_cache_size, feature_table: expected one or neither, got both")
        super().__init__(partition, replace=replace, weighted=weighted, structure=structure,
                         node_data=node_data)
        if (self.hold_start, self.hold_stop) != (self.node_start, self.node_stop) and not (
                self.draw_start <= self.hold_start and self.hold_stop <= self.draw_stop):
            raise ValueError(f"node_data: the CUDA sampler orders its feature table by in-degree, "
                             f"so it needs the in-edges of the nodes whose rows it holds: expected "
                             f"a structure over [{self.hold_start}, {self.hold_stop}), got one "
                             f"over [{self.draw_start}, {self.draw_stop})")
        if feature_table is not None:
            _check_table(feature_table, self.hold_start, self.hold_stop)
        self.topology = topology
        self.device = K.torch_device()
        self._keep: list[torch.Tensor] = []  # device tensors behind kernel arguments
        csc = self.structure
        weight = cum = None
        if weighted:
            assert csc.edge_weight is not None  # checked by NeighborSampler
            indptr = np.asarray(csc.indptr)
            weight = np.ascontiguousarray(csc.edge_weight, dtype=np.float32)
            if replace:  # the CPU sampler's own sums, so both draw the same
                with cpu_kernels.parallel_guard():
                    cum = cpu_kernels.segmented_cumsum(indptr, weight)
                weight = None
        self.csc = K.CscArgs(
            indptr=self._place(csc.indptr, np.int64),
            indices=self._place(csc.indices, np.int64),
            orig_ids=self._place(csc.orig_ids, np.int64),
            node_start=self.draw_start,
            weight=None if weight is None else self._place(weight, np.float32),
            cumweight=None if cum is None else self._place(cum, np.float64),
        )
        self._y = self._place(self.node_data.y, np.int64)
        if feature_table is None:  # after the structure, so "auto" sees what it left free
            assert size is not None
            first = self.hold_start - self.draw_start
            indptr = np.asarray(self.structure.indptr)[first:first + self.hold_stop - self.hold_start + 1]
            feature_table = FeatureTable(self.node_data.x, indptr, self.hold_start, self.device, size)
        #: The features held here (GPU cache and mapped host rows).
        self.feature_table = feature_table

    def sample_neighbors(self, nodes: torch.Tensor, fanout: int, key: int, hop: int) -> HopSample:
        ids = self._ids(nodes, "nodes")
        self.check_drawable(ids, "nodes")
        return self.sample_owned(ids, fanout, key, hop)

    def sample_owned(self, nodes: torch.Tensor, fanout: int, key: int, hop: int) -> HopSample:
        if int(fanout) < -1:
            raise ValueError(f"fanout: expected an integer >= 0, or -1 for all; got {fanout}")
        ids = self._ids(nodes, "nodes")
        counts = K.count_draws(ids, self.csc.indptr, self.draw_start, int(fanout), self.replace)
        neighbors = K.fill_draws(ids, counts, self.csc, int(fanout), int(key) & _MASK64, int(hop),
                                 replace=self.replace, weighted=self.weighted)
        return HopSample(counts=counts, neighbors=neighbors)

    def new_relabeler(self, seeds: torch.Tensor) -> Relabeler:
        return CudaRelabeler(self._ids(seeds, "seeds"))

    def gather_local(
        self, nodes: torch.Tensor, features: bool, labels: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        ids = self._ids(nodes, "nodes")
        self.check_held(ids, "nodes")
        return self.gather_owned(ids, features, labels)

    def gather_owned(
        self, nodes: torch.Tensor, features: bool, labels: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        ids = self._ids(nodes, "nodes")
        x = self.feature_table.gather(ids) if features else None
        y = K.gather_labels(ids, self.hold_start, self._y) if labels else None
        return x, y
