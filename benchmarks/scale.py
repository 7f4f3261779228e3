"""Scale benchmark (not a test): ``papers-like`` (ogbn-papers100M's shape) at 1/100, 1/40,
1/20 and 1/10 of its size, generated, partitioned, served and read by trainers on this
machine; a cost model of a server's memory and start-up time fitted on what it measured.

Per scale, each step its own process:

1. ``graphfeed-partition generate --preset papers-like --scale S`` (streamed to a graph
   directory) and ``partition --graph-dir ... --num-parts P --method range``: wall time
   and peak RSS (``wait4``);
2. P servers (``--structure partition --features partition``: each holds its partition
   only; ``--device cpu``, memory-mapped, ``--verify size``), started one after the other
   as on machines of their own, the partition's files dropped from the page cache first,
   ``--startup-repeats`` times (3): each one's median time from its start to its
   partition loaded (its ``PeerService`` SERVING), and to ``SERVING`` once its peers are;
   its resident memory (anonymous and file-backed) after start-up and after the
   trainers' runs, and its peak;
3. 1, then 2 trainer processes (``benchmarks/scale_trainer.py``: ``RemoteNeighborLoader``,
   fanouts [15, 10, 5], batch 1024, bfloat16 on the wire, a feature cache of 10 % of the
   nodes) reading ``--batches`` batches each: batches/s, bytes per batch, the servers' CPU
   seconds per batch, each trainer's memory; then one trainer training GraphSAGE on
   ``--train-batches`` batches (its losses);
4. at the first scale, the same with 2 and 8 partitions too (``--extra-parts``), so that
   the model tells a partition's share from the whole graph's.

A scale whose servers and trainers would not fit in the memory available is skipped, saying
so. The cost model (:mod:`scale_model`) is fitted on every server measured and checked
against each; it predicts ogbn-papers100M at 8 and 16 partitions. Writes
``benchmarks/results/scale.json`` and ``scale.png`` (memory and start-up time against the
graph's size); ``--refit JSON`` fits the model again on the rows of results already
written, writes it into them and redraws their plot.

    python benchmarks/scale.py --data /data/scale        # 1/100 .. 1/10: about an hour on 2 cores
    python benchmarks/scale.py --data /data/scale --feature-dtype float16 --prefetch-bytes 134217728

Needs about 25 GB of disk at 1/10 (the graph directory is deleted once partitioned, the
partitions once measured unless ``--keep``) and about 16 GiB of memory at 1/10 (a scale waits
for the memory it needs, ``--wait-memory``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import RESULTS, child_command, load_average, machine, read_results, run_measured, write_json
from scale_model import check, fit, plot, print_table

log = logging.getLogger("bench.scale")
REPO = Path(__file__).resolve().parents[1]
SCALES = (0.01, 0.025, 0.05, 0.1)
#: The servers' --prefetch (their default).
SERVER_PREFETCH = 4
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "partitioner", *args]


def proc_memory(pid: int) -> dict[str, float]:
    """Resident memory of a process in GiB: all, anonymous, file-backed (``/proc``)."""
    out = {}
    keys = {"VmRSS": "rss_gib", "RssAnon": "anon_gib", "RssFile": "file_gib", "VmHWM": "peak_gib"}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in keys:
            out[keys[key]] = round(int(line.split()[1]) / 2**20, 3)
    return out


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def health(address: str, service: str = "") -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=2.0)
        except grpc.RpcError:
            return "DOWN"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


class Servers:
    """One server process per partition on reserved loopback ports, started one after
    the other, each timed to its partition loaded and to SERVING."""

    def __init__(self, part_dir: Path, parts: int, logs: Path, extra: list[str] | None = None) -> None:
        from protos.ports import reserved_ports

        self._held = contextlib.ExitStack()
        self.addresses = [f"127.0.0.1:{p}" for p in self._held.enter_context(reserved_ports(parts))]
        self.part_dir, self.logs, self.extra = part_dir, logs, extra or []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.rows: list[dict[str, Any]] = []
        self.workers: int | None = None

    def start(self, timeout: float = 1800.0) -> None:
        for p, address in enumerate(self.addresses):
            cmd = [sys.executable, "-m", "sampling_server", "--partition-dir", str(self.part_dir),
                   "--partition", str(p), "--listen", address, "--peers", ",".join(self.addresses),
                   "--structure", "partition", "--features", "partition", "--device", "cpu",
                   "--verify", "size", "--log-level", "INFO", *self.extra]
            with (self.logs / f"server{p}.log").open("wb") as out:
                started = time.monotonic()
                self.procs.append(subprocess.Popen(child_command(cmd), cwd=REPO, env=ENV, stdout=out,
                                                   stderr=subprocess.STDOUT))
            self._wait(p, "graphfeed.v1.PeerService", started, timeout)
            self.rows.append({"partition": p, "loaded_seconds": round(time.monotonic() - started, 2),
                              "started": started})
        for p, row in enumerate(self.rows):
            self._wait(p, "", row["started"], timeout)
            row["serving_seconds"] = round(time.monotonic() - row.pop("started"), 2)
        for p, row in enumerate(self.rows):
            row["after_start"] = proc_memory(self.procs[p].pid)
        found = re.search(r"(\d+) sampling workers", (self.logs / "server0.log").read_text())
        self.workers = int(found.group(1)) if found else None

    def _wait(self, p: int, service: str, started: float, timeout: float) -> None:
        while health(self.addresses[p], service) != "SERVING":
            if self.procs[p].poll() is not None:
                raise RuntimeError(f"server {p} exited: {(self.logs / f'server{p}.log').read_text()[-3000:]}")
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"server {p}: {service or 'overall'} not SERVING within {timeout:.0f} s")
            time.sleep(0.05)

    def cpu(self) -> float:
        return sum(cpu_seconds(proc.pid) for proc in self.procs)

    def stop(self) -> list[int | None]:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        codes: list[int | None] = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=120))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(None)
        self._held.close()
        return codes


def run_trainers(servers: Servers, count: int, args: argparse.Namespace, logs: Path, train: bool = False,
                 batches: int | None = None) -> dict[str, Any]:
    """``count`` trainer ranks at once reading ``batches`` batches each (default
    ``--batches``, ``--train-batches`` when they ``train``); what each measured, and the
    servers' CPU per batch."""
    batches = batches or (args.train_batches if train else args.batches)
    outs = [logs / f"trainer{count}-{r}-{batches}{'-train' if train else ''}.json" for r in range(count)]
    cpu0, started = servers.cpu(), time.perf_counter()
    procs = []
    for rank, out in enumerate(outs):
        cmd = [sys.executable, str(REPO / "benchmarks" / "scale_trainer.py"), "--servers",
               ",".join(servers.addresses), "--rank", str(rank), "--world-size", str(count),
               "--batches", str(batches), "--cache-size", str(args.cache_size), "--out", str(out),
               *(["--train"] if train else [])]
        with (logs / f"trainer{count}-{rank}.log").open("wb") as log_file:
            procs.append(subprocess.Popen(child_command(cmd), cwd=REPO, env=ENV, stdout=log_file,
                                          stderr=subprocess.STDOUT))
    codes = [proc.wait(timeout=args.timeout) for proc in procs]
    if any(codes):
        raise RuntimeError(f"trainers exited {codes}: {(logs / f'trainer{count}-0.log').read_text()[-3000:]}")
    ranks = [json.loads(out.read_text()) for out in outs]
    total = count * (batches + 1)  # the first batch of each rank is not timed but costs the servers
    return {"trainers": count, "ranks": ranks,
            "server_memory": [proc_memory(proc.pid) for proc in servers.procs],
            "batches_per_s": round(sum(r["batches_per_s"] for r in ranks), 3),
            "bytes_per_batch": round(sum(r["bytes_per_batch"] for r in ranks) / count),
            "server_cpu_seconds_per_batch": round((servers.cpu() - cpu0) / total, 4),
            "wall_seconds": round(time.perf_counter() - started, 1), "load_average": load_average()}


def partition_facts(part_dir: Path) -> dict[str, Any]:
    """The graph's and each partition's sizes, from the manifest."""
    from partitioner.format import read_manifest

    m = read_manifest(part_dir)
    info = m.node_types[m.target_type]
    row_bytes = info.feature_dim * np.dtype(info.feature_dtype).itemsize  # as stored
    return {"graph": m.graph_name, "nodes": m.num_nodes, "edges": m.num_edges,
            "feature_bytes": m.num_nodes * row_bytes, "partitions": m.num_partitions,
            "part_nodes": [sum(p.num_nodes.values()) for p in m.partitions],
            "part_edges": [sum(p.num_edges.values()) for p in m.partitions],
            "part_file_bytes": [sum(r.size_bytes for r in p.files.values()) for p in m.partitions]}


def warm_kernels() -> None:
    """Compile and cache the Numba kernels first (``python -m sampling_server.warmup``), as
    a deployment's image does: a kernel compiled on first use would stall the first batches."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "sampling_server.warmup"], cwd=REPO, env=ENV, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    log.info("kernels compiled and cached in %.1f s", time.perf_counter() - started)


def evict(part_dir: Path) -> None:
    """Drop the partition's files from the page cache (written back first), so that each
    server starts as on a machine that has not read them yet."""
    for path in part_dir.rglob("*.npy"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def memory_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def wait_for_memory(need_gib: float, seconds: float) -> float:
    """The memory available once it is ``need_gib``, or after ``seconds`` (checked every
    minute: on a shared machine, others' jobs end)."""
    deadline = time.monotonic() + seconds
    while (free := memory_available_gib()) < need_gib and time.monotonic() < deadline:
        log.info("waiting for %.1f GiB of memory (%.1f GiB available)", need_gib, free)
        time.sleep(60)
    return free


def measure(scale: float, parts: int, args: argparse.Namespace, graph_dir: Path, train: bool = True
            ) -> dict[str, Any]:
    """Partition the graph in ``graph_dir`` into ``parts``, serve it and read it (and train
    on it with ``train``)."""
    part_dir = args.data / f"{graph_dir.name}-{parts}"
    stored = ["--feature-dtype", args.feature_dtype] if args.feature_dtype else []
    cmd = cli("partition", "--graph-dir", str(graph_dir), "--num-parts", str(parts), "--method", "range",
              "--out", str(part_dir), "--overwrite", "--no-progress", *stored)
    step = run_measured(f"partition-{parts}", cmd, timeout=args.timeout)
    if step.returncode:
        raise RuntimeError(f"partitioning failed: {step.tail}")
    row: dict[str, Any] = {"scale": scale, "measured": time.strftime("%Y-%m-%d %H:%M"),
                           **partition_facts(part_dir),
                           "partition": {"seconds": step.wall_seconds, "peak_rss_gib": step.peak_rss_gib}}
    logs = Path(tempfile.mkdtemp(prefix=f"scale-{parts}-", dir=args.data))
    row["load_average_before"] = load_average()
    starts, workers = start_repeatedly(part_dir, parts, logs, args.startup_repeats - (not args.startup_only))
    if args.startup_only:
        row["servers"], row["sampling_workers"] = [{"partition": p} for p in range(parts)], workers
    else:
        serve_and_read(row, part_dir, parts, logs, args, train)
    keep_medians(row["servers"], starts)
    log.info("scale %g, %d parts: %s", scale, parts,
             json.dumps({k: v for k, v in row.items() if k not in ("runs", "training")}))
    if not args.keep:
        shutil.rmtree(part_dir, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)
    return row


def serve_and_read(row: dict[str, Any], part_dir: Path, parts: int, logs: Path, args: argparse.Namespace,
                   train: bool) -> None:
    """Start the servers, run the trainers, record what both measured into ``row``."""
    extra = ["--prefetch-bytes", str(args.prefetch_bytes)] if args.prefetch_bytes else []
    row["server_prefetch"], row["server_prefetch_bytes"] = SERVER_PREFETCH, args.prefetch_bytes
    servers = Servers(part_dir, parts, logs, extra)
    try:
        evict(part_dir)
        servers.start()
        run_trainers(servers, 1, args, logs, batches=2)  # the servers' one-time set-up: hot orders, plans
        row["runs"] = [run_trainers(servers, n, args, logs) for n in args.trainers]
        if args.train_batches and train:
            row["training"] = run_trainers(servers, 1, args, logs, train=True)
        for p, server in enumerate(servers.rows):
            server["after_runs"] = proc_memory(servers.procs[p].pid)
        row["servers"], row["sampling_workers"] = servers.rows, servers.workers
    finally:
        row["server_exit_codes"] = servers.stop()


def start_repeatedly(part_dir: Path, parts: int, logs: Path, repeats: int
                     ) -> tuple[list[list[dict[str, Any]]], int | None]:
    """The servers started ``repeats`` times, each time with the page cache emptied of
    their files and stopped once all are serving: each start's rows of :class:`Servers`,
    and the servers' sampling workers."""
    starts: list[list[dict[str, Any]]] = []
    workers = None
    for _ in range(repeats):
        servers = Servers(part_dir, parts, logs)
        try:
            evict(part_dir)
            servers.start()
            starts.append(servers.rows)
            workers = servers.workers
        finally:
            codes = servers.stop()
        if any(code != 0 for code in codes):
            log.warning("a server did not stop cleanly after its start-up was timed: exit codes %s", codes)
    return starts, workers


def keep_medians(rows: list[dict[str, Any]], starts: list[list[dict[str, Any]]]) -> None:
    """Each server's start-up times: the median of ``starts`` and its own in ``rows``
    (where it has one): start-up is what the machine's other work disturbs most."""
    for p, row in enumerate(rows):
        mine = [start[p] for start in starts] + ([dict(row)] if "loaded_seconds" in row else [])
        row["loaded_seconds_each"] = [r["loaded_seconds"] for r in mine]
        for key in ("loaded_seconds", "serving_seconds"):
            row[key] = round(statistics.median(r[key] for r in mine), 2)


def run_scale(scale: float, args: argparse.Namespace, extra_parts: list[int]) -> list[dict[str, Any]]:
    graph_dir = args.data / f"papers-like-{scale:g}"
    step = run_measured("generate", cli("generate", "--preset", "papers-like", "--scale", f"{scale:g}",
                                        "--out", str(graph_dir)), timeout=args.timeout)
    if step.returncode:
        raise RuntimeError(f"generating failed: {step.tail}")
    generated = {"seconds": step.wall_seconds, "peak_rss_gib": step.peak_rss_gib,
                 "bytes": sum(f.stat().st_size for f in graph_dir.glob("*.npy"))}
    try:
        rows = []
        for parts in [args.parts, *extra_parts]:
            rows.append({**measure(scale, parts, args, graph_dir, train=parts == args.parts),
                         "generate": generated})
        return rows
    finally:
        shutil.rmtree(graph_dir, ignore_errors=True)


def startup_only(args: argparse.Namespace) -> int:
    """``--startup-only``: each server's start-up measured again at every scale and
    partition count the results hold, replacing theirs; the model fitted again."""
    path = RESULTS / f"{args.results_name}.json"
    payload = read_results(path)
    measured = sorted({(r["scale"], r["partitions"]) for r in payload["rows"]})
    for scale in sorted({s for s, _ in measured}):
        parts = [p for s, p in measured if s == scale]
        args.parts, extra = parts[0], parts[1:]
        for new in run_scale(scale, args, extra):
            key = (scale, new["partitions"])
            row = next(r for r in payload["rows"] if (r["scale"], r["partitions"]) == key)
            for server, again in zip(row["servers"], new["servers"], strict=True):
                server.update({k: again[k] for k in ("loaded_seconds", "serving_seconds",
                                                     "loaded_seconds_each")})
            row["startup"] = {"measured": new["measured"], "load_average_before": new["load_average_before"]}
    payload["model"] = fit(payload["rows"])
    write_json(args.results_name, payload)
    plot(payload, path.with_suffix(".png"))
    print_table(payload)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/scale"))
    parser.add_argument("--scales", type=float, nargs="+", default=list(SCALES))
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--extra-parts", type=int, nargs="*", default=[2, 8],
                        help="partition counts also measured at the first scale")
    parser.add_argument("--trainers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, default=200, help="timed batches per trainer rank")
    parser.add_argument("--train-batches", type=int, default=40,
                        help="batches of the training run, on --parts partitions (0: none)")
    parser.add_argument("--cache-size", default="0.1")
    parser.add_argument("--prefetch-bytes", type=int, metavar="BYTES", default=None,
                        help="the servers' --prefetch-bytes, in bytes (default: none, --prefetch alone)")
    parser.add_argument("--feature-dtype", choices=["float16", "float32"], default=None,
                        help="the partitions' stored feature dtype (graphfeed-partition partition "
                        "--feature-dtype; default: the generator's float32)")
    parser.add_argument("--memory-gib", type=float, default=16.0,
                        help="servers and trainers must fit in this at 1/10 (scaled linearly)")
    parser.add_argument("--wait-memory", type=float, default=3600.0, metavar="S",
                        help="seconds a scale waits for the memory it needs before it is skipped")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--keep", action="store_true", help="keep the partitions and logs")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows of the other scales in the results already written")
    parser.add_argument("--results-name", default="scale")
    parser.add_argument("--startup-only", action="store_true",
                        help="measure the servers' start-up again (nothing else) and put it into the "
                        "results already written, then fit the model again: start-up is the figure a "
                        "busy machine disturbs most")
    parser.add_argument("--startup-repeats", type=int, default=3, metavar="N",
                        help="each partition count's servers started N times (the page cache "
                        "emptied each time), each server's median start-up kept (3)")
    parser.add_argument("--model-from", type=Path, metavar="JSON",
                        help="check the cost model of results already written against these runs "
                        "(e.g. another feature dtype or --prefetch-bytes) instead of fitting one")
    parser.add_argument("--refit", type=Path, metavar="JSON",
                        help="fit the model on these results' rows again (no measuring), write it "
                        "into them and redraw their plot")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.refit:
        measured = read_results(args.refit)
        measured["model"] = fit(measured["rows"])
        args.refit.write_text(json.dumps(measured, indent=1) + "\n")
        plot(measured, args.refit.with_suffix(".png"))
        print_table(measured)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # servers stop in their finally
    args.data.mkdir(parents=True, exist_ok=True)
    warm_kernels()
    payload: dict[str, Any] = {"benchmark": "scale", "date": time.strftime("%Y-%m-%d"),
                               "machine": machine(), "fanouts": [15, 10, 5], "batch_size": 1024,
                               "feature_dtype": "bfloat16", "cache_size": args.cache_size, "rows": [],
                               "stored_feature_dtype": args.feature_dtype or "float32",
                               "prefetch_bytes": args.prefetch_bytes,
                               "skipped": []}
    if args.append and (RESULTS / f"{args.results_name}.json").is_file():
        kept = read_results(RESULTS / f"{args.results_name}.json")
        payload["rows"] = [r for r in kept["rows"] if r["scale"] not in args.scales]
        payload["skipped"] = [r for r in kept.get("skipped", []) if r["scale"] not in args.scales]
    if args.startup_only:
        return startup_only(args)
    for i, scale in enumerate(sorted(args.scales)):
        need = args.memory_gib * scale / 0.1 + 2.0
        free = wait_for_memory(need, args.wait_memory)
        if need > free:
            reason = f"needs about {need:.1f} GiB of memory, {free:.1f} GiB available"
            payload["skipped"].append({"scale": scale, "reason": reason})
            log.warning("scale %g skipped: %s", scale, reason)
            continue
        payload["rows"].extend(run_scale(scale, args, args.extra_parts if i == 0 else []))
        payload["rows"].sort(key=lambda r: (r["scale"], r["partitions"]))
        write_json(args.results_name, payload)  # each scale kept as it ends
    if args.model_from is not None:  # another run's model, checked against these runs
        payload["check"] = {"model_from": args.model_from.name,
                            **check(read_results(args.model_from)["model"], payload["rows"])}
        log.info("the model of %s against these runs: %s", args.model_from, json.dumps(payload["check"]))
    else:
        payload["model"] = fit(payload["rows"])
    path = write_json(args.results_name, payload)
    plot(payload, RESULTS / f"{args.results_name}.png")
    print_table(payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
