"""``graphfeed-train``'s node classification (``--task node``, the default), on either
kind of graph, as a :class:`~trainer_client.loop.Task` of the one training loop.

The loss is the cross-entropy of the labelled seeds (a model reads a batch of either kind
through :func:`~trainer_client.typed_models.model_inputs`); the figure is accuracy. On
the servers the evaluation is exact by default: layer-wise inference over every node
(:mod:`trainer_client.evaluate`), the split's accuracy read off batches of its seeds
that carry their logits; ``--eval sampled`` (or ``--eval-fanouts``) and
``--partition-dir`` evaluate on sampled neighborhoods, each rank its share of the split,
counts summed over the ranks.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch_geometric.data import Data, HeteroData

from trainer_client.cluster import Cluster
from trainer_client.ddp import DistEnv, all_reduce_sums
from trainer_client.evaluate import (
    OUTPUT,
    LayerwiseEvaluation,
    evaluation_mode,
    labeled,
    layerwise_evaluation,
)
from trainer_client.export import export_outputs
from trainer_client.featureless import (
    EmbeddingInput,
    embedding_config,
    input_width,
    plain_embedding,
    server_embeddings,
)
from trainer_client.graph import PLAIN_NODE_TYPE, TypedGraph
from trainer_client.in_process import InProcessLoader, LocalGraph
from trainer_client.loader import RemoteNeighborLoader
from trainer_client.loop import (
    BatchSource,
    Step,
    Task,
    loader_options,
    model_edge_dim,
    sampled_fanouts,
    uses_edge_features,
)
from trainer_client.models import MODELS, build_model, seed_labels
from trainer_client.typed_models import TYPED_MODELS, build_typed_model, model_inputs


@dataclass(kw_only=True)
class NodeTask(Task):
    """Node classification on the ``train``, ``val`` and ``test`` node splits."""

    name = "node"
    val: BatchSource
    test: BatchSource
    #: Layer-wise inference over every node: the evaluation's when ``eval_fanouts`` is None
    #: (``val`` and ``test`` are then batches of their seeds carrying the last layer's rows,
    #: ``out``, not their neighborhoods), and the export's (None: neither).
    layerwise: LayerwiseEvaluation | None = None

    def build_model(self) -> torch.nn.Module:
        args, graph = self.args, self.graph
        if graph.typed:
            return build_typed_model(args.model, graph, hidden_channels=args.hidden, num_layers=args.layers,
                                     dropout=args.dropout, embeddings=self.embedding_factory())
        features = graph.feature_dims[PLAIN_NODE_TYPE]
        width = features or input_width(args)
        model = build_model(args.model, width, graph.num_classes, hidden_channels=args.hidden,
                            num_layers=args.layers, dropout=args.dropout, heads=args.heads,
                            edge_dim=model_edge_dim(args, graph))
        return model if features else EmbeddingInput(plain_embedding(graph, width, self.embedding_factory()),
                                                     model)

    def config(self) -> dict[str, Any]:
        args = self.args
        config = {"model": args.model, "hidden": args.hidden, "layers": args.layers,
                  **embedding_config(args, self.graph)}
        return config if self.graph.typed else {**config, "heads": args.heads}  # --heads: the plain GAT's

    def step(self, model: torch.nn.Module, batch: Any) -> Step:
        out, y = labeled(model(*model_inputs(batch)), seed_labels(batch))
        # Unlabeled seeds are masked out; an empty loss still takes part in DDP's sync.
        loss = F.cross_entropy(out, y, reduction="sum") / max(int(y.numel()), 1)
        return Step(loss, int((out.argmax(dim=-1) == y).sum()), int(y.numel()), int(y.numel()))

    def evaluate(self, model: torch.nn.Module, split: str) -> dict[str, float]:
        """Accuracy on the split's labelled nodes (the same draws every time: epoch 0)."""
        model.eval()
        if self.eval_fanouts is None and self.layerwise is not None:
            with self.layerwise.outputs(model):
                correct, count = _correct(self.split(split), partial(_seed_rows, attr=OUTPUT))
        else:
            with torch.no_grad():
                correct, count = _correct(self.split(split), lambda batch: model(*model_inputs(batch)))
        total_correct, total = all_reduce_sums([correct, count], self.env)
        return {"acc": total_correct / max(total, 1.0)}

    def finish(self, model: torch.nn.Module) -> None:
        """Every node's logits out (``--export-embeddings``, ``--keep-embeddings``)."""
        if self.layerwise is not None:
            export_outputs(self.layerwise, model, [self.graph.target_type], self.args, self.env,
                           self.config())

    def split(self, name: str) -> BatchSource:
        return self.val if name == "val" else self.test

    def metric(self, split: str) -> str:
        return "acc"

    def describe(self) -> str:
        args, graph, world = self.args, self.graph, self.env.world_size
        kind = f"typed: {list(graph.node_types)}, target {graph.target_type!r}" if graph.typed else "plain"
        evaluation = "exact, layer-wise over every node" if self.eval_fanouts is None else \
            f"sampled, fanouts {self.eval_fanouts}"
        return (f"graph {graph.name} ({kind}, {graph.num_classes} classes): model {args.model}; batch "
                f"size {args.batch_size} per rank: {args.batch_size * world} seeds per optimizer step over "
                f"{world} ranks; evaluation: {evaluation}")


def _correct(source: BatchSource, logits: Callable[[Data | HeteroData], torch.Tensor]) -> tuple[int, int]:
    """This rank's right predictions and labelled seeds of ``source``'s batches (epoch 0)."""
    source.set_epoch(0)
    correct = count = 0
    for batch in source:
        out, y = labeled(logits(batch), seed_labels(batch))
        correct, count = correct + int((out.argmax(dim=-1) == y).sum()), count + int(y.numel())
    return correct, count


def _seed_rows(batch: Data | HeteroData, attr: str) -> torch.Tensor:
    """The seeds' rows of ``attr`` (on the store with ``batch_size``)."""
    store = next(s for s in batch.node_stores if "batch_size" in s)
    rows: torch.Tensor = store[attr][: int(store.batch_size)]
    return rows


def _split_loaders(make: Callable[..., Any], args: argparse.Namespace, fanouts: list[int],
                   **common: Any) -> dict[str, Any]:
    """The train, val and test loaders ``make(split, num_neighbors=, batch_size=, ...)``
    builds: the training split shuffled, the others with ``fanouts``."""
    return {split: make(split, num_neighbors=args.fanouts if train else fanouts, shuffle=train,
                        batch_size=args.batch_size if train else args.eval_batch_size, **common)
            for split, train in (("train", True), ("val", False), ("test", False))}


def cluster_task(args: argparse.Namespace, env: DistEnv, cluster: Cluster) -> NodeTask:
    """The task on the servers' graph: this rank's loaders, sharing the cluster's channels,
    with the trainer-side feature cache of ``--cache-size``; layer-wise evaluation unless
    ``--eval sampled`` (or ``--eval-fanouts`` naming fanouts)."""
    graph = cluster.graph
    check_model_kind(args.model, graph, "the servers serve")
    common = loader_options(args, env)
    layerwise = layerwise_evaluation(args, env, cluster, common)
    if evaluation_mode(args, "node", graph.typed) == "sampled":
        fanouts = sampled_fanouts(args)
        loaders = _split_loaders(partial(RemoteNeighborLoader, cluster), args, fanouts, **common)
        return NodeTask(args=args, env=env, graph=graph, eval_fanouts=fanouts, layerwise=layerwise,
                        embeddings=server_embeddings(args, env, cluster), **loaders)
    out = layerwise.output_names([graph.target_type])[graph.target_type]
    val, test = (RemoteNeighborLoader(cluster, split, num_neighbors=[0], batch_size=args.eval_batch_size,
                                      include_features=False, node_tensors={OUTPUT: out},
                                      **{**common, "edge_features": False}) for split in ("val", "test"))
    train = RemoteNeighborLoader(cluster, "train", num_neighbors=args.fanouts, shuffle=True,
                                 batch_size=args.batch_size, **common)
    return NodeTask(args=args, env=env, graph=graph, eval_fanouts=None, layerwise=layerwise, train=train,
                    val=val, test=test, embeddings=server_embeddings(args, env, cluster))


def partition_dir_task(args: argparse.Namespace, env: DistEnv) -> NodeTask:
    """The task sampling in this process from ``--partition-dir`` (either kind of graph).
    Evaluation is sampled: a plain graph's default samples every neighbor at every hop
    (the logits of layer-wise inference, batch by batch), a typed graph's with the
    training fanouts."""
    if getattr(args, "eval", None) == "layerwise":
        raise ValueError("--eval layerwise: expected --servers (the layer tables live on the servers), got "
                         "--partition-dir")
    local = LocalGraph(args.partition_dir)
    check_model_kind(args.model, local.meta, "--partition-dir holds")
    fanouts = sampled_fanouts(args) if local.meta.typed or getattr(args, "eval_fanouts_given", False) \
        else [-1] * len(args.fanouts)
    loaders = _split_loaders(partial(InProcessLoader, local), args, fanouts, rank=env.rank,
                             world_size=env.world_size, device=env.device, seed=args.seed,
                             edge_features=uses_edge_features(args))
    return NodeTask(args=args, env=env, graph=local.meta, eval_fanouts=fanouts,
                    source="the partition directory's", **loaders)


def check_model_kind(model: str, graph: TypedGraph, where: str) -> None:
    """Refuse a model of the other kind of graph than ``graph`` (``where``: "the servers
    serve", "--partition-dir holds")."""
    if graph.typed and model not in TYPED_MODELS:
        raise ValueError(f"--model {model}: {where} the typed graph {graph.name!r} (format v2); expected "
                         f"a typed model: {', '.join(TYPED_MODELS)}")
    if not graph.typed and model in TYPED_MODELS:
        raise ValueError(f"--model {model}: expected a typed graph (format v2), but {where} the "
                         f"homogeneous graph {graph.name!r}; use --model {', '.join(sorted(MODELS))}")
