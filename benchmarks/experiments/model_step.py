"""How long one training step of the default model takes on a real sampled batch (not a
test): the figure that the fixed sleep of ``netns_link.py --step-ms`` and ``stream.py
--steps-ms`` stands for.

Batches of ``--preset`` (default ``products-like``, one partition), fanouts [15, 10, 5],
1024 seeds, are sampled by graphfeed's sampler and put on ``--device`` with their
features and labels before the clock starts, so only the step is timed: forward,
cross-entropy on the seeds, backward and an Adam update of the trainer's default model
(GraphSAGE, 256 hidden channels, one layer per hop, ``trim_to_layer``), synchronised per
step on a GPU. Rows: float32, and (on a GPU) bfloat16 autocast. Writes
``benchmarks/results/model_step.json``.

    .venv/bin/python benchmarks/experiments/model_step.py --data data/bench --device cuda
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, sampler
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import machine, seed_batches, write_json
from sampler import BATCH, FANOUTS, ensure_partition

from partitioner import load_partition
from partitioner.graph import PLAIN_EDGE_TYPE, PLAIN_NODE_TYPE
from partitioner.partition import Partition
from sampling_server.sampler import create_sampler
from sampling_server.sampler.rng import batch_key
from trainer_client.models import build_model

log = logging.getLogger("bench.model_step")


def sampled_batches(part: Partition, device: torch.device, count: int) -> list[dict[str, Any]]:
    """``count`` sampled batches of ``part`` with ``x`` and ``y``, already on ``device``."""
    sampler = create_sampler(part, device="cuda" if device.type == "cuda" else "cpu")
    seeds = seed_batches(np.asarray(part.splits["train"]), 0, BATCH)
    t, et = PLAIN_NODE_TYPE, PLAIN_EDGE_TYPE  # a plain graph: one node and one edge type
    start = part.node_range(t)[0]
    labels = torch.from_numpy(np.clip(np.asarray(part.y), 0, None))
    batches = []
    for i in range(count):
        out = sampler.sample(next(seeds), t, FANOUTS, batch_key(0, 0, 0, i))
        local = (out.node[t].cpu() - start).numpy()
        batches.append({
            "x": torch.from_numpy(np.asarray(part.x[t])[local]).to(device),
            "y": labels[torch.from_numpy(local[:BATCH])].to(device),
            "edge_index": out.edge_index(et).to(device),
            "num_sampled_nodes": list(out.num_sampled_nodes[t]),
            "num_sampled_edges": list(out.num_sampled_edges[et]),
        })
    return batches


def time_steps(batches: list[dict[str, Any]], device: torch.device, num_classes: int, *,
               autocast: torch.dtype | None, warmup: int) -> dict[str, Any]:
    """Milliseconds per step over ``batches`` (after ``warmup`` untimed steps)."""
    torch.manual_seed(0)
    model = build_model("sage", int(batches[0]["x"].shape[1]), num_classes, num_layers=len(FANOUTS))
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    cast = torch.autocast(device.type, dtype=autocast) if autocast is not None else nullcontext()
    times = []
    for i in range(warmup + len(batches)):
        b = batches[i % len(batches)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with cast:
            out = model(b["x"], b["edge_index"], BATCH, b["num_sampled_nodes"], b["num_sampled_edges"])
            loss = torch.nn.functional.cross_entropy(out.float(), b["y"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return {"ms_median": round(statistics.median(times), 2), "ms_min": round(min(times), 2),
            "ms_max": round(max(times), 2), "steps": len(times)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path("data/bench"))
    p.add_argument("--preset", default="products-like")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=int, default=20, help="distinct sampled batches, each timed once")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--results-name", default="model_step")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.batches < 1 or args.warmup < 0:
        p.error(f"--batches >= 1 and --warmup >= 0 expected, got {args.batches} and {args.warmup}")
    device = torch.device(args.device)
    part = load_partition(ensure_partition(args.data, args.preset), 0, verify="size")
    batches = sampled_batches(part, device, args.batches)
    num_classes = int(part.manifest.num_classes)
    nodes = [int(b["x"].shape[0]) for b in batches]
    edges = [int(b["edge_index"].shape[1]) for b in batches]
    rows = []
    casts: list[tuple[str, torch.dtype | None]] = [("float32", None)]
    if device.type == "cuda":
        casts.append(("bfloat16 autocast", torch.bfloat16))
    for label, cast in casts:
        row = {"label": label, **time_steps(batches, device, num_classes, autocast=cast, warmup=args.warmup)}
        log.info("%-18s %7.2f ms per step (%.2f-%.2f)", label, row["ms_median"], row["ms_min"], row["ms_max"])
        rows.append(row)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    payload = {"benchmark": "model_step", "preset": args.preset, "fanouts": FANOUTS, "batch_size": BATCH,
               "device": name, "model": "sage, hidden 256, 3 layers, trim_to_layer, Adam",
               "nodes_per_batch_median": int(statistics.median(nodes)),
               "edges_per_batch_median": int(statistics.median(edges)),
               "machine": machine(), "torch": torch.__version__, "rows": rows}
    path = write_json(args.results_name, payload)
    sizes = f"{payload['nodes_per_batch_median']} nodes, {payload['edges_per_batch_median']} edges"
    print(f"{name}: " + ", ".join(f"{r['label']} {r['ms_median']} ms" for r in rows) + f" per step ({sizes})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
