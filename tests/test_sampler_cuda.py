"""The CUDA sampler: structural properties, equality with the CPU sampler, dedup, gathers.

Without a GPU these run on Numba's CUDA simulator (``conftest.py``), so the graphs are
tiny; on a real GPU the same tests run on the device, and the ``gpu``-marked ones add
zero-copy, stream and larger-graph checks.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest
import torch
from graph_fixtures import (
    HUB,
    LocalPeers,
    global_adjacency,
    mixed_graph,
    star_graph,
    write_and_load,
)
from numba import cuda
from sampler_checks import check_sampler_output

from partitioner.format import Partition, load_node_data, load_structure
from sampling_server.sampler import cuda_kernels as K
from sampling_server.sampler.cuda_sampler import CudaNeighborSampler
from sampling_server.sampler.ptx_check import kernel_signatures
from sampling_server.sampler.rng import batch_key

VARIANTS = [(False, False), (True, False), (False, True), (True, True)]
VARIANT_IDS = ["uniform", "replace", "weighted", "weighted-replace"]
HAS_CPU_SAMPLER = importlib.util.find_spec("sampling_server.sampler.cpu_sampler") is not None
needs_cpu = pytest.mark.skipif(not HAS_CPU_SAMPLER,
                               reason="sampling_server.sampler.cpu_sampler is not written yet")


@pytest.fixture(scope="module")
def one_part(tmp_path_factory: pytest.TempPathFactory) -> list[Partition]:
    return write_and_load(mixed_graph(), tmp_path_factory.mktemp("mixed1"), 1)


@pytest.fixture(scope="module")
def two_parts(tmp_path_factory: pytest.TempPathFactory) -> list[Partition]:
    return write_and_load(mixed_graph(), tmp_path_factory.mktemp("mixed2"), 2)


def _seeds(part: Partition, count: int = 4) -> np.ndarray:
    """``count`` owned nodes, the hub first when this partition owns it."""
    start, stop = part.node_range
    owned = np.arange(start, stop, dtype=np.int64)
    hub = np.nonzero(np.asarray(part.orig_ids) == HUB)[0]
    first = owned[hub] if hub.size else owned[:0]
    rest = owned[np.isin(owned, first, invert=True)][:: max(1, owned.size // count)]
    return np.concatenate([first, rest])[:count]


def _equal_outputs(a: Any, b: Any) -> None:
    assert torch.equal(a.n_id.cpu(), b.n_id.cpu())
    assert torch.equal(a.row.cpu(), b.row.cpu())
    assert torch.equal(a.col.cpu(), b.col.cpu())
    assert a.num_sampled_nodes == b.num_sampled_nodes
    assert a.num_sampled_edges == b.num_sampled_edges


# -- structure -----------------------------------------------------------------------
@pytest.mark.parametrize(("replace", "weighted"), VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("fanouts", [[3, 2], [-1, 1], [0, 2]], ids=["3-2", "all-1", "0-2"])
def test_output_properties(one_part: list[Partition], replace: bool, weighted: bool,
                           fanouts: list[int]) -> None:
    sampler = CudaNeighborSampler(one_part[0], replace=replace, weighted=weighted)
    seeds = _seeds(one_part[0])
    out = sampler.sample(seeds, fanouts, batch_key(0, 1, 0, 3))
    assert out.n_id.device == sampler.device == K.torch_device()
    check_sampler_output(out, seeds, fanouts, global_adjacency(one_part), replace=replace)


def test_isolated_and_empty_frontiers(one_part: list[Partition]) -> None:
    """Nodes without in-edges draw nothing; an empty frontier stays empty."""
    part = one_part[0]
    degree = np.diff(np.asarray(part.indptr))
    isolated = np.nonzero(degree == 0)[0][:2] + part.node_range[0]
    for replace, weighted in VARIANTS:
        sampler = CudaNeighborSampler(part, replace=replace, weighted=weighted)
        out = sampler.sample(isolated, [4, 4], key=7)
        assert out.num_sampled_nodes == [isolated.size, 0, 0]
        assert out.num_sampled_edges == [0, 0]
        empty = sampler.sample_neighbors(torch.empty(0, dtype=torch.int64), 3, key=7, hop=0)
        assert empty.counts.numel() == 0 and empty.neighbors.numel() == 0


def test_same_key_same_batch(one_part: list[Partition]) -> None:
    sampler = CudaNeighborSampler(one_part[0])
    seeds = _seeds(one_part[0])
    a = sampler.sample(seeds, [3, 2], batch_key(1, 2, 0, 5))
    _equal_outputs(a, sampler.sample(seeds, [3, 2], batch_key(1, 2, 0, 5)))
    other = [sampler.sample(seeds, [3, 2], batch_key(1, 2, 0, b)).n_id for b in range(6, 9)]
    assert any(not torch.equal(a.n_id, o) for o in other), "the key must change the draws"


# -- the same batches as the CPU sampler ---------------------------------------------
@needs_cpu
@pytest.mark.parametrize(("replace", "weighted"), VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("topology", ["device", "uva"])
def test_matches_cpu_sampler(one_part: list[Partition], replace: bool, weighted: bool,
                             topology: str) -> None:
    from sampling_server.sampler.cpu_sampler import CpuNeighborSampler

    part = one_part[0]
    gpu = CudaNeighborSampler(part, replace=replace, weighted=weighted, topology=topology)
    cpu = CpuNeighborSampler(part, replace=replace, weighted=weighted)
    seeds = _seeds(part, 5)
    for key in (batch_key(3, 0, 0, 0), batch_key(3, 0, 1, 9)):
        _equal_outputs(gpu.sample(seeds, [4, 3], key), cpu.sample(seeds, [4, 3], key))
    hub = torch.as_tensor(seeds[:1])  # the hub, with in-degree ~ the graph size
    for fanout in (1, 7, 30, -1):
        a = gpu.sample_neighbors(hub, fanout, key=11, hop=2)
        b = cpu.sample_neighbors(hub, fanout, key=11, hop=2)
        assert torch.equal(a.counts.cpu(), b.counts) and torch.equal(a.neighbors.cpu(), b.neighbors)


@needs_cpu
@pytest.mark.parametrize(("replace", "weighted"), [(False, False), (True, True)],
                         ids=["uniform", "weighted-replace"])
def test_matches_cpu_across_partitions(two_parts: list[Partition], replace: bool,
                                       weighted: bool) -> None:
    """Two CUDA partitions answering each other draw what two CPU partitions draw."""
    from sampling_server.sampler.cpu_sampler import CpuNeighborSampler

    gpus = [CudaNeighborSampler(p, replace=replace, weighted=weighted) for p in two_parts]
    cpus = [CpuNeighborSampler(p, replace=replace, weighted=weighted) for p in two_parts]
    seeds = _seeds(two_parts[0], 3)
    a = gpus[0].minibatch(seeds, [3, 2], 99, remote=LocalPeers(gpus).neighbors,
                          remote_data=LocalPeers(gpus).node_data)
    b = cpus[0].minibatch(seeds, [3, 2], 99, remote=LocalPeers(cpus).neighbors,
                          remote_data=LocalPeers(cpus).node_data)
    _equal_outputs(a.structure, b.structure)
    assert a.x is not None and b.x is not None and a.y is not None and b.y is not None
    assert torch.equal(a.x.cpu(), b.x) and torch.equal(a.y.cpu(), b.y)


@needs_cpu
@pytest.mark.parametrize(("replace", "weighted"), [(False, False), (True, True)],
                         ids=["uniform", "weighted-replace"])
def test_the_whole_graph_s_structure_draws_what_the_owners_draw(
        tmp_path: Path, replace: bool, weighted: bool) -> None:
    """Partition 1's CUDA sampler over the whole graph's structure draws every hop itself
    (no peer asked) and makes the batch two CPU partitions answering each other make."""
    from sampling_server.sampler.cpu_sampler import CpuNeighborSampler

    parts = write_and_load(mixed_graph(), tmp_path, 2)
    gpu = CudaNeighborSampler(parts[1], replace=replace, weighted=weighted,
                              structure=load_structure(tmp_path))
    cpus = [CpuNeighborSampler(p, replace=replace, weighted=weighted) for p in parts]
    start = parts[1].node_range[0]
    indptr, indices = np.asarray(parts[1].indptr), np.asarray(parts[1].indices)
    remote_in = [v for v in range(parts[1].num_nodes)  # seeds with only partition 0's in-edges
                 if indptr[v + 1] > indptr[v] and (indices[indptr[v]:indptr[v + 1]] < start).all()]
    seeds = np.asarray(remote_in[:3], dtype=np.int64) + start
    assert seeds.size == 3
    gpu_peers, cpu_peers = LocalPeers(cpus), LocalPeers(cpus)
    a = gpu.minibatch(seeds, [3, 2], 99, remote=gpu_peers.neighbors,
                      remote_data=gpu_peers.node_data)
    b = cpus[1].minibatch(seeds, [3, 2], 99, remote=cpu_peers.neighbors,
                          remote_data=cpu_peers.node_data)
    _equal_outputs(a.structure, b.structure)
    hop1 = a.structure.n_id.cpu()[3:3 + a.structure.num_sampled_nodes[1]]
    assert bool((hop1 < parts[1].node_range[0]).any())  # partition 0's nodes drawn from
    assert not gpu_peers.asked
    assert a.x is not None and b.x is not None and torch.equal(a.x.cpu(), b.x)
    # and with every node's rows: its feature table holds them all (half on the device,
    # hottest by in-degree), the labels too; no peer asked for any
    rows = load_node_data(tmp_path)
    whole = CudaNeighborSampler(parts[1], replace=replace, weighted=weighted,
                                structure=load_structure(tmp_path), node_data=rows,
                                gpu_cache_size=0.5)
    assert whole.feature_table.num_rows == rows.num_nodes
    assert 0 < whole.feature_table.cached < rows.num_nodes
    whole_peers = LocalPeers(cpus)
    c = whole.minibatch(seeds, [3, 2], 99, remote=whole_peers.neighbors,
                        remote_data=whole_peers.node_data)
    _equal_outputs(c.structure, b.structure)
    assert c.x is not None and c.y is not None and b.y is not None
    assert torch.equal(c.x.cpu(), b.x) and torch.equal(c.y.cpu(), b.y)
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
        drawn = sampler.sample_neighbors(torch.tensor([0]), 3, key=5, hop=hop).neighbors.cpu()
        assert drawn.unique().numel() == 3
        counts[drawn.numpy()] += 1
    freq = counts[1:] / trials
    assert np.all(np.abs(freq - 0.3) < 4 * np.sqrt(0.3 * 0.7 / trials)), freq


def test_weighted_draws_follow_weights(tmp_path: Path) -> None:
    """With replacement, neighbor i is drawn in proportion to its weight."""
    weights = [1.0, 2.0, 3.0, 4.0]
    (part,) = write_and_load(star_graph(weights=weights), tmp_path / "star", 1)
    sampler = CudaNeighborSampler(part, replace=True, weighted=True)
    drawn = torch.cat([sampler.sample_neighbors(torch.tensor([0]), 50, key=8, hop=h).neighbors
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
    device = K.torch_device()
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
        sampler.new_relabeler(torch.tensor([1, 3, 2, 3, 1], device=sampler.device))


def test_bad_input_is_named(one_part: list[Partition]) -> None:
    sampler = CudaNeighborSampler(one_part[0])
    with pytest.raises(ValueError, match="nodes: expected global node IDs owned"):
        sampler.sample_neighbors(torch.tensor([10_000]), 2, key=1, hop=0)
    with pytest.raises(ValueError, match="nodes: expected a 1-D int64 tensor"):
        sampler.sample_neighbors(torch.tensor([1.0]), 2, key=1, hop=0)
    with pytest.raises(ValueError, match="fanout"):
        sampler.sample_neighbors(torch.tensor([1]), -2, key=1, hop=0)
    with pytest.raises(ValueError, match="topology"):
        CudaNeighborSampler(one_part[0], topology="host")


def test_ownership_is_read_once_per_hop(one_part: list[Partition],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ID range read is a synchronisation on a GPU: a batch reads its seeds' range,
    each hop's frontier's and the gathered nodes', and no more (the frontier's own check
    is not repeated inside the hop, nor the gather's)."""
    part = one_part[0]
    sampler = CudaNeighborSampler(part)
    reads: list[int] = []
    real = CudaNeighborSampler.id_range

    def counted(nodes: torch.Tensor) -> tuple[int, int]:
        reads.append(int(nodes.numel()))
        return real(nodes)

    monkeypatch.setattr(CudaNeighborSampler, "id_range", staticmethod(counted))
    batch = sampler.minibatch(_seeds(part), [3, 2], key=8)
    hops_with_frontier = sum(1 for n in batch.structure.num_sampled_nodes[:2] if n)
    assert len(reads) == 1 + hops_with_frontier + 1
    reads.clear()  # the public entry points still check what they are given
    with pytest.raises(ValueError, match="nodes: expected global node IDs owned"):
        sampler.gather_local(torch.tensor([part.node_range[1]]), True, True)
    assert reads == [1]


def test_id_range_and_owns_all(two_parts: list[Partition]) -> None:
    sampler = CudaNeighborSampler(two_parts[1])
    start, stop = two_parts[1].node_range
    assert sampler.id_range(torch.tensor([7, -3, 12, 5])) == (-3, 12)
    assert sampler.owns_all(torch.empty(0, dtype=torch.int64))
    assert sampler.owns_all(torch.tensor([stop - 1, start]))
    assert not sampler.owns_all(torch.tensor([start, stop]))
    assert not sampler.owns_all(torch.tensor([start - 1, start]))
    with pytest.raises(ValueError, match=r"seeds: expected global node IDs in \[0, \d+\); "
                                         r"got values in \[-1, 0\]"):
        sampler.check_in_graph(torch.tensor([0, -1]), "seeds")


# -- gathers ---------------------------------------------------------------------------
@pytest.mark.parametrize("topology", ["device", "uva"])
def test_features_and_labels_are_rows_of_n_id(one_part: list[Partition], topology: str) -> None:
    part = one_part[0]
    sampler = CudaNeighborSampler(part, topology=topology)
    seeds = _seeds(part)
    batch = sampler.minibatch(seeds, [3, 2], key=21)
    assert batch.x is not None and batch.y is not None
    local = batch.structure.n_id.cpu().numpy() - part.node_range[0]
    assert batch.x.dtype == torch.float32 and batch.x.device == sampler.device
    assert np.array_equal(batch.x.cpu().numpy(), np.asarray(part.x)[local])
    assert np.array_equal(batch.y.cpu().numpy(), np.asarray(part.y)[local])
    x, y = sampler.gather_local(torch.empty(0, dtype=torch.int64), True, True)
    assert x is not None and y is not None and x.shape == (0, part.x.shape[1]) and y.numel() == 0


# -- the launchers pass exactly the types ptx_check compiles ----------------------------
@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, tuple[Any, ...]]]]:
    seen: list[tuple[str, tuple[Any, ...]]] = []
    real = K.launch

    def record(kernel: Any, n: int, *args: Any) -> None:
        seen.append((kernel.__name__, tuple(numba.typeof(a) for a in args)))
        real(kernel, n, *args)

    monkeypatch.setattr(K, "launch", record)
    yield seen


def test_launch_signatures_are_declared(one_part: list[Partition],
                                        launches: list[tuple[str, tuple[Any, ...]]]) -> None:
    part = one_part[0]
    for replace, weighted in VARIANTS:
        sampler = CudaNeighborSampler(part, replace=replace, weighted=weighted, gpu_cache_size=0.5)
        sampler.minibatch(_seeds(part), [3, 2], key=4)
    table = K.NodeTable(64, K.torch_device())
    K.table_grow(table, 128)
    # the typed sampler's feature gather
    device = K.torch_device()
    K.gather_rows(torch.tensor([1], device=device), 0,
                  K.kernel_arg(torch.zeros((2, 3), device=device)), torch.float32)
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
    assert K.kernel_arg(t).__cuda_array_interface__["data"][0] == t.data_ptr()
    sampler = CudaNeighborSampler(part)
    seeds = _seeds(part)
    expected = sampler.sample(seeds, [3, 2], key=5)
    assert expected.n_id.is_cuda and expected.row.is_cuda
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        got = sampler.sample(seeds, [3, 2], key=5)
    stream.synchronize()
    _equal_outputs(got, expected)


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
        got, want = K.kernel_arg(t), cuda.as_cuda_array(t)
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
    assert isinstance(sampler.csc.indices, MappedNDArray)
    out = sampler.sample(_seeds(one_part[0]), [3, 2], key=6)
    assert out.n_id.is_cuda


@pytest.mark.gpu
@needs_cpu
@pytest.mark.parametrize(("replace", "weighted"), VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("topology", ["device", "uva"])
def test_larger_graph_matches_cpu(tmp_path: Path, replace: bool, weighted: bool,
                                  topology: str) -> None:
    """Thousands of threads racing on the hash table still give the CPU's batch."""
    from sampling_server.sampler.cpu_sampler import CpuNeighborSampler

    (part,) = write_and_load(mixed_graph(20_000, seed=3), tmp_path / "big", 1)
    gpu = CudaNeighborSampler(part, replace=replace, weighted=weighted, topology=topology)
    cpu = CpuNeighborSampler(part, replace=replace, weighted=weighted)
    seeds = np.random.default_rng(1).choice(20_000 - 3, 512, replace=False)
    for key in range(3):
        a = gpu.sample(seeds, [15, 10, 5], key)
        _equal_outputs(a, cpu.sample(seeds, [15, 10, 5], key))
    check_sampler_output(a, seeds, [15, 10, 5], global_adjacency([part]), replace=replace)


@pytest.mark.gpu
@needs_cpu
@pytest.mark.parametrize("topology", ["device", "uva"])
def test_every_node_s_rows_on_a_gpu_match_the_owners(tmp_path: Path, topology: str) -> None:
    """A CUDA sampler over the whole graph's structure and rows (a third of them in GPU
    memory, the rest pinned over UVA) makes the batches, features and labels of two CPU
    partitions answering each other, asking no peer."""
    from sampling_server.sampler.cpu_sampler import CpuNeighborSampler

    root = tmp_path / "big2"
    parts = write_and_load(mixed_graph(20_000, seed=3), root, 2)
    gpu = CudaNeighborSampler(parts[0], topology=topology, structure=load_structure(root),
                              node_data=load_node_data(root), gpu_cache_size=0.33)
    cpus = [CpuNeighborSampler(p) for p in parts]
    asked, answered = LocalPeers(cpus), LocalPeers(cpus)
    seeds = _seeds(parts[0], 256)
    for key in range(2):
        a = gpu.minibatch(seeds, [15, 10, 5], key, remote=asked.neighbors,
                          remote_data=asked.node_data)
        b = cpus[0].minibatch(seeds, [15, 10, 5], key, remote=answered.neighbors,
                              remote_data=answered.node_data)
        _equal_outputs(a.structure, b.structure)
        assert a.x is not None and b.x is not None and a.y is not None and b.y is not None
        assert torch.equal(a.x.cpu(), b.x) and torch.equal(a.y.cpu(), b.y)
    assert not asked.asked and not asked.fetched and answered.fetched


def test_numbas_per_allocation_log_lines_stay_out_of_an_info_log() -> None:
    """numba-cuda logs each device allocation and free at INFO once the application has
    configured logging; a CUDA server's INFO log must not fill with them."""
    import logging
    import os
    import subprocess
    import sys

    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from sampling_server.sampler import cuda_kernels as K\n"
            "print(logging.getLogger(K.NUMBA_DRIVER_LOGGER).isEnabledFor(logging.INFO))\n")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CUDA_LOG_LEVEL"}
    quiet = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                           text=True, timeout=120, check=True)
    asked = subprocess.run([sys.executable, "-c", code], cwd=root,
                           env={**env, "NUMBA_CUDA_LOG_LEVEL": "INFO"}, capture_output=True,
                           text=True, timeout=120, check=True)
    assert quiet.stdout.split() == ["False"] and asked.stdout.split() == ["True"]
    assert not logging.getLogger(K.NUMBA_DRIVER_LOGGER).isEnabledFor(logging.INFO)
