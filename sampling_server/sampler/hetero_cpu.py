"""The CPU heterogeneous sampler: :class:`HeteroNeighborSampler` over the homogeneous
Numba ``@njit`` kernels, run per relation.

Each relation's CSC (over the owned destination nodes, sources as global IDs of the
source type) is drawn with the destination type's original IDs and first owned ID, so a
relation is sampled exactly as a homogeneous graph would be: by :mod:`cpu_fused`'s hops
into the batch's arrays (one dense map per node type), or by
:func:`cpu_kernels.sample_uniform` for peers and the generic path. Nothing is copied at
start-up: the partition's arrays stay read-only memory maps.
"""

from __future__ import annotations

import numpy as np
import torch

from partitioner.hetero import EdgeType
from partitioner.hetero_format import HeteroPartition
from sampling_server.sampler import cpu_fused as F
from sampling_server.sampler import cpu_gather as G
from sampling_server.sampler import cpu_kernels as K
from sampling_server.sampler.base import Relabeler, is_identity
from sampling_server.sampler.cpu_sampler import (
    DENSE_RELABEL_MAX_NODES,
    CpuRelabeler,
    _as_ids,
    _DenseMapPool,
)
from sampling_server.sampler.hetero_base import (
    HeteroNeighborSampler,
    HeteroRemote,
    NumNeighbors,
    normalize_num_neighbors,
    relation_key,
)
from sampling_server.sampler.hetero_types import HeteroSamplerOutput
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
        # one pass per node type (not per relation), shared with orig_ids_local
        self._orig_identity = {t: is_identity(self._orig_ids[t], self.node_range(t)[0])
                               for t in self.node_types}
        self._csc = {et: F.CscView(self._indptr[et], self._indices[et], self._orig_ids[et[2]],
                                   self.node_range(et[2])[0], self._orig_identity[et[2]])
                     for et in self.edge_types}
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

    def sample(self, seeds: torch.Tensor | np.ndarray, seed_type: str,
               num_neighbors: NumNeighbors, key: int,
               remote: HeteroRemote | None = None) -> HeteroSamplerOutput:
        """As :meth:`HeteroNeighborSampler.sample`. With dense relabel maps for every node
        type, each relation's hop is relabelled by :mod:`cpu_fused`'s passes
        straight into the batch's arrays (and drawn in the same passes when its frontier is
        all owned here)."""
        if len(self._dense_maps) != len(self.node_types):
            return super().sample(seeds, seed_type, num_neighbors, key, remote)
        fanouts = normalize_num_neighbors(num_neighbors, self.edge_types)
        hops = len(next(iter(fanouts.values()))) if fanouts else 0
        seeds_np = self._seed_tensor(seeds, seed_type, remote).numpy()
        nodes: dict[str, F.NodeList] = {}
        try:
            node_cap, edge_cap = self._capacities(seeds_np.size, seed_type, fanouts, hops)
            for t in self.node_types:
                first = seeds_np if t == seed_type else np.empty(0, dtype=np.int64)
                local_of = self._dense_maps[t].take()
                try:
                    nodes[t] = F.NodeList(local_of, first, node_cap[t])
                except ValueError:
                    self._dense_maps[t].give_back(local_of)
                    raise
            edges = {et: F.EdgeList(edge_cap[et]) for et in self.edge_types}
            per_hop = {t: [n.count] for t, n in nodes.items()}
            lo = dict.fromkeys(self.node_types, 0)
            for hop in range(hops):
                hi = {t: n.count for t, n in nodes.items()}
                for et in self.edge_types:
                    self._relation_hop(et, nodes, edges[et], lo[et[2]], hi[et[2]],
                                       fanouts[et][hop], key, hop, remote)
                for t, n in nodes.items():
                    per_hop[t].append(n.count - hi[t])
                lo = hi
        finally:
            for t, n in nodes.items():
                n.close()
                self._dense_maps[t].give_back(n.local_of)
        return HeteroSamplerOutput(
            input_type=seed_type, node={t: torch.from_numpy(n.ids()) for t, n in nodes.items()},
            row={et: torch.from_numpy(e.row[:e.size]) for et, e in edges.items()},
            col={et: torch.from_numpy(e.col[:e.size]) for et, e in edges.items()},
            num_sampled_nodes=per_hop, num_sampled_edges={et: e.per_hop for et, e in edges.items()})

    def _capacities(self, seeds: int, seed_type: str, fanouts: dict[EdgeType, list[int]],
                    hops: int) -> tuple[dict[str, int], dict[EdgeType, int]]:
        """First buffer sizes per node type and relation (full draws; ``-1`` counted as 16)."""
        frontier = {t: seeds if t == seed_type else 0 for t in self.node_types}
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
        return ({t: min(n, self._dense_maps[t].num_nodes, F.START_CAPACITY_MAX)
                 for t, n in node_cap.items()},
                {et: min(n, F.START_CAPACITY_MAX) for et, n in edge_cap.items()})

    def _relation_hop(self, et: EdgeType, nodes: dict[str, F.NodeList], edges: F.EdgeList,
                      lo: int, hi: int, fanout: int, key: int, hop: int,
                      remote: HeteroRemote | None) -> None:
        """Draw and relabel one relation's hop from the ``dst`` frontier ``n_id[lo:hi]``."""
        src, _, dst = et
        frontier = nodes[dst].ids(lo, hi)
        if fanout == 0 or frontier.size == 0:
            edges.per_hop.append(0)
            return
        start, stop = self.node_range(dst)
        if 0 <= fanout <= K.STRIDE_MAX_FANOUT and int(frontier.min()) >= start and int(
                frontier.max()) < stop:
            F.draw_hop(nodes[src], edges, lo, self._csc[et], frontier, fanout,
                       np.uint64(relation_key(key, et)), hop, self.replace)
            return
        drawn = self._sample_frontier(et, torch.from_numpy(frontier), fanout, key, hop, remote)
        F.relabel_hop(nodes[src], edges, lo, _as_ids(drawn.neighbors, "neighbors"),
                      _as_ids(drawn.counts, "counts"), hop)

    def new_relabeler(self, node_type: str, seeds: torch.Tensor) -> Relabeler:
        """A hash-table relabeler: the generic path's, used when a node type is too large
        for dense maps (:meth:`sample` numbers through dense maps otherwise)."""
        return CpuRelabeler(_as_ids(seeds, "seeds"))

    def gather_local(self, node_type: str, nodes: torch.Tensor, features: bool,
                     labels: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self.check_node_type(node_type, "node_type")
        ids = _as_ids(nodes, "nodes")
        self.check_owned(node_type, torch.from_numpy(ids), "nodes")
        start = self.node_range(node_type)[0]
        x_src = self.partition.x.get(node_type) if features else None
        want_y = labels and node_type == self.target_type
        if x_src is not None and want_y:
            xs, ys = G.gather_with_labels(x_src, self.partition.y, ids, start)
            return torch.from_numpy(xs), torch.from_numpy(ys)
        x = None if x_src is None else torch.from_numpy(G.gather(x_src, ids, start))
        y = torch.from_numpy(G.gather(self.partition.y, ids, start)) if want_y else None
        return x, y
