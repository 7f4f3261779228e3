"""The whole system as separate processes on 127.0.0.1: `python -m sampling_server` per
partition and `python -m trainer_client.train` per DDP rank (gloo), as a user runs them."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_procs import ENV, REPO

from partitioner import partition_graph
from partitioner.synthetic import generate
from protos.ports import reserved_ports


@pytest.fixture(scope="module")
def part_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cluster") / "small-2"
    partition_graph(generate("small", progress=False), 2, out, method="metis", progress=False)
    return out


class Cluster:
    """Sampling-server processes, one per partition, on ports reserved (with the DDP
    master's) until :meth:`stop`."""

    def __init__(self, part_dir: Path, num_parts: int = 2):
        self.part_dir = part_dir
        self._held = contextlib.ExitStack()
        *ports, self.master_port = self._held.enter_context(reserved_ports(num_parts + 1))
        self.addresses = [f"127.0.0.1:{p}" for p in ports]
        self.procs: list[subprocess.Popen[str]] = []

    def start(self) -> None:
        for p, address in enumerate(self.addresses):
            cmd = [sys.executable, "-m", "sampling_server", "--partition-dir", str(self.part_dir),
                   "--partition", str(p), "--listen", address, "--peers", ",".join(self.addresses),
                   "--log-level", "WARNING"]
            self.procs.append(subprocess.Popen(cmd, cwd=REPO, env=ENV, text=True))

    def stop(self) -> list[int | None]:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=30))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait(timeout=10))
        self._held.close()
        return codes


@pytest.fixture
def cluster(part_dir: Path) -> Iterator[Cluster]:
    c = Cluster(part_dir)
    try:
        yield c
    finally:
        c.stop()


def _trainers(cluster: Cluster, tmp_path: Path, *extra: str, world: int = 2,
              timeout: float = 30) -> list[subprocess.Popen[str]]:
    procs = []
    for rank in range(world):
        env = {**ENV, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(cluster.master_port)}
        cmd = [sys.executable, "-m", "trainer_client.train", "--servers", ",".join(cluster.addresses),
               "--fanouts", "5,3", "--batch-size", "100", "--hidden", "32", "--device", "cpu",
               "--timeout", str(timeout), "--no-progress", "--metrics-json",
               str(tmp_path / "metrics.json"), *extra]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def test_trainers_started_before_the_servers_connect_train_and_stay_in_sync(
    cluster: Cluster, tmp_path: Path
) -> None:
    trainers = _trainers(cluster, tmp_path, "--epochs", "3", timeout=60)
    time.sleep(3)  # the trainers are up and retrying before any server exists
    assert all(p.poll() is None for p in trainers)
    cluster.start()
    outputs = [p.communicate(timeout=240)[0] for p in trainers]
    assert [p.returncode for p in trainers] == [0, 0], outputs
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    # every training seed once per epoch over both ranks; equal batch counts per rank
    assert all(e["seeds"] == 1200 for e in metrics["epochs"])
    # both ranks hold identical parameters after the steps
    fingerprints = metrics["param_fingerprints"]
    assert len(fingerprints) == 2 and fingerprints[0] == fingerprints[1]
    assert metrics["test_acc"] > 0.5  # 6 classes: chance is 0.17
    assert cluster.stop() == [0, 0]  # SIGTERM drains and exits cleanly


def test_a_server_killed_mid_training_fails_the_trainers_clearly_without_hanging(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start()
    timeout = 8.0
    trainers = _trainers(cluster, tmp_path, "--epochs", "1000", "--log-level", "INFO",
                         timeout=timeout)
    # wait until training runs (rank 0 logs every epoch), then kill server 1 outright
    assert trainers[0].stdout is not None
    deadline = time.monotonic() + 120
    for line in trainers[0].stdout:
        if "epoch 1:" in line or time.monotonic() > deadline:
            break
    assert time.monotonic() < deadline, "training did not start"
    cluster.procs[1].kill()
    killed = time.monotonic()
    outputs = []
    for p in trainers:
        out, _ = p.communicate(timeout=6 * timeout + 90)
        outputs.append(out)
    elapsed = time.monotonic() - killed
    assert all(p.returncode not in (0, None) for p in trainers), outputs
    # --reconnect-timeout (15 s) + 2 s backoff, plus the processes' own exit
    assert elapsed < 45, f"the trainers ended {elapsed:.1f} s after the kill"
    print(f"both trainers ended {elapsed:.1f} s after the kill")
    text = "\n".join(outputs)
    assert "rank 0:" in text or "rank 1:" in text, text[-3000:]
    assert cluster.addresses[1] in text, text[-3000:]  # the error names the dead server
