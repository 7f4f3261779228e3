"""The manifest of a partitioned graph, one model for both formats.

A partitioned graph is a typed graph: node types, edge types ``(src, rel, dst)``, one
labelled target type. A plain graph is the typed graph of one node type
(:data:`~partitioner.graph.PLAIN_NODE_TYPE`) and one edge type
(:data:`~partitioner.graph.PLAIN_EDGE_TYPE`); it is written in format v1, whose layout
names no type, and a typed graph in format v2, whose file roles and paths carry the type
(``docs/partition-format.md``)::

    v1 (plain)                             v2 (typed)
    partition_book.npy                     partition_book/<type>.npy
    node_map.npy                           node_map/<type>.npy
    part-<p>/indptr.npy                    part-<p>/<src>__<rel>__<dst>/indptr.npy
    part-<p>/indices.npy                   part-<p>/<src>__<rel>__<dst>/indices.npy
    part-<p>/edge_weight.npy               part-<p>/<src>__<rel>__<dst>/edge_weight.npy
    part-<p>/e_id.npy                      part-<p>/<src>__<rel>__<dst>/e_id.npy
    part-<p>/edge_attr.npy                 part-<p>/<src>__<rel>__<dst>/edge_attr.npy
    part-<p>/x.npy, orig_ids.npy           part-<p>/<type>/x.npy, orig_ids.npy
    part-<p>/y.npy, <split>_idx.npy        part-<p>/<target>/y.npy, <split>_idx.npy

:func:`role` names a file the way its manifest does. Both JSON layouts are read into
:class:`Manifest` and written back byte for byte as they were (the graph's fingerprint
is the hash of that JSON). Edge IDs (``e_id``) and edge features (``edge_attr``) are
optional files of either version, flagged per edge type by keys that are left out when
absent, so manifests written before they existed read, load and hash as they did.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from partitioner.graph import PLAIN_EDGE_TYPE, PLAIN_NODE_TYPE, EdgeType, edge_type_name, parse_edge_type
from partitioner.npyio import FileRecord

FORMAT_NAME = "graphfeed-partition"
#: Format of a plain graph's partitions.
FORMAT_VERSION = 1
#: Format of a typed graph's partitions.
TYPED_FORMAT_VERSION = 2
MANIFEST_FILE = "manifest.json"
#: The dtypes node features may be stored in (``graphfeed-partition partition
#: --feature-dtype``): half precision halves a partition's feature bytes on disk and in a
#: server's page cache.
FEATURE_DTYPES = ("float16", "float32", "float64")


class PartitionFormatError(ValueError):
    """A partition on disk does not match its manifest; the message names the file."""


def role(kind: str, key: str | EdgeType | None) -> str:
    """A file's role in a manifest: ``kind`` (``indptr``, ``x``, ``train_idx`` ...) of the
    node or edge type ``key``, or of a plain graph's one type (``key`` None)."""
    if key is None:
        return kind
    return f"{edge_type_name(key) if isinstance(key, tuple) else key}/{kind}"


def shared_role(kind: str, node_type: str | None) -> str:
    """The role of a file every partition shares (``partition_book``, ``node_map``) of
    ``node_type`` (None: a plain graph's one type): the kind first, as its path."""
    return kind if node_type is None else f"{kind}/{node_type}"


@dataclass(frozen=True)
class NodeTypeInfo:
    """What the manifest records of one node type."""

    #: Number of nodes of the type.
    num_nodes: int
    #: Feature dimension (0: the type has no features and no ``x.npy``).
    feature_dim: int
    #: numpy dtype name of the features (``""`` without features).
    feature_dtype: str


@dataclass(frozen=True)
class EdgeFeatureInfo:
    """What the manifest records of one edge type's features (``edge_attr.npy``)."""

    #: Shape of one edge's features: ``()`` for ``[E]`` features, ``(F,)`` for ``[E, F]``.
    shape: tuple[int, ...]
    #: numpy dtype name of the features.
    dtype: str

    @property
    def dim(self) -> int:
        """Values per edge (1 for ``[E]`` features)."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class LinkSplitInfo:
    """What the manifest records of one link split (``links/<split>/*.npy``,
    :mod:`partitioner.links`)."""

    #: The relation its edges belong to (:data:`~partitioner.graph.PLAIN_EDGE_TYPE` on a
    #: plain graph).
    edge_type: EdgeType
    #: Number of edges ``E``.
    num_edges: int
    #: Given negative destinations per edge ``K`` (``neg_dst.npy``); 0 for none.
    num_negatives: int = 0
    #: Shape of one edge's label (``()``: one value per edge).
    label_shape: tuple[int, ...] = ()
    #: numpy dtype name of the labels (``label.npy``); None: the split has no labels.
    label_dtype: str | None = None


def link_role(split: str, kind: str) -> str:
    """The role (and path stem) of a link split's shared file: ``links/<split>/<kind>``."""
    return f"links/{split}/{kind}"


@dataclass(frozen=True)
class PartitionInfo:
    """The manifest's entry for one partition."""

    #: Partition ID ``p``.
    id: int
    #: Node type to the number of owned nodes of that type.
    num_nodes: dict[str, int]
    #: Edge type to the number of in-edges of the owned destination nodes.
    num_edges: dict[EdgeType, int]
    #: Edge type to those in-edges whose source another partition owns.
    num_remote_edges: dict[EdgeType, int]
    #: Split name to the number of owned target-type nodes in it.
    split_sizes: dict[str, int]
    #: File role (:func:`role`) to its record.
    files: dict[str, FileRecord]


@dataclass(frozen=True)
class Manifest:
    """Everything recorded about a partitioned graph (plain or typed)."""

    #: Name of the source graph.
    graph_name: str
    #: Node type to its facts, in the graph's node-type order.
    node_types: dict[str, NodeTypeInfo]
    #: Edge type to its number of edges, in the graph's edge-type order.
    edge_types: dict[EdgeType, int]
    #: The labelled node type.
    target_type: str
    #: Number of classes.
    num_classes: int
    #: Node type to its ``P+1`` offsets: partition p owns IDs ``[book[p], book[p+1])``.
    partition_book: dict[str, tuple[int, ...]]
    #: One entry per partition, in ID order.
    partitions: tuple[PartitionInfo, ...]
    #: Shared files (partition books and node maps).
    files: dict[str, FileRecord]
    #: Edge types stored with edge weights (``edge_weight.npy``).
    weighted: frozenset[EdgeType] = frozenset()
    #: How the graph was partitioned (method, parameters, seed, elapsed seconds).
    algorithm: dict[str, Any] = field(default_factory=dict)
    #: Format version: 1 for a plain graph, 2 for a typed one.
    format_version: int = TYPED_FORMAT_VERSION
    #: Edge types stored with the original ID of each in-edge (``e_id.npy``): every edge
    #: type of a graph written since edge IDs exist, none of one written before.
    edge_ids: frozenset[EdgeType] = frozenset()
    #: Edge type to its features' shape and dtype (``edge_attr.npy``), types with features only.
    edge_features: dict[EdgeType, EdgeFeatureInfo] = field(default_factory=dict)
    #: Link split name to its facts (its files are shared ones, under ``links/<split>/``);
    #: empty for a graph without link splits (and absent from its JSON).
    link_splits: dict[str, LinkSplitInfo] = field(default_factory=dict)
    #: Edge type to the bound of its edges' original IDs (``0 <= e_id < bound``), for the
    #: types whose IDs are not ``0 .. E-1`` (edges removed by
    #: :func:`~partitioner.links.random_link_split` keep their IDs); absent otherwise.
    edge_id_bounds: dict[EdgeType, int] = field(default_factory=dict)

    @property
    def typed(self) -> bool:
        """Whether the graph is typed (users see ``HeteroData``), not plain (``Data``)."""
        return self.format_version >= TYPED_FORMAT_VERSION

    def key(self, t: str | EdgeType) -> str | EdgeType | None:
        """``t`` as :func:`role` takes it: None for a plain graph's one type."""
        return t if self.typed else None

    def role(self, kind: str, t: str | EdgeType) -> str:
        """The role of file ``kind`` of node or edge type ``t`` in this manifest."""
        return role(kind, self.key(t))

    def shared_role(self, kind: str, t: str) -> str:
        """The role of the shared file ``kind`` (book, node map) of node type ``t``."""
        return shared_role(kind, t if self.typed else None)

    @property
    def num_partitions(self) -> int:
        return len(self.partitions)

    @property
    def num_nodes(self) -> int:
        """Nodes of every type."""
        return sum(t.num_nodes for t in self.node_types.values())

    @property
    def num_edges(self) -> int:
        """Edges of every type."""
        return sum(self.edge_types.values())

    @property
    def target(self) -> NodeTypeInfo:
        """The target type's facts."""
        return self.node_types[self.target_type]

    @property
    def feature_dtypes(self) -> dict[str, str]:
        """Node type to its features' numpy dtype name, for the types with features."""
        return {t: i.feature_dtype for t, i in self.node_types.items() if i.feature_dim}

    @property
    def has_edge_ids(self) -> bool:
        """Whether every edge type stores its edges' original IDs (``Partition.e_id``)."""
        return bool(self.edge_types) and self.edge_ids >= set(self.edge_types)

    @property
    def edge_feature_shapes(self) -> dict[EdgeType, tuple[int, ...]]:
        """Edge type to the shape of one edge's features, for the types with features."""
        return {et: i.shape for et, i in self.edge_features.items()}

    @property
    def edge_feature_dims(self) -> dict[EdgeType, int]:
        """Edge type to the values per edge of its features, for the types with features."""
        return {et: i.dim for et, i in self.edge_features.items()}

    @property
    def edge_feature_dtypes(self) -> dict[EdgeType, str]:
        """Edge type to its features' numpy dtype name, for the types with features."""
        return {et: i.dtype for et, i in self.edge_features.items()}

    def edge_id_bound(self, edge_type: EdgeType) -> int:
        """Bound of ``edge_type``'s original edge IDs: its number of edges unless recorded."""
        return self.edge_id_bounds.get(edge_type, self.edge_types[edge_type])

    def edge_cut(self, edge_type: EdgeType | None = None) -> int:
        """Directed edges (of one type, or all) whose endpoints lie in different partitions."""
        return sum(n for p in self.partitions for et, n in p.num_remote_edges.items()
                   if edge_type is None or et == edge_type)

    def edge_book(self, edge_type: EdgeType) -> tuple[int, ...]:
        """``P+1`` offsets of ``edge_type``'s internal edge IDs: partition p holds the
        in-edges ``[book[p], book[p+1])``, numbered in the order of its CSC (the global
        CSC that :func:`~partitioner.joins.load_structure` joins is that numbering)."""
        out = [0]
        for info in self.partitions:
            out.append(out[-1] + int(info.num_edges[edge_type]))
        return tuple(out)

    def split_counts(self, split: str) -> list[int]:
        """Seeds of ``split`` owned by each partition."""
        return [int(p.split_sizes.get(split, 0)) for p in self.partitions]

    def records(self) -> list[FileRecord]:
        """Every file the manifest lists."""
        out = list(self.files.values())
        for p in self.partitions:
            out.extend(p.files.values())
        return out

    def to_json(self) -> dict[str, Any]:
        return _v2_json(self) if self.typed else _v1_json(self)

    @property
    def fingerprint(self) -> str:
        """Hex SHA-256 of the manifest's canonical JSON: what tells this partitioning from
        any other (every server of the graph reports it; a checkpoint records it)."""
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @staticmethod
    def from_json(obj: dict[str, Any]) -> Manifest:
        if obj.get("format") != FORMAT_NAME:
            raise PartitionFormatError(
                f"{MANIFEST_FILE}: expected format {FORMAT_NAME!r}, got {obj.get('format')!r}")
        version = obj.get("format_version")
        if version == FORMAT_VERSION:
            return _from_v1(obj)
        if version == TYPED_FORMAT_VERSION:
            return _from_v2(obj)
        raise PartitionFormatError(f"{MANIFEST_FILE}: expected format_version {FORMAT_VERSION} or "
                                   f"{TYPED_FORMAT_VERSION}, got {version!r}")

    def write(self, root: Path) -> None:
        """Write ``manifest.json`` atomically (last, so a partial output never loads)."""
        tmp = root / (MANIFEST_FILE + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(root / MANIFEST_FILE)


def _files_json(files: dict[str, FileRecord]) -> dict[str, Any]:
    return {k: v.to_json() for k, v in files.items()}


def _files(obj: dict[str, Any]) -> dict[str, FileRecord]:
    return {str(k): FileRecord.from_json(v) for k, v in obj.items()}


def _edge_data_json(m: Manifest, et: EdgeType) -> dict[str, Any]:
    """An edge type's edge ID and feature keys, only where set: manifests written before
    edge data existed have none of them, and read and hash as they did."""
    out: dict[str, Any] = {}
    if et in m.edge_ids:
        out["has_edge_ids"] = True
    feats = m.edge_features.get(et)
    if feats is not None:
        out.update(edge_feature_shape=list(feats.shape), edge_feature_dtype=feats.dtype)
    if et in m.edge_id_bounds:
        out["num_edge_ids"] = m.edge_id_bounds[et]
    return out


def _edge_data(obj: dict[str, Any]) -> tuple[bool, EdgeFeatureInfo | None]:
    """Inverse of :func:`_edge_data_json` for one edge type's entry."""
    feats = None
    if "edge_feature_dtype" in obj:
        feats = EdgeFeatureInfo(shape=tuple(int(d) for d in obj["edge_feature_shape"]),
                                dtype=str(obj["edge_feature_dtype"]))
    return bool(obj.get("has_edge_ids", False)), feats


def _v1_json(m: Manifest) -> dict[str, Any]:
    (t, info), = m.node_types.items()
    (et,) = m.edge_types
    return {
        "format": FORMAT_NAME, "format_version": m.format_version,
        "graph": {"name": m.graph_name, "num_nodes": info.num_nodes, "num_edges": m.num_edges,
                  "feature_dim": info.feature_dim, "feature_dtype": info.feature_dtype,
                  "num_classes": m.num_classes, "has_edge_weight": et in m.weighted,
                  **_edge_data_json(m, et)},
        "num_partitions": m.num_partitions,
        "partition_book": list(m.partition_book[t]),
        "algorithm": m.algorithm,
        "files": _files_json(m.files),
        "partitions": [{"id": p.id, "num_nodes": p.num_nodes[t], "num_edges": p.num_edges[et],
                        "num_remote_edges": p.num_remote_edges[et], "split_sizes": p.split_sizes,
                        "files": _files_json(p.files)} for p in m.partitions],
        **_link_splits_json(m),
    }


def _from_v1(obj: dict[str, Any]) -> Manifest:
    """A v1 manifest: its JSON read as v2's of its one node type and one edge type."""
    g, t, et = obj["graph"], PLAIN_NODE_TYPE, edge_type_name(PLAIN_EDGE_TYPE)
    edge = {"num_edges": g["num_edges"], "has_edge_weight": g["has_edge_weight"],
            **{k: g[k] for k in _EDGE_DATA_KEYS if k in g}}
    typed = {"graph": {"name": g["name"], "target_type": t, "num_classes": g["num_classes"],
                       "node_types": {t: {k: g[k] for k in ("num_nodes", "feature_dim", "feature_dtype")}},
                       "edge_types": {et: edge}},
             "partition_book": {t: obj["partition_book"]},
             "partitions": [{**p, "num_nodes": {t: p["num_nodes"]}, "num_edges": {et: p["num_edges"]},
                             "num_remote_edges": {et: p["num_remote_edges"]}} for p in obj["partitions"]]}
    plain = replace(_from_v2({**obj, **typed, "link_splits": {}}), format_version=FORMAT_VERSION)
    return replace(plain, link_splits=_link_splits(obj.get("link_splits", {}), typed=False))


def _link_splits_json(m: Manifest) -> dict[str, Any]:
    """The ``link_splits`` key, only when the graph has link splits: manifests written
    before link splits existed read and hash as they did. A plain graph's entries name no
    edge type."""
    if not m.link_splits:
        return {}
    out = {}
    for name, info in m.link_splits.items():
        entry: dict[str, Any] = {"num_edges": info.num_edges, "num_negatives": info.num_negatives}
        if m.typed:
            entry["edge_type"] = edge_type_name(info.edge_type)
        if info.label_dtype is not None:
            entry.update(label_shape=list(info.label_shape), label_dtype=info.label_dtype)
        out[name] = entry
    return {"link_splits": out}


def _link_splits(obj: dict[str, Any], *, typed: bool) -> dict[str, LinkSplitInfo]:
    """Inverse of :func:`_link_splits_json`."""
    out = {}
    for name, entry in obj.items():
        has_label = entry.get("label_dtype") is not None
        out[str(name)] = LinkSplitInfo(
            edge_type=parse_edge_type(str(entry["edge_type"])) if typed else PLAIN_EDGE_TYPE,
            num_edges=int(entry["num_edges"]), num_negatives=int(entry.get("num_negatives", 0)),
            label_shape=tuple(int(d) for d in entry["label_shape"]) if has_label else (),
            label_dtype=str(entry["label_dtype"]) if has_label else None)
    return out


#: An edge type's keys of edge IDs and features (:func:`_edge_data_json`).
_EDGE_DATA_KEYS = ("has_edge_ids", "edge_feature_shape", "edge_feature_dtype", "num_edge_ids")


def _v2_json(m: Manifest) -> dict[str, Any]:
    def edge(et: EdgeType) -> dict[str, Any]:  # the flags only where set: older manifests' JSON
        return {"num_edges": m.edge_types[et], **({"has_edge_weight": True} if et in m.weighted else {}),
                **_edge_data_json(m, et)}

    by_name = edge_type_name
    return {
        "format": FORMAT_NAME, "format_version": m.format_version,
        "graph": {
            "name": m.graph_name, "target_type": m.target_type, "num_classes": m.num_classes,
            "node_types": {t: {"num_nodes": i.num_nodes, "feature_dim": i.feature_dim,
                               "feature_dtype": i.feature_dtype} for t, i in m.node_types.items()},
            "edge_types": {by_name(et): edge(et) for et in m.edge_types},
        },
        "num_partitions": m.num_partitions,
        "partition_book": {t: list(b) for t, b in m.partition_book.items()},
        "algorithm": m.algorithm,
        "files": _files_json(m.files),
        "partitions": [{"id": p.id, "num_nodes": p.num_nodes,
                        "num_edges": {by_name(k): v for k, v in p.num_edges.items()},
                        "num_remote_edges": {by_name(k): v for k, v in p.num_remote_edges.items()},
                        "split_sizes": p.split_sizes, "files": _files_json(p.files)}
                       for p in m.partitions],
        **_link_splits_json(m),
    }


def _from_v2(obj: dict[str, Any]) -> Manifest:
    g = obj["graph"]
    edges = {parse_edge_type(k): v for k, v in g["edge_types"].items()}
    edge_data = {et: _edge_data(v) for et, v in edges.items()}
    return Manifest(
        graph_name=str(g["name"]), target_type=str(g["target_type"]), num_classes=int(g["num_classes"]),
        node_types={str(t): NodeTypeInfo(int(i["num_nodes"]), int(i["feature_dim"]), str(i["feature_dtype"]))
                    for t, i in g["node_types"].items()},
        edge_types={et: int(v["num_edges"]) for et, v in edges.items()},
        weighted=frozenset(et for et, v in edges.items() if v.get("has_edge_weight")),
        partition_book={str(t): tuple(int(x) for x in b) for t, b in obj["partition_book"].items()},
        partitions=tuple(PartitionInfo(
            id=int(p["id"]), num_nodes={str(k): int(v) for k, v in p["num_nodes"].items()},
            num_edges={parse_edge_type(k): int(v) for k, v in p["num_edges"].items()},
            num_remote_edges={parse_edge_type(k): int(v) for k, v in p["num_remote_edges"].items()},
            split_sizes={str(k): int(v) for k, v in p["split_sizes"].items()}, files=_files(p["files"]))
            for p in obj["partitions"]),
        files=_files(obj["files"]), algorithm=dict(obj.get("algorithm", {})),
        format_version=TYPED_FORMAT_VERSION,
        edge_ids=frozenset(et for et, (ids, _) in edge_data.items() if ids),
        edge_features={et: feats for et, (_, feats) in edge_data.items() if feats is not None},
        edge_id_bounds={et: int(v["num_edge_ids"]) for et, v in edges.items() if "num_edge_ids" in v},
        link_splits=_link_splits(obj.get("link_splits", {}), typed=True))


def read_manifest(root: str | Path) -> Manifest:
    """Read and check ``root/manifest.json`` (format v1 or v2); every failure a
    :class:`PartitionFormatError` naming it."""
    path = Path(root) / MANIFEST_FILE
    if not path.is_file():
        raise PartitionFormatError(f"{path}: manifest not found; is {root} a partition directory?")
    try:
        manifest = Manifest.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, PartitionFormatError):
            raise
        raise PartitionFormatError(f"{path}: malformed manifest ({type(exc).__name__}: {exc})") from exc
    check_manifest(path, manifest)
    return manifest


def read_format_version(root: str | Path) -> int:
    """The ``format_version`` of the partition directory ``root`` (1 or 2)."""
    return read_manifest(root).format_version


def check_manifest(path: Path, m: Manifest) -> None:
    """The manifest's facts agree with each other: types, books, per-partition counts."""
    if m.target_type not in m.node_types:
        raise PartitionFormatError(
            f"{path}: target_type: expected one of {list(m.node_types)}, got {m.target_type!r}")
    for et in m.edge_types:
        if et[0] not in m.node_types or et[2] not in m.node_types:
            raise PartitionFormatError(f"{path}: edge type {et}: unknown node type")
    for t, info in m.node_types.items():
        for kind in ("partition_book", "node_map"):
            if m.shared_role(kind, t) not in m.files:
                raise PartitionFormatError(f"{path}: files: expected {m.shared_role(kind, t)!r}, got "
                                           f"{sorted(m.files)[:8]}")
        book = m.partition_book.get(t)
        name = f"partition_book[{t!r}]" if m.typed else "partition_book"
        if (book is None or len(book) != m.num_partitions + 1 or book[0] != 0
                or book[-1] != info.num_nodes):
            raise PartitionFormatError(
                f"{path}: {name}: expected {m.num_partitions + 1} offsets from 0 to "
                f"{info.num_nodes}, got {None if book is None else list(book)[:8]}")
        for p in m.partitions:
            if book[p.id + 1] - book[p.id] != p.num_nodes.get(t):
                where = f"num_nodes[{t!r}]" if m.typed else "num_nodes"
                raise PartitionFormatError(
                    f"{path}: partitions[{p.id}].{where}: expected {book[p.id + 1] - book[p.id]} "
                    f"(from partition_book), got {p.num_nodes.get(t)}")
    for et, feats in m.edge_features.items():
        name = f"edge_types[{edge_type_name(et)!r}]" if m.typed else "graph"
        if not _numeric(feats.dtype) or any(d < 0 for d in feats.shape):
            raise PartitionFormatError(f"{path}: {name}.edge_feature_dtype/shape: expected a numeric "
                                       f"dtype and sizes >= 0, got {feats.dtype!r} {list(feats.shape)}")
    _check_link_splits(path, m)
    for et, total in m.edge_types.items():
        if sum(p.num_edges.get(et, 0) for p in m.partitions) != total:
            what = f"edge_types[{edge_type_name(et)!r}]" if m.typed else "num_edges"
            raise PartitionFormatError(f"{path}: {what}: partitions' edges do not add up to {total}")


def _numeric(dtype: str) -> bool:
    """Whether ``dtype`` names a numpy dtype of booleans, integers or floats."""
    try:
        return np.dtype(dtype).kind in "biuf"
    except TypeError:
        return False


def _check_link_splits(path: Path, m: Manifest) -> None:
    """Each link split names an edge type of the graph, sizes >= 0, a numeric label dtype,
    and the shared files it needs (``src``, ``dst``; ``label``, ``neg_dst`` when it has them)."""
    for name, info in m.link_splits.items():
        what = f"{path}: link_splits[{name!r}]"
        if info.edge_type not in m.edge_types:
            raise PartitionFormatError(f"{what}.edge_type: expected one of {list(m.edge_types)}, got "
                                       f"{info.edge_type!r}")
        if info.num_edges < 0 or info.num_negatives < 0 or any(d < 0 for d in info.label_shape):
            raise PartitionFormatError(f"{what}: expected sizes >= 0, got num_edges {info.num_edges}, "
                                       f"num_negatives {info.num_negatives}, label_shape "
                                       f"{list(info.label_shape)}")
        if info.label_dtype is not None and not _numeric(info.label_dtype):
            raise PartitionFormatError(f"{what}.label_dtype: expected a numeric dtype, got "
                                       f"{info.label_dtype!r}")
        kinds = ["src", "dst", *(["label"] if info.label_dtype is not None else []),
                 *(["neg_dst"] if info.num_negatives else [])]
        for kind in kinds:
            if link_role(name, kind) not in m.files:
                raise PartitionFormatError(f"{path}: files: expected {link_role(name, kind)!r} "
                                           f"(link split {name!r}), found none")
