"""The CPU sampler: :class:`NeighborSampler` over Numba ``@njit`` kernels, run per relation.

Tensors are torch CPU tensors; they cross to the kernels as NumPy views
(``Tensor.numpy()``) and come back with ``torch.from_numpy``, without copies. Each
relation's CSC (over the destination type's nodes whose in-edges are here, sources as
global IDs of the source type) is drawn with the destination type's original IDs and
first ID, so a relation is sampled exactly as a plain graph is: by :mod:`cpu_fused`'s
hops straight into the batch's arrays (one dense relabel map per node type), or by
:func:`cpu_kernels.sample_neighbors` (uniform or weighted) for peers and
the generic path. The partition's arrays stay as loaded (read-only memory maps by
default): nothing is copied at start-up except, for weighted sampling, the float64
per-node prefix sums of the edge weights (8 bytes per edge).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from partitioner.graph import EdgeType
from partitioner.partition import NodeData, Partition, Structure
from sampling_server.sampler import cpu_fused as F
from sampling_server.sampler import cpu_gather as G
from sampling_server.sampler import cpu_kernels as K
from sampling_server.sampler.base import NeighborSampler, Relabeler, Seeds
from sampling_server.sampler.fanouts import NumNeighbors, normalize_num_neighbors, num_hops
from sampling_server.sampler.gather import Blocks
from sampling_server.sampler.peers import NodeRows, Remote, edges_of
from sampling_server.sampler.rows import int64_array, is_identity, numpy_words, torch_dtype
from sampling_server.sampler.types import HopSample, SamplerOutput

#: Initial relabel table size, in expected nodes per seed (the table grows as needed).
NODES_PER_SEED_HINT = 16
#: Graphs with at most this many nodes of a type relabel through dense maps (4 bytes a
#: node per batch in flight); larger ones through per-batch hash tables.
DENSE_RELABEL_MAX_NODES = 1 << 28


def _gathers_into(src_x: np.ndarray, dtype: torch.dtype) -> bool:
    """Whether the gather kernels copy rows of ``src_x`` straight into ``dtype``: C-contiguous
    rows, as stored or float32 or float16 narrowed to bfloat16."""
    return src_x.ndim == 2 and src_x.flags.c_contiguous and (
        dtype == torch_dtype(src_x.dtype)
        or (dtype == torch.bfloat16 and src_x.dtype in (np.float32, np.float16)))


def as_ids(nodes: torch.Tensor | np.ndarray, field: str) -> np.ndarray:
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
    """Dedup and relabel of one batch's nodes of one type: an open-addressing hash table
    (global ID -> local ID) of power-of-two size, at most half full, doubled as it fills."""

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
        ids = as_ids(neighbors, "neighbors")
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


class CpuNeighborSampler(NeighborSampler):
    """Neighbor sampling of one partition on the CPU (Numba ``@njit`` kernels, parallel
    over frontier nodes within each relation)."""

    device = torch.device("cpu")

    def __init__(self, partition: Partition, *, replace: bool = False, weighted: bool = False,
                 structure: Structure | None = None, node_data: NodeData | None = None):
        super().__init__(partition, replace=replace, weighted=weighted, structure=structure,
                         node_data=node_data)
        csc = self.structure
        self._indptr = {et: np.asarray(csc.indptr[et]) for et in self.edge_types}
        self._indices = {et: np.asarray(csc.indices[et]) for et in self.edge_types}
        #: int64 original IDs of the nodes whose in-edges are here, per type: the keys of
        #: their draws, so that draws do not depend on how the graph was partitioned.
        self._orig_ids = {t: np.ascontiguousarray(csc.orig_ids[t], dtype=np.int64) for t in self.node_types}
        # one pass per node type (not per relation), shared with orig_ids_local
        self._identity = {t: is_identity(self._orig_ids[t], self.draw[t][0]) for t in self.node_types}
        self._csc = {et: F.CscView(self._indptr[et], self._indices[et], self._orig_ids[et[2]],
                                   self.draw[et[2]][0], self._identity[et[2]], self.edge_start[et])
                     for et in self.edge_types}
        counts = {t: i.num_nodes for t, i in partition.manifest.node_types.items()}
        self._dense_maps = {t: F.DenseMaps(n) for t, n in counts.items() if n <= DENSE_RELABEL_MAX_NODES}
        #: Per weighted relation: the weights and their float64 per-node prefix sums.
        self._weights: dict[EdgeType, tuple[np.ndarray, np.ndarray]] = {}
        if weighted:
            with K.parallel_guard():
                for et in self.edge_types:
                    weight = np.asarray(csc.edge_weight[et])
                    self._weights[et] = (weight, K.segmented_cumsum(self._indptr[et], weight))

    def node_ids(self, nodes: torch.Tensor, field: str) -> torch.Tensor:
        return torch.from_numpy(as_ids(nodes, field))

    def sample_owned(self, edge_type: EdgeType, nodes: torch.Tensor, fanout: int, key: int,
                     hop: int, edges: bool = False) -> HopSample:
        ids, et = as_ids(nodes, "nodes"), edge_type
        if int(fanout) < -1:
            raise ValueError(f"fanout: expected an integer >= 0, or -1 for all; got {fanout}")
        stream = np.uint64(self.draw_key(key, et))
        offsets, out, edge_ids = K.sample_neighbors(
            self._indptr[et], self._indices[et], self._orig_ids[et[2]], self.draw[et[2]][0], ids,
            int(fanout), stream, int(hop), self.replace, self._weights.get(et),
            edge_start=self.edge_start[et], edges=edges)
        return HopSample(counts=torch.from_numpy(np.diff(offsets)), neighbors=torch.from_numpy(out),
                         edges=None if edge_ids is None else torch.from_numpy(edge_ids))

    def sample(self, seeds: Seeds, seed_type: str, num_neighbors: NumNeighbors,
               key: int, remote: Remote | None = None, edges: bool = False) -> SamplerOutput:
        """As :meth:`NeighborSampler.sample`. With dense relabel maps for every node type,
        each relation's hop is relabelled by :mod:`cpu_fused`'s passes straight into the
        batch's arrays (its edges' internal IDs too, with ``edges``), and drawn in the same
        passes when its frontier is all here (uniform draws, fanout up to
        :data:`~cpu_kernels.STRIDE_MAX_FANOUT`)."""
        if len(self._dense_maps) != len(self.node_types):
            return super().sample(seeds, seed_type, num_neighbors, key, remote, edges)
        fanouts = normalize_num_neighbors(num_neighbors, self.edge_types)
        hops = num_hops(fanouts)
        seeds_np = {t: as_ids(v, "seeds") for t, v in self.seed_tensors(seeds, seed_type, remote).items()}
        nodes: dict[str, F.NodeList] = {}
        try:
            node_cap, edge_cap = self._capacities({t: v.size for t, v in seeds_np.items()}, fanouts, hops)
            for t in self.node_types:
                nodes[t] = F.NodeList(self._dense_maps[t], seeds_np[t], node_cap[t])
            lists = {et: F.EdgeList(edge_cap[et], edges) for et in self.edge_types}
            per_hop = {t: [n.count] for t, n in nodes.items()}
            lo = dict.fromkeys(self.node_types, 0)
            for hop in range(hops):
                hi = {t: n.count for t, n in nodes.items()}
                for et in self.edge_types:
                    self._relation_hop(et, nodes, lists[et], lo[et[2]], hi[et[2]], fanouts[et][hop],
                                       key, hop, remote)
                for t, n in nodes.items():
                    per_hop[t].append(n.count - hi[t])
                lo = hi
        finally:
            for n in nodes.values():
                n.close()
        return SamplerOutput(
            input_type=seed_type, node={t: torch.from_numpy(n.ids()) for t, n in nodes.items()},
            row={et: torch.from_numpy(e.row[:e.size]) for et, e in lists.items()},
            col={et: torch.from_numpy(e.col[:e.size]) for et, e in lists.items()},
            num_sampled_nodes=per_hop, num_sampled_edges={et: e.per_hop for et, e in lists.items()},
            edge={et: torch.from_numpy(e.edge[:e.size]) for et, e in lists.items() if e.edge is not None})

    def _capacities(self, seeds: Mapping[str, int], fanouts: Mapping[EdgeType, list[int]],
                    hops: int) -> tuple[dict[str, int], dict[EdgeType, int]]:
        """First buffer sizes per node type and relation, from the seeds per type, when
        every draw is full (``-1`` counted as 16) and no frontier outgrows its type; they
        grow if short."""
        frontier = dict(seeds)
        node_cap, edge_cap = dict(frontier), dict.fromkeys(self.edge_types, 0)
        for hop in range(hops):
            added = dict.fromkeys(self.node_types, 0)
            for et in self.edge_types:
                f = fanouts[et][hop]
                drawn = frontier[et[2]] * (f if f >= 0 else 16)
                edge_cap[et] += drawn
                added[et[0]] += drawn
            for t in self.node_types:
                frontier[t] = min(added[t], self._dense_maps[t].num_nodes)
                node_cap[t] += frontier[t]
        return ({t: min(n, self._dense_maps[t].num_nodes, F.START_CAPACITY_MAX) for t, n in node_cap.items()},
                {et: min(n, F.START_CAPACITY_MAX) for et, n in edge_cap.items()})

    def _relation_hop(self, et: EdgeType, nodes: dict[str, F.NodeList], edges: F.EdgeList, lo: int,
                      hi: int, fanout: int, key: int, hop: int, remote: Remote | None) -> None:
        """Draw and relabel one relation's hop from the ``dst`` frontier ``n_id[lo:hi]``
        (with the edges' internal IDs when ``edges`` keeps them)."""
        src, _, dst = et
        frontier = nodes[dst].ids(lo, hi)
        if fanout == 0 or frontier.size == 0:
            edges.per_hop.append(0)
            return
        frontier_t = torch.from_numpy(frontier)
        if 0 <= fanout <= K.STRIDE_MAX_FANOUT and et not in self._weights \
                and self.draws_all(dst, frontier_t):
            F.draw_hop(nodes[src], edges, lo, self._csc[et], frontier, fanout,
                       np.uint64(self.draw_key(key, et)), hop, self.replace)
            return
        want_edges = edges.edge is not None
        drawn = self.sample_frontier(et, frontier_t, fanout, key, hop, remote, want_edges)
        F.relabel_hop(nodes[src], edges, lo, as_ids(drawn.neighbors, "neighbors"),
                      as_ids(drawn.counts, "counts"), hop,
                      as_ids(edges_of(drawn, "sample_frontier"), "edges") if want_edges else None)

    def new_relabeler(self, node_type: str, seeds: torch.Tensor) -> Relabeler:
        """A hash-table relabeler: the generic path's, used when a node type is too large
        for dense maps (:meth:`sample` numbers through dense maps otherwise)."""
        return CpuRelabeler(as_ids(seeds, "seeds"))

    def gather_owned(self, node_type: str, nodes: torch.Tensor, features: bool, labels: bool) -> NodeRows:
        ids = as_ids(nodes, "nodes")
        start = self.hold[node_type][0]
        src_x = self.node_data.x.get(node_type) if features else None
        src_y = self.node_data.y if labels and node_type == self.target_type else None
        if src_x is not None and src_y is not None:
            xs, ys = G.gather_with_labels(src_x, src_y, ids, start)
            return torch.from_numpy(xs), torch.from_numpy(ys)
        x = None if src_x is None else torch.from_numpy(G.gather(src_x, ids, start))
        y = None if src_y is None else torch.from_numpy(G.gather(src_y, ids, start))
        return x, y

    def gather_local_into_blocks(self, node_type: str, nodes: torch.Tensor, positions: torch.Tensor,
                                 blocks: Blocks, layout: G.RowBlocks | None) -> None:
        """One parallel pass over every block (:func:`cpu_gather.gather_into`),
        float32 features narrowed to bfloat16 blocks on the way."""
        src_x = np.asarray(self.node_data.x[node_type])
        if layout is None or not blocks or not _gathers_into(src_x, blocks[0][2].dtype):
            super().gather_local_into_blocks(node_type, nodes, positions, blocks, layout)
            return
        ids = as_ids(nodes, "nodes")
        self.check_held(node_type, torch.from_numpy(ids), "nodes")
        G.gather_into(src_x, ids, self.hold[node_type][0], int64_array(positions), layout,
                      bfloat16=blocks[0][2].dtype == torch.bfloat16)

    def gather_local_into(self, node_type: str, nodes: torch.Tensor, positions: torch.Tensor,
                          x: torch.Tensor | None, y: torch.Tensor | None) -> None:
        """One parallel pass per tensor: each row read from :attr:`node_data` and written
        to its place (float32 features narrowed to a bfloat16 ``x`` on the way)."""
        ids = as_ids(nodes, "nodes")
        self.check_held(node_type, torch.from_numpy(ids), "nodes")
        src_x = np.asarray(self.node_data.x[node_type]) if x is not None else None
        src_y = np.asarray(self.node_data.y) if y is not None else None
        direct_x = x is None or (src_x is not None and x.is_contiguous() and _gathers_into(src_x, x.dtype))
        direct_y = y is None or (src_y is not None and y.is_contiguous() and y.dtype == torch.int64
                                 and src_y.dtype == np.int64 and src_y.flags.c_contiguous)
        if not (direct_x and direct_y):
            super().gather_local_into(node_type, nodes, positions, x, y)
            return
        pos = int64_array(positions)
        start = self.hold[node_type][0]
        if x is not None and src_x is not None:
            G.gather_into(src_x, ids, start, pos, numpy_words(x), bfloat16=x.dtype == torch.bfloat16)
        if y is not None and src_y is not None:
            G.gather_into(src_y, ids, start, pos, y.numpy())
