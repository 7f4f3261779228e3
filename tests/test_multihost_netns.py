"""Multi-host run in network namespaces: two sampling servers and two DDP trainers, each
in its own namespace with its own address on a private bridge (all inside namespaces this
test creates and removes), started with the very commands of deploy/docker-compose.yml
(the cluster's token job's too).

Each namespace gets an /etc/netns/<ns>/hosts that names the others as compose does
(server0, server1, trainer0, trainer1), so the compose commands run unchanged but for the
python executable and the /data directory. Skips, saying why, where it cannot run (not
root, no `ip`, no network namespaces)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "deploy" / "docker-compose.yml"
SUBNET = "10.231.77"  # only ever inside the namespaces below
TAG = f"gf{os.getpid() % 100000}"
HOSTS = {"server0": 1, "server1": 2, "trainer0": 3, "trainer1": 4}  # compose hostnames


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
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{SUBNET}.{host} {name}\n" for name, host in HOSTS.items()
        )
        for name, host in HOSTS.items():
            ns = f"{TAG}-{name}"
            _ip("netns", "add", ns)
            made.append(ns)
            # `ip netns exec` bind-mounts /etc/netns/<ns>/* over /etc/*.
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
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
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def _in(ns: str, *cmd: str, env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen[str]:
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], cwd=REPO, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                                 **(env or {})}, **kw)  # type: ignore[call-overload]


def _compose_commands(data: Path) -> dict[str, list[str]]:
    """Each compose service's command, with this python, `data` in place of /data and
    `data`/secrets in place of the token volume (/var/lib/graphfeed)."""
    volumes = {"/data": data, "/var/lib/graphfeed": data / "secrets"}
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    commands = {}
    for name, svc in services.items():
        cmd = [str(c) for c in svc["command"]]
        assert cmd[0] == "python", (name, cmd)
        for i, c in enumerate(cmd):
            for mount, local in volumes.items():
                if c.startswith(mount + "/"):
                    cmd[i] = str(local) + c[len(mount):]
        commands[name] = [sys.executable, *cmd[1:]]
    return commands


def test_servers_and_trainers_on_separate_hosts_train_to_completion(
    hosts: dict[str, str], tmp_path: Path
) -> None:
    commands = _compose_commands(tmp_path)
    assert set(commands) == {"partition", "token", *HOSTS}
    for job in ("partition", "token"):  # the token: servers on the bridge refuse to start without
        subprocess.run(commands[job], check=True, cwd=REPO, timeout=300, capture_output=True)
    procs = [_in(hosts[name], *commands[name]) for name in ("server0", "server1")]
    trainers = []
    try:
        for name in ("trainer0", "trainer1"):
            env = {"GLOO_SOCKET_IFNAME": "eth0"}
            trainers.append(_in(hosts[name], *commands[name], "--timeout", "60", "--no-progress",
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs = [t.communicate(timeout=300)[0] for t in trainers]
        assert [t.returncode for t in trainers] == [0, 0], "\n".join(o[-3000:] for o in outputs)
        metrics = json.loads((tmp_path / "metrics.json").read_text())
        assert metrics["world_size"] == 2
        assert len(metrics["epochs"]) == 5
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
        codes = [_wait_or_dump(p, 60) for p in procs]
    assert codes == [0, 0]


def _wait_or_dump(proc: subprocess.Popen[str], timeout: float) -> int | None:
    """The exit code of ``proc``; a server still running after ``timeout`` seconds writes
    every thread's stack to its stderr (SIGUSR1) before it is killed, and counts as None."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        proc.wait(timeout=30)
        return None
