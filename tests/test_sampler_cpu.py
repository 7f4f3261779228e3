"""The CPU sampler: draws follow the spec in docs/sampling.md exactly (against a plain
Python reference), batches have every promised property, a multi-partition batch equals
the one-partition batch, gathered rows belong to n_id, and the draws are uniform /
weight-proportional by chi-square tests over fixed keys."""

from __future__ import annotations

import itertools
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import numba
import numpy as np
import pytest
import torch
from graph_fixtures import (
    HUB,
    NUM_ISOLATED,
    LocalPeers,
    check_node_map,
    global_adjacency,
    mixed_graph,
    star_graph,
    write_and_load,
)
from sampler_checks import check_sampler_output, in_neighbors
from scipy import stats

from partitioner.format import Partition, load_node_data, load_structure
from partitioner.graph import GraphData
from partitioner.synthetic import generate
from sampling_server.sampler import (
    CpuNeighborSampler,
    CpuRelabeler,
    Minibatch,
    batch_key,
    cpu_sampler,
    create_sampler,
    rng,
)
from sampling_server.sampler import cpu_fused as F
from sampling_server.sampler import cpu_kernels as K
from sampling_server.sampler.base import NeighborSampler, RemoteNeighbors, RemoteNodeData, begin
from sampling_server.sampler.convert import to_pyg_data

FANOUTS = [[2, 2], [3, -1], [0, 5], [5, 3, 2]]
MODES = [(False, False), (True, False), (False, True), (True, True)]  # (replace, weighted)
MODE_IDS = ["uniform", "replace", "weighted", "weighted-replace"]
#: Keys of the statistical tests (fixed, so the tests are deterministic).
STAT_KEYS = [batch_key(2024, 0, 0, i) for i in range(4000)]
P_MIN = 1e-4


# -- fixtures -------------------------------------------------------------------------
Parted = tuple[GraphData, list[Partition]]


@pytest.fixture(scope="module")
def graph() -> GraphData:
    return mixed_graph()


@pytest.fixture(scope="module")
def whole(graph: GraphData, tmp_path_factory: pytest.TempPathFactory) -> list[Partition]:
    root = tmp_path_factory.mktemp("mixed-p1")
    parts = write_and_load(graph, root, 1)
    assert np.array_equal(check_node_map(root, parts), np.arange(graph.num_nodes))
    return parts


@pytest.fixture(scope="module")
def three(graph: GraphData, tmp_path_factory: pytest.TempPathFactory) -> list[Partition]:
    """Range partitioning: global IDs equal original IDs, as with one partition."""
    root = tmp_path_factory.mktemp("mixed-p3")
    parts = write_and_load(graph, root, 3, method="range")
    assert np.array_equal(check_node_map(root, parts), np.arange(graph.num_nodes))
    return parts


@pytest.fixture(scope="module")
def shuffled(graph: GraphData, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Partition],
                                                                                   np.ndarray]:
    """Random partitioning: global IDs are a real relabelling of the original IDs."""
    root = tmp_path_factory.mktemp("mixed-random2")
    parts = write_and_load(graph, root, 2, method="random")
    node_map = check_node_map(root, parts)
    assert not np.array_equal(node_map, np.arange(graph.num_nodes))
    return parts, node_map


def _star(tmp_path: Path, weights: list[float] | None = None, degree: int = 20,
          **kw: bool) -> CpuNeighborSampler:
    return CpuNeighborSampler(write_and_load(star_graph(degree, weights), tmp_path, 1)[0], **kw)


def _samplers(parts: list[Partition], replace: bool, weighted: bool) -> list[CpuNeighborSampler]:
    return [CpuNeighborSampler(p, replace=replace, weighted=weighted) for p in parts]


def _assert_same_batch(a: Minibatch, b: Minibatch) -> None:
    sa, sb = a.structure, b.structure
    for name in ("n_id", "row", "col"):
        assert torch.equal(getattr(sa, name), getattr(sb, name)), name
    assert sa.num_sampled_nodes == sb.num_sampled_nodes
    assert sa.num_sampled_edges == sb.num_sampled_edges
    assert a.x is not None and b.x is not None and torch.equal(a.x, b.x)
    assert a.y is not None and b.y is not None and torch.equal(a.y, b.y)


# -- the spec, as plain Python ----------------------------------------------------------
def reference_draw(neighbors: np.ndarray, weights: np.ndarray | None, fanout: int, key: int,
                   hop: int, node: int, replace: bool) -> list[int]:
    """docs/sampling.md's draw of one node, written independently of the kernels."""
    d = neighbors.size
    if d == 0 or fanout == 0:
        return []
    if fanout < 0 or (not replace and d <= fanout):
        return neighbors.tolist()
    with np.errstate(over="ignore"):
        s = rng.node_stream(np.uint64(key), np.int64(hop), np.int64(node))
        if replace and weights is None:
            pos = [int(rng.uniform_below(s, np.int64(t), np.int64(d))) for t in range(fanout)]
        elif replace:
            assert weights is not None
            cum = np.cumsum(weights.astype(np.float64))
            draws = [rng.uniform(s, np.int64(t)) * cum[-1] for t in range(fanout)]
            pos = [min(int(np.searchsorted(cum, u, side="right")), d - 1) for u in draws]
        elif weights is None:
            pos, chosen = [], set()
            for t in range(fanout):
                j = d - fanout + t
                r = int(rng.uniform_below(s, np.int64(t), np.int64(j + 1)))
                r = j if r in chosen else r
                chosen.add(r)
                pos.append(r)
        else:
            score = [math.log(1.0 - rng.uniform(s, np.int64(e))) / float(weights[e])
                     for e in range(d)]
            pos = sorted(sorted(range(d), key=lambda e: (-score[e], e))[:fanout])
    return neighbors[pos].tolist()


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize(("replace", "weighted"), MODES, ids=MODE_IDS)
def test_draws_follow_the_spec_exactly(whole: list[Partition], replace: bool, weighted: bool,
                                       parallel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if parallel:  # tiny frontiers and gathers take the prange kernels too
        monkeypatch.setattr(K, "PARALLEL_MIN_NODES", 0)
        monkeypatch.setattr(K, "PARALLEL_MIN_ROWS", 0)
    part = whole[0]
    sampler = CpuNeighborSampler(part, replace=replace, weighted=weighted)
    indptr, indices = np.asarray(part.indptr), np.asarray(part.indices)
    weight = np.asarray(part.edge_weight) if weighted else None
    nodes = torch.arange(part.num_nodes)
    for fanout, key, hop in itertools.product([0, 1, 3, 7, 40, -1], [1, 2**63 + 5], [0, 2]):
        got = sampler.sample_neighbors(nodes, fanout, key, hop)
        counts = got.counts.tolist()
        flat = got.neighbors.tolist()
        at = 0
        for v in range(part.num_nodes):
            lo, hi = indptr[v], indptr[v + 1]
            want = reference_draw(indices[lo:hi], None if weight is None else weight[lo:hi],
                                  fanout, key, hop, v, replace)
            assert flat[at:at + counts[v]] == want, (v, fanout, key, hop)
            at += counts[v]
        assert at == len(flat)
    x, y = sampler.gather_local(nodes.flip(0), True, True)
    assert x is not None and y is not None
    assert np.array_equal(x.numpy(), np.asarray(part.x)[::-1])
    assert np.array_equal(y.numpy(), np.asarray(part.y)[::-1])


def test_compiled_rng_equals_python_rng() -> None:
    with np.errstate(over="ignore"):
        for key, hop, node in [(0, 0, 0), (2**64 - 1, 3, 17), (123456789, 1, 2**40)]:
            s = rng.node_stream(np.uint64(key), np.int64(hop), np.int64(node))
            assert K.node_stream(np.uint64(key), hop, node) == s
            for j in (0, 1, 99):
                assert K.uniform(s, j) == rng.uniform(s, np.int64(j))
                assert K.uniform_below(s, j, 7) == rng.uniform_below(s, np.int64(j), np.int64(7))


# -- structure ------------------------------------------------------------------------
def _seed_sets(part: Partition) -> list[np.ndarray]:
    start, stop = part.node_range
    owned = np.arange(start, stop)
    gen = np.random.default_rng(part.partition_id)
    sets = [owned, gen.permutation(owned)[:5], owned[-1:], owned[::3][::-1].copy()]
    return [s for s in sets if s.size]


@pytest.mark.parametrize(("replace", "weighted"), MODES, ids=MODE_IDS)
def test_batches_have_every_property(whole: list[Partition], replace: bool,
                                     weighted: bool) -> None:
    sampler = CpuNeighborSampler(whole[0], replace=replace, weighted=weighted)
    adj = global_adjacency(whole)
    n = whole[0].num_nodes
    seeds_sets = [*_seed_sets(whole[0]), np.array([HUB]), np.arange(n - NUM_ISOLATED, n)]
    for fanouts, seeds, i in itertools.product(FANOUTS, seeds_sets, range(3)):
        out = sampler.sample(seeds, fanouts, batch_key(7, 0, 0, i))
        check_sampler_output(out, seeds, fanouts, adj, replace=replace)


@pytest.mark.parametrize(("replace", "weighted"), MODES, ids=MODE_IDS)
def test_multi_partition_batch_equals_single_partition_batch(
    whole: list[Partition], three: list[Partition], replace: bool, weighted: bool
) -> None:
    single = CpuNeighborSampler(whole[0], replace=replace, weighted=weighted)
    samplers = _samplers(three, replace, weighted)
    peers = LocalPeers(samplers)
    adj = global_adjacency(three)
    assert adj == global_adjacency(whole)
    for sampler, fanouts in itertools.product(samplers, FANOUTS):
        for i, seeds in enumerate(_seed_sets(sampler.partition)):
            key = batch_key(11, 1, 0, i)
            got = sampler.minibatch(seeds, fanouts, key, remote=peers.neighbors,
                                    remote_data=peers.node_data)
            check_sampler_output(got.structure, seeds, fanouts, adj, replace=replace)
            _assert_same_batch(got, single.minibatch(seeds, fanouts, key))
    assert len(peers.asked) == 3, "every partition should have served remote frontiers"


@pytest.mark.parametrize(("replace", "weighted"), MODES, ids=MODE_IDS)
def test_the_whole_graph_s_structure_draws_every_hop_as_the_owners_would(
    graph: GraphData, tmp_path_factory: pytest.TempPathFactory, replace: bool, weighted: bool
) -> None:
    """A sampler over :func:`load_structure` (random partitioning: global IDs relabelled)
    draws every hop itself, no peer asked for a sample, and makes the batches the
    peer-asking samplers make; features and labels still come from their owners."""
    root = tmp_path_factory.mktemp("mixed-random3")
    parts = write_and_load(graph, root, 3, method="random")
    full = load_structure(root)
    assert full.node_range == (0, graph.num_nodes) and full.indices.size == graph.num_edges
    assert global_adjacency(parts) == in_neighbors(full.indptr, full.indices, 0)
    asking = _samplers(parts, replace, weighted)
    holding = [CpuNeighborSampler(p, replace=replace, weighted=weighted, structure=full)
               for p in parts]
    asking_peers, holding_peers = LocalPeers(asking), LocalPeers(holding)
    for p, fanouts in itertools.product(range(3), FANOUTS):
        for i, seeds in enumerate(_seed_sets(parts[p])):
            key = batch_key(5, 0, 0, i)
            want = asking[p].minibatch(seeds, fanouts, key, remote=asking_peers.neighbors,
                                       remote_data=asking_peers.node_data)
            got = holding[p].minibatch(seeds, fanouts, key, remote=holding_peers.neighbors,
                                       remote_data=holding_peers.node_data)
            _assert_same_batch(got, want)
    assert asking_peers.asked and not holding_peers.asked
    with pytest.raises(ValueError, match=r"nodes: expected global node IDs in \[0, "):
        holding[0].sample_neighbors(torch.tensor([graph.num_nodes]), 2, 1, 0)
    with pytest.raises(ValueError, match="structure: expected the in-edges of at least"):
        CpuNeighborSampler(parts[1], structure=parts[0].structure)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["stored", "bfloat16"])
def test_every_node_s_rows_gather_as_the_owners_would(
    graph: GraphData, tmp_path_factory: pytest.TempPathFactory, dtype: torch.dtype | None
) -> None:
    """A sampler over :func:`load_node_data` (random partitioning) gathers every row
    itself, into a tensor and into blocks of rows (as into stream messages), the rows
    and labels the owners answer with; no peer is asked."""
    root = tmp_path_factory.mktemp("mixed-random3-rows")
    parts = write_and_load(graph, root, 3, method="random")
    rows = load_node_data(root)
    asking = _samplers(parts, False, False)
    holding = [CpuNeighborSampler(p, structure=load_structure(root), node_data=rows) for p in parts]
    asking_peers, holding_peers = LocalPeers(asking), LocalPeers(holding)
    gen = torch.Generator().manual_seed(3)
    for p in range(3):
        n_id = torch.randperm(graph.num_nodes, generator=gen)[:57]
        want_x, want_y = asking[p].gather(n_id, remote=asking_peers.node_data, dtype=dtype)
        got_x, got_y = holding[p].gather(n_id, remote=holding_peers.node_data, dtype=dtype)
        assert want_x is not None and got_x is not None and want_y is not None
        assert torch.equal(got_x, want_x) and torch.equal(got_y, want_y)
        out = torch.empty_like(want_x)
        blocks = [(a, min(a + 16, len(n_id)), out[a:a + 16]) for a in range(0, len(n_id), 16)]
        got_y = holding[p].gather_to(n_id, blocks, remote=holding_peers.node_data)
        assert torch.equal(out, want_x) and torch.equal(got_y, want_y)
    assert asking_peers.fetched and not holding_peers.fetched
    with pytest.raises(ValueError, match=r"nodes: expected global node IDs in \[0, "):
        holding[0].gather_local(torch.tensor([graph.num_nodes]), True, False)
    with pytest.raises(ValueError, match="node_data: expected the float32 features of at least"):
        CpuNeighborSampler(parts[1], node_data=parts[0].node_data)


def test_features_and_labels_are_rows_of_n_id(
    graph: GraphData, shuffled: tuple[list[Partition], np.ndarray]
) -> None:
    parts, node_map = shuffled
    orig_of = np.argsort(node_map)
    samplers = _samplers(parts, False, True)
    peers = LocalPeers(samplers)
    adj = global_adjacency(parts)
    for sampler, fanouts in itertools.product(samplers, FANOUTS):
        for i, seeds in enumerate(_seed_sets(sampler.partition)):
            batch = sampler.minibatch(seeds, fanouts, batch_key(3, 0, 0, i),
                                      remote=peers.neighbors, remote_data=peers.node_data)
            check_sampler_output(batch.structure, seeds, fanouts, adj)
            orig = orig_of[batch.structure.n_id.numpy()]
            assert batch.x is not None and batch.y is not None
            assert batch.x.dtype == torch.float32 and batch.y.dtype == torch.int64
            assert np.array_equal(batch.x.numpy(), graph.x[orig])
            assert np.array_equal(batch.y.numpy(), graph.y[orig])
    x, y = samplers[0].gather_local(torch.tensor([parts[0].node_range[0]]), False, True)
    assert x is None and y is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gather_of_mixed_owners_in_a_wire_dtype_equals_indexing_then_casting(
    graph: GraphData, shuffled: tuple[list[Partition], np.ndarray], dtype: torch.dtype
) -> None:
    """Owned rows gathered straight into place (float32 -> bfloat16 narrowed on the way,
    float16 the generic way), remote ones scattered in: the rows of n_id, cast as
    ``Tensor.to`` casts them, with or without features or labels."""
    parts, node_map = shuffled
    orig_of = np.argsort(node_map)
    samplers = _samplers(parts, False, False)
    peers = LocalPeers(samplers)
    rng = np.random.default_rng(5)
    num_nodes = int(samplers[0].partition_book[-1])
    for n_id in (rng.permutation(num_nodes), rng.choice(num_nodes, 17, replace=False),
                 np.arange(*parts[0].node_range)[::-1].copy()):  # the last: all owned
        ids = torch.from_numpy(n_id)
        want_x = torch.from_numpy(graph.x[orig_of[n_id]]).to(dtype)
        want_y = torch.from_numpy(graph.y[orig_of[n_id]])
        x, y = samplers[0].gather(ids, remote=peers.node_data, dtype=dtype)
        assert x is not None and y is not None and x.dtype == dtype
        assert torch.equal(x.view(torch.uint8), want_x.view(torch.uint8))
        assert torch.equal(y, want_y)
        x, y = samplers[0].gather(ids, labels=False, remote=peers.node_data, dtype=dtype)
        assert y is None and x is not None and torch.equal(x.view(torch.uint8), want_x.view(torch.uint8))
        x, y = samplers[0].gather(ids, features=False, remote=peers.node_data, dtype=dtype)
        assert x is None and y is not None and torch.equal(y, want_y)


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
    assert a == n
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("even", [True, False])
def test_gather_to_blocks_equals_gather(
    graph: GraphData, shuffled: tuple[list[Partition], np.ndarray], dtype: torch.dtype, even: bool
) -> None:
    """``gather_to`` writes the rows ``gather`` returns into the blocks, bit for bit, and
    returns the same labels: all owned or mixed, blocks of one size (one pass over all of
    them; float16 block by block) or uneven ones (block by block)."""
    parts, _ = shuffled
    samplers = _samplers(parts, False, False)
    peers = LocalPeers(samplers)
    rng = np.random.default_rng(9)
    num_nodes = int(samplers[0].partition_book[-1])
    width = parts[0].x.shape[1]
    for n_id in (rng.permutation(num_nodes)[:1500], np.arange(*parts[0].node_range)[::-1].copy()):
        ids = torch.from_numpy(n_id)
        want_x, want_y = samplers[0].gather(ids, remote=peers.node_data, dtype=dtype)
        assert want_x is not None
        sizes = [97] * (-(-ids.numel() // 97)) if even else [5, 300, 1, 64] + [1000] * 3
        blocks = _blocks(ids.numel(), sizes, width, dtype)
        y = samplers[0].gather_to(ids, blocks, remote=peers.node_data)
        got = torch.cat([rows for _, _, rows in blocks])
        assert torch.equal(got.view(torch.uint8), want_x.view(torch.uint8))
        assert y is not None and torch.equal(y, want_y)
        assert samplers[0].gather_to(ids, _blocks(ids.numel(), sizes, width, dtype), labels=False,
                                     remote=peers.node_data) is None


def test_peer_requests_are_in_flight_while_the_own_share_is_done(
    shuffled: tuple[list[Partition], np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hop's remote draws and a gather's remote rows are asked for before the sampler
    does its own partition's share, so the two overlap: each patched local step sees the
    peer's request already started, and the peer answers only once the local step ran.
    A peer's error still reaches the caller."""
    parts, _ = shuffled
    samplers = _samplers(parts, False, False)
    sampler, peers = samplers[0], LocalPeers(samplers)
    seen: list[str] = []

    def overlapped(name: str, local: Any, remote: Any) -> tuple[Any, Any]:
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

    start, stop = parts[0].node_range
    num_nodes = int(sampler.partition_book[-1])
    frontier = torch.tensor([start, stop, start + 1, num_nodes - 1])  # two owners
    local, remote = overlapped("sample", sampler.sample_neighbors, peers.neighbors)
    monkeypatch.setattr(sampler, "sample_neighbors", local)
    got = sampler.sample_frontier(frontier, 3, batch_key(1, 0, 0, 0), 0, remote)
    monkeypatch.undo()
    want = sampler.sample_frontier(frontier, 3, batch_key(1, 0, 0, 0), 0, peers.neighbors)
    assert torch.equal(got.counts, want.counts) and torch.equal(got.neighbors, want.neighbors)

    local, remote = overlapped("gather", sampler.gather_local_into, peers.node_data)
    monkeypatch.setattr(sampler, "gather_local_into", local)
    x, y = sampler.gather(frontier, remote=remote)
    monkeypatch.undo()
    want_x, want_y = sampler.gather(frontier, remote=peers.node_data)
    assert x is not None and want_x is not None and torch.equal(x, want_x)
    assert y is not None and want_y is not None and torch.equal(y, want_y)
    assert seen == ["sample", "gather"]

    def failing(*args: Any) -> Any:
        raise ConnectionError("peer partition 1: gone")
    with pytest.raises(ConnectionError, match="gone"):
        sampler.sample_frontier(frontier, 3, batch_key(1, 0, 0, 0), 0, cast(RemoteNeighbors, failing))
    with pytest.raises(ConnectionError, match="gone"):
        sampler.gather(frontier, remote=cast(RemoteNodeData, failing))


def test_begin_without_overlap_runs_the_call_in_place() -> None:
    """``overlap=False`` (a CUDA sampler under the simulator): the call has run, on the
    caller's thread, when ``begin`` returns; its error is raised by ``result()``."""
    done = begin(threading.get_ident, overlap=False)
    assert done.done() and done.result() == threading.get_ident()
    failed = begin(lambda: 1 // 0, overlap=False)
    with pytest.raises(ZeroDivisionError):
        failed.result()
    assert begin(lambda: threading.get_ident()).result(timeout=10) != threading.get_ident()
    with ThreadPoolExecutor(1, thread_name_prefix="given") as pool:  # on the pool given
        assert begin(lambda: threading.current_thread().name, pool=pool).result(timeout=10) \
            .startswith("given")
        assert begin(threading.get_ident, overlap=False, pool=pool).result() == threading.get_ident()


@pytest.mark.parametrize("shape", [(0, 4), (0,), (0, 2, 3), (6, 0)])
def test_gather_from_a_table_without_rows_or_columns(shape: tuple[int, ...]) -> None:
    """A partition that holds no node of a type with features has a [0, F] table."""
    from sampling_server.sampler import cpu_gather as G

    src = np.zeros(shape, dtype=np.float64)
    nodes = np.zeros(0 if shape[0] == 0 else 2, dtype=np.int64)
    got = G.gather(src, nodes, 0)
    assert got.shape == (nodes.size, *shape[1:]) and got.dtype == src.dtype


def test_gather_into_and_scatter_into_match_numpy_and_name_bad_shapes() -> None:
    from sampling_server.sampler import cpu_gather as G

    rng = np.random.default_rng(3)
    src = rng.standard_normal((500, 7)).astype(np.float32)
    nodes = rng.choice(np.arange(100, 600), 300, replace=False)
    places = rng.permutation(300)
    out = np.zeros((300, 7), np.float32)
    G.gather_into(src, nodes, 100, places, out)
    want = np.zeros_like(out)
    want[places] = src[nodes - 100]
    assert np.array_equal(out, want)
    labels = np.zeros(300, np.int64)
    G.gather_into(np.arange(500, dtype=np.int64), nodes, 100, places, labels)
    assert np.array_equal(labels[places], nodes - 100)
    again = np.zeros_like(out)
    G.scatter_into(src[:300], places, again)
    assert np.array_equal(again[places], src[:300])
    G.scatter_into(np.empty((0, 7), np.float32), np.empty(0, np.int64), again)  # nothing to do
    with pytest.raises(ValueError, match="scatter_into: expected"):
        G.scatter_into(src[:300].astype(np.float64), places, again)
    with pytest.raises(ValueError, match="gather_into: expected"):
        G.gather_into(src, nodes, 100, places[:10], out)
    # the same into blocks of 64 rows, each an array of its own, in one pass
    blocks = [np.zeros((min(64, 300 - a), 7), np.float32) for a in range(0, 300, 64)]
    G.gather_into_blocks(src, nodes, 100, places, G.RowBlocks(blocks))
    assert np.array_equal(np.concatenate(blocks), want)
    G.scatter_into_blocks(src[:300], places, G.RowBlocks(blocks))
    assert np.array_equal(np.concatenate(blocks)[places], src[:300])
    for bad in ([], [np.zeros((64, 7), np.float32), np.zeros((65, 7), np.float32)],
                [np.zeros((3, 7), np.float32), np.zeros((3, 7), np.float32), np.zeros((4, 7), np.float32)],
                [np.zeros((4, 7), np.float32), np.zeros((4, 6), np.float32)],
                [np.zeros((4, 7), np.float32), np.zeros((4, 7), np.float64)]):
        with pytest.raises(ValueError, match="RowBlocks: expected"):
            G.RowBlocks(bad)
    with pytest.raises(ValueError, match="gather_into_blocks: expected"):
        G.gather_into_blocks(src.astype(np.float64), nodes, 100, places, G.RowBlocks(blocks))
    with pytest.raises(ValueError, match="scatter_into_blocks: expected"):
        G.scatter_into_blocks(src[:300, :6], places, G.RowBlocks(blocks))


def test_same_key_same_batch_and_other_keys_differ(whole: list[Partition]) -> None:
    sampler = CpuNeighborSampler(whole[0])
    seeds = np.array([HUB, 0, 1, 2, 3])
    a = sampler.minibatch(seeds, [3, 3], batch_key(1, 2, 3, 4))
    _assert_same_batch(a, CpuNeighborSampler(whole[0]).minibatch(seeds, [3, 3],
                                                                  batch_key(1, 2, 3, 4)))
    others = [sampler.sample(seeds, [3, 3], batch_key(1, 2, 3, i)) for i in range(5, 10)]
    assert all(not torch.equal(o.n_id, a.structure.n_id) or not torch.equal(o.row, a.structure.row)
               for o in others)
    assert len({tuple(o.n_id.tolist()) for o in others}) > 1


# -- statistics ------------------------------------------------------------------------
def _draw_counts(sampler: CpuNeighborSampler, fanout: int, degree: int) -> np.ndarray:
    counts = np.zeros(degree, dtype=np.int64)
    node = torch.tensor([0])
    for key in STAT_KEYS:
        drawn = sampler.sample_neighbors(node, fanout, key, 0).neighbors.numpy()
        counts += np.bincount(drawn - 1, minlength=degree)
    return counts


@pytest.mark.parametrize("replace", [False, True], ids=["without", "with"])
def test_uniform_draws_are_uniform(tmp_path: Path, replace: bool) -> None:
    counts = _draw_counts(_star(tmp_path, replace=replace), 5, 20)
    assert counts.sum() == len(STAT_KEYS) * 5
    assert stats.chisquare(counts).pvalue > P_MIN  # expected 4000 * 5 / 20 each


def test_floyd_draws_distinct_uniform_subsets(tmp_path: Path) -> None:
    sampler = _star(tmp_path, degree=5)
    subsets: dict[tuple[int, ...], int] = {}
    for key in STAT_KEYS:
        drawn = sampler.sample_neighbors(torch.tensor([0]), 2, key, 1).neighbors.tolist()
        assert len(set(drawn)) == 2
        subsets[tuple(sorted(drawn))] = subsets.get(tuple(sorted(drawn)), 0) + 1
    assert len(subsets) == 10
    assert stats.chisquare(list(subsets.values())).pvalue > P_MIN


def test_weighted_with_replacement_is_proportional(tmp_path: Path) -> None:
    weights = [1.0, 2.0, 3.0, 4.0, 0.5, 6.0, 2.5, 1.0]
    counts = _draw_counts(_star(tmp_path, weights, weighted=True, replace=True), 5, len(weights))
    expected = np.asarray(weights) / sum(weights) * counts.sum()
    assert stats.chisquare(counts, expected).pvalue > P_MIN


def _successive_sampling(weights: list[float], k: int) -> dict[tuple[int, ...], float]:
    """Exact probability of each k-subset under Efraimidis–Spirakis, which equals
    drawing k times without replacement, each time in proportion to the weights left."""
    probs: dict[tuple[int, ...], float] = {}
    for order in itertools.permutations(range(len(weights)), k):
        p, left = 1.0, sum(weights)
        for i in order:
            p *= weights[i] / left
            left -= weights[i]
        subset = tuple(sorted(order))
        probs[subset] = probs.get(subset, 0.0) + p
    return probs


def test_weighted_without_replacement_matches_exact_es_probabilities(tmp_path: Path) -> None:
    weights = [1.0, 2.0, 3.0, 4.0]
    sampler = _star(tmp_path, weights, weighted=True)
    exact = _successive_sampling(weights, 2)
    seen = dict.fromkeys(exact, 0)
    for key in STAT_KEYS:
        drawn = sampler.sample_neighbors(torch.tensor([0]), 2, key, 0).neighbors.tolist()
        assert drawn == sorted(drawn) and len(set(drawn)) == 2  # CSC order, distinct
        seen[tuple(d - 1 for d in drawn)] += 1
    subsets = list(exact)
    observed = np.array([seen[s] for s in subsets])
    expected = np.array([exact[s] for s in subsets]) * len(STAT_KEYS)
    assert stats.chisquare(observed, expected).pvalue > P_MIN
    inclusion = [sum(p for s, p in exact.items() if i in s) for i in range(len(weights))]
    got = [sum(seen[s] for s in subsets if i in s) / len(STAT_KEYS) for i in range(len(weights))]
    assert np.allclose(got, inclusion, atol=0.03)


def test_weighted_without_replacement_favors_heavy_neighbors(tmp_path: Path) -> None:
    weights = [float(w) for w in range(1, 11)]
    counts = _draw_counts(_star(tmp_path, weights, weighted=True), 3, len(weights))
    assert counts.sum() == 3 * len(STAT_KEYS) and counts.max() <= len(STAT_KEYS)
    sigma = math.sqrt(len(STAT_KEYS) / 4)  # a Bernoulli's variance is at most 1/4
    assert np.all(np.diff(counts) > -3 * sigma), counts
    assert counts[-1] > 4 * counts[0]


# -- relabel ---------------------------------------------------------------------------
def test_relabeler_grows_and_numbers_in_first_seen_order() -> None:
    gen = np.random.default_rng(0)
    seeds = np.array([10, 3, 99], dtype=np.int64)
    relabeler = CpuRelabeler(seeds, expected_nodes=4)
    numbered = {int(s): i for i, s in enumerate(seeds)}
    for size in (0, 7, 5000, 20000):
        ids = gen.integers(0, 30000, size)
        new, local = relabeler.add(torch.from_numpy(ids))
        want_new = []
        for g in ids.tolist():
            if g not in numbered:
                numbered[g] = len(numbered)
                want_new.append(g)
        assert new.tolist() == want_new
        assert local.tolist() == [numbered[g] for g in ids.tolist()]
    assert len(relabeler) == len(numbered)


# -- bad input ------------------------------------------------------------------------
def test_bad_input_names_the_field(whole: list[Partition], three: list[Partition]) -> None:
    sampler = CpuNeighborSampler(three[0])
    stop = three[0].node_range[1]
    with pytest.raises(ValueError, match="seeds"):
        sampler.sample(np.array([stop]), [2], key=1)
    with pytest.raises(ValueError, match="seeds"):
        sampler.sample(np.array([-1]), [2], key=1)
    with pytest.raises(ValueError, match="seeds"):
        sampler.sample(np.array([0, 1, 0]), [2], key=1)
    with pytest.raises(ValueError, match="fanouts"):
        sampler.sample(np.array([0]), [-2], key=1)
    with pytest.raises(ValueError, match="fanouts"):
        sampler.sample(np.array([0]), [], key=1)
    with pytest.raises(ValueError, match="fanout"):
        sampler.sample_neighbors(torch.tensor([0]), -3, key=1, hop=0)
    with pytest.raises(ValueError, match="nodes"):
        sampler.sample_neighbors(torch.tensor([stop]), 2, key=1, hop=0)
    with pytest.raises(ValueError, match="nodes"):
        sampler.gather_local(torch.tensor([stop]), True, True)
    with pytest.raises(ValueError, match="nodes"):
        sampler.sample_neighbors(torch.tensor([0], dtype=torch.int32), 2, key=1, hop=0)
    with pytest.raises(RuntimeError, match="remote"):
        sampler.sample(np.arange(stop), [-1, -1], key=1)


def test_weighted_needs_edge_weights(tmp_path: Path) -> None:
    part = write_and_load(mixed_graph(weighted=False), tmp_path, 1)[0]
    with pytest.raises(ValueError, match="weight"):
        CpuNeighborSampler(part, weighted=True)
    with pytest.raises(ValueError, match="weight"):
        create_sampler(part, "cpu", weighted=True)


def test_create_sampler(whole: list[Partition]) -> None:
    assert isinstance(create_sampler(whole[0], "cpu", replace=True), CpuNeighborSampler)
    if not torch.cuda.is_available():
        assert isinstance(create_sampler(whole[0]), CpuNeighborSampler)
    with pytest.raises(ValueError, match="device"):
        create_sampler(whole[0], "tpu")
    with pytest.raises(ValueError, match="topology"):
        create_sampler(whole[0], "cpu", topology="disk")


# -- PyG ------------------------------------------------------------------------------
def test_pyg_graphsage_runs_on_a_converted_batch(whole: list[Partition]) -> None:
    from torch_geometric.nn import SAGEConv

    sampler = CpuNeighborSampler(whole[0])
    data = to_pyg_data(sampler.minibatch(np.array([HUB, 0, 9]), [4, 3], batch_key(0, 0, 0, 0)))
    assert data.batch_size == 3 and data.num_nodes == data.n_id.numel()
    assert data.edge_index.shape == (2, sum(data.num_sampled_edges))
    assert len(data.num_sampled_nodes) == 3
    torch.manual_seed(0)
    conv1, conv2 = SAGEConv(data.x.shape[1], 16), SAGEConv(16, 4)
    hidden = conv1(data.x, data.edge_index).relu()
    out = conv2(hidden, data.edge_index)[: data.batch_size]
    assert out.shape == (3, 4)
    loss = torch.nn.functional.cross_entropy(out, data.y[: data.batch_size], ignore_index=-1)
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.parametrize(("replace", "weighted"), MODES, ids=MODE_IDS)
def test_fused_path_and_generic_path_agree(whole: list[Partition], monkeypatch: pytest.MonkeyPatch,
                                               replace: bool, weighted: bool) -> None:
    """The fused hops (the default: draws, relabel and edges straight into the batch's
    arrays through a dense map) give exactly the generic path's batch (draw, then relabel
    through a hash table, as for huge graphs), and leave the dense maps all UNSEEN."""
    dense = CpuNeighborSampler(whole[0], replace=replace, weighted=weighted)
    monkeypatch.setattr(cpu_sampler, "DENSE_RELABEL_MAX_NODES", 0)
    hashed = CpuNeighborSampler(whole[0], replace=replace, weighted=weighted)
    assert dense._dense_maps is not None and hashed._dense_maps is None
    for i, seeds in enumerate(_seed_sets(whole[0])):
        for fanouts in FANOUTS:
            a = dense.sample(seeds, fanouts, batch_key(9, 0, 0, i))
            generic = NeighborSampler.sample(dense, seeds, fanouts, batch_key(9, 0, 0, i))
            b = hashed.sample(seeds, fanouts, batch_key(9, 0, 0, i))
            for other in (generic, b):
                assert torch.equal(a.n_id, other.n_id) and torch.equal(a.row, other.row)
                assert torch.equal(a.col, other.col)
                assert a.num_sampled_nodes == other.num_sampled_nodes
                assert a.num_sampled_edges == other.num_sampled_edges
    pooled = dense._dense_maps._free
    assert pooled and all(bool((m == F.UNSEEN).all()) for m in pooled)
    for bad in (np.array([HUB, HUB]), np.array([1, 2, 3, 1])):
        with pytest.raises(ValueError, match=r"seeds.*repeats"):
            dense.sample(bad, [2], 0)
        with pytest.raises(ValueError, match=r"seeds.*repeats"):
            NeighborSampler.sample(dense, bad, [2], 0)
    assert all(bool((m == F.UNSEEN).all()) for m in dense._dense_maps._free)


def test_fused_numbering_does_not_depend_on_threads(tmp_path: Path) -> None:
    """Large frontiers (many chunks, many repeats within a hop): the parallel first-seen
    numbering gives the sequential numbering whatever the number of threads."""
    part = write_and_load(generate("small", seed=1, progress=False), tmp_path, 1)[0]
    sampler = CpuNeighborSampler(part)
    seeds = np.random.default_rng(0).permutation(part.num_nodes)[:1500]
    expected = NeighborSampler.sample(sampler, seeds, [10, 10], batch_key(5, 0, 0, 0))
    assert expected.n_id.numel() > 3000 and expected.num_sampled_edges[1] > 20 * K.PARALLEL_MIN_NODES
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, before}):
            numba.set_num_threads(threads)
            got = sampler.sample(seeds, [10, 10], batch_key(5, 0, 0, 0))
            for name in ("n_id", "row", "col"):
                assert torch.equal(getattr(got, name), getattr(expected, name)), (threads, name)
    finally:
        numba.set_num_threads(before)


CONCURRENT_SAMPLING = """
import sys, threading
import numpy as np, torch
from pathlib import Path
from partitioner.format import load_partition
from partitioner.partition import partition_graph
from partitioner.synthetic import generate
from sampling_server.sampler.cpu_sampler import CpuNeighborSampler
import numba
out = Path(sys.argv[1])
partition_graph(generate("small", progress=False), 1, out, method="range", progress=False)
part = load_partition(out, 0)
sampler = CpuNeighborSampler(part)
nodes = np.arange(part.manifest.num_nodes)
errors = []
def work(t):
    rng = np.random.default_rng(t)
    for i in range(40):
        try:
            sampler.sample(torch.from_numpy(rng.choice(nodes, 16, replace=False)), [4, 3], key=i)
        except Exception as exc:
            errors.append(repr(exc))
threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
for t in threads: t.start()
for t in threads: t.join(timeout=120)
print(numba.threading_layer(), len(errors), errors[:3])
sys.exit(1 if errors or numba.threading_layer() != "workqueue" else 0)
"""


def test_concurrent_batches_under_the_workqueue_threading_layer(tmp_path: Path) -> None:
    """Numba's workqueue layer (no OpenMP or TBB, as in a slim container) must not see
    two parallel kernels at once: every one runs under ``parallel_guard``, or the process
    aborts or leaves a relabel map dirty (false "repeated seed" errors in later batches)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue", "NUMBA_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", CONCURRENT_SAMPLING, str(tmp_path / "g")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("seed", range(4))
def test_answers_of_several_owners_go_back_in_frontier_order(seed: int) -> None:
    """merge_hop_samples: each owner answers its frontier entries (a count and a run of
    neighbors each, runs back to back); the merged hop lists every entry's run in
    frontier order, as per-entry Python lists do."""
    from sampling_server.sampler.base import merge_hop_samples
    from sampling_server.sampler.types import HopSample

    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 300))
    owner = rng.integers(0, 3, n)
    positions = {g: torch.from_numpy(np.flatnonzero(owner == g)) for g in range(3) if (owner == g).any()}
    runs: list[list[int]] = [[] for _ in range(n)]
    parts = {}
    for g, pos in positions.items():
        counts = rng.integers(0, 6, pos.numel())
        values = rng.integers(0, 10**9, int(counts.sum()))
        start = 0
        for p, c in zip(pos.tolist(), counts.tolist(), strict=True):
            runs[p] = values[start:start + c].tolist()
            start += c
        parts[g] = HopSample(counts=torch.from_numpy(counts), neighbors=torch.from_numpy(values))
    if seed % 2:  # answers may come in int32
        parts = {g: HopSample(h.counts.to(torch.int32), h.neighbors) for g, h in parts.items()}
    merged = merge_hop_samples(n, positions, parts, torch.device("cpu"))
    assert merged.counts.tolist() == [len(r) for r in runs]
    assert merged.neighbors.tolist() == [v for r in runs for v in r]


def test_the_helpers_that_keep_the_interpreter_lock_agree_with_numpy() -> None:
    from sampling_server.sampler import cpu_kernels as k

    rng = np.random.default_rng(7)
    for ids in (rng.integers(-5, 10**12, 100_003), rng.integers(0, 1000, 17).astype(np.int32),
                rng.integers(0, 10**9, 1000)[::3], np.array([42]), np.arange(10)[::-1]):
        assert k.id_min_max(ids) == (ids.min(), ids.max())
        assert k.total(ids) == ids.sum()
    assert k.total(np.zeros(0, np.int64)) == 0
    assert np.array_equal(k.positions(5), np.arange(5)) and k.positions(0).size == 0
    assert k.positions(3).dtype == np.int64
    book = np.array([0, 10, 10, 25, 40])  # partition 1 empty
    ids = rng.integers(0, 40, 500)
    owner = k.owners(book, ids)
    assert np.array_equal(owner, np.searchsorted(book, ids, side="right") - 1)
    for parts, n in ((3, 70_000), (100, 1_000)):  # the lock released (large), many partitions
        many = np.sort(rng.integers(0, 10**6, parts + 1))
        many[0], many[-1] = 0, 10**6
        some = rng.integers(0, 10**6, n)
        assert np.array_equal(k.owners(many, some), np.searchsorted(many, some, side="right") - 1)
        order, starts = k.group_positions(k.owners(many, some), parts)
        assert np.array_equal(np.sort(order), np.arange(n)) and starts[-1] == n
        assert np.array_equal(k.take(some, order), some[order])
        full, offsets = k.run_offsets(n, order, np.ones(n, np.int64))
        assert np.array_equal(full, np.ones(n)) and np.array_equal(offsets, np.arange(n))
    order, starts = k.group_positions(owner, 4)
    for p in range(4):
        assert np.array_equal(order[starts[p]:starts[p + 1]], np.flatnonzero(owner == p))
    with pytest.raises(ValueError, match="owner outside"):
        k.group_positions(np.array([0, 4]), 4)
    pos = rng.integers(0, ids.size, 50)
    assert np.array_equal(k.take(ids, pos), ids[pos])
    perm = rng.permutation(30)
    counts = rng.integers(0, 5, 30)
    full, offsets = k.run_offsets(30, perm, counts)
    expect = np.zeros(30, np.int64)
    expect[perm] = counts
    assert np.array_equal(full, expect) and np.array_equal(offsets, np.cumsum(expect) - expect)


def test_owner_groups_on_the_cpu_match_the_torch_way() -> None:
    from sampling_server.sampler.base import owner_groups

    rng = np.random.default_rng(3)
    for n, parts in ((0, 3), (1, 3), (200, 3), (1000, 5)):
        owner = torch.from_numpy(rng.integers(0, parts, n))
        for skip in (None, 1):
            fast = owner_groups(owner, skip, num_parts=parts)
            slow = owner_groups(owner, skip)
            assert list(fast) == sorted(slow) and all(torch.equal(fast[p], slow[p]) for p in slow)
