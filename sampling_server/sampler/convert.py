"""Minibatch -> PyG ``Data``, laid out as PyG's ``NeighborLoader`` lays out its batches."""

from __future__ import annotations

from torch_geometric.data import Data

from sampling_server.sampler.types import Minibatch


def to_pyg_data(batch: Minibatch) -> Data:
    """A PyG ``Data`` of ``batch``, sharing its tensors (no copies).

    Fields as ``NeighborLoader`` sets them: ``x``, ``edge_index`` (``[source; target]``,
    local IDs), ``y``, ``n_id`` (global IDs), ``batch_size`` (the seeds are nodes
    ``0 .. batch_size-1``, so a model's loss uses ``out[:batch_size]``), and
    ``num_sampled_nodes`` / ``num_sampled_edges`` per hop (for ``trim_to_layer``).
    """
    s = batch.structure
    data = Data(x=batch.x, edge_index=s.edge_index, y=batch.y, n_id=s.n_id,
                batch_size=s.batch_size, num_sampled_nodes=list(s.num_sampled_nodes),
                num_sampled_edges=list(s.num_sampled_edges))
    data.num_nodes = int(s.n_id.numel())
    return data
