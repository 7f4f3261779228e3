"""The trainer-side hot-feature cache's parts, without servers (trainer_client/cache.py,
fills.py, sampling_server/hot.py): a plain graph's plan, the fill's failures, the sizes,
the rows' assembly and the servers' plan masks. With servers: test_feature_cache.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch

from protos import sampling_pb2 as pb
from protos.channel import ServerUnavailable
from sampling_server.hot import PLAN_BITSETS, HotNodes
from trainer_client import fills
from trainer_client.cache import CacheError, FeatureCache, parse_cache_size, plan_caches, plan_counts
from trainer_client.graph import TypedGraph

# ---- the plan -----------------------------------------------------------------------------


def _plain_graph(book: list[int], dim: int, dtype: int = pb.FLOAT32) -> TypedGraph:
    return TypedGraph(node_types=("_N",), edge_types=(("_N", "_E", "_N"),), target_type="_N",
                      num_nodes={"_N": book[-1]}, feature_dims={"_N": dim}, num_classes=2,
                      books={"_N": np.asarray(book)}, feature_dtypes={"_N": dtype}, typed=False)


@pytest.mark.parametrize("size", [("fraction", 0.1), ("fraction", 1.0), ("bytes", 80 * 60), ("bytes", 10**12),
                                  ("bytes", 0)])
def test_a_plain_graphs_plan_is_its_rows_split_by_partition_size(size: tuple[str, float]) -> None:
    book = [0, 100, 300, 600]
    plan = plan_caches(size, _plain_graph(book, 20), None)  # float32: 80 bytes a row
    assert plan == {"_N": (plan_counts(size, book, 80), pb.FLOAT32)}
    assert plan_caches(size, _plain_graph(book, 20), pb.BFLOAT16)["_N"] == \
        (plan_counts(size, book, 40), pb.BFLOAT16)


# ---- the fill's failures -----------------------------------------------------------------


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


def _fill(streams: list[_Stream], reconnect: float = 15.0) -> FeatureCache:
    """A fill of 5 rows of each of 3 partitions of 10 nodes, one fake stream each."""
    return fills.fill_feature_cache(lambda p, count, timeout: streams[p].open(None, timeout),
                                    ["a:1", "b:2", "c:3"], [5, 5, 5], np.array([0, 10, 20, 30]), 4,
                                    pb.FLOAT32, torch.device("cpu"), node_type="_N", progress=False,
                                    reconnect=reconnect)


def test_a_failed_partition_ends_the_whole_fill_at_once_naming_it() -> None:
    streams = [_Stream(fail=False), _Stream(fail=True), _Stream(fail=False)]
    started = time.monotonic()
    with pytest.raises(ServerUnavailable, match=r"StreamHotNodes at b:2 failed: UNAVAILABLE: the server "
                                                r"went away \(the feature cache's fill of partition 1 was "
                                                r"retried for 1 s\)"):
        _fill(streams, reconnect=1.0)
    assert time.monotonic() - started < 10
    assert all(s.opened and s.cancelled.is_set() for s in streams if not s.fail)


def test_an_interrupted_fill_ends_its_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    streams = [_Stream(fail=False) for _ in range(3)]

    def interrupted(*args: object, **kwargs: object) -> None:
        time.sleep(0.3)  # the streams are open by then
        raise KeyboardInterrupt

    monkeypatch.setattr(fills, "wait", interrupted)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        _fill(streams)
    assert time.monotonic() - started < 10
    assert all(s.opened and s.cancelled.is_set() for s in streams)


# ---- sizes and the rows' assembly -----------------------------------------------------------


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


def test_the_train_cli_takes_a_cache_size_and_refuses_a_bad_one(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer_client.train import build_parser

    parser = build_parser()
    assert parser.parse_args(["--servers", "h:1"]).cache_size is None
    assert parser.parse_args(["--servers", "h:1", "--cache-size", "2GiB"]).cache_size == "2GiB"
    with pytest.raises(SystemExit):
        parser.parse_args(["--servers", "h:1", "--cache-size", "lots"])
    assert "--cache-size: expected 'auto', a fraction" in capsys.readouterr().err


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


def test_the_servers_plan_mask_equals_the_rank_rule() -> None:
    """A node is cached under plan ``counts`` iff its position in its partition's hot order
    is below ``counts[owner]``; the server's bitset gives exactly that, for several plans
    at once, keeps only the plans used last, and names an ID outside the graph."""
    rng = np.random.default_rng(4)
    book = np.array([0, 70, 71, 200, 333])  # a one-node partition among them
    orders = {p: rng.permutation(np.arange(book[p], book[p + 1])) for p in range(book.size - 1)}
    # what HotNodes reads of its store (a plain graph's one type)
    store = SimpleNamespace(books={"_N": book}, partition_id=0, typed=False)
    hot = HotNodes(store, "_N", lambda: None)  # type: ignore[arg-type]
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


def test_a_server_keeps_only_the_hot_prefix_plans_ask_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another partition's hot order is read from its server once per longer prefix a
    plan needs, and only that prefix is kept (not 8 bytes per node of the graph)."""
    book = np.array([0, 100, 250, 400])
    orders = {p: np.arange(book[p], book[p + 1])[::-1].copy() for p in range(3)}
    store = SimpleNamespace(books={"_N": book}, partition_id=0, typed=False)
    hot = HotNodes(store, "_N", lambda: None)  # type: ignore[arg-type]
    hot._own_order = orders[0]
    reads: list[tuple[int, int]] = []

    def fetch(partition: int, count: int) -> np.ndarray:
        reads.append((partition, count))
        return orders[partition][:count]

    monkeypatch.setattr(hot, "_fetch_order", fetch)
    for counts in [(10, 15, 0), (10, 15, 15), (30, 5, 15), (0, 15, 150)]:
        hot.cached_mask(torch.arange(400), counts)
    assert reads == [(1, 15), (2, 15), (2, 150)]
    assert {p: o.size for p, o in hot._orders.items()} == {1: 15, 2: 150}
    np.testing.assert_array_equal(hot.prefix(2, 3), orders[2][:3])
    np.testing.assert_array_equal(hot.prefix(0, 4), orders[0][:4])
