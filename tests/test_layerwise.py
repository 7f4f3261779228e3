"""Layer-wise inference with the layer tables on the servers: every node's output equals a
single-process forward of the model on the whole graph, to float rounding, for every model
the trainer offers (GraphSAGE, GCN with the whole graph's degrees, GAT, GIN, GINE with edge
features, R-GCN, hetero-sage), plain and typed graphs, 1 and 2 ranks (threads, each its own
cluster), 1 and 3 partitions; featureless inputs (dense and server-held), link encoders
and a user's PyG model; a model without the per-layer protocol is refused naming what it
lacks; a server restarted mid-layer makes the pass redo the layer and end bit for bit
the same, and a server gone for good is named within the reconnect time."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from edge_fixtures import with_edge_attr
from graph_fixtures import AnyGraph, mixed, mixed_graph
from in_process_servers import server_config, serving
from layerwise_fixtures import plain_forward, run_pass, typed_forward
from torch import Tensor, nn
from torch_geometric.nn import GraphSAGE

from partitioner import partition_graph
from partitioner.graph import TypedGraphData
from protos.channel import ServerUnavailable
from sampling_server.server import SamplingServer, create_server
from trainer_client import Cluster
from trainer_client.embeddings import RemoteEmbedding
from trainer_client.featureless import EmbeddingInput, dense_embedding
from trainer_client.graph import TypedGraph
from trainer_client.layerwise import layer_model
from trainer_client.link_models import build_link_model
from trainer_client.models import build_model
from trainer_client.node_tensors import RemoteNodeTensor
from trainer_client.typed_models import build_typed_model

HIDDEN = 8
PLAIN_MODELS = ["sage", "gcn", "gat", "gin", "gine"]
TYPED_MODELS = ["rgcn", "hetero-sage"]


def _graph(kind: str) -> AnyGraph:
    """The mixed graphs (hubs, isolated nodes, repeated edges, self-loops) with edge
    features; the typed one with reverse relations, so every type has in-edges."""
    if kind == "plain":
        return with_edge_attr(mixed("plain"))
    if kind == "bare":  # a plain graph without features
        graph = mixed_graph()
        graph.x = None
        return graph
    typed = mixed("typed")
    assert isinstance(typed, TypedGraphData)
    return typed.add_reverse()


@pytest.fixture(scope="module")
def clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, int], Any]]:
    """Servers of every graph and partition count: (graph, addresses, servers, root, state)."""
    out, contexts = {}, []
    for kind, counts in (("plain", (1, 3)), ("typed", (1, 3)), ("bare", (3,))):
        graph = _graph(kind)
        for parts in counts:
            root = tmp_path_factory.mktemp(f"{kind}-{parts}")
            partition_graph(graph, parts, root, method="random", progress=False)
            state = tmp_path_factory.mktemp(f"state-{kind}-{parts}")
            context = serving(root, parts, state_dir=state)
            addresses, servers = context.__enter__()
            contexts.append(context)
            out[kind, parts] = (graph, addresses, servers, root, state)
    try:
        yield out
    finally:
        for context in contexts:
            context.__exit__(None, None, None)


def _close(got: Tensor, want: Tensor) -> None:
    """Equal to float rounding: the largest difference within 1e-5 of the largest value."""
    diff = float((got - want).abs().max())
    assert got.shape == want.shape and diff <= 1e-5 * max(float(want.abs().max()), 1.0), diff


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("name", PLAIN_MODELS)
def test_every_plain_models_output_equals_the_full_graph_forward(
        clusters: dict[tuple[str, int], Any], name: str, ranks: int, parts: int) -> None:
    graph, addresses, *_ = clusters["plain", parts]
    torch.manual_seed(1)
    model = build_model(name, graph.feature_dim, graph.num_classes, hidden_channels=HIDDEN, num_layers=2,
                        heads=2, edge_dim=3 if name == "gine" else None).eval()
    got = run_pass(addresses, model, ranks)
    _close(got["_N"], plain_forward(model, graph))


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("name", TYPED_MODELS)
def test_every_typed_models_output_equals_the_full_graph_forward(
        clusters: dict[tuple[str, int], Any], name: str, ranks: int, parts: int) -> None:
    graph, addresses, *_ = clusters["typed", parts]
    with Cluster(addresses) as cluster:
        facts = cluster.graph
    torch.manual_seed(2)
    model = build_typed_model(name, facts, hidden_channels=HIDDEN, num_layers=2).eval()
    got = run_pass(addresses, model, ranks)
    assert set(got) == {"paper"}  # the node task's output: the target type's logits
    _close(got["paper"], typed_forward(model, graph)["paper"])


@pytest.mark.parametrize("ranks", [1, 2])
def test_three_layers_and_a_users_pyg_model(clusters: dict[tuple[str, int], Any], ranks: int) -> None:
    graph, addresses, *_ = clusters["plain", 3]
    torch.manual_seed(3)
    model = GraphSAGE(graph.feature_dim, HIDDEN, num_layers=3, out_channels=5).eval()  # PyG's own
    got = run_pass(addresses, model, ranks, batch_size=5)
    with torch.no_grad():
        want = model(torch.from_numpy(graph.x), torch.from_numpy(graph.edge_index))
    _close(got["_N"], want)


@pytest.mark.parametrize("held", ["dense", "servers"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_featureless_inputs_dense_or_held_by_the_servers(
        clusters: dict[tuple[str, int], Any], held: str, ranks: int) -> None:
    graph, addresses, *_ = clusters["bare", 3]
    torch.manual_seed(4)
    gcn = build_model("gcn", HIDDEN, graph.num_classes, hidden_channels=HIDDEN, num_layers=2)
    with Cluster(addresses) as cluster:
        embedding: nn.Module = dense_embedding(graph.num_nodes, HIDDEN) if held == "dense" else \
            RemoteEmbedding(cluster, f"emb-bare-{ranks}", HIDDEN, init="uniform", scale=0.5, seed=3)
        model = EmbeddingInput(embedding, gcn).eval()
        with torch.no_grad():
            rows = embedding(torch.arange(graph.num_nodes)) if held == "dense" else \
                embedding(torch.from_numpy(cluster.global_ids(np.arange(graph.num_nodes), "_N")))
        got = run_pass(addresses, model, ranks)
        _close(got["_N"], plain_forward(gcn.eval(), graph, rows))


def test_a_typed_graphs_featureless_types_held_by_the_servers(clusters: dict[tuple[str, int], Any]) -> None:
    graph, addresses, *_ = clusters["typed", 3]
    with Cluster(addresses) as cluster:
        tables: dict[str, RemoteEmbedding] = {}

        def factory(node_type: str, width: int) -> nn.Module:
            tables[node_type] = RemoteEmbedding(cluster, f"emb-typed-{node_type}", width, node_type=node_type,
                                                init="uniform", scale=0.5, seed=5)
            return tables[node_type]

        torch.manual_seed(5)
        model = build_typed_model("rgcn", cluster.graph, hidden_channels=HIDDEN, num_layers=2,
                                  embeddings=factory).eval()
        got = run_pass(addresses, model, 2)
        with torch.no_grad():  # the reference reads the same rows, by original ID
            dense = {t: e(torch.from_numpy(cluster.global_ids(np.arange(graph.num_nodes[t]), t)))
                     for t, e in tables.items()}
    for t, rows in dense.items():  # the same model with those rows as dense tables
        model.input.embs[t] = nn.Embedding.from_pretrained(rows)
    _close(got["paper"], typed_forward(model, graph)["paper"])


@pytest.mark.parametrize("kind", ["plain", "typed"])
def test_a_link_encoders_embeddings_of_both_ends(clusters: dict[tuple[str, int], Any], kind: str) -> None:
    graph, addresses, *_ = clusters[kind, 3]
    with Cluster(addresses) as cluster:
        facts: TypedGraph = cluster.graph
    edge_type = ("author", "writes", "paper") if kind == "typed" else facts.edge_types[0]
    torch.manual_seed(6)
    model = build_link_model("rgcn" if kind == "typed" else "sage", facts, edge_type, hidden_channels=HIDDEN,
                             num_layers=2).eval()
    got = run_pass(addresses, model, 2)
    if kind == "plain":
        _close(got["_N"], plain_forward(model.encoder, graph))
        return
    want = typed_forward(model.encoder, graph)
    assert set(got) == {"author", "paper"}
    for t in got:
        _close(got[t], want[t])


def test_a_model_without_the_per_layer_protocol_is_refused_naming_it(clusters: dict[tuple[str, int], Any]
                                                                     ) -> None:
    _, addresses, *_ = clusters["typed", 1]
    expected = (r"Linear lacks num_layers, inference_per_layer, output_types; expected a model with "
                r"num_layers and inference_per_layer\(layer, x_dict, edge_index_dict, seed_type, "
                r"batch_size\)")
    with Cluster(addresses) as cluster, pytest.raises(TypeError, match=expected):
        layer_model(nn.Linear(2, 2), cluster.graph)


def _restart(server: SamplingServer, root: Path, partition: int, addresses: list[str], state: Path
             ) -> SamplingServer:
    """Stop ``server`` and start a new one for its partition on the same port and state."""
    port = server.port
    server.stop(None).wait(10)
    fresh, _ = create_server(server_config(root, partition, listen=f"127.0.0.1:{port}", state_dir=state))
    fresh.set_peers(addresses)
    fresh.start()
    assert fresh.wait_until_serving(60)
    return fresh


@pytest.mark.parametrize("kind", ["plain", "typed"])
def test_a_server_restarted_mid_layer_leaves_the_output_bit_for_bit_the_same(
        clusters: dict[tuple[str, int], Any], kind: str) -> None:
    graph, addresses, servers, root, state = clusters[kind, 3]
    with Cluster(addresses) as cluster:
        facts = cluster.graph
    torch.manual_seed(7)
    model = build_model("gcn", graph.feature_dim, graph.num_classes, hidden_channels=HIDDEN, num_layers=3) \
        if kind == "plain" else build_typed_model("rgcn", facts, hidden_channels=HIDDEN, num_layers=3)
    model.eval()
    unbroken = run_pass(addresses, model, 2, batch_size=4)
    restarted: list[int] = []

    def restart_mid_layer(layer: int, index: int) -> None:
        if layer == 1 and index == 1 and not restarted:  # layer 0's table is snapshotted by now
            servers[1] = _restart(servers[1], root, 1, addresses, state)
            restarted.append(layer)

    again = run_pass(addresses, model, 2, batch_size=4, on_batch=restart_mid_layer)
    assert restarted and again.keys() == unbroken.keys()
    for t in again:
        assert torch.equal(again[t], unbroken[t]), t


def test_a_lost_server_is_named_within_the_reconnect_time(tmp_path: Path) -> None:
    graph = _graph("plain")
    partition_graph(graph, 3, tmp_path / "parts", method="random", progress=False)
    with serving(tmp_path / "parts", 3, state_dir=tmp_path / "state") as (addresses, servers):
        model = build_model("sage", graph.feature_dim, graph.num_classes, hidden_channels=HIDDEN,
                            num_layers=2).eval()
        started: list[float] = []

        def lose_one(layer: int, index: int) -> None:
            if layer == 1 and not started:
                servers[2].stop(None).wait(10)
                started.append(time.monotonic())

        with pytest.raises(ServerUnavailable) as info:
            run_pass(addresses, model, 1, batch_size=4, on_batch=lose_one, reconnect=2.0)
        assert time.monotonic() - started[0] < 60
        assert addresses[2] in str(info.value)


# -- every node's output out ---------------------------------------------------------------


def _train(addresses: list[str], out: Path, model: str, *extra: str) -> int:
    from trainer_client.train import main

    return main(["--servers", ",".join(addresses), "--model", model, "--fanouts", "3,3", "--hidden", "8",
                 "--batch-size", "16", "--epochs", "1", "--no-progress", "--device", "cpu", "--timeout", "60",
                 "--checkpoint-dir", str(out / "ckpt"), "--metrics-json", str(out / "metrics.json"), *extra])


@pytest.mark.parametrize("kind", ["plain", "typed"])
def test_the_export_holds_every_nodes_output_of_the_selected_model(
        clusters: dict[tuple[str, int], Any], tmp_path: Path, kind: str) -> None:
    from trainer_client.ddp import BEST_NAME
    from trainer_client.export import MANIFEST, read_outputs

    graph, addresses, *_ = clusters[kind, 3]
    target = "paper" if kind == "typed" else "_N"
    export = tmp_path / "export"
    assert _train(addresses, tmp_path, "rgcn" if kind == "typed" else "gcn", "--export-embeddings",
                  str(export), "--eval", "sampled") == 0
    manifest = json.loads((export / MANIFEST).read_text())
    best = torch.load(tmp_path / "ckpt" / BEST_NAME, weights_only=True)
    assert manifest["checkpoint"]["epoch"] == best["epoch"] and manifest["model"]["hidden"] == 8
    with Cluster(addresses) as cluster:
        facts = cluster.graph
    model = build_typed_model("rgcn", facts, hidden_channels=8, num_layers=2) if kind == "typed" else \
        build_model("gcn", graph.feature_dim, graph.num_classes, hidden_channels=8, num_layers=2, heads=4)
    model.load_state_dict(best["model"])
    model.eval()
    want = typed_forward(model, graph)[target] if kind == "typed" else plain_forward(model, graph)
    assert list(manifest["node_types"]) == [target]
    assert manifest["node_types"][target]["shape"] == list(want.shape)
    shard = manifest["node_types"][target]["shards"][0]
    assert np.load(export / shard["file"], mmap_mode="r", allow_pickle=False).dtype == np.float32
    _close(torch.from_numpy(read_outputs(export, target)), want)
    again = tmp_path / "from-checkpoint"  # a checkpoint's model exported without training
    assert _train(addresses, tmp_path, "rgcn" if kind == "typed" else "gcn", "--epochs", "0", "--resume",
                  "--export-embeddings", str(again)) == 0
    assert np.array_equal(read_outputs(again, target), read_outputs(export, target))


def test_an_export_is_written_whole_or_not_at_all(clusters: dict[tuple[str, int], Any], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer_client import export as exporting

    _, addresses, *_ = clusters["plain", 1]
    export = tmp_path / "export"
    assert _train(addresses, tmp_path, "sage", "--export-embeddings", str(export),
                  "--keep-embeddings", "kept-out") == 0
    first = exporting.read_outputs(export, "_N").copy()
    with Cluster(addresses) as cluster:  # kept on the servers too, under its name
        kept = RemoteNodeTensor.find(cluster, "kept-out/_N")
        assert torch.equal(kept.read(kept.global_ids(np.arange(first.shape[0]))), torch.from_numpy(first))
        kept.drop(forget=True)
        kept.close()

    def crash(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(exporting, "_into_place", crash)  # dies before the rename
    assert _train(addresses, tmp_path / "again", "sage", "--seed", "9", "--export-embeddings",
                  str(export)) == 1
    assert np.array_equal(exporting.read_outputs(export, "_N"), first)  # the earlier export, whole
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".export")) == []
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        _train(addresses, tmp_path, "sage", "--export-embeddings", str(tmp_path / "other"))
