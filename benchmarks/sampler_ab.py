"""Time per batch of one sampler, best of several runs, to compare two versions of the code
side by side on a noisy host (not a test).

On a shared machine the same loop's time can vary 2x from one minute to the next, so
medians over long passes hide a change of 20 %. This benchmark runs ``--runs`` short runs
of ``--batches`` batches each (every batch synchronised on a GPU) and keeps the fastest,
once for the structure alone and once with features and labels gathered. Alternate
invocations of the two versions in one session and compare the invocations pairwise:

    git worktree add /tmp/before <commit>
    for v in before after before after; do
      if [ $v = before ]; then P=/tmp/before; else P=.; fi
      PYTHONPATH=$P python benchmarks/sampler_ab.py --label $v --device cuda
    done

Appends one record per invocation to ``benchmarks/results/sampler_ab.json`` (label, the
``sampling_server`` it imported, ms per batch and sampled edges/s of the fastest run, every
run's ms, and the process CPU time of the fastest run).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, machine, write_json
from sampler import BATCH, FANOUTS, ensure_partition

log = logging.getLogger("bench.sampler_ab")


def best_of(step: Any, runs: int, batches: int) -> dict[str, Any]:
    """The fastest of ``runs`` runs of ``batches`` calls of ``step(i) -> sampled edges``."""
    times, cpu, edges = [], [], []
    for _ in range(runs):
        wall, proc, n = time.perf_counter(), time.process_time(), 0
        for i in range(batches):
            n += step(i)
        times.append((time.perf_counter() - wall) / batches)
        cpu.append((time.process_time() - proc) / batches)
        edges.append(n / batches)
    best = int(np.argmin(times))
    return {"ms_per_batch": round(times[best] * 1e3, 3),
            "edges_per_s": round(edges[best] / times[best], 1),
            "cpu_ms_per_batch": round(cpu[best] * 1e3, 3),
            "runs_ms": [round(t * 1e3, 3) for t in times]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", required=True, help="what this invocation measures (e.g. before, after)")
    p.add_argument("--data", type=Path, default=Path("data/bench"))
    p.add_argument("--preset", default="products-like")
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--topology", default="device", choices=["device", "uva"], help="CUDA only")
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--results-name", default="sampler_ab")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    import sampling_server
    from partitioner import load_partition
    from sampling_server.sampler import create_sampler
    from sampling_server.sampler.rng import batch_key

    part = load_partition(ensure_partition(args.data, args.preset), 0)
    options = {"topology": args.topology} if args.device == "cuda" else {}
    sampler = create_sampler(part, device=args.device, **options)
    train = np.array(part.splits["train"])
    np.random.default_rng(0).shuffle(train)
    if train.size < BATCH:
        raise SystemExit(f"{args.preset}: {train.size} training nodes, fewer than one batch ({BATCH})")

    def step(features: bool) -> Any:
        def one(i: int) -> int:
            start = (i * BATCH) % (train.size - BATCH + 1)
            out = sampler.sample(train[start:start + BATCH], FANOUTS, batch_key(0, 0, 0, i))
            if features:
                sampler.gather(out.n_id)
            if args.device == "cuda":
                torch.cuda.synchronize()
            return int(out.row.numel())
        return one

    record: dict[str, Any] = {"label": args.label, "sampling_server": sampling_server.__file__,
                              "device": args.device, "topology": args.topology,
                              "preset": args.preset, "batch_size": BATCH, "fanouts": FANOUTS,
                              "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine()}
    if args.device == "cuda":
        record["gpu"] = torch.cuda.get_device_name()
    for name, features in (("structure", False), ("features", True)):
        for i in range(args.warmup):
            step(features)(i)
        record[name] = best_of(step(features), args.runs, args.batches)
        log.info("%s %s: %.2f ms/batch (%.1f M edges/s), runs %s", args.label, name,
                 record[name]["ms_per_batch"], record[name]["edges_per_s"] / 1e6,
                 record[name]["runs_ms"])
    path = RESULTS / f"{args.results_name}.json"
    records = json.loads(path.read_text())["records"] if path.is_file() else []
    write_json(args.results_name, {"benchmark": "sampler_ab", "records": [*records, record]})
    log.info("appended to %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
