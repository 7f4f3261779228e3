"""Tiny graphs for the data-layer, sampler and service tests, plain and typed, written as
real partitions and loaded back; and the checks and in-process peers those tests share.

Tests of a capability are parametrized over :data:`KINDS`: a plain graph is the typed
graph of one node type and one edge type below the user's API, so the same test runs on
:func:`mixed_graph` (plain) and :func:`mixed_typed` (typed). Every graph's features
encode the original node ID (``x[v, j] = v + j / 100``) so a test can tell which node a
gathered row belongs to.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from partitioner.format import load_node_map, load_partition, read_manifest
from partitioner.graph import (
    PLAIN_EDGE_TYPE,
    PLAIN_NODE_TYPE,
    EdgeType,
    GraphData,
    TypedGraphData,
    plain_view,
)
from partitioner.partition import Partition
from partitioner.synthetic import generate
from partitioner.writer import partition_graph
from sampling_server.sampler.base import NeighborSampler
from sampling_server.sampler.cpu_sampler import CpuNeighborSampler
from sampling_server.sampler.types import HopSample, Minibatch, SamplerOutput

#: The graph kinds every capability is tested on.
KINDS = ("plain", "typed")
#: Node of :func:`mixed_graph` whose in-neighbors are (almost) all other active nodes
#: (in :func:`mixed_typed`: a paper that every other active paper cites).
HUB = 5
#: Nodes of :func:`mixed_graph` with no edges at all (the last ones; in :func:`mixed_typed`
#: the last papers, authors and topics).
NUM_ISOLATED = 3
#: Edges of :func:`mixed_graph` that appear more than once (source, target, times).
REPEATED_EDGES = ((1, 2, 3), (3, 4, 2))
#: The sampling modes ``(replace, weighted)``, and their test IDs.
MODES = [(False, False), (True, False), (False, True), (True, True)]
MODE_IDS = ["uniform", "replace", "weighted", "weighted-replace"]

AnyGraph = GraphData | TypedGraphData


def _node_data(num_nodes: int, feature_dim: int, num_classes: int) -> dict[str, np.ndarray]:
    v = np.arange(num_nodes, dtype=np.int64)
    x = (v[:, None] + np.arange(feature_dim)[None, :] / 100).astype(np.float32)
    y = v % num_classes
    y[v % 7 == 6] = -1
    return {"x": x, "y": y}


def _edges(gen: np.random.Generator, n_src: int, n_dst: int, hub: int | None) -> np.ndarray:
    """Random edges among the active nodes (the last :data:`NUM_ISOLATED` of each end
    have none), every other active source into ``hub``, repeated edges and a self loop
    (when both ends are of one type), shuffled."""
    a_src, a_dst = n_src - NUM_ISOLATED, n_dst - NUM_ISOLATED
    src = [gen.integers(0, a_src, 3 * max(a_src, a_dst))]
    dst = [gen.integers(0, a_dst, 3 * max(a_src, a_dst))]
    if hub is not None:
        others = np.setdiff1d(np.arange(a_src), [hub])
        src.append(others)
        dst.append(np.full(others.size, hub))
    for s, t, times in REPEATED_EDGES:
        src.append(np.full(times, s))
        dst.append(np.full(times, t))
    if n_src == n_dst:
        src.append(np.array([7]))
        dst.append(np.array([7]))
    edge_index = np.stack([np.concatenate(src), np.concatenate(dst)]).astype(np.int64)
    return np.ascontiguousarray(edge_index[:, gen.permutation(edge_index.shape[1])])


def _splits(num_nodes: int) -> dict[str, np.ndarray]:
    return {"train": np.arange(0, num_nodes, 2, dtype=np.int64),
            "val": np.arange(1, num_nodes, 4, dtype=np.int64),
            "test": np.arange(3, num_nodes, 4, dtype=np.int64)}


def mixed_graph(num_nodes: int = 48, *, weighted: bool = True, seed: int = 0) -> GraphData:
    """A small directed graph with the cases samplers get wrong: a high-degree hub
    (:data:`HUB`, in-degree ~ ``num_nodes``), isolated nodes (the last
    :data:`NUM_ISOLATED`), repeated edges (:data:`REPEATED_EDGES`), a self loop, and
    positive float32 edge weights (when ``weighted``). Edges are shuffled."""
    gen = np.random.default_rng(seed)
    edge_index = _edges(gen, num_nodes, num_nodes, HUB)
    weight = np.asarray(gen.uniform(0.1, 5.0, edge_index.shape[1]), np.float32) if weighted else None
    graph = GraphData(name="mixed", num_nodes=num_nodes, edge_index=edge_index, num_classes=4,
                      splits=_splits(num_nodes), edge_weight=weight, **_node_data(num_nodes, 6, 4))
    graph.validate()
    return graph


def mixed_typed(*, weighted: bool = True, seed: int = 0) -> TypedGraphData:
    """The typed counterpart of :func:`mixed_graph`: papers (features, labels, the target
    type), authors (features of another width) and topics (no features); relations
    ``author writes paper`` (with the hub), ``paper cites paper`` (repeated edges, a self
    loop), ``paper has_topic topic`` and its reverse; every relation weighted when
    ``weighted``. Two relations end at papers, so a paper draws independently for each."""
    gen = np.random.default_rng(seed)
    counts = {"paper": 40, "author": 30, "topic": 12}
    edges: dict[EdgeType, np.ndarray] = {
        ("author", "writes", "paper"): _edges(gen, 30, 40, HUB),
        ("paper", "cites", "paper"): _edges(gen, 40, 40, None),
        ("paper", "has_topic", "topic"): _edges(gen, 40, 12, None),
    }
    has_topic = edges[("paper", "has_topic", "topic")]
    edges[("topic", "rev_has_topic", "paper")] = np.ascontiguousarray(has_topic[::-1])
    weights = {et: np.asarray(gen.uniform(0.1, 5.0, ei.shape[1]), np.float32) for et, ei in edges.items()} \
        if weighted else {}
    papers = _node_data(40, 6, 4)
    authors = _node_data(30, 3, 4)
    graph = TypedGraphData(name="mixed-typed", num_nodes=counts, edge_index=edges,
                           x={"paper": papers["x"], "author": authors["x"] + 1000.0},
                           target_type="paper", y=papers["y"], num_classes=4, splits=_splits(40),
                           edge_weight=weights)
    graph.validate()
    return graph


def mixed(kind: str, *, weighted: bool = True, seed: int = 0) -> AnyGraph:
    """The mixed graph of ``kind`` (one of :data:`KINDS`)."""
    if kind == "plain":
        return mixed_graph(weighted=weighted, seed=seed)
    return mixed_typed(weighted=weighted, seed=seed)


def typed_view(graph: AnyGraph) -> TypedGraphData:
    """Any graph as the typed model (a plain graph: one node and edge type)."""
    return plain_view(graph) if isinstance(graph, GraphData) else graph


def star_graph(degree: int = 20, weights: Sequence[float] | None = None) -> GraphData:
    """Node 0 with in-edges from ``1 .. degree`` (in that CSC order), optionally
    weighted (``weights[i]`` on the edge from ``i + 1``)."""
    if weights is not None:
        degree = len(weights)
    src = np.arange(1, degree + 1, dtype=np.int64)
    edge_index = np.stack([src, np.zeros(degree, dtype=np.int64)])
    weight = None if weights is None else np.asarray(weights, dtype=np.float32)
    graph = GraphData(name="star", num_nodes=degree + 1, edge_index=edge_index, num_classes=2,
                      splits={"train": np.array([0], dtype=np.int64)}, edge_weight=weight,
                      **_node_data(degree + 1, 3, 2))
    graph.validate()
    return graph


def write_and_load(graph: AnyGraph, root: Path, num_parts: int, method: str = "range") -> list[Partition]:
    """Partition ``graph`` into ``root`` (``partition_graph``) and load every partition
    (read-only memory maps, as a server loads them)."""
    partition_graph(graph, num_parts, root, method=method, progress=False)
    return [load_partition(root, p) for p in range(read_manifest(root).num_partitions)]


class Parted(NamedTuple):
    """A partitioned graph: where it was written, its partitions, and per node type the
    original ID -> global ID map."""

    root: Path
    parts: list[Partition]
    maps: dict[str, np.ndarray]

    def orig_of(self, node_type: str) -> np.ndarray:
        """Global ID -> original ID of ``node_type``."""
        return np.argsort(self.maps[node_type])


def parted(graph: AnyGraph, root: Path, parts: int, method: str) -> Parted:
    """:func:`write_and_load`, with the node maps (checked against the partitions): a
    ``range`` partitioning keeps every original ID, a ``random`` one renumbers every type."""
    partitions = write_and_load(graph, root, parts, method=method)
    out = Parted(root, partitions, check_node_maps(root, partitions))
    kept = [np.array_equal(m, np.arange(m.size)) for m in out.maps.values()]
    assert all(kept) if method == "range" else not any(kept) if method == "random" else True, method
    return out


def cpu_samplers(parts: Sequence[Partition], replace: bool = False, weighted: bool = False,
                 **kw: Any) -> list[CpuNeighborSampler]:
    """A CPU sampler of each partition."""
    return [CpuNeighborSampler(p, replace=replace, weighted=weighted, **kw) for p in parts]


def node_maps_of(partitions: Sequence[Partition]) -> dict[str, np.ndarray]:
    """Per node type, original ID -> global ID of a partitioned graph (from ``orig_ids``)."""
    m = partitions[0].manifest
    maps = {t: np.empty(i.num_nodes, dtype=np.int64) for t, i in m.node_types.items()}
    for part in partitions:
        for t in part.node_types:
            start, stop = part.node_range(t)
            maps[t][np.asarray(part.orig_ids[t])] = np.arange(start, stop)
    return maps


def check_node_maps(root: Path, partitions: Sequence[Partition]) -> dict[str, np.ndarray]:
    """The written node maps, asserted to agree with the partitions' ``orig_ids``."""
    maps = node_maps_of(partitions)
    for t, node_map in maps.items():
        assert np.array_equal(np.asarray(load_node_map(root, t)), node_map), t
    return maps


def global_adjacency(partitions: Sequence[Partition]) -> dict[EdgeType, dict[int, list[int]]]:
    """Per edge type, every global destination ID -> its in-neighbors (global IDs of the
    source type, CSC order, repeats kept)."""
    adj: dict[EdgeType, dict[int, list[int]]] = {}
    for part in partitions:
        for et in part.edge_types:
            start = part.node_range(et[2])[0]
            indptr, indices = np.asarray(part.indptr[et]), np.asarray(part.indices[et])
            rel = adj.setdefault(et, {})
            for i in range(part.num_nodes(et[2])):
                rel[start + i] = indices[indptr[i]:indptr[i + 1]].tolist()
    return adj


class LocalPeers:
    """In-process stand-ins for the peer servers: a sampler's ``remote``
    (:class:`~sampling_server.sampler.peers.Remote`), answered by the samplers of the
    other partitions (what a peer's servicer would call), counting what was asked."""

    def __init__(self, samplers: Sequence[NeighborSampler]):
        self.samplers = list(samplers)
        #: Frontier nodes asked of each partition, across calls.
        self.asked: dict[int, int] = {}
        #: Nodes whose rows were asked of each partition, across calls.
        self.fetched: dict[int, int] = {}

    def sample(self, edge_type: EdgeType, nodes_by_partition: Mapping[int, torch.Tensor], fanout: int,
               key: int, hop: int, edges: bool = False) -> dict[int, HopSample]:
        out = {}
        for p, nodes in nodes_by_partition.items():
            self.asked[p] = self.asked.get(p, 0) + int(nodes.numel())
            peer = self.samplers[p]
            s = peer.sample_relation(edge_type, nodes.to(peer.device), fanout, key, hop, edges)
            out[p] = HopSample(s.counts.cpu(), s.neighbors.cpu(), None if s.edges is None else s.edges.cpu())
        return out

    def node_data(self, node_type: str, nodes_by_partition: Mapping[int, torch.Tensor], features: bool,
                  labels: bool) -> dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]:
        out: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        for p, nodes in nodes_by_partition.items():
            self.fetched[p] = self.fetched.get(p, 0) + int(nodes.numel())
            peer = self.samplers[p]
            x, y = peer.gather_local(node_type, nodes.to(peer.device), features, labels)
            out[p] = (None if x is None else x.cpu(), None if y is None else y.cpu())
        return out

    def orig_ids(self, node_type: str,
                 nodes_by_partition: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {p: self.samplers[p].orig_ids_local(node_type, nodes)
                for p, nodes in nodes_by_partition.items()}

    def has_edges(self, edge_type: EdgeType, pairs_by_partition: Mapping[int, tuple[np.ndarray, np.ndarray]]
                  ) -> dict[int, np.ndarray]:
        return {p: self.samplers[p].has_edges_local(edge_type, src, dst)
                for p, (src, dst) in pairs_by_partition.items()}

    def edge_data(self, edge_type: EdgeType, edges_by_partition: Mapping[int, torch.Tensor], ids: bool,
                  features: bool, dtype: torch.dtype | None) -> dict[int, tuple[torch.Tensor | None, ...]]:
        return {p: self.samplers[p].edge_rows_local(edge_type, edges, ids, features, dtype)
                for p, edges in edges_by_partition.items()}


def check_sampler_output(out: SamplerOutput, seeds: np.ndarray, seed_type: str,
                         fanouts: Mapping[EdgeType, Sequence[int]],
                         adj: Mapping[EdgeType, Mapping[int, list[int]]], *, replace: bool = False) -> None:
    """Assert every structural property DESIGN.md promises of a sampled batch, per node
    type and relation. ``adj``: per edge type, every global destination ID of the whole
    graph -> its in-neighbors (:func:`global_adjacency`)."""
    node = {t: n.cpu().numpy() for t, n in out.node.items()}
    hops = len(next(iter(fanouts.values())))
    assert out.input_type == seed_type and out.batch_size == seeds.size
    assert np.array_equal(node[seed_type][: seeds.size], seeds), "seeds must come first, in order"
    for t, n_id in node.items():
        assert np.unique(n_id).size == n_id.size, f"{t}: n_id repeats a node"
        assert sum(out.num_sampled_nodes[t]) == n_id.size and len(out.num_sampled_nodes[t]) == hops + 1
        assert out.num_sampled_nodes[t][0] == (seeds.size if t == seed_type else 0)
    for et, fanout in fanouts.items():
        _check_relation(out, et, list(fanout), node, adj[et], replace)
    _check_first_seen(out)


def _check_relation(out: SamplerOutput, et: EdgeType, fanouts: list[int], node: Mapping[str, np.ndarray],
                    adj: Mapping[int, list[int]], replace: bool) -> None:
    src_t, _, dst_t = et
    row, col = out.row[et].cpu().numpy(), out.col[et].cpu().numpy()
    assert len(out.num_sampled_edges[et]) == len(fanouts)
    assert sum(out.num_sampled_edges[et]) == row.size == col.size
    assert row.size == 0 or (row.min() >= 0 and row.max() < node[src_t].size)
    nsn, e0 = out.num_sampled_nodes[dst_t], 0
    for hop, fanout in enumerate(fanouts):
        e1 = e0 + out.num_sampled_edges[et][hop]
        lo, hi = sum(nsn[:hop]), sum(nsn[: hop + 1])  # targets: the previous hop's new nodes
        r, c = row[e0:e1], col[e0:e1]
        assert e1 == e0 or (c.min() >= lo and c.max() < hi), f"{et} hop {hop}: targets"
        assert np.all(np.diff(c) >= 0), f"{et} hop {hop}: edges must be grouped by target in order"
        for t in range(lo, hi):
            target = int(node[dst_t][t])
            sources = [int(node[src_t][s]) for s in r[c == t]]
            neigh = adj[target]
            for s, k in Counter(sources).items():
                assert s in neigh, f"{et} hop {hop}: edge {s}->{target} is not in the graph"
                if not replace:
                    assert k <= neigh.count(s), f"{et} hop {hop}: neighbor {s} of {target} repeats"
            expected = len(neigh) if fanout < 0 else min(fanout, len(neigh))
            if replace and fanout >= 0 and neigh:
                expected = fanout
            assert len(sources) == expected, (f"{et} hop {hop}: node {target} has {len(neigh)} in-neighbors "
                                              f"and fanout {fanout}, got {len(sources)} sampled")
        e0 = e1


def _check_first_seen(out: SamplerOutput) -> None:
    """Each hop's new nodes of a type are its relations' sources not seen before, in
    order of first appearance, relation after relation in the graph's edge-type order."""
    offsets = {et: np.concatenate([[0], np.cumsum(out.num_sampled_edges[et])]) for et in out.row}
    for t, nsn in out.num_sampled_nodes.items():
        for hop in range(len(nsn) - 1):
            lo, hi = sum(nsn[: hop + 1]), sum(nsn[: hop + 2])
            seq = np.concatenate([out.row[et].cpu().numpy()[offsets[et][hop]:offsets[et][hop + 1]]
                                  for et in out.row if et[0] == t] or [np.empty(0, np.int64)])
            assert seq.size == 0 or seq.max() < hi
            fresh = seq[seq >= lo]
            _, first = np.unique(fresh, return_index=True)
            assert np.array_equal(fresh[np.sort(first)], np.arange(lo, hi)), f"{t} hop {hop}: numbering"


def check_edge_ids(out: SamplerOutput, partitions: Sequence[Partition], *, replace: bool = False) -> None:
    """Every sampled edge's internal ID (``out.edge``, asked for) names that very edge:
    the partition holding it (:meth:`~partitioner.manifest.Manifest.edge_book`) has the
    edge's source at that position of its ``indices``, within its target's CSC range;
    without replacement no edge of a target is sampled twice (repeated edges are
    distinct edges)."""
    m = partitions[0].manifest
    assert set(out.edge) == set(out.row), "every edge type has its edge IDs"
    for et, edge in out.edge.items():
        src_t, _, dst_t = et
        ids = edge.cpu().numpy()
        assert edge.dtype == torch.int64 and ids.shape == out.row[et].shape, et
        sources = out.node[src_t].cpu().numpy()[out.row[et].cpu().numpy()]
        targets = out.node[dst_t].cpu().numpy()[out.col[et].cpu().numpy()]
        book = np.asarray(m.edge_book(et))
        assert ids.size == 0 or (ids.min() >= 0 and ids.max() < book[-1]), f"{et}: edge IDs out of range"
        owner = np.searchsorted(book, ids, side="right") - 1
        for p in np.unique(owner):
            part, here = partitions[p], owner == p
            pos = ids[here] - book[p]
            indptr, indices = np.asarray(part.indptr[et]), np.asarray(part.indices[et])
            local = targets[here] - part.node_range(dst_t)[0]
            assert np.all((local >= 0) & (local < part.num_nodes(dst_t))), f"{et}: target not in part {p}"
            assert np.array_equal(indices[pos], sources[here]), f"{et}: edge ID of another source"
            within = (indptr[local] <= pos) & (pos < indptr[local + 1])
            assert np.all(within), f"{et}: edge ID of another target"
        if not replace:
            pairs = np.stack([targets, ids])
            assert np.unique(pairs, axis=1).shape[1] == ids.size, f"{et}: an edge drawn twice for a target"


def assert_same_batch(a: Minibatch, b: Minibatch) -> None:
    """Equal: nodes, edges, counts, features, labels and original IDs of every type."""
    sa, sb = a.structure, b.structure
    assert sa.num_sampled_nodes == sb.num_sampled_nodes and sa.num_sampled_edges == sb.num_sampled_edges
    for t in sa.node:
        assert torch.equal(sa.node[t].cpu(), sb.node[t].cpu()), t
    for et in sa.row:
        assert torch.equal(sa.row[et].cpu(), sb.row[et].cpu()), et
        assert torch.equal(sa.col[et].cpu(), sb.col[et].cpu()), et
    assert set(sa.edge) == set(sb.edge)
    for et in sa.edge:
        assert torch.equal(sa.edge[et].cpu(), sb.edge[et].cpu()), et
    assert set(a.x) == set(b.x) and set(a.orig_id) == set(b.orig_id)
    for t in a.x:
        assert torch.equal(a.x[t].cpu(), b.x[t].cpu()), t
    for t in a.orig_id:
        assert torch.equal(a.orig_id[t], b.orig_id[t]), t
    assert (a.y is None) == (b.y is None)
    if a.y is not None and b.y is not None:
        assert torch.equal(a.y.cpu(), b.y.cpu())


def check_rows(graph: AnyGraph, batch: Minibatch) -> None:
    """A batch's features and labels are the original graph's rows of its nodes."""
    typed = typed_view(graph)
    assert set(batch.x) == set(typed.x), "featureless types get no features"
    for t, x in batch.x.items():
        assert np.array_equal(x.cpu().numpy(), typed.x[t][batch.orig_id[t].numpy()]), t
    assert batch.y is not None and batch.target_type == typed.target_type
    assert np.array_equal(batch.y.cpu().numpy(), typed.y[batch.orig_id[typed.target_type].numpy()])


def target(graph: AnyGraph) -> str:
    """The target type of a graph (a plain graph's one node type)."""
    return typed_view(graph).target_type


def large(kind: str, *, seed: int = 3) -> AnyGraph:
    """A graph of ``kind`` with thousands of nodes of each type and weights on every
    relation, for the real-GPU tests: :func:`mixed_graph` of 20,000 nodes, or
    ``mag-small`` with its reverse relations."""
    if kind == "plain":
        return mixed_graph(20_000, seed=seed)
    graph = generate("mag-small", seed=seed, progress=False)
    assert isinstance(graph, TypedGraphData)
    gen = np.random.default_rng(seed)
    graph.edge_weight = {et: np.asarray(gen.uniform(0.1, 5.0, ei.shape[1]), np.float32)
                         for et, ei in graph.edge_index.items()}
    typed = graph.add_reverse()
    typed.validate()
    return typed

def load_all(root: Path) -> list[Partition]:
    """Every partition written under ``root``."""
    return [load_partition(root, p) for p in range(read_manifest(root).num_partitions)]


def node_maps(root: Path, graph: TypedGraphData) -> dict[str, np.ndarray]:
    """Original ID -> global ID, per node type, of the partitioning at ``root``."""
    return {t: np.asarray(load_node_map(root, t)) for t in graph.node_types}


def tiny_typed(seed: int = 0) -> TypedGraphData:
    """Papers (features, labels), authors and topics (no features), three relations."""
    rng = np.random.default_rng(seed)
    counts = {"paper": 30, "author": 20, "topic": 6}
    edges = {
        ("author", "writes", "paper"): np.stack(
            [rng.integers(0, 20, 60), rng.integers(0, 30, 60)]).astype(np.int64),
        ("paper", "cites", "paper"): np.stack(
            [rng.integers(0, 30, 50), rng.integers(0, 30, 50)]).astype(np.int64),
        ("paper", "has_topic", "topic"): np.stack(
            [rng.integers(0, 30, 40), rng.integers(0, 6, 40)]).astype(np.int64),
    }
    y = rng.integers(0, 3, 30).astype(np.int64)
    y[[3, 7]] = -1
    order = rng.permutation(np.setdiff1d(np.arange(30), [3, 7]))
    splits = {"train": np.sort(order[:14]), "val": np.sort(order[14:20]),
              "test": np.sort(order[20:28])}
    x = {"paper": rng.standard_normal((30, 4)).astype(np.float32)}
    return TypedGraphData(name="tiny-typed", num_nodes=counts, edge_index=edges, x=x,
                          target_type="paper", y=y, num_classes=3, splits=splits)


__all__ = ["HUB", "KINDS", "MODES", "MODE_IDS", "NUM_ISOLATED", "PLAIN_EDGE_TYPE", "PLAIN_NODE_TYPE",
           "REPEATED_EDGES", "AnyGraph", "LocalPeers", "Parted", "assert_same_batch", "check_edge_ids",
           "check_node_maps", "check_rows", "check_sampler_output", "cpu_samplers", "global_adjacency",
           "large", "load_all", "mixed", "mixed_graph", "mixed_typed", "node_maps", "node_maps_of", "parted",
           "star_graph", "target", "tiny_typed", "typed_view", "write_and_load"]
