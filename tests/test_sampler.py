"""The CPU sampler on both kinds of graph (:data:`KINDS`: plain, and typed): batches have
every promised property; a multi-partition batch equals the one-partition batch (in
original IDs whatever the partitioning); the whole graph's structure and rows give the
owners' draws and rows; gathered rows belong to ``n_id``, in every wire dtype and into row
blocks; peer requests overlap the sampler's own share; the fused path equals the generic
one; bad input is named. The draws themselves (the spec, the statistics) are in
``test_sampler_kernels.py``, PyG batches in ``test_sampler_pyg.py``, the CUDA sampler in
``test_sampler_cuda.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from graph_fixtures import (
    HUB,
    MODE_IDS,
    MODES,
    NUM_ISOLATED,
    AnyGraph,
    LocalPeers,
    Parted,
    assert_same_batch,
    check_rows,
    check_sampler_output,
    cpu_samplers,
    global_adjacency,
    mixed,
    parted,
    typed_view,
    write_and_load,
)

from partitioner.graph import EdgeType
from partitioner.joins import load_node_data, load_structure
from partitioner.partition import Partition, Structure
from sampling_server.sampler import (
    CpuNeighborSampler,
    Minibatch,
    NeighborSampler,
    batch_key,
    cpu_sampler,
    create_sampler,
    normalize_num_neighbors,
)
from sampling_server.sampler import cpu_fused as F
from sampling_server.sampler.types import HopSample

FANOUTS = [[2, 2], [3, -1], [0, 5], [5, 3, 2]]

# Tiny graphs: Numba's threads would only wait for each other (the kernels' parallel paths
# are tested with several threads in test_sampler_kernels.py).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def whole(graph: AnyGraph, tmp_path_factory: pytest.TempPathFactory) -> list[Partition]:
    """One partition: global IDs are original IDs."""
    return parted(graph, tmp_path_factory.mktemp("mixed-p1"), 1, "range").parts


@pytest.fixture(scope="module")
def three(graph: AnyGraph, tmp_path_factory: pytest.TempPathFactory) -> list[Partition]:
    """Range partitioning: global IDs equal original IDs, as with one partition."""
    return parted(graph, tmp_path_factory.mktemp("mixed-p3"), 3, "range").parts


@pytest.fixture(scope="module")
def shuffled(graph: AnyGraph, tmp_path_factory: pytest.TempPathFactory) -> Parted:
    """Random partitioning into 3: global IDs are a real relabelling of the original IDs."""
    return parted(graph, tmp_path_factory.mktemp("mixed-random3"), 3, "random")


def _seed_sets(part: Partition) -> list[np.ndarray]:
    """Sets of owned seeds of the target type: all, a shuffled few, the last, every third
    backwards."""
    owned = np.arange(*part.node_range(part.target_type))
    gen = np.random.default_rng(part.partition_id)
    sets = [owned, gen.permutation(owned)[:5], owned[-1:], owned[::3][::-1].copy()]
    return [s for s in sets if s.size]


def _fanouts(sampler: NeighborSampler, fanouts: list[int]) -> dict[EdgeType, list[int]]:
    return normalize_num_neighbors(fanouts, sampler.edge_types)


def _in_original_ids(batch: Minibatch) -> Minibatch:
    """``batch`` with its nodes named by original IDs (batches of two partitionings of one
    graph compare equal this way)."""
    return dataclasses.replace(batch, structure=dataclasses.replace(batch.structure, node=batch.orig_id))


def _adjacency(structure: Structure) -> dict[EdgeType, dict[int, list[int]]]:
    """:func:`global_adjacency` of a structure."""
    adj: dict[EdgeType, dict[int, list[int]]] = {}
    for et, indptr in structure.indptr.items():
        start, stop = structure.node_range(et[2])
        indices = np.asarray(structure.indices[et])
        adj[et] = {start + i: indices[indptr[i]:indptr[i + 1]].tolist() for i in range(stop - start)}
    return adj


def _same_labels(got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    """Both None (a type without labels), or equal."""
    assert (got is None) == (want is None)
    assert got is None or want is None or torch.equal(got, want)


def _featured(graph: AnyGraph) -> list[str]:
    """Node types with features."""
    return list(typed_view(graph).x)


# -- structure ------------------------------------------------------------------------
@pytest.mark.parametrize(("replace", "weighted"), MODES, ids=MODE_IDS)
def test_batches_have_every_property(whole: list[Partition], replace: bool, weighted: bool) -> None:
    sampler = CpuNeighborSampler(whole[0], replace=replace, weighted=weighted)
    adj = global_adjacency(whole)
    t = sampler.target_type
    n = whole[0].num_nodes(t)
    seeds_sets = [*_seed_sets(whole[0]), np.array([HUB]), np.arange(n - NUM_ISOLATED, n)]
    for fanouts, seeds, i in itertools.product(FANOUTS, seeds_sets, range(3)):
        out = sampler.sample(seeds, t, fanouts, batch_key(7, 0, 0, i))
        check_sampler_output(out, seeds, t, _fanouts(sampler, fanouts), adj, replace=replace)
    for u in sampler.node_types:  # seeds of every type (a typed graph's others too)
        seeds = np.arange(*whole[0].node_range(u))[:6]
        out = sampler.sample(seeds, u, [3, 2], batch_key(7, 0, 0, 9))
        check_sampler_output(out, seeds, u, _fanouts(sampler, [3, 2]), adj, replace=replace)


def test_a_dict_gives_each_relation_its_fanouts(kind: str, whole: list[Partition]) -> None:
    """PyG's dict form of ``num_neighbors``: per relation (as a tuple or ``src__rel__dst``);
    a relation left out draws nothing. On a plain graph the dict of its one relation is
    its list."""
    sampler = CpuNeighborSampler(whole[0])
    t, first = sampler.target_type, sampler.edge_types[0]
    seeds = np.arange(*whole[0].node_range(t))[:16]
    only_first = sampler.sample(seeds, t, {first: [4, 4]}, key=3)
    for et, n in only_first.num_sampled_edges.items():
        assert (sum(n) > 0) == (et == first), et
    if kind == "plain":
        assert_same_batch(Minibatch(only_first, t), Minibatch(sampler.sample(seeds, t, [4, 4], key=3), t))
        return
    named = {"author__writes__paper": [4, 0], "paper__cites__paper": [3, 2],
             "paper__has_topic__topic": [0, 6], "topic__rev_has_topic__paper": [-1, 1]}
    out = sampler.sample(seeds, t, named, key=11)
    check_sampler_output(out, seeds, t, normalize_num_neighbors(named, sampler.edge_types),
                         global_adjacency(whole))
    assert out.num_sampled_nodes["author"][2] == 0  # only ``writes`` draws authors


@pytest.mark.parametrize(("replace", "weighted"), MODES, ids=MODE_IDS)
def test_multi_partition_batch_equals_single_partition_batch(
    whole: list[Partition], three: list[Partition], shuffled: Parted, replace: bool, weighted: bool
) -> None:
    """Peers answered in process, seeds on every partition: the batch of three range
    partitions is the one-partition batch; that of three random partitions (global IDs
    relabelled) is too, in original IDs (draws are keyed by original IDs)."""
    single = CpuNeighborSampler(whole[0], replace=replace, weighted=weighted)
    adj = global_adjacency(three)
    assert adj == global_adjacency(whole)
    for parts in (three, shuffled.parts):
        samplers = cpu_samplers(parts, replace, weighted)
        peers = LocalPeers(samplers)
        for sampler, fanouts in itertools.product(samplers, FANOUTS):
            t = sampler.target_type
            for i, seeds in enumerate(_seed_sets(sampler.partition)):
                key = batch_key(11, 1, 0, i)
                got = sampler.minibatch(seeds, t, fanouts, key, remote=peers)
                if parts is three:
                    check_sampler_output(got.structure, seeds, t, _fanouts(sampler, fanouts), adj,
                                         replace=replace)
                    assert_same_batch(got, single.minibatch(seeds, t, fanouts, key))
                else:
                    want = single.minibatch(shuffled.orig_of(t)[seeds], t, fanouts, key)
                    assert_same_batch(_in_original_ids(got), _in_original_ids(want))
        assert len(peers.asked) == len(parts), "every partition should have served remote frontiers"


@pytest.mark.parametrize(("replace", "weighted"), MODES, ids=MODE_IDS)
def test_the_whole_graph_s_structure_draws_every_hop_as_the_owners_would(
    graph: AnyGraph, shuffled: Parted, replace: bool, weighted: bool
) -> None:
    """A sampler over :func:`load_structure` (random partitioning: global IDs relabelled)
    draws every hop itself, no peer asked for a sample, and makes the batches the
    peer-asking samplers make; features and labels still come from their owners."""
    parts, typed = shuffled.parts, typed_view(graph)
    full = load_structure(shuffled.root)
    for t, n in typed.num_nodes.items():
        assert full.node_range(t) == (0, n)
    assert {et: a.size for et, a in full.indices.items()} == \
        {et: ei.shape[1] for et, ei in typed.edge_index.items()}
    assert global_adjacency(parts) == _adjacency(full)
    asking = cpu_samplers(parts, replace, weighted)
    holding = cpu_samplers(parts, replace, weighted, structure=full)
    asking_peers, holding_peers = LocalPeers(asking), LocalPeers(holding)
    for p, fanouts in itertools.product(range(3), FANOUTS):
        t = parts[p].target_type
        for i, seeds in enumerate(_seed_sets(parts[p])):
            key = batch_key(5, 0, 0, i)
            want = asking[p].minibatch(seeds, t, fanouts, key, remote=asking_peers)
            got = holding[p].minibatch(seeds, t, fanouts, key, remote=holding_peers)
            assert_same_batch(got, want)
    assert asking_peers.asked and not holding_peers.asked and holding_peers.fetched
    et = holding[0].edge_types[-1]
    with pytest.raises(ValueError, match=r"nodes: expected global (node|'\w+') IDs in \[0, "):
        holding[0].sample_relation(et, torch.tensor([typed.num_nodes[et[2]]]), 2, 1, 0)
    with pytest.raises(ValueError, match="structure: expected the in-edges of at least"):
        CpuNeighborSampler(parts[1], structure=parts[0].structure)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["stored", "bfloat16"])
def test_every_node_s_rows_gather_as_the_owners_would(graph: AnyGraph, shuffled: Parted,
                                                      dtype: torch.dtype | None) -> None:
    """A sampler over :func:`load_node_data` (random partitioning) gathers every row of
    every type itself, into a tensor and into blocks of rows (as into stream messages),
    the rows and labels the owners answer with; no peer is asked."""
    parts = shuffled.parts
    rows = load_node_data(shuffled.root)
    asking = cpu_samplers(parts)
    holding = cpu_samplers(parts, structure=load_structure(shuffled.root), node_data=rows)
    asking_peers, holding_peers = LocalPeers(asking), LocalPeers(holding)
    gen = torch.Generator().manual_seed(3)
    for p, t in itertools.product(range(3), _featured(graph)):
        n_id = torch.randperm(rows.num_nodes[t], generator=gen)[: rows.num_nodes[t] - 3]
        want_x, want_y = asking[p].gather(t, n_id, remote=asking_peers, dtype=dtype)
        got_x, got_y = holding[p].gather(t, n_id, remote=holding_peers, dtype=dtype)
        assert want_x is not None and got_x is not None and torch.equal(got_x, want_x)
        assert (want_y is None) == (got_y is None) == (t != parts[p].target_type)
        _same_labels(got_y, want_y)
        out = torch.empty_like(want_x)
        blocks = [(a, min(a + 16, len(n_id)), out[a:a + 16]) for a in range(0, len(n_id), 16)]
        got_y = holding[p].gather_to(t, n_id, blocks, remote=holding_peers)
        assert torch.equal(out, want_x)
        _same_labels(got_y, want_y)
    assert asking_peers.fetched and not holding_peers.fetched
    t = parts[0].target_type
    with pytest.raises(ValueError, match=r"nodes: expected global (node|'\w+') IDs in \[0, "):
        holding[0].gather_local(t, torch.tensor([rows.num_nodes[t]]), True, False)
    with pytest.raises(ValueError, match="node_data: expected the rows of at least the owned"):
        CpuNeighborSampler(parts[1], node_data=parts[0].node_data)
    wide = dataclasses.replace(rows, x={u: np.asarray(x, np.float64) for u, x in rows.x.items()})
    with pytest.raises(ValueError, match=r"node_data: expected float32 rows of \[\d+\] for .*got"):
        CpuNeighborSampler(parts[1], node_data=wide)


# -- node data --------------------------------------------------------------------------
def test_features_and_labels_are_rows_of_n_id(graph: AnyGraph, shuffled: Parted) -> None:
    parts = shuffled.parts
    samplers = cpu_samplers(parts, False, True)
    peers = LocalPeers(samplers)
    adj = global_adjacency(parts)
    for sampler, fanouts in itertools.product(samplers, FANOUTS):
        t = sampler.target_type
        for i, seeds in enumerate(_seed_sets(sampler.partition)):
            batch = sampler.minibatch(seeds, t, fanouts, batch_key(3, 0, 0, i), remote=peers)
            check_sampler_output(batch.structure, seeds, t, _fanouts(sampler, fanouts), adj)
            check_rows(graph, batch)
            for u, n_id in batch.structure.node.items():
                assert np.array_equal(shuffled.maps[u][batch.orig_id[u].numpy()], n_id.numpy()), u
            assert all(x.dtype == torch.float32 for x in batch.x.values())
            assert batch.y is not None and batch.y.dtype == torch.int64
    t = parts[0].target_type
    x, y = samplers[0].gather_local(t, torch.tensor([parts[0].node_range(t)[0]]), False, True)
    assert x is None and y is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_of_mixed_owners_in_a_wire_dtype_equals_indexing_then_casting(
    graph: AnyGraph, shuffled: Parted, dtype: torch.dtype
) -> None:
    """Owned rows gathered straight into place (float32 -> bfloat16 narrowed on the way,
    float16 the generic way), remote ones scattered in: the rows of n_id of every type
    with features, cast as ``Tensor.to`` casts them, with or without features or labels
    (labels: the target type's only)."""
    typed, parts = typed_view(graph), shuffled.parts
    sampler = cpu_samplers(parts)[0]
    peers = LocalPeers(cpu_samplers(parts))
    rng = np.random.default_rng(5)
    for t in _featured(graph):
        n = typed.num_nodes[t]
        labelled = t == typed.target_type
        for n_id in (rng.permutation(n), rng.choice(n, min(17, n), replace=False),
                     np.arange(*parts[0].node_range(t))[::-1].copy()):  # the last: all owned
            ids = torch.from_numpy(n_id)
            orig = shuffled.orig_of(t)[n_id]
            want_x = torch.from_numpy(typed.x[t][orig]).to(dtype)
            want_y = torch.from_numpy(typed.y[orig]) if labelled else None
            x, y = sampler.gather(t, ids, remote=peers, dtype=dtype)
            assert x is not None and x.dtype == dtype
            assert torch.equal(x.view(torch.uint8), want_x.view(torch.uint8))
            _same_labels(y, want_y)
            x, y = sampler.gather(t, ids, labels=False, remote=peers, dtype=dtype)
            assert y is None and x is not None and torch.equal(x.view(torch.uint8), want_x.view(torch.uint8))
            x, y = sampler.gather(t, ids, features=False, remote=peers, dtype=dtype)
            assert x is None
            _same_labels(y, want_y)


def _blocks(n: int, sizes: list[int], width: int, dtype: torch.dtype) -> list[tuple[int, int, torch.Tensor]]:
    """Blocks of ``sizes`` rows covering ``0 .. n``, each in memory of its own whose items
    are not aligned (as in stream messages)."""
    out, a = [], 0
    for size in sizes:
        b = min(n, a + size)
        item = torch.empty((), dtype=dtype).element_size()
        word = {2: np.uint16, 4: np.uint32}[item]
        raw = np.zeros((b - a) * width * item + 1, dtype=np.uint8)[1:].view(word).reshape(b - a, width)
        out.append((a, b, torch.from_numpy(raw).view(dtype)))
        a = b
        if a == n:
            break
    assert a == n
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("even", [True, False])
def test_gather_to_blocks_equals_gather(graph: AnyGraph, shuffled: Parted, dtype: torch.dtype,
                                        even: bool) -> None:
    """``gather_to`` writes the rows ``gather`` returns into the blocks, bit for bit, and
    returns the same labels: all owned or mixed, blocks of one size (one pass over all of
    them; float16 block by block) or uneven ones (block by block)."""
    typed, parts = typed_view(graph), shuffled.parts
    sampler = cpu_samplers(parts)[0]
    peers = LocalPeers(cpu_samplers(parts))
    rng = np.random.default_rng(9)
    for t in _featured(graph):
        width = typed.x[t].shape[1]
        for n_id in (rng.permutation(typed.num_nodes[t]), np.arange(*parts[0].node_range(t))[::-1].copy()):
            ids = torch.from_numpy(n_id)
            want_x, want_y = sampler.gather(t, ids, remote=peers, dtype=dtype)
            assert want_x is not None
            sizes = [7] * (-(-ids.numel() // 7)) if even else [5, 13, 1, 6, 100]
            blocks = _blocks(ids.numel(), sizes, width, dtype)
            y = sampler.gather_to(t, ids, blocks, remote=peers)
            got = torch.cat([rows for _, _, rows in blocks])
            assert torch.equal(got.view(torch.uint8), want_x.view(torch.uint8))
            _same_labels(y, want_y)
            assert sampler.gather_to(t, ids, _blocks(ids.numel(), sizes, width, dtype), labels=False,
                                     remote=peers) is None


def _gated(name: str, local: Callable[..., Any], remote: Callable[..., Any],
           seen: list[str]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``local`` and ``remote`` wrapped so that the local step records ``name`` once it
    sees the peer request started, and the peer answers only once the local step ran."""
    asked, local_done = threading.Event(), threading.Event()

    def local_step(*args: Any, **kwargs: Any) -> Any:
        if asked.wait(5.0):
            seen.append(name)
        local_done.set()
        return local(*args, **kwargs)

    def remote_call(*args: Any, **kwargs: Any) -> Any:
        asked.set()
        assert local_done.wait(5.0), f"{name}: the peer's answer was awaited before the local step"
        return remote(*args, **kwargs)
    return local_step, remote_call


class _GonePeers:
    """A :class:`~sampling_server.sampler.peers.Remote` whose every call fails."""

    def sample(self, *args: Any, **kwargs: Any) -> Mapping[int, HopSample]:
        raise ConnectionError("peer partition 1: gone")

    def node_data(self, *args: Any) -> Mapping[int, tuple[torch.Tensor | None, torch.Tensor | None]]:
        raise ConnectionError("peer partition 1: gone")

    def orig_ids(self, *args: Any) -> Mapping[int, torch.Tensor]:
        raise ConnectionError("peer partition 1: gone")

    def edge_data(self, *args: Any) -> Mapping[int, tuple[torch.Tensor | None, torch.Tensor | None]]:
        raise ConnectionError("peer partition 1: gone")


def test_peer_requests_are_in_flight_while_the_own_share_is_done(
    shuffled: Parted, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hop's remote draws and a gather's remote rows, node or edge, are asked for before
    the sampler does its own partition's share, so the two overlap: each patched local step
    sees the peer's request already started, and the peer answers only once the local step
    ran. A peer's error still reaches the caller."""
    parts = shuffled.parts
    samplers = cpu_samplers(parts)
    sampler, peers = samplers[0], LocalPeers(samplers)
    t = sampler.target_type
    et = next(e for e in sampler.edge_types if e[2] == t)
    seen: list[str] = []
    (start, stop), n = parts[0].node_range(t), int(sampler.books[t][-1])
    frontier = torch.tensor([start, stop, start + 1, n - 1])  # two owners
    key = batch_key(1, 0, 0, 0)
    local, remote = _gated("sample", sampler.sample_relation, peers.sample, seen)
    monkeypatch.setattr(sampler, "sample_relation", local)
    monkeypatch.setattr(peers, "sample", remote)
    got = sampler.sample_frontier(et, frontier, 3, key, 0, peers)
    monkeypatch.undo()
    want = sampler.sample_frontier(et, frontier, 3, key, 0, peers)
    assert torch.equal(got.counts, want.counts) and torch.equal(got.neighbors, want.neighbors)

    local, remote = _gated("gather", sampler.gather_local_into, peers.node_data, seen)
    monkeypatch.setattr(sampler, "gather_local_into", local)
    monkeypatch.setattr(peers, "node_data", remote)
    x, y = sampler.gather(t, frontier, remote=peers)
    monkeypatch.undo()
    want_x, want_y = sampler.gather(t, frontier, remote=peers)
    assert x is not None and want_x is not None and torch.equal(x, want_x)
    assert y is not None and want_y is not None and torch.equal(y, want_y)

    edges = sampler.sample_frontier(et, frontier, -1, key, 0, peers, edges=True).edges
    assert edges is not None
    local, remote = _gated("edge rows", sampler._edge_rows_here, peers.edge_data, seen)
    monkeypatch.setattr(sampler, "_edge_rows_here", local)
    monkeypatch.setattr(peers, "edge_data", remote)
    e_id, _ = sampler.edge_rows(et, edges, remote=peers)
    monkeypatch.undo()
    book = parts[0].manifest.edge_book(et)
    owner = np.searchsorted(book, edges.numpy(), side="right") - 1
    assert 0 in owner.tolist() and len(set(owner.tolist())) > 1  # here and elsewhere
    assert e_id is not None and e_id.tolist() == [int(parts[q].e_id[et][e - book[q]])
                                                  for q, e in zip(owner, edges.tolist(), strict=True)]
    assert seen == ["sample", "gather", "edge rows"]

    gone = _GonePeers()
    with pytest.raises(ConnectionError, match="gone"):
        sampler.sample_frontier(et, frontier, 3, key, 0, gone)
    with pytest.raises(ConnectionError, match="gone"):
        sampler.gather(t, frontier, remote=gone)
    with pytest.raises(ConnectionError, match="gone"):
        sampler.orig_ids_of(t, frontier, remote=gone)
    with pytest.raises(ConnectionError, match="gone"):
        sampler.edge_rows(et, edges, remote=gone)


def test_same_key_same_batch_and_other_keys_differ(whole: list[Partition]) -> None:
    sampler = CpuNeighborSampler(whole[0])
    t = sampler.target_type
    seeds = np.array([HUB, 0, 1, 2, 3])
    a = sampler.minibatch(seeds, t, [3, 3], batch_key(1, 2, 3, 4))
    assert_same_batch(a, CpuNeighborSampler(whole[0]).minibatch(seeds, t, [3, 3], batch_key(1, 2, 3, 4)))
    others = [sampler.sample(seeds, t, [3, 3], batch_key(1, 2, 3, i)) for i in range(5, 10)]
    drawn = {tuple(itertools.chain(*(o.node[u].tolist() for u in o.node))) for o in others}
    assert len(drawn) > 1, "the key must change the draws"


@pytest.mark.parametrize(("replace", "weighted"), MODES, ids=MODE_IDS)
def test_fused_path_and_generic_path_agree(whole: list[Partition], three: list[Partition],
                                           monkeypatch: pytest.MonkeyPatch, replace: bool,
                                           weighted: bool) -> None:
    """The fused hops (the default: draws, relabel and edges straight into the batch's
    arrays through dense maps) give exactly the generic path's batch (draw, then relabel
    through a hash table, as for huge graphs), on one partition and on three (where the
    peers draw the remote frontiers and the fused passes relabel them), and leave the
    dense maps all UNSEEN."""
    for parts in (whole, three):
        dense = cpu_samplers(parts, replace, weighted)
        with monkeypatch.context() as m:
            m.setattr(cpu_sampler, "DENSE_RELABEL_MAX_NODES", 0)
            hashed = cpu_samplers(parts, replace, weighted)
        assert all(s._dense_maps for s in dense) and not any(s._dense_maps for s in hashed)
        dense_peers, hashed_peers = LocalPeers(dense), LocalPeers(hashed)
        for (sampler, other), fanouts in itertools.product(zip(dense, hashed, strict=True), FANOUTS):
            t = sampler.target_type
            for i, seeds in enumerate(_seed_sets(sampler.partition)):
                key = batch_key(9, 0, 0, i)
                a = Minibatch(sampler.sample(seeds, t, fanouts, key, dense_peers), t)
                generic = NeighborSampler.sample(sampler, seeds, t, fanouts, key, dense_peers)
                b = other.sample(seeds, t, fanouts, key, hashed_peers)
                assert_same_batch(a, Minibatch(generic, t))
                assert_same_batch(a, Minibatch(b, t))
        _check_unseen(dense)
    sampler, t = dense[0], dense[0].target_type  # repeated seeds are refused either way
    first = three[0].node_range(t)[0]
    for bad in (np.array([first, first]), first + np.array([1, 2, 3, 1])):
        with pytest.raises(ValueError, match=r"^seeds: expected unique node IDs; \d+ repeats"):
            sampler.sample(bad, t, [2], 0, dense_peers)
        with pytest.raises(ValueError, match=r"^seeds: expected unique node IDs; \d+ repeats"):
            NeighborSampler.sample(sampler, bad, t, [2], 0, dense_peers)
    _check_unseen(dense)


def _check_unseen(samplers: list[CpuNeighborSampler]) -> None:
    """Every dense relabel map given back is all UNSEEN (each batch reset what it set)."""
    for s in samplers:
        for pool in s._dense_maps.values():
            assert all(bool((m == F.UNSEEN).all()) for m in pool._free)


# -- bad input ------------------------------------------------------------------------
def test_bad_input_names_the_field(three: list[Partition]) -> None:
    sampler = CpuNeighborSampler(three[0])
    t, et = sampler.target_type, sampler.edge_types[0]
    start, stop = three[0].node_range(t)
    seeds = torch.tensor([start, start + 1])
    cases: list[tuple[Any, str, Any, str]] = [
        (np.array([stop]), t, [2], "seeds"),
        (np.array([-1]), t, [2], "seeds"),
        (np.array([start, start + 1, start]), t, [2], "seeds"),
        (np.array([[start]]), t, [2], "seeds"),
        (seeds, "venue", [2], "seed_type"),
        (seeds, t, [-2], "fanouts"),
        (seeds, t, [], "fanouts"),
        (seeds, t, [2, -2], "fanouts"),
        (seeds, t, {}, "num_neighbors"),
        (seeds, t, {"paper__sells__paper": [2]}, "num_neighbors"),
        (seeds, t, {("a", "b"): [2]}, "num_neighbors"),
    ]
    if len(sampler.edge_types) > 1:
        cases.append((seeds, t, {sampler.edge_types[0]: [2], sampler.edge_types[1]: [2, 2]},
                      "num_neighbors"))
    for s, seed_type, fanouts, field in cases:
        with pytest.raises(ValueError, match=f"^{field}: expected"):
            sampler.sample(s, seed_type, fanouts, key=1)
    with pytest.raises(ValueError, match=r"^fanout: expected"):
        sampler.sample_relation(et, torch.tensor([start]), -3, key=1, hop=0)
    with pytest.raises(ValueError, match=r"^nodes: expected"):
        sampler.sample_relation(et, torch.tensor([stop]), 2, key=1, hop=0)
    with pytest.raises(ValueError, match=r"^nodes: expected"):
        sampler.sample_relation(et, torch.tensor([start], dtype=torch.int32), 2, key=1, hop=0)
    with pytest.raises(ValueError, match=r"^edge_type: expected"):
        sampler.sample_relation(("paper", "sells", "paper"), seeds, 2, 1, 0)
    with pytest.raises(ValueError, match=r"^nodes: expected"):
        sampler.gather_local(t, torch.tensor([stop]), True, True)
    with pytest.raises(ValueError, match=r"^node_type: expected"):
        sampler.gather_local("venue", seeds, True, True)
    with pytest.raises(RuntimeError, match="remote"):  # the hops reach the other partitions
        sampler.sample(np.arange(start, stop), t, [-1, -1], key=1)
    with pytest.raises(RuntimeError, match="remote"):
        sampler.gather(t, torch.tensor([stop]))


def test_weighted_needs_edge_weights(kind: str, tmp_path: Path) -> None:
    part = write_and_load(mixed(kind, weighted=False), tmp_path, 1)[0]
    what = "the partition has" if kind == "plain" else r"edge types \[.*\] have"
    with pytest.raises(ValueError, match=rf"^weighted: {what} no edge weights"):
        CpuNeighborSampler(part, weighted=True)
    with pytest.raises(ValueError, match=r"^weighted: "):
        create_sampler(part, "cpu", weighted=True)


def test_create_sampler(whole: list[Partition]) -> None:
    assert isinstance(create_sampler(whole[0], "cpu", replace=True), CpuNeighborSampler)
    if not torch.cuda.is_available():
        assert isinstance(create_sampler(whole[0]), CpuNeighborSampler)
    with pytest.raises(ValueError, match=r"^device: expected"):
        create_sampler(whole[0], "tpu")
    with pytest.raises(ValueError, match=r"^topology: expected"):
        create_sampler(whole[0], "cpu", topology="disk")
