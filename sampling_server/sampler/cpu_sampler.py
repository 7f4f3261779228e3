"""The CPU sampler: :class:`NeighborSampler` over Numba ``@njit`` kernels.

Tensors are torch CPU tensors; they cross to the kernels as NumPy views
(``Tensor.numpy()``) and come back with ``torch.from_numpy``, without copies. The
partition's arrays stay as loaded (read-only memory maps by default): nothing is copied
at start-up except, for weighted sampling, the float64 per-node prefix sums of the edge
weights (8 bytes per edge).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from partitioner.format import Partition
from sampling_server.sampler import cpu_kernels as K
from sampling_server.sampler.base import NeighborSampler, Relabeler
from sampling_server.sampler.types import HopSample

_MASK64 = (1 << 64) - 1
#: Initial relabel table size, in expected nodes per seed (the table grows as needed).
NODES_PER_SEED_HINT = 16


def _as_ids(nodes: torch.Tensor | np.ndarray, field: str) -> np.ndarray:
    """A C-contiguous int64 NumPy view (or copy, if needed) of a 1-D ID tensor."""
    if isinstance(nodes, torch.Tensor):
        if nodes.device.type != "cpu":
            raise ValueError(f"{field}: expected a CPU tensor, got one on {nodes.device}")
        if nodes.dtype != torch.int64:
            raise ValueError(f"{field}: expected int64 node IDs, got {nodes.dtype}")
        arr = nodes.detach().contiguous().numpy()
    else:
        arr = np.ascontiguousarray(nodes, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{field}: expected a 1-D array of node IDs, got shape {list(arr.shape)}")
    return arr


class CpuRelabeler(Relabeler):
    """Dedup and relabel of one batch: an open-addressing hash table (global ID ->
    local ID) of power-of-two size, at most half full, doubled as it fills."""

    def __init__(self, seeds: np.ndarray, expected_nodes: int | None = None):
        expected = max(int(expected_nodes or seeds.size * NODES_PER_SEED_HINT), seeds.size, 16)
        size = 1 << (K.MAX_LOAD_DIVISOR * expected - 1).bit_length()
        self._keys = np.full(size, K.EMPTY, dtype=np.int64)
        self._values = np.empty(size, dtype=np.int64)
        dup = K.table_insert_unique(self._keys, self._values, seeds, 0)
        if dup >= 0:
            raise ValueError(f"seeds: expected unique node IDs; {int(seeds[dup])} repeats")
        self._count = int(seeds.size)

    def __len__(self) -> int:
        """Nodes numbered so far."""
        return self._count

    def add(self, neighbors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = _as_ids(neighbors, "neighbors")
        new_ids = np.empty(ids.size, dtype=np.int64)
        local = np.empty(ids.size, dtype=np.int64)
        first_new, done = self._count, 0
        self._reserve(self._count + ids.size)  # at most one rehash per hop
        while True:
            limit = self._keys.size // K.MAX_LOAD_DIVISOR
            done, self._count = K.table_add(self._keys, self._values, self._count, limit, ids,
                                            done, first_new, new_ids, local)
            if done == ids.size:
                break
            self._reserve(2 * self._count)
        new = new_ids[: self._count - first_new]
        return torch.from_numpy(new), torch.from_numpy(local)

    def _reserve(self, nodes: int) -> None:
        """Grow the table (power-of-two size) until ``nodes`` keys fit under the load limit."""
        size = self._keys.size
        while size // K.MAX_LOAD_DIVISOR < nodes:
            size *= 2
        if size != self._keys.size:
            self._keys, self._values = K.table_rehash(self._keys, self._values, size)


class DenseRelabeler(Relabeler):
    """Dedup and relabel of one batch through a dense map (global ID -> local ID, -1 =
    unseen) borrowed from the sampler's pool: one memory access per neighbor, against
    several probes per neighbor for a hash table. The map is reset (only the batch's own
    entries) when the batch closes."""

    def __init__(self, seeds: np.ndarray, pool: _DenseMapPool):
        self._pool = pool
        self._map: np.ndarray | None = pool.take()
        self._seen: list[np.ndarray] = []
        dup = K.dense_insert_unique(self._map, seeds)  # undoes its inserts on a repeat
        if dup >= 0:
            self.close()
            raise ValueError(f"seeds: expected unique node IDs; {int(seeds[dup])} repeats")
        self._seen.append(seeds)
        self._count = int(seeds.size)

    def __len__(self) -> int:
        """Nodes numbered so far."""
        return self._count

    def add(self, neighbors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._map is None:
            raise RuntimeError("relabeler used after close()")
        ids = _as_ids(neighbors, "neighbors")
        new_ids = np.empty(ids.size, dtype=np.int64)
        local = np.empty(ids.size, dtype=np.int64)
        first_new = self._count
        with K.parallel_guard():
            K.dense_lookup(self._map, ids, local)
        self._count = K.dense_add(self._map, self._count, ids, new_ids, local)
        new = new_ids[: self._count - first_new]
        self._seen.append(new)
        return torch.from_numpy(new), torch.from_numpy(local)

    def close(self) -> None:
        if self._map is not None:
            with K.parallel_guard():
                for ids in self._seen:
                    K.dense_reset(self._map, ids)
            self._pool.give_back(self._map)
            self._map = None


class _DenseMapPool:
    """Dense maps of ``num_nodes`` entries, all -1, one per batch being sampled at once."""

    def __init__(self, num_nodes: int):
        self._num_nodes = num_nodes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        dtype = np.int32 if self._num_nodes < 2**31 else np.int64
        return np.full(self._num_nodes, -1, dtype=dtype)

    def give_back(self, table: np.ndarray) -> None:
        with self._lock:
            self._free.append(table)


#: Graphs with at most this many nodes relabel through dense maps (4 bytes a node per
#: batch in flight); larger ones through per-batch hash tables.
DENSE_RELABEL_MAX_NODES = 1 << 28


class CpuNeighborSampler(NeighborSampler):
    """Neighbor sampling of one partition on the CPU (Numba ``@njit`` kernels, parallel
    over frontier nodes)."""

    device = torch.device("cpu")

    def __init__(self, partition: Partition, *, replace: bool = False, weighted: bool = False):
        super().__init__(partition, replace=replace, weighted=weighted)
        self._indptr = np.asarray(partition.indptr)
        self._indices = np.asarray(partition.indices)
        #: int64 original ID of each owned node: draws are keyed by it, so they do not
        #: depend on how the graph was partitioned.
        self._orig_ids = np.ascontiguousarray(partition.orig_ids, dtype=np.int64)
        num_nodes = partition.manifest.num_nodes
        self._dense_maps = (_DenseMapPool(num_nodes) if num_nodes <= DENSE_RELABEL_MAX_NODES
                            else None)
        self._weight: np.ndarray | None = None
        self._cum_weight: np.ndarray | None = None
        if weighted:
            assert partition.edge_weight is not None  # checked by NeighborSampler
            self._weight = np.asarray(partition.edge_weight)
            with K.parallel_guard():
                self._cum_weight = K.segmented_cumsum(self._indptr, self._weight)

    def sample_neighbors(self, nodes: torch.Tensor, fanout: int, key: int, hop: int) -> HopSample:
        if int(fanout) < -1:
            raise ValueError(f"fanout: expected an integer >= 0, or -1 for all; got {fanout}")
        ids = _as_ids(nodes, "nodes")
        self.check_owned(torch.from_numpy(ids), "nodes")
        args = (self._orig_ids, self.node_start, ids, int(fanout), np.uint64(int(key) & _MASK64), int(hop),
                self.replace)
        if self._weight is not None and self._cum_weight is not None:
            offsets, out = K.sample_weighted(self._indptr, self._indices, self._weight,
                                             self._cum_weight, *args)
        else:
            offsets, out = K.sample_uniform(self._indptr, self._indices, *args)
        return HopSample(counts=torch.from_numpy(np.diff(offsets)), neighbors=torch.from_numpy(out))

    def new_relabeler(self, seeds: torch.Tensor) -> Relabeler:
        ids = _as_ids(seeds, "seeds")
        if self._dense_maps is not None:
            return DenseRelabeler(ids, self._dense_maps)
        return CpuRelabeler(ids)

    def gather_local(
        self, nodes: torch.Tensor, features: bool, labels: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        ids = _as_ids(nodes, "nodes")
        self.check_owned(torch.from_numpy(ids), "nodes")
        if features and labels:
            xs, ys = K.gather_with_labels(self.partition.x, self.partition.y, ids, self.node_start)
            return torch.from_numpy(xs), torch.from_numpy(ys)
        x = torch.from_numpy(K.gather(self.partition.x, ids, self.node_start)) if features else None
        y = torch.from_numpy(K.gather(self.partition.y, ids, self.node_start)) if labels else None
        return x, y
