"""The whole graph on one server: every partition's in-edges, features and labels, or
edge IDs and edge features, checked as :func:`~partitioner.format.load_partition` checks
them and joined in partition order, in memory; and their files and bytes."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from partitioner.format import Verify, bad_file, check_csc, check_edge_data, check_files, file_record
from partitioner.graph import EdgeType
from partitioner.manifest import MANIFEST_FILE, Manifest, read_manifest
from partitioner.npyio import FileRecord, load_npy
from partitioner.partition import EdgeData, NodeData, Structure

log = logging.getLogger(__name__)

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
        rec = file_record(base, m, info, kind, t)
        part = load_npy(base / rec.path)
        if part.shape != (n, *shape):
            raise bad_file(base, rec.path, f"expected shape {[n, *shape]} (the manifest's partition "
                        f"{info.id}), got {list(part.shape)}")
        if part.dtype != dtype:
            raise bad_file(base, rec.path, f"expected {np.dtype(dtype).name} (the manifest's), got "
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
            part_ptr = load_npy(base / file_record(base, m, info, "indptr", et).path)
            part_src = load_npy(base / file_record(base, m, info, "indices", et).path)
            check_csc(base, m, info, et, part_ptr, part_src, n)
            if part_src.shape != (e,):
                raise bad_file(base, file_record(base, m, info, "indices", et).path,
                            f"expected {e} edges (the manifest's partition {info.id}), got "
                            f"{list(part_src.shape)}")
            np.add(part_ptr[1:], edge, out=offsets[node + 1:node + n + 1])
            node, edge = node + n, edge + e
        if edge != total:
            raise bad_file(base, MANIFEST_FILE, f"expected {total} edges in all, its partitions hold {edge}")
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
                check_edge_data(base, m, info, et, e_id[et][book[info.id]:book[info.id + 1]], None)
        feats = m.edge_features.get(et)
        if feats is not None:
            edge_attr[et] = _joined(base, m, "edge_attr", et, sizes, feats.shape, np.dtype(feats.dtype))
    out = EdgeData(e_id=e_id, edge_attr=edge_attr, edge_start=dict.fromkeys(m.edge_types, 0))
    log.info("loaded the edge IDs and features of all %d partitions of %s: %d edges, %.1f MiB",
             m.num_partitions, base, m.num_edges, out.nbytes / 2**20)
    return out
