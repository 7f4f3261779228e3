"""Read and write a typed graph as one ``.npz`` archive of plain arrays (never pickled).

Type names live in the keys (``docs/datasets.md`` has the full table):

- ``num_nodes__<type>``: one integer per node type (the archive's order is the graph's
  node-type order);
- ``edge_index__<src>__<rel>__<dst>``: ``[2, E]`` or ``[E, 2]`` integers, local IDs;
- ``x__<type>``: ``[N_t, F_t]`` floats, for the types that have features;
- ``y__<type>``: ``[N_t]`` or ``[N_t, 1]`` integer labels (``-1`` = unlabeled; or floats,
  NaN = unlabeled); exactly one such key, which names the target type;
- optional: ``num_classes``, ``train_idx``/``val_idx``/``test_idx`` (local IDs of the
  target type) or ``train_mask``/``val_mask``/``test_mask``.

An archive with any ``edge_index__`` key is typed (:func:`is_hetero_npz`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from partitioner.graph import SPLITS, EdgeType, GraphDataError, edge_type_name, parse_edge_type
from partitioner.readers.npz import _edge_index, _features, _labels, _load_all, _scalar, _splits
from partitioner.typed import TypedGraphData

log = logging.getLogger(__name__)

_SPLIT_KEYS = tuple(f"{s}_{kind}" for s in SPLITS for kind in ("idx", "mask"))


def is_hetero_npz(path: str | Path) -> bool:
    """Whether the ``.npz`` at ``path`` holds a typed graph (reads the key names only)."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            return any(k.startswith("edge_index__") for k in npz.files)
    except (OSError, ValueError, AttributeError):
        return False


def read_npz_hetero(path: str | Path, *, name: str | None = None) -> TypedGraphData:
    """Read a typed graph from the ``.npz`` at ``path``; ``name`` defaults to the file stem.

    Raises :class:`GraphDataError` naming the file and the key when one is missing or
    malformed.
    """
    path = Path(path)
    arrays = _load_all(path)
    num_nodes = {k.split("__", 1)[1]: _scalar(arrays, k, path, default=0)
                 for k in arrays if k.startswith("num_nodes__")}
    if not num_nodes:
        raise GraphDataError(f"{path}: expected num_nodes__<type> keys, got keys {sorted(arrays)}")
    edges: dict[EdgeType, np.ndarray] = {}
    x: dict[str, np.ndarray] = {}
    targets: list[str] = []
    for key, value in arrays.items():
        kind, _, rest = key.partition("__")
        if kind == "edge_index" and rest:
            edges[parse_edge_type(rest)] = _edge_index(value, path)
        elif kind == "x" and rest:
            x[rest] = _features(value, path)
        elif kind == "y" and rest:
            targets.append(rest)
        elif kind != "num_nodes" and key not in (*_SPLIT_KEYS, "num_classes"):
            log.warning("%s: ignoring key %r, which graphfeed does not read", path, key)
    if len(targets) != 1:
        raise GraphDataError(
            f"{path}: expected exactly one y__<type> key (the labelled type), got {targets}")
    target = targets[0]
    if target not in num_nodes:
        raise GraphDataError(f"{path}: y__{target}: expected a node type among {list(num_nodes)}")
    y = _labels(arrays[f"y__{target}"], path)
    default_classes = max(int(y.max()) + 1, 1) if y.size else 1
    graph = TypedGraphData(
        name=name if name is not None else path.stem, num_nodes=num_nodes, edge_index=edges,
        x=x, target_type=target, y=y,
        num_classes=_scalar(arrays, "num_classes", path, default=default_classes),
        splits=_splits(arrays, num_nodes[target], path),
    )
    graph.validate()
    log.info("read typed graph %s from %s: %d nodes, %d edges", graph.name, path,
             graph.total_nodes, graph.num_edges())
    return graph


def write_npz_hetero(graph: TypedGraphData, path: str | Path, *, compress: bool = False) -> None:
    """Write ``graph`` to ``path`` (exactly that name) in the layout :func:`read_npz_hetero`
    reads; splits are written as ``<split>_idx``, the name is not stored."""
    graph.validate()
    arrays: dict[str, np.ndarray] = {}
    for t, n in graph.num_nodes.items():
        arrays[f"num_nodes__{t}"] = np.asarray(n, dtype=np.int64)
    for et, ei in graph.edge_index.items():
        arrays[f"edge_index__{edge_type_name(et)}"] = np.asarray(ei)
    for t, feats in graph.x.items():
        arrays[f"x__{t}"] = np.asarray(feats)
    arrays[f"y__{graph.target_type}"] = np.asarray(graph.y)
    arrays["num_classes"] = np.asarray(graph.num_classes, dtype=np.int64)
    for split, ids in graph.splits.items():
        arrays[f"{split}_idx"] = np.asarray(ids)
    save: Callable[..., None] = np.savez_compressed if compress else np.savez
    with open(path, "wb") as file:  # a file object: np.savez would append ".npz" to a name
        save(file, **arrays)
    log.info("wrote typed graph %s to %s", graph.name, path)
