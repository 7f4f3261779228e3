"""The validating reader of partitioned graphs (formats v1 and v2, one model).

:func:`load_partition` loads one partition as a :class:`Partition`: per edge type the CSC
in-edges of the owned destination nodes, per node type the owned nodes' original IDs and
features, the target type's labels and split shares. A plain graph (format v1) loads as
the typed graph of one node type and one edge type. :func:`load_structure` and
:func:`load_node_data` join every partition's in-edges, or features and labels, for a
server that holds the whole graph's; :func:`load_edge_data` joins every partition's edge
IDs and edge features. Every reader refuses files that do not match the
manifest (:mod:`partitioner.manifest`), naming the file. Arrays are read-only memory maps
unless loaded with ``mmap=False``.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from partitioner.graph import SPLITS, EdgeType
from partitioner.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    TYPED_FORMAT_VERSION,
    EdgeFeatureInfo,
    Manifest,
    NodeTypeInfo,
    PartitionFormatError,
    PartitionInfo,
    read_format_version,
    read_manifest,
    role,
)
from partitioner.npyio import FileRecord, load_npy, read_npy_header, sha256_file

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "TYPED_FORMAT_VERSION",
    "EdgeData",
    "EdgeFeatureInfo",
    "Manifest",
    "NodeData",
    "NodeTypeInfo",
    "Partition",
    "PartitionFormatError",
    "PartitionInfo",
    "Structure",
    "Verify",
    "check_files",
    "edge_data_bytes",
    "edge_data_records",
    "load_edge_data",
    "load_node_data",
    "load_node_map",
    "load_partition",
    "load_structure",
    "node_data_bytes",
    "node_data_records",
    "read_format_version",
    "read_manifest",
    "role",
    "structure_bytes",
    "structure_records",
]

log = logging.getLogger(__name__)

Verify = Literal["full", "size"]


@dataclass(frozen=True)
class Structure:
    """In-edges (CSC per edge type) of one contiguous range of global IDs per node type:
    the nodes a sampler can draw from without asking another server. A partition's own
    ranges (:attr:`Partition.structure`), or every node of the graph
    (:func:`load_structure`)."""

    #: Edge type to int64 ``[n_dst+1]`` CSC offsets over its destination type's range.
    indptr: dict[EdgeType, np.ndarray]
    #: Edge type to int64 ``[e]`` global source IDs (of the source type) of the in-edges.
    indices: dict[EdgeType, np.ndarray]
    #: Node type to int64 ``[n_t]`` original IDs of its range (draws are keyed by them).
    orig_ids: dict[str, np.ndarray]
    #: Node type to the global ID of the first node of its range.
    node_start: dict[str, int]
    #: Edge type to float32 ``[e]`` edge weights aligned with ``indices`` (weighted types only).
    edge_weight: dict[EdgeType, np.ndarray] = field(default_factory=dict)
    #: Edge type to the internal edge ID of its first in-edge held here (the position in
    #: ``indices`` plus this is the edge's internal ID, :meth:`Manifest.edge_book`); 0 if absent.
    edge_start: dict[EdgeType, int] = field(default_factory=dict)

    def node_range(self, node_type: str) -> tuple[int, int]:
        """``[start, stop)`` of the global IDs of ``node_type`` whose in-edges this holds."""
        start = self.node_start[node_type]
        return start, start + int(self.orig_ids[node_type].shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (memory maps included)."""
        arrays = [*self.indptr.values(), *self.indices.values(), *self.orig_ids.values(),
                  *self.edge_weight.values()]
        return sum(int(a.nbytes) for a in arrays)


@dataclass(frozen=True)
class NodeData:
    """Features and labels of one contiguous range of global IDs per node type: the rows
    a server gathers without asking another. A partition's own (:attr:`Partition.node_data`),
    or every node's (:func:`load_node_data`)."""

    #: Node type to ``[n_t, F_t]`` features of its range (types with features only).
    x: dict[str, np.ndarray]
    #: int64 ``[n_target]`` labels of the target type's range, ``-1`` = unlabeled.
    y: np.ndarray
    #: Node type to the global ID of the first node of its range.
    node_start: dict[str, int]
    #: Node type to the number of nodes of its range.
    num_nodes: dict[str, int]
    #: The labelled node type.
    target_type: str

    def node_range(self, node_type: str) -> tuple[int, int]:
        """``[start, stop)`` of the global IDs of ``node_type`` whose rows this holds."""
        start = self.node_start[node_type]
        return start, start + self.num_nodes[node_type]

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (memory maps included)."""
        return sum(int(a.nbytes) for a in self.x.values()) + int(self.y.nbytes)


@dataclass(frozen=True)
class EdgeData:
    """Original edge IDs and edge features of one contiguous range of internal edge IDs
    per edge type (:meth:`Manifest.edge_book`): the edge rows a server gathers without
    asking another. A partition's own (:attr:`Partition.edge_data`), or every edge's
    (:func:`load_edge_data`)."""

    #: Edge type to int64 ``[e]`` original edge IDs (the edge's column in the input's
    #: ``edge_index`` of its type), in internal-ID order.
    e_id: dict[EdgeType, np.ndarray]
    #: Edge type to ``[e, *F_e]`` edge features in internal-ID order (types with them only).
    edge_attr: dict[EdgeType, np.ndarray]
    #: Edge type to the internal ID of the range's first edge.
    edge_start: dict[EdgeType, int]

    def edge_range(self, edge_type: EdgeType) -> tuple[int, int]:
        """``[start, stop)`` of the internal edge IDs of ``edge_type`` held here."""
        start = self.edge_start[edge_type]
        return start, start + int(self.e_id[edge_type].shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (memory maps included)."""
        return sum(int(a.nbytes) for a in [*self.e_id.values(), *self.edge_attr.values()])


@dataclass
class Partition:
    """One loaded partition of a graph (see the module doc)."""

    #: The whole manifest (graph facts, partition books, every partition's sizes).
    manifest: Manifest
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
    #: Edge type to float32 ``[e_pr]`` edge weights aligned with ``indices`` (weighted types).
    edge_weight: dict[EdgeType, np.ndarray] = field(default_factory=dict)
    #: Edge type to int64 ``[e_pr]`` original edge IDs aligned with ``indices`` (empty for
    #: partitions written without them).
    e_id: dict[EdgeType, np.ndarray] = field(default_factory=dict)
    #: Edge type to ``[e_pr, *F_e]`` edge features aligned with ``indices`` (types with them).
    edge_attr: dict[EdgeType, np.ndarray] = field(default_factory=dict)

    @property
    def target_type(self) -> str:
        return self.manifest.target_type

    @property
    def node_types(self) -> tuple[str, ...]:
        return tuple(self.manifest.node_types)

    @property
    def edge_types(self) -> tuple[EdgeType, ...]:
        return tuple(self.manifest.edge_types)

    def node_range(self, node_type: str) -> tuple[int, int]:
        """``[start, stop)`` of the global IDs of ``node_type`` this partition owns."""
        book, p = self.partition_book[node_type], self.partition_id
        return int(book[p]), int(book[p + 1])

    def num_nodes(self, node_type: str) -> int:
        start, stop = self.node_range(node_type)
        return stop - start

    def num_edges(self, edge_type: EdgeType) -> int:
        return int(self.indices[edge_type].shape[0])

    @property
    def structure(self) -> Structure:
        """The in-edges of the owned nodes, as a :class:`Structure`."""
        return Structure(indptr=self.indptr, indices=self.indices, orig_ids=self.orig_ids,
                         node_start={t: self.node_range(t)[0] for t in self.node_types},
                         edge_weight=self.edge_weight, edge_start=self.edge_start)

    @property
    def edge_start(self) -> dict[EdgeType, int]:
        """Edge type to the internal ID of this partition's first in-edge of it."""
        return {et: self.manifest.edge_book(et)[self.partition_id] for et in self.edge_types}

    @property
    def edge_data(self) -> EdgeData:
        """The original IDs and features of this partition's in-edges, as an :class:`EdgeData`."""
        return EdgeData(e_id=self.e_id, edge_attr=self.edge_attr, edge_start=self.edge_start)

    @property
    def node_data(self) -> NodeData:
        """The features and labels of the owned nodes, as a :class:`NodeData`."""
        return NodeData(x=self.x, y=self.y, node_start={t: self.node_range(t)[0] for t in self.node_types},
                        num_nodes={t: self.num_nodes(t) for t in self.node_types},
                        target_type=self.target_type)


# -- files ------------------------------------------------------------------------------
def _check_file(root: Path, rec: FileRecord, verify: Verify) -> None:
    path = root / rec.path
    if not path.is_file():
        raise PartitionFormatError(f"{path}: missing (the manifest lists it)")
    size = path.stat().st_size
    if size != rec.size_bytes:
        kind = "truncated" if size < rec.size_bytes else "larger than recorded"
        raise PartitionFormatError(f"{path}: {kind}: expected {rec.size_bytes} bytes, got {size}")
    try:
        dtype, shape, fortran, _ = read_npy_header(path)
    except ValueError as exc:
        raise PartitionFormatError(f"{path}: not a valid .npy file ({exc})") from exc
    if dtype.hasobject:
        raise PartitionFormatError(f"{path}: object arrays are refused (no pickle)")
    if fortran or dtype.name != rec.dtype or tuple(shape) != rec.shape:
        raise PartitionFormatError(
            f"{path}: expected {rec.dtype} of shape {list(rec.shape)} (C order), "
            f"got {dtype.name} of shape {list(shape)}{' (Fortran order)' if fortran else ''}")
    if verify == "full":
        digest = sha256_file(path)
        if digest != rec.sha256:
            raise PartitionFormatError(
                f"{path}: SHA-256 mismatch: expected {rec.sha256[:16]}…, got {digest[:16]}… "
                "(the file is corrupted or was replaced)")


def check_files(root: str | Path, records: list[FileRecord], verify: Verify = "full") -> None:
    """Check that every recorded file exists and matches its size, header and checksum."""
    base = Path(root)
    with ThreadPoolExecutor(max_workers=2) as pool:
        for fut in [pool.submit(_check_file, base, r, verify) for r in records]:
            fut.result()


def _fail(base: Path, rel: str, what: str) -> PartitionFormatError:
    return PartitionFormatError(f"{base / rel}: {what}")


def _record(base: Path, m: Manifest, info: PartitionInfo, kind: str, t: str | EdgeType) -> FileRecord:
    """The record of ``kind`` of type ``t`` in partition ``info``; refused by name when absent."""
    name = m.role(kind, t)
    rec = info.files.get(name)
    if rec is None:
        raise PartitionFormatError(f"{base / MANIFEST_FILE}: partitions[{info.id}].files: expected "
                                   f"a record for {name!r}, found none")
    return rec


# -- one partition ----------------------------------------------------------------------
def load_partition(root: str | Path, partition_id: int, *, mmap: bool = True,
                   verify: Verify = "full") -> Partition:
    """Load and validate partition ``partition_id`` of the partition directory ``root``.

    ``verify='full'`` also checks every file's SHA-256; ``'size'`` checks sizes and
    headers only (faster for very large partitions). Raises :class:`PartitionFormatError`
    naming the offending file.
    """
    base = Path(root)
    m = read_manifest(base)
    if not 0 <= partition_id < m.num_partitions:
        raise PartitionFormatError(f"partition: expected an ID in [0, {m.num_partitions}), "
                                   f"got {partition_id}")
    info = m.partitions[partition_id]
    books = {t: m.files[m.shared_role("partition_book", t)] for t in m.node_types}
    check_files(base, [*books.values(), *info.files.values()], verify)

    def load(kind: str, t: str | EdgeType) -> np.ndarray:
        return load_npy(base / _record(base, m, info, kind, t).path, mmap)

    def present(kind: str, t: str | EdgeType) -> bool:
        return m.role(kind, t) in info.files

    target = m.target_type
    part = Partition(
        manifest=m, partition_id=partition_id,
        partition_book={t: load_npy(base / r.path, mmap=False) for t, r in books.items()},
        indptr={et: load("indptr", et) for et in m.edge_types},
        indices={et: load("indices", et) for et in m.edge_types},
        edge_weight={et: load("edge_weight", et) for et in m.edge_types if present("edge_weight", et)},
        e_id={et: load("e_id", et) for et in m.edge_types if et in m.edge_ids},
        edge_attr={et: load("edge_attr", et) for et in m.edge_features},
        x={t: load("x", t) for t in m.node_types if present("x", t)},
        orig_ids={t: load("orig_ids", t) for t in m.node_types},
        y=load("y", target),
        splits={s: load(f"{s}_idx", target) for s in SPLITS if present(f"{s}_idx", target)})
    _check_partition(base, part)
    log.info("loaded partition %d of %s: nodes %s, edges %s", partition_id, base,
             _by_type(m, {t: part.num_nodes(t) for t in m.node_types}),
             _by_type(m, {et: part.num_edges(et) for et in m.edge_types}))
    return part


def _by_type(m: Manifest, counts: dict[str, int] | dict[EdgeType, int]) -> object:
    """Counts per type for a log line: the number alone for a plain graph."""
    return counts if m.typed else next(iter(counts.values()))


def _check_partition(base: Path, part: Partition) -> None:
    """Structural checks beyond the manifest: books, CSC offsets, ID ranges, shapes."""
    m, p = part.manifest, part.partition_id
    info = m.partitions[p]
    for t, book in part.partition_book.items():
        if book.tolist() != list(m.partition_book[t]):
            raise _fail(base, m.files[m.shared_role("partition_book", t)].path,
                        "does not match the manifest's partition_book")
    for et in m.edge_types:
        _check_csc(base, m, info, et, part.indptr[et], part.indices[et], part.num_nodes(et[2]))
        weight = part.edge_weight.get(et)
        if weight is not None and weight.shape != part.indices[et].shape:
            raise _fail(base, _record(base, m, info, "edge_weight", et).path,
                        f"expected shape [{part.num_edges(et)}] (one per in-edge), got {list(weight.shape)}")
        _check_edge_data(base, m, info, et, part.e_id.get(et), part.edge_attr.get(et))
    for t in m.node_types:
        _check_rows(base, m, info, t, {"orig_ids": part.orig_ids[t], "x": part.x.get(t),
                                       **({"y": part.y} if t == m.target_type else {})},
                    part.num_nodes(t))
    start, stop = part.node_range(m.target_type)
    for split, ids in part.splits.items():
        if ids.size and (int(ids.min()) < start or int(ids.max()) >= stop):
            what = "global IDs" if not m.typed else f"global {m.target_type!r} IDs"
            raise _fail(base, _record(base, m, info, f"{split}_idx", m.target_type).path,
                        f"expected {what} in [{start}, {stop}) owned by partition {p}")


def _check_csc(base: Path, m: Manifest, info: PartitionInfo, et: EdgeType, indptr: np.ndarray,
               indices: np.ndarray, num_dst: int) -> None:
    """One partition's CSC of ``et``: ``num_dst + 1`` offsets from 0 to its edge count,
    never decreasing; source IDs of the source type in range."""
    path = _record(base, m, info, "indptr", et).path
    e = int(indices.shape[0])
    if indptr.shape != (num_dst + 1,):
        owned = f"owned {et[2]!r} nodes" if m.typed else "owned nodes"
        raise _fail(base, path, f"expected shape [{num_dst + 1}] ({owned} + 1), got {list(indptr.shape)}")
    if int(indptr[0]) != 0 or int(indptr[-1]) != e:
        raise _fail(base, path, f"expected offsets from 0 to {e}, got {int(indptr[0])} to {int(indptr[-1])}")
    if num_dst and bool((np.diff(indptr) < 0).any()):
        raise _fail(base, path, "offsets decrease")
    n_src = m.node_types[et[0]].num_nodes
    if e:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= n_src:
            what = f"{et[0]!r} source IDs" if m.typed else "source IDs"
            raise _fail(base, _record(base, m, info, "indices", et).path,
                        f"expected {what} in [0, {n_src}), got [{lo}, {hi}]")


def _check_edge_data(base: Path, m: Manifest, info: PartitionInfo, et: EdgeType, e_id: np.ndarray | None,
                     edge_attr: np.ndarray | None) -> None:
    """A partition's edge IDs and features of ``et``, as the manifest describes them: one
    int64 ID in ``[0, E_et)`` and one row of the recorded shape and dtype per in-edge."""
    e = info.num_edges[et]
    if e_id is not None:
        path = _record(base, m, info, "e_id", et).path
        if e_id.shape != (e,) or e_id.dtype != np.int64:
            raise _fail(base, path, f"expected int64 of shape [{e}] (one per in-edge), got "
                        f"{e_id.dtype} of shape {list(e_id.shape)}")
        total = m.edge_id_bound(et)
        if e and (int(e_id.min()) < 0 or int(e_id.max()) >= total):
            raise _fail(base, path, f"expected edge IDs in [0, {total}), got [{int(e_id.min())}, "
                        f"{int(e_id.max())}]")
    feats = m.edge_features.get(et)
    if edge_attr is not None and feats is not None:
        want = (e, *feats.shape)
        if edge_attr.shape != want or edge_attr.dtype.name != feats.dtype:
            raise _fail(base, _record(base, m, info, "edge_attr", et).path,
                        f"expected {feats.dtype} of shape {list(want)} (one row per in-edge, as the "
                        f"manifest's edge_feature_shape and dtype), got {edge_attr.dtype} of shape "
                        f"{list(edge_attr.shape)}")


def _check_rows(base: Path, m: Manifest, info: PartitionInfo, t: str,
                arrays: dict[str, np.ndarray | None], num_nodes: int) -> None:
    """A partition's per-node arrays of type ``t``, by kind: ``x`` holds ``num_nodes``
    rows of the type's features (and exists exactly when the type has features), the
    others one entry per node."""
    dim = m.node_types[t].feature_dim
    for kind, arr in arrays.items():
        if kind == "x":
            if (arr is None) != (dim == 0) or (arr is not None and arr.shape != (num_nodes, dim)):
                rec = info.files.get(m.role("x", t))
                raise _fail(base, rec.path if rec else f"part-{info.id}/{t}/x.npy",
                            f"expected {num_nodes} rows of {dim} features, got "
                            f"{None if arr is None else list(arr.shape)}")
        elif arr is not None and arr.shape != (num_nodes,):
            raise _fail(base, _record(base, m, info, kind, t).path,
                        f"expected shape [{num_nodes}] (one per owned node), got {list(arr.shape)}")


# -- the whole graph ----------------------------------------------------------------------
#: The kinds of a partition's files that make up its :class:`Structure`, and its
#: :class:`NodeData`.
STRUCTURE_FILES = ("indptr", "indices", "orig_ids", "edge_weight")
NODE_DATA_FILES = ("x", "y")
#: The kinds of a partition's files that make up its :class:`EdgeData`.
EDGE_DATA_FILES = ("e_id", "edge_attr")


def _records_of(m: Manifest, kinds: tuple[str, ...]) -> list[FileRecord]:
    return [r for info in m.partitions for k, r in info.files.items() if k.rpartition("/")[2] in kinds]


def structure_records(manifest: Manifest, weights: bool = True) -> list[FileRecord]:
    """Every partition's structure files (:data:`STRUCTURE_FILES`), in partition order."""
    kinds = STRUCTURE_FILES if weights else STRUCTURE_FILES[:3]
    return _records_of(manifest, kinds)


def node_data_records(manifest: Manifest) -> list[FileRecord]:
    """Every partition's feature and label files (:data:`NODE_DATA_FILES`), in partition order."""
    return _records_of(manifest, NODE_DATA_FILES)


def edge_data_records(manifest: Manifest) -> list[FileRecord]:
    """Every partition's edge ID and edge feature files (:data:`EDGE_DATA_FILES`), in
    partition order (none for a graph written before edge IDs existed)."""
    return _records_of(manifest, EDGE_DATA_FILES)


def structure_bytes(manifest: Manifest) -> int:
    """Bytes of the whole graph's joined structure (:func:`load_structure`): offsets and
    original IDs (8 bytes a node), sources (8 bytes an edge) and weights (4 bytes an edge
    of a weighted type)."""
    nodes = sum(manifest.node_types[et[2]].num_nodes + 1 for et in manifest.edge_types)
    ids = sum(i.num_nodes for i in manifest.node_types.values())
    edges = sum(manifest.edge_types.values())
    weights = sum(n for et, n in manifest.edge_types.items() if et in manifest.weighted)
    return 8 * (nodes + ids + edges) + 4 * weights


def node_data_bytes(manifest: Manifest) -> int:
    """Bytes of the whole graph's joined features and labels (:func:`load_node_data`)."""
    rows = sum(i.num_nodes * i.feature_dim * np.dtype(i.feature_dtype).itemsize
               for i in manifest.node_types.values() if i.feature_dim)
    return rows + 8 * manifest.target.num_nodes


def edge_data_bytes(manifest: Manifest) -> int:
    """Bytes of the whole graph's joined edge IDs (8 bytes an edge) and edge features
    (:func:`load_edge_data`)."""
    ids = sum(n for et, n in manifest.edge_types.items() if et in manifest.edge_ids)
    feats = sum(manifest.edge_types[et] * i.dim * np.dtype(i.dtype).itemsize
                for et, i in manifest.edge_features.items())
    return 8 * ids + feats


def _joined(base: Path, m: Manifest, kind: str, t: str | EdgeType, sizes: list[int],
            shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Every partition's file ``kind`` of ``t``, ``sizes[p]`` rows each, concatenated in
    partition order into a new read-only array of ``shape[1:]``-wide rows."""
    out = np.empty((sum(sizes), *shape), dtype=dtype)
    row = 0
    for info, n in zip(m.partitions, sizes, strict=True):
        rec = _record(base, m, info, kind, t)
        part = load_npy(base / rec.path)
        if part.shape != (n, *shape):
            raise _fail(base, rec.path, f"expected shape {[n, *shape]} (the manifest's partition "
                        f"{info.id}), got {list(part.shape)}")
        if part.dtype != dtype:
            raise _fail(base, rec.path, f"expected {np.dtype(dtype).name} (the manifest's), got "
                        f"{part.dtype.name}")
        out[row:row + n] = part
        row += n
    out.flags.writeable = False
    return out


def load_structure(root: str | Path, *, verify: Verify = "full", weights: bool = True) -> Structure:
    """The in-edges of every node of the graph in ``root``: each partition's structure
    files (:data:`STRUCTURE_FILES`; edge weights only with ``weights``) checked as
    :func:`load_partition` checks them and joined in partition order, in memory
    (:func:`structure_bytes`). Every partition's files must be present under ``root``; a
    missing or mismatching one raises :class:`PartitionFormatError` naming it."""
    base = Path(root)
    m = read_manifest(base)
    check_files(base, structure_records(m, weights), verify)
    indptr: dict[EdgeType, np.ndarray] = {}
    indices: dict[EdgeType, np.ndarray] = {}
    edge_weight: dict[EdgeType, np.ndarray] = {}
    for et, total in m.edge_types.items():
        offsets = np.empty(m.node_types[et[2]].num_nodes + 1, dtype=np.int64)
        offsets[0] = 0
        node = edge = 0
        for info in m.partitions:
            n, e = info.num_nodes[et[2]], info.num_edges[et]
            part_ptr = load_npy(base / _record(base, m, info, "indptr", et).path)
            part_src = load_npy(base / _record(base, m, info, "indices", et).path)
            _check_csc(base, m, info, et, part_ptr, part_src, n)
            if part_src.shape != (e,):
                raise _fail(base, _record(base, m, info, "indices", et).path,
                            f"expected {e} edges (the manifest's partition {info.id}), got "
                            f"{list(part_src.shape)}")
            np.add(part_ptr[1:], edge, out=offsets[node + 1:node + n + 1])
            node, edge = node + n, edge + e
        if edge != total:
            raise _fail(base, MANIFEST_FILE, f"expected {total} edges in all, its partitions hold {edge}")
        offsets.flags.writeable = False
        indptr[et] = offsets
        sizes = [info.num_edges[et] for info in m.partitions]
        indices[et] = _joined(base, m, "indices", et, sizes, (), np.dtype(np.int64))
        if weights and et in m.weighted:
            edge_weight[et] = _joined(base, m, "edge_weight", et, sizes, (), np.dtype(np.float32))
    orig_ids = {t: _joined(base, m, "orig_ids", t, [p.num_nodes[t] for p in m.partitions], (),
                           np.dtype(np.int64)) for t in m.node_types}
    out = Structure(indptr=indptr, indices=indices, orig_ids=orig_ids,
                    node_start=dict.fromkeys(m.node_types, 0), edge_weight=edge_weight)
    log.info("loaded the structure of all %d partitions of %s: %d nodes, %d edges, %.1f MiB",
             m.num_partitions, base, m.num_nodes, m.num_edges, out.nbytes / 2**20)
    return out


def load_node_data(root: str | Path, *, verify: Verify = "full") -> NodeData:
    """The features and labels of every node of the graph in ``root``: each partition's
    ``x`` and ``y`` (:data:`NODE_DATA_FILES`) checked as :func:`load_partition` checks
    them and joined in partition order, in memory (:func:`node_data_bytes`). Every
    partition's files must be present under ``root``; a missing or mismatching one raises
    :class:`PartitionFormatError` naming it."""
    base = Path(root)
    m = read_manifest(base)
    check_files(base, node_data_records(m), verify)
    x = {t: _joined(base, m, "x", t, [p.num_nodes[t] for p in m.partitions], (i.feature_dim,),
                    np.dtype(i.feature_dtype))
         for t, i in m.node_types.items() if i.feature_dim}
    target = m.target_type
    y = _joined(base, m, "y", target, [p.num_nodes[target] for p in m.partitions], (), np.dtype(np.int64))
    out = NodeData(x=x, y=y, node_start=dict.fromkeys(m.node_types, 0),
                   num_nodes={t: i.num_nodes for t, i in m.node_types.items()}, target_type=target)
    log.info("loaded the features and labels of all %d partitions of %s: %d nodes, %.1f MiB",
             m.num_partitions, base, m.num_nodes, out.nbytes / 2**20)
    return out


def load_edge_data(root: str | Path, *, verify: Verify = "full") -> EdgeData:
    """The original IDs and features of every edge of the graph in ``root``, by internal
    edge ID (:meth:`Manifest.edge_book`; ``edge_start`` 0): each partition's ``e_id`` and
    ``edge_attr`` (:data:`EDGE_DATA_FILES`) checked as :func:`load_partition` checks them
    and joined in partition order, in memory (:func:`edge_data_bytes`). Edge types
    without them are absent (every type of a graph written before edge IDs existed).
    Every partition's files must be present under ``root``; a missing or mismatching one
    raises :class:`PartitionFormatError` naming it."""
    base = Path(root)
    m = read_manifest(base)
    check_files(base, edge_data_records(m), verify)
    e_id: dict[EdgeType, np.ndarray] = {}
    edge_attr: dict[EdgeType, np.ndarray] = {}
    for et in m.edge_types:
        sizes = [info.num_edges[et] for info in m.partitions]
        if et in m.edge_ids:
            e_id[et] = _joined(base, m, "e_id", et, sizes, (), np.dtype(np.int64))
            book = m.edge_book(et)
            for info in m.partitions:
                _check_edge_data(base, m, info, et, e_id[et][book[info.id]:book[info.id + 1]], None)
        feats = m.edge_features.get(et)
        if feats is not None:
            edge_attr[et] = _joined(base, m, "edge_attr", et, sizes, feats.shape, np.dtype(feats.dtype))
    out = EdgeData(e_id=e_id, edge_attr=edge_attr, edge_start=dict.fromkeys(m.edge_types, 0))
    log.info("loaded the edge IDs and features of all %d partitions of %s: %d edges, %.1f MiB",
             m.num_partitions, base, m.num_edges, out.nbytes / 2**20)
    return out


def load_node_map(root: str | Path, node_type: str | None = None, *, verify: Verify = "full") -> np.ndarray:
    """The int64 ``[N_t]`` map from original IDs of ``node_type`` (default: the target
    type, a plain graph's one type) to its global IDs."""
    m = read_manifest(root)
    t = node_type or m.target_type
    rec = m.files.get(m.shared_role("node_map", t) if t in m.node_types else "")
    if rec is None:
        raise PartitionFormatError(f"node_type: expected one of {list(m.node_types)}, got {node_type!r}")
    check_files(root, [rec], verify)
    return load_npy(Path(root) / rec.path, mmap=True)
