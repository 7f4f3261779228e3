"""A model trained through the service matches one trained with PyG's single-process
``NeighborLoader`` on the same graph: global batches on a METIS partitioning (whose parts
follow the classes) give the same test accuracy within 1 point, averaged over seeds.

PyG's loader needs ``pyg-lib`` or ``torch-sparse`` (``make bench-peers`` installs the
latter); without them this test is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_loader import TIMEOUTS, RealServers
from torch_geometric.data import Data
from torch_geometric.nn import GraphSAGE

from partitioner import partition_graph
from partitioner.graph import GraphData
from partitioner.synthetic import generate
from trainer_client.loader import RemoteNeighborLoader

SEEDS = range(5)
EPOCHS = 5
FANOUTS = [10, 5]
BATCH = 128


def _pyg_sampling_available() -> bool:
    try:
        import torch_sparse  # noqa: F401
        return True
    except ImportError:
        try:
            import pyg_lib  # noqa: F401
            return True
        except ImportError:
            return False


pytestmark = pytest.mark.skipif(not _pyg_sampling_available(),
                                reason="PyG's NeighborLoader needs pyg-lib or torch-sparse")


def _train(graph: GraphData, seed: int, epochs: Iterable[Iterable[Data]]) -> float:
    """Train GraphSAGE on the batches of each epoch; test accuracy of the full-graph forward."""
    torch.manual_seed(seed)
    model = GraphSAGE(graph.feature_dim, 32, num_layers=2, out_channels=graph.num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for batches in epochs:
        model.train()
        for batch in batches:
            optimizer.zero_grad()
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
            y = batch.y[: batch.batch_size]
            F.cross_entropy(out[y >= 0], y[y >= 0]).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(graph.x), torch.from_numpy(graph.edge_index)).argmax(-1)
    test = torch.from_numpy(graph.splits["test"])
    return float((pred[test] == torch.from_numpy(graph.y)[test]).float().mean())


def test_service_training_matches_pyg_neighbor_loader_within_one_point(tmp_path: Path) -> None:
    from torch_geometric.loader import NeighborLoader

    graph = generate("small", progress=False)
    data = Data(x=torch.from_numpy(graph.x), edge_index=torch.from_numpy(graph.edge_index),
                y=torch.from_numpy(graph.y))
    root = tmp_path / "metis-4"
    partition_graph(graph, 4, root, method="metis", progress=False)
    cluster = RealServers(root, 4)
    service, pyg = [], []
    try:
        for seed in SEEDS:
            loader = RemoteNeighborLoader(cluster.addresses, "train", num_neighbors=FANOUTS, batch_size=BATCH,
                                          shuffle=True, seed=seed, **TIMEOUTS)
            service.append(_train(graph, seed, (loader for _ in range(EPOCHS))))
            loader.close()
            torch.manual_seed(seed)
            reference = NeighborLoader(data, num_neighbors=FANOUTS, batch_size=BATCH, shuffle=True,
                                       input_nodes=torch.from_numpy(graph.splits["train"]))
            pyg.append(_train(graph, seed, (reference for _ in range(EPOCHS))))
    finally:
        cluster.stop()
    print(f"test accuracy over seeds {list(SEEDS)}: service {np.round(service, 4).tolist()} "
          f"(mean {np.mean(service):.4f}), PyG {np.round(pyg, 4).tolist()} (mean {np.mean(pyg):.4f})")
    assert abs(np.mean(service) - np.mean(pyg)) < 0.01
    assert min(service) > 0.5  # far above chance (1/6): the runs trained
