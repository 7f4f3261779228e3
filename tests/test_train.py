"""Tests for trainer_client/models.py and train.py: models on sampled batches, and the
trainer end to end against real sampling servers in this process (world size 1), plus
a two-rank DDP run over Gloo in subprocesses."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from test_decode import encode_batch, fake_batch
from test_loader import real_servers

from protos.security import Security, default_security, set_default_security
from trainer_client.decode import decode_batch
from trainer_client.evaluate import layerwise_logits
from trainer_client.loader import RemoteNeighborLoader
from trainer_client.models import MODELS, batch_inputs, build_model
from trainer_client.train import BEST_NAME, CHECKPOINT_NAME, main

REPO = Path(__file__).resolve().parents[1]


# ---- models ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_trimmed_forward_gives_the_seeds_the_same_logits(name: str) -> None:
    torch.manual_seed(0)
    data = decode_batch(encode_batch(0, fake_batch(np.arange(6), num_hops=2))).data
    model = build_model(name, 4, 3, hidden_channels=8, num_layers=2, dropout=0.0).eval()
    x, edge_index, batch_size, nodes, edges = batch_inputs(data)
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
        ({"name": "mlp"}, r"model: expected one of \['sage', 'gcn', 'gat', 'gin'\], got 'mlp'"),
        ({"num_layers": 0}, r"num_layers: expected an integer >= 1, got 0"),
        ({"dropout": 1.0}, r"dropout: expected 0 <= dropout < 1, got 1.0"),
        ({"name": "gat", "hidden_channels": 10, "heads": 4}, r"heads: expected an integer >= 1 dividing"),
    ],
)
def test_bad_model_settings_name_the_field(kwargs: dict[str, object], pattern: str) -> None:
    args: dict[str, object] = {"name": "sage", "in_channels": 4, "out_channels": 3, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        build_model(**args)  # type: ignore[arg-type]


# ---- the trainer -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    pytest.importorskip("sampling_server.server")
    with real_servers(tmp_path_factory.mktemp("graph") / "small-2") as addresses:
        yield addresses


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _args(servers: list[str], tmp_path: Path, *extra: str) -> list[str]:
    return ["--servers", ",".join(servers), "--fanouts", "5,3", "--batch-size", "200", "--hidden", "32",
            "--lr", "0.01", "--dropout", "0.2", "--device", "cpu", "--timeout", "30", "--no-progress",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-json", str(tmp_path / "metrics.json"),
            *extra]


def test_training_writes_metrics_and_checkpoints_then_resumes(servers: list[str], tmp_path: Path) -> None:
    assert main(_args(servers, tmp_path, "--epochs", "2")) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["world_size"] == 1 and metrics["start_epoch"] == 0
    assert [e["epoch"] for e in metrics["epochs"]] == [0, 1]
    for e in metrics["epochs"]:
        assert e["seeds"] == 1200 and e["batches"] >= 6 and e["seeds_per_second"] > 0
        assert 0 <= e["train_acc"] <= 1 and 0 <= e["val_acc"] <= 1 and e["loss"] > 0
        assert e["received_mb"] > 0 and e["cache_hit_rate"] is None  # no cache on the CPU by default
    assert metrics["epochs"][1]["loss"] < metrics["epochs"][0]["loss"]
    assert metrics["test_acc"] > 1 / 6  # better than chance on 6 classes
    state = torch.load(tmp_path / "ckpt" / CHECKPOINT_NAME, weights_only=True)
    assert state["epoch"] == 1 and set(state) >= {"model", "optimizer", "history"}
    vals = [e["val_acc"] for e in metrics["epochs"]]
    assert metrics["selected_epoch"] == int(np.argmax(vals)) and metrics["selected_val_acc"] == max(vals)
    assert metrics["eval_fanouts"] == "full" and metrics["batch_size_per_step"] == 200
    best = torch.load(tmp_path / "ckpt" / BEST_NAME, weights_only=True)
    assert best["epoch"] == metrics["selected_epoch"]

    assert main(_args(servers, tmp_path, "--epochs", "3", "--resume")) == 0
    resumed = json.loads((tmp_path / "metrics.json").read_text())
    assert resumed["start_epoch"] == 2
    assert [e["epoch"] for e in resumed["epochs"]] == [0, 1, 2]
    assert resumed["epochs"][:2] == metrics["epochs"]
    vals = [e["val_acc"] for e in resumed["epochs"]]
    assert resumed["selected_epoch"] == int(np.argmax(vals))  # the earliest best, across the resume


def test_an_epoch_reports_its_cache_hits_and_bytes(servers: list[str], tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "trainer_client.train"):
        assert main(_args(servers, tmp_path, "--epochs", "1", "--cache-size", "0.3")) == 0
    cached = json.loads((tmp_path / "metrics.json").read_text())["epochs"][0]
    assert 0.3 < cached["cache_hit_rate"] <= 1  # the hot 30 % of nodes: more than their share
    assert main(_args(servers, tmp_path, "--epochs", "1", "--cache-size", "0")) == 0
    plain = json.loads((tmp_path / "metrics.json").read_text())["epochs"][0]
    assert plain["cache_hit_rate"] is None and 0 < cached["received_mb"] < plain["received_mb"]
    assert re.search(r"epoch 0: .*\(rank 0: waited \d+\.\d s for data, received \d+\.\d MB, "
                     r"cache hits \d+\.\d%\)", caplog.text)


@pytest.mark.parametrize("name", ["sage", "gat"])
def test_layerwise_inference_through_the_service_equals_the_full_graph_forward(
    servers: list[str], name: str
) -> None:
    from partitioner.synthetic import generate

    graph = generate("small", progress=False)
    torch.manual_seed(0)
    model = build_model(name, graph.feature_dim, graph.num_classes, hidden_channels=16, num_layers=2).eval()
    all_nodes = torch.ones(graph.num_nodes, dtype=torch.bool)
    with RemoteNeighborLoader(servers, input_nodes=all_nodes, num_neighbors=[-1], batch_size=700,
                              batches="partition", connect_timeout=30) as loader:
        logits, y = layerwise_logits(model, loader, distributed=False, device=torch.device("cpu"))
    with torch.no_grad():
        full = model(torch.from_numpy(graph.x), torch.from_numpy(graph.edge_index))
    assert torch.equal(y, torch.from_numpy(graph.y))
    assert torch.allclose(logits, full, atol=1e-4)


def test_no_progress_bar_when_stderr_is_not_a_terminal(
    servers: list[str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    argv = [a for a in _args(servers, tmp_path, "--epochs", "1") if a != "--no-progress"]
    assert main(argv) == 0
    assert "\r" not in capfd.readouterr().err


def test_sampled_evaluation_with_eval_fanouts(servers: list[str], tmp_path: Path) -> None:
    assert main(_args(servers, tmp_path, "--epochs", "1", "--eval-fanouts", "4,2")) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["eval_fanouts"] == [4, 2] and metrics["selected_epoch"] == 0
    assert metrics["test_acc"] > 1 / 6


@pytest.mark.parametrize(("device", "message"), [
    ("cuda", "--device cuda: CUDA is not available here"),
    ("cuda:3", "--device cuda:3: CUDA is not available here"),
    ("tpu", "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
])
def test_a_device_this_machine_lacks_is_a_plain_error(
    device: str, message: str, caplog: pytest.LogCaptureFixture
) -> None:
    if torch.cuda.is_available() and device.startswith("cuda"):
        pytest.skip("this machine has CUDA")
    assert main(["--servers", "127.0.0.1:1", "--device", device, "--timeout", "1"]) == 1
    assert message in caplog.text


def test_main_leaves_the_callers_default_security_as_it_found_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """main() sets the channels' default security for its run and restores it after, so
    that later loaders in the same process read theirs (the environment, or their own)."""
    for name in ("GRAPHFEED_TLS_CA", "GRAPHFEED_TOKEN", "GRAPHFEED_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert main(["--servers", "127.0.0.1:1", "--timeout", "0.5", "--device", "cpu"]) == 1
    monkeypatch.setenv("GRAPHFEED_TOKEN", "from-the-environment")
    assert default_security().token == "from-the-environment"
    own = Security(token="own")
    set_default_security(own)
    try:
        assert main(["--servers", "127.0.0.1:1", "--timeout", "0.5", "--device", "cpu"]) == 1
        assert default_security() is own
    finally:
        set_default_security(None)


@pytest.mark.parametrize(("args", "message"), [
    (["--dist-backend", "mpi"], "--dist-backend: invalid choice: 'mpi'"),
    (["--device", "cpu", "--dist-backend", "nccl"],
     "--dist-backend nccl: expected a CUDA --device, got 'cpu'; use gloo on the CPU"),
])
def test_a_bad_dist_backend_is_a_plain_error(args: list[str], message: str,
                                            caplog: pytest.LogCaptureFixture,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["--servers", "127.0.0.1:1", "--timeout", "1", *args])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code not in (0, None)
    assert message in caplog.text + capsys.readouterr().err


def test_gloo_on_the_cpu_is_what_auto_picks() -> None:
    from trainer_client.train import setup_distributed

    env = setup_distributed("cpu", 1.0, "auto")  # one rank: no process group is started
    assert env.backend == "" and env.comm_device == torch.device("cpu")
    with pytest.raises(ValueError, match="--dist-backend: expected one of auto, nccl, gloo, got 'x'"):
        setup_distributed("cpu", 1.0, "x")


def test_a_graph_without_training_nodes_is_refused_with_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from graph_fixtures import mixed_graph

    from partitioner import partition_graph

    graph = mixed_graph()
    graph.splits = {"val": graph.splits["val"], "test": graph.splits["test"]}
    partition_graph(graph, 1, tmp_path / "no-train", method="range", progress=False)
    with real_servers(tmp_path / "no-train", 1) as addresses:
        assert main(_args(addresses, tmp_path, "--epochs", "1")) == 1
    assert "split: the graph has no 'train' nodes on any partition (nothing to iterate)" in caplog.text


def test_resuming_a_different_model_is_refused(
    servers: list[str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert main(_args(servers, tmp_path, "--epochs", "1", "--model", "gcn")) == 0
    assert main(_args(servers, tmp_path, "--epochs", "2", "--resume", "--model", "sage")) == 1
    assert "--resume: checkpoint" in caplog.text and "'model': 'gcn'" in caplog.text


def test_unreachable_servers_end_the_run_with_a_clear_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, reserve_ports: Callable[[int], list[int]]
) -> None:
    address = f"127.0.0.1:{reserve_ports(1)[0]}"  # held: nothing listens there
    assert main(["--servers", address, "--timeout", "1", "--device", "cpu"]) == 1
    assert f"server {address}: no ClusterInfo within connect_timeout=1 s" in caplog.text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fanouts", "5,x"], "expected comma-separated integers"),
        (["--fanouts", "5,-3"], "--fanouts: expected fanouts >= -1"),
        (["--batch-size", "0"], "expected a value > 0"),
        (["--resume"], "--resume: expected --checkpoint-dir too"),
        (["--model", "mlp"], "invalid choice: 'mlp'"),
    ],
)
def test_bad_flags_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--servers", "127.0.0.1:1", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_two_ranks_train_with_ddp_over_gloo(servers: list[str], tmp_path: Path,
                                           reserve_ports: Callable[[int], list[int]]) -> None:
    port = reserve_ports(1)[0]  # rank 0's TCPStore binds it
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        argv = _args(servers, tmp_path, "--epochs", "1")
        cmd = [sys.executable, "-m", "trainer_client.train", *argv]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["epochs"][0]["seeds"] == 1200  # every train seed once over both ranks
    assert metrics["epochs"][0]["batches"] >= 3  # per rank: 6 or more batches in all, over 2 ranks
