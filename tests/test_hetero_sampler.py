"""The typed sampler on format v2 partitions: properties against the original graph,
reproducibility, uniformity, CPU == CUDA (simulator), 1 == 2 partitions, HeteroData."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from partitioner.graph import EdgeType
from partitioner.hetero_writer import partition_hetero_graph
from partitioner.synthetic import generate
from partitioner.typed import TypedGraphData
from sampling_server.sampler import create_hetero_sampler, normalize_num_neighbors, to_hetero_data
from sampling_server.sampler.cpu_fused import UNSEEN
from sampling_server.sampler.hetero_base import HeteroNeighborSampler, relation_key
from sampling_server.sampler.hetero_cpu import CpuHeteroSampler
from sampling_server.sampler.hetero_cuda import CudaHeteroSampler
from tests.hetero_fixtures import tiny_hetero
from tests.hetero_sampler_checks import (
    LocalHeteroPeers,
    assert_same_batch,
    check_hetero_batch,
    load_all,
    node_maps,
)

WRITES: EdgeType = ("author", "writes", "paper")
CITES: EdgeType = ("paper", "cites", "paper")


@pytest.fixture(scope="module")
def small() -> TypedGraphData:
    return generate("mag-small", seed=1, progress=False).add_reverse()


def _partitioned(graph: TypedGraphData, parts: int, method: str, root: Path) -> Path:
    partition_hetero_graph(graph, parts, root, method=method, seed=0, progress=False)
    return root


@pytest.fixture(scope="module")
def small_one(small: TypedGraphData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _partitioned(small, 1, "random", tmp_path_factory.mktemp("mag-small-1"))


@pytest.fixture(scope="module")
def small_two(small: TypedGraphData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _partitioned(small, 2, "metis", tmp_path_factory.mktemp("mag-small-2"))


@pytest.fixture(scope="module")
def one_sampler(small_one: Path) -> CpuHeteroSampler:
    return CpuHeteroSampler(load_all(small_one)[0])


def _train_seeds(graph: TypedGraphData, n: int, offset: int = 0) -> np.ndarray:
    return np.asarray(graph.splits["train"][offset:offset + n], dtype=np.int64)


@pytest.mark.parametrize("num_neighbors", [
    [5, 3],
    [-1, 2],
    {"author__writes__paper": [4, 0], "paper__cites__paper": [3, 2],
     "paper__rev_writes__author": [0, 6], "field_of_study__rev_has_topic__paper": [-1, 1]},
])
def test_single_partition_properties(small: TypedGraphData, small_one: Path,
                                     one_sampler: CpuHeteroSampler, num_neighbors: object) -> None:
    seeds = _train_seeds(small, 48)
    maps = node_maps(small_one, small)
    fanouts = normalize_num_neighbors(num_neighbors, small.edge_types)  # type: ignore[arg-type]
    batch = one_sampler.minibatch(maps["paper"][seeds], "paper", num_neighbors, key=11)  # type: ignore[arg-type]
    check_hetero_batch(small, maps, batch, "paper", seeds, fanouts)
    assert sum(sum(v) for v in batch.structure.num_sampled_edges.values()) > 0


def test_dict_leaves_out_edge_types(small: TypedGraphData, small_one: Path,
                                    one_sampler: CpuHeteroSampler) -> None:
    maps = node_maps(small_one, small)
    out = one_sampler.sample(maps["paper"][_train_seeds(small, 16)], "paper",
                             {("paper", "cites", "paper"): [4, 4]}, key=3)
    for et, n in out.num_sampled_edges.items():
        assert (sum(n) > 0) == (et == CITES), et
    assert out.num_sampled_nodes["author"] == [0, 0, 0]


def test_same_key_same_batch_other_key_differs(small: TypedGraphData, small_one: Path,
                                              one_sampler: CpuHeteroSampler) -> None:
    seeds = node_maps(small_one, small)["paper"][_train_seeds(small, 32)]
    a = one_sampler.minibatch(seeds, "paper", [6, 4], key=5)
    assert_same_batch(a, one_sampler.minibatch(seeds, "paper", [6, 4], key=5))
    b = one_sampler.minibatch(seeds, "paper", [6, 4], key=6)
    assert not torch.equal(a.orig_id["author"], b.orig_id["author"])


def test_relations_into_one_type_draw_independently() -> None:
    """Distinct relations get distinct keys, so one node's draws are not tied across them."""
    keys = {relation_key(7, et) for et in [WRITES, CITES, ("paper", "rev_cites", "paper")]}
    assert len(keys) == 3 and relation_key(7, WRITES) != relation_key(8, WRITES)


def test_uniform_draws_of_one_node(small: TypedGraphData, small_one: Path,
                                   one_sampler: CpuHeteroSampler) -> None:
    """Chi-square: every in-edge of one paper along ``writes`` is drawn k/d of the time."""
    src, dst = small.edge_index[WRITES]
    degree = np.bincount(dst, minlength=small.num_nodes["paper"])
    paper = int(np.flatnonzero((degree >= 10) & (degree <= 20))[0])
    d, k, trials = int(degree[paper]), 4, 3000
    maps = node_maps(small_one, small)
    node = torch.tensor([maps["paper"][paper]], dtype=torch.int64)
    authors, mult = np.unique(maps["author"][src[dst == paper]], return_counts=True)
    counts = np.zeros(authors.size)
    for key in range(trials):
        drawn = one_sampler.sample_relation(WRITES, node, k, key, 0).neighbors.numpy()
        assert drawn.size == k
        counts += np.bincount(np.searchsorted(authors, drawn), minlength=authors.size)
    expected = trials * k * mult / d
    assert stats.chisquare(counts, expected).pvalue > 1e-4


def test_two_partitions_equal_one(small: TypedGraphData, small_one: Path, small_two: Path) -> None:
    """Peers answered in process: the 2-partition batch equals the 1-partition one, in
    original IDs, with seeds owned by both partitions."""
    one = CpuHeteroSampler(load_all(small_one)[0])
    samplers = [CpuHeteroSampler(p) for p in load_all(small_two)]
    peers = LocalHeteroPeers(samplers)
    maps1, maps2 = node_maps(small_one, small), node_maps(small_two, small)
    seeds = _train_seeds(small, 64, offset=100)
    fanouts = {"paper__cites__paper": [5, 3], "author__writes__paper": [4, 2],
               "paper__rev_writes__author": [3, 3], "institution__rev_affiliated_with__author": [2, 2],
               "paper__has_topic__field_of_study": [2, 2], "author__affiliated_with__institution": [1, 1],
               "field_of_study__rev_has_topic__paper": [2, 2]}
    want = one.minibatch(maps1["paper"][seeds], "paper", fanouts, key=99)
    got = samplers[0].minibatch(maps2["paper"][seeds], "paper", fanouts, key=99, remote=peers)
    assert peers.asked.get(1, 0) > 0  # the other partition was really asked
    assert_same_batch(want, got)
    check_hetero_batch(small, maps2, got, "paper", seeds,
                       normalize_num_neighbors(fanouts, small.edge_types))


@pytest.mark.parametrize("replace", [False, True], ids=["uniform", "replace"])
def test_fused_path_equals_the_generic_path(small: TypedGraphData, small_one: Path,
                                            small_two: Path, replace: bool) -> None:
    """The fused draw-and-relabel hops (the CPU default) give exactly the batch of the
    shared per-relation path (draw, then relabel), on one partition and on two (where
    remote frontiers are drawn by the peer and relabelled by the fused passes), and leave
    every dense map all UNSEEN."""
    fanouts = {"paper__cites__paper": [5, 3], "author__writes__paper": [-1, 2],
               "paper__rev_writes__author": [3, 3], "paper__has_topic__field_of_study": [2, 0]}
    seeds = _train_seeds(small, 200, offset=7)
    for root in (small_one, small_two):
        samplers = [CpuHeteroSampler(p, replace=replace) for p in load_all(root)]
        peers = LocalHeteroPeers(samplers) if len(samplers) > 1 else None
        paper = node_maps(root, small)["paper"][seeds]
        for key in (3, 4):
            got = samplers[0].sample(paper, "paper", fanouts, key=key, remote=peers)
            want = HeteroNeighborSampler.sample(samplers[0], paper, "paper", fanouts, key, peers)
            assert got.num_sampled_nodes == want.num_sampled_nodes
            assert got.num_sampled_edges == want.num_sampled_edges
            for t in want.node:
                assert torch.equal(got.node[t], want.node[t]), t
            for et in want.row:
                assert torch.equal(got.row[et], want.row[et]), et
                assert torch.equal(got.col[et], want.col[et]), et
        for s in samplers:
            for pool in s._dense_maps.values():
                assert all(bool((m == UNSEEN).all()) for m in pool._free)


def test_remote_nodes_need_a_remote(small: TypedGraphData, small_two: Path) -> None:
    sampler = CpuHeteroSampler(load_all(small_two)[0])
    start, stop = sampler.node_range("paper")
    with pytest.raises(ValueError, match="seeds"):
        sampler.sample(torch.tensor([stop]), "paper", [2], key=1)
    with pytest.raises(RuntimeError, match="remote"):
        sampler.sample(torch.arange(start, min(stop, start + 200)), "paper", [10, 10], key=1)


def test_bad_input_names_the_field(one_sampler: CpuHeteroSampler) -> None:
    seeds = torch.tensor([0, 1])
    cases: list[tuple[object, str, str]] = [
        ([2], "venue", "seed_type"),
        ({"paper__sells__paper": [2]}, "paper", "num_neighbors"),
        ({"paper__cites__paper": [2], "author__writes__paper": [2, 2]}, "paper", "num_neighbors"),
        ([2, -2], "paper", "fanouts"),
        ([], "paper", "fanouts"),
        ({}, "paper", "num_neighbors"),
    ]
    for fanouts, seed_type, field in cases:
        with pytest.raises(ValueError, match=field):
            one_sampler.sample(seeds, seed_type, fanouts, key=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seeds"):
        one_sampler.sample(torch.tensor([0, 0]), "paper", [2], key=1)
    with pytest.raises(ValueError, match="edge_type"):
        one_sampler.sample_relation(("paper", "sells", "paper"), seeds, 2, 1, 0)
    with pytest.raises(ValueError, match="device"):
        create_hetero_sampler(one_sampler.partition, "tpu")


def test_to_hetero_data_shapes(small: TypedGraphData, one_sampler: CpuHeteroSampler) -> None:
    batch = one_sampler.minibatch(torch.arange(20), "paper", [4, 3], key=2)
    data = to_hetero_data(batch)
    s = batch.structure
    assert set(data.node_types) == set(small.node_types)
    assert set(data.edge_types) == set(small.edge_types)
    assert data["paper"].batch_size == 20
    for t in small.node_types:
        assert data[t].num_nodes == s.node[t].numel() == data[t].n_id.numel()
    assert data["paper"].x.shape == (s.node["paper"].numel(), small.x["paper"].shape[1])
    assert "x" not in data["author"] and data["paper"].y.shape == (s.node["paper"].numel(),)
    for et in small.edge_types:
        ei = data[et].edge_index
        assert ei.shape == (2, s.row[et].numel())
        if ei.numel():
            assert int(ei[0].max()) < data[et[0]].num_nodes and int(ei[1].max()) < data[et[2]].num_nodes
    assert data.num_sampled_nodes["paper"][0] == 20


@pytest.fixture(scope="module")
def tiny_parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[TypedGraphData, Path]:
    g = tiny_hetero()
    return g, _partitioned(g, 2, "hash", tmp_path_factory.mktemp("tiny-2"))


@pytest.mark.parametrize(("replace", "topology"), [(False, "device"), (True, "device"),
                                                   (False, "uva")])
def test_cuda_equals_cpu(tiny_parts: tuple[TypedGraphData, Path], replace: bool,
                         topology: str) -> None:
    """The CUDA sampler (the simulator here) draws exactly the CPU sampler's batch, also
    across partitions."""
    g, root = tiny_parts
    parts = load_all(root)
    cpu = [CpuHeteroSampler(p, replace=replace) for p in parts]
    gpu = [CudaHeteroSampler(p, replace=replace, topology=topology) for p in parts]
    maps = node_maps(root, g)
    seeds = torch.from_numpy(maps["paper"][g.splits["train"][:6]])
    fanouts = [3, 2]
    for key in (1, 2):
        a = cpu[0].minibatch(seeds, "paper", fanouts, key, remote=LocalHeteroPeers(cpu))
        b = gpu[0].minibatch(seeds, "paper", fanouts, key, remote=LocalHeteroPeers(gpu))
        assert_same_batch(a, b)
        if not replace:
            check_hetero_batch(g, maps, b, "paper", g.splits["train"][:6],
                               normalize_num_neighbors(fanouts, g.edge_types))


def _pyg_neighbor_backend() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in ("pyg_lib", "torch_sparse"))


@pytest.mark.skipif(not _pyg_neighbor_backend(), reason="PyG's hetero NeighborLoader needs "
                    "pyg-lib or torch-sparse (make bench-peers)")
def test_structure_matches_pyg_neighbor_loader(small: TypedGraphData, small_one: Path,
                                               one_sampler: CpuHeteroSampler) -> None:
    """Same seeds and fanouts: nodes per type and edges per edge type agree with PyG's
    hetero ``NeighborLoader`` on average (both are uniform without replacement)."""
    from torch_geometric.data import HeteroData
    from torch_geometric.loader import NeighborLoader

    data = HeteroData()
    for t, n in small.num_nodes.items():
        data[t].num_nodes = n
    for et, ei in small.edge_index.items():
        data[et].edge_index = torch.from_numpy(ei)
    batch, num_batches = 64, 10
    seeds = _train_seeds(small, batch * num_batches)
    loader = NeighborLoader(data, num_neighbors={et: [5, 3] for et in small.edge_types},
                            input_nodes=("paper", torch.from_numpy(seeds)), batch_size=batch)
    maps = node_maps(small_one, small)
    ours, theirs = [], []
    for i, b in enumerate(loader):
        out = one_sampler.sample(maps["paper"][seeds[i * batch:(i + 1) * batch]], "paper", [5, 3],
                                 key=1000 + i)
        ours.append([out.node[t].numel() for t in small.node_types]
                    + [out.row[et].numel() for et in small.edge_types])
        theirs.append([b[t].num_nodes for t in small.node_types]
                      + [b[et].edge_index.shape[1] for et in small.edge_types])
    a, b_ = np.asarray(ours, float), np.asarray(theirs, float)
    assert a.shape == b_.shape == (num_batches, len(small.node_types) + len(small.edge_types))
    bound = 5 * np.sqrt((a.var(0) + b_.var(0)) / num_batches) + 1
    assert (np.abs(a.mean(0) - b_.mean(0)) <= bound).all(), (a.mean(0), b_.mean(0))


@pytest.mark.gpu
@pytest.mark.parametrize("topology", ["device", "uva"])
def test_real_gpu_equals_cpu_on_mag_small(small: TypedGraphData, small_two: Path,
                                          topology: str) -> None:
    """On a real GPU: the 2-partition CUDA batch equals the CPU batch and has every property."""
    parts = load_all(small_two)
    cpu = [CpuHeteroSampler(p) for p in parts]
    gpu = [CudaHeteroSampler(p, topology=topology) for p in parts]
    maps = node_maps(small_two, small)
    seeds = _train_seeds(small, 512)
    a = cpu[0].minibatch(maps["paper"][seeds], "paper", [25, 20], 5, remote=LocalHeteroPeers(cpu))
    b = gpu[0].minibatch(maps["paper"][seeds], "paper", [25, 20], 5, remote=LocalHeteroPeers(gpu))
    assert all(t.device.type == "cuda" for t in b.structure.node.values())
    assert_same_batch(a, b)
    check_hetero_batch(small, maps, b, "paper", seeds,
                       normalize_num_neighbors([25, 20], small.edge_types))
