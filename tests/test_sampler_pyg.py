"""Sampled batches as PyG batches, on both kinds of graph: a plain graph's batch becomes a
``Data``, a typed graph's a ``HeteroData``, laid out as PyG's (hetero) ``NeighborLoader``
lays out its batches; and their sizes agree with that loader's on average."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from graph_fixtures import HUB, KINDS, AnyGraph, mixed, typed_view, write_and_load

from sampling_server.sampler import CpuNeighborSampler, batch_key
from sampling_server.sampler.convert import to_pyg_data


@pytest.fixture(scope="module", params=KINDS)
def graph(request: pytest.FixtureRequest) -> AnyGraph:
    return mixed(request.param)


@pytest.fixture(scope="module")
def sampler(graph: AnyGraph, tmp_path_factory: pytest.TempPathFactory) -> CpuNeighborSampler:
    """The sampler of the graph as one partition (global IDs are original IDs)."""
    return CpuNeighborSampler(write_and_load(graph, tmp_path_factory.mktemp("mixed-p1"), 1)[0])


def test_batches_are_laid_out_as_pyg_lays_them_out(graph: AnyGraph, sampler: CpuNeighborSampler) -> None:
    """A plain graph's batch becomes a ``Data`` (one GraphSAGE step runs on it), a typed
    graph's a ``HeteroData``, each laid out as PyG's (hetero) ``NeighborLoader`` lays out
    its batches."""
    from torch_geometric.nn import SAGEConv

    t, typed = sampler.target_type, typed_view(graph)
    batch = sampler.minibatch(np.array([HUB, 0, 9]), t, [4, 3], batch_key(0, 0, 0, 0))
    s = batch.structure
    if sampler.plain:
        data = to_pyg_data(batch, plain=True)
        assert data.batch_size == 3 and data.num_nodes == data.n_id.numel() == s.node[t].numel()
        assert data.edge_index.shape == (2, sum(data.num_sampled_edges))
        assert len(data.num_sampled_nodes) == 3
        torch.manual_seed(0)
        conv1, conv2 = SAGEConv(data.x.shape[1], 16), SAGEConv(16, 4)
        out = conv2(conv1(data.x, data.edge_index).relu(), data.edge_index)[: data.batch_size]
        loss = torch.nn.functional.cross_entropy(out, data.y[: data.batch_size], ignore_index=-1)
        loss.backward()
        assert out.shape == (3, 4) and torch.isfinite(loss)
        return
    hetero = to_pyg_data(batch)
    assert set(hetero.node_types) == set(typed.node_types) and set(hetero.edge_types) == set(typed.edge_types)
    assert hetero[t].batch_size == 3 and hetero.num_sampled_nodes[t][0] == 3
    for u in typed.node_types:
        assert hetero[u].num_nodes == s.node[u].numel() == hetero[u].n_id.numel()
        assert ("x" in hetero[u]) == (u in typed.x)
    assert hetero[t].x.shape == (s.node[t].numel(), typed.x[t].shape[1])
    assert hetero[t].y.shape == (s.node[t].numel(),) and "y" not in hetero["author"]
    for et in typed.edge_types:
        ei = hetero[et].edge_index
        assert ei.shape == (2, s.row[et].numel()) == (2, sum(hetero.num_sampled_edges[et]))
        assert ei.numel() == 0 or (int(ei[0].max()) < hetero[et[0]].num_nodes
                                   and int(ei[1].max()) < hetero[et[2]].num_nodes)


def _pyg_neighbor_backend() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("pyg_lib", "torch_sparse"))


@pytest.mark.skipif(not _pyg_neighbor_backend(), reason="PyG's NeighborLoader needs pyg-lib or "
                    "torch-sparse (make bench-peers)")
def test_structure_matches_pyg_neighbor_loader(graph: AnyGraph, sampler: CpuNeighborSampler) -> None:
    """Same seeds and fanouts: nodes per type and edges per edge type agree with PyG's
    (hetero) ``NeighborLoader`` on average (both are uniform without replacement)."""
    from torch_geometric.data import HeteroData
    from torch_geometric.loader import NeighborLoader

    typed = typed_view(graph)
    data = HeteroData()
    for t, n in typed.num_nodes.items():
        data[t].num_nodes = n
    for et, ei in typed.edge_index.items():
        data[et].edge_index = torch.from_numpy(ei)
    t = typed.target_type
    batch, num_batches = 2, 10
    seeds = np.asarray(typed.splits["train"][: batch * num_batches], dtype=np.int64)
    loader = NeighborLoader(data, num_neighbors={et: [3, 2] for et in typed.edge_types},
                            input_nodes=(t, torch.from_numpy(seeds)), batch_size=batch)
    ours, theirs = [], []
    for i, b in enumerate(loader):
        out = sampler.sample(seeds[i * batch:(i + 1) * batch], t, [3, 2], key=1000 + i)
        ours.append([out.node[u].numel() for u in typed.node_types]
                    + [out.row[et].numel() for et in typed.edge_types])
        theirs.append([b[u].num_nodes for u in typed.node_types]
                      + [b[et].edge_index.shape[1] for et in typed.edge_types])
    a, b_ = np.asarray(ours, float), np.asarray(theirs, float)
    assert a.shape == b_.shape == (num_batches, len(typed.node_types) + len(typed.edge_types))
    bound = 5 * np.sqrt((a.var(0) + b_.var(0)) / num_batches) + 1
    assert (np.abs(a.mean(0) - b_.mean(0)) <= bound).all(), (a.mean(0), b_.mean(0))
