"""The validating reader of partitioned graphs (formats v1 and v2, one model).

:func:`load_partition` loads one partition as a :class:`~partitioner.partition.Partition`:
per edge type the CSC in-edges of the owned destination nodes, per node type the owned
nodes' original IDs and features, the target type's labels and split shares. A plain
graph (format v1) loads as the typed graph of one node type and one edge type. It refuses
files that do not match the manifest (:mod:`partitioner.manifest`), naming the file; the
checks of one partition's files (:func:`check_files`, :func:`check_csc`,
:func:`check_edge_data`) are also those of the whole-graph joins (:mod:`partitioner.joins`).
Arrays are read-only memory maps unless loaded with ``mmap=False``.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import numpy as np

from partitioner.graph import SPLITS, EdgeType
from partitioner.manifest import MANIFEST_FILE, Manifest, PartitionFormatError, PartitionInfo, read_manifest
from partitioner.npyio import FileRecord, load_npy, read_npy_header, sha256_file
from partitioner.partition import Partition

log = logging.getLogger(__name__)

Verify = Literal["full", "size"]


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


def bad_file(base: Path, rel: str, what: str) -> PartitionFormatError:
    """The refusal of the file ``rel`` under ``base``, saying ``what`` is wrong."""
    return PartitionFormatError(f"{base / rel}: {what}")


def file_record(base: Path, m: Manifest, info: PartitionInfo, kind: str, t: str | EdgeType) -> FileRecord:
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

    ``verify='full'`` also checks every file's SHA-256 and the range of the edge IDs;
    ``'size'`` checks sizes, headers and the structure only (faster for very large
    partitions: the edge IDs, read only for batches that ask for them, are not read at
    start-up). Raises :class:`PartitionFormatError` naming the offending file.
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
        return load_npy(base / file_record(base, m, info, kind, t).path, mmap)

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
    _check_partition(base, part, edge_id_ranges=verify == "full")
    log.info("loaded partition %d of %s: nodes %s, edges %s", partition_id, base,
             _by_type(m, {t: part.num_nodes(t) for t in m.node_types}),
             _by_type(m, {et: part.num_edges(et) for et in m.edge_types}))
    return part


def _by_type(m: Manifest, counts: dict[str, int] | dict[EdgeType, int]) -> object:
    """Counts per type for a log line: the number alone for a plain graph."""
    return counts if m.typed else next(iter(counts.values()))


def _check_partition(base: Path, part: Partition, edge_id_ranges: bool) -> None:
    """Structural checks beyond the manifest: books, CSC offsets, ID ranges (of the edge
    IDs too with ``edge_id_ranges``), shapes."""
    m, p = part.manifest, part.partition_id
    info = m.partitions[p]
    for t, book in part.partition_book.items():
        if book.tolist() != list(m.partition_book[t]):
            raise bad_file(base, m.files[m.shared_role("partition_book", t)].path,
                        "does not match the manifest's partition_book")
    for et in m.edge_types:
        check_csc(base, m, info, et, part.indptr[et], part.indices[et], part.num_nodes(et[2]))
        weight = part.edge_weight.get(et)
        if weight is not None and weight.shape != part.indices[et].shape:
            raise bad_file(base, file_record(base, m, info, "edge_weight", et).path,
                        f"expected shape [{part.num_edges(et)}] (one per in-edge), got {list(weight.shape)}")
        check_edge_data(base, m, info, et, part.e_id.get(et), part.edge_attr.get(et), ranges=edge_id_ranges)
    for t in m.node_types:
        _check_rows(base, m, info, t, {"orig_ids": part.orig_ids[t], "x": part.x.get(t),
                                       **({"y": part.y} if t == m.target_type else {})},
                    part.num_nodes(t))
    start, stop = part.node_range(m.target_type)
    for split, ids in part.splits.items():
        if ids.size and (int(ids.min()) < start or int(ids.max()) >= stop):
            what = "global IDs" if not m.typed else f"global {m.target_type!r} IDs"
            raise bad_file(base, file_record(base, m, info, f"{split}_idx", m.target_type).path,
                        f"expected {what} in [{start}, {stop}) owned by partition {p}")


def check_csc(base: Path, m: Manifest, info: PartitionInfo, et: EdgeType, indptr: np.ndarray,
               indices: np.ndarray, num_dst: int) -> None:
    """One partition's CSC of ``et``: ``num_dst + 1`` offsets from 0 to its edge count,
    never decreasing; source IDs of the source type in range."""
    path = file_record(base, m, info, "indptr", et).path
    e = int(indices.shape[0])
    if indptr.shape != (num_dst + 1,):
        owned = f"owned {et[2]!r} nodes" if m.typed else "owned nodes"
        raise bad_file(base, path, f"expected shape [{num_dst + 1}] ({owned} + 1), got {list(indptr.shape)}")
    if int(indptr[0]) != 0 or int(indptr[-1]) != e:
        raise bad_file(base, path, f"expected offsets from 0 to {e}, got {int(indptr[0])} to "
                       f"{int(indptr[-1])}")
    if num_dst and bool((np.diff(indptr) < 0).any()):
        raise bad_file(base, path, "offsets decrease")
    n_src = m.node_types[et[0]].num_nodes
    if e:
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= n_src:
            what = f"{et[0]!r} source IDs" if m.typed else "source IDs"
            raise bad_file(base, file_record(base, m, info, "indices", et).path,
                        f"expected {what} in [0, {n_src}), got [{lo}, {hi}]")


def check_edge_data(base: Path, m: Manifest, info: PartitionInfo, et: EdgeType, e_id: np.ndarray | None,
                    edge_attr: np.ndarray | None, ranges: bool = True) -> None:
    """A partition's edge IDs and features of ``et``, as the manifest describes them: one
    int64 ID (in ``[0, E_et)``, read with ``ranges``) and one row of the recorded shape
    and dtype per in-edge."""
    e = info.num_edges[et]
    if e_id is not None:
        path = file_record(base, m, info, "e_id", et).path
        if e_id.shape != (e,) or e_id.dtype != np.int64:
            raise bad_file(base, path, f"expected int64 of shape [{e}] (one per in-edge), got "
                        f"{e_id.dtype} of shape {list(e_id.shape)}")
        total = m.edge_id_bound(et)
        if ranges and e and (int(e_id.min()) < 0 or int(e_id.max()) >= total):
            raise bad_file(base, path, f"expected edge IDs in [0, {total}), got [{int(e_id.min())}, "
                        f"{int(e_id.max())}]")
    feats = m.edge_features.get(et)
    if edge_attr is not None and feats is not None:
        want = (e, *feats.shape)
        if edge_attr.shape != want or edge_attr.dtype.name != feats.dtype:
            raise bad_file(base, file_record(base, m, info, "edge_attr", et).path,
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
                raise bad_file(base, rec.path if rec else f"part-{info.id}/{t}/x.npy",
                            f"expected {num_nodes} rows of {dim} features, got "
                            f"{None if arr is None else list(arr.shape)}")
        elif arr is not None and arr.shape != (num_nodes,):
            raise bad_file(base, file_record(base, m, info, kind, t).path,
                        f"expected shape [{num_nodes}] (one per owned node), got {list(arr.shape)}")


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
