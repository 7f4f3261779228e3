"""Partition format v2, for typed graphs: the manifest and the validating reader.

Layout of a v2 partition root (see ``docs/partition-format.md``)::

    manifest.json                      format_version 2, typed graph facts, file records
    partition_book/<type>.npy          int64 [P+1] per node type
    node_map/<type>.npy                int64 [N_t]: original ID -> global ID of that type
    part-<p>/<type>/orig_ids.npy       int64 [n_pt]: original ID of each owned node
    part-<p>/<type>/x.npy              [n_pt, F_t] (types with features only)
    part-<p>/<src>__<rel>__<dst>/indptr.npy   int64 [n_pd+1]: CSC over owned dst nodes
    part-<p>/<src>__<rel>__<dst>/indices.npy  int64 [e_pr]: global IDs of the src type
    part-<p>/<target>/y.npy            int64 [n_p,target] labels (-1 = unlabeled)
    part-<p>/<target>/<split>_idx.npy  int64: global IDs of owned target nodes in the split

Global IDs are per type: partition ``p`` owns IDs ``[book_t[p], book_t[p+1])`` of type
``t``. Version 1 (homogeneous) directories are read by :mod:`partitioner.format`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from partitioner.format import (
    FORMAT_NAME,
    MANIFEST_FILE,
    PartitionFormatError,
    Verify,
    _fail,
    _load,
    check_files,
    parse_manifest_file,
)
from partitioner.graph import SPLITS
from partitioner.hetero import EdgeType, edge_type_name, parse_edge_type
from partitioner.npyio import FileRecord

log = logging.getLogger(__name__)

HETERO_FORMAT_VERSION = 2


def read_format_version(root: str | Path) -> int:
    """The ``format_version`` of the partition directory ``root`` (1 or 2)."""
    path = Path(root) / MANIFEST_FILE
    if not path.is_file():
        raise PartitionFormatError(f"{path}: manifest not found; is {root} a partition directory?")
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PartitionFormatError(f"{path}: malformed manifest ({exc})") from exc
    version = obj.get("format_version") if isinstance(obj, dict) else None
    if version not in (1, HETERO_FORMAT_VERSION):
        raise PartitionFormatError(f"{path}: expected format_version 1 or 2, got {version!r}")
    return int(version)


@dataclass(frozen=True)
class HeteroPartitionInfo:
    """The manifest's entry for one partition of a typed graph."""

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
    #: File role (``paper/x``, ``author__writes__paper/indptr`` ...) to its record.
    files: dict[str, FileRecord]

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "num_nodes": self.num_nodes,
            "num_edges": {edge_type_name(k): v for k, v in self.num_edges.items()},
            "num_remote_edges": {edge_type_name(k): v for k, v in self.num_remote_edges.items()},
            "split_sizes": self.split_sizes,
            "files": {k: v.to_json() for k, v in self.files.items()},
        }

    @staticmethod
    def from_json(obj: dict[str, Any]) -> HeteroPartitionInfo:
        return HeteroPartitionInfo(
            id=int(obj["id"]),
            num_nodes={str(k): int(v) for k, v in obj["num_nodes"].items()},
            num_edges={parse_edge_type(k): int(v) for k, v in obj["num_edges"].items()},
            num_remote_edges={parse_edge_type(k): int(v)
                              for k, v in obj["num_remote_edges"].items()},
            split_sizes={str(k): int(v) for k, v in obj["split_sizes"].items()},
            files={str(k): FileRecord.from_json(v) for k, v in obj["files"].items()},
        )


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
class HeteroManifest:
    """Everything recorded about a partitioned typed graph."""

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
    partitions: tuple[HeteroPartitionInfo, ...]
    #: Shared files (``partition_book/<type>``, ``node_map/<type>``).
    files: dict[str, FileRecord]
    #: How the graph was partitioned (method, parameters, seed, elapsed seconds).
    algorithm: dict[str, Any] = field(default_factory=dict)
    #: Format version.
    format_version: int = HETERO_FORMAT_VERSION

    @property
    def num_partitions(self) -> int:
        return len(self.partitions)

    @property
    def num_nodes(self) -> int:
        return sum(t.num_nodes for t in self.node_types.values())

    @property
    def num_edges(self) -> int:
        return sum(self.edge_types.values())

    def edge_cut(self, edge_type: EdgeType | None = None) -> int:
        """Directed edges (of one type, or all) whose endpoints lie in different partitions."""
        return sum(n for p in self.partitions for et, n in p.num_remote_edges.items()
                   if edge_type is None or et == edge_type)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME, "format_version": self.format_version,
            "graph": {
                "name": self.graph_name, "target_type": self.target_type,
                "num_classes": self.num_classes,
                "node_types": {t: {"num_nodes": i.num_nodes, "feature_dim": i.feature_dim,
                                   "feature_dtype": i.feature_dtype}
                               for t, i in self.node_types.items()},
                "edge_types": {edge_type_name(k): {"num_edges": v}
                               for k, v in self.edge_types.items()},
            },
            "num_partitions": self.num_partitions,
            "partition_book": {t: list(b) for t, b in self.partition_book.items()},
            "algorithm": self.algorithm,
            "files": {k: v.to_json() for k, v in self.files.items()},
            "partitions": [p.to_json() for p in self.partitions],
        }

    @staticmethod
    def from_json(obj: dict[str, Any]) -> HeteroManifest:
        if obj.get("format") != FORMAT_NAME:
            raise PartitionFormatError(
                f"{MANIFEST_FILE}: expected format {FORMAT_NAME!r}, got {obj.get('format')!r}"
            )
        if obj.get("format_version") != HETERO_FORMAT_VERSION:
            raise PartitionFormatError(
                f"{MANIFEST_FILE}: expected format_version {HETERO_FORMAT_VERSION} (typed graph), "
                f"got {obj.get('format_version')!r}; load version 1 with load_partition"
            )
        g = obj["graph"]
        return HeteroManifest(
            graph_name=str(g["name"]), target_type=str(g["target_type"]),
            num_classes=int(g["num_classes"]),
            node_types={str(t): NodeTypeInfo(int(i["num_nodes"]), int(i["feature_dim"]),
                                             str(i["feature_dtype"]))
                        for t, i in g["node_types"].items()},
            edge_types={parse_edge_type(k): int(v["num_edges"])
                        for k, v in g["edge_types"].items()},
            partition_book={str(t): tuple(int(x) for x in b)
                            for t, b in obj["partition_book"].items()},
            partitions=tuple(HeteroPartitionInfo.from_json(p) for p in obj["partitions"]),
            files={str(k): FileRecord.from_json(v) for k, v in obj["files"].items()},
            algorithm=dict(obj.get("algorithm", {})),
        )

    def write(self, root: Path) -> None:
        """Write ``manifest.json`` atomically (last, so a partial output never loads)."""
        tmp = root / (MANIFEST_FILE + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(root / MANIFEST_FILE)

    def records(self) -> list[FileRecord]:
        """Every file the manifest lists."""
        out = list(self.files.values())
        for p in self.partitions:
            out.extend(p.files.values())
        return out


def read_hetero_manifest(root: str | Path) -> HeteroManifest:
    """Read and check ``root/manifest.json`` of a v2 (typed) partition directory."""
    path, manifest = parse_manifest_file(root, HeteroManifest.from_json)
    _check_manifest(path, manifest)
    return manifest


def _check_manifest(path: Path, m: HeteroManifest) -> None:
    if m.target_type not in m.node_types:
        raise PartitionFormatError(
            f"{path}: target_type: expected one of {list(m.node_types)}, got {m.target_type!r}")
    for et in m.edge_types:
        if et[0] not in m.node_types or et[2] not in m.node_types:
            raise PartitionFormatError(f"{path}: edge type {et}: unknown node type")
    for t, info in m.node_types.items():
        book = m.partition_book.get(t)
        if (book is None or len(book) != m.num_partitions + 1 or book[0] != 0
                or book[-1] != info.num_nodes):
            raise PartitionFormatError(
                f"{path}: partition_book[{t!r}]: expected {m.num_partitions + 1} offsets from 0 "
                f"to {info.num_nodes}, got {None if book is None else list(book)[:8]}")
        for p in m.partitions:
            if book[p.id + 1] - book[p.id] != p.num_nodes.get(t):
                raise PartitionFormatError(
                    f"{path}: partitions[{p.id}].num_nodes[{t!r}]: expected "
                    f"{book[p.id + 1] - book[p.id]} (from partition_book), got "
                    f"{p.num_nodes.get(t)}")
    for et, total in m.edge_types.items():
        if sum(p.num_edges.get(et, 0) for p in m.partitions) != total:
            raise PartitionFormatError(
                f"{path}: edge_types[{edge_type_name(et)!r}]: partitions' edges do not add up "
                f"to {total}")


@dataclass
class HeteroPartition:
    """One loaded partition of a typed graph. Arrays are read-only memory maps unless
    loaded with ``mmap=False``."""

    #: The whole manifest.
    manifest: HeteroManifest
    #: This partition's ID ``p``.
    partition_id: int
    #: Node type to its int64 ``[P+1]`` offsets.
    partition_book: dict[str, np.ndarray]
    #: Edge type to int64 ``[n_pd+1]`` CSC offsets over the owned destination nodes.
    indptr: dict[EdgeType, np.ndarray]
    #: Edge type to int64 ``[e_pr]`` global source IDs (of the source type).
    indices: dict[EdgeType, np.ndarray]
    #: Node type to ``[n_pt, F_t]`` features of the owned nodes (types with features only).
    x: dict[str, np.ndarray]
    #: Node type to int64 ``[n_pt]`` original IDs of the owned nodes.
    orig_ids: dict[str, np.ndarray]
    #: int64 ``[n_p,target]`` labels of the owned target nodes, ``-1`` = unlabeled.
    y: np.ndarray
    #: Split name to the int64 global IDs of the owned target nodes in it.
    splits: dict[str, np.ndarray]

    @property
    def target_type(self) -> str:
        return self.manifest.target_type

    def node_range(self, node_type: str) -> tuple[int, int]:
        """``[start, stop)`` of the global IDs of ``node_type`` this partition owns."""
        book, p = self.partition_book[node_type], self.partition_id
        return int(book[p]), int(book[p + 1])

    def num_nodes(self, node_type: str) -> int:
        start, stop = self.node_range(node_type)
        return stop - start

    def num_edges(self, edge_type: EdgeType) -> int:
        return int(self.indices[edge_type].shape[0])


def load_hetero_partition(
    root: str | Path, partition_id: int, *, mmap: bool = True, verify: Verify = "full"
) -> HeteroPartition:
    """Load and validate partition ``partition_id`` of the v2 directory ``root``.

    ``verify='full'`` checks every file's SHA-256, ``'size'`` sizes and headers only.
    Raises :class:`PartitionFormatError` naming the offending file.
    """
    base = Path(root)
    m = read_hetero_manifest(base)
    if not 0 <= partition_id < m.num_partitions:
        raise PartitionFormatError(
            f"partition: expected an ID in [0, {m.num_partitions}), got {partition_id}")
    info = m.partitions[partition_id]
    books = {t: m.files[f"partition_book/{t}"] for t in m.node_types}
    check_files(base, [*books.values(), *info.files.values()], verify)
    files = {k: _load(base, r, mmap) for k, r in info.files.items()}
    target = m.target_type
    try:
        part = HeteroPartition(
            manifest=m, partition_id=partition_id,
            partition_book={t: _load(base, r, mmap=False) for t, r in books.items()},
            indptr={et: files[f"{edge_type_name(et)}/indptr"] for et in m.edge_types},
            indices={et: files[f"{edge_type_name(et)}/indices"] for et in m.edge_types},
            x={t: files[f"{t}/x"] for t in m.node_types if f"{t}/x" in files},
            orig_ids={t: files[f"{t}/orig_ids"] for t in m.node_types},
            y=files[f"{target}/y"],
            splits={s: files[f"{target}/{s}_idx"] for s in SPLITS
                    if f"{target}/{s}_idx" in files},
        )
    except KeyError as exc:
        raise PartitionFormatError(
            f"{base / MANIFEST_FILE}: partitions[{partition_id}].files: expected a record for "
            f"{exc.args[0]!r}, found none") from None
    _check_partition(base, part)
    log.info("loaded typed partition %d of %s: %s nodes", partition_id, base,
             {t: part.num_nodes(t) for t in m.node_types})
    return part


def load_hetero_node_map(root: str | Path, node_type: str, *, verify: Verify = "full") -> np.ndarray:
    """The int64 ``[N_t]`` map from original IDs of ``node_type`` to its global IDs."""
    m = read_hetero_manifest(root)
    rec = m.files.get(f"node_map/{node_type}")
    if rec is None:
        raise PartitionFormatError(
            f"node_type: expected one of {list(m.node_types)}, got {node_type!r}")
    check_files(root, [rec], verify)
    return _load(Path(root), rec, mmap=True)


def _check_partition(base: Path, part: HeteroPartition) -> None:
    """Structural checks beyond the manifest: books, CSC offsets, ID ranges, shapes."""
    m, p = part.manifest, part.partition_id
    files = m.partitions[p].files
    for t, book in part.partition_book.items():
        if book.tolist() != list(m.partition_book[t]):
            raise _fail(base, m.files[f"partition_book/{t}"].path,
                        "does not match the manifest's partition_book")
    for et in m.edge_types:
        _check_csc(base, part, et, files)
    for t, info in m.node_types.items():
        n = part.num_nodes(t)
        if part.orig_ids[t].shape != (n,):
            raise _fail(base, files[f"{t}/orig_ids"].path,
                        f"expected shape [{n}] (one per owned node), got "
                        f"{list(part.orig_ids[t].shape)}")
        if info.feature_dim and (t not in part.x or part.x[t].shape != (n, info.feature_dim)):
            rec = files.get(f"{t}/x")
            raise _fail(base, rec.path if rec else f"part-{p}/{t}/x.npy",
                        f"expected {n} rows of {info.feature_dim} features")
    n_target = part.num_nodes(m.target_type)
    if part.y.shape != (n_target,):
        raise _fail(base, files[f"{m.target_type}/y"].path,
                    f"expected shape [{n_target}], got {list(part.y.shape)}")
    start, stop = part.node_range(m.target_type)
    for split, ids in part.splits.items():
        if ids.size and (int(ids.min()) < start or int(ids.max()) >= stop):
            raise _fail(base, files[f"{m.target_type}/{split}_idx"].path,
                        f"expected global IDs in [{start}, {stop}) owned by partition {p}")


def _check_csc(base: Path, part: HeteroPartition, et: EdgeType, files: dict[str, FileRecord]) -> None:
    m = part.manifest
    name = edge_type_name(et)
    indptr, indices = part.indptr[et], part.indices[et]
    n_dst = part.num_nodes(et[2])
    e = int(indices.shape[0])
    if indptr.shape != (n_dst + 1,):
        raise _fail(base, files[f"{name}/indptr"].path,
                    f"expected shape [{n_dst + 1}] (owned {et[2]!r} nodes + 1), got "
                    f"{list(indptr.shape)}")
    if int(indptr[0]) != 0 or int(indptr[-1]) != e:
        raise _fail(base, files[f"{name}/indptr"].path,
                    f"expected offsets from 0 to {e}, got {int(indptr[0])} to {int(indptr[-1])}")
    if n_dst and bool((np.diff(indptr) < 0).any()):
        raise _fail(base, files[f"{name}/indptr"].path, "offsets decrease")
    n_src = m.node_types[et[0]].num_nodes
    if e:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= n_src:
            raise _fail(base, files[f"{name}/indices"].path,
                        f"expected {et[0]!r} source IDs in [0, {n_src}), got [{lo}, {hi}]")
