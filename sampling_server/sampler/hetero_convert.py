"""Typed minibatch -> PyG ``HeteroData``, laid out as PyG's hetero ``NeighborLoader``
lays out its batches."""

from __future__ import annotations

from torch_geometric.data import HeteroData

from sampling_server.sampler.hetero_types import HeteroMinibatch


def to_hetero_data(batch: HeteroMinibatch) -> HeteroData:
    """A PyG ``HeteroData`` of ``batch``, sharing its tensors (no copies).

    Per node type: ``n_id`` (original IDs, as the homogeneous loader's ``n_id``),
    ``num_nodes``, ``x`` for types with features, ``y`` on the target type, and
    ``batch_size`` on the seed type (its first ``batch_size`` nodes are the seeds). Per
    edge type: ``edge_index`` (``[source; target]``, local IDs of each end's type).
    ``num_sampled_nodes`` / ``num_sampled_edges``: per-hop counts set per type as PyG
    sets them (``data.num_sampled_nodes_dict``, for ``trim_to_layer``), and as dicts on
    the batch itself. The service's loader lays its batches out the same way.
    """
    s = batch.structure
    data = HeteroData()
    for t, n_id in s.node.items():
        data[t].n_id = batch.orig_id[t]
        data[t].num_nodes = int(n_id.numel())
        if t in batch.x:
            data[t].x = batch.x[t]
    if batch.y is not None:
        data[batch.target_type].y = batch.y
    data[s.input_type].batch_size = s.batch_size
    for et in s.row:
        data[et].edge_index = s.edge_index(et)
    data.num_sampled_nodes = {t: list(v) for t, v in s.num_sampled_nodes.items()}
    data.num_sampled_edges = {et: list(v) for et, v in s.num_sampled_edges.items()}
    data.set_value_dict("num_sampled_nodes", data.num_sampled_nodes)  # per type, as PyG
    data.set_value_dict("num_sampled_edges", data.num_sampled_edges)
    return data
