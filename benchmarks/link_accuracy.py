"""Link-prediction accuracy (not a test): the service's link batches against PyG's
in-process ``LinkNeighborLoader``, the same model trained the same way on each.

Graph: a synthetic preset with link splits (``citation2-small`` by default): in memory for
PyG, and served by graphfeed servers (``--servers``) on a partitioning of the same preset
(``graphfeed-partition partition --preset citation2-small ...``). For every seed of
``--seeds`` both sides train ``graphfeed-train --task link``'s model (encoder, decoder,
fanouts, batch size, negatives, epochs, learning rate and seed alike) with the trainer's
own loop (:func:`trainer_client.loop.run`: best validation epoch kept, tested
at the end), PyG's side through :mod:`trainer_client.link_pyg`, the service's through
:func:`service_job`. Reports the test figure (MRR against the stored negatives) per seed,
each side's mean and standard deviation, and Welch's t-test of the difference; writes
``benchmarks/results/link-accuracy.json``.

    python benchmarks/link_accuracy.py --servers node0:50051,node1:50051 --seeds 0,1,2,3,4
    python benchmarks/link_accuracy.py --service-stand-in pyg --seeds 0,1 --epochs 1   # the harness

``--service-stand-in pyg`` runs the "service" side through PyG's loader too (the
harness's own check: both sides then draw alike and agree exactly). Takes a few minutes a
seed on a 2-core machine with the defaults.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import machine, write_json

from partitioner.graph import PLAIN_EDGE_TYPE
from trainer_client import train
from trainer_client.cluster import Cluster
from trainer_client.ddp import DistEnv
from trainer_client.link_pyg import PygLinkGraph, StoredLinkSplit
from trainer_client.link_task import LinkTask, build_link_task, cluster_link_task
from trainer_client.loop import run

log = logging.getLogger("bench.link_accuracy")

#: One process on the CPU: both sides train alike.
ONE = DistEnv(0, 1, 0, torch.device("cpu"))
#: The trainer flags both sides share (the seed and the graph's address aside).
TRAIN_FLAGS = ["--task", "link", "--model", "sage", "--decoder", "dot", "--fanouts", "10,5",
               "--batch-size", "512", "--hidden", "128", "--lr", "0.003", "--dropout", "0.0",
               "--epochs", "10", "--neg-ratio", "1", "--device", "cpu", "--no-progress"]


def pyg_graph(graph: Any) -> PygLinkGraph:
    """A generated graph with link splits (``GraphData`` / ``TypedGraphData`` with
    ``link_splits`` in original IDs) held for PyG's loader."""
    from torch_geometric.data import Data, HeteroData

    typed = bool(getattr(graph, "typed", False))

    def ids(values: Any) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))

    splits = {name: StoredLinkSplit(tuple(s.edge_type) if typed else PLAIN_EDGE_TYPE, ids(s.src), ids(s.dst),
                                    None if s.neg_dst is None else ids(s.neg_dst))
              for name, s in graph.link_splits.items()}
    if not typed:
        data = Data(x=torch.from_numpy(np.asarray(graph.x, np.float32)), edge_index=ids(graph.edge_index),
                    num_nodes=graph.num_nodes)
        return PygLinkGraph(data, splits, name=graph.name)
    hetero = HeteroData()
    for t, n in graph.num_nodes.items():
        hetero[t].num_nodes = n
        if t in graph.x:
            hetero[t].x = torch.from_numpy(np.asarray(graph.x[t], np.float32))
    for et, ei in graph.edge_index.items():
        hetero[et].edge_index = ids(ei)
    return PygLinkGraph(hetero, splits, name=graph.name)


def pyg_job(graph: PygLinkGraph, args: argparse.Namespace) -> LinkTask:
    """PyG's side: the trainer's link task through PyG's ``LinkNeighborLoader``."""
    make = partial(graph.loader, rank=0, world_size=1, seed=args.seed, device=ONE.device)
    return build_link_task(make, graph.link_splits, graph.facts(), args, ONE, source="PyG's")


# ---- the service's side ------------------------------------------------------------------
def service_job(args: argparse.Namespace, cluster: Cluster) -> LinkTask:
    """THE SERVICE'S SIDE: the trainer's link task on ``RemoteLinkNeighborLoader`` batches
    streamed by the servers of ``cluster`` (exactly what ``graphfeed-train --task link
    --servers ...`` trains on: :func:`trainer_client.link_task.cluster_link_task`)."""
    return cluster_link_task(args, ONE, cluster)


def welch(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Welch's two-sided t-test of equal means: ``t``, ``df`` and ``p`` (scipy's when it is
    importable, else the same figures from the regularized incomplete beta function)."""
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if x.size < 2 or y.size < 2:
        return {"t": float("nan"), "df": float("nan"), "p": float("nan")}
    vx, vy = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
    if vx + vy == 0.0:
        same = float(x.mean() == y.mean())
        return {"t": 0.0 if same else float("inf"), "df": float(x.size + y.size - 2), "p": same}
    t = float((x.mean() - y.mean()) / math.sqrt(vx + vy))
    df = float((vx + vy) ** 2 / (vx ** 2 / (x.size - 1) + vy ** 2 / (y.size - 1)))
    try:
        from scipy import stats
        return {"t": t, "df": df, "p": float(stats.ttest_ind(x, y, equal_var=False).pvalue)}
    except ImportError:
        return {"t": t, "df": df, "p": _betainc(df / 2, 0.5, df / (df + t * t))}


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` (Lentz's continued fraction)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x)
                     + b * math.log(1 - x)) / a
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        num = 1.0 if i == 0 else (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)) if i % 2 == 0
                                  else -((a + m) * (a + b + m) * x) / ((a + 2 * m) * (a + 2 * m + 1)))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = 1.0 + num / (c if abs(c) > 1e-300 else 1e-300)
        f *= c * d
        if abs(1.0 - c * d) < 1e-12:
            break
    return front * (f - 1.0)


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's test figures per seed, their mean and standard deviation (ddof 1)."""
    scores = [float(r[f"test_{r['test_metric']}"]) for r in runs]
    return {"metric": runs[0]["test_metric"] if runs else None, "test": scores,
            "val": [float(r[f"selected_val_{r['val_metric']}"]) for r in runs],
            "selected_epoch": [r["selected_epoch"] for r in runs],
            "mean": float(np.mean(scores)) if scores else float("nan"),
            "std": float(np.std(scores, ddof=1)) if len(scores) > 1 else 0.0,
            "seconds": [round(float(r["seconds"]), 1) for r in runs]}


def compare(pyg: PygLinkGraph, service: Callable[[argparse.Namespace], LinkTask], seeds: Sequence[int],
            flags: Sequence[str]) -> dict[str, Any]:
    """Train the same model on both sides for every seed; the report (see the module doc)."""
    sides: dict[str, list[dict[str, Any]]] = {"pyg": [], "service": []}
    for seed in seeds:
        args = train.parse_args(["--servers", "unused:1", *flags, "--seed", str(seed)])
        for side, job in (("pyg", partial(pyg_job, pyg)), ("service", service)):
            started = time.perf_counter()
            result = run(args, ONE, job(args))
            sides[side].append(result)
            log.info("seed %d, %s: test %s %.4f (%.0f s)", seed, side, result["test_metric"],
                     result[f"test_{result['test_metric']}"], time.perf_counter() - started)
    report = {name: summary(runs) for name, runs in sides.items()}
    return {**report, "welch": welch(report["pyg"]["test"], report["service"]["test"]),
            "seeds": list(seeds), "flags": list(flags)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="citation2-small", help="synthetic preset with link splits")
    parser.add_argument("--servers", default=None, help="servers serving a partitioning of --preset")
    parser.add_argument("--service-stand-in", choices=["pyg"], default=None,
                        help="instead of --servers: PyG's loader on both sides (checks the harness)")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--epochs", type=int, default=None, help="default: the trainer flags' 10")
    parser.add_argument("--name", default="link-accuracy", help="results file name (without .json)")
    opts, extra = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (opts.servers is None) == (opts.service_stand_in is None):
        parser.error("--servers or --service-stand-in: expected exactly one of them")
    from partitioner.synthetic import generate

    graph = pyg_graph(generate(opts.preset, progress=False))
    flags = [*TRAIN_FLAGS, *(["--epochs", str(opts.epochs)] if opts.epochs is not None else []), *extra]
    seeds = [int(s) for s in opts.seeds.split(",") if s.strip()]
    started = time.perf_counter()
    if opts.service_stand_in:
        report = compare(graph, partial(pyg_job, graph), seeds, flags)
    else:
        cluster = Cluster(opts.servers, connect_timeout=120.0)
        try:
            report = compare(graph, partial(service_job, cluster=cluster), seeds, flags)
        finally:
            cluster.close()
    source = "servers" if opts.servers else f"{opts.service_stand_in} stand-in"
    payload = {"preset": opts.preset, "service_source": source, **report,
               "seconds": round(time.perf_counter() - started, 1), "machine": machine()}
    path = write_json(opts.name, payload)
    log.info("PyG %.4f ± %.4f, service %.4f ± %.4f (Welch p = %.3g); wrote %s", report["pyg"]["mean"],
             report["pyg"]["std"], report["service"]["mean"], report["service"]["std"], report["welch"]["p"],
             path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
