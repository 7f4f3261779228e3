"""The server-side GPU feature cache of the CUDA sampler: per node type with features,
hot rows in GPU memory, the rest in mapped host memory, one gather kernel over both; on
both kinds of graph.

Without a GPU the tables live in CPU tensors and numpy arrays and the kernel runs on
Numba's CUDA simulator (``conftest.py``); the ``gpu``-marked tests check the real
placement (device tensor, pinned mapped host memory) and larger gathers on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from graph_fixtures import LocalPeers, assert_same_batch, large, mixed, write_and_load

from partitioner.partition import Partition
from protos import sampling_pb2 as pb
from sampling_server import cli
from sampling_server.config import ConfigError, ServerConfig
from sampling_server.feature_placement import (
    AUTO_FREE_FRACTION,
    GpuCacheSize,
    parse_gpu_cache_size,
    rows_on_device,
    slot_maps,
)
from sampling_server.fields import cast_features
from sampling_server.sampler import cuda_kernels
from sampling_server.sampler.cpu_sampler import CpuNeighborSampler
from sampling_server.sampler.cuda_features import FeatureTable
from sampling_server.sampler.cuda_launch import torch_device
from sampling_server.sampler.cuda_sampler import CudaNeighborSampler
from sampling_server.sampler.hot_order import in_degree, in_degree_order
from sampling_server.store import PartitionStore

FRACTIONS = [0.0, 0.3, 1.0]


@pytest.fixture(scope="module")
def one_part(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Partition:
    return write_and_load(mixed(kind), tmp_path_factory.mktemp("gpucache1"), 1)[0]


@pytest.fixture(scope="module")
def two_parts(kind: str, tmp_path_factory: pytest.TempPathFactory) -> list[Partition]:
    return write_and_load(mixed(kind), tmp_path_factory.mktemp("gpucache2"), 2)


def _all_nodes(part: Partition, t: str) -> torch.Tensor:
    """Every owned node of type ``t``, in a shuffled order with repeats (as a batch's n_id
    never is, but the gather must not care)."""
    start, stop = part.node_range(t)
    ids = np.random.default_rng(0).permutation(np.arange(start, stop, dtype=np.int64))
    return torch.from_numpy(np.concatenate([ids, ids[:5]]))


def _indptrs(part: Partition, t: str) -> list[np.ndarray]:
    """The CSC offsets of every relation ending at ``t``."""
    return [np.asarray(part.indptr[et]) for et in part.edge_types if et[2] == t]


def _hot_order(part: Partition, t: str) -> np.ndarray:
    start, stop = part.node_range(t)
    return in_degree_order(_indptrs(part, t), start, stop - start)


# -- sizes -------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "expected"), [
    ("auto", GpuCacheSize("auto")), (" AUTO ", GpuCacheSize("auto")),
    (0, GpuCacheSize("fraction", 0.0)), (1, GpuCacheSize("fraction", 1.0)),
    (0.25, GpuCacheSize("fraction", 0.25)), ("0.25", GpuCacheSize("fraction", 0.25)),
    ("25%", GpuCacheSize("fraction", 0.25)), ("2GiB", GpuCacheSize("bytes", 2.0 * 2**30)),
    ("512 MB", GpuCacheSize("bytes", 512e6)), ("1000B", GpuCacheSize("bytes", 1000.0)),
])
def test_sizes_parse_like_the_trainers_cache_size(value: object, expected: GpuCacheSize) -> None:
    assert parse_gpu_cache_size(value) == expected


@pytest.mark.parametrize("value", [-0.1, 1.5, "150%", "lots", "2 parsecs", "", float("nan"),
                                   True, None, [0.2]])
def test_bad_sizes_name_the_field_what_was_expected_and_what_came(value: object) -> None:
    with pytest.raises(ValueError) as info:
        parse_gpu_cache_size(value)
    message = str(info.value)
    assert message.startswith("gpu_cache_size: expected 'auto', a fraction of the partition's")
    assert message.endswith(f"got {value!r}")


def test_rows_on_device() -> None:
    frac, size = GpuCacheSize("fraction", 0.3), GpuCacheSize("bytes", 1000.0)
    assert rows_on_device(frac, 10, 40, None) == 3
    assert rows_on_device(GpuCacheSize("fraction", 1.0), 10, 40, 0) == 10
    assert rows_on_device(size, 100, 40, None) == 25  # 1000 B of 40-byte rows
    assert rows_on_device(size, 10, 40, None) == 10
    auto = GpuCacheSize("auto")
    assert rows_on_device(auto, 10, 40, None) == 10  # the simulator: no device memory to size
    assert rows_on_device(auto, 10, 40, 10**9) == 10  # fits
    # 2000 B free: half of it less 8 B of maps per node leaves 920 B, 23 rows of 40 B
    assert AUTO_FREE_FRACTION == 0.5
    assert rows_on_device(auto, 10, 40, 2000) == 10
    assert rows_on_device(auto, 100, 40, 2000) == (1000 - 800) // 40
    assert rows_on_device(auto, 100, 40, 100) == 0


def test_slot_maps_follow_the_hot_order(one_part: Partition) -> None:
    for t in one_part.node_types:
        start, stop = one_part.node_range(t)
        order = _hot_order(one_part, t)
        degree = in_degree(_indptrs(one_part, t), stop - start)
        for k in (0, 7, order.size):
            slot, host_slot = slot_maps(order, start, k)
            assert slot.dtype == np.int32 and host_slot.dtype == np.int32
            assert np.array_equal(slot[order[:k] - start], np.arange(k))
            assert np.array_equal(host_slot[order[k:] - start], np.arange(order.size - k))
            assert np.all((slot >= 0) != (host_slot >= 0)), "every node in exactly one table"
            if 0 < k < order.size:  # every cached node at least as hot as every other one
                assert degree[slot >= 0].min() >= degree[slot < 0].max()
        n = order.size
        with pytest.raises(ValueError, match=rf"^cached: expected 0 \.\. {n} .*, got {n + 1}$"):
            slot_maps(order, start, n + 1)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_table_slots_and_rows_match_the_hot_order(one_part: Partition, fraction: float) -> None:
    for t, x_t in one_part.x.items():
        start, stop = one_part.node_range(t)
        n = stop - start
        order = _hot_order(one_part, t)
        table = FeatureTable(x_t, order, start, torch_device(), fraction)
        k = int(fraction * n)
        assert table.cached == k and np.array_equal(table.order, order)
        assert table.slot.dtype == torch.int32 and table.host_slot.dtype == torch.int32
        slot = table.slot.cpu().numpy()
        assert np.array_equal(slot[order[:k] - start], np.arange(k))
        assert np.all(np.delete(slot, order[:k] - start) == -1)
        x = np.asarray(x_t)
        assert np.array_equal(table.device_rows.cpu().numpy()[:k], x[order[:k] - start])
        assert np.array_equal(np.asarray(table.host_rows)[:n - k], x[order[k:] - start])


def test_the_sampler_s_tables_follow_the_in_degree_over_every_relation(one_part: Partition) -> None:
    """A CUDA sampler's table of a type is ordered by in-degree summed over the relations
    ending at the type (on a typed graph, papers are cited and written: both count)."""
    sampler = CudaNeighborSampler(one_part, gpu_cache_size=0.5)
    assert set(sampler.feature_tables) == set(one_part.x)
    for t, table in sampler.feature_tables.items():
        assert np.array_equal(table.order, _hot_order(one_part, t))
        assert table.cached == one_part.num_nodes(t) // 2


# -- gathers -----------------------------------------------------------------------------
@pytest.mark.parametrize("topology", ["device", "uva"])
@pytest.mark.parametrize("size", [0, 0.3, 1, "auto", "100B"])
def test_gathered_rows_are_the_original_rows(one_part: Partition, topology: str,
                                             size: float | str) -> None:
    sampler = CudaNeighborSampler(one_part, topology=topology, gpu_cache_size=size)
    for t, x_t in one_part.x.items():
        nodes = _all_nodes(one_part, t)
        x, y = sampler.gather_local(t, nodes, True, True)
        assert x is not None and x.dtype == torch.float32
        local = nodes.numpy() - one_part.node_range(t)[0]
        assert x.cpu().numpy().tobytes() == np.asarray(x_t)[local].tobytes()  # bit for bit
        assert (y is None) == (t != one_part.target_type)
        assert y is None or np.array_equal(y.cpu().numpy(), np.asarray(one_part.y)[local])
        empty, _ = sampler.gather_local(t, torch.empty(0, dtype=torch.int64), True, False)
        assert empty is not None and empty.shape == (0, x_t.shape[1])


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_minibatches_equal_the_cpu_samplers_in_every_wire_dtype(
        two_parts: list[Partition], fraction: float) -> None:
    """Two partitions answering each other: the batch and its features of every type (cast
    to each wire dtype as the server does, bfloat16 included) are bit-identical to the CPU's."""
    gpus = [CudaNeighborSampler(p, gpu_cache_size=fraction) for p in two_parts]
    cpus = [CpuNeighborSampler(p) for p in two_parts]
    t = two_parts[0].target_type
    seeds = np.arange(*two_parts[0].node_range(t), 5)
    a = gpus[0].minibatch(seeds, t, [3, 2], 17, remote=LocalPeers(gpus))
    b = cpus[0].minibatch(seeds, t, [3, 2], 17, remote=LocalPeers(cpus))
    assert_same_batch(a, b)
    assert set(a.x) == set(b.x) == set(two_parts[0].x)
    for u in a.x:
        for dtype in (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16):
            ga, gb = cast_features(a.x[u], dtype).cpu(), cast_features(b.x[u], dtype)
            assert ga.dtype == gb.dtype
            assert ga.view(torch.uint8).numpy().tobytes() == gb.view(torch.uint8).numpy().tobytes()


def test_float16_features(kind: str, tmp_path: Path) -> None:
    graph = mixed(kind)
    if isinstance(graph.x, dict):
        graph.x = {t: (x / 7).astype(np.float16) for t, x in graph.x.items()}
    else:
        graph.x = (graph.x / 7).astype(np.float16)
    (part,) = write_and_load(graph, tmp_path / "f16", 1)
    sampler = CudaNeighborSampler(part, gpu_cache_size="40%")
    for t, x_t in part.x.items():
        nodes = _all_nodes(part, t)
        x, _ = sampler.gather_local(t, nodes, True, False)
        assert x is not None and x.dtype == torch.float16
        assert x.cpu().numpy().tobytes() == np.asarray(x_t)[nodes.numpy() - part.node_range(t)[0]].tobytes()


def test_samplers_of_one_store_share_its_tables(kind: str, tmp_path: Path) -> None:
    write_and_load(mixed(kind), tmp_path / "p", 1)
    store = PartitionStore(ServerConfig(partition_dir=tmp_path / "p", partition=0, device="cuda",
                                        gpu_cache_size="50%"))
    store.load()
    first = store.sampler()
    assert isinstance(first, CudaNeighborSampler)
    assert set(first.feature_tables) == set(store.partition.x)
    for t, table in first.feature_tables.items():
        assert table.cached == store.partition.num_nodes(t) // 2
    for replace, weighted in [(True, False), (False, True)]:
        other = store.sampler(replace=replace, weighted=weighted)
        assert isinstance(other, CudaNeighborSampler)
        assert other.feature_tables is first.feature_tables


def test_a_cuda_server_holding_the_whole_graph_tables_every_row(kind: str, tmp_path: Path) -> None:
    """With the whole structure (``auto``'s choice on this graph), a CUDA server's
    ``features: auto`` takes every node's rows: one table per type over the whole graph,
    shared by its samplers; with its partition's own structure it keeps its own rows."""
    write_and_load(mixed(kind), tmp_path / "p", 2)
    store = PartitionStore(ServerConfig(partition_dir=tmp_path / "p", partition=1, device="cuda",
                                        gpu_cache_size="50%"))
    store.load()
    assert (store.structure_mode, store.features_mode) == ("full", "full")
    first = store.sampler()
    assert isinstance(first, CudaNeighborSampler)
    for t, table in first.feature_tables.items():
        assert table.num_rows == store.manifest.node_types[t].num_nodes
    again = store.sampler(replace=True)
    assert isinstance(again, CudaNeighborSampler) and again.feature_tables is first.feature_tables
    own = PartitionStore(ServerConfig(partition_dir=tmp_path / "p", partition=1, device="cuda",
                                      structure="partition"))
    own.load()
    assert own.features_mode == "partition"


def test_conflicting_or_foreign_tables_are_refused(two_parts: list[Partition]) -> None:
    p0, p1 = two_parts
    t = p0.target_type
    tables = CudaNeighborSampler(p0, gpu_cache_size=0.5).feature_tables
    with pytest.raises(ValueError, match=r"^gpu_cache_size, feature_tables: expected one or neither"):
        CudaNeighborSampler(p0, gpu_cache_size=0.5, feature_tables=tables)
    with pytest.raises(ValueError, match=rf"^feature_tables\['{t}'\]: expected the table of the rows held"):
        CudaNeighborSampler(p1, feature_tables=tables)
    with pytest.raises(ValueError, match=r"^gpu_cache_size: expected 'auto'.*got '1\.5'$"):
        CudaNeighborSampler(p0, gpu_cache_size="1.5")


# -- configuration -----------------------------------------------------------------------
def test_config_and_cluster_file_check_the_size(tmp_path: Path) -> None:
    assert ServerConfig(partition_dir=tmp_path, partition=0).gpu_cache_size == "auto"
    assert ServerConfig(partition_dir=tmp_path, partition=0, gpu_cache_size="2GiB").gpu_cache_size == "2GiB"
    with pytest.raises(ConfigError, match=r"^gpu_cache_size: expected 'auto', .*got 2$"):
        ServerConfig(partition_dir=tmp_path, partition=0, gpu_cache_size=2)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("defaults: {partition_dir: /d, gpu_cache_size: 20%}\n"
                       "servers: [{partition: 0, address: 'h:1'}]\n")
    assert ServerConfig.from_cluster_yaml(cluster, 0).gpu_cache_size == "20%"
    cluster.write_text("defaults: {partition_dir: /d, gpu_cache_size: lots}\n"
                       "servers: [{partition: 0, address: 'h:1'}]\n")
    with pytest.raises(ConfigError, match=r"gpu_cache_size: expected .*got 'lots'"):
        ServerConfig.from_cluster_yaml(cluster, 0)


def test_cli_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "configure_logging", lambda level, fmt: None)
    parser = cli.build_parser()
    base = ["--partition", "0", "--partition-dir", str(tmp_path)]
    assert cli.config_from_args(parser.parse_args(base)).gpu_cache_size == "auto"
    args = parser.parse_args([*base, "--gpu-cache-size", "30%"])
    assert cli.config_from_args(args).gpu_cache_size == "30%"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--gpu-cache-size", "lots"])
    err = capsys.readouterr().err
    assert "--gpu-cache-size: expected 'auto', a fraction" in err and "got 'lots'" in err
    assert "--gpu-cache-size" in parser.format_help()
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")  # no usable GPU
    config = cli.config_from_args(parser.parse_args([*base, "--gpu-cache-size", "0.5"]))
    with pytest.raises(ConfigError, match=r"^--gpu-cache-size: expected auto on a server that "
                                          r"samples on the CPU .*got '0\.5'"):
        cli.check_device(config)


# -- the launch matches what ptx_check compiles --------------------------------------------
def test_every_feature_dtype_has_a_declared_signature() -> None:
    sigs = cuda_kernels.SIGNATURES["gather_split_rows_kernel"]
    assert len(sigs) == len(cuda_kernels.FEATURE_DTYPES)
    assert {s[4].dtype for s in sigs} == set(cuda_kernels.FEATURE_DTYPES)


# -- real GPU only -------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_rows_live_on_the_gpu_and_in_mapped_host_memory(kind: str, tmp_path: Path, fraction: float) -> None:
    from numba.cuda.cudadrv.devicearray import MappedNDArray

    (part,) = write_and_load(large(kind), tmp_path / "big", 1)
    sampler = CudaNeighborSampler(part, topology="uva", gpu_cache_size=fraction)
    for t, table in sampler.feature_tables.items():
        assert table.device_rows.is_cuda and table.slot.is_cuda and table.host_slot.is_cuda
        if table.cached < part.num_nodes(t):
            assert isinstance(table.host_rows, MappedNDArray)
        start, stop = part.node_range(t)
        nodes = torch.from_numpy(np.random.default_rng(2).integers(start, stop, 50_000)).cuda()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            x, _ = sampler.gather_local(t, nodes, True, False)
        stream.synchronize()
        assert x is not None and x.is_cuda
        expected = np.asarray(part.x[t])[nodes.cpu().numpy() - start]
        assert x.cpu().numpy().tobytes() == expected.tobytes()


@pytest.mark.gpu
def test_auto_caches_a_small_partition_whole(one_part: Partition) -> None:
    sampler = CudaNeighborSampler(one_part)
    for t, table in sampler.feature_tables.items():
        assert table.cached == one_part.num_nodes(t) and table.device_rows.is_cuda
