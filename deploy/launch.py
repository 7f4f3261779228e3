"""Start, stop and inspect a graphfeed cluster over ssh, from one YAML file.

    python deploy/launch.py start  cluster.yaml [--dry-run] [--only servers|trainers]
    python deploy/launch.py stop   cluster.yaml [--dry-run] [--only servers|trainers]
    python deploy/launch.py status cluster.yaml [--dry-run] [--only servers|trainers]
    python deploy/launch.py logs   cluster.yaml [--dry-run] [--only ...] [--out DIR]

One sampling server per partition runs on its storage node and one ``torchrun`` per
trainer host runs on the GPU nodes (see ``deploy/cluster.example.yaml`` for the file).
Every process is started under ``nohup`` with its log and pid file in ``log_dir``;
``stop`` sends SIGTERM (servers drain their streams, torchrun forwards it to its
workers); ``status`` checks the pid and prints the tail of the log; ``logs`` copies every
process's whole log to ``--out`` on this machine (``<name>.log``, e.g. ``server-0.log``).

Secure by default: the servers require the cluster's bearer token, and the trainers send
it. The launcher makes it once (random, mode 600) in ``security.token_file`` on this
machine (default: beside the cluster file, ``<name>.token``) and, with every ``start``,
writes it to ``<log_dir>/graphfeed.token`` (mode 600) on each node through ssh's standard
input: the token is never on a command line, local or remote. ``security`` also takes
mutual TLS files already on the nodes (``tls_ca``, ``tls_cert``, ``tls_key``; ``{host}``
is replaced by each node's host), or ``insecure: true`` (no token: a network you trust).

ssh always runs with ``BatchMode=yes``: keys or an agent only, it never prompts, and a
``password`` anywhere in the file is refused. Remote commands are built with
``shlex.quote`` and run by the remote user's login shell (POSIX sh assumed).
``--dry-run`` prints every ssh command, one per line, and runs nothing.

Exit codes: 0 success, 1 a remote command failed or timed out, 2 invalid cluster file.
"""

from __future__ import annotations

import argparse
import logging
import os
import posixpath
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from cluster_file import (  # beside this script
    Cluster,
    ClusterError,
    ServerSpec,
    SshConfig,
    TrainerSpec,
    load_cluster,
)

log = logging.getLogger("launch")

#: Seconds one ssh command may take before it is counted as failed.
SSH_TIMEOUT_S = 60.0
#: Log lines ``status`` shows per process.
TAIL_LINES = 5


@dataclass(frozen=True)
class Step:
    """One remote command: what it is, where it runs, and the ssh argv that runs it."""

    label: str
    host: str
    argv: tuple[str, ...]
    #: The process it concerns, e.g. ``server-0`` (names its gathered log).
    name: str = ""
    #: Bytes for the remote command's standard input (the token; never printed).
    stdin: bytes | None = field(default=None, repr=False)


# --------------------------------------------------------------------------- commands


def ssh_argv(ssh: SshConfig, host: str, remote: str) -> tuple[str, ...]:
    """The ssh argv running ``remote`` (one shell command line) on ``host``."""
    argv = ["ssh", "-o", "BatchMode=yes", "-p", str(ssh.port)]
    if ssh.identity_file:
        argv += ["-i", os.path.expanduser(ssh.identity_file)]
    for option in ssh.options:
        argv += ["-o", option]
    argv += [f"{ssh.user}@{host}" if ssh.user else host, remote]
    return tuple(argv)


def _q(args: Sequence[object]) -> str:
    return " ".join(shlex.quote(str(a)) for a in args)


def _files(cluster: Cluster, name: str) -> tuple[str, str]:
    """(log file, pid file) of the process called ``name``."""
    return (posixpath.join(cluster.log_path, f"{name}.log"),
            posixpath.join(cluster.log_path, f"{name}.pid"))


def _background(cluster: Cluster, name: str, command: Sequence[object]) -> str:
    """Shell line starting ``command`` in ``workdir`` under nohup, logging to ``name``;
    first, with a token, the token from standard input into its file (mode 600, replaced
    at once, so that processes starting on the same node never read half of it)."""
    logfile, pidfile = _files(cluster, name)
    token = ""
    if cluster.remote_token is not None:
        partial = shlex.quote(cluster.remote_token) + ".$$"
        token = (f"(umask 077 && cat > {partial} && mv -f {partial} "
                 f"{shlex.quote(cluster.remote_token)}) && ")
    return (f"mkdir -p {shlex.quote(cluster.log_path)} && {token}cd {shlex.quote(cluster.workdir)} && "
            f"{{ nohup {_q(command)} > {shlex.quote(logfile)} 2>&1 < /dev/null & "
            f"echo $! > {shlex.quote(pidfile)}; }}")


def _credentials(cluster: Cluster, host: str, server: bool) -> list[str]:
    """The token, TLS and insecure flags of a server or trainer on ``host``."""
    sec = cluster.security
    flags = sec.files(host)
    if cluster.remote_token is not None:
        flags += ["--token-file", cluster.remote_token]
    if sec.insecure and server:
        flags.append("--insecure")
    return flags


def server_command(cluster: Cluster, server: ServerSpec) -> list[str]:
    command = [cluster.python, "-m", "sampling_server", "--partition-dir", cluster.partition_dir,
               "--partition", str(server.partition), "--listen", f"0.0.0.0:{server.port}"]
    if len(cluster.servers) > 1:
        command += ["--peers", cluster.peers]
    if server.device:
        command += ["--device", server.device]
    return command + _credentials(cluster, server.host, True) + _flag_args(cluster.server_args)


def _flag_args(args: Sequence[tuple[str, Any]]) -> list[str]:
    out: list[str] = []
    for key, value in args:
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is None or value is False:
            continue
        elif isinstance(value, list):
            out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


def trainer_command(cluster: Cluster, trainers: TrainerSpec, rank: int) -> list[str]:
    return [cluster.python, "-m", "torch.distributed.run",
            "--nnodes", str(len(trainers.hosts)), "--node-rank", str(rank),
            "--nproc-per-node", str(trainers.gpus_per_host),
            "--master-addr", trainers.hosts[0], "--master-port", str(trainers.master_port),
            "-m", "trainer_client.train", "--servers", cluster.peers,
            *_credentials(cluster, trainers.hosts[rank], False), *_flag_args(trainers.args)]


def stop_command(cluster: Cluster, name: str) -> str:
    _, pid = _files(cluster, name)
    qpid = shlex.quote(pid)
    return (f"if [ ! -f {qpid} ]; then echo 'not running (no pid file)'; "
            f"elif kill -0 \"$(cat {qpid})\" 2>/dev/null; then kill -TERM \"$(cat {qpid})\" "
            f"&& echo 'sent SIGTERM'; else echo 'not running (exited)'; fi")


def status_command(cluster: Cluster, name: str) -> str:
    logfile, pid = _files(cluster, name)
    qpid = shlex.quote(pid)
    return (f"if [ -f {qpid} ] && kill -0 \"$(cat {qpid})\" 2>/dev/null; "
            f"then echo \"running (pid $(cat {qpid}))\"; else echo 'not running'; fi; "
            f"tail -n {TAIL_LINES} {shlex.quote(logfile)} 2>/dev/null || true")


def logs_command(cluster: Cluster, name: str) -> str:
    logfile, _ = _files(cluster, name)
    return f"cat {shlex.quote(logfile)}"


def _processes(cluster: Cluster, only: str | None) -> list[tuple[str, str, int | None]]:
    """(name, host, index) of every process: servers by partition, trainers by rank."""
    procs: list[tuple[str, str, int | None]] = []
    if only in (None, "servers"):
        procs += [(f"server-{s.partition}", s.host, s.partition) for s in cluster.servers]
    if only in (None, "trainers"):
        if cluster.trainers is None:
            if only == "trainers":
                raise ClusterError("trainers: not set in the cluster file")
        else:
            procs += [(f"trainer-{r}", h, r) for r, h in enumerate(cluster.trainers.hosts)]
    return procs


def plan(cluster: Cluster, action: str, only: str | None = None,
         token: bytes | None = None) -> list[Step]:
    """Every ssh command ``action`` (start, stop, status) runs, in order; ``token``: the
    bytes each start writes to the node's token file (None: a dry run's plan)."""
    steps: list[Step] = []
    for name, host, index in _processes(cluster, only):
        if action == "start":
            if name.startswith("server-"):
                command = server_command(cluster, cluster.servers[int(index or 0)])
            else:
                assert cluster.trainers is not None
                command = trainer_command(cluster, cluster.trainers, int(index or 0))
            remote = _background(cluster, name, command)
        elif action == "stop":
            remote = stop_command(cluster, name)
        elif action == "status":
            remote = status_command(cluster, name)
        elif action == "logs":
            remote = logs_command(cluster, name)
        else:
            raise ValueError(f"unknown action {action!r}")
        steps.append(Step(label=f"{name} on {host}", host=host,
                          argv=ssh_argv(cluster.ssh, host, remote), name=name,
                          stdin=token if action == "start" else None))
    return steps


def cluster_token(cluster: Cluster) -> bytes | None:
    """The cluster's token, from ``security.token_file`` (made there, mode 600, when
    missing); None without a token."""
    path = cluster.security.token_file
    if path is None:
        return None
    from protos.security import make_token_file  # graphfeed's own, installed with it

    if make_token_file(path):
        log.info("made the cluster's token in %s (mode 600); keep it: every start sends it", path)
    return path.read_bytes()


# --------------------------------------------------------------------------- running


def run_step(step: Step, timeout: float = SSH_TIMEOUT_S,
             stdout: BinaryIO | None = None) -> tuple[bool, str]:
    """Run one step; (succeeded, its output). With ``stdout``, the remote command's
    standard output goes there and only its standard error comes back."""
    log.debug("running %s", shlex.join(step.argv))
    feed: dict[str, Any] = ({"stdin": subprocess.DEVNULL} if step.stdin is None
                            else {"input": step.stdin})
    try:
        done = subprocess.run(step.argv, stdout=subprocess.PIPE if stdout is None else stdout,
                              stderr=subprocess.PIPE, timeout=timeout, check=False, **feed)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f} s"
    except OSError as exc:
        return False, f"cannot run ssh ({exc})"
    output = ((done.stdout or b"") + done.stderr).decode(errors="replace").rstrip()
    if done.returncode != 0:
        return False, f"exit {done.returncode}: {output}"
    return True, output


def run_steps(steps: Sequence[Step], run: Callable[[Step], tuple[bool, str]]) -> bool:
    """``run`` every step (in parallel), print each one's output; True when all succeeded."""
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(steps)))) as pool:
        results = list(pool.map(run, steps))
    for step, (ok, output) in zip(steps, results, strict=True):
        print(f"== {step.label}: {'ok' if ok else 'FAILED'}")
        if output:
            print(output)
        if not ok:
            log.error("%s failed", step.label)
    return all(ok for ok, _ in results)


def gather_logs(steps: Sequence[Step], out_dir: Path, timeout: float = SSH_TIMEOUT_S) -> bool:
    """Run the ``logs`` steps and write each remote log to ``out_dir``; True when every
    log was copied. A failed copy leaves no file behind."""
    out_dir.mkdir(parents=True, exist_ok=True)

    def fetch(step: Step) -> tuple[bool, str]:
        target = out_dir / f"{step.name}.log"
        with target.open("wb") as fh:
            ok, output = run_step(step, timeout, stdout=fh)
        if not ok:
            target.unlink()
            return False, output
        return True, f"{target} ({target.stat().st_size:,} bytes)"

    return run_steps(steps, fetch)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("start", "stop", "status", "logs"))
    parser.add_argument("cluster", type=Path, help="cluster YAML file")
    parser.add_argument("--dry-run", action="store_true",
                        help="print every ssh command, one per line; run nothing")
    parser.add_argument("--only", choices=("servers", "trainers"))
    parser.add_argument("--timeout", type=float, default=SSH_TIMEOUT_S,
                        help=f"seconds per ssh command ({SSH_TIMEOUT_S:.0f})")
    parser.add_argument("--out", type=Path, default=Path("cluster-logs"),
                        help="logs: local directory for the copies (cluster-logs)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        cluster = load_cluster(args.cluster)
        token = cluster_token(cluster) if args.action == "start" and not args.dry_run else None
        steps = plan(cluster, args.action, args.only, token)
    except ClusterError as exc:
        print(f"launch.py: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"launch.py: error: security.token_file: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        for step in steps:
            print(shlex.join(step.argv))
        return 0
    if args.action == "logs":
        return 0 if gather_logs(steps, args.out, args.timeout) else 1
    return 0 if run_steps(steps, lambda s: run_step(s, args.timeout)) else 1


if __name__ == "__main__":
    sys.exit(main())
