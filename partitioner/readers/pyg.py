"""Convert between PyG graphs and graphfeed's: a ``Data`` is a :class:`GraphData`, a
``HeteroData`` a :class:`TypedGraphData`.

:func:`from_pyg` takes any graph the user already has in memory (a PyG dataset's
``dataset[0]``, or their own); :func:`to_pyg` gives one back to PyG.
"""

from __future__ import annotations

import logging
from typing import Any, overload

import numpy as np
import torch
from torch_geometric.data import Data, HeteroData

from partitioner.graph import (
    PLAIN_EDGE_TYPE,
    SPLITS,
    EdgeType,
    GraphData,
    GraphDataError,
    LinkSplit,
    TypedGraphData,
    labels_to_int64,
    plain_view,
)

log = logging.getLogger(__name__)

_FLOAT_DTYPES = (torch.float16, torch.float32, torch.float64)


def from_pyg(data: Data | HeteroData, *, name: str = "pyg", num_classes: int | None = None,
             target_type: str | None = None) -> GraphData | TypedGraphData:
    """Convert a PyG ``Data`` to a :class:`GraphData`, or a ``HeteroData`` to a
    :class:`TypedGraphData` (copying tensors to host memory).

    Reads ``x`` (required in a ``Data``; per node type where present in a ``HeteroData``),
    ``edge_index`` (per edge type), ``y`` (``[N]`` or ``[N, 1]``) and the splits from
    ``train_mask``/``val_mask``/``test_mask`` or ``train_idx``/``val_idx``/``test_idx``
    (of the target type: ``target_type``, else the one node type with ``y``), edge
    features (per edge type) from ``edge_attr`` (``[E]`` or ``[E, F]``, their dtype kept,
    bfloat16 becoming float32; an edge's original ID is its column in ``edge_index``), and
    edge weights from ``edge_weight``, else from a 1-D ``edge_attr`` whose values are all
    positive. Features keep their float16/32/64 dtype (bfloat16 becomes float32); integers
    become int64.
    ``num_classes`` defaults to ``data.num_classes`` when set, else ``y.max() + 1``.
    Link splits follow the names of PyG's ``train_test_split_edges``: a ``[2, E]``
    ``<split>_pos_edge_index`` (in a ``HeteroData``, of an edge type's store) is the link
    split ``<split>`` of that edge type, a ``<split>_neg_edge_index`` the link split
    ``<split>_neg`` (negative edges, as OGB collab's ``val_neg``).
    """
    if isinstance(data, HeteroData):
        graph: GraphData | TypedGraphData = _from_hetero_data(data, name, num_classes, target_type)
    elif isinstance(data, Data):
        if target_type is not None:
            raise GraphDataError(f"target_type: only for a HeteroData (a Data has one node type), "
                                 f"got {target_type!r}")
        graph = _from_data(data, name, num_classes)
    else:
        raise GraphDataError(f"data: expected a torch_geometric.data.Data or HeteroData, got "
                             f"{type(data).__name__}")
    graph.validate()
    log.info("converted %s from PyG %s", name, type(data).__name__)
    return graph


def _from_data(data: Data, name: str, num_classes: int | None) -> GraphData:
    edge_index = _edge_index(_required(data, "edge_index", "data"), "data.edge_index")
    x = _features(_required(data, "x", "data"), "data.x")
    y = _labels(_required(data, "y", "data"), "data.y")
    num_nodes = int(data.num_nodes) if data.num_nodes is not None else int(x.shape[0])
    return GraphData(
        name=name, num_nodes=num_nodes, edge_index=edge_index, x=x, y=y,
        num_classes=_num_classes(data, y, num_classes), splits=_splits(data, num_nodes, "data"),
        edge_weight=_edge_weight(data, edge_index.shape[1], "data"),
        edge_attr=_edge_attr(data, edge_index.shape[1], "data"),
        link_splits=_link_splits(data, PLAIN_EDGE_TYPE, "data"),
    )


def _from_hetero_data(data: HeteroData, name: str, num_classes: int | None,
                      target_type: str | None) -> TypedGraphData:
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
    weights: dict[EdgeType, np.ndarray] = {}
    attrs: dict[EdgeType, np.ndarray] = {}
    links: dict[str, LinkSplit] = {}
    for s, r, d in data.edge_types:
        et, field = (str(s), str(r), str(d)), f"data[{(s, r, d)!r}]"
        edges[et] = _edge_index(_required(data[s, r, d], "edge_index", field), f"{field}.edge_index")
        weight = _edge_weight(data[s, r, d], edges[et].shape[1], field)
        if weight is not None:
            weights[et] = weight
        attr = _edge_attr(data[s, r, d], edges[et].shape[1], field)
        if attr is not None:
            attrs[et] = attr
        for split, link in _link_splits(data[s, r, d], et, field).items():
            if split in links:
                raise GraphDataError(f"{field}.{split}: link split {split!r} is given for two edge types "
                                     f"({links[split].edge_type} and {et})")
            links[split] = link
    x = {t: _features(data[t].x, f"data[{t!r}].x") for t in data.node_types if "x" in data[t]}
    store = data[target_type]
    y = _labels(store.y, f"data[{target_type!r}].y")
    return TypedGraphData(
        name=name, num_nodes=num_nodes, edge_index=edges, x=x, target_type=target_type, y=y,
        num_classes=_num_classes(data, y, num_classes),
        splits=_splits(store, num_nodes[target_type], f"data[{target_type!r}]"), edge_weight=weights,
        edge_attr=attrs, link_splits=links,
    )


def _link_splits(store: Any, edge_type: EdgeType, field: str) -> dict[str, LinkSplit]:
    """A store's ``<split>_pos_edge_index`` / ``<split>_neg_edge_index`` as link splits."""
    out = {}
    for key in sorted(str(k) for k in store.keys()):  # noqa: SIM118 - a PyG store is no dict
        for suffix, name_of in (("_pos_edge_index", ""), ("_neg_edge_index", "_neg")):
            if key.endswith(suffix) and len(key) > len(suffix):
                edges = _edge_index(store[key], f"{field}.{key}")
                out[key[:-len(suffix)] + name_of] = LinkSplit(edge_type, edges[0].copy(), edges[1].copy())
    return out


@overload
def to_pyg(graph: TypedGraphData) -> HeteroData: ...
@overload
def to_pyg(graph: GraphData) -> Data: ...
def to_pyg(graph: GraphData | TypedGraphData) -> Data | HeteroData:
    """Convert ``graph`` to a PyG ``Data`` (a :class:`TypedGraphData`: a ``HeteroData``)
    with ``train_mask``/``val_mask``/``test_mask`` (on the target type), edge weights
    as ``edge_weight`` and edge features as ``edge_attr`` (per edge type).

    The masks do not keep the order of a split's node IDs; ``num_classes`` is set as a
    graph attribute so that :func:`from_pyg` finds it again.
    """
    graph.validate(check_values=False)
    g = graph if isinstance(graph, TypedGraphData) else plain_view(graph)
    data = HeteroData() if isinstance(graph, TypedGraphData) else Data()

    def store(key: str | EdgeType) -> Any:  # a Data is its one node and edge type's store
        return data[key] if isinstance(data, HeteroData) else data

    for et, ei in g.edge_index.items():
        store(et).edge_index = _to_tensor(ei)
    for t, n in g.num_nodes.items():
        store(t).num_nodes = n
        if t in g.x:
            store(t).x = _to_tensor(g.x[t])
    for key, arrays in (("edge_weight", g.edge_weight), ("edge_attr", g.edge_attr)):
        for et, array in arrays.items():
            store(et)[key] = _to_tensor(array)
    target, n_target = store(g.target_type), g.num_nodes[g.target_type]
    target.y = _to_tensor(graph.y)
    for split, ids in graph.splits.items():
        mask = torch.zeros(n_target, dtype=torch.bool)
        mask[_to_tensor(ids)] = True
        target[f"{split}_mask"] = mask
    data.num_classes = graph.num_classes
    return data


def _required(store: Any, key: str, field: str) -> torch.Tensor:
    value = store.get(key, None)
    if not isinstance(value, torch.Tensor):
        raise GraphDataError(
            f"{field}.{key}: expected a tensor, got {type(value).__name__}; "
            f"keys present: {sorted(store.keys())}"
        )
    return value


def _to_numpy(tensor: torch.Tensor, field: str) -> np.ndarray:
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise GraphDataError(f"{field}: expected a dense tensor, got layout {tensor.layout}")
    return tensor.detach().cpu().numpy()


def _edge_index(tensor: torch.Tensor, field: str) -> np.ndarray:
    edge_index = _to_numpy(tensor, field)
    if edge_index.ndim != 2 or edge_index.shape[0] != 2:
        raise GraphDataError(f"{field}: expected shape [2, E], got {list(edge_index.shape)}")
    if not np.issubdtype(edge_index.dtype, np.integer):
        raise GraphDataError(f"{field}: expected an integer dtype, got {edge_index.dtype}")
    return np.ascontiguousarray(edge_index, dtype=np.int64)


def _features(tensor: torch.Tensor, field: str) -> np.ndarray:
    if tensor.dim() != 2:
        raise GraphDataError(f"{field}: expected shape [N, F], got {list(tensor.shape)}")
    if tensor.dtype == torch.bfloat16:
        log.info("%s is bfloat16, which numpy lacks; converting to float32", field)
        tensor = tensor.float()
    if tensor.dtype not in _FLOAT_DTYPES:
        raise GraphDataError(f"{field}: expected float16, float32 or float64, got {tensor.dtype}")
    return _to_numpy(tensor, field)


def _labels(tensor: torch.Tensor, field: str) -> np.ndarray:
    """``[N]`` or ``[N, 1]`` labels as int64 ``[N]`` (:func:`labels_to_int64`)."""
    if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16
        tensor = tensor.float()
    return labels_to_int64(_to_numpy(tensor, field), field)


def _num_classes(data: Data | HeteroData, y: np.ndarray, given: int | None) -> int:
    if given is not None:
        return int(given)
    stored = data.get("num_classes", None)
    if stored is not None:
        return int(stored)
    return max(int(y.max()) + 1, 1) if y.size else 1


def _splits(store: Any, num_nodes: int, field: str) -> dict[str, np.ndarray]:
    """The splits of a ``Data`` or of the target type's node store, from masks or IDs."""
    splits: dict[str, np.ndarray] = {}
    for split in SPLITS:
        mask = store.get(f"{split}_mask", None)
        idx = store.get(f"{split}_idx", None)
        if mask is not None and idx is not None:
            raise GraphDataError(f"{field}: expected {split}_mask or {split}_idx, got both")
        if mask is not None:
            if mask.dtype != torch.bool or tuple(mask.shape) != (num_nodes,):
                raise GraphDataError(
                    f"{field}.{split}_mask: expected bool of shape [{num_nodes}], "
                    f"got {mask.dtype} of shape {list(mask.shape)}"
                )
            splits[split] = _to_numpy(mask.nonzero().view(-1), f"{field}.{split}_mask").astype(np.int64)
        elif idx is not None:
            if idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.dim() != 1:
                raise GraphDataError(
                    f"{field}.{split}_idx: expected 1-D integer node IDs, "
                    f"got {idx.dtype} of shape {list(idx.shape)}"
                )
            splits[split] = _to_numpy(idx, f"{field}.{split}_idx").astype(np.int64, copy=False)
    return splits


def _edge_weight(store: Any, num_edges: int, field: str) -> np.ndarray | None:
    """``edge_weight``, else a 1-D ``edge_attr`` of positive numbers, of a ``Data`` or an
    edge type's store."""
    edge_attr = store.get("edge_attr", None)
    if store.get("edge_weight", None) is not None:
        key, weight = "edge_weight", store.edge_weight
    elif (isinstance(edge_attr, torch.Tensor) and edge_attr.dim() == 1 and edge_attr.dtype != torch.bool
          and edge_attr.numel() and bool((edge_attr > 0).all())):
        key, weight = "edge_attr", edge_attr
    else:
        return None
    if tuple(weight.shape) != (num_edges,):
        raise GraphDataError(
            f"{field}.{key}: expected [{num_edges}] edge weights, got shape {list(weight.shape)}"
        )
    return _to_numpy(weight.float(), f"{field}.{key}").astype(np.float32, copy=False)


def _edge_attr(store: Any, num_edges: int, field: str) -> np.ndarray | None:
    """``edge_attr`` of a ``Data`` or an edge type's store: ``[E]`` or ``[E, F]`` numbers in
    their dtype (bfloat16, which numpy lacks, as float32); None without one."""
    attr = store.get("edge_attr", None)
    if attr is None:
        return None
    name = f"{field}.edge_attr"
    if not isinstance(attr, torch.Tensor):
        raise GraphDataError(f"{name}: expected a tensor, got {type(attr).__name__}")
    if attr.dtype == torch.bfloat16:
        log.info("%s is bfloat16, which numpy lacks; converting to float32", name)
        attr = attr.float()
    if attr.dim() not in (1, 2) or attr.shape[0] != num_edges or attr.is_complex():
        raise GraphDataError(f"{name}: expected numbers of shape [{num_edges}] or [{num_edges}, F] "
                             f"(one row per edge), got {attr.dtype} of shape {list(attr.shape)}")
    return _to_numpy(attr, name)


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory where torch can (writable and C-contiguous)."""
    array = np.asarray(array)
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, order="C")
    return torch.from_numpy(array)
