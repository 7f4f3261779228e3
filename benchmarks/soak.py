"""Soak with faults: sampling servers under many trainers for minutes, while servers die
and come back, trainers are killed, idle and slow clients and fuzzed calls arrive.

Two clusters run side by side on this machine, both secure by default (a token made for
the run): a plain graph (synthetic ``small``) and a typed one (``mag-small``), each in
``--partitions`` partitions (2, or 4 for the variant), one server process per partition,
sampling from their own partition's structure and features (``--structure partition
--features partition``, so every batch asks the peers). ``--trainers`` processes
(default 8 per core, at least 16) each run a ``RemoteNeighborLoader`` epoch after epoch
as one rank of a 2-rank job, half the jobs on each graph (``benchmarks/soak_trainer.py``).

The clock starts once every trainer has finished its first epoch; for ``--minutes`` (10;
an hour for a release) a fault schedule repeats every 10 minutes (or once, for shorter
runs), at these fractions of it: 0.20 kill -9 of a plain server and its restart; 0.27 a rolling
SIGTERM restart of the typed servers; 0.36 a trainer killed and started again (it
redoes the epoch it was in, as from a checkpoint); 0.42 an idle client that opens every
stream slot it can get and reads none, another that opens every server's --max-streams
streams over one channel per server and never reads, newcomers timed to their first batch
meanwhile, and a slow client; 0.52 a burst of fuzzed calls; 0.60 kill -9 of a typed server and its
restart; 0.68 a rolling restart of the plain servers. The first fifth and the last fifth
of each cycle are free of faults. Then the trainers finish their epoch and exit.

Recorded per minute (``benchmarks/soak_report.py``): delivered batches/s in all and per
trainer (each trainer's share against its preset's mean), server RSS, open streams,
p50/p99 time to next batch, errors by status code; at the end, per epoch and trainer,
seeds lost and doubled; the targets; a plot over time.

    python benchmarks/soak.py [--minutes 10] [--partitions 2] [--trainers N]

Writes ``benchmarks/results/soak.json`` and ``soak.png`` (``soak-4p`` for 4 partitions).
The run loads the whole machine for its duration.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import child_command, machine, write_json
from soak_report import analyse, plot
from test_limits import fuzz as fuzz_calls

from protos import sampling_pb2 as pb
from protos.channel import create_channel
from protos.epoch_call import stream_minibatches
from protos.ports import reserved_ports
from protos.security import Security, make_token_file, read_token

log = logging.getLogger("soak")
REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "benchmarks" / "soak_trainer.py"
#: Fractions of a cycle at which each fault starts.
SCHEDULE = (("kill_restart", 0.20, "plain", 1), ("rolling_restart", 0.27, "typed", None),
            ("trainer_kill", 0.36, None, None), ("idle_and_slow", 0.42, "plain", 0),
            ("fuzz", 0.52, None, None), ("kill_restart", 0.60, "typed", 0),
            ("rolling_restart", 0.68, "plain", None))
CYCLE_S = 600.0
#: The servers' --max-streams (the default): what the client that never reads opens on each.
MAX_STREAMS = 32
SCRAPE_S = 5.0


def health(address: str, timeout: float = 2.0) -> str:
    """The overall health status name at ``address`` (``DOWN`` without an answer)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=timeout)
        except grpc.RpcError:
            return "DOWN"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


@dataclass
class Cluster:
    """One graph's servers: a process per partition on fixed loopback ports."""

    name: str
    part_dir: Path
    logs: Path
    token_file: Path
    ports: list[int]
    metrics_ports: list[int]
    procs: list[subprocess.Popen[bytes] | None] = field(default_factory=list)
    #: (partition, pid, start time) of every server process started.
    incarnations: list[tuple[int, int, float]] = field(default_factory=list)

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def command(self, p: int) -> list[str]:
        return [sys.executable, "-m", "sampling_server", "--partition-dir", str(self.part_dir),
                "--partition", str(p), "--listen", self.addresses[p], "--peers",
                ",".join(self.addresses), "--device", "cpu", "--structure", "partition",
                "--features", "partition", "--grace", "10", "--token-file", str(self.token_file),
                "--metrics-port", str(self.metrics_ports[p]), "--log-level", "INFO"]

    def start(self, p: int) -> None:
        out = (self.logs / f"{self.name}-server{p}.{len(self.incarnations)}.log").open("wb")
        proc = subprocess.Popen(child_command(self.command(p)), cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        out.close()
        if p < len(self.procs):
            self.procs[p] = proc
        else:
            self.procs.append(proc)
        self.incarnations.append((p, proc.pid, time.time()))

    def wait_serving(self, p: int, timeout: float = 300.0) -> float:
        """Seconds until partition ``p``'s server is SERVING; TimeoutError after ``timeout``."""
        started = time.monotonic()
        while health(self.addresses[p]) != "SERVING":
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{self.name} server {p} not SERVING within {timeout:.0f} s")
            time.sleep(0.2)
        return time.monotonic() - started

    def signal(self, p: int, sig: int) -> None:
        proc = self.procs[p]
        assert proc is not None
        proc.send_signal(sig)
        proc.wait(timeout=120)

    def stop(self) -> list[int | None]:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = []
        for proc in self.procs:
            try:
                codes.append(None if proc is None else proc.wait(timeout=60))
            except subprocess.TimeoutExpired:
                proc.kill()  # type: ignore[union-attr]
                codes.append(None)
        return codes


@dataclass
class Trainer:
    """One trainer process (a rank of a job) and its restarts."""

    name: str
    preset: str
    job: int
    rank: int
    servers: str
    log: Path
    stop_file: Path
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    exits: list[int | None] = field(default_factory=list)

    def start(self, token_file: Path) -> None:
        cmd = [sys.executable, str(TRAINER), "--servers", self.servers, "--log", str(self.log),
               "--kind", self.preset, "--rank", str(self.rank), "--world-size", "2",
               "--seed", str(self.job), "--stop-file", str(self.stop_file),
               "--client-id", self.name, *self.extra]
        out = self.log.with_suffix(".out").open("ab")
        self.proc = subprocess.Popen(child_command(cmd), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1",
                                          "GRAPHFEED_TOKEN_FILE": str(token_file)})
        out.close()

    def has_epoch(self) -> bool:
        return self.log.exists() and '"event": "epoch"' in self.log.read_text()


class Monitor(threading.Thread):
    """Every :data:`SCRAPE_S` seconds: each server's RSS and its metrics, and the CPU time
    the machine spent, this soak's processes apart (other work on a shared machine)."""

    def __init__(self, clusters: list[Cluster]) -> None:
        super().__init__(name="soak-monitor", daemon=True)
        self.clusters = clusters
        self.samples: list[dict[str, Any]] = []
        self.cpu: list[dict[str, float]] = []
        self._own: dict[int, float] = {}
        self.stopped = threading.Event()

    def _cpu(self, now: float) -> None:
        """Busy and stolen CPU seconds of the machine so far, and the CPU seconds this
        soak's processes spent since the last sample (a process started since then
        counts whole; a killed one's last seconds are lost)."""
        total = psutil.cpu_times()
        busy = total.user + total.system + total.nice + getattr(total, "irq", 0.0) + \
            getattr(total, "softirq", 0.0)
        spent, seen = 0.0, {}
        me = psutil.Process()
        for proc in [me, *me.children(recursive=True)]:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            seen[proc.pid] = times.user + times.system
            spent += seen[proc.pid] - self._own.get(proc.pid, 0.0)
        self._own = seen
        self.cpu.append({"t": now, "busy": busy, "steal": getattr(total, "steal", 0.0),
                         "soak": spent})

    def run(self) -> None:
        while not self.stopped.wait(SCRAPE_S):
            now = time.time()
            self._cpu(now)
            for c in self.clusters:
                for p, proc in enumerate(c.procs):
                    if proc is None or proc.poll() is not None:
                        continue
                    sample = {"t": now, "server": f"{c.name}{p}", "pid": proc.pid}
                    try:
                        sample["rss"] = psutil.Process(proc.pid).memory_info().rss
                        sample["metrics"] = scrape(c.metrics_ports[p])
                    except (psutil.Error, OSError):
                        continue  # going away (a fault): the next sample tells
                    self.samples.append(sample)


def scrape(port: int) -> dict[str, float]:
    """The server's counters and gauges that the report reads, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    wanted = ("graphfeed_streams_open", "graphfeed_requests_rejected_total",
              "graphfeed_peer_errors_total", "graphfeed_streams_evicted_total",
              "graphfeed_streams_waiting", "graphfeed_client_streams")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k not in ("partition", "method"))
                key = f"{s.name}{{{labels}}}" if labels else s.name
                out[key] = out.get(key, 0.0) + s.value
    return out


def _hog_request(client_id: str, **kw: Any) -> pb.EpochRequest:
    base: dict[str, Any] = {"split": "train", "fanouts": [-1, -1], "batch_size": 1,
                            "world_size": 1, "include_features": True, "client_id": client_id}
    base.update(kw)
    return pb.EpochRequest(**base)


class Faults:
    """The fault schedule's actions; each records when it ran and what it saw."""

    def __init__(self, clusters: dict[str, Cluster], trainers: list[Trainer], run_dir: Path,
                 token_file: Path, args: argparse.Namespace) -> None:
        self.clusters, self.trainers, self.run_dir = clusters, trainers, run_dir
        self.token_file, self.args = token_file, args
        self.security = Security(token=read_token(token_file))
        self.rng = random.Random(args.seed)
        self.events: list[dict[str, Any]] = []
        self.extra_trainers: list[Trainer] = []

    def run(self, name: str, cluster: str | None, partition: int | None) -> None:
        started = time.time()
        try:
            detail = getattr(self, name)(cluster, partition)
        except Exception as exc:  # recorded: a fault that fails is a finding, not a crash
            log.exception("fault %s failed", name)
            detail = {"failed": f"{type(exc).__name__}: {exc}"[:300]}
        self.events.append({"fault": name, "cluster": cluster, "partition": partition,
                            "start": started, "end": time.time(), **detail})
        log.info("fault %s %s %s: %s", name, cluster or "", "" if partition is None else partition,
                 detail)

    def kill_restart(self, cluster: str, p: int) -> dict[str, Any]:
        c = self.clusters[cluster]
        c.signal(p, signal.SIGKILL)
        c.start(p)
        return {"serving_after_s": round(c.wait_serving(p), 1)}

    def rolling_restart(self, cluster: str, _: None) -> dict[str, Any]:
        c = self.clusters[cluster]
        codes, serving = [], []
        for p in reversed(range(len(c.procs))):
            c.signal(p, signal.SIGTERM)  # drains (--grace 10), then exits
            proc = c.procs[p]
            codes.append(proc.returncode if proc is not None else None)
            c.start(p)
            serving.append(round(c.wait_serving(p), 1))
        return {"exit_codes": codes, "serving_after_s": serving}

    def trainer_kill(self, *_: None) -> dict[str, Any]:
        victim = self.rng.choice([t for t in self.trainers if t.proc and t.proc.poll() is None])
        assert victim.proc is not None
        victim.proc.kill()
        victim.exits.append(victim.proc.wait(timeout=60))
        victim.start(self.token_file)
        return {"trainer": victim.name}

    def idle_and_slow(self, cluster: str, p: int) -> dict[str, Any]:
        """Two idle clients on one cluster: one takes every slot it can get on server
        ``p`` and reads one message of each; the other opens ``--max-streams`` streams of
        one-seed batches on every server of the cluster, over one channel per server, and
        never reads any. Newcomers are timed to their first batch on server ``p``
        meanwhile, and a slow client reads one batch every 1.5 s on the same cluster."""
        c = self.clusters[cluster]
        window = min(40.0, 0.07 * self.args.cycle_s)  # newcomers, once it holds its slots
        name = f"slow-{len(self.extra_trainers)}"  # one per cycle
        slow = Trainer(name, "plain", 99, 0, ",".join(c.addresses), self.run_dir / f"{name}.jsonl",
                       self.run_dir / f"{name}.stop", ("--step-ms", "1500", "--stop-mid-epoch"))
        slow.start(self.token_file)
        self.extra_trainers.append(slow)
        evicted = "graphfeed_streams_evicted_total{reason=fair_share}"
        evicted_before = [scrape(port).get(evicted, 0.0) for port in c.metrics_ports]
        with contextlib.ExitStack() as stack:
            channels = [stack.enter_context(create_channel(a, security=self.security)) for a in c.addresses]
            never_read = [stream_minibatches(channel, _hog_request("never-reads"), timeout=window + 600,
                                             parse=None, acknowledge=None)
                          for channel in channels for _ in range(MAX_STREAMS)]
            held = []
            for _ in range(256):  # until refused: every slot it can get
                call = stream_minibatches(channels[p], _hog_request("idle-client"), timeout=window + 600,
                                          parse=None, acknowledge=None)
                try:
                    next(call)
                except grpc.RpcError as exc:
                    refused = exc.code().name
                    break
                held.append(call)
            else:
                refused = "never"
            probes: list[float | str] = []
            ends = time.monotonic() + window
            while time.monotonic() < ends:
                time.sleep(min(8.0, max(0.0, ends - time.monotonic())))
                asked = time.monotonic()
                call = stream_minibatches(channels[p], _hog_request(f"newcomer-{len(probes)}", fanouts=[5],
                                                                    batch_size=32), timeout=60)
                try:
                    next(call)
                    probes.append(round(time.monotonic() - asked, 2))
                except grpc.RpcError as exc:
                    probes.append(f"{exc.code().name} after {time.monotonic() - asked:.1f} s")
                call.cancel()
            taken_back = sum(scrape(port).get(evicted, 0.0) - before
                             for port, before in zip(c.metrics_ports, evicted_before, strict=True))
            for call in held + never_read:
                call.cancel()
        slow.stop_file.touch()
        return {"idle_streams": len(held), "idle_client_refused_with": refused,
                "never_reading_streams": len(never_read), "streams_taken_back": int(taken_back),
                "newcomer_first_batch_s": probes}

    def fuzz(self, *_: None) -> dict[str, Any]:
        """``--fuzz-calls`` mutated and random requests to every method of every server,
        nine in ten with the token."""
        addresses = [a for c in self.clusters.values() for a in c.addresses]
        channels = [create_channel(a, security=self.security if k < 9 else Security())
                    for a in addresses for k in range(10)]
        try:
            codes = fuzz_calls(channels, self.args.fuzz_calls, seed=self.args.seed)
        finally:
            for channel in channels:
                channel.close()
        return {"calls": sum(codes.values()), "codes": dict(codes)}


def make_graphs(data: Path, partitions: int) -> dict[str, Path]:
    """The plain and the typed graph, partitioned (made once under ``data``)."""
    from partitioner import partition_graph
    from partitioner.synthetic import generate

    dirs = {"plain": data / f"small-{partitions}", "typed": data / f"mag-small-{partitions}"}
    if not (dirs["plain"] / "manifest.json").exists():
        partition_graph(generate("small", progress=False), partitions, dirs["plain"],
                        method="metis", progress=False, overwrite=True)
    if not (dirs["typed"] / "manifest.json").exists():
        partition_graph(generate("mag-small", progress=False), partitions,
                        dirs["typed"], method="random", progress=False, overwrite=True)
    return dirs


def start_trainers(args: argparse.Namespace, clusters: dict[str, Cluster], run_dir: Path,
                   token_file: Path) -> list[Trainer]:
    """``args.trainers`` processes: 2-rank jobs, plain and typed in turn."""
    trainers = []
    for job in range(args.trainers // 2):
        preset = ("plain", "typed")[job % 2]
        for rank in (0, 1):
            name = f"{preset}-job{job}-rank{rank}"
            trainer = Trainer(name, preset, job, rank, ",".join(clusters[preset].addresses),
                              run_dir / f"{name}.jsonl", run_dir / "stop")
            trainer.start(token_file)
            trainers.append(trainer)
    return trainers


def wait_first_epochs(trainers: list[Trainer], timeout: float) -> float:
    """Wait until every trainer has finished its first epoch (the soak's clock starts
    then: the trainers have started, and none is still starving while the others import
    PyTorch and open their streams); the time."""
    deadline = time.monotonic() + timeout
    while not all(t.has_epoch() for t in trainers):
        dead = [t.name for t in trainers if t.proc is not None and t.proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"trainers without a first epoch: exited {dead}, or over {timeout} s")
        time.sleep(1.0)
    return time.time()


def run_schedule(faults: Faults, t0: float, seconds: float, cycle: float) -> None:
    """Every fault of :data:`SCHEDULE` in every cycle, each at its time (or once the one
    before it is done)."""
    cycles = max(1, round(seconds / cycle))
    for k in range(cycles):
        for name, fraction, cluster, partition in SCHEDULE:
            at = t0 + (k + fraction) * cycle
            time.sleep(max(0.0, at - time.time()))
            faults.run(name, cluster, partition)


def finish(trainers: list[Trainer], stop_file: Path, timeout: float) -> dict[str, Any]:
    """Stop the trainers after their epoch; each one's exits (None: hung, then killed)."""
    stop_file.touch()
    deadline = time.monotonic() + timeout
    for t in trainers:
        assert t.proc is not None
        try:
            t.exits.append(t.proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            t.proc.send_signal(signal.SIGUSR1)
            t.proc.kill()
            t.proc.wait(timeout=30)
            t.exits.append(None)
    return {t.name: t.exits for t in trainers}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="soak time after warm-up (10)")
    p.add_argument("--partitions", type=int, default=2, choices=(2, 4))
    p.add_argument("--trainers", type=int, default=max(16, 8 * (os.cpu_count() or 2)),
                   help="trainer processes, an even number (8 per core, at least 16)")
    p.add_argument("--fuzz-calls", type=int, default=10_000, help="fuzzed calls per burst (10000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=REPO / "data" / "soak", help="graphs (made once)")
    p.add_argument("--keep", type=Path, default=None, help="keep the logs here")
    p.add_argument("--results-name", default=None, help="soak, or soak-4p with 4 partitions")
    args = p.parse_args(argv)
    if args.trainers < 2 or args.trainers % 2:
        p.error(f"--trainers: expected an even number >= 2, got {args.trainers}")
    if args.minutes <= 0:
        p.error(f"--minutes: expected > 0, got {args.minutes}")
    args.cycle_s = min(CYCLE_S, args.minutes * 60)
    args.results_name = args.results_name or ("soak" if args.partitions == 2 else "soak-4p")
    return args


def warm_kernels() -> None:
    """Compile and cache the Numba kernels first (``python -m sampling_server.warmup``),
    as the container image does when it is built: a kernel a server compiles on first
    use holds that server's interpreter for seconds, stalling every stream it serves."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "sampling_server.warmup"], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    log.info("kernels compiled and cached in %.1f s", time.perf_counter() - started)


def soak(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    graphs = make_graphs(args.data, args.partitions)
    warm_kernels()
    token_file = run_dir / "token"
    make_token_file(token_file)
    held = contextlib.ExitStack()  # ports held bound for the soak: a restarted server keeps its address
    ports = held.enter_context(reserved_ports(4 * args.partitions))
    clusters = {name: Cluster(name, graphs[name], run_dir, token_file,
                              ports[2 * i * args.partitions:(2 * i + 1) * args.partitions],
                              ports[(2 * i + 1) * args.partitions:(2 * i + 2) * args.partitions])
                for i, name in enumerate(("plain", "typed"))}
    trainers: list[Trainer] = []
    monitor = Monitor(list(clusters.values()))
    try:
        for c in clusters.values():
            for p in range(args.partitions):
                c.start(p)
        for c in clusters.values():
            for p in range(args.partitions):
                c.wait_serving(p)
        monitor.start()
        trainers = start_trainers(args, clusters, run_dir, token_file)
        t0 = wait_first_epochs(trainers, 900)
        log.info("every trainer has finished its first epoch: the soak's %.1f minutes start", args.minutes)
        faults = Faults(clusters, trainers, run_dir, token_file, args)
        run_schedule(faults, t0, args.minutes * 60, args.cycle_s)
        time.sleep(max(0.0, t0 + args.minutes * 60 - time.time()))
        t_end = time.time()
        exits = finish(trainers + faults.extra_trainers, run_dir / "stop", 600)
        monitor.stopped.set()
        server_exits = {name: c.stop() for name, c in clusters.items()}
    finally:
        monitor.stopped.set()
        for t in trainers:
            if t.proc is not None and t.proc.poll() is None:
                t.proc.kill()
        for c in clusters.values():
            for proc in c.procs:
                if proc is not None and proc.poll() is None:
                    proc.kill()
        held.close()
    return analyse(run_dir, t0=t0, t_end=t_end, trainers=[(t.name, t.preset, t.log) for t in trainers],
                   samples=monitor.samples, cpu=monitor.cpu, faults=faults.events,
                   trainer_exits=exits, server_exits=server_exits, cycle_s=args.cycle_s)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    results: dict[str, Any] = {"machine": machine(), "command": " ".join(sys.argv),
                               "settings": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="graphfeed-soak-") as tmp:
        run_dir = args.keep or Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        results.update(soak(args, run_dir))
    path = write_json(args.results_name, results)
    plot(results, path.with_suffix(".png"))
    verdict = results["targets"]
    print(f"wrote {path} and {path.with_suffix('.png')}")
    for name, target in verdict.items():
        state = {True: "PASS", False: "FAIL", None: "not measured"}[target["pass"]]
        print(f"{state} {name}: {target['value']} (target {target['target']})")
    return 1 if any(t["pass"] is False for t in verdict.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
