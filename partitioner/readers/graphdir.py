"""A graph as a directory of ``.npy`` files, read memory-mapped for out-of-core work.

Layout: ``graph.json`` (name, num_nodes, num_classes), ``edge_index.npy`` ([2, E] int64),
``x.npy`` ([N, F]), ``y.npy`` ([N] int64), optional ``edge_weight.npy`` ([E] float32) and
``<split>_idx.npy`` (int64) for the splits present (``valid_idx.npy`` is read as ``val``).
See docs/datasets.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from partitioner.graph import SPLITS, GraphData, GraphDataError
from partitioner.npyio import load_npy, save_npy

GRAPH_FILE = "graph.json"


def save_graph_dir(graph: GraphData, out_dir: str | Path) -> Path:
    """Write ``graph`` as a graph directory (arrays written in chunks)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_npy(out, "edge_index.npy", graph.edge_index)
    save_npy(out, "x.npy", graph.x)
    save_npy(out, "y.npy", graph.y)
    if graph.edge_weight is not None:
        save_npy(out, "edge_weight.npy", graph.edge_weight)
    for split, ids in graph.splits.items():
        save_npy(out, f"{split}_idx.npy", ids)
    meta = {"name": graph.name, "num_nodes": graph.num_nodes, "num_classes": graph.num_classes}
    (out / GRAPH_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return out


def read_graph_dir(path: str | Path, *, mmap: bool = True) -> GraphData:
    """Read a graph directory; arrays are read-only memory maps when ``mmap``."""
    root = Path(path)
    meta_path = root / GRAPH_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{meta_path}: not found; a graph directory holds {GRAPH_FILE}, edge_index.npy, "
            "x.npy, y.npy (write one with `graphfeed-partition generate`)"
        )
    meta = json.loads(meta_path.read_text())

    def load(name: str) -> np.ndarray:
        file = root / name
        if not file.is_file():
            raise GraphDataError(f"{file}: missing from the graph directory")
        return load_npy(file, mmap)

    weight = root / "edge_weight.npy"
    split_files = {s: f"{s}_idx.npy" for s in SPLITS}
    if not (root / "val_idx.npy").is_file() and (root / "valid_idx.npy").is_file():
        split_files["val"] = "valid_idx.npy"  # OGB's name for the split
    graph = GraphData(
        name=str(meta.get("name", root.name)), num_nodes=int(meta["num_nodes"]),
        edge_index=load("edge_index.npy"), x=load("x.npy"), y=load("y.npy"),
        num_classes=int(meta["num_classes"]),
        splits={s: load(f) for s, f in split_files.items() if (root / f).is_file()},
        edge_weight=load(weight.name) if weight.is_file() else None,
    )
    graph.validate(check_values=False)
    return graph
