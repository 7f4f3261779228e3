"""Sampled edges carry their internal edge IDs, on both kinds of graph (:data:`KINDS`):
each ID names the very edge drawn (its source at that position of the owning partition's
CSC, within its target's range; repeated edges told apart), asking for them changes no
draw, and the IDs are the same whichever path drew them: the fused hops or the generic
path, one partition or several answering each other (range partitions: the same IDs;
random ones: the same edges), the partition's own structure or the whole graph's. The
CUDA sampler's are in ``test_sampler_cuda.py``, the peer wire's in ``test_peer_edges.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from graph_fixtures import (
    HUB,
    MODE_IDS,
    MODES,
    REPEATED_EDGES,
    AnyGraph,
    LocalPeers,
    Parted,
    assert_same_batch,
    check_edge_ids,
    check_sampler_output,
    cpu_samplers,
    global_adjacency,
    parted,
)

from partitioner.graph import EdgeType
from partitioner.joins import load_structure
from partitioner.partition import Partition
from sampling_server.sampler import (
    CpuNeighborSampler,
    InProcessPeers,
    Minibatch,
    NeighborSampler,
    SamplerOutput,
    batch_key,
    cpu_sampler,
    normalize_num_neighbors,
)
from sampling_server.sampler.types import HopSample

FANOUTS = [[2, 2], [3, -1], [0, 5], [5, 3, 2]]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def whole(graph: AnyGraph, tmp_path_factory: pytest.TempPathFactory) -> Parted:
    """One partition: global IDs are original IDs, internal edge IDs CSC positions."""
    return parted(graph, tmp_path_factory.mktemp("edges-p1"), 1, "range")


@pytest.fixture(scope="module")
def three(graph: AnyGraph, tmp_path_factory: pytest.TempPathFactory) -> Parted:
    """Three range partitions: the same global IDs and the same edge numbering."""
    return parted(graph, tmp_path_factory.mktemp("edges-p3"), 3, "range")


@pytest.fixture(scope="module")
def shuffled(graph: AnyGraph, tmp_path_factory: pytest.TempPathFactory) -> Parted:
    """Three random partitions: global IDs and edge IDs renumbered."""
    return parted(graph, tmp_path_factory.mktemp("edges-random3"), 3, "random")


def _seed_sets(part: Partition) -> list[np.ndarray]:
    """Owned seeds of the target type: all of them, a shuffled few, the last one."""
    owned = np.arange(*part.node_range(part.target_type))
    sets = [owned, np.random.default_rng(part.partition_id).permutation(owned)[:5], owned[-1:]]
    return [s for s in sets if s.size]


def _without_edges(out: SamplerOutput) -> Minibatch:
    return Minibatch(dataclasses.replace(out, edge={}), out.input_type)


def _edge_identity(out: SamplerOutput, parts: list[Partition]) -> dict[EdgeType, np.ndarray]:
    """Per edge type, ``[2, E]``: each sampled edge's target as an original ID and its
    rank among the target's in-edges (CSC order, which no partitioning changes): the same
    edge whatever the numbering."""
    out_ids: dict[EdgeType, np.ndarray] = {}
    for et, edge in out.edge.items():
        dst_t = et[2]
        book = np.asarray(parts[0].manifest.edge_book(et))
        ids = edge.numpy()
        targets = out.node[dst_t].numpy()[out.col[et].numpy()]
        orig, rank = np.empty(ids.size, np.int64), np.empty(ids.size, np.int64)
        owner = np.searchsorted(book, ids, side="right") - 1
        for p in np.unique(owner):
            here, part = owner == p, parts[p]
            local = targets[here] - part.node_range(dst_t)[0]
            orig[here] = np.asarray(part.orig_ids[dst_t])[local]
            rank[here] = ids[here] - book[p] - np.asarray(part.indptr[et])[local]
        out_ids[et] = np.stack([orig, rank])
    return out_ids


# -- every edge ID names its edge; asking changes no draw --------------------------------
@pytest.mark.parametrize(("replace", "weighted"), MODES, ids=MODE_IDS)
def test_edge_ids_name_the_drawn_edges_and_change_no_draw(
    whole: Parted, three: Parted, shuffled: Parted, monkeypatch: pytest.MonkeyPatch, replace: bool,
    weighted: bool
) -> None:
    """On one partition and on three (range and random; the peers answered in process),
    by the fused hops, the generic path and the hash-table relabel alike: the batch with
    edge IDs is the batch without (which has none), and every ID names its edge."""
    for written in (whole, three, shuffled):
        parts = written.parts
        fused = cpu_samplers(parts, replace, weighted)
        with monkeypatch.context() as m:
            m.setattr(cpu_sampler, "DENSE_RELABEL_MAX_NODES", 0)
            hashed = cpu_samplers(parts, replace, weighted)
        fused_peers, hashed_peers = InProcessPeers(fused), InProcessPeers(hashed)
        adj = global_adjacency(parts)
        for (sampler, other), fanouts in itertools.product(zip(fused, hashed, strict=True), FANOUTS):
            t = sampler.target_type
            for i, seeds in enumerate(_seed_sets(sampler.partition)):
                key = batch_key(13, 0, 0, i)
                plain = sampler.sample(seeds, t, fanouts, key, fused_peers)
                assert plain.edge == {}
                got = sampler.sample(seeds, t, fanouts, key, fused_peers, edges=True)
                assert_same_batch(_without_edges(got), Minibatch(plain, t))
                check_sampler_output(got, seeds, t, normalize_num_neighbors(fanouts, sampler.edge_types),
                                     adj, replace=replace)
                check_edge_ids(got, parts, replace=replace)
                generic = NeighborSampler.sample(sampler, seeds, t, fanouts, key, fused_peers, edges=True)
                assert_same_batch(Minibatch(generic, t), Minibatch(got, t))
                hashed_out = other.sample(seeds, t, fanouts, key, hashed_peers, edges=True)
                assert_same_batch(Minibatch(hashed_out, t), Minibatch(got, t))


def test_repeated_edges_are_told_apart(whole: Parted) -> None:
    """Targets with a repeated in-edge (:data:`REPEATED_EDGES`, along every relation, or
    reversed), all of whose in-edges are drawn: each copy of the edge comes with an ID of
    its own, its position in the CSC."""
    part = whole.parts[0]
    sampler = CpuNeighborSampler(part)
    ends = {v for s, t, _ in REPEATED_EDGES for v in (s, t)}
    for et in part.edge_types:
        repeats = 0
        for dst in sorted(ends):
            drawn = sampler.sample_relation(et, torch.tensor([dst]), -1, key=3, hop=0, edges=True)
            assert drawn.edges is not None
            lo, hi = np.asarray(part.indptr[et])[dst:dst + 2]
            assert np.array_equal(drawn.edges.numpy(), np.arange(lo, hi))
            assert np.array_equal(drawn.neighbors.numpy(), np.asarray(part.indices[et])[lo:hi])
            repeats += drawn.neighbors.numel() - drawn.neighbors.unique().numel()
        assert repeats >= min(times for _, _, times in REPEATED_EDGES) - 1, et


def test_the_hub_s_edges_drawn_at_every_fanout(whole: Parted, three: Parted) -> None:
    """The hub (in-degree ~ the graph's size), at fanouts below and above Floyd's scan
    limit and all: its draws with edge IDs are its draws without them, and each ID is a
    distinct in-edge of the hub; on three partitions its owner numbers them from its own
    first edge."""
    for written in (whole, three):
        samplers = cpu_samplers(written.parts)
        for sampler in samplers:
            t = sampler.target_type
            if not sampler.draws_all(t, torch.tensor([HUB])):
                continue
            part = sampler.partition
            into_t = [e for e in sampler.edge_types if e[2] == t]
            for et, fanout in itertools.product(into_t, [1, 7, 40, 70, -1]):
                plain = sampler.sample_relation(et, torch.tensor([HUB]), fanout, key=5, hop=1)
                got = sampler.sample_relation(et, torch.tensor([HUB]), fanout, key=5, hop=1, edges=True)
                assert plain.edges is None and got.edges is not None
                assert torch.equal(plain.neighbors, got.neighbors) and torch.equal(plain.counts, got.counts)
                pos = got.edges.numpy() - part.edge_start[et]
                lv = HUB - part.node_range(t)[0]
                lo, hi = np.asarray(part.indptr[et])[lv:lv + 2]
                assert np.all((lo <= pos) & (pos < hi)) and np.unique(pos).size == pos.size
                assert np.array_equal(np.asarray(part.indices[et])[pos], got.neighbors.numpy())


# -- the same edges whatever the partitioning ------------------------------------------
@pytest.mark.parametrize(("replace", "weighted"), MODES, ids=MODE_IDS)
def test_edge_ids_do_not_depend_on_the_partitioning(whole: Parted, three: Parted, shuffled: Parted,
                                                    replace: bool, weighted: bool) -> None:
    """``minibatch``: three range partitions give the one-partition batch's very edge
    IDs; three random ones (global and edge IDs renumbered) give IDs of the same edges."""
    single = CpuNeighborSampler(whole.parts[0], replace=replace, weighted=weighted)
    for written in (three, shuffled):
        samplers = cpu_samplers(written.parts, replace, weighted)
        peers = InProcessPeers(samplers)
        for sampler, fanouts in itertools.product(samplers, FANOUTS):
            t = sampler.target_type
            for i, seeds in enumerate(_seed_sets(sampler.partition)):
                key = batch_key(17, 2, 0, i)
                got = sampler.minibatch(seeds, t, fanouts, key, remote=peers, edges=True, features=False)
                orig_seeds = written.orig_of(t)[seeds]
                want = single.minibatch(orig_seeds, t, fanouts, key, edges=True, features=False)
                if written is three:
                    assert_same_batch(got, want)
                want_edges = _edge_identity(want.structure, whole.parts)
                got_edges = _edge_identity(got.structure, written.parts)
                assert set(got_edges) == set(want_edges) == set(sampler.edge_types)
                for et, identity in want_edges.items():
                    assert np.array_equal(got_edges[et], identity), et


def test_the_whole_graph_s_structure_gives_the_owners_edge_ids(shuffled: Parted) -> None:
    """A sampler over :func:`load_structure` (edge IDs from 0, the owners' numbering
    joined) draws every hop itself and gives the edge IDs the owners give."""
    parts = shuffled.parts
    full = load_structure(shuffled.root)
    asking, holding = cpu_samplers(parts), cpu_samplers(parts, structure=full)
    asking_peers, holding_peers = LocalPeers(asking), LocalPeers(holding)
    for p, fanouts in itertools.product(range(3), FANOUTS):
        t = parts[p].target_type
        for i, seeds in enumerate(_seed_sets(parts[p])):
            key = batch_key(19, 0, 0, i)
            want = asking[p].sample(seeds, t, fanouts, key, asking_peers, edges=True)
            got = holding[p].sample(seeds, t, fanouts, key, holding_peers, edges=True)
            assert_same_batch(Minibatch(got, t), Minibatch(want, t))
            check_edge_ids(got, parts)
    assert asking_peers.asked and not holding_peers.asked


# -- a peer that answers without the edge IDs --------------------------------------------
class _EdgelessPeers(LocalPeers):
    """Peers that answer every hop without edge IDs, asked for or not."""

    def sample(self, edge_type: EdgeType, nodes_by_partition: Mapping[int, torch.Tensor], fanout: int,
               key: int, hop: int, edges: bool = False) -> dict[int, HopSample]:
        answers = super().sample(edge_type, nodes_by_partition, fanout, key, hop, edges)
        return {p: HopSample(a.counts, a.neighbors) for p, a in answers.items()}


def test_an_answer_without_the_edge_ids_asked_for_is_an_error(three: Parted) -> None:
    samplers = cpu_samplers(three.parts)
    sampler, peers = samplers[0], _EdgelessPeers(samplers)
    t = sampler.target_type
    seeds = np.arange(*three.parts[0].node_range(t))
    sampler.sample(seeds, t, [-1, -1], 1, peers)  # not asked for: nothing missing
    for sample in (sampler.sample, lambda *a, **kw: NeighborSampler.sample(sampler, *a, **kw)):
        with pytest.raises(RuntimeError, match=r"^partition \d answered without the edge IDs asked for"):
            sample(seeds, t, [-1, -1], 1, peers, edges=True)
