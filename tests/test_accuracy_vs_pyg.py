"""A model trained on graphfeed's minibatches matches the same model trained in one
process with PyG's ``NeighborLoader`` (same fanouts, batch size, epochs and seeds): test
accuracies averaged over seeds within 1 point, on both kinds of graph. Both models are
tested by one full-graph forward pass (exact, no sampling).

- plain: GraphSAGE on ``small``, METIS-partitioned in 4 (whose parts follow the
  classes), global batches from ``RemoteNeighborLoader`` as ``Data``;
- typed: R-GCN on ``mag-small`` (ogbn-mag-shaped: papers, authors, institutions, fields
  of study) with reverse relations and a larger test split (2,000 papers, so that one
  run's accuracy is measured to about 1 point), METIS-partitioned in 2, batches as
  ``HeteroData``.

On both, the runs must be far above an MLP on the seeds' features alone.

The partitions are served by in-process sampling servers (gRPC). Everything runs on one
thread (torch and Numba; the ``one_thread`` fixture).

PyG's loader needs ``pyg-lib`` or ``torch-sparse`` (``make bench-peers`` installs the
latter); without them this test is skipped.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from graph_fixtures import KINDS
from in_process_servers import served
from test_loader import TIMEOUTS
from torch import nn
from torch_geometric.data import Data, HeteroData
from torch_geometric.nn import GraphSAGE

from partitioner.graph import TypedGraphData
from partitioner.readers.pyg import to_pyg
from partitioner.synthetic import TYPED_PRESETS, generate_plain, generate_typed
from partitioner.writer import partition_graph
from trainer_client.graph import TypedGraph
from trainer_client.loader import RemoteNeighborLoader
from trainer_client.typed_models import RGCN, typed_batch_inputs

FANOUTS = [10, 5]
HIDDEN = 32
LR = 0.01

#: ``mag-small`` with 1,600 / 400 / 2,000 train / val / test papers.
TYPED_PRESET = dataclasses.replace(TYPED_PRESETS["mag-small"], split_sizes=(1600, 400, 2000))


def _pyg_sampling_available() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("pyg_lib", "torch_sparse"))


pytestmark = [pytest.mark.skipif(not _pyg_sampling_available(),
                                 reason="PyG's NeighborLoader needs pyg-lib or torch-sparse "
                                        "(make bench-peers installs torch-sparse)"),
              pytest.mark.usefixtures("one_thread")]


@dataclasses.dataclass
class Case:
    """One kind's graph, model and settings."""

    #: The whole graph as PyG holds it (the reference loader's input, the test's graph).
    data: Data | HeteroData
    #: Its partitions.
    root: Path
    parts: int
    #: The seed (labelled) node type: None on a plain graph.
    seed_type: str | None
    seeds: range
    epochs: int
    batch: int
    #: A fresh model (after ``torch.manual_seed``).
    model: Callable[[], nn.Module]
    #: The seeds' logits of a batch.
    logits: Callable[[nn.Module, Any], torch.Tensor]
    #: Logits of every node of the seed type, by one full-graph forward pass.
    full_logits: Callable[[nn.Module], torch.Tensor]
    #: Split name to the IDs of its nodes (of the seed type).
    splits: dict[str, np.ndarray]

    def store(self, batch: Any) -> Any:
        return batch if self.seed_type is None else batch[self.seed_type]

    def split(self, name: str) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.splits[name], dtype=np.int64))


def _plain(tmp: Path) -> Case:
    graph = generate_plain("small", progress=False)
    root = tmp / "metis-4"
    partition_graph(graph, 4, root, method="metis", progress=False)
    data = Data(x=torch.from_numpy(graph.x), edge_index=torch.from_numpy(graph.edge_index),
                y=torch.from_numpy(graph.y))
    return Case(data, root, 4, None, range(5), 5, 128,
                model=lambda: GraphSAGE(graph.feature_dim, HIDDEN, num_layers=2,
                                        out_channels=graph.num_classes),
                logits=lambda m, b: m(b.x, b.edge_index)[: b.batch_size],
                full_logits=lambda m: m(data.x, data.edge_index), splits=graph.splits)


def _typed(tmp: Path) -> Case:
    graph: TypedGraphData = generate_typed(TYPED_PRESET, seed=0, progress=False).add_reverse()
    root = tmp / "metis-2"
    partition_graph(graph, 2, root, method="metis", progress=False)
    data = to_pyg(graph)
    meta = TypedGraph(node_types=tuple(graph.node_types), edge_types=tuple(graph.edge_types),
                      num_nodes=dict(graph.num_nodes),
                      feature_dims={t: graph.feature_dim(t) for t in graph.node_types},
                      target_type=graph.target_type, num_classes=graph.num_classes)
    n_id = {t: torch.arange(data[t].num_nodes) for t in data.node_types}
    return Case(data, root, 2, "paper", range(8), 10, 200,
                model=lambda: RGCN(meta, hidden_channels=HIDDEN, num_layers=len(FANOUTS), dropout=0.5),
                logits=lambda m, b: m(*typed_batch_inputs(b)),
                full_logits=lambda m: m({"paper": data["paper"].x}, data.edge_index_dict, n_id,
                                        data["paper"].num_nodes), splits=graph.splits)


def _train(case: Case, seed: int, epochs: Iterable[Iterable[Any]]) -> float:
    """Train on the batches of each epoch; the test accuracy of the full-graph forward."""
    torch.manual_seed(seed)
    model = case.model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for batches in epochs:
        model.train()
        for batch in batches:
            optimizer.zero_grad()
            store = case.store(batch)
            y = store.y[: store.batch_size]
            F.cross_entropy(case.logits(model, batch)[y >= 0], y[y >= 0]).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        pred = case.full_logits(model).argmax(-1)
    test = case.split("test")
    return float((pred[test] == case.store(case.data).y[test]).float().mean())


def _mlp_accuracy(case: Case, seed: int) -> float:
    """An MLP on the seed type's features alone, trained full batch to convergence."""
    torch.manual_seed(seed)
    x, y = case.store(case.data).x, case.store(case.data).y
    train, test = case.split("train"), case.split("test")
    mlp = nn.Sequential(nn.Linear(x.shape[1], HIDDEN), nn.ReLU(), nn.Dropout(0.5),
                        nn.Linear(HIDDEN, int(y.max()) + 1))
    optimizer = torch.optim.Adam(mlp.parameters(), lr=LR)
    for _ in range(200):
        mlp.train()
        optimizer.zero_grad()
        F.cross_entropy(mlp(x[train]), y[train]).backward()
        optimizer.step()
    mlp.eval()
    with torch.no_grad():
        return float((mlp(x[test]).argmax(-1) == y[test]).float().mean())


@pytest.mark.parametrize("kind", KINDS)
def test_training_on_graphfeed_batches_matches_pyg_neighbor_loader(kind: str, tmp_path: Path) -> None:
    from torch_geometric.loader import NeighborLoader

    case = (_plain if kind == "plain" else _typed)(tmp_path)
    ours, pyg = [], []
    with served(case.root, case.parts) as addresses:
        for seed in case.seeds:
            with RemoteNeighborLoader(addresses, "train", num_neighbors=FANOUTS, batch_size=case.batch,
                                      shuffle=True, seed=seed, **TIMEOUTS) as loader:
                # each pass over the loader is the next epoch
                ours.append(_train(case, seed, (loader for _ in range(case.epochs))))
    train = case.split("train")
    for seed in case.seeds:
        torch.manual_seed(seed)
        if case.seed_type is None:
            reference = NeighborLoader(case.data, num_neighbors=FANOUTS, batch_size=case.batch, shuffle=True,
                                       input_nodes=train)
        else:
            reference = NeighborLoader(case.data, num_neighbors={et: FANOUTS for et in case.data.edge_types},
                                       batch_size=case.batch, shuffle=True,
                                       input_nodes=(case.seed_type, train))
        pyg.append(_train(case, seed, (reference for _ in range(case.epochs))))
    mlp = [_mlp_accuracy(case, seed) for seed in case.seeds]
    print(f"{kind}: test accuracy over seeds {list(case.seeds)}: graphfeed {np.round(ours, 4).tolist()} "
          f"(mean {np.mean(ours):.4f}), PyG {np.round(pyg, 4).tolist()} (mean {np.mean(pyg):.4f}); "
          f"MLP on the features {np.round(mlp, 4).tolist()} (mean {np.mean(mlp):.4f})")
    assert abs(np.mean(ours) - np.mean(pyg)) < 0.01
    assert np.mean(ours) > np.mean(mlp) + 0.2  # the structure is what the model learns from
