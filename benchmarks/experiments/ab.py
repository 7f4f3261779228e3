"""A/B of two checkouts of graphfeed (not a test): the same benchmarks run on each,
alternating within one run, so that both see the same machine and the same load.

Each round runs every benchmark once on each checkout, A then B on even rounds and B
then A on odd ones; each run is the checkout's own ``benchmarks/<name>.py`` with its own
code (``cwd`` and the import path are the checkout), on one partition directory both
read (``--data``). The figures each run writes (seeds/s and edges/s per row, MiB/s per
stream row, bytes per batch and batches/s per cache row, and the run's own ratios such
as graphfeed against PyG) are collected per round; the report gives each figure's
median per checkout and B's median over A's. Writes
``benchmarks/results/<results-name>.json``.

    git worktree add /tmp/before <commit>
    python benchmarks/experiments/ab.py --a /tmp/before --b . --data data/bench --rounds 3

The default benchmarks take about 6 minutes a round on a 2-core machine once the
graphs are written (``sampler``, ``hetero``, ``stream`` replay rows, ``feature_cache``
bytes per batch, ``link``); ``--benchmarks`` picks some, ``--rounds`` sets the rounds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common

from common import machine, write_json

log = logging.getLogger("bench.ab")

#: Each benchmark's arguments for one A/B run (``{data}``: the shared data directory).
RUNS: dict[str, list[str]] = {
    "sampler": ["--data", "{data}", "--passes", "1", "--batches", "12", "--pyg-batches", "4",
                "--pyg-workers", "0", "2", "--devices", "cpu"],
    "hetero": ["--data", "{data}", "--passes", "1"],
    "stream": ["--data", "{data}", "--passes", "1", "--gib", "1", "--sizes-kib", "4096", "--no-diagnostics",
               "--steps-ms"],
    "feature_cache": ["--data", "{data}", "--batches", "6", "--compare-batches", "0", "0"],
    "link": ["--data", "{data}", "--passes", "1", "--batches", "12", "--pyg-batches", "4",
             "--pyg-workers", "0", "--devices", "cpu"],
}
#: The per-row figures collected, where a row has them.
ROW_FIELDS = ("seeds_per_s", "edges_per_s", "mib_per_s", "bytes_per_batch", "batches_per_s")
#: How each benchmark names its results file.
NAME_FLAG = {"hetero": "--name"}


def row_label(row: dict[str, Any]) -> str:
    if "label" in row:
        return str(row["label"])
    return f"cache {row.get('cache')} {row.get('dtype')} compact={row.get('compact_indices')}"


def figures(result: dict[str, Any]) -> dict[str, float]:
    """The numbers of one benchmark's JSON: per row its figures, and its ratios' medians."""
    out: dict[str, float] = {}
    for row in result.get("rows", []):
        if not isinstance(row, dict) or row.get("skipped"):
            continue
        for field in ROW_FIELDS:
            value = row.get(field)
            if isinstance(value, int | float):
                out[f"{row_label(row)}: {field}"] = float(value)
    for name, ratio in (result.get("ratios") or {}).items():
        value = ratio.get("median") if isinstance(ratio, dict) else ratio
        if isinstance(value, int | float):
            out[f"ratio {name}"] = float(value)
    return out


def run_once(checkout: Path, bench: str, data: Path, name: str, python: str) -> dict[str, float]:
    args = [a.replace("{data}", str(data)) for a in RUNS[bench]]
    cmd = [python, f"benchmarks/{bench}.py", *args, NAME_FLAG.get(bench, "--results-name"), name]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    path = checkout / "benchmarks" / "results" / f"{name}.json"
    result = json.loads(path.read_text())
    for stale in (path, path.with_suffix(".png")):  # the run's own files: not results to keep
        stale.unlink(missing_ok=True)
    log.info("%s %s: %.0f s", checkout, bench, time.perf_counter() - started)
    return figures(result)


def commit_of(checkout: Path) -> str:
    """The checkout's commit (``+`` when its tree has changes), or ``?`` outside git."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True,
                             text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=checkout,
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return rev + ("+" if dirty else "")


def summarize(per_round: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, Any]:
    """Per benchmark and figure: each checkout's values and median, and B over A."""
    out: dict[str, Any] = {}
    for bench, sides in per_round.items():
        names = sorted(set().union(*sides["a"]) & set().union(*sides["b"]))
        table = {}
        for figure in names:
            a = [r[figure] for r in sides["a"] if figure in r]
            b = [r[figure] for r in sides["b"] if figure in r]
            ma, mb = statistics.median(a), statistics.median(b)
            table[figure] = {"a": a, "b": b, "a_median": ma, "b_median": mb,
                             "b_over_a": round(mb / ma, 4) if ma else None}
        out[bench] = table
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, required=True, help="checkout A (e.g. the commit before a change)")
    parser.add_argument("--b", type=Path, default=Path("."), help="checkout B (default: this one)")
    parser.add_argument("--data", type=Path, default=Path("data/bench"),
                        help="the partitions both read (written by the first run that needs them)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--benchmarks", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--results-name", default="ab")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: expected an integer >= 1, got {args.rounds}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    checkouts = {"a": args.a.resolve(), "b": args.b.resolve()}
    data = args.data.resolve()
    per_round: dict[str, dict[str, list[dict[str, float]]]] = {
        bench: {"a": [], "b": []} for bench in args.benchmarks}
    commits = {side: commit_of(path) for side, path in checkouts.items()}
    for r in range(args.rounds):
        order = ["a", "b"] if r % 2 == 0 else ["b", "a"]
        for bench in args.benchmarks:
            for side in order:
                got = run_once(checkouts[side], bench, data, f"ab-{side}-{bench}-{r}", sys.executable)
                per_round[bench][side].append(got)
        # written after every round: a run stopped early keeps the rounds it finished
        summary = summarize(per_round)
        path = write_json(args.results_name, {
            "benchmark": "ab", **commits, "rounds": r + 1, "machine": machine(),
            "runs": {b: RUNS[b] for b in args.benchmarks}, "figures": summary})
    for bench, table in summary.items():
        print(f"== {bench}")
        for figure, row in table.items():
            print(f"{figure:<90} A {row['a_median']:>14.4g}  B {row['b_median']:>14.4g}  "
                  f"B/A {row['b_over_a']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
