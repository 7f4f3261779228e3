"""deploy/: compose, SLURM and Kubernetes files parse, hang together and use real CLI flags.

Fast and offline: nothing is built, started or pulled. The sbatch scripts run once against
stand-in `scontrol` / `srun` / python executables that record the commands they would start.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
K8S_SERVERS = DEPLOY / "k8s" / "servers.yaml"
K8S_TRAINERS = DEPLOY / "k8s" / "trainers.yaml"
SBATCH_SERVERS = DEPLOY / "slurm" / "servers.sbatch"
SBATCH_TRAINERS = DEPLOY / "slurm" / "trainers.sbatch"

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@functools.cache
def _help_flags(*args: str) -> frozenset[str]:
    out = subprocess.run(
        [sys.executable, *args, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT, check=True
    ).stdout
    return frozenset(FLAG.findall(out))


def _flags_after(tokens: list[str], module: str, stop: str | None = None) -> set[str]:
    """Flags following `-m module` in a tokenized command (up to `-m stop`, if given)."""
    for i in range(len(tokens) - 1):
        if tokens[i] == "-m" and tokens[i + 1] == module:
            rest = tokens[i + 2 :]
            if stop is not None and "-m" in rest:
                rest = rest[: rest.index("-m")]
            return {t for t in rest if FLAG.fullmatch(t)}
    raise AssertionError(f"no `-m {module}` in {tokens}")


def _check_command(tokens: list[str]) -> str:
    """Check the flags of one graphfeed command against the CLI's --help; return its kind."""
    joined = " ".join(tokens)
    if "-m sampling_server" in joined:
        flags = _flags_after(tokens, "sampling_server")
        assert flags <= _help_flags("-m", "sampling_server"), flags
        assert {"--partition-dir", "--partition", "--listen", "--peers"} <= flags
        return "server"
    if "-m trainer_client.train" in joined:
        flags = _flags_after(tokens, "trainer_client.train")
        assert flags <= _help_flags("-m", "trainer_client.train"), flags
        assert "--servers" in flags
        run_flags = _flags_after(tokens, "torch.distributed.run", stop="trainer_client.train")
        assert run_flags <= _help_flags("-m", "torch.distributed.run"), run_flags
        static = {"--nnodes", "--node-rank", "--master-addr", "--master-port"}
        elastic = {"--nnodes", "--max-restarts", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"}
        assert static <= run_flags or elastic <= run_flags, run_flags
        if elastic <= run_flags:  # resumes from its checkpoint, part way through an epoch
            assert {"--checkpoint-dir", "--checkpoint-every", "--resume"} <= flags, flags
            assert tokens[tokens.index("--rdzv-backend") + 1] == "c10d"
            assert re.fullmatch(r"\d+:\S+", tokens[tokens.index("--nnodes") + 1]), tokens
        return "trainer"
    if "-m partitioner partition" in joined:
        flags = _flags_after(tokens, "partitioner")
        assert flags <= _help_flags("-m", "partitioner", "partition"), flags
        return "partition"
    raise AssertionError(f"not a graphfeed command: {joined}")


# --- docker compose ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    docs = list(yaml.safe_load_all(COMPOSE.read_text()))
    assert len(docs) == 1
    return docs[0]


TOKEN_FILE = "/var/lib/graphfeed/token"


def test_compose_services_and_order(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"partition", "token", "server0", "server1", "trainer0", "trainer1"}
    assert {"data", "secrets"} <= set(compose["volumes"])
    for name, svc in services.items():
        assert svc["restart"] == "no", name
        assert ("data:/data" in svc["volumes"]) == (name != "token"), name
        assert svc["image"] == "graphfeed:latest"
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (COMPOSE.parent / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
    for name in ("server0", "server1"):
        svc = services[name]
        assert svc["hostname"] == name
        assert svc["depends_on"] == {"partition": {"condition": "service_completed_successfully"},
                                     "token": {"condition": "service_completed_successfully"}}
    for name in ("trainer0", "trainer1"):
        svc = services[name]
        assert svc["hostname"] == name
        assert svc["depends_on"] == {
            "server0": {"condition": "service_healthy"},
            "server1": {"condition": "service_healthy"},
        }


def test_compose_healthcheck_is_grpc_health_one_liner(compose: dict[str, Any]) -> None:
    for name in ("server0", "server1"):
        test = compose["services"][name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"]
        code = test[3]
        compile(code, "<healthcheck>", "exec")
        assert "grpc_health.v1" in code and "localhost:50051" in code and "SERVING" in code
        assert "grpc_health_probe" not in code


def test_compose_makes_a_token_and_every_call_carries_it(compose: dict[str, Any]) -> None:
    """Secure by default: one token per cluster, made by the `token` job in a volume of its
    own that servers and trainers mount read-only (and the partition job not at all); the
    servers require it, the trainers send it, nobody runs --insecure."""
    services = compose["services"]
    token = services["token"]
    assert token["command"] == ["python", "-m", "protos.security", "new-token", TOKEN_FILE]
    assert token["volumes"] == ["secrets:/var/lib/graphfeed"]
    assert "secrets:/var/lib/graphfeed:ro" not in services["partition"]["volumes"]
    for name in ("server0", "server1", "trainer0", "trainer1"):
        command = [str(t) for t in services[name]["command"]]
        assert command[command.index("--token-file") + 1] == TOKEN_FILE, name
        assert "--insecure" not in command
        assert "secrets:/var/lib/graphfeed:ro" in services[name]["volumes"], name
    listen = [str(t) for t in services["server0"]["command"]]
    assert listen[listen.index("--listen") + 1] == "0.0.0.0:50051"  # beyond loopback: needs it


def test_compose_commands(compose: dict[str, Any]) -> None:
    services = {k: v for k, v in compose["services"].items() if k != "token"}
    kinds = {name: _check_command([str(t) for t in svc["command"]]) for name, svc in services.items()}
    assert kinds == {
        "partition": "partition",
        "server0": "server",
        "server1": "server",
        "trainer0": "trainer",
        "trainer1": "trainer",
    }
    for i in (0, 1):
        server = [str(t) for t in services[f"server{i}"]["command"]]
        assert server[server.index("--partition") + 1] == str(i)
        assert server[server.index("--peers") + 1] == "server0:50051,server1:50051"
        trainer = [str(t) for t in services[f"trainer{i}"]["command"]]
        assert trainer[trainer.index("--rdzv-endpoint") + 1] == "trainer0:29500"
        assert trainer[trainer.index("--rdzv-conf") + 1] == f"is_host={int(i == 0)}"  # trainer0 holds it
        assert trainer[trainer.index("--local-addr") + 1] == f"trainer{i}"  # where its ranks meet
        assert trainer[trainer.index("--nnodes") + 1] == "1:2"
        assert trainer[trainer.index("--servers") + 1] == "server0:50051,server1:50051"
        assert trainer[trainer.index("--checkpoint-dir") + 1] == "/data/ckpt"  # both read it
        env = services[f"trainer{i}"]["environment"]
        assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_compose_tls_variant_adds_tls_and_token_to_every_command(compose: dict[str, Any]) -> None:
    tls = yaml.safe_load((DEPLOY / "docker-compose.tls.yml").read_text())
    services = tls["services"]
    assert set(services) == {"server0", "server1", "trainer0", "trainer1"}
    for name, svc in services.items():
        command = [str(t) for t in svc["command"]]
        base = [str(t) for t in compose["services"][name]["command"]]
        token = base.index("--token-file")
        base = base[:token] + base[token + 2:]  # the TLS variant's token is make-certs.sh's
        assert command[: len(base)] == base, name  # the same command, plus security flags
        assert _check_command(command) in ("server", "trainer")
        assert "./certs:/certs:ro" in svc["volumes"] and "data:/data" in svc["volumes"]
        assert command[command.index("--tls-ca") + 1] == "/certs/ca.crt"
        assert command[command.index("--tls-cert") + 1] == f"/certs/{name}.crt"
        assert command[command.index("--token-file") + 1] == "/certs/token"
    for name in ("server0", "server1"):
        code = services[name]["healthcheck"]["test"][3]
        compile(code, "<healthcheck>", "exec")
        assert "ssl_channel_credentials" in code and "SERVING" in code


# --- Dockerfile ---------------------------------------------------------------------------


def test_dockerfile() -> None:
    text = DOCKERFILE.read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert "ARG BASE_IMAGE=python:3.11-slim" in lines
    assert lines[1] == "FROM ${BASE_IMAGE}"
    assert any(ln.startswith("ARG WHEELHOUSE") for ln in lines)
    assert "--no-index --find-links" in text
    assert '"torch==2.13.0"' in text
    assert "--mount=type=bind,target=/src" in text  # the sources never land in a layer
    assert not re.findall(r"^(COPY|ADD) ", text, flags=re.M)
    assert "ENV NUMBA_CACHE_DIR=" in text  # site-packages is read-only to the runtime user
    warm = lines.index("RUN python -m sampling_server.warmup")
    assert lines.index("USER 10001:10001") < warm  # the cache belongs to the runtime user
    assert "WORKDIR /data" in lines
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    for secret in ("TOKEN", "PASSWORD", "SECRET", "id_rsa", "id_ed25519", "--mount=type=secret"):
        assert not any(secret.lower() in ln.lower() for ln in lines), secret

    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    assert {".git", ".venv", "data"} <= set(ignored)
    assert "wheelhouse" not in ignored


def test_podman_settings_for_compose_test() -> None:
    conf = (DEPLOY / "podman" / "containers.conf").read_text()
    assert 'runtime = "runc"' in conf
    assert 'default_ulimits = ["nofile=16384:16384", "nproc=16384:16384"]' in conf
    # podman 4.3 (Debian bookworm) refuses --health-startup-interval, which
    # podman-compose derives from start_interval.
    compose = yaml.safe_load(COMPOSE.read_text())
    for name in ("server0", "server1"):
        assert "start_interval" not in compose["services"][name]["healthcheck"]


def _compose_test_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("compose_test", DEPLOY / "compose_test.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compose_test_installs_name_resolution() -> None:
    """The servers find their peers by compose service name: the host needs a DNS plugin.

    A machine where the plugin was once installed by hand hid its absence from the apt
    step; the list, the docs and CI's fresh-host run must all cover it."""
    compose = yaml.safe_load(COMPOSE.read_text())
    peers = " ".join(compose["services"]["server0"]["command"])
    assert "server1:50051" in peers  # a service name, resolved by the network's DNS
    packages = dict(_compose_test_module().HOST_REQUIREMENTS)
    assert packages["golang-github-containernetworking-plugin-dnsname"] == "/usr/lib/cni/dnsname"
    assert {"podman", "runc", "debootstrap"} <= set(packages)
    doc = (ROOT / "docs" / "deploy.md").read_text()
    assert all(f"`{pkg}`" in doc for pkg in packages), "docs/deploy.md must name every host package"
    assert 'COMPOSE_TEST_ARGS="--fresh-host"' in (ROOT / ".ci" / "run").read_text()


# --- Kubernetes -----------------------------------------------------------------------------


def _k8s(path: Path) -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    by_kind: dict[str, dict[str, Any]] = {}
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(d)
        assert d["kind"] not in by_kind, f"two {d['kind']} in {path.name}"
        by_kind[d["kind"]] = d
    return by_kind


def _shell_tokens(container: dict[str, Any]) -> list[str]:
    command = container["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    tokens = shlex.split(command[2])
    assert tokens[0] == "exec"
    return tokens[1:]


def test_k8s_servers() -> None:
    objs = _k8s(K8S_SERVERS)
    assert set(objs) == {"PersistentVolumeClaim", "Job", "Service", "StatefulSet"}
    svc, sts = objs["Service"], objs["StatefulSet"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"] == "graphfeed-server"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()

    pod = sts["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    tokens = _shell_tokens(server)
    assert _check_command(tokens) == "server"
    assert tokens[tokens.index("--partition") + 1] == "${HOSTNAME##*-}"
    replicas = sts["spec"]["replicas"]
    peers = tokens[tokens.index("--peers") + 1].split(",")
    assert peers == [f"graphfeed-server-{i}.graphfeed-server:50051" for i in range(replicas)]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["grpc"]["port"] == 50051, probe
    claim = objs["PersistentVolumeClaim"]["metadata"]["name"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": claim}} in pod["volumes"]
    part_dir = tokens[tokens.index("--partition-dir") + 1]
    _check_k8s_token(pod, server, tokens)

    job = objs["Job"]["spec"]["template"]["spec"]
    (part,) = job["containers"]
    assert _check_command(part["command"]) == "partition"
    assert part["command"][part["command"].index("--out") + 1] == part_dir
    assert part["command"][part["command"].index("--num-parts") + 1] == str(replicas)


def test_k8s_trainers() -> None:
    objs = _k8s(K8S_TRAINERS)
    assert set(objs) == {"Service", "Job"}
    svc, job = objs["Service"], objs["Job"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == 2
    assert svc["spec"]["clusterIP"] == "None"
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    (trainer,) = pod["containers"]
    tokens = _shell_tokens(trainer)
    assert _check_command(tokens) == "trainer"
    assert tokens[tokens.index("--node-rank") + 1] == "${JOB_COMPLETION_INDEX}"
    assert tokens[tokens.index("--nnodes") + 1] == "2"
    name, sub = job["metadata"]["name"], svc["metadata"]["name"]
    assert tokens[tokens.index("--master-addr") + 1] == f"{name}-0.{sub}"
    servers = tokens[tokens.index("--servers") + 1].split(",")
    assert servers == [f"graphfeed-server-{i}.graphfeed-server:50051" for i in range(2)]
    _check_k8s_token(pod, trainer, tokens)


def _check_k8s_token(pod: dict[str, Any], container: dict[str, Any], tokens: list[str]) -> None:
    """The pod reads the cluster's token from the Secret graphfeed-token, as a file (it
    waits for the Secret: not optional), and passes the file, never the token."""
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "graphfeed-token"
    assert not volume["secret"].get("optional", False)
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    assert tokens[tokens.index("--token-file") + 1] == mount["mountPath"] + "/token"
    assert "--insecure" not in tokens
    header = "".join(K8S_SERVERS.read_text().split("---")[0])
    assert "kubectl create secret generic graphfeed-token --from-file=token=/dev/stdin" in header


# --- SLURM --------------------------------------------------------------------------------


@pytest.mark.parametrize("script", [SBATCH_SERVERS, SBATCH_TRAINERS], ids=lambda p: p.name)
def test_sbatch_syntax_and_headers(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert re.search(r"^#SBATCH --nodes=\d+$", text, flags=re.M)
    assert "#SBATCH --job-name=" in text


def _write_exe(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run_sbatch(
    tmp_path: Path, script: Path, args: list[str], env: dict[str, str], *, scontrol: str | None = None
) -> list[list[str]]:
    """Run `script` with stand-ins: srun runs each task locally, PYTHON records its argv.

    `scontrol` replaces the stand-in's body (default: hosts nodeA and nodeB)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.txt"
    two_hosts = 'test "$1 $2" = "show hostnames" && printf "%s\\n" nodeA nodeB\n'
    _write_exe(bin_dir / "scontrol", scontrol or two_hosts)
    _write_exe(
        bin_dir / "srun",
        "n=2; while [[ $1 == --* ]]; do shift; done\n"
        'for ((i = 0; i < n; i++)); do SLURM_PROCID=$i SLURM_NODEID=$i "$@" || exit; done\n',
    )
    rec = shlex.quote(str(record))
    _write_exe(bin_dir / "fakepython", f'printf "%s\\0" "$@" >> {rec}; echo >> {rec}\n')
    full_env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHON": str(bin_dir / "fakepython"),
        "SLURM_JOB_NODELIST": "node[A-B]",
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NNODES": "2",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        **env,
    }
    subprocess.run(["bash", str(script), *args], check=True, env=full_env, timeout=30, capture_output=True)
    return [line.rstrip("\0").split("\0") for line in record.read_text().splitlines() if line]


def test_servers_sbatch_commands(tmp_path: Path) -> None:
    calls = _run_sbatch(tmp_path, SBATCH_SERVERS, ["/shared/parts", "--workers", "4"], {})
    token_file = str(tmp_path / "graphfeed-token-42")
    # first the job makes the cluster's token (once: the maker keeps an existing file)
    assert calls[0] == ["-m", "protos.security", "new-token", token_file]
    servers = calls[1:]
    assert len(servers) == 2
    for i, argv in enumerate(servers):
        tokens = ["python", *argv]
        assert _check_command(tokens) == "server"
        assert argv[argv.index("--partition") + 1] == str(i)
        assert argv[argv.index("--partition-dir") + 1] == "/shared/parts"
        assert argv[argv.index("--peers") + 1] == "nodeA:50051,nodeB:50051"
        assert argv[argv.index("--token-file") + 1] == token_file
        assert "--insecure" not in argv and "--tls-cert" not in argv
        assert argv[-2:] == ["--workers", "4"]
    assert (tmp_path / "graphfeed-servers-42.txt").read_text().strip() == "nodeA:50051,nodeB:50051"


def test_servers_sbatch_mutual_tls_and_insecure(tmp_path: Path) -> None:
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / "tls").mkdir()
    calls = _run_sbatch(tmp_path / "tls", SBATCH_SERVERS, ["/shared/parts"],
                        {"TLS_DIR": "/shared/certs", "GRAPHFEED_TOKEN_FILE": "/shared/token"})
    for argv in calls[1:]:
        assert argv[argv.index("--tls-cert") + 1] == f"/shared/certs/{host}.crt"
        assert argv[argv.index("--tls-ca") + 1] == "/shared/certs/ca.crt"
        assert argv[argv.index("--token-file") + 1] == "/shared/token"
    (tmp_path / "open").mkdir()
    calls = _run_sbatch(tmp_path / "open", SBATCH_SERVERS, ["/shared/parts"], {"INSECURE": "1"})
    assert len(calls) == 2 and all("--insecure" in a and "--token-file" not in a for a in calls)


def test_trainers_sbatch_commands(tmp_path: Path) -> None:
    token = tmp_path / "graphfeed-token-41"
    token.write_text("t\n")
    calls = _run_sbatch(tmp_path, SBATCH_TRAINERS, [], {"SERVERS": "nodeA:50051,nodeB:50051",
                                                        "GRAPHFEED_TOKEN_FILE": str(token)})
    assert len(calls) == 2
    for argv in calls:
        tokens = ["python", *argv]
        assert _check_command(tokens) == "trainer"
        assert argv[argv.index("--rdzv-endpoint") + 1] == "nodeA:29500"
        assert argv[argv.index("--rdzv-id") + 1] == "42"  # the same after a requeue
        assert argv[argv.index("--nnodes") + 1] == "1:2"
        assert argv[argv.index("--max-restarts") + 1] == "3"
        assert argv[argv.index("--servers") + 1] == "nodeA:50051,nodeB:50051"
        assert argv[argv.index("--checkpoint-dir") + 1] == str(tmp_path / "graphfeed-ckpt-42")
        assert argv[argv.index("--checkpoint-every") + 1] == "100"
        assert argv[-3:] == ["--resume", "--epochs", "5"]  # the user's arguments last: they win
    text = SBATCH_TRAINERS.read_text()
    assert "#SBATCH --requeue" in text and "#SBATCH --no-kill" in text and "--kill-on-bad-exit=0" in text
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text


def test_trainers_sbatch_needs_the_token_file(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError) as info:
        _run_sbatch(tmp_path, SBATCH_TRAINERS, [], {"SERVERS": "nodeA:50051",
                                                    "GRAPHFEED_TOKEN_FILE": ""})
    assert info.value.returncode == 2 and b"GRAPHFEED_TOKEN_FILE" in info.value.stderr


def test_trainers_sbatch_long_node_list(tmp_path: Path) -> None:
    """The first host of a long list is read without a pipe that can die of SIGPIPE.

    `scontrol ... | head -n 1` under pipefail killed the job (exit 141) whenever scontrol
    still had lines to write when head exited: always, with a node list this long."""
    many = 'test "$1 $2" = "show hostnames" && printf "%s\\n" nodeA nodeB; seq -f "node%g" 1 200000\n'
    calls = _run_sbatch(tmp_path, SBATCH_TRAINERS, [], {"SERVERS": "nodeA:50051", "INSECURE": "1"},
                        scontrol=many)
    assert [argv[argv.index("--rdzv-endpoint") + 1] for argv in calls] == ["nodeA:29500", "nodeA:29500"]


@pytest.mark.parametrize("script", [SBATCH_SERVERS, SBATCH_TRAINERS], ids=lambda p: p.name)
def test_sbatch_stops_when_scontrol_fails(tmp_path: Path, script: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError) as info:
        _run_sbatch(tmp_path, script, ["/shared/parts"], {"SERVERS": "nodeA:50051", "INSECURE": "1"},
                    scontrol='echo "scontrol: error: invalid node list" >&2; exit 1\n')
    assert info.value.returncode == 1
    assert not (tmp_path / "argv.txt").exists()  # nothing started


# Readers that exit before their writer is done; under pipefail the writer's SIGPIPE fails
# the whole pipeline (and so the script), depending on timing.
EARLY_EXIT_READER = re.compile(r"\|\s*(head\b|grep\s+(-\w*[qm]\w*|--quiet|--max-count)|sed\s+[^|]*\dq)")


def _shell_sources() -> list[Path]:
    scripts = [*DEPLOY.glob("slurm/*.sbatch"), ROOT / ".ci" / "run", ROOT / "Makefile", DOCKERFILE]
    scripts += [p for p in (*DEPLOY.rglob("*.sh"), *ROOT.glob("examples/**/*.sh")) if p.is_file()]
    return scripts


def test_no_pipe_into_early_exit_reader() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _shell_sources()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if not line.lstrip().startswith("#") and EARLY_EXIT_READER.search(line)
    ]
    assert not offenders, "pipes that can die of SIGPIPE under pipefail:\n" + "\n".join(offenders)


# --- docs ---------------------------------------------------------------------------------


def test_deploy_doc_covers_every_way() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    for needle in (
        "deploy/launch.py start deploy/cluster.example.yaml --dry-run",
        "deploy/slurm/servers.sbatch",
        "deploy/slurm/trainers.sbatch",
        "deploy/k8s/servers.yaml",
        "deploy/k8s/trainers.yaml",
        "deploy/docker-compose.yml",
        "deploy/Dockerfile",
        "podman",
    ):
        assert needle in text, needle
