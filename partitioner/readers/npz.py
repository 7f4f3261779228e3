"""Read and write a graph as one ``.npz`` archive of plain arrays (never pickled).

Keys (``docs/datasets.md`` has the full table):

- required: ``edge_index`` (``[2, E]`` or ``[E, 2]`` integers), ``x`` (``[N, F]`` floats),
  ``y`` (``[N]`` or ``[N, 1]`` integers, ``-1`` for unlabeled nodes, or floats with NaN
  for unlabeled nodes, as OGB stores papers100M's);
- optional: ``num_nodes`` (default ``x.shape[0]``), ``num_classes`` (default
  ``y.max() + 1``), ``train_idx``/``val_idx``/``test_idx`` (node IDs) or
  ``train_mask``/``val_mask``/``test_mask`` (``[N]`` booleans), ``edge_weight`` (``[E]``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from partitioner.graph import SPLITS, GraphData, GraphDataError, labels_to_int64

log = logging.getLogger(__name__)

#: Keys :func:`read_npz` requires.
REQUIRED_KEYS: tuple[str, ...] = ("edge_index", "x", "y")
#: Keys :func:`read_npz` understands besides the required ones.
OPTIONAL_KEYS: tuple[str, ...] = (
    "num_nodes",
    "num_classes",
    "edge_weight",
    *(f"{split}_{kind}" for split in SPLITS for kind in ("idx", "mask")),
    "valid_idx", "valid_mask",
)


def read_npz(path: str | Path, *, name: str | None = None) -> GraphData:
    """Read a graph from the ``.npz`` at ``path``; ``name`` defaults to the file's stem.

    An ``edge_index`` of shape ``[2, 2]`` is taken as ``[2, E]``. Raises
    :class:`GraphDataError` naming the file and the key when a key is missing or malformed.
    """
    path = Path(path)
    arrays = _load_all(path)
    missing = [key for key in REQUIRED_KEYS if key not in arrays]
    if missing:
        raise GraphDataError(
            f"{path}: missing required key {missing[0]!r}; keys present: {sorted(arrays)}"
        )
    ignored = sorted(set(arrays) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if ignored:
        log.warning("%s: ignoring keys graphfeed does not read: %s", path, ignored)
    x = _features(arrays["x"], path)
    num_nodes = _scalar(arrays, "num_nodes", path, default=int(x.shape[0]))
    y = _labels(arrays["y"], path)
    default_classes = max(int(y.max()) + 1, 1) if y.size else 1
    edge_index = _edge_index(arrays["edge_index"], path)
    graph = GraphData(
        name=name if name is not None else path.stem,
        num_nodes=num_nodes,
        edge_index=edge_index,
        x=x,
        y=y,
        num_classes=_scalar(arrays, "num_classes", path, default=default_classes),
        splits=_splits(arrays, num_nodes, path),
        edge_weight=_edge_weight(arrays.get("edge_weight"), edge_index.shape[1], path),
    )
    graph.validate()
    log.info(
        "read %s from %s: %d nodes, %d edges, %d features",
        graph.name, path, graph.num_nodes, graph.num_edges, graph.feature_dim,
    )
    return graph


def write_npz(graph: GraphData, path: str | Path, *, compress: bool = False) -> None:
    """Write ``graph`` to ``path`` (exactly that name) in the layout :func:`read_npz` reads.

    Splits are written as ``<split>_idx``; the graph's name is not stored.
    """
    graph.validate()
    arrays: dict[str, np.ndarray] = {
        "edge_index": np.asarray(graph.edge_index),
        "x": np.asarray(graph.x),
        "y": np.asarray(graph.y),
        "num_nodes": np.asarray(graph.num_nodes, dtype=np.int64),
        "num_classes": np.asarray(graph.num_classes, dtype=np.int64),
    }
    for split, ids in graph.splits.items():
        arrays[f"{split}_idx"] = np.asarray(ids)
    if graph.edge_weight is not None:
        arrays["edge_weight"] = np.asarray(graph.edge_weight)
    save: Callable[..., None] = np.savez_compressed if compress else np.savez
    with open(path, "wb") as file:  # a file object: np.savez would append ".npz" to a name
        save(file, **arrays)
    log.info("wrote %s to %s", graph.name, path)


def _load_all(path: Path) -> dict[str, np.ndarray]:
    try:
        npz = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such .npz file") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise GraphDataError(
            f"{path}: expected an .npz archive of named arrays, got a single .npy array"
        )
    with npz:
        arrays: dict[str, np.ndarray] = {}
        for key in npz.files:
            try:
                arrays[key] = npz[key]
            except ValueError as err:  # object arrays would need pickle
                raise GraphDataError(
                    f"{path}: key {key!r}: expected a plain numeric array, got one that needs "
                    f"pickle to load ({err})"
                ) from None
    return arrays


def _edge_index(raw: np.ndarray, path: Path) -> np.ndarray:
    if raw.ndim != 2 or 2 not in raw.shape:
        raise GraphDataError(
            f"{path}: edge_index: expected shape [2, E] or [E, 2], got {list(raw.shape)}"
        )
    if not np.issubdtype(raw.dtype, np.integer):
        raise GraphDataError(f"{path}: edge_index: expected an integer dtype, got {raw.dtype}")
    oriented = raw if raw.shape[0] == 2 else raw.T
    return np.ascontiguousarray(oriented, dtype=np.int64)


def _features(raw: np.ndarray, path: Path) -> np.ndarray:
    if raw.ndim != 2:
        raise GraphDataError(f"{path}: x: expected shape [N, F], got {list(raw.shape)}")
    if raw.dtype not in (np.float16, np.float32, np.float64):
        raise GraphDataError(f"{path}: x: expected float16, float32 or float64, got {raw.dtype}")
    return raw


def _labels(raw: np.ndarray, path: Path) -> np.ndarray:
    y = raw[:, 0] if raw.ndim == 2 and raw.shape[1] == 1 else raw
    if y.ndim != 1:
        raise GraphDataError(f"{path}: y: expected shape [N] or [N, 1], got {list(raw.shape)}")
    return labels_to_int64(y, f"{path}: y")


def _scalar(arrays: dict[str, np.ndarray], key: str, path: Path, *, default: int) -> int:
    if key not in arrays:
        return default
    value = arrays[key]
    if value.size != 1 or not np.issubdtype(value.dtype, np.integer):
        raise GraphDataError(
            f"{path}: {key}: expected one integer, got {value.dtype} of shape {list(value.shape)}"
        )
    return int(value.reshape(()))


def _splits(arrays: dict[str, np.ndarray], num_nodes: int, path: Path) -> dict[str, np.ndarray]:
    splits: dict[str, np.ndarray] = {}
    if "val_idx" not in arrays and "val_mask" not in arrays:  # OGB's name for the split
        for kind in ("idx", "mask"):
            if f"valid_{kind}" in arrays:
                log.info("%s: reading valid_%s as the val split", path, kind)
                arrays = {**arrays, f"val_{kind}": arrays[f"valid_{kind}"]}
    for split in SPLITS:
        idx, mask = arrays.get(f"{split}_idx"), arrays.get(f"{split}_mask")
        if idx is not None and mask is not None:
            raise GraphDataError(f"{path}: expected {split}_idx or {split}_mask, got both")
        if mask is not None:
            if mask.dtype != np.bool_ or mask.shape != (num_nodes,):
                raise GraphDataError(
                    f"{path}: {split}_mask: expected bool of shape [{num_nodes}], "
                    f"got {mask.dtype} of shape {list(mask.shape)}"
                )
            splits[split] = np.flatnonzero(mask).astype(np.int64)
        elif idx is not None:
            column = idx.ndim == 2 and idx.shape[1] == 1
            if not np.issubdtype(idx.dtype, np.integer) or not (idx.ndim == 1 or column):
                raise GraphDataError(
                    f"{path}: {split}_idx: expected integer node IDs of shape [K] or [K, 1], "
                    f"got {idx.dtype} of shape {list(idx.shape)}"
                )
            splits[split] = idx.reshape(-1).astype(np.int64, copy=False)
    return splits


def _edge_weight(raw: np.ndarray | None, num_edges: int, path: Path) -> np.ndarray | None:
    if raw is None:
        return None
    weight = raw.reshape(-1) if raw.ndim == 2 and raw.shape[1] == 1 else raw
    if weight.shape != (num_edges,) or not np.issubdtype(weight.dtype, np.number):
        raise GraphDataError(
            f"{path}: edge_weight: expected [{num_edges}] numbers, "
            f"got {weight.dtype} of shape {list(raw.shape)}"
        )
    return weight.astype(np.float32, copy=False)
