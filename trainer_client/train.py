"""Train a GNN node classifier on minibatches streamed by graphfeed servers, with DDP.

::

    graphfeed-train --servers node0:50051,node1:50051 --fanouts 10,5 --epochs 10
    torchrun --nproc-per-node 4 -m trainer_client.train --servers ... --checkpoint-dir ckpt

torchrun-compatible: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` come from the environment (NCCL on GPUs, Gloo on CPUs); without them (or
with a world size of 1) it trains in one process without a process group. Every rank
gets the same number of batches per epoch, so no rank waits for another at the end of
an epoch; each wait on the service is bounded by ``--timeout``, and each collective by
the process group's timeout, so a failure ends the job with a clear error instead of
a hang. The process group is destroyed on every exit path.

Each epoch trains on the ``train`` split, evaluates on ``val`` (each rank its share;
counts are all-reduced) and, on rank 0, logs loss / train acc / val acc and saves a
checkpoint (``torch.save`` of state dicts and plain numbers only; ``--resume`` loads it
with ``torch.load(weights_only=True)``). The ``test`` split is evaluated at the end and
``--metrics-json`` receives every figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from protos.allocator import keep_freed_memory
from protos.channel import GraphfeedError
from protos.security import Security, read_token, set_default_security
from trainer_client.loader import Cluster, RemoteNeighborLoader
from trainer_client.models import MODELS, NodeClassifier, batch_inputs, build_model

log = logging.getLogger("trainer_client.train")

#: File name of the checkpoint inside ``--checkpoint-dir``.
CHECKPOINT_NAME = "checkpoint.pt"


# ---- arguments -------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _positive(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a value > 0, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="graphfeed-train", description="Train a GNN on minibatches from graphfeed sampling servers.")
    p.add_argument("--servers", required=True, help="comma-separated host:port of the sampling servers")
    p.add_argument("--fanouts", type=_int_list, default=[10, 5], help="neighbors per hop (default 10,5)")
    p.add_argument("--batch-size", type=_positive(int), default=1024, help="seeds per batch")
    p.add_argument("--eval-batch-size", type=_positive(int), default=None, help="default: --batch-size")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=_positive(float), default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--model", choices=sorted(MODELS), default="sage")
    p.add_argument("--hidden", type=_positive(int), default=256)
    p.add_argument("--layers", type=_positive(int), default=None, help="default: number of fanouts")
    p.add_argument("--heads", type=_positive(int), default=4, help="attention heads (gat)")
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK when available), cpu, cuda[:i]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feature-dtype", choices=["float32", "float16", "bfloat16", "stored"], default="float32",
                   help="feature dtype on the wire (cast to float32 on the device)")
    p.add_argument("--prefetch", type=_positive(int), default=4, help="batches streamed ahead")
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir if it has one")
    p.add_argument("--metrics-json", type=Path, default=None)
    p.add_argument("--timeout", type=_positive(float), default=120.0,
                   help="seconds to wait for servers at start and for a stalled stream before it is resumed")
    p.add_argument("--reconnect-timeout", type=_positive(float), default=15.0,
                   help="seconds a broken stream is retried (a server restarted within this time "
                        "is rejoined) before the server counts as gone")
    p.add_argument("--tls-ca", type=Path, default=None,
                   help="CA (PEM) that signed the servers' certificates: connect with TLS")
    p.add_argument("--tls-cert", type=Path, default=None, help="this trainer's certificate (mutual TLS)")
    p.add_argument("--tls-key", type=Path, default=None, help="this trainer's private key (mutual TLS)")
    p.add_argument("--token-file", type=Path, default=None,
                   help="file holding the servers' bearer token (or set GRAPHFEED_TOKEN_FILE / "
                        "GRAPHFEED_TOKEN)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-level", default="INFO")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.epochs < 0:
        parser.error(f"--epochs: expected >= 0, got {args.epochs}")
    if not args.fanouts or any(f < -1 for f in args.fanouts):
        parser.error(f"--fanouts: expected fanouts >= -1, got {args.fanouts}")
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout: expected 0 <= dropout < 1, got {args.dropout}")
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume: expected --checkpoint-dir too")
    args.layers = args.layers or len(args.fanouts)
    args.eval_batch_size = args.eval_batch_size or args.batch_size
    return args


# ---- distributed setup -----------------------------------------------------------------


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job."""

    #: Global rank (``RANK``).
    rank: int
    #: Number of ranks (``WORLD_SIZE``).
    world_size: int
    #: Rank on this machine (``LOCAL_RANK``), picks the GPU.
    local_rank: int
    #: Device the model trains on.
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return default if value is None or value == "" else int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer in the environment, got {value!r}") from None


def setup_distributed(device: str, timeout: float) -> DistEnv:
    """Read the torchrun environment, pick the device, start the process group (if any)."""
    rank, world_size, local_rank = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"RANK, WORLD_SIZE: expected 0 <= RANK < WORLD_SIZE, got {rank}, {world_size}")
    if device == "auto":
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size > 1:
        backend = "nccl" if dev.type == "cuda" else "gloo"
        # Collectives wait for the slowest rank's batch: bounded by the loader's timeouts.
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=3 * timeout + 60))
    return DistEnv(rank, world_size, local_rank, dev)


def teardown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sums(values: Sequence[float], env: DistEnv) -> list[float]:
    """Sum ``values`` over all ranks (identity without a process group)."""
    if not env.distributed:
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64,
                     device=env.device if env.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return [float(v) for v in t.tolist()]


# ---- one epoch -------------------------------------------------------------------------


@dataclass
class EpochMetrics:
    """Figures of one epoch, over all ranks."""

    epoch: int
    #: Mean training loss per seed.
    loss: float
    #: Accuracy on the training batches' seeds.
    train_acc: float
    #: Accuracy on the validation split.
    val_acc: float
    #: Training seeds over all ranks.
    seeds: int
    #: Batches per rank.
    batches: int
    #: Seconds of the training pass / of validation.
    train_seconds: float
    eval_seconds: float
    #: Training seeds per second over all ranks.
    seeds_per_second: float
    #: Seconds rank 0 waited for batches that had not arrived yet.
    data_wait_seconds: float


def _labeled(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mask = y >= 0
    return out[mask], y[mask]


def train_epoch(
    model: torch.nn.Module, loader: RemoteNeighborLoader, optimizer: torch.optim.Optimizer,
    env: DistEnv, *, progress: bool,
) -> tuple[float, float, int, float]:
    """One pass over this rank's batches; returns (loss, acc, seeds, seconds) over all ranks."""
    model.train()
    loss_sum = correct = count = 0.0
    started = time.perf_counter()
    bar = tqdm(loader, total=len(loader), disable=not progress, desc=f"epoch {loader.epoch}", leave=False)
    for batch in bar:
        optimizer.zero_grad(set_to_none=True)
        out = model(*batch_inputs(batch))
        out, y = _labeled(out, batch.y[: batch.batch_size])
        # Unlabeled seeds are masked out; an empty loss still takes part in DDP's sync.
        loss = F.cross_entropy(out, y, reduction="sum") / max(int(y.numel()), 1)
        loss.backward()
        optimizer.step()
        value = float(loss.detach())
        loss_sum += value * y.numel()
        correct += int((out.argmax(dim=-1) == y).sum())
        count += y.numel()
        if progress:
            bar.set_postfix(loss=f"{value:.4f}")
    seconds = time.perf_counter() - started
    loss_sum, correct, count = all_reduce_sums([loss_sum, correct, count], env)
    return loss_sum / max(count, 1.0), correct / max(count, 1.0), int(count), seconds


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: RemoteNeighborLoader, env: DistEnv) -> float:
    """Accuracy on the loader's split; each rank evaluates its share."""
    model.eval()
    correct = count = 0.0
    for batch in loader:
        out, y = _labeled(model(*batch_inputs(batch)), batch.y[: batch.batch_size])
        correct += int((out.argmax(dim=-1) == y).sum())
        count += y.numel()
    correct, count = all_reduce_sums([correct, count], env)
    return correct / max(count, 1.0)


# ---- checkpoints -----------------------------------------------------------------------


def _model_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"model": args.model, "hidden": args.hidden, "layers": args.layers, "heads": args.heads}


def save_checkpoint(path: Path, model: NodeClassifier, optimizer: torch.optim.Optimizer, epoch: int,
                    history: list[dict[str, Any]], config: dict[str, Any]) -> None:
    """Write the checkpoint atomically (state dicts and plain values only: no pickled objects)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                "history": history, "config": config}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model: NodeClassifier, optimizer: torch.optim.Optimizer,
                    config: dict[str, Any], device: torch.device) -> tuple[int, list[dict[str, Any]]]:
    """Load a checkpoint with ``weights_only=True``; return (next epoch, history)."""
    state = torch.load(path, map_location=device, weights_only=True)
    if state.get("config") != config:
        raise ValueError(f"--resume: checkpoint {path} was written for {state.get('config')}, not {config}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["epoch"]) + 1, list(state["history"])


# ---- main ------------------------------------------------------------------------------


def make_loaders(args: argparse.Namespace, env: DistEnv, cluster: Cluster) -> list[RemoteNeighborLoader]:
    """The train, val and test loaders of this rank, sharing the cluster's channels."""
    common: dict[str, Any] = dict(
        num_neighbors=args.fanouts, rank=env.rank, world_size=env.world_size, device=env.device,
        prefetch=args.prefetch, seed=args.seed, feature_dtype=args.feature_dtype,
        stall_timeout=args.timeout, reconnect_timeout=args.reconnect_timeout,
    )
    return [
        RemoteNeighborLoader(cluster, "train", batch_size=args.batch_size, shuffle=True, **common),
        RemoteNeighborLoader(cluster, "val", batch_size=args.eval_batch_size, **common),
        RemoteNeighborLoader(cluster, "test", batch_size=args.eval_batch_size, **common),
    ]


def parameter_fingerprints(model: torch.nn.Module, env: DistEnv) -> list[float]:
    """A float64 digest of every parameter, from every rank (rank order). DDP keeps the
    replicas bitwise equal, so the digests agree unless the ranks diverged."""
    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            flat = p.detach().to("cpu", torch.float64).flatten()
            total += (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum() * (i + 1)
    if not env.distributed:
        return [float(total)]
    mine = total.reshape(1).to(env.device)
    everyone = [torch.zeros_like(mine) for _ in range(env.world_size)]
    dist.all_gather(everyone, mine)
    return [float(t) for t in everyone]


def run(args: argparse.Namespace, env: DistEnv, cluster: Cluster) -> dict[str, Any]:
    """Train, validate every epoch, test at the end; return the metrics."""
    train_loader, val_loader, test_loader = make_loaders(args, env, cluster)
    torch.manual_seed(args.seed)
    model = build_model(args.model, train_loader.num_features, train_loader.num_classes,
                        hidden_channels=args.hidden, num_layers=args.layers, dropout=args.dropout,
                        heads=args.heads).to(env.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    config = _model_config(args)
    ckpt = args.checkpoint_dir / CHECKPOINT_NAME if args.checkpoint_dir else None
    start, history = 0, list[dict[str, Any]]()
    if args.resume and ckpt is not None and ckpt.exists():
        start, history = load_checkpoint(ckpt, model, optimizer, config, env.device)
        log.info("resumed from %s at epoch %d", ckpt, start)
    ddp: torch.nn.Module = model
    if env.distributed:
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)
    started = time.perf_counter()
    for epoch in range(start, args.epochs):
        train_loader.set_epoch(epoch)
        loss, train_acc, seeds, train_s = train_epoch(
            ddp, train_loader, optimizer, env, progress=env.rank == 0 and not args.no_progress)
        eval_started = time.perf_counter()
        val_acc = evaluate(model, val_loader, env)
        m = EpochMetrics(epoch, loss, train_acc, val_acc, seeds, len(train_loader), train_s,
                         time.perf_counter() - eval_started, seeds / max(train_s, 1e-9),
                         train_loader.last_stats.wait_seconds)
        history.append(asdict(m))
        log.info("epoch %d: loss %.4f, train acc %.4f, val acc %.4f, %.1f s, %.0f seeds/s",
                 epoch, loss, train_acc, val_acc, train_s, m.seeds_per_second)
        if env.rank == 0 and ckpt is not None:
            save_checkpoint(ckpt, model, optimizer, epoch, history, config)
    test_acc = evaluate(model, test_loader, env)
    fingerprints = parameter_fingerprints(model, env)
    if len(set(fingerprints)) != 1:
        log.warning("model replicas differ across ranks: %s", fingerprints)
    log.info("test acc %.4f", test_acc)
    return {
        "graph": cluster.info.graph_name, "world_size": env.world_size, "device": str(env.device),
        "model": config, "fanouts": args.fanouts, "batch_size": args.batch_size, "seed": args.seed,
        "start_epoch": start, "epochs": history, "test_acc": test_acc,
        "param_fingerprints": fingerprints,
        "seconds": time.perf_counter() - started,
        "seeds_per_second": sum(h["seeds_per_second"] for h in history) / max(len(history), 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (0 ok, 1 a graphfeed or input error)."""
    args = parse_args(argv)
    keep_freed_memory()  # every batch allocates alike: reuse the blocks, skip page faults
    env: DistEnv | None = None
    cluster: Cluster | None = None
    try:
        env = setup_distributed(args.device, args.timeout)
        logging.basicConfig(
            level=args.log_level.upper() if env.rank == 0 else logging.WARNING,
            format=f"%(asctime)s rank{env.rank} %(levelname)s %(name)s: %(message)s",
        )
        set_default_security(Security(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key,
                                      token=read_token(args.token_file)))
        log.info("waiting up to %g s for the servers %s", args.timeout, args.servers)
        cluster = Cluster(args.servers, connect_timeout=args.timeout)
        metrics = run(args, env, cluster)
        if env.rank == 0 and args.metrics_json is not None:
            args.metrics_json.parent.mkdir(parents=True, exist_ok=True)
            args.metrics_json.write_text(json.dumps(metrics, indent=2) + "\n")
        return 0
    except (GraphfeedError, ValueError) as exc:
        rank = env.rank if env is not None else _env_int("RANK", 0)
        log.error("rank %d: %s", rank, exc, exc_info=log.isEnabledFor(logging.DEBUG))
        return 1
    finally:
        if cluster is not None:
            cluster.close()
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main())
