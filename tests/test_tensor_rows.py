"""Node tensor rows delivered with a batch (``EpochRequest.node_tensors``): every batch
carries each named tensor's rows of its nodes of the tensor's type, as the tables hold
them, whichever partition owns them (1 and 3 partitions, both kinds of graph, one-hop
and two-hop batches); ``IN_DEGREE`` tables hold each node's in-degree without
self-loops; ``every_node`` batches cover every node of a type once, without a list of
seeds; bad requests are refused naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from graph_fixtures import KINDS, AnyGraph, mixed, typed_view
from in_process_servers import serving

from partitioner import partition_graph
from protos import codec
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.channel import GraphfeedError
from trainer_client import Cluster
from trainer_client.loader import RemoteNeighborLoader
from trainer_client.node_tensors import RemoteNodeTensor, row_init


@pytest.fixture(scope="module", params=[(k, p) for k in KINDS for p in (1, 3)],
                ids=lambda k: f"{k[0]}-{k[1]}")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[AnyGraph, Cluster]]:
    kind, parts = request.param
    graph = mixed(kind)
    root = tmp_path_factory.mktemp(f"{kind}-{parts}")
    partition_graph(graph, parts, root, method="random", progress=False)
    with serving(root, parts, state_dir=tmp_path_factory.mktemp("state")) as (addresses, _), \
            Cluster(addresses) as connected:
        yield graph, connected


def _stores(batch: object, types: list[str], typed: bool) -> dict[str, object]:
    return {t: batch[t] for t in types} if typed else {types[0]: batch}  # type: ignore[index]


@pytest.mark.parametrize("hops", [[-1], [2, 2]])
def test_every_batch_carries_the_rows_of_its_nodes_as_the_tables_hold_them(
        cluster: tuple[AnyGraph, Cluster], hops: list[int]) -> None:
    _, c = cluster
    types = list(c.graph.node_types)
    tables = [RemoteNodeTensor(c, f"rows-{t}", (3,), node_type=t, init=row_init("uniform", 1.0, 5))
              for t in types]
    scalar = RemoteNodeTensor(c, "scalar", (), dtype=torch.float64, init=row_init("normal", 2.0, 1))
    some = torch.arange(0, int(tables[0].book[-1]), 3)
    tables[0].write(some, torch.full((some.numel(), 3), 7.0))  # rows as written
    loader = RemoteNeighborLoader(c, input_nodes=c.graph.target_type, num_neighbors=hops, batch_size=9,
                                  batches="partition", include_features=False, return_internal_ids=True,
                                  node_tensors={"h": tables, "s": scalar.name})
    assert loader.every_node
    seen = 0
    for batch in loader:
        stores = _stores(batch, types, c.graph.typed)
        for t, table in zip(types, tables, strict=True):
            store = stores[t]
            assert "x" not in store
            assert torch.equal(store.h, table.read(store.internal_n_id))  # type: ignore[attr-defined]
        target = stores[c.graph.target_type]
        assert torch.equal(target.s, scalar.read(target.internal_n_id))  # type: ignore[attr-defined]
        seen += int(target.batch_size)  # type: ignore[attr-defined]
    assert seen == c.graph.num_nodes[c.graph.target_type]
    for table in [*tables, scalar]:
        table.drop(forget=True)
        table.close()


def test_every_node_batches_cover_each_node_of_the_type_once(cluster: tuple[AnyGraph, Cluster]) -> None:
    _, c = cluster
    for t in c.graph.node_types:
        loader = RemoteNeighborLoader(c, input_nodes=t, num_neighbors=[0], batch_size=5, batches="partition",
                                      include_features=False)
        seeds = []
        for batch in loader:
            store = batch[t] if c.graph.typed else batch
            assert torch.equal(store.input_id, store.n_id[:store.batch_size])
            seeds.append(store.n_id[:store.batch_size])
        assert torch.equal(torch.sort(torch.cat(seeds)).values, torch.arange(c.graph.num_nodes[t]))
        assert loader.num_seeds == c.graph.num_nodes[t] and len(loader.input_nodes) == c.graph.num_nodes[t]


def test_in_degree_rows_count_each_nodes_in_edges_but_self_loops(cluster: tuple[AnyGraph, Cluster]) -> None:
    graph, c = cluster
    typed = typed_view(graph)
    for t in c.graph.node_types:
        table = RemoteNodeTensor(c, f"deg-{t}", (), node_type=t, dtype=torch.int64,
                                 init=row_init("in_degree"))
        want = np.zeros(typed.num_nodes[t], dtype=np.int64)
        for (src, _, dst), ei in typed.edge_index.items():
            if dst == t:
                keep = ei[0] != ei[1] if src == dst else np.ones(ei.shape[1], dtype=bool)
                want += np.bincount(ei[1][keep], minlength=want.size)
        got = table.read(table.global_ids(np.arange(want.size)))
        assert np.array_equal(got.numpy(), want), t
        table.close()


def test_bad_requests_are_refused_naming_the_field(cluster: tuple[AnyGraph, Cluster]) -> None:
    _, c = cluster
    gone = RemoteNodeTensor(c, "gone", (2,))
    gone.drop(forget=True)  # the loader counts on it: the servers refuse, naming it
    with pytest.raises(GraphfeedError, match=r"NOT_FOUND.*EpochRequest.node_tensors\[0\].*'gone'"):
        next(iter(RemoteNeighborLoader(c, input_nodes=c.graph.target_type, num_neighbors=[1], batch_size=4,
                                       batches="partition", node_tensors={"h": gone})))
    gone.close()
    with pytest.raises(GraphfeedError, match=r"FindNodeTensor.*NOT_FOUND.*'missing'"):
        next(iter(RemoteNeighborLoader(c, input_nodes=c.graph.target_type, num_neighbors=[1], batch_size=4,
                                       batches="partition", node_tensors={"h": "missing"})))
    stub = pb_grpc.NodeTensorServiceStub(c.channel(0))
    with pytest.raises(grpc.RpcError) as info:
        stub.CreateNodeTensor(pb.CreateNodeTensorRequest(spec=pb.NodeTensorSpec(
            name="deg-wide", dims=[2], dtype=pb.INT64, init=pb.RowInit(kind=pb.RowInit.IN_DEGREE))),
            timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "NodeTensorSpec.dims: expected one value per node with IN_DEGREE" in str(info.value.details())
    with pytest.raises(ValueError, match="node_tensors: expected attribute names a batch does not use"):
        RemoteNeighborLoader(c, input_nodes=c.graph.target_type, num_neighbors=[1], batch_size=4,
                             batches="partition", node_tensors={"x": "anything"}).stream()
    request = pb.EpochRequest(fanouts=[1], batch_size=4, world_size=1, every_node=pb.EveryNode(),
                              node_tensors=["a", "a"])
    if c.graph.typed:
        request.typed.seed_type = c.graph.target_type
    with pytest.raises(grpc.RpcError) as info:
        next(iter(pb_grpc.SamplingServiceStub(c.channel(0)).StreamMinibatches(
            iter([pb.StreamMinibatchesRequest(epoch=request)]), timeout=30)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "EpochRequest.node_tensors: expected each name once" in str(info.value.details())
    fetch = pb.FetchNodeDataRequest(nodes=codec.encode_tensor(np.zeros(0, np.int64)), node_tensor="missing",
                                    node_type=c.graph.target_type if c.graph.typed else "")
    with pytest.raises(grpc.RpcError) as info:
        list(pb_grpc.PeerServiceStub(c.channel(0)).FetchNodeData(fetch, timeout=30))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "FetchNodeDataRequest.node_tensor" in str(info.value.details())



def test_a_one_hop_pass_over_every_node_is_bounded_by_its_batches_in_degrees(tmp_path: Path) -> None:
    """The limit on a batch's edges counts, for one hop of owned seeds, the in-degrees of
    the seeds of its worst batch, not every edge of the graph: a pass over every node with
    every neighbor fits limits far below the graph's edges; two hops still count them all."""
    graph = mixed("plain")
    partition_graph(graph, 2, tmp_path / "parts", method="range", progress=False)
    degrees = np.bincount(graph.edge_index[1], minlength=graph.num_nodes)
    limit = int(degrees.max()) + 8  # the hub alone nearly fills a batch
    with serving(tmp_path / "parts", 2, max_batch_edges=limit) as (addresses, _), Cluster(addresses) as c:
        assert graph.edge_index.shape[1] > limit
        seen = 0
        for batch in RemoteNeighborLoader(c, input_nodes=c.graph.target_type, num_neighbors=[-1],
                                          batch_size=2, batches="partition", include_features=False):
            assert batch.edge_index.shape[1] <= limit
            seen += int(batch.batch_size)
        assert seen == graph.num_nodes
        for hops, size in (([-1], 16), ([-1, -1], 2)):
            with pytest.raises(GraphfeedError, match=r"may sample \d+ edges per batch; expected at most "
                                                     rf"{limit} \(server limit --max-batch-edges"):
                next(iter(RemoteNeighborLoader(c, input_nodes=c.graph.target_type, num_neighbors=hops,
                                               batch_size=size, batches="partition")))
