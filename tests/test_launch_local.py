"""deploy/launch.py for real: start, status, logs and stop of 2 servers and 2 torchrun
trainers, through a stand-in `ssh` that runs each remote command line on this machine.

Everything but the ssh hop is what a cluster runs: the launcher's own command lines,
`nohup` in the background, pid and log files, SIGTERM on stop."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import yaml
from test_launch import launch, use_stand_in_ssh

from partitioner import partition_graph
from partitioner.synthetic import generate
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
NAMES = ["server-0", "server-1", "trainer-0", "trainer-1"]


def _states(cluster: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """Process name -> 'running' / 'not running', from `launch.py status`."""
    assert launch.main(["status", str(cluster)]) == 0
    states: dict[str, str] = {}
    current = None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("== "):
            current = line[3:].split(" on ")[0]
        elif current is not None and current not in states and "running" in line:
            states[current] = "not running" if line.startswith("not running") else "running"
    return states


def _wait_for(cluster: Path, capsys: pytest.CaptureFixture[str], names: list[str], state: str,
              timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        states = _states(cluster, capsys)
        if all(states.get(n) == state for n in names) or time.monotonic() > deadline:
            return states
        time.sleep(1)


def _unauthenticated(address: str, timeout: float = 60.0) -> bool:
    """Whether a caller without the token gets UNAUTHENTICATED (waits for the server)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.SamplingServiceStub(channel)
        while True:
            try:
                stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=5)
                return False
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    return True
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


@pytest.mark.slow
def test_launcher_runs_a_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str],
                                 reserve_ports: Callable[[int], list[int]]) -> None:
    use_stand_in_ssh(tmp_path, monkeypatch)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", str(REPO))

    parts = tmp_path / "small-2"
    partition_graph(generate("small", progress=False), 2, parts, method="metis", progress=False)
    p0, p1, master = reserve_ports(3)
    metrics = tmp_path / "metrics.json"
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({
        "python": sys.executable, "workdir": str(REPO), "log_dir": str(tmp_path / "logs"),
        "partition_dir": str(parts),
        "servers": [{"host": "127.0.0.1", "port": p0, "partition": 0, "device": "cpu"},
                    {"host": "127.0.0.1", "port": p1, "partition": 1, "device": "cpu"}],
        "trainers": {"hosts": ["127.0.0.1", "localhost"], "gpus_per_host": 1,
                     "master_port": master,
                     "args": {"epochs": 2, "fanouts": [5, 3], "batch_size": 100,
                              "device": "cpu", "timeout": 60, "no_progress": True,
                              "metrics_json": str(metrics)}},
    }))
    try:
        assert launch.main(["start", str(cluster)]) == 0
        capsys.readouterr()
        # secure by default: the launcher made the cluster's token and handed it over a file
        on_node = tmp_path / "logs" / "graphfeed.token"
        assert on_node.read_bytes() == (tmp_path / "cluster.token").read_bytes()
        assert on_node.stat().st_mode & 0o777 == 0o600
        assert _unauthenticated(f"127.0.0.1:{p0}"), "a caller without the token was served"
        states = _wait_for(cluster, capsys, ["trainer-0", "trainer-1"], "not running", 240)
        assert states == {"server-0": "running", "server-1": "running",
                          "trainer-0": "not running", "trainer-1": "not running"}, states

        gathered = tmp_path / "gathered"
        assert launch.main(["logs", str(cluster), "--out", str(gathered)]) == 0
        assert sorted(p.stem for p in gathered.iterdir()) == NAMES
        trainer_log = (gathered / "trainer-0.log").read_text()
        assert "test acc" in trainer_log, trainer_log[-3000:]
        result = json.loads(metrics.read_text())
        assert result["world_size"] == 2 and result["test_acc"] > 0.5
        assert len(set(result["param_fingerprints"])) == 1
    finally:  # stop even after a failure above (and do not hide that failure)
        stopped = launch.main(["stop", str(cluster)])
        stop_output = capsys.readouterr().out
        states = _wait_for(cluster, capsys, NAMES, "not running", 60)
    assert stopped == 0, stop_output
    # The finished trainers are reported, not treated as failures.
    assert stop_output.count("sent SIGTERM") == 2 and stop_output.count("not running (exited)") == 2
    assert set(states.values()) == {"not running"}, states
    # The servers drained on SIGTERM and stopped cleanly.
    for name in ("server-0", "server-1"):
        text = (tmp_path / "logs" / f"{name}.log").read_text()
        assert "SIGTERM: draining" in text and text.rstrip().endswith("stopped"), text[-2000:]
