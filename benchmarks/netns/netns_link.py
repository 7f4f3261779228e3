"""Links shaped by tc (not a test): two sampling servers and two trainers, each in its own
network namespace on one switch, every host's link shaped by ``tc`` to a rate (default 10
and 25 Gbit/s, both directions) plus, where the kernel has netem, a small delay.

First the links themselves are measured: a raw TCP transfer server0 -> trainer0 and
1-byte round trips, unshaped, at each rate and at ``--check-rate`` (1 Gbit/s), so that
the shaping is seen to take effect and the machine's own ceiling is known. Then the
servers (one per partition of the preset, default ``products-like`` in 2 ``range``
partitions) serve two trainer processes (ranks 0 and 1 of one DDP world), which read
with ``RemoteNeighborLoader`` on the CPU, fanouts [15, 10, 5], batch 1024, and sleep
``--step-ms`` after every batch in place of the model step. Rows: float32 and bfloat16
features on the wire, without and with a 20 % trainer-side cache (the default hot-node
ranking), at every rate. Per row: delivered batches/s per trainer, bytes per batch, the
trainers' wait fraction, the ratio to float32 without cache over the same link, the bytes
per second on each trainer's link against its rate, each server's seconds per batch by
stage and per answer to the other server's calls (their work alone: against the caller's
time for the same calls, what the network and the queues add), and its threads' mean wait
for the interpreter lock (all from its Prometheus metrics: near the 5 ms switch interval,
the lock bounds the server), what every host's link carried each way (its interface's
counters: a server's outgoing link carries its answers to the other server's peer calls
besides its batches), and the CPU seconds all processes spent per batch; the last two
say whether the CPU or a link bounds a row.

Target: bfloat16 + 20 % cache >= 3x the batches/s per trainer of float32 without cache
over the same 10 Gbit/s link. Needs root (namespaces, tc). Writes
``benchmarks/results/netns_link.json`` and ``netns_link.png``.

    sudo .venv/bin/python benchmarks/netns/netns_link.py --data data/bench
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import RESULTS, child_command, ensure_partitions, machine, write_json
from netns_report import plot, print_table, summarize
from netns_topology import (
    LinkShape,
    NetnsError,
    Network,
    parse_rate,
    plan_topology,
    remove_stale,
    why_not_root,
)

log = logging.getLogger("bench.netns_link")

FANOUTS = [15, 10, 5]
BATCH = 1024
SERVERS = ("server0", "server1")
TRAINERS = ("trainer0", "trainer1")
PORT, METRICS_PORT, PROBE_PORT = 50051, 9100, 5201
TAG_PREFIX = "gfl"
ROLES = Path(__file__).resolve().parent / "netns_roles.py"
REPO = Path(__file__).resolve().parents[2]
DEFAULT_ROWS = "float32:0,bfloat16:0,float32:0.2,bfloat16:0.2"
STAGES = ("sample", "gather", "encode", "peer_sample", "peer_fetch", "answer_sample", "answer_fetch")


@dataclass(frozen=True)
class RowPlan:
    """One measured row: a link shape, the wire feature dtype and the cache fraction."""

    link: LinkShape
    dtype: str
    cache: float


def parse_rows(text: str) -> list[tuple[str, float]]:
    """``"float32:0,bfloat16:0.2"`` -> [("float32", 0.0), ("bfloat16", 0.2)]."""
    rows = []
    for item in text.split(","):
        dtype, _, cache = item.strip().partition(":")
        if dtype not in ("float32", "float16", "bfloat16") or not re.fullmatch(r"0?\.\d+|0|1", cache):
            raise ValueError(f"rows: expected DTYPE:CACHE items such as float32:0,bfloat16:0.2 "
                             f"(DTYPE float32, float16 or bfloat16; CACHE 0 .. 1), got {item!r}")
        rows.append((dtype, float(cache)))
    return rows


def plan_rows(rates: list[float], delay_us: float, rows: list[tuple[str, float]],
              repeat: int = 1) -> list[RowPlan]:
    """Every row at every rate, rate by rate (the link is reshaped once per rate); with
    ``repeat``, all the rows of a rate once, then again (noise spreads over every row)."""
    return [RowPlan(LinkShape(rate, delay_us), d, c) for rate in rates for _ in range(repeat)
            for d, c in rows]


def merge_repeats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (link, dtype, cache): the repeat with the median batches/s per trainer,
    and every repeat's batches/s beside it."""
    groups: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["link"], r["dtype"], r["cache"]), []).append(r)
    merged = []
    for reps in groups.values():
        ranked = sorted(reps, key=lambda r: r["batches_per_s_per_trainer"])
        row = dict(ranked[(len(ranked) - 1) // 2])  # the lower median of an even count
        row["repeats_batches_per_s_per_trainer"] = [r["batches_per_s_per_trainer"] for r in reps]
        merged.append(row)
    return merged


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path("data/bench"))
    p.add_argument("--preset", default="products-like", help="synthetic preset (products-like, small)")
    p.add_argument("--partition-dir", type=Path, default=None,
                   help="an existing 2-partition graph (instead of --data/--preset)")
    p.add_argument("--rates", type=parse_rate, nargs="+", default=[10e9, 25e9],
                   help="link rates (10gbit 25gbit; a bare number is Gbit/s)")
    p.add_argument("--delay-us", type=float, default=100.0,
                   help="one-way delay per link, microseconds, where the kernel has netem")
    p.add_argument("--rows", type=parse_rows, default=parse_rows(DEFAULT_ROWS),
                   help=f"DTYPE:CACHE per row, comma-separated (default {DEFAULT_ROWS})")
    p.add_argument("--step-ms", type=float, default=50.0, help="the model step a sleep stands for")
    p.add_argument("--batches", type=int, default=40,
                   help="timed batches per trainer and row (after the prefetch window's backlog); "
                        "with fewer, the batches the servers sampled ahead inflate the fast rows")
    p.add_argument("--warmup", type=int, default=1, help="untimed batches per trainer before each row")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure every row this many times (interleaved); the median is reported")
    p.add_argument("--batch-size", type=int, default=BATCH)
    p.add_argument("--probe-seconds", type=float, default=3.0, help="raw TCP transfer per link probe")
    p.add_argument("--check-rate", type=parse_rate, default=1e9,
                   help="an extra probe at a rate the machine surely carries, to show the shaping "
                        "holds (default 1gbit)")
    p.add_argument("--row-timeout", type=float, default=900.0, help="seconds a row may take")
    p.add_argument("--subnet", default="10.231.78", help="private /24 of the namespaces")
    p.add_argument("--server-workers", type=int, default=None,
                   help="each server's sampling threads (its --workers; default: the server's own)")
    p.add_argument("--server-threads", type=int, default=None,
                   help="threads of each parallel kernel of a server's sampling thread (its --threads; "
                        "default: the server's own, every usable CPU)")
    p.add_argument("--server-structure", choices=("partition", "full"), default=None,
                   help="each server's --structure: sample from its own partition's in-edges "
                        "(asking the peer to draw its nodes' neighbors) or from the whole "
                        "graph's (default: the server's own, auto, which is full for these "
                        "graphs)")
    p.add_argument("--server-features", choices=("partition", "full"), default=None,
                   help="each server's --features: gather its own partition's rows (asking the "
                        "peer for its nodes') or every node's (default: the server's own, auto, "
                        "which is full for these graphs)")
    p.add_argument("--server-switch-interval-ms", type=float, default=None,
                   help="each server's interpreter switch interval (sys.setswitchinterval; "
                        "default: Python's 5 ms): how long a thread may keep the lock while "
                        "others wait for it")
    p.add_argument("--results-name", default="netns_link")
    args = p.parse_args(argv)
    if args.server_switch_interval_ms is not None and not args.server_switch_interval_ms > 0:
        p.error(f"--server-switch-interval-ms: expected milliseconds > 0, got "
                f"{args.server_switch_interval_ms}")
    if args.step_ms < 0 or args.batches < 1 or args.warmup < 0 or args.delay_us < 0 or args.repeat < 1:
        p.error("--step-ms, --delay-us and --warmup must be >= 0, --batches and --repeat >= 1")
    for name in ("server_workers", "server_threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')}: expected an integer >= 1, got {value}")
    return args


def server_command(args: argparse.Namespace, part_dir: Path, partition: int,
                   addresses: list[str]) -> list[str]:
    """The command line of server ``partition`` (of the servers at ``addresses``)."""
    launch = [sys.executable, "-m", "sampling_server"]
    if args.server_switch_interval_ms is not None:
        launch = [sys.executable, "-c",
                  "import runpy, sys; sys.setswitchinterval(float(sys.argv.pop(1)) / 1e3); "
                  "runpy.run_module('sampling_server', run_name='__main__', alter_sys=True)",
                  repr(args.server_switch_interval_ms)]
    cmd = [*launch, "--partition-dir", str(part_dir.resolve()), "--partition", str(partition),
           "--listen", addresses[partition], "--peers", ",".join(addresses),
           "--verify", "size", "--no-mmap", "--device", "cpu",
           "--metrics-port", str(METRICS_PORT), "--log-level", "WARNING",
           "--insecure"]  # namespaces of this run's own, on a bridge nothing else reaches
    if args.server_workers is not None:
        cmd += ["--workers", str(args.server_workers)]
    if args.server_threads is not None:
        cmd += ["--threads", str(args.server_threads)]
    if args.server_structure is not None:
        cmd += ["--structure", args.server_structure]
    if args.server_features is not None:
        cmd += ["--features", args.server_features]
    return cmd


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name" or "name[stage]": value} (histogram buckets left out)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if not m or line.startswith("#") or "le=" in (m.group(2) or ""):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        key = m.group(1) + (f"[{labels['stage']}]" if "stage" in labels else "")
        try:
            values[key] = values.get(key, 0.0) + float(m.group(3))
        except ValueError:
            continue
    return values


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat)."""
    cpu = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0)
    return float(sum(cpu) - idle), float(sum(cpu))


class Bench:
    """The servers and trainers of one run inside ``net``; :meth:`stop` ends them all."""

    def __init__(self, net: Network, args: argparse.Namespace, tmp: Path) -> None:
        self.net, self.args, self.tmp = net, args, tmp
        self.servers: dict[str, subprocess.Popen[str]] = {}
        self.others: list[subprocess.Popen[str]] = []
        self.addresses = [f"{net.topo.host(s).address}:{PORT}" for s in SERVERS]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

    def _start(self, host: str, cmd: list[str], log_name: str) -> subprocess.Popen[str]:
        out = open(self.tmp / log_name, "w")  # noqa: SIM115 (closed with the process)
        proc = self.net.popen(host, child_command(cmd), stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                              env=self.env)
        out.close()
        return proc

    def tail(self, log_name: str, lines: int = 25) -> str:
        path = self.tmp / log_name
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else ""

    # -- the links alone ------------------------------------------------------------------
    def probe(self, shape: LinkShape | None) -> dict[str, Any]:
        """Raw TCP server0 -> trainer0 and 1-byte round trips trainer0 -> server0."""
        self.net.shape(shape)
        py, a = sys.executable, self.args
        server = self.net.topo.host("server0").address
        sink = self._start("trainer0", [py, str(ROLES), "tcp-sink", "--port", str(PROBE_PORT)], "sink.log")
        self.others.append(sink)
        source = self._start("server0", [py, str(ROLES), "tcp-source", "--host",
                                         self.net.topo.host("trainer0").address, "--port",
                                         str(PROBE_PORT), "--seconds", str(a.probe_seconds)], "source.log")
        self.others.append(source)
        transfer = self._json(sink, "sink.log", 120 + a.probe_seconds)
        source.wait(30)
        qdisc = self.net.qdisc_stats("server0") if shape else ""
        echo = self._start("server0", [py, str(ROLES), "tcp-echo", "--port", str(PROBE_PORT + 1)], "echo.log")
        self.others.append(echo)
        ping = self._start("trainer0", [py, str(ROLES), "tcp-ping", "--host", server, "--port",
                                        str(PROBE_PORT + 1)], "ping.log")
        self.others.append(ping)
        rtt = self._json(ping, "ping.log", 120)
        echo.wait(30)
        sent = re.search(r"Sent (\d+) bytes", qdisc)
        row = {"link": shape.label if shape else "unshaped",
               "rate_gbit": shape.rate_bits / 1e9 if shape else None,
               "delay_us_applied": shape.delay_us if shape else 0.0,
               "tcp_gbit_per_s": transfer["gbit_per_s"], "tcp_bytes": transfer["bytes"],
               "rtt_median_us": rtt["rtt_median_us"], "rtt_p10_us": rtt["rtt_p10_us"],
               "qdisc_sent_bytes": int(sent.group(1)) if sent else None,
               "qdisc": qdisc.strip().splitlines()[0] if qdisc.strip() else "none"}
        log.info("link %-22s raw TCP %.2f Gbit/s, RTT %.0f us", row["link"], row["tcp_gbit_per_s"],
                 row["rtt_median_us"])
        return row

    def _json(self, proc: subprocess.Popen[str], log_name: str, timeout: float) -> dict[str, Any]:
        import json

        code = proc.wait(timeout)
        lines = (self.tmp / log_name).read_text().strip().splitlines()
        if code != 0 or not lines:
            raise RuntimeError(f"{log_name}: exit {code}:\n{self.tail(log_name)}")
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    # -- servers ----------------------------------------------------------------------------
    def start_servers(self, part_dir: Path) -> None:
        for p, name in enumerate(SERVERS):
            cmd = server_command(self.args, part_dir, p, self.addresses)
            self.servers[name] = self._start(name, cmd, f"{name}.log")

    def check_servers(self) -> None:
        for name, proc in self.servers.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.tail(name + '.log')}")

    def scrape(self) -> dict[str, dict[str, float]]:
        """Each server's metrics and CPU seconds, the machine's CPU counters, and the bytes
        each host's link carried each way."""
        code = ("import sys,urllib.request;"
                "print(urllib.request.urlopen(sys.argv[1],timeout=20).read().decode())")
        out: dict[str, dict[str, float]] = {}
        for name, proc in self.servers.items():
            host = self.net.topo.host(name)
            text = subprocess.run(["ip", "netns", "exec", host.namespace, sys.executable, "-c", code,
                                   f"http://{host.address}:{METRICS_PORT}/metrics"],
                                  capture_output=True, text=True,
                                  timeout=60, check=True).stdout
            out[name] = {**parse_metrics(text), "cpu_seconds": process_cpu_seconds(proc.pid)}
        busy, total = machine_busy()
        out["machine"] = {"busy": busy, "total": total}
        out["links"] = {}
        for name in (*SERVERS, *TRAINERS):
            sent, received = self.net.link_bytes(name)
            out["links"].update({f"{name} out": float(sent), f"{name} in": float(received)})
        return out

    # -- one row ------------------------------------------------------------------------------
    def run_row(self, plan: RowPlan, index: int) -> dict[str, Any]:
        a, tmp = self.args, self.tmp / f"row{index}"
        tmp.mkdir()
        go = tmp / "go"
        trainers = []
        for rank, name in enumerate(TRAINERS):
            cmd = [sys.executable, str(ROLES), "trainer", "--servers", ",".join(self.addresses),
                   "--rank", str(rank), "--world-size", str(len(TRAINERS)), "--dtype", plan.dtype,
                   "--cache", str(plan.cache), "--fanouts", ",".join(map(str, FANOUTS)),
                   "--batch-size", str(a.batch_size), "--batches", str(a.batches),
                   "--warmup", str(a.warmup), "--step-ms", str(a.step_ms),
                   "--ready", str(tmp / f"ready{rank}"), "--go", str(go),
                   "--out", str(tmp / f"out{rank}.json"), "--timeout", str(a.row_timeout)]
            trainers.append(self._start(name, cmd, f"row{index}-{name}.log"))
            self.others.append(trainers[-1])
        deadline = time.monotonic() + a.row_timeout
        while not all((tmp / f"ready{r}").exists() for r in range(len(TRAINERS))):
            self._check_row(trainers, index, deadline)
            time.sleep(0.05)
        before = self.scrape()
        go.touch()
        started = time.perf_counter()
        while any(t.poll() is None for t in trainers):
            self._check_row(trainers, index, deadline)
            time.sleep(0.05)
        wall = time.perf_counter() - started
        self._check_row(trainers, index, deadline)
        after = self.scrape()
        import json

        results = [json.loads((tmp / f"out{r}.json").read_text()) for r in range(len(TRAINERS))]
        return row_result(plan, results, before, after, wall)

    def _check_row(self, trainers: list[subprocess.Popen[str]], index: int, deadline: float) -> None:
        self.check_servers()
        for name, t in zip(TRAINERS, trainers, strict=True):
            if t.poll() not in (None, 0):
                raise RuntimeError(f"row {index}: {name} exited ({t.returncode}):\n"
                                   f"{self.tail(f'row{index}-{name}.log')}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"row {index}: not done within --row-timeout {self.args.row_timeout:.0f} s")

    def stop(self) -> None:
        """SIGTERM every process still running (servers drain), SIGKILL after 30 s."""
        procs = [*self.others, *self.servers.values()]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def _grown(before: dict[str, float], after: dict[str, float], key: str) -> float:
    """How much counter ``key`` of one server's metrics grew over the window."""
    return after.get(key, 0) - before.get(key, 0)


def _mean_ms(before: dict[str, float], after: dict[str, float], histogram: str,
             digits: int = 1) -> float | None:
    """The mean of the observations of ``histogram`` (its ``_count`` / ``_sum`` keys with
    ``{}`` for the suffix) over the window, in ms; None: nothing observed."""
    count, total = (_grown(before, after, histogram.format(k)) for k in ("count", "sum"))
    return round(1e3 * total / count, digits) if count else None


def row_result(plan: RowPlan, trainers: list[dict[str, Any]], before: dict[str, dict[str, float]],
               after: dict[str, dict[str, float]], wall: float, cores: int | None = None) -> dict[str, Any]:
    """One row from the trainers' results and the servers' counters around the window;
    ``cores``: the machine's (default: all of them)."""
    n = len(trainers)
    mean = lambda key: sum(float(t[key]) for t in trainers) / n  # noqa: E731
    servers = {}
    server_cpu = 0.0
    server_batches = 0.0
    for name in SERVERS:
        b, e = before[name], after[name]
        batches = _grown(b, e, "graphfeed_batches_sent_total")
        sent = _grown(b, e, "graphfeed_bytes_sent_total")
        stages = {f"{s}_ms": ms for s in STAGES
                  if (ms := _mean_ms(b, e, f"graphfeed_stage_seconds_{{}}[{s}]")) is not None}
        gil_wait = _mean_ms(b, e, "graphfeed_gil_wait_seconds_{}", digits=2)
        gil = {} if gil_wait is None else {"gil_wait_ms": gil_wait}
        cpu = e["cpu_seconds"] - b["cpu_seconds"]
        server_cpu += cpu
        server_batches += batches
        servers[name] = {"batches": int(batches), "sent_gbit_per_s": round(8 * sent / wall / 1e9, 3),
                         "cpu_seconds": round(cpu, 2), **stages, **gil}
    delivered = sum(int(t["batches"]) for t in trainers)
    trainer_cpu = sum(float(t["cpu_seconds_per_batch"]) * int(t["batches"]) for t in trainers)
    busy = (after["machine"]["busy"] - before["machine"]["busy"]) / (after["machine"]["total"]
                                                                      - before["machine"]["total"])
    # The servers' CPU over the batches they sent in the window (they also refill the
    # trainers' prefetch windows), the trainers' over the batches they took.
    cpu_per_batch = server_cpu / (server_batches or delivered) + trainer_cpu / delivered
    bytes_per_batch = mean("bytes_per_batch")
    cores = cores or os.cpu_count() or 1
    links = link_use(before.get("links", {}), after.get("links", {}), wall, plan.link.rate_bits)
    for name in SERVERS:
        for way in ("out", "in"):
            if f"{name} {way}" in links:
                servers[name][f"link_{way}_gbit_per_s"] = links[f"{name} {way}"]["gbit_per_s"]
    busiest = max(links, key=lambda k: links[k]["use"], default=None)
    per_trainer = mean("batches_per_s")
    link_figures: dict[str, Any] = {}
    if busiest is not None:
        use = links[busiest]["use"]
        link_figures = {"links": links, "busiest_link": busiest, "busiest_link_use": use,
                        "busiest_link_bound_batches_per_s": round(per_trainer / use, 2) if use else None}
    return {"link": plan.link.label, "rate_gbit": plan.link.rate_bits / 1e9, "dtype": plan.dtype,
            "cache": plan.cache, "trainers": trainers, "seconds": round(wall, 2),
            "batches_per_s_per_trainer": round(mean("batches_per_s"), 3),
            "bytes_per_batch": round(bytes_per_batch),
            "wait_fraction": round(mean("wait_fraction"), 3),
            "hit_rate": round(mean("hit_rate"), 4),
            "received_gbit_per_s_per_trainer": round(mean("received_gbit_per_s"), 3),
            "link_utilization": round(mean("received_gbit_per_s") * 1e9 / plan.link.rate_bits, 3),
            "link_bound_batches_per_s": round(plan.link.rate_bytes / bytes_per_batch, 2),
            "cpu_seconds_per_batch": round(cpu_per_batch, 3),
            "cpu_bound_batches_per_s_per_trainer": round(cores / cpu_per_batch / n, 2),
            "machine_busy_fraction": round(busy, 3), "servers": servers, **link_figures}


def link_use(before: dict[str, float], after: dict[str, float], wall: float,
             rate_bits: float) -> dict[str, dict[str, float]]:
    """Per host link and direction ("server0 out"): the Gbit/s its interface carried over
    the window and that against the link's rate. A server's link carries more than its
    batches: its answers to the other server's peer calls go out on it, the other's
    answers come in."""
    out = {}
    for key, end in after.items():
        if key in before and wall > 0:
            bits = 8 * (end - before[key]) / wall
            out[key] = {"gbit_per_s": round(bits / 1e9, 3), "use": round(bits / rate_bits, 3)}
    return out


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace, part_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
    """Probes, then every row; namespaces and processes are gone when it returns or raises."""
    removed = remove_stale(TAG_PREFIX)
    if removed:
        log.warning("removed namespaces left by a killed run: %s", removed)
    topo = plan_topology([*SERVERS, *TRAINERS], f"{TAG_PREFIX}{os.getpid()}", args.subnet)
    with Network(topo) as net, tempfile.TemporaryDirectory(prefix="netns-link-") as tmp:
        delay = args.delay_us if net.netem else 0.0  # labels say only what is applied
        plans = plan_rows(args.rates, delay, args.rows, args.repeat)
        bench = Bench(net, args, Path(tmp))
        try:
            probes = [bench.probe(None)] + [bench.probe(LinkShape(r, delay))
                                            for r in [args.check_rate, *args.rates]]
            bench.start_servers(part_dir)
            rows, shaped = [], None
            for i, plan in enumerate(plans):
                if plan.link != shaped:
                    net.shape(plan.link)
                    shaped = plan.link
                rows.append(bench.run_row(plan, i))
                log.info("%s %s cache %.0f%%: %.2f batches/s per trainer, %.1f MB/batch, waits %.0f%%",
                         plan.link.label, plan.dtype, 100 * plan.cache, rows[-1]["batches_per_s_per_trainer"],
                         rows[-1]["bytes_per_batch"] / 1e6, 100 * rows[-1]["wait_fraction"])
        finally:
            bench.stop()
        return probes, rows, net.netem


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    reason = why_not_root()
    if reason:
        print(f"netns_link: {reason}", file=sys.stderr)
        return 2
    from partitioner.format import read_manifest

    part_dir = args.partition_dir or ensure_partitions(args.data, args.preset, len(SERVERS))
    manifest = read_manifest(part_dir)
    if manifest.num_partitions != len(SERVERS):
        print(f"netns_link: --partition-dir: expected {len(SERVERS)} partitions, got "
              f"{manifest.num_partitions}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)  # so every finally block runs (namespaces, processes)
    try:
        probes, rows, netem = run(args, part_dir)
    except NetnsError as exc:
        print(f"netns_link: {exc}", file=sys.stderr)
        return 2
    measurements, rows = rows, merge_repeats(rows)
    summary = summarize(rows)
    payload = {"benchmark": "netns_link", "graph": manifest.graph_name, "partitions": manifest.num_partitions,
               "num_nodes": manifest.num_nodes, "fanouts": FANOUTS, "batch_size": args.batch_size,
               "step_ms": args.step_ms, "server_workers": args.server_workers,
               "server_threads": args.server_threads, "server_structure": args.server_structure,
               "server_features": args.server_features,
               "server_switch_interval_ms": args.server_switch_interval_ms, "batches": args.batches,
               "repeat": args.repeat, "netem": netem,
               "delay_us_requested": args.delay_us, "machine": machine(), "probes": probes,
               "rows": rows, **summary, "measurements": measurements if args.repeat > 1 else []}
    path = write_json(args.results_name, payload)
    plot(rows, RESULTS / f"{args.results_name}.png")
    print_table(probes, rows, summary)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
