"""Faults and limits, measured on real server processes (2 partitions of the ``small``
synthetic graph on 127.0.0.1):

* fuzz: N mutated and random requests to every RPC from T threads: status codes, time,
  each server's RSS before and at its peak (sampled every 50 ms), health afterwards;
* kill -9 + restart of server 1 mid-epoch: seeds lost and doubled, batches identical to
  an unbroken epoch, seconds from the kill to the end of the epoch, longest wait;
* kill -9 of server 1 for good: seconds until the trainer's error, and whether it names it;
* rolling restart with SIGTERM (--grace 30): longest wait between batches over 3 epochs.

Writes ``benchmarks/results/faults.json``. Usage: ``python benchmarks/experiments/faults.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the fault tests' harness
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import machine, write_json
from server_procs import ServerProcs, health_status
from test_limits import fuzz as fuzz_calls

from partitioner import partition_graph
from partitioner.synthetic import generate_plain as generate
from protos.channel import GraphfeedError
from trainer_client.loader import RemoteNeighborLoader


def _start(part_dir: Path, log_dir: Path, *extra: str) -> ServerProcs:
    servers = ServerProcs(part_dir, 2, *extra, log_dir=log_dir)
    servers.start()
    for p in (0, 1):
        servers.wait_status(p, "SERVING", 180)
    return servers


def _loader(servers: ServerProcs, **kw: Any) -> RemoteNeighborLoader:
    settings: dict[str, Any] = {"num_neighbors": [5, 3], "batch_size": 4, "shuffle": True,
                                "seed": 3, "connect_timeout": 60, "stall_timeout": 60, **kw}
    return RemoteNeighborLoader(servers.addresses, "train", **settings)


def _digest(batch: Any) -> str:
    h = hashlib.sha256()
    for name in ("n_id", "edge_index", "x", "y"):
        h.update(getattr(batch, name).numpy().tobytes())
    return h.hexdigest()


def fuzz(servers: ServerProcs, calls: int, threads: int) -> dict[str, Any]:
    procs = [psutil.Process(p.pid) for p in servers.procs if p is not None]
    with _loader(servers) as loader:  # the working set: one normal epoch first
        sum(1 for _ in loader)
    before = [p.memory_info().rss for p in procs]
    peak = list(before)
    done = threading.Event()

    def sample_rss() -> None:
        while not done.wait(0.05):
            for i, p in enumerate(procs):
                peak[i] = max(peak[i], p.memory_info().rss)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    started = time.monotonic()
    channels = [grpc.insecure_channel(address) for address in servers.addresses]
    try:
        codes = fuzz_calls(channels, calls, threads, timeout=900)
    finally:
        for channel in channels:
            channel.close()
    seconds = time.monotonic() - started
    done.set()
    sampler.join(1)
    mib = 1 << 20
    return {"calls": sum(codes.values()), "threads": threads, "seconds": round(seconds, 1),
            "codes": dict(codes),
            "rss_before_mib": [round(b / mib) for b in before],
            "rss_peak_mib": [round(p / mib) for p in peak],
            "rss_growth_mib": [round((p - b) / mib) for p, b in zip(peak, before, strict=True)],
            "health_after": [health_status(a) for a in servers.addresses]}


def kill_and_restart(servers: ServerProcs) -> dict[str, Any]:
    with _loader(servers, reconnect_timeout=120) as loader:
        unbroken = [_digest(b) for b in loader]
        loader.set_epoch(0)
        got, seeds, arrivals = [], [], []
        killed = 0.0
        for i, batch in enumerate(loader):
            arrivals.append(time.monotonic())
            got.append(_digest(batch))
            seeds.append(np.asarray(batch.n_id[: batch.batch_size]))
            if i == 3:
                servers.kill(1)
                killed = time.monotonic()
                servers.start(1)
        end = time.monotonic()
        resumes = loader.last_stats.resumes
    all_seeds = np.concatenate(seeds)
    unique = np.unique(all_seeds).size
    return {"seeds": 1200, "seeds_lost": 1200 - unique, "seeds_doubled": int(all_seeds.size - unique),
            "batches_identical": got == unbroken, "batches": len(got), "streams_resumed": resumes,
            "kill_to_epoch_end_s": round(end - killed, 1),
            "longest_wait_s": round(max(b - a for a, b in itertools.pairwise(arrivals)), 1)}


def kill_for_good(servers: ServerProcs) -> dict[str, Any]:
    dead = servers.addresses[1]
    with _loader(servers) as loader:  # default reconnect_timeout
        killed, message = time.monotonic(), ""
        try:
            for i, _ in enumerate(loader):
                if i == 3:
                    servers.kill(1)
                    killed = time.monotonic()
        except GraphfeedError as exc:
            message = str(exc)
        seconds = time.monotonic() - killed
    return {"seconds_to_error": round(seconds, 1), "names_the_dead_server": dead in message,
            "error": message[:300], "survivor_health": health_status(servers.addresses[0])}


def rolling_restart(servers: ServerProcs) -> dict[str, Any]:
    failures: list[str] = []
    restarted: list[float] = []

    def restart() -> None:
        try:
            for p in (1, 0):
                servers.terminate(p)
                proc = servers.procs[p]
                assert proc is not None
                proc.wait(timeout=120)
                restarted.append(time.monotonic())
                servers.start(p)
                servers.wait_status(p, "SERVING", 180)
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}"[:300])

    thread = threading.Thread(target=restart, daemon=True)
    arrivals: list[float] = []
    lost = doubled = 0
    with _loader(servers, reconnect_timeout=120, batch_size=10) as loader:
        for epoch in range(3):
            loader.set_epoch(epoch)
            seeds = []
            for i, batch in enumerate(loader):
                arrivals.append(time.monotonic())
                seeds.append(np.asarray(batch.n_id[: batch.batch_size]))
                if epoch == 0 and i == 3:
                    thread.start()
                time.sleep(0.05)
            all_seeds = np.concatenate(seeds)
            lost += 1200 - np.unique(all_seeds).size
            doubled += all_seeds.size - np.unique(all_seeds).size
    thread.join(300)
    return {"epochs": 3, "seeds_lost": int(lost), "seeds_doubled": int(doubled),
            "restarts_during_training": sum(t < arrivals[-1] for t in restarted),
            "restart_failures": failures,
            "longest_wait_s": round(max(b - a for a, b in itertools.pairwise(arrivals)), 1)}


SCENARIOS = ("fuzz", "kill_and_restart", "kill_for_good", "rolling_restart")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--only", nargs="*", default=None, choices=SCENARIOS,
                        help="scenarios to run (default: all)")
    parser.add_argument("--logs", type=Path, default=None, help="keep the servers' logs here")
    args = parser.parse_args()
    results: dict[str, Any] = {"machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        part_dir = root / "small-2"
        partition_graph(generate("small", progress=False), 2, part_dir, method="metis",
                        progress=False)
        for name, run, extra in (("fuzz", lambda s: fuzz(s, args.calls, args.threads), ()),
                                 ("kill_and_restart", kill_and_restart, ()),
                                 ("kill_for_good", kill_for_good, ()),
                                 ("rolling_restart", rolling_restart, ("--grace", "30"))):
            if args.only and name not in args.only:
                continue
            log_dir = (args.logs or root) / name
            log_dir.mkdir(parents=True, exist_ok=True)
            servers = _start(part_dir, log_dir, *extra)
            try:
                results[name] = run(servers)
            finally:
                servers.stop()
            print(name, results[name], flush=True)
    if not args.only:
        print("wrote", write_json("faults", results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
