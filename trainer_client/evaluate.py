"""Evaluation for the trainer: full-neighbor layer-wise inference (PyG's
``BasicGNN.inference`` through the service: layer ``i`` runs once over every node with
*all* its in-neighbors and layer ``i-1``'s outputs of them, so each node's output is
exact and computed once; ``docs/training.md``, "Evaluation"), and accuracy on a split's
nodes (on sampled neighborhoods: :func:`trainer_client.loop.one_pass`). Each rank
computes the batches of its share and the ranks sum their rows (every node lies in
exactly one batch across ranks); each holds one ``[num_nodes, hidden]`` table per layer.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch_geometric.nn.models.basic_gnn import BasicGNN

from trainer_client.loader import RemoteNeighborLoader
from trainer_client.models import NodeClassifier

log = logging.getLogger(__name__)


def labeled(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits and labels of the labelled nodes (label >= 0)."""
    mask = y >= 0
    return out[mask], y[mask]


@torch.no_grad()
def layerwise_logits(model: NodeClassifier, loader: RemoteNeighborLoader, *, distributed: bool,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[N, C]`` and labels ``[N]`` of every node, by original ID, with full
    neighborhoods. ``loader`` iterates every node once over the ranks (``input_nodes``
    all nodes, ``num_neighbors=[-1]``, ``shuffle=False``)."""
    if loader.num_neighbors != [-1]:
        raise ValueError(f"loader: expected num_neighbors=[-1] for layer-wise inference, got "
                         f"{loader.num_neighbors}")
    gnn: BasicGNN = model.gnn
    model.eval()
    num_nodes = int(loader.cluster_info.num_nodes)
    y_all = torch.full((num_nodes,), -1, dtype=torch.int64, device=device)
    h_prev: torch.Tensor | None = None
    for layer in range(gnn.num_layers):
        loader.set_epoch(0)
        h: torch.Tensor | None = None
        for batch in loader:
            seeds = batch.n_id[: batch.batch_size]
            x = batch.x if h_prev is None else h_prev[batch.n_id]
            out = gnn.inference_per_layer(layer, x, batch.edge_index, batch.batch_size)
            if h is None:
                h = torch.zeros((num_nodes, out.shape[1]), dtype=out.dtype, device=device)
            h[seeds] = out
            if layer == 0:
                y_all[seeds] = batch.y[: batch.batch_size]
        width = torch.tensor([0 if h is None else h.shape[1]], dtype=torch.int64, device=device)
        if distributed:  # a rank without batches learns the width from the others
            dist.all_reduce(width, op=dist.ReduceOp.MAX)
        if h is None:
            h = torch.zeros((num_nodes, int(width)), device=device)
        if distributed:
            dist.all_reduce(h)
        h_prev = h
    if distributed:
        y_all += 1  # -1 (not seen on this rank) becomes 0, so a sum over ranks is exact
        dist.all_reduce(y_all)
        y_all -= 1
    assert h_prev is not None
    return h_prev, y_all


def accuracy_of(logits: torch.Tensor, y: torch.Tensor, nodes: torch.Tensor) -> float:
    """Accuracy of ``logits`` on the labeled ``nodes`` (original IDs)."""
    ids = nodes.to(logits.device)
    out, labels = labeled(logits[ids], y[ids])
    return float((out.argmax(dim=-1) == labels).sum()) / max(int(labels.numel()), 1)
