"""The trainer's typed path: R-GCN / hetero GraphSAGE on ``HeteroData`` minibatches.

``graphfeed-train --model rgcn|hetero-sage`` on a typed graph (format v2) runs
:func:`run_typed`: the homogeneous trainer's loop, best-validation selection,
checkpoints and metrics (:mod:`trainer_client.train`), with typed models
(:mod:`trainer_client.hetero_models`) over any :class:`~trainer_client.hetero_source.HeteroBatchSource`.

Evaluation is on sampled neighborhoods (``--eval-fanouts``, by default the training
fanouts, as PyG's and DGL's ogbn-mag examples evaluate), each rank its share of the
split, counts summed over the ranks. Full-neighbor layer-wise inference, the homogeneous
default, would have to run every layer over every node of every type; ``--eval-fanouts
full`` on a typed graph instead samples every neighbor (fanout -1 at every hop), which is
exact but grows with the hubs' degrees (a field of study with thousands of papers): for
small graphs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from trainer_client.cluster import Cluster
from trainer_client.hetero_models import (
    NEEDS_UNUSED_PARAMETER_SEARCH,
    HeteroMeta,
    build_hetero_model,
    hetero_batch_inputs,
)
from trainer_client.hetero_source import (
    HeteroBatchSource,
    InProcessHeteroLoader,
    LocalHeteroGraph,
    ServiceHeteroLoader,
)
from trainer_client.loader import RemoteNeighborLoader
from trainer_client.train import (
    DistEnv,
    EpochMetrics,
    all_reduce_sums,
    end_epoch,
    restore_selected,
    resume_state,
)

log = logging.getLogger("trainer_client.train")


@dataclass
class TypedLoaders:
    """The typed batch sources of one rank."""

    train: HeteroBatchSource
    val: HeteroBatchSource
    test: HeteroBatchSource
    #: The graph's name, for the metrics.
    graph_name: str


def eval_fanouts(args: argparse.Namespace) -> list[int]:
    """The typed evaluation fanouts: the training fanouts unless ``--eval-fanouts`` was
    given; ``full`` is -1 at every hop."""
    if not getattr(args, "eval_fanouts_given", False):
        return list(args.fanouts)
    return list(args.eval_fanouts) if args.eval_fanouts is not None else [-1] * len(args.fanouts)


def local_loaders(args: argparse.Namespace, env: DistEnv) -> TypedLoaders:
    """Sources sampling in this process from ``args.partition_dir`` (format v2)."""
    graph = LocalHeteroGraph(args.partition_dir)
    common: dict[str, Any] = dict(rank=env.rank, world_size=env.world_size, device=env.device, seed=args.seed)
    fanouts = eval_fanouts(args)
    return TypedLoaders(
        train=InProcessHeteroLoader(graph, "train", num_neighbors=args.fanouts, batch_size=args.batch_size,
                                    shuffle=True, **common),
        val=InProcessHeteroLoader(graph, "val", num_neighbors=fanouts, batch_size=args.eval_batch_size,
                                  **common),
        test=InProcessHeteroLoader(graph, "test", num_neighbors=fanouts, batch_size=args.eval_batch_size,
                                   **common),
        graph_name=graph.manifest.graph_name)


def remote_loaders(args: argparse.Namespace, env: DistEnv, cluster: Cluster) -> TypedLoaders:
    """Sources streaming typed batches from the servers of ``cluster`` (sharing its
    channels), with the trainer-side feature cache of ``--cache-size`` (every node type
    with features, :func:`~trainer_client.cache.plan_typed_counts`)."""
    common: dict[str, Any] = dict(
        rank=env.rank, world_size=env.world_size, device=env.device, prefetch=args.prefetch,
        seed=args.seed, feature_dtype=args.feature_dtype, stall_timeout=args.timeout,
        reconnect_timeout=args.reconnect_timeout, cache_size=args.cache_size, cache_progress=False)
    fanouts = eval_fanouts(args)
    return TypedLoaders(
        train=ServiceHeteroLoader(RemoteNeighborLoader(cluster, "train", num_neighbors=args.fanouts,
                                                       batch_size=args.batch_size, shuffle=True, **common)),
        val=ServiceHeteroLoader(RemoteNeighborLoader(cluster, "val", num_neighbors=fanouts,
                                                     batch_size=args.eval_batch_size, **common)),
        test=ServiceHeteroLoader(RemoteNeighborLoader(cluster, "test", num_neighbors=fanouts,
                                                      batch_size=args.eval_batch_size, **common)),
        graph_name=cluster.info.graph_name)


def _seeds_and_labels(batch: Any, target: str) -> tuple[int, torch.Tensor]:
    size = int(batch[target].batch_size)
    return size, batch[target].y[:size]


def train_typed_epoch(model: torch.nn.Module, loader: HeteroBatchSource, optimizer: torch.optim.Optimizer,
                      env: DistEnv, *, progress: bool, epoch: int) -> tuple[float, float, int, float, float]:
    """One pass over this rank's batches; (loss, acc, seeds, seconds) over all ranks and
    this rank's seconds spent waiting for batches."""
    model.train()
    target = loader.meta.target_type
    loss_sum = correct = count = 0.0
    waited = 0.0
    started = time.perf_counter()
    batches = iter(tqdm(loader, total=len(loader), disable=not progress, desc=f"epoch {epoch}", leave=False))
    while True:
        asked = time.perf_counter()
        batch = next(batches, None)
        waited += time.perf_counter() - asked
        if batch is None:
            break
        optimizer.zero_grad(set_to_none=True)
        out = model(*hetero_batch_inputs(batch))
        _, y = _seeds_and_labels(batch, target)
        mask = y >= 0
        out, y = out[mask], y[mask]
        # Unlabeled seeds are masked out; an empty loss still takes part in DDP's sync.
        loss = F.cross_entropy(out, y, reduction="sum") / max(int(y.numel()), 1)
        loss.backward()
        optimizer.step()
        loss_sum += float(loss.detach()) * y.numel()
        correct += int((out.argmax(dim=-1) == y).sum())
        count += y.numel()
    seconds = time.perf_counter() - started
    loss_sum, correct, count = all_reduce_sums([loss_sum, correct, count], env)
    return loss_sum / max(count, 1.0), correct / max(count, 1.0), int(count), seconds, waited


@torch.no_grad()
def typed_accuracy(model: torch.nn.Module, loader: HeteroBatchSource, env: DistEnv) -> float:
    """Accuracy on the loader's labelled seeds with its sampled neighborhoods; each rank
    its share, counts summed over the ranks."""
    model.eval()
    loader.set_epoch(0)  # the same draws at every evaluation
    target = loader.meta.target_type
    correct = count = 0.0
    for batch in loader:
        out = model(*hetero_batch_inputs(batch))
        _, y = _seeds_and_labels(batch, target)
        mask = y >= 0
        correct += int((out[mask].argmax(dim=-1) == y[mask]).sum())
        count += int(mask.sum())
    correct, count = all_reduce_sums([correct, count], env)
    return correct / max(count, 1.0)


def _config(args: argparse.Namespace, meta: HeteroMeta) -> dict[str, Any]:
    return {"model": args.model, "hidden": args.hidden, "layers": args.layers, "graph": meta.to_json()}


def _wrap(model: torch.nn.Module, name: str, env: DistEnv) -> torch.nn.Module:
    if not env.distributed:
        return model
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids,
                                   find_unused_parameters=NEEDS_UNUSED_PARAMETER_SEARCH[name])


def run_typed(args: argparse.Namespace, env: DistEnv, loaders: TypedLoaders) -> dict[str, Any]:
    """Train a typed model; validate every epoch and keep the best-validation weights;
    test those at the end; return the metrics (the homogeneous trainer's keys)."""
    meta = loaders.train.meta
    torch.manual_seed(args.seed)
    model = build_hetero_model(args.model, meta, hidden_channels=args.hidden, num_layers=args.layers,
                               dropout=args.dropout).to(env.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    config = _config(args, meta)
    ckpt, best_path, start, history, selection = resume_state(args, model, optimizer, config, env)
    fanouts = eval_fanouts(args)
    log.info("typed graph %s: %s, target %r (%d classes); model %s; batch size %d per rank over %d ranks; "
             "evaluation: sampled, fanouts %s", loaders.graph_name, meta.node_types, meta.target_type,
             meta.num_classes, args.model, args.batch_size, env.world_size, fanouts)
    ddp = _wrap(model, args.model, env)
    progress = env.rank == 0 and not args.no_progress and sys.stderr.isatty()
    started = time.perf_counter()
    for epoch in range(start, args.epochs):
        loaders.train.set_epoch(epoch)
        loss, train_acc, seeds, train_s, waited = train_typed_epoch(ddp, loaders.train, optimizer, env,
                                                                     progress=progress, epoch=epoch)
        eval_started = time.perf_counter()
        val_acc = typed_accuracy(model, loaders.val, env)
        received, hit_rate = 0, None  # in process: nothing received, no cache
        if isinstance(loaders.train, ServiceHeteroLoader):
            stats = loaders.train.loader.last_stats
            received = stats.bytes
            hit_rate = round(stats.hit_rate, 4) if loaders.train.loader.typed_caches else None
        m = EpochMetrics(epoch, loss, train_acc, val_acc, seeds, len(loaders.train), train_s,
                         time.perf_counter() - eval_started, seeds / max(train_s, 1e-9), waited,
                         round(received / 1e6, 3), hit_rate)
        end_epoch(m, history, selection, model, optimizer, env, (ckpt, best_path), config)
    fingerprints = restore_selected(model, selection, env)
    test_acc = typed_accuracy(model, loaders.test, env)
    log.info("selected epoch %s (val acc %.4f): test acc %.4f", selection.epoch, selection.val_acc, test_acc)
    return {
        "graph": loaders.graph_name, "typed": True, "world_size": env.world_size, "device": str(env.device),
        "model": {k: v for k, v in config.items() if k != "graph"}, "fanouts": args.fanouts,
        "batch_size": args.batch_size, "batch_size_per_step": args.batch_size * env.world_size,
        "seed": args.seed, "eval_fanouts": fanouts, "start_epoch": start, "epochs": history,
        "selected_epoch": selection.epoch, "selected_val_acc": selection.val_acc, "test_acc": test_acc,
        "param_fingerprints": fingerprints, "seconds": time.perf_counter() - started,
        "seeds_per_second": sum(h["seeds_per_second"] for h in history) / max(len(history), 1),
    }
