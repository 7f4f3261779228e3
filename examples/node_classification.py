"""Node classification with graphfeed: PyG's NeighborLoader loop, with RemoteNeighborLoader
in its place. GraphSAGE, validation every epoch, the best-validation model kept and
tested; one process (for several, see train_ddp.py).

Partition a graph, then let graphfeed-local start a sampling server per partition, run
this script against them and stop them::

    graphfeed-partition partition --synthetic small --num-parts 2 --out parts/   # or your graph
    graphfeed-local --partition-dir parts/ --trainer-script examples/node_classification.py -- --epochs 10

or run it against servers you started yourself::

    python examples/node_classification.py --servers 127.0.0.1:50051,127.0.0.1:50052

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
from torch_geometric.nn import GraphSAGE

from trainer_client import Cluster, RemoteNeighborLoader


@torch.no_grad()
def accuracy(model: torch.nn.Module, loader: RemoteNeighborLoader) -> float:
    """Accuracy on the loader's seeds (the first ``batch_size`` nodes of each batch)."""
    model.eval()
    correct = total = 0
    for batch in loader:
        out = model(batch.x, batch.edge_index)[: batch.batch_size]
        correct += int((out.argmax(-1) == batch.y[: batch.batch_size]).sum())
        total += batch.batch_size
    return correct / max(total, 1)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", required=True, help="comma-separated host:port of the sampling servers")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--fanouts", default="10,5", help="neighbors drawn per hop (default 10,5)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--metrics-json", type=Path, default=None, help="write the final metrics here")
    args = parser.parse_args(argv)
    fanouts = [int(k) for k in args.fanouts.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    cluster = Cluster(args.servers)  # one set of channels for the three loaders
    train_loader = RemoteNeighborLoader(cluster, "train", num_neighbors=fanouts,
                                        batch_size=args.batch_size, shuffle=True, device=device)
    val_loader, test_loader = (RemoteNeighborLoader(cluster, split, num_neighbors=fanouts,
                                                    batch_size=1024, device=device)
                               for split in ("val", "test"))

    model = GraphSAGE(train_loader.num_features, args.hidden, num_layers=len(fanouts),
                      out_channels=train_loader.num_classes).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    best = {"val_acc": -1.0, "epoch": -1}
    best_state = None
    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)  # a new shuffle every epoch
        model.train()
        total_loss = 0.0
        for batch in train_loader:
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            loss = F.cross_entropy(out, batch.y[: batch.batch_size])
            loss.backward()
            optimizer.step()
            total_loss += loss.item() * batch.batch_size
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
