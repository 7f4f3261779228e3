"""Check that a synthetic typed preset rewards relational models (not a test).

Trains, full batch in one process, an MLP on paper features and a relational model (one
``SAGEConv`` per relation summed per node type, as R-GCN does, with learnable embeddings
for featureless types) on ``mag-small`` with reverse relations, for several seeds, and
reports the test accuracy at the best validation epoch. Writes
``benchmarks/results/hetero_learnability.json``.

    python benchmarks/experiments/hetero_learnability.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.data import HeteroData
from torch_geometric.nn import HeteroConv, SAGEConv

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import machine, write_json

from partitioner.readers.pyg import to_pyg
from partitioner.synthetic import TYPED_PRESETS, generate_typed

log = logging.getLogger("bench.hetero_learnability")


class Relational(nn.Module):
    """Two layers of per-relation SAGEConv summed per node type; embeddings for
    featureless node types."""

    def __init__(self, data: HeteroData, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.data = data
        self.lin = nn.Linear(data["paper"].x.shape[1], hidden)
        self.emb = nn.ModuleDict({t: nn.Embedding(data[t].num_nodes, hidden)
                                  for t in data.node_types if t != "paper"})
        self.convs = nn.ModuleList([
            HeteroConv({et: SAGEConv((hidden, hidden), hidden) for et in data.edge_types},
                       aggr="sum")
            for _ in range(2)
        ])
        self.out = nn.Linear(hidden, num_classes)

    def forward(self) -> torch.Tensor:
        h = {"paper": self.lin(self.data["paper"].x)}
        h.update({t: e.weight for t, e in self.emb.items()})
        for conv in self.convs:
            h = conv(h, self.data.edge_index_dict)
            h = {k: F.dropout(F.relu(v), 0.5, self.training) for k, v in h.items()}
        return self.out(h["paper"])


def train(model: nn.Module, forward: Callable[[], torch.Tensor], data: HeteroData,
          epochs: int) -> tuple[float, float]:
    """(best validation accuracy, test accuracy at that epoch)."""
    store = data["paper"]
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    best = (0.0, 0.0)
    for _ in range(epochs):
        model.train()
        opt.zero_grad()
        F.cross_entropy(forward()[store.train_mask], store.y[store.train_mask]).backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            pred = forward().argmax(1)
        val = (pred[store.val_mask] == store.y[store.val_mask]).float().mean().item()
        test = (pred[store.test_mask] == store.y[store.test_mask]).float().mean().item()
        if val > best[0]:
            best = (val, test)
    return best


def _bind(model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: model(x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="mag-small", choices=sorted(TYPED_PRESETS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    rows = []
    for seed in args.seeds:
        graph = generate_typed(args.preset, seed=seed, progress=False).add_reverse()
        data = to_pyg(graph)
        torch.manual_seed(seed)
        x = data["paper"].x
        mlp = nn.Sequential(nn.Linear(x.shape[1], args.hidden), nn.ReLU(), nn.Dropout(0.5),
                            nn.Linear(args.hidden, graph.num_classes))
        rel = Relational(data, args.hidden, graph.num_classes)
        models: list[tuple[str, nn.Module, Callable[[], torch.Tensor]]] = [
            ("mlp", mlp, _bind(mlp, x)), ("relational", rel, rel)]
        for name, model, fwd in models:
            started = time.perf_counter()
            val, test = train(model, fwd, data, args.epochs)
            rows.append({"seed": seed, "model": name, "val": round(val, 4),
                         "test": round(test, 4),
                         "seconds": round(time.perf_counter() - started, 1)})
            log.info("seed %d %s: val %.3f, test %.3f", seed, name, val, test)
    payload = {"benchmark": "hetero_learnability", "preset": args.preset,
               "epochs": args.epochs, "hidden": args.hidden, "machine": machine(),
               "runs": rows}
    path = write_json("hetero_learnability", payload)
    for name in ("mlp", "relational"):
        tests = [r["test"] for r in rows if r["model"] == name]
        print(f"{name:>10}: test accuracy {sum(tests) / len(tests):.3f} "
              f"(seeds {args.seeds}: {tests})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
