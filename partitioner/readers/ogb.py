"""Read OGB node-property datasets from a local copy: no prompts, no downloads, no pickle.

ogb's own ``NodePropPredDataset`` asks questions on stdin, downloads on its own, and caches
a pickled ``processed/data_processed`` file. This reader uses only the side-effect-free
parts of the ``ogb`` package: its metadata table (``ogb/nodeproppred/master.csv``) and its
raw-file readers (``ogb.io.read_graph_raw``), pointed at ``<root>/<dir_name>/raw/``.
It writes nothing under ``root``.

products, arxiv and papers100M are plain graphs (:class:`GraphData`). ogbn-mag is typed
(:class:`TypedGraphData`); its raw layout (``read_csv_heterograph_raw``) is::

    raw/num-node-dict.csv.gz                       header of node types, one row of counts
    raw/triplet-type-list.csv.gz                   one (src, relation, dst) per row
    raw/relations/<src>___<rel>___<dst>/edge.csv.gz  one local (src, dst) pair per row
    raw/relations/<src>___<rel>___<dst>/num-edge-list.csv.gz
    raw/node-feat/paper/node-feat.csv.gz           128 floats per paper
    raw/nodetype-has-label.csv.gz, raw/node-label/paper/node-label.csv.gz
    split/time/nodetype-has-split.csv.gz, split/time/paper/{train,valid,test}.csv.gz

Every relation listed in ``triplet-type-list.csv.gz`` is read (ogbn-mag has four:
``author writes paper``, ``paper cites paper``, ``paper has_topic field_of_study``,
``author affiliated_with institution``); papers are the target type. With
``papers_only``, graphfeed takes its plain paper→paper ``cites`` subgraph instead, with the
papers' features, labels and splits.

Edge features, where a dataset has them, are read as ogb's readers give them
(``raw/edge-feat.csv.gz`` beside ``raw/edge.csv.gz``, ``edge_feat`` in ``raw/data.npz``,
``raw/relations/<src>___<rel>___<dst>/edge-feat.csv.gz`` per relation) into ``edge_attr``:
float32, or int64 for integer features, one row per edge. Datasets whose edges ogb
mirrors (``add_inverse_edge``, e.g. ogbn-products) have edge ``2i`` the stored edge ``i``
and ``2i + 1`` its reverse, with a copy of its features, as ogb lays them out.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from partitioner.graph import (
    SPLITS,
    EdgeType,
    GraphData,
    GraphDataError,
    TypedGraphData,
    labels_to_int64,
    make_undirected,
    undirected_columns,
)

log = logging.getLogger(__name__)

#: The OGB datasets :func:`read_ogb` reads, by their OGB names.
SUPPORTED: tuple[str, ...] = ("ogbn-arxiv", "ogbn-mag", "ogbn-papers100M", "ogbn-products")

_UNSUPPORTED: dict[str, str] = {
    "ogbn-proteins": (
        "it is multi-label (112 binary tasks per node) and has no node features, while "
        "graphfeed needs one class label and one feature vector per node"
    ),
}

#: ogbn-mag: its target node type, and the relation of its plain papers-only view.
MAG_NODE_TYPE = "paper"
MAG_RELATION: tuple[str, str, str] = ("paper", "cites", "paper")

#: OGB's split file stems, in graphfeed's order (OGB's ``valid`` is graphfeed's ``val``).
_OGB_SPLIT_FILES: tuple[str, ...] = ("train", "valid", "test")


class DatasetNotFoundError(FileNotFoundError):
    """The local copy of a dataset is missing or incomplete; the message says what to put where."""


@dataclass(frozen=True)
class OgbMeta:
    """One dataset's row of ogb's ``master.csv``, typed."""

    #: OGB name, e.g. ``ogbn-products``.
    name: str
    #: Folder under the root in ogb's layout: the name with ``-`` replaced by ``_``.
    dir_name: str
    #: Folder the downloaded zip unpacks to, e.g. ``products`` or ``papers100M-bin``.
    download_name: str
    #: Where the zip is published.
    url: str
    #: Release number; ogb writes ``RELEASE_v<version>.txt`` next to ``raw/``.
    version: str
    #: Number of classes.
    num_classes: int
    #: Name of the split folder under ``split/``, e.g. ``sales_ranking`` or ``time``.
    split: str
    #: Whether the raw edges are stored one way and must be mirrored.
    add_inverse_edge: bool
    #: Whether the raw files are ``.npz`` (True) or ``.csv.gz`` (False).
    binary: bool
    #: Whether the raw graph is typed (ogbn-mag).
    typed: bool


def read_ogb(name: str, root: str | Path, *, to_undirected: bool = False,
             papers_only: bool = False) -> GraphData | TypedGraphData:
    """Read the local copy of OGB node-property dataset ``name`` under ``root``: a
    :class:`GraphData`, or a :class:`TypedGraphData` for ogbn-mag (with every node type
    and relation; its plain paper→paper ``cites`` subgraph with ``papers_only``).

    ``root`` holds the unpacked dataset folder: ``<root>/<dir_name>/raw/`` in ogb's layout
    (``ogbn_products``), or the folder the zip unpacks to (``products``). Labels become
    int64 with ``-1`` for unlabeled nodes; features are float32; OGB's ``valid`` split is
    graphfeed's ``val``. ``to_undirected`` (plain graphs) adds every edge's reverse and
    drops duplicate edges (arxiv, mag and papers100M store citations one way); the edges
    then come sorted by (source, target), and edge features follow them
    (:func:`~partitioner.graph.make_undirected`). A typed graph gets reverse relations from
    :meth:`TypedGraphData.add_reverse` instead. Edge features (``edge-feat``), where the
    dataset has them, become ``edge_attr`` (see the module doc).

    Raises :class:`DatasetNotFoundError` at once, naming the missing files and the URL,
    when the local copy is missing or incomplete, and :class:`GraphDataError` for names
    graphfeed does not read.
    """
    meta = ogb_metadata(name)
    if meta.typed and to_undirected and not papers_only:
        raise GraphDataError(f"to_undirected: for plain graphs; {meta.name} is typed (add reverse "
                             "relations with TypedGraphData.add_reverse(), or pass papers_only=True)")
    root = Path(root)
    ds_dir = _locate_dataset_dir(meta, root)
    _check_local_copy(meta, root, ds_dir)
    start = time.perf_counter()
    with _ogb_output_to_log():
        splits = _read_splits(meta, ds_dir)
        if not meta.typed:
            graph = _read_homogeneous(meta, ds_dir, splits)
        else:
            mag = _read_typed(meta, ds_dir, splits)
            if not papers_only:
                log.info("read %s (typed) from %s in %.1fs:\n%s", meta.name, ds_dir,
                         time.perf_counter() - start, mag.summary())
                return mag
            graph = _papers_of(mag, ds_dir / "raw")
    if to_undirected:
        if graph.edge_attr is None:
            graph.edge_index = make_undirected(graph.edge_index, graph.num_nodes)[0]
        else:
            graph.edge_index, columns = undirected_columns(graph.edge_index, graph.num_nodes)
            graph.edge_attr = graph.edge_attr[columns]
    graph.validate()
    log.info(
        "read %s from %s: %d nodes, %d edges, %d features, %s in %.1fs",
        meta.name, ds_dir, graph.num_nodes, graph.num_edges, graph.feature_dim,
        ", ".join(f"{k}={v.size}" for k, v in splits.items()), time.perf_counter() - start,
    )
    return graph


def ogb_metadata(name: str) -> OgbMeta:
    """Look ``name`` up in ogb's ``master.csv`` (case and ``_``/``-`` are forgiven).

    Raises :class:`GraphDataError` for names graphfeed does not read, listing those it does.
    """
    table = _master_table()
    by_key = {_name_key(column): str(column) for column in table.columns}
    canonical = by_key.get(_name_key(name))
    if canonical in _UNSUPPORTED:
        raise GraphDataError(
            f"name: {canonical} is not supported: {_UNSUPPORTED[canonical]}. "
            f"Supported OGB datasets: {', '.join(SUPPORTED)}"
        )
    if canonical not in SUPPORTED:
        raise GraphDataError(
            f"name: expected one of the OGB datasets {', '.join(SUPPORTED)}, got {name!r}"
        )
    row = table[canonical]
    return OgbMeta(
        name=canonical,
        dir_name=canonical.replace("-", "_"),
        download_name=str(row["download_name"]),
        url=str(row["url"]),
        version=str(row["version"]),
        num_classes=int(row["num classes"]),
        split=str(row["split"]),
        add_inverse_edge=row["add_inverse_edge"] == "True",
        binary=row["binary"] == "True",
        typed=row["is hetero"] == "True",
    )


def _name_key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


@functools.cache
def _master_table(task: str = "nodeproppred", reader: str = "read_ogb") -> Any:
    """ogb's metadata table of ``task`` (``nodeproppred``, ``linkproppred``), read exactly
    as ogb reads it, without importing ogb; ``reader`` names who needs it when ogb is
    missing."""
    spec = importlib.util.find_spec("ogb")
    if spec is None or spec.origin is None:
        raise ImportError(f"{reader} needs the 'ogb' package (pip install 'ogb>=1.3.6')")
    path = Path(spec.origin).parent / task / "master.csv"
    return pd.read_csv(path, index_col=0, keep_default_na=False)


@functools.cache
def _raw_readers() -> Any:
    """Import ``ogb.io.read_graph_raw`` without ogb's import-time PyPI version check.

    ``import ogb`` starts a non-daemon thread that asks PyPI for ogb's latest version
    (through the ``outdated`` package, with no timeout); on a machine without internet
    that can hold up the process's exit. Hiding ``outdated`` while ogb is first imported
    makes ogb skip the check, as it does when ``outdated`` is not installed.
    """
    hide = "ogb" not in sys.modules and "outdated" not in sys.modules
    if hide:
        sys.modules["outdated"] = None  # type: ignore[assignment]
    try:
        return importlib.import_module("ogb.io.read_graph_raw")
    finally:
        if hide:
            del sys.modules["outdated"]


@contextlib.contextmanager
def _ogb_output_to_log() -> Iterator[None]:
    """Send what ogb's readers print to stdout to this module's debug log instead."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        for line in buffer.getvalue().splitlines():
            if line.strip():
                log.debug("ogb: %s", line.strip())


class _DatasetNames(Protocol):
    """Where a dataset's metadata says its local copy lies (:class:`OgbMeta`, and the
    link datasets' ``OgbLinkMeta``)."""

    @property
    def name(self) -> str: ...

    @property
    def dir_name(self) -> str: ...

    @property
    def download_name(self) -> str: ...


def _locate_dataset_dir(meta: _DatasetNames, root: Path) -> Path:
    """``<root>/<dir_name>`` (ogb's layout) or, failing that, the zip's own folder name."""
    primary = root / meta.dir_name
    unzipped = root / meta.download_name
    if not primary.is_dir() and (unzipped / "raw").is_dir():
        log.info("%s: reading %s, the zip's folder (%s is absent)", meta.name, unzipped, primary)
        return unzipped
    return primary


def _required_files(meta: OgbMeta) -> list[str]:
    """Files :func:`read_ogb` reads, relative to the dataset folder."""
    split = f"split/{meta.split}"
    if meta.typed:
        relation = "___".join(MAG_RELATION)
        return [
            "raw/num-node-dict.csv.gz",
            "raw/triplet-type-list.csv.gz",
            f"raw/relations/{relation}/edge.csv.gz",
            f"raw/relations/{relation}/num-edge-list.csv.gz",
            f"raw/node-feat/{MAG_NODE_TYPE}/node-feat.csv.gz",
            "raw/nodetype-has-label.csv.gz",
            f"raw/node-label/{MAG_NODE_TYPE}/node-label.csv.gz",
            f"{split}/nodetype-has-split.csv.gz",
            *(f"{split}/{MAG_NODE_TYPE}/{stem}.csv.gz" for stem in _OGB_SPLIT_FILES),
        ]
    if meta.binary:
        raw = ["raw/data.npz", "raw/node-label.npz"]
    else:
        raw = [
            f"raw/{stem}.csv.gz"
            for stem in ("edge", "num-node-list", "num-edge-list", "node-feat", "node-label")
        ]
    return raw + [f"{split}/{stem}.csv.gz" for stem in _OGB_SPLIT_FILES]


def _check_local_copy(meta: OgbMeta, root: Path, ds_dir: Path) -> None:
    """Raise :class:`DatasetNotFoundError` naming every missing file and how to get it."""
    missing = [ds_dir / rel for rel in _required_files(meta) if not (ds_dir / rel).is_file()]
    if not missing:
        release = ds_dir / f"RELEASE_v{meta.version}.txt"
        if not release.is_file():
            log.warning(
                "%s: %s is absent, so the local copy may be an older release than ogb's "
                "v%s; graphfeed reads it anyway", meta.name, release, meta.version,
            )
        return
    listing = "\n  ".join(str(path) for path in missing)
    message = (
        f"{meta.name} not found under {root}: expected these files, which are missing:\n"
        f"  {listing}\n"
    )
    pickled = sorted(str(p) for p in {m.parent / "split_dict.pt" for m in missing} if p.is_file())
    if pickled:
        message += (
            f"Found {', '.join(pickled)}, which graphfeed does not read because it is a "
            "pickle; put train.csv.gz, valid.csv.gz and test.csv.gz (one node ID per line) "
            "beside it instead (docs/datasets.md shows a one-off conversion).\n"
        )
    message += (
        f"Download {meta.url} on a machine with internet, unzip it into {root} and rename "
        f"{root / meta.download_name} to {root / meta.dir_name} (the unrenamed folder is "
        f"accepted too), so that {root / meta.dir_name / 'raw'} exists. "
        "graphfeed never downloads or prompts."
    )
    raise DatasetNotFoundError(message)


def _read_homogeneous(meta: OgbMeta, ds_dir: Path, splits: dict[str, np.ndarray]) -> GraphData:
    """products and arxiv (csv.gz) or papers100M (npz), through ogb's raw readers."""
    readers = _raw_readers()
    raw_dir = ds_dir / "raw"
    if meta.binary:
        graph = readers.read_binary_graph_raw(str(raw_dir), meta.add_inverse_edge)[0]
        label_file = raw_dir / "node-label.npz"
        labels = _npz_array(label_file, "node_label")
    else:
        graph = readers.read_csv_graph_raw(str(raw_dir), meta.add_inverse_edge)[0]
        label_file = raw_dir / "node-label.csv.gz"
        labels = pd.read_csv(label_file, compression="gzip", header=None).values
    if graph["node_feat"] is None:
        raise GraphDataError(f"{raw_dir}: expected node features (node_feat), found none")
    n = int(graph["num_nodes"])
    edge_index = np.ascontiguousarray(graph["edge_index"], dtype=np.int64)
    return GraphData(
        name=meta.name, num_nodes=n, edge_index=edge_index,
        x=_features_to_float32(graph["node_feat"], ds_dir), y=_labels_to_int64(labels, n, label_file),
        num_classes=meta.num_classes, splits=splits,
        edge_attr=_edge_feat(graph.get("edge_feat"), edge_index.shape[1],
                             raw_dir / ("data.npz" if meta.binary else "edge-feat.csv.gz")))


def _read_typed(meta: OgbMeta, ds_dir: Path, splits: dict[str, np.ndarray]) -> TypedGraphData:
    """ogbn-mag with every node type and relation, papers first (the target type comes
    first in the homogeneous view and in summaries), then OGB's order."""
    raw_dir = ds_dir / "raw"
    _check_relation_files(raw_dir)
    readers = _raw_readers()
    raw = readers.read_csv_heterograph_raw(str(raw_dir), meta.add_inverse_edge)[0]
    labels = readers.read_node_label_hetero(str(raw_dir))
    counts = {str(t): int(n) for t, n in raw["num_nodes_dict"].items()}
    if MAG_NODE_TYPE not in counts or MAG_NODE_TYPE not in labels:
        raise GraphDataError(
            f"{raw_dir / 'nodetype-has-label.csv.gz'}: expected labels for node type "
            f"{MAG_NODE_TYPE!r}, got them for {sorted(labels)}"
        )
    num_nodes = {MAG_NODE_TYPE: counts.pop(MAG_NODE_TYPE), **counts}
    edges: dict[EdgeType, np.ndarray] = {
        (str(s), str(r), str(d)): np.ascontiguousarray(ei, dtype=np.int64)
        for (s, r, d), ei in raw["edge_index_dict"].items()
    }
    x = {str(t): _features_to_float32(f, raw_dir / "node-feat" / str(t))
         for t, f in (raw["node_feat_dict"] or {}).items() if f is not None}
    edge_attr: dict[EdgeType, np.ndarray] = {}
    for et, ei in edges.items():
        feat_file = raw_dir / "relations" / "___".join(et) / "edge-feat.csv.gz"
        if feat_file.is_file():  # read here: ogb's heterograph reader slices them past the end
            feat = _read_feat_csv(feat_file)
            attr = _edge_feat(np.repeat(feat, 2, axis=0) if meta.add_inverse_edge else feat, ei.shape[1],
                              feat_file)
            if attr is not None:
                edge_attr[et] = attr
    label_file = raw_dir / "node-label" / MAG_NODE_TYPE / "node-label.csv.gz"
    graph = TypedGraphData(
        name=meta.name, num_nodes=num_nodes, edge_index=edges, x=x, target_type=MAG_NODE_TYPE,
        y=_labels_to_int64(labels[MAG_NODE_TYPE], num_nodes[MAG_NODE_TYPE], label_file),
        num_classes=meta.num_classes, splits=splits, edge_attr=edge_attr,
    )
    graph.validate()
    return graph


def _papers_of(mag: TypedGraphData, raw_dir: Path) -> GraphData:
    """ogbn-mag's paper→paper ``cites`` subgraph with the papers' features and labels."""
    if MAG_RELATION not in mag.edge_index:
        raise GraphDataError(
            f"{raw_dir / 'triplet-type-list.csv.gz'}: expected the relation {MAG_RELATION}, "
            f"got {sorted(mag.edge_index)}"
        )
    if MAG_NODE_TYPE not in mag.x:
        raise GraphDataError(
            f"{raw_dir / 'node-feat'}: expected features for node type {MAG_NODE_TYPE!r}, "
            f"got them for {sorted(mag.x)}"
        )
    return GraphData(name=mag.name, num_nodes=mag.num_nodes[MAG_NODE_TYPE],
                     edge_index=mag.edge_index[MAG_RELATION], x=mag.x[MAG_NODE_TYPE], y=mag.y,
                     num_classes=mag.num_classes, splits=mag.splits,
                     edge_attr=mag.edge_attr.get(MAG_RELATION))


def _read_splits(meta: OgbMeta, ds_dir: Path) -> dict[str, np.ndarray]:
    """``split/<split>/{train,valid,test}.csv.gz`` as graphfeed's train/val/test."""
    split_dir = ds_dir / "split" / meta.split
    if meta.typed:
        per_type = _raw_readers().read_nodesplitidx_split_hetero(str(split_dir))
        if MAG_NODE_TYPE not in per_type[0]:
            raise GraphDataError(
                f"{split_dir / 'nodetype-has-split.csv.gz'}: expected a split for node type "
                f"{MAG_NODE_TYPE!r}, got one for {sorted(per_type[0])}"
            )
        arrays = [ids[MAG_NODE_TYPE] for ids in per_type]
    else:
        arrays = [_read_id_csv(split_dir / f"{stem}.csv.gz") for stem in _OGB_SPLIT_FILES]
    return {
        ours: np.asarray(ids, dtype=np.int64).reshape(-1)
        for ours, ids in zip(SPLITS, arrays, strict=True)
    }


def _read_id_csv(path: Path) -> np.ndarray:
    """One node ID per line, as ogb's ``get_idx_split`` reads it; an empty file is no IDs."""
    try:
        return pd.read_csv(path, compression="gzip", header=None).values.T[0]
    except pd.errors.EmptyDataError:
        return np.empty(0, dtype=np.int64)


def _npz_array(path: Path, key: str) -> np.ndarray:
    with np.load(path, allow_pickle=False) as npz:
        if key not in npz.files:
            raise GraphDataError(f"{path}: expected the key {key!r}, got keys {sorted(npz.files)}")
        return np.asarray(npz[key])


def _features_to_float32(x: np.ndarray, ds_dir: Path) -> np.ndarray:
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.number):
        raise GraphDataError(
            f"{ds_dir}: node features: expected a numeric [N, F] array, "
            f"got {x.dtype} of shape {list(x.shape)}"
        )
    return np.ascontiguousarray(x, dtype=np.float32)


def _read_feat_csv(path: Path) -> np.ndarray:
    """A headerless ``.csv.gz`` of features as ogb reads it: int64 when every value is an
    integer, else float32."""
    values = pd.read_csv(path, compression="gzip", header=None).values
    return values.astype(np.int64 if "int" in str(values.dtype) else np.float32)


def _edge_feat(feat: np.ndarray | None, num_edges: int, source: Path) -> np.ndarray | None:
    """ogb's ``edge_feat`` (None without one) as ``[E, F]`` edge features, one row per edge."""
    if feat is None:
        return None
    attr = np.asarray(feat)
    if attr.ndim != 2 or attr.shape[0] != num_edges or attr.dtype.kind not in "biuf":
        raise GraphDataError(f"{source}: edge features: expected numbers of shape [{num_edges}, F] "
                             f"(one row per edge), got {attr.dtype} of shape {list(attr.shape)}")
    return np.ascontiguousarray(attr)


def _labels_to_int64(raw: np.ndarray, num_nodes: int, source: Path) -> np.ndarray:
    """``[N]`` or ``[N, 1]`` labels to ``[N]`` int64; NaN (unlabeled) becomes ``-1``."""
    labels = np.asarray(raw)
    if labels.shape not in ((num_nodes,), (num_nodes, 1)):
        raise GraphDataError(
            f"{source}: expected one label per node, shape [{num_nodes}] or [{num_nodes}, 1], "
            f"got {list(labels.shape)}"
        )
    return labels_to_int64(labels, str(source))


def _check_relation_files(raw_dir: Path) -> None:
    """Every relation the triplet list names must have its edge files (ogb would fail
    deep inside pandas otherwise)."""
    triplets = pd.read_csv(raw_dir / "triplet-type-list.csv.gz", header=None).values
    missing = [
        raw_dir / "relations" / "___".join(map(str, t)) / stem
        for t in triplets for stem in ("edge.csv.gz", "num-edge-list.csv.gz")
        if not (raw_dir / "relations" / "___".join(map(str, t)) / stem).is_file()
    ]
    if missing:
        listing = "\n  ".join(str(p) for p in missing)
        raise GraphDataError(
            f"{raw_dir / 'triplet-type-list.csv.gz'} lists relations whose files are "
            f"missing:\n  {listing}"
        )
