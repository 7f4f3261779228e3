"""Read OGB link-property datasets (ogbl-citation2, ogbl-collab) from a local copy: no
prompts, no downloads, no pickle.

ogb's ``LinkPropPredDataset`` lays a dataset out as::

    raw/edge.csv.gz, num-node-list.csv.gz, num-edge-list.csv.gz, node-feat.csv.gz
    raw/edge_weight.csv.gz, raw/edge_year.csv.gz          (collab: per train edge)
    raw/node_year.csv.gz                                  (citation2: per paper)
    split/<split>/{train,valid,test}.pt                   (split "time" for both)

``raw/edge.csv.gz`` holds the **train** edges, so the message-passing graph never holds a
validation or test edge. Each ``.pt`` file is a ``torch.save``'d dict of numpy arrays (or
tensors); it is read with ``torch.load(weights_only=True)``, allowing only numpy's array
reconstruction on top of PyTorch's own safe types, never full unpickling:

- ogbl-citation2: ``source_node``, ``target_node`` ``[E]``; valid/test also
  ``target_node_neg`` ``[E, 1000]``, OGB's given negatives (each source is ranked
  against its own 1000); the graph is directed (citing -> cited) as stored, or made
  undirected with ``to_undirected`` (as OGB's examples train it);
- ogbl-collab: ``edge`` ``[E, 2]``, ``weight``, ``year``; valid/test also ``edge_neg``
  ``[E', 2]``, the negative edges Hits@50 ranks the positives against. ogb mirrors every
  train edge (``add_inverse_edge``), so the graph is undirected, each edge ``2i`` the stored
  edge ``i`` and ``2i + 1`` its reverse, with its ``edge_weight`` (collaborations that
  year, positive) as edge weight.

Link splits: ``train`` (OGB's train edges, one direction), ``val`` and ``test`` (with
``neg_dst`` from ``target_node_neg`` for citation2), and for collab ``val_neg`` /
``test_neg`` (its negative edges). OGB link datasets have no node labels: every ``y`` is
``-1`` (``num_classes`` 1).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from partitioner.graph import PLAIN_EDGE_TYPE, GraphData, GraphDataError, LinkSplit, make_undirected
from partitioner.readers.ogb import (
    DatasetNotFoundError,
    _features_to_float32,
    _locate_dataset_dir,
    _master_table,
    _ogb_output_to_log,
    _raw_readers,
)

log = logging.getLogger(__name__)

#: The OGB link datasets :func:`read_ogb_link` reads.
LINK_SUPPORTED: tuple[str, ...] = ("ogbl-citation2", "ogbl-collab")

#: OGB's split file stems to graphfeed's link split names.
_OGB_SPLITS = {"train": "train", "valid": "val", "test": "test"}


@dataclass(frozen=True)
class OgbLinkMeta:
    """One dataset's row of ogb's ``linkproppred/master.csv``, typed."""

    #: OGB name, e.g. ``ogbl-collab``.
    name: str
    #: Folder under the root in ogb's layout (``ogbl_collab``).
    dir_name: str
    #: Folder the downloaded zip unpacks to (``collab``, ``citation-v2``).
    download_name: str
    #: Where the zip is published.
    url: str
    #: Name of the split folder under ``split/``.
    split: str
    #: Whether ogb mirrors the stored edges.
    add_inverse_edge: bool


def is_ogb_link(name: str) -> bool:
    """Whether ``name`` names an OGB link-property dataset (``ogbl-*``)."""
    return name.strip().lower().replace("_", "-").startswith("ogbl-")


def ogb_link_metadata(name: str) -> OgbLinkMeta:
    """Look ``name`` up in ogb's link ``master.csv``; names graphfeed does not read are refused."""
    key = name.strip().lower().replace("_", "-")
    canonical = next((s for s in LINK_SUPPORTED if s.lower() == key), None)
    if canonical is None:
        raise GraphDataError(f"name: expected one of the OGB link datasets {', '.join(LINK_SUPPORTED)}, "
                             f"got {name!r}")
    row = _master_table("linkproppred", "read_ogb_link")[canonical]
    return OgbLinkMeta(name=canonical, dir_name=canonical.replace("-", "_"),
                       download_name=str(row["download_name"]), url=str(row["url"]),
                       split=str(row["split"]), add_inverse_edge=row["add_inverse_edge"] == "True")


def _required_files(meta: OgbLinkMeta) -> list[str]:
    raw = [f"raw/{stem}.csv.gz" for stem in ("edge", "num-node-list", "num-edge-list", "node-feat")]
    if meta.name == "ogbl-collab":
        raw.append("raw/edge_weight.csv.gz")
    return raw + [f"split/{meta.split}/{stem}.pt" for stem in _OGB_SPLITS]


def read_ogb_link(name: str, root: str | Path, *, to_undirected: bool = False) -> GraphData:
    """Read the local copy of OGB link dataset ``name`` under ``root`` (``<root>/ogbl_collab``
    in ogb's layout, or the folder its zip unpacks to) as a plain graph with link splits
    (see the module doc). ``to_undirected`` adds every edge's reverse and drops repeats
    (citation2; collab is undirected already). Raises :class:`DatasetNotFoundError` naming
    the missing files and the URL when the copy is incomplete."""
    meta = ogb_link_metadata(name)
    ds_dir = _locate_dataset_dir(meta, Path(root))
    missing = [ds_dir / rel for rel in _required_files(meta) if not (ds_dir / rel).is_file()]
    if missing:
        listing = "\n  ".join(str(p) for p in missing)
        raise DatasetNotFoundError(
            f"{meta.name} not found under {root}: expected these files, which are missing:\n  {listing}\n"
            f"Download {meta.url} on a machine with internet and unzip it into {root} (as "
            f"{Path(root) / meta.dir_name} or {Path(root) / meta.download_name}). graphfeed never "
            "downloads or prompts.")
    start = time.perf_counter()
    raw_dir = ds_dir / "raw"
    extra = ["edge_weight"] if meta.name == "ogbl-collab" else []
    with _ogb_output_to_log():
        raw = _raw_readers().read_csv_graph_raw(str(raw_dir), meta.add_inverse_edge,
                                                additional_edge_files=extra)[0]
    n = int(raw["num_nodes"])
    if raw["node_feat"] is None:
        raise GraphDataError(f"{raw_dir}: expected node features (node-feat.csv.gz), found none")
    edge_index = np.ascontiguousarray(raw["edge_index"], dtype=np.int64)
    weight = None
    if "edge_weight" in raw:
        weight = np.ascontiguousarray(np.asarray(raw["edge_weight"]).reshape(-1), dtype=np.float32)
    if to_undirected:
        edge_index, weight = make_undirected(edge_index, n, weight)
    split_dir = ds_dir / "split" / meta.split
    parts = {ours: load_pt_dict(split_dir / f"{stem}.pt") for stem, ours in _OGB_SPLITS.items()}
    links = _citation2_splits(parts, split_dir) if meta.name == "ogbl-citation2" else \
        _collab_splits(parts, split_dir)
    graph = GraphData(name=meta.name, num_nodes=n, edge_index=edge_index,
                      x=_features_to_float32(raw["node_feat"], ds_dir), y=np.full(n, -1, dtype=np.int64),
                      num_classes=1, edge_weight=weight, link_splits=links)
    graph.validate()
    log.info("read %s from %s: %d nodes, %d message-passing edges, link splits %s in %.1fs", meta.name,
             ds_dir, n, graph.num_edges, {k: v.num_edges for k, v in links.items()},
             time.perf_counter() - start)
    return graph


def _field(part: dict[str, np.ndarray], key: str, path: Path, ndim: int) -> np.ndarray:
    """``part[key]`` as int64 with ``ndim`` dimensions, refused naming the file and key."""
    if key not in part:
        raise GraphDataError(f"{path}: expected the key {key!r}, got {sorted(part)}")
    arr = np.asarray(part[key])
    if arr.ndim != ndim or arr.dtype.kind not in "iu":
        raise GraphDataError(f"{path}: {key}: expected {ndim}-D integers, got {arr.dtype} of shape "
                             f"{list(arr.shape)}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _citation2_splits(parts: dict[str, dict[str, np.ndarray]], split_dir: Path) -> dict[str, LinkSplit]:
    out = {}
    for name, part in parts.items():
        path = split_dir / f"{'valid' if name == 'val' else name}.pt"
        neg = _field(part, "target_node_neg", path, 2) if name != "train" else None
        out[name] = LinkSplit(PLAIN_EDGE_TYPE, _field(part, "source_node", path, 1),
                              _field(part, "target_node", path, 1), neg_dst=neg)
    return out


def _collab_splits(parts: dict[str, dict[str, np.ndarray]], split_dir: Path) -> dict[str, LinkSplit]:
    out = {}
    for name, part in parts.items():
        path = split_dir / f"{'valid' if name == 'val' else name}.pt"
        edge = _pairs(_field(part, "edge", path, 2), path, "edge")
        out[name] = LinkSplit(PLAIN_EDGE_TYPE, edge[:, 0].copy(), edge[:, 1].copy())
        if name != "train":
            neg = _pairs(_field(part, "edge_neg", path, 2), path, "edge_neg")
            out[f"{name}_neg"] = LinkSplit(PLAIN_EDGE_TYPE, neg[:, 0].copy(), neg[:, 1].copy())
    return out


def _pairs(edge: np.ndarray, path: Path, key: str) -> np.ndarray:
    if edge.shape[1] != 2:
        raise GraphDataError(f"{path}: {key}: expected shape [E, 2], got {list(edge.shape)}")
    return edge


def _numpy_globals() -> list[Any]:
    """What ``torch.load(weights_only=True)`` needs beyond PyTorch's safe types to rebuild
    numpy arrays (under numpy 2's and numpy 1's module names), and nothing more."""
    core = np._core if hasattr(np, "_core") else np.core
    rebuild = core.multiarray._reconstruct
    dtypes = [type(np.dtype(t)) for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                                          "uint32", "uint64", "float16", "float32", "float64")]
    return [rebuild, (rebuild, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype, *dtypes]


def load_pt_dict(path: Path) -> dict[str, np.ndarray]:
    """A ``torch.save``'d dict of numpy arrays or tensors, as numpy arrays, read with
    ``torch.load(weights_only=True)`` (no arbitrary unpickling: anything else is refused)."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a refused or malformed file
        raise GraphDataError(f"{path}: expected a dict of arrays readable without unpickling code "
                             f"(torch.load weights_only), got: {str(exc).splitlines()[0]}") from exc
    if not isinstance(obj, dict):
        raise GraphDataError(f"{path}: expected a dict of arrays, got {type(obj).__name__}")
    return {str(k): v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for k, v in obj.items()}
