"""What only typed graphs have through the service: the typed ClusterInfo, typed
requests and their refusals, PyG's typed ``input_nodes`` and ``num_neighbors`` forms,
node types without features or without nodes in a partition, servers as processes.
What both kinds share is tested on both in test_service.py."""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from graph_fixtures import load_all, node_maps, tiny_typed
from in_process_servers import served, server_config
from test_limits import METHODS, _structured, call_raw, mutated
from test_loader import TIMEOUTS
from torch_geometric.data import HeteroData

from partitioner.graph import EdgeType, TypedGraphData
from partitioner.writer import partition_graph
from protos import codec
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.channel import create_channel
from protos.epoch_call import stream_minibatches
from sampling_server.sampler import CpuNeighborSampler, batch_key
from sampling_server.server import create_server
from tests.server_procs import ServerProcs
from trainer_client.loader import RemoteNeighborLoader

FANOUTS = [3, 2]
DICT_FANOUTS: dict[EdgeType | str, list[int]] = {
    ("author", "writes", "paper"): [2, 2], "paper__rev_writes__author": [3, 1],
    "paper__cites__paper": [2, 0]}


@pytest.fixture(scope="module")
def graph() -> TypedGraphData:
    return tiny_typed().add_reverse()


@pytest.fixture(scope="module")
def one(graph: TypedGraphData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("typed-1")
    partition_graph(graph, 1, root, method="random", seed=0, progress=False)
    return root


@pytest.fixture(scope="module")
def two(graph: TypedGraphData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("typed-2")
    partition_graph(graph, 2, root, method="hash", seed=0, progress=False)
    return root


@pytest.fixture(scope="module")
def cluster(two: Path) -> Iterator[list[str]]:
    with served(two, 2) as addresses:
        yield addresses


def _edges(graph: TypedGraphData) -> dict[EdgeType, set[tuple[int, int]]]:
    return {et: set(zip(ei[0].tolist(), ei[1].tolist(), strict=True))
            for et, ei in graph.edge_index.items()}


def check_batch(graph: TypedGraphData, data: HeteroData, seed_type: str,
                input_nodes: torch.Tensor) -> None:
    """Fields, types and shapes of a typed batch, every edge in the original graph with
    its type and direction, features and labels equal to the original rows."""
    assert isinstance(data, HeteroData)
    assert set(data.node_types) == set(graph.node_types)
    assert set(data.edge_types) == set(graph.edge_types)
    seeds = data[seed_type].n_id[: data[seed_type].batch_size]
    assert torch.equal(seeds, input_nodes[data[seed_type].input_id])
    for t in graph.node_types:
        store = data[t]
        assert store.n_id.dtype == torch.int64 and store.n_id.shape == (store.num_nodes,)
        assert store.n_id.unique().numel() == store.num_nodes
        assert sum(store.num_sampled_nodes) == store.num_nodes
        assert data.num_sampled_nodes[t] == store.num_sampled_nodes
        assert "internal_n_id" not in store
        if t in graph.x:
            assert store.x.dtype == torch.float32
            assert torch.equal(store.x, torch.from_numpy(graph.x[t][store.n_id.numpy()]))
        else:
            assert "x" not in store
    assert torch.equal(data[graph.target_type].y,
                       torch.from_numpy(graph.y[data[graph.target_type].n_id.numpy()]))
    edges = _edges(graph)
    for et in graph.edge_types:
        ei = data[et].edge_index
        assert ei.dtype == torch.int64 and ei.shape == (2, sum(data[et].num_sampled_edges))
        src = data[et[0]].n_id[ei[0]].tolist()
        dst = data[et[2]].n_id[ei[1]].tolist()
        assert set(zip(src, dst, strict=True)) <= edges[et], et


# -- cluster facts and bad requests -----------------------------------------------------
def test_cluster_info_advertises_the_typed_graph(cluster: list[str], graph: TypedGraphData) -> None:
    with create_channel(cluster[1]) as channel:
        info = pb_grpc.SamplingServiceStub(channel).GetClusterInfo(pb.ClusterInfoRequest(), timeout=30)
    typed = info.typed
    assert typed.target_type == "paper" and info.format_version == 2 and info.num_classes == 3
    assert [n.name for n in typed.node_types] == list(graph.node_types)
    assert [(e.src, e.rel, e.dst) for e in typed.edge_types] == list(graph.edge_types)
    for n in typed.node_types:
        assert n.num_nodes == graph.num_nodes[n.name]
        assert n.feature_dim == (4 if n.name == "paper" else 0)
        assert n.feature_dtype == (pb.FLOAT32 if n.name == "paper" else pb.DTYPE_UNSPECIFIED)
        assert len(n.partition_book) == 3 and n.partition_book[-1] == n.num_nodes
    assert [e.num_edges for e in typed.edge_types] == [graph.num_edges(et) for et in graph.edge_types]
    assert info.num_nodes == 30 and info.feature_dim == 4 and info.hot_order == "visits_v1"
    assert sum(s.train for s in info.split_sizes) == len(graph.splits["train"])


def test_owned_ranges_of_every_node_type_give_original_ids_and_labels(
    cluster: list[str], graph: TypedGraphData
) -> None:
    """LookupNodes(owned_range, node_type): the type's original IDs in global ID order, the
    target type's labels, -1 for the other types; a range past the type's is refused."""
    with create_channel(cluster[1]) as channel:
        stub = pb_grpc.SamplingServiceStub(channel)
        info = stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=30)
        for node_type in info.typed.node_types:
            start, stop = node_type.partition_book[1], node_type.partition_book[2]
            reply = stub.LookupNodes(pb.LookupNodesRequest(
                owned_range=pb.NodeRange(first=start, count=stop - start),
                node_type=node_type.name), timeout=30)
            orig = codec.decode_tensor(reply.original_ids)
            labels = codec.decode_tensor(reply.labels)
            assert orig.shape == labels.shape == (stop - start,)
            assert np.unique(orig).size == orig.size
            assert orig.size == 0 or (orig.min() >= 0 and orig.max() < node_type.num_nodes)
            global_ids = stub.LookupNodes(pb.LookupNodesRequest(
                original_ids=codec.encode_tensor(orig), node_type=node_type.name), timeout=30)
            assert codec.decode_tensor(global_ids.global_ids).tolist() == list(range(start, stop))
            if node_type.name == "paper":
                assert labels.tolist() == graph.y[orig].tolist()
            else:
                assert (labels == -1).all()
            past = pb.LookupNodesRequest(owned_range=pb.NodeRange(first=start, count=stop - start + 1),
                                         node_type=node_type.name)
            got = _code(lambda r=past: stub.LookupNodes(r, timeout=30))
            assert got[0] == INVALID and f"global {node_type.name!r} IDs owned by partition 1" \
                in got[1], got


def test_typed_servers_start_without_errors(two: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A typed partition has no hot order; its server does not try to compute one."""
    with caplog.at_level(logging.INFO), served(two, 2) as addresses:
        assert len(addresses) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


def _typed_request(**kw: object) -> pb.EpochRequest:
    settings: dict[str, object] = {"split": "train", "fanouts": [2], "batch_size": 4,
                                   "world_size": 1}
    settings.update(kw)
    request = pb.EpochRequest(**settings)  # type: ignore[arg-type]
    request.typed.SetInParent()
    return request


def _code(call: object) -> tuple[grpc.StatusCode, str]:
    try:
        result = call()  # type: ignore[operator]
        if not isinstance(result, pb.ClusterInfo | pb.LookupNodesReply):
            list(result)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


def _epoch_cases() -> list[tuple[pb.EpochRequest, grpc.StatusCode, str]]:
    untyped = pb.EpochRequest(split="train", fanouts=[2], batch_size=4, world_size=1)
    both = _typed_request()
    both.typed.edge_fanouts.add(edge_type="author__writes__paper", fanouts=[2])
    unknown = _typed_request(fanouts=[])
    unknown.typed.edge_fanouts.add(edge_type="paper__sells__paper", fanouts=[2])
    hops = _typed_request(fanouts=[])
    hops.typed.edge_fanouts.add(edge_type="author__writes__paper", fanouts=[2])
    hops.typed.edge_fanouts.add(edge_type="paper__cites__paper", fanouts=[2, 2])
    seed_type = _typed_request()
    seed_type.typed.seed_type = "venue"
    split_of_author = _typed_request()
    split_of_author.typed.seed_type = "author"
    over = _typed_request(fanouts=[])
    over.typed.edge_fanouts.add(edge_type="paper__cites__paper", fanouts=[2**31 - 1])
    return [
        (over, INVALID, "--max-fanout"),
        (untyped, PRECONDITION, "EpochRequest.typed"),
        (both, INVALID, "EpochRequest.fanouts"),
        (unknown, INVALID, "EpochRequest.typed.edge_fanouts[0].edge_type"),
        (hops, INVALID, "same number of hops"),
        (seed_type, INVALID, "EpochRequest.typed.seed_type"),
        (split_of_author, INVALID, "EpochRequest.typed.seed_type"),
        (_typed_request(fanouts=[2, -3]), INVALID, "EpochRequest.fanouts"),
        (_typed_request(cache_counts=[1, 1]), INVALID, "EpochRequest.cache_counts"),
        (_typed_request(typed_cache_counts=[pb.TypedCounts(name="author", counts=[1, 1])]),
         INVALID, "EpochRequest.typed_cache_counts[0].name"),
        (_typed_request(typed_cache_counts=[pb.TypedCounts(name="venue", counts=[1, 1])]),
         INVALID, "EpochRequest.typed_cache_counts[0].name"),
        (_typed_request(typed_cache_counts=[pb.TypedCounts(name="paper", counts=[1])]),
         INVALID, "EpochRequest.typed_cache_counts[0].counts"),
        (_typed_request(typed_cache_counts=[pb.TypedCounts(name="paper")]),
         INVALID, "EpochRequest.typed_cache_counts[0].counts"),
        (_typed_request(typed_cache_counts=[pb.TypedCounts(name="paper", counts=[1, 10**6])]),
         INVALID, "EpochRequest.typed_cache_counts[0].counts[1]"),
        (_typed_request(typed_cache_counts=[pb.TypedCounts(name="paper", counts=[1, 1]),
                                            pb.TypedCounts(name="paper", counts=[1, 1])]),
         INVALID, "EpochRequest.typed_cache_counts[1].name"),
        (_typed_request(typed_cache_counts=[pb.TypedCounts(name="paper", counts=[1, 1])],
                        include_features=True, expect=pb.ServerExpectation(hot_order="visits_v1")),
         PRECONDITION, "EpochRequest.expect"),
        (_typed_request(sampling=pb.SamplingOptions(weighted=True)), PRECONDITION,
         "EpochRequest.sampling.weighted"),
        (_typed_request(feature_dtype=pb.INT8), INVALID, "EpochRequest.feature_dtype"),
        (_typed_request(expect=pb.ServerExpectation(graph_fingerprint="0" * 64)), PRECONDITION,
         "EpochRequest.expect.graph_fingerprint"),
    ]


def test_bad_typed_requests_get_clear_errors(cluster: list[str]) -> None:
    nodes = codec.encode_tensor(np.zeros(1, np.int64))
    with create_channel(cluster[0]) as channel:
        stub = pb_grpc.SamplingServiceStub(channel)
        peer = pb_grpc.PeerServiceStub(channel)
        for request, code, field in _epoch_cases():
            got = _code(lambda r=request: stream_minibatches(channel, r, timeout=30))
            assert got[0] == code and field in got[1], (field, got)
        cases = [
            (lambda: peer.SampleNeighbors(pb.SampleNeighborsRequest(nodes=nodes, fanout=2),
                                          timeout=30), "SampleNeighborsRequest.edge_type"),
            (lambda: peer.SampleNeighbors(pb.SampleNeighborsRequest(
                nodes=nodes, fanout=2, edge_type="paper__x__paper"), timeout=30),
             "SampleNeighborsRequest.edge_type"),
            (lambda: peer.SampleNeighbors(pb.SampleNeighborsRequest(
                nodes=codec.encode_tensor(np.array([10**6])), fanout=2,
                edge_type="author__writes__paper"), timeout=30), "SampleNeighborsRequest.nodes"),
            (lambda: peer.FetchNodeData(pb.FetchNodeDataRequest(nodes=nodes, want_labels=True),
                                        timeout=30), "FetchNodeDataRequest.node_type"),
            (lambda: peer.FetchNodeData(pb.FetchNodeDataRequest(
                nodes=nodes, want_features=True, node_type="author"), timeout=30),
             "FetchNodeDataRequest.want_features"),
            (lambda: peer.FetchNodeData(pb.FetchNodeDataRequest(
                nodes=nodes, want_labels=True, node_type="topic"), timeout=30),
             "FetchNodeDataRequest.want_labels"),
            (lambda: stub.LookupNodes(pb.LookupNodesRequest(original_ids=nodes, node_type="venue"),
                                      timeout=30), "LookupNodesRequest.node_type"),
        ]
        for call, field in cases:
            got = _code(call)
            assert got[0] == INVALID and field in got[1], (field, got)
        hot_cases = [
            (pb.HotNodesRequest(count=1, node_type="venue"), "HotNodesRequest.node_type"),
            (pb.HotNodesRequest(count=1, node_type="author", include_features=True),
             "HotNodesRequest.node_type"),
            (pb.HotNodesRequest(count=10**6, node_type="author"), "HotNodesRequest.count"),
        ]
        for hot, field in hot_cases:
            got = _code(lambda r=hot: stub.StreamHotNodes(r, timeout=30))
            assert got[0] == INVALID and field in got[1], (field, got)
        # the server goes on serving
        info = _code(lambda: stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=30))
        assert info[0] == grpc.StatusCode.OK


def test_bad_typed_loader_arguments_are_refused(cluster: list[str]) -> None:
    cases: list[tuple[dict[str, object], str]] = [
        ({"input_nodes": ("venue", [0])}, "input_nodes"),
        ({"num_neighbors": {"paper__sells__paper": [2]}}, "num_neighbors"),
        ({"num_neighbors": {"paper__cites__paper": [2], "author__writes__paper": [2, 2]}},
         "num_neighbors"),
        ({"cache_size": "lots"}, "cache_size"),
        ({"input_nodes": ("author", [0, 0])}, "input_nodes"),
        ({"input_nodes": ("author", [1000])}, "input_nodes"),
    ]
    for kwargs, field in cases:
        settings: dict[str, object] = {"num_neighbors": FANOUTS, "batch_size": 4, **TIMEOUTS}
        settings.update(kwargs)
        with pytest.raises(ValueError, match=field):
            RemoteNeighborLoader(cluster, **settings)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split"):
        RemoteNeighborLoader(cluster, "train", input_nodes=("author", [0]), num_neighbors=[2],
                             batch_size=4, **TIMEOUTS)


# -- batches ------------------------------------------------------------------------------
@pytest.mark.parametrize("input_nodes", ["train", ("author", None)])
def test_loader_yields_hetero_data_of_the_original_graph(
        cluster: list[str], graph: TypedGraphData, input_nodes: object) -> None:
    num_neighbors = FANOUTS if input_nodes == "train" else DICT_FANOUTS
    seed_type = "paper" if input_nodes == "train" else "author"
    with RemoteNeighborLoader(cluster, input_nodes=input_nodes, num_neighbors=num_neighbors,  # type: ignore[arg-type]
                              batch_size=4, shuffle=True, **TIMEOUTS) as loader:
        assert loader.metadata() == (list(graph.node_types), list(graph.edge_types))
        assert loader.typed_graph is not None and loader.typed_graph.feature_dims["author"] == 0
        seen = []
        for data in loader:
            check_batch(graph, data, seed_type, loader.input_nodes)
            assert data[seed_type].batch_size <= 4
            seen.append(data[seed_type].n_id[: data[seed_type].batch_size])
        want = graph.splits["train"] if seed_type == "paper" else np.arange(graph.num_nodes["author"])
        assert sorted(torch.cat(seen).tolist()) == sorted(want.tolist())


def test_compact_typed_batches_are_narrow_on_the_wire_and_the_same_decoded(
        cluster: list[str]) -> None:
    """compact_indices on a typed request: IDs travel as INT32, each relation's edges as
    INT32 sources (less those marked as first reaching a node) plus narrow per-target
    counts, labels as INT8 and cache masks as bits (test_service.py: the loader's batches
    are the int64 batches)."""
    request = _typed_request(include_labels=True, include_original_ids=True, compact_indices=True,
                             include_features=True, fanouts=[3, 2])
    request.typed_cache_counts.add(name="paper", counts=[3, 3])
    with create_channel(cluster[0]) as channel:
        chunks = list(stream_minibatches(channel, request, timeout=30))
    dtypes = {t.name: t.dtype for c in chunks for t in c.tensors}
    assert dtypes, "no batches"
    for name, dtype in dtypes.items():
        kind = name.split("/")[0]
        want = {"n_id": pb.INT32, "orig_id": pb.INT32, "edge_src": pb.INT32, "edge_count": pb.UINT8,
                "edge_new": pb.UINT8, "y": pb.INT8, "x_cached": pb.UINT8, "x": pb.FLOAT32}[kind]
        assert dtype == want, (name, dtype)
    assert any(name.startswith("edge_new/") for name in dtypes)



@pytest.mark.gpu
def test_cuda_servers_send_the_cpu_sampler_batches(two: Path, one: Path,
                                                   graph: TypedGraphData) -> None:
    """On a real GPU: servers sampling with the typed CUDA sampler send the batches the
    whole-graph CPU sampler draws (the simulator serves one thread only, so not in CI)."""
    whole = CpuNeighborSampler(load_all(one)[0])
    maps = node_maps(one, graph)
    with served(two, 2, device="cuda") as addresses, RemoteNeighborLoader(
            addresses, input_nodes="train", num_neighbors=FANOUTS, batch_size=7,
            **TIMEOUTS) as loader:
        for i, data in enumerate(loader):
            seeds = data["paper"].n_id[: data["paper"].batch_size].numpy()
            want = whole.minibatch(maps["paper"][seeds], "paper", FANOUTS, batch_key(0, 0, 0, i))
            assert torch.equal(data["paper"].x, want.x["paper"])
            for t in graph.node_types:
                assert torch.equal(data[t].n_id, want.orig_id[t]), (i, t)
            for et in graph.edge_types:
                assert torch.equal(data[et].edge_index, want.structure.edge_index(et)), (i, et)


def test_a_partition_without_nodes_of_a_featured_type_serves(tmp_path: Path) -> None:
    """Topics with features, all of them in one range partition: the other partitions'
    servers hold a [0, F] table for them and still serve (and answer their peers)."""
    graph = tiny_typed()
    graph.x["topic"] = np.random.default_rng(1).standard_normal((6, 2)).astype(np.float64)
    graph = graph.add_reverse()
    root = tmp_path / "range-3"
    partition_graph(graph, 3, root, method="range", seed=0, progress=False)
    books = [part.node_range("topic") for part in load_all(root)]
    assert any(stop == start for start, stop in books)  # a partition without topics
    with served(root, 3) as addresses, RemoteNeighborLoader(
            addresses, input_nodes="train", num_neighbors=[-1, -1], batch_size=4, **TIMEOUTS) as loader:
        topics = 0
        for data in loader:
            n_id = data["topic"].n_id.numpy()
            assert torch.equal(data["topic"].x, torch.from_numpy(graph.x["topic"][n_id]).float())
            topics += n_id.size
        assert topics > 0


def test_peers_listed_in_the_wrong_order_are_refused(two: Path) -> None:
    """The typed servers check their peers' identity as the homogeneous ones do."""
    built = [create_server(server_config(two, p)) for p in range(2)]
    addresses = [f"127.0.0.1:{port}" for _, port in built]
    servers = [s for s, _ in built]
    try:
        for s in servers:
            s.set_peers(addresses[::-1] if s is servers[0] else addresses)
            s.start()
        monitor = servers[0].monitor
        assert monitor is not None
        deadline = time.monotonic() + 60
        while monitor.problem is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert monitor.problem is not None and "serves partition 0" in monitor.problem
        assert not servers[0].wait_until_serving(0.5)
    finally:
        for s in servers:
            s.stop(None).wait(10)


def test_typed_arguments_on_a_homogeneous_graph_are_refused(tmp_path: Path) -> None:
    from partitioner import partition_graph
    from partitioner.synthetic import generate

    partition_graph(generate("small", progress=False), 1, tmp_path, method="range", progress=False)
    with served(tmp_path, 1) as addresses:
        with pytest.raises(ValueError, match="homogeneous"):
            RemoteNeighborLoader(addresses, num_neighbors={"a__b__c": [2]}, batch_size=4, **TIMEOUTS)
        with pytest.raises(ValueError, match="homogeneous"):
            RemoteNeighborLoader(addresses, input_nodes=("paper", [0]), num_neighbors=[2],
                                 batch_size=4, **TIMEOUTS)
        with create_channel(addresses[0]) as channel:
            code, details = _code(lambda: stream_minibatches(channel,
                _typed_request(), timeout=30))
            assert code == INVALID and "EpochRequest.typed" in details
            stub = pb_grpc.SamplingServiceStub(channel)
            code, details = _code(lambda: stream_minibatches(channel, pb.EpochRequest(
                split="train", fanouts=[2], batch_size=4, world_size=1,
                typed_cache_counts=[pb.TypedCounts(name="paper", counts=[1])]), timeout=30))
            assert code == INVALID and "EpochRequest.typed_cache_counts" in details
            code, details = _code(lambda: stub.StreamHotNodes(pb.HotNodesRequest(
                count=1, node_type="paper"), timeout=30))
            assert code == INVALID and "HotNodesRequest.node_type" in details
            peer = pb_grpc.PeerServiceStub(channel)
            code, details = _code(lambda: peer.SampleNeighbors(pb.SampleNeighborsRequest(
                nodes=codec.encode_tensor(np.zeros(1, np.int64)), fanout=2,
                edge_type="a__b__c"), timeout=30))
            assert code == INVALID and "SampleNeighborsRequest.edge_type" in details


# -- real processes, with a token ---------------------------------------------------------
def test_server_processes_serve_typed_batches_with_a_token(
        two: Path, graph: TypedGraphData, one: Path, tmp_path: Path) -> None:
    """Two server processes guarded by a bearer token: the typed peer calls carry it, a
    peer call without it is refused, and the batches equal the whole-graph sampler's."""
    token = tmp_path / "token"
    token.write_text("typed-secret\n")
    procs = ServerProcs(two, 2, "--device", "cpu", "--token-file", str(token), log_dir=tmp_path)
    procs.start()
    try:
        for p in range(2):
            procs.wait_status(p, "SERVING", timeout=120)
        with create_channel(procs.addresses[1]) as channel:
            code, _ = _code(lambda: pb_grpc.PeerServiceStub(channel).SampleNeighbors(
                pb.SampleNeighborsRequest(nodes=codec.encode_tensor(np.zeros(1, np.int64)),
                                          fanout=2, edge_type="author__writes__paper"), timeout=30))
            assert code == grpc.StatusCode.UNAUTHENTICATED
        whole = CpuNeighborSampler(load_all(one)[0])
        maps = node_maps(one, graph)
        request = _typed_request(split="", fanouts=FANOUTS, batch_size=6, global_batches=True,
                                 include_features=True, include_labels=True,
                                 include_original_ids=True)
        seeds = node_maps(two, graph)["paper"][graph.splits["train"]]
        request.seeds.CopyFrom(codec.encode_tensor(seeds))
        metadata = (("authorization", "Bearer typed-secret"),)
        with create_channel(procs.addresses[0]) as channel:
            chunks = list(stream_minibatches(channel,
                request, timeout=120, metadata=metadata))
        assert chunks and all(c.num_chunks == 1 for c in chunks)  # tiny batches: one message
        for c in chunks:  # partition 0's batches of rank 0: 0, 2, ...
            named = {t.name: codec.decode_tensor(pb.Tensor(dtype=t.dtype, shape=t.shape, data=t.data))
                     for t in c.tensors}
            i = c.batch_index
            want = whole.minibatch(maps["paper"][graph.splits["train"][6 * i:6 * i + 6]], "paper",
                                   FANOUTS, batch_key(0, 0, 0, i))
            for t in graph.node_types:
                assert np.array_equal(named[f"orig_id/{t}"], want.orig_id[t].numpy()), (i, t)
            assert np.array_equal(named["x/paper"], want.x["paper"].numpy())
            for et in graph.edge_types:
                name = f"edge_index/{et[0]}__{et[1]}__{et[2]}"
                assert np.array_equal(named[name], want.structure.edge_index(et).numpy())
    finally:
        assert procs.stop() == [0, 0]


# -- fuzz ---------------------------------------------------------------------------------
def _typed_structured(rng: random.Random, method: str) -> bytes:
    """A well-formed typed message of ``method`` with names and values from edge cases."""
    names = ["", "paper", "author", "venue", "author__writes__paper", "paper__cites__paper",
             "a__b", "x" * 5000, "paper\n__cites__paper"]
    if method == "StreamMinibatches":
        wrapped = pb.StreamMinibatchesRequest.FromString(_structured(rng, method))
        msg = wrapped.epoch
        msg.typed.seed_type = rng.choice(names)
        for _ in range(rng.choice([0, 1, 3])):
            msg.typed.edge_fanouts.add(edge_type=rng.choice(names),
                                       fanouts=[rng.choice([-2, -1, 0, 2, 10**6])
                                                for _ in range(rng.choice([0, 1, 2, 40]))])
        for _ in range(rng.choice([0, 0, 1, 2])):
            msg.typed_cache_counts.add(name=rng.choice(names),
                                       counts=[rng.choice([-1, 0, 1, 10**6])
                                               for _ in range(rng.choice([0, 1, 2, 3]))])
        return wrapped.SerializeToString()
    if method == "SampleNeighbors":
        sample = pb.SampleNeighborsRequest.FromString(_structured(rng, method))
        sample.edge_type = rng.choice(names)
        return sample.SerializeToString()
    if method == "StreamHotNodes":
        hot = pb.HotNodesRequest.FromString(_structured(rng, method))
        hot.node_type = rng.choice(names)
        return hot.SerializeToString()
    if method in ("FetchNodeData", "LookupNodes"):
        kind = pb.FetchNodeDataRequest if method == "FetchNodeData" else pb.LookupNodesRequest
        node = kind.FromString(_structured(rng, method))
        node.node_type = rng.choice(names)
        return node.SerializeToString()
    return _structured(rng, method)


def test_fuzzed_typed_requests_never_get_internal_or_unknown(cluster: list[str]) -> None:
    rng = random.Random(5)
    codes: Counter[str] = Counter()
    with grpc.insecure_channel(cluster[0]) as channel:
        for _ in range(600):
            method = rng.choice(list(METHODS))
            codes[call_raw(channel, method,
                           mutated(rng, lambda m=method: _typed_structured(rng, m))).name] += 1
    assert codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0, codes
    with create_channel(cluster[0]) as channel:  # still serving
        assert pb_grpc.SamplingServiceStub(channel).GetClusterInfo(
            pb.ClusterInfoRequest(), timeout=30).HasField("typed")


def _typed_name(kind: str, key: str | tuple[str, str, str]) -> str:
    return f"{kind}/{key if isinstance(key, str) else '__'.join(key)}"


def test_compact_typed_edges_fall_back_when_not_grouped_by_target() -> None:
    from protos.compact import expand_typed_sources
    from sampling_server.produce import structure_tensors
    from sampling_server.sampler.types import SamplerOutput
    from trainer_client.batch_checks import TypedSpec, _expanded
    from trainer_client.decode import BatchDecodeError

    # one hop from 2 seeds of type b: relation a->b reaches 3 new a nodes (0, 1, 2) in edge
    # order and a again; b->a's edges are not grouped by target
    grouped = torch.tensor([[0, 1, 0, 2], [0, 0, 1, 1]])
    scattered = torch.tensor([[1, 0, 1], [1, 0, 1]])
    edges = {"a__r__b": [4], "b__s__a": [3]}
    ab, ba = ("a", "r", "b"), ("b", "s", "a")
    spec = TypedSpec(("a", "b"), (ab, ba), {}, "b", "b")
    sampled = SamplerOutput(input_type="b", node={"a": torch.arange(3), "b": torch.arange(2)},
                            row={ab: grouped[0], ba: scattered[0]}, col={ab: grouped[1], ba: scattered[1]},
                            num_sampled_nodes={"a": [0, 3], "b": [2, 0]},
                            num_sampled_edges={ab: [4], ba: [3]})
    out = structure_tensors(sampled, _typed_name, compact_form=True)
    assert sorted(k for k in out if not k.startswith("n_id")) == [
        "edge_count/a__r__b", "edge_index/b__s__a", "edge_new/a__r__b", "edge_src/a__r__b"]
    tensors = {k: torch.as_tensor(v) for k, v in out.items()}
    assert tensors["edge_count/a__r__b"].tolist() == [2, 2]
    assert tensors["edge_src/a__r__b"].tolist() == [0]  # the one edge that reaches a again
    assert tensors["edge_new/a__r__b"].tolist() == [0b1011]
    assert tensors["edge_index/b__s__a"].dtype == torch.int32
    sources = expand_typed_sources({"a__r__b": tensors["edge_src/a__r__b"]},
                                   {"a__r__b": tensors["edge_new/a__r__b"]}, edges, 0, 3)
    assert torch.equal(_expanded(tensors, spec, ab, 4, 2, "batch 0", sources["a__r__b"]),
                       grouped)
    with pytest.raises(ValueError, match="edge_new"):  # marks one new node too few
        expand_typed_sources({"a__r__b": torch.tensor([0, 2])},
                             {"a__r__b": torch.tensor([0b0011], dtype=torch.uint8)}, edges, 0, 3)
    tensors["edge_count/a__r__b"] = torch.tensor([2, 1], dtype=torch.uint8)
    with pytest.raises(BatchDecodeError, match="edge_count/a__r__b"):
        _expanded(tensors, spec, ab, 4, 2, "batch 0", sources["a__r__b"])
    # sources not numbered as a sampler numbers them: every source travels
    def one_relation(row: list[int], col: list[int], a: list[int], b: list[int]) -> dict[str, object]:
        sampled = SamplerOutput(input_type="b", node={"a": torch.arange(sum(a)), "b": torch.arange(sum(b))},
                                row={ab: torch.tensor(row)}, col={ab: torch.tensor(col)},
                                num_sampled_nodes={"a": a, "b": b}, num_sampled_edges={ab: [len(row)]})
        named = structure_tensors(sampled, _typed_name, compact_form=True)
        return {k: v for k, v in named.items() if not k.startswith("n_id")}

    renumbered = one_relation([2, 1, 0, 0], [0, 0, 1, 1], [0, 3], [2, 0])
    assert "edge_new/a__r__b" not in renumbered
    assert renumbered["edge_src/a__r__b"].tolist() == [2, 1, 0, 0]  # type: ignore[attr-defined]
    # a target past the frontier: not grouped as the samplers group them
    late = one_relation([0], [5], [0, 1], [3, 0])
    assert list(late) == ["edge_index/a__r__b"]
