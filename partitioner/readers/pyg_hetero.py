"""Convert between PyG's ``HeteroData`` and :class:`~partitioner.hetero.TypedGraphData`."""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch_geometric.data import HeteroData

from partitioner.graph import SPLITS, EdgeType, GraphDataError
from partitioner.readers.pyg import _labels, _to_numpy, _to_tensor
from partitioner.typed import TypedGraphData

log = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.float16, torch.float32, torch.float64)


def from_pyg_hetero(
    data: HeteroData, *, name: str = "pyg-hetero", target_type: str | None = None,
    num_classes: int | None = None,
) -> TypedGraphData:
    """Convert a PyG ``HeteroData`` (copying tensors to host memory).

    Reads every node type's ``num_nodes`` and ``x`` (when present), every edge type's
    ``edge_index``, and ``y`` plus ``train_mask``/``val_mask``/``test_mask`` (or
    ``*_idx``) of the target type: ``target_type``, else the one node type with ``y``.
    ``num_classes`` defaults to ``data.num_classes`` when set, else ``y.max() + 1``.
    """
    if not isinstance(data, HeteroData):
        raise GraphDataError(f"data: expected torch_geometric.data.HeteroData, got "
                             f"{type(data).__name__} (use from_pyg for homogeneous Data)")
    with_y = [t for t in data.node_types if "y" in data[t]]
    if target_type is None:
        if len(with_y) != 1:
            raise GraphDataError(
                f"target_type: expected one node type with y, got {with_y}; pass target_type")
        target_type = with_y[0]
    if target_type not in with_y:
        raise GraphDataError(f"data[{target_type!r}].y: expected labels, got none")
    num_nodes = {t: int(data[t].num_nodes) for t in data.node_types}
    edges: dict[EdgeType, np.ndarray] = {}
    for et in data.edge_types:
        ei = _to_numpy(data[et].edge_index, f"{et}.edge_index")
        if ei.ndim != 2 or ei.shape[0] != 2 or not np.issubdtype(ei.dtype, np.integer):
            raise GraphDataError(f"data[{et}].edge_index: expected integers of shape [2, E], "
                                 f"got {ei.dtype} of shape {list(ei.shape)}")
        edges[(str(et[0]), str(et[1]), str(et[2]))] = np.ascontiguousarray(ei, dtype=np.int64)
    x = {t: _features(t, data[t].x) for t in data.node_types if "x" in data[t]}
    store = data[target_type]
    y_np = _labels(store.y, f"data[{target_type!r}].y")
    stored = getattr(data, "num_classes", None) if "num_classes" in data else None
    graph = TypedGraphData(
        name=name, num_nodes=num_nodes, edge_index=edges, x=x, target_type=target_type,
        y=y_np,
        num_classes=int(num_classes or stored or (max(int(y_np.max()) + 1, 1) if y_np.size else 1)),
        splits=_splits(store, target_type, num_nodes[target_type]),
    )
    graph.validate()
    log.info("converted %s from PyG HeteroData: %d node types, %d edge types", name,
             len(num_nodes), len(edges))
    return graph


def to_pyg_hetero(graph: TypedGraphData) -> HeteroData:
    """Convert ``graph`` to a PyG ``HeteroData`` with masks on the target type."""
    graph.validate(check_values=False)
    data = HeteroData()
    for t, n in graph.num_nodes.items():
        data[t].num_nodes = n
        if t in graph.x:
            data[t].x = _to_tensor(np.asarray(graph.x[t]))
    for et, ei in graph.edge_index.items():
        data[et].edge_index = _to_tensor(np.asarray(ei))
    target = data[graph.target_type]
    target.y = _to_tensor(np.asarray(graph.y))
    for split, ids in graph.splits.items():
        mask = torch.zeros(graph.num_nodes[graph.target_type], dtype=torch.bool)
        mask[_to_tensor(np.asarray(ids))] = True
        target[f"{split}_mask"] = mask
    data.num_classes = graph.num_classes
    return data


def _features(node_type: str, tensor: torch.Tensor) -> np.ndarray:
    if tensor.dim() != 2:
        raise GraphDataError(f"data[{node_type!r}].x: expected shape [N, F], got {list(tensor.shape)}")
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    if tensor.dtype not in _FLOAT_DTYPES:
        raise GraphDataError(f"data[{node_type!r}].x: expected float16/32/64, got {tensor.dtype}")
    return _to_numpy(tensor, f"{node_type}.x")


def _splits(store: object, node_type: str, n: int) -> dict[str, np.ndarray]:
    splits: dict[str, np.ndarray] = {}
    for split in SPLITS:
        mask = getattr(store, f"{split}_mask", None)
        idx = getattr(store, f"{split}_idx", None)
        if mask is not None and idx is not None:
            raise GraphDataError(f"data[{node_type!r}]: expected {split}_mask or {split}_idx, got both")
        if mask is not None:
            if mask.dtype != torch.bool or tuple(mask.shape) != (n,):
                raise GraphDataError(f"data[{node_type!r}].{split}_mask: expected bool of shape "
                                     f"[{n}], got {mask.dtype} of shape {list(mask.shape)}")
            splits[split] = _to_numpy(mask.nonzero().view(-1), split).astype(np.int64)
        elif idx is not None:
            splits[split] = _to_numpy(idx.view(-1), split).astype(np.int64)
    return splits
