"""Typed sampler benchmark (not a test): graphfeed's CPU hetero sampler beside PyG's
hetero ``NeighborLoader`` on the same graph in the same run.

Graph: a ``mag-like`` preset with reverse relations (``mag-like`` by default), written once
as one v2 partition under ``--data``; seeds: shuffled training papers, batch 1024,
fanouts [25, 20] for every edge type. Reports seeds/s and sampled edges/s for the
structure alone and with paper features and labels gathered; PyG's loader always gathers
``x``, so its rows compare with the latter. Every row runs once per pass (``--passes``);
the report gives each row's median, min and max, and the ratio of graphfeed's best row to
PyG's best row of each pass. graphfeed runs with 1 and 2 threads, and with 2 batches in
flight on 2 threads (as ``sampling_server``'s two sampling workers do; PyG's
``num_workers=2`` is the counterpart). Writes ``benchmarks/results/hetero.json``.

    make bench-peers            # PyG's torch-sparse (else the PyG rows are skipped)
    python benchmarks/hetero.py --data data/bench
    OMP_WAIT_POLICY=PASSIVE python benchmarks/hetero.py --data data/bench --name hetero-passive

OpenMP's wait policy (read once, when the OpenMP runtime loads) matters on a shared,
oversubscribed machine: with the default spinning wait, every parallel kernel's barrier
can cost a scheduler time slice; the JSON records the policy in force.

Takes about a minute a pass on a 2-core machine, plus 1-2 minutes the first time to
generate ``mag-like`` and write it under ``--data``.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import load_average, machine, spread, summarize_passes, time_batches, write_json

from partitioner.format import load_node_map, load_partition
from partitioner.graph import TypedGraphData
from partitioner.synthetic import generate_typed
from partitioner.writer import partition_graph
from sampling_server.sampler import create_sampler

log = logging.getLogger("bench.hetero")

BATCH = 1024


def measure(label: str, step: Callable[[np.ndarray, int], int], train: np.ndarray,
            num_batches: int, in_flight: int = 1) -> dict[str, Any]:
    """Time ``step(seeds, batch_index) -> sampled edges`` over batches of ``train``
    (``in_flight`` batches at once, each on its own thread)."""
    row = time_batches(label, step, train, BATCH, num_batches, in_flight=in_flight)
    log.info("%s: %.0f seeds/s, %.2f M edges/s, %.1f ms/batch", label, row["seeds_per_s"],
             row["edges_per_s"] / 1e6, row["ms_per_batch"])
    return row


def graphfeed_rows(root: Path, graph: TypedGraphData, fanouts: list[int],
                   num_batches: int, threads: int) -> list[dict[str, Any]]:
    """The CPU sampler with ``threads`` Numba (and torch) threads; with more than one, also
    ``threads`` batches at once (as ``sampling_server``'s sampling workers run them)."""
    import numba

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    torch.set_num_threads(threads)
    sampler = create_sampler(load_partition(root, 0, verify="size"), device="cpu")
    to_global = np.asarray(load_node_map(root, graph.target_type, verify="size"))
    train = np.asarray(graph.splits["train"])
    t = graph.target_type

    def structure(seeds: np.ndarray, i: int) -> int:
        out = sampler.sample(to_global[seeds], t, fanouts, key=i)
        return sum(int(r.numel()) for r in out.row.values())

    def with_data(seeds: np.ndarray, i: int) -> int:
        out = sampler.minibatch(to_global[seeds], t, fanouts, key=i)
        return sum(int(r.numel()) for r in out.structure.row.values())

    name = f"graphfeed CPU hetero sampler ({threads} thread{'s' if threads > 1 else ''})"
    rows = [measure(f"{name}: structure", structure, train, num_batches),
            measure(f"{name}: + features, labels, orig IDs", with_data, train, num_batches)]
    if threads > 1:
        rows += [measure(f"{name}, {threads} batches in flight: {kind}", step, train, num_batches,
                         threads)
                 for kind, step in (("structure", structure),
                                    ("+ features, labels, orig IDs", with_data))]
    return rows


def pyg_rows(graph: TypedGraphData, fanouts: list[int], num_batches: int,
             workers: list[int]) -> list[dict[str, Any]]:
    """PyG's hetero NeighborLoader (needs pyg-lib or torch-sparse); skipped without them."""
    if not any(importlib.util.find_spec(m) for m in ("pyg_lib", "torch_sparse")):
        log.warning("PyG hetero NeighborLoader skipped: neither pyg-lib nor torch-sparse "
                    "is installed (make bench-peers)")
        return [{"label": "pyg hetero NeighborLoader", "skipped": "no pyg-lib or torch-sparse"}]
    from torch_geometric.data import HeteroData
    from torch_geometric.loader import NeighborLoader

    data = HeteroData()
    for nt, n in graph.num_nodes.items():
        data[nt].num_nodes = n
        if nt in graph.x:
            data[nt].x = torch.from_numpy(np.asarray(graph.x[nt]))
    data[graph.target_type].y = torch.from_numpy(np.asarray(graph.y))
    for et, ei in graph.edge_index.items():
        data[et].edge_index = torch.from_numpy(np.asarray(ei))
    train = np.asarray(graph.splits["train"])
    rows = []
    for nw in workers:
        loader = NeighborLoader(data, num_neighbors={et: fanouts for et in graph.edge_types},
                                input_nodes=(graph.target_type, torch.from_numpy(train)),
                                batch_size=BATCH, shuffle=True, num_workers=nw,
                                persistent_workers=nw > 0)
        it = _epochs(loader)

        def step(_seeds: np.ndarray, _i: int, it: Iterator[Any] = it) -> int:
            b = next(it)
            return sum(int(b[et].edge_index.shape[1]) for et in b.edge_types)

        rows.append(measure(f"pyg hetero NeighborLoader (num_workers={nw})", step, train,
                            num_batches))
    return rows


def _epochs(loader: Any) -> Iterator[Any]:
    """The loader's batches, epoch after epoch (a small graph has few batches)."""
    while True:
        yield from loader


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--preset", default="mag-like")
    parser.add_argument("--fanouts", type=int, nargs="+", default=[25, 20])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--passes", type=int, default=3,
                        help="times every row runs (the report gives median, min and max)")
    parser.add_argument("--pyg-batches", type=int, default=5)
    parser.add_argument("--pyg-workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--name", default="hetero", help="results file name (without .json)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="Numba/torch thread counts to run graphfeed's sampler with")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from protos.allocator import keep_freed_memory

    keep_freed_memory()  # as the server does at start-up; applies to every row alike
    started = time.perf_counter()
    graph = generate_typed(args.preset, seed=0, progress=False).add_reverse()
    root = args.data / f"{args.preset}-hetero-1"
    if not (root / "manifest.json").is_file():
        partition_graph(graph, 1, root, method="range", overwrite=True, progress=False)
    log.info("graph ready in %.1f s", time.perf_counter() - started)
    passes: list[list[dict[str, Any]]] = []
    load: list[list[float]] = []
    for i in range(args.passes):
        log.info("pass %d of %d (load average %s)", i + 1, args.passes, load_average())
        rows = [r for n in args.threads for r in graphfeed_rows(root, graph, args.fanouts,
                                                                args.batches, n)]
        torch.set_num_threads(max(args.threads))
        rows += pyg_rows(graph, args.fanouts, args.pyg_batches, args.pyg_workers)
        passes.append(rows)
        load.append(load_average())
    rows = summarize_passes(passes)
    ratios: dict[str, list[float]] = {}
    for p in passes:
        theirs = [r["seeds_per_s"] for r in p if r["label"].startswith("pyg") and "seeds_per_s" in r]
        for kind, suffix in (("with_data", "orig IDs"), ("structure", "structure")):
            ours = [r["seeds_per_s"] for r in p if r["label"].endswith(suffix)]
            if theirs and ours:
                ratios.setdefault(f"{kind}_vs_best_pyg", []).append(max(ours) / max(theirs))
    payload = {"benchmark": "hetero_sampler", "preset": args.preset, "add_reverse": True,
               "fanouts": args.fanouts, "batch_size": BATCH, "machine": machine(),
               "date": time.strftime("%Y-%m-%d", time.gmtime()), "rows": rows,
               "load_average_after_each_pass": load,
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
               "ratios": {k: spread(v) for k, v in ratios.items()}, "passes": passes}
    path = write_json(args.name, payload)
    for r in rows:
        if "seeds_per_s" in r:
            print(f"{r['label']:<68} {r['seeds_per_s']:>10.0f} seeds/s (min {r['seeds_per_s_min']:.0f}, "
                  f"max {r['seeds_per_s_max']:.0f}) {r['edges_per_s'] / 1e6:>7.2f} M edges/s "
                  f"{r['ms_per_batch']:>9.1f} ms/batch")
        else:
            print(f"{r['label']:<68} skipped: {r['skipped']}")
    for k, v in payload["ratios"].items():
        print(f"{k}: median {v['median']} (min {v['min']}, max {v['max']}; per pass {v['per_pass']})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
