"""Evaluation by exact layer-wise inference, for the node and the link task
(``docs/training.md``, "Evaluation"): every node's output is computed once per
evaluation, layer by layer, into tables on the servers
(:class:`~trainer_client.layerwise.LayerwiseInference`); the split's figures are then
read off batches of its seeds (no neighbors) that carry the last layer's rows of their
nodes (``node_tensors``), each rank its share, the counts summed over the ranks. The
last layer's tables have fixed names (:meth:`LayerwiseEvaluation.output_names`), so the
splits' loaders are made once, with the task.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainer_client.cluster import Cluster
from trainer_client.ddp import DistEnv
from trainer_client.featureless import shared_token
from trainer_client.layerwise import LayerwiseInference, ProcessGroup
from trainer_client.node_tensors import RemoteNodeTensor

#: The attribute of a split's batches that holds the last layer's rows of their nodes.
OUTPUT = "out"
#: ``--eval`` choices.
EVAL_MODES = ("layerwise", "sampled")


def labeled(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits and labels of the labelled nodes (label >= 0)."""
    mask = y >= 0
    return out[mask], y[mask]


@dataclass
class LayerwiseEvaluation:
    """What a task's layer-wise evaluation needs: the servers, this rank's place, the
    layers' loaders' options, the tables' prefix and how many layers make the output."""

    cluster: Cluster
    env: DistEnv
    batch_size: int
    num_layers: int
    loader_options: dict[str, Any] = field(default_factory=dict)
    #: The tables' prefix (``lw/<run>``, the same on every rank).
    name: str = ""
    progress: bool = False

    def output_names(self, node_types: Sequence[str]) -> dict[str, str]:
        """The last layer's table of each of ``node_types``, by node type."""
        return {t: f"{self.name}/{self.num_layers - 1}/{t}" for t in node_types}

    @contextmanager
    def outputs(self, model: nn.Module, keep: str | None = None) -> Iterator[dict[str, RemoteNodeTensor]]:
        """Every node's output of ``model``, in the last layer's tables on the servers
        while the block runs (every rank enters it); dropped after, unless kept as
        ``<keep>/<type>``."""
        inference = LayerwiseInference(model, self.cluster, ProcessGroup(self.env), self.batch_size,
                                       self.loader_options, name=self.name, keep=keep or "",
                                       progress=self.progress)
        try:
            yield inference.run()
        finally:
            inference.close()


def evaluation_mode(args: argparse.Namespace, task: str, typed: bool) -> str:
    """``--eval`` as given, else from ``--eval-fanouts`` as it always chose (``full`` on a
    plain graph's node task: layer-wise; other fanouts: sampled), else the default: layer-wise
    from the servers (docs/training.md, "Evaluation": measured faster for every task and
    kind at the splits' sizes), sampled with ``--partition-dir``."""
    mode: str | None = getattr(args, "eval", None)
    if mode is not None:
        return mode
    if getattr(args, "eval_fanouts_given", False):
        return "layerwise" if args.eval_fanouts is None and task == "node" and not typed else "sampled"
    return "sampled" if getattr(args, "partition_dir", None) is not None else "layerwise"


def layerwise_evaluation(args: argparse.Namespace, env: DistEnv, cluster: Cluster,
                         loader_options: dict[str, Any]) -> LayerwiseEvaluation:
    """The run's layer-wise evaluation, its tables named for this run."""
    return LayerwiseEvaluation(cluster, env, args.eval_batch_size, args.layers, dict(loader_options),
                               name=f"lw/{shared_token(env)}",
                               progress=env.rank == 0 and not args.no_progress and sys.stderr.isatty())
