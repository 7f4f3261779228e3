"""The trainer-side hot-feature cache (trainer_client/cache.py, sampling_server/hot.py):
the plan, the fill, bit-identical batches with and without it, old clients, bad sizes.
Real servers on the ``small`` synthetic graph."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch
from test_loader import TIMEOUTS, real_servers

from partitioner.format import load_partition
from protos import fastwire
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.channel import ServerUnavailable, create_channel
from protos.codec import decode_tensor, encode_tensor
from sampling_server.hot import HOT_ORDER, PLAN_BITSETS, HotNodes, hot_order, visit_scores
from trainer_client.cache import CacheError, FeatureCache, parse_cache_size, plan_counts
from trainer_client.decode import BatchAssembler
from trainer_client.loader import Cluster, RemoteNeighborLoader

ARGS = {"num_neighbors": [5, 3], "batch_size": 96, "shuffle": True, "seed": 3, **TIMEOUTS}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    out = tmp_path_factory.mktemp("cache") / "small-3"
    with real_servers(out, num_parts=3) as addresses:
        yield out, addresses


def _raw(x: torch.Tensor) -> torch.Tensor:
    """The bits of a feature tensor, for bitwise comparison."""
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("batches", ["global", "partition"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_x_is_bit_identical_with_and_without_the_cache(servers: tuple[Path, list[str]], batches: str,
                                                       dtype: str) -> None:
    _, addresses = servers
    with Cluster(addresses, connect_timeout=30) as cluster:
        plain = RemoteNeighborLoader(cluster, "train", batches=batches, feature_dtype=dtype,
                                     cast_features=False, cache_size=0, **ARGS)
        cached = RemoteNeighborLoader(cluster, "train", batches=batches, feature_dtype=dtype,
                                      cast_features=False, cache_size=0.3, **ARGS)
        assert plain.cache is None and cached.cache is not None
        for epoch in range(2):
            plain.set_epoch(epoch)
            cached.set_epoch(epoch)
            count = rows = 0
            for a, b in zip(plain, cached, strict=True):
                assert torch.equal(a.n_id, b.n_id) and torch.equal(a.edge_index, b.edge_index)
                assert a.x.dtype == b.x.dtype == getattr(torch, dtype)
                assert torch.equal(_raw(a.x), _raw(b.x))
                assert torch.equal(a.y, b.y)
                count, rows = count + 1, rows + a.num_nodes
                # the counters cover the batches taken so far, not those prefetched
                for stats in (plain.last_stats, cached.last_stats):
                    assert (stats.batches, stats.rows) == (count, rows)
            assert count == len(plain) > 1
            assert 0 < cached.last_stats.hit_rate < 1 and plain.last_stats.hit_rate == 0
            assert cached.last_stats.bytes < plain.last_stats.bytes


def test_the_plan_is_the_same_on_every_party(servers: tuple[Path, list[str]]) -> None:
    out, addresses = servers
    with Cluster(addresses, connect_timeout=30) as cluster:
        assert {i.hot_order for i in cluster.infos} == {HOT_ORDER} == {"visits_v1"}
        for p, address in enumerate(cluster.addresses):
            part = load_partition(out, p)
            start = int(part.partition_book[p])
            expected = hot_order(part)
            score = visit_scores(part.indptr, part.indices, start, part.splits["train"])
            assert (np.diff(score[expected - start]) <= 0).all()  # hottest first
            with create_channel(address) as channel:
                stub = pb_grpc.SamplingServiceStub(channel)
                blocks = list(stub.StreamHotNodes(pb.HotNodesRequest(count=expected.size), timeout=30))
            got = np.concatenate([decode_tensor(m.n_id) for m in blocks])
            np.testing.assert_array_equal(got, expected)
        a = RemoteNeighborLoader(cluster, "train", cache_size=0.2, **ARGS)
        b = RemoteNeighborLoader(cluster, "val", cache_size=0.2, rank=1, world_size=2, **ARGS)
        assert a.cache is b.cache  # one plan, one fill
        book = cluster.partition_book
        assert a.cache is not None and list(a.cache.counts) == plan_counts(("fraction", 0.2), book, 16)
        assert sum(a.cache.counts) <= 0.2 * int(book[-1])


def test_the_cache_fills_once_per_job_not_per_epoch(servers: tuple[Path, list[str]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _, addresses = servers
    calls: list[int] = []
    fill = FeatureCache._fill_partition

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return fill(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(FeatureCache, "_fill_partition", counting)
    with Cluster(addresses, connect_timeout=30) as cluster:
        loaders = [RemoteNeighborLoader(cluster, split, cache_size="25%", **ARGS)
                   for split in ("train", "val", "train")]
        assert len(calls) == 3  # one StreamHotNodes per partition
        for epoch in range(3):
            for loader in loaders:
                loader.set_epoch(epoch)
                assert sum(1 for _ in loader) == len(loader)
        assert len(calls) == 3


def test_the_partitions_fill_at_once(servers: tuple[Path, list[str]],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _, addresses = servers
    fill = FeatureCache._fill_partition
    running, most = [0], [0]
    lock = threading.Lock()

    def overlapping(*args: object, **kwargs: object) -> torch.Tensor:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.3)  # long enough for the other partitions' fills to start
            return fill(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(FeatureCache, "_fill_partition", overlapping)
    with Cluster(addresses, connect_timeout=30) as cluster:
        counts = plan_counts(("fraction", 0.3), cluster.partition_book.tolist(), 4)
        cache = FeatureCache.fill(cluster, counts, pb.FLOAT32, torch.device("cpu"))
        assert most[0] == 3 and cache.num_rows == sum(counts)
        x = load_partition(servers[0], 1).x
        assert x is not None
        held = torch.nonzero(cache.slot >= 0).flatten()
        own = held[(held >= int(cluster.partition_book[1])) & (held < int(cluster.partition_book[2]))]
        assert own.numel() == counts[1]
        assert torch.equal(cache.rows[cache.slot[own].long()],
                           torch.from_numpy(x[(own - int(cluster.partition_book[1])).numpy()]))


class _Stream:
    """A StreamHotNodes call that fails at once, or waits until it is cancelled."""

    def __init__(self, fail: bool) -> None:
        self.fail, self.cancelled, self.opened = fail, threading.Event(), False

    def open(self, request: object, timeout: float) -> _Stream:
        self.opened = True
        return self

    def __iter__(self) -> Iterator[object]:
        if self.fail:
            time.sleep(0.3)  # the other streams are open by then
            raise _Unavailable()
        if not self.cancelled.wait(20):
            raise AssertionError("the stream was not cancelled")
        raise _Unavailable("cancelled")

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


class _Unavailable(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    def __init__(self, details: str = "the server went away") -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


def _fake_cluster(streams: list[_Stream]) -> SimpleNamespace:
    """What a fill reads of a Cluster of 3 partitions of 10 nodes, one fake stream each."""
    return SimpleNamespace(partition_book=np.array([0, 10, 20, 30]),
                           info=SimpleNamespace(feature_dim=4, feature_dtype=pb.FLOAT32),
                           addresses=["a:1", "b:2", "c:3"], client_id="test",
                           stubs=[SimpleNamespace(StreamHotNodes=s.open) for s in streams],
                           expectation=lambda p: pb.ServerExpectation(partition_id=p))


def test_a_failed_partition_ends_the_whole_fill_at_once_naming_it() -> None:
    streams = [_Stream(fail=False), _Stream(fail=True), _Stream(fail=False)]
    cluster = _fake_cluster(streams)
    started = time.monotonic()
    with pytest.raises(ServerUnavailable, match=r"StreamHotNodes at b:2 failed: UNAVAILABLE: the server "
                                                r"went away \(the feature cache's fill of partition 1 was "
                                                r"retried for 1 s\)"):
        FeatureCache.fill(cluster, [5, 5, 5], pb.FLOAT32, torch.device("cpu"),  # type: ignore[arg-type]
                          progress=False, reconnect=1.0)
    assert time.monotonic() - started < 10
    assert all(s.opened and s.cancelled.is_set() for s in streams if not s.fail)


def test_a_partition_whose_stream_breaks_is_filled_again(servers: tuple[Path, list[str]],
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A server restarting during the fill (UNAVAILABLE after some blocks): that partition
    is streamed again from its first row; the cache equals an unbroken fill."""
    _, addresses = servers
    fill = FeatureCache._fill_partition
    broken: list[int] = []

    def breaks_once(cls: object, cluster: Cluster, p: int, k: int, *args: object) -> torch.Tensor:
        if p == 1 and not broken:
            broken.append(p)
            args[-2](k // 2)  # type: ignore[operator]  # progress: half the rows came
            raise ServerUnavailable("StreamHotNodes at b failed: UNAVAILABLE: restarting")
        return fill(cluster, p, k, *args)  # type: ignore[arg-type]

    with Cluster(addresses, connect_timeout=30) as cluster:
        counts = plan_counts(("fraction", 0.3), cluster.partition_book.tolist(), 4)
        whole = FeatureCache.fill(cluster, counts, pb.FLOAT32, torch.device("cpu"), progress=False)
        monkeypatch.setattr(FeatureCache, "_fill_partition", classmethod(breaks_once))
        again = FeatureCache.fill(cluster, counts, pb.FLOAT32, torch.device("cpu"), progress=False)
    assert broken == [1]
    assert torch.equal(again.rows, whole.rows) and torch.equal(again.slot, whole.slot)
    assert "partition 1's stream broke after" in caplog.text and "filling it again" in caplog.text


def test_an_interrupted_fill_ends_its_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer_client import cache as cache_module

    streams = [_Stream(fail=False) for _ in range(3)]
    cluster = _fake_cluster(streams)

    def interrupted(*args: object, **kwargs: object) -> None:
        time.sleep(0.3)  # the streams are open by then
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_module, "wait", interrupted)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        FeatureCache.fill(cluster, [5, 5, 5], pb.FLOAT32, torch.device("cpu"),  # type: ignore[arg-type]
                          progress=False)
    assert time.monotonic() - started < 10
    assert all(s.opened and s.cancelled.is_set() for s in streams)


def test_hot_nodes_are_hit_more_often_than_their_share(servers: tuple[Path, list[str]]) -> None:
    _, addresses = servers
    with Cluster(addresses, connect_timeout=30) as cluster:
        loader = RemoteNeighborLoader(cluster, "train", cache_size=0.2, **ARGS)
        assert loader.cache is not None
        share = loader.cache.num_rows / int(cluster.info.num_nodes)
        list(loader)
        stats = loader.last_stats
        assert stats.rows > 0 and stats.cached_rows > 0
        assert share < stats.hit_rate < 1.0, (share, stats.hit_rate)


def _one_batch(address: str, request: pb.EpochRequest) -> dict[str, object]:
    with create_channel(address) as channel:
        stub = fastwire.MinibatchStreamStub(channel)
        assembler = BatchAssembler()
        for msg in stub.StreamMinibatches(request, timeout=30):
            batch = assembler.add(msg)
            if batch is not None:
                return dict(batch.data.items())
    raise AssertionError("no batch")


def test_a_client_without_a_plan_gets_the_full_x(servers: tuple[Path, list[str]]) -> None:
    _, addresses = servers
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
def test_a_bad_plan_is_invalid_argument_naming_the_field(servers: tuple[Path, list[str]],
                                                         counts: list[int], pattern: str) -> None:
    _, addresses = servers
    request = pb.EpochRequest(fanouts=[2], batch_size=8, world_size=1, include_features=True,
                              seeds=encode_tensor(np.arange(8, dtype=np.int64)))
    request.cache_counts.extend(counts)
    with create_channel(addresses[1]) as channel, pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.SamplingServiceStub(channel).StreamMinibatches(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() and __import__("re").search(pattern, err.value.details())


@pytest.mark.parametrize("value", [-0.1, 1.5, "lots", True, "2XB", "120%", float("nan"), [0.1]])
def test_bad_cache_sizes_are_refused_naming_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"^cache_size: expected 'auto', a fraction of the nodes"):
        parse_cache_size(value)


def test_cache_sizes_parse_and_split_across_partitions() -> None:
    assert parse_cache_size(0.2) == ("fraction", 0.2)
    assert parse_cache_size("20%") == ("fraction", 0.2)
    assert parse_cache_size("2GiB") == ("bytes", 2.0 * 2**30)
    assert parse_cache_size("1.5 MB") == ("bytes", 1.5e6)
    assert parse_cache_size("auto") == parse_cache_size(" AUTO ") == ("auto", 0.0)
    book = [0, 100, 300, 600]
    assert plan_counts(("fraction", 0.1), book, 8) == [10, 20, 30]
    assert plan_counts(("bytes", 80 * 60), book, 80) == [10, 20, 30]
    assert plan_counts(("fraction", 0.0), book, 8) == [0, 0, 0]
    assert plan_counts(("bytes", 10**12), book, 8) == [100, 200, 300]


def test_auto_takes_a_quarter_of_a_gpus_free_memory_and_nothing_on_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer_client.cache import AUTO_FREE_FRACTION, auto_cache_bytes

    assert AUTO_FREE_FRACTION == 0.25
    assert auto_cache_bytes(torch.device("cpu"), 1000) == 0
    asked: list[torch.device] = []

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        asked.append(device)
        return 8 * 2**30, 80 * 2**30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    gpu = torch.device("cuda:1")
    assert auto_cache_bytes(gpu, 1000) == 2 * 2**30 - 4000  # the rows, after a 4-byte index per node
    assert asked == [gpu]
    assert auto_cache_bytes(gpu, 2**30) == 0  # the index alone takes the budget
    with pytest.raises(ValueError, match="cache_size: expected a fraction or bytes here"):
        plan_counts(("auto", 0.0), [0, 10], 8)


def test_an_auto_cache_is_planned_once_per_device_and_shared(
        servers: tuple[Path, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer_client import cluster as cluster_module

    _, addresses = servers
    budgets = [40_000, 10_000, 5_000]  # free memory shrinks once the first cache is filled

    def measured(device: torch.device, num_nodes: int) -> int:
        return budgets.pop(0)

    with Cluster(addresses, connect_timeout=30) as cluster:
        assert RemoteNeighborLoader(cluster, "train", **ARGS).cache is None  # auto on a CPU: none
        monkeypatch.setattr(cluster_module, "auto_cache_bytes", measured)
        other = Cluster(addresses, connect_timeout=30)
        loaders = [RemoteNeighborLoader(other, split, cache_size="auto", **ARGS)
                   for split in ("train", "val", "test")]
        first = loaders[0].cache
        assert first is not None and all(loader.cache is first for loader in loaders)
        row_bytes = int(other.info.feature_dim) * first.rows.element_size()
        assert list(first.counts) == plan_counts(("bytes", 40_000), other.partition_book.tolist(),
                                                 row_bytes)
        assert budgets == [10_000, 5_000]  # measured once
        assert sum(1 for _ in loaders[0]) == len(loaders[0]) and loaders[0].last_stats.hit_rate > 0
        other.close()


def test_the_train_cli_takes_a_cache_size_and_refuses_a_bad_one(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer_client.train import build_parser

    parser = build_parser()
    assert parser.parse_args(["--servers", "h:1"]).cache_size is None
    assert parser.parse_args(["--servers", "h:1", "--cache-size", "2GiB"]).cache_size == "2GiB"
    with pytest.raises(SystemExit):
        parser.parse_args(["--servers", "h:1", "--cache-size", "lots"])
    assert "--cache-size: expected 'auto', a fraction" in capsys.readouterr().err


def test_servers_without_a_hot_order_get_no_plan(servers: tuple[Path, list[str]],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    _, addresses = servers
    with Cluster(addresses, connect_timeout=30) as cluster:
        for info in cluster.infos:
            info.hot_order = ""  # as a server from before the cache answers
        loader = RemoteNeighborLoader(cluster, "train", cache_size=0.2, **ARGS)
        assert loader.cache is None
        assert "running without the feature cache" in caplog.text
        assert list(loader._request().cache_counts) == []
        assert sum(1 for _ in loader) == len(loader) and loader.last_stats.hit_rate == 0


def test_a_batch_that_disagrees_with_the_cache_is_refused() -> None:
    rows = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    slot = torch.tensor([-1, 0, -1, 1, 2, -1])
    cache = FeatureCache([1, 2], rows, slot, pb.FLOAT32)
    n_id = torch.tensor([3, 0, 4, 5])
    cached = torch.tensor([True, False, True, False])
    x_missing = torch.full((2, 4), -1.0)
    x = cache.assemble(x_missing, cached, n_id)
    assert torch.equal(x, torch.stack([rows[1], x_missing[0], rows[2], x_missing[1]]))
    with pytest.raises(CacheError, match=r"tensor 'x_cached': marks 1 nodes this cache does not hold"):
        cache.assemble(x_missing[:1], torch.tensor([True, False, True, True]), n_id)
    with pytest.raises(CacheError, match=r"tensor 'x': expected torch.float32 with 2 rows"):
        cache.assemble(x_missing[:1], cached, n_id)
    with pytest.raises(CacheError, match=r"tensor 'n_id': expected node IDs in 0 .. 5, got values in 0 .. 9"):
        cache.assemble(x_missing, cached, torch.tensor([3, 0, 4, 9]))
    with pytest.raises(CacheError, match=r"tensor 'x': expected 4 columns, got shape \[2, 3\]"):
        cache.assemble(x_missing[:, :3], cached, n_id)
    with pytest.raises(CacheError, match=r"tensor 'x_cached': expected 3 entries"):
        cache.assemble(x_missing, cached, n_id[:3])


@pytest.mark.parametrize(("wire", "out"), [(torch.float32, None), (torch.bfloat16, None),
                                           (torch.bfloat16, torch.float32),
                                           (torch.float16, torch.float32),
                                           (torch.float64, None)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cpu_assembly_equals_indexing_then_casting_bit_for_bit(wire: torch.dtype,
                                                               out: torch.dtype | None,
                                                               slot_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    # more nodes per batch than the kernel's prefetch distances, some of them repeated
    num_nodes, k, width = 500, 200, 7
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3e38])
    rows = torch.cat([special.repeat(width, 1).T[:, :width],
                      torch.randn((k - special.numel(), width), generator=gen) * 1e3]).to(wire)
    hot = torch.randperm(num_nodes, generator=gen)[:k]
    slot = torch.full((num_nodes,), -1, dtype=slot_dtype)
    slot[hot] = torch.arange(k, dtype=slot_dtype)
    cache = FeatureCache([k], rows, slot, pb.FLOAT32)
    n_id = torch.randint(0, num_nodes, (400,), generator=gen)
    cached = slot[n_id] >= 0
    x_missing = (torch.randn((int((~cached).sum()), width), generator=gen) * 7).to(wire)
    want = torch.empty((n_id.numel(), width), dtype=wire)
    want[cached] = rows[slot[n_id[cached]].long()]
    want[~cached] = x_missing
    want = want.to(out or wire)
    got = cache.assemble(x_missing, cached, n_id, out)
    assert got.dtype == want.dtype and got.shape == want.shape
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
    assert torch.equal(got.view(bits), want.view(bits))
    # every node cached, and none
    assert torch.equal(cache.assemble(rows[:0], torch.ones(k, dtype=torch.bool), hot, out)
                       .view(bits), rows.to(out or wire).view(bits))
    assert torch.equal(cache.assemble(x_missing, torch.zeros(len(x_missing), dtype=torch.bool),
                                      n_id[:len(x_missing)], out).view(bits),
                       x_missing.to(out or wire).view(bits))


def test_cast_features_are_bit_identical_with_and_without_the_cache(
        servers: tuple[Path, list[str]]) -> None:
    # bfloat16 on the wire, float32 in the batch: the cache widens its rows as it
    # assembles x, the plain loader casts the received x; the same bits either way
    _, addresses = servers
    with Cluster(addresses, connect_timeout=30) as cluster:
        plain = RemoteNeighborLoader(cluster, "train", feature_dtype="bfloat16", cache_size=0,
                                     **ARGS)
        cached = RemoteNeighborLoader(cluster, "train", feature_dtype="bfloat16",
                                      cache_size=0.3, **ARGS)
        count = 0
        for a, b in zip(plain, cached, strict=True):
            assert a.x.dtype == b.x.dtype == torch.float32
            assert torch.equal(_raw(a.x), _raw(b.x))
            count += 1
        assert count == len(plain) > 1 and cached.last_stats.hit_rate > 0


def test_the_servers_plan_mask_equals_the_rank_rule() -> None:
    """A node is cached under plan ``counts`` iff its position in its partition's hot order
    is below ``counts[owner]``; the server's bitset gives exactly that, for several plans
    at once, keeps only the plans used last, and names an ID outside the graph."""
    rng = np.random.default_rng(4)
    book = np.array([0, 70, 71, 200, 333])  # a one-node partition among them
    orders = {p: rng.permutation(np.arange(book[p], book[p + 1])) for p in range(book.size - 1)}
    store = SimpleNamespace(partition_book=book, partition_id=0)  # what HotNodes reads of it
    hot = HotNodes(store, lambda: None)  # type: ignore[arg-type]
    hot._own_order = orders[0]
    hot._orders = {p: o for p, o in orders.items() if p}
    rank = np.empty(int(book[-1]), dtype=np.int64)
    for order in orders.values():
        rank[order] = np.arange(order.size)
    owner = np.searchsorted(book, np.arange(book[-1]), side="right") - 1
    n_id = torch.from_numpy(rng.integers(0, book[-1], 2000))
    plans = [(0, 0, 0, 0), (70, 1, 129, 133), (5, 0, 64, 1), (1, 1, 1, 1)] + \
        [tuple(int(rng.integers(0, s + 1)) for s in np.diff(book)) for _ in range(PLAN_BITSETS)]
    for counts in plans + plans[:2]:
        want = rank[n_id.numpy()] < np.asarray(counts)[owner[n_id.numpy()]]
        got = hot.cached_mask(n_id, counts)
        assert got.dtype == torch.bool and np.array_equal(got.numpy(), want), counts
    assert len(hot._plans) == PLAN_BITSETS
    assert np.array_equal(hot.cached_mask(torch.tensor([], dtype=torch.int64), plans[1]).numpy(),
                          np.zeros(0, dtype=bool))
    with pytest.raises(ValueError, match=r"n_id: expected global node IDs in 0 .. 332, got 333 at"):
        hot.cached_mask(torch.tensor([4, 333]), plans[1])
