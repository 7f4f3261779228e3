"""Node classification on a typed graph (papers, authors, institutions, fields of study, as
in ogbn-mag): on servers of a typed partition RemoteNeighborLoader yields PyG HeteroData,
as PyG's hetero NeighborLoader does. The model is written here in plain PyG: an input
layer per node type (a Linear for types with features, a learned embedding for the
others), then per layer one SAGEConv per relation, summed per node type (HeteroConv).
Validation every epoch, the best-validation model kept and tested.

    graphfeed-partition partition --synthetic mag-small --add-reverse --num-parts 2 --out parts-typed/
    graphfeed-local --partition-dir parts-typed/ --trainer-script examples/typed_graph.py -- --epochs 5

or against servers you started yourself on a typed partition::

    python examples/typed_graph.py --servers 127.0.0.1:50051,127.0.0.1:50052

Prints a line per epoch, then the best validation accuracy, its epoch and the test
accuracy of that model (and writes them to ``--metrics-json`` when given).
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.data import HeteroData
from torch_geometric.nn import HeteroConv, SAGEConv

from trainer_client import Cluster, RemoteNeighborLoader, TypedGraph


class TypedSAGE(nn.Module):
    """Per node type an input layer, then ``num_layers`` HeteroConv layers of one SAGEConv
    per relation (summed per type), then a classifier for the target type."""

    def __init__(self, graph: TypedGraph, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.target = graph.target_type
        self.inputs = nn.ModuleDict({
            t: nn.Linear(graph.feature_dims[t], hidden) if graph.feature_dims[t] > 0
            else nn.Embedding(graph.num_nodes[t], hidden)  # indexed by the type's n_id
            for t in graph.node_types})
        self.convs = nn.ModuleList(
            HeteroConv({et: SAGEConv(hidden, hidden) for et in graph.edge_types}, aggr="sum")
            for _ in range(num_layers))
        self.classify = nn.Linear(hidden, graph.num_classes)

    def forward(self, batch: HeteroData) -> torch.Tensor:
        h = {t: self.inputs[t](batch[t].x if "x" in batch[t] else batch[t].n_id)
             for t in batch.node_types}
        for conv in self.convs:
            out = conv(h, batch.edge_index_dict)
            h = {t: F.relu(out[t]) if t in out else h[t] for t in h}  # types no relation reaches keep theirs
        return self.classify(h[self.target])


@torch.no_grad()
def accuracy(model: TypedSAGE, loader: RemoteNeighborLoader) -> float:
    """Accuracy on the loader's seeds (the first ``batch_size`` target nodes of a batch)."""
    model.eval()
    correct = total = 0
    for batch in loader:
        seeds = batch[model.target].batch_size
        out = model(batch)[:seeds]
        correct += int((out.argmax(-1) == batch[model.target].y[:seeds]).sum())
        total += seeds
    return correct / max(total, 1)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", required=True, help="comma-separated host:port of the sampling servers")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--fanouts", default="10,5", help="neighbors per hop, every relation (default 10,5)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--metrics-json", type=Path, default=None, help="write the final metrics here")
    args = parser.parse_args(argv)
    fanouts = [int(k) for k in args.fanouts.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    cluster = Cluster(args.servers)
    train_loader = RemoteNeighborLoader(cluster, "train", num_neighbors=fanouts,
                                        batch_size=args.batch_size, shuffle=True, device=device)
    val_loader, test_loader = (RemoteNeighborLoader(cluster, split, num_neighbors=fanouts,
                                                    batch_size=1024, device=device)
                               for split in ("val", "test"))
    graph = train_loader.typed_graph  # node and edge types, feature widths, classes
    if graph is None:
        parser.error("--servers: these servers hold a plain graph; see examples/node_classification.py")

    model = TypedSAGE(graph, args.hidden, num_layers=len(fanouts)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    best = {"val_acc": -1.0, "epoch": -1}
    best_state = None
    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)
        model.train()
        total_loss = 0.0
        for batch in train_loader:
            seeds = batch[model.target].batch_size
            optimizer.zero_grad()
            loss = F.cross_entropy(model(batch)[:seeds], batch[model.target].y[:seeds])
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * seeds
        val_acc = accuracy(model, val_loader)
        if val_acc > best["val_acc"]:
            best, best_state = {"val_acc": val_acc, "epoch": epoch}, copy.deepcopy(model.state_dict())
        print(f"epoch {epoch:3d}  loss {total_loss / train_loader.num_seeds:.4f}  val acc {val_acc:.4f}")

    assert best_state is not None, "--epochs: expected at least 1"
    model.load_state_dict(best_state)
    metrics = {"best_val_acc": best["val_acc"], "best_epoch": best["epoch"],
               "test_acc": accuracy(model, test_loader)}
    cluster.close()
    print(f"best val acc {metrics['best_val_acc']:.4f} (epoch {metrics['best_epoch']}), "
          f"test acc {metrics['test_acc']:.4f}")
    if args.metrics_json is not None:
        args.metrics_json.write_text(json.dumps(metrics) + "\n")
    return metrics


if __name__ == "__main__":
    main()
