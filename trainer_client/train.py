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

Typed graphs (format v2, e.g. ogbn-mag) train ``--model rgcn`` or ``hetero-sage`` on
``HeteroData`` batches (:mod:`trainer_client.hetero_train`), from the servers or, with
``--partition-dir`` instead of ``--servers``, sampled in this process from the partition
files::

    graphfeed-train --partition-dir parts/mag-2 --model rgcn --fanouts 10,5 --epochs 10
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
from trainer_client.cache import parse_cache_size
from trainer_client.evaluate import accuracy_of, layerwise_logits, sampled_accuracy
from trainer_client.hetero_models import HETERO_MODELS
from trainer_client.loader import MAX_SEEDS, Cluster, RemoteNeighborLoader
from trainer_client.models import MODELS, NodeClassifier, batch_inputs, build_model

log = logging.getLogger("trainer_client.train")

#: File name of the checkpoint inside ``--checkpoint-dir`` (the latest epoch).
CHECKPOINT_NAME = "checkpoint.pt"
#: File name of the checkpoint of the epoch with the best validation accuracy.
BEST_NAME = "best.pt"


# ---- arguments -------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _eval_fanouts(text: str) -> list[int] | None:
    if text.strip().lower() == "full":
        return None
    fanouts = _int_list(text)
    if not fanouts or any(f < -1 for f in fanouts):
        raise argparse.ArgumentTypeError(f"expected 'full' or comma-separated fanouts >= -1, got {text!r}")
    return fanouts


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


def _cache_size(text: str) -> float | str | None:
    if text.strip().lower() == "auto":
        return None
    try:
        parse_cache_size(text, "--cache-size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="graphfeed-train", description="Train a GNN on minibatches from graphfeed sampling servers.")
    p.add_argument("--servers", default=None, help="comma-separated host:port of the sampling servers")
    p.add_argument("--partition-dir", type=Path, default=None,
                   help="instead of --servers: sample in this process from a typed (format v2) "
                        "partition directory on this machine (typed models only)")
    p.add_argument("--fanouts", type=_int_list, default=[10, 5], help="neighbors per hop (default 10,5)")
    p.add_argument("--batch-size", type=_positive(int), default=1024,
                   help="training seeds per batch on each rank: one optimizer step sees "
                        "world size x this (PyG's per-process batch_size)")
    p.add_argument("--eval-batch-size", type=_positive(int), default=None, help="default: --batch-size")
    p.add_argument("--eval-fanouts", type=_eval_fanouts, default=argparse.SUPPRESS,
                   help="neighbors per hop for validation and test, or 'full': exact full-neighbor "
                        "layer-wise inference (the default on homogeneous graphs); on typed graphs "
                        "sampled, by default with --fanouts, 'full' = every neighbor")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=_positive(float), default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--model", choices=[*sorted(MODELS), *HETERO_MODELS], default="sage",
                   help="sage, gcn, gat, gin (homogeneous graphs); rgcn, hetero-sage (typed graphs)")
    p.add_argument("--hidden", type=_positive(int), default=256)
    p.add_argument("--layers", type=_positive(int), default=None, help="default: number of fanouts")
    p.add_argument("--heads", type=_positive(int), default=4, help="attention heads (gat)")
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK when available), cpu, cuda[:i]")
    p.add_argument("--dist-backend", choices=DIST_BACKENDS, default="auto",
                   help="DDP's process group: auto (NCCL on CUDA, gloo on the CPU), nccl or gloo "
                        "(gloo lets several ranks share one GPU: --device cuda:0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feature-dtype", choices=["float32", "float16", "bfloat16", "stored"], default="float32",
                   help="feature dtype on the wire (cast to float32 on the device)")
    p.add_argument("--cache-size", type=_cache_size, default=None,
                   help="trainer-side hot-feature cache: a fraction of the nodes (0.2, '20%%'), a size "
                        "('2GiB') or 0 for none; default 'auto': on a CUDA device every row when the "
                        "features fit in a quarter of its free memory, else the hottest that do; "
                        "0 on the CPU")
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
    args.eval_fanouts_given = hasattr(args, "eval_fanouts")
    if not args.eval_fanouts_given:
        args.eval_fanouts = None
    if (args.servers is None) == (args.partition_dir is None):
        parser.error("--servers or --partition-dir: expected exactly one of them")
    if args.partition_dir is not None and args.model not in HETERO_MODELS:
        parser.error(f"--partition-dir: trains typed models ({', '.join(HETERO_MODELS)}) only, got --model "
                     f"{args.model}; homogeneous graphs train through servers (graphfeed-local)")
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
    #: The process group's backend (``nccl`` or ``gloo``; ``""`` without one).
    backend: str = ""

    @property
    def comm_device(self) -> torch.device:
        """Where this job's own collectives' tensors live: the GPU under NCCL, else the CPU
        (gloo's collectives take CPU tensors; DDP's own buckets go either way)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return default if value is None or value == "" else int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer in the environment, got {value!r}") from None


#: ``--dist-backend`` choices; ``auto``: NCCL on a CUDA device, gloo on the CPU.
DIST_BACKENDS = ("auto", "nccl", "gloo")


def setup_distributed(device: str, timeout: float, backend: str = "auto") -> DistEnv:
    """Read the torchrun environment, pick the device, start the process group (if any).

    ``backend``: one of :data:`DIST_BACKENDS`. gloo on CUDA devices lets several ranks
    share one GPU (``--device cuda:0`` on each), which NCCL refuses."""
    rank, world_size, local_rank = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"RANK, WORLD_SIZE: expected 0 <= RANK < WORLD_SIZE, got {rank}, {world_size}")
    if backend not in DIST_BACKENDS:
        raise ValueError(f"--dist-backend: expected one of {', '.join(DIST_BACKENDS)}, got {backend!r}")
    dev = resolve_device(device, local_rank)
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    elif backend == "nccl" and dev.type != "cuda":
        raise ValueError(f"--dist-backend nccl: expected a CUDA --device, got {str(dev)!r}; "
                         "use gloo on the CPU")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size <= 1:
        return DistEnv(rank, world_size, local_rank, dev)
    # Collectives wait for the slowest rank's batch: bounded by the loader's timeouts.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=3 * timeout + 60))
    return DistEnv(rank, world_size, local_rank, dev, backend)


def resolve_device(device: str, local_rank: int) -> torch.device:
    """The training device: ``auto`` and ``cuda`` mean ``cuda:LOCAL_RANK`` (``auto`` falls
    back to the CPU); CUDA is checked before anything starts."""
    if device == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device: expected auto, cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"--device: expected auto, cpu, cuda or cuda:N, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here (torch.cuda.is_available() is "
                         "False); use --device cpu, or auto")
    index = local_rank if dev.index is None else dev.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"--device {device}: expected a CUDA device in 0 .. {count - 1} on this machine "
                         f"(LOCAL_RANK={local_rank}), got cuda:{index}")
    return torch.device("cuda", index)


def teardown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sums(values: Sequence[float], env: DistEnv) -> list[float]:
    """Sum ``values`` over all ranks (identity without a process group)."""
    if not env.distributed:
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64, device=env.comm_device)
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
    #: Megabytes (10**6 bytes) of batches rank 0 received for the training pass.
    received_mb: float = 0.0
    #: Share of rank 0's feature rows taken from its feature cache (None: no cache).
    cache_hit_rate: float | None = None


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


# ---- checkpoints -----------------------------------------------------------------------


def _model_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"model": args.model, "hidden": args.hidden, "layers": args.layers, "heads": args.heads}


def save_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
                    history: list[dict[str, Any]], config: dict[str, Any]) -> None:
    """Write the checkpoint atomically (state dicts and plain values only: no pickled objects)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                "history": history, "config": config}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    config: dict[str, Any], device: torch.device) -> tuple[int, list[dict[str, Any]]]:
    """Load a checkpoint with ``weights_only=True``; return (next epoch, history)."""
    state = torch.load(path, map_location=device, weights_only=True)
    if state.get("config") != config:
        raise ValueError(f"--resume: checkpoint {path} was written for {state.get('config')}, not {config}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["epoch"]) + 1, list(state["history"])


# ---- main ------------------------------------------------------------------------------


@dataclass
class Loaders:
    """The loaders of one rank. With full-neighbor evaluation, ``val`` and ``test`` only
    name their splits' nodes and ``everything`` streams every node for layer-wise
    inference; with ``--eval-fanouts``, ``val`` and ``test`` stream sampled batches."""

    train: RemoteNeighborLoader
    val: RemoteNeighborLoader
    test: RemoteNeighborLoader
    everything: RemoteNeighborLoader | None


def make_loaders(args: argparse.Namespace, env: DistEnv, cluster: Cluster) -> Loaders:
    """The loaders of this rank, sharing the cluster's channels."""
    common: dict[str, Any] = dict(
        rank=env.rank, world_size=env.world_size, device=env.device,
        prefetch=args.prefetch, seed=args.seed, feature_dtype=args.feature_dtype,
        stall_timeout=args.timeout, reconnect_timeout=args.reconnect_timeout,
        cache_size=args.cache_size,
        cache_progress=None if env.rank == 0 and not args.no_progress else False,
    )
    train = RemoteNeighborLoader(cluster, "train", num_neighbors=args.fanouts, batch_size=args.batch_size,
                                 shuffle=True, **common)
    eval_fanouts = args.eval_fanouts or [-1]
    val = RemoteNeighborLoader(cluster, "val", num_neighbors=eval_fanouts, batch_size=args.eval_batch_size,
                               **common)
    test = RemoteNeighborLoader(cluster, "test", num_neighbors=eval_fanouts, batch_size=args.eval_batch_size,
                                **common)
    everything = None
    if args.eval_fanouts is None:
        if cluster.info.num_nodes > MAX_SEEDS:
            raise ValueError(f"--eval-fanouts full: layer-wise inference streams every node, at most "
                             f"{MAX_SEEDS} (one request), but the graph has {cluster.info.num_nodes}; "
                             "pass --eval-fanouts, e.g. 15,10")
        all_nodes = torch.ones(int(cluster.info.num_nodes), dtype=torch.bool)
        everything = RemoteNeighborLoader(cluster, input_nodes=all_nodes, num_neighbors=[-1],
                                          batch_size=args.eval_batch_size, batches="partition", **common)
    return Loaders(train, val, test, everything)


def evaluate(model: NodeClassifier, loaders: Loaders, env: DistEnv, *, test: bool) -> tuple[float, float]:
    """Validation and (when ``test``) test accuracy (-1.0 when not computed)."""
    if loaders.everything is not None:
        logits, y = layerwise_logits(model, loaders.everything, distributed=env.distributed,
                                     device=env.device)
        val = accuracy_of(logits, y, loaders.val.input_nodes)
        return val, accuracy_of(logits, y, loaders.test.input_nodes) if test else -1.0
    val = sampled_accuracy(model, loaders.val, distributed=env.distributed, device=env.device)
    if not test:
        return val, -1.0
    return val, sampled_accuracy(model, loaders.test, distributed=env.distributed, device=env.device)


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
    mine = total.reshape(1).to(env.comm_device)
    everyone = [torch.zeros_like(mine) for _ in range(env.world_size)]
    dist.all_gather(everyone, mine)
    return [float(t) for t in everyone]


@dataclass
class Selection:
    """The epoch with the best validation accuracy so far, and its model weights."""

    epoch: int | None = None
    val_acc: float = -1.0
    state: dict[str, torch.Tensor] | None = None

    def offer(self, epoch: int, val_acc: float, model: torch.nn.Module) -> bool:
        """Keep ``model``'s weights when ``val_acc`` beats the best so far."""
        if val_acc <= self.val_acc:
            return False
        self.epoch, self.val_acc = epoch, val_acc
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return True

    @classmethod
    def resumed(cls, history: list[dict[str, Any]], best_path: Path | None,
                device: torch.device) -> Selection:
        """The selection of a resumed run: its history's best epoch, with the weights
        of ``best_path`` when that file holds that epoch."""
        if not history:
            return cls()
        best = max(history, key=lambda h: h["val_acc"])
        state = None
        if best_path is not None and best_path.exists():
            saved = torch.load(best_path, map_location=device, weights_only=True)
            if int(saved["epoch"]) == int(best["epoch"]):
                state = saved["model"]
        if state is None:
            log.warning("--resume: no %s for epoch %d; selecting among the epochs from here on",
                        BEST_NAME, best["epoch"])
            return cls()
        return cls(int(best["epoch"]), float(best["val_acc"]), state)



def resume_state(
    args: argparse.Namespace, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    config: dict[str, Any], env: DistEnv,
) -> tuple[Path | None, Path | None, int, list[dict[str, Any]], Selection]:
    """The checkpoint paths (None without ``--checkpoint-dir``), the first epoch, the history
    and the best-validation selection: from the checkpoint with ``--resume``, else fresh."""
    ckpt = args.checkpoint_dir / CHECKPOINT_NAME if args.checkpoint_dir else None
    best_path = args.checkpoint_dir / BEST_NAME if args.checkpoint_dir else None
    start, history = 0, list[dict[str, Any]]()
    if args.resume and ckpt is not None and ckpt.exists():
        start, history = load_checkpoint(ckpt, model, optimizer, config, env.device)
        log.info("resumed from %s at epoch %d", ckpt, start)
    return ckpt, best_path, start, history, Selection.resumed(history, best_path, env.device)


def end_epoch(m: EpochMetrics, history: list[dict[str, Any]], selection: Selection, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer, env: DistEnv, paths: tuple[Path | None, Path | None],
              config: dict[str, Any]) -> None:
    """Record an epoch: its metrics, the best-validation selection, the log line and (rank
    0) the checkpoint at ``paths[0]`` and, when it improved, the best one at ``paths[1]``."""
    history.append(asdict(m))
    improved = selection.offer(m.epoch, m.val_acc, model)
    cache = "" if m.cache_hit_rate is None else f", cache hits {m.cache_hit_rate:.1%}"
    log.info("epoch %d: loss %.4f, train acc %.4f, val acc %.4f%s, %.1f s, %.0f seeds/s "
             "(rank 0: waited %.1f s for data, received %.1f MB%s)", m.epoch, m.loss,
             m.train_acc, m.val_acc, " (best so far)" if improved else "", m.train_seconds,
             m.seeds_per_second, m.data_wait_seconds, m.received_mb, cache)
    ckpt, best_path = paths
    if env.rank == 0 and ckpt is not None:
        save_checkpoint(ckpt, model, optimizer, m.epoch, history, config)
        if improved and best_path is not None:
            save_checkpoint(best_path, model, optimizer, m.epoch, history, config)


def restore_selected(model: torch.nn.Module, selection: Selection, env: DistEnv) -> list[float]:
    """Load the selected epoch's weights (if any); return the replicas' parameter
    fingerprints, with a warning when they differ."""
    if selection.state is not None:
        model.load_state_dict(selection.state)
    fingerprints = parameter_fingerprints(model, env)
    if len(set(fingerprints)) != 1:
        log.warning("model replicas differ across ranks: %s", fingerprints)
    return fingerprints

def run(args: argparse.Namespace, env: DistEnv, cluster: Cluster) -> dict[str, Any]:
    """Train; validate every epoch and keep the model of the best validation accuracy;
    test that model at the end; return the metrics."""
    loaders = make_loaders(args, env, cluster)
    train_loader = loaders.train
    torch.manual_seed(args.seed)
    model = build_model(args.model, train_loader.num_features, train_loader.num_classes,
                        hidden_channels=args.hidden, num_layers=args.layers, dropout=args.dropout,
                        heads=args.heads).to(env.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    config = _model_config(args)
    ckpt, best_path, start, history, selection = resume_state(args, model, optimizer, config, env)
    log.info("batch size %d per rank: %d seeds per optimizer step over %d ranks; evaluation: %s",
             args.batch_size, args.batch_size * env.world_size, env.world_size,
             "full neighbors, layer-wise" if args.eval_fanouts is None else f"fanouts {args.eval_fanouts}")
    ddp: torch.nn.Module = model
    if env.distributed:
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids)
    progress = env.rank == 0 and not args.no_progress and sys.stderr.isatty()
    started = time.perf_counter()
    for epoch in range(start, args.epochs):
        train_loader.set_epoch(epoch)
        loss, train_acc, seeds, train_s = train_epoch(ddp, train_loader, optimizer, env, progress=progress)
        eval_started = time.perf_counter()
        val_acc, _ = evaluate(model, loaders, env, test=False)
        stats = train_loader.last_stats
        m = EpochMetrics(epoch, loss, train_acc, val_acc, seeds, len(train_loader), train_s,
                         time.perf_counter() - eval_started, seeds / max(train_s, 1e-9),
                         stats.wait_seconds, round(stats.bytes / 1e6, 3),
                         None if train_loader.cache is None else round(stats.hit_rate, 4))
        end_epoch(m, history, selection, model, optimizer, env, (ckpt, best_path), config)
    fingerprints = restore_selected(model, selection, env)
    _, test_acc = evaluate(model, loaders, env, test=True)
    log.info("selected epoch %s (val acc %.4f): test acc %.4f", selection.epoch, selection.val_acc, test_acc)
    return {
        "graph": cluster.info.graph_name, "world_size": env.world_size, "device": str(env.device),
        "model": config, "fanouts": args.fanouts, "batch_size": args.batch_size,
        "batch_size_per_step": args.batch_size * env.world_size, "seed": args.seed,
        "eval_fanouts": "full" if args.eval_fanouts is None else args.eval_fanouts,
        "start_epoch": start, "epochs": history, "selected_epoch": selection.epoch,
        "selected_val_acc": selection.val_acc, "test_acc": test_acc,
        "param_fingerprints": fingerprints,
        "seconds": time.perf_counter() - started,
        "seeds_per_second": sum(h["seeds_per_second"] for h in history) / max(len(history), 1),
    }


def run_on_cluster(args: argparse.Namespace, env: DistEnv, cluster: Cluster) -> dict[str, Any]:
    """Train the servers' graph: :func:`run` on a homogeneous graph, the typed path
    (:mod:`trainer_client.hetero_train`) on a typed one (``ClusterInfo.typed``: format v2)."""
    typed = cluster.info.HasField("typed")
    if typed and args.model not in HETERO_MODELS:
        raise ValueError(f"--model {args.model}: the servers serve the typed graph "
                         f"{cluster.info.graph_name!r} (format v2); expected a typed model: "
                         f"{', '.join(HETERO_MODELS)}")
    if not typed and args.model in HETERO_MODELS:
        raise ValueError(f"--model {args.model}: expected a typed graph (format v2), but the servers serve "
                         f"the homogeneous graph {cluster.info.graph_name!r}; use --model "
                         f"{', '.join(sorted(MODELS))}")
    if typed:
        from trainer_client.hetero_train import remote_loaders, run_typed

        return run_typed(args, env, remote_loaders(args, env, cluster))
    return run(args, env, cluster)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (0 ok, 1 a graphfeed or input error)."""
    args = parse_args(argv)
    keep_freed_memory()  # every batch allocates alike: reuse the blocks, skip page faults
    env: DistEnv | None = None
    cluster: Cluster | None = None
    previous_security: list[Security | None] = []  # set once this run sets its own
    try:
        rank = _env_int("RANK", 0)
        logging.basicConfig(
            level=args.log_level.upper() if rank == 0 else logging.WARNING,
            format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
        )
        previous_security.append(set_default_security(Security(
            ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key,
            token=read_token(args.token_file))))
        env = setup_distributed(args.device, args.timeout, args.dist_backend)
        if args.partition_dir is not None:
            from trainer_client.hetero_train import local_loaders, run_typed

            metrics = run_typed(args, env, local_loaders(args, env))
        else:
            log.info("waiting up to %g s for the servers %s", args.timeout, args.servers)
            cluster = Cluster(args.servers, connect_timeout=args.timeout)
            metrics = run_on_cluster(args, env, cluster)
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
        if previous_security:  # an in-process caller keeps its own
            set_default_security(previous_security[0])


if __name__ == "__main__":
    sys.exit(main())
