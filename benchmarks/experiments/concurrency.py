"""Sampling workers as threads of one process against separate processes (not a test).

A sampling server runs its workers as threads of one process: they share its
interpreter lock, its malloc arena (the server keeps one, :mod:`protos.allocator`) and
its OpenMP pools. This benchmark measures what that sharing costs on the machine at
hand. ``K`` workers each loop over the server's own calls for one batch (sample its
multi-hop neighborhood, gather its feature rows in the wire dtype and its labels, encode
it into 4 MiB stream messages; one partition, no peers) for ``--seconds``, and run

- as ``K`` threads of one process (how ``sampling_server`` runs them), and
- as ``K`` processes of one thread each (the partition's arrays memory-mapped, so the
  processes share their pages; the CPUs split among them for their kernel calls, as a
  server running its workers as processes would have to split them),

for each ``K`` of ``--workers``, each measured in fresh child processes that start
together once all have loaded and warmed up. ``--allocators`` repeats the rows with
glibc's allocator as the server sets it (``keep``: freed blocks kept, one arena), as
glibc leaves it (``default``), or with freed blocks kept and glibc's own number of
arenas (``keep-arenas``). ``--layers`` runs them on named Numba threading layers, and
``--spinners`` with threads running pure Python beside the workers: a batch then waits
up to the interpreter's switch interval (5 ms) to take the lock back after each call
that released it, so its slowdown counts those calls. Reports batches/s, the mean time a batch spent sampling,
gathering and encoding, and the cores used; the processes-over-threads ratio for each
``K`` says what a server would gain from running its workers as processes on this
machine.

    python benchmarks/experiments/concurrency.py --data data/bench --workers 1 2 4 6
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, sampler
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import load_average, machine, seed_batches, wait_for, write_json

log = logging.getLogger("bench.concurrency")

FANOUTS = [15, 10, 5]
BATCH = 1024
MODES = ("threads", "processes")
ALLOCATORS = ("keep", "default", "keep-arenas")
#: Numba threading layers a row may ask for (``NUMBA_THREADING_LAYER``); ``default`` lets
#: Numba pick (TBB, else OpenMP, else its own ``workqueue``).
LAYERS = ("default", "omp", "tbb", "workqueue")
#: Where a batch's features go (``--x-into``).
X_INTO = ("messages", "tensor")
#: Seconds a child may take to load and warm up, and to finish after its run.
START_TIMEOUT_S = 600.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path("data/bench"),
                   help="where the one-partition copy of --preset is written once")
    p.add_argument("--preset", default="products-like", help="synthetic preset")
    p.add_argument("--partition-dir", type=Path, default=None,
                   help="an existing one-partition graph (instead of --data/--preset)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 6],
                   help="numbers of workers K to measure")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--allocators", nargs="+", choices=ALLOCATORS, default=["keep"])
    p.add_argument("--layers", nargs="+", choices=LAYERS, default=["default"],
                   help="Numba threading layers to run each row with (a layer that cannot "
                        "load fails its row)")
    p.add_argument("--spinners", type=int, nargs="+", default=[0],
                   help="threads running pure Python beside the workers in each process (rows "
                        "for each count): how much a batch waits to take the interpreter lock "
                        "back after each call that released it")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per kernel call in every row (the server's --threads; "
                        "default: the CPUs the process may use in the threads rows, as the "
                        "server, and those CPUs split among the K processes in the "
                        "processes rows)")
    p.add_argument("--x-into", nargs="+", choices=X_INTO, default=["messages"],
                   help="where a batch's features are gathered: into the stream messages that "
                        "carry them (the server's way where they span several) or into a tensor, "
                        "then encoded into messages (its way before)")
    p.add_argument("--seconds", type=float, default=10.0, help="timed seconds per row")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                   help="wire dtype of the gathered rows")
    p.add_argument("--fanouts", type=int, nargs="+", default=FANOUTS)
    p.add_argument("--batch-size", type=int, default=BATCH)
    p.add_argument("--results-name", default="concurrency")
    # one child: its workers, after the others are ready
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-workers", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--child-seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child-spinners", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--allocator", choices=ALLOCATORS, default="keep", help=argparse.SUPPRESS)
    p.add_argument("--child-x-into", choices=X_INTO, default="messages", help=argparse.SUPPRESS)
    p.add_argument("--ready", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--go", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("workers", "fanouts"):
        if any(v < 1 for v in getattr(args, name)):
            p.error(f"--{name.replace('_', '-')}: expected integers >= 1, got {getattr(args, name)}")
    if args.seconds <= 0:
        p.error(f"--seconds: expected seconds > 0, got {args.seconds}")
    if any(v < 0 for v in args.spinners):
        p.error(f"--spinners: expected integers >= 0, got {args.spinners}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads: expected an integer >= 1, got {args.threads}")
    return args


def set_allocator(name: str) -> None:
    """glibc's allocator as ``name`` says (before any worker thread starts)."""
    from protos import allocator

    if name == "keep":
        allocator.keep_freed_memory()
    elif name == "keep-arenas":
        allocator.keep_freed_memory(arena_max=8 * (os.cpu_count() or 1))  # glibc's own cap


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Load the partition, warm up, signal ready, wait for go, then run the workers for
    ``--seconds``: their batches, wall and CPU time, mean sample and gather time."""
    set_allocator(args.allocator)
    import torch

    from partitioner.graph import PLAIN_EDGE_TYPE, PLAIN_NODE_TYPE
    from protos import codec, fastwire
    from protos import sampling_pb2 as pb
    from sampling_server.config import ServerConfig
    from sampling_server.messages import Prepared
    from sampling_server.store import PartitionStore
    from sampling_server.threads import kernel_threads, limit_kernel_threads

    threads = kernel_threads(args.threads)
    torch.set_num_threads(threads)
    config = ServerConfig(partition_dir=args.partition_dir, partition=0, listen="127.0.0.1:0",
                          device="cpu")
    store = PartitionStore(config)
    store.load()
    sampler = store.sampler()
    train = store.split_seeds("train")
    wire = getattr(torch, args.dtype)
    timings: list[tuple[float, float, float, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    nt, et = PLAIN_NODE_TYPE, PLAIN_EDGE_TYPE  # a plain graph: one node and one edge type
    row = tuple(np.asarray(store.partition.x[nt]).shape[1:])
    chunk = codec.DEFAULT_CHUNK_BYTES

    def one(seeds: np.ndarray, key: int) -> tuple[float, float, float, int]:
        def head(i: int, n: int) -> pb.MinibatchChunk:
            return pb.MinibatchChunk(batch_index=key, chunk_index=i, num_chunks=n)

        started = time.perf_counter()
        out = sampler.sample(seeds, nt, args.fanouts, key)
        n_id = out.node[nt]
        sampled = time.perf_counter()
        rows: list[fastwire.RowMessages] = []
        if args.child_x_into == "messages" and fastwire.RowMessages.worth_it(wire, row, n_id.numel(),
                                                                             chunk):
            rows.append(fastwire.RowMessages(head, "x", wire, n_id.numel(), row, chunk))
            x, y = None, sampler.gather_to(nt, n_id, rows[0].blocks, labels=True)
        else:
            x, y = sampler.gather(nt, n_id, features=True, labels=True, dtype=wire)
        gathered = time.perf_counter()
        named: dict[str, codec.TensorLike] = {"n_id": n_id, "edge_index": out.edge_index(et)}
        named.update({k: v for k, v in (("x", x), ("y", y)) if v is not None})
        Prepared.of(head, named, chunk, 0, rows).messages()
        return (sampled - started, gathered - sampled, time.perf_counter() - gathered,
                int(out.row[et].numel()))

    def work(index: int, until: float | None, warm: int) -> None:
        try:
            limit_kernel_threads(threads)
            batches = seed_batches(train, 1000 * args.child_seed + index, args.batch_size)
            for i in range(warm):
                one(next(batches), i)
            i = warm
            while until is not None and time.perf_counter() < until:
                t = one(next(batches), 10_000 * index + i)
                i += 1
                with lock:
                    timings.append(t)
        except BaseException as e:  # re-raised by the child's main thread
            errors.append(e)

    def run_all(until: float | None, warm: int) -> None:
        workers = [threading.Thread(target=work, args=(k, until, warm))
                   for k in range(args.child_workers)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        if errors:
            raise errors[0]

    run_all(None, 2)
    import numba

    layer = numba.threading_layer()
    if args.ready is not None:
        args.ready.touch()
    if args.go is not None:
        wait_for(args.go, START_TIMEOUT_S, "the start signal")
    stop = threading.Event()

    def spin() -> None:  # pure Python: holds the interpreter lock but for forced switches
        while not stop.is_set():
            sum(range(2000))

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(args.child_spinners)]
    for t in spinners:
        t.start()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    try:
        run_all(wall0 + args.seconds, 0)
    finally:
        stop.set()
        for t in spinners:
            t.join()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    arr = np.asarray(timings, dtype=np.float64).reshape(-1, 4)
    return {"batches": len(timings), "seconds": wall, "cpu_seconds": cpu,
            "sample_s": float(arr[:, 0].sum()), "gather_s": float(arr[:, 1].sum()),
            "encode_s": float(arr[:, 2].sum()), "edges": int(arr[:, 3].sum()),
            "kernel_threads": threads, "threading_layer": layer}


def run_row(args: argparse.Namespace, part_dir: Path, mode: str, workers: int,
            allocator: str, scratch: Path, layer: str = "default", spinners: int = 0,
            x_into: str = "messages") -> dict[str, Any]:
    """One row: ``workers`` threads in one child, or ``workers`` one-thread children
    (each child with ``spinners`` pure-Python threads beside its workers)."""
    procs, per = (1, workers) if mode == "threads" else (workers, 1)
    name = f"{mode}-{workers}-{allocator}-{layer}-{spinners}-{x_into}"
    go = scratch / f"go-{name}"
    readies = [scratch / f"ready-{name}-{i}" for i in range(procs)]
    base = [sys.executable, str(Path(__file__).resolve()), "--child", "--partition-dir", str(part_dir),
            "--child-workers", str(per), "--child-spinners", str(spinners),
            "--allocator", allocator, "--seconds", str(args.seconds), "--child-x-into", x_into,
            "--dtype", args.dtype, "--batch-size", str(args.batch_size), "--go", str(go),
            "--fanouts", *map(str, args.fanouts)]
    threads = args.threads
    if threads is None and mode == "processes":
        from protos.cpus import usable_cpus

        threads = max(1, usable_cpus() // workers)
    if threads is not None:
        base += ["--threads", str(threads)]
    logs = [scratch / f"child-{name}-{i}.log" for i in range(procs)]
    env = dict(os.environ)
    if layer != "default":
        env["NUMBA_THREADING_LAYER"] = layer
    children = []
    for i in range(procs):  # stderr to a file: a full pipe would stall a child before ready
        with logs[i].open("w") as err:
            children.append(subprocess.Popen([*base, "--child-seed", str(i), "--ready", str(readies[i])],
                                             stdout=subprocess.PIPE, stderr=err, text=True, env=env))

    def tail(i: int) -> str:
        return logs[i].read_text(errors="replace")[-3000:]
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(r.exists() for r in readies):
            failed = [i for i, c in enumerate(children) if c.poll() is not None]
            if failed:
                raise RuntimeError(f"{mode} x{workers}: a child exited before it was ready "
                                   f"({children[failed[0]].returncode}):\n{tail(failed[0])}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode} x{workers}: children not ready within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        go.touch()
        results = []
        for i, c in enumerate(children):
            out, _ = c.communicate(timeout=args.seconds + START_TIMEOUT_S)
            if c.returncode != 0:
                raise RuntimeError(f"{mode} x{workers}: a child exited {c.returncode}:\n{tail(i)}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
    batches = sum(r["batches"] for r in results)
    rate = sum(r["batches"] / r["seconds"] for r in results)
    return {"mode": mode, "workers": workers, "allocator": allocator,
            "threading_layer": results[0]["threading_layer"], "spinners": spinners, "x_into": x_into,
            "batches": batches,
            "batches_per_s": round(rate, 3),
            **{f"{step}_ms": round(1e3 * sum(r[f"{step}_s"] for r in results) / max(batches, 1), 2)
               for step in ("sample", "gather", "encode")},
            "cores_used": round(sum(r["cpu_seconds"] / r["seconds"] for r in results), 2),
            "edges_per_s": round(sum(r["edges"] / r["seconds"] for r in results), 1),
            "kernel_threads": results[0]["kernel_threads"]}


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Processes over threads in batches/s, per allocator, threading layer and number of
    workers; features gathered into their messages over into a tensor, likewise."""
    by = {(r["mode"], r["allocator"], r["threading_layer"], r.get("spinners", 0), r["workers"],
           r.get("x_into", "messages")): r["batches_per_s"] for r in rows}
    out = {}
    for (mode, allocator, layer, spinners, workers, x_into), rate in by.items():
        threads = by.get(("threads", allocator, layer, spinners, workers, x_into))
        spun = f", {spinners} spinners" if spinners else ""
        if mode == "processes" and threads:
            into = f", x into {x_into}" if x_into != "messages" else ""
            out[f"processes_vs_threads({allocator}, {layer}{spun}{into}, {workers})"] = \
                round(rate / threads, 3)
        tensor = by.get((mode, allocator, layer, spinners, workers, "tensor"))
        if x_into == "messages" and tensor:
            out[f"messages_vs_tensor({mode}, {allocator}, {layer}{spun}, {workers})"] = \
                round(rate / tensor, 3)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'mode':<10} {'x into':<9} {'alloc':<12} {'layer':<10} {'spin':>4} {'K':>3} {'batches/s':>10} "
            f"{'sample ms':>10} {'gather ms':>10} {'encode ms':>10} {'cores':>6}")
    lines = [head] + [f"{r['mode']:<10} {r['x_into']:<9} {r['allocator']:<12} {r['threading_layer']:<10} "
                      f"{r['spinners']:>4} {r['workers']:>3} {r['batches_per_s']:>10.2f} "
                      f"{r['sample_ms']:>10.1f} {r['gather_ms']:>10.1f} {r['encode_ms']:>10.1f} "
                      f"{r['cores_used']:>6.2f}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.partition_dir is None:
        from sampler import ensure_partition

        args.partition_dir = ensure_partition(args.data, args.preset)
    part_dir = args.partition_dir.resolve()
    rows = []
    with tempfile.TemporaryDirectory(prefix="graphfeed-concurrency-") as scratch:
        for layer, allocator, spinners, workers, mode, x_into in itertools.product(
                args.layers, args.allocators, args.spinners, args.workers, args.modes, args.x_into):
            row = run_row(args, part_dir, mode, workers, allocator, Path(scratch), layer, spinners,
                          x_into)
            log.info("%s x%d (%s, %s, %d spinners, x into %s): %.2f batches/s, sample %.1f ms, "
                     "gather %.1f ms, encode %.1f ms, %.2f cores", mode, workers, allocator,
                     row["threading_layer"], spinners, x_into, row["batches_per_s"], row["sample_ms"],
                     row["gather_ms"],
                     row["encode_ms"], row["cores_used"])
            rows.append(row)
    result = {"benchmark": "concurrency", "partition_dir": str(part_dir), "fanouts": args.fanouts,
              "batch_size": args.batch_size, "dtype": args.dtype, "seconds": args.seconds,
              "threads": args.threads, "machine": machine(), "load_average": load_average(),
              "rows": rows, "ratios": ratios(rows)}
    print(table(rows))
    for name, value in result["ratios"].items():
        print(f"{name}: {value}")
    path = write_json(args.results_name, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
