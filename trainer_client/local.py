"""``graphfeed-local``: train on your own partitions on one machine.

::

    graphfeed-local --partition-dir parts/ -- --epochs 10 --fanouts 10,5 --metrics-json m.json
    graphfeed-local --partition-dir parts/ --nproc-per-node 2 -- --epochs 10

Starts one sampling server per partition of ``--partition-dir`` on loopback ports held
for them (:func:`protos.ports.reserved_ports`; each server reports the port it bound
with ``--port-file``), waits until every one answers SERVING on the gRPC health
service, runs ``trainer_client.train --servers <those addresses>`` (or your
``--trainer-script``) with the trainer arguments given after ``--`` (under ``torchrun
--standalone`` when ``--nproc-per-node`` > 1), stops the servers (SIGTERM, then SIGKILL
after ``--grace``), and exits with the trainer's exit code (torchrun's with several
processes: 1 for any failed rank). The servers' logs go to a run directory of their own,
``./graphfeed-local-runs/<date>-<time>/server-<p>.log`` (or ``--log-dir``). Servers that
fail to come up end the run with exit 1 and their log named; bad flags exit 2, the
trainer's too (checked before any server starts, as is ``--task link`` on a graph
without link splits).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from partitioner.format import PartitionFormatError, read_manifest
from partitioner.manifest import Manifest
from protos.channel import create_channel
from protos.cpus import usable_cpus
from protos.ports import reserved_ports, wait_port_file

log = logging.getLogger("graphfeed-local")

_SERVING = health_pb2.HealthCheckResponse.SERVING


#: Where the servers' logs go by default: a new directory under this one, per run.
RUNS_DIR = "graphfeed-local-runs"
#: Times the servers are started on new ports when one cannot bind its own.
BIND_ATTEMPTS = 3
#: What a server that could not bind its port logs (``sampling_server.server.create_server``).
BIND_FAILED = "cannot bind"


class LocalError(RuntimeError):
    """A server of the local cluster did not come up."""


def serving(address: str, timeout: float) -> bool:
    """Whether ``address`` answers SERVING on the overall health service."""
    channel = create_channel(address)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                          timeout=timeout)
        return bool(reply.status == _SERVING)
    except grpc.RpcError:
        return False
    finally:
        channel.close()


def wait_serving(addresses: Sequence[str], procs: Sequence[subprocess.Popen[bytes]],
                 logs: Sequence[Path | str], timeout: float) -> None:
    """Wait until every server answers SERVING; raise :class:`LocalError` when one exits
    or ``timeout`` seconds pass (``logs``: where each server's output goes, for the message)."""
    deadline = time.monotonic() + timeout
    pending = set(range(len(addresses)))
    while pending:
        for p in sorted(pending):
            if procs[p].poll() is not None:
                raise LocalError(f"sampling server {p} exited with {procs[p].returncode} before serving; "
                                 f"see {logs[p]}")
            if serving(addresses[p], timeout=1.0):
                pending.discard(p)
        if pending and time.monotonic() > deadline:
            raise LocalError(f"sampling servers {sorted(pending)} not SERVING within {timeout:g} s; "
                             f"see {[str(logs[p]) for p in sorted(pending)]}")
        if pending:
            time.sleep(0.2)


def stop(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> list[int]:
    """SIGTERM every running process, SIGKILL what is left after ``grace`` seconds."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait(timeout=10))
    return codes


@contextlib.contextmanager
def local_servers(args: argparse.Namespace, num_parts: int) -> Iterator[list[str]]:
    """One sampling server per partition, SERVING; stopped on the way out. Their ports
    stay reserved while they run; should a server still fail to bind its port (where a
    reservation does not hold), all of them start again on other ports."""
    args.log_dir.mkdir(parents=True, exist_ok=True)
    logs = [args.log_dir / f"server-{p}.log" for p in range(num_parts)]
    for attempt in range(1, BIND_ATTEMPTS + 1):
        with reserved_ports(num_parts, args.host) as ports:
            addresses = [f"{args.host}:{port}" for port in ports]
            procs = start_servers(args, addresses, logs)
            try:
                if all_bound(procs, logs, args.ready_timeout):
                    log.info("started %d sampling servers on %s (logs in %s); waiting for SERVING",
                             num_parts, ",".join(addresses), args.log_dir)
                    wait_serving(addresses, procs, logs, args.ready_timeout)
                    yield addresses
                    return
            finally:
                codes = stop(procs, args.grace)
                log.info("sampling servers stopped (exit codes %s)", codes)
        log.warning("a sampling server could not bind its port (attempt %d of %d); starting "
                    "them all again on other ports", attempt, BIND_ATTEMPTS)
    raise LocalError(f"sampling servers could not bind ports on {args.host} in {BIND_ATTEMPTS} "
                     f"attempts; see {[str(p) for p in logs]}")


def start_servers(args: argparse.Namespace, addresses: Sequence[str],
                  logs: Sequence[Path]) -> list[subprocess.Popen[bytes]]:
    """A ``graphfeed-server`` process per address (partition ``p`` on ``addresses[p]``),
    each writing its bound port to ``<log>.port``."""
    procs: list[subprocess.Popen[bytes]] = []
    for p, address in enumerate(addresses):
        port_file(logs[p]).unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "sampling_server", "--partition-dir", str(args.partition_dir),
               "--partition", str(p), "--listen", address, "--peers", ",".join(addresses),
               "--port-file", str(port_file(logs[p])), "--device", args.server_device,
               *shared_cpus(args.server_args, len(addresses))]
        with logs[p].open("wb") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
    return procs


def port_file(server_log: Path) -> Path:
    """Where the server logging to ``server_log`` writes the port it bound."""
    return server_log.with_suffix(".port")


def all_bound(procs: Sequence[subprocess.Popen[bytes]], logs: Sequence[Path], timeout: float) -> bool:
    """Wait until every server has bound its port: True; False when one could not bind
    it (exited, its log saying so); :class:`LocalError` when one exits for another reason
    or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    for p, (proc, server_log) in enumerate(zip(procs, logs, strict=True)):
        try:
            wait_port_file(port_file(server_log), max(deadline - time.monotonic(), 0.0), proc,
                           what=f"sampling server {p}")
        except RuntimeError as exc:
            if BIND_FAILED in server_log.read_text(errors="replace"):
                return False
            raise LocalError(f"{exc}; see {server_log}") from None
        except TimeoutError as exc:
            raise LocalError(f"{exc}; see {server_log}") from None
    return True


def shared_cpus(server_args: Sequence[str], num_servers: int) -> list[str]:
    """``server_args`` plus ``--threads``, unless given: the servers share this machine,
    so each one's kernels get their share of its CPUs rather than all of them."""
    if any(a == "--threads" or a.startswith("--threads=") for a in server_args):
        return list(server_args)
    return [*server_args, f"--threads={max(1, usable_cpus() // num_servers)}"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="graphfeed-local", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start one sampling server per partition on this machine, train with torchrun, "
                    "stop the servers. Trainer arguments (graphfeed-train's) go after '--'.",
        epilog="example:\n  graphfeed-local --partition-dir parts/ -- --epochs 10 --fanouts 10,5")
    p.add_argument("--partition-dir", type=Path, required=True,
                   help="a partitioned graph (format v1, or v2 for a typed graph)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="trainer processes (DDP ranks)")
    p.add_argument("--trainer-script", type=Path, default=None,
                   help="your own training script (it must take --servers) instead of graphfeed-train")
    p.add_argument("--host", default="127.0.0.1", help="address the servers listen on")
    p.add_argument("--server-device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="sampling device of the servers")
    p.add_argument("--server-arg", dest="server_args", action="append", default=[],
                   help="one more graphfeed-server argument (repeatable), e.g. --server-arg=--workers=1; "
                        "each server gets --threads=<this machine's CPUs / servers> unless one is given")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds to wait for every server to load its partition and serve")
    p.add_argument("--grace", type=float, default=30.0, help="seconds servers get to stop")
    p.add_argument("--log-dir", type=Path, default=None,
                   help=f"directory for the servers' logs (default: a new {RUNS_DIR}/<date>-<time>/ "
                   "under the current directory)")
    return p


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv[:cut])
    trainer_args = argv[cut + 1:]
    if unknown:
        own = _without(argv[:cut], unknown)
        parser.error(f"unrecognized arguments: {' '.join(unknown)}; graphfeed-train's arguments go "
                     f"after '--': graphfeed-local {' '.join(own)} -- {' '.join([*unknown, *trainer_args])}")
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node: expected an integer >= 1, got {args.nproc_per_node}")
    if any(a == "--servers" or a.startswith("--servers=") for a in trainer_args):
        parser.error("--servers: graphfeed-local passes the servers it starts; drop it from the trainer "
                     "arguments")
    args.log_dir = args.log_dir or new_run_dir(Path.cwd() / RUNS_DIR)
    return args, trainer_args


def _without(argv: Sequence[str], unknown: Sequence[str]) -> list[str]:
    """``argv`` less the ``unknown`` arguments (each taken out once, in order)."""
    rest, pending = [], list(unknown)
    for arg in argv:
        if pending and arg == pending[0]:
            pending.pop(0)
        else:
            rest.append(arg)
    return rest


def new_run_dir(root: Path) -> Path:
    """A directory under ``root`` named for this moment (``<date>-<time>``, then ``-2``,
    ``-3``... when taken) that does not exist yet."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = root / stamp, 1
    while path.exists():
        n += 1
        path = root / f"{stamp}-{n}"
    return path


def check_trainer_args(trainer_args: Sequence[str], manifest: Manifest, partition_dir: Path) -> None:
    """Refuse, before any server starts, what graphfeed-train would refuse at start: its
    flags (parsed as it parses them, exit 2 with its message), and ``--task link`` on a
    graph without link splits (:class:`ValueError`)."""
    from trainer_client.train import parse_args as trainer_parse_args  # torch: only when it is used

    trainer = trainer_parse_args(["--servers", "graphfeed-local", *trainer_args])
    if trainer.task == "link" and not manifest.link_splits:
        raise ValueError(f"--task link: expected a graph with link splits, but {partition_dir} has none; "
                         "partition it with --link-split (or from an OGB link dataset)")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: the trainer's exit code, 1 when the servers did not come up,
    2 on bad flags (the trainer's too) or a partition directory that cannot be read."""
    args, trainer_args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        manifest = read_manifest(args.partition_dir)
        if args.trainer_script is None:
            check_trainer_args(trainer_args, manifest, args.partition_dir)
    except (PartitionFormatError, OSError) as exc:
        sys.stderr.write(f"graphfeed-local: error: --partition-dir: {exc}\n")
        return 2
    except ValueError as exc:
        sys.stderr.write(f"graphfeed-local: error: {exc}\n")
        return 2
    num_parts = manifest.num_partitions
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        with local_servers(args, num_parts) as addresses:
            return train(addresses, trainer_args, args)
    except LocalError as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        log.warning("interrupted: servers stopped")
        return 130


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def train(addresses: Sequence[str], trainer_args: Sequence[str], args: argparse.Namespace) -> int:
    """Run the trainer against ``addresses``; its exit code. One process runs
    ``trainer_client.train`` directly (its own exit code); more run under torchrun."""
    launcher = [sys.executable]
    if args.nproc_per_node > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc_per_node}"]
    program = [str(args.trainer_script)] if args.trainer_script else ["-m", "trainer_client.train"]
    cmd = [*launcher, *program, "--servers", ",".join(addresses), *trainer_args]
    log.info("training: %s", " ".join(cmd))
    trainer = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        code = trainer.wait()
    except KeyboardInterrupt:
        trainer.send_signal(signal.SIGTERM)
        try:
            trainer.wait(timeout=args.grace)
        except subprocess.TimeoutExpired:
            trainer.kill()
            trainer.wait(timeout=10)
        raise
    log.info("trainer exited with %d", code)
    return code


if __name__ == "__main__":
    sys.exit(main())
