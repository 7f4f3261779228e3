"""The models (plain and typed), the in-process typed batch source, and ``graphfeed-train``
end to end on both kinds of graph: the same loop, checkpoints, resume and metrics on a
plain graph's servers, a typed graph's servers and a typed partition directory (in
this process, world size 1), and DDP over Gloo in subprocesses.

A plain graph is the ``small`` synthetic graph in two partitions (GraphSAGE); a typed one
an ogbn-mag-shaped graph of a few hundred papers in two partitions (R-GCN)."""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from graph_fixtures import KINDS
from in_process_servers import served
from test_decode import encode_batch, fake_batch
from test_loader import TIMEOUTS, real_servers
from torch_geometric.data import Data, HeteroData

from partitioner.graph import TypedGraphData
from partitioner.synthetic import TypedPreset, _mag_relations, generate, generate_typed
from partitioner.writer import partition_graph
from trainer_client import train
from trainer_client.ddp import BEST_NAME, CHECKPOINT_NAME, DistEnv
from trainer_client.decode import decode_batch
from trainer_client.graph import TypedGraph
from trainer_client.in_process import InProcessLoader, LocalGraph
from trainer_client.loader import RemoteNeighborLoader
from trainer_client.loop import run as run_task
from trainer_client.models import MODELS, NEEDS_EDGE_FEATURES, batch_inputs, build_model
from trainer_client.node_task import NodeTask, partition_dir_task
from trainer_client.typed_models import RGCN, TypedSAGE, build_typed_model, layer_plan, typed_batch_inputs

REPO = Path(__file__).resolve().parents[1]
main = train.main
ONE = DistEnv(0, 1, 0, torch.device("cpu"))

#: An ogbn-mag-shaped graph of a few hundred papers (all four relations, reverses added).
MINI = TypedPreset(
    num_nodes={"paper": 300, "author": 400, "institution": 12, "field_of_study": 40},
    relations=_mag_relations(2_400, 1_800, 2_400, 380, homophily=0.5),
    target_type="paper", feature_dim=8, num_classes=4, feature_signal=0.6,
    split_sizes=(160, 60, 60), max_weight_ratio=20.0,
)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def servers(parts2: Path) -> Iterator[list[str]]:
    """The plain graph's servers."""
    with real_servers(parts2) as addresses:
        yield addresses


@pytest.fixture(scope="module")
def mini(tmp_path_factory: pytest.TempPathFactory) -> tuple[TypedGraphData, Path]:
    """The typed graph, and its two partitions."""
    graph = generate_typed(MINI, seed=0, progress=False).add_reverse()
    root = tmp_path_factory.mktemp("mini") / "parts-2"
    partition_graph(graph, 2, root, method="metis", progress=False)
    return graph, root


@pytest.fixture(scope="module")
def typed_servers(mini: tuple[TypedGraphData, Path]) -> Iterator[list[str]]:
    with served(mini[1], 2) as addresses:
        yield addresses


@pytest.fixture(scope="module")
def local(mini: tuple[TypedGraphData, Path]) -> LocalGraph:
    return LocalGraph(mini[1])


@dataclass
class Run:
    """How ``graphfeed-train`` runs on one kind of graph, and what its runs must show."""

    #: "plain", "typed" (servers), "plain-dir" or "typed-dir" (``--partition-dir``, in
    #: this process).
    kind: str
    #: The flags naming the graph (``--servers`` or ``--partition-dir``) and its model.
    source: list[str]
    #: Training seeds of an epoch over all ranks.
    seeds: int
    #: Accuracy of guessing.
    chance: float

    def args(self, out: Path, *extra: str) -> list[str]:
        return [*self.source, "--fanouts", "5,3", "--batch-size", "40" if self.typed else "200", "--hidden",
                "16" if self.typed else "32", "--lr", "0.02" if self.typed else "0.01", "--dropout", "0.2",
                "--device", "cpu", "--timeout", "30", "--no-progress", "--checkpoint-dir", str(out / "ckpt"),
                "--metrics-json", str(out / "metrics.json"), *extra]

    @property
    def typed(self) -> bool:
        return self.kind.startswith("typed")

    @property
    def in_process(self) -> bool:
        return self.kind.endswith("-dir")


@pytest.fixture(params=["plain", "typed", "plain-dir", "typed-dir"])
def run(request: pytest.FixtureRequest) -> Run:
    return _run_of(request.param, request)


def _run_of(kind: str, request: pytest.FixtureRequest) -> Run:
    """How to train on ``kind`` (see :class:`Run`)."""
    if kind == "plain":
        return Run("plain", ["--servers", ",".join(request.getfixturevalue("servers")), "--model", "sage"],
                   1200, 1 / 6)
    if kind == "plain-dir":
        root = request.getfixturevalue("parts2")
        return Run("plain-dir", ["--partition-dir", str(root), "--model", "sage"], 1200, 1 / 6)
    if kind == "typed":
        addresses = request.getfixturevalue("typed_servers")
        return Run("typed", ["--servers", ",".join(addresses), "--model", "rgcn"], 160, 1 / 4)
    _, root = request.getfixturevalue("mini")
    return Run("typed-dir", ["--partition-dir", str(root), "--model", "rgcn"], 160, 1 / 4)


def _metrics(out: Path) -> dict[str, object]:
    result: dict[str, object] = json.loads((out / "metrics.json").read_text())
    return result


# ---- plain models ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(set(MODELS) - NEEDS_EDGE_FEATURES))  # GINE: test_edge_features.py
def test_trimmed_forward_gives_the_seeds_the_same_logits(name: str) -> None:
    torch.manual_seed(0)
    data = decode_batch(encode_batch(0, fake_batch(np.arange(6), num_hops=2))).data
    model = build_model(name, 4, 3, hidden_channels=8, num_layers=2, dropout=0.0).eval()
    x, edge_index, batch_size, nodes, edges, _ = batch_inputs(data)
    trimmed = model(x, edge_index, batch_size, nodes, edges)
    full = model(x, edge_index, batch_size)
    assert trimmed.shape == (6, 3)
    assert torch.allclose(trimmed, full, atol=1e-5)


def test_more_layers_than_hops_runs_without_trimming() -> None:
    data = decode_batch(encode_batch(0, fake_batch(np.arange(6), num_hops=1))).data
    model = build_model("sage", 4, 3, hidden_channels=8, num_layers=3)
    assert model(*batch_inputs(data)).shape == (6, 3)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"name": "mlp"}, r"model: expected one of \['sage', 'gcn', 'gat', 'gin', 'gine'\], got 'mlp'"),
        ({"num_layers": 0}, r"num_layers: expected an integer >= 1, got 0"),
        ({"dropout": 1.0}, r"dropout: expected 0 <= dropout < 1, got 1.0"),
        ({"name": "gat", "hidden_channels": 10, "heads": 4}, r"heads: expected an integer >= 1 dividing"),
    ],
)
def test_bad_model_settings_name_the_field(kwargs: dict[str, object], pattern: str) -> None:
    args: dict[str, object] = {"name": "sage", "in_channels": 4, "out_channels": 3, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        build_model(**args)  # type: ignore[arg-type]


# ---- typed models ----------------------------------------------------------------------


def test_layer_plan_computes_only_what_reaches_the_target(local: LocalGraph) -> None:
    plan = layer_plan(local.meta, 2)
    last_relations, last_outputs = plan[1]
    assert last_outputs == ["paper"]
    assert {et[2] for et in last_relations} == {"paper"}
    first_relations, first_outputs = plan[0]
    # institution -> author -> paper: institutions feed layer 0, but no layer outputs them
    assert "institution" not in first_outputs
    assert ("author", "affiliated_with", "institution") not in first_relations
    assert ("institution", "rev_affiliated_with", "author") in first_relations


@pytest.mark.parametrize("name", ["rgcn", "hetero-sage"])
def test_every_rgcn_parameter_gets_a_gradient(name: str, local: LocalGraph) -> None:
    """R-GCN needs no unused-parameter search under DDP; to_hetero's stack does."""
    loader = InProcessLoader(local, "train", num_neighbors=[5, 3], batch_size=64, shuffle=True)
    batch = next(iter(loader))
    torch.manual_seed(0)
    model = build_typed_model(name, local.meta, hidden_channels=16, num_layers=2, dropout=0.0)
    out = model(*typed_batch_inputs(batch))
    assert out.shape == (batch["paper"].batch_size, local.meta.num_classes)
    F.cross_entropy(out, batch["paper"].y[: batch["paper"].batch_size]).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    if name == "rgcn":
        assert missing == []
    else:
        # exactly the convolutions whose outputs never reach the target type's logits
        plan = layer_plan(local.meta, 2)
        unused = {f"gnn.convs.{i}.{'__'.join(et)}" for i, (relations, _) in enumerate(plan)
                  for et in local.meta.edge_types if et not in relations}
        assert unused and {n.rsplit(".", 2)[0] for n in missing} == unused


def test_featureless_types_are_embedded_by_n_id(local: LocalGraph) -> None:
    model = RGCN(local.meta, hidden_channels=8, num_layers=2)
    assert set(model.input.lins) == {"paper"}
    assert set(model.input.embs) == {"author", "institution", "field_of_study"}
    assert model.input.embs["author"].num_embeddings == local.meta.num_nodes["author"]
    n_id = {"author": torch.tensor([5, 0, 5]), "institution": torch.tensor([1]),
            "field_of_study": torch.tensor([3]), "paper": torch.tensor([0])}
    h = model.input({"paper": torch.zeros(1, 8)}, n_id)
    assert torch.equal(h["author"], model.input.embs["author"].weight[[5, 0, 5]])
    with pytest.raises(ValueError, match=r"batch\['paper'\].x"):
        model.input({}, n_id)


def test_trimming_does_not_change_the_seeds_logits(local: LocalGraph) -> None:
    loader = InProcessLoader(local, "val", num_neighbors=[5, 3], batch_size=32)
    batch = next(iter(loader))
    inputs = typed_batch_inputs(batch)
    assert inputs[4] is not None and inputs[5] is not None  # the counts trim_to_layer reads
    torch.manual_seed(0)
    model = RGCN(local.meta, hidden_channels=16, num_layers=2).eval()
    with torch.no_grad():
        trimmed = model(*inputs)
        full = model(*inputs[:4])
    torch.testing.assert_close(trimmed, full)


def test_typed_sage_dropout_follows_train_and_eval(local: LocalGraph) -> None:
    """to_hetero traces the module: a training flag read at trace time would stick."""
    batch = next(iter(InProcessLoader(local, "val", num_neighbors=[5, 3], batch_size=32)))
    torch.manual_seed(0)
    model = TypedSAGE(local.meta, hidden_channels=16, num_layers=2, dropout=0.5)
    inputs = typed_batch_inputs(batch)
    with torch.no_grad():
        model.eval()
        assert torch.equal(model(*inputs), model(*inputs))
        model.train()
        assert not torch.equal(model(*inputs), model(*inputs))


def test_bad_typed_graphs_and_loader_arguments_name_the_field(local: LocalGraph) -> None:
    with pytest.raises(ValueError, match="split"):
        InProcessLoader(local, "nope", num_neighbors=[2], batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        InProcessLoader(local, "train", num_neighbors=[2], batch_size=0)
    with pytest.raises(ValueError, match="target_type"):
        TypedGraph(node_types=("a",), edge_types=(), num_nodes={"a": 1}, feature_dims={"a": 1},
                   target_type="b", num_classes=2)
    featureless = TypedGraph(node_types=("a",), edge_types=(), num_nodes={"a": 0}, feature_dims={"a": 0},
                             target_type="a", num_classes=2)
    with pytest.raises(ValueError, match=r"num_nodes\['a'\]: a node type without features needs its node"):
        RGCN(featureless)


# ---- the in-process loader, both kinds --------------------------------------------------


def _in_process(kind: str, request: pytest.FixtureRequest) -> tuple[LocalGraph, np.ndarray]:
    """The graph of ``kind`` sampled in this process, and its labels by original ID."""
    if kind == "plain":
        return LocalGraph(request.getfixturevalue("parts2")), np.asarray(generate("small", progress=False).y)
    graph, _ = request.getfixturevalue("mini")
    return request.getfixturevalue("local"), np.asarray(graph.y)


def _seed_store(batch: Any) -> Any:
    """The store of a batch's seeds: a ``Data`` itself, a ``HeteroData``'s papers."""
    return batch["paper"] if isinstance(batch, HeteroData) else batch


@pytest.mark.parametrize("kind", KINDS)
def test_in_process_loader_covers_each_seed_once_over_ranks(kind: str,
                                                            request: pytest.FixtureRequest) -> None:
    local, y = _in_process(kind, request)
    loaders = [InProcessLoader(local, "train", num_neighbors=[4, 2], batch_size=24, shuffle=True,
                               rank=r, world_size=2, seed=3) for r in range(2)]
    assert len(loaders[0]) == len(loaders[1]) > 0
    seen = []
    for loader in loaders:
        loader.set_epoch(1)
        for batch in loader:
            assert isinstance(batch, HeteroData if kind == "typed" else Data)
            store = _seed_store(batch)
            ids = store.n_id[: store.batch_size]
            assert torch.equal(ids, loader.input_nodes[store.input_id])
            assert torch.equal(store.y[: store.batch_size], torch.from_numpy(y)[ids])
            if kind == "typed":
                authors = batch["author"]
                assert "x" not in authors and authors.n_id.numel() == authors.num_nodes
            seen.append(ids)
    train = np.sort(np.asarray(local.split_nodes("train")[0]))
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.from_numpy(train))


@pytest.mark.parametrize("kind", KINDS)
def test_in_process_batches_are_the_servers_batches(kind: str, request: pytest.FixtureRequest) -> None:
    """Same plan, same keys, same sampler: --partition-dir trains on exactly the batches
    the servers would stream, in the same layout."""
    local, _ = _in_process(kind, request)
    addresses = request.getfixturevalue("typed_servers" if kind == "typed" else "servers")
    for rank in range(2):
        ours = InProcessLoader(local, "train", num_neighbors=[4, 2], batch_size=30, shuffle=True,
                               rank=rank, world_size=2, seed=5)
        with RemoteNeighborLoader(addresses, "train", num_neighbors=[4, 2], batch_size=30, shuffle=True,
                                  rank=rank, world_size=2, seed=5, **TIMEOUTS) as theirs:
            assert theirs.graph.fingerprint == local.meta.fingerprint  # the same graph, either way
            for epoch in (0, 1):
                ours.set_epoch(epoch)
                theirs.set_epoch(epoch)
                pairs = list(zip(ours, theirs, strict=True))
                assert len(pairs) == len(theirs) > 0
                for a, b in pairs:
                    assert type(a) is type(b)
                    stores = [(a, b)] if kind == "plain" else \
                        [(a[t], b[t]) for t in a.node_types] + [(a[e], b[e]) for e in a.edge_types]
                    for sa, sb in stores:
                        assert sorted(sa.keys()) == sorted(sb.keys())
                        for key, value in sa.items():
                            if isinstance(value, torch.Tensor):
                                assert value.dtype == sb[key].dtype and torch.equal(value, sb[key]), key
                            else:
                                assert value == sb[key], key


# ---- the trainer on both kinds ---------------------------------------------------------


def test_training_writes_metrics_and_checkpoints_then_resumes(run: Run, tmp_path: Path) -> None:
    assert main(run.args(tmp_path, "--epochs", "2")) == 0
    metrics = _metrics(tmp_path)
    assert metrics["world_size"] == 1 and metrics["start_epoch"] == 0
    assert ("typed" in metrics) == run.typed
    assert metrics["model"]["model"] == ("rgcn" if run.typed else "sage")
    epochs = metrics["epochs"]
    assert [e["epoch"] for e in epochs] == [0, 1]
    for e in epochs:
        assert e["seeds"] == run.seeds and e["batches"] == -(-run.seeds // (40 if run.typed else 200))
        assert e["seeds_per_second"] > 0
        assert 0 <= e["train_acc"] <= 1 and 0 <= e["val_acc"] <= 1 and e["loss"] > 0
        assert (e["received_mb"] > 0) == (not run.in_process) and e["cache_hit_rate"] is None
    assert epochs[1]["loss"] < epochs[0]["loss"]
    assert metrics["test_acc"] > run.chance  # better than guessing
    state = torch.load(tmp_path / "ckpt" / CHECKPOINT_NAME, weights_only=True)
    assert state["epoch"] == 1 and set(state) >= {"model", "optimizer", "history", "config", "graph"}
    vals = [e["val_acc"] for e in epochs]
    assert metrics["selected_epoch"] == int(np.argmax(vals)) and metrics["selected_val_acc"] == max(vals)
    # from the servers: layer-wise inference; in process a plain graph samples every neighbor
    assert metrics["eval_fanouts"] == ("full" if not run.in_process else [5, 3] if run.typed else [-1, -1])
    assert metrics["batch_size_per_step"] == (40 if run.typed else 200)
    best = torch.load(tmp_path / "ckpt" / BEST_NAME, weights_only=True)
    assert best["epoch"] == metrics["selected_epoch"]

    assert main(run.args(tmp_path, "--epochs", "3", "--resume")) == 0
    resumed = _metrics(tmp_path)
    assert resumed["start_epoch"] == 2
    assert [e["epoch"] for e in resumed["epochs"]] == [0, 1, 2]
    assert resumed["epochs"][:2] == epochs
    vals = [e["val_acc"] for e in resumed["epochs"]]
    assert resumed["selected_epoch"] == int(np.argmax(vals))  # the earliest best, across the resume


@pytest.mark.parametrize("kind", ["plain", "typed"])
def test_an_epoch_reports_its_cache_hits_and_bytes_and_trains_the_same_weights(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = _run_of(kind, request)
    with caplog.at_level(logging.INFO, "trainer_client.train"):
        assert main(run.args(tmp_path / "cached", "--epochs", "1", "--cache-size", "0.3")) == 0
    cached = _metrics(tmp_path / "cached")
    assert main(run.args(tmp_path / "plain", "--epochs", "1", "--cache-size", "0")) == 0
    uncached = _metrics(tmp_path / "plain")
    hit_rate, received = cached["epochs"][0]["cache_hit_rate"], cached["epochs"][0]["received_mb"]
    assert 0.3 < hit_rate <= 1 if kind == "plain" else 0 < hit_rate <= 1  # the hottest: above their share
    assert uncached["epochs"][0]["cache_hit_rate"] is None
    assert 0 < received < uncached["epochs"][0]["received_mb"]
    assert cached["param_fingerprints"] == uncached["param_fingerprints"]  # the same batches
    assert re.search(r"epoch 0: .*\(rank 0: waited \d+\.\d s for data, received \d+\.\d MB, "
                     r"cache hits \d+\.\d%\)", caplog.text)


@pytest.mark.parametrize("kind", ["plain", "typed"])
def test_evaluation_samples_with_eval_fanouts(kind: str, request: pytest.FixtureRequest,
                                              tmp_path: Path) -> None:
    """--eval-fanouts 4,2: sampled evaluation on both kinds; a typed graph's "full"
    samples every neighbor at every hop."""
    run = _run_of(kind, request)
    assert main(run.args(tmp_path, "--epochs", "1", "--eval-fanouts", "4,2")) == 0
    metrics = _metrics(tmp_path)
    assert metrics["eval_fanouts"] == [4, 2] and metrics["selected_epoch"] == 0
    assert metrics["test_acc"] > run.chance
    if run.typed:
        assert main(run.args(tmp_path, "--epochs", "1", "--eval-fanouts", "full")) == 0
        assert _metrics(tmp_path)["eval_fanouts"] == [-1, -1]


def test_resuming_another_model_or_graph_is_refused_in_one_line(
        run: Run, request: pytest.FixtureRequest, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert main(run.args(tmp_path, "--epochs", "1")) == 0
    caplog.clear()
    assert main(run.args(tmp_path, "--epochs", "2", "--resume", "--hidden", "8")) == 1
    assert "--resume: checkpoint" in caplog.text and f"'hidden': {16 if run.typed else 32}" in caplog.text
    # the checkpoint of another graph: one line naming both graphs, whatever the shapes
    path = tmp_path / "ckpt" / CHECKPOINT_NAME
    state = torch.load(path, weights_only=True)
    ours = state["graph"]
    assert ours["name"] and len(ours["fingerprint"]) == 64
    state["graph"] = {"name": "other", "fingerprint": "f" * 64}
    torch.save(state, path)
    caplog.clear()
    assert main(run.args(tmp_path, "--epochs", "2", "--resume")) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert re.search(rf"trained on graph 'other' \(fingerprint ffffffffffff\), not on the .*graph "
                     rf"'{ours['name']}' \(fingerprint {ours['fingerprint'][:12]}\)", errors[0])
    # a checkpoint from before the graph was recorded (a typed one kept the graph's types
    # in its config): it loads where the graph's types and the shapes fit
    del state["graph"]
    if run.typed:
        facts = request.getfixturevalue("local").meta.to_json()
        state["config"]["graph"] = dict(facts, num_classes=99)
        torch.save(state, path)
        caplog.clear()
        assert main(run.args(tmp_path, "--epochs", "2", "--resume")) == 1
        assert "trained on a graph it does not record" in caplog.text
        state["config"]["graph"] = facts
    torch.save(state, path)
    assert main(run.args(tmp_path, "--epochs", "2", "--resume")) == 0
    assert _metrics(tmp_path)["start_epoch"] == 1


def test_an_unrecorded_checkpoint_of_other_shapes_is_refused_in_one_line(
        servers: list[str], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    plain = _args_plain(servers, tmp_path)
    assert main([*plain, "--epochs", "1"]) == 0
    path = tmp_path / "ckpt" / CHECKPOINT_NAME
    state = torch.load(path, weights_only=True)
    del state["graph"]  # as written before checkpoints recorded their graph
    state["model"] = {k: torch.cat([v, v]) if v.dim() else v for k, v in state["model"].items()}
    torch.save(state, path)
    caplog.clear()
    assert main([*plain, "--epochs", "2", "--resume"]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert "trained on a graph it does not record, not on the servers' graph 'small'" in errors[0]
    assert "size mismatch for" in errors[0] and "'model': 'sage'" in errors[0]


def _args_plain(servers: list[str], out: Path) -> list[str]:
    return Run("plain", ["--servers", ",".join(servers), "--model", "sage"], 1200, 1 / 6).args(out)


def test_a_model_of_the_other_kind_is_refused_at_start(servers: list[str], typed_servers: list[str],
                                                       mini: tuple[TypedGraphData, Path], parts2: Path,
                                                       tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--servers", ",".join(typed_servers), "--model", "sage", "--epochs", "1", "--no-progress",
                 "--timeout", "30"]) == 1
    assert "expected a typed model" in caplog.text
    caplog.clear()
    assert main(["--servers", ",".join(servers), "--model", "rgcn", "--epochs", "1", "--no-progress",
                 "--timeout", "30"]) == 1
    assert "expected a typed graph (format v2)" in caplog.text
    caplog.clear()
    assert main(["--partition-dir", str(parts2), "--model", "rgcn", "--no-progress"]) == 1
    assert "expected a typed graph (format v2)" in caplog.text
    caplog.clear()
    assert main(["--partition-dir", str(mini[1]), "--model", "sage", "--no-progress"]) == 1
    assert "expected a typed model" in caplog.text
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "rgcn"])
    assert "--servers or --partition-dir" in capsys.readouterr().err


@pytest.mark.parametrize(("kind", "model"), [("plain", "sage"), ("plain-dir", "sage"), ("typed-dir", "rgcn"),
                                            ("typed-dir", "hetero-sage")])
def test_two_ddp_ranks_train_every_seed_once_and_stay_identical(
        kind: str, model: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """torchrun with 2 gloo ranks: equal batch counts, every training seed once per epoch,
    one set of weights."""
    run = _run_of(kind, request)
    args = [*run.args(tmp_path, "--epochs", "1"), "--model", model]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "trainer_client.train", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = _metrics(tmp_path)
    assert metrics["world_size"] == 2 and metrics["model"]["model"] == model
    assert len(set(metrics["param_fingerprints"])) == 1
    assert metrics["epochs"][0]["seeds"] == run.seeds  # every training seed once, over both ranks


def test_ctrl_c_ends_a_run_in_one_line_whose_command_resumes_it(request: pytest.FixtureRequest,
                                                                tmp_path: Path) -> None:
    """SIGINT (Ctrl-C) in graphfeed-train: exit status 130 and one line, no traceback,
    naming the last checkpoint's epoch and path and the command that continues the run,
    which does."""
    argv = _run_of("plain-dir", request).args(tmp_path, "--epochs", "1000")
    proc = subprocess.Popen([sys.executable, "-m", "trainer_client.train", *argv], cwd=REPO, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1"))
    checkpoint = tmp_path / "ckpt" / CHECKPOINT_NAME
    try:
        deadline = time.monotonic() + 300
        while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the condition: the first epoch's checkpoint is written
        assert checkpoint.exists() and proc.poll() is None
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert len(lines) == 1, err[-3000:]
    said = re.search(r"interrupted: saved epoch (\d+) in (\S+); continue with: graphfeed-train (.+)$",
                     lines[0])
    assert said and Path(said.group(2)) == checkpoint, lines[0]
    again = shlex.split(said.group(3))
    assert again == [*argv, "--resume"]
    epoch = int(said.group(1))
    assert main([*again, "--epochs", str(epoch + 2)]) == 0
    assert _metrics(tmp_path)["start_epoch"] == epoch + 1


@pytest.mark.parametrize("raised", ["interrupt", "interrupt in a kernel", "system error after a stop request",
                                    "other system error"])
def test_an_interrupt_inside_a_compiled_kernel_is_an_interrupt(
        raised: str, parts2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Ctrl-C that lands inside a Numba kernel reaches Python as a SystemError caused by
    the KeyboardInterrupt (or, unchained, after the SIGINT handler asked to stop): it ends
    the run as Ctrl-C does (130, one line); any other SystemError is not taken for one."""
    from trainer_client import loop

    def run(*_: object) -> None:
        if raised == "interrupt":
            raise KeyboardInterrupt
        if raised == "system error after a stop request":  # the interrupt's own exception not chained
            loop.stop_requested.set()
            raise SystemError("CPUDispatcher returned a result with an exception set")
        try:
            raise KeyboardInterrupt if raised == "interrupt in a kernel" else ValueError("bug")
        except (KeyboardInterrupt, ValueError) as cause:
            raise SystemError("CPUDispatcher returned a result with an exception set") from cause

    monkeypatch.setattr(train, "run", run)
    argv = ["--partition-dir", str(parts2), "--device", "cpu", "--checkpoint-dir", str(tmp_path)]
    if raised == "other system error":
        with pytest.raises(SystemError):
            train.main(argv)
        return
    with caplog.at_level(logging.WARNING, logger="trainer_client.train"):
        assert train.main(argv) == 130
    assert [r.getMessage() for r in caplog.records if "interrupted" in r.getMessage()] == [
        f"interrupted: nothing saved yet in {tmp_path}; continue with: graphfeed-train "
        f"{shlex.join([*argv, '--resume'])}"]


def test_a_ctrl_c_that_python_dropped_still_ends_the_run_at_the_next_step(
        parts2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A KeyboardInterrupt raised where Python drops it (inside a finalizer it is printed
    and swallowed) leaves the stop request set: the next step ends the run as Ctrl-C
    does (130, one line), and the SIGINT handler is the caller's again afterwards."""
    from trainer_client import loop

    step = NodeTask.step
    steps: list[int] = []

    def swallowed(self: NodeTask, *args: object) -> object:
        steps.append(1)
        loop.stop_requested.set()  # what the SIGINT handler does before its exception is lost
        return step(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(NodeTask, "step", swallowed)
    before = signal.getsignal(signal.SIGINT)
    argv = ["--partition-dir", str(parts2), "--device", "cpu", "--checkpoint-dir", str(tmp_path),
            "--epochs", "50", "--no-progress"]
    with caplog.at_level(logging.WARNING, logger="trainer_client.train"):
        assert train.main(argv) == 130
    assert len(steps) == 1
    assert len([r for r in caplog.records if "interrupted" in r.getMessage()]) == 1
    assert signal.getsignal(signal.SIGINT) is before
    assert not loop.stop_requested.is_set()  # a later run in this process is not stopped


@dataclass(kw_only=True)
class _TaskWithState(NodeTask):
    """A task with state beyond its model's weights (as server-held embeddings have)."""

    steps: int = 0
    loaded: list[dict[str, Any]] = field(default_factory=list)
    selected: list[bool] = field(default_factory=list)

    def after_step(self) -> None:
        self.steps += 1

    def state_dict(self, selected: bool = False) -> dict[str, Any]:
        self.selected.append(selected)
        return {"steps": torch.tensor(self.steps), "snapshot": f"after-{self.steps}"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded.append(state)


def test_a_tasks_own_state_and_step_hook_go_through_the_loop(parts2: Path, tmp_path: Path) -> None:
    """The loop calls a task's after_step once per optimizer step, keeps its state_dict
    in both checkpoints (saying when the epoch is the best so far), hands it back on
    --resume before training on, and the selected epoch's at the end when that is not the
    last epoch."""
    def task(*extra: str) -> _TaskWithState:
        args = train.parse_args(["--partition-dir", str(parts2), "--fanouts", "3", "--batch-size", "400",
                                 "--hidden", "8", "--device", "cpu", "--no-progress",
                                 "--checkpoint-dir", str(tmp_path), *extra])
        node = partition_dir_task(args, ONE)
        return _TaskWithState(**{f.name: getattr(node, f.name) for f in fields(node)})

    first = task("--epochs", "2")
    metrics = run_task(first.args, ONE, first)
    batches = metrics["epochs"][0]["batches"]
    assert first.steps == 2 * batches
    saved = torch.load(tmp_path / CHECKPOINT_NAME, weights_only=True)["task"]
    assert saved == {"steps": torch.tensor(2 * batches), "snapshot": f"after-{2 * batches}"}
    best = torch.load(tmp_path / BEST_NAME, weights_only=True)
    assert best["task"]["steps"] == (best["epoch"] + 1) * batches
    scores = [h["val_acc"] for h in metrics["epochs"]]
    assert first.selected == [True, scores[1] > scores[0]]
    assert first.loaded == ([] if metrics["selected_epoch"] == 1 else [best["task"]])
    again = task("--epochs", "3", "--resume")
    run_task(again.args, ONE, again)
    assert again.loaded[0] == saved and again.steps == batches


class _Crash(Exception):
    """The process of a run dies (an exception out of the loop)."""


@dataclass(kw_only=True)
class _Crashing(NodeTask):
    """A task that dies before its ``at``-th training step (counted over epochs)."""

    at: int = -1
    steps: int = 0

    def step(self, model: torch.nn.Module, batch: Any) -> Any:
        if self.steps == self.at:
            raise _Crash
        self.steps += 1
        return super().step(model, batch)


def test_a_run_resumed_from_a_step_checkpoint_ends_as_the_unbroken_run(parts2: Path, tmp_path: Path) -> None:
    """--checkpoint-every 3: a run that dies at step 4 of epoch 1 leaves the checkpoint of
    step 3 (the epoch's progress and training sums with it); --resume trains the rest of
    the epoch, the same batches, and ends with the unbroken run's weights and figures."""
    def task(out: Path, *extra: str) -> _Crashing:
        args = train.parse_args(["--partition-dir", str(parts2), "--fanouts", "3", "--batch-size", "100",
                                 "--hidden", "8", "--dropout", "0", "--device", "cpu", "--no-progress",
                                 "--epochs", "2", "--checkpoint-every", "3", "--checkpoint-dir", str(out),
                                 *extra])
        node = partition_dir_task(args, ONE)
        return _Crashing(**{f.name: getattr(node, f.name) for f in fields(node)})

    whole = task(tmp_path / "whole")
    unbroken = run_task(whole.args, ONE, whole)
    batches = unbroken["epochs"][0]["batches"]
    dying = task(tmp_path / "broken")
    dying.at = batches + 4
    with pytest.raises(_Crash):
        run_task(dying.args, ONE, dying)
    checkpoint = tmp_path / "broken" / CHECKPOINT_NAME
    assert train.last_saved(tmp_path / "broken") == (checkpoint, "step 3 of epoch 1")
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["epoch"] == 0 and saved["partial"]["seeds"] == 300 and saved["partial"]["sums"][3] == 300
    again = task(tmp_path / "broken", "--resume")
    resumed = run_task(again.args, ONE, again)
    assert again.steps == batches - 3 and resumed["start_epoch"] == 1
    assert resumed["param_fingerprints"] == unbroken["param_fingerprints"]
    for a, b in zip(resumed["epochs"], unbroken["epochs"], strict=True):
        assert a["seeds"] == b["seeds"] and a["val_acc"] == b["val_acc"]
        assert a["loss"] == pytest.approx(b["loss"]) and a["train_acc"] == pytest.approx(b["train_acc"])
    torch.save(saved, checkpoint)  # the step's checkpoint again
    other = task(tmp_path / "broken", "--resume", "--seed", "1")
    with pytest.raises(ValueError, match=r"--seed: the checkpoint in .* was taken at step 3 of epoch 1 with "
                                         r"--seed 0 \(the epoch's order\), got 1"):
        run_task(other.args, ONE, other)


# ---- the plain graph's evaluation and a graph without training nodes ---------------------


def test_no_progress_bar_when_stderr_is_not_a_terminal(
    servers: list[str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    argv = [a for a in [*_args_plain(servers, tmp_path), "--epochs", "1"] if a != "--no-progress"]
    assert main(argv) == 0
    assert "\r" not in capfd.readouterr().err


def test_a_graph_without_training_nodes_is_refused_with_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from graph_fixtures import mixed_graph

    from partitioner import partition_graph

    graph = mixed_graph()
    graph.splits = {"val": graph.splits["val"], "test": graph.splits["test"]}
    partition_graph(graph, 1, tmp_path / "no-train", method="range", progress=False)
    with real_servers(tmp_path / "no-train", 1) as addresses:
        assert main([*_args_plain(addresses, tmp_path), "--epochs", "1"]) == 1
    assert "split: the graph has no 'train' nodes on any partition (nothing to iterate)" in caplog.text
