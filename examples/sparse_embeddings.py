"""Node classification on a typed graph whose authors, institutions and fields of study
have no features (ogbn-mag's shape), with their learnable embeddings held by the sampling
servers, as DGL's DistEmbedding with SparseAdagrad: each server holds the rows of its
partition's nodes, a batch reads the rows of its nodes, and SparseAdagrad sends their
gradients back, applied there to exactly the rows the step touched. No trainer holds an
embedding table. The papers' features go through a Linear; then per layer one SAGEConv
per relation (HeteroConv). Validation every epoch; the last epoch's model is tested.

    graphfeed-partition partition --synthetic mag-small --add-reverse --num-parts 2 --out parts-typed/
    graphfeed-local --partition-dir parts-typed/ --trainer-script examples/sparse_embeddings.py -- --epochs 5

Prints a line per epoch, then the best validation accuracy, its epoch and the test
accuracy of the last model (and writes them to ``--metrics-json`` when given).
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.data import HeteroData
from torch_geometric.nn import HeteroConv, SAGEConv

from trainer_client import Cluster, RemoteNeighborLoader, TypedGraph
from trainer_client.embeddings import RemoteEmbedding, SparseAdagrad


class TypedSAGE(nn.Module):
    """Per node type an input (a Linear of the features, or the type's server-held
    embedding), then HeteroConv layers, then a classifier for the target type."""

    def __init__(self, graph: TypedGraph, cluster: Cluster, hidden: int, num_layers: int, job: str) -> None:
        super().__init__()
        self.target = graph.target_type
        self.linears = nn.ModuleDict({t: nn.Linear(graph.feature_dims[t], hidden)
                                      for t in graph.node_types if graph.feature_dims[t] > 0})
        # One table per featureless type, on the servers; its rows start uniform in [-0.1, 0.1).
        self.tables = {t: RemoteEmbedding(cluster, f"{job}/{t}", hidden, node_type=t, init="uniform",
                                          scale=0.1)
                       for t in graph.node_types if graph.feature_dims[t] <= 0}
        self.embeddings = nn.ModuleDict(self.tables)
        self.convs = nn.ModuleList(
            HeteroConv({et: SAGEConv(hidden, hidden) for et in graph.edge_types}, aggr="sum")
            for _ in range(num_layers))
        self.classify = nn.Linear(hidden, graph.num_classes)

    def forward(self, batch: HeteroData) -> torch.Tensor:
        h = {t: self.linears[t](batch[t].x) if t in self.linears
             else self.embeddings[t](batch[t].internal_n_id)  # tables are addressed by internal IDs
             for t in batch.node_types}
        for conv in self.convs:
            out = conv(h, batch.edge_index_dict)
            h = {t: F.relu(out[t]) if t in out else h[t] for t in h}
        return self.classify(h[self.target])


@torch.no_grad()
def accuracy(model: TypedSAGE, loader: RemoteNeighborLoader) -> float:
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
    parser.add_argument("--lr", type=float, default=0.01, help="the dense layers' Adam")
    parser.add_argument("--sparse-lr", type=float, default=0.06, help="the embeddings' Adagrad")
    parser.add_argument("--metrics-json", type=Path, default=None, help="write the final metrics here")
    args = parser.parse_args(argv)
    fanouts = [int(k) for k in args.fanouts.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    cluster = Cluster(args.servers)
    train_loader = RemoteNeighborLoader(cluster, "train", num_neighbors=fanouts, batch_size=args.batch_size,
                                        shuffle=True, device=device, return_internal_ids=True)
    val_loader, test_loader = (RemoteNeighborLoader(cluster, split, num_neighbors=fanouts, batch_size=1024,
                                                    device=device, return_internal_ids=True)
                               for split in ("val", "test"))
    graph = train_loader.typed_graph
    if graph is None:
        parser.error("--servers: these servers hold a plain graph; see examples/node_classification.py")

    job = f"example-{uuid.uuid4().hex[:8]}"  # this run's tables
    model = TypedSAGE(graph, cluster, args.hidden, len(fanouts), job).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # the dense layers
    sparse = SparseAdagrad(model.tables.values(), lr=args.sparse_lr)  # creates the tables
    best = {"val_acc": -1.0, "epoch": -1}
    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)
        model.train()
        total_loss = 0.0
        for batch in train_loader:
            seeds = batch[model.target].batch_size
            optimizer.zero_grad()
            sparse.zero_grad()
            loss = F.cross_entropy(model(batch)[:seeds], batch[model.target].y[:seeds])
            loss.backward()
            optimizer.step()
            sparse.step()  # the rows' gradients to their servers
            total_loss += loss.item() * seeds
        val_acc = accuracy(model, val_loader)
        if val_acc > best["val_acc"]:
            best = {"val_acc": val_acc, "epoch": epoch}
        print(f"epoch {epoch:3d}  loss {total_loss / train_loader.num_seeds:.4f}  val acc {val_acc:.4f}")

    metrics = {"best_val_acc": best["val_acc"], "best_epoch": best["epoch"],
               "test_acc": accuracy(model, test_loader)}
    for emb in model.tables.values():
        assert emb.table is not None
        emb.table.drop(forget=True)  # the tables leave the servers
    cluster.close()
    print(f"best val acc {metrics['best_val_acc']:.4f} (epoch {metrics['best_epoch']}), "
          f"test acc {metrics['test_acc']:.4f}")
    if args.metrics_json is not None:
        args.metrics_json.write_text(json.dumps(metrics) + "\n")
    return metrics


if __name__ == "__main__":
    main()
