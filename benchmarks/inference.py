"""Every node's output of a trained-shape model, three ways (not a test): layer-wise with
the layer tables on the servers (``trainer_client.layerwise``), layer-wise with the
replicated ``[num_nodes, width]`` tables every rank holds and all-reduces per layer (the
evaluation's former path, kept here to compare against), and sampled per-node inference of
every node with the training fanouts. 2 trainer ranks (gloo) against 2 servers (each
holding its own partition's structure and features only), on a
plain graph (GraphSAGE) and a typed one (R-GCN; no replicated path exists for it), 2 and
3 layers.

Per run: seconds, nodes/s (every node of the output type, over the pass's seconds), the
bytes each rank received and sent (batches, table writes, all-reduces), the peak RSS of
each rank and of each server. Sampled inference of a large graph is timed on its first
``--sample-batches`` batches per rank and scaled to all of them (said in the row). The
plain preset's passes also run at a quarter of its size, to show what grows with the
graph. ``--eval-splits`` adds the measurement behind ``--eval``'s default: evaluating the
validation split layer-wise (every node, then the split's rows) against sampled
evaluation of the split, with the training fanouts and with every neighbor (as exact).
``--exactness`` adds each model's largest difference from a one-process full-graph
forward on the small presets.

    python benchmarks/inference.py --data data/bench                       # products-like, mag-like
    python benchmarks/inference.py --data data/bench --plain small --typed mag-small --quick
    python benchmarks/inference.py --plain small --typed mag-small --quick --device cuda --server-device cuda

Writes ``benchmarks/results/inference[-<name>].json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import RESULTS, load_average, machine, read_results, write_json

log = logging.getLogger("bench.inference")
REPO = Path(__file__).resolve().parents[1]
MODES = ("servers", "replicated", "sampled")
FANOUTS = {2: [15, 10], 3: [15, 10, 5]}


# -- graphs --------------------------------------------------------------------------------
def ensure_graph(data: Path, preset: str, fraction: float = 1.0) -> Path:
    """``preset`` (plain or typed; ``fraction``: a plain preset at that share of its nodes
    and edges) in 2 range partitions under ``data``, written once."""
    import dataclasses

    from partitioner.synthetic import PLAIN_PRESETS, TYPED_PRESETS, generate
    from partitioner.writer import partition_graph

    name = preset if fraction == 1.0 else f"{preset}-{fraction:g}"
    out = data / f"inference-{name}-2"
    if not (out / "manifest.json").is_file():
        spec: Any = TYPED_PRESETS.get(preset) or PLAIN_PRESETS[preset]
        if fraction != 1.0:
            spec = dataclasses.replace(spec, num_nodes=int(spec.num_nodes * fraction),
                                       num_undirected_edges=int(spec.num_undirected_edges * fraction),
                                       split_sizes=tuple(int(s * fraction) for s in spec.split_sizes))
        log.info("generating %s and partitioning it in 2 into %s", name, out)
        partition_graph(generate(spec, progress=False), 2, out, method="range", overwrite=True)
    return out


# -- one rank ------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """One rank of one run; writes its figures to ``<out>.<rank>``."""
    import torch.distributed as dist

    from trainer_client import Cluster
    from trainer_client.ddp import DistEnv

    dist.init_process_group("gloo")
    env = DistEnv(dist.get_rank(), dist.get_world_size(), 0, torch.device("cpu"), "gloo")
    cluster = Cluster(args.servers, client_id=f"inference-bench-rank{env.rank}")
    device = torch.device(args.device)
    model = _model(args, cluster).to(device)
    options = dict(rank=env.rank, world_size=env.world_size, stall_timeout=600.0, reconnect_timeout=30.0,
                   device=device)
    dist.barrier()
    started = time.perf_counter()
    figures = {"servers": _on_servers, "replicated": _replicated, "sampled": _sampled,
               "eval-layerwise": _eval_layerwise, "eval-sampled": _eval_sampled}[args.mode](
                   args, cluster, model, env, options)
    seconds = figures.pop("seconds", time.perf_counter() - started)
    dist.barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    Path(f"{args.out}.{env.rank}").write_text(json.dumps({"seconds": seconds, "rank_peak_rss_gib": peak,
                                                          **figures}))
    cluster.close()
    dist.destroy_process_group()


def _model(args: argparse.Namespace, cluster: Any) -> torch.nn.Module:
    from trainer_client.models import build_model
    from trainer_client.typed_models import build_typed_model

    torch.manual_seed(0)
    graph = cluster.graph
    if graph.typed:
        return build_typed_model("rgcn", graph, hidden_channels=args.hidden, num_layers=args.layers).eval()
    return build_model("sage", graph.feature_dims[graph.target_type], graph.num_classes,
                       hidden_channels=args.hidden, num_layers=args.layers).eval()


def _on_servers(args: argparse.Namespace, cluster: Any, model: torch.nn.Module, env: Any,
                options: dict[str, Any]) -> dict[str, Any]:
    from trainer_client.layerwise import LayerwiseInference, ProcessGroup

    inference = LayerwiseInference(model, cluster, ProcessGroup(env), args.batch_size, options,
                                   name=f"bench/{os.getppid()}")
    started = time.perf_counter()
    inference.run()
    seconds = time.perf_counter() - started
    inference.close()
    return {"seconds": seconds, "received_bytes": sum(s.received for s in inference.stats),
            "sent_bytes": sum(s.written for s in inference.stats),
            "nodes": cluster.graph.num_nodes[cluster.graph.target_type]}


@torch.no_grad()
def _replicated(args: argparse.Namespace, cluster: Any, model: Any, env: Any,
                options: dict[str, Any]) -> dict[str, Any]:
    """Layer-wise inference as the evaluation did it before the tables moved to the servers:
    every rank holds a ``[num_nodes, width]`` table per layer and all-reduces it whole."""
    import torch.distributed as dist

    from trainer_client.loader import RemoteNeighborLoader

    graph, gnn = cluster.graph, model.gnn
    num_nodes = graph.num_nodes[graph.target_type]
    received = sent = 0
    h_prev: torch.Tensor | None = None
    for layer in range(gnn.num_layers):
        loader = RemoteNeighborLoader(cluster, input_nodes=graph.target_type, num_neighbors=[-1],
                                      batch_size=args.batch_size, batches="partition",
                                      include_features=layer == 0, include_labels=False,
                                      return_internal_ids=True, **options)
        h: torch.Tensor | None = None
        for batch in loader:
            ids = batch.internal_n_id.cpu()
            x = batch.x if h_prev is None else h_prev[ids].to(batch.edge_index.device)
            out = gnn.inference_per_layer(layer, x, batch.edge_index, batch.batch_size).cpu()
            if h is None:
                h = torch.zeros((num_nodes, out.shape[1]))
            h[ids[: batch.batch_size]] = out
        received += loader.last_stats.bytes
        width = torch.tensor([0 if h is None else h.shape[1]])
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        h = torch.zeros((num_nodes, int(width))) if h is None else h
        dist.all_reduce(h)  # a ring all-reduce sends 2 (n-1)/n of the table per rank
        sent += int(2 * (env.world_size - 1) / env.world_size * h.numel() * h.element_size())
        h_prev = h
        loader.close()
    return {"received_bytes": received, "sent_bytes": sent, "nodes": num_nodes}


@torch.no_grad()
def _sampled(args: argparse.Namespace, cluster: Any, model: Any, env: Any,
             options: dict[str, Any]) -> dict[str, Any]:
    """Every node of the output type on its own sampled neighborhood (the training fanouts)."""
    from trainer_client.loader import RemoteNeighborLoader

    graph = cluster.graph
    loader = RemoteNeighborLoader(cluster, input_nodes=graph.target_type, num_neighbors=FANOUTS[args.layers],
                                  batch_size=args.batch_size, batches="partition", include_labels=False,
                                  **options)
    return _timed_batches(args, loader, model, graph.num_nodes[graph.target_type])


def _timed_batches(args: argparse.Namespace, loader: Any, model: Any, nodes: int) -> dict[str, Any]:
    """A sampled pass's forward over ``loader``'s batches (the first ``--sample-batches``
    timed and scaled to all when set)."""
    from trainer_client.typed_models import model_inputs

    total = len(loader)
    limit = min(total, args.sample_batches) if args.sample_batches else total
    started = time.perf_counter()
    batches = iter(loader)
    for _ in range(limit):
        model(*model_inputs(next(batches)))
    seconds = time.perf_counter() - started
    received = loader.last_stats.bytes
    batches.close()
    loader.close()
    scale = total / max(limit, 1)
    return {"seconds": seconds * scale, "received_bytes": int(received * scale), "sent_bytes": 0,
            "nodes": nodes, "batches_timed": limit, "batches": total}


def _eval_layerwise(args: argparse.Namespace, cluster: Any, model: Any, env: Any,
                    options: dict[str, Any]) -> dict[str, Any]:
    """Validation as ``--eval layerwise`` makes it: every node, then the split's rows."""
    from trainer_client.evaluate import LayerwiseEvaluation
    from trainer_client.loader import RemoteNeighborLoader

    evaluation = LayerwiseEvaluation(cluster, env, args.batch_size, args.layers, options,
                                     name=f"bench/{os.getppid()}")
    target = cluster.graph.target_type
    out = evaluation.output_names([target])[target]
    split = RemoteNeighborLoader(cluster, "val", num_neighbors=[0], batch_size=args.batch_size,
                                 include_features=False, node_tensors={"out": out}, **options)
    started = time.perf_counter()
    with evaluation.outputs(model):
        for _ in split:
            pass
    return {"seconds": time.perf_counter() - started, "nodes": split.num_seeds}


def _eval_sampled(args: argparse.Namespace, cluster: Any, model: Any, env: Any,
                  options: dict[str, Any]) -> dict[str, Any]:
    from trainer_client.loader import RemoteNeighborLoader

    fanouts = FANOUTS[args.layers] if args.fanouts == "training" else [-1] * args.layers
    split = RemoteNeighborLoader(cluster, "val", num_neighbors=fanouts, batch_size=args.batch_size,
                                 **options)
    return _timed_batches(args, split, model, split.num_seeds)


# -- the driver ----------------------------------------------------------------------------
def _peaks(procs: Any) -> list[float]:
    """Each server's peak RSS (GiB) since the last :func:`_reset`."""
    out = []
    for proc in procs.procs:
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                out.append(round(int(line.split()[1]) / (1 << 20), 3))
    return out


def _reset(procs: Any) -> None:
    """Start each server's peak RSS anew (``/proc/<pid>/clear_refs``)."""
    for proc in procs.procs:
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")


def run(args: argparse.Namespace, procs: Any, mode: str, layers: int, **extra: str) -> dict[str, Any]:
    _reset(procs)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(Path(__file__).resolve()), "--worker", "--mode", mode, "--servers",
               ",".join(procs.addresses), "--out", str(out), "--layers", str(layers), "--hidden",
               str(args.hidden), "--batch-size", str(args.batch_size), "--sample-batches",
               str(args.sample_batches), "--device", args.device,
               *[f"--{k}={v}" for k, v in extra.items()]]
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0 and "--max-batch-edges" in proc.stderr:  # the servers refuse it
            why = next(line for line in proc.stderr.splitlines() if "--max-batch-edges" in line)
            log.info("%s (%d layers) refused: %s", mode, layers, why)
            return {"mode": mode, "layers": layers, **extra, "refused": why.split("INVALID_ARGUMENT: ")[-1]}
        if proc.returncode != 0:
            raise RuntimeError(f"{mode} ({layers} layers) failed:\n{proc.stderr[-4000:]}")
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    seconds = max(r["seconds"] for r in ranks)
    row = {"mode": mode, "layers": layers, **extra, "seconds": round(seconds, 2),
           "nodes": ranks[0]["nodes"], "nodes_per_s": round(ranks[0]["nodes"] / seconds, 1),
           "received_mb_per_rank": [round(r.get("received_bytes", 0) / 1e6, 1) for r in ranks],
           "sent_mb_per_rank": [round(r.get("sent_bytes", 0) / 1e6, 1) for r in ranks],
           "rank_peak_rss_gib": [round(r["rank_peak_rss_gib"], 3) for r in ranks],
           "server_peak_rss_gib": _peaks(procs), "load_average": load_average(),
           "wall_seconds": round(time.perf_counter() - started, 1)}
    if "batches_timed" in ranks[0]:
        row["timed"] = f"{ranks[0]['batches_timed']} of {ranks[0]['batches']} batches per rank, scaled"
    log.info("%s", row)
    return row


def measure(args: argparse.Namespace, parts: Path, modes: list[str], evaluation: bool,
            rows: list[dict[str, Any]], save: Callable[[], None]) -> None:
    """Every run of one graph into ``rows`` (``save()`` after each; a run ``rows`` holds
    already is not made again)."""
    from server_procs import ServerProcs

    plan: list[tuple[str, int, dict[str, str]]] = [(mode, layers, {}) for layers in args.layers
                                                   for mode in modes]
    if evaluation:
        plan += [(mode, layers, extra) for layers in args.layers for mode, extra in (
            ("eval-layerwise", {}), ("eval-sampled", {"fanouts": "training"}),
            ("eval-sampled", {"fanouts": "full"}))]
    done = {(r["mode"], r["layers"], r.get("fanouts")) for r in rows}
    plan = [p for p in plan if (p[0], p[1], p[2].get("fanouts")) not in done]
    if not plan:
        return
    with tempfile.TemporaryDirectory(dir=args.data) as state:
        # each server holds its own partition only, as at scale: the other rows come from the peer
        procs = ServerProcs(parts, 2, "--device", args.server_device, "--state-dir", state, "--log-level",
                            "WARNING", "--structure", "partition", "--features", "partition")
        procs.start()
        try:
            for p in range(2):
                procs.wait_status(p, "SERVING", timeout=1800)
            for mode, layers, extra in plan:
                rows.append(run(args, procs, mode, layers, **extra))
                save()
        finally:
            procs.stop()


def link_evaluation(args: argparse.Namespace, preset: str) -> list[dict[str, Any]]:
    """The link task's validation (GraphSAGE, 2 layers, hidden ``--hidden``) through
    ``graphfeed-train --task link --epochs 1`` on 1 rank, by each evaluation: its
    ``eval_seconds``."""
    from server_procs import ServerProcs

    rows = []
    with tempfile.TemporaryDirectory(dir=args.data) as state:
        procs = ServerProcs(ensure_graph(args.data, preset), 2, "--device", "cpu", "--state-dir", state,
                            "--log-level", "WARNING")
        procs.start()
        try:
            for p in range(2):
                procs.wait_status(p, "SERVING", timeout=1800)
            for label, flags in (("layerwise", ["--eval", "layerwise"]),
                                 ("sampled, training fanouts", ["--eval", "sampled"]),
                                 ("sampled, every neighbor",
                                  ["--eval", "sampled", "--eval-fanouts", "-1,-1"])):
                out = Path(state) / "metrics.json"
                cmd = [sys.executable, "-m", "trainer_client.train", "--servers",
                       ",".join(procs.addresses), "--task", "link", "--epochs", "1", "--fanouts", "15,10",
                       "--hidden", str(args.hidden),
                       "--batch-size", str(args.batch_size), "--eval-batch-size", "64", "--no-progress",
                       "--device", "cpu", "--metrics-json", str(out), *flags]
                subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=args.timeout,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
                metrics = json.loads(out.read_text())
                epoch = metrics["epochs"][0]
                rows.append({"mode": f"link {label}", "eval_seconds": round(epoch["eval_seconds"], 2),
                             "val_mrr": round(epoch["val_mrr"], 4), "load_average": load_average()})
                log.info("%s", rows[-1])
        finally:
            procs.stop()
    return rows


def exactness(data: Path) -> dict[str, dict[str, float]]:
    """Each model's largest absolute difference from a one-process full-graph forward, per
    kind of graph: ``small`` (``edge-feat-small`` for GINE) and ``mag-small`` with reverse
    relations, 3 random partitions, 2 ranks (threads), hidden 64."""
    from in_process_servers import serving

    from partitioner import partition_graph
    from partitioner.graph import TypedGraphData
    from partitioner.synthetic import generate

    cases = {"small": ["sage", "gcn", "gat", "gin"], "edge-feat-small": ["gine"],
             "mag-small": ["rgcn", "hetero-sage"]}
    out: dict[str, dict[str, float]] = {"plain": {}, "typed": {}}
    for preset, names in cases.items():
        graph = generate(preset, progress=False)
        graph = graph.add_reverse() if isinstance(graph, TypedGraphData) else graph
        with tempfile.TemporaryDirectory(dir=data) as tmp:
            partition_graph(graph, 3, Path(tmp) / "parts", method="random", progress=False)
            with serving(Path(tmp) / "parts", 3, state_dir=Path(tmp) / "state") as (addresses, _):
                for name in names:
                    kind = "typed" if isinstance(graph, TypedGraphData) else "plain"
                    out[kind][name] = _difference(name, graph, addresses)
                    log.info("exactness: %s %s: %.3g", kind, name, out[kind][name])
    return out


def _difference(name: str, graph: Any, addresses: list[str]) -> float:
    """``name``'s largest absolute difference on ``graph``'s servers at ``addresses``."""
    from layerwise_fixtures import plain_forward, run_pass, typed_forward

    from partitioner.graph import TypedGraphData
    from trainer_client import Cluster
    from trainer_client.models import build_model
    from trainer_client.typed_models import build_typed_model

    torch.manual_seed(0)
    with Cluster(addresses) as cluster:
        facts = cluster.graph
    model: torch.nn.Module
    if isinstance(graph, TypedGraphData):
        model = build_typed_model(name, facts, hidden_channels=64).eval()
        want = typed_forward(model, graph)
    else:
        edge_dim = graph.edge_attr.shape[1] if name == "gine" else None
        model = build_model(name, graph.feature_dim, graph.num_classes, hidden_channels=64,
                            edge_dim=edge_dim).eval()
        want = {"_N": plain_forward(model, graph)}
    got = run_pass(addresses, model, 2, batch_size=512)
    return max(float((got[t] - want[t]).abs().max()) for t in got)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--plain", default="products-like", help="plain preset (GraphSAGE)")
    parser.add_argument("--fraction", type=float, default=1.0,
                        help="the plain preset at this share of its nodes, edges and splits")
    parser.add_argument("--typed", default="mag-like", help="typed preset (R-GCN; '': none)")
    parser.add_argument("--layers", type=lambda s: [int(v) for v in s.split(",")], default=[2, 3])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--sample-batches", type=int, default=40,
                        help="sampled passes: batches per rank timed, then scaled to all (0: all)")
    parser.add_argument("--quick", action="store_true", help="no quarter-size graph")
    parser.add_argument("--eval-splits", action="store_true", help="also measure --eval's default")
    parser.add_argument("--exactness", action="store_true", help="also each model's difference")
    parser.add_argument("--link", default="citation2-small",
                        help="link preset whose validation --eval-splits times through graphfeed-train")
    parser.add_argument("--keep", action="store_true",
                        help="keep the runs the results file holds, make only the others")
    parser.add_argument("--link-only", action="store_true",
                        help="only the link task's evaluations, added to the results of an earlier run")
    parser.add_argument("--exactness-only", action="store_true",
                        help="only each model's difference, added to the results of an earlier run")
    parser.add_argument("--device", default="cpu", help="the trainer ranks' device (cuda: both share it)")
    parser.add_argument("--server-device", default="cpu", help="the servers' sampling device")
    parser.add_argument("--timeout", type=float, default=7200.0)
    parser.add_argument("--results-name", default="inference")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--servers", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--fanouts", default="training", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.worker:
        args.layers = args.layers[0]
        worker(args)
        return
    args.data.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {"benchmark": "inference", "machine": machine(), "ranks": 2, "servers": 2,
                               "device": args.device, "server_device": args.server_device,
                               "hidden": args.hidden, "batch_size": args.batch_size,
                               "sampled_fanouts": {str(k): v for k, v in FANOUTS.items()}, "runs": {}}
    if args.exactness_only or args.link_only:  # added to the results of an earlier run
        payload = read_results(RESULTS / f"{args.results_name}.json")
        if args.exactness_only:
            payload["exactness"] = exactness(args.data)
        if args.link_only:
            payload["runs"][args.link] = link_evaluation(args, args.link)
        log.info("written %s", write_json(args.results_name, payload))
        return
    graphs = [(args.plain, args.fraction, list(MODES), args.eval_splits)]
    if args.typed:
        graphs.append((args.typed, 1.0, ["servers", "sampled"], args.eval_splits))
    if not args.quick:
        graphs.insert(1, (args.plain, args.fraction / 4, ["servers", "replicated"], False))
    if args.keep and (RESULTS / f"{args.results_name}.json").is_file():
        payload["runs"] = read_results(RESULTS / f"{args.results_name}.json")["runs"]

    def save() -> None:
        payload["rows"] = [{"graph": g, **row} for g, rows in payload["runs"].items() for row in rows]
        write_json(args.results_name, payload)  # what is measured so far

    for preset, fraction, modes, evaluation in graphs:
        name = preset if fraction == 1.0 else f"{preset}-{fraction:g}"
        parts = ensure_graph(args.data, preset, fraction)
        measure(args, parts, modes, evaluation, payload["runs"].setdefault(name, []), save)
    if args.eval_splits and not payload["runs"].get(args.link):
        payload["runs"][args.link] = link_evaluation(args, args.link)
        save()
    if args.exactness:
        payload["exactness"] = exactness(args.data)
    path = write_json(args.results_name, payload)
    log.info("written %s", path)


if __name__ == "__main__":
    main()
