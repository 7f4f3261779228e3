"""``graphfeed-train --task link``: train a link predictor on seed-edge batches and
evaluate it with OGB's protocols, on either kind of graph, with DDP.

A :class:`LinkJob` is what one run trains on: the training split's batches (binary
negatives, ``--neg-ratio`` per positive, optionally strict and with the batch's positive
seed edges excluded from message passing), and how validation and test are evaluated
(:func:`evaluation_protocol`, from the graph's stored link splits):

* ``given``: the split stores negatives per edge (ogbl-citation2): MRR and Hits@1/3/10 of
  each positive ranked against its own K negatives;
* ``hits``: a ``<split>_neg`` split exists (ogbl-collab): Hits@K (``--hits-k``, 50) of the
  positives against the shared negative edges;
* ``sampled``: neither: MRR against ``--eval-negatives`` negatives drawn per positive
  (triplet mode, the same draws every evaluation).

Evaluation runs on sampled neighborhoods (``--eval-fanouts``, default ``--fanouts``). Each
rank scores its own share of a split (each positive lies in exactly one rank's batches);
the ranks add their sums, and for Hits@K agree on the K-th highest negative score first
(:mod:`trainer_client.link_metrics`), so every positive is counted once. :func:`run_link`
trains, selects the epoch of the best validation figure (MRR, or Hits@K), keeps its
checkpoint (``best.pt``), tests that model and returns the metrics, as the node task's
:func:`trainer_client.loop.run` does, reusing its checkpoints and selection
(:mod:`trainer_client.ddp`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch_geometric.data import HeteroData

from partitioner.graph import EdgeType, edge_type_name
from trainer_client.cluster import Cluster
from trainer_client.ddp import DistEnv, RunRecord, all_reduce_sums, keep_epoch, restore_selected, resume_state
from trainer_client.graph import TypedGraph
from trainer_client.link_loader import RemoteLinkNeighborLoader
from trainer_client.link_metrics import hits_at_k, ogb_ranks, ranking_means, ranking_sums
from trainer_client.link_models import LINK_MODELS, LinkPredictor, build_link_model, link_inputs, link_targets
from trainer_client.loop import Batches, TimedBatches, evaluation_fanouts, loader_options, model_edge_dim
from trainer_client.typed_models import FIND_UNUSED_PARAMETERS, TYPED_MODELS

log = logging.getLogger("trainer_client.train")

#: ``--exclude`` choices (``none``: PyG's behaviour, seed edges stay in message passing).
EXCLUDE_CHOICES = ("none", "self", "reverse")
#: Evaluation protocols (see the module doc).
PROTOCOLS = ("given", "hits", "sampled")


#: What the loop needs of a link loader (the node loop's :class:`~trainer_client.loop.Batches`).
LinkSource = Batches


class SplitFacts(Protocol):
    """What the trainer reads of a stored link split's facts."""

    @property
    def edge_type(self) -> EdgeType: ...

    @property
    def num_edges(self) -> int: ...

    @property
    def num_negatives(self) -> int: ...


#: ``make(split, num_neighbors=, batch_size=, shuffle=, neg_sampling=, ...)``: a loader
#: of one link split for this rank (the service's or PyG's).
LinkLoaderFactory = Callable[..., LinkSource]


@dataclass
class LinkEvaluation:
    """How one split is evaluated (see the module doc)."""

    #: The split ("val", "test").
    split: str
    #: One of :data:`PROTOCOLS`.
    protocol: str
    #: The split's batches: triplet layout for ``given`` and ``sampled``, its positive
    #: edges for ``hits``.
    positives: LinkSource
    #: ``hits``: the batches of the negative edges (``<split>_neg``); else None.
    negatives: LinkSource | None
    #: Negatives per positive (``given``, ``sampled``), or the K of Hits@K.
    k: int

    @property
    def metric(self) -> str:
        """The figure that selects the model: ``mrr`` or ``hits@K``."""
        return f"hits@{self.k}" if self.protocol == "hits" else "mrr"

    def describe(self) -> str:
        if self.protocol == "hits":
            return f"Hits@{self.k} against {self.split}_neg"
        kind = "stored" if self.protocol == "given" else "sampled"
        return f"MRR against {self.k} {kind} negatives per edge"


@dataclass
class LinkJob:
    """What one link run trains on."""

    train: LinkSource
    val: LinkEvaluation
    test: LinkEvaluation
    #: The graph's facts (what the model is built for).
    graph: TypedGraph
    #: The seed edges' type.
    edge_type: EdgeType
    #: Fanouts of the evaluation.
    eval_fanouts: list[int] = field(default_factory=list)
    #: Whose graph it is, for messages.
    source: str = "the servers'"


def evaluation_protocol(splits: Mapping[str, SplitFacts], split: str, *, eval_negatives: int,
                        hits_k: int) -> tuple[str, int]:
    """``(protocol, k)`` of evaluating ``split`` (see the module doc)."""
    if split not in splits:
        raise ValueError(f"link split {split!r}: expected the graph to store it, found {sorted(splits)}; "
                         "partition with link splits (graphfeed-partition ... --link-split)")
    if int(splits[split].num_negatives) > 0:
        return "given", int(splits[split].num_negatives)
    if f"{split}_neg" in splits:
        return "hits", hits_k
    return "sampled", eval_negatives


def _exclude(args: argparse.Namespace) -> str | None:
    return None if args.exclude == "none" else str(args.exclude)


def build_link_job(make: LinkLoaderFactory, splits: Mapping[str, SplitFacts], graph: TypedGraph,
                   args: argparse.Namespace, source: str = "the servers'") -> LinkJob:
    """The loaders of a link run from ``make`` and the graph's stored ``splits``."""
    if "train" not in splits:
        raise ValueError(f"--task link: expected a link split 'train' in {source} graph {graph.name!r}, "
                         f"found {sorted(splits) or 'none'}; partition it with link splits (--link-split)")
    edge_type = tuple(splits["train"].edge_type)
    edge_type = (str(edge_type[0]), str(edge_type[1]), str(edge_type[2]))
    fanouts = evaluation_fanouts(args, True)  # sampled: --eval-fanouts, else --fanouts ('full': -1s)
    assert fanouts is not None
    train = make("train", num_neighbors=list(args.fanouts), batch_size=args.batch_size, shuffle=True,
                 neg_sampling=dict(mode="binary", amount=args.neg_ratio),
                 strict_negatives=args.strict_negatives, exclude=_exclude(args))

    def evaluation(split: str) -> LinkEvaluation:
        protocol, k = evaluation_protocol(splits, split, eval_negatives=args.eval_negatives,
                                          hits_k=args.hits_k)
        if tuple(splits[split].edge_type) != edge_type:
            raise ValueError(f"link split {split!r}: expected edges of {edge_type_name(edge_type)} as "
                             f"'train', got {edge_type_name(splits[split].edge_type)}")
        each = dict(num_neighbors=fanouts, batch_size=args.eval_batch_size, shuffle=False)
        negatives = None
        if protocol == "given":
            positives = make(split, neg_sampling="given", **each)
        elif protocol == "sampled":
            positives = make(split, neg_sampling=dict(mode="triplet", amount=k),
                             strict_negatives=args.strict_negatives, **each)
        else:
            positives = make(split, neg_sampling=None, **each)
            negatives = make(f"{split}_neg", neg_sampling=None, **each)
        return LinkEvaluation(split, protocol, positives, negatives, k)

    return LinkJob(train, evaluation("val"), evaluation("test"), graph, edge_type, fanouts, source)


def service_loader_class() -> Callable[..., LinkSource]:
    """The service's link loader."""
    loader: Callable[..., LinkSource] = RemoteLinkNeighborLoader
    return loader


def link_splits_of(graph: Any, where: str) -> Mapping[str, SplitFacts]:
    """``graph.link_splits`` (split name to facts), refused when there are none."""
    splits: Mapping[str, SplitFacts] | None = getattr(graph, "link_splits", None)
    if not splits:
        raise ValueError(f"--task link: {where} graph {getattr(graph, 'name', '')!r} has no link splits; "
                         "partition it with --link-split (or an OGB link dataset)")
    return splits


def cluster_link_job(args: argparse.Namespace, env: DistEnv, cluster: Cluster) -> LinkJob:
    """The link loaders of this rank on the servers' graph (sharing the cluster's channels)."""
    graph = cluster.graph
    check_link_model(args.model, graph)
    common = loader_options(args, env)
    splits = link_splits_of(graph, "the servers'")
    return build_link_job(partial(service_loader_class(), cluster, **common), splits, graph, args)


def check_link_model(model: str, graph: TypedGraph) -> None:
    """Refuse an encoder the link task cannot build for ``graph``'s kind."""
    allowed = TYPED_MODELS if graph.typed else LINK_MODELS
    if model not in allowed:
        kind = "typed" if graph.typed else "plain"
        raise ValueError(f"--model {model}: --task link on the {kind} graph {graph.name!r} expects one of "
                         f"{', '.join(allowed)}")
    if not graph.typed:
        model_edge_dim(argparse.Namespace(model=model), graph)  # GINE: a graph with edge features


# ---- passes ----------------------------------------------------------------------------


def _seed_count(batch: Any, edge_type: EdgeType) -> int:
    store = batch[edge_type] if isinstance(batch, HeteroData) else batch
    return int(store.input_id.numel()) if "input_id" in store else 0


def train_pass(ddp: torch.nn.Module, source: LinkSource, edge_type: EdgeType, env: DistEnv,
               optimizer: torch.optim.Optimizer, *, progress: bool = False,
               epoch: int = 0) -> tuple[float, float, int, float, float]:
    """One training pass (binary cross-entropy with logits over each batch's positive and
    negative pairs). Returns the mean loss per pair and the pairs' accuracy (logit > 0 for
    a positive), over all ranks; the positive seed edges over all ranks; this rank's
    seconds in all and waiting for its batches."""
    ddp.train()
    loss_sum = correct = pairs = seeds = 0.0
    started = time.perf_counter()
    timed = TimedBatches(source, progress, epoch)
    for batch in timed:
        t = link_targets(batch, edge_type)
        if t.label is None:
            raise ValueError("training batches: expected binary link batches (edge_label_index, edge_label), "
                             "got triplet ones")
        label = (t.label > 0).float()
        scores = ddp(link_inputs(batch), t.src, t.dst)
        loss = F.binary_cross_entropy_with_logits(scores, label)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += float(loss.detach()) * label.numel()
        correct += int(((scores.detach() > 0).float() == label).sum())
        pairs += label.numel()
        seeds += _seed_count(batch, edge_type)
        timed.show_loss(loss)
    loss_sum, correct, pairs, seeds = all_reduce_sums([loss_sum, correct, pairs, seeds], env)
    return loss_sum / max(pairs, 1.0), correct / max(pairs, 1.0), int(seeds), \
        time.perf_counter() - started, timed.waited


@torch.no_grad()
def _pair_scores(model: LinkPredictor, source: LinkSource, edge_type: EdgeType
                 ) -> Iterator[tuple[Tensor, Tensor | None]]:
    """Per batch of this rank: the positives' scores ``[P]`` and, in triplet layout, their
    negatives' ``[P, K]`` (the same draws every time: epoch 0)."""
    model.eval()
    source.set_epoch(0)
    for batch in source:
        t = link_targets(batch, edge_type)
        h_src, h_dst = model.embed(link_inputs(batch))
        pos = model.score(h_src, h_dst, t.src, t.dst)
        yield pos, None if t.dst_neg is None else model.score(h_src, h_dst, t.src, t.dst_neg)


def _cat(parts: list[Tensor]) -> Tensor:
    return torch.cat([p.reshape(-1).float().cpu() for p in parts]) if parts else torch.zeros(0)


def evaluate_split(model: LinkPredictor, ev: LinkEvaluation, edge_type: EdgeType,
                   env: DistEnv) -> dict[str, float]:
    """The split's figures over all ranks: ``mrr``, ``hits@1/3/10`` and ``count``
    (positives), or ``hits@K`` and ``count``."""
    if ev.protocol == "hits":
        assert ev.negatives is not None
        positives = _cat([p for p, _ in _pair_scores(model, ev.positives, edge_type)])
        negatives = _cat([p for p, _ in _pair_scores(model, ev.negatives, edge_type)])
        return hits_at_k(positives, negatives, ev.k, env)
    ranks: list[Tensor] = []
    for pos, neg in _pair_scores(model, ev.positives, edge_type):
        if neg is None:
            raise ValueError(f"{ev.split} batches: expected triplet layout (dst_neg_index) for MRR, "
                             "got binary")
        ranks.append(ogb_ranks(pos.float().cpu(), neg.float().cpu()))
    sums = ranking_sums(torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.float64))
    keys = list(sums)
    return ranking_means(dict(zip(keys, all_reduce_sums([sums[k] for k in keys], env), strict=True)))


# ---- the run ---------------------------------------------------------------------------


@dataclass
class LinkEpochMetrics:
    """Figures of one link epoch, over all ranks."""

    epoch: int
    #: Mean binary cross-entropy per scored pair.
    loss: float
    #: Accuracy of the training pairs (logit > 0 for positives).
    train_acc: float
    #: The validation figures (``mrr``, ``hits@k``, ``count``).
    val: dict[str, float]
    #: The figure that selects the model (``val[metric]``).
    val_score: float
    #: Positive training seed edges over all ranks.
    seed_edges: int
    #: Batches per rank.
    batches: int
    train_seconds: float
    eval_seconds: float
    #: Positive seed edges per second over all ranks.
    seed_edges_per_second: float
    #: Seconds rank 0 waited for batches that had not arrived yet.
    data_wait_seconds: float


def run_link(args: argparse.Namespace, env: DistEnv, job: LinkJob) -> dict[str, Any]:
    """Train; validate every epoch and keep the model of the best validation figure; test
    that model at the end; return the metrics."""
    graph, edge_type = job.graph, job.edge_type
    torch.manual_seed(args.seed)
    model = build_link_model(args.model, graph, edge_type, decoder=args.decoder, hidden_channels=args.hidden,
                             num_layers=args.layers, dropout=args.dropout,
                             edge_dim=model_edge_dim(args, graph)).to(env.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    seed_edges = edge_type_name(edge_type) if graph.typed else ""  # "" on a plain graph, as on the wire
    config = {"task": "link", "model": args.model, "decoder": args.decoder, "hidden": args.hidden,
              "layers": args.layers, "edge_type": seed_edges}
    record = RunRecord(config, graph.identity(), graph.to_json(), job.source)
    ckpt, best_path, start, history, selection = resume_state(args, model, optimizer, record, env,
                                                              "val_score")
    log.info("link prediction on %s (%s) edges %s: model %s + %s decoder; %d seed edges per batch per rank, "
             "%g negatives each; validation: %s; test: %s; evaluation fanouts %s", graph.name,
             "typed" if graph.typed else "plain", seed_edges or "(its one edge type)", args.model,
             args.decoder, args.batch_size, args.neg_ratio, job.val.describe(), job.test.describe(),
             job.eval_fanouts)
    ddp = model if not env.distributed else DistributedDataParallel(
        model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
        find_unused_parameters=graph.typed and FIND_UNUSED_PARAMETERS.get(args.model, False))
    progress = env.rank == 0 and not args.no_progress and sys.stderr.isatty()
    started = time.perf_counter()
    for epoch in range(start, args.epochs):
        job.train.set_epoch(epoch)
        loss, train_acc, seeds, train_s, waited = train_pass(ddp, job.train, edge_type, env, optimizer,
                                                             progress=progress, epoch=epoch)
        eval_started = time.perf_counter()
        val = evaluate_split(model, job.val, edge_type, env)
        m = LinkEpochMetrics(epoch, loss, train_acc, val, val[job.val.metric], seeds, len(job.train), train_s,
                             time.perf_counter() - eval_started, seeds / max(train_s, 1e-9), waited)
        improved = keep_epoch(asdict(m), m.val_score, history, selection, model, optimizer, env,
                              (ckpt, best_path), record)
        log.info("epoch %d: loss %.4f, train acc %.4f, val %s %.4f%s, %.1f s, %.0f seed edges/s "
                 "(rank 0 waited %.1f s for data)", epoch, loss, train_acc, job.val.metric, m.val_score,
                 " (best so far)" if improved else "", train_s, m.seed_edges_per_second, waited)
    fingerprints = restore_selected(model, selection, env)
    test = evaluate_split(model, job.test, edge_type, env)
    log.info("selected epoch %s (val %s %.4f): test %s", selection.epoch, job.val.metric, selection.val_acc,
             ", ".join(f"{k} {v:.4f}" for k, v in test.items() if k != "count"))
    return {
        "task": "link", "graph": graph.name, **({"typed": True} if graph.typed else {}),
        "world_size": env.world_size, "device": str(env.device), "model": record.config,
        "edge_type": seed_edges, "fanouts": args.fanouts, "eval_fanouts": job.eval_fanouts,
        "batch_size": args.batch_size, "batch_size_per_step": args.batch_size * env.world_size,
        "neg_ratio": args.neg_ratio, "strict_negatives": args.strict_negatives, "exclude": args.exclude,
        "seed": args.seed, "val_protocol": job.val.describe(), "test_protocol": job.test.describe(),
        "val_metric": job.val.metric, "test_metric": job.test.metric, "start_epoch": start, "epochs": history,
        "selected_epoch": selection.epoch, "selected_val": selection.val_acc, "test": test,
        "test_score": test[job.test.metric], "param_fingerprints": fingerprints,
        "seconds": time.perf_counter() - started,
        "seed_edges_per_second": sum(h["seed_edges_per_second"] for h in history) / max(len(history), 1),
    }
