"""Partition a graph and write it to disk, out of core: one writer for plain and typed graphs.

A graph reaches the writer as a :class:`~partitioner.graph.TypedGraphData` (a plain
:class:`~partitioner.graph.GraphData` as its one-type view). Nodes are relabelled per
type so that each partition owns one contiguous ID range of every type, in original-ID
order within the partition. Each relation's edges are stored once, as CSC in-edges in
the partition that owns the destination, a node's in-edges in input order, each with its
original edge ID (its column in the relation's ``edge_index``, or its ``edge_ids`` entry),
weight and features aligned with it. Every pass
reads the source in chunks (``pread`` for memory-mapped sources), so peak memory is O(N)
for the maps plus one partition's in-edges of one relation, never the whole graph. A
plain graph is written in format v1, a typed one in v2 (:mod:`partitioner.manifest`).
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

from partitioner.algorithms import assign
from partitioner.graph import SPLITS, EdgeType, GraphData, TypedGraphData, edge_type_name, plain_view
from partitioner.links import write_link_splits
from partitioner.manifest import (
    FEATURE_DTYPES,
    FORMAT_VERSION,
    TYPED_FORMAT_VERSION,
    EdgeFeatureInfo,
    Manifest,
    NodeTypeInfo,
    PartitionInfo,
    role,
    shared_role,
)
from partitioner.npyio import (
    FileRecord,
    NpyWriter,
    iter_edge_chunks,
    iter_row_chunks,
    read_flat,
    read_rows,
    save_npy,
)

log = logging.getLogger(__name__)

#: Edges per chunk in the streaming passes (16M edges = 256 MiB of int64 pairs).
DEFAULT_EDGE_CHUNK = 1 << 24
#: Node rows per chunk when splitting features and labels.
DEFAULT_ROW_CHUNK = 1 << 18


def warn_empty_splits(graph: GraphData | TypedGraphData) -> None:
    """Warn about every split the graph lacks or has empty (a trainer refuses to iterate it);
    a link-prediction graph (one with link splits) needs no node splits."""
    if graph.link_splits:
        return
    for split in [s for s in SPLITS if graph.splits.get(s) is None or len(graph.splits[s]) == 0]:
        log.warning("%s: the %r split is empty; graphfeed-train needs train and val nodes and a "
                    "loader refuses an empty split (give %s_idx or %s_mask, or OGB's valid_idx for val)",
                    graph.name, split, split, split)


def partition_graph(
    graph: GraphData | TypedGraphData, num_parts: int, out_dir: str | Path, *, method: str = "metis",
    seed: int = 0, overwrite: bool = False, edge_chunk: int = DEFAULT_EDGE_CHUNK,
    progress: bool = True, extra: dict[str, Any] | None = None, feature_dtype: str | None = None,
) -> Manifest:
    """Split ``graph`` into ``num_parts`` partitions with ``method`` (any of
    :data:`partitioner.algorithms.METHODS`; a typed graph's on its homogeneous view) and
    write them to ``out_dir``; returns the manifest (its ``algorithm`` records method,
    seed, time, ``feature_dtype`` when given and ``extra``). ``feature_dtype``
    (:data:`FEATURE_DTYPES`; None: as the graph holds them) is the dtype the node features
    are stored in."""
    stored_dtype(feature_dtype)
    warn_empty_splits(graph)
    started = time.perf_counter()
    graph.validate()  # ID ranges too: a bad ID would otherwise fail deep in METIS or the writer
    typed = plain_view(graph) if isinstance(graph, GraphData) else graph
    # the homogeneous view (a plain graph is its own: its edges are not copied)
    view = graph if isinstance(graph, GraphData) else graph.to_homogeneous()
    whole = assign(view, num_parts, method, seed=seed, edge_chunk=edge_chunk, progress=progress)
    del view
    offsets = typed.node_offsets()
    part_of = {t: whole[offsets[t]:offsets[t] + n] for t, n in typed.num_nodes.items()}
    algorithm = {"method": method, "num_parts": num_parts, "seed": seed,
                 "assign_seconds": round(time.perf_counter() - started, 3),
                 **({"feature_dtype": feature_dtype} if feature_dtype else {}), **(extra or {})}
    return _write_partitions(typed, part_of, out_dir, num_parts=num_parts, algorithm=algorithm,
                             overwrite=overwrite, edge_chunk=edge_chunk, progress=progress,
                             started=started, feature_dtype=feature_dtype)


def stored_dtype(feature_dtype: str | None, features: np.dtype | None = None) -> np.dtype | None:
    """The dtype features of ``features``' dtype are stored in (None: none to store); a
    ``ValueError`` naming ``feature_dtype`` for one not in :data:`FEATURE_DTYPES`."""
    if feature_dtype is not None and feature_dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature_dtype: expected one of {list(FEATURE_DTYPES)} or None (as the graph "
                         f"holds them), got {feature_dtype!r}")
    if features is None:
        return None
    return np.dtype(feature_dtype) if feature_dtype else np.dtype(features)


def _cast_rows(x: np.ndarray, dtype: np.dtype, node_type: str, first: int) -> np.ndarray:
    """``x`` (rows from ``first`` of ``node_type``'s features) in ``dtype``; a
    ``ValueError`` naming ``feature_dtype`` where a finite value does not fit in it."""
    if x.dtype == dtype:
        return x
    with np.errstate(over="ignore"):  # an overflow is refused below, naming the row
        out = x.astype(dtype)
    if np.issubdtype(dtype, np.floating) and np.finfo(dtype).max < np.finfo(x.dtype).max:
        bad = np.isinf(out) & np.isfinite(x)
        if bad.any():
            row = first + int(np.argwhere(bad)[0][0])
            raise ValueError(f"feature_dtype: {dtype.name} holds values up to {np.finfo(dtype).max:g}, "
                             f"node {row} of type {node_type!r} has a feature of "
                             f"{float(x[bad][0]):g}; keep {x.dtype.name} (no --feature-dtype) or "
                             "scale the features")
    return out


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
def _count_in_edges(src: np.ndarray, dst: np.ndarray, dst_map: np.ndarray, src_part: np.ndarray,
                    dst_part: np.ndarray, in_degree: np.ndarray, remote: np.ndarray) -> None:
    """Add a chunk's edges to the in-degree of each global target, and count, per
    target partition, the edges whose source lies in another partition."""
    for i in range(src.size):
        d = dst[i]
        in_degree[dst_map[d]] += 1
        if src_part[src[i]] != dst_part[d]:
            remote[dst_part[d]] += 1


@numba.njit(cache=True)
def _scatter_in_edges(src: np.ndarray, dst: np.ndarray, weight: np.ndarray, src_map: np.ndarray,
                      dst_map: np.ndarray, start: int, stop: int, cursor: np.ndarray, first: int,
                      indices: np.ndarray, out_weight: np.ndarray, out_eid: np.ndarray,
                      slots: np.ndarray) -> None:
    """Place the chunk's edges (input columns ``first ..``) whose target is in
    ``[start, stop)`` at their CSC slot (a counting sort, stable in input order), with
    their original edge ID; with ``slots`` (one per chunk edge), record each edge's slot
    there (-1: another partition's), for the rows of other per-edge arrays."""
    has_weight = weight.size > 0
    has_slots = slots.size > 0
    for i in range(src.size):
        t = dst_map[dst[i]]
        if start <= t < stop:
            pos = cursor[t - start]
            cursor[t - start] = pos + 1
            indices[pos] = src_map[src[i]]
            out_eid[pos] = first + i
            if has_weight:
                out_weight[pos] = weight[i]
            if has_slots:
                slots[i] = pos
        elif has_slots:
            slots[i] = -1


class _Layout:
    """Where each file goes: format v1 names no type, v2 names the node or edge type."""

    def __init__(self, typed: bool) -> None:
        self.typed = typed

    def shared(self, kind: str, t: str) -> tuple[str, str]:
        """(role, path) of a file shared by every partition (book, node map)."""
        name = shared_role(kind, t if self.typed else None)
        return name, f"{name}.npy"

    def own(self, p: int, kind: str, t: str | EdgeType) -> tuple[str, str]:
        """(role, path) of a file of partition ``p``."""
        name = role(kind, t if self.typed else None)
        return name, f"part-{p}/{name}.npy"


def write_partitions(
    graph: TypedGraphData | GraphData, part_of: Mapping[str, np.ndarray] | np.ndarray,
    out_dir: str | Path, *, num_parts: int | None = None, algorithm: dict[str, Any] | None = None,
    overwrite: bool = False, edge_chunk: int = DEFAULT_EDGE_CHUNK, progress: bool = True,
    started: float | None = None, feature_dtype: str | None = None,
) -> Manifest:
    """Write ``graph`` split by ``part_of`` (node type to ``[N_t]`` partition IDs; one
    array for a plain graph) into ``out_dir`` and return the manifest (written last). The
    manifest's ``algorithm["seconds"]`` counts from ``started`` (a ``time.perf_counter()``
    value; default: now); ``feature_dtype`` as :func:`partition_graph`'s. The graph is
    validated first, ID ranges included."""
    stored_dtype(feature_dtype)
    graph.validate()
    return _write_partitions(plain_view(graph) if isinstance(graph, GraphData) else graph, part_of, out_dir,
                             num_parts=num_parts, algorithm=algorithm, overwrite=overwrite,
                             edge_chunk=edge_chunk, progress=progress, started=started,
                             feature_dtype=feature_dtype)


def _write_partitions(
    graph: TypedGraphData, part_of: Mapping[str, np.ndarray] | np.ndarray, out_dir: str | Path, *,
    num_parts: int | None, algorithm: dict[str, Any] | None, overwrite: bool, edge_chunk: int,
    progress: bool, started: float | None, feature_dtype: str | None = None,
) -> Manifest:
    """:func:`write_partitions` of a validated graph."""
    started = time.perf_counter() if started is None else started
    if not isinstance(part_of, Mapping):
        part_of = {graph.target_type: part_of}
    out = _prepare_out_dir(Path(out_dir), overwrite)
    parts, num_parts = _check_assignment(graph, part_of, num_parts)
    layout = _Layout(graph.typed)
    books, node_maps, shared = {}, {}, {}
    for t, owner in parts.items():
        book = np.zeros(num_parts + 1, dtype=np.int64)
        np.cumsum(np.bincount(owner, minlength=num_parts), out=book[1:])
        books[t], node_maps[t] = book, _relabel(owner, book)
        for kind, array in (("partition_book", book), ("node_map", node_maps[t])):
            name, path = layout.shared(kind, t)
            shared[name] = save_npy(out, path, array)
    link_files, link_infos = write_link_splits(graph, out, node_maps)
    shared.update(link_files)
    files: list[dict[str, FileRecord]] = [{} for _ in range(num_parts)]
    edges = {et: np.zeros(num_parts, dtype=np.int64) for et in graph.edge_types}
    remote = {et: np.zeros(num_parts, dtype=np.int64) for et in graph.edge_types}
    with tqdm(total=graph.num_edges() * (num_parts + 1), desc="in-edges", unit="edge", unit_scale=True,
              disable=not progress) as bar:
        for et in graph.edge_types:
            _write_relation(graph, et, out, layout, parts, books, node_maps, files, edges[et],
                            remote[et], edge_chunk, bar)
    with tqdm(total=graph.total_nodes, desc="nodes", unit="node", unit_scale=True,
              disable=not progress) as bar:
        for t in graph.node_types:
            _write_node_type(graph, t, out, layout, parts[t], books[t], files, bar, feature_dtype)
    target = graph.target_type
    split_sizes = _write_splits(graph.splits, out, layout, target, parts[target], node_maps[target], files)
    infos = tuple(PartitionInfo(
        id=p, num_nodes={t: int(b[p + 1] - b[p]) for t, b in books.items()},
        num_edges={et: int(edges[et][p]) for et in graph.edge_types},
        num_remote_edges={et: int(remote[et][p]) for et in graph.edge_types},
        split_sizes=split_sizes[p], files=files[p]) for p in range(num_parts))
    algo = dict(algorithm or {})
    algo["seconds"] = round(time.perf_counter() - started, 3)
    manifest = Manifest(
        graph_name=graph.name,
        node_types={t: NodeTypeInfo(n, graph.feature_dim(t),
                                    np.dtype(feature_dtype or graph.x[t].dtype).name if t in graph.x else "")
                    for t, n in graph.num_nodes.items()},
        edge_types={et: graph.num_edges(et) for et in graph.edge_types},
        target_type=target, num_classes=graph.num_classes,
        partition_book={t: tuple(int(v) for v in b) for t, b in books.items()},
        partitions=infos, files=shared, weighted=frozenset(graph.edge_weight), algorithm=algo,
        format_version=TYPED_FORMAT_VERSION if graph.typed else FORMAT_VERSION,
        edge_ids=frozenset(graph.edge_types),
        edge_features={et: EdgeFeatureInfo(tuple(int(d) for d in a.shape[1:]), np.dtype(a.dtype).name)
                       for et, a in graph.edge_attr.items()},
        link_splits=link_infos, edge_id_bounds=_edge_id_bounds(graph))
    manifest.write(out)
    log.info("wrote %d partitions to %s in %.1f s", num_parts, out, algo["seconds"])
    _warn_without_training(manifest)
    return manifest


def _edge_id_bounds(graph: TypedGraphData) -> dict[EdgeType, int]:
    """Per edge type with ``edge_ids`` beyond ``0 .. E-1``: the bound of its original IDs."""
    out = {}
    for et, ids in graph.edge_ids.items():
        bound = int(np.max(ids)) + 1 if len(ids) else 0
        if bound > graph.num_edges(et):
            out[et] = bound
    return out


def _prepare_out_dir(out: Path, overwrite: bool) -> Path:
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"out_dir: {out} exists and is not empty "
                                  "(pass overwrite=True / --overwrite)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _warn_without_training(manifest: Manifest) -> None:
    idle = [p.id for p in manifest.partitions if p.split_sizes.get("train", 1) == 0]
    if idle:
        what = f"training {manifest.target_type} nodes" if manifest.typed else "training nodes"
        log.warning("partitions %s own no %s (method %r); metis, hash or random spread them",
                    idle, what, manifest.algorithm.get("method", "given"))


def _check_assignment(graph: TypedGraphData, part_of: Mapping[str, np.ndarray],
                      num_parts: int | None) -> tuple[dict[str, np.ndarray], int]:
    """The checked assignment (int32 per node type) and its number of partitions."""
    if num_parts is not None and num_parts < 1:
        raise ValueError(f"num_parts: expected an integer >= 1, got {num_parts}")
    if set(part_of) != set(graph.num_nodes):
        raise ValueError(f"part_of: expected one array per node type {list(graph.num_nodes)}, "
                         f"got {list(part_of)}")
    checked: dict[str, np.ndarray] = {}
    for t, n in graph.num_nodes.items():
        arr = np.asarray(part_of[t])
        name = f"part_of[{t!r}]" if graph.typed else "part_of"
        if arr.shape != (n,) or arr.dtype.kind not in "iu":
            raise ValueError(f"{name}: expected integers of shape [{n}], got {arr.dtype} of shape "
                             f"{list(arr.shape)}")
        arr = arr.astype(np.int32, copy=False)
        if arr.size and (int(arr.min()) < 0 or (num_parts is not None and int(arr.max()) >= num_parts)):
            bound = "" if num_parts is None else f" in [0, {num_parts})"
            raise ValueError(f"{name}: expected partition IDs >= 0{bound}, got "
                             f"[{int(arr.min())}, {int(arr.max())}]")
        checked[t] = arr
    parts = num_parts or 1 + max((int(a.max()) for a in checked.values() if a.size), default=0)
    used = sum((np.bincount(a, minlength=parts) for a in checked.values()), np.zeros(parts, np.int64))
    if bool((used == 0).any()):
        raise ValueError("part_of: every partition 0..P-1 must own at least one node")
    return checked, parts


def _write_relation(graph: TypedGraphData, et: EdgeType, out: Path, layout: _Layout,
                    parts: dict[str, np.ndarray], books: dict[str, np.ndarray],
                    node_maps: dict[str, np.ndarray], files: list[dict[str, FileRecord]],
                    edges: np.ndarray, remote: np.ndarray, chunk: int, bar: tqdm) -> None:
    """CSC in-edges of each partition's owned destination nodes for one relation: one
    counting pass over the edges, then one placing pass per partition."""
    s, _, d = et
    edge_index = graph.edge_index[et]
    weight = graph.edge_weight.get(et)
    attr = graph.edge_attr.get(et)
    in_degree = np.zeros(graph.num_nodes[d], dtype=np.int64)
    for _, src, dst in iter_edge_chunks(edge_index, chunk):
        _count_in_edges(src, dst, node_maps[d], parts[s], parts[d], in_degree, remote)
        bar.update(src.size)
    book = books[d]
    no_weight = np.empty(0, dtype=np.float32)
    for p in range(len(files)):
        start, stop = int(book[p]), int(book[p + 1])
        indptr = np.zeros(stop - start + 1, dtype=np.int64)
        np.cumsum(in_degree[start:stop], out=indptr[1:])
        indices = np.empty(int(indptr[-1]), dtype=np.int64)
        e_id = np.empty(indices.size, dtype=np.int64)
        weights = np.empty(indices.size if weight is not None else 0, dtype=np.float32)
        attrs = None if attr is None else np.empty((indices.size, *attr.shape[1:]), dtype=attr.dtype)
        slots = np.empty(min(chunk, edge_index.shape[1]) if attr is not None else 0, dtype=np.int64)
        cursor = indptr[:-1].copy()
        for first, src, dst in iter_edge_chunks(edge_index, chunk):
            w = no_weight if weight is None else read_flat(weight, first, first + src.size)
            _scatter_in_edges(src, dst, w, node_maps[s], node_maps[d], start, stop, cursor, first,
                              indices, weights, e_id, slots)
            if attr is not None and attrs is not None:
                mine = slots[:src.size] >= 0
                if mine.any():
                    attrs[slots[:src.size][mine]] = read_rows(attr, first, first + src.size)[mine]
            bar.update(src.size)
        edges[p] = indices.size
        if et in graph.edge_ids:  # the edges' own original IDs rather than their columns
            e_id = np.asarray(graph.edge_ids[et])[e_id]
        for kind, array in (("indptr", indptr), ("indices", indices), ("e_id", e_id),
                            *((("edge_weight", weights),) if weight is not None else ()),
                            *((("edge_attr", attrs),) if attrs is not None else ())):
            name, path = layout.own(p, kind, et)
            files[p][name] = save_npy(out, path, array)
    log.debug("relation %s: %d edges written", edge_type_name(et), int(edges.sum()))


def _write_node_type(graph: TypedGraphData, t: str, out: Path, layout: _Layout, part_of: np.ndarray,
                     book: np.ndarray, files: list[dict[str, FileRecord]], bar: tqdm,
                     feature_dtype: str | None = None) -> None:
    """One sequential pass over a node type's rows, appending each row's features (in
    ``feature_dtype``), label (target type) and original ID to its partition's files (new
    IDs follow original order within a partition)."""
    sizes = np.diff(book)
    feats = graph.x.get(t)
    dtype = stored_dtype(feature_dtype, feats.dtype if feats is not None else None)
    labels = graph.y if t == graph.target_type else None

    def writer(p: int, kind: str, dtype: Any, shape: tuple[int, ...]) -> tuple[str, NpyWriter]:
        name, path = layout.own(p, kind, t)
        return name, NpyWriter(out, path, dtype, shape)

    writers = [dict([writer(p, "orig_ids", np.int64, (int(n),)),
                     *([writer(p, "x", dtype, (int(n), feats.shape[1]))] if feats is not None else []),
                     *([writer(p, "y", np.int64, (int(n),))] if labels is not None else [])])
               for p, n in enumerate(sizes)]
    rows = feats if feats is not None else np.empty((graph.num_nodes[t], 0), dtype=np.float32)
    for first, x in iter_row_chunks(rows, DEFAULT_ROW_CHUNK):
        if feats is not None and dtype is not None:
            x = _cast_rows(x, dtype, t, first)
        span = slice(first, first + x.shape[0])
        owner = part_of[span]
        ids = np.arange(span.start, span.stop, dtype=np.int64)
        y = np.asarray(labels[span]) if labels is not None else None
        for p, ws in enumerate(writers):
            mine = owner == p
            for name, w in ws.items():
                kind = name.rpartition("/")[2]
                w.append(ids[mine] if kind == "orig_ids" else x[mine] if kind == "x" else y[mine])  # type: ignore[index]
        bar.update(x.shape[0])
    for p, ws in enumerate(writers):
        files[p].update({name: w.close() for name, w in ws.items()})


def _write_splits(
    splits: Mapping[str, np.ndarray], out: Path, layout: _Layout, target: str, part_of: np.ndarray,
    node_map: np.ndarray, files: list[dict[str, FileRecord]],
) -> list[dict[str, int]]:
    """Each partition's share of every split of the ``target`` type, as its
    ``<split>_idx.npy`` in new IDs (sorted); returns the shares' sizes per partition."""
    sizes: list[dict[str, int]] = [{} for _ in files]
    for split in SPLITS:
        if split not in splits:
            continue
        ids = np.asarray(splits[split])
        owner, new_ids = part_of[ids], node_map[ids]
        for p in range(len(files)):
            mine = np.sort(new_ids[owner == p])
            name, path = layout.own(p, f"{split}_idx", target)
            files[p][name] = save_npy(out, path, mine)
            sizes[p][split] = int(mine.size)
    return sizes
