"""A graph as a directory of ``.npy`` files, read memory-mapped for out-of-core work.

Layout of a plain graph: ``graph.json`` (name, num_nodes, num_classes), ``edge_index.npy``
([2, E] int64), ``x.npy`` ([N, F]), ``y.npy`` ([N] int64), optional ``edge_weight.npy``
([E] float32), ``edge_attr.npy`` ([E] or [E, F] edge features, any numeric dtype) and
``<split>_idx.npy`` (int64) for the splits present (``valid_idx.npy`` is
read as ``val``). A typed graph's ``graph.json`` also names its ``target_type`` and its
``edge_types`` (``src__rel__dst``, in order) and gives ``num_nodes`` per node type; its
arrays are ``edge_index/<src>__<rel>__<dst>.npy``, optional ``edge_weight/<src>__<rel>__<dst>.npy``
and ``edge_attr/<src>__<rel>__<dst>.npy``,
``x/<type>.npy`` for the types with features, and the target type's ``y.npy`` and splits.
Optional ``edge_ids.npy`` (``edge_ids/<src>__<rel>__<dst>.npy``) hold the edges' original
IDs where they are not their columns. Link splits (:mod:`partitioner.links`), when the graph has them, are
``links/<split>/{src,dst,label,neg_dst}.npy`` in original IDs, ``graph.json``'s
``link_splits`` naming each split's edge type (``src__rel__dst``; ``""`` on a plain graph).
See docs/datasets.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from partitioner.graph import (
    PLAIN_EDGE_TYPE,
    SPLITS,
    GraphData,
    GraphDataError,
    LinkSplit,
    TypedGraphData,
    check_link_split_name,
    edge_type_name,
    parse_edge_type,
    plain_view,
)
from partitioner.npyio import load_npy, save_npy

GRAPH_FILE = "graph.json"


def save_graph_dir(graph: GraphData | TypedGraphData, out_dir: str | Path) -> Path:
    """Write ``graph`` as a graph directory (arrays written in chunks)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {"name": graph.name, "num_nodes": graph.num_nodes,
                            "num_classes": graph.num_classes}
    typed = isinstance(graph, TypedGraphData)
    g = graph if isinstance(graph, TypedGraphData) else plain_view(graph)
    if typed:
        meta.update(target_type=g.target_type, edge_types=[edge_type_name(et) for et in g.edge_types])
    per_type: dict[str, Mapping[Any, np.ndarray]] = {
        "edge_index": g.edge_index, "edge_weight": g.edge_weight, "edge_attr": g.edge_attr,
        "edge_ids": g.edge_ids, "x": g.x}  # a typed graph's files name their type: x/paper.npy
    arrays = {f"{kind}/{t if isinstance(t, str) else edge_type_name(t)}" if typed else kind: array
              for kind, by_type in per_type.items() for t, array in by_type.items()}
    arrays.update({"y": graph.y, **{f"{split}_idx": ids for split, ids in graph.splits.items()}})
    if graph.link_splits:
        meta["link_splits"] = {name: edge_type_name(ls.edge_type) if typed else ""
                               for name, ls in graph.link_splits.items()}
        for name, ls in graph.link_splits.items():
            parts = {"src": ls.src, "dst": ls.dst, "label": ls.label, "neg_dst": ls.neg_dst}
            arrays.update({f"links/{name}/{k}": a for k, a in parts.items() if a is not None})
    for name, array in arrays.items():
        save_npy(out, f"{name}.npy", array)
    (out / GRAPH_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return out


def read_graph_dir(path: str | Path, *, mmap: bool = True) -> GraphData | TypedGraphData:
    """Read a graph directory: a :class:`GraphData`, or a :class:`TypedGraphData` when its
    ``graph.json`` gives ``num_nodes`` per node type; arrays are read-only memory maps
    when ``mmap``."""
    root = Path(path)
    meta_path = root / GRAPH_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{meta_path}: not found; a graph directory holds {GRAPH_FILE}, edge_index.npy, "
            "x.npy, y.npy (write one with `graphfeed-partition generate`)"
        )
    meta = _read_meta(meta_path)

    def load(name: str) -> np.ndarray:
        file = root / f"{name}.npy"
        if not file.is_file():
            raise GraphDataError(f"{file}: missing from the graph directory")
        return load_npy(file, mmap)

    def present(name: str) -> bool:
        return (root / f"{name}.npy").is_file()

    split_files = {s: f"{s}_idx" for s in SPLITS}
    if not present("val_idx") and present("valid_idx"):
        split_files["val"] = "valid_idx"  # OGB's name for the split
    splits = {s: load(f) for s, f in split_files.items() if present(f)}
    name, num_classes = str(meta.get("name", root.name)), int(meta["num_classes"])
    graph: GraphData | TypedGraphData
    if isinstance(meta["num_nodes"], dict):
        edge_types = {parse_edge_type(et): et for et in meta["edge_types"]}
        graph = TypedGraphData(
            name=name, num_nodes={str(t): int(n) for t, n in meta["num_nodes"].items()},
            edge_index={et: load(f"edge_index/{n}") for et, n in edge_types.items()},
            x={t: load(f"x/{t}") for t in meta["num_nodes"] if present(f"x/{t}")},
            target_type=str(meta["target_type"]), y=load("y"), num_classes=num_classes, splits=splits,
            edge_weight={et: load(f"edge_weight/{n}") for et, n in edge_types.items()
                         if present(f"edge_weight/{n}")},
            edge_attr={et: load(f"edge_attr/{n}") for et, n in edge_types.items()
                       if present(f"edge_attr/{n}")},
            edge_ids={et: load(f"edge_ids/{n}") for et, n in edge_types.items() if present(f"edge_ids/{n}")})
    else:
        graph = GraphData(
            name=name, num_nodes=int(meta["num_nodes"]), edge_index=load("edge_index"),
            x=load("x") if present("x") else None,
            y=load("y"), num_classes=num_classes, splits=splits,
            edge_weight=load("edge_weight") if present("edge_weight") else None,
            edge_attr=load("edge_attr") if present("edge_attr") else None,
            edge_ids=load("edge_ids") if present("edge_ids") else None)
    graph.link_splits = {name: LinkSplit(
        edge_type=parse_edge_type(et) if et else PLAIN_EDGE_TYPE, src=load(f"links/{name}/src"),
        dst=load(f"links/{name}/dst"),
        label=load(f"links/{name}/label") if present(f"links/{name}/label") else None,
        neg_dst=load(f"links/{name}/neg_dst") if present(f"links/{name}/neg_dst") else None)
        for name, et in _link_split_names(meta, meta_path).items()}
    graph.validate(check_values=False)
    return graph


def _link_split_names(meta: dict[str, Any], path: Path) -> dict[str, str]:
    """``graph.json``'s ``link_splits``: split name to its edge type's name."""
    found = meta.get("link_splits", {})
    if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()):
        raise GraphDataError(f"{path}: link_splits: expected an object of split name to edge type "
                             f"'src__rel__dst' ('' on a plain graph), got {found!r}")
    return {check_link_split_name(name): et for name, et in found.items()}


def _read_meta(path: Path) -> dict[str, Any]:
    """``graph.json``, refused naming the file and the key when malformed."""
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise GraphDataError(f"{path}: expected JSON, got {err}") from None
    typed = isinstance(meta, dict) and isinstance(meta.get("num_nodes"), dict)
    for key in ("num_nodes", "num_classes", *(("target_type", "edge_types") if typed else ())):
        if not isinstance(meta, dict) or key not in meta:
            raise GraphDataError(f"{path}: expected the key {key!r}, got "
                                 f"{sorted(meta) if isinstance(meta, dict) else type(meta).__name__}")
    return meta
