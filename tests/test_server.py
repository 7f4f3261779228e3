"""The sampling server end to end: two in-process servers (each the other's peer) on
loopback ports serving the ``small`` synthetic graph in 2 partitions, spoken to with raw
gRPC stubs and the codec's TensorAssembler, as a trainer would."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from partitioner import partition_graph
from partitioner.format import PartitionFormatError, load_node_map, load_partition, read_manifest
from partitioner.graph import PLAIN_EDGE_TYPE, PLAIN_NODE_TYPE, GraphData
from partitioner.synthetic import generate_plain as generate
from protos import codec
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.assembler import TensorAssembler
from protos.channel import PeerError, create_channel, server_options
from protos.epoch_call import stream_minibatches
from sampling_server import cli
from sampling_server.config import ConfigError, ServerConfig, config_from_cluster
from sampling_server.errors import Stopping, abort_on_error
from sampling_server.health import PEER_SERVICE
from sampling_server.jobs import EpochJob, epoch_job
from sampling_server.peer_client import PeerClient
from sampling_server.pipeline import SamplingPipeline
from sampling_server.server import SamplingServer, create_server
from sampling_server.store import PartitionStore, colocated_servers

FANOUTS = [5, 3]
TIMEOUT = 30.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# -- fixtures -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph() -> GraphData:
    return generate("small", progress=False)


def _config(root: Path, partition: int, **kw: object) -> ServerConfig:
    # servers that ask their peers to sample and gather (the default, auto, would hold the
    # whole structure and every feature of these small graphs: the full_structure and
    # full_graph fixtures' servers)
    settings: dict[str, object] = {"listen": "127.0.0.1:0", "device": "cpu", "peer_timeout": 5.0,
                                   "health_interval": 0.5, "grace": 1.0, "structure": "partition",
                                   "features": "partition"}
    settings.update(kw)
    return ServerConfig(partition_dir=root, partition=partition, **settings)  # type: ignore[arg-type]


def _servers(root: Path, count: int = 2, **kw: object) -> tuple[list[SamplingServer], list[str]]:
    """``count`` bound servers (not started), one per partition, that know each other's
    addresses."""
    built = [create_server(_config(root, p, **kw)) for p in range(count)]
    addresses = [f"127.0.0.1:{port}" for _, port in built]
    servers = [s for s, _ in built]
    for s in servers:
        s.set_peers(addresses)
    return servers, addresses


def _stop(servers: list[SamplingServer]) -> None:
    for s in servers:
        s.stop(None).wait(10)


@pytest.fixture(scope="module")
def cluster(parts2: Path) -> Iterator[list[str]]:
    servers, addresses = _servers(parts2)
    for s in servers:
        s.start()
    assert all(s.wait_until_serving(20) for s in servers)
    yield addresses
    _stop(servers)


@pytest.fixture(scope="module")
def truth(graph: GraphData, parts2: Path) -> Truth:
    node_map = np.asarray(load_node_map(parts2))
    orig = np.empty_like(node_map)
    orig[node_map] = np.arange(node_map.size)
    src, dst = graph.edge_index
    return Truth(graph=graph, orig_of=orig, edges=set((src * graph.num_nodes + dst).tolist()),
                 book=np.asarray(read_manifest(parts2).partition_book[PLAIN_NODE_TYPE]))


@dataclass
class Truth:
    """The original graph, and global -> original IDs."""

    graph: GraphData
    orig_of: np.ndarray
    edges: set[int]
    book: np.ndarray

    def owner(self, ids: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.book, ids, side="right") - 1


@dataclass
class Batch:
    index: int
    header: pb.MinibatchHeader
    tensors: dict[str, np.ndarray]
    torch: dict[str, torch.Tensor]

    @property
    def seeds(self) -> np.ndarray:
        return self.tensors["n_id"][: self.header.num_seed_nodes]


# -- helpers --------------------------------------------------------------------------
def request(**kw: object) -> pb.EpochRequest:
    fields: dict[str, object] = {"split": "train", "fanouts": FANOUTS, "batch_size": 64,
                                 "world_size": 1, "rank": 0, "seed": 7, "shuffle": True,
                                 "include_features": True, "include_labels": True,
                                 "client_id": "test"}
    fields.update(kw)
    return pb.EpochRequest(**fields)  # type: ignore[arg-type]


def stream(address: str, req: pb.EpochRequest) -> list[Batch]:
    """One stream, reassembled; checks the chunk sequence of every batch."""
    channel = create_channel(address)
    batches: list[Batch] = []
    assembler = TensorAssembler()
    header, expect = None, 0
    try:
        for msg in stream_minibatches(channel, req, timeout=TIMEOUT):
            assert msg.chunk_index == expect and msg.num_chunks >= 1
            if msg.chunk_index == 0:
                assert msg.HasField("header")
                header = msg.header
            assembler.add_all(msg.tensors)
            expect += 1
            if expect == msg.num_chunks:
                names = {"n_id", "edge_index"} | ({"x"} if req.include_features else set()) \
                    | ({"y"} if req.include_labels else set()) \
                    | ({"orig_id"} if req.include_original_ids else set())
                chunks = list(assembler.names)
                tensors = assembler.finish(expected=names)
                assert set(chunks) == names
                assert header is not None
                batches.append(Batch(msg.batch_index, header, tensors, {}))
                expect = 0
    finally:
        channel.close()
    assert expect == 0, "stream ended inside a batch"
    return batches


def rank_epoch(addresses: list[str], req: pb.EpochRequest) -> list[Batch]:
    """One rank's epoch from every server, merged by batch index."""
    batches = []
    for address in addresses:
        got = stream(address, req)
        indices = [b.index for b in got]
        assert indices == sorted(set(indices)), "batches must arrive in increasing index order"
        batches.extend(got)
    return sorted(batches, key=lambda b: b.index)


def rpc_error(address: str, req: pb.EpochRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stream(address, req)
    return info.value


def health_status(address: str, service: str = "") -> int:
    channel = create_channel(address)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2)
        return int(reply.status)
    except grpc.RpcError:
        return -1
    finally:
        channel.close()


def check_batch(batch: Batch, truth: Truth, req: pb.EpochRequest) -> int:
    """Every edge exists in the original graph, header counts add up, rows are the
    original rows. Returns how many edges have a target owned by the other partition
    of the seeds' (drawn by a peer)."""
    n_id, edge_index = batch.tensors["n_id"], batch.tensors["edge_index"]
    h = batch.header
    assert h.num_sampled_nodes[0] == h.num_seed_nodes and sum(h.num_sampled_nodes) == n_id.size
    assert len(h.num_sampled_edges) == len(req.fanouts)
    assert sum(h.num_sampled_edges) == edge_index.shape[1]
    assert np.unique(n_id).size == n_id.size
    assert edge_index.size == 0 or edge_index.max() < n_id.size
    orig = truth.orig_of[n_id]
    src, dst = orig[edge_index[0]], orig[edge_index[1]]
    keys = (src * truth.graph.num_nodes + dst).tolist()
    assert all(k in truth.edges for k in keys), "a sampled edge is not in the graph"
    if "x" in batch.tensors and batch.tensors["x"].dtype == np.float32:
        assert np.array_equal(batch.tensors["x"], truth.graph.x[orig])
    if "y" in batch.tensors:
        assert np.array_equal(batch.tensors["y"], truth.graph.y[orig])
    seeds_owner = truth.owner(batch.seeds)
    if not req.global_batches:
        assert np.unique(seeds_owner).size == 1, "a batch's seeds come from one partition"
    targets = n_id[edge_index[1]]
    return int((truth.owner(targets) != seeds_owner[0]).sum())


# -- cluster info and health ------------------------------------------------------------
def test_cluster_info(cluster: list[str], parts2: Path) -> None:
    manifest = read_manifest(parts2)
    infos = []
    for p, address in enumerate(cluster):
        channel = create_channel(address)
        infos.append(pb_grpc.SamplingServiceStub(channel).GetClusterInfo(
            pb.ClusterInfoRequest(client_id="test"), timeout=5))
        channel.close()
        info = infos[-1]
        assert info.partition_id == p
        assert info.num_partitions == 2 and info.num_nodes == manifest.num_nodes
        assert info.num_edges == manifest.num_edges
        assert list(info.partition_book) == list(manifest.partition_book[PLAIN_NODE_TYPE])
        assert info.feature_dim == manifest.target.feature_dim and info.feature_dtype == pb.FLOAT32
        assert info.label_dtype == pb.INT64 and info.num_classes == manifest.num_classes
        assert [s.train for s in info.split_sizes] == \
            [q.split_sizes["train"] for q in manifest.partitions]
        assert [s.test for s in info.split_sizes] == \
            [q.split_sizes["test"] for q in manifest.partitions]
        assert list(info.peer_addresses) == cluster
        assert info.device == "cpu" and info.server_version and info.format_version == 1
        assert info.graph_name == "small" and not info.has_edge_weights
    infos[1].partition_id = 0
    assert infos[0] == infos[1]


def test_health_serving_only_when_both_servers_are_up(parts2: Path) -> None:
    servers, addresses = _servers(parts2)
    try:
        servers[0].start()
        assert servers[0].wait_until_loaded(20)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # the peer is down: never SERVING
            assert health_status(addresses[0]) == NOT_SERVING
            time.sleep(0.1)
        assert health_status(addresses[0], PEER_SERVICE) == SERVING  # what peers probe
        assert health_status(addresses[0], "graphfeed.v1.SamplingService") == NOT_SERVING
        servers[1].start()
        assert servers[0].wait_until_serving(10) and servers[1].wait_until_serving(10)
        assert health_status(addresses[0]) == SERVING and health_status(addresses[1]) == SERVING
    finally:
        _stop(servers)


# -- the epoch stream ---------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_epoch_stream_covers_every_seed_once(cluster: list[str], truth: Truth,
                                             world_size: int) -> None:
    train = truth.graph.splits["train"]
    node_map = np.empty_like(truth.orig_of)
    node_map[truth.orig_of] = np.arange(node_map.size)
    seeds, counts, remote_edges = [], set(), 0
    for rank in range(world_size):
        req = request(world_size=world_size, rank=rank, batch_size=50)
        batches = rank_epoch(cluster, req)
        assert [b.index for b in batches] == list(range(len(batches)))
        counts.add(len(batches))
        for b in batches:
            assert b.header.num_batches == len(batches)
            assert 1 <= b.header.num_seed_nodes <= 50
            remote_edges += check_batch(b, truth, req)
            seeds.append(b.seeds)
    assert len(counts) == 1, f"ranks got different batch counts: {counts}"
    got = np.concatenate(seeds)
    assert np.array_equal(np.sort(got), np.sort(node_map[train])), "every train seed exactly once"
    assert remote_edges > 0, "no edge was drawn by a peer"


def test_features_travel_in_the_requested_dtype(cluster: list[str], truth: Truth) -> None:
    for dtype, torch_dtype in ((pb.FLOAT16, torch.float16), (pb.BFLOAT16, torch.bfloat16)):
        batch = stream(cluster[0], request(feature_dtype=dtype, batch_size=200))[0]
        x = torch.from_numpy(batch.tensors["x"].copy())
        if dtype == pb.BFLOAT16:
            x = x.view(torch.bfloat16)
        assert x.dtype == torch_dtype
        orig = truth.orig_of[batch.tensors["n_id"]]
        want = torch.from_numpy(truth.graph.x[orig]).to(torch_dtype)
        assert torch.equal(x, want)


def test_resume_from_skips_exactly_the_earlier_batches(cluster: list[str]) -> None:
    req = request(world_size=2, rank=1, batch_size=40)
    full = rank_epoch(cluster, req)
    k = len(full) // 2
    resumed = rank_epoch(cluster, request(world_size=2, rank=1, batch_size=40, resume_from=k))
    assert [b.index for b in resumed] == list(range(k, len(full)))
    for a, b in zip(full[k:], resumed, strict=True):
        assert a.header == b.header
        for name in a.tensors:
            assert np.array_equal(a.tensors[name], b.tensors[name])
    assert rank_epoch(cluster, request(world_size=2, rank=1, batch_size=40,
                                       resume_from=len(full))) == []
    err = rpc_error(cluster[0], request(world_size=2, rank=1, batch_size=40,
                                        resume_from=len(full) + 1))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "resume_from" in err.details()


def test_explicit_seeds_are_split_by_owner(cluster: list[str], truth: Truth) -> None:
    seeds = np.array([5, 3999, 17, 2500, 1000, 3000, 42], dtype=np.int64)
    req = _seeds_request(codec.encode_tensor(seeds))
    req.batch_size, req.shuffle = 2, False
    got = rank_epoch(cluster, req)
    assert np.array_equal(np.sort(np.concatenate([b.seeds for b in got])), np.sort(seeds))
    for b in got:
        check_batch(b, truth, req)


def test_global_batches_follow_the_seed_order_across_partitions(cluster: list[str], truth: Truth) -> None:
    seeds = np.array([5, 3999, 17, 2500, 1000, 3000, 42, 2001, 7], dtype=np.int64)
    req = _seeds_request(codec.encode_tensor(seeds))
    req.batch_size, req.shuffle, req.global_batches, req.include_original_ids = 2, False, True, True
    got = rank_epoch(cluster, req)
    assert [b.index for b in got] == list(range(5))
    assert {tuple(stream(a, req)[0].seeds) for a in cluster} == {(5, 3999), (17, 2500)}
    assert np.array_equal(np.concatenate([b.seeds for b in got]), seeds)
    for b in got:
        check_batch(b, truth, req)
        assert np.array_equal(b.tensors["orig_id"], truth.orig_of[b.tensors["n_id"]])


def test_lookup_nodes_lists_splits_and_maps_original_ids(cluster: list[str], truth: Truth) -> None:
    original = np.array([0, 3999, 17, 2500], dtype=np.int64)
    found = np.full(original.size, -1)
    for address in cluster:
        channel = create_channel(address)
        stub = pb_grpc.SamplingServiceStub(channel)
        split = stub.LookupNodes(pb.LookupNodesRequest(split="val"), timeout=TIMEOUT)
        glob, orig = codec.decode_tensor(split.global_ids), codec.decode_tensor(split.original_ids)
        assert np.array_equal(glob, np.sort(glob)) and np.array_equal(orig, truth.orig_of[glob])
        assert set(orig.tolist()) <= set(truth.graph.splits["val"].tolist())
        reply = stub.LookupNodes(pb.LookupNodesRequest(original_ids=codec.encode_tensor(original)),
                                 timeout=TIMEOUT)
        ids = codec.decode_tensor(reply.global_ids)
        found = np.maximum(found, ids)
        assert np.all((ids == -1) | (truth.owner(ids) == cluster.index(address)))
        with pytest.raises(grpc.RpcError) as info:
            stub.LookupNodes(pb.LookupNodesRequest(original_ids=codec.encode_tensor(np.array([4000]))),
                             timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "LookupNodesRequest.original_ids: expected original node IDs in [0, 4000)" \
            in info.value.details()
        channel.close()
    assert np.array_equal(truth.orig_of[found], original)


def test_labels_and_features_are_optional(cluster: list[str]) -> None:
    batches = stream(cluster[1], request(include_features=False, include_labels=False))
    assert batches and all(set(b.tensors) == {"n_id", "edge_index"} for b in batches)


# -- bad requests ----------------------------------------------------------------------------
def _seeds_request(seeds: pb.Tensor) -> pb.EpochRequest:
    req = request()
    req.seeds.CopyFrom(seeds)
    return req


BAD_REQUESTS = {
    "unknown split": (request(split="bogus"), "EpochRequest.split"),
    "negative fanout": (request(fanouts=[5, -5]), "EpochRequest.fanouts"),
    "no fanouts": (request(fanouts=[]), "EpochRequest.fanouts"),
    "zero batch size": (request(batch_size=0), "EpochRequest.batch_size"),
    "zero world size": (request(world_size=0), "EpochRequest.world_size"),
    "rank out of range": (request(world_size=2, rank=2), "EpochRequest.rank"),
    "negative resume": (request(resume_from=-1), "EpochRequest.resume_from"),
    "negative epoch": (request(epoch=-1), "EpochRequest.epoch"),
    "int dtype": (request(feature_dtype=pb.INT64), "EpochRequest.feature_dtype"),
    "unknown dtype": (request(feature_dtype=99), "EpochRequest.feature_dtype"),
    "seeds out of range": (_seeds_request(codec.encode_tensor(np.array([1, 4000]))),
                           "EpochRequest.seeds"),
    "negative seeds": (_seeds_request(codec.encode_tensor(np.array([-1, 2]))), "EpochRequest.seeds"),
    "empty seeds": (_seeds_request(codec.encode_tensor(np.zeros(0, np.int64))), "EpochRequest.seeds"),
    "repeated seeds": (_seeds_request(codec.encode_tensor(np.array([3, 3]))), "EpochRequest.seeds"),
    "float seeds": (_seeds_request(codec.encode_tensor(np.array([1.0]))), "EpochRequest.seeds"),
    "truncated seeds": (_seeds_request(pb.Tensor(dtype=pb.INT64, shape=[2], data=b"\0" * 9)),
                        "EpochRequest.seeds"),
    "no seeds": (pb.EpochRequest(fanouts=[2], batch_size=4, world_size=1), "EpochRequest.seeds_source"),
    "global batches of a split": (request(global_batches=True), "EpochRequest.seeds_source"),
    "more ranks than seeds": (_seeds_request(codec.encode_tensor(np.array([1, 2]))), "world_size"),
}
BAD_REQUESTS["more ranks than seeds"][0].world_size = 3


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_invalid_argument_naming_the_field(cluster: list[str], case: str) -> None:
    req, field = BAD_REQUESTS[case]
    err = rpc_error(cluster[0], req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert field in err.details()
    assert "expected" in err.details() or case == "more ranks than seeds"
    assert stream(cluster[0], request(batch_size=400)), "the server stopped serving"


def test_weighted_sampling_without_weights_is_a_failed_precondition(cluster: list[str]) -> None:
    err = rpc_error(cluster[0], request(sampling=pb.SamplingOptions(weighted=True)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "sampling.weighted" in err.details()


def _info(address: str) -> pb.ClusterInfo:
    with create_channel(address) as channel:
        return pb_grpc.SamplingServiceStub(channel).GetClusterInfo(pb.ClusterInfoRequest(),
                                                                   timeout=TIMEOUT)


@pytest.mark.parametrize(("change", "cached", "message"), [
    ({"graph_fingerprint": "0" * 64}, False, "EpochRequest.expect.graph_fingerprint: expected '"),
    ({"partition_id": 1}, False, "EpochRequest.expect.partition_id: expected 0 (the partition"),
    ({"hot_order": "in_degree_v1"}, True, "EpochRequest.expect.hot_order: expected 'visits_v1'"),
])
def test_a_server_unlike_what_the_job_read_refuses_the_stream(
    cluster: list[str], change: dict[str, object], cached: bool, message: str
) -> None:
    """A server restarted with another graph, partition or hot order (EpochRequest.expect:
    what the trainer read when its job began) refuses instead of streaming its batches."""
    info = _info(cluster[0])
    assert info.hot_order == "visits_v1"
    expect = {"graph_fingerprint": info.graph_fingerprint, "partition_id": info.partition_id,
              "hot_order": info.hot_order}
    counts = {"cache_counts": [5, 5]} if cached else {}
    with create_channel(cluster[0]) as channel:  # what the job read: served
        call = stream_minibatches(channel,
            request(expect=pb.ServerExpectation(**expect), **counts), timeout=TIMEOUT)
        assert next(call).batch_index == 0
        call.cancel()
    err = rpc_error(cluster[0], request(expect=pb.ServerExpectation(**{**expect, **change}),
                                        **counts))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert message in err.details() and "restarted with another" in err.details()
    # the hot order matters only to a trainer with a cache
    assert stream(cluster[0], request(expect=pb.ServerExpectation(**{**expect, "hot_order": "x"})))


@pytest.mark.parametrize("wrong", ["graph", "partition"])
def test_a_peer_on_another_graph_or_partition_refuses_the_peer_calls(
    cluster: list[str], truth: Truth, wrong: str
) -> None:
    """A server's peer calls carry its graph fingerprint and the partition it expects
    there (SampleNeighborsRequest/FetchNodeDataRequest.expect): a peer restarted on another
    graph, or another partition at that address, refuses (FAILED_PRECONDITION) instead of
    answering with rows of another graph; a stream whose peer refuses ends with
    FAILED_PRECONDITION, not INTERNAL."""
    fingerprint = _info(cluster[0]).graph_fingerprint
    nodes = {0: torch.tensor([0, 1, 2])}
    right = PeerClient(cluster, 1, timeout=5.0, fingerprint=fingerprint)
    addresses = cluster if wrong == "graph" else cluster[::-1]
    client = PeerClient(addresses, 1, timeout=5.0,
                        fingerprint="0" * 64 if wrong == "graph" else fingerprint)
    field = "graph_fingerprint" if wrong == "graph" else "partition_id"
    try:
        assert right.neighbors(nodes, 3, key=1, hop=0)[0].counts.numel() == 3
        assert right.node_data(nodes, features=True, labels=True)[0][0].shape[0] == 3
        calls = [lambda: client.neighbors(nodes, 3, key=1, hop=0),
                 lambda: client.node_data(nodes, features=True, labels=False),
                 lambda: client.orig_ids(nodes)]
        for call, request in zip(calls, ["SampleNeighborsRequest", "FetchNodeDataRequest",
                                         "FetchNodeDataRequest"], strict=True):
            with pytest.raises(PeerError) as info:
                call()
            assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert f"{request}.expect.{field}: expected" in str(info.value)
    finally:
        right.close()
        client.close()


def test_a_peer_refusing_ends_the_stream_failed_precondition() -> None:
    from sampling_server.errors import abort_on_error

    class Context:
        def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise RuntimeError(code, details)

    with pytest.raises(RuntimeError) as info, abort_on_error(Context(), "StreamMinibatches", 1):  # type: ignore[arg-type]
        raise PeerError("peer partition 0 (h:1): SampleNeighborsRequest.expect...", partition=0,
                        address="h:1", code=grpc.StatusCode.FAILED_PRECONDITION)
    assert info.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION


def test_a_cache_fill_from_a_server_with_another_hot_order_is_refused(cluster: list[str]) -> None:
    info = _info(cluster[1])
    expect = pb.ServerExpectation(graph_fingerprint=info.graph_fingerprint,
                                  partition_id=info.partition_id, hot_order="in_degree_v1")
    with create_channel(cluster[1]) as channel, pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.SamplingServiceStub(channel).StreamHotNodes(
            pb.HotNodesRequest(count=3, include_features=True, expect=expect), timeout=TIMEOUT))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "HotNodesRequest.expect.hot_order: expected 'visits_v1'" in err.value.details()


@pytest.mark.parametrize(("method", "message"), [
    ("/graphfeed.v1.SamplingService/StreamMinibatches", "StreamMinibatchesRequest"),
    ("/graphfeed.v1.PeerService/SampleNeighbors", "SampleNeighborsRequest"),
    ("/graphfeed.v1.SamplingService/GetClusterInfo", "ClusterInfoRequest"),
])
def test_garbage_bytes_are_invalid_argument(cluster: list[str], method: str, message: str) -> None:
    channel = create_channel(cluster[1])
    call = channel.unary_stream(method, request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as info:
        list(call(b"\xff" * 16, timeout=5))
    channel.close()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    assert stream(cluster[1], request(batch_size=400))


def test_peer_service_checks_ownership_and_fanout(cluster: list[str], truth: Truth) -> None:
    channel = create_channel(cluster[0])
    stub = pb_grpc.PeerServiceStub(channel)
    foreign = codec.encode_tensor(np.array([int(truth.book[1])], dtype=np.int64))
    own = codec.encode_tensor(np.array([0, 1], dtype=np.int64))
    cases = [
        (stub.SampleNeighbors, pb.SampleNeighborsRequest(nodes=foreign, fanout=3),
         "SampleNeighborsRequest.nodes"),
        (stub.SampleNeighbors, pb.SampleNeighborsRequest(nodes=own, fanout=-5),
         "SampleNeighborsRequest.fanout"),
        (stub.FetchNodeData, pb.FetchNodeDataRequest(nodes=foreign, want_features=True),
         "FetchNodeDataRequest.nodes"),
    ]
    for method, req, field in cases:
        with pytest.raises(grpc.RpcError) as info:
            list(method(req, timeout=5))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.details()
    chunks = list(stub.SampleNeighbors(pb.SampleNeighborsRequest(nodes=own, fanout=3), timeout=5))
    channel.close()
    assembler = TensorAssembler()
    for c in chunks:
        assembler.add_all(c.tensors)
    got = assembler.finish(expected={"counts", "neighbors"})
    assert got["counts"].shape == (2,) and got["counts"].sum() == got["neighbors"].size


@pytest.mark.parametrize("dtype", [pb.FLOAT32, pb.BFLOAT16])
def test_fetch_node_data_answers_read_as_plain_protobuf(parts2: Path, truth: Truth,
                                                        dtype: pb.DType.ValueType) -> None:
    """A peer's rows, cast on the way and framed without protobuf's copies, read by the
    generated stubs: several chunk messages (small chunks), every row in order, features
    as ``Tensor.to`` casts them, labels and original IDs."""
    servers, addresses = _servers(parts2, chunk_bytes=4096)
    try:
        for s in servers:
            s.start()
        assert all(s.wait_until_serving(20) for s in servers)
        lo, hi = int(truth.book[0]), int(truth.book[1])
        nodes = np.random.default_rng(3).permutation(np.arange(lo, hi, dtype=np.int64))
        channel = create_channel(addresses[0])
        chunks = list(pb_grpc.PeerServiceStub(channel).FetchNodeData(pb.FetchNodeDataRequest(
            nodes=codec.encode_tensor(nodes), want_features=True, want_labels=True,
            want_original_ids=True, feature_dtype=dtype), timeout=TIMEOUT))
        channel.close()
    finally:
        _stop(servers)
    assert len(chunks) > 2 and [c.chunk_index for c in chunks] == list(range(len(chunks)))
    assembler = TensorAssembler()
    for c in chunks:
        assert c.num_chunks == len(chunks)
        assembler.add_all(c.tensors)
    got = assembler.finish(expected={"x", "y", "orig_id"})
    orig = truth.orig_of[nodes]
    assert np.array_equal(got["orig_id"], orig)
    assert np.array_equal(got["y"], truth.graph.y[orig])
    want = torch.from_numpy(truth.graph.x[orig]).to(codec.dtype_to_torch(dtype))
    x = torch.from_numpy(np.array(got["x"]))  # bfloat16 arrives as its 16-bit words
    bits = x if dtype == pb.FLOAT32 else x.view(torch.bfloat16)
    assert torch.equal(bits.view(torch.uint8), want.view(torch.uint8))


def _raw_epoch(address: str, req: pb.EpochRequest) -> list[tuple[list[bytes], dict[str, np.ndarray]]]:
    """Every batch of one stream: its serialized messages and its tensors."""
    channel = create_channel(address)
    call = stream_minibatches(channel, req, timeout=TIMEOUT, parse=None, acknowledge=None)
    out: list[tuple[list[bytes], dict[str, np.ndarray]]] = []
    raw: list[bytes] = []
    assembler = TensorAssembler()
    try:
        for message in call:
            msg = pb.MinibatchChunk.FromString(message)
            assert msg.chunk_index == len(raw)
            raw.append(message)
            assembler.add_all(msg.tensors)
            if len(raw) == msg.num_chunks:
                out.append((raw, assembler.finish()))
                call.taken(len(out))
                raw = []
    finally:
        channel.close()
    assert not raw, "stream ended inside a batch"
    return out


@pytest.fixture(scope="module")
def small_chunks(parts2: Path) -> Iterator[list[str]]:
    """A second pair of servers, with messages of at most 1 KiB of tensor data."""
    servers, addresses = _servers(parts2, chunk_bytes=1024)
    for s in servers:
        s.start()
    assert all(s.wait_until_serving(20) for s in servers)
    yield addresses
    _stop(servers)


@pytest.mark.parametrize("dtype", [pb.FLOAT32, pb.BFLOAT16])
@pytest.mark.parametrize("plan", ["per partition", "cached", "global"])
def test_features_gathered_into_their_messages_match_the_encoded_ones(
        cluster: list[str], small_chunks: list[str], truth: Truth, dtype: pb.DType.ValueType,
        plan: str) -> None:
    """Rows spanning several messages are gathered straight into them (whole rows, one
    ``x`` chunk a message, after the batch's other tensors): the batches are bit-identical
    to those of servers that send ``x`` as one tensor with the others (default messages),
    with peers' rows, with a cache plan and with global batches."""
    kw: dict[str, object] = {"feature_dtype": dtype, "batch_size": 48, "include_original_ids": True}
    if plan == "cached":
        kw["cache_counts"] = [40, 40]
    if plan == "global":
        kw.update(global_batches=True, shuffle=False)
    req = request(**kw)
    if plan == "global":
        req.seeds.CopyFrom(codec.encode_tensor(np.arange(0, 4000, 25, dtype=np.int64)))
    want = _raw_epoch(cluster[0], req)
    got = _raw_epoch(small_chunks[0], req)
    assert len(got) == len(want) > 1
    row_bytes = truth.graph.x.shape[1] * (4 if dtype == pb.FLOAT32 else 2)
    gathered = 0
    for (messages, tensors), (_, expected) in zip(got, want, strict=True):
        assert tensors.keys() == expected.keys()
        for name, value in expected.items():
            assert tensors[name].dtype == value.dtype and np.array_equal(tensors[name], value), name
        chunks = [pb.MinibatchChunk.FromString(m).tensors for m in messages]
        with_x = [i for i, c in enumerate(chunks) if any(t.name == "x" for t in c)]
        if tensors["x"].nbytes > 1024:  # x spans messages: gathered into them
            gathered += 1
            assert with_x == list(range(with_x[0], len(chunks))) and with_x[0] > 0
            for i in with_x:
                assert len(chunks[i]) == 1 and len(chunks[i][0].data) % row_bytes == 0
                assert 0 < len(chunks[i][0].data) <= 1024
    assert gathered > 0


@pytest.mark.parametrize("dtype", [pb.FLOAT32, pb.BFLOAT16])
def test_one_partition_s_rows_gathered_into_their_messages_match_the_encoded_ones(
        parts1: Path, dtype: pb.DType.ValueType) -> None:
    """The same with every row owned (no peer), with and without a cache plan."""
    built = [create_server(_config(parts1, 0, chunk_bytes=size))
             for size in (1024, codec.DEFAULT_CHUNK_BYTES)]
    for server, port in built:
        server.set_peers([f"127.0.0.1:{port}"])
        server.start()
    try:
        assert all(server.wait_until_serving(20) for server, _ in built)
        for counts in ([], [300]):
            req = request(feature_dtype=dtype, batch_size=40, cache_counts=counts)
            got, want = (_raw_epoch(f"127.0.0.1:{port}", req) for _, port in built)
            assert len(got) == len(want) > 1
            for (messages, tensors), (encoded, expected) in zip(got, want, strict=True):
                assert len(messages) > len(encoded)  # x in its own messages of 1 KiB
                assert tensors.keys() == expected.keys()
                for name, value in expected.items():
                    assert np.array_equal(tensors[name], value), name
    finally:
        _stop([server for server, _ in built])


@pytest.fixture(scope="module")
def full_structure(parts2: Path) -> Iterator[list[SamplingServer]]:
    """A pair of servers that each hold the whole graph's structure."""
    servers, _ = _servers(parts2, structure="full")
    for s in servers:
        s.start()
    assert all(s.wait_until_serving(20) for s in servers)
    yield servers
    _stop(servers)


def _stage_calls(server: SamplingServer, stage: str) -> float:
    return server.metrics.registry.get_sample_value(
        "graphfeed_stage_seconds_count",
        {"partition": str(server.store.partition_id), "stage": stage}) or 0.0


def _plan_request(plan: str) -> pb.EpochRequest:
    """An epoch of small batches with original IDs, labels and features, as ``plan`` says
    (``per partition``, ``global``, ``with replacement``, ``bfloat16 with a cache plan``)."""
    kw: dict[str, object] = {"batch_size": 48, "include_original_ids": True, "fanouts": [6, 4, 3]}
    if plan == "global":
        kw.update(global_batches=True, shuffle=False)
    if plan == "with replacement":
        kw["sampling"] = pb.SamplingOptions(replace=True)
    if plan == "bfloat16 with a cache plan":
        kw.update(feature_dtype=pb.BFLOAT16, cache_counts=[60, 40])
    req = request(**kw)
    if plan == "global":
        req.seeds.CopyFrom(codec.encode_tensor(np.arange(0, 4000, 25, dtype=np.int64)))
    return req


def _assert_same_epochs(cluster: list[str], servers: list[SamplingServer],
                        req: pb.EpochRequest) -> None:
    """Each of ``servers`` streams the epoch bit for bit as the ``cluster`` server of its
    partition does (features, labels and original IDs included)."""
    for p, server in enumerate(servers):
        want = _raw_epoch(cluster[p], req)
        got = _raw_epoch(f"127.0.0.1:{server.port}", req)
        assert len(got) == len(want) > 1
        for (_, tensors), (_, expected) in zip(got, want, strict=True):
            assert tensors.keys() == expected.keys()
            assert {"x", "y", "orig_id"} <= tensors.keys()
            for name, value in expected.items():
                assert np.array_equal(tensors[name], value), (p, name)


@pytest.mark.parametrize("plan", ["per partition", "global", "with replacement"])
def test_servers_holding_the_full_structure_make_the_same_batches_without_peer_sampling(
        cluster: list[str], full_structure: list[SamplingServer], plan: str) -> None:
    """``structure: full`` draws every hop on the server (the draws are keyed by the
    nodes' original IDs): the batches are bit-identical to those of servers that ask
    their peers, no peer is asked to sample, and the features still come from theirs."""
    answers = [_stage_calls(s, "answer_sample") for s in full_structure]
    fetched = [_stage_calls(s, "peer_fetch") for s in full_structure]
    _assert_same_epochs(cluster, full_structure, _plan_request(plan))
    assert [_stage_calls(s, "answer_sample") for s in full_structure] == answers
    assert all(_stage_calls(s, "peer_sample") == 0 for s in full_structure)
    assert all(_stage_calls(s, "peer_fetch") > f for s, f in zip(full_structure, fetched, strict=True))


@pytest.fixture(scope="module")
def full_graph(parts2: Path) -> Iterator[list[SamplingServer]]:
    """A pair of servers with the defaults (``auto``: the whole graph's structure and
    every node's features and labels, on this small graph), their features gathered into
    1 KiB stream messages."""
    servers, _ = _servers(parts2, structure="auto", features="auto", chunk_bytes=1024)
    for s in servers:
        s.start()
    assert all(s.wait_until_serving(20) for s in servers)
    yield servers
    _stop(servers)


@pytest.mark.parametrize("plan", ["per partition", "global", "bfloat16 with a cache plan"])
def test_servers_holding_every_feature_make_the_same_batches_without_peer_calls(
        cluster: list[str], full_graph: list[SamplingServer], plan: str) -> None:
    """``features: full`` (with ``structure: full``) gathers every row on the server: the
    batches, labels and original IDs included, are bit-identical to those of servers that
    ask their peers, and no peer is asked to sample or gather."""
    assert [(s.store.structure_mode, s.store.features_mode) for s in full_graph] == \
        [("full", "full")] * 2
    stages = ("answer_sample", "answer_fetch", "peer_sample", "peer_fetch")
    before = [[_stage_calls(s, stage) for stage in stages] for s in full_graph]
    _assert_same_epochs(cluster, full_graph, _plan_request(plan))
    assert [[_stage_calls(s, stage) for stage in stages] for s in full_graph] == before


@pytest.mark.parametrize("plan", ["per partition", "bfloat16 with a cache plan"])
def test_servers_holding_every_feature_but_their_own_structure_ask_their_peers_for_no_row(
        cluster: list[str], parts2: Path, plan: str) -> None:
    """``features: full`` with the partition's own structure (a choice the CPU sampler
    allows): the servers ask their peers to draw the frontier nodes the peers own, but
    gather every row and label themselves (the original IDs of their nodes, which come
    with the structure, they still ask for), and the batches are bit-identical."""
    servers, _ = _servers(parts2, features="full")
    for s in servers:
        s.start()
    try:
        assert all(s.wait_until_serving(20) for s in servers)
        assert [(s.store.structure_mode, s.store.features_mode) for s in servers] == \
            [("partition", "full")] * 2
        _assert_same_epochs(cluster, servers, _plan_request(plan))
        assert all(_stage_calls(s, "peer_sample") > 0 for s in servers)
        fetched = [_stage_calls(s, "peer_fetch") for s in servers]
        without_ids = _plan_request(plan)
        without_ids.include_original_ids = False
        for s in servers:
            assert len(_raw_epoch(f"127.0.0.1:{s.port}", without_ids)) > 1
        assert [_stage_calls(s, "peer_fetch") for s in servers] == fetched
    finally:
        _stop(servers)


def test_servers_holding_the_whole_graph_match_on_relabelled_float16_partitions(
        tmp_path: Path) -> None:
    """Three random partitions (global IDs relabelled, unlike the range partitions above)
    of float16 features: servers holding the whole graph (the defaults) stream what servers
    that ask their peers stream, in every wire dtype, with and without a cache plan, in
    both batch plans."""
    graph = generate("small", progress=False)
    graph.x = graph.x.astype(np.float16)
    root = tmp_path / "parts"
    partition_graph(graph, 3, root, method="random", progress=False)
    asking, _ = _servers(root, 3)
    holding, _ = _servers(root, 3, structure="auto", features="auto")
    try:
        for s in (*asking, *holding):
            s.start()
        assert all(s.wait_until_serving(30) for s in (*asking, *holding))
        assert {(s.store.structure_mode, s.store.features_mode) for s in holding} == \
            {("full", "full")}
        addresses = [f"127.0.0.1:{s.port}" for s in asking]
        for dtype in (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16):
            for plan in ("per partition", "global", "with a cache plan"):
                req = request(batch_size=40, fanouts=[5, 4], include_original_ids=True,
                              feature_dtype=dtype)
                if plan == "global":
                    req.global_batches, req.shuffle = True, False
                    req.seeds.CopyFrom(codec.encode_tensor(np.arange(0, 4000, 17, dtype=np.int64)))
                if plan == "with a cache plan":
                    req.cache_counts.extend([150, 150, 150])
                _assert_same_epochs(addresses, holding, req)
    finally:
        _stop(asking)
        _stop(holding)


def test_every_feature_needs_every_partition_s_files(parts2: Path, tmp_path: Path) -> None:
    """``features: full`` refuses to start (before the port is bound) where another
    partition's feature file is missing, naming it; ``auto`` keeps to the partition's own
    rows there, and where one is present but corrupted (``full`` fails the load)."""
    root = tmp_path / "no-x-0"
    shutil.copytree(parts2, root)
    (root / "part-0" / "x.npy").unlink()
    with pytest.raises(PartitionFormatError, match=r"part-0/x\.npy: missing"):
        create_server(_config(root, 1, features="full"))
    _auto_keeps_to_the_partition_where_a_file_is_bad(parts2, tmp_path / "bad", "features", "y")
    store = PartitionStore(_config(parts2, 1, features="auto", structure="auto", mmap=False))
    store.load()
    assert store.features_mode == "full"
    t, et = PLAIN_NODE_TYPE, PLAIN_EDGE_TYPE
    assert store.sampler().hold[t] == (0, store.manifest.num_nodes)
    # the partition's own arrays are its rows of the whole graph's, not a second copy
    part, alone = store.partition, load_partition(parts2, 1)
    assert np.array_equal(part.x[t], alone.x[t]) and np.array_equal(part.y, alone.y)
    assert np.array_equal(part.indices[et], alone.indices[et])
    assert np.array_equal(part.orig_ids[t], alone.orig_ids[t])
    assert np.shares_memory(part.x[t], store.sampler().node_data.x[t])
    assert np.shares_memory(part.indices[et], store.sampler().structure.indices[et])


def test_servers_on_one_host_share_its_memory_for_auto() -> None:
    """``auto`` weighs an equal share of the available memory among the servers whose
    addresses name the same host (they load at the same time)."""
    peers = ("10.0.0.1:50051", "10.0.0.1:50052", "10.0.0.2:50051", "[::1]:1", "[::1]:2")
    assert [colocated_servers(peers, p) for p in range(5)] == [2, 2, 1, 2, 2]
    assert colocated_servers((), 0) == 1


def test_every_feature_on_a_gpu_needs_the_whole_structure() -> None:
    """The CUDA sampler orders its feature table by the in-degree of the nodes it holds:
    ``full`` with the partition's own structure is refused, by name."""
    with pytest.raises(ConfigError, match="features: expected 'auto' or 'partition' with device"):
        ServerConfig(partition_dir=Path("."), partition=0, features="full", device="cuda",
                     structure="partition")
    assert ServerConfig(partition_dir=Path("."), partition=0, features="full",
                        device="cuda").features == "full"


def test_the_full_structure_needs_every_partition_s_files(parts2: Path, tmp_path: Path) -> None:
    """A server asked for the full structure refuses to start (before it binds its port)
    where another partition's structure file is missing, naming the file."""
    root = tmp_path / "only-part-0"
    shutil.copytree(parts2, root)
    (root / "part-1" / "indices.npy").unlink()
    with pytest.raises(PartitionFormatError, match=r"part-1/indices\.npy: missing"):
        create_server(_config(root, 0, structure="full"))
    create_server(_config(root, 0))[0].stop(None).wait(10)  # its own partition is whole


def test_auto_takes_the_whole_structure_only_where_every_partition_s_files_are(
        parts2: Path, tmp_path: Path) -> None:
    """The default, ``auto``: the whole structure where both partitions' files are under the
    partition directory, the partition's own where one is missing (logged, no error)."""
    store = PartitionStore(_config(parts2, 1, structure="auto"))
    store.load()
    assert store.structure_mode == "full"
    assert store.sampler().draw[PLAIN_NODE_TYPE][0] == 0
    _auto_keeps_to_the_partition_where_a_file_is_bad(parts2, tmp_path / "bad", "structure",
                                                     "indices")


def _auto_keeps_to_the_partition_where_a_file_is_bad(parts2: Path, root: Path, field: str,
                                                     role: str) -> None:
    """``field: auto`` keeps partition 1's server to its own partition where partition 0's
    ``role`` file is missing, or there but corrupted (a warning, no error); ``full``
    fails the load on the corrupted one, naming it."""
    for fault in ("missing", "corrupted"):
        if root.exists():
            shutil.rmtree(root)
        shutil.copytree(parts2, root)
        path = root / "part-0" / f"{role}.npy"
        if fault == "missing":
            path.unlink()
        else:
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x01
            path.write_bytes(bytes(data))
        store = PartitionStore(_config(root, 1, **{field: "auto"}))
        store.load()
        assert getattr(store, f"{field}_mode") == "partition", fault
        sampler = store.sampler()
        start = (sampler.draw if field == "structure" else sampler.hold)[PLAIN_NODE_TYPE][0]
        assert start == store.type_range(PLAIN_NODE_TYPE)[0] > 0, fault
    with pytest.raises(PartitionFormatError, match=rf"part-0/{role}\.npy: SHA-256 mismatch"):
        PartitionStore(_config(root, 1, **{field: "full"})).load()


def test_the_structure_setting_from_flags_and_the_cluster_file(tmp_path: Path) -> None:
    parser = cli.build_parser()
    base = ["--partition", "0", "--partition-dir", str(tmp_path)]
    assert cli.config_from_args(parser.parse_args(base)).structure == "auto"
    assert ServerConfig(partition_dir=tmp_path, partition=0).structure == "auto"
    assert cli.config_from_args(parser.parse_args([*base, "--structure", "full"])).structure == "full"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--structure", "halo"])
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("defaults: {partition_dir: /d, structure: full}\n"
                       "servers: [{partition: 0, address: 'h:1'}]\n")
    assert ServerConfig.from_cluster_yaml(cluster, 0).structure == "full"
    with pytest.raises(ConfigError, match=r"^structure: expected one of \['auto', 'partition', 'full'\]"):
        ServerConfig(partition_dir=tmp_path, partition=0, structure="all")
    # and the features the server gathers itself
    assert cli.config_from_args(parser.parse_args(base)).features == "auto"
    assert ServerConfig(partition_dir=tmp_path, partition=0).features == "auto"
    assert cli.config_from_args(parser.parse_args([*base, "--features", "partition"])).features \
        == "partition"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--features", "hot"])
    cluster.write_text("defaults: {partition_dir: /d, features: full}\n"
                       "servers: [{partition: 0, address: 'h:1'}]\n")
    assert ServerConfig.from_cluster_yaml(cluster, 0).features == "full"
    with pytest.raises(ConfigError, match=r"^features: expected one of \['auto', 'partition', 'full'\]"):
        ServerConfig(partition_dir=tmp_path, partition=0, features="all")


# -- failures -----------------------------------------------------------------------------------
def test_a_client_that_goes_away_ends_its_stream(cluster: list[str],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sampling_server")
    channel = create_channel(cluster[0])
    call = stream_minibatches(channel,
        request(batch_size=5, client_id="leaver"), timeout=TIMEOUT)
    next(call)
    call.cancel()
    channel.close()
    deadline = time.monotonic() + 5
    while "client=leaver" not in caplog.text or "ended early" not in caplog.text:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.05)
    assert stream(cluster[0], request(batch_size=400))


def test_dead_peer_fails_the_stream_quickly_naming_the_peer(parts2: Path) -> None:
    servers, addresses = _servers(parts2, peer_timeout=2.0)
    try:
        for s in servers:
            s.start()
        assert all(s.wait_until_serving(20) for s in servers)
        servers[1].stop(None).wait(10)
        started = time.monotonic()
        err = rpc_error(addresses[0], request(fanouts=[10, 10], batch_size=100))
        elapsed = time.monotonic() - started
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "peer partition 1" in err.details() and addresses[1] in err.details()
        assert elapsed < 10
    finally:
        _stop(servers)


class _HangingPeer(pb_grpc.PeerServiceServicer):
    def __init__(self) -> None:
        self.release = threading.Event()

    def SampleNeighbors(self, request: pb.SampleNeighborsRequest,
                        context: grpc.ServicerContext) -> Iterator[pb.SampleNeighborsChunk]:
        self.release.wait(10)
        return iter(())

    def FetchNodeData(self, request: pb.FetchNodeDataRequest,
                      context: grpc.ServicerContext) -> Iterator[pb.NodeDataChunk]:
        self.release.wait(10)
        return iter(())


def test_peer_client_raises_peer_error_within_its_timeout(reserve_ports: Callable[[int], list[int]]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    hanging = _HangingPeer()
    server = grpc.server(ThreadPoolExecutor(4), options=server_options())
    pb_grpc.add_PeerServiceServicer_to_server(hanging, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    dead_port = reserve_ports(1)[0]  # held: nothing listens on it
    addresses = ["127.0.0.1:1", f"127.0.0.1:{port}", f"127.0.0.1:{dead_port}"]
    client = PeerClient(addresses, 0, timeout=0.5)
    try:
        # a hung peer runs into the deadline; a dead one is UNAVAILABLE (or, as the
        # peer client retries UNAVAILABLE with backoff, runs into the deadline retrying)
        codes = {1: {grpc.StatusCode.DEADLINE_EXCEEDED},
                 2: {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}}
        for p, allowed in codes.items():
            started = time.monotonic()
            with pytest.raises(PeerError) as info:
                client.neighbors({p: torch.tensor([1, 2])}, 3, key=1, hop=0)
            assert time.monotonic() - started < 10
            assert info.value.partition == p and info.value.code in allowed
            assert f"peer partition {p} ({addresses[p]})" in str(info.value)
    finally:
        hanging.release.set()
        client.close()
        server.stop(None)


def _counted_stream(parts1: Path, **settings: Any) -> tuple[SamplingPipeline, EpochJob, list[int]]:
    """A pipeline (``settings``: its keywords) on partition 0 of ``parts1``, an epoch job of
    more than 20 batches, and the list its produced batches' indices are appended to."""
    store = PartitionStore(_config(parts1, 0))
    store.load()
    pipeline = SamplingPipeline(store, None, workers=2, **settings)
    produced: list[int] = []
    real = pipeline.produce

    def counting(job, ref):  # type: ignore[no-untyped-def]
        produced.append(ref.index)
        return real(job, ref)

    pipeline.produce = counting  # type: ignore[method-assign]
    job = epoch_job(request(batch_size=10, include_features=False), store)
    assert len(job.batches) > 20
    return pipeline, job, produced


def test_a_slow_client_holds_sampling_back(parts1: Path) -> None:
    pipeline, job, produced = _counted_stream(parts1, prefetch=2)
    messages = pipeline.stream(job)
    next(messages)
    time.sleep(0.3)
    # the batch being sent, the next (its first message encoded ahead), `prefetch` after it
    assert len(produced) <= 4
    rest = list(messages)
    assert len(produced) == len(job.batches)
    assert sum(done is not None for _, done in rest) == len(job.batches) - 1
    pipeline.close()


@pytest.mark.parametrize(("prefetch_bytes", "ahead"), [(1, 1), (1 << 40, 4)], ids=["one-batch", "unbounded"])
def test_prefetch_bytes_bounds_the_batches_sampled_ahead(parts1: Path, prefetch_bytes: int,
                                                         ahead: int) -> None:
    """With --prefetch-bytes below a batch's size a stream samples one batch ahead (the
    next, held to be encoded ahead, besides), whatever --prefetch says; with room for
    more, --prefetch bounds it again; every batch still arrives."""
    pipeline, job, produced = _counted_stream(parts1, prefetch=4, prefetch_bytes=prefetch_bytes)
    messages = pipeline.stream(job)
    for _ in range(3):  # a few batches in: their sizes known
        while next(messages)[1] is None:
            pass
    sent = 3
    # the batches sent and `ahead` after them (one of which may be held to encode ahead)
    deadline = time.monotonic() + 60
    while len(produced) < sent + ahead and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert sent + ahead <= len(produced) <= sent + ahead + 1, produced
    rest = list(messages)
    assert len(produced) == len(job.batches)
    assert sum(done is not None for _, done in rest) == len(job.batches) - sent
    pipeline.close()


def test_prefetch_bytes_from_the_flag(tmp_path: Path) -> None:
    parser = cli.build_parser()
    base = ["--partition-dir", str(tmp_path), "--partition", "0"]
    assert cli.config_from_args(parser.parse_args(base)).prefetch_bytes is None
    given = cli.config_from_args(parser.parse_args([*base, "--prefetch-bytes", "512M"]))
    assert given.prefetch_bytes == 512 << 20
    with pytest.raises(ConfigError, match=r"prefetch_bytes: expected bytes >= 1 or None \(prefetch alone\), "
                                          r"got 0"):
        ServerConfig(partition_dir=tmp_path, partition=0, prefetch_bytes=0)


def test_ahead_counts_batches_that_fit_in_the_bytes_and_never_fewer_than_one() -> None:
    from sampling_server.messages import Prepared
    from sampling_server.pipeline import Ahead

    def done(nbytes: int) -> Future[Prepared]:
        future: Future[Prepared] = Future()
        future.set_result(Prepared(lambda i, n: pb.MinibatchChunk(), [], built=[b""], built_sizes=[nbytes]))
        return future

    assert Ahead(4, None).batches() == 4
    ahead = Ahead(4, 250)
    assert ahead.batches() == 1  # no batch seen yet
    ahead.produced(done(100))
    assert ahead.batches() == 2
    ahead.produced(done(10))
    assert ahead.batches() == 4  # never more than prefetch
    ahead.produced(done(1000))
    assert ahead.batches() == 1  # never fewer than one
    failed: Future[Prepared] = Future()
    failed.set_exception(RuntimeError("x"))
    ahead.produced(failed)
    assert ahead.batches() == 1


def test_a_stream_running_when_the_server_stops_ends_unavailable_not_internal(
        parts1: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = PartitionStore(_config(parts1, 0))
    store.load()
    pipeline = SamplingPipeline(store, None, workers=1, prefetch=1)
    job = epoch_job(request(batch_size=10, include_features=False), store)
    messages = pipeline.stream(job)
    next(messages)
    pipeline.close()  # what SamplingServer.stop does once gRPC has stopped
    with pytest.raises(Stopping, match=r"partition 0 is shutting down; retry on its restarted server \(here"):
        list(messages)

    class Context:
        def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise RuntimeError(code, details)

    with caplog.at_level(logging.INFO, "sampling_server"), pytest.raises(RuntimeError) as info, \
            abort_on_error(Context(), "StreamMinibatches", 0):  # type: ignore[arg-type]
        raise Stopping("the server of partition 0 is shutting down")
    assert info.value.args[0] == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in info.value.args[1]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_sampling_threads_run_kernels_on_the_usable_cpus(
        parts1: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numba

    from sampling_server import threads

    store = PartitionStore(_config(parts1, 0))
    pool_size = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
    for given, cpus, expected in [(1, 8, 1), (None, 1, 1), (None, 64, pool_size)]:
        monkeypatch.setattr(threads, "usable_cpus", lambda cpus=cpus: cpus)
        pipeline = SamplingPipeline(store, None, workers=2, threads=given)
        try:
            assert pipeline.threads == (given or cpus)
            seen = {pipeline._pool.submit("test", numba.get_num_threads).result(timeout=30),
                    pipeline.lookups.submit(numba.get_num_threads).result(timeout=30)}
            assert seen == {min(expected, pool_size)}
        finally:
            pipeline.close()


def test_streams_beyond_max_streams_are_resource_exhausted(parts1: Path) -> None:
    server, port = create_server(_config(parts1, 0, max_streams=1))
    server.start()
    assert server.wait_until_serving(20)
    address = f"127.0.0.1:{port}"
    channel = create_channel(address)
    first = stream_minibatches(channel,
        request(batch_size=5), timeout=TIMEOUT)
    try:
        next(first)  # holds the only slot
        err = rpc_error(address, request())
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max-streams" in err.details()
        first.cancel()
        deadline = time.monotonic() + 5
        while True:  # the slot comes back once the server sees the cancel
            try:
                assert stream(address, request(batch_size=400))
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        channel.close()
        server.stop(None).wait(10)


def test_a_corrupted_partition_never_serves_and_says_why(parts1: Path, tmp_path: Path) -> None:
    root = tmp_path / "corrupt"
    shutil.copytree(parts1, root)
    x = root / "part-0" / "x.npy"
    data = bytearray(x.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes: only the SHA-256 can tell
    x.write_bytes(bytes(data))
    server, port = create_server(_config(root, 0))
    server.start()
    try:
        assert server.shutdown_requested.wait(20)  # serve() exits 1 on this
        assert not server.wait_until_loaded(0)
        assert health_status(f"127.0.0.1:{port}") == NOT_SERVING
        err = rpc_error(f"127.0.0.1:{port}", request())
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "failed to load" in err.details() and "x.npy" in err.details()
        assert "SHA-256" in err.details()
    finally:
        server.stop(None).wait(10)


# -- process, configuration, command line --------------------------------------------------
def test_sigterm_drains_and_exits_zero(parts1: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sampling_server", "--partition-dir", str(parts1), "--partition",
         "0", "--listen", "127.0.0.1:0", "--device", "cpu", "--grace", "2"],
        stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    watchdog = threading.Timer(60, proc.kill)  # never hang the suite on a stuck server
    watchdog.start()
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "SERVING" in line and "NOT_SERVING" not in line:
                break
        assert proc.poll() is None, "".join(lines)
        proc.send_signal(signal.SIGUSR1)  # a stack dump for a stuck server; it keeps serving
        dump = []
        for line in proc.stderr:
            dump.append(line)
            if line.lstrip().startswith("File ") and "sampling_server" in line:
                break
        assert any(ln.startswith(("Thread 0x", "Current thread 0x")) for ln in dump), "".join(dump)
        assert proc.poll() is None, "".join(lines + dump)
        port = int(next(ln for ln in lines if "listening on port" in ln)
                   .split("listening on port ")[1].split()[0])
        channel = create_channel(f"127.0.0.1:{port}")
        call = stream_minibatches(channel,
            request(batch_size=10, include_features=False), timeout=TIMEOUT)
        first = next(call)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # mid-stream: the stream is drained, not cut
        rest = list(call)
        channel.close()
        assert 1 + len(rest) == first.header.num_batches  # one message per batch here
        assert proc.wait(timeout=15) == 0, "".join(lines) + proc.stderr.read()
        assert time.monotonic() - started < 15  # --grace 2, plus a loaded host's slack
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cluster_file(tmp_path: Path, parts2: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"""\
defaults:
  partition_dir: {parts2}
  workers: 3
servers:
  - {{partition: 1, address: "node1:6000", device: cpu}}
  - {{partition: 0, address: "node0:5000"}}
""")
    config = ServerConfig.from_cluster_yaml(path, 1, prefetch=7)
    assert config.peers == ("node0:5000", "node1:6000")
    assert config.listen == "0.0.0.0:6000" and config.workers == 3 and config.device == "cpu"
    assert config.prefetch == 7 and config.partition_dir == parts2
    with pytest.raises(ConfigError, match="no entry for partition 2"):
        ServerConfig.from_cluster_yaml(path, 2)
    with pytest.raises(ConfigError, match=r"unknown keys.*wokers"):
        config_from_cluster({"servers": [{"partition": 0, "address": "a:1", "wokers": 2}]}, 0)
    with pytest.raises(ConfigError, match="missing \\[1\\]"):
        config_from_cluster({"servers": [{"partition": 0, "address": "a:1"},
                                         {"partition": 2, "address": "b:1"}]}, 0)
    with pytest.raises(ConfigError, match="workers: expected an integer >= 1 or None \\(automatic\\), got 0"):
        ServerConfig(partition_dir=parts2, partition=0, workers=0)


def test_server_refuses_wrong_partition_or_peers(parts2: Path) -> None:
    with pytest.raises(ConfigError, match="partition: expected an ID in \\[0, 2\\)"):
        create_server(_config(parts2, 5))
    with pytest.raises(ConfigError, match="peers: expected 2 addresses"):
        create_server(_config(parts2, 0, peers=("a:1", "b:2", "c:3")))
    server, _ = create_server(_config(parts2, 0))
    with pytest.raises(ConfigError, match="--peers or --cluster"):
        server.start()
    server.stop(None).wait(5)


def test_cli_help_and_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "configure_logging", lambda level, fmt: None)
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--partition-dir" in out and "--cluster" in out and "SIGTERM" in out
    assert cli.main(["--partition", "0"]) == 2
    assert "--partition-dir" in capsys.readouterr().err
    assert cli.main(["--partition", "0", "--partition-dir", str(tmp_path)]) == 2
    assert "manifest not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--partition", "0", "--partition-dir", "x", "--chunk-bytes", "100G"])
    assert "chunk-bytes" in capsys.readouterr().err


def test_a_device_this_machine_lacks_exits_2_with_one_sentence(
        capsys: pytest.CaptureFixture[str], parts1: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "configure_logging", lambda level, fmt: None)
    base = ["--partition", "0", "--partition-dir", str(parts1)]
    assert cli.main([*base, "--device", "cpu", "--topology", "uva"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("graphfeed-server: error: --topology uva: only the CUDA sampler")
    assert "\n" not in err and "Traceback" not in err
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")  # what a machine without a GPU looks like
    assert cli.main([*base, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("graphfeed-server: error: --device cuda: no usable CUDA GPU here")
    assert "\n" not in err


def test_a_stop_racing_the_end_of_the_load_never_joins_an_unstarted_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server stopped just as its partition finished loading (found in CI: stop() raised
    "cannot join thread before it is started") stops cleanly; and a monitor stopped before
    the load ends never starts probing."""
    from grpc_health.v1 import health

    from sampling_server.health import HealthMonitor

    monitor = HealthMonitor(health.HealthServicer(), 0, None, probe_timeout=1.0, interval=0.1)
    starting = threading.Event()
    real_start = threading.Thread.start

    def slow_start(thread: threading.Thread) -> None:
        if thread.name == "health-probe":
            starting.set()
            time.sleep(0.3)  # the stop comes in here
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", slow_start)
    loading = threading.Thread(target=monitor.loaded, name="loader")
    loading.start()
    assert starting.wait(5)
    monitor.shutdown()  # raised RuntimeError before
    loading.join(5)
    assert monitor._thread is not None and not monitor._thread.is_alive()

    stopped = HealthMonitor(health.HealthServicer(), 0, None, probe_timeout=1.0, interval=0.1)
    stopped.shutdown()
    stopped.loaded()
    assert stopped._thread is None
