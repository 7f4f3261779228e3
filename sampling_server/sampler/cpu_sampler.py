"""The CPU sampler: :class:`NeighborSampler` over Numba ``@njit`` kernels.

Tensors are torch CPU tensors; they cross to the kernels as NumPy views
(``Tensor.numpy()``) and come back with ``torch.from_numpy``, without copies. The
partition's arrays stay as loaded (read-only memory maps by default): nothing is copied
at start-up except, for weighted sampling, the float64 per-node prefix sums of the edge
weights (8 bytes per edge).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from partitioner.format import NodeData, Partition, Structure
from sampling_server.sampler import cpu_fused as F
from sampling_server.sampler import cpu_gather as G
from sampling_server.sampler import cpu_kernels as K
from sampling_server.sampler.base import (
    NeighborSampler,
    Relabeler,
    RemoteNeighbors,
    check_fanouts,
    int64_array,
    numpy_words,
    torch_dtype,
)
from sampling_server.sampler.types import HopSample, SamplerOutput

_MASK64 = (1 << 64) - 1


def _gathers_into(src_x: np.ndarray, dtype: torch.dtype) -> bool:
    """Whether the gather kernels copy rows of ``src_x`` straight into ``dtype``: C-contiguous
    rows, as stored or float32 narrowed to bfloat16."""
    return src_x.ndim == 2 and src_x.flags.c_contiguous and (
        dtype == torch_dtype(src_x.dtype) or (dtype == torch.bfloat16 and src_x.dtype == np.float32))
#: Initial relabel table size, in expected nodes per seed (the table grows as needed).
NODES_PER_SEED_HINT = 16


def _as_ids(nodes: torch.Tensor | np.ndarray, field: str) -> np.ndarray:
    """A C-contiguous int64 NumPy view (or copy, if needed) of a 1-D ID tensor."""
    if isinstance(nodes, torch.Tensor):
        if nodes.device.type != "cpu":
            raise ValueError(f"{field}: expected a CPU tensor, got one on {nodes.device}")
        if nodes.dtype != torch.int64:
            raise ValueError(f"{field}: expected int64 node IDs, got {nodes.dtype}")
        arr = nodes.numpy()  # (integer tensors need no detach: they never require grad)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
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


class _DenseMapPool:
    """Dense relabel maps (global ID -> local ID) of ``num_nodes`` entries, all
    :data:`~cpu_fused.UNSEEN`, one per batch being sampled at once; a batch resets the
    entries it set before it gives its map back."""

    def __init__(self, num_nodes: int):
        self.num_nodes = num_nodes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        dtype = np.int32 if self.num_nodes < 2**31 else np.int64
        return np.full(self.num_nodes, F.UNSEEN, dtype=dtype)

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

    def __init__(self, partition: Partition, *, replace: bool = False, weighted: bool = False,
                 structure: Structure | None = None, node_data: NodeData | None = None):
        super().__init__(partition, replace=replace, weighted=weighted, structure=structure,
                         node_data=node_data)
        csc = self.structure
        self._indptr = np.asarray(csc.indptr)
        self._indices = np.asarray(csc.indices)
        #: int64 original ID of each node of the structure: draws are keyed by it, so they
        #: do not depend on how the graph was partitioned.
        self._orig_ids = np.ascontiguousarray(csc.orig_ids, dtype=np.int64)
        self._csc = F.CscView(self._indptr, self._indices, self._orig_ids, self.draw_start)
        if self.structure.node_range == (self.node_start, self.node_stop):
            self._orig_identity = self._csc.orig_is_global  # for orig_ids_of: known already
        num_nodes = partition.manifest.num_nodes
        self._dense_maps = (_DenseMapPool(num_nodes) if num_nodes <= DENSE_RELABEL_MAX_NODES
                            else None)
        self._weight: np.ndarray | None = None
        self._cum_weight: np.ndarray | None = None
        if weighted:
            assert csc.edge_weight is not None  # checked by NeighborSampler
            self._weight = np.asarray(csc.edge_weight)
            with K.parallel_guard():
                self._cum_weight = K.segmented_cumsum(self._indptr, self._weight)

    def sample_neighbors(self, nodes: torch.Tensor, fanout: int, key: int, hop: int) -> HopSample:
        if int(fanout) < -1:
            raise ValueError(f"fanout: expected an integer >= 0, or -1 for all; got {fanout}")
        ids = _as_ids(nodes, "nodes")
        self.check_drawable(torch.from_numpy(ids), "nodes")
        args = (self._orig_ids, self.draw_start, ids, int(fanout), np.uint64(int(key) & _MASK64), int(hop),
                self.replace)
        if self._weight is not None and self._cum_weight is not None:
            offsets, out = K.sample_weighted(self._indptr, self._indices, self._weight,
                                             self._cum_weight, *args)
        else:
            offsets, out = K.sample_uniform(self._indptr, self._indices, *args)
        return HopSample(counts=torch.from_numpy(np.diff(offsets)), neighbors=torch.from_numpy(out))

    def sample(
        self, seeds: torch.Tensor | np.ndarray, fanouts: Sequence[int], key: int,
        remote: RemoteNeighbors | None = None,
    ) -> SamplerOutput:
        """As :meth:`NeighborSampler.sample`. With a dense relabel map, every hop is
        relabelled by :mod:`cpu_fused`'s passes straight into the batch's arrays, and a
        hop whose frontier is all owned here (uniform draws, fanout up to
        :data:`~cpu_kernels.STRIDE_MAX_FANOUT`) is drawn in the same passes."""
        if self._dense_maps is None:
            return super().sample(seeds, fanouts, key, remote)
        hops = check_fanouts(fanouts)
        seeds_t = self._seed_ids(seeds, remote)
        ids = seeds_t.numpy()
        n_cap, e_cap = F.capacity(ids.size, hops, self._dense_maps.num_nodes)
        local_of = self._dense_maps.take()
        try:
            nodes = F.NodeList(local_of, ids, n_cap)
        except ValueError:
            self._dense_maps.give_back(local_of)
            raise
        edges = F.EdgeList(e_cap)
        per_hop, lo = [nodes.count], 0
        try:
            for hop, fanout in enumerate(hops):
                hi = nodes.count
                self._sample_hop(nodes, edges, lo, hi, fanout, key, hop, remote)
                per_hop.append(nodes.count - hi)
                lo = hi
        finally:
            nodes.close()
            self._dense_maps.give_back(local_of)
        return SamplerOutput(n_id=torch.from_numpy(nodes.ids()),
                             row=torch.from_numpy(edges.row[:edges.size]),
                             col=torch.from_numpy(edges.col[:edges.size]),
                             num_sampled_nodes=per_hop, num_sampled_edges=edges.per_hop)

    def _seed_ids(self, seeds: torch.Tensor | np.ndarray, remote: RemoteNeighbors | None) -> torch.Tensor:
        """Seeds as a CPU int64 tensor, checked as :meth:`NeighborSampler.sample` checks them."""
        if isinstance(seeds, np.ndarray):  # copies: split arrays are read-only memmaps
            seeds = torch.from_numpy(np.array(seeds, dtype=np.int64))
        if seeds.device.type != "cpu" or seeds.dtype != torch.int64:
            seeds = seeds.to(device="cpu", dtype=torch.int64)
        seeds_t = torch.from_numpy(_as_ids(seeds, "seeds"))
        if remote is None:
            self.check_drawable(seeds_t, "seeds")
        else:
            self.check_in_graph(seeds_t, "seeds")
        return seeds_t

    def _sample_hop(self, nodes: F.NodeList, edges: F.EdgeList, lo: int, hi: int, fanout: int,
                    key: int, hop: int, remote: RemoteNeighbors | None) -> None:
        """Draw and relabel the hop of frontier ``n_id[lo:hi]`` into ``nodes`` and ``edges``."""
        frontier = nodes.ids(lo, hi)
        frontier_t = torch.from_numpy(frontier)
        if self.draws_all(frontier_t) and not self.weighted and 0 <= fanout <= K.STRIDE_MAX_FANOUT:
            F.draw_hop(nodes, edges, lo, self._csc, frontier, fanout,
                       np.uint64(int(key) & _MASK64), hop, self.replace)
            return
        drawn = self.sample_frontier(frontier_t, fanout, key, hop, remote)
        F.relabel_hop(nodes, edges, lo, _as_ids(drawn.neighbors, "neighbors"),
                      _as_ids(drawn.counts, "counts"), hop)

    def new_relabeler(self, seeds: torch.Tensor) -> Relabeler:
        """A hash-table relabeler: the generic path's, used when the graph is too large
        for dense maps (:meth:`sample` numbers through a dense map otherwise)."""
        return CpuRelabeler(_as_ids(seeds, "seeds"))

    def gather_local(
        self, nodes: torch.Tensor, features: bool, labels: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        ids = _as_ids(nodes, "nodes")
        self.check_held(torch.from_numpy(ids), "nodes")
        rows = self.node_data
        if features and labels:
            xs, ys = G.gather_with_labels(rows.x, rows.y, ids, self.hold_start)
            return torch.from_numpy(xs), torch.from_numpy(ys)
        x = torch.from_numpy(G.gather(rows.x, ids, self.hold_start)) if features else None
        y = torch.from_numpy(G.gather(rows.y, ids, self.hold_start)) if labels else None
        return x, y

    def gather_local_into_blocks(self, nodes: torch.Tensor, positions: torch.Tensor,
                                 blocks: Sequence[tuple[int, int, torch.Tensor]],
                                 layout: G.RowBlocks | None) -> None:
        """One parallel pass over every block (:func:`cpu_gather.gather_into_blocks`),
        float32 features narrowed to bfloat16 blocks on the way."""
        src_x = np.asarray(self.node_data.x)
        if layout is None or not blocks or not _gathers_into(src_x, blocks[0][2].dtype):
            super().gather_local_into_blocks(nodes, positions, blocks, layout)
            return
        ids = _as_ids(nodes, "nodes")
        self.check_held(torch.from_numpy(ids), "nodes")
        pos = int64_array(positions)
        G.gather_into_blocks(src_x, ids, self.hold_start, pos, layout)

    def gather_local_into(self, nodes: torch.Tensor, positions: torch.Tensor,
                          x: torch.Tensor | None, y: torch.Tensor | None) -> None:
        """One parallel pass per tensor: each row read from :attr:`node_data` and written
        to its place (float32 features narrowed to a bfloat16 ``x`` on the way)."""
        ids = _as_ids(nodes, "nodes")
        self.check_held(torch.from_numpy(ids), "nodes")
        pos = int64_array(positions)
        src_x, src_y = np.asarray(self.node_data.x), np.asarray(self.node_data.y)
        direct_x = x is None or (x.is_contiguous() and _gathers_into(src_x, x.dtype))
        direct_y = y is None or (y.is_contiguous() and y.dtype == torch.int64
                                 and src_y.dtype == np.int64 and src_y.flags.c_contiguous)
        if not (direct_x and direct_y):
            super().gather_local_into(nodes, positions, x, y)
            return
        if x is not None:
            G.gather_into(src_x, ids, self.hold_start, pos, numpy_words(x))
        if y is not None:
            G.gather_into(src_y, ids, self.hold_start, pos, y.numpy())
