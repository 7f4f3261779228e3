"""The trainer-side feature cache on typed graphs: per-type hot orders served by
``StreamHotNodes(node_type=...)``, the plan per node type (``typed_cache_counts``), and
batches whose ``x`` of every type is bit-identical with and without the cache."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from server_procs import ServerProcs
from test_hetero_service import served
from test_loader import TIMEOUTS
from torch_geometric.data import HeteroData

from partitioner.hetero import HeteroGraphData
from partitioner.hetero_writer import partition_hetero_graph
from protos import codec
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.channel import ProtocolError, create_channel
from sampling_server.hot import typed_visit_scores
from tests.hetero_fixtures import tiny_hetero
from tests.hetero_sampler_checks import load_all, node_maps
from trainer_client.cache import plan_typed_counts
from trainer_client.hetero_loader import finish_typed
from trainer_client.loader import RemoteNeighborLoader

FEATURED = ("paper", "author")


@pytest.fixture(scope="module")
def graph() -> HeteroGraphData:
    """The tiny typed graph with features on two types, in two stored dtypes."""
    g = tiny_hetero()
    g.x["author"] = np.random.default_rng(3).standard_normal((20, 3)).astype(np.float16)
    return g.add_reverse()


@pytest.fixture(scope="module")
def two(graph: HeteroGraphData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("typed-cache-2")
    partition_hetero_graph(graph, 2, root, method="hash", seed=0, progress=False)
    return root


@pytest.fixture(scope="module")
def cluster(two: Path) -> Iterator[list[str]]:
    with served(two, 2) as addresses:
        yield addresses


def _hot_nodes(address: str, node_type: str, count: int, features: bool = False,
               dtype: int = pb.DTYPE_UNSPECIFIED) -> tuple[np.ndarray, np.ndarray | None]:
    with create_channel(address) as channel:
        blocks = list(pb_grpc.SamplingServiceStub(channel).StreamHotNodes(pb.HotNodesRequest(
            count=count, node_type=node_type, include_features=features, feature_dtype=dtype),
            timeout=30))
    ids = np.concatenate([codec.decode_tensor(b.n_id) for b in blocks])
    x = np.concatenate([codec.decode_tensor(b.x) for b in blocks]) if features else None
    return ids, x


def test_each_type_is_ordered_by_its_in_degree_over_every_relation(
        cluster: list[str], graph: HeteroGraphData, two: Path) -> None:
    """The served order of each type and partition: every owned node once, the in-degree
    summed over the relations ending at the type (counted on the original graph) never
    rising, ties by lower global ID."""
    maps = node_maps(two, graph)
    for t in graph.node_types:
        degree = np.zeros(graph.num_nodes[t], dtype=np.int64)
        for et, edges in graph.edge_index.items():
            if et[2] == t:
                degree += np.bincount(edges[1], minlength=graph.num_nodes[t])
        global_degree = np.empty_like(degree)
        global_degree[maps[t]] = degree  # original -> global
        seen = []
        for p, address in enumerate(cluster):
            with create_channel(address) as channel:
                info = pb_grpc.SamplingServiceStub(channel).GetClusterInfo(pb.ClusterInfoRequest(),
                                                                            timeout=30)
            book = next(n.partition_book for n in info.typed.node_types if n.name == t)
            ids, _ = _hot_nodes(address, t, book[p + 1] - book[p])
            assert sorted(ids.tolist()) == list(range(book[p], book[p + 1]))
            d = global_degree[ids]
            assert (np.diff(d) <= 0).all(), (t, p, d)
            ties = np.diff(d) == 0
            assert (np.diff(ids)[ties] > 0).all(), (t, p)
            seen.append(ids)
        assert sum(s.size for s in seen) == graph.num_nodes[t]


def test_hot_rows_are_the_types_features(cluster: list[str], graph: HeteroGraphData,
                                         two: Path) -> None:
    maps = node_maps(two, graph)
    for t in FEATURED:
        original = np.empty(graph.num_nodes[t], dtype=np.int64)
        original[maps[t]] = np.arange(graph.num_nodes[t])  # global -> original
        for dtype in (pb.DTYPE_UNSPECIFIED, pb.FLOAT32, pb.BFLOAT16):
            ids, x = _hot_nodes(cluster[1], t, 5, features=True, dtype=dtype)
            want = torch.from_numpy(graph.x[t][original[ids]])
            if dtype != pb.DTYPE_UNSPECIFIED:
                want = want.to(codec.dtype_to_torch(dtype))
            assert x is not None and ids.size == 5
            got = torch.from_numpy(x) if dtype != pb.BFLOAT16 else \
                torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
            assert torch.equal(got, want), (t, dtype)


def test_typed_visit_scores_follow_their_model(two: Path) -> None:
    """The typed visit estimate (the rule compared with in-degree in the benchmark) against
    a plain loop over the same model, on a partition whose ID ranges do not start at 0."""
    part = load_all(two)[1]
    fanouts = (2, 1)
    got = typed_visit_scores(part, fanouts, batch=4)
    ranges = {t: part.node_range(t) for t in part.manifest.node_types}
    size = {t: b - a for t, (a, b) in ranges.items()}
    frontier = {t: np.zeros(n) for t, n in size.items()}
    train = [v - ranges["paper"][0] for v in part.splits["train"]]
    for v in train:
        frontier["paper"][v] = min(1.0, 4 / len(train))
    total = {t: f.copy() for t, f in frontier.items()}
    for fanout in fanouts:
        drawn = {t: np.zeros(n) for t, n in size.items()}
        for (src, rel, dst), indptr in part.indptr.items():
            indices = part.indices[(src, rel, dst)]
            for u in range(size[dst]):
                lo, hi = int(indptr[u]), int(indptr[u + 1])
                if hi > lo:
                    for e in range(lo, hi):
                        v = int(indices[e]) - ranges[src][0]
                        if 0 <= v < size[src]:
                            drawn[src][v] += frontier[dst][u] * min(fanout, hi - lo) / (hi - lo)
        for t in size:
            frontier[t] = np.exp(-total[t]) * -np.expm1(-drawn[t])
            total[t] = total[t] + drawn[t]
    assert set(got) == set(size)
    for t in size:
        np.testing.assert_allclose(got[t], total[t], rtol=1e-12, atol=0)
    assert got["author"].sum() > 0  # reached through writes' reverse relation


def _batches(cluster: list[str], **kw: object) -> tuple[list[HeteroData], RemoteNeighborLoader]:
    settings: dict[str, object] = {"num_neighbors": [3, 2], "batch_size": 4, "shuffle": True,
                                   "seed": 5, **TIMEOUTS}
    settings.update(kw)
    loader = RemoteNeighborLoader(cluster, **settings)  # type: ignore[arg-type]
    with loader:
        return list(loader), loader


@pytest.mark.parametrize(("cache_size", "feature_dtype", "batches"), [
    (0.3, "float32", "partition"),
    (1.0, "bfloat16", "partition"),
    ("300B", "stored", "global"),
])
def test_cached_batches_are_bit_identical(cluster: list[str], cache_size: object,
                                          feature_dtype: str, batches: str) -> None:
    input_nodes = "train" if batches == "partition" else ("author", None)
    common = {"feature_dtype": feature_dtype, "batches": batches, "input_nodes": input_nodes}
    plain, _ = _batches(cluster, cache_size=0, **common)
    cached, loader = _batches(cluster, cache_size=cache_size, **common)
    assert set(loader.typed_caches) == set(FEATURED)
    # compact batches with a cache leave original IDs and labels to the node tables
    assert set(loader.typed_node_tables) == {"paper", "author", "topic"}
    request = loader._request()
    assert not request.include_original_ids and not request.include_labels
    assert loader.last_stats is not None and loader.last_stats.hit_rate > 0
    if cache_size == 1.0:
        assert loader.last_stats.hit_rate == 1.0
    assert len(plain) == len(cached) > 0
    for a, b in zip(plain, cached, strict=True):
        assert torch.equal(a["paper"].y, b["paper"].y) and b["paper"].y.dtype == torch.int64
        for t in a.node_types:
            assert torch.equal(a[t].n_id, b[t].n_id) and "internal_n_id" not in b[t]
            assert ("x" in a[t]) == ("x" in b[t]) == (t in FEATURED)
            if t in FEATURED:
                assert a[t].x.dtype == b[t].x.dtype == torch.float32
                assert torch.equal(a[t].x, b[t].x), t
                assert "x_cached" not in b[t]


def test_the_plan_names_every_featured_type_and_fits_the_budget(cluster: list[str]) -> None:
    with create_channel(cluster[0]) as channel:
        info = pb_grpc.SamplingServiceStub(channel).GetClusterInfo(pb.ClusterInfoRequest(), timeout=30)
    plan = plan_typed_counts(("fraction", 0.5), info, None)
    assert set(plan) == set(FEATURED)
    for t in info.typed.node_types:
        if t.name in plan:
            counts, wire = plan[t.name]
            assert wire == t.feature_dtype
            assert len(counts) == 2 and sum(counts) <= t.num_nodes // 2
            assert all(0 <= c <= t.partition_book[p + 1] - t.partition_book[p]
                       for p, c in enumerate(counts))
    row = {"paper": 4 * 2, "author": 3 * 2}  # bfloat16 on the wire
    for budget in (0, 50, 200, 10**6):
        plan = plan_typed_counts(("bytes", budget), info, pb.BFLOAT16)
        used = sum(sum(c) * row[t] for t, (c, _) in plan.items())
        assert used <= budget and all(w == pb.BFLOAT16 for _, w in plan.values())
    full = plan_typed_counts(("bytes", 10**6), info, pb.BFLOAT16)
    assert {t: sum(c) for t, (c, _) in full.items()} == {"paper": 30, "author": 20}


def test_a_batch_marking_rows_no_cache_holds_is_refused() -> None:
    data = HeteroData()
    data["paper"].num_nodes = 2
    data["paper"].n_id = torch.tensor([0, 1])
    data["paper"].x = torch.zeros(1, 4)
    data["paper"].x_cached = torch.tensor([True, False])
    with pytest.raises(ProtocolError, match="x_cached/paper"):
        finish_typed(data, "paper", np.arange(2), torch.device("cpu"), feature_dtype=None,
                     non_blocking=False, keep_internal_ids=False, caches={})


@pytest.mark.gpu
@pytest.mark.parametrize("cache_size", [0.3, "auto"])
def test_a_cuda_trainer_assembles_typed_batches_on_the_gpu(cluster: list[str],
                                                           cache_size: object) -> None:
    """Each type's cache in GPU memory; the batches equal a CPU loader's without cache."""
    plain, _ = _batches(cluster, cache_size=0, feature_dtype="bfloat16")
    cached, loader = _batches(cluster, cache_size=cache_size, feature_dtype="bfloat16",
                              device="cuda")
    assert set(loader.typed_caches) == set(FEATURED)
    assert all(c.rows.device.type == "cuda" for c in loader.typed_caches.values())
    if cache_size == "auto":  # the tiny graph fits: every row is cached
        assert loader.last_stats is not None and loader.last_stats.hit_rate == 1.0
    assert len(plain) == len(cached) > 0
    for a, b in zip(plain, cached, strict=True):
        for t in FEATURED:
            assert b[t].x.device.type == "cuda"
            assert torch.equal(a[t].x, b[t].x.cpu()), t


def _typed_digest(batch: HeteroData) -> str:
    h = hashlib.sha256()
    for t in batch.node_types:
        for name in ("n_id", "x", "y"):
            if name in batch[t]:
                h.update(t.encode() + name.encode() + batch[t][name].numpy().tobytes())
    for et in batch.edge_types:
        h.update(batch[et].edge_index.numpy().tobytes())
    return h.hexdigest()


def test_a_typed_server_restarted_mid_epoch_rejoins_a_cached_stream(two: Path,
                                                                    tmp_path: Path) -> None:
    """Real server processes, the trainer's cache on: server 1 killed and started again
    after the second batch; its stream resumes with the same plan (the restarted server
    computes the same per-type orders) and every batch is the unbroken run's."""
    procs = ServerProcs(two, 2, "--device", "cpu", log_dir=tmp_path)
    procs.start()
    try:
        for p in range(2):
            procs.wait_status(p, "SERVING", timeout=120)
        with RemoteNeighborLoader(procs.addresses, input_nodes="train", num_neighbors=[3, 2],
                                  batch_size=2, shuffle=True, seed=4, cache_size=0.5,
                                  batches="partition", prefetch=1, connect_timeout=60,
                                  stall_timeout=60, reconnect_timeout=120) as loader:
            assert set(loader.typed_caches) == set(FEATURED)
            unbroken = [_typed_digest(b) for b in loader]
            resumes = 0
            for _ in range(3):  # until the kill lands while server 1 still streams
                loader.set_epoch(0)
                got = []
                for i, batch in enumerate(loader):
                    got.append(_typed_digest(batch))
                    if i == 1:
                        procs.kill(1)
                        procs.start(1)
                assert got == unbroken
                resumes = loader.last_stats.resumes if loader.last_stats else 0
                if resumes:
                    break
                procs.wait_status(1, "SERVING", 120)
            assert resumes >= 1, "the kill never broke a stream"
            assert loader.last_stats is not None and loader.last_stats.hit_rate > 0
    finally:
        procs.stop()
