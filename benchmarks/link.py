"""Link-prediction benchmark (not a test): graphfeed's link batches beside PyG's
``LinkNeighborLoader`` on the same graph in the same run, and the bytes edge features add
to a batch.

Graph: ``citation2-like`` (full size: 2,927,963 nodes, 30,561,187 edges, 128-dim
features; generated once as one partition under ``--data``), seed edges from its
``train`` link split, fanouts [15, 10, 5], batch 1024 seed edges, binary negatives 1:1
(each batch: 1024 positive and 1024 negative edges, the neighborhood of their ends, and
their features). Reports seed edges/s. graphfeed's rows make each batch as a server does
(:func:`sampling_server.sampler.links.link_seeds`: negatives keyed by the edges' original
IDs, the distinct ends, then the neighborhood and the feature gather), one batch at a time
and ``IN_FLIGHT`` at once as a server's sampling workers run them; PyG's with
``num_workers`` 0, 1 and 2 (in a child process with its own copy of the graph). Every
row runs once per pass; the ratios are per pass (graphfeed's best against PyG's best).

A second part measures the bytes per batch of ``edge_attr`` beside ``x`` on the wire:
link batches of ``edge-feat-small`` (8 float32 features per edge, 16 per node) through
two in-process servers with ``edge_features=True``.

    make bench-peers            # PyG's torch-sparse/torch-scatter (else PyG is skipped)
    python benchmarks/link.py --data data/bench

Writes ``benchmarks/results/link.json`` and ``link.png``. ``--preset citation2-small``
runs the same on the small graph in seconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import subprocess
import sys
import tempfile
import time
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
    spread,
    summarize_passes,
    time_batches,
    write_json,
)
from sampler import release_freed_memory

from partitioner import PLAIN_EDGE_TYPE, PLAIN_NODE_TYPE, load_partition, partition_graph
from partitioner.partition import Partition

log = logging.getLogger("bench.link")

FANOUTS = [15, 10, 5]
BATCH = 1024
#: Batches graphfeed's server-like CPU rows make at once (a server's sampling workers).
IN_FLIGHT = 2


def ensure_partition(data: Path, preset: str) -> Path:
    """One-partition copy of ``preset`` with its link splits under ``data`` (generated
    once, through a graph directory as ``graphfeed-partition generate`` writes it)."""
    part_dir = data / f"{preset}-1"
    if (part_dir / "manifest.json").is_file():
        return part_dir
    graph_dir = data / preset
    if not (graph_dir / "graph.json").is_file():
        log.info("generating %s in %s (minutes at full size)", preset, graph_dir)
        subprocess.run([sys.executable, "-m", "partitioner", "generate", "--preset", preset, "--out",
                        str(graph_dir)], check=True)
    subprocess.run([sys.executable, "-m", "partitioner", "partition", "--graph-dir", str(graph_dir),
                    "--num-parts", "1", "--method", "range", "--out", str(part_dir), "--overwrite"],
                   check=True)
    return part_dir


def train_edges(part_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """The ``train`` link split's sources and destinations (global IDs: with one range
    partition, the original IDs)."""
    from partitioner.links import load_link_split
    from partitioner.manifest import read_manifest

    split = load_link_split(part_dir, read_manifest(part_dir), "train")
    return np.asarray(split.src), np.asarray(split.dst)


def graphfeed_rows(part: Partition, edges: tuple[np.ndarray, np.ndarray], device: str, n: int
                   ) -> list[dict[str, Any]]:
    """Link batches as a server makes them: structure only, and with features."""
    from sampling_server.sampler import create_sampler
    from sampling_server.sampler.links import BINARY, LinkOptions, link_seeds
    from sampling_server.sampler.rng import batch_key

    t, et = PLAIN_NODE_TYPE, PLAIN_EDGE_TYPE
    sampler = create_sampler(part, device=device)
    num_nodes = part.manifest.node_types[t].num_nodes
    options = LinkOptions(et, BINARY, 1.0, False, num_nodes, num_nodes)
    src, dst = edges

    def identity(_: str, orig: np.ndarray) -> np.ndarray:  # one range partition keeps the IDs
        return orig

    def batch(positions: np.ndarray, i: int, features: bool) -> int:
        key = batch_key(0, 0, 0, i)
        made = link_seeds(sampler, options, key, src[positions], dst[positions], None, None, identity, None)
        out = sampler.sample(made.seeds, t, FANOUTS, key)
        if features:
            x, _ = sampler.gather(t, out.node[t], labels=False)
            assert x is not None
        if device == "cuda":
            torch.cuda.synchronize()
        return int(out.row[et].numel())

    positions = np.arange(src.size, dtype=np.int64)
    rows = []
    for label, step, in_flight in (
            ("structure", lambda p, i: batch(p, i, False), 1),
            ("+ features", lambda p, i: batch(p, i, True), 1),
            (f"+ features, {IN_FLIGHT} in flight", lambda p, i: batch(p, i, True), IN_FLIGHT)):
        if in_flight > 1 and device != "cpu":
            continue
        row = time_batches(f"graphfeed {device}: {label}", step, positions, BATCH, n, in_flight=in_flight)
        log.info("%-44s %10.0f seed edges/s", row["label"], row["seeds_per_s"])
        rows.append(row)
    return rows


def pyg_rows(part: Partition, edges: tuple[np.ndarray, np.ndarray], n: int, workers: list[int]
             ) -> list[dict[str, Any]]:
    """PyG's own LinkNeighborLoader (needs torch-sparse / pyg-lib); skipped without them."""
    try:
        import torch_sparse  # noqa: F401
    except ImportError:
        log.warning("PyG LinkNeighborLoader skipped: torch-sparse is not installed (make bench-peers)")
        return [{"label": "pyg LinkNeighborLoader", "skipped": "torch-sparse not installed"}]
    from torch_geometric.data import Data
    from torch_geometric.loader import LinkNeighborLoader

    indptr = np.asarray(part.indptr[PLAIN_EDGE_TYPE])
    edge_index = torch.empty((2, int(indptr[-1])), dtype=torch.int64)
    edge_index[0] = torch.from_numpy(np.asarray(part.indices[PLAIN_EDGE_TYPE]))
    edge_index[1] = torch.repeat_interleave(torch.arange(indptr.size - 1), torch.from_numpy(np.diff(indptr)))
    x = torch.from_numpy(np.array(part.x[PLAIN_NODE_TYPE]))
    label_index = torch.from_numpy(np.stack(edges))
    rows = []
    for nw in workers:
        for kind, data in (("structure", Data(edge_index=edge_index, num_nodes=indptr.size - 1)),
                           ("+ features", Data(edge_index=edge_index, x=x, num_nodes=indptr.size - 1))):
            loader = LinkNeighborLoader(data, num_neighbors=FANOUTS, edge_label_index=label_index,
                                        neg_sampling="binary", batch_size=BATCH, shuffle=True,
                                        num_workers=nw, persistent_workers=nw > 0, is_sorted=True)
            rows.append(_time_loader(f"pyg LinkNeighborLoader (num_workers={nw}): {kind}", loader, n))
            del loader  # its workers stop here, before the next loader forks
            gc.collect()
    return rows


def _time_loader(label: str, loader: Any, n: int) -> dict[str, Any]:
    it = iter(loader)
    next(it)
    started, seeds, edges = time.perf_counter(), 0, 0
    for _ in range(n):
        batch = next(it)
        seeds += int(batch.input_id.numel())
        edges += int(batch.edge_index.size(1))
    wall = time.perf_counter() - started
    row = {"label": label, "batches": n, "seconds": round(wall, 3), "seeds_per_s": round(seeds / wall, 1),
           "edges_per_s": round(edges / wall, 1), "ms_per_batch": round(1000 * wall / n, 2)}
    log.info("%-44s %10.0f seed edges/s", label, row["seeds_per_s"])
    return row


def run_pyg_child(args: argparse.Namespace) -> list[dict[str, Any]]:
    """PyG's rows in a child process (its copies of the graph do not stack on ours)."""
    out = RESULTS / "link-pyg.tmp"
    subprocess.run([sys.executable, __file__, "--data", str(args.data), "--preset", args.preset,
                    "--pyg-batches", str(args.pyg_batches), "--pyg-only", str(out),
                    "--pyg-workers", *map(str, args.pyg_workers)], check=True, timeout=3600)
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    out.unlink()
    return rows


def edge_attr_bytes(batches: int = 4) -> dict[str, Any]:
    """Bytes per link batch of ``x`` and of ``edge_attr`` (float32 on the wire), on
    ``edge-feat-small`` through two in-process servers."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from in_process_servers import served

    from partitioner.synthetic import generate_plain as generate
    from trainer_client.link_loader import RemoteLinkNeighborLoader

    graph = generate("edge-feat-small")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "p2"
        partition_graph(graph, 2, root, method="range", progress=False)
        index = torch.from_numpy(np.asarray(graph.edge_index)[:, :BATCH * batches])
        x_bytes, attr_bytes, edges = [], [], []
        with served(root, 2) as addresses, RemoteLinkNeighborLoader(
                addresses, edge_label_index=index, num_neighbors=FANOUTS, batch_size=BATCH,
                neg_sampling="binary", edge_features=True, cache_size=0) as loader:
            for batch in loader:
                x_bytes.append(batch.x.numel() * 4)
                attr_bytes.append(batch.edge_attr.numel() * 4)
                edges.append(batch.edge_index.size(1))
    assert graph.edge_attr is not None
    out: dict[str, Any] = {"graph": "edge-feat-small", "node_feature_dim": int(graph.x.shape[1]),
           "edge_feature_dim": int(np.prod(graph.edge_attr.shape[1:])),
           "sampled_edges_per_batch": round(float(np.mean(edges)), 1),
           "x_bytes_per_batch": round(float(np.mean(x_bytes))),
           "edge_attr_bytes_per_batch": round(float(np.mean(attr_bytes)))}
    out["edge_attr_share"] = round(out["edge_attr_bytes_per_batch"]
                                   / (out["edge_attr_bytes_per_batch"] + out["x_bytes_per_batch"]), 3)
    log.info("edge_attr: %s", out)
    return out


def ratios(passes: list[list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Per pass: graphfeed's best CPU row with features against PyG's best."""
    out: dict[str, list[float]] = {}
    for rows in passes:
        ours = [r["seeds_per_s"] for r in rows if r["label"].startswith("graphfeed cpu: + features")]
        pyg = [r["seeds_per_s"] for r in rows if r["label"].startswith("pyg") and "+ features" in r["label"]
               and "seeds_per_s" in r]
        if ours and pyg:
            out.setdefault("graphfeed CPU best / PyG LinkNeighborLoader best (+ features)", []).append(
                round(max(ours) / max(pyg), 2))
    return out


def plot(rows: list[dict[str, Any]], path: Path, where: str) -> None:
    plt = pyplot()
    timed = [r for r in rows if "seeds_per_s" in r]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(timed) + 1.5))
    ax.barh([r["label"] for r in timed], [r["seeds_per_s"] for r in timed],
            color=["tab:blue" if r["label"].startswith("graphfeed") else "tab:gray" for r in timed])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("seed edges/s (median over passes; log scale)")
    ax.set_title(f"Link batches, fanouts {FANOUTS}, batch {BATCH}, binary 1:1 ({where})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--preset", default="citation2-like")
    parser.add_argument("--batches", type=int, default=30, help="timed batches per graphfeed row")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--pyg-batches", type=int, default=10)
    parser.add_argument("--pyg-workers", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--devices", nargs="*", default=None,
                        help="graphfeed devices (default: cpu, plus cuda when usable)")
    parser.add_argument("--no-baselines", action="store_true", help="graphfeed's rows only")
    parser.add_argument("--results-name", default="link")
    parser.add_argument("--pyg-only", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    part_dir = args.data / f"{args.preset}-1"
    if args.pyg_only is not None:
        part = load_partition(part_dir, 0, verify="size")
        args.pyg_only.write_text(json.dumps(pyg_rows(part, train_edges(part_dir), args.pyg_batches,
                                                     args.pyg_workers)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from protos.allocator import keep_freed_memory

    keep_freed_memory()
    part_dir = ensure_partition(args.data, args.preset)
    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    edges = train_edges(part_dir)
    passes: list[list[dict[str, Any]]] = []
    load = []
    for i in range(args.passes):
        log.info("pass %d of %d (load average %s)", i + 1, args.passes, load_average())
        part = load_partition(part_dir, 0, verify="size", mmap=False)
        rows = [r for d in devices for r in graphfeed_rows(part, edges, d, args.batches)]
        del part
        if not args.no_baselines:
            release_freed_memory()
            rows += run_pyg_child(args)
        passes.append(rows)
        load.append(load_average())
    rows = summarize_passes(passes)
    payload = {"benchmark": "link", "preset": args.preset, "fanouts": FANOUTS, "batch_size": BATCH,
               "negatives": "binary 1:1", "seed_edges": int(edges[0].size), "machine": machine(),
               "torch_threads": torch.get_num_threads(),
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
               "date": time.strftime("%Y-%m-%d", time.gmtime()), "load_average_after_each_pass": load,
               "rows": rows, "ratios": {k: spread(v) for k, v in ratios(passes).items()},
               "edge_attr": edge_attr_bytes(), "passes": passes}
    path = write_json(args.results_name, payload)
    plot(rows, RESULTS / f"{args.results_name}.png", describe_machine(payload))
    for r in rows:
        if "seeds_per_s" in r:
            print(f"{r['label']:<52} {r['seeds_per_s']:>10,.0f} seed edges/s "
                  f"(min {r['seeds_per_s_min']:>9,.0f}, max {r['seeds_per_s_max']:>9,.0f})")
        else:
            print(f"{r['label']:<52} skipped: {r.get('skipped')}")
    for k, v in payload["ratios"].items():
        print(f"{k}: median {v['median']} (min {v['min']}, max {v['max']}; per pass {v['per_pass']})")
    print(f"edge_attr: {payload['edge_attr']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
