"""Servers check that every peer serves the partition its --peers position says, of the
same graph, and stay NOT_SERVING with a plain sentence until it does."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from partitioner import partition_graph
from partitioner.synthetic import generate
from protos import sampling_pb2 as pb
from protos.epoch_call import stream_minibatches
from sampling_server.config import ServerConfig
from sampling_server.server import SamplingServer, create_server


def _parts(tmp_path_factory: pytest.TempPathFactory, name: str, seed: int) -> Path:
    root = tmp_path_factory.mktemp(name)
    partition_graph(generate("small", seed=seed, progress=False), 2, root, method="range",
                    progress=False, overwrite=True)
    return root


@pytest.fixture(scope="module")
def graph_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _parts(tmp_path_factory, "graph-a", 0)


@pytest.fixture(scope="module")
def graph_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _parts(tmp_path_factory, "graph-b", 1)


def _start(dirs: list[Path], order: list[int]) -> tuple[list[SamplingServer], list[str]]:
    """Servers of partitions 0 and 1 (from ``dirs[p]``); --peers lists them in ``order``."""
    built = [create_server(ServerConfig(partition_dir=d, partition=p, listen="127.0.0.1:0",
                                        device="cpu", peer_timeout=5.0, health_interval=0.3))
             for p, d in enumerate(dirs)]
    addresses = [f"127.0.0.1:{port}" for _, port in built]
    servers = [s for s, _ in built]
    for s in servers:
        s.set_peers([addresses[i] for i in order])
        s.start()
    assert all(s.wait_until_loaded(30) for s in servers)
    return servers, addresses


def _problem(server: SamplingServer, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.monitor is not None
        if server.monitor.problem:
            return server.monitor.problem
        time.sleep(0.1)
    raise AssertionError("no peer problem reported")


def _refusal(address: str) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        request = pb.EpochRequest(split="train", fanouts=[2], batch_size=10, world_size=1)
        with pytest.raises(grpc.RpcError) as info:
            list(stream_minibatches(channel, request, timeout=10))
    return info.value


def test_peers_listed_in_the_wrong_order_keep_the_servers_not_serving(graph_a: Path) -> None:
    servers, addresses = _start([graph_a, graph_a], order=[1, 0])
    try:
        problem = _problem(servers[0])
        assert "serves partition 0, but --peers lists it at position 1" in problem
        assert "partition order" in problem
        assert not servers[0].wait_until_serving(1.0)
        err = _refusal(addresses[0])
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "NOT_SERVING" in (err.details() or "") and "partition order" in (err.details() or "")
    finally:
        for s in servers:
            s.stop(None).wait(10)


def test_a_peer_serving_another_graph_keeps_the_servers_not_serving(
    graph_a: Path, graph_b: Path
) -> None:
    servers, _ = _start([graph_a, graph_b], order=[0, 1])
    try:
        for s in servers:
            problem = _problem(s)
            assert "serves another graph" in problem and "same partitioned graph" in problem
            assert not s.wait_until_serving(0.5)
    finally:
        for s in servers:
            s.stop(None).wait(10)


def test_the_right_peers_serve(graph_a: Path) -> None:
    servers, _ = _start([graph_a, graph_a], order=[0, 1])
    try:
        assert all(s.wait_until_serving(20) for s in servers)
        assert all(s.monitor is not None and s.monitor.problem is None for s in servers)
        assert servers[0].store.graph_fingerprint == servers[1].store.graph_fingerprint
    finally:
        for s in servers:
            s.stop(None).wait(10)
