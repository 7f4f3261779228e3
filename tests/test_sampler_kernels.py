"""The CPU sampler's kernels: each relation's draws follow the spec in docs/sampling.md
exactly (against a plain Python reference, on both kinds of graph), the compiled and
Python random streams agree, draws are uniform / weight-proportional by chi-square tests
over fixed keys (star graphs), the relabel table and the fused numbering are exact
whatever the threads, and the helpers that keep the interpreter lock agree with NumPy."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from graph_fixtures import HUB, KINDS, PLAIN_EDGE_TYPE, mixed, star_graph, write_and_load
from scipy import stats

from partitioner.graph import EdgeType
from partitioner.partition import Partition
from partitioner.synthetic import generate
from sampling_server.sampler import CpuNeighborSampler, CpuRelabeler, batch_key, relation_key, rng
from sampling_server.sampler import cpu_gather as G
from sampling_server.sampler import cpu_glue as L
from sampling_server.sampler import cpu_kernels as K
from sampling_server.sampler.base import NeighborSampler
from sampling_server.sampler.rows import begin, merge_hop_samples, owner_groups
from sampling_server.sampler.types import HopSample

MODES = [(False, False), (True, False), (False, True), (True, True)]  # (replace, weighted)
MODE_IDS = ["uniform", "replace", "weighted", "weighted-replace"]
#: Keys of the statistical tests (fixed, so the tests are deterministic).
STAT_KEYS = [batch_key(2024, 0, 0, i) for i in range(4000)]
P_MIN = 1e-4


@pytest.fixture(scope="module", params=KINDS)
def whole(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Partition:
    """The mixed graph of each kind, as one partition (global IDs are original IDs)."""
    return write_and_load(mixed(request.param), tmp_path_factory.mktemp("mixed-p1"), 1)[0]


def _star(tmp_path: Path, weights: list[float] | None = None, degree: int = 20, *, replace: bool = False,
          weighted: bool = False) -> CpuNeighborSampler:
    part = write_and_load(star_graph(degree, weights), tmp_path, 1)[0]
    return CpuNeighborSampler(part, replace=replace, weighted=weighted)


def _drawn(sampler: CpuNeighborSampler, fanout: int, key: int, hop: int = 0) -> torch.Tensor:
    """In-neighbors of the star's center (node 0) drawn with ``key``."""
    return sampler.sample_relation(PLAIN_EDGE_TYPE, torch.tensor([0]), fanout, key, hop).neighbors


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


def _check_relation_draws(sampler: CpuNeighborSampler, part: Partition, et: EdgeType) -> None:
    """Every node's draws along ``et`` are the reference's, keyed by the relation's draw
    key and the node's original ID; asked for, their internal edge IDs come with the same
    draws and name the drawn edges (the source at that CSC position, within the node's
    range; distinct without replacement)."""
    indptr, indices = np.asarray(part.indptr[et]), np.asarray(part.indices[et])
    weight = np.asarray(part.edge_weight[et]) if sampler.weighted else None
    orig = np.asarray(part.orig_ids[et[2]])
    start, stop = part.node_range(et[2])
    nodes = torch.arange(start, stop)
    for fanout, key, hop in itertools.product([0, 1, 3, 7, 40, -1], [1, 2**63 + 5], [0, 2]):
        got = sampler.sample_relation(et, nodes, fanout, key, hop)
        with_edges = sampler.sample_relation(et, nodes, fanout, key, hop, edges=True)
        assert got.edges is None and with_edges.edges is not None
        assert torch.equal(with_edges.counts, got.counts) and torch.equal(with_edges.neighbors, got.neighbors)
        counts, flat, at = got.counts.tolist(), got.neighbors.tolist(), 0
        pos = with_edges.edges.numpy() - part.edge_start[et]
        assert np.array_equal(indices[pos], got.neighbors.numpy())
        for v in range(stop - start):
            lo, hi = indptr[v], indptr[v + 1]
            want = reference_draw(indices[lo:hi], None if weight is None else weight[lo:hi], fanout,
                                  sampler.draw_key(key, et), hop, int(orig[v]), sampler.replace)
            assert flat[at:at + counts[v]] == want, (et, v, fanout, key, hop)
            mine = pos[at:at + counts[v]]
            assert np.all((lo <= mine) & (mine < hi)), (et, v, fanout)
            assert sampler.replace or np.unique(mine).size == mine.size, (et, v, fanout)
            at += counts[v]
        assert at == len(flat)


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize(("replace", "weighted"), MODES, ids=MODE_IDS)
def test_draws_follow_the_spec_exactly(whole: Partition, replace: bool, weighted: bool, parallel: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Per relation (a plain graph's one), and the rows gathered in any order."""
    if parallel:  # tiny frontiers and gathers take the prange kernels too
        monkeypatch.setattr(K, "PARALLEL_MIN_NODES", 0)
        monkeypatch.setattr(K, "PARALLEL_MIN_ROWS", 0)
        monkeypatch.setattr(G, "PARALLEL_MIN_ROWS", 0)
    sampler = CpuNeighborSampler(whole, replace=replace, weighted=weighted)
    for et in sampler.edge_types:
        _check_relation_draws(sampler, whole, et)
    for t, x in whole.x.items():
        nodes = torch.arange(*whole.node_range(t)).flip(0)
        got_x, got_y = sampler.gather_local(t, nodes, True, True)
        assert got_x is not None and np.array_equal(got_x.numpy(), np.asarray(x)[::-1])
        assert (got_y is None) == (t != whole.target_type)
        assert got_y is None or np.array_equal(got_y.numpy(), np.asarray(whole.y)[::-1])


def test_compiled_rng_equals_python_rng() -> None:
    with np.errstate(over="ignore"):
        for key, hop, node in [(0, 0, 0), (2**64 - 1, 3, 17), (123456789, 1, 2**40)]:
            s = rng.node_stream(np.uint64(key), np.int64(hop), np.int64(node))
            assert K.node_stream(np.uint64(key), hop, node) == s
            for j in (0, 1, 99):
                assert K.uniform(s, j) == rng.uniform(s, np.int64(j))
                assert K.uniform_below(s, j, 7) == rng.uniform_below(s, np.int64(j), np.int64(7))


def test_relations_draw_with_keys_of_their_own(whole: Partition) -> None:
    """A typed graph's relations (even two into one type) draw with distinct keys, so one
    node's draws are not tied across them; a plain graph's one relation draws with the
    batch key itself (as before typed graphs existed: the same batches)."""
    writes, cites = ("author", "writes", "paper"), ("paper", "cites", "paper")
    keys = {relation_key(7, et) for et in [writes, cites, ("paper", "rev_cites", "paper")]}
    assert len(keys) == 3 and relation_key(7, writes) != relation_key(8, writes)
    assert all(0 <= k < 2**64 for k in keys)
    sampler = CpuNeighborSampler(whole)
    for et in sampler.edge_types:
        want = (2**64 - 3) if sampler.plain else relation_key(-3, et)
        assert sampler.draw_key(-3, et) == want


# -- statistics ------------------------------------------------------------------------
def _draw_counts(sampler: CpuNeighborSampler, fanout: int, degree: int) -> np.ndarray:
    counts = np.zeros(degree, dtype=np.int64)
    for key in STAT_KEYS:
        counts += np.bincount(_drawn(sampler, fanout, key).numpy() - 1, minlength=degree)
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
        drawn = _drawn(sampler, 2, key, hop=1).tolist()
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
        drawn = _drawn(sampler, 2, key).tolist()
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


def test_uniform_draws_of_one_node_along_a_relation(whole: Partition) -> None:
    """Chi-square: each in-edge of the hub along its relation (a typed graph's ``writes``)
    is drawn k/d of the time, repeated edges in proportion to their count."""
    sampler = CpuNeighborSampler(whole)
    et = sampler.edge_types[0]  # a typed graph's first: author writes paper (the hub's)
    indptr = np.asarray(whole.indptr[et])
    sources, mult = np.unique(np.asarray(whole.indices[et])[indptr[HUB]:indptr[HUB + 1]], return_counts=True)
    d, k, trials = int(mult.sum()), 4, 3000
    assert d >= 20
    counts = np.zeros(sources.size)
    for key in range(trials):
        drawn = sampler.sample_relation(et, torch.tensor([HUB]), k, key, 0).neighbors.numpy()
        assert drawn.size == k
        counts += np.bincount(np.searchsorted(sources, drawn), minlength=sources.size)
    assert stats.chisquare(counts, trials * k * mult / d).pvalue > P_MIN


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
    with pytest.raises(ValueError, match=r"^seeds: expected unique node IDs; 3 repeats"):
        CpuRelabeler(np.array([1, 3, 2, 3], dtype=np.int64))


@pytest.mark.parametrize("preset", ["small", "mag-small"], ids=KINDS)
def test_fused_numbering_does_not_depend_on_threads(tmp_path: Path, preset: str) -> None:
    """Large frontiers (many chunks, many repeats within a hop; on a typed graph several
    relations numbering into one type): the parallel first-seen numbering gives the
    sequential numbering whatever the number of threads."""
    part = write_and_load(generate(preset, seed=1, progress=False), tmp_path, 1)[0]
    sampler = CpuNeighborSampler(part)
    t = part.target_type
    seeds = np.random.default_rng(0).permutation(part.num_nodes(t))[:1500]
    expected = NeighborSampler.sample(sampler, seeds, t, [10, 10], batch_key(5, 0, 0, 0))
    assert expected.node[t].numel() > 3000
    assert max(e[1] for e in expected.num_sampled_edges.values()) > 20 * K.PARALLEL_MIN_NODES
    before = numba.get_num_threads()
    try:
        for threads in sorted({1, before}):
            numba.set_num_threads(threads)
            got = sampler.sample(seeds, t, [10, 10], batch_key(5, 0, 0, 0))
            for u in expected.node:
                assert torch.equal(got.node[u], expected.node[u]), (threads, u)
            for et in expected.row:
                assert torch.equal(got.row[et], expected.row[et]), (threads, et)
                assert torch.equal(got.col[et], expected.col[et]), (threads, et)
    finally:
        numba.set_num_threads(before)


CONCURRENT_SAMPLING = """
import sys, threading
import numpy as np
from pathlib import Path
from partitioner import partition_graph
from partitioner.format import load_partition
from partitioner.synthetic import generate
from sampling_server.sampler.cpu_sampler import CpuNeighborSampler
import numba
errors = []
def work(sampler, t, nodes, seed):
    rng = np.random.default_rng(seed)
    for i in range(20):
        try:
            sampler.sample(rng.choice(nodes, 96, replace=False), t, [4, 3], key=i)
        except Exception as exc:
            errors.append(repr(exc))
for preset in ("small", "mag-small"):
    out = Path(sys.argv[1]) / preset
    partition_graph(generate(preset, progress=False), 1, out, method="range", progress=False)
    part = load_partition(out, 0)
    sampler, t = CpuNeighborSampler(part), part.target_type
    nodes = np.arange(part.num_nodes(t))
    threads = [threading.Thread(target=work, args=(sampler, t, nodes, s)) for s in range(4)]
    for th in threads: th.start()
    for th in threads: th.join(timeout=120)
print(numba.threading_layer(), len(errors), errors[:3])
sys.exit(1 if errors or numba.threading_layer() != "workqueue" else 0)
"""


def test_concurrent_batches_under_the_workqueue_threading_layer(tmp_path: Path) -> None:
    """Numba's workqueue layer (no OpenMP or TBB, as in a slim container) must not see
    two parallel kernels at once: every one runs under ``parallel_guard``, or the process
    aborts or leaves a relabel map dirty (false "repeated seed" errors in later batches);
    a plain graph and a typed one."""
    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue", "NUMBA_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-c", CONCURRENT_SAMPLING, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


# -- the plumbing ----------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_answers_of_several_owners_go_back_in_frontier_order(seed: int) -> None:
    """merge_hop_samples: each owner answers its frontier entries (a count and a run of
    neighbors and of their edge IDs each, runs back to back); the merged hop lists every
    entry's runs in frontier order, as per-entry Python lists do."""
    gen = np.random.default_rng(seed)
    n = int(gen.integers(0, 300))
    owner = gen.integers(0, 3, n)
    positions = {g: torch.from_numpy(np.flatnonzero(owner == g)) for g in range(3) if (owner == g).any()}
    runs: list[list[int]] = [[] for _ in range(n)]
    parts = {}
    for g, pos in positions.items():
        counts = gen.integers(0, 6, pos.numel())
        values = gen.integers(0, 10**9, int(counts.sum()))
        start = 0
        for p, c in zip(pos.tolist(), counts.tolist(), strict=True):
            runs[p] = values[start:start + c].tolist()
            start += c
        parts[g] = HopSample(counts=torch.from_numpy(counts), neighbors=torch.from_numpy(values),
                             edges=torch.from_numpy(values) + 7)  # edge IDs: as neighbors, shifted
    if seed % 2:  # answers may come in int32
        parts = {g: HopSample(h.counts.to(torch.int32), h.neighbors, h.edges) for g, h in parts.items()}
    merged = merge_hop_samples(n, positions, parts, torch.device("cpu"))
    assert merged.counts.tolist() == [len(r) for r in runs]
    assert merged.neighbors.tolist() == [v for r in runs for v in r]
    assert merged.edges is not None and merged.edges.tolist() == [v + 7 for r in runs for v in r]
    # a part without edge IDs: the merged hop has none (edges were not asked for)
    edgeless = {g: HopSample(h.counts, h.neighbors) for g, h in parts.items()}
    again = merge_hop_samples(n, positions, edgeless, torch.device("cpu"))
    assert (again.edges is None or not positions) and torch.equal(again.neighbors, merged.neighbors)


def test_the_helpers_that_keep_the_interpreter_lock_agree_with_numpy() -> None:
    gen = np.random.default_rng(7)
    for ids in (gen.integers(-5, 10**12, 100_003), gen.integers(0, 1000, 17).astype(np.int32),
                gen.integers(0, 10**9, 1000)[::3], np.array([42]), np.arange(10)[::-1]):
        assert L.id_min_max(ids) == (ids.min(), ids.max())
        assert L.total(ids) == ids.sum()
    assert L.total(np.zeros(0, np.int64)) == 0
    assert np.array_equal(L.positions(5), np.arange(5)) and L.positions(0).size == 0
    assert L.positions(3).dtype == np.int64
    book = np.array([0, 10, 10, 25, 40])  # partition 1 empty
    ids = gen.integers(0, 40, 500)
    owner = L.owners(book, ids)
    assert np.array_equal(owner, np.searchsorted(book, ids, side="right") - 1)
    for parts, n in ((3, 70_000), (100, 1_000)):  # the lock released (large), many partitions
        many = np.sort(gen.integers(0, 10**6, parts + 1))
        many[0], many[-1] = 0, 10**6
        some = gen.integers(0, 10**6, n)
        assert np.array_equal(L.owners(many, some), np.searchsorted(many, some, side="right") - 1)
        order, starts = L.group_positions(L.owners(many, some), parts)
        assert np.array_equal(np.sort(order), np.arange(n)) and starts[-1] == n
        assert np.array_equal(L.take(some, order), some[order])
        full, offsets = L.run_offsets(n, order, np.ones(n, np.int64))
        assert np.array_equal(full, np.ones(n)) and np.array_equal(offsets, np.arange(n))
    order, starts = L.group_positions(owner, 4)
    for p in range(4):
        assert np.array_equal(order[starts[p]:starts[p + 1]], np.flatnonzero(owner == p))
    with pytest.raises(ValueError, match="owner outside"):
        L.group_positions(np.array([0, 4]), 4)
    pos = gen.integers(0, ids.size, 50)
    assert np.array_equal(L.take(ids, pos), ids[pos])
    perm = gen.permutation(30)
    counts = gen.integers(0, 5, 30)
    full, offsets = L.run_offsets(30, perm, counts)
    expect = np.zeros(30, np.int64)
    expect[perm] = counts
    assert np.array_equal(full, expect) and np.array_equal(offsets, np.cumsum(expect) - expect)


def test_owner_groups_on_the_cpu_match_the_torch_way() -> None:
    gen = np.random.default_rng(3)
    for n, parts in ((0, 3), (1, 3), (200, 3), (1000, 5)):
        owner = torch.from_numpy(gen.integers(0, parts, n))
        fast = owner_groups(owner, parts)
        slow = {p: torch.nonzero(owner == p).flatten() for p in torch.unique(owner).tolist()}
        assert list(fast) == sorted(slow) and all(torch.equal(fast[p], slow[p]) for p in slow)


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


# -- row gathers -----------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0, 4), (0,), (0, 2, 3), (6, 0)])
def test_gather_from_a_table_without_rows_or_columns(shape: tuple[int, ...]) -> None:
    """A partition that holds no node of a type with features has a [0, F] table."""
    src = np.zeros(shape, dtype=np.float64)
    nodes = np.zeros(0 if shape[0] == 0 else 2, dtype=np.int64)
    got = G.gather(src, nodes, 0)
    assert got.shape == (nodes.size, *shape[1:]) and got.dtype == src.dtype


def test_gather_into_and_scatter_into_match_numpy_and_name_bad_shapes() -> None:
    gen = np.random.default_rng(3)
    src = gen.standard_normal((500, 7)).astype(np.float32)
    nodes = gen.choice(np.arange(100, 600), 300, replace=False)
    places = gen.permutation(300)
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
    G.gather_into(src, nodes, 100, places, G.RowBlocks(blocks))
    assert np.array_equal(np.concatenate(blocks), want)
    G.scatter_into(src[:300], places, G.RowBlocks(blocks))
    assert np.array_equal(np.concatenate(blocks)[places], src[:300])
    bad_layouts: list[list[np.ndarray]] = [
        [], [np.zeros((64, 7), np.float32), np.zeros((65, 7), np.float32)],
        [np.zeros((3, 7), np.float32), np.zeros((3, 7), np.float32), np.zeros((4, 7), np.float32)],
        [np.zeros((4, 7), np.float32), np.zeros((4, 6), np.float32)],
        [np.zeros((4, 7), np.float32), np.zeros((4, 7), np.float64)]]
    for bad in bad_layouts:
        with pytest.raises(ValueError, match="RowBlocks: expected"):
            G.RowBlocks(bad)
    with pytest.raises(ValueError, match="gather_into: expected"):
        G.gather_into(src.astype(np.float64), nodes, 100, places, G.RowBlocks(blocks))
    with pytest.raises(ValueError, match="scatter_into: expected"):
        G.scatter_into(src[:300, :6], places, G.RowBlocks(blocks))


def test_float16_rows_narrow_to_bfloat16_as_torch_casts_them() -> None:
    """Every float16 value (subnormals, infinities, NaNs) gathered into bfloat16 words
    equals torch's cast of it, into an array and into blocks; without ``bfloat16`` the
    words are copied as they are."""
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    src = words.view(np.float16).reshape(-1, 16)
    nodes = np.arange(src.shape[0], dtype=np.int64)
    places = nodes[::-1].copy()
    want = torch.from_numpy(src.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    out = np.empty(src.shape, np.uint16)
    G.gather_into(src, nodes, 0, places, out, bfloat16=True)
    np.testing.assert_array_equal(out[places], want)
    blocks = [np.empty((1000, 16), np.uint16) for _ in range(4)] + [np.empty((96, 16), np.uint16)]
    G.gather_into(src, nodes, 0, places, G.RowBlocks(blocks), bfloat16=True)
    np.testing.assert_array_equal(np.concatenate(blocks)[places], want)
    G.gather_into(src, nodes, 0, places, out)
    np.testing.assert_array_equal(out[places], src.view(np.uint16))
