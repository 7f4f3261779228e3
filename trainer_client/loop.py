"""The training loop of ``graphfeed-train``, one for both kinds of graph.

A :class:`Job` is what one run trains on: its batch sources (the servers' loaders, or the
in-process loader of ``--partition-dir``), the graph's facts and how it is evaluated
(:func:`evaluation_fanouts`). :func:`run` trains it: each epoch trains on ``train``,
evaluates ``val`` (each rank its share, counts summed over the ranks), keeps the
best-validation weights, logs and checkpoints (:mod:`trainer_client.ddp`); the selected
model is tested at the end. A model reads a batch of either kind through
:func:`~trainer_client.typed_models.model_inputs`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from trainer_client.cluster import Cluster
from trainer_client.ddp import (
    DistEnv,
    EpochMetrics,
    RunRecord,
    all_reduce_sums,
    end_epoch,
    restore_selected,
    resume_state,
)
from trainer_client.evaluate import accuracy_of, labeled, layerwise_logits
from trainer_client.graph import PLAIN_NODE_TYPE, TypedGraph
from trainer_client.in_process import InProcessLoader, LocalGraph
from trainer_client.inputs import MAX_SEEDS
from trainer_client.loader import RemoteNeighborLoader
from trainer_client.models import (
    EDGE_MODELS,
    MODELS,
    NEEDS_EDGE_FEATURES,
    NodeClassifier,
    build_model,
    edge_dim_of,
    seed_labels,
)
from trainer_client.typed_models import FIND_UNUSED_PARAMETERS, TYPED_MODELS, build_typed_model, model_inputs

log = logging.getLogger("trainer_client.train")


class Batches(Protocol):
    """What a training loop needs of any loader (node or link batches): ``len()``
    batches per epoch (equal on every rank), ``set_epoch`` and the batches."""

    def set_epoch(self, epoch: int) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...


class BatchSource(Batches, Protocol):
    """What the node loop needs of a loader: :class:`Batches`, and the seeds' original IDs."""

    @property
    def input_nodes(self) -> torch.Tensor: ...


class TimedBatches:
    """The batches of one pass behind a progress bar (shown when ``progress``), counting
    in :attr:`waited` the seconds this rank waited for them."""

    def __init__(self, source: Batches, progress: bool, epoch: int) -> None:
        self.bar = tqdm(source, total=len(source), disable=not progress, desc=f"epoch {epoch}", leave=False)
        self.progress = progress
        self.waited = 0.0

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.bar)
        while True:
            asked = time.perf_counter()
            batch = next(batches, None)
            self.waited += time.perf_counter() - asked
            if batch is None:
                return
            yield batch

    def show_loss(self, loss: torch.Tensor) -> None:
        """Show a batch's loss beside the bar."""
        if self.progress:
            self.bar.set_postfix(loss=f"{float(loss.detach()):.4f}")


@dataclass
class Job:
    """What one run trains on."""

    train: BatchSource
    val: BatchSource
    test: BatchSource
    #: The graph's facts.
    graph: TypedGraph
    #: Fanouts of the sampled evaluation; None: full-neighbor layer-wise inference over
    #: :attr:`everything` (``val`` and ``test`` then only name their splits' nodes).
    eval_fanouts: list[int] | None
    #: Every node, one hop with every neighbor, for layer-wise inference.
    everything: RemoteNeighborLoader | None = None
    #: Whose graph it is, for messages.
    source: str = "the servers'"


def evaluation_fanouts(args: argparse.Namespace, typed: bool) -> list[int] | None:
    """The evaluation's fanouts (None: full-neighbor layer-wise inference, a plain graph's
    default). Typed graphs are evaluated on samples, as PyG's and DGL's ogbn-mag examples
    do (layer-wise inference would run every layer over every node of every type): the
    training fanouts unless ``--eval-fanouts`` was given, ``full`` being -1 at every hop."""
    if not typed:
        return None if args.eval_fanouts is None else list(args.eval_fanouts)
    if not getattr(args, "eval_fanouts_given", False):
        return list(args.fanouts)
    return list(args.eval_fanouts) if args.eval_fanouts is not None else [-1] * len(args.fanouts)


def _split_loaders(make: Callable[..., Any], args: argparse.Namespace, fanouts: list[int],
                   **common: Any) -> list[Any]:
    """The train, val and test loaders ``make(split, num_neighbors=, batch_size=, ...)``
    builds: the training split shuffled, the others with ``fanouts``."""
    return [make("train", num_neighbors=args.fanouts, batch_size=args.batch_size, shuffle=True, **common)] + \
        [make(split, num_neighbors=fanouts, batch_size=args.eval_batch_size, shuffle=False, **common)
         for split in ("val", "test")]


def loader_options(args: argparse.Namespace, env: DistEnv) -> dict[str, Any]:
    """The options every loader of this rank on the servers takes from the flags (node and
    link loaders alike)."""
    return dict(
        rank=env.rank, world_size=env.world_size, device=env.device, prefetch=args.prefetch, seed=args.seed,
        feature_dtype=args.feature_dtype, stall_timeout=args.timeout,
        reconnect_timeout=args.reconnect_timeout, cache_size=args.cache_size,
        cache_progress=None if env.rank == 0 and not args.no_progress else False,
        edge_features=uses_edge_features(args))


def cluster_job(args: argparse.Namespace, env: DistEnv, cluster: Cluster) -> Job:
    """The loaders of this rank on the servers' graph, sharing the cluster's channels, with
    the trainer-side feature cache of ``--cache-size``."""
    graph = cluster.graph
    check_model_kind(args.model, graph, "the servers serve")
    common = loader_options(args, env)
    fanouts = evaluation_fanouts(args, graph.typed)
    if fanouts is None and uses_edge_features(args):  # layer-wise inference takes no edge features
        fanouts = [-1] * len(args.fanouts)
    train, val, test = _split_loaders(partial(RemoteNeighborLoader, cluster), args, fanouts or [-1],
                                      **common)
    everything = None
    if fanouts is None:
        if cluster.info.num_nodes > MAX_SEEDS:
            raise ValueError(f"--eval-fanouts full: layer-wise inference streams every node, at most "
                             f"{MAX_SEEDS} (one request), but the graph has {cluster.info.num_nodes}; "
                             "pass --eval-fanouts, e.g. 15,10")
        all_nodes = torch.ones(int(cluster.info.num_nodes), dtype=torch.bool)
        everything = RemoteNeighborLoader(cluster, input_nodes=all_nodes, num_neighbors=[-1],
                                          batch_size=args.eval_batch_size, batches="partition", **common)
    return Job(train, val, test, graph=graph, eval_fanouts=fanouts, everything=everything)


def check_model_kind(model: str, graph: TypedGraph, where: str) -> None:
    """Refuse a model of the other kind of graph than ``graph`` (``where``: "the servers
    serve", "--partition-dir holds")."""
    if graph.typed and model not in TYPED_MODELS:
        raise ValueError(f"--model {model}: {where} the typed graph {graph.name!r} (format v2); expected "
                         f"a typed model: {', '.join(TYPED_MODELS)}")
    if not graph.typed and model in TYPED_MODELS:
        raise ValueError(f"--model {model}: expected a typed graph (format v2), but {where} the "
                         f"homogeneous graph {graph.name!r}; use --model {', '.join(sorted(MODELS))}")


def partition_dir_job(args: argparse.Namespace, env: DistEnv) -> Job:
    """Loaders sampling in this process from ``--partition-dir`` (either kind of graph).
    Evaluation is sampled: a plain graph's default ``full`` samples every neighbor at
    every hop (the same logits as layer-wise inference, batch by batch)."""
    local = LocalGraph(args.partition_dir)
    check_model_kind(args.model, local.meta, "--partition-dir holds")
    fanouts = evaluation_fanouts(args, local.meta.typed) or [-1] * len(args.fanouts)
    train, val, test = _split_loaders(partial(InProcessLoader, local), args, fanouts, rank=env.rank,
                                      world_size=env.world_size, device=env.device, seed=args.seed,
                                      edge_features=uses_edge_features(args))
    return Job(train, val, test, graph=local.meta, eval_fanouts=fanouts, source="the partition directory's")


def build_job_model(args: argparse.Namespace, graph: TypedGraph) -> torch.nn.Module:
    """The model of ``--model`` for ``graph``."""
    if graph.typed:
        return build_typed_model(args.model, graph, hidden_channels=args.hidden, num_layers=args.layers,
                                 dropout=args.dropout)
    return build_model(args.model, graph.feature_dims[PLAIN_NODE_TYPE], graph.num_classes,
                       hidden_channels=args.hidden, num_layers=args.layers, dropout=args.dropout,
                       heads=args.heads, edge_dim=model_edge_dim(args, graph))


def uses_edge_features(args: argparse.Namespace) -> bool:
    """Whether the job's model takes edge features: GINE always, GAT with ``--edge-features``."""
    return args.model in NEEDS_EDGE_FEATURES or (args.model in EDGE_MODELS
                                                  and bool(getattr(args, "edge_features", False)))


def model_edge_dim(args: argparse.Namespace, graph: TypedGraph) -> int | None:
    """The model's ``edge_dim`` (None: it takes no edge features); refuses a model that
    needs edge features on a graph without them, and ``--edge-features`` on a model that
    takes none."""
    if getattr(args, "edge_features", False) and args.model not in EDGE_MODELS:
        raise ValueError(f"--edge-features: expected a model that takes edge features "
                         f"({', '.join(sorted(EDGE_MODELS))}), got --model {args.model}")
    if not uses_edge_features(args):
        return None
    shape = graph.edge_feature_shapes.get(graph.edge_types[0]) if not graph.typed else None
    if shape is None or not graph.has_edge_ids:
        raise ValueError(f"--model {args.model}{' --edge-features' if args.model == 'gat' else ''}: "
                         f"expected a graph with edge features, {graph.name!r} has none")
    return edge_dim_of(shape)


def one_pass(model: torch.nn.Module, source: BatchSource, env: DistEnv,
             optimizer: torch.optim.Optimizer | None = None, *, progress: bool = False,
             epoch: int = 0) -> tuple[float, float, int, float, float]:
    """One pass over this rank's batches: a training step on each with ``optimizer``,
    else an evaluation of the labelled seeds (the same draws every time: epoch 0). Returns
    (loss, accuracy, seeds) over all ranks, and this rank's seconds in all and waiting for
    its batches."""
    training = optimizer is not None
    model.train(training)
    if not training:
        source.set_epoch(0)
    loss_sum = correct = count = 0.0
    started = time.perf_counter()
    timed = TimedBatches(source, progress, epoch)
    with torch.set_grad_enabled(training):
        for batch in timed:
            out, y = labeled(model(*model_inputs(batch)), seed_labels(batch))
            # Unlabeled seeds are masked out; an empty loss still takes part in DDP's sync.
            loss = F.cross_entropy(out, y, reduction="sum") / max(int(y.numel()), 1)
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            loss_sum += float(loss.detach()) * y.numel()
            correct += int((out.argmax(dim=-1) == y).sum())
            count += y.numel()
            timed.show_loss(loss)
    loss_sum, correct, count = all_reduce_sums([loss_sum, correct, count], env)
    return loss_sum / max(count, 1.0), correct / max(count, 1.0), int(count), \
        time.perf_counter() - started, timed.waited


def evaluate(model: torch.nn.Module, job: Job, env: DistEnv, *, test: bool) -> tuple[float, float]:
    """Validation and (when ``test``) test accuracy (-1.0 when not computed)."""
    if job.everything is not None:
        assert isinstance(model, NodeClassifier)
        logits, y = layerwise_logits(model, job.everything, distributed=env.distributed, device=env.device)
        val = accuracy_of(logits, y, job.val.input_nodes)
        return val, accuracy_of(logits, y, job.test.input_nodes) if test else -1.0
    val = one_pass(model, job.val, env)[1]
    return val, one_pass(model, job.test, env)[1] if test else -1.0


def _traffic(source: BatchSource) -> tuple[float, float | None]:
    """Megabytes received for the last epoch's batches and the feature caches' hit rate
    (None without a cache; nothing is received in process)."""
    if not isinstance(source, RemoteNeighborLoader):
        return 0.0, None
    stats = source.last_stats
    return round(stats.bytes / 1e6, 3), round(stats.hit_rate, 4) if source.caches else None


def run(args: argparse.Namespace, env: DistEnv, job: Job) -> dict[str, Any]:
    """Train; validate every epoch and keep the model of the best validation accuracy;
    test that model at the end; return the metrics."""
    graph = job.graph
    torch.manual_seed(args.seed)
    model = build_job_model(args, graph).to(env.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    config = {"model": args.model, "hidden": args.hidden, "layers": args.layers}  # what the weights are of
    record = RunRecord(config if graph.typed else {**config, "heads": args.heads},  # --heads: the plain GAT's
                       graph.identity(), graph.to_json(), job.source)
    ckpt, best_path, start, history, selection = resume_state(args, model, optimizer, record, env)
    kind = f"typed: {list(graph.node_types)}, target {graph.target_type!r}" if graph.typed else "plain"
    log.info("graph %s (%s, %d classes): model %s; batch size %d per rank: %d seeds per optimizer step over "
             "%d ranks; evaluation: %s", graph.name, kind, graph.num_classes, args.model, args.batch_size,
             args.batch_size * env.world_size, env.world_size,
             "full neighbors, layer-wise" if job.eval_fanouts is None else
             f"sampled, fanouts {job.eval_fanouts}")
    ddp = model if not env.distributed else DistributedDataParallel(
        model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
        find_unused_parameters=FIND_UNUSED_PARAMETERS.get(args.model, False))
    progress = env.rank == 0 and not args.no_progress and sys.stderr.isatty()
    started = time.perf_counter()
    for epoch in range(start, args.epochs):
        job.train.set_epoch(epoch)
        loss, train_acc, seeds, train_s, waited = one_pass(ddp, job.train, env, optimizer,
                                                           progress=progress, epoch=epoch)
        eval_started = time.perf_counter()
        val_acc, _ = evaluate(model, job, env, test=False)
        m = EpochMetrics(epoch, loss, train_acc, val_acc, seeds, len(job.train), train_s,
                         time.perf_counter() - eval_started, seeds / max(train_s, 1e-9), waited,
                         *_traffic(job.train))
        end_epoch(m, history, selection, model, optimizer, env, (ckpt, best_path), record)
    fingerprints = restore_selected(model, selection, env)
    _, test_acc = evaluate(model, job, env, test=True)
    log.info("selected epoch %s (val acc %.4f): test acc %.4f", selection.epoch, selection.val_acc, test_acc)
    return {
        "graph": graph.name, **({"typed": True} if graph.typed else {}), "world_size": env.world_size,
        "device": str(env.device), "model": record.config, "fanouts": args.fanouts,
        "batch_size": args.batch_size, "batch_size_per_step": args.batch_size * env.world_size,
        "seed": args.seed, "eval_fanouts": "full" if job.eval_fanouts is None else job.eval_fanouts,
        "start_epoch": start, "epochs": history, "selected_epoch": selection.epoch,
        "selected_val_acc": selection.val_acc, "test_acc": test_acc, "param_fingerprints": fingerprints,
        "seconds": time.perf_counter() - started,
        "seeds_per_second": sum(h["seeds_per_second"] for h in history) / max(len(history), 1),
    }
