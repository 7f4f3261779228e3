"""Partition format v1: the manifest, and the validating reader all later code uses.

Layout of a partition root (see ``docs/partition-format.md``)::

    manifest.json            format version, graph facts, partition book, file records
    partition_book.npy       int64 [P+1]: partition p owns global IDs [book[p], book[p+1])
    node_map.npy             int64 [N]: original node ID -> global ID
    part-<p>/indptr.npy      int64 [n_p+1]: CSC offsets over the owned nodes
    part-<p>/indices.npy     int64 [e_p]: global source ID of each in-edge
    part-<p>/edge_weight.npy float32 [e_p] (only when the graph has edge weights)
    part-<p>/x.npy           [n_p, F] features of the owned nodes
    part-<p>/y.npy           int64 [n_p] labels (-1 = unlabeled)
    part-<p>/orig_ids.npy    int64 [n_p] original ID of each owned node
    part-<p>/<split>_idx.npy int64: global IDs of the owned nodes in the split
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

from partitioner.graph import SPLITS
from partitioner.npyio import FileRecord, load_npy, read_npy_header, sha256_file

log = logging.getLogger(__name__)

FORMAT_NAME = "graphfeed-partition"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"

Verify = Literal["full", "size"]


class PartitionFormatError(ValueError):
    """A partition on disk does not match its manifest; the message names the file."""


@dataclass(frozen=True)
class Structure:
    """In-edges (CSC) of one contiguous range of global node IDs: the nodes a sampler can
    draw from without asking another server. A partition's own range
    (:attr:`Partition.structure`), or every node of the graph (:func:`load_structure`)."""

    #: int64 ``[n+1]`` CSC offsets over the nodes ``node_start .. node_start+n-1``.
    indptr: np.ndarray
    #: int64 ``[e]`` global source ID of each in-edge.
    indices: np.ndarray
    #: int64 ``[n]`` original ID of each node (draws are keyed by it).
    orig_ids: np.ndarray
    #: Global ID of the first node.
    node_start: int
    #: float32 ``[e]`` edge weights, aligned with ``indices``; None when absent.
    edge_weight: np.ndarray | None = None

    @property
    def num_nodes(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def node_range(self) -> tuple[int, int]:
        """``[start, stop)`` of the global IDs whose in-edges this holds."""
        return self.node_start, self.node_start + self.num_nodes

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (memory maps included)."""
        arrays = (self.indptr, self.indices, self.orig_ids, self.edge_weight)
        return sum(int(a.nbytes) for a in arrays if a is not None)


@dataclass(frozen=True)
class NodeData:
    """Features and labels of one contiguous range of global node IDs: the rows a server
    gathers without asking another. A partition's own (:attr:`Partition.node_data`), or
    every node's (:func:`load_node_data`)."""

    #: ``[n, F]`` features of the nodes ``node_start .. node_start+n-1``.
    x: np.ndarray
    #: int64 ``[n]`` labels, ``-1`` = unlabeled.
    y: np.ndarray
    #: Global ID of the first node.
    node_start: int

    @property
    def num_nodes(self) -> int:
        return int(self.x.shape[0])

    @property
    def node_range(self) -> tuple[int, int]:
        """``[start, stop)`` of the global IDs whose rows this holds."""
        return self.node_start, self.node_start + self.num_nodes

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (memory maps included)."""
        return int(self.x.nbytes) + int(self.y.nbytes)


@dataclass(frozen=True)
class PartitionInfo:
    """The manifest's entry for one partition."""

    #: Partition ID ``p``.
    id: int
    #: Number of owned nodes ``n_p`` (global IDs ``book[p] .. book[p+1]-1``).
    num_nodes: int
    #: Number of in-edges of the owned nodes ``e_p``.
    num_edges: int
    #: In-edges whose source is owned by another partition.
    num_remote_edges: int
    #: Split name to the number of owned nodes in it.
    split_sizes: dict[str, int]
    #: File role (``indptr``, ``x``, ``train_idx`` ...) to its record.
    files: dict[str, FileRecord]

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "num_nodes": self.num_nodes, "num_edges": self.num_edges,
            "num_remote_edges": self.num_remote_edges, "split_sizes": self.split_sizes,
            "files": {k: v.to_json() for k, v in self.files.items()},
        }

    @staticmethod
    def from_json(obj: dict[str, Any]) -> PartitionInfo:
        return PartitionInfo(
            id=int(obj["id"]), num_nodes=int(obj["num_nodes"]), num_edges=int(obj["num_edges"]),
            num_remote_edges=int(obj["num_remote_edges"]),
            split_sizes={str(k): int(v) for k, v in obj["split_sizes"].items()},
            files={str(k): FileRecord.from_json(v) for k, v in obj["files"].items()},
        )


@dataclass(frozen=True)
class Manifest:
    """Everything recorded about a partitioned graph."""

    #: Name of the source graph.
    graph_name: str
    #: Total nodes ``N`` and directed edges ``E``.
    num_nodes: int
    num_edges: int
    #: Feature dimension ``F`` and numpy dtype name of the features.
    feature_dim: int
    feature_dtype: str
    #: Number of classes.
    num_classes: int
    #: Whether ``edge_weight.npy`` files exist.
    has_edge_weight: bool
    #: ``P+1`` range offsets: partition p owns global IDs ``[book[p], book[p+1])``.
    partition_book: tuple[int, ...]
    #: One entry per partition, in ID order.
    partitions: tuple[PartitionInfo, ...]
    #: Shared files (``partition_book``, ``node_map``).
    files: dict[str, FileRecord]
    #: How the graph was partitioned (method, parameters, seed, elapsed seconds).
    algorithm: dict[str, Any] = field(default_factory=dict)
    #: Format version.
    format_version: int = FORMAT_VERSION

    @property
    def num_partitions(self) -> int:
        return len(self.partitions)

    @property
    def edge_cut(self) -> int:
        """Directed edges whose endpoints lie in different partitions."""
        return sum(p.num_remote_edges for p in self.partitions)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME, "format_version": self.format_version,
            "graph": {
                "name": self.graph_name, "num_nodes": self.num_nodes,
                "num_edges": self.num_edges, "feature_dim": self.feature_dim,
                "feature_dtype": self.feature_dtype, "num_classes": self.num_classes,
                "has_edge_weight": self.has_edge_weight,
            },
            "num_partitions": self.num_partitions,
            "partition_book": list(self.partition_book),
            "algorithm": self.algorithm,
            "files": {k: v.to_json() for k, v in self.files.items()},
            "partitions": [p.to_json() for p in self.partitions],
        }

    @staticmethod
    def from_json(obj: dict[str, Any]) -> Manifest:
        if obj.get("format") != FORMAT_NAME:
            raise PartitionFormatError(
                f"{MANIFEST_FILE}: expected format {FORMAT_NAME!r}, got {obj.get('format')!r}"
            )
        if obj.get("format_version") == 2:
            raise PartitionFormatError(
                f"{MANIFEST_FILE}: format_version 2 holds a typed (heterogeneous) graph; "
                "load it with partitioner.load_hetero_partition"
            )
        if obj.get("format_version") != FORMAT_VERSION:
            raise PartitionFormatError(
                f"{MANIFEST_FILE}: expected format_version {FORMAT_VERSION}, "
                f"got {obj.get('format_version')!r}"
            )
        g = obj["graph"]
        parts = tuple(PartitionInfo.from_json(p) for p in obj["partitions"])
        return Manifest(
            graph_name=str(g["name"]), num_nodes=int(g["num_nodes"]),
            num_edges=int(g["num_edges"]), feature_dim=int(g["feature_dim"]),
            feature_dtype=str(g["feature_dtype"]), num_classes=int(g["num_classes"]),
            has_edge_weight=bool(g["has_edge_weight"]),
            partition_book=tuple(int(b) for b in obj["partition_book"]),
            partitions=parts,
            files={str(k): FileRecord.from_json(v) for k, v in obj["files"].items()},
            algorithm=dict(obj.get("algorithm", {})),
        )

    def write(self, root: Path) -> None:
        """Write ``manifest.json`` atomically (last, so a partial output never loads)."""
        tmp = root / (MANIFEST_FILE + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(root / MANIFEST_FILE)


M = TypeVar("M")


def parse_manifest_file(root: str | Path, from_json: Callable[[dict[str, Any]], M]) -> tuple[Path, M]:
    """``root/manifest.json`` parsed by ``from_json``; every failure a PartitionFormatError naming it."""
    path = Path(root) / MANIFEST_FILE
    if not path.is_file():
        raise PartitionFormatError(f"{path}: manifest not found; is {root} a partition directory?")
    try:
        return path, from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, PartitionFormatError):
            raise
        raise PartitionFormatError(f"{path}: malformed manifest ({type(exc).__name__}: {exc})") from exc


def read_manifest(root: str | Path) -> Manifest:
    """Read and check ``root/manifest.json``."""
    path, manifest = parse_manifest_file(root, Manifest.from_json)
    _check_manifest(path, manifest)
    return manifest


def _check_manifest(path: Path, m: Manifest) -> None:
    book = m.partition_book
    if len(book) != m.num_partitions + 1 or book[0] != 0 or book[-1] != m.num_nodes:
        raise PartitionFormatError(
            f"{path}: partition_book: expected {m.num_partitions + 1} offsets from 0 to "
            f"{m.num_nodes}, got {list(book)[:8]}"
        )
    for p in m.partitions:
        if book[p.id + 1] - book[p.id] != p.num_nodes:
            raise PartitionFormatError(
                f"{path}: partitions[{p.id}].num_nodes: expected {book[p.id + 1] - book[p.id]} "
                f"(from partition_book), got {p.num_nodes}"
            )
    if sum(p.num_edges for p in m.partitions) != m.num_edges:
        raise PartitionFormatError(f"{path}: num_edges: partitions' edges do not add up")


@dataclass
class Partition:
    """One loaded partition: CSC in-edges, node data and split shares of the owned range.

    Arrays are read-only memory maps unless loaded with ``mmap=False``.
    """

    #: The whole manifest (graph facts, partition book, every partition's sizes).
    manifest: Manifest
    #: This partition's ID ``p``.
    partition_id: int
    #: int64 ``[P+1]`` range offsets of all partitions.
    partition_book: np.ndarray
    #: int64 ``[n_p+1]`` CSC offsets; in-edges of local node i are ``indptr[i]:indptr[i+1]``.
    indptr: np.ndarray
    #: int64 ``[e_p]`` global source IDs of the in-edges.
    indices: np.ndarray
    #: ``[n_p, F]`` features of the owned nodes.
    x: np.ndarray
    #: int64 ``[n_p]`` labels, ``-1`` = unlabeled.
    y: np.ndarray
    #: int64 ``[n_p]`` original IDs of the owned nodes.
    orig_ids: np.ndarray
    #: Split name to the int64 global IDs of the owned nodes in it.
    splits: dict[str, np.ndarray]
    #: float32 ``[e_p]`` edge weights, aligned with ``indices``; None when absent.
    edge_weight: np.ndarray | None = None

    @property
    def node_range(self) -> tuple[int, int]:
        """``[start, stop)`` of the global IDs this partition owns."""
        return int(self.partition_book[self.partition_id]), int(
            self.partition_book[self.partition_id + 1]
        )

    @property
    def num_nodes(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    @property
    def structure(self) -> Structure:
        """The in-edges of the owned nodes, as a :class:`Structure`."""
        return Structure(indptr=self.indptr, indices=self.indices, orig_ids=self.orig_ids,
                         node_start=self.node_range[0], edge_weight=self.edge_weight)

    @property
    def node_data(self) -> NodeData:
        """The features and labels of the owned nodes, as a :class:`NodeData`."""
        return NodeData(x=self.x, y=self.y, node_start=self.node_range[0])


def _check_file(root: Path, rec: FileRecord, verify: Verify) -> None:
    path = root / rec.path
    if not path.is_file():
        raise PartitionFormatError(f"{path}: missing (the manifest lists it)")
    size = path.stat().st_size
    if size != rec.size_bytes:
        kind = "truncated" if size < rec.size_bytes else "larger than recorded"
        raise PartitionFormatError(
            f"{path}: {kind}: expected {rec.size_bytes} bytes, got {size}"
        )
    try:
        dtype, shape, fortran, _ = read_npy_header(path)
    except ValueError as exc:
        raise PartitionFormatError(f"{path}: not a valid .npy file ({exc})") from exc
    if dtype.hasobject:
        raise PartitionFormatError(f"{path}: object arrays are refused (no pickle)")
    if fortran or dtype.name != rec.dtype or tuple(shape) != rec.shape:
        raise PartitionFormatError(
            f"{path}: expected {rec.dtype} of shape {list(rec.shape)} (C order), "
            f"got {dtype.name} of shape {list(shape)}{' (Fortran order)' if fortran else ''}"
        )
    if verify == "full":
        digest = sha256_file(path)
        if digest != rec.sha256:
            raise PartitionFormatError(
                f"{path}: SHA-256 mismatch: expected {rec.sha256[:16]}…, got {digest[:16]}… "
                "(the file is corrupted or was replaced)"
            )


def check_files(root: str | Path, records: list[FileRecord], verify: Verify = "full") -> None:
    """Check that every recorded file exists and matches its size, header and checksum."""
    base = Path(root)
    with ThreadPoolExecutor(max_workers=2) as pool:
        for fut in [pool.submit(_check_file, base, r, verify) for r in records]:
            fut.result()


def _load(root: Path, rec: FileRecord, mmap: bool) -> np.ndarray:
    return load_npy(root / rec.path, mmap)


def load_partition(
    root: str | Path, partition_id: int, *, mmap: bool = True, verify: Verify = "full"
) -> Partition:
    """Load and validate partition ``partition_id`` of the partition directory ``root``.

    ``verify='full'`` also checks every file's SHA-256; ``'size'`` checks sizes and
    headers only (faster for very large partitions). Raises :class:`PartitionFormatError`
    naming the offending file.
    """
    base = Path(root)
    manifest = read_manifest(base)
    if not 0 <= partition_id < manifest.num_partitions:
        raise PartitionFormatError(
            f"partition: expected an ID in [0, {manifest.num_partitions}), got {partition_id}"
        )
    info = manifest.partitions[partition_id]
    records = [manifest.files["partition_book"], *info.files.values()]
    check_files(base, records, verify)
    files = {k: _load(base, r, mmap) for k, r in info.files.items()}
    part = Partition(
        manifest=manifest, partition_id=partition_id,
        partition_book=_load(base, manifest.files["partition_book"], mmap=False),
        indptr=files["indptr"], indices=files["indices"], x=files["x"], y=files["y"],
        orig_ids=files["orig_ids"], edge_weight=files.get("edge_weight"),
        splits={s: files[f"{s}_idx"] for s in SPLITS if f"{s}_idx" in files},
    )
    _check_partition(base, part)
    log.info("loaded partition %d of %s: %d nodes, %d edges", partition_id, base,
             part.num_nodes, part.num_edges)
    return part


#: The files of a partition that make up its :class:`Structure`.
STRUCTURE_FILES = ("indptr", "indices", "orig_ids", "edge_weight")


def structure_records(manifest: Manifest, weights: bool = True) -> list[FileRecord]:
    """Every partition's structure files (:data:`STRUCTURE_FILES`), in partition order."""
    return [r for info in manifest.partitions for k, r in info.files.items()
            if k in STRUCTURE_FILES and (weights or k != "edge_weight")]


def load_structure(root: str | Path, *, verify: Verify = "full", weights: bool = True) -> Structure:
    """The in-edges of every node of the graph in ``root``: each partition's structure
    files (:data:`STRUCTURE_FILES`; edge weights only with ``weights`` and when the graph
    has them) checked as :func:`load_partition` checks them and joined in partition order,
    in memory (``8 (N + 1) + 8 E`` bytes for the CSC, ``8 N`` for the original IDs, ``4 E``
    for the weights). Every partition's files must be present under ``root``; a missing
    or mismatching one raises :class:`PartitionFormatError` naming it."""
    base = Path(root)
    m = read_manifest(base)
    check_files(base, structure_records(m, weights), verify)
    with_weights = weights and all("edge_weight" in info.files for info in m.partitions)
    indptr = np.empty(m.num_nodes + 1, dtype=np.int64)
    indices = np.empty(m.num_edges, dtype=np.int64)
    orig_ids = np.empty(m.num_nodes, dtype=np.int64)
    weight = np.empty(m.num_edges, dtype=np.float32) if with_weights else None
    indptr[0] = 0
    node, edge = 0, 0
    for info in m.partitions:
        files = info.files
        offsets = _load(base, files["indptr"], mmap=True)
        src = _load(base, files["indices"], mmap=True)
        n, e = info.num_nodes, info.num_edges
        if offsets.shape != (n + 1,) or src.shape != (e,):
            raise _fail(base, files["indptr"].path,
                        f"expected {n + 1} offsets over {e} edges (the manifest's partition "
                        f"{info.id}), got {list(offsets.shape)} over {list(src.shape)}")
        _check_csc(base, files, offsets, src, m.num_nodes)
        _check_starts_at(base, m, info.id, node)
        np.add(offsets[1:], edge, out=indptr[node + 1:node + n + 1])
        indices[edge:edge + e] = src
        orig_ids[node:node + n] = _load(base, files["orig_ids"], mmap=True)
        if weight is not None:
            weight[edge:edge + e] = _load(base, files["edge_weight"], mmap=True)
        node, edge = node + n, edge + e
    if node != m.num_nodes or edge != m.num_edges:
        raise _fail(base, MANIFEST_FILE, f"expected {m.num_nodes} nodes and {m.num_edges} "
                    f"edges in all, its partitions hold {node} and {edge}")
    for a in (indptr, indices, orig_ids, weight):
        if a is not None:
            a.flags.writeable = False
    log.info("loaded the structure of all %d partitions of %s: %d nodes, %d edges, %.1f MiB",
             m.num_partitions, base, node, edge,
             sum(a.nbytes for a in (indptr, indices, orig_ids, weight) if a is not None) / 2**20)
    return Structure(indptr=indptr, indices=indices, orig_ids=orig_ids, node_start=0,
                     edge_weight=weight)


#: The files of a partition that make up its :class:`NodeData`.
NODE_DATA_FILES = ("x", "y")


def node_data_records(manifest: Manifest) -> list[FileRecord]:
    """Every partition's feature and label files (:data:`NODE_DATA_FILES`), in partition
    order."""
    return [r for info in manifest.partitions for k, r in info.files.items()
            if k in NODE_DATA_FILES]


def node_data_bytes(manifest: Manifest) -> int:
    """Bytes of the whole graph's joined features and labels (:func:`load_node_data`)."""
    n = manifest.num_nodes
    return n * manifest.feature_dim * np.dtype(manifest.feature_dtype).itemsize + 8 * n


def load_node_data(root: str | Path, *, verify: Verify = "full") -> NodeData:
    """The features and labels of every node of the graph in ``root``: each partition's
    ``x`` and ``y`` (:data:`NODE_DATA_FILES`) checked as :func:`load_partition` checks
    them and joined in partition order, in memory (``N F`` features in the stored dtype
    and ``8 N`` bytes of labels). Every partition's files must be present under ``root``;
    a missing or mismatching one raises :class:`PartitionFormatError` naming it."""
    base = Path(root)
    m = read_manifest(base)
    check_files(base, node_data_records(m), verify)
    x = np.empty((m.num_nodes, m.feature_dim), dtype=np.dtype(m.feature_dtype))
    y = np.empty(m.num_nodes, dtype=np.int64)
    node = 0
    for info in m.partitions:
        files = info.files
        n = info.num_nodes
        _check_starts_at(base, m, info.id, node)
        rows, labels = _load(base, files["x"], mmap=True), _load(base, files["y"], mmap=True)
        _check_node_rows(base, files, {"x": rows, "y": labels}, n, m.feature_dim)
        if rows.dtype != x.dtype:
            raise _fail(base, files["x"].path, f"expected {x.dtype.name} features (the "
                        f"manifest's feature_dtype), got {rows.dtype.name}")
        x[node:node + n] = rows
        y[node:node + n] = labels
        node += n
    if node != m.num_nodes:
        raise _fail(base, MANIFEST_FILE, f"expected {m.num_nodes} nodes in all, its partitions "
                    f"hold {node}")
    x.flags.writeable = False
    y.flags.writeable = False
    log.info("loaded the features and labels of all %d partitions of %s: %d nodes, %.1f MiB",
             m.num_partitions, base, node, (x.nbytes + y.nbytes) / 2**20)
    return NodeData(x=x, y=y, node_start=0)


def load_node_map(root: str | Path, *, verify: Verify = "full") -> np.ndarray:
    """The int64 ``[N]`` map from original node IDs to global IDs."""
    manifest = read_manifest(root)
    rec = manifest.files["node_map"]
    check_files(root, [rec], verify)
    return _load(Path(root), rec, mmap=True)


def _fail(base: Path, rel: str, what: str) -> PartitionFormatError:
    return PartitionFormatError(f"{base / rel}: {what}")


def _check_csc(base: Path, files: dict[str, FileRecord], indptr: np.ndarray, indices: np.ndarray,
               num_nodes: int) -> None:
    """One partition's CSC: offsets from 0 to its edge count, never decreasing; source IDs
    in ``[0, num_nodes)``."""
    num_edges = int(indices.shape[0])
    if int(indptr[0]) != 0 or int(indptr[-1]) != num_edges:
        raise _fail(base, files["indptr"].path,
                    f"expected offsets from 0 to {num_edges}, got {int(indptr[0])} to "
                    f"{int(indptr[-1])}")
    if indptr.shape[0] > 1 and bool((np.diff(indptr) < 0).any()):
        raise _fail(base, files["indptr"].path, "offsets decrease")
    if num_edges:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= num_nodes:
            raise _fail(base, files["indices"].path,
                        f"expected source IDs in [0, {num_nodes}), got [{lo}, {hi}]")


def _check_starts_at(base: Path, m: Manifest, partition: int, node: int) -> None:
    """Partition ``partition`` of the book starts at ``node``, right after those before it."""
    if node != int(m.partition_book[partition]):
        raise _fail(base, MANIFEST_FILE, f"partition {partition} starts at node "
                    f"{int(m.partition_book[partition])}, not after the {node} nodes before it")


def _check_node_rows(base: Path, files: dict[str, FileRecord], arrays: dict[str, np.ndarray],
                     num_nodes: int, feature_dim: int) -> None:
    """A partition's per-node arrays (``x``: ``num_nodes`` rows of ``feature_dim``; ``y``,
    ``orig_ids``: one entry per node), by role."""
    for role, arr in arrays.items():
        if role == "x":
            if arr.shape != (num_nodes, feature_dim):
                raise _fail(base, files["x"].path, f"expected {num_nodes} rows of {feature_dim}, "
                            f"got {list(arr.shape)}")
        elif arr.shape != (num_nodes,):
            raise _fail(base, files[role].path, f"expected shape [{num_nodes}] (one per owned "
                        f"node), got {list(arr.shape)}")


def _check_partition(base: Path, part: Partition) -> None:
    """Structural checks beyond the manifest: book, CSC offsets, ID ranges."""
    m, p = part.manifest, part.partition_id
    files = m.partitions[p].files
    if part.partition_book.tolist() != list(m.partition_book):
        raise _fail(base, "partition_book.npy", "does not match the manifest's partition_book")
    _check_csc(base, files, part.indptr, part.indices, m.num_nodes)
    start, stop = part.node_range
    for split, ids in part.splits.items():
        if ids.size and (int(ids.min()) < start or int(ids.max()) >= stop):
            raise _fail(base, files[f"{split}_idx"].path,
                        f"expected global IDs in [{start}, {stop}) owned by partition {p}")
    _check_node_rows(base, files, {"x": part.x, "y": part.y, "orig_ids": part.orig_ids},
                     part.num_nodes, m.feature_dim)
