"""Typed-graph partitioning benchmark (not a test): full-size ``mag-like`` into 2 and 4
parts with METIS on the homogeneous view, written as partition format v2.

Each run is one ``graphfeed-partition partition --synthetic mag-like`` process (generate,
optionally add reverse relations, assign, write), measured for wall time and peak RSS;
the manifest adds the assignment and write times. Writes
``benchmarks/results/hetero_partition.json``.

    python benchmarks/experiments/hetero_partition.py --data data/bench
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import RunResult, machine, run_measured, write_json

log = logging.getLogger("bench.hetero_partition")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--preset", default="mag-like")
    parser.add_argument("--parts", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--method", default="metis")
    parser.add_argument("--no-reverse", action="store_true",
                        help="partition the relations as generated (default: --add-reverse)")
    parser.add_argument("--memory-gib", type=float, default=20.0,
                        help="address-space cap per run (default 20)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    runs: list[RunResult] = []
    details: list[dict[str, Any]] = []
    for parts in args.parts:
        out = args.data / f"{args.preset}-{args.method}-{parts}"
        command = [sys.executable, "-m", "partitioner", "partition", "--synthetic", args.preset,
                   "--num-parts", str(parts), "--method", args.method, "--out", str(out),
                   "--overwrite", "--no-progress"]
        if not args.no_reverse:
            command.append("--add-reverse")
        log.info("running %s", " ".join(command))
        result = run_measured(f"{args.method}-{parts}", command, timeout=args.timeout,
                              memory_limit_gib=args.memory_gib)
        runs.append(result)
        details.append(_manifest_facts(out) if result.returncode == 0 else {})
        log.info("%s: exit %d, %.1f s, peak RSS %.2f GiB", result.label, result.returncode,
                 result.wall_seconds, result.peak_rss_gib)
        shutil.rmtree(out, ignore_errors=True)
    payload = {"benchmark": "hetero_partition", "preset": args.preset,
               "add_reverse": not args.no_reverse, "machine": machine(), "runs": runs,
               "manifests": details}
    path = write_json("hetero_partition", payload)
    for r, d in zip(runs, details, strict=True):
        print(f"{r.label:>8}: exit {r.returncode}, {r.wall_seconds:7.1f} s total, "
              f"assign {d.get('assign_seconds', float('nan')):6.1f} s, "
              f"assign+write {d.get('seconds', float('nan')):6.1f} s, "
              f"peak RSS {r.peak_rss_gib:5.2f} GiB, edge cut {d.get('edge_cut_fraction', 0):.1%}")
    print(f"wrote {path}")
    return 0 if all(r.returncode == 0 for r in runs) else 1


def _manifest_facts(out: Path) -> dict[str, Any]:
    """Timings, edge cut and balance from the written manifest."""
    m = json.loads((out / "manifest.json").read_text())
    parts = m["partitions"]
    cut = sum(sum(p["num_remote_edges"].values()) for p in parts)
    edges = sum(sum(p["num_edges"].values()) for p in parts)
    train = [p["split_sizes"].get("train", 0) for p in parts]
    size = sum(f["size_bytes"] for p in parts for f in p["files"].values())
    return {"assign_seconds": m["algorithm"].get("assign_seconds"),
            "seconds": m["algorithm"].get("seconds"), "num_edges": edges,
            "edge_cut_fraction": round(cut / max(edges, 1), 4),
            "train_balance": round(max(train) / (sum(train) / len(train)), 4),
            "bytes_on_disk": size}


if __name__ == "__main__":
    raise SystemExit(main())
