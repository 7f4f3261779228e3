"""Property checks of typed minibatches against the original graph, and in-process peers
for multi-partition typed sampling."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from partitioner.graph import EdgeType
from partitioner.hetero_format import load_hetero_node_map, load_hetero_partition, read_hetero_manifest
from partitioner.typed import TypedGraphData
from sampling_server.sampler.hetero_base import HeteroNeighborSampler
from sampling_server.sampler.hetero_types import HeteroMinibatch
from sampling_server.sampler.types import HopSample


class LocalHeteroPeers:
    """The ``remote`` of a typed sampler, answered by the other partitions' samplers in
    process (what a peer's servicer would call)."""

    def __init__(self, samplers: Sequence[HeteroNeighborSampler]):
        self.samplers = list(samplers)
        #: Frontier nodes asked of each partition, across calls.
        self.asked: dict[int, int] = {}

    def sample(self, edge_type: EdgeType, nodes_by_partition: Mapping[int, torch.Tensor],
               fanout: int, key: int, hop: int) -> dict[int, HopSample]:
        out = {}
        for p, nodes in nodes_by_partition.items():
            self.asked[p] = self.asked.get(p, 0) + int(nodes.numel())
            peer = self.samplers[p]
            s = peer.sample_relation(edge_type, nodes.to(peer.device), fanout, key, hop)
            out[p] = HopSample(s.counts.cpu(), s.neighbors.cpu())
        return out

    def node_data(self, node_type: str, nodes_by_partition: Mapping[int, torch.Tensor],
                  features: bool, labels: bool
                  ) -> dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]:
        out: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        for p, nodes in nodes_by_partition.items():
            peer = self.samplers[p]
            x, y = peer.gather_local(node_type, nodes.to(peer.device), features, labels)
            out[p] = (None if x is None else x.cpu(), None if y is None else y.cpu())
        return out

    def orig_ids(self, node_type: str, nodes_by_partition: Mapping[int, torch.Tensor]
                 ) -> dict[int, torch.Tensor]:
        return {p: self.samplers[p].orig_ids_local(node_type, nodes)
                for p, nodes in nodes_by_partition.items()}


def node_maps(root: Path, graph: TypedGraphData) -> dict[str, np.ndarray]:
    """Original ID -> global ID, per node type, of the partitioning at ``root``."""
    return {t: np.asarray(load_hetero_node_map(root, t)) for t in graph.node_types}


def load_all(root: Path) -> list:  # type: ignore[type-arg]
    m = read_hetero_manifest(root)
    return [load_hetero_partition(root, p) for p in range(m.num_partitions)]


def _in_degree(graph: TypedGraphData, et: EdgeType) -> np.ndarray:
    return np.bincount(graph.edge_index[et][1], minlength=graph.num_nodes[et[2]])


def _pair_codes(graph: TypedGraphData, et: EdgeType, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    return src.astype(np.int64) * graph.num_nodes[et[2]] + dst.astype(np.int64)


def check_hetero_batch(
    graph: TypedGraphData, maps: Mapping[str, np.ndarray], batch: HeteroMinibatch,
    seed_type: str, seeds_orig: np.ndarray, fanouts: Mapping[EdgeType, list[int]],
) -> None:
    """Every property a typed batch must have, checked through original IDs."""
    s = batch.structure
    assert set(s.node) == set(graph.node_types) and set(s.row) == set(graph.edge_types)
    assert s.input_type == seed_type and s.batch_size == seeds_orig.size
    orig = {t: batch.orig_id[t].numpy() for t in graph.node_types}
    np.testing.assert_array_equal(orig[seed_type][: seeds_orig.size], seeds_orig)
    for t in graph.node_types:
        n_id = s.node[t].cpu().numpy()
        assert np.unique(n_id).size == n_id.size, f"{t}: repeated nodes"
        np.testing.assert_array_equal(maps[t][orig[t]], n_id)  # n_id and orig_id agree
        assert sum(s.num_sampled_nodes[t]) == n_id.size
        assert len(s.num_sampled_nodes[t]) == len(next(iter(fanouts.values()))) + 1
        if t != seed_type:
            assert s.num_sampled_nodes[t][0] == 0
    for et in graph.edge_types:
        _check_edges(graph, batch, et, fanouts[et], orig)
    _check_first_seen(graph, batch)
    _check_data(graph, batch, orig)


def _check_edges(graph: TypedGraphData, batch: HeteroMinibatch, et: EdgeType, fanout: list[int],
                 orig: Mapping[str, np.ndarray]) -> None:
    s = batch.structure
    src_t, _, dst_t = et
    row, col = s.row[et].cpu().numpy(), s.col[et].cpu().numpy()
    assert row.size == col.size == sum(s.num_sampled_edges[et])
    assert len(s.num_sampled_edges[et]) == len(fanout)
    src, dst = orig[src_t][row], orig[dst_t][col]
    codes = _pair_codes(graph, et, src, dst)
    graph_codes, mult = np.unique(_pair_codes(graph, et, *graph.edge_index[et]), return_counts=True)
    assert np.isin(codes, graph_codes).all(), f"{et}: a sampled edge is not in the graph"
    got_codes, got_mult = np.unique(codes, return_counts=True)  # without replacement:
    assert (got_mult <= mult[np.searchsorted(graph_codes, got_codes)]).all()  # each edge once
    degree = _in_degree(graph, et)
    nsn, e0 = s.num_sampled_nodes[dst_t], 0
    for hop, k in enumerate(fanout):
        e1 = e0 + s.num_sampled_edges[et][hop]
        lo, hi = sum(nsn[:hop]), sum(nsn[: hop + 1])  # dst nodes added by the previous hop
        c = col[e0:e1]
        assert ((c >= lo) & (c < hi)).all(), f"{et} hop {hop}: targets outside the frontier"
        assert (np.diff(c) >= 0).all(), f"{et} hop {hop}: edges not grouped by target"
        d = degree[orig[dst_t][lo:hi]]
        expected = d if k == -1 else np.minimum(d, k)
        np.testing.assert_array_equal(np.bincount(c - lo, minlength=hi - lo), expected,
                                      err_msg=f"{et} hop {hop}: per-target draws")
        e0 = e1


def _check_first_seen(graph: TypedGraphData, batch: HeteroMinibatch) -> None:
    """Each hop's new nodes of a type are its edges' sources not seen before, in order
    of first appearance, relation after relation in the graph's edge-type order."""
    s = batch.structure
    offsets = {et: np.concatenate([[0], np.cumsum(s.num_sampled_edges[et])]) for et in s.row}
    for t in graph.node_types:
        nsn = s.num_sampled_nodes[t]
        for hop in range(len(nsn) - 1):
            lo, hi = sum(nsn[: hop + 1]), sum(nsn[: hop + 2])
            seq = np.concatenate([s.row[et].cpu().numpy()[offsets[et][hop]:offsets[et][hop + 1]]
                                  for et in graph.edge_types if et[0] == t] or [np.empty(0, np.int64)])
            assert (seq < hi).all()
            fresh = seq[seq >= lo]
            _, first = np.unique(fresh, return_index=True)
            np.testing.assert_array_equal(fresh[np.sort(first)], np.arange(lo, hi))


def _check_data(graph: TypedGraphData, batch: HeteroMinibatch, orig: Mapping[str, np.ndarray]) -> None:
    assert set(batch.x) == set(graph.x)  # featureless types get no features
    for t, x in batch.x.items():
        np.testing.assert_array_equal(x.cpu().numpy(), graph.x[t][orig[t]])
    assert batch.y is not None and batch.target_type == graph.target_type
    np.testing.assert_array_equal(batch.y.cpu().numpy(), graph.y[orig[graph.target_type]])


def assert_same_batch(a: HeteroMinibatch, b: HeteroMinibatch) -> None:
    """Equal in original IDs: nodes, edges, counts, features, labels."""
    sa, sb = a.structure, b.structure
    assert sa.num_sampled_nodes == sb.num_sampled_nodes
    assert sa.num_sampled_edges == sb.num_sampled_edges
    for t in sa.node:
        assert torch.equal(a.orig_id[t], b.orig_id[t]), t
    for et in sa.row:
        assert torch.equal(sa.row[et].cpu(), sb.row[et].cpu()), et
        assert torch.equal(sa.col[et].cpu(), sb.col[et].cpu()), et
    assert set(a.x) == set(b.x)
    for t in a.x:
        assert torch.equal(a.x[t].cpu(), b.x[t].cpu()), t
    assert (a.y is None) == (b.y is None)
    if a.y is not None and b.y is not None:
        assert torch.equal(a.y.cpu(), b.y.cpu())
