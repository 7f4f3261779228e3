"""Write partition format v1 from a node-to-partition assignment, out of core.

Every pass reads the source graph in chunks (``pread`` for memory-mapped sources), so
peak memory is O(N) for the maps plus one partition's in-edges, never the whole graph.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numba
import numpy as np
from tqdm import tqdm

from partitioner.format import FORMAT_VERSION, Manifest, PartitionInfo
from partitioner.graph import SPLITS, GraphData
from partitioner.npyio import (
    FileRecord,
    NpyWriter,
    iter_edge_chunks,
    iter_row_chunks,
    read_flat,
    save_npy,
)

log = logging.getLogger(__name__)

#: Edges per chunk in the streaming passes (16M edges = 256 MiB of int64 pairs).
DEFAULT_EDGE_CHUNK = 1 << 24
#: Node rows per chunk when splitting features and labels.
DEFAULT_ROW_CHUNK = 1 << 18


@numba.njit(cache=True)
def _relabel(part_of: np.ndarray, book: np.ndarray) -> np.ndarray:
    """Original ID -> global ID: partition p's nodes, in original order, from book[p]."""
    cursor = book[:-1].copy()
    node_map = np.empty(part_of.size, dtype=np.int64)
    for v in range(part_of.size):
        p = part_of[v]
        node_map[v] = cursor[p]
        cursor[p] += 1
    return node_map


@numba.njit(cache=True)
def _count_in_edges(
    src: np.ndarray, dst: np.ndarray, node_map: np.ndarray, part_of: np.ndarray,
    in_degree: np.ndarray, remote: np.ndarray,
) -> None:
    """Add a chunk's edges to the in-degree of each global target, and count, per
    target partition, the edges whose source lies in another partition."""
    for i in range(src.size):
        d = dst[i]
        in_degree[node_map[d]] += 1
        if part_of[src[i]] != part_of[d]:
            remote[part_of[d]] += 1


@numba.njit(cache=True)
def _scatter_in_edges(
    src: np.ndarray, dst: np.ndarray, weight: np.ndarray, node_map: np.ndarray,
    start: int, stop: int, cursor: np.ndarray, indices: np.ndarray, out_weight: np.ndarray,
) -> None:
    """Place the chunk's edges whose target is in ``[start, stop)`` at their CSC slot
    (a counting sort, stable in input order)."""
    has_weight = weight.size > 0
    for i in range(src.size):
        t = node_map[dst[i]]
        if start <= t < stop:
            pos = cursor[t - start]
            cursor[t - start] = pos + 1
            indices[pos] = node_map[src[i]]
            if has_weight:
                out_weight[pos] = weight[i]


def write_partitions(
    graph: GraphData, part_of: np.ndarray, out_dir: str | Path, *,
    algorithm: dict[str, Any] | None = None, overwrite: bool = False,
    edge_chunk: int = DEFAULT_EDGE_CHUNK, progress: bool = True, started: float | None = None,
) -> Manifest:
    """Write ``graph`` split by ``part_of`` (``[N]`` partition IDs) as format v1 into
    ``out_dir`` and return the manifest (written last). The manifest's
    ``algorithm["seconds"]`` counts from ``started`` (a ``time.perf_counter()`` value;
    default: now)."""
    started = time.perf_counter() if started is None else started
    out = _prepare_out_dir(Path(out_dir), overwrite)
    part_of = _check_assignment(graph, part_of)
    num_parts = int(part_of.max()) + 1 if part_of.size else 1
    book = np.zeros(num_parts + 1, dtype=np.int64)
    np.cumsum(np.bincount(part_of, minlength=num_parts), out=book[1:])
    node_map = _relabel(part_of, book)
    shared = {"partition_book": save_npy(out, "partition_book.npy", book),
              "node_map": save_npy(out, "node_map.npy", node_map)}
    in_degree, remote = _count_pass(graph, node_map, part_of, edge_chunk, progress)
    files: list[dict[str, FileRecord]] = [{} for _ in range(num_parts)]
    for p in tqdm(range(num_parts), desc="in-edges", unit="part", disable=not progress):
        files[p].update(_write_in_edges(graph, out, p, book, node_map, in_degree, edge_chunk))
    _write_node_data(graph, out, part_of, book, files, progress)
    split_sizes = write_splits(graph.splits, out, part_of, node_map, files)
    parts = tuple(
        PartitionInfo(id=p, num_nodes=int(book[p + 1] - book[p]),
                      num_edges=int(in_degree[book[p]:book[p + 1]].sum()),
                      num_remote_edges=int(remote[p]), split_sizes=split_sizes[p],
                      files=files[p])
        for p in range(num_parts)
    )
    algo = dict(algorithm or {})
    algo["seconds"] = round(time.perf_counter() - started, 3)
    manifest = Manifest(
        graph_name=graph.name, num_nodes=graph.num_nodes, num_edges=graph.num_edges,
        feature_dim=graph.feature_dim, feature_dtype=np.dtype(graph.x.dtype).name,
        num_classes=graph.num_classes, has_edge_weight=graph.edge_weight is not None,
        partition_book=tuple(int(b) for b in book), partitions=parts, files=shared,
        algorithm=algo, format_version=FORMAT_VERSION,
    )
    manifest.write(out)
    log.info("wrote %d partitions to %s in %.1f s", num_parts, out, algo["seconds"])
    return manifest


def _prepare_out_dir(out: Path, overwrite: bool) -> Path:
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"out_dir: {out} exists and is not empty (pass overwrite=True / --overwrite)"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _check_assignment(graph: GraphData, part_of: np.ndarray) -> np.ndarray:
    arr = np.asarray(part_of)
    if arr.shape != (graph.num_nodes,) or arr.dtype.kind not in "iu":
        raise ValueError(
            f"part_of: expected integers of shape [{graph.num_nodes}], "
            f"got {arr.dtype} of shape {list(arr.shape)}"
        )
    arr = arr.astype(np.int32, copy=False)
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"part_of: expected partition IDs >= 0, got {int(arr.min())}")
    if arr.size and bool((np.bincount(arr) == 0).any()):
        raise ValueError("part_of: every partition 0..P-1 must own at least one node")
    return arr


def _count_pass(
    graph: GraphData, node_map: np.ndarray, part_of: np.ndarray, chunk: int, progress: bool
) -> tuple[np.ndarray, np.ndarray]:
    in_degree = np.zeros(graph.num_nodes, dtype=np.int64)
    remote = np.zeros(int(part_of.max()) + 1, dtype=np.int64)
    with tqdm(total=graph.num_edges, desc="count", unit="edge", unit_scale=True,
              disable=not progress) as bar:
        for _, src, dst in iter_edge_chunks(graph.edge_index, chunk):
            _count_in_edges(src, dst, node_map, part_of, in_degree, remote)
            bar.update(src.size)
    return in_degree, remote


def _write_in_edges(
    graph: GraphData, out: Path, p: int, book: np.ndarray, node_map: np.ndarray,
    in_degree: np.ndarray, chunk: int,
) -> dict[str, FileRecord]:
    start, stop = int(book[p]), int(book[p + 1])
    indptr = np.zeros(stop - start + 1, dtype=np.int64)
    np.cumsum(in_degree[start:stop], out=indptr[1:])
    indices = np.empty(int(indptr[-1]), dtype=np.int64)
    edge_weight = graph.edge_weight
    has_w = edge_weight is not None
    weights = np.empty(indices.size if has_w else 0, dtype=np.float32)
    cursor = indptr[:-1].copy()
    no_weight = np.empty(0, dtype=np.float32)
    for first, src, dst in iter_edge_chunks(graph.edge_index, chunk):
        w = no_weight if edge_weight is None else read_flat(edge_weight, first, first + src.size)
        _scatter_in_edges(src, dst, w, node_map, start, stop, cursor, indices, weights)
    files = {"indptr": save_npy(out, f"part-{p}/indptr.npy", indptr),
             "indices": save_npy(out, f"part-{p}/indices.npy", indices)}
    if has_w:
        files["edge_weight"] = save_npy(out, f"part-{p}/edge_weight.npy", weights)
    return files


def _write_node_data(
    graph: GraphData, out: Path, part_of: np.ndarray, book: np.ndarray,
    files: list[dict[str, FileRecord]], progress: bool,
) -> None:
    """One sequential pass over the node rows, appending each row to its partition's
    ``x``/``y``/``orig_ids`` files (new IDs follow original order within a partition)."""
    sizes = np.diff(book)
    f = graph.feature_dim
    writers = [
        {"x": NpyWriter(out, f"part-{p}/x.npy", graph.x.dtype, (int(n), f)),
         "y": NpyWriter(out, f"part-{p}/y.npy", np.int64, (int(n),)),
         "orig_ids": NpyWriter(out, f"part-{p}/orig_ids.npy", np.int64, (int(n),))}
        for p, n in enumerate(sizes)
    ]
    with tqdm(total=graph.num_nodes, desc="nodes", unit="node", unit_scale=True,
              disable=not progress) as bar:
        for first, x in iter_row_chunks(graph.x, DEFAULT_ROW_CHUNK):
            rows = slice(first, first + x.shape[0])
            owner, y = part_of[rows], np.asarray(graph.y[rows])
            ids = np.arange(rows.start, rows.stop, dtype=np.int64)
            for p, w in enumerate(writers):
                mine = owner == p
                w["x"].append(x[mine])
                w["y"].append(y[mine])
                w["orig_ids"].append(ids[mine])
            bar.update(x.shape[0])
    for p, w in enumerate(writers):
        files[p].update({k: wr.close() for k, wr in w.items()})


def write_splits(
    splits: Mapping[str, np.ndarray], out: Path, part_of: np.ndarray, node_map: np.ndarray,
    files: list[dict[str, FileRecord]], prefix: str = "",
) -> list[dict[str, int]]:
    """Each partition's share of every split, as ``part-<p>/<prefix><split>_idx.npy`` in
    new IDs (sorted); returns the shares' sizes per partition. ``prefix`` is the node
    type's folder (``"paper/"``) in a typed partition."""
    sizes: list[dict[str, int]] = [{} for _ in files]
    for split in SPLITS:
        if split not in splits:
            continue
        ids = np.asarray(splits[split])
        owner, new_ids = part_of[ids], node_map[ids]
        for p in range(len(files)):
            mine = np.sort(new_ids[owner == p])
            files[p][f"{prefix}{split}_idx"] = save_npy(out, f"part-{p}/{prefix}{split}_idx.npy", mine)
            sizes[p][split] = int(mine.size)
    return sizes
