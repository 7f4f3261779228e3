"""``graphfeed-train --sparse-embedding``: featureless node types trained with embeddings
held by the servers, for the node task (typed graph: R-GCN and hetero-sage) and the link
task (a plain graph without features, and a typed one), with 1 and 2 DDP ranks; a
resumed run equals an unbroken one bit for bit; a server restarted mid-training is named
and --resume continues; the tables leave the servers when the run ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from in_process_servers import server_config, serving

from partitioner import partition_graph
from partitioner.synthetic import generate
from sampling_server.server import SamplingServer, create_server
from trainer_client.train import main

REPO = Path(__file__).resolve().parents[1]
GRAPHS = {"typed": "mag-small", "bare": "citation2-bare-small"}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for kind, preset in GRAPHS.items():
        root = tmp_path_factory.mktemp(kind)
        graph = generate(preset, progress=False)
        if kind == "typed":  # hetero-sage (to_hetero) updates every type: each needs in-edges
            graph = graph.add_reverse()  # type: ignore[union-attr]
        partition_graph(graph, 2, root, method="random", progress=False)
        out[kind] = root
    return out


@pytest.fixture(scope="module")
def clusters(roots: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[dict[str, tuple[list[str], list[SamplingServer]]]]:
    contexts = {kind: serving(root, 2, state_dir=tmp_path_factory.mktemp(f"state-{kind}"))
                for kind, root in roots.items()}
    try:
        yield {kind: context.__enter__() for kind, context in contexts.items()}
    finally:
        for context in contexts.values():
            context.__exit__(None, None, None)


def _args(addresses: list[str], out: Path, *extra: str) -> list[str]:
    return ["--servers", ",".join(addresses), "--fanouts", "5,5", "--hidden", "16", "--batch-size", "256",
            "--no-progress", "--device", "cpu", "--metrics-json", str(out / "metrics.json"), "--seed", "3",
            *extra]


def _metrics(out: Path) -> dict[str, Any]:
    metrics: dict[str, Any] = json.loads((out / "metrics.json").read_text())
    return metrics


def _held(servers: list[SamplingServer]) -> list[str]:
    return sorted(t.spec.name for s in servers for t in s.node_tensors.tensors())


@pytest.mark.parametrize("model", ["rgcn", "hetero-sage"])
def test_a_typed_graph_trains_with_server_held_embeddings(
    clusters: dict[str, tuple[list[str], list[SamplingServer]]], tmp_path: Path, model: str
) -> None:
    addresses, servers = clusters["typed"]
    assert main(_args(addresses, tmp_path, "--model", model, "--epochs", "2", "--sparse-embedding",
                      "--embedding-dim", "8")) == 0
    metrics = _metrics(tmp_path)
    assert metrics["model"]["embedding"] == {"dim": 8, "sparse": True}
    assert metrics["test_acc"] > 0.2  # 8 classes, weakly informative features: learns beyond chance
    assert _held(servers) == []  # the run's tables left the servers' memory


@pytest.mark.parametrize("sparse", [False, True])
def test_a_featureless_plain_graph_learns_links_from_embeddings_alone(
    clusters: dict[str, tuple[list[str], list[SamplingServer]]], tmp_path: Path, sparse: bool
) -> None:
    addresses, _ = clusters["bare"]
    extra = ["--sparse-embedding"] if sparse else []
    assert main(_args(addresses, tmp_path, "--task", "link", "--epochs", "3", *extra)) == 0
    metrics = _metrics(tmp_path)
    # 100 negatives per edge: a random ranking's MRR is about 0.05 (exact evaluation, layer-wise)
    assert metrics["test_mrr"] > 0.08


@pytest.mark.parametrize(("kind", "task"), [("typed", "node"), ("bare", "link")])
def test_a_resumed_run_equals_an_unbroken_one_bit_for_bit(
    clusters: dict[str, tuple[list[str], list[SamplingServer]]], tmp_path: Path, kind: str, task: str
) -> None:
    addresses, servers = clusters[kind]
    common = ["--task", task, "--sparse-embedding", *(["--model", "rgcn"] if kind == "typed" else [])]
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    assert main(_args(addresses, unbroken, *common, "--epochs", "3", "--checkpoint-dir", str(unbroken))) == 0
    assert main(_args(addresses, broken, *common, "--epochs", "2", "--checkpoint-dir", str(broken))) == 0
    assert main(_args(addresses, broken, *common, "--epochs", "3", "--checkpoint-dir", str(broken),
                      "--resume")) == 0
    want, got = _metrics(unbroken), _metrics(broken)
    assert got["start_epoch"] == 2
    assert got["param_fingerprints"] == want["param_fingerprints"]
    figure = "test_acc" if task == "node" else "test_mrr"
    assert got[figure] == want[figure]
    assert [h["loss"] for h in got["epochs"]] == [h["loss"] for h in want["epochs"]]
    assert _held(servers) == []


def test_two_ddp_ranks_train_with_server_held_embeddings(
    clusters: dict[str, tuple[list[str], list[SamplingServer]]], tmp_path: Path
) -> None:
    addresses, servers = clusters["typed"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "trainer_client.train", *_args(addresses, tmp_path, "--model", "rgcn", "--epochs", "1",
                                                "--sparse-embedding")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = _metrics(tmp_path)
    assert metrics["world_size"] == 2 and len(set(metrics["param_fingerprints"])) == 1
    assert _held(servers) == []


def test_a_server_restarted_mid_training_is_named_and_resume_continues(
    roots: dict[str, Path], tmp_path: Path
) -> None:
    """A server killed and restarted while a job trains reloads its last snapshot; the
    trainer ends naming it and --resume (the rows since the snapshot are lost), and the
    resumed job finishes."""
    state = tmp_path / "state"
    with serving(roots["typed"], 2, state_dir=state) as (addresses, servers):
        args = _args(addresses, tmp_path, "--model", "rgcn", "--epochs", "40", "--sparse-embedding",
                     "--checkpoint-dir", str(tmp_path / "ckpt"), "--reconnect-timeout", "60")
        proc = subprocess.Popen([sys.executable, "-m", "trainer_client.train", *args], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1"))
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.extend(proc.stdout or []), daemon=True)
        reader.start()
        deadline = time.monotonic() + 300
        # the embeddings' first snapshot (layer-wise evaluation snapshots its layers too)
        while not (state / "p1").is_dir() or not any((state / "p1").glob("emb*/*/meta.json")):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(output)[-3000:]
            time.sleep(0.2)  # polls files written by another process: no event to wait on
        port = servers[1].port
        servers[1].stop(None).wait(10)
        servers[1], _ = create_server(server_config(roots["typed"], 1, listen=f"127.0.0.1:{port}",
                                                    state_dir=state))
        servers[1].set_peers(addresses)
        servers[1].start()
        assert servers[1].wait_until_serving(60)
        assert proc.wait(timeout=300) == 1
        reader.join(30)
        text = "".join(output)
        assert "partition 1" in text and "--resume" in text and "lost" in text, text[-3000:]
        again = [a if a != "40" else "2" for a in args]
        assert main([*again, "--resume"]) == 0
        assert _metrics(tmp_path)["start_epoch"] >= 1


def test_a_trainer_killed_mid_epoch_resumes_to_the_unbroken_result(
    clusters: dict[str, tuple[list[str], list[SamplingServer]]], tmp_path: Path
) -> None:
    """kill -9 of a trainer whose server-held tables are past its last checkpoint: --resume
    puts them back to the checkpoint's snapshot, and the run ends as an unbroken one."""
    addresses, servers = clusters["typed"]
    common = ["--model", "rgcn", "--sparse-embedding", "--epochs", "3"]
    unbroken, killed = tmp_path / "unbroken", tmp_path / "killed"
    assert main(_args(addresses, unbroken, *common, "--checkpoint-dir", str(unbroken))) == 0
    args = _args(addresses, killed, *common, "--checkpoint-dir", str(killed))
    proc = subprocess.Popen([sys.executable, "-m", "trainer_client.train", *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1"))
    deadline = time.monotonic() + 300
    try:
        while True:  # the first checkpoint written, and a step past it applied on the servers
            steps = [t.step for t in servers[0].node_tensors.tensors()]
            if (killed / "checkpoint.pt").exists() and steps and max(steps) > _checkpoint_step(killed):
                break
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it was killed"
            time.sleep(0.02)  # watches another process's files and the servers' state
    finally:
        proc.kill()
        proc.wait(30)
    assert main([*args, "--resume"]) == 0
    want, got = _metrics(unbroken), _metrics(killed)
    assert got["param_fingerprints"] == want["param_fingerprints"]
    assert got["test_acc"] == want["test_acc"]


def _checkpoint_step(directory: Path) -> int:
    """The server-held tables' step the checkpoint in ``directory`` records."""
    import torch

    try:
        saved = torch.load(directory / "checkpoint.pt", map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError):
        return 1 << 30  # being replaced: look again
    return int(saved["task"]["node_tensors"]["step"])
