"""Sampler benchmark (not a test): graphfeed's samplers beside PyG's NeighborLoader and a
plain vectorized-PyTorch floor, on the same graph in the same run.

Graph: ``products-like`` (written once as one partition under ``--data``), fanouts
[15, 10, 5], batch 1024, the training seeds shuffled. Reports seeds/s and sampled
edges/s for the structure alone and with features (and labels) gathered. Every row runs
once per pass (``--passes``), the passes one after the other, so each pass compares rows
measured within a few minutes of each other; the report gives each row's median, min and
max over the passes and each ratio per pass. Writes ``benchmarks/results/sampler.json``
and ``sampler.png``.

graphfeed's CPU rows run twice: one batch at a time (every kernel parallel over the
batch), and ``IN_FLIGHT`` batches at once as ``sampling_server``'s sampling workers run
them (the counterpart of PyG's ``num_workers=2``). The ratios are given for each and for
graphfeed's best configuration against PyG's best.

    make bench-peers            # PyG's torch-sparse/torch-scatter (else that row is skipped)
    python benchmarks/sampler.py --data data/bench

Takes about 2 minutes a pass on a 2-core machine with the defaults, plus about a minute
the first time, to generate ``products-like`` and write it as one partition under
``--data`` (3 GB). ``--plot-only JSON...`` redraws the plot from results already written
(a sampler JSON, and ``gpu-check.json`` for the CUDA rows of ``make gpu-check``).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (
    RESULTS,
    describe_machine,
    load_average,
    machine,
    pyplot,
    read_results,
    report_step,
    spread,
    summarize_passes,
    time_batches,
    write_json,
)

from partitioner import PLAIN_EDGE_TYPE, PLAIN_NODE_TYPE, load_partition, partition_graph
from partitioner.partition import Partition

log = logging.getLogger("bench.sampler")

FANOUTS = [15, 10, 5]
BATCH = 1024
#: Batches the server-like CPU rows sample at once: ``sampling_server``'s default number
#: of sampling workers (each batch's kernels are parallel as well).
IN_FLIGHT = 2


def ensure_partition(data: Path, preset: str) -> Path:
    """One-partition copy of ``preset`` under ``data`` (generated once)."""
    from partitioner.readers.graphdir import read_graph_dir, save_graph_dir
    from partitioner.synthetic import generate_plain as generate

    graph_dir, part_dir = data / preset, data / f"{preset}-1"
    if (part_dir / "manifest.json").is_file():
        return part_dir
    if not (graph_dir / "graph.json").is_file():
        save_graph_dir(generate(preset), graph_dir)
    partition_graph(read_graph_dir(graph_dir), 1, part_dir, method="range", overwrite=True)
    return part_dir


def measure(label: str, step: Callable[[np.ndarray, int], int], part: Partition,
            num_batches: int, in_flight: int = 1) -> dict[str, Any]:
    """Time ``step(seeds, batch_index) -> sampled edges`` over batches of the training
    seeds (``in_flight`` batches at once, each on its own thread)."""
    row = time_batches(label, step, np.asarray(part.splits["train"]), BATCH, num_batches,
                       in_flight=in_flight)
    log.info("%-38s %10.0f seeds/s %12.0f edges/s", label, row["seeds_per_s"], row["edges_per_s"])
    return row


def graphfeed_rows(part: Partition, device: str, n: int, topology: str = "device",
                   gpu_cache_size: str | None = None) -> list[dict[str, Any]]:
    """Structure and + features rows; with ``gpu_cache_size`` (CUDA) the + features row
    alone, with that share of the feature rows in GPU memory and the rest host-mapped."""
    from partitioner.graph import PLAIN_EDGE_TYPE, PLAIN_NODE_TYPE
    from sampling_server.sampler import create_sampler
    from sampling_server.sampler.rng import batch_key

    t, et = PLAIN_NODE_TYPE, PLAIN_EDGE_TYPE
    sampler = create_sampler(part, device=device, topology=topology, gpu_cache_size=gpu_cache_size)
    name = device if device != "cuda" else f"cuda/{topology}"
    if gpu_cache_size is not None:
        name += f" gpu-cache {gpu_cache_size}"

    def structure(seeds: np.ndarray, i: int) -> int:
        out = sampler.sample(seeds, t, FANOUTS, batch_key(0, 0, 0, i))
        return int(out.row[et].numel())

    def with_features(seeds: np.ndarray, i: int) -> int:
        out = sampler.sample(seeds, t, FANOUTS, batch_key(0, 0, 0, i))
        x, y = sampler.gather(t, out.node[t])
        assert x is not None and y is not None
        return int(out.row[et].numel())

    def sync(fn: Callable[[np.ndarray, int], int]) -> Callable[[np.ndarray, int], int]:
        if device != "cuda":
            return fn

        def synced(seeds: np.ndarray, i: int) -> int:
            result = fn(seeds, i)
            torch.cuda.synchronize()
            return result

        return synced

    features = measure(f"graphfeed {name}: + features", sync(with_features), part, n)
    if gpu_cache_size is not None:
        return [features]
    rows = [measure(f"graphfeed {name}: structure", sync(structure), part, n), features]
    if device == "cpu":  # as the server samples: its 2 workers each take a batch
        rows += [measure(f"graphfeed {name}, {IN_FLIGHT} in flight: {kind}", step, part, n,
                         IN_FLIGHT) for kind, step in (("structure", structure),
                                                       ("+ features", with_features))]
    return rows


def torch_floor_rows(part: Partition, n: int) -> list[dict[str, Any]]:
    """A plain vectorized-PyTorch sampler (with replacement, unique-based relabel)."""
    t, et = PLAIN_NODE_TYPE, PLAIN_EDGE_TYPE
    indptr, indices, x = (torch.from_numpy(np.asarray(a))
                          for a in (part.indptr[et], part.indices[et], part.x[t]))
    gen = torch.Generator().manual_seed(0)

    def sample(seeds: np.ndarray, features: bool) -> int:
        nodes = torch.from_numpy(seeds)
        frontier, edges = nodes, 0
        for k in FANOUTS:
            start, deg = indptr[frontier], indptr[frontier + 1] - indptr[frontier]
            has = deg > 0
            start, deg = start[has], deg[has]
            pick = (torch.rand((deg.numel(), k), generator=gen) * deg[:, None]).long()
            nbrs = indices[(start[:, None] + pick).flatten()]
            edges += nbrs.numel()
            allnodes, inverse = torch.unique(torch.cat([nodes, nbrs]), return_inverse=True)
            frontier = allnodes[~torch.isin(allnodes, nodes)]
            nodes = torch.cat([nodes, frontier])
            del inverse
        if features:
            x.index_select(0, nodes)
        return edges

    return [measure("pytorch floor: structure", lambda s, i: sample(s, False), part, n),
            measure("pytorch floor: + features", lambda s, i: sample(s, True), part, n)]


def pyg_rows(part: Partition, n: int, workers: list[int]) -> list[dict[str, Any]]:
    """PyG's own NeighborLoader (needs torch-sparse / pyg-lib); skipped without them."""
    try:
        import torch_sparse  # noqa: F401
    except ImportError:
        log.warning("PyG NeighborLoader skipped: torch-sparse is not installed (make bench-peers)")
        return [{"label": "pyg NeighborLoader", "skipped": "torch-sparse not installed"}]
    from torch_geometric.data import Data
    from torch_geometric.loader import NeighborLoader

    # Edges are in CSC order (grouped by target), so PyG is told they are sorted by column
    # (is_sorted): it then skips a sort and a permutation of every edge at start-up, and
    # samples exactly as it otherwise would. The arrays are built once, without copies of
    # the partition's own (read through memory maps), to fit beside a busy machine.
    indptr = np.asarray(part.indptr[PLAIN_EDGE_TYPE])
    edge_index = torch.empty((2, int(indptr[-1])), dtype=torch.int64)
    edge_index[0] = torch.from_numpy(np.asarray(part.indices[PLAIN_EDGE_TYPE]))
    edge_index[1] = torch.repeat_interleave(torch.arange(indptr.size - 1),
                                            torch.from_numpy(np.diff(indptr)))
    data = Data(edge_index=edge_index, x=torch.from_numpy(np.array(part.x[PLAIN_NODE_TYPE])),
                y=torch.from_numpy(np.array(part.y)), num_nodes=indptr.size - 1)
    train = torch.from_numpy(np.asarray(part.splits["train"]))
    structure_only = Data(edge_index=data.edge_index, num_nodes=data.num_nodes)
    rows = []
    for nw in workers:
        for kind, source in (("structure", structure_only), ("+ features", data)):
            loader = NeighborLoader(source, num_neighbors=FANOUTS, batch_size=BATCH,
                                    shuffle=True, input_nodes=train, num_workers=nw,
                                    persistent_workers=nw > 0, is_sorted=True)
            rows.append(_time_loader(f"pyg NeighborLoader (num_workers={nw}): {kind}",
                                     loader, n))
            # stop its workers here, before the next loader forks: an iterator left to a
            # later collection can be inherited by those children and fail in them
            del loader
            gc.collect()
    return rows


def _time_loader(label: str, loader: Any, n: int) -> dict[str, Any]:
    it = iter(loader)
    next(it)
    started, seeds, edges = time.perf_counter(), 0, 0
    for _ in range(n):
        batch = next(it)
        seeds += batch.batch_size
        edges += batch.edge_index.size(1)
    wall = time.perf_counter() - started
    row = {"label": label, "batches": n, "seconds": round(wall, 3),
           "seeds_per_s": round(seeds / wall, 1), "edges_per_s": round(edges / wall, 1)}
    log.info("%-38s %10.0f seeds/s %12.0f edges/s", label, row["seeds_per_s"], row["edges_per_s"])
    return row


def run_pyg_child(args: argparse.Namespace) -> list[dict[str, Any]]:
    """PyG's rows in a child process, so its copies of the graph (CSC conversion, shared
    memory for workers) do not stack on top of this process's."""
    out = RESULTS / "sampler-pyg.tmp"
    cmd = [sys.executable, __file__, "--data", str(args.data), "--preset", args.preset,
           "--pyg-batches", str(args.pyg_batches), "--pyg-only", str(out),
           "--pyg-workers", *map(str, args.pyg_workers)]
    subprocess.run(cmd, check=True, timeout=3600)
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    out.unlink()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--preset", default="products-like")
    parser.add_argument("--batches", type=int, default=40, help="timed batches per row")
    parser.add_argument("--passes", type=int, default=3,
                        help="times every row runs (the report gives median, min and max)")
    parser.add_argument("--pyg-batches", type=int, default=15)
    parser.add_argument("--pyg-workers", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--devices", nargs="*", default=None,
                        help="graphfeed devices (default: cpu, plus cuda when usable)")
    parser.add_argument("--topologies", nargs="*", default=["device"], choices=["device", "uva"],
                        help="CUDA graph placements to measure (default: device)")
    parser.add_argument("--gpu-cache-sizes", nargs="*", default=[], metavar="SIZE",
                        help="CUDA: a + features row per server-side GPU feature cache size "
                        "(e.g. 1 0.2 0: all rows in GPU memory, 20 %%, all host-mapped over UVA)")
    parser.add_argument("--no-baselines", action="store_true",
                        help="graphfeed's rows only (no PyTorch floor, no PyG)")
    parser.add_argument("--results-name", default="sampler",
                        help="benchmarks/results/<name>.json and .png (default: sampler)")
    parser.add_argument("--plot-only", type=Path, nargs="+", metavar="JSON",
                        help="draw <results-name>.png beside the first of these results instead "
                        "of measuring")
    parser.add_argument("--pyg-only", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plot_only:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        return plot_only(args.plot_only, args.results_name)
    if args.pyg_only is not None:  # child process: PyG's rows alone, memory of its own
        part = load_partition(args.data / f"{args.preset}-1", 0, verify="size")
        args.pyg_only.write_text(json.dumps(pyg_rows(part, args.pyg_batches, args.pyg_workers)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from protos.allocator import keep_freed_memory

    keep_freed_memory()  # as the server does at start-up; applies to every row alike
    part_dir = ensure_partition(args.data, args.preset)
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    passes: list[list[dict[str, Any]]] = []
    load: list[list[float]] = []
    for i in range(args.passes):
        log.info("pass %d of %d (load average %s)", i + 1, args.passes, load_average())
        passes.append(one_pass(args, part_dir, devices))
        load.append(load_average())
    rows = summarize_passes(passes)
    payload = {"benchmark": "sampler", "preset": args.preset, "fanouts": FANOUTS,
               "batch_size": BATCH, "machine": machine(), "torch_threads": torch.get_num_threads(),
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
               "date": time.strftime("%Y-%m-%d", time.gmtime()),
               "load_average_after_each_pass": load, "rows": rows,
               "ratios": {k: spread(v) for k, v in ratios(passes).items()}, "passes": passes}
    path = write_json(args.results_name, payload)
    plot([(describe_machine(payload), rows)], RESULTS / f"{args.results_name}.png")
    for r in rows:
        if "seeds_per_s" not in r:
            print(f"{r['label']:<48} skipped: {r.get('skipped')}")
            continue
        print(f"{r['label']:<48} {r['seeds_per_s']:>10,.0f} seeds/s (min {r['seeds_per_s_min']:>8,.0f}, "
              f"max {r['seeds_per_s_max']:>8,.0f}) {r['edges_per_s']:>14,.0f} edges/s")
    for k, v in payload["ratios"].items():
        print(f"{k}: median {v['median']} (min {v['min']}, max {v['max']}; per pass {v['per_pass']})")
    print(f"wrote {path}")
    return 0


def one_pass(args: argparse.Namespace, part_dir: Path, devices: list[str]) -> list[dict[str, Any]]:
    """Every row once. In memory, as a server holds its partition (a cold memory map
    would time page faults); released before PyG's child process loads its own copy."""
    part = load_partition(part_dir, 0, verify="size", mmap=False)
    rows: list[dict[str, Any]] = []
    for device in devices:
        for topology in args.topologies if device == "cuda" else ["device"]:
            rows += graphfeed_rows(part, device, args.batches, topology)
        for size in args.gpu_cache_sizes if device == "cuda" else []:
            rows += graphfeed_rows(part, device, args.batches, "device", size)
    if not args.no_baselines:
        rows += torch_floor_rows(part, max(args.batches // 4, 5))
    del part
    if not args.no_baselines:
        release_freed_memory()
        rows += run_pyg_child(args)
    return rows


def release_freed_memory() -> None:
    """Give the memory this process freed back to the system (``malloc_trim``), which
    :func:`keep_freed_memory` otherwise keeps, before PyG's child loads its own copy."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        log.debug("malloc_trim unavailable")


def ratios(passes: list[list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Per pass: graphfeed CPU over PyG's best configuration of the same pass (structure
    alone and with features), and over the vectorized-PyTorch floor; CUDA with every
    feature row in GPU memory over every row host-mapped."""
    out: dict[str, list[float]] = {}
    for rows in passes:
        by = {r["label"]: r["seeds_per_s"] for r in rows if "seeds_per_s" in r}
        cached, mapped = (by.get(f"graphfeed cuda/device gpu-cache {s}: + features") for s in ("1", "0"))
        if cached and mapped:
            out.setdefault("cuda_features_gpu_cache_1_vs_0", []).append(cached / mapped)
        for kind, key in (("structure", "structure"), ("+ features", "features")):
            pyg = [v for k, v in by.items() if k.startswith("pyg") and k.endswith(kind)]
            floor = by.get(f"pytorch floor: {kind}")
            one = by.get(f"graphfeed cpu: {kind}")
            two = by.get(f"graphfeed cpu, {IN_FLIGHT} in flight: {kind}")
            # one batch at a time; the server's way; graphfeed's best configuration
            for name, ours in (("cpu", one), (f"cpu_{IN_FLIGHT}_in_flight", two),
                               ("cpu_best", max(one or 0, two or 0))):
                if ours and pyg:
                    out.setdefault(f"{name}_{key}_vs_pyg_best", []).append(ours / max(pyg))
                if ours and floor:
                    out.setdefault(f"{name}_{key}_vs_pytorch_floor", []).append(ours / floor)
    return out


#: The plot's rows: (label, how each row of a results file is picked for it).
PLOT_ROWS = (("graphfeed CUDA, graph in GPU memory", "graphfeed cuda/device: "),
             ("graphfeed CPU, best of 1 and 2 batches in flight", "graphfeed cpu"),
             ("vectorized-PyTorch floor, CPU", "pytorch floor: "),
             ("PyG NeighborLoader, CPU, best num_workers", "pyg NeighborLoader"))


def plot_rows(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{plot row: {"structure" | "+ features": seeds/s}}, the best matching row of each."""
    out: dict[str, dict[str, float]] = {}
    for name, prefix in PLOT_ROWS:
        for kind in ("structure", "+ features"):
            rates = [r["seeds_per_s"] for r in rows if "seeds_per_s" in r
                     and r["label"].startswith(prefix) and r["label"].endswith(f": {kind}")
                     and "gpu-cache" not in r["label"]]
            if rates:
                out.setdefault(name, {})[kind] = max(rates)
    return out


def plot(sources: list[tuple[str, list[dict[str, Any]]]], path: Path) -> None:
    """Seeds/s of graphfeed beside PyG and the PyTorch floor, structure alone and with
    features, from one or more results (``sources``: (machine, rows) each)."""
    plt = pyplot()
    if plt is None:
        return
    bars = []  # (label, {kind: seeds/s}, {kind: PyG's seeds/s on the same machine})
    for where, rows in sources:
        picked = plot_rows(rows)
        pyg = picked.get(PLOT_ROWS[-1][0], {})
        bars += [(f"{name}\n({where})", kinds, pyg) for name, kinds in picked.items()]
    fig, ax = plt.subplots(figsize=(9.5, 1.0 * len(bars) + 1.8))
    height = 0.38
    for k, (kind, color) in enumerate((("structure", "tab:blue"), ("+ features", "tab:orange"))):
        ys = [i + (k - 0.5) * height for i in range(len(bars))]
        values = [kinds.get(kind, 0.0) for _, kinds, _ in bars]
        ax.barh(ys, values, height=height, color=color, label=kind)
        for y, v, (_, _, pyg) in zip(ys, values, bars, strict=True):
            ratio = f"  ({v / pyg[kind]:.1f}x PyG)" if kind in pyg and v != pyg[kind] else ""
            if v:
                ax.text(v * 1.05, y, f"{v:,.0f}{ratio}", va="center", fontsize=8)
    ax.set_yticks(range(len(bars)), [label for label, _, _ in bars], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(right=ax.get_xlim()[1] * 8)
    ax.set_xlabel("seeds/s, median of the passes (log scale); x PyG: against PyG's best row on "
                  "the same machine", fontsize=9)
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"products-like, fanouts {FANOUTS}, batch {BATCH}: seeds sampled per second")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log.info("wrote %s", path)


def plot_only(paths: list[Path], name: str) -> int:
    """The plot of results already written: sampler JSONs, and ``make gpu-check``
    reports (their sampler step's rows); ``<name>.png`` beside the first."""
    sources = []
    for path in paths:
        payload = read_results(path)
        step = report_step(payload, "sampler")
        rows = step["rows"] if step is not None else payload.get("rows", [])
        sources.append((describe_machine(payload), rows))
    plot(sources, paths[0].parent / f"{name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
