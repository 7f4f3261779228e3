"""``graphfeed-local``: servers for every partition on one machine, the trainer against
them, the servers stopped, the trainer's exit code returned."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from partitioner import partition_graph
from partitioner.synthetic import generate
from trainer_client.local import serving

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("local") / "small-2"
    partition_graph(generate("small", progress=False), 2, root, method="metis", progress=False)
    return root


def local(*argv: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``graphfeed-local argv`` run in ``cwd`` (where its run directories go)."""
    return subprocess.run([sys.executable, "-m", "trainer_client.local", *argv], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout)


def refused(argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
            capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    """``graphfeed-local argv`` in this process, in ``tmp_path``, for a run refused before
    any server starts (starting one fails the test): its exit code and its stderr."""
    from trainer_client import local as local_module

    def no_servers(*_: object) -> None:
        raise AssertionError("a server was started")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(local_module, "local_servers", no_servers)
    try:
        code: object = local_module.main(argv)
    except SystemExit as exc:  # argparse's errors
        code = exc.code
    return code, capsys.readouterr().err


def _addresses(stderr: str) -> list[str]:
    found = re.search(r"started 2 sampling servers on (\S+)", stderr)
    assert found, stderr
    return found.group(1).split(",")


def test_trains_on_own_partitions_and_stops_the_servers(parts: Path, tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.json"
    done = local("--partition-dir", str(parts), "--server-device", "cpu", "--",
                 "--epochs", "1", "--fanouts", "5,3", "--batch-size", "300", "--hidden", "16",
                 "--device", "cpu", "--timeout", "60", "--metrics-json", str(metrics), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(metrics.read_text())
    assert result["selected_epoch"] == 0 and result["test_acc"] > 1 / 6
    assert "sampling servers stopped (exit codes [0, 0])" in done.stderr
    assert not any(serving(a, timeout=0.5) for a in _addresses(done.stderr))
    # the servers' logs in a run directory of their own, none in the user's partitions
    runs = list((tmp_path / "graphfeed-local-runs").iterdir())
    assert len(runs) == 1 and re.fullmatch(r"\d{8}-\d{6}", runs[0].name), runs
    assert {p.name for p in runs[0].glob("server-*.log")} == {"server-0.log", "server-1.log"}
    assert f"logs in {runs[0]}" in done.stderr
    assert not (parts / "logs").exists()


def test_returns_the_trainers_exit_code(parts: Path, tmp_path: Path) -> None:
    """A trainer that fails once it sees the servers' graph (a typed model on a plain one)."""
    done = local("--partition-dir", str(parts), "--server-device", "cpu", "--log-dir", str(tmp_path),
                 "--", "--model", "rgcn", "--device", "cpu", "--timeout", "60", cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "--model rgcn: expected a typed graph (format v2)" in done.stderr
    assert "trainer exited with 1" in done.stderr and "sampling servers stopped" in done.stderr


@pytest.mark.parametrize(("argv", "message"), [
    (["--partition-dir", "/nonexistent/parts"], "graphfeed-local: error: --partition-dir:"),
    (["--partition-dir", "x", "--", "--servers", "a:1"], "--servers: graphfeed-local passes the servers"),
    (["--partition-dir", "x", "--nproc-per-node", "0"], "--nproc-per-node: expected an integer >= 1"),
    (["--partition-dir", "x", "--nnodes", "3:2"], "--nnodes: expected 1 <= MIN <= MAX, got '3:2'"),
    (["--partition-dir", "x", "--nnodes", "two"], "--nnodes: expected N or MIN:MAX, got 'two'"),
    # trainer flags without '--': the message names the command that works
    (["--partition-dir", "parts", "--epochs", "1", "--", "--fanouts", "5,3"],
     "unrecognized arguments: --epochs 1; graphfeed-train's arguments go after '--': "
     "graphfeed-local --partition-dir parts -- --epochs 1 --fanouts 5,3"),
])
def test_bad_flags_exit_2(argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                         capsys: pytest.CaptureFixture[str]) -> None:
    code, stderr = refused(argv, tmp_path, monkeypatch, capsys)
    assert code == 2 and message in stderr, stderr
    assert not (tmp_path / "graphfeed-local-runs").exists()


def test_bad_flags_exit_2_from_the_command(tmp_path: Path) -> None:
    """The same through the installed module's entry point, in a process of its own."""
    done = local("--partition-dir", "/nonexistent/parts", cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and "graphfeed-local: error: --partition-dir:" in done.stderr


@pytest.mark.parametrize(("trainer_args", "message"), [
    (["--epochs", "1", "--bogus"], "graphfeed-train: error: unrecognized arguments: --bogus"),
    (["--batch-size", "0"], "graphfeed-train: error: argument --batch-size: expected a value > 0, got 0"),
    (["--task", "link"], "graphfeed-local: error: --task link: expected a graph with link splits, but "),
    (["--checkpoint-dir", "ckpt"], "graphfeed-local: error: --nnodes 1:3: expected --checkpoint-dir and "
                                   "--resume in graphfeed-train's arguments"),
])
def test_the_trainers_arguments_are_checked_before_any_server_starts(
        trainer_args: list[str], message: str, parts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    elastic = ["--nnodes", "1:3"] if "--checkpoint-dir" in trainer_args else []
    code, stderr = refused(["--partition-dir", str(parts), "--server-device", "cpu", *elastic, "--",
                            *trainer_args], tmp_path, monkeypatch, capsys)
    assert code == 2 and message in stderr, stderr[-3000:]
    assert not (tmp_path / "graphfeed-local-runs").exists()


def test_servers_that_cannot_bind_their_ports_start_again_on_others(
    parts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where a reserved port cannot be bound (it was not reserved for sharing here), the
    servers start again on new ports instead of failing the run."""
    from trainer_client import local as local_module

    taken = socket.socket()  # bound without SO_REUSEADDR: no server can bind it
    taken.bind(("127.0.0.1", 0))
    real, calls = local_module.reserved_ports, []

    @contextlib.contextmanager
    def first_port_taken(count: int, host: str) -> Iterator[list[int]]:
        calls.append(count)
        with real(count, host) as ports:
            yield [taken.getsockname()[1], *ports[1:]] if len(calls) == 1 else ports

    monkeypatch.setattr(local_module, "reserved_ports", first_port_taken)
    args, _ = local_module.parse_args(["--partition-dir", str(parts), "--server-device", "cpu",
                                       "--log-dir", str(tmp_path), "--grace", "10"])
    with taken, local_module.local_servers(args, 2) as addresses:
        assert all(serving(a, timeout=5) for a in addresses)
    assert calls == [2, 2]
    assert "could not bind its port (attempt 1 of 3)" in caplog.text


def test_the_example_training_loop_runs_under_graphfeed_local(parts: Path, tmp_path: Path) -> None:
    done = local("--partition-dir", str(parts), "--server-device", "cpu", "--log-dir", str(tmp_path),
                 "--trainer-script", str(REPO / "examples" / "train_ddp.py"), "--", "--epochs", "1",
                 cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "epoch 0: val acc" in done.stdout
    assert re.search(r"best val acc 0\.\d{4}, test acc 0\.\d{4}\n$", done.stdout), done.stdout[-2000:]


def test_local_servers_share_the_machines_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer_client import local

    monkeypatch.setattr(local, "usable_cpus", lambda: 16)
    assert local.shared_cpus([], 2) == ["--threads=8"]
    assert local.shared_cpus(["--workers=1"], 3) == ["--workers=1", "--threads=5"]
    assert local.shared_cpus([], 32) == ["--threads=1"]
    assert local.shared_cpus(["--threads", "3"], 2) == ["--threads", "3"]  # the user's own wins
    assert local.shared_cpus(["--threads=3"], 2) == ["--threads=3"]
