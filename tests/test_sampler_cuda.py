"""The CUDA sampler on both kinds of graph: structural properties, equality with the CPU
sampler (one partition, across partitions, over the whole graph's structure and rows),
dedup, bad input, host reads, gathers, and the kernels' launch types.

Without a GPU these run on Numba's CUDA simulator (``conftest.py``), so the graphs are
tiny; on a real GPU the same tests run on the device, and the ``gpu``-marked ones add
zero-copy, stream and larger-graph checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest
import torch
from graph_fixtures import (
    HUB,
    KINDS,
    NUM_ISOLATED,
    PLAIN_EDGE_TYPE,
    AnyGraph,
    LocalPeers,
    assert_same_batch,
    check_edge_ids,
    check_rows,
    check_sampler_output,
    global_adjacency,
    large,
    mixed,
    parted,
    star_graph,
    typed_view,
    write_and_load,
)
from numba import cuda

from partitioner.joins import load_node_data, load_structure
from partitioner.partition import Partition
from sampling_server.sampler import Minibatch, cuda_features, normalize_num_neighbors
from sampling_server.sampler import cuda_kernels as K
from sampling_server.sampler import cuda_launch as L
from sampling_server.sampler.cpu_sampler import CpuNeighborSampler
from sampling_server.sampler.cuda_sampler import CudaNeighborSampler
from sampling_server.sampler.links import BINARY, TRIPLET, LinkOptions, exclude_edges, link_seeds
from sampling_server.sampler.ptx_check import kernel_signatures
from sampling_server.sampler.rng import batch_key
from sampling_server.sampler.types import SamplerOutput

VARIANTS = [(False, False), (True, False), (False, True), (True, True)]  # (replace, weighted)
VARIANT_IDS = ["uniform", "replace", "weighted", "weighted-replace"]


@pytest.fixture(scope="module", params=KINDS)
def graph(request: pytest.FixtureRequest) -> AnyGraph:
    return mixed(request.param)


@pytest.fixture(scope="module")
def one_part(graph: AnyGraph, tmp_path_factory: pytest.TempPathFactory) -> list[Partition]:
    return write_and_load(graph, tmp_path_factory.mktemp("mixed1"), 1)


@pytest.fixture(scope="module")
def two_parts(graph: AnyGraph, tmp_path_factory: pytest.TempPathFactory) -> list[Partition]:
    return write_and_load(graph, tmp_path_factory.mktemp("mixed2"), 2)


def _seeds(part: Partition, count: int = 4) -> np.ndarray:
    """``count`` owned nodes of the target type, the hub first when this partition owns it."""
    t = part.target_type
    owned = np.arange(*part.node_range(t), dtype=np.int64)
    first = owned[np.asarray(part.orig_ids[t]) == HUB]
    rest = owned[np.isin(owned, first, invert=True)][:: max(1, owned.size // count)]
    return np.concatenate([first, rest])[:count]


def _same(a: SamplerOutput, b: SamplerOutput) -> None:
    assert_same_batch(Minibatch(a, ""), Minibatch(b, ""))


# -- structure -----------------------------------------------------------------------
@pytest.mark.parametrize(("replace", "weighted"), VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("fanouts", [[3, 2], [-1, 1], [0, 2]], ids=["3-2", "all-1", "0-2"])
def test_output_properties(one_part: list[Partition], replace: bool, weighted: bool,
                           fanouts: list[int]) -> None:
    sampler = CudaNeighborSampler(one_part[0], replace=replace, weighted=weighted)
    seeds, t = _seeds(one_part[0]), sampler.target_type
    out = sampler.sample(seeds, t, fanouts, batch_key(0, 1, 0, 3))
    assert all(n.device == sampler.device == L.torch_device() for n in out.node.values())
    check_sampler_output(out, seeds, t, normalize_num_neighbors(fanouts, sampler.edge_types),
                         global_adjacency(one_part), replace=replace)


def test_isolated_and_empty_frontiers(one_part: list[Partition]) -> None:
    """Nodes without in-edges draw nothing; an empty frontier stays empty."""
    part = one_part[0]
    t = part.target_type
    isolated = np.arange(*part.node_range(t))[-NUM_ISOLATED:]
    for replace, weighted in VARIANTS:
        sampler = CudaNeighborSampler(part, replace=replace, weighted=weighted)
        out = sampler.sample(isolated, t, [4, 4], key=7)
        assert out.num_sampled_nodes == {u: [isolated.size * (u == t), 0, 0] for u in sampler.node_types}
        assert out.num_sampled_edges == {et: [0, 0] for et in sampler.edge_types}
        for et in sampler.edge_types:
            empty = sampler.sample_relation(et, torch.empty(0, dtype=torch.int64), 3, key=7, hop=0)
            assert empty.counts.numel() == 0 and empty.neighbors.numel() == 0


def test_same_key_same_batch(one_part: list[Partition]) -> None:
    sampler = CudaNeighborSampler(one_part[0])
    seeds, t = _seeds(one_part[0]), sampler.target_type
    a = sampler.sample(seeds, t, [3, 2], batch_key(1, 2, 0, 5))
    _same(a, sampler.sample(seeds, t, [3, 2], batch_key(1, 2, 0, 5)))
    other = [sampler.sample(seeds, t, [3, 2], batch_key(1, 2, 0, b)).node for b in range(6, 9)]
    assert any(not all(torch.equal(a.node[u], o[u]) for u in o) for o in other), \
        "the key must change the draws"


# -- the same batches as the CPU sampler ---------------------------------------------
@pytest.mark.parametrize(("replace", "weighted"), VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("topology", ["device", "uva"])
def test_matches_cpu_sampler(one_part: list[Partition], replace: bool, weighted: bool,
                             topology: str) -> None:
    part = one_part[0]
    gpu = CudaNeighborSampler(part, replace=replace, weighted=weighted, topology=topology)
    cpu = CpuNeighborSampler(part, replace=replace, weighted=weighted)
    seeds, t = _seeds(part, 5), part.target_type
    for key, edges in ((batch_key(3, 0, 0, 0), False), (batch_key(3, 0, 1, 9), True)):
        got = gpu.sample(seeds, t, [4, 3], key, edges=edges)
        assert bool(got.edge) == edges
        _same(got, cpu.sample(seeds, t, [4, 3], key, edges=edges))
    check_edge_ids(got, one_part, replace=replace)
    hub = torch.as_tensor(seeds[:1])  # the hub, with in-degree ~ the graph size
    for et in (e for e in part.edge_types if e[2] == t):  # every relation into the hub
        for fanout in (1, 7, 30, -1):
            a = gpu.sample_relation(et, hub, fanout, key=11, hop=2, edges=True)
            b = cpu.sample_relation(et, hub, fanout, key=11, hop=2, edges=True)
            assert torch.equal(a.counts.cpu(), b.counts) and torch.equal(a.neighbors.cpu(), b.neighbors)
            assert a.edges is not None and b.edges is not None and torch.equal(a.edges.cpu(), b.edges)
            plain = gpu.sample_relation(et, hub, fanout, key=11, hop=2)
            assert plain.edges is None and torch.equal(plain.neighbors, a.neighbors)


@pytest.mark.parametrize(("replace", "weighted"), [(False, False), (True, True)],
                         ids=["uniform", "weighted-replace"])
def test_matches_cpu_across_partitions(graph: AnyGraph, two_parts: list[Partition], replace: bool,
                                       weighted: bool) -> None:
    """Two CUDA partitions answering each other draw (and gather) what two CPU partitions
    do, with the same internal edge IDs (the second partition's from its own first edge)."""
    gpus = [CudaNeighborSampler(p, replace=replace, weighted=weighted) for p in two_parts]
    cpus = [CpuNeighborSampler(p, replace=replace, weighted=weighted) for p in two_parts]
    seeds, t = _seeds(two_parts[0], 3), two_parts[0].target_type
    a = gpus[0].minibatch(seeds, t, [3, 2], 99, remote=LocalPeers(gpus), edges=True)
    b = cpus[0].minibatch(seeds, t, [3, 2], 99, remote=LocalPeers(cpus), edges=True)
    assert_same_batch(a, b)
    check_rows(graph, a)
    check_edge_ids(a.structure, two_parts, replace=replace)


def _reaching_seeds(part: Partition, count: int) -> np.ndarray:
    """Owned nodes of the target type with in-neighbors (along any relation) owned by
    another partition."""
    t = part.target_type
    start, _ = part.node_range(t)
    found: set[int] = set()
    for et in (e for e in part.edge_types if e[2] == t):
        indptr, indices = np.asarray(part.indptr[et]), np.asarray(part.indices[et])
        lo, hi = part.node_range(et[0])
        for v in range(part.num_nodes(t)):
            nbrs = indices[indptr[v]:indptr[v + 1]]
            if ((nbrs < lo) | (nbrs >= hi)).any():
                found.add(start + v)
    return np.asarray(sorted(found)[:count], dtype=np.int64)


@pytest.mark.parametrize(("replace", "weighted"), [(False, False), (True, True)],
                         ids=["uniform", "weighted-replace"])
def test_the_whole_graph_s_structure_draws_what_the_owners_draw(
        graph: AnyGraph, tmp_path: Path, replace: bool, weighted: bool) -> None:
    """Partition 1's CUDA sampler over the whole graph's structure draws every hop itself
    (no peer asked) and makes the batch two CPU partitions answering each other make."""
    parts = write_and_load(graph, tmp_path, 2)
    gpu = CudaNeighborSampler(parts[1], replace=replace, weighted=weighted,
                              structure=load_structure(tmp_path))
    cpus = [CpuNeighborSampler(p, replace=replace, weighted=weighted) for p in parts]
    seeds, t = _reaching_seeds(parts[1], 3), parts[1].target_type
    assert seeds.size == 3
    gpu_peers, cpu_peers = LocalPeers(cpus), LocalPeers(cpus)
    a = gpu.minibatch(seeds, t, [3, 2], 99, remote=gpu_peers)
    b = cpus[1].minibatch(seeds, t, [3, 2], 99, remote=cpu_peers)
    assert_same_batch(a, b)
    assert cpu_peers.asked and not gpu_peers.asked
    assert any(n.numel() and not gpu.own[u][0] <= int(n.min()) <= int(n.max()) < gpu.own[u][1]
               for u, n in a.structure.node.items()), \
        "nodes of partition 0 should have been drawn"
    # and with every node's rows: its feature tables hold them all (half on the device,
    # hottest by in-degree), the labels too; no peer asked for any
    rows = load_node_data(tmp_path)
    whole = CudaNeighborSampler(parts[1], replace=replace, weighted=weighted,
                                structure=load_structure(tmp_path), node_data=rows, gpu_cache_size=0.5)
    assert set(whole.feature_tables) == set(typed_view(graph).x)
    for u, table in whole.feature_tables.items():
        assert table.num_rows == rows.num_nodes[u] and 0 < table.cached < table.num_rows
    whole_peers = LocalPeers(cpus)
    assert_same_batch(whole.minibatch(seeds, t, [3, 2], 99, remote=whole_peers), b)
    assert not whole_peers.asked and not whole_peers.fetched
    assert gpu_peers.fetched  # the sampler with its partition's own rows did ask
    with pytest.raises(ValueError, match="node_data: the CUDA sampler orders its feature table"):
        CudaNeighborSampler(parts[1], node_data=rows)


# -- draw statistics -------------------------------------------------------------------
def test_uniform_draws_are_uniform(tmp_path: Path) -> None:
    """Each of 10 in-neighbors is drawn with probability 3/10 (fanout 3, 300 draws)."""
    (part,) = write_and_load(star_graph(10), tmp_path / "star", 1)
    sampler = CudaNeighborSampler(part)
    counts = np.zeros(11)
    trials = 100
    for hop in range(trials):
        drawn = sampler.sample_relation(PLAIN_EDGE_TYPE, torch.tensor([0]), 3, key=5, hop=hop).neighbors.cpu()
        assert drawn.unique().numel() == 3
        counts[drawn.numpy()] += 1
    freq = counts[1:] / trials
    assert np.all(np.abs(freq - 0.3) < 4 * np.sqrt(0.3 * 0.7 / trials)), freq


def test_weighted_draws_follow_weights(tmp_path: Path) -> None:
    """With replacement, neighbor i is drawn in proportion to its weight."""
    weights = [1.0, 2.0, 3.0, 4.0]
    (part,) = write_and_load(star_graph(weights=weights), tmp_path / "star", 1)
    sampler = CudaNeighborSampler(part, replace=True, weighted=True)
    drawn = torch.cat([sampler.sample_relation(PLAIN_EDGE_TYPE, torch.tensor([0]), 50, key=8, hop=h).neighbors
                       for h in range(8)]).cpu().numpy()
    freq = np.bincount(drawn, minlength=5)[1:] / drawn.size
    expect = np.array(weights) / sum(weights)
    assert np.all(np.abs(freq - expect) < 4 * np.sqrt(expect * (1 - expect) / drawn.size)), freq


# -- dedup / relabel -------------------------------------------------------------------
def _first_seen(seeds: list[int], chunks: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    ids = {v: i for i, v in enumerate(seeds)}
    out = []
    for chunk in chunks:
        new = []
        for v in chunk:
            if v not in ids:
                ids[v] = len(ids)
                new.append(v)
        out.append((new, [ids[v] for v in chunk]))
    return out


def test_dedup_kernels_with_many_repeats() -> None:
    """The hash-table kernels number new nodes in first-seen order, through a rehash."""
    device = L.torch_device()
    gen = np.random.default_rng(0)
    seeds = [50, 3, 1000, 7]
    chunks = [gen.integers(0, 40, 120).tolist(), [3, 3, 3, 50], [],
              gen.integers(0, 200, 150).tolist()]
    table = K.NodeTable(64, device)
    K.table_insert_seeds(table, torch.tensor(seeds, device=device))
    assert table.size == 4
    for chunk, (new, local) in zip(chunks, _first_seen(seeds, chunks), strict=True):
        ids = torch.tensor(chunk, dtype=torch.int64, device=device)
        needed = K.table_capacity(table.size + len(chunk))
        if needed > table.capacity:
            K.table_grow(table, needed)
        got_new, got_local = K.table_add(table, ids)
        assert got_new.cpu().tolist() == new
        assert got_local.cpu().tolist() == local
    assert table.capacity >= 2 * table.size


def test_relabeler_rejects_repeated_seeds(one_part: list[Partition]) -> None:
    sampler = CudaNeighborSampler(one_part[0])
    with pytest.raises(ValueError, match="seeds: expected unique node IDs; 3 repeats"):
        sampler.new_relabeler(sampler.target_type, torch.tensor([1, 3, 2, 3, 1], device=sampler.device))


def test_bad_input_is_named(one_part: list[Partition]) -> None:
    sampler = CudaNeighborSampler(one_part[0])
    t, et = sampler.target_type, sampler.edge_types[0]
    with pytest.raises(ValueError, match=r"^nodes: expected global (node|'\w+') IDs owned"):
        sampler.sample_relation(et, torch.tensor([10_000]), 2, key=1, hop=0)
    with pytest.raises(ValueError, match=r"^nodes: expected a 1-D int64 tensor"):
        sampler.sample_relation(et, torch.tensor([1.0]), 2, key=1, hop=0)
    with pytest.raises(ValueError, match=r"^fanout: expected"):
        sampler.sample_relation(et, torch.tensor([1]), -2, key=1, hop=0)
    with pytest.raises(ValueError, match=r"^edge_type: expected"):
        sampler.sample_relation(("paper", "sells", "paper"), torch.tensor([1]), 2, key=1, hop=0)
    with pytest.raises(ValueError, match=r"^seed_type: expected"):
        sampler.sample(torch.tensor([1]), "venue", [2], key=1)
    with pytest.raises(ValueError, match=r"^node_type: expected"):
        sampler.gather_local("venue", torch.tensor([1]), True, True)
    with pytest.raises(ValueError, match=r"^topology: expected"):
        CudaNeighborSampler(one_part[0], topology="host")
    with pytest.raises(ValueError, match=r"^seeds: expected"):
        sampler.sample(torch.tensor([one_part[0].num_nodes(t)]), t, [2], key=1)


def test_ownership_is_read_once_per_hop(one_part: list[Partition], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ID range read is a synchronisation on a GPU: a batch reads its seeds' range,
    each relation's frontier's at each hop and each type's gathered nodes', and no more
    (the frontier's own check is not repeated inside the hop, nor the gather's)."""
    part = one_part[0]
    sampler = CudaNeighborSampler(part)
    reads: list[int] = []
    real = CudaNeighborSampler.id_range

    def counted(nodes: torch.Tensor) -> tuple[int, int]:
        reads.append(int(nodes.numel()))
        return real(nodes)

    monkeypatch.setattr(CudaNeighborSampler, "id_range", staticmethod(counted))
    t = sampler.target_type
    batch = sampler.minibatch(_seeds(part), t, [3, 2], key=8, original_ids=False)
    s = batch.structure
    frontiers = sum(1 for et in sampler.edge_types for hop in range(2) if s.num_sampled_nodes[et[2]][hop])
    gathered = sum(1 for u, n in s.node.items() if n.numel() and (sampler.has_features(u) or u == t))
    assert len(reads) == 1 + frontiers + gathered
    reads.clear()  # the public entry points still check what they are given
    with pytest.raises(ValueError, match=r"^nodes: expected global (node|'\w+') IDs owned"):
        sampler.gather_local(t, torch.tensor([part.node_range(t)[1]]), True, True)
    assert reads == [1]


def test_id_range_and_draws_all(two_parts: list[Partition]) -> None:
    sampler = CudaNeighborSampler(two_parts[1])  # its partition's own in-edges: the owned range
    t = sampler.target_type
    start, stop = two_parts[1].node_range(t)
    assert sampler.id_range(torch.tensor([7, -3, 12, 5])) == (-3, 12)
    assert sampler.draws_all(t, torch.empty(0, dtype=torch.int64))
    assert sampler.draws_all(t, torch.tensor([stop - 1, start]))
    assert not sampler.draws_all(t, torch.tensor([start, stop]))
    assert not sampler.draws_all(t, torch.tensor([start - 1, start]))
    with pytest.raises(ValueError, match=r"^seeds: expected global (node|'\w+') IDs in \[0, \d+\); "
                                         r"got values in \[-1, 0\]"):
        sampler.check_in_graph(t, torch.tensor([0, -1]), "seeds")


# -- gathers ---------------------------------------------------------------------------
@pytest.mark.parametrize("topology", ["device", "uva"])
def test_features_and_labels_are_rows_of_n_id(graph: AnyGraph, one_part: list[Partition],
                                              topology: str) -> None:
    part = one_part[0]
    sampler = CudaNeighborSampler(part, topology=topology)
    batch = sampler.minibatch(_seeds(part), part.target_type, [3, 2], key=21)
    check_rows(graph, batch)
    assert all(x.dtype == torch.float32 and x.device == sampler.device for x in batch.x.values())
    for t, x_t in part.x.items():
        x, y = sampler.gather_local(t, torch.empty(0, dtype=torch.int64), True, True)
        assert x is not None and x.shape == (0, x_t.shape[1])
        assert (y is None) == (t != part.target_type) and (y is None or y.numel() == 0)


# -- the launchers pass exactly the types ptx_check compiles ----------------------------
@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, tuple[Any, ...]]]]:
    seen: list[tuple[str, tuple[Any, ...]]] = []
    real = K.launch

    def record(kernel: Any, n: int, *args: Any) -> None:
        seen.append((kernel.__name__, tuple(numba.typeof(a) for a in args)))
        real(kernel, n, *args)

    monkeypatch.setattr(K, "launch", record)
    monkeypatch.setattr(cuda_features, "launch", record)
    yield seen


def test_launch_signatures_are_declared(tmp_path: Path, launches: list[tuple[str, tuple[Any, ...]]]) -> None:
    for kind in KINDS:
        part = write_and_load(mixed(kind), tmp_path / kind, 1)[0]
        for replace, weighted in VARIANTS:
            sampler = CudaNeighborSampler(part, replace=replace, weighted=weighted, gpu_cache_size=0.5)
            sampler.minibatch(_seeds(part), part.target_type, [3, 2], key=4, edges=replace)
    table = K.NodeTable(64, L.torch_device())
    K.table_grow(table, 128)
    declared = {name: [tuple(s) for s in sigs] for name, _, sigs in kernel_signatures()}
    for name, types in launches:
        assert types in declared[name], (
            f"{name} launched with {types}, not among its declared SIGNATURES")
    assert {name for name, _ in launches} == set(declared), "a kernel went unexercised"


# -- real GPU only -----------------------------------------------------------------------
@pytest.mark.gpu
def test_zero_copy_and_current_stream(one_part: list[Partition]) -> None:
    part = one_part[0]
    t = torch.arange(10, device="cuda")
    assert L.kernel_arg(t).__cuda_array_interface__["data"][0] == t.data_ptr()
    sampler = CudaNeighborSampler(part)
    seeds = _seeds(part)
    expected = sampler.sample(seeds, part.target_type, [3, 2], key=5)
    assert all(n.is_cuda for n in expected.node.values()) and all(r.is_cuda for r in expected.row.values())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        got = sampler.sample(seeds, part.target_type, [3, 2], key=5)
    stream.synchronize()
    _same(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32, torch.float16,
                                   torch.float64, torch.uint8, torch.bool])
def test_kernel_args_match_numbas_own_view(dtype: torch.dtype) -> None:
    """kernel_arg builds its device arrays directly; they must be what numba-cuda makes
    from the array interface: same memory, shape, strides, dtype and Numba type."""
    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device="cuda")

    # contiguous, and also two whose dimension of size 1 has a stride of its own
    cases = [zeros(7), zeros(3, 5), zeros(0), zeros(0, 3), zeros(2, 8)[:1, :4],
             zeros(4, 1).as_strided((4, 1), (1, 5))]
    for t in cases:
        assert t.is_contiguous()
        got, want = L.kernel_arg(t), cuda.as_cuda_array(t)
        assert got.shape == want.shape and got.strides == want.strides
        assert got.dtype == want.dtype
        assert numba.typeof(got) == numba.typeof(want)
        if t.numel():
            assert got.__cuda_array_interface__["data"][0] == t.data_ptr()
            np.testing.assert_array_equal(got.copy_to_host(), t.cpu().numpy())


@pytest.mark.gpu
def test_uva_reads_mapped_host_memory(one_part: list[Partition]) -> None:
    from numba.cuda.cudadrv.devicearray import MappedNDArray

    sampler = CudaNeighborSampler(one_part[0], topology="uva")
    assert all(isinstance(csc.indices, MappedNDArray) for csc in sampler.csc.values())
    out = sampler.sample(_seeds(one_part[0]), sampler.target_type, [3, 2], key=6)
    assert all(n.is_cuda for n in out.node.values())


def _larger_seeds(part: Partition, count: int) -> np.ndarray:
    """``count`` owned training nodes of ``part``."""
    t = part.target_type
    start, stop = part.node_range(t)
    owned = np.asarray(part.splits["train"], dtype=np.int64)
    return np.random.default_rng(1).permutation(owned[(owned >= start) & (owned < stop)])[:count]


@pytest.mark.gpu
@pytest.mark.parametrize(("replace", "weighted"), VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("topology", ["device", "uva"])
@pytest.mark.parametrize("kind", KINDS)
def test_larger_graph_matches_cpu(kind: str, tmp_path: Path, replace: bool, weighted: bool,
                                  topology: str) -> None:
    """Thousands of threads racing on the hash tables still give the CPU's batch."""
    graph = large(kind)
    (part,) = write_and_load(graph, tmp_path / "big", 1)
    gpu = CudaNeighborSampler(part, replace=replace, weighted=weighted, topology=topology)
    cpu = CpuNeighborSampler(part, replace=replace, weighted=weighted)
    seeds, t = _larger_seeds(part, 512), part.target_type
    for key in range(3):
        a = gpu.sample(seeds, t, [15, 10, 5], key, edges=key == 2)
        _same(a, cpu.sample(seeds, t, [15, 10, 5], key, edges=key == 2))
    check_edge_ids(a, [part], replace=replace)
    check_sampler_output(a, seeds, t, normalize_num_neighbors([15, 10, 5], part.edge_types),
                         global_adjacency([part]), replace=replace)


@pytest.mark.gpu
@pytest.mark.parametrize("topology", ["device", "uva"])
@pytest.mark.parametrize("kind", KINDS)
def test_larger_graph_across_partitions_matches_cpu(kind: str, tmp_path: Path, topology: str) -> None:
    """Two CUDA partitions answering each other make the batches, features and labels of
    two CPU partitions, and every batch has every property."""
    graph = large(kind)
    parts = write_and_load(graph, tmp_path / "big2", 2)
    gpus = [CudaNeighborSampler(p, topology=topology) for p in parts]
    cpus = [CpuNeighborSampler(p) for p in parts]
    seeds, t = _larger_seeds(parts[0], 512), parts[0].target_type
    a = gpus[0].minibatch(seeds, t, [25, 20], 5, remote=LocalPeers(gpus), edges=True)
    b = cpus[0].minibatch(seeds, t, [25, 20], 5, remote=LocalPeers(cpus), edges=True)
    assert all(n.device.type == "cuda" for n in a.structure.node.values())
    assert all(e.device.type == "cuda" for e in a.structure.edge.values())
    assert_same_batch(a, b)
    check_sampler_output(a.structure, seeds, t, normalize_num_neighbors([25, 20], parts[0].edge_types),
                         global_adjacency(parts))
    check_edge_ids(a.structure, parts)
    check_rows(graph, a)


@pytest.mark.gpu
@pytest.mark.parametrize("topology", ["device", "uva"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_node_s_rows_on_a_gpu_match_the_owners(kind: str, tmp_path: Path, topology: str) -> None:
    """A CUDA sampler over the whole graph's structure and rows (a third of them in GPU
    memory, the rest pinned over UVA) makes the batches, features and labels of two CPU
    partitions answering each other, asking no peer."""
    graph = large(kind)
    root = tmp_path / "big2"
    parts = write_and_load(graph, root, 2)
    gpu = CudaNeighborSampler(parts[0], topology=topology, structure=load_structure(root),
                              node_data=load_node_data(root), gpu_cache_size=0.33)
    cpus = [CpuNeighborSampler(p) for p in parts]
    asked, answered = LocalPeers(cpus), LocalPeers(cpus)
    seeds, t = _larger_seeds(parts[0], 256), parts[0].target_type
    for key in range(2):
        a = gpu.minibatch(seeds, t, [15, 10, 5], key, remote=asked)
        b = cpus[0].minibatch(seeds, t, [15, 10, 5], key, remote=answered)
        assert_same_batch(a, b)
        check_rows(graph, a)
    assert not asked.asked and not asked.fetched and answered.fetched


def test_numbas_per_allocation_log_lines_stay_out_of_an_info_log() -> None:
    """numba-cuda logs each device allocation and free at INFO once the application has
    configured logging; a CUDA server's INFO log must not fill with them."""
    import logging
    import os
    import subprocess
    import sys

    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from sampling_server.sampler import cuda_kernels as K, cuda_launch as L\n"
            "print(logging.getLogger(L.NUMBA_DRIVER_LOGGER).isEnabledFor(logging.INFO))\n")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CUDA_LOG_LEVEL"}
    quiet = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                           text=True, timeout=120, check=True)
    asked = subprocess.run([sys.executable, "-c", code], cwd=root,
                           env={**env, "NUMBA_CUDA_LOG_LEVEL": "INFO"}, capture_output=True,
                           text=True, timeout=120, check=True)
    assert quiet.stdout.split() == ["False"] and asked.stdout.split() == ["True"]
    assert not logging.getLogger(L.NUMBA_DRIVER_LOGGER).isEnabledFor(logging.INFO)


@pytest.mark.parametrize("mode", ["binary", "triplet"])
def test_link_batches_match_the_cpu_sampler(graph: AnyGraph, mode: str, tmp_path: Path) -> None:
    """A link batch (strict negatives, the seed edges excluded) drawn by two CUDA
    partitions equals the one two CPU partitions draw."""
    two = parted(graph, tmp_path, 2, "random")
    two_parts, maps = two.parts, two.maps
    part = two_parts[0]
    et = part.edge_types[0]
    n = {t: part.manifest.node_types[t].num_nodes for t in part.node_types}
    options = LinkOptions(et, BINARY if mode == "binary" else TRIPLET, 2.0, True, n[et[0]], n[et[2]])
    indptr, indices = np.asarray(part.indptr[et]), np.asarray(part.indices[et])
    start = part.node_range(et[2])[0]
    rows = np.flatnonzero(np.diff(indptr))[:3]
    dst = rows + start
    src = indices[indptr[rows]]
    outs = []
    for kind in (CudaNeighborSampler, CpuNeighborSampler):
        samplers = [kind(p) for p in two_parts]
        remote = LocalPeers(samplers)
        made = link_seeds(samplers[0], options, 7, src, dst, None, None, lambda t, o: maps[t][o], remote)
        out = samplers[0].sample(made.seeds, et[0], [2, 2], 7, remote, edges=True)
        exclude_edges(out, {et: (torch.from_numpy(src), torch.from_numpy(dst))}, n)
        outs.append((made, out))
    (gm, go), (cm, co) = outs
    _same(go, co)
    assert gm.tensors.keys() == cm.tensors.keys()
    for key, value in gm.tensors.items():
        assert torch.equal(value.cpu(), cm.tensors[key]), key
