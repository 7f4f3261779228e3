"""The training loop of ``graphfeed-train``, one for every task and both kinds of graph.

A :class:`Task` says what a run trains (node classification:
:mod:`trainer_client.node_task`; link prediction: :mod:`trainer_client.link_task`): its
model, its training batches and the loss of one of them, how it evaluates a split (an
opaque procedure returning that split's figures, over all ranks) and which figure selects
the model. :func:`run` trains any task alike: each epoch a training pass (DDP, progress
bar, the batches' traffic), an evaluation of ``val``, the selection of the
best-validation weights, the log line and the checkpoints (:mod:`trainer_client.ddp`);
``--resume``; the selected model tested at the end; the metrics. A task that keeps state
beyond its model's weights (an optimizer of its own, a snapshot on the servers) hands it
to the checkpoints (:meth:`Task.state_dict`) and takes it back on ``--resume``; one that
acts after every optimizer step (pushing gradient rows) does it in :meth:`Task.after_step`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from protos.plan import EPOCH_START, EpochProgress
from trainer_client.ddp import (
    Checkpoints,
    DistEnv,
    PartialEpoch,
    RunRecord,
    all_reduce_sums,
    restore_rng,
    restore_selected,
)
from trainer_client.featureless import ServerEmbeddings
from trainer_client.graph import TypedGraph
from trainer_client.models import EDGE_MODELS, NEEDS_EDGE_FEATURES, edge_dim_of
from trainer_client.stream import StreamStats
from trainer_client.typed_models import FIND_UNUSED_PARAMETERS, EmbeddingFactory

log = logging.getLogger("trainer_client.train")


class Batches(Protocol):
    """What the loop needs of any loader (node or link batches): ``len()`` batches per
    epoch (equal on every rank), ``set_epoch`` and the batches."""

    def set_epoch(self, epoch: int) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...


@runtime_checkable
class ResumableBatches(Batches, Protocol):
    """Batches whose epoch can be resumed part way (the servers' loaders and the in-process
    one): :meth:`progress_after` a number of steps, and ``set_epoch`` from it, perhaps
    with another world size."""

    def set_epoch(self, epoch: int, start: EpochProgress = ...) -> None: ...

    def progress_after(self, steps: int) -> EpochProgress: ...


class BatchSource(Batches, Protocol):
    """A node loader: :class:`Batches`, and the seeds' original IDs."""

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
class Step:
    """What a task's training batch gave."""

    #: The loss to minimize, a mean over ``count`` scored items (with its graph).
    loss: torch.Tensor
    #: Items predicted right, of ``count`` scored (labelled seeds, or seed and negative pairs).
    correct: int
    count: int
    #: The batch's training seeds (seed nodes, or positive seed edges).
    seeds: int


@dataclass(kw_only=True)
class Task(ABC):
    """What the loop trains (see the module doc): the run's flags, this rank's place, and
    the loaders the task opened per split when it was built."""

    #: ``--task``.
    name: ClassVar[str]
    args: argparse.Namespace
    env: DistEnv
    graph: TypedGraph
    #: This rank's training batches.
    train: Batches
    #: The evaluation's fanouts (None: exact full-neighbor inference).
    eval_fanouts: list[int] | None
    #: Whose graph it is, for messages ("the servers'", ...).
    source: str = "the servers'"
    #: The featureless types' embeddings when the servers hold them (``--sparse-embedding``);
    #: None: dense ones in the model.
    embeddings: ServerEmbeddings | None = None

    @abstractmethod
    def build_model(self) -> torch.nn.Module:
        """The model, every module the task trains with the loop's optimizer."""

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """What the weights are of (recorded in checkpoints, compared on ``--resume``)."""

    @abstractmethod
    def step(self, model: torch.nn.Module, batch: Any) -> Step:
        """The loss and counts of one training batch (``model`` is DDP's)."""

    @abstractmethod
    def evaluate(self, model: torch.nn.Module, split: str) -> dict[str, float]:
        """The figures of ``split`` ("val", "test") over all ranks; every rank calls it."""

    @abstractmethod
    def metric(self, split: str) -> str:
        """The figure of :meth:`evaluate` that selects the model (``val``) or is reported."""

    @abstractmethod
    def describe(self) -> str:
        """The run's first log line: the graph, the model, the batches, the evaluation."""

    def facts(self) -> dict[str, Any]:
        """The task's own entries of the metrics."""
        return {}

    def embedding_factory(self) -> EmbeddingFactory | None:
        """What makes the featureless types' input modules (None: dense embeddings)."""
        return None if self.embeddings is None else self.embeddings.module

    def start(self) -> None:
        """Called once the model is built (the server-held tables are created then)."""
        if self.embeddings is not None:
            self.embeddings.start()

    def after_step(self) -> None:
        """Called after every optimizer step (the server-held tables' gradients are pushed)."""
        if self.embeddings is not None:
            self.embeddings.step()

    def state_dict(self, selected: bool = False) -> dict[str, Any]:
        """State the checkpoints keep beside the model and the loop's optimizer (tensors
        and plain values; empty: none); ``selected``: the epoch is the best so far (the
        server-held tables are snapshotted, that one kept until a better one)."""
        return {} if self.embeddings is None else self.embeddings.state_dict(selected)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back :meth:`state_dict` of the checkpoint ``--resume`` continues from, or
        of the selected epoch at the end."""
        if self.embeddings is not None:
            self.embeddings.load_state_dict(state)

    def finish(self, model: torch.nn.Module) -> None:
        """Called with the selected model once it is tested (every node's output exported)."""
        del model  # nothing more by default

    def close(self) -> None:
        """Called when the run is over (the server-held tables leave the servers' memory)."""
        if self.embeddings is not None:
            self.embeddings.close()


def loader_options(args: argparse.Namespace, env: DistEnv) -> dict[str, Any]:
    """The options every loader of this rank on the servers takes from the flags (node and
    link loaders alike)."""
    return dict(
        rank=env.rank, world_size=env.world_size, device=env.device, prefetch=args.prefetch, seed=args.seed,
        feature_dtype=args.feature_dtype, stall_timeout=args.timeout,
        reconnect_timeout=args.reconnect_timeout, cache_size=args.cache_size,
        cache_progress=None if env.rank == 0 and not args.no_progress else False,
        edge_features=uses_edge_features(args),
        return_internal_ids=bool(getattr(args, "sparse_embedding", False)))


def sampled_fanouts(args: argparse.Namespace) -> list[int]:
    """Sampled evaluation's fanouts: ``--eval-fanouts`` (``full``: -1 at every hop of
    ``--fanouts``), else ``--fanouts``."""
    if not getattr(args, "eval_fanouts_given", False):
        return list(args.fanouts)
    return list(args.eval_fanouts) if args.eval_fanouts is not None else [-1] * len(args.fanouts)


def uses_edge_features(args: argparse.Namespace) -> bool:
    """Whether the model takes edge features: GINE always, GAT with ``--edge-features``."""
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


# ---- an epoch --------------------------------------------------------------------------


@dataclass
class EpochMetrics:
    """Figures of one epoch's training pass, over all ranks, whatever the task."""

    epoch: int
    #: Mean training loss per scored item (labelled seed, or pair).
    loss: float
    #: Share of the training pass's scored items predicted right.
    train_acc: float
    #: Training seeds over all ranks (seed nodes, or positive seed edges).
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
    #: Rank 0's training streams called again after a break or a stall.
    resumes: int = 0


#: Saves the checkpoint of an epoch taken part way.
KeepPartial = Callable[[PartialEpoch], None]


#: Set when graphfeed-train is asked to stop (SIGINT: Ctrl-C): every step and epoch checks
#: it, so that a KeyboardInterrupt that Python dropped (one raised inside a finalizer is
#: printed and swallowed) still ends the run at the next step.
stop_requested = threading.Event()


def check_stop() -> None:
    """Raise KeyboardInterrupt once a stop was requested (:data:`stop_requested`)."""
    if stop_requested.is_set():
        raise KeyboardInterrupt("stop requested (SIGINT)")


def train_pass(task: Task, model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
               progress: bool, resumed: PartialEpoch | None = None, every: int = 0,
               keep: KeepPartial | None = None) -> EpochMetrics:
    """One training pass over this rank's batches (the rest of the epoch after
    ``resumed``), calling ``keep`` every ``every`` steps of the epoch but its last; the
    figures over all ranks (this rank's seconds, and the traffic of its stream)."""
    model.train()
    train, env = task.train, task.env
    before = resumed.sums if resumed else (0.0,) * 4
    if resumed or every:
        if not isinstance(train, ResumableBatches):
            raise ValueError(f"--checkpoint-every, --resume: the training batches ({type(train).__name__}) "
                             "cannot resume an epoch part way")
        train.set_epoch(epoch, resumed.progress if resumed else EPOCH_START)
    else:
        train.set_epoch(epoch)
    first = resumed.progress.steps if resumed else 0
    sums = [0.0] * 4  # loss x count, correct, count, seeds
    started = time.perf_counter()
    timed = TimedBatches(train, progress, epoch)
    for i, batch in enumerate(timed, start=1):
        check_stop()
        step = task.step(model, batch)
        optimizer.zero_grad(set_to_none=True)
        step.loss.backward()
        optimizer.step()
        task.after_step()
        sums = [a + b for a, b in zip(sums, (float(step.loss.detach()) * step.count, step.correct, step.count,
                                             step.seeds), strict=True)]
        timed.show_loss(step.loss)
        if keep is not None and every and (first + i) % every == 0 and i < len(train):
            assert isinstance(train, ResumableBatches)
            so_far = tuple(a + b for a, b in zip(before, all_reduce_sums(sums, env), strict=True))
            keep(PartialEpoch(epoch, train.progress_after(i), so_far, task.args.seed))
    passed = all_reduce_sums(sums, env)
    loss_sum, correct, count, seeds = (a + b for a, b in zip(before, passed, strict=True))
    seconds = time.perf_counter() - started
    # a stream's figures: the servers' loaders have them, in-process ones receive nothing
    stats: StreamStats = getattr(train, "last_stats", None) or StreamStats()
    return EpochMetrics(epoch, loss_sum / max(count, 1.0), correct / max(count, 1.0), int(seeds),
                        len(train), seconds, 0.0, passed[3] / max(seconds, 1e-9), timed.waited,
                        round(stats.bytes / 1e6, 3),
                        round(stats.hit_rate, 4) if getattr(train, "caches", None) else None,
                        stats.resumes)


def _epoch_line(m: EpochMetrics, metric: str, val: float, improved: bool) -> str:
    traffic = "".join([f", cache hits {m.cache_hit_rate:.1%}" if m.cache_hit_rate is not None else "",
                       f", {m.resumes} stream resumes" if m.resumes else ""])
    return (f"epoch {m.epoch}: loss {m.loss:.4f}, train acc {m.train_acc:.4f}, val {metric} {val:.4f}"
            f"{' (best so far)' if improved else ''}; {m.train_seconds:.1f} s training + "
            f"{m.eval_seconds:.1f} s evaluation, {m.seeds_per_second:.0f} seeds/s (rank 0: waited "
            f"{m.data_wait_seconds:.1f} s for data, received {m.received_mb:.1f} MB{traffic})")


# ---- the run ---------------------------------------------------------------------------


def history_last(history: list[dict[str, Any]]) -> int | None:
    """The last epoch of ``history`` (None: none)."""
    return int(history[-1]["epoch"]) if history else None


def run(args: argparse.Namespace, env: DistEnv, task: Task) -> dict[str, Any]:
    """Train ``task``; validate every epoch and keep the model of the best validation
    figure; test that model at the end; return the metrics."""
    graph, metric = task.graph, task.metric("val")
    torch.manual_seed(args.seed)
    model = task.build_model().to(env.device)
    task.start()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    checkpoints = Checkpoints(args.checkpoint_dir, RunRecord(task.config(), graph.identity(), graph.to_json(),
                                                             task.source))
    state = checkpoints.resume(args.resume, model, optimizer, env, f"val_{metric}")
    if state.start or state.partial:  # resumed
        task.load_state_dict(state.task)
        restore_rng(state.rng, env)
    if state.partial and state.partial.seed != args.seed:
        raise ValueError(f"--seed: the checkpoint in {args.checkpoint_dir} was taken at {state.partial} "
                         f"with --seed {state.partial.seed} (the epoch's order), got {args.seed}")
    log.info("%s", task.describe())
    ddp = model if not env.distributed else DistributedDataParallel(
        model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
        find_unused_parameters=FIND_UNUSED_PARAMETERS.get(args.model, False))
    progress = env.rank == 0 and not args.no_progress and sys.stderr.isatty()
    started = time.perf_counter()
    every = getattr(args, "checkpoint_every", 0)

    def keep(partial: PartialEpoch) -> None:
        checkpoints.keep_partial(partial, state, model, optimizer, env, task.state_dict())

    try:
        for epoch in range(state.start, args.epochs):
            check_stop()
            m = train_pass(task, ddp, optimizer, epoch, progress,
                           state.partial if epoch == state.start else None, every, keep)
            eval_started = time.perf_counter()
            val = task.evaluate(model, "val")
            m.eval_seconds = time.perf_counter() - eval_started
            row = {**asdict(m), **{f"val_{k}": v for k, v in val.items()}}
            kept = task.state_dict(selected=val[metric] > state.selection.score)
            improved = checkpoints.keep(row, val[metric], state, model, optimizer, env, kept)
            log.info("%s", _epoch_line(m, metric, val[metric], improved))
    finally:
        checkpoints.flush()  # the checkpoint being written, also when training failed
    fingerprints = restore_selected(model, state.selection, env)
    if state.selection.task and state.selection.epoch != history_last(state.history):
        task.load_state_dict(state.selection.task)
    test = task.evaluate(model, "test")
    log.info("selected epoch %s (val %s %.4f): test %s", state.selection.epoch, metric, state.selection.score,
             ", ".join(f"{k} {v:.4f}" for k, v in test.items() if k != "count"))
    history = state.history
    task.finish(model)
    task.close()
    return {
        "task": task.name, "graph": graph.name, **({"typed": True} if graph.typed else {}),
        "world_size": env.world_size, "device": str(env.device), "model": task.config(), **task.facts(),
        "fanouts": args.fanouts, "eval_fanouts": "full" if task.eval_fanouts is None else task.eval_fanouts,
        "batch_size": args.batch_size, "batch_size_per_step": args.batch_size * env.world_size,
        "seed": args.seed, "val_metric": metric, "test_metric": task.metric("test"),
        "start_epoch": state.start, "epochs": history, "selected_epoch": state.selection.epoch,
        f"selected_val_{metric}": state.selection.score, **{f"test_{k}": v for k, v in test.items()},
        "param_fingerprints": fingerprints, "seconds": time.perf_counter() - started,
        "seeds_per_second": sum(h["seeds_per_second"] for h in history) / max(len(history), 1),
    }
