"""Feature cache benchmark (not a test): bytes per batch, delivered batches/s and the
cache hit rate of one trainer, for cache sizes x wire feature dtypes, in one run.

One real ``sampling_server`` process per partition of the preset (default
``products-like`` in one partition, as ``benchmarks/sampler.py`` writes it), read by
``RemoteNeighborLoader`` on the CPU with fanouts [15, 10, 5] and batch 1024. Every row
uses a fresh loader (and cluster), so each cache is filled once before its batches are
timed; the fill time and the cache's memory are reported beside the batches.

Target: bytes per batch / 4 or better at 20 % cache + bfloat16 vs float32 without cache.
Writes ``benchmarks/results/feature_cache.json``.

    python benchmarks/feature_cache.py --data data/bench
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import machine, write_json

log = logging.getLogger("bench.feature_cache")

FANOUTS = [15, 10, 5]
BATCH = 1024
CACHE_SIZES = [0.0, 0.05, 0.1, 0.2]
DTYPES = ["float32", "bfloat16"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_servers(part_dir: Path, num_parts: int, ports: list[int]) -> list[subprocess.Popen[bytes]]:
    addresses = [f"127.0.0.1:{p}" for p in ports]
    procs = []
    for p in range(num_parts):
        cmd = [sys.executable, "-m", "sampling_server", "--partition-dir", str(part_dir),
               "--partition", str(p), "--listen", addresses[p], "--verify", "size", "--no-mmap",
               "--device", "cpu", "--log-level", "WARNING"]
        if num_parts > 1:
            cmd += ["--peers", ",".join(addresses)]
        procs.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    return procs


def measure(addresses: list[str], cache: float, dtype: str, num_batches: int,
            batch_size: int) -> dict[str, Any]:
    """One row: fill the cache, then time ``num_batches`` batches after a first one."""
    from trainer_client.loader import RemoteNeighborLoader

    started = time.perf_counter()
    loader = RemoteNeighborLoader(addresses, "train", num_neighbors=FANOUTS, batch_size=batch_size,
                                  shuffle=True, feature_dtype=dtype, cache_size=cache,
                                  cache_progress=False, connect_timeout=600, stall_timeout=300)
    fill = time.perf_counter() - started
    it = iter(loader)
    next(it)  # the first batch pays the servers' one-time set-up (hot orders, samplers)
    first = loader.last_stats
    b0, r0, c0 = first.bytes, first.rows, first.cached_rows
    started = time.perf_counter()
    for _ in range(num_batches):
        next(it)
    wall = time.perf_counter() - started
    stats = loader.last_stats
    nbytes, rows, hits = stats.bytes - b0, stats.rows - r0, stats.cached_rows - c0
    row = {"cache": cache, "dtype": dtype, "batches": num_batches,
           "bytes_per_batch": round(nbytes / num_batches),
           "batches_per_s": round(num_batches / wall, 3),
           "hit_rate": round(hits / rows, 4) if rows else 0.0,
           "nodes_per_batch": round(rows / num_batches),
           "cache_nodes": loader.cache.num_rows if loader.cache else 0,
           "cache_mib": round(loader.cache.nbytes / 2**20, 1) if loader.cache else 0.0,
           "fill_seconds": round(fill, 2)}
    del it
    loader.close()
    log.info("%s", row)
    return row


def compare_plans(part_dir: Path, warm: int, test: int, fractions: list[float]) -> list[dict[str, Any]]:
    """Hit rates of two hot-node rules at equal size, on one partition with the server's
    own sampler: in-degree (the default) vs node counts of ``warm`` pre-sampled batches;
    both measured on ``test`` other batches."""
    import numpy as np

    from partitioner import load_partition
    from sampling_server.hot import hot_order
    from sampling_server.sampler import batch_key, create_sampler

    part = load_partition(part_dir, 0, verify="size", mmap=True)
    sampler = create_sampler(part, device="cpu")
    train = np.asarray(part.splits["train"])
    rng = np.random.default_rng(1)
    start, n = part.node_range[0], part.num_nodes

    def counts(first: int, num: int) -> tuple[np.ndarray, int]:
        hits = np.zeros(n, dtype=np.int64)
        for i in range(first, first + num):
            seeds = rng.choice(train, size=min(BATCH, train.size), replace=False)
            ids = sampler.sample(seeds, FANOUTS, batch_key(0, 0, 0, i)).n_id.numpy() - start
            hits += np.bincount(ids, minlength=n)
        return hits, int(hits.sum())

    warm_counts, _ = counts(0, warm)
    test_counts, total = counts(warm, test)
    by_degree = hot_order(part.indptr, start) - start
    by_counts = np.lexsort((np.arange(n), -warm_counts))
    rows = []
    for f in fractions:
        k = int(f * n)
        degree_hits, sampled_hits = (float(test_counts[order[:k]].sum()) for order in (by_degree, by_counts))
        rows.append({"cache": f, "in_degree_hit_rate": round(degree_hits / total, 4),
                     "presampled_hit_rate": round(sampled_hits / total, 4),
                     "presample_batches": warm, "test_batches": test})
        log.info("%s", rows[-1])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--preset", default="products-like")
    parser.add_argument("--partition-dir", type=Path, default=None,
                        help="an existing partitioned graph (instead of --data/--preset)")
    parser.add_argument("--batches", type=int, default=8, help="timed batches per row")
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--compare-batches", type=int, nargs=2, default=[16, 8],
                        metavar=("PRESAMPLE", "TEST"),
                        help="batches for the in-degree vs pre-sampled counts comparison (0 0: skip)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from partitioner.format import read_manifest

    if args.partition_dir is None:
        from sampler import ensure_partition
        part_dir = ensure_partition(args.data, args.preset)
    else:
        part_dir = args.partition_dir
    manifest = read_manifest(part_dir)
    ports = [free_port() for _ in range(manifest.num_partitions)]
    procs = start_servers(part_dir, manifest.num_partitions, ports)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    try:
        rows = [measure(addresses, c, d, args.batches, args.batch_size) for d in DTYPES for c in CACHE_SIZES]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(60)
    warm, test = args.compare_batches
    plans = compare_plans(part_dir, warm, test, CACHE_SIZES[1:]) \
        if min(args.compare_batches) > 0 and manifest.num_partitions == 1 else []
    base = next(r for r in rows if r["cache"] == 0 and r["dtype"] == "float32")
    for r in rows:
        r["bytes_vs_float32_no_cache"] = round(r["bytes_per_batch"] / base["bytes_per_batch"], 3)
    payload = {"benchmark": "feature_cache", "graph": manifest.graph_name,
               "partitions": manifest.num_partitions, "num_nodes": manifest.num_nodes,
               "fanouts": FANOUTS, "batch_size": args.batch_size, "machine": machine(), "rows": rows,
               "plans": plans}
    path = write_json("feature_cache", payload)
    print(f"{'dtype':<9} {'cache':>5} {'MB/batch':>9} {'vs f32':>7} {'batch/s':>8} {'hit':>6} "
          f"{'cache MiB':>9} {'fill s':>7}")
    for r in rows:
        print(f"{r['dtype']:<9} {r['cache']:>5.0%} {r['bytes_per_batch'] / 1e6:>9.1f} "
              f"{r['bytes_vs_float32_no_cache']:>7.3f} {r['batches_per_s']:>8.2f} "
              f"{r['hit_rate']:>6.1%} {r['cache_mib']:>9.1f} {r['fill_seconds']:>7.2f}")
    for p in plans:
        print(f"cache {p['cache']:.0%}: hit rate in-degree {p['in_degree_hit_rate']:.1%}, "
              f"pre-sampled counts {p['presampled_hit_rate']:.1%}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
