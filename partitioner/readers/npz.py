"""Read and write a graph as one ``.npz`` archive of plain arrays (never pickled), plain or
typed.

Keys of a plain graph (``docs/datasets.md`` has the full tables):

- required: ``edge_index`` (``[2, E]`` or ``[E, 2]`` integers), ``x`` (``[N, F]`` floats),
  ``y`` (``[N]`` or ``[N, 1]`` integers, ``-1`` for unlabeled nodes, or floats with NaN
  for unlabeled nodes, as OGB stores papers100M's; a link graph, one with link splits,
  may leave it out: every node is then unlabeled);
- optional: ``num_nodes`` (default ``x.shape[0]``), ``edge_weight`` (``[E]``),
  ``edge_attr`` (``[E]`` or ``[E, F]`` edge features of any numeric dtype, aligned with
  ``edge_index``: an edge's original ID is its column there), ``edge_ids`` (``[E]``
  original IDs of the edges where they are not their columns, e.g. after a link split).

Keys of a typed graph, which name the types:

- ``num_nodes__<type>``: one integer per node type (the archive's order is the graph's
  node-type order);
- ``edge_index__<src>__<rel>__<dst>``: ``[2, E]`` or ``[E, 2]`` integers, local IDs;
- ``edge_weight__<src>__<rel>__<dst>``: optional ``[E]`` positive weights of a relation;
- ``edge_attr__<src>__<rel>__<dst>``: optional ``[E]`` or ``[E, F]`` edge features of a relation;
- ``x__<type>``: ``[N_t, F_t]`` floats, for the types that have features;
- ``y__<type>``: labels as above; exactly one such key, which names the target type (a
  link graph may have none: its first link split's destination type is then the target
  type, every node unlabeled).

Both: optional ``num_classes`` (default ``y.max() + 1``), ``train_idx``/``val_idx``/
``test_idx`` (node IDs; of the target type in a typed graph) or ``train_mask``/
``val_mask``/``test_mask`` (booleans), OGB's ``valid_*`` for ``val``. An archive with any
``edge_index__`` key is typed (:func:`is_typed_npz`).

Link splits (:mod:`partitioner.links`), in original IDs, for a split name ``S`` (``train``,
``val``, ``test`` ...; on a typed graph each key ends in ``__<src>__<rel>__<dst>``, the
split's edge type):

- ``S_pos``: ``[2, E]`` or ``[E, 2]`` its edges (``train_pos``, ``val_pos``, ``test_pos``);
- ``S_neg_dst``: optional ``[E, K]`` given negative destinations of each edge (citation2's
  protocol);
- ``S_label``: optional ``[E, ...]`` labels of its edges;
- ``S_neg``: ``[2, E']`` or ``[E', 2]`` negative edges, read as the link split ``S_neg``
  (collab's ``val_neg`` / ``test_neg``, for Hits@K).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from partitioner.graph import (
    PLAIN_EDGE_TYPE,
    SPLITS,
    EdgeType,
    GraphData,
    GraphDataError,
    LinkSplit,
    TypedGraphData,
    edge_type_name,
    labels_to_int64,
    parse_edge_type,
    plain_view,
)

log = logging.getLogger(__name__)

#: Keys of a plain archive :func:`read_npz` requires.
REQUIRED_KEYS: tuple[str, ...] = ("edge_index", "x", "y")
#: Keys of a plain archive :func:`read_npz` understands besides the required ones.
OPTIONAL_KEYS: tuple[str, ...] = (
    "num_nodes",
    "num_classes",
    "edge_weight",
    "edge_attr",
    "edge_ids",
    *(f"{split}_{kind}" for split in SPLITS for kind in ("idx", "mask")),
    "valid_idx", "valid_mask",
)
#: Key prefixes of a typed archive, each followed by ``__`` and a node or edge type name.
TYPED_PREFIXES: tuple[str, ...] = ("num_nodes", "edge_index", "edge_weight", "edge_attr", "edge_ids", "x",
                                   "y")
#: Keys of either kind that name no type.
_SHARED_KEYS = frozenset(OPTIONAL_KEYS) - {"num_nodes", "edge_weight", "edge_attr", "edge_ids"}


def is_typed_npz(path: str | Path) -> bool:
    """Whether the ``.npz`` at ``path`` holds a typed graph (reads the key names only)."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            return _is_typed(npz.files)
    except (OSError, ValueError, AttributeError):
        return False


def _is_typed(keys: list[str] | dict[str, np.ndarray]) -> bool:
    return any(k.startswith("edge_index__") for k in keys)


def read_npz(path: str | Path, *, name: str | None = None) -> GraphData | TypedGraphData:
    """Read the graph in the ``.npz`` at ``path``: a :class:`GraphData`, or a
    :class:`TypedGraphData` when the archive has ``edge_index__*`` keys. ``name`` defaults
    to the file's stem.

    An ``edge_index`` of shape ``[2, 2]`` is taken as ``[2, E]``. Raises
    :class:`GraphDataError` naming the file and the key when a key is missing or malformed.
    """
    path = Path(path)
    arrays = _load_all(path)  # every key, the link splits' too, for the errors to list
    name = name if name is not None else path.stem
    typed = _is_typed(arrays)
    links = _link_splits({k: v for k, v in arrays.items() if _LINK_KEY.fullmatch(k)}, path, typed=typed)
    graph = _read_typed(arrays, path, name, links) if typed else _read_plain(arrays, path, name, links)
    graph.link_splits = links
    graph.validate()
    log.info("read %s from %s: %s", graph.name, path, _sizes(graph))
    return graph


def _sizes(graph: GraphData | TypedGraphData) -> str:
    if isinstance(graph, TypedGraphData):
        return (f"{graph.total_nodes} nodes of {len(graph.num_nodes)} types, {graph.num_edges()} edges "
                f"of {len(graph.edge_index)} types")
    return f"{graph.num_nodes} nodes, {graph.num_edges} edges, {graph.feature_dim} features"


def _read_plain(arrays: dict[str, np.ndarray], path: Path, name: str,
                links: dict[str, LinkSplit]) -> GraphData:
    # a link graph needs neither labels nor features (its nodes then get learnable embeddings)
    missing = [key for key in REQUIRED_KEYS if key not in arrays and not (key in ("x", "y") and links)]
    if "x" not in arrays and "num_nodes" not in arrays:
        missing.append("num_nodes")
    if missing:
        raise GraphDataError(f"{path}: missing required key{'s' * (len(missing) > 1)} "
                             f"{', '.join(map(repr, missing))}; the file has the keys {sorted(arrays)}")
    _warn_ignored(path, [k for k in arrays if k not in REQUIRED_KEYS and k not in OPTIONAL_KEYS])
    x = _features(arrays["x"], path, "x") if "x" in arrays else None
    num_nodes = _scalar(arrays, "num_nodes", path, default=int(x.shape[0]) if x is not None else 0)
    y = _labels(arrays, "y", num_nodes, path)
    edge_index = _edge_index(arrays["edge_index"], path, "edge_index")
    return GraphData(
        name=name, num_nodes=num_nodes, edge_index=edge_index, x=x, y=y,
        num_classes=_num_classes(arrays, y, path), splits=_splits(arrays, num_nodes, path),
        edge_weight=None if "edge_weight" not in arrays else
        _edge_weight(arrays["edge_weight"], path, "edge_weight", edge_index.shape[1]),
        edge_attr=None if "edge_attr" not in arrays else
        _edge_attr(arrays["edge_attr"], path, "edge_attr", edge_index.shape[1]),
        edge_ids=None if "edge_ids" not in arrays else _edge_ids(arrays["edge_ids"], path, "edge_ids"),
    )


def _read_typed(arrays: dict[str, np.ndarray], path: Path, name: str,
                links: dict[str, LinkSplit]) -> TypedGraphData:
    by_kind: dict[str, dict[str, str]] = {kind: {} for kind in TYPED_PREFIXES}
    ignored = []
    for key in arrays:
        kind, _, rest = key.partition("__")
        if kind in by_kind and rest:
            by_kind[kind][rest] = key
        elif key not in _SHARED_KEYS:
            ignored.append(key)
    _warn_ignored(path, ignored)
    num_nodes = {t: _scalar(arrays, k, path, default=0) for t, k in by_kind["num_nodes"].items()}
    if not num_nodes:
        raise GraphDataError(f"{path}: expected num_nodes__<type> keys; the file has the keys "
                             f"{sorted(arrays)}")
    targets = list(by_kind["y"])
    if not targets and links:  # a link graph needs no labels: its first split's destination type
        targets = [next(iter(links.values())).edge_type[2]]
    if len(targets) != 1:
        raise GraphDataError(f"{path}: expected exactly one y__<type> key (the labelled type; none in a link "
                             f"graph), got {targets}; the file has the keys {sorted(arrays)}")
    target = targets[0]
    if target not in num_nodes:
        raise GraphDataError(f"{path}: y__{target}: expected a node type among {list(num_nodes)}")
    edges = {_edge_type(rest, path, k): _edge_index(arrays[k], path, k)
             for rest, k in by_kind["edge_index"].items()}
    per_edge: dict[str, dict[EdgeType, np.ndarray]] = {"edge_weight": {}, "edge_attr": {}, "edge_ids": {}}
    readers = (("edge_weight", _edge_weight), ("edge_attr", _edge_attr),
               ("edge_ids", lambda raw, path, key, _: _edge_ids(raw, path, key)))
    for kind, read in readers:
        for rest, key in by_kind[kind].items():
            et = _edge_type(rest, path, key)
            if et not in edges:
                raise GraphDataError(f"{path}: {key}: expected a relation with an edge_index__{rest} key, "
                                     f"got none; relations: {[edge_type_name(e) for e in edges]}")
            per_edge[kind][et] = read(arrays[key], path, key, edges[et].shape[1])
    y = _labels(arrays, f"y__{target}", num_nodes[target], path)
    return TypedGraphData(
        name=name, num_nodes=num_nodes, edge_index=edges,
        x={t: _features(arrays[k], path, k) for t, k in by_kind["x"].items()}, target_type=target,
        y=y, num_classes=_num_classes(arrays, y, path), splits=_splits(arrays, num_nodes[target], path),
        edge_weight=per_edge["edge_weight"], edge_attr=per_edge["edge_attr"], edge_ids=per_edge["edge_ids"],
    )


def _labels(arrays: dict[str, np.ndarray], key: str, num_nodes: int, path: Path) -> np.ndarray:
    """The labels under ``key``; without the key (a link graph's), every node unlabeled."""
    if key not in arrays:
        return np.full(num_nodes, -1, np.int64)
    return labels_to_int64(arrays[key], f"{path}: {key}")


def _edge_ids(raw: np.ndarray, path: Path, key: str) -> np.ndarray:
    """Original edge IDs as int64 (their shape is checked with the graph)."""
    if raw.dtype.kind not in "iu":
        raise GraphDataError(f"{path}: {key}: expected integer edge IDs, got {raw.dtype}")
    return np.ascontiguousarray(raw, dtype=np.int64)


def write_npz(graph: GraphData | TypedGraphData, path: str | Path, *, compress: bool = False) -> None:
    """Write ``graph`` to ``path`` (exactly that name) in the layout :func:`read_npz` reads
    back (a typed graph with its types in the keys). Splits are written as
    ``<split>_idx``; the graph's name is not stored."""
    graph.validate()
    typed = isinstance(graph, TypedGraphData)
    g = graph if isinstance(graph, TypedGraphData) else plain_view(graph)

    def key(kind: str, t: str | EdgeType) -> str:  # a typed graph's keys end in their type
        return f"{kind}__{t if isinstance(t, str) else edge_type_name(t)}" if typed else kind

    arrays = {key("num_nodes", t): np.asarray(n, dtype=np.int64) for t, n in g.num_nodes.items()}
    per_type: tuple[tuple[str, Mapping[Any, np.ndarray]], ...] = (
        ("edge_index", g.edge_index), ("edge_weight", g.edge_weight), ("edge_attr", g.edge_attr),
        ("edge_ids", g.edge_ids), ("x", g.x), ("y", {g.target_type: g.y}))
    for kind, by_type in per_type:
        arrays.update({key(kind, t): np.asarray(a) for t, a in by_type.items()})
    arrays["num_classes"] = np.asarray(graph.num_classes, dtype=np.int64)
    for split, ids in graph.splits.items():
        arrays[f"{split}_idx"] = np.asarray(ids)
    for split, link in graph.link_splits.items():
        suffix = f"__{edge_type_name(link.edge_type)}" if typed else ""
        arrays[f"{split}_pos{suffix}"] = np.stack([np.asarray(link.src), np.asarray(link.dst)])
        if link.neg_dst is not None:
            arrays[f"{split}_neg_dst{suffix}"] = np.asarray(link.neg_dst)
        if link.label is not None:
            arrays[f"{split}_label{suffix}"] = np.asarray(link.label)
    save: Callable[..., None] = np.savez_compressed if compress else np.savez
    with open(path, "wb") as file:  # a file object: np.savez would append ".npz" to a name
        save(file, **arrays)
    log.info("wrote %s to %s: %s", graph.name, path, _sizes(graph))


def _edge_type(name: str, path: Path, key: str) -> EdgeType:
    try:
        return parse_edge_type(name)
    except GraphDataError as err:
        raise GraphDataError(f"{path}: {key}: {err}") from None


def _warn_ignored(path: Path, keys: list[str]) -> None:
    keys = [k for k in keys if not _LINK_KEY.fullmatch(k)]  # read as link splits
    if keys:
        log.warning("%s: ignoring keys graphfeed does not read: %s", path, sorted(keys))


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


def _edge_index(raw: np.ndarray, path: Path, key: str) -> np.ndarray:
    if raw.ndim != 2 or 2 not in raw.shape:
        raise GraphDataError(
            f"{path}: {key}: expected shape [2, E] or [E, 2], got {list(raw.shape)}"
        )
    if not np.issubdtype(raw.dtype, np.integer):
        raise GraphDataError(f"{path}: {key}: expected an integer dtype, got {raw.dtype}")
    oriented = raw if raw.shape[0] == 2 else raw.T
    return np.ascontiguousarray(oriented, dtype=np.int64)


def _features(raw: np.ndarray, path: Path, key: str) -> np.ndarray:
    if raw.ndim != 2:
        raise GraphDataError(f"{path}: {key}: expected shape [N, F], got {list(raw.shape)}")
    if raw.dtype not in (np.float16, np.float32, np.float64):
        raise GraphDataError(f"{path}: {key}: expected float16, float32 or float64, got {raw.dtype}")
    return raw


def _scalar(arrays: dict[str, np.ndarray], key: str, path: Path, *, default: int) -> int:
    if key not in arrays:
        return default
    value = arrays[key]
    if value.size != 1 or not np.issubdtype(value.dtype, np.integer):
        raise GraphDataError(
            f"{path}: {key}: expected one integer, got {value.dtype} of shape {list(value.shape)}"
        )
    return int(value.reshape(()))


def _num_classes(arrays: dict[str, np.ndarray], y: np.ndarray, path: Path) -> int:
    return _scalar(arrays, "num_classes", path, default=max(int(y.max()) + 1, 1) if y.size else 1)


def _splits(arrays: dict[str, np.ndarray], num_nodes: int, path: Path) -> dict[str, np.ndarray]:
    """The splits of ``<split>_idx`` or ``<split>_mask`` keys (OGB's ``valid_*`` for val)
    over ``num_nodes`` nodes (the target type's in a typed graph)."""
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


def _edge_weight(raw: np.ndarray, path: Path, key: str, num_edges: int) -> np.ndarray:
    weight = raw.reshape(-1) if raw.ndim == 2 and raw.shape[1] == 1 else raw
    if weight.shape != (num_edges,) or not np.issubdtype(weight.dtype, np.number):
        raise GraphDataError(
            f"{path}: {key}: expected [{num_edges}] numbers, "
            f"got {weight.dtype} of shape {list(raw.shape)}"
        )
    return weight.astype(np.float32, copy=False)


def _edge_attr(raw: np.ndarray, path: Path, key: str, num_edges: int) -> np.ndarray:
    """``[E]`` or ``[E, F]`` edge features, kept in their dtype (booleans, integers, floats)."""
    if raw.ndim not in (1, 2) or raw.shape[0] != num_edges or raw.dtype.kind not in "biuf":
        raise GraphDataError(
            f"{path}: {key}: expected numbers of shape [{num_edges}] or [{num_edges}, F] (one row "
            f"per edge of edge_index), got {raw.dtype} of shape {list(raw.shape)}"
        )
    return raw


#: A link split's key: split name, kind, and on a typed graph ``__<edge type>``.
_LINK_KEY = re.compile(r"(?P<split>[A-Za-z0-9-]+(?:_[A-Za-z0-9-]+)*?)_(?P<kind>pos|neg_dst|neg|label)"
                       r"(?:__(?P<et>.+))?")


def _link_splits(keys: dict[str, np.ndarray], path: Path, *, typed: bool) -> dict[str, LinkSplit]:
    """The link splits of an archive's link keys (see the module doc)."""
    parts: dict[str, dict[str, np.ndarray]] = {}
    types: dict[str, EdgeType] = {}
    for key, raw in keys.items():
        m = _LINK_KEY.fullmatch(key)
        assert m is not None  # the caller picked the keys by this pattern
        if typed != (m["et"] is not None):
            want = "end in __<src>__<rel>__<dst> (the split's edge type)" if typed else "name no edge type"
            kind_of = "typed" if typed else "plain"
            raise GraphDataError(f"{path}: {key}: link keys of a {kind_of} graph {want}")
        split, kind = m["split"], m["kind"]
        if kind == "neg":  # negative edges: a split of their own
            split, kind = f"{split}_neg", "pos"
        et = _edge_type(m["et"], path, key) if typed else PLAIN_EDGE_TYPE
        if types.setdefault(split, et) != et:
            raise GraphDataError(f"{path}: {key}: expected edge type {edge_type_name(types[split])} as the "
                                 f"split's other keys, got {edge_type_name(et)}")
        parts.setdefault(split, {})[kind] = raw
    out = {}
    for split, found in parts.items():
        if "pos" not in found:
            raise GraphDataError(f"{path}: link split {split!r}: expected the key {split}_pos with its "
                                 f"edges, got only {sorted(found)}")
        edges = _edge_index(found["pos"], path, f"{split}_pos")
        neg = found.get("neg_dst")
        if neg is not None and (neg.ndim != 2 or neg.dtype.kind not in "iu"):
            raise GraphDataError(f"{path}: {split}_neg_dst: expected [E, K] integers, got {neg.dtype} of "
                                 f"shape {list(neg.shape)}")
        out[split] = LinkSplit(types[split], edges[0].copy(), edges[1].copy(), label=found.get("label"),
                               neg_dst=None if neg is None else np.ascontiguousarray(neg, dtype=np.int64))
    return out
