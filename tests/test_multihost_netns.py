"""Multi-host run in network namespaces: two sampling servers and two DDP trainers, each
in its own namespace with its own address on a private bridge (all inside namespaces this
test creates and removes), started with the same commands the deploy files use.

Skips, saying why, where it cannot run (not root, no `ip`, no network namespaces)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from partitioner import partition_graph
from partitioner.synthetic import generate

REPO = Path(__file__).resolve().parents[1]
SUBNET = "10.231.77"  # only ever inside the namespaces below
TAG = f"gf{os.getpid() % 100000}"
HOSTS = {"s0": 1, "s1": 2, "t0": 3, "t1": 4}


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"{TAG}probe"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"network namespaces are unavailable here ({exc})"
    return None


@pytest.fixture
def hosts() -> Iterator[dict[str, str]]:
    """Namespace per host, each with eth0 on one bridge; name -> namespace."""
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    bridge_ns = f"{TAG}-br"
    made = [bridge_ns]
    try:
        _ip("netns", "add", bridge_ns)
        _ip("link", "add", "br0", "type", "bridge", ns=bridge_ns)
        _ip("link", "set", "br0", "up", ns=bridge_ns)
        for name, host in HOSTS.items():
            ns = f"{TAG}-{name}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", f"v{name}", "netns", bridge_ns, "type", "veth", "peer", "name",
                "eth0", "netns", ns)
            _ip("link", "set", f"v{name}", "master", "br0", "up", ns=bridge_ns)
            _ip("addr", "add", f"{SUBNET}.{host}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        yield {name: f"{TAG}-{name}" for name in HOSTS}
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _in(ns: str, *cmd: str, env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], cwd=REPO, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                                 **(env or {})}, **kw)  # type: ignore[call-overload]


def test_servers_and_trainers_on_separate_hosts_train_to_completion(
    hosts: dict[str, str], tmp_path: Path
) -> None:
    data = tmp_path / "small-2"
    partition_graph(generate("small", progress=False), 2, data, method="metis", progress=False)
    servers = [f"{SUBNET}.{HOSTS['s0']}:50051", f"{SUBNET}.{HOSTS['s1']}:50051"]
    procs = [
        _in(hosts[f"s{p}"], sys.executable, "-m", "sampling_server", "--partition-dir", str(data),
            "--partition", str(p), "--listen", servers[p], "--peers", ",".join(servers),
            "--log-level", "WARNING")
        for p in range(2)
    ]
    master = f"{SUBNET}.{HOSTS['t0']}"
    trainers = []
    try:
        for rank in range(2):
            env = {"GLOO_SOCKET_IFNAME": "eth0"}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--node-rank", str(rank), "--nproc-per-node", "1", "--master-addr", master,
                   "--master-port", "29500", "-m", "trainer_client.train",
                   "--servers", ",".join(servers), "--epochs", "2", "--fanouts", "5,3",
                   "--batch-size", "100", "--device", "cpu", "--timeout", "60",
                   "--no-progress", "--metrics-json", str(tmp_path / "metrics.json")]
            trainers.append(_in(hosts[f"t{rank}"], *cmd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT))
        outputs = [t.communicate(timeout=300)[0] for t in trainers]
        assert [t.returncode for t in trainers] == [0, 0], "\n".join(o[-3000:] for o in outputs)
        metrics = json.loads((tmp_path / "metrics.json").read_text())
        assert metrics["world_size"] == 2
        assert all(e["seeds"] == 1200 for e in metrics["epochs"])
        assert metrics["test_acc"] > 0.5
        fingerprints = metrics["param_fingerprints"]
        assert fingerprints[0] == fingerprints[1]
    finally:
        for t in trainers:
            if t.poll() is None:
                t.kill()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=60) for p in procs]
    assert codes == [0, 0]
