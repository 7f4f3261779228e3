"""Helpers shared by the benchmarks: child processes measured for wall time and peak
RSS, machine description, JSON output."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
log = logging.getLogger("bench")


@dataclass
class RunResult:
    """One measured child process."""

    label: str
    command: list[str]
    returncode: int
    wall_seconds: float
    peak_rss_gib: float
    tail: str


#: Run as ``python -c _LAUNCH LIMIT PARENT COMMAND...``: the address-space limit (0: none),
#: then the kernel asked to SIGKILL the process when its parent dies (PR_SET_PDEATHSIG,
#: which ``exec`` keeps), then ``COMMAND`` in its place (same process).
_LAUNCH = ("import ctypes, os, resource, signal, sys\n"
           "limit = int(sys.argv[1])\n"
           "if limit:\n    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
           "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
           "if os.getppid() != int(sys.argv[2]):\n    sys.exit(1)\n"
           "os.execvp(sys.argv[3], sys.argv[3:])\n")


def child_command(command: list[str], memory_limit_bytes: int | None = None) -> list[str]:
    """``command`` run so that it dies with this process (and within ``memory_limit_bytes``
    of address space): set up by a launcher that then execs it, not by ``preexec_fn``,
    which makes the forked child run the at-fork hooks of this process's libraries
    before exec (gRPC's abort such a child while this process has gRPC threads)."""
    return [sys.executable, "-c", _LAUNCH, str(memory_limit_bytes or 0), str(os.getpid()), *command]


def run_measured(
    label: str, command: list[str], *, timeout: float, memory_limit_gib: float | None = None
) -> RunResult:
    """Run ``command``; return its wall time and its own peak RSS (``wait4``)."""
    limit = None if memory_limit_gib is None else int(memory_limit_gib * (1 << 30))
    started = time.perf_counter()
    proc = subprocess.Popen(child_command(command, limit), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = started + timeout
    output: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        output.append(line)
        if time.perf_counter() > deadline:
            proc.kill()
            break
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    return RunResult(label, command, code, round(wall, 2), round(usage.ru_maxrss / (1 << 20), 3),
                     "".join(output[-15:]))


_HELD_PORTS = contextlib.ExitStack()


def held_port(host: str = "127.0.0.1") -> int:
    """A port of ``host`` held bound by this process until it exits
    (:func:`protos.ports.reserved_ports`): a server it starts binds it, no other process
    can take it first."""
    from protos.ports import reserved_ports

    return int(_HELD_PORTS.enter_context(reserved_ports(1, host))[0])


def wait_for(path: Path, timeout: float, what: str) -> None:
    """Wait until ``path`` exists (a file another process creates as a signal); after
    ``timeout`` seconds, TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: no {path} within {timeout:.0f} s")
        time.sleep(0.01)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1),
            "python": sys.version.split()[0], "platform": platform.platform(),
            "numba_threading_layer": threading_layer()}


def threading_layer() -> str:
    """The Numba threading layer graphfeed's parallel CPU kernels get on this machine
    (``workqueue``: one parallel kernel at a time per process, see docs/operations.md)."""
    try:
        from sampling_server.sampler.cpu_kernels import threading_layer as layer

        return layer()
    except Exception as e:  # a report still gets written; this says why the layer is missing
        return f"unknown ({type(e).__name__}: {e})"


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1, default=lambda o: asdict(o)) + "\n")
    return path


def seed_batches(train: np.ndarray, seed: int, batch: int) -> Iterator[np.ndarray]:
    """Full batches of shuffled training seeds, epoch after epoch (a small graph repeats)."""
    if train.size < batch:
        raise ValueError(f"the graph has {train.size} training nodes, fewer than one batch ({batch})")
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(train.size)
        for i in range(0, train.size - batch + 1, batch):
            yield train[order[i:i + batch]]


def time_batches(label: str, step: Callable[[np.ndarray, int], int], train: np.ndarray, batch: int,
                 num_batches: int, warmup: int = 2, in_flight: int = 1) -> dict[str, Any]:
    """Time ``step(seeds, batch_index) -> sampled edges`` over ``num_batches`` batches of
    ``batch`` shuffled ``train`` seeds, after ``warmup`` untimed ones. ``in_flight > 1``
    runs that many batches at once on as many threads (as a sampling server's workers
    do), the next batch starting as soon as one is done."""
    it = seed_batches(train, 0, batch)
    for i in range(warmup):
        step(next(it), i)
    batches = [next(it) for _ in range(num_batches)]
    seeds = sum(s.size for s in batches)
    started = time.perf_counter()
    if in_flight > 1:
        with ThreadPoolExecutor(in_flight, thread_name_prefix="bench") as pool:
            edges = sum(pool.map(step, batches, range(warmup, warmup + num_batches)))
    else:
        edges = sum(step(s, warmup + i) for i, s in enumerate(batches))
    wall = time.perf_counter() - started
    row = {"label": label, "batches": num_batches, "seconds": round(wall, 3),
           "seeds_per_s": round(seeds / wall, 1), "edges_per_s": round(edges / wall, 1),
           "ms_per_batch": round(1000 * wall / num_batches, 2)}
    if in_flight > 1:
        row["in_flight"] = in_flight
    return row


def spread(values: list[float], digits: int = 2) -> dict[str, Any]:
    """Values measured once per pass: the list, its median, min and max."""
    arr = np.asarray(values, dtype=np.float64)
    return {"per_pass": [round(float(v), digits) for v in arr],
            "median": round(float(np.median(arr)), digits),
            "min": round(float(arr.min()), digits), "max": round(float(arr.max()), digits)}


def summarize_passes(passes: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per label (in first-seen order) over the passes: the median seeds/s,
    edges/s and ms/batch, and the min and max seeds/s. Skipped rows stay as they are."""
    by: dict[str, list[dict[str, Any]]] = {}
    for rows in passes:
        for r in rows:
            by.setdefault(r["label"], []).append(r)
    out = []
    for label, rows in by.items():
        timed = [r for r in rows if "seeds_per_s" in r]
        if not timed:
            out.append(rows[0])
            continue
        row: dict[str, Any] = {"label": label, "passes": len(timed)}
        for key in ("seeds_per_s", "edges_per_s", "ms_per_batch"):
            if all(key in r for r in timed):
                row[key] = round(float(np.median([r[key] for r in timed])), 1)
        row["seeds_per_s_min"] = min(r["seeds_per_s"] for r in timed)
        row["seeds_per_s_max"] = max(r["seeds_per_s"] for r in timed)
        out.append(row)
    return out


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages."""
    return [round(v, 2) for v in os.getloadavg()]


def ensure_partitions(data: Path, preset: str, num_parts: int) -> Path:
    """``num_parts`` range partitions of ``preset`` under ``data`` (generated once; the
    graph directory is the one ``benchmarks/sampler.py`` writes)."""
    from partitioner import partition_graph
    from partitioner.readers.graphdir import read_graph_dir, save_graph_dir
    from partitioner.synthetic import generate_plain as generate

    graph_dir, part_dir = data / preset, data / f"{preset}-{num_parts}"
    if (part_dir / "manifest.json").is_file():
        return part_dir
    if not (graph_dir / "graph.json").is_file():
        log.info("generating %s in %s (minutes for products-like)", preset, graph_dir)
        save_graph_dir(generate(preset), graph_dir)
    log.info("partitioning %s into %d (range) in %s", preset, num_parts, part_dir)
    partition_graph(read_graph_dir(graph_dir), num_parts, part_dir, method="range", overwrite=True)
    return part_dir


# -- plots: each benchmark draws its own from its JSON (also with --plot-only) ----------------
def read_results(path: Path) -> dict[str, Any]:
    """A results JSON (``write_json``'s, or ``make gpu-check``'s report)."""
    payload: dict[str, Any] = json.loads(Path(path).read_text())
    return payload


def report_step(payload: dict[str, Any], name: str) -> dict[str, Any] | None:
    """What the step ``name`` of a ``make gpu-check`` report measured (None when the
    payload is no such report, or the step did not pass)."""
    for step in payload.get("steps", []):
        if step.get("name") == name and step.get("status") == "passed":
            figures: dict[str, Any] = step.get("figures", {})
            return figures
    return None


def describe_machine(payload: dict[str, Any]) -> str:
    """The machine of a results JSON in a few words: ``NVIDIA H200, 16 cores`` or
    ``2 cores, Intel Xeon``."""
    info = payload.get("machine", {})
    cpu = str(info.get("cpu", "")).replace("(R)", "").replace(" Processor", "").strip()
    gpu = payload.get("gpu")
    gpu_name = gpu.get("name") if isinstance(gpu, dict) else gpu
    cores = f"{info.get('cores')} cores" if info.get("cores") else ""
    return ", ".join(p for p in (gpu_name, cores, None if gpu_name else cpu) if p)


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend, or None (with a warning) when
    matplotlib is not installed (it is a development dependency)."""
    try:
        import matplotlib
    except ImportError:
        log.warning("no plot: matplotlib is not installed (make install)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
