"""Edge IDs and edge features through the service, for both kinds of graph: every
sampled edge's ``e_id`` is its column in the input's ``edge_index`` and its
``edge_attr`` that column's features, aligned with ``edge_index`` whatever the
partitioning, the wire form or the servers' peers; GINE and GAT take them."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from graph_fixtures import KINDS, AnyGraph, mixed, typed_view
from in_process_servers import served
from torch_geometric.data import Data, HeteroData

from partitioner.format import load_partition
from partitioner.graph import EdgeType, GraphData, TypedGraphData, edge_type_name
from partitioner.manifest import read_manifest
from partitioner.synthetic import generate
from partitioner.writer import partition_graph
from protos import codec
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.assembler import TensorAssembler
from protos.channel import create_channel
from sampling_server.sampler import CpuNeighborSampler
from trainer_client.loader import RemoteNeighborLoader
from trainer_client.models import NodeClassifier, batch_inputs
from trainer_client.train import main as train_main

FANOUTS = [3, 2]


def with_edge_attr(graph: AnyGraph) -> AnyGraph:
    """``graph`` with edge features that name their edge: row ``e`` of a relation holds
    ``e`` and ``-e / 8`` (a plain graph: two columns; typed: widths 2, 3, none and 1-d)."""
    if isinstance(graph, GraphData):
        e = np.arange(graph.num_edges, dtype=np.float32)
        graph.edge_attr = np.stack([e, -e / 8], axis=1)
        return graph
    assert isinstance(graph, TypedGraphData)
    widths = [2, 3, 0, 1]
    for et, width in zip(list(graph.edge_index), widths, strict=True):
        e = np.arange(graph.edge_index[et].shape[1], dtype=np.float32)
        if width == 1:
            graph.edge_attr[et] = e.copy()  # one value per edge: [E]
        elif width:
            graph.edge_attr[et] = np.stack([e - k / 8 for k in range(width)], axis=1)
    return graph


def _stores(batch: Data | HeteroData) -> dict:
    """Edge type -> (its store, source store, destination store)."""
    if isinstance(batch, HeteroData):
        return {et: (batch[et], batch[et[0]], batch[et[2]]) for et in batch.edge_types}
    return {None: (batch, batch, batch)}


def check_batch(graph: AnyGraph, batch: Data | HeteroData, features: bool) -> int:
    """Assert every sampled edge is the input's edge ``e_id`` (its ends in original IDs)
    with that edge's features; returns the edges checked."""
    typed = typed_view(graph)
    checked = 0
    for et, (store, src, dst) in _stores(batch).items():
        key = et if et is not None else next(iter(typed.edge_index))
        edge_index = np.asarray(typed.edge_index[key])
        e_id = store.e_id.numpy()
        assert store.e_id.dtype == torch.int64 and e_id.shape == (store.edge_index.shape[1],)
        ends = np.stack([src.n_id.numpy()[store.edge_index[0].numpy()],
                         dst.n_id.numpy()[store.edge_index[1].numpy()]])
        assert np.array_equal(edge_index[:, e_id], ends), key
        attr = typed.edge_attr.get(key)
        if features and attr is not None:
            assert np.array_equal(store.edge_attr.numpy(), attr[e_id]), key
        else:
            assert "edge_attr" not in store, key
        checked += e_id.size
    return checked


@pytest.mark.parametrize("kind", KINDS)
def test_every_sampled_edge_carries_its_original_id_and_features(kind: str, tmp_path: Path) -> None:
    graph = with_edge_attr(mixed(kind, weighted=False))
    root = tmp_path / "p2"
    partition_graph(graph, 2, root, method="range", progress=False)
    with served(root, 2) as addresses:
        checked = 0
        for compact in (True, False):
            with RemoteNeighborLoader(addresses, num_neighbors=FANOUTS, batch_size=6, edge_features=True,
                                      compact_indices=compact) as loader:
                for batch in loader:
                    checked += check_batch(graph, batch, features=True)
        with RemoteNeighborLoader(addresses, num_neighbors=FANOUTS, batch_size=6, edge_ids=True) as loader:
            for batch in loader:
                check_batch(graph, batch, features=False)
        assert checked > 100


@pytest.mark.parametrize("kind", KINDS)
def test_servers_holding_the_whole_structure_and_features_send_the_same_edge_rows(
        kind: str, tmp_path: Path) -> None:
    graph = with_edge_attr(mixed(kind, weighted=False))
    root = tmp_path / "p2"
    partition_graph(graph, 2, root, method="random", progress=False)
    runs = []
    for held in ({}, {"structure": "full", "features": "full"}):
        with served(root, 2, **held) as addresses, \
                RemoteNeighborLoader(addresses, num_neighbors=FANOUTS, batch_size=7, shuffle=True,
                                     edge_features=True) as loader:
            batches = list(loader)
        for batch in batches:
            check_batch(graph, batch, features=True)
        runs.append([torch.cat([s.e_id for s, _, _ in _stores(b).values()]) for b in batches])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_edge_rows_are_the_same_whatever_the_partitioning(kind: str, tmp_path: Path) -> None:
    graph = with_edge_attr(mixed(kind, weighted=False))
    runs = []
    for parts, method in ((1, "range"), (3, "random")):
        root = tmp_path / f"p{parts}"
        partition_graph(graph, parts, root, method=method, progress=False)
        with served(root, parts) as addresses, \
                RemoteNeighborLoader(addresses, num_neighbors=FANOUTS, batch_size=5, shuffle=True,
                                     edge_features=True, feature_dtype="float16") as loader:
            runs.append([{et: (s.e_id.clone(), s.edge_attr.clone() if "edge_attr" in s else None)
                          for et, (s, _, _) in _stores(b).items()} for b in loader])
    assert len(runs[0]) == len(runs[1]) > 0
    for one, three in zip(*runs, strict=True):
        for et, (e_id, attr) in one.items():
            assert torch.equal(e_id, three[et][0])
            assert (attr is None and three[et][1] is None) or torch.equal(attr, three[et][1])


def test_edge_features_are_refused_by_name_where_the_graph_has_none(tmp_path: Path) -> None:
    graph = mixed("plain", weighted=False)
    partition_graph(graph, 1, tmp_path, method="range", progress=False)
    with served(tmp_path, 1) as addresses, pytest.raises(ValueError, match="edge_features: expected a graph "
                                                                           "with edge features"):
        RemoteNeighborLoader(addresses, num_neighbors=FANOUTS, batch_size=4, edge_features=True)
    with pytest.raises(ValueError, match="edge_features: expected True, False or an attribute name"):
        RemoteNeighborLoader(["127.0.0.1:1"], num_neighbors=FANOUTS, batch_size=4, edge_features="2bad")


def test_edge_features_go_in_the_attribute_the_user_names(tmp_path: Path) -> None:
    graph = with_edge_attr(mixed("plain", weighted=False))
    partition_graph(graph, 2, tmp_path, method="range", progress=False)
    with served(tmp_path, 2) as addresses, \
            RemoteNeighborLoader(addresses, num_neighbors=FANOUTS, batch_size=8,
                                 edge_features="edge_feat") as loader:
        batch = next(iter(loader))
    assert "edge_attr" not in batch and batch.edge_feat.shape == (batch.edge_index.shape[1], 2)
    assert batch.edge_feat.dtype == torch.float32


@pytest.mark.parametrize("model", ["gine", "gat"])
def test_edge_models_take_the_batch_s_edge_features_and_trim_exactly(model: str, tmp_path: Path) -> None:
    graph = with_edge_attr(mixed("plain", weighted=False))
    partition_graph(graph, 2, tmp_path, method="range", progress=False)
    with served(tmp_path, 2) as addresses, \
            RemoteNeighborLoader(addresses, num_neighbors=FANOUTS, batch_size=8,
                                 edge_features=True) as loader:
        batch = next(iter(loader))
    torch.manual_seed(0)
    net = NodeClassifier(model, 6, 4, hidden_channels=8, num_layers=2, dropout=0.0, heads=2,
                         edge_dim=2).eval()
    x, edge_index, size, nodes, edges, attr = batch_inputs(batch)
    assert attr is not None
    trimmed = net(x, edge_index, size, nodes, edges, attr)
    whole = net(x, edge_index, size, None, None, attr)
    assert trimmed.shape == (size, 4)
    torch.testing.assert_close(trimmed, whole)
    shuffled = net(x, edge_index, size, None, None, attr[torch.randperm(attr.shape[0])])
    assert not torch.allclose(shuffled, whole)  # the features count
    with pytest.raises(ValueError, match="edge_attr: expected the batch's edge features"):
        net(x, edge_index, size)
    with pytest.raises(ValueError, match="'gine' needs edge features"):
        NodeClassifier("gine", 6, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_fetch_edge_data_answers_held_edges_in_slices_and_refuses_others_by_field(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer reads and sends its edge rows slice by slice (one message a slice of about
    ``chunk_bytes``), every row in the order asked, in the dtype asked."""
    graph = with_edge_attr(mixed(kind, weighted=False))
    partition_graph(graph, 2, tmp_path, method="range", progress=False)
    m = read_manifest(tmp_path)
    typed = typed_view(graph)
    et = next(iter(typed.edge_index))
    name = edge_type_name(et) if m.typed else ""
    book = m.edge_book(et)
    ids = np.random.default_rng(1).permutation(np.arange(book[0], book[1], dtype=np.int64))
    own = codec.encode_tensor(ids)
    foreign = codec.encode_tensor(np.array([book[1]], dtype=np.int64))
    read: list[int] = []
    rows_of = CpuNeighborSampler.edge_rows_local

    def counted(self: CpuNeighborSampler, edge_type: EdgeType, edges: torch.Tensor, *args: object) -> object:
        read.append(edges.numel())
        return rows_of(self, edge_type, edges, *args)

    monkeypatch.setattr(CpuNeighborSampler, "edge_rows_local", counted)
    with served(tmp_path, 2, chunk_bytes=256) as addresses:
        channel = create_channel(addresses[0])
        stub = pb_grpc.PeerServiceStub(channel)
        chunks = list(stub.FetchEdgeData(pb.FetchEdgeDataRequest(
            edges=own, edge_type=name, want_edge_ids=True, want_features=True, feature_dtype=pb.FLOAT16),
            timeout=10))
        assert len(chunks) > 2 and [(c.chunk_index, c.num_chunks) for c in chunks] == \
            [(k, len(chunks)) for k in range(len(chunks))]
        row_bytes = 8 + 2 * int(np.prod(typed.edge_attr[et].shape[1:]))
        assert len(read) == len(chunks) and sum(read) == ids.size and max(read) * row_bytes <= 256
        assembler = TensorAssembler()
        for c in chunks:
            assembler.add_all(c.tensors)
        got = assembler.finish(expected={"e_id", "edge_attr"})
        part = load_partition(tmp_path, 0)
        assert np.array_equal(got["e_id"], np.asarray(part.e_id[et])[ids - book[0]])
        assert got["edge_attr"].dtype == np.float16
        assert np.array_equal(got["edge_attr"], typed.edge_attr[et][got["e_id"]].astype(np.float16))
        cases = [(pb.FetchEdgeDataRequest(edges=foreign, edge_type=name, want_edge_ids=True),
                  "FetchEdgeDataRequest.edges: expected internal edge IDs"),
                 (pb.FetchEdgeDataRequest(edges=own, edge_type="x__y__z" if m.typed else "paper",
                                          want_edge_ids=True), "FetchEdgeDataRequest.edge_type")]
        for request, message in cases:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.FetchEdgeData(request, timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in info.value.details()
        channel.close()


@pytest.fixture(scope="module")
def edge_preset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``edge-feat-small`` (labels decided by the edges' features), in two partitions."""
    root = tmp_path_factory.mktemp("edge-feat-small")
    partition_graph(generate("edge-feat-small", progress=False), 2, root, method="metis", progress=False)
    return root


def _test_accuracy(root: Path, out: Path, model: str) -> float:
    with served(root, 2) as addresses:
        assert train_main(["--servers", ",".join(addresses), "--model", model, "--fanouts", "10,5",
                           "--batch-size", "64", "--hidden", "64", "--epochs", "8", "--lr", "0.005",
                           "--dropout", "0", "--device", "cpu", "--timeout", "60", "--no-progress",
                           "--eval-fanouts", "10,5", "--metrics-json", str(out / f"{model}.json")]) == 0
    return float(json.loads((out / f"{model}.json").read_text())["test_acc"])


def test_on_labels_the_edges_decide_a_model_with_edge_features_beats_those_without(
        edge_preset: Path, tmp_path: Path) -> None:
    """GINE (edge features) against GIN and GraphSAGE (none), same sizes, fanouts and
    epochs, trained through the service: the preset's labels follow its edges' features
    (about 1 in 6 by guessing), so only the first can learn them (docs/training.md)."""
    with_edges = _test_accuracy(edge_preset, tmp_path, "gine")
    without = max(_test_accuracy(edge_preset, tmp_path, m) for m in ("gin", "sage"))
    assert with_edges > without + 0.3, (with_edges, without)
    assert with_edges > 0.6, with_edges
