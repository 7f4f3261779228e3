"""Tests for trainer_client/stream.py and loader.py.

Most run against a fake SamplingService in this process (canned batches that follow the
epoch plan and honor ``resume_from``, with injected faults: a dropped stream, a stall,
a malformed batch, a rejected request, a server that starts late or dies). The last
ones run real sampling servers on the ``small`` synthetic graph in two partitions.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from test_decode import NUM_CLASSES, encode_batch, fake_batch

from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.channel import (
    FailedPrecondition,
    InvalidRequest,
    ProtocolError,
    ServerUnavailable,
    server_options,
)
from protos.codec import decode_tensor, encode_tensor
from protos.plan import EPOCH_START, EpochProgress, plan_epoch, plan_global_epoch, shuffled_seeds
from protos.ports import reserved_ports
from trainer_client.loader import Cluster, RemoteNeighborLoader

FEATURE_DIM = 4
NODES_PER_PART = 100
# Timeouts for tests that do not test them: long enough that a loaded 2-core CI host
# never trips them (the fault tests set their own short ones).
TIMEOUTS = {"connect_timeout": 20.0, "stall_timeout": 15.0, "reconnect_timeout": 30.0}


# ---- a fake sampling service ---------------------------------------------------------------


@dataclass
class Faults:
    """Faults a fake server injects (each once)."""

    #: Drop the stream with UNAVAILABLE in the middle of its k-th batch (0-based).
    drop_at: int | None = None
    #: Stop sending for ``stall_seconds`` before its k-th batch.
    stall_at: int | None = None
    stall_seconds: float = 30.0
    #: Send a malformed k-th batch.
    malformed_at: int | None = None
    #: Seconds to wait before every batch.
    delay: float = 0.0
    #: Answer GetClusterInfo with UNAVAILABLE until this time.monotonic() (still loading).
    loading_until: float = 0.0
    fired: set[str] = field(default_factory=set)

    def once(self, name: str, k: int, at: int | None) -> bool:
        if at is None or k != at or name in self.fired:
            return False
        self.fired.add(name)
        return True


class FakeSampling(pb_grpc.SamplingServiceServicer):
    """Partition ``partition`` of a graph of ``len(splits)`` partitions of 100 nodes each;
    partition p's train/val/test seeds are its first nodes, in that order."""

    def __init__(self, splits: list[tuple[int, int, int]], partition: int, faults: Faults | None = None,
                 graph_name: str = "fake", chunk_bytes: int = 96) -> None:
        self.splits, self.partition, self.faults = splits, partition, faults or Faults()
        self.graph_name, self.chunk_bytes = graph_name, chunk_bytes
        self.peers: list[str] = []
        self.requests: list[pb.EpochRequest] = []
        self.book = [NODES_PER_PART * p for p in range(len(splits) + 1)]

    def info(self) -> pb.ClusterInfo:
        return pb.ClusterInfo(
            format_version=1, graph_name=self.graph_name, num_nodes=self.book[-1], num_edges=1000,
            partition_book=self.book, partition_id=self.partition, num_partitions=len(self.splits),
            feature_dim=FEATURE_DIM, feature_dtype=pb.FLOAT32, num_classes=NUM_CLASSES,
            split_sizes=[pb.SplitSizes(train=a, val=b, test=c) for a, b, c in self.splits],
            peer_addresses=self.peers, server_version="fake", device="cpu", label_dtype=pb.INT64,
        )

    def GetClusterInfo(
        self, request: pb.ClusterInfoRequest, context: grpc.ServicerContext
    ) -> pb.ClusterInfo:
        if time.monotonic() < self.faults.loading_until:
            context.abort(grpc.StatusCode.UNAVAILABLE, "partition 0 is still loading")
        return self.info()

    def seeds(self, split: str, partition: int) -> np.ndarray:
        """Global IDs of ``split`` owned by ``partition``."""
        sizes = self.splits[partition]
        start = self.book[partition] + sum(sizes[: ("train", "val", "test").index(split)])
        return np.arange(start, start + sizes[("train", "val", "test").index(split)])

    def LookupNodes(
        self, request: pb.LookupNodesRequest, context: grpc.ServicerContext
    ) -> pb.LookupNodesReply:
        """Original IDs are the global IDs here."""
        if request.WhichOneof("query") == "split":
            nodes = self.seeds(request.split, self.partition)
            return pb.LookupNodesReply(global_ids=encode_tensor(nodes), original_ids=encode_tensor(nodes))
        ids = decode_tensor(request.original_ids)
        owned = (ids >= self.book[self.partition]) & (ids < self.book[self.partition + 1])
        return pb.LookupNodesReply(global_ids=encode_tensor(np.where(owned, ids, -1).astype(np.int64)))

    def StreamMinibatches(
        self, requests: Iterator[pb.StreamMinibatchesRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.MinibatchChunk]:
        request = next(requests).epoch  # the acknowledgements after it are not read here
        self.requests.append(request)
        if request.batch_size == 13:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "EpochRequest.batch_size: expected anything but 13")
        if request.global_batches:
            yield from self._global_batches(request, context)
            return
        if request.WhichOneof("seeds_source") == "split":
            counts = [len(self.seeds(request.split, p)) for p in range(len(self.splits))]
            mine = self.seeds(request.split, self.partition)
        else:
            seeds = decode_tensor(request.seeds)
            owner = np.searchsorted(self.book, seeds, side="right") - 1
            counts = np.bincount(owner, minlength=len(self.splits)).tolist()
            mine = seeds[owner == self.partition]
        plan = plan_epoch(counts, request.batch_size, request.world_size, shuffle=request.shuffle,
                          seed=request.seed, epoch=request.epoch, drop_last=request.drop_last)
        mine = shuffled_seeds(mine, shuffle=request.shuffle, seed=request.seed, epoch=request.epoch,
                              partition=self.partition)
        refs = [b for b in plan.rank_batches(request.rank)
                if b.partition == self.partition and b.index >= request.resume_from]
        for k, ref in enumerate(refs):
            yield from self._batch(k, ref.index, plan.seeds_of(self.partition, ref.part_batch, mine),
                                   plan.batches_per_rank, len(request.fanouts), context)

    def _global_batches(self, request: pb.EpochRequest,
                        context: grpc.ServicerContext) -> Iterator[pb.MinibatchChunk]:
        seeds = decode_tensor(request.seeds)
        plan = plan_global_epoch(seeds.size, request.batch_size, request.world_size, len(self.splits),
                                 shuffle=request.shuffle, seed=request.seed, epoch=request.epoch,
                                 drop_last=request.drop_last)
        refs = [b for b in plan.rank_batches(request.rank)
                if b.partition == self.partition and b.index >= request.resume_from]
        for k, ref in enumerate(refs):
            yield from self._batch(k, ref.index, seeds[plan.positions(ref.part_batch)],
                                   plan.batches_per_rank, len(request.fanouts), context)

    def _batch(self, k: int, index: int, seeds: np.ndarray, num_batches: int, hops: int,
               context: grpc.ServicerContext) -> Iterator[pb.MinibatchChunk]:
        f = self.faults
        time.sleep(f.delay)
        if f.once("stall", k, f.stall_at):
            end = time.monotonic() + f.stall_seconds
            while context.is_active() and time.monotonic() < end:
                time.sleep(0.02)
        messages = encode_batch(index, fake_batch(seeds, num_hops=hops), num_batches=num_batches,
                                chunk_bytes=self.chunk_bytes)
        if f.once("malformed", k, f.malformed_at):
            messages[0].header.num_sampled_nodes[0] += 1
        if f.once("drop", k, f.drop_at):
            yield messages[0]
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected: connection dropped")
        yield from messages


class FakeCluster:
    """Fake servers on 127.0.0.1, one per partition."""

    def __init__(self, splits: list[tuple[int, int, int]], faults: dict[int, Faults] | None = None,
                 ports: list[int] | None = None, graph_name: str = "fake") -> None:
        faults = faults or {}
        self.servicers = [FakeSampling(splits, p, faults.get(p), graph_name) for p in range(len(splits))]
        self.servers: list[grpc.Server] = []
        self.addresses: list[str] = []
        for p, servicer in enumerate(self.servicers):
            server = grpc.server(ThreadPoolExecutor(8), options=server_options())
            pb_grpc.add_SamplingServiceServicer_to_server(servicer, server)
            port = server.add_insecure_port(f"127.0.0.1:{ports[p] if ports else 0}")
            self.servers.append(server)
            self.addresses.append(f"127.0.0.1:{port}")
        for servicer in self.servicers:
            servicer.peers = list(self.addresses)
        for server in self.servers:
            server.start()

    def stop(self) -> None:
        for server in self.servers:
            server.stop(0).wait(5)


@contextlib.contextmanager
def fake_cluster(splits: list[tuple[int, int, int]], **kwargs: object) -> Iterator[FakeCluster]:
    cluster = FakeCluster(splits, **kwargs)  # type: ignore[arg-type]
    try:
        yield cluster
    finally:
        cluster.stop()


def seeds_of(batch: object) -> list[int]:
    return batch.n_id[: batch.batch_size].tolist()  # type: ignore[attr-defined]


def expected_batches(splits: list[tuple[int, int, int]], loader: RemoteNeighborLoader) -> list[list[int]]:
    """The seeds of each of the loader's batches, by the plan (what the servers send)."""
    fake = FakeSampling(splits, 0)
    if loader.batches == "global":
        train = np.concatenate([fake.seeds("train", p) for p in range(len(splits))])
        glob = plan_global_epoch(train.size, loader.batch_size, loader.world_size, len(splits),
                                 shuffle=loader.shuffle, seed=loader.seed, epoch=loader.epoch,
                                 drop_last=loader.drop_last)
        return [train[glob.positions(ref.part_batch)].tolist() for ref in glob.rank_batches(loader.rank)]
    counts = [len(fake.seeds("train", p)) for p in range(len(splits))]
    plan = plan_epoch(counts, loader.batch_size, loader.world_size, shuffle=loader.shuffle,
                      seed=loader.seed, epoch=loader.epoch, drop_last=loader.drop_last)
    out = []
    for ref in plan.rank_batches(loader.rank):
        mine = shuffled_seeds(fake.seeds("train", ref.partition), shuffle=loader.shuffle, seed=loader.seed,
                              epoch=loader.epoch, partition=ref.partition)
        out.append(plan.seeds_of(ref.partition, ref.part_batch, mine).tolist())
    return out


UNEVEN = [(7, 2, 2), (3, 1, 1), (11, 3, 0)]


# ---- order, lengths, coverage --------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [1, 4])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("batches", ["global", "partition"])
def test_batches_arrive_in_plan_order_and_cover_every_seed_once(prefetch: int, shuffle: bool,
                                                                batches: str) -> None:
    with fake_cluster(UNEVEN) as cluster:
        loaders = [RemoteNeighborLoader(cluster.addresses[::-1], "train", num_neighbors=[2, 2], batch_size=2,
                                        shuffle=shuffle, rank=r, world_size=3, prefetch=prefetch,
                                        batches=batches, **TIMEOUTS)
                   for r in range(3)]
        seen: list[int] = []
        for loader in loaders:
            loader.set_epoch(1)
            batches = list(loader)
            assert len(batches) == len(loader) == len(loaders[0])
            assert [seeds_of(b) for b in batches] == expected_batches(UNEVEN, loader)
            for b in batches:
                assert loader.input_nodes[b.input_id].tolist() == seeds_of(b)
                assert b.x.dtype == torch.float32 and b.x.shape == (b.num_nodes, FEATURE_DIM)
                assert torch.equal(b.y, b.n_id % NUM_CLASSES)
                seen += seeds_of(b)
            assert loader.last_stats.batches == len(loader) and loader.last_stats.resumes == 0
            loader.close()
    train = [s for p in range(3) for s in FakeSampling(UNEVEN, 0).seeds("train", p).tolist()]
    assert sorted(seen) == sorted(train)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_len_is_equal_on_every_rank_for_uneven_seeds(drop_last: bool, world_size: int) -> None:
    with fake_cluster(UNEVEN) as cluster:
        lengths = []
        for rank in range(world_size):
            with RemoteNeighborLoader(cluster.addresses, "train", num_neighbors=[1], batch_size=3,
                                      drop_last=drop_last, rank=rank, world_size=world_size,
                                      **TIMEOUTS) as loader:
                lengths.append((len(loader), sum(1 for _ in loader)))
        assert len(set(lengths)) == 1 and lengths[0][0] == lengths[0][1] > 0


def test_explicit_seeds_are_each_sampled_once() -> None:
    seeds = np.array([250, 3, 120, 7, 205, 150, 42])
    with fake_cluster(UNEVEN) as cluster:
        got: list[int] = []
        for rank in range(2):
            with RemoteNeighborLoader(cluster.addresses, seeds=torch.from_numpy(seeds), num_neighbors=[1],
                                      batch_size=2, rank=rank, world_size=2, **TIMEOUTS) as loader:
                assert loader.seeds_per_partition == [3, 2, 2]
                got += [s for b in loader for s in seeds_of(b)]
        assert sorted(got) == sorted(seeds.tolist())


def test_breaking_off_an_epoch_stops_the_reader_threads() -> None:
    with fake_cluster(UNEVEN) as cluster, RemoteNeighborLoader(
            cluster.addresses, "train", num_neighbors=[1], batch_size=1, **TIMEOUTS) as loader:
        it = iter(loader)
        next(it)
        it.close()  # what a `break` does once the generator is collected
        gc.collect()
        # the process's shared decode threads (protos.codec) serve every stream and stay
        assert not [t for t in threading.enumerate() if t.name.startswith("graphfeed-")
                    and not t.name.startswith("graphfeed-decode")]


def test_cpu_batches_are_completed_in_the_reader_threads_and_their_errors_reach_the_consumer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU device the reader threads complete each batch (so the work overlaps the
    consumer's step); the batches are those of the consumer's own completion, and an
    error raised while completing one is raised to the consumer, after which the
    readers stop."""
    completed_in: list[str] = []
    fail = {"at": 0}  # the call (1, 2, ...) that raises; 0: none
    original = RemoteNeighborLoader._finish

    def recording(self: RemoteNeighborLoader, *args: Any) -> Any:
        completed_in.append(threading.current_thread().name)
        if len(completed_in) == fail["at"]:
            raise ProtocolError("completing batch: broken on purpose")
        return original(self, *args)

    monkeypatch.setattr(RemoteNeighborLoader, "_finish", recording)
    with fake_cluster(UNEVEN) as cluster:
        with RemoteNeighborLoader(cluster.addresses, "train", num_neighbors=[2], batch_size=2,
                                  **TIMEOUTS) as loader:
            batches = list(loader)
            assert len(batches) == len(loader) == len(completed_in)
            assert all(name.startswith("graphfeed-stream-p") for name in completed_in)
            assert [seeds_of(b) for b in batches] == expected_batches(UNEVEN, loader)
            assert all(b.x.dtype == torch.float32 and torch.equal(b.y, b.n_id % NUM_CLASSES)
                       for b in batches)
            assert loader.last_stats.rows == sum(b.num_nodes for b in batches)
            completed_in.clear()
            fail["at"] = 3
            with pytest.raises(ProtocolError, match="broken on purpose"):
                list(loader)
        gc.collect()
        assert not [t for t in threading.enumerate() if t.name.startswith("graphfeed-stream")]


# ---- failures ------------------------------------------------------------------------------


def test_a_dropped_stream_resumes_from_the_next_batch() -> None:
    with fake_cluster(UNEVEN, faults={2: Faults(drop_at=2)}) as cluster:
        loader = RemoteNeighborLoader(cluster.addresses, "train", num_neighbors=[2], batch_size=2, **TIMEOUTS)
        batches = [seeds_of(b) for b in loader]
        assert batches == expected_batches(UNEVEN, loader)
        owned = [b.index for b in loader.plan(0).rank_batches(0) if b.partition == 2]
        assert [r.resume_from for r in cluster.servicers[2].requests] == [0, owned[2]]
        assert loader.last_stats.resumes == 1
        loader.close()


def test_a_stalled_stream_is_cancelled_and_resumed() -> None:
    with fake_cluster(UNEVEN, faults={0: Faults(stall_at=1, stall_seconds=30)}) as cluster:
        loader = RemoteNeighborLoader(cluster.addresses, "train", num_neighbors=[2], batch_size=2,
                                      **{**TIMEOUTS, "stall_timeout": 0.5})
        started = time.monotonic()
        assert [seeds_of(b) for b in loader] == expected_batches(UNEVEN, loader)
        assert time.monotonic() - started < 10
        owned = [b.index for b in loader.plan(0).rank_batches(0) if b.partition == 0]
        assert [r.resume_from for r in cluster.servicers[0].requests] == [0, owned[1]]
        loader.close()


def test_a_server_killed_mid_epoch_raises_server_unavailable_in_bounded_time() -> None:
    splits = [(40, 0, 0), (40, 0, 0)]
    with fake_cluster(splits, faults={1: Faults(delay=0.1)}) as cluster:
        loader = RemoteNeighborLoader(cluster.addresses, "train", num_neighbors=[1], batch_size=2,
                                      **{**TIMEOUTS, "stall_timeout": 1.0, "reconnect_timeout": 1.5})
        it = iter(loader)
        next(it), next(it)
        cluster.servers[1].stop(0)
        started = time.monotonic()
        pattern = rf"server {cluster.addresses[1]} \(partition 1\): stream of rank 0, epoch 0 broke at batch"
        with pytest.raises(ServerUnavailable, match=pattern):
            for _ in it:
                pass
        assert time.monotonic() - started < 8
        loader.close()


def test_a_malformed_batch_raises_a_protocol_error_naming_the_server() -> None:
    with fake_cluster(UNEVEN, faults={1: Faults(malformed_at=0)}) as cluster:
        loader = RemoteNeighborLoader(cluster.addresses, "train", num_neighbors=[2], batch_size=2, **TIMEOUTS)
        with pytest.raises(ProtocolError, match=rf"at {cluster.addresses[1]}: malformed reply: batch \d+: "
                                                r"MinibatchHeader.num_sampled_nodes\[0\]"):
            list(loader)
        loader.close()


def test_a_rejected_request_is_raised_at_once_not_retried() -> None:
    with fake_cluster(UNEVEN) as cluster:
        loader = RemoteNeighborLoader(cluster.addresses, "train", num_neighbors=[2], batch_size=13,
                                      **TIMEOUTS)
        with pytest.raises(InvalidRequest, match=r"EpochRequest\.batch_size: expected anything but 13"):
            list(loader)
        assert sum(len(s.requests) for s in cluster.servicers) <= 3
        loader.close()


# ---- cluster checks and argument validation --------------------------------------------------


def test_missing_servers_are_found_through_peer_addresses() -> None:
    with fake_cluster(UNEVEN) as cluster, Cluster(cluster.addresses[1], connect_timeout=5) as found:
        assert found.addresses == cluster.addresses
        assert [s.train for s in found.info.split_sizes] == [7, 3, 11]


def test_servers_of_different_graphs_are_refused() -> None:
    pattern = r"ClusterInfo.graph_name: servers disagree: .* says 'fake', .* says 'other'"
    with fake_cluster(UNEVEN[:2]) as a, fake_cluster(UNEVEN[:2], graph_name="other") as b, \
            pytest.raises(ValueError, match=pattern):
        Cluster([a.addresses[0], b.addresses[1]], connect_timeout=5)


def test_a_partition_served_twice_is_refused() -> None:
    with fake_cluster(UNEVEN[:2]) as a, fake_cluster(UNEVEN[:2]) as b, \
            pytest.raises(ValueError, match=r"servers: partition 0 is served by both"):
        Cluster([a.addresses[0], b.addresses[0]], connect_timeout=5)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"servers": "nohost"}, r"servers: expected 'host:port' addresses, got 'nohost'"),
        ({"servers": ["a:1", "a:1"]}, r"servers: expected each address once"),
        ({"split": "dev"},
         r"split: expected one of \['train', 'val', 'test'\] \(or 'valid' for 'val'\), got 'dev'"),
        ({"split": "train", "seeds": [1]}, r"split, input_nodes: expected one of them"),
        ({"input_nodes": [1], "seeds": [1]}, r"input_nodes, seeds: expected one of them"),
        ({"input_nodes": []}, r"input_nodes: expected at least one node, got an empty array"),
        ({"batches": "local"}, r"batches: expected one of \['global', 'partition'\], got 'local'"),
        ({"num_neighbors": []}, r"num_neighbors: expected a non-empty list of integers"),
        ({"num_neighbors": [5, -2]},
         r"num_neighbors: expected fanouts >= -1 \(-1 = all neighbors\), got \[5, -2\]"),
        ({"batch_size": 0}, r"batch_size: expected an integer in 1 \.\. \d+, got 0"),
        ({"rank": 2, "world_size": 2}, r"rank: expected an integer in 0 \.\. 1, got 2"),
        ({"world_size": 0}, r"world_size: expected an integer >= 1, got 0"),
        ({"prefetch": 0}, r"prefetch: expected an integer >= 1, got 0"),
        ({"feature_dtype": "int8"}, r"feature_dtype: expected one of .*got 'int8'"),
        ({"device": "gpu7"}, r"device: expected a torch device such as 'cpu' or 'cuda:0', got 'gpu7'"),
        ({"stall_timeout": 0}, r"stall: expected seconds > 0, got 0"),
        ({"seeds": [[1, 2]]}, r"input_nodes: expected a 1-d array of node IDs or a boolean mask, got shape "
                               r"\[1, 2\]"),
        ({"seeds": [1.5]}, r"input_nodes: expected integer node IDs or a boolean mask, got dtype float64"),
    ],
)
def test_bad_arguments_are_refused_before_connecting(kwargs: dict[str, object], pattern: str) -> None:
    args: dict[str, object] = {"servers": "127.0.0.1:1", "num_neighbors": [2], "batch_size": 4, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        RemoteNeighborLoader(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"world_size": 30}, r"world_size: giving 30 ranks equal batch counts needs"),
        ({"seeds": [5, 300]}, r"input_nodes: expected node IDs in 0 \.\. 299, got \[300\]"),
        ({"seeds": [5, 6, 5]}, r"input_nodes: expected each node ID once, got 1 repeats \(e.g. 5\)"),
        ({"input_nodes": np.zeros(10, dtype=bool)},
         r"input_nodes: expected a boolean mask of 300 entries \(one per node\), got 10"),
        ({"input_nodes": np.zeros(300, dtype=bool)},
         r"input_nodes: expected a mask with at least one True entry, got none"),
        ({"split": "test", "world_size": 1, "batch_size": 1, "seeds": None},
         r"split: the graph has no 'test' nodes on any partition"),
        ({"weighted": True}, r"weighted: expected a graph with edge weights"),
    ],
)
def test_arguments_that_disagree_with_the_cluster_are_refused(
    kwargs: dict[str, object], pattern: str
) -> None:
    args: dict[str, object] = {"num_neighbors": [2], "batch_size": 4, **TIMEOUTS, **kwargs}
    splits = [(a, b, 0) for a, b, _ in UNEVEN]  # no test nodes anywhere
    with fake_cluster(splits) as cluster, pytest.raises(ValueError, match=pattern):
        RemoteNeighborLoader(cluster.addresses, **args)  # type: ignore[arg-type]


# ---- real servers --------------------------------------------------------------------------


class RealServers:
    """Real sampling servers on ``127.0.0.1``, one per partition of ``small``."""

    def __init__(self, out: Path, num_parts: int) -> None:
        from partitioner import partition_graph
        from partitioner.synthetic import generate

        if not (out / "manifest.json").exists():
            partition_graph(generate("small", progress=False), num_parts, out, method="range", progress=False)
        self.out = out
        # held until stop(): a server restarted on its address finds it free
        self._held = contextlib.ExitStack()
        self.addresses = [f"127.0.0.1:{p}" for p in self._held.enter_context(reserved_ports(num_parts))]
        self.servers = [self._start(p) for p in range(num_parts)]

    def _start(self, partition: int, out: Path | None = None) -> object:
        from sampling_server.config import ServerConfig
        from sampling_server.server import create_server

        config = ServerConfig(partition_dir=out or self.out, partition=partition,
                              listen=self.addresses[partition],
                              peers=tuple(self.addresses), device="cpu", health_interval=0.2)
        server = create_server(config)[0]
        server.start()
        return server

    def restart(self, partition: int, down_seconds: float, out: Path | None = None) -> None:
        """Kill the server of ``partition`` (cancelling its streams), start a new one later
        (on the partitions in ``out`` when given)."""
        self.servers[partition].stop(0).wait(10)  # type: ignore[attr-defined]
        time.sleep(down_seconds)
        self.servers[partition] = self._start(partition, out)

    def restart_all(self, down_seconds: float, out: Path | None = None) -> None:
        """Kill every server, then start them all again (on ``out`` when given)."""
        self._stop_servers()
        time.sleep(down_seconds)
        self.servers = [self._start(p, out) for p in range(len(self.servers))]

    def _stop_servers(self) -> None:
        for server in self.servers:
            server.stop(0).wait(10)  # type: ignore[attr-defined]

    def stop(self) -> None:
        """Stop every server and free their ports."""
        self._stop_servers()
        self._held.close()


@contextlib.contextmanager
def real_servers(out: Path, num_parts: int = 2) -> Iterator[list[str]]:
    """``small`` partitioned in ``num_parts`` under ``out``, one started server each."""
    cluster = RealServers(out, num_parts)
    try:
        yield cluster.addresses
    finally:
        cluster.stop()


def test_real_servers_give_every_train_seed_once_per_epoch_on_two_ranks(tmp_path: Path) -> None:
    pytest.importorskip("sampling_server.server")
    with real_servers(tmp_path / "small-2") as addresses:
        cluster = Cluster(addresses[::-1], connect_timeout=30)
        loaders = [RemoteNeighborLoader(cluster, "train", num_neighbors=[5, 3], batch_size=128, shuffle=True,
                                        rank=r, world_size=2, feature_dtype="bfloat16", **TIMEOUTS)
                   for r in range(2)]
        num_train = loaders[0].num_seeds
        assert len(loaders[0]) == len(loaders[1])
        for epoch in range(2):
            seen: list[int] = []
            for loader in loaders:
                loader.set_epoch(epoch)
                count = 0
                for batch in loader:
                    count += 1
                    seen += seeds_of(batch)
                    assert batch.x.dtype == torch.float32 and batch.x.shape[1] == loader.num_features
                    assert batch.num_sampled_nodes[0] == batch.batch_size
                    assert batch.edge_index.shape[1] == sum(batch.num_sampled_edges)
                    assert int(batch.y[: batch.batch_size].min()) >= 0
                assert count == len(loader)
            assert len(seen) == len(set(seen)) == num_train
        cluster.close()


def _steps(loaders: list[RemoteNeighborLoader], epoch: int, start: EpochProgress,
           steps: int | None = None) -> list[list[Any]]:
    """Each rank's first ``steps`` batches (all: None) of ``epoch`` from ``start``."""
    out = []
    for loader in loaders:
        loader.set_epoch(epoch, start)
        out.append([batch for _, batch in zip(range(len(loader) if steps is None else steps), loader,
                                              strict=False)])
    return out


def test_real_servers_resume_an_epoch_part_way_on_any_world_size(tmp_path: Path) -> None:
    """Two steps of three ranks, then the rest of the epoch from their progress: on three
    ranks the unbroken run's batches bit for bit (keyed by their steps), on two ranks (or
    four) equal batches per rank, and every training seed once in the epoch either way."""
    pytest.importorskip("sampling_server.server")
    with real_servers(tmp_path / "small-2") as addresses, Cluster(addresses, connect_timeout=30) as cluster:
        def ranks(world: int) -> list[RemoteNeighborLoader]:
            return [RemoteNeighborLoader(cluster, "train", num_neighbors=[5, 3], batch_size=64, shuffle=True,
                                         rank=r, world_size=world, **TIMEOUTS) for r in range(world)]

        three = ranks(3)
        unbroken = _steps(three, 1, EPOCH_START)
        first = _steps(three, 1, EPOCH_START, 2)
        progress = three[0].progress_after(2)
        assert {loader.progress_after(2) for loader in three} == {progress}
        trained = [s for rank in first for b in rank for s in seeds_of(b)]
        assert progress == EpochProgress(2, len(trained))
        for resumed, whole in zip(_steps(three, 1, progress), unbroken, strict=True):
            assert len(resumed) == len(whole) - 2
            for a, b in zip(resumed, whole[2:], strict=True):
                assert torch.equal(a.n_id, b.n_id) and torch.equal(a.x, b.x)
                assert torch.equal(a.edge_index, b.edge_index)
        for world in (2, 4):
            rest = _steps(ranks(world), 1, progress)
            assert len({len(r) for r in rest}) == 1
            seen = trained + [s for r in rest for b in r for s in seeds_of(b)]
            assert sorted(seen) == sorted(three[0].input_nodes.tolist())


@pytest.mark.parametrize("cache_size", [0, 0.3])
def test_real_server_restart_mid_epoch_resumes_with_identical_batches(
    tmp_path: Path, cache_size: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also with the trainer's feature cache: the restarted server's batches mark the same
    cached rows, and x is bit-identical."""
    pytest.importorskip("sampling_server.server")
    from protos import channel as channel_module

    # A small receive window (no window growth): a server cannot send all its (small)
    # batches ahead of the reader, so its stream is still running when it is restarted.
    options = channel_module.channel_options
    monkeypatch.setattr(channel_module, "channel_options", lambda *a: [
        *options(*a), ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)])
    cluster = RealServers(tmp_path / "small-2", 2)
    try:
        loader = RemoteNeighborLoader(cluster.addresses, "train", num_neighbors=[5, 3], batch_size=100,
                                      shuffle=True, prefetch=1, cache_size=cache_size,
                                      **{**TIMEOUTS, "stall_timeout": 5.0, "reconnect_timeout": 20.0})
        assert (loader.cache is not None) == (cache_size > 0)
        unbroken = [(b.n_id.clone(), b.x.clone()) for b in loader]
        loader.set_epoch(0)  # the same epoch again (a new pass alone would move on to epoch 1)
        resumed = []
        for i, batch in enumerate(loader):
            resumed.append((batch.n_id.clone(), batch.x.clone()))
            if i == 2:
                cluster.restart(1, down_seconds=0.5)
        assert len(resumed) == len(unbroken) == len(loader)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                   for a, b in zip(resumed, unbroken, strict=True))
        assert loader.last_stats.resumes >= 1
        if cache_size:
            assert loader.last_stats.hit_rate > 0
        loader.close()
    finally:
        cluster.stop()


@pytest.mark.parametrize(("restarted", "cache_size"), [("every server", 0), ("every server", 0.3),
                                                      ("one server", 0)])
def test_servers_restarted_on_another_graph_mid_epoch_stop_the_epoch_naming_it(
    tmp_path: Path, restarted: str, cache_size: float
) -> None:
    """Batches of another graph never enter a running job. Every server restarted on
    another graph (so that they agree among themselves): each refuses the resume
    (FAILED_PRECONDITION naming EpochRequest.expect). One server restarted on it (a
    rolling upgrade under way): the others' peer calls to it are refused too
    (SampleNeighborsRequest/FetchNodeDataRequest.expect), so their streams end with
    FAILED_PRECONDITION instead of sampling from two graphs. The loader raises at once."""
    pytest.importorskip("sampling_server.server")
    from partitioner import partition_graph
    from partitioner.synthetic import generate

    other = tmp_path / "other-small-2"
    partition_graph(generate("small", seed=1, progress=False), 2, other, method="range",
                    progress=False)
    cluster = RealServers(tmp_path / "small-2", 2)
    try:
        loader = RemoteNeighborLoader(cluster.addresses, "train", num_neighbors=[5, 3],
                                      batch_size=50, prefetch=1, cache_size=cache_size,
                                      **{**TIMEOUTS, "reconnect_timeout": 20.0})
        every = restarted == "every server"
        message = (r"EpochRequest\.expect\.graph_fingerprint: expected '[0-9a-f]{12}\.\.\.' \(the "
                   r"graph this server holds now\), got '[0-9a-f]{12}\.\.\.'.*restarted with "
                   r"another graph"
                   if every else r"another graph")
        started = time.monotonic()
        with pytest.raises(FailedPrecondition, match=message):
            # the restart lands mid-epoch, or (the servers sent the whole epoch ahead) the
            # next epoch's first calls are refused
            for epoch in range(2):
                loader.set_epoch(epoch)
                for i, _ in enumerate(loader):
                    if epoch == 0 and i == 1:
                        if every:
                            cluster.restart_all(0.2, out=other)
                        else:
                            cluster.restart(0, 0.2, out=other)
        assert time.monotonic() - started < 20  # refused at once, not retried until reconnect
        loader.close()
    finally:
        cluster.stop()


# ---- the PyG user's mistakes -------------------------------------------------------------


@pytest.mark.parametrize(("name", "pattern"), [
    ("num_workers", r"num_workers: not supported by RemoteNeighborLoader \(sampling runs on the sampling "
                    r"servers; use prefetch="),
    ("transform", r"transform: not supported by RemoteNeighborLoader \(apply the transform"),
    ("time_attr", r"time_attr: not supported .*temporal sampling is not supported"),
    ("bogus", r"unexpected keyword argument 'bogus'"),
])
def test_neighbor_loader_keywords_without_meaning_here_say_what_to_use(name: str, pattern: str) -> None:
    with pytest.raises(TypeError, match=pattern):
        RemoteNeighborLoader("127.0.0.1:1", num_neighbors=[2], batch_size=4, **{name: 1})  # type: ignore[arg-type]


def test_valid_is_taken_for_val() -> None:
    with fake_cluster(UNEVEN) as cluster, RemoteNeighborLoader(
            cluster.addresses, "valid", num_neighbors=[1], batch_size=2, **TIMEOUTS) as loader:
        assert loader.split == "val" and loader.num_seeds == 6


def test_drop_last_that_empties_the_epoch_warns(caplog: pytest.LogCaptureFixture) -> None:
    with fake_cluster(UNEVEN) as cluster, RemoteNeighborLoader(
            cluster.addresses, "val", num_neighbors=[1], batch_size=4, drop_last=True, world_size=2,
            **TIMEOUTS) as loader:
        assert len(loader) == 0 and list(loader) == []
    assert "drop_last: the epoch has no batches: 6 seeds are fewer than batch_size=4 x world_size=2" \
        in caplog.text


def test_pin_memory_without_cuda_is_a_warning_not_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with fake_cluster(UNEVEN) as cluster, RemoteNeighborLoader(
            cluster.addresses, "train", num_neighbors=[1], batch_size=4, pin_memory=True,
            **TIMEOUTS) as loader:
        assert loader.pin_memory is False
        assert sum(len(seeds_of(b)) for b in loader) > 0
    assert "pin_memory=True: no CUDA device here" in caplog.text
