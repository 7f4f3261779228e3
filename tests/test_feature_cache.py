"""The trainer-side hot-feature cache with servers, on both kinds of graph: batches
bit-identical with and without it, one fill per job shared by the loaders of a cluster,
filled again after a break, "auto" planned once per device, hot rows hit more often than
their share, servers without a hot order, a server restarted mid-epoch; and on the
servers, the hot orders every party computes alike and what they do with a plan.

A plain graph is the ``small`` synthetic graph in three partitions; a typed one the tiny
typed graph with features on two node types (float32 papers, float16 authors) in two.
The parts without servers are in test_cache_plan.py."""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from graph_fixtures import load_all, node_maps, tiny_typed
from in_process_servers import served
from server_procs import ServerProcs
from test_loader import TIMEOUTS, real_servers
from torch_geometric.data import Data, HeteroData

from partitioner.format import load_partition
from partitioner.graph import PLAIN_NODE_TYPE, TypedGraphData
from partitioner.writer import partition_graph
from protos import codec, fastwire
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.channel import ProtocolError, ServerUnavailable, create_channel
from protos.codec import encode_tensor
from protos.epoch_call import last_chunk, stream_minibatches
from sampling_server.sampler.hot_order import HOT_ORDER, hot_order, visit_scores
from trainer_client import cluster as cluster_module
from trainer_client import fills
from trainer_client.cache import plan_caches, plan_counts
from trainer_client.decode import BatchAssembler, DecodedBatch
from trainer_client.graph import TypedGraph
from trainer_client.loader import Cluster, RemoteNeighborLoader

ARGS = {"num_neighbors": [5, 3], "batch_size": 96, "shuffle": True, "seed": 3, **TIMEOUTS}
#: The typed graph's node types with features.
FEATURED = ("paper", "author")


def _raw(x: torch.Tensor) -> torch.Tensor:
    """The bits of a feature tensor, for bitwise comparison."""
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    out = tmp_path_factory.mktemp("cache") / "small-3"
    with real_servers(out, num_parts=3) as addresses:
        yield out, addresses


@pytest.fixture(scope="module")
def typed_graph() -> TypedGraphData:
    """The tiny typed graph with features on two types, in two stored dtypes."""
    g = tiny_typed()
    g.x["author"] = np.random.default_rng(3).standard_normal((20, 3)).astype(np.float16)
    return g.add_reverse()


@pytest.fixture(scope="module")
def typed_parts(typed_graph: TypedGraphData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("typed-cache-2")
    partition_graph(typed_graph, 2, root, method="hash", seed=0, progress=False)
    return root


@pytest.fixture(scope="module")
def typed(typed_parts: Path) -> Iterator[tuple[Path, list[str]]]:
    with served(typed_parts, 2) as addresses:
        yield typed_parts, addresses


@dataclass
class Kind:
    """A served graph of one kind, and how its loaders are made."""

    name: str
    root: Path
    addresses: list[str]
    #: Loader arguments every test uses.
    args: dict[str, Any]
    #: Node types with features, and every node type.
    featured: tuple[str, ...]
    node_types: tuple[str, ...]

    def loader(self, cluster: Cluster | list[str], split: str = "train", **kw: Any) -> RemoteNeighborLoader:
        return RemoteNeighborLoader(cluster, split, **{**self.args, **kw})


@pytest.fixture(params=["plain", "typed"])
def kind(request: pytest.FixtureRequest) -> Kind:
    root, addresses = request.getfixturevalue(request.param)
    if request.param == "plain":
        return Kind("plain", root, addresses, ARGS, ("_N",), ("_N",))
    args = {**ARGS, "num_neighbors": [3, 2], "batch_size": 4, "seed": 5}
    return Kind("typed", root, addresses, args, FEATURED, ("paper", "author", "topic"))


def stores(batch: Data | HeteroData) -> list[tuple[str, Any]]:
    """``(node type, store)`` of a batch ("_N": a plain batch itself)."""
    return [("_N", batch)] if isinstance(batch, Data) else [(t, batch[t]) for t in batch.node_types]


def edge_indices(batch: Data | HeteroData) -> list[torch.Tensor]:
    return [batch.edge_index] if isinstance(batch, Data) else [batch[e].edge_index for e in batch.edge_types]


def assert_same_batches(a: Data | HeteroData, b: Data | HeteroData, dtype: torch.dtype | None = None) -> None:
    """Batches equal value for value, features bit for bit (of ``dtype`` when given)."""
    assert type(a) is type(b)
    for (t, sa), (_, sb) in zip(stores(a), stores(b), strict=True):
        assert torch.equal(sa.n_id, sb.n_id) and "internal_n_id" not in sb, t
        assert ("x" in sa) == ("x" in sb) and "x_cached" not in sb, t
        if "x" in sa:
            assert sa.x.dtype == sb.x.dtype and (dtype is None or sa.x.dtype == dtype), t
            assert torch.equal(_raw(sa.x), _raw(sb.x)), t
        if "y" in sa:
            assert torch.equal(sa.y, sb.y) and sb.y.dtype == torch.int64, t
    for ea, eb in zip(edge_indices(a), edge_indices(b), strict=True):
        assert torch.equal(ea, eb)


@pytest.mark.parametrize(("cache_size", "dtype", "batches", "cast"), [
    (0.3, "float32", "partition", False),
    (0.3, "bfloat16", "global", False),
    (0.3, "float16", "global", True),
    (1.0, "bfloat16", "partition", True),
    ("bytes", "stored", "global", True),
])
def test_batches_are_bit_identical_with_and_without_the_cache(kind: Kind, cache_size: object, dtype: str,
                                                               batches: str, cast: bool) -> None:
    if cache_size == "bytes":  # about half of every type's rows
        cache_size = "300B" if kind.name == "typed" else "250KB"
    with Cluster(kind.addresses, connect_timeout=30) as cluster:
        common = {"batches": batches, "feature_dtype": dtype, "cast_features": cast}
        uncached = kind.loader(cluster, cache_size=0, **common)
        cached = kind.loader(cluster, cache_size=cache_size, **common)
        assert not uncached.caches and set(cached.caches) == set(kind.featured)
        # compact batches with a cache leave original IDs and labels to the node tables
        assert set(cached.node_tables) == set(kind.node_types) and not uncached.node_tables
        request = cached._request()
        assert not request.include_original_ids and not request.include_labels
        want = torch.float32 if cast else None if dtype == "stored" else getattr(torch, dtype)
        for epoch in range(2):
            uncached.set_epoch(epoch)
            cached.set_epoch(epoch)
            count = rows = 0
            for a, b in zip(uncached, cached, strict=True):
                assert_same_batches(a, b, want)
                count += 1
                rows += sum(int(s.num_nodes) for _, s in stores(a) if "x" in s)
                # the counters cover the batches taken so far, not those prefetched
                for stats in (uncached.last_stats, cached.last_stats):
                    assert (stats.batches, stats.rows) == (count, rows)
            assert count == len(uncached) > 1
            hit_rate = cached.last_stats.hit_rate
            assert hit_rate == 1.0 if cache_size == 1.0 else 0 < hit_rate < 1
            assert uncached.last_stats.hit_rate == 0
            assert cached.last_stats.bytes < uncached.last_stats.bytes


def test_one_plan_fills_once_per_job_and_its_loaders_share_it(kind: Kind,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    fill = fills._fill_partition

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return fill(*args, **kwargs)

    monkeypatch.setattr(fills, "_fill_partition", counting)
    with Cluster(kind.addresses, connect_timeout=30) as cluster:
        loaders = [kind.loader(cluster, split, cache_size="25%") for split in ("train", "val", "train")]
        loaders.append(kind.loader(cluster, "val", cache_size="25%", rank=1, world_size=2))
        streams = sum(1 for cache in loaders[0].caches.values() for c in cache.counts if c)
        assert len(calls) == streams >= len(kind.featured)  # one StreamHotNodes per partition and type
        assert all(loader.caches[t] is loaders[0].caches[t] for loader in loaders for t in kind.featured)
        for t, cache in loaders[0].caches.items():
            book = cluster.graph.books[t]
            assert list(cache.counts) == plan_counts(("fraction", 0.25), book, 1)
            assert sum(cache.counts) <= 0.25 * int(book[-1])
        for epoch in range(3):
            for loader in loaders[:3]:
                loader.set_epoch(epoch)
                assert sum(1 for _ in loader) == len(loader)
        assert len(calls) == streams


def test_a_partition_whose_stream_breaks_is_filled_again(kind: Kind, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A server restarting during the fill (UNAVAILABLE after some blocks): that partition
    is streamed again from its first row; the cache equals an unbroken fill."""
    fill = fills._fill_partition
    broken: list[int] = []

    def breaks_once(open_stream: Any, address: str, p: int, k: int, out: torch.Tensor, timeout: float,
                    started: Any, progress: Any) -> torch.Tensor:
        if p == 1 and not broken:
            broken.append(p)
            progress(k // 2)  # half the rows came
            raise ServerUnavailable("StreamHotNodes at b failed: UNAVAILABLE: restarting")
        return fill(open_stream, address, p, k, out, timeout, started, progress)

    with Cluster(kind.addresses, connect_timeout=30) as cluster:
        t = kind.featured[-1]
        counts = plan_counts(("fraction", 0.5), cluster.graph.books[t], 1)
        cpu = torch.device("cpu")
        whole = cluster.fill_feature_cache(counts, pb.FLOAT32, cpu, progress=False, node_type=t)
        monkeypatch.setattr(fills, "_fill_partition", breaks_once)
        again = cluster.fill_feature_cache(counts, pb.FLOAT32, cpu, progress=False, node_type=t)
    assert broken == [1]
    assert torch.equal(again.rows, whole.rows) and torch.equal(again.slot, whole.slot)
    assert "partition 1's stream broke after" in caplog.text and "filling it again" in caplog.text


def test_the_partitions_fill_at_once(plain: tuple[Path, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    root, addresses = plain
    fill = fills._fill_partition
    running, most = [0], [0]
    lock = threading.Lock()

    def overlapping(*args: Any, **kwargs: Any) -> torch.Tensor:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.3)  # long enough for the other partitions' fills to start
            return fill(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(fills, "_fill_partition", overlapping)
    with Cluster(addresses, connect_timeout=30) as cluster:
        book = cluster.graph.books[PLAIN_NODE_TYPE]
        counts = plan_counts(("fraction", 0.3), book.tolist(), 4)
        cache = cluster.fill_feature_cache(counts, pb.FLOAT32, torch.device("cpu"))
        assert most[0] == 3 and cache.num_rows == sum(counts)
        x = load_partition(root, 1).x.get(PLAIN_NODE_TYPE)
        assert x is not None
        held = torch.nonzero(cache.slot >= 0).flatten()
        own = held[(held >= int(book[1])) & (held < int(book[2]))]
        assert own.numel() == counts[1]
        rows = torch.from_numpy(x[(own - int(book[1])).numpy()])
        assert torch.equal(cache.rows[cache.slot[own].long()], rows)


def test_hot_nodes_are_hit_more_often_than_their_share(kind: Kind) -> None:
    with Cluster(kind.addresses, connect_timeout=30) as cluster:
        loader = kind.loader(cluster, cache_size=0.2)
        rows = sum(c.num_rows for c in loader.caches.values())
        share = rows / sum(cluster.graph.num_nodes[t] for t in kind.featured)
        list(loader)
        stats = loader.last_stats
        assert stats.rows > 0 and stats.cached_rows > 0
        assert share < stats.hit_rate < 1.0, (share, stats.hit_rate)


def test_an_auto_cache_is_planned_once_per_device_and_shared(kind: Kind,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    budgets = [40_000, 10_000, 5_000]  # free memory shrinks once the first cache is filled
    asked: list[int] = []

    def measured(device: torch.device, num_nodes: int) -> int:
        asked.append(num_nodes)
        return budgets.pop(0)

    with Cluster(kind.addresses, connect_timeout=30) as cluster:
        assert not kind.loader(cluster).caches  # auto on a CPU: none
        monkeypatch.setattr(cluster_module, "auto_cache_bytes", measured)
        other = Cluster(kind.addresses, connect_timeout=30)
        loaders = [kind.loader(other, split, cache_size="auto") for split in ("train", "val", "test")]
        first = loaders[0].caches
        assert set(first) == set(kind.featured)
        assert all(loader.caches[t] is first[t] for loader in loaders for t in first)
        assert budgets == [10_000, 5_000] and asked == [other.graph.featured_nodes]  # measured once
        rows = {t: int(other.graph.feature_dims[t]) * c.rows.element_size() for t, c in first.items()}
        assert sum(sum(c.counts) * rows[t] for t, c in first.items()) <= 40_000
        assert sum(1 for _ in loaders[0]) == len(loaders[0]) and loaders[0].last_stats.hit_rate > 0
        other.close()


def test_servers_without_a_hot_order_get_no_plan(kind: Kind, caplog: pytest.LogCaptureFixture) -> None:
    with Cluster(kind.addresses, connect_timeout=30) as cluster:
        for info in cluster.infos:
            info.hot_order = ""  # as a server from before the cache answers
        loader = kind.loader(cluster, cache_size=0.2)
        assert not loader.caches and loader.cache is None and not loader.typed_caches
        assert "running without the feature cache" in caplog.text
        request = loader._request()
        assert list(request.cache_counts) == [] and list(request.typed_cache_counts) == []
        assert sum(1 for _ in loader) == len(loader) and loader.last_stats.hit_rate == 0


def test_a_batch_marking_rows_no_cache_holds_is_refused(kind: Kind) -> None:
    """A server that marks rows as cached that this loader planned no cache for."""
    with Cluster(kind.addresses, connect_timeout=30) as cluster:
        loader = kind.loader(cluster, cache_size=0)
        t = kind.featured[0]
        data = HeteroData()
        data[t].num_nodes = 2
        data[t].n_id = torch.tensor([0, 1])
        data[t].x = torch.zeros(1, 4)
        data[t].x_cached = torch.tensor([True, False])
        name = "x_cached" if kind.name == "plain" else f"x_cached/{t}"
        pattern = rf"tensor '{name}': expected none \(this loader sent no cache plan"
        with pytest.raises(ProtocolError, match=pattern):
            loader._finish(DecodedBatch(0, data, 0), np.arange(2))


def _digest(batch: Data | HeteroData) -> str:
    h = hashlib.sha256()
    for t, store in stores(batch):
        for name in ("n_id", "x", "y"):
            if name in store:
                h.update(t.encode() + name.encode() + store[name].numpy().tobytes())
    for edge_index in edge_indices(batch):
        h.update(edge_index.numpy().tobytes())
    return h.hexdigest()


def test_a_server_restarted_mid_epoch_rejoins_a_cached_stream(kind: Kind, tmp_path: Path) -> None:
    """Real server processes, the trainer's cache on: server 1 killed and started again
    after the second batch; its stream resumes with the same plan (the restarted server
    computes the same hot orders) and every batch is the unbroken run's."""
    procs = ServerProcs(kind.root, len(kind.addresses), "--device", "cpu", log_dir=tmp_path)
    procs.start()
    try:
        for p in range(len(kind.addresses)):
            procs.wait_status(p, "SERVING", timeout=120)
        args = {**kind.args, "batch_size": 2 if kind.name == "typed" else 40, "seed": 4}
        timeouts = {"connect_timeout": 60, "stall_timeout": 60, "reconnect_timeout": 120}
        with RemoteNeighborLoader(procs.addresses, "train", **{**args, **timeouts}, cache_size=0.5,
                                  batches="partition", prefetch=1) as loader:
            assert set(loader.caches) == set(kind.featured)
            unbroken = [_digest(b) for b in loader]
            resumes = 0
            for _ in range(3):  # until the kill lands while server 1 still streams
                loader.set_epoch(0)
                got = []
                for i, batch in enumerate(loader):
                    got.append(_digest(batch))
                    if i == 1:
                        procs.kill(1)
                        procs.start(1)
                assert got == unbroken
                resumes = loader.last_stats.resumes
                if resumes:
                    break
                procs.wait_status(1, "SERVING", 120)
            assert resumes >= 1, "the kill never broke a stream"
            assert loader.last_stats.hit_rate > 0
    finally:
        procs.stop()


# ---- hot orders and plans on the servers ---------------------------------------------------


def test_a_graphs_hot_order_is_the_same_on_every_party(kind: Kind) -> None:
    """Each server ranks each type's nodes by the servers' rule, exactly as
    ``hot_order`` computes it from the partition alone (what a trainer's plan and the
    servers' plan bitsets rely on): the expected visits, hottest first."""
    with Cluster(kind.addresses, connect_timeout=30) as cluster:
        assert {i.hot_order for i in cluster.infos} == {HOT_ORDER} == {"visits_v1"}
        for p, address in enumerate(cluster.addresses):
            part = load_partition(kind.root, p)
            scores = visit_scores(part)
            for t in kind.node_types:
                start = part.node_range(t)[0]
                expected = hot_order(part, t)
                assert (np.diff(scores[t][expected - start]) <= 0).all()  # hottest first
                ids, _ = _hot_nodes(address, t if kind.name == "typed" else "", expected.size)
                np.testing.assert_array_equal(ids, expected)


def _hot_nodes(address: str, node_type: str, count: int, features: bool = False,
               dtype: int = pb.DTYPE_UNSPECIFIED) -> tuple[np.ndarray, np.ndarray | None]:
    with create_channel(address) as channel:
        blocks = list(pb_grpc.SamplingServiceStub(channel).StreamHotNodes(pb.HotNodesRequest(
            count=count, node_type=node_type, include_features=features, feature_dtype=dtype),
            timeout=30))
    ids = np.concatenate([codec.decode_tensor(b.n_id) for b in blocks])
    x = np.concatenate([codec.decode_tensor(b.x) for b in blocks]) if features else None
    return ids, x


def test_in_degree_ranks_each_type_by_its_in_degree_over_every_relation(
        typed_parts: Path, typed_graph: TypedGraphData) -> None:
    """``--hot-order in_degree_v1``: the served order of each type and partition has
    every owned node once, the in-degree summed over the relations ending at the type
    (counted on the original graph) never rising, ties by lower global ID."""
    root, graph = typed_parts, typed_graph
    maps = node_maps(root, graph)
    with served(root, 2, hot_order="in_degree_v1") as cluster:
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
                assert info.hot_order == "in_degree_v1"
                book = next(n.partition_book for n in info.typed.node_types if n.name == t)
                ids, _ = _hot_nodes(address, t, book[p + 1] - book[p])
                assert sorted(ids.tolist()) == list(range(book[p], book[p + 1]))
                d = global_degree[ids]
                assert (np.diff(d) <= 0).all(), (t, p, d)
                ties = np.diff(d) == 0
                assert (np.diff(ids)[ties] > 0).all(), (t, p)
                seen.append(ids)
            assert sum(s.size for s in seen) == graph.num_nodes[t]


def test_hot_rows_are_the_types_features(typed: tuple[Path, list[str]], typed_graph: TypedGraphData) -> None:
    (root, cluster), graph = typed, typed_graph
    maps = node_maps(root, graph)
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


def test_visit_scores_follow_their_model(typed_parts: Path) -> None:
    """The typed visit estimate (the rule compared with in-degree in the benchmark) against
    a plain loop over the same model, on a partition whose ID ranges do not start at 0."""
    part = load_all(typed_parts)[1]
    fanouts = (2, 1)
    got = visit_scores(part, fanouts, batch=4)
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


def test_a_typed_graphs_plan_names_every_featured_type_and_fits_the_budget(
        typed: tuple[Path, list[str]]) -> None:
    with create_channel(typed[1][0]) as channel:
        info = pb_grpc.SamplingServiceStub(channel).GetClusterInfo(pb.ClusterInfoRequest(), timeout=30)
    graph = TypedGraph.from_info(info)
    plan = plan_caches(("fraction", 0.5), graph, None)
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
        plan = plan_caches(("bytes", budget), graph, pb.BFLOAT16)
        used = sum(sum(c) * row[t] for t, (c, _) in plan.items())
        assert used <= budget and all(w == pb.BFLOAT16 for _, w in plan.values())
    full = plan_caches(("bytes", 10**6), graph, pb.BFLOAT16)
    assert {t: sum(c) for t, (c, _) in full.items()} == {"paper": 30, "author": 20}


# ---- what the servers do with a plan ------------------------------------------------------


def _one_batch(address: str, request: pb.EpochRequest) -> dict[str, object]:
    with create_channel(address) as channel:
        stub = fastwire.MinibatchStreamStub(channel)
        assembler = BatchAssembler()
        for msg in stub.StreamMinibatches(request, timeout=30, acknowledge=last_chunk):
            batch = assembler.add(msg)
            if batch is not None:
                return dict(batch.data.items())
    raise AssertionError("no batch")


def test_a_client_without_a_plan_gets_the_full_x(plain: tuple[Path, list[str]]) -> None:
    _, addresses = plain
    request = pb.EpochRequest(split="train", fanouts=[5, 3], batch_size=64, world_size=1,
                              include_features=True, include_labels=True)
    old = _one_batch(addresses[0], request)
    assert "x_cached" not in old and old["x"].shape[0] == old["n_id"].numel()  # type: ignore[attr-defined]
    request.cache_counts.extend([20, 20, 20])
    new = _one_batch(addresses[0], request)
    mask = new["x_cached"]
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and bool(mask.any())
    assert new["x"].shape[0] == int((~mask).sum())  # type: ignore[attr-defined]
    assert torch.equal(new["x"], old["x"][~mask])  # type: ignore[index]


@pytest.mark.parametrize(("counts", "pattern"), [
    ([1, 2], r"EpochRequest.cache_counts: expected 3 entries"),
    ([1, -1, 0], r"EpochRequest.cache_counts\[1\]: expected 0 \.\. "),
    ([10**9, 0, 0], r"EpochRequest.cache_counts\[0\]: expected 0 \.\. "),
])
def test_a_bad_plan_is_invalid_argument_naming_the_field(plain: tuple[Path, list[str]],
                                                         counts: list[int], pattern: str) -> None:
    _, addresses = plain
    request = pb.EpochRequest(fanouts=[2], batch_size=8, world_size=1, include_features=True,
                              seeds=encode_tensor(np.arange(8, dtype=np.int64)))
    request.cache_counts.extend(counts)
    with create_channel(addresses[1]) as channel, pytest.raises(grpc.RpcError) as err:
        list(stream_minibatches(channel, request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() and re.search(pattern, err.value.details())


@pytest.mark.gpu
@pytest.mark.parametrize("cache_size", [0.3, "auto"])
def test_a_cuda_loader_assembles_every_type_on_the_gpu(kind: Kind, cache_size: object) -> None:
    """Each type's cache in GPU memory; the batches equal a CPU loader's without cache
    (the plain graph's dtypes and casts in detail: test_gpu_trainer.py)."""
    with Cluster(kind.addresses, connect_timeout=30) as cluster:
        cpu = kind.loader(cluster, cache_size=0, feature_dtype="bfloat16")
        gpu = kind.loader(cluster, cache_size=cache_size, feature_dtype="bfloat16", device="cuda")
        assert set(gpu.caches) == set(kind.featured)
        assert all(c.rows.device.type == "cuda" for c in gpu.caches.values())
        count = 0
        for a, b in zip(cpu, gpu, strict=True):
            for (t, sa), (_, sb) in zip(stores(a), stores(b), strict=True):
                assert torch.equal(sa.n_id, sb.n_id.cpu()), t
                if "x" in sa:
                    assert sb.x.device.type == "cuda" and torch.equal(_raw(sa.x), _raw(sb.x.cpu())), t
            count += 1
        assert count == len(cpu) > 0
        if cache_size == "auto":  # the test graphs fit: every row is cached
            assert gpu.last_stats.hit_rate == 1.0
