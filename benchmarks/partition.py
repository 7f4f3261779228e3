"""Partitioning benchmark (not a test): generate ``products-like`` and partition it.

Each step runs as its own process, measured for wall time and peak RSS:

1. ``graphfeed-partition generate --preset products-like`` (target: < 60 s, < 8 GiB);
2. streaming ``range`` and ``hash`` partitioning into 2 and 4 parts from the
   memory-mapped graph directory (target: 4 parts < 180 s, < 8 GiB);
3. METIS into 4 parts, under a memory cap so that it fails cleanly if it does not fit.

Writes ``benchmarks/results/partition.json`` and ``partition.png``. Takes about 4 minutes
on a 2-core machine (generating 33 s, each streaming partition about 20 s, METIS 143 s
and about 15 GiB of memory: ``--skip-metis`` leaves it out) and several GB under ``--data``.

    python benchmarks/partition.py --data data/bench     # or: make bench-partition
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, RunResult, machine, run_measured, write_json

log = logging.getLogger("bench.partition")

TARGETS = {"generate_seconds": 60, "partition4_seconds": 180, "peak_rss_gib": 8}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "partitioner", *args]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--preset", default="products-like")
    parser.add_argument("--skip-metis", action="store_true")
    parser.add_argument("--metis-memory-gib", type=float, default=20.0,
                        help="address-space cap for the METIS run (default 20)")
    parser.add_argument("--metis-timeout", type=float, default=1800.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    graph_dir = args.data / args.preset
    shutil.rmtree(graph_dir, ignore_errors=True)
    runs: list[RunResult] = []

    def step(label: str, command: list[str], timeout: float = 900.0,
             memory_gib: float | None = None) -> RunResult:
        log.info("running %s: %s", label, " ".join(command))
        result = run_measured(label, command, timeout=timeout, memory_limit_gib=memory_gib)
        log.info("%s: exit %d, %.1f s, peak RSS %.2f GiB", label, result.returncode,
                 result.wall_seconds, result.peak_rss_gib)
        runs.append(result)
        return result

    step("generate", cli("generate", "--preset", args.preset, "--out", str(graph_dir)))
    for method, parts in (("range", 2), ("range", 4), ("hash", 4)):
        out = args.data / f"{args.preset}-{method}-{parts}"
        step(f"{method}-{parts}", cli("partition", "--graph-dir", str(graph_dir), "--num-parts",
                                      str(parts), "--method", method, "--out", str(out),
                                      "--overwrite", "--no-progress"))
        shutil.rmtree(out, ignore_errors=True)
    if not args.skip_metis:
        out = args.data / f"{args.preset}-metis-4"
        step("metis-4", cli("partition", "--graph-dir", str(graph_dir), "--num-parts", "4",
                            "--method", "metis", "--out", str(out), "--overwrite", "--no-progress"),
             timeout=args.metis_timeout, memory_gib=args.metis_memory_gib)
        shutil.rmtree(out, ignore_errors=True)
    payload = {"benchmark": "partition", "preset": args.preset, "machine": machine(),
               "targets": TARGETS, "runs": runs}
    path = write_json("partition", payload)
    plot(runs, RESULTS / "partition.png")
    for r in runs:
        print(f"{r.label:>10}: exit {r.returncode}, {r.wall_seconds:7.1f} s, "
              f"peak RSS {r.peak_rss_gib:5.2f} GiB")
    print(f"wrote {path}")
    return 0 if all(r.returncode == 0 for r in runs if r.label != "metis-4") else 1


def plot(runs: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.label for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.bar(labels, [r.wall_seconds for r in runs], color="tab:blue")
    a.set_ylabel("wall time (s)")
    b.bar(labels, [r.peak_rss_gib for r in runs], color="tab:orange")
    b.axhline(TARGETS["peak_rss_gib"], color="red", linestyle="--", label="8 GiB target")
    b.set_ylabel("peak RSS (GiB)")
    b.legend()
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("products-like: generate and partition (2 cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
