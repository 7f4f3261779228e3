"""Server-held embeddings against dense replicated ones (not a test): R-GCN on a typed
graph whose authors, institutions and fields of study have no features (``mag-like``:
ogbn-mag's sizes; ``mag-small``), trained by 2 DDP ranks on gloo, the featureless types'
embeddings either dense ``nn.Embedding`` in the model (their whole gradient all-reduced by
DDP every step) or held by the servers (``RemoteEmbedding`` + ``SparseAdagrad``: each
step reads the batch's rows and pushes their gradients).

Per mode: training steps per second, and bytes a rank moves per step for the embeddings
(dense: the tables' gradients DDP all-reduces; server-held: the rows read and the
gradient rows pushed) and for the rest of the model (DDP); for the server-held mode the
bytes of the tables and of their optimizer state on each server. The modes alternate,
``--passes`` times each, against the same 2 servers, and the report gives medians and the
ratios. The batches (seeds, fanouts, features) are the same in both modes.

    python benchmarks/embeddings.py --data data/bench                   # mag-like
    python benchmarks/embeddings.py --data data/bench --preset mag-small

Writes ``benchmarks/results/embeddings[-<preset>].json``. ``mag-like`` is generated and
partitioned once under ``--data`` (about 2 minutes); each pass runs ``--steps`` steps
after ``--warmup`` per mode.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import machine, write_json

log = logging.getLogger("bench.embeddings")
REPO = Path(__file__).resolve().parents[1]
MODES = ("dense", "server")


def ensure_typed(data: Path, preset: str) -> Path:
    """``preset`` in 2 random partitions under ``data`` (written once)."""
    from partitioner.synthetic import generate_typed
    from partitioner.writer import partition_graph

    out = data / f"{preset}-2"
    if not (out / "manifest.json").is_file():
        log.info("generating %s and partitioning it in 2 into %s", preset, out)
        partition_graph(generate_typed(preset, progress=False), 2, out, method="random", overwrite=True)
    return out


# -- the worker: one rank ------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """One DDP rank training ``args.steps`` steps (after ``args.warmup``) in one mode;
    rank 0 writes the figures to ``args.out``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainer_client import Cluster, RemoteNeighborLoader
    from trainer_client.embeddings import RemoteEmbedding, SparseAdagrad
    from trainer_client.typed_models import build_typed_model, model_inputs

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    server = args.mode == "server"
    device = torch.device(args.device)
    cluster = Cluster(args.servers, client_id=f"emb-bench-rank{rank}")
    loader = RemoteNeighborLoader(cluster, "train", num_neighbors=args.fanouts, batch_size=args.batch_size,
                                  shuffle=True, rank=rank, world_size=world, return_internal_ids=server,
                                  device=device)
    graph = cluster.graph
    tables: dict[str, RemoteEmbedding] = {}

    def remote(t: str, width: int) -> torch.nn.Module:
        tables[t] = RemoteEmbedding(cluster, f"bench/{args.job}/{t}", width, node_type=t, init="uniform",
                                    scale=0.05, job_id=args.job, rank=rank, world_size=world, device=device)
        return tables[t]

    model = build_typed_model("rgcn", graph, hidden_channels=args.hidden, num_layers=len(args.fanouts),
                              dropout=0.0, embeddings=remote if server else None).to(device)
    sparse = SparseAdagrad(list(tables.values()), lr=0.06) if server else None
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    embedding_params = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".embs." in n)
    other_params = sum(p.numel() * p.element_size() for p in model.parameters()) - embedding_params
    times: list[float] = []

    def epochs() -> Iterator[Any]:
        """The loader's batches, epoch after epoch."""
        for epoch in itertools.count():
            loader.set_epoch(epoch)
            yield from loader

    batches = epochs()
    start_bytes = 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start_bytes = sum(t.table.bytes_read + t.table.bytes_sent for t in tables.values() if t.table)
        batch = next(batches)
        dist.barrier()
        started = time.perf_counter()
        out = ddp(*model_inputs(batch))
        labels = batch[graph.target_type].y[: out.shape[0]]
        loss = torch.nn.functional.cross_entropy(out[labels >= 0], labels[labels >= 0])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if sparse is not None:
            sparse.step()
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    moved = sum(t.table.bytes_read + t.table.bytes_sent for t in tables.values() if t.table) - start_bytes
    held = _held(cluster, [t.name for t in tables.values()]) if server else []
    dist.barrier()
    if rank == 0:
        for t in tables.values():
            if t.table is not None:
                t.table.drop(forget=True)
        args.out.write_text(json.dumps({
            "mode": args.mode, "steps": args.steps, "seconds_per_step": statistics.median(times),
            "steps_per_s": 1.0 / statistics.median(times),
            # dense: the tables' gradients, which DDP's all-reduce carries every step
            "embedding_bytes_per_step": moved / args.steps if server else embedding_params,
            "other_bytes_per_step": other_params, "embedding_param_bytes_per_rank": embedding_params,
            "tables_on_servers": held,
        }))
    loader.close()
    cluster.close()
    dist.destroy_process_group()


def _held(cluster: Any, names: list[str]) -> list[dict[str, Any]]:
    """Per server and table: the bytes of its rows and of its optimizer state."""
    from protos import sampling_pb2 as pb
    from protos import sampling_pb2_grpc as pb_grpc

    out = []
    for p in range(cluster.num_partitions):
        stub = pb_grpc.NodeTensorServiceStub(cluster.channel(p))
        for name in names:
            info = stub.FindNodeTensor(pb.FindNodeTensorRequest(name=name), timeout=60)
            out.append({"partition": p, "tensor": name, "rows": info.num_rows, "row_bytes": info.row_bytes,
                        "optimizer_bytes": info.state_bytes})
    return out


# -- the driver ----------------------------------------------------------------------------
def run_mode(args: argparse.Namespace, servers: list[str], mode: str, job: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(Path(__file__).resolve()), "--worker", "--mode", mode, "--servers", ",".join(servers),
               "--out", str(out), "--job", job, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch-size", str(args.batch_size), "--hidden", str(args.hidden),
               "--fanouts", ",".join(map(str, args.fanouts)), "--device", args.device]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            raise RuntimeError(f"{mode} pass failed:\n{proc.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
    log.info("%s: %.2f steps/s, %.1f MB of embeddings per step", mode, result["steps_per_s"],
             result["embedding_bytes_per_step"] / 1e6)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--preset", default="mag-like", choices=["mag-like", "mag-small"])
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1024, help="seeds per rank and step")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--fanouts", type=lambda s: [int(v) for v in s.split(",")], default=[10, 5])
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--device", default="cpu",
                        help="the trainers' device (cpu, cuda: both ranks share it)")
    parser.add_argument("--results-name", default=None, help="results file name (default: by preset)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--servers", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--job", default="bench", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.worker:
        worker(args)
        return
    from server_procs import ServerProcs

    parts = ensure_typed(args.data, args.preset)
    with tempfile.TemporaryDirectory() as state:
        procs = ServerProcs(parts, 2, "--device", "cpu", "--state-dir", state)
        procs.start()
        try:
            for p in range(2):
                procs.wait_status(p, "SERVING", timeout=600)
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
            for i in range(args.passes):
                for mode in MODES:
                    runs[mode].append(run_mode(args, procs.addresses, mode, f"pass{i}"))
        finally:
            procs.stop()
    summary = {m: {"steps_per_s": statistics.median(r["steps_per_s"] for r in rs),
                   "embedding_bytes_per_step": statistics.median(r["embedding_bytes_per_step"] for r in rs),
                   "other_bytes_per_step": rs[0]["other_bytes_per_step"]} for m, rs in runs.items()}
    dense, server = summary["dense"], summary["server"]
    payload = {
        "benchmark": "embeddings", "preset": args.preset, "machine": machine(), "ranks": 2,
        "batch_size_per_rank": args.batch_size, "fanouts": args.fanouts, "hidden": args.hidden,
        "device": args.device,
        "steps": args.steps, "passes": args.passes, "runs": runs, "summary": summary,
        "rows": [{"label": mode, **figures} for mode, figures in summary.items()],
        "tables_on_servers": runs["server"][-1]["tables_on_servers"],
        "embedding_bytes_ratio": dense["embedding_bytes_per_step"] / server["embedding_bytes_per_step"],
        "total_bytes_ratio": (dense["embedding_bytes_per_step"] + dense["other_bytes_per_step"])
        / (server["embedding_bytes_per_step"] + server["other_bytes_per_step"]),
        "speedup": server["steps_per_s"] / dense["steps_per_s"],
    }
    name = args.results_name or ("embeddings" if args.preset == "mag-like" else f"embeddings-{args.preset}")
    path = write_json(name, payload)
    log.info("embedding bytes per step %.1fx fewer, all bytes %.1fx fewer, steps %.2fx faster -> %s",
             payload["embedding_bytes_ratio"], payload["total_bytes_ratio"], payload["speedup"], path)


if __name__ == "__main__":
    main()
