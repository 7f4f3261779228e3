"""Minibatch -> PyG ``Data`` or ``HeteroData``, laid out as PyG's (hetero)
``NeighborLoader`` lays out its batches."""

from __future__ import annotations

from typing import Any

from torch_geometric.data import Data, HeteroData

from partitioner.graph import EdgeType
from sampling_server.sampler.types import Minibatch


def to_pyg_data(batch: Minibatch, plain: bool = False) -> Data | HeteroData:
    """A PyG batch of ``batch``, sharing its tensors (no copies): a ``HeteroData``, or
    (``plain``: a plain graph's batch, one node and edge type) a ``Data``.

    Per node type: ``n_id`` (original IDs when the batch has them, else global IDs),
    ``num_nodes``, ``x`` for types with features, ``y`` on the target type, and
    ``batch_size`` on the seed type (its first ``batch_size`` nodes are the seeds). Per
    edge type: ``edge_index`` (``[source; target]``, local IDs of each end's type), and
    ``e_id`` / ``edge_attr`` where the batch has them.
    ``num_sampled_nodes`` / ``num_sampled_edges``: per-hop counts (for ``trim_to_layer``),
    set per type as PyG sets them (``data.num_sampled_nodes_dict``) and as dicts on the
    batch itself; a ``Data`` has the lists of its one type.
    """
    s = batch.structure
    if plain:
        (t, n_id), = s.node.items()
        (et,) = s.row
        data = Data(x=batch.x.get(t), edge_index=s.edge_index(et), y=batch.y,
                    n_id=batch.orig_id.get(t, n_id), batch_size=s.batch_size,
                    num_sampled_nodes=list(s.num_sampled_nodes[t]),
                    num_sampled_edges=list(s.num_sampled_edges[et]))
        data.num_nodes = int(n_id.numel())
        _edge_rows(data, batch, et)
        return data
    typed = HeteroData()
    for t, n_id in s.node.items():
        typed[t].n_id = batch.orig_id.get(t, n_id)
        typed[t].num_nodes = int(n_id.numel())
        if t in batch.x:
            typed[t].x = batch.x[t]
    if batch.y is not None:
        typed[batch.target_type].y = batch.y
    typed[s.input_type].batch_size = s.batch_size
    for et in s.row:
        typed[et].edge_index = s.edge_index(et)
        _edge_rows(typed[et], batch, et)
    typed.num_sampled_nodes = {t: list(v) for t, v in s.num_sampled_nodes.items()}
    typed.num_sampled_edges = {et: list(v) for et, v in s.num_sampled_edges.items()}
    typed.set_value_dict("num_sampled_nodes", typed.num_sampled_nodes)  # per type, as PyG
    typed.set_value_dict("num_sampled_edges", typed.num_sampled_edges)
    return typed


def _edge_rows(store: Any, batch: Minibatch, edge_type: EdgeType) -> None:
    """Set ``edge_type``'s ``e_id`` and ``edge_attr`` on its ``store`` where the batch has them."""
    if edge_type in batch.e_id:
        store.e_id = batch.e_id[edge_type]
    if edge_type in batch.edge_attr:
        store.edge_attr = batch.edge_attr[edge_type]
