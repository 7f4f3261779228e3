"""``graphfeed-train --task link``: link prediction on seed-edge batches, evaluated with
OGB's protocols, on either kind of graph, as a :class:`~trainer_client.loop.Task` of the
one training loop.

A :class:`LinkTask` trains on the training split's batches (binary negatives,
``--neg-ratio`` per positive, optionally strict and with the batch's positive seed edges
excluded from message passing) with binary cross-entropy over the positive and negative
pairs, and evaluates validation and test by the protocol the graph's stored link splits
call for (:func:`evaluation_protocol`):

* ``given``: the split stores negatives per edge (ogbl-citation2): MRR and Hits@1/3/10 of
  each positive ranked against its own K negatives;
* ``hits``: a ``<split>_neg`` split exists (ogbl-collab): Hits@K (``--hits-k``, 50) of the
  positives against the shared negative edges;
* ``sampled``: neither: MRR against ``--eval-negatives`` negatives drawn per positive
  (triplet mode, the same draws every evaluation).

On the servers the evaluation is exact by default: every node's embedding is computed
once by layer-wise inference (:mod:`trainer_client.evaluate`), and the split's pairs and
negatives are scored from batches of their ends (no neighbors) carrying those
embeddings; ``--eval sampled`` (or ``--eval-fanouts``) embeds them on sampled
neighborhoods instead (default ``--fanouts``). Each rank scores its own share of a split
(each positive lies in exactly one rank's batches);
the ranks add their sums, and for Hits@K agree on the K-th highest negative score first
(:mod:`trainer_client.link_metrics`), so every positive is counted once. The model is
selected by the validation split's MRR (or Hits@K).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.data import Data, HeteroData

from partitioner.graph import EdgeType, edge_type_name
from trainer_client.cluster import Cluster
from trainer_client.ddp import DistEnv
from trainer_client.evaluate import OUTPUT, LayerwiseEvaluation, evaluation_mode, layerwise_evaluation
from trainer_client.export import export_outputs
from trainer_client.featureless import embedding_config, input_width, server_embeddings
from trainer_client.graph import TypedGraph
from trainer_client.link_loader import RemoteLinkNeighborLoader
from trainer_client.link_metrics import hits_at_k, ogb_ranks, rank_metrics
from trainer_client.link_models import LINK_MODELS, LinkPredictor, build_link_model, link_inputs, link_targets
from trainer_client.loop import Batches, Step, Task, loader_options, model_edge_dim, sampled_fanouts
from trainer_client.typed_models import TYPED_MODELS

#: ``--exclude`` choices (``none``: PyG's behaviour, seed edges stay in message passing).
EXCLUDE_CHOICES = ("none", "self", "reverse")
#: Evaluation protocols (see the module doc).
PROTOCOLS = ("given", "hits", "sampled")


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
LinkLoaderFactory = Callable[..., Batches]


@dataclass
class LinkEvaluation:
    """How one split is evaluated (see the module doc)."""

    #: The split ("val", "test").
    split: str
    #: One of :data:`PROTOCOLS`.
    protocol: str
    #: The split's batches: triplet layout for ``given`` and ``sampled``, its positive
    #: edges for ``hits``.
    positives: Batches
    #: ``hits``: the batches of the negative edges (``<split>_neg``); else None.
    negatives: Batches | None
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


@dataclass(kw_only=True)
class LinkTask(Task):
    """Link prediction on the graph's link splits (see the module doc)."""

    name = "link"
    #: The seed edges' type.
    edge_type: EdgeType
    val: LinkEvaluation
    test: LinkEvaluation
    #: Layer-wise inference over every node: the evaluation's when ``eval_fanouts`` is None
    #: (the splits' batches then carry their nodes' embeddings, ``out``, not their
    #: neighborhoods), and the export's (None: neither).
    layerwise: LayerwiseEvaluation | None = None

    def split(self, name: str) -> LinkEvaluation:
        """How split ``name`` ("val", "test") is evaluated."""
        return self.val if name == "val" else self.test

    def build_model(self) -> torch.nn.Module:
        args = self.args
        return build_link_model(args.model, self.graph, self.edge_type, decoder=args.decoder,
                                hidden_channels=args.hidden, num_layers=args.layers, dropout=args.dropout,
                                edge_dim=model_edge_dim(args, self.graph),
                                embeddings=self.embedding_factory(), embedding_dim=input_width(args))

    @property
    def _seed_edges(self) -> str:
        """The seed edges' type as the wire names it ("" on a plain graph)."""
        return edge_type_name(self.edge_type) if self.graph.typed else ""

    def config(self) -> dict[str, Any]:
        args = self.args
        return {"task": "link", "model": args.model, "decoder": args.decoder, "hidden": args.hidden,
                "layers": args.layers, "edge_type": self._seed_edges, **embedding_config(args, self.graph)}

    def step(self, model: torch.nn.Module, batch: Any) -> Step:
        """Binary cross-entropy with logits over the batch's positive and negative pairs;
        a pair is right when its logit is on its label's side of 0."""
        t = link_targets(batch, self.edge_type)
        if t.label is None:
            raise ValueError("training batches: expected binary link batches (edge_label_index, edge_label), "
                             "got triplet ones")
        label = (t.label > 0).float()
        scores = model(link_inputs(batch), t.src, t.dst)
        loss = F.binary_cross_entropy_with_logits(scores, label)
        store = batch[self.edge_type] if isinstance(batch, HeteroData) else batch
        seeds = int(store.input_id.numel()) if "input_id" in store else 0
        return Step(loss, int(((scores.detach() > 0).float() == label).sum()), int(label.numel()), seeds)

    def evaluate(self, model: torch.nn.Module, split: str) -> dict[str, float]:
        """``mrr``, ``hits@1/3/10`` and ``count`` (positives), or ``hits@K`` and ``count``."""
        assert isinstance(model, LinkPredictor)
        model.eval()
        if self.eval_fanouts is not None or self.layerwise is None:
            return self._scored(model, split, lambda batch: model.embed(link_inputs(batch)))
        with self.layerwise.outputs(model):
            return self._scored(model, split, partial(_embedded, edge_type=self.edge_type))

    def finish(self, model: torch.nn.Module) -> None:
        """Every node's embedding out (``--export-embeddings``, ``--keep-embeddings``)."""
        if self.layerwise is not None:
            ends = list(dict.fromkeys([self.edge_type[0], self.edge_type[2]]))
            export_outputs(self.layerwise, model, ends, self.args, self.env, self.config())

    def _scored(self, model: LinkPredictor, split: str, embed: Embed) -> dict[str, float]:
        ev = self.split(split)
        if ev.protocol == "hits":
            assert ev.negatives is not None
            positives = _cat([p for p, _ in _pair_scores(model, ev.positives, self.edge_type, embed)])
            negatives = _cat([p for p, _ in _pair_scores(model, ev.negatives, self.edge_type, embed)])
            return hits_at_k(positives, negatives, ev.k, self.env)
        ranks: list[Tensor] = []
        for pos, neg in _pair_scores(model, ev.positives, self.edge_type, embed):
            if neg is None:
                raise ValueError(f"{ev.split} batches: expected triplet layout (dst_neg_index) for MRR, "
                                 "got binary")
            ranks.append(ogb_ranks(pos.float().cpu(), neg.float().cpu()))
        return rank_metrics(torch.cat(ranks) if ranks else torch.zeros(0, dtype=torch.float64), self.env)

    def metric(self, split: str) -> str:
        return self.split(split).metric

    def describe(self) -> str:
        args = self.args
        how = "exact, layer-wise over every node" if self.layerwise else f"fanouts {self.eval_fanouts}"
        return (f"link prediction on {self.graph.name} ({'typed' if self.graph.typed else 'plain'}) edges "
                f"{self._seed_edges or '(its one edge type)'}: model {args.model} + {args.decoder} decoder; "
                f"{args.batch_size} seed edges per batch per rank, {args.neg_ratio:g} negatives each; "
                f"validation: {self.val.describe()}; test: {self.test.describe()}; evaluation "
                f"{how}")

    def facts(self) -> dict[str, Any]:
        args = self.args
        return {"edge_type": self._seed_edges, "neg_ratio": args.neg_ratio,
                "strict_negatives": args.strict_negatives, "exclude": args.exclude,
                "val_protocol": self.val.describe(), "test_protocol": self.test.describe()}


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


def build_link_task(make: LinkLoaderFactory, splits: Mapping[str, SplitFacts], graph: TypedGraph,
                    args: argparse.Namespace, env: DistEnv, source: str = "the servers'",
                    layerwise: LayerwiseEvaluation | None = None) -> LinkTask:
    """The link task of this rank, its loaders from ``make`` and the graph's stored
    ``splits``; with ``layerwise``, the splits' batches are of their ends only, carrying
    the last layer's embeddings."""
    if "train" not in splits:
        raise ValueError(f"--task link: expected a link split 'train' in {source} graph {graph.name!r}, "
                         f"found {sorted(splits) or 'none'}; partition it with link splits (--link-split)")
    edge_type = tuple(splits["train"].edge_type)
    edge_type = (str(edge_type[0]), str(edge_type[1]), str(edge_type[2]))
    fanouts = sampled_fanouts(args)
    train = make("train", num_neighbors=list(args.fanouts), batch_size=args.batch_size, shuffle=True,
                 neg_sampling=dict(mode="binary", amount=args.neg_ratio),
                 strict_negatives=args.strict_negatives, exclude=_exclude(args))

    def evaluation(split: str) -> LinkEvaluation:
        protocol, k = evaluation_protocol(splits, split, eval_negatives=args.eval_negatives,
                                          hits_k=args.hits_k)
        if tuple(splits[split].edge_type) != edge_type:
            raise ValueError(f"link split {split!r}: expected edges of {edge_type_name(edge_type)} as "
                             f"'train', got {edge_type_name(splits[split].edge_type)}")
        each: dict[str, Any] = dict(num_neighbors=fanouts, batch_size=args.eval_batch_size, shuffle=False)
        if layerwise is not None:
            ends = list(dict.fromkeys([edge_type[0], edge_type[2]]))
            each.update(num_neighbors=[0], include_features=False, edge_features=False,
                        node_tensors={OUTPUT: list(layerwise.output_names(ends).values())})
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

    return LinkTask(args=args, env=env, graph=graph, train=train, source=source, edge_type=edge_type,
                    eval_fanouts=None if layerwise else fanouts, val=evaluation("val"),
                    test=evaluation("test"), layerwise=layerwise)


def link_splits_of(graph: Any, where: str) -> Mapping[str, SplitFacts]:
    """``graph.link_splits`` (split name to facts), refused when there are none."""
    splits: Mapping[str, SplitFacts] | None = getattr(graph, "link_splits", None)
    if not splits:
        raise ValueError(f"--task link: {where} graph {getattr(graph, 'name', '')!r} has no link splits; "
                         "partition it with --link-split (or an OGB link dataset)")
    return splits


def cluster_link_task(args: argparse.Namespace, env: DistEnv, cluster: Cluster) -> LinkTask:
    """The link task of this rank on the servers' graph (its loaders sharing the cluster's
    channels)."""
    graph = cluster.graph
    check_link_model(args.model, graph)
    splits = link_splits_of(graph, "the servers'")
    common = loader_options(args, env)
    make: LinkLoaderFactory = partial(RemoteLinkNeighborLoader, cluster, **common)
    layerwise = layerwise_evaluation(args, env, cluster, common)
    exact = evaluation_mode(args, "link", graph.typed) == "layerwise"
    task = build_link_task(make, splits, graph, args, env, layerwise=layerwise if exact else None)
    task.layerwise = layerwise  # the export's too
    task.embeddings = server_embeddings(args, env, cluster)
    return task


def check_link_model(model: str, graph: TypedGraph) -> None:
    """Refuse an encoder the link task cannot build for ``graph``'s kind."""
    allowed = TYPED_MODELS if graph.typed else LINK_MODELS
    if model not in allowed:
        kind = "typed" if graph.typed else "plain"
        raise ValueError(f"--model {model}: --task link on the {kind} graph {graph.name!r} expects one of "
                         f"{', '.join(allowed)}")
    if not graph.typed:
        model_edge_dim(argparse.Namespace(model=model), graph)  # GINE: a graph with edge features


# ---- evaluation ------------------------------------------------------------------------


#: The embeddings of a batch's source-type and destination-type nodes.
Embed = Callable[[Any], tuple[Tensor, Tensor]]


def _embedded(batch: Data | HeteroData, edge_type: EdgeType) -> tuple[Tensor, Tensor]:
    """The embeddings a layer-wise evaluation's batch carries (``out``) of its source-type
    and destination-type nodes."""
    if isinstance(batch, HeteroData):
        return batch[edge_type[0]][OUTPUT], batch[edge_type[2]][OUTPUT]
    return batch[OUTPUT], batch[OUTPUT]


@torch.no_grad()
def _pair_scores(model: LinkPredictor, source: Batches, edge_type: EdgeType, embed: Embed
                 ) -> Iterator[tuple[Tensor, Tensor | None]]:
    """Per batch of this rank: the positives' scores ``[P]`` and, in triplet layout, their
    negatives' ``[P, K]`` (the same draws every time: epoch 0), from ``embed(batch)``."""
    source.set_epoch(0)
    for batch in source:
        t = link_targets(batch, edge_type)
        h_src, h_dst = embed(batch)
        pos = model.score(h_src, h_dst, t.src, t.dst)
        yield pos, None if t.dst_neg is None else model.score(h_src, h_dst, t.src, t.dst_neg)


def _cat(parts: list[Tensor]) -> Tensor:
    return torch.cat([p.reshape(-1).float().cpu() for p in parts]) if parts else torch.zeros(0)
