"""Convert between a PyG ``Data`` object and :class:`GraphData`.

``from_pyg`` takes any homogeneous graph the user already has in memory (a PyG dataset's
``dataset[0]``, or their own ``Data``); ``to_pyg`` gives a :class:`GraphData` back to PyG.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch_geometric.data import Data, HeteroData

from partitioner.graph import SPLITS, GraphData, GraphDataError, labels_to_int64

log = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.float16, torch.float32, torch.float64)


def from_pyg(data: Data, *, name: str = "pyg", num_classes: int | None = None) -> GraphData:
    """Convert a PyG ``Data`` to :class:`GraphData` (copying tensors to host memory).

    Reads ``edge_index``, ``x``, ``y`` (``[N]`` or ``[N, 1]``), the splits from
    ``train_mask``/``val_mask``/``test_mask`` or ``train_idx``/``val_idx``/``test_idx``,
    and edge weights from ``edge_weight``, else from a 1-D ``edge_attr``. Features keep
    their float16/32/64 dtype (bfloat16 becomes float32); integers become int64.
    ``num_classes`` defaults to ``data.num_classes`` when set, else ``y.max() + 1``.
    """
    if isinstance(data, HeteroData):
        raise GraphDataError(
            "data: expected a homogeneous torch_geometric.data.Data, got HeteroData; "
            "convert it first, e.g. with data.to_homogeneous() or by building a Data "
            "from one node type and one edge type"
        )
    edge_index = _to_numpy(_required(data, "edge_index"), "edge_index")
    if edge_index.ndim != 2 or edge_index.shape[0] != 2:
        raise GraphDataError(
            f"data.edge_index: expected shape [2, E], got {list(edge_index.shape)}"
        )
    if not np.issubdtype(edge_index.dtype, np.integer):
        raise GraphDataError(f"data.edge_index: expected an integer dtype, got {edge_index.dtype}")
    x = _features(_required(data, "x"))
    y = _labels(_required(data, "y"))
    num_nodes = int(data.num_nodes) if data.num_nodes is not None else int(x.shape[0])
    graph = GraphData(
        name=name,
        num_nodes=num_nodes,
        edge_index=np.ascontiguousarray(edge_index, dtype=np.int64),
        x=x,
        y=y,
        num_classes=_num_classes(data, y, num_classes),
        splits=_splits(data, num_nodes),
        edge_weight=_edge_weight(data, edge_index.shape[1]),
    )
    graph.validate()
    log.info("converted %s from PyG: %d nodes, %d edges", name, graph.num_nodes, graph.num_edges)
    return graph


def to_pyg(graph: GraphData) -> Data:
    """Convert ``graph`` to a PyG ``Data`` with ``train_mask``/``val_mask``/``test_mask``.

    The masks do not keep the order of a split's node IDs; ``num_classes`` is set on the
    ``Data`` so that :func:`from_pyg` finds it again.
    """
    graph.validate(check_values=False)
    data = Data(
        x=_to_tensor(graph.x),
        edge_index=_to_tensor(graph.edge_index),
        y=_to_tensor(graph.y),
        num_nodes=graph.num_nodes,
    )
    for split, ids in graph.splits.items():
        mask = torch.zeros(graph.num_nodes, dtype=torch.bool)
        mask[_to_tensor(ids)] = True
        data[f"{split}_mask"] = mask
    if graph.edge_weight is not None:
        data.edge_weight = _to_tensor(graph.edge_weight)
    data.num_classes = graph.num_classes
    return data


def _required(data: Data, key: str) -> torch.Tensor:
    value = data.get(key, None)
    if not isinstance(value, torch.Tensor):
        raise GraphDataError(
            f"data.{key}: expected a tensor, got {type(value).__name__}; "
            f"keys present: {sorted(data.keys())}"
        )
    return value


def _to_numpy(tensor: torch.Tensor, key: str) -> np.ndarray:
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise GraphDataError(f"data.{key}: expected a dense tensor, got layout {tensor.layout}")
    return tensor.detach().cpu().numpy()


def _features(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dim() != 2:
        raise GraphDataError(f"data.x: expected shape [N, F], got {list(tensor.shape)}")
    if tensor.dtype == torch.bfloat16:
        log.info("data.x is bfloat16, which numpy lacks; converting to float32")
        tensor = tensor.float()
    if tensor.dtype not in _FLOAT_DTYPES:
        raise GraphDataError(f"data.x: expected float16, float32 or float64, got {tensor.dtype}")
    return _to_numpy(tensor, "x")


def _labels(tensor: torch.Tensor, field: str = "data.y") -> np.ndarray:
    """``[N]`` or ``[N, 1]`` labels as int64 ``[N]`` (:func:`labels_to_int64`)."""
    y = tensor[:, 0] if tensor.dim() == 2 and tensor.shape[1] == 1 else tensor
    if y.dim() != 1:
        raise GraphDataError(f"{field}: expected shape [N] or [N, 1], got {list(tensor.shape)}")
    if y.dtype.is_complex or y.dtype == torch.bool:
        raise GraphDataError(f"{field}: expected integer labels (-1 for unlabeled) or float "
                             f"labels (NaN for unlabeled), got {y.dtype}")
    if y.dtype == torch.bfloat16:  # NumPy has no bfloat16
        y = y.float()
    return labels_to_int64(_to_numpy(y, "y"), field)


def _num_classes(data: Data, y: np.ndarray, given: int | None) -> int:
    if given is not None:
        return int(given)
    stored = data.get("num_classes", None)
    if stored is not None:
        return int(stored)
    return max(int(y.max()) + 1, 1) if y.size else 1


def _splits(data: Data, num_nodes: int) -> dict[str, np.ndarray]:
    splits: dict[str, np.ndarray] = {}
    for split in SPLITS:
        mask = data.get(f"{split}_mask", None)
        idx = data.get(f"{split}_idx", None)
        if mask is not None and idx is not None:
            raise GraphDataError(f"data: expected {split}_mask or {split}_idx, got both")
        if mask is not None:
            if mask.dtype != torch.bool or tuple(mask.shape) != (num_nodes,):
                raise GraphDataError(
                    f"data.{split}_mask: expected bool of shape [{num_nodes}], "
                    f"got {mask.dtype} of shape {list(mask.shape)}"
                )
            splits[split] = _to_numpy(mask.nonzero().view(-1), f"{split}_mask").astype(np.int64)
        elif idx is not None:
            if idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.dim() != 1:
                raise GraphDataError(
                    f"data.{split}_idx: expected 1-D integer node IDs, "
                    f"got {idx.dtype} of shape {list(idx.shape)}"
                )
            splits[split] = _to_numpy(idx, f"{split}_idx").astype(np.int64, copy=False)
    return splits


def _edge_weight(data: Data, num_edges: int) -> np.ndarray | None:
    edge_attr = data.get("edge_attr", None)
    if data.get("edge_weight", None) is not None:
        key, weight = "edge_weight", data.edge_weight
    elif isinstance(edge_attr, torch.Tensor) and edge_attr.dim() == 1:
        key, weight = "edge_attr", edge_attr
    else:
        return None
    if tuple(weight.shape) != (num_edges,):
        raise GraphDataError(
            f"data.{key}: expected [{num_edges}] edge weights, got shape {list(weight.shape)}"
        )
    return _to_numpy(weight.float(), key).astype(np.float32, copy=False)


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory where torch can (writable and C-contiguous)."""
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, order="C")
    return torch.from_numpy(array)
