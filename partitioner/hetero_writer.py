"""Partition a typed graph and write partition format v2.

Nodes are assigned on the homogeneous view (every node type in one ID space, METIS
balancing nodes, edges and the target type's training nodes), then relabelled per type
so that each partition owns one contiguous ID range of every type. Each relation's
edges are stored once, as CSC in-edges in the partition that owns the destination.
The relations are held in memory one at a time (ogbn-mag's largest has 7.5M edges).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from partitioner.algorithms import assign
from partitioner.hetero import EdgeType, HeteroGraphData, edge_type_name
from partitioner.hetero_format import (
    HETERO_FORMAT_VERSION,
    HeteroManifest,
    HeteroPartitionInfo,
    NodeTypeInfo,
)
from partitioner.npyio import FileRecord, save_npy
from partitioner.writer import _prepare_out_dir, _relabel, write_splits

log = logging.getLogger(__name__)


def partition_hetero_graph(
    graph: HeteroGraphData, num_parts: int, out_dir: str | Path, *, method: str = "metis",
    seed: int = 0, overwrite: bool = False, progress: bool = True,
    extra: dict[str, Any] | None = None,
) -> HeteroManifest:
    """Split ``graph`` into ``num_parts`` partitions with ``method`` (any of
    :data:`partitioner.algorithms.METHODS`, run on the homogeneous view) and write format
    v2 to ``out_dir``. ``extra`` is recorded in the manifest's ``algorithm``."""
    started = time.perf_counter()
    graph.validate()  # ID ranges too: a bad ID would otherwise fail deep in the writer
    view = graph.to_homogeneous()
    part_of = assign(view, num_parts, method, seed=seed, progress=progress)
    del view
    assign_seconds = time.perf_counter() - started
    offsets = graph.node_offsets()
    typed = {t: part_of[offsets[t]:offsets[t] + n] for t, n in graph.num_nodes.items()}
    algorithm = {"method": method, "num_parts": num_parts, "seed": seed,
                 "assign_seconds": round(assign_seconds, 3), **(extra or {})}
    return write_hetero_partitions(graph, typed, out_dir, num_parts=num_parts,
                                   algorithm=algorithm, overwrite=overwrite,
                                   progress=progress, started=started)


def write_hetero_partitions(
    graph: HeteroGraphData, part_of: dict[str, np.ndarray], out_dir: str | Path, *,
    num_parts: int, algorithm: dict[str, Any] | None = None, overwrite: bool = False,
    progress: bool = True, started: float | None = None,
) -> HeteroManifest:
    """Write ``graph`` split by ``part_of`` (node type to ``[N_t]`` partition IDs) as
    format v2 into ``out_dir`` and return the manifest (written last)."""
    started = time.perf_counter() if started is None else started
    out = _prepare_out_dir(Path(out_dir), overwrite)
    part_of = _check_assignment(graph, part_of, num_parts)
    books: dict[str, np.ndarray] = {}
    node_maps: dict[str, np.ndarray] = {}
    shared: dict[str, FileRecord] = {}
    for t, parts in part_of.items():
        book = np.zeros(num_parts + 1, dtype=np.int64)
        np.cumsum(np.bincount(parts, minlength=num_parts), out=book[1:])
        books[t], node_maps[t] = book, _relabel(parts, book)
        shared[f"partition_book/{t}"] = save_npy(out, f"partition_book/{t}.npy", book)
        shared[f"node_map/{t}"] = save_npy(out, f"node_map/{t}.npy", node_maps[t])
    files: list[dict[str, FileRecord]] = [{} for _ in range(num_parts)]
    edges = np.zeros((num_parts, len(graph.edge_types)), dtype=np.int64)
    remote = np.zeros_like(edges)
    for j, et in enumerate(tqdm(graph.edge_types, desc="relations", unit="rel",
                                disable=not progress)):
        _write_relation(graph, et, out, books, node_maps, files, edges[:, j], remote[:, j])
    for t in tqdm(graph.node_types, desc="node types", unit="type", disable=not progress):
        _write_node_type(graph, t, out, part_of[t], files)
    split_sizes = _write_target(graph, out, part_of[graph.target_type],
                                node_maps[graph.target_type], files)
    infos = tuple(
        HeteroPartitionInfo(
            id=p, num_nodes={t: int(b[p + 1] - b[p]) for t, b in books.items()},
            num_edges={et: int(edges[p, j]) for j, et in enumerate(graph.edge_types)},
            num_remote_edges={et: int(remote[p, j]) for j, et in enumerate(graph.edge_types)},
            split_sizes=split_sizes[p], files=files[p])
        for p in range(num_parts)
    )
    algo = dict(algorithm or {})
    algo["seconds"] = round(time.perf_counter() - started, 3)
    manifest = HeteroManifest(
        graph_name=graph.name,
        node_types={t: NodeTypeInfo(n, graph.feature_dim(t),
                                    np.dtype(graph.x[t].dtype).name if t in graph.x else "")
                    for t, n in graph.num_nodes.items()},
        edge_types={et: graph.num_edges(et) for et in graph.edge_types},
        target_type=graph.target_type, num_classes=graph.num_classes,
        partition_book={t: tuple(int(v) for v in b) for t, b in books.items()},
        partitions=infos, files=shared, algorithm=algo, format_version=HETERO_FORMAT_VERSION,
    )
    manifest.write(out)
    log.info("wrote %d typed partitions to %s in %.1f s", num_parts, out, algo["seconds"])
    _warn_without_training(manifest)
    return manifest


def _warn_without_training(manifest: HeteroManifest) -> None:
    idle = [p.id for p in manifest.partitions if p.split_sizes.get("train", 1) == 0]
    if idle:
        log.warning("partitions %s own no training %s nodes (method %r); metis, hash or "
                    "random spread every type", idle, manifest.target_type,
                    manifest.algorithm.get("method", "given"))


def _check_assignment(
    graph: HeteroGraphData, part_of: dict[str, np.ndarray], num_parts: int
) -> dict[str, np.ndarray]:
    if num_parts < 1:
        raise ValueError(f"num_parts: expected an integer >= 1, got {num_parts}")
    if set(part_of) != set(graph.num_nodes):
        raise ValueError(
            f"part_of: expected one array per node type {list(graph.num_nodes)}, "
            f"got {list(part_of)}")
    checked: dict[str, np.ndarray] = {}
    used = np.zeros(num_parts, dtype=np.int64)
    for t, n in graph.num_nodes.items():
        arr = np.asarray(part_of[t])
        if arr.shape != (n,) or arr.dtype.kind not in "iu":
            raise ValueError(f"part_of[{t!r}]: expected integers of shape [{n}], "
                             f"got {arr.dtype} of shape {list(arr.shape)}")
        arr = arr.astype(np.int32, copy=False)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= num_parts):
            raise ValueError(f"part_of[{t!r}]: expected partition IDs in [0, {num_parts}), "
                             f"got [{int(arr.min())}, {int(arr.max())}]")
        used += np.bincount(arr, minlength=num_parts)
        checked[t] = arr
    if bool((used == 0).any()):
        raise ValueError("part_of: every partition 0..P-1 must own at least one node")
    return checked


def _write_relation(
    graph: HeteroGraphData, et: EdgeType, out: Path, books: dict[str, np.ndarray],
    node_maps: dict[str, np.ndarray], files: list[dict[str, FileRecord]],
    edges: np.ndarray, remote: np.ndarray,
) -> None:
    """CSC in-edges of each partition's owned destination nodes for one relation; in-edges
    of a node keep their input order."""
    s, _, d = et
    ei = graph.edge_index[et]
    dst = node_maps[d][np.asarray(ei[1])]
    order = np.argsort(dst, kind="stable")
    dst = dst[order]
    src = node_maps[s][np.asarray(ei[0])[order]]
    del order
    name = edge_type_name(et)
    book_s, book_d = books[s], books[d]
    cuts = np.searchsorted(dst, book_d)
    for p in range(len(files)):
        lo, hi = int(cuts[p]), int(cuts[p + 1])
        n_dst = int(book_d[p + 1] - book_d[p])
        indptr = np.zeros(n_dst + 1, dtype=np.int64)
        np.cumsum(np.bincount(dst[lo:hi] - book_d[p], minlength=n_dst), out=indptr[1:])
        indices = src[lo:hi]
        own = (indices >= book_s[p]) & (indices < book_s[p + 1])
        edges[p], remote[p] = hi - lo, int(indices.size - np.count_nonzero(own))
        files[p][f"{name}/indptr"] = save_npy(out, f"part-{p}/{name}/indptr.npy", indptr)
        files[p][f"{name}/indices"] = save_npy(out, f"part-{p}/{name}/indices.npy", indices)


def _write_node_type(
    graph: HeteroGraphData, t: str, out: Path, part_of: np.ndarray,
    files: list[dict[str, FileRecord]],
) -> None:
    """Original IDs and features of each partition's nodes of type ``t``, in original
    order (so local ID ``i`` is global ID ``book[p] + i``)."""
    order = np.argsort(part_of, kind="stable")
    cuts = np.searchsorted(part_of[order], np.arange(len(files) + 1))
    feats = graph.x.get(t)
    for p in range(len(files)):
        ids = order[cuts[p]:cuts[p + 1]].astype(np.int64)
        files[p][f"{t}/orig_ids"] = save_npy(out, f"part-{p}/{t}/orig_ids.npy", ids)
        if feats is not None:
            files[p][f"{t}/x"] = save_npy(out, f"part-{p}/{t}/x.npy", feats[ids])


def _write_target(
    graph: HeteroGraphData, out: Path, part_of: np.ndarray, node_map: np.ndarray,
    files: list[dict[str, FileRecord]],
) -> list[dict[str, int]]:
    """Labels and split shares of the target type."""
    t = graph.target_type
    y = np.asarray(graph.y)
    for p in range(len(files)):
        files[p][f"{t}/y"] = save_npy(out, f"part-{p}/{t}/y.npy", y[part_of == p])
    return write_splits(graph.splits, out, part_of, node_map, files, prefix=f"{t}/")
