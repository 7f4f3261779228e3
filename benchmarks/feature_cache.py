"""Feature cache benchmark (not a test): bytes per batch (features and structure apart),
delivered batches/s and the cache hit rate of one trainer, for cache sizes x wire feature
dtypes, in one run; and the hit rates of several hot-node rules at equal size.

One real ``sampling_server`` process per partition of the preset (default
``products-like`` in one partition, as ``benchmarks/sampler.py`` writes it), read by
``RemoteNeighborLoader`` on the CPU with fanouts [15, 10, 5] and batch 1024. Every row
uses a fresh loader (and cluster), so each cache is filled once before its batches are
timed; the fill time (the cache and, with it, the node table of original IDs and
labels) and their memory are reported beside the batches. The rows use the loader's
defaults (compact structure, the servers' hot order); one more row, the first, is the
float32 baseline as a client without ``compact_indices`` receives it.

On a graph of several partitions the cache fill alone is also timed (``--fill-passes``):
every partition's rows at once, as ``Cluster.fill_feature_cache`` streams them, against one
partition after the other, alternating.

Target: bytes per batch / 4 or better at 20 % cache + bfloat16 vs float32 without cache.
Writes ``benchmarks/results/feature_cache.json`` (``--results-name``).

``--typed PRESET`` runs the same rows on a typed graph instead (a preset of
``partitioner.synthetic`` with reverse relations, in two partitions, written once
under ``--data``; seeds: the training nodes of the target type; ``--typed-fanouts`` for
every edge type): the cache then holds every node type with features, and the hot-node
rules are compared per node type on a one-partition copy.

    python benchmarks/feature_cache.py --data data/bench
    python benchmarks/feature_cache.py --data data/bench --typed mag-like --results-name feature_cache_typed

Takes about 3 minutes on a 2-core machine once ``products-like`` is written (the first run
writes it, as ``benchmarks/sampler.py`` does); ``--typed mag-like`` about 2 minutes more
the first time. Also writes ``<results-name>.png``: bytes per batch by cache size and
dtype; ``--plot-only JSON`` redraws it from results already written.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import RESULTS, describe_machine, held_port, machine, pyplot, read_results, write_json

log = logging.getLogger("bench.feature_cache")

FANOUTS = [15, 10, 5]
BATCH = 1024
CACHE_SIZES = [0.0, 0.05, 0.1, 0.2]
DTYPES = ["float32", "bfloat16"]


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
            batch_size: int, compact_indices: bool = True,
            fanouts: list[int] = FANOUTS) -> dict[str, Any]:
    """One row: fill the cache, then time ``num_batches`` batches after a first one."""
    from trainer_client.loader import RemoteNeighborLoader

    started = time.perf_counter()
    loader = RemoteNeighborLoader(addresses, "train", num_neighbors=fanouts, batch_size=batch_size,
                                  shuffle=True, feature_dtype=dtype, cache_size=cache,
                                  cache_progress=False, connect_timeout=600, stall_timeout=300,
                                  compact_indices=compact_indices)
    typed = loader.typed_graph
    caches, tables = list(loader.caches.values()), list(loader.node_tables.values())
    # one feature width for every row (a homogeneous graph, or one typed type with features)
    widths = {d for d in typed.feature_dims.values() if d} if typed else {loader.num_features}
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
    row_bytes = widths.pop() * (4 if dtype == "float32" else 2) if len(widths) == 1 else 0
    feature_bytes = (rows - hits) * row_bytes  # the rows of "x" received (0: widths differ)
    row = {"cache": cache, "dtype": dtype, "compact_indices": loader.compact_indices,
           "batches": num_batches, "bytes_per_batch": round(nbytes / num_batches),
           "feature_bytes_per_batch": round(feature_bytes / num_batches),
           "structure_bytes_per_batch": round((nbytes - feature_bytes) / num_batches),
           "batches_per_s": round(num_batches / wall, 3),
           "hit_rate": round(hits / rows, 4) if rows else 0.0,
           "nodes_per_batch": round(rows / num_batches),
           "cache_nodes": sum(c.num_rows for c in caches),
           "cache_mib": round(sum(c.nbytes for c in caches) / 2**20, 1),
           "node_table_mib": round(sum(t.nbytes for t in tables) / 2**20, 1),
           "fill_seconds": round(fill, 2)}
    del it
    loader.close()
    log.info("%s", row)
    return row


def typed_partition(data: Path, preset: str, parts: int = 2) -> Path:
    """The typed ``preset`` with reverse relations in ``parts`` partitions under ``data``
    (written once; METIS for several, one range for one, as ``benchmarks/hetero.py``)."""
    from partitioner.synthetic import generate_typed
    from partitioner.writer import partition_graph

    root = data / f"{preset}-hetero-{parts}"
    if not (root / "manifest.json").is_file():
        started = time.perf_counter()
        graph = generate_typed(preset, seed=0, progress=False).add_reverse()
        partition_graph(graph, parts, root, method="metis" if parts > 1 else "range",
                        overwrite=True, progress=False)
        log.info("%s: generated and partitioned in %.1f s", root, time.perf_counter() - started)
    return root


def compare_fills(addresses: list[str], fraction: float, dtype: str, passes: int) -> list[dict[str, Any]]:
    """The cache fill alone (``Cluster.fill_feature_cache`` of ``fraction`` of every partition's
    nodes), every partition at once (the trainer's way) against one partition after the
    other, alternating, ``passes`` times each; each fill's tables are freed after it."""
    import gc

    import torch

    from protos import codec
    from protos.allocator import keep_freed_memory
    from trainer_client import cache as cache_module
    from trainer_client.cache import plan_counts
    from trainer_client.cluster import Cluster

    # as graphfeed-train does (after the rows above, which ran without it): each fill then
    # reuses the freed tables' pages, and the kernel's page faults stay out of the timing
    keep_freed_memory()
    wire = codec.torch_to_dtype(getattr(torch, dtype))
    at_once = cache_module.MAX_FILL_STREAMS
    rows: list[dict[str, Any]] = []
    with Cluster(addresses, connect_timeout=600) as cluster:
        book = cluster.graph.books[cluster.graph.target_type].tolist()
        counts = plan_counts(("fraction", fraction), book, 1)
        for p in range(2 * passes + 1):  # the first fill (unrecorded) warms the servers
            streams = at_once if p % 2 else 1
            cache_module.MAX_FILL_STREAMS = streams
            try:
                started = time.perf_counter()
                cache = cluster.fill_feature_cache(counts, wire, torch.device("cpu"), progress=False)
                wall = time.perf_counter() - started
            finally:
                cache_module.MAX_FILL_STREAMS = at_once
            nbytes = cache.rows.numel() * cache.rows.element_size()
            del cache
            gc.collect()
            if p:
                rows.append({"streams": streams, "partitions": len(book) - 1, "fraction": fraction,
                             "dtype": dtype, "seconds": round(wall, 3),
                             "mb_per_s": round(nbytes / wall / 1e6, 1), "pass": (p - 1) // 2})
                log.info("fill: %s", rows[-1])
    return rows


def compare_plans(part_dir: Path, warm: int, test: int, fractions: list[float],
                  fanouts: list[int]) -> list[dict[str, Any]]:
    """Hit rates of hot-node rules at equal size, on one partition with the server's own
    sampler, all measured on the same ``test`` batches, per node type with features (and,
    on a typed graph, for ``author``, featureless in ``mag-like`` and its largest type):
    expected visits (``visits_v1``, the servers' default, for [15, 10, 5]; and the same
    estimate for these ``fanouts``), in-degree over the relations ending at the type
    (``in_degree_v1``), in-degree among the nodes the training nodes reach within the
    hops (the rest after), and node counts of ``warm`` other pre-sampled batches."""
    import numpy as np
    import torch

    from partitioner import load_partition
    from sampling_server.sampler import batch_key, create_sampler
    from sampling_server.sampler.fanouts import normalize_num_neighbors
    from sampling_server.sampler.hot_order import hot_order, in_degree, visit_scores

    part = load_partition(part_dir, 0, verify="size", mmap=True)
    sampler = create_sampler(part, device="cpu")
    train = np.asarray(part.splits["train"])
    rng = np.random.default_rng(1)
    types = list(part.node_types)
    num_neighbors = normalize_num_neighbors(fanouts, part.edge_types)

    def counts(first: int, num: int) -> dict[str, np.ndarray]:
        out = {t: np.zeros(part.num_nodes(t), dtype=np.int64) for t in types}
        for i in range(first, first + num):
            seeds = torch.from_numpy(rng.choice(train, size=min(BATCH, train.size), replace=False))
            batch = sampler.sample(seeds, part.target_type, num_neighbors, batch_key(0, 0, 0, i))
            for t, ids in batch.node.items():
                out[t] += np.bincount(ids.numpy() - part.node_range(t)[0], minlength=out[t].size)
        return out

    warm_counts, test_counts = counts(0, warm), counts(warm, test)
    visits = visit_scores(part, tuple(fanouts))
    featured = [t for t, i in part.manifest.node_types.items() if i.feature_dim > 0]
    rows = []
    for t in dict.fromkeys([*featured, "author"] if part.manifest.typed else featured):
        if t not in types:
            continue
        start, n = part.node_range(t)[0], part.num_nodes(t)
        ids = np.arange(n)
        degree = in_degree([ip for et, ip in part.indptr.items() if et[2] == t], n)
        started = time.perf_counter()
        orders = {"visits": hot_order(part, t, "visits_v1") - start}
        log.info("%s: visits_v1 order of %d nodes in %.1f s", t, n, time.perf_counter() - started)
        orders["visits_these_fanouts"] = np.lexsort((ids, -degree, -visits[t]))
        orders["in_degree"] = hot_order(part, t, "in_degree_v1") - start
        orders["reachable_in_degree"] = np.lexsort((ids, -degree, ~(visits[t] > 0)))
        orders["presampled"] = np.lexsort((ids, -warm_counts[t]))
        total = int(test_counts[t].sum())
        for f in fractions:
            k = int(f * n)
            row: dict[str, Any] = {"node_type": t} if part.manifest.typed else {}  # a plain graph's: none
            row.update(cache=f, presample_batches=warm, test_batches=test)
            for name, order in orders.items():
                row[f"{name}_hit_rate"] = round(float(test_counts[t][order[:k]].sum()) / max(total, 1), 4)
            rows.append(row)
            log.info("%s", row)
    return rows


def print_table(rows: list[dict[str, Any]], plans: list[dict[str, Any]]) -> None:
    """The run's table on stdout (the CLI's own output)."""
    print(f"{'dtype':<9} {'cache':>5} {'compact':>7} {'MB/batch':>9} {'structure':>9} {'vs f32':>7} "
          f"{'vs f32c':>7} {'batch/s':>8} {'hit':>6} {'cache MiB':>9} {'fill s':>7}")
    for r in rows:
        print(f"{r['dtype']:<9} {r['cache']:>5.0%} {r['compact_indices']!s:>7} "
              f"{r['bytes_per_batch'] / 1e6:>9.1f} {r['structure_bytes_per_batch'] / 1e6:>9.1f} "
              f"{r['bytes_vs_float32_no_cache']:>7.3f} {r['bytes_vs_float32_no_cache_compact']:>7.3f} "
              f"{r['batches_per_s']:>8.2f} {r['hit_rate']:>6.1%} {r['cache_mib']:>9.1f} "
              f"{r['fill_seconds']:>7.2f}")
    for p in plans:
        rates = ", ".join(f"{k.removesuffix('_hit_rate')} {v:.1%}" for k, v in p.items()
                          if k.endswith("_hit_rate"))
        what = f"{p['node_type']} " if "node_type" in p else ""
        print(f"{what}cache {p['cache']:.0%}: hit rate {rates}")


def plot(payload: dict[str, Any], path: Path) -> None:
    """Bytes per batch by cache size and wire dtype (feature rows and structure stacked),
    against float32 without cache as a client without the compact structure receives it,
    and a quarter of that (the target)."""
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in payload["rows"] if r.get("compact_indices", True)]
    base = next((r for r in payload["rows"] if not r.get("compact_indices", True)), None)
    caches = sorted({r["cache"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.38
    for k, dtype in enumerate(DTYPES):
        mine = {r["cache"]: r for r in rows if r["dtype"] == dtype}
        xs = [i + (k - 0.5) * width for i, c in enumerate(caches) if c in mine]
        feats = [mine[c]["feature_bytes_per_batch"] / 1e6 for c in caches if c in mine]
        structure = [mine[c]["structure_bytes_per_batch"] / 1e6 for c in caches if c in mine]
        ax.bar(xs, feats, width=width, label=f"{dtype} feature rows", color=f"C{k}")
        ax.bar(xs, structure, width=width, bottom=feats, color="0.6",
               label="structure (IDs, edges, labels)" if k == 0 else None)
        for x, f, st in zip(xs, feats, structure, strict=True):
            total = f + st
            note = f"{total:.1f}" + (f" ({base['bytes_per_batch'] / 1e6 / total:.2f}x)" if base else "")
            ax.text(x, total + 2, note, ha="center", va="bottom", fontsize=7)
    if base is not None:
        mb = base["bytes_per_batch"] / 1e6
        ax.axhline(mb, color="black", linestyle=":",
                   label=f"float32, no cache, without the compact structure: {mb:.1f} MB")
        ax.axhline(mb / 4, color="tab:red", linestyle="--",
                   label=f"a quarter of that (the target): {mb / 4:.1f} MB")
    hits = {r["cache"]: r["hit_rate"] for r in rows}
    ax.set_xticks(range(len(caches)), ["no cache" if c == 0 else
                                       f"{c:.0%} of the nodes\n{hits[c]:.1%} of rows hit" for c in caches])
    ax.set_ylabel("MB per batch")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
    ax.legend(fontsize=8, loc="upper right")
    graph = payload.get("graph", "")
    ax.set_title(f"{graph}, fanouts {payload.get('fanouts')}, batch {payload.get('batch_size')}: "
                 f"bytes a trainer receives per batch ({describe_machine(payload)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log.info("wrote %s", path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--preset", default="products-like")
    parser.add_argument("--partition-dir", type=Path, default=None,
                        help="an existing partitioned graph (instead of --data/--preset)")
    parser.add_argument("--batches", type=int, default=8,
                        help="timed batches per row (0: no rows, e.g. for the fill comparison alone)")
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--compare-batches", type=int, nargs=2, default=[16, 8],
                        metavar=("PRESAMPLE", "TEST"),
                        help="batches for the comparison of hot-node rules (0 0: skip)")
    parser.add_argument("--fill-passes", type=int, default=3,
                        help="passes of the fill comparison (every partition at once against one "
                             "after the other; several partitions only; 0: skip)")
    parser.add_argument("--fill-fraction", type=float, default=1.0,
                        help="share of every partition's nodes the compared fills hold")
    parser.add_argument("--fill-dtype", default="float32", choices=DTYPES)
    parser.add_argument("--results-name", default="feature_cache")
    parser.add_argument("--typed", metavar="PRESET", default=None,
                        help="a typed graph preset (e.g. mag-like) instead of --preset")
    parser.add_argument("--typed-fanouts", type=int, nargs="+", default=[10, 5],
                        help="fanouts of every edge type with --typed")
    parser.add_argument("--plot-only", type=Path, metavar="JSON",
                        help="draw <results-name>.png beside these results instead of measuring")
    args = parser.parse_args()
    if args.plot_only:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        plot(read_results(args.plot_only), args.plot_only.parent / f"{args.results_name}.png")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from partitioner.manifest import read_manifest

    if args.typed:
        part_dir = typed_partition(args.data, args.typed)
        manifest = read_manifest(part_dir)
    elif args.partition_dir is None:
        from sampler import ensure_partition
        part_dir = ensure_partition(args.data, args.preset)
        manifest = read_manifest(part_dir)
    else:
        part_dir = args.partition_dir
        manifest = read_manifest(part_dir)
    fanouts = args.typed_fanouts if args.typed else FANOUTS
    ports = [held_port() for _ in range(manifest.num_partitions)]
    procs = start_servers(part_dir, manifest.num_partitions, ports)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    try:  # the baseline first: float32, no cache, int64 structure (a client from before)
        rows = [] if args.batches <= 0 else \
            [measure(addresses, 0.0, "float32", args.batches, args.batch_size, compact_indices=False,
                     fanouts=fanouts)] + \
            [measure(addresses, c, d, args.batches, args.batch_size, fanouts=fanouts)
             for d in DTYPES for c in CACHE_SIZES]
        fills = compare_fills(addresses, args.fill_fraction, args.fill_dtype, args.fill_passes) \
            if args.fill_passes > 0 and manifest.num_partitions > 1 and not args.typed else []
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(60)
    warm, test = args.compare_batches
    plans = [] if min(args.compare_batches) <= 0 else \
        compare_plans(typed_partition(args.data, args.typed, 1), warm, test, CACHE_SIZES[1:],
                      fanouts) if args.typed else \
        compare_plans(part_dir, warm, test, CACHE_SIZES[1:], fanouts) if manifest.num_partitions == 1 else []
    base, compact_base = (rows[0], rows[1]) if rows else ({}, {})
    for r in rows:
        r["bytes_vs_float32_no_cache"] = round(r["bytes_per_batch"] / base["bytes_per_batch"], 3)
        r["bytes_vs_float32_no_cache_compact"] = round(
            r["bytes_per_batch"] / compact_base["bytes_per_batch"], 3)
    num_nodes = ({t: i.num_nodes for t, i in manifest.node_types.items()} if args.typed
                 else manifest.num_nodes)
    payload = {"benchmark": "feature_cache", "graph": manifest.graph_name, "typed": bool(args.typed),
               "partitions": manifest.num_partitions, "num_nodes": num_nodes,
               "fanouts": fanouts, "batch_size": args.batch_size, "machine": machine(), "rows": rows,
               "plans": plans, "fills": fills}
    if fills:
        by = {s: [r["seconds"] for r in fills if r["streams"] == s] for s in {r["streams"] for r in fills}}
        payload["fill_speedup_all_at_once"] = round(
            statistics.median(by[1]) / statistics.median(by[max(by)]), 3)
    path = write_json(args.results_name, payload)
    if rows:
        plot(payload, RESULTS / f"{args.results_name}.png")
    print_table(rows, plans)
    for r in fills:
        print(f"fill, {r['streams']} stream(s) at a time: {r['seconds']:.2f} s ({r['mb_per_s']:.0f} MB/s)")
    if fills:
        print(f"fill, all partitions at once vs one after the other: "
              f"{payload['fill_speedup_all_at_once']:.2f}x (medians)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
