"""deploy/launch.py: dry-run plans of the example cluster, and cluster-file validation."""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "deploy" / "cluster.example.yaml"


def _load_launch() -> ModuleType:
    """deploy/launch.py as a script sees itself: its folder first on the import path."""
    if str(ROOT / "deploy") not in sys.path:
        sys.path.insert(0, str(ROOT / "deploy"))
    spec = importlib.util.spec_from_file_location("graphfeed_launch", ROOT / "deploy" / "launch.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


launch = _load_launch()
cluster_file = importlib.import_module("cluster_file")  # the cluster file's model and checks


def _dry_run(capsys: pytest.CaptureFixture[str], *args: str, path: Path = EXAMPLE) -> list[list[str]]:
    """Each printed ssh command as an argv (the remote command is the last element)."""
    assert launch.main([*args, str(path), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    return [shlex.split(line) for line in lines]


def _after(tokens: list[str], flag: str) -> str:
    return tokens[tokens.index(flag) + 1]


def _started(remote: list[str]) -> list[str]:
    """The tokens of the remote start line from ``nohup`` on (the process and its log)."""
    return remote[remote.index("nohup"):]


def _example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE.read_text())


def _write(tmp_path: Path, obj: dict[str, Any]) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(obj))
    return path


PEERS = "storage0:50051,storage1:50051,storage2:50051,storage2:50052"


def test_start_plan_servers(capsys: pytest.CaptureFixture[str]) -> None:
    cmds = _dry_run(capsys, "start", "--only", "servers")
    assert len(cmds) == 4
    hosts = ["storage0", "storage1", "storage2", "storage2"]
    ports = ["50051", "50051", "50051", "50052"]
    for partition, argv in enumerate(cmds):
        assert argv[0] == "ssh"
        assert argv[argv.index("BatchMode=yes") - 1] == "-o"
        assert argv[-2] == f"graphfeed@{hosts[partition]}"
        assert _after(argv, "-p") == "22"
        remote = shlex.split(argv[-1])
        assert remote[remote.index("nohup") + 1:remote.index("nohup") + 4] == [
            "/opt/graphfeed/.venv/bin/python", "-m", "sampling_server"]
        assert _after(remote, "--partition") == str(partition)
        assert _after(remote, "--partition-dir") == "/data/products-4"
        assert _after(remote, "--listen") == f"0.0.0.0:{ports[partition]}"
        assert _after(remote, "--peers") == PEERS
        # paths with spaces stay one word
        assert _after(remote, "cd") == "/opt/graphfeed/my repo"
        assert _after(_started(remote), ">") == f"/opt/graphfeed/my repo/logs/server-{partition}.log"
        assert remote[-2] == f"/opt/graphfeed/my repo/logs/server-{partition}.pid;"
        assert ("--device" in remote) == (partition == 2)


def test_server_args_reach_every_server_as_flags_it_knows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``server_args`` become flags of every server's command line, which the server's
    own parser accepts; the flags the launcher sets itself are refused, named."""
    from sampling_server import cli

    obj = _example()
    obj["server_args"] = {"structure": "full", "workers": 6, "no-mmap": True, "verify": "size",
                          "metrics_port": None}
    cmds = _dry_run(capsys, "start", "--only", "servers", path=_write(tmp_path, obj))
    assert len(cmds) == 4
    parser = cli.build_parser()
    for argv in cmds:
        remote = shlex.split(argv[-1])
        start = remote.index("sampling_server") + 1
        server_argv = remote[start:remote.index(">", start)]
        assert _after(server_argv, "--structure") == "full" and "--no-mmap" in server_argv
        assert "--metrics-port" not in server_argv
        config = cli.config_from_args(parser.parse_args(server_argv))
        assert (config.structure, config.workers, config.mmap, config.verify) == \
            ("full", 6, False, "size")
    for key in ("listen", "partition_dir", "device", "peers", "token_file", "insecure"):
        bad = _example()
        bad["server_args"] = {key: "x"}
        with pytest.raises(launch.ClusterError, match=rf"^server_args\.{key}: set by the launcher"):
            cluster_file.parse_cluster(bad)
    bad = _example()
    bad["server_args"] = ["--workers", "6"]
    with pytest.raises(launch.ClusterError, match=r"^server_args: expected a mapping"):
        cluster_file.parse_cluster(bad)
    bad["server_args"] = {"workers; rm -rf /": 1}
    with pytest.raises(launch.ClusterError, match=r"expected a flag name"):
        cluster_file.parse_cluster(bad)


def test_start_plan_trainers(capsys: pytest.CaptureFixture[str]) -> None:
    cmds = _dry_run(capsys, "start", "--only", "trainers")
    assert [argv[-2] for argv in cmds] == ["graphfeed@gpu0", "graphfeed@gpu1"]
    for rank, argv in enumerate(cmds):
        assert "BatchMode=yes" in argv
        remote = shlex.split(argv[-1])
        assert "torch.distributed.run" in remote
        assert _after(remote, "--nnodes") == "2"
        assert _after(remote, "--node-rank") == str(rank)
        assert _after(remote, "--nproc-per-node") == "8"
        assert _after(remote, "--master-addr") == "gpu0"
        assert _after(remote, "--master-port") == "29500"
        assert remote.index("torch.distributed.run") < remote.index("trainer_client.train")
        assert _after(remote, "--servers") == PEERS
        assert _after(remote, "--fanouts") == "15,10,5"
        assert _after(remote, "--batch-size") == "1024"
        assert _after(remote, "--epochs") == "10"
        assert _after(remote, "--checkpoint-dir") == "/shared/ckpt/products"
        assert _after(_started(remote), ">") == f"/opt/graphfeed/my repo/logs/trainer-{rank}.log"


TOKEN_ON_NODES = "/opt/graphfeed/my repo/logs/graphfeed.token"


def test_every_process_gets_the_token_from_a_file_it_never_sees_on_a_command_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    cmds = _dry_run(capsys, "start")
    assert len(cmds) == 6
    for argv in cmds:
        remote = shlex.split(argv[-1])
        started = _started(remote)
        assert _after(started, "--token-file") == TOKEN_ON_NODES and "--insecure" not in started
        # the token is written from ssh's standard input before the process starts
        assert remote.index("cat") < remote.index("nohup") and "077" in remote
    token = b"not-a-real-token\n"
    steps = launch.plan(cluster_file.load_cluster(EXAMPLE), "start", token=token)
    assert [s.stdin for s in steps] == [token] * 6
    assert not any(b"not-a-real-token" in " ".join(s.argv).encode() for s in steps)
    assert "not-a-real-token" not in repr(steps[0])
    assert all(s.stdin is None for s in launch.plan(cluster_file.load_cluster(EXAMPLE), "stop"))


def test_the_cluster_token_is_made_once_beside_the_cluster_file(tmp_path: Path) -> None:
    cluster = cluster_file.load_cluster(_write(tmp_path, _example()))
    # the example names its file; by default it is the cluster file's name, .token
    assert cluster.security.token_file == tmp_path / "cluster.example.token"
    obj = _example()
    del obj["security"]
    cluster = cluster_file.load_cluster(_write(tmp_path, obj))
    assert cluster.security.token_file == tmp_path / "cluster.token"
    token = launch.cluster_token(cluster)
    assert token and len(token.strip()) >= 40
    assert (tmp_path / "cluster.token").stat().st_mode & 0o777 == 0o600
    assert launch.cluster_token(cluster) == token  # kept across starts


def test_security_settings_become_each_process_flags(capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path) -> None:
    obj = _example()
    obj["security"] = {"tls_ca": "/etc/gf/ca.crt", "tls_cert": "/etc/gf/{host}.crt",
                       "tls_key": "/etc/gf/{host}.key"}
    cmds = _dry_run(capsys, "start", path=_write(tmp_path, obj))
    hosts = ["storage0", "storage1", "storage2", "storage2", "gpu0", "gpu1"]
    for host, argv in zip(hosts, cmds, strict=True):
        started = _started(shlex.split(argv[-1]))
        assert _after(started, "--tls-ca") == "/etc/gf/ca.crt"
        assert _after(started, "--tls-cert") == f"/etc/gf/{host}.crt"
        assert _after(started, "--tls-key") == f"/etc/gf/{host}.key"
        assert "--token-file" in started  # mutual TLS and the token, both
    obj["security"] = {"insecure": True}
    cmds = _dry_run(capsys, "start", path=_write(tmp_path, obj))
    for argv in cmds:
        started = _started(shlex.split(argv[-1]))
        assert "--token-file" not in started and "cat" not in argv[-1]
        assert ("--insecure" in started) == ("sampling_server" in started)
    for bad, field in (({"tls_cert": "c"}, "security.tls_cert"),
                       ({"tls_cert": "c", "tls_key": "k"}, "security.tls_ca"),
                       ({"insecure": "yes"}, "security.insecure"),
                       ({"token": "s3cret"}, "security")):
        obj["security"] = bad
        with pytest.raises(launch.ClusterError, match=rf"^{field}"):
            cluster_file.parse_cluster(obj)


def test_start_plan_all(capsys: pytest.CaptureFixture[str]) -> None:
    cmds = _dry_run(capsys, "start")
    assert len(cmds) == 6
    assert all("BatchMode=yes" in argv for argv in cmds)


def test_stop_plan(capsys: pytest.CaptureFixture[str]) -> None:
    cmds = _dry_run(capsys, "stop")
    assert len(cmds) == 6
    names = [f"server-{i}" for i in range(4)] + ["trainer-0", "trainer-1"]
    for name, argv in zip(names, cmds, strict=True):
        assert "BatchMode=yes" in argv
        remote = argv[-1]
        assert "kill -TERM" in remote
        assert shlex.quote(f"/opt/graphfeed/my repo/logs/{name}.pid") in remote


def test_status_plan(capsys: pytest.CaptureFixture[str]) -> None:
    cmds = _dry_run(capsys, "status", "--only", "servers")
    assert len(cmds) == 4
    for partition, argv in enumerate(cmds):
        remote = argv[-1]
        assert "kill -0" in remote
        assert "tail -n" in remote
        assert shlex.quote(f"/opt/graphfeed/my repo/logs/server-{partition}.log") in remote


def test_dry_run_runs_nothing(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("subprocess.run called in a dry run")

    monkeypatch.setattr(launch.subprocess, "run", boom)
    assert len(_dry_run(capsys, "start")) == 6


def test_servers_sorted_by_partition(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    obj = _example()
    obj["servers"].reverse()
    cmds = _dry_run(capsys, "start", "--only", "servers", path=_write(tmp_path, obj))
    for partition, argv in enumerate(cmds):
        remote = shlex.split(argv[-1])
        assert _after(remote, "--partition") == str(partition)
        assert _after(remote, "--peers") == PEERS


def _error(tmp_path: Path, capsys: pytest.CaptureFixture[str], obj: dict[str, Any]) -> str:
    assert launch.main(["start", str(_write(tmp_path, obj)), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


def test_password_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    obj = _example()
    obj["ssh"]["password"] = "hunter2"
    with pytest.raises(launch.ClusterError, match=r"ssh\.password.*not allowed"):
        cluster_file.parse_cluster(obj)
    assert "ssh.password" in _error(tmp_path, capsys, obj)


def test_batchmode_option_refused() -> None:
    obj = _example()
    obj["ssh"]["options"].append("BatchMode=no")
    with pytest.raises(launch.ClusterError, match=r"ssh\.options\[2\]"):
        cluster_file.parse_cluster(obj)


def test_duplicate_partition(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    obj = _example()
    obj["servers"][3]["partition"] = 1
    with pytest.raises(launch.ClusterError, match=r"servers\[3\]\.partition: duplicate partition 1"):
        cluster_file.parse_cluster(obj)
    assert "duplicate partition" in _error(tmp_path, capsys, obj)


def test_missing_partition() -> None:
    obj = _example()
    obj["servers"][3]["partition"] = 7
    with pytest.raises(launch.ClusterError, match=r"servers: partitions must be 0\.\.3.*missing \[3\]"):
        cluster_file.parse_cluster(obj)


@pytest.mark.parametrize("port", [0, 70000, "50051", True])
def test_bad_server_port(port: object) -> None:
    obj = _example()
    obj["servers"][1]["port"] = port
    with pytest.raises(launch.ClusterError, match=r"servers\[1\]\.port"):
        cluster_file.parse_cluster(obj)


def test_bad_master_port_and_empty_hosts() -> None:
    obj = _example()
    obj["trainers"]["master_port"] = -1
    with pytest.raises(launch.ClusterError, match=r"trainers\.master_port"):
        cluster_file.parse_cluster(obj)
    obj = _example()
    obj["trainers"]["hosts"] = []
    with pytest.raises(launch.ClusterError, match=r"trainers\.hosts"):
        cluster_file.parse_cluster(obj)


def test_missing_and_unknown_fields() -> None:
    obj = _example()
    del obj["workdir"]
    with pytest.raises(launch.ClusterError, match=r"^workdir"):
        cluster_file.parse_cluster(obj)
    obj = _example()
    del obj["servers"][0]["host"]
    with pytest.raises(launch.ClusterError, match=r"servers\[0\]\.host: missing"):
        cluster_file.parse_cluster(obj)
    obj = _example()
    obj["servers"][0]["adress"] = "x"
    with pytest.raises(launch.ClusterError, match=r"servers\[0\].*adress"):
        cluster_file.parse_cluster(obj)
    obj = _example()
    obj["trainers"]["args"]["servers"] = "a:1"
    with pytest.raises(launch.ClusterError, match=r"trainers\.args\.servers"):
        cluster_file.parse_cluster(obj)


def test_real_run_uses_timeout(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[tuple[tuple[str, ...], float]] = []

    def fake_run(argv: tuple[str, ...], **kwargs: Any) -> Any:
        calls.append((argv, kwargs["timeout"]))
        raise launch.subprocess.TimeoutExpired(argv, kwargs["timeout"])

    monkeypatch.setattr(launch.subprocess, "run", fake_run)
    assert launch.main(["status", str(EXAMPLE), "--only", "trainers", "--timeout", "3"]) == 1
    assert [argv[-2] for argv, _ in calls] == ["graphfeed@gpu0", "graphfeed@gpu1"]
    assert all(timeout == 3 for _, timeout in calls)
    assert "timed out" in capsys.readouterr().out


def test_logs_plan(capsys: pytest.CaptureFixture[str]) -> None:
    cmds = _dry_run(capsys, "logs")
    assert [c[-1] for c in cmds] == [
        f"cat '/opt/graphfeed/my repo/logs/{name}.log'"
        for name in ("server-0", "server-1", "server-2", "server-3", "trainer-0", "trainer-1")]


def use_stand_in_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put first on PATH an `ssh` that runs its last argument (the remote command line)
    with sh on this machine, ignoring the host and options."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text('#!/bin/sh\nfor last; do :; done\nexec sh -c "$last"\n')
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{launch.os.environ['PATH']}")


def test_logs_are_gathered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    """A stand-in ssh runs the remote command here; every log lands in --out."""
    use_stand_in_ssh(tmp_path, monkeypatch)
    obj = _example()
    obj["workdir"] = str(tmp_path / "remote")
    logs = tmp_path / "remote" / "logs"
    logs.mkdir(parents=True)
    names = ["server-0", "server-1", "server-2", "server-3", "trainer-0", "trainer-1"]
    for name in names:
        (logs / f"{name}.log").write_text(f"{name} says hello\n")
    out = tmp_path / "gathered"
    cluster = _write(tmp_path, obj)
    assert launch.main(["logs", str(cluster), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.log" for n in names)
    assert (out / "trainer-1.log").read_text() == "trainer-1 says hello\n"

    (logs / "server-2.log").unlink()  # a missing log fails the command and leaves no file
    for f in out.iterdir():
        f.unlink()
    assert launch.main(["logs", str(cluster), "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "server-2 on storage2: FAILED" in printed
    assert not (out / "server-2.log").exists() and (out / "server-3.log").exists()
