"""Partition algorithms: each maps every node to a partition (``part_of[v] = p``).

``random`` and ``hash`` need O(N) memory; ``range`` streams the edges once to balance
nodes, edges and training nodes over contiguous ID ranges; ``metis`` loads the whole
undirected graph to cut few edges while balancing nodes, edges and training nodes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numba
import numpy as np
from tqdm import tqdm

from partitioner.graph import GraphData
from partitioner.npyio import iter_edge_chunks

log = logging.getLogger(__name__)

METHODS = ("random", "hash", "range", "metis")
#: Mean integer METIS node weight (resolution of the combined node/edge/train cost).
_METIS_MEAN_WEIGHT = 1000


def assign(
    graph: GraphData, num_parts: int, method: str, *, seed: int = 0,
    edge_chunk: int = 1 << 24, progress: bool = True,
) -> np.ndarray:
    """``int32 [N]`` partition of every node, by ``method`` (one of :data:`METHODS`)."""
    if num_parts < 1:
        raise ValueError(f"num_parts: expected an integer >= 1, got {num_parts}")
    if num_parts > graph.num_nodes:
        raise ValueError(
            f"num_parts: expected at most num_nodes ({graph.num_nodes}), got {num_parts}"
        )
    table: dict[str, Callable[[], np.ndarray]] = {
        "random": lambda: random_partition(graph.num_nodes, num_parts, seed),
        "hash": lambda: hash_partition(graph.num_nodes, num_parts, seed),
        "range": lambda: range_partition(graph, num_parts, edge_chunk, progress),
        "metis": lambda: metis_partition(graph, num_parts, seed, progress),
    }
    if method not in table:
        raise ValueError(f"method: expected one of {list(METHODS)}, got {method!r}")
    part_of = table[method]().astype(np.int32, copy=False)
    sizes = np.bincount(part_of, minlength=num_parts)
    if sizes.size != num_parts or bool((sizes == 0).any()):
        empty = np.flatnonzero(sizes[:num_parts] == 0).tolist()
        raise ValueError(
            f"num_parts: method {method!r} left partitions {empty} of {num_parts} empty "
            f"({graph.num_nodes} nodes); use fewer partitions or another method"
        )
    log.info("%s partition into %d parts: nodes per part %s", method, num_parts, sizes.tolist())
    return part_of


def random_partition(num_nodes: int, num_parts: int, seed: int) -> np.ndarray:
    """A uniformly random assignment with node counts differing by at most one."""
    return (np.random.default_rng(seed).permutation(num_nodes) % num_parts).astype(np.int32)


@numba.njit(parallel=True, cache=True)
def _hash_parts(num_nodes: int, num_parts: int, seed: np.uint64) -> np.ndarray:
    out = np.empty(num_nodes, dtype=np.int32)
    for v in numba.prange(num_nodes):
        z = np.uint64(v) + seed * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        out[v] = np.int32(z % np.uint64(num_parts))
    return out


def hash_partition(num_nodes: int, num_parts: int, seed: int) -> np.ndarray:
    """Each node to ``hash(v, seed) mod P``: stateless, so any process computes it alone."""
    return _hash_parts(num_nodes, num_parts, np.uint64(seed))


@numba.njit(cache=True)
def _add_in_degree(dst: np.ndarray, in_degree: np.ndarray) -> None:
    for d in dst:
        in_degree[d] += 1


def balance_cost(degree: np.ndarray, train: np.ndarray | None) -> np.ndarray:
    """Per-node cost ``1/N + deg/sum(deg) + is_train/T``: nodes, edges and training nodes
    weigh the same in total, so balancing the cost balances all three."""
    n = degree.size
    cost = np.full(n, 1.0 / n)
    cost += degree / max(int(degree.sum()), 1)
    if train is not None and train.size:
        cost[train] += 1.0 / train.size
    return cost


def range_partition(
    graph: GraphData, num_parts: int, edge_chunk: int = 1 << 24, progress: bool = True
) -> np.ndarray:
    """Contiguous original-ID ranges balancing nodes, in-edges and training nodes.

    One streaming pass counts in-degrees; each node then costs
    ``1/N + deg/E + is_train/T`` and the ranges cut the cumulative cost into equal parts.
    """
    n = graph.num_nodes
    in_degree = np.zeros(n, dtype=np.int64)
    with tqdm(total=graph.num_edges, desc="degrees", unit="edge", unit_scale=True,
              disable=not progress) as bar:
        for _, _src, dst in iter_edge_chunks(graph.edge_index, edge_chunk):
            _add_in_degree(dst, in_degree)
            bar.update(dst.size)
    cumulative = np.cumsum(balance_cost(in_degree, graph.splits.get("train")))
    cuts = cumulative[-1] * np.arange(1, num_parts) / num_parts
    bounds = np.searchsorted(cumulative, cuts, side="left")
    # Every part keeps at least one node.
    bounds = np.clip(bounds, np.arange(1, num_parts), n - num_parts + np.arange(1, num_parts))
    bounds = np.maximum.accumulate(bounds)
    return np.searchsorted(bounds, np.arange(n), side="right").astype(np.int32)


def metis_partition(
    graph: GraphData, num_parts: int, seed: int = 0, progress: bool = True
) -> np.ndarray:
    """METIS (pymetis) balancing nodes, edges and training nodes together.

    Each node weighs ``1/N + deg/D + is_train/T`` (``deg`` its undirected degree, ``D`` the
    sum of degrees, ``T`` the training nodes), as in :func:`range_partition`, scaled to
    integers. pymetis always calls METIS with one balance constraint (it has no ``ncon``
    argument), so a multi-column weight array would be misread: METIS would take the first
    N entries of the flattened array as the node weights.
    """
    import pymetis

    if num_parts == 1:
        return np.zeros(graph.num_nodes, dtype=np.int32)
    xadj, adjncy = undirected_csr(graph, progress)
    n = graph.num_nodes
    cost = balance_cost(np.diff(xadj), graph.splits.get("train"))
    scale = _METIS_MEAN_WEIGHT * n / cost.sum()
    weights = np.maximum(np.rint(cost * scale), 1).astype(np.int64)
    options = pymetis.Options(seed=seed)
    log.info("running METIS on %d nodes, %d adjacency entries", graph.num_nodes, adjncy.size)
    _cut, parts = pymetis.part_graph(
        num_parts, adjacency=pymetis.CSRAdjacency(xadj, adjncy),
        vweights=weights.reshape(-1), options=options,
    )
    return np.asarray(parts, dtype=np.int32)


@numba.njit(cache=True)
def _fill_symmetric(
    src: np.ndarray, dst: np.ndarray, cursor: np.ndarray, adjncy: np.ndarray, count_only: bool
) -> None:
    for i in range(src.size):
        u, v = src[i], dst[i]
        if u == v:
            continue
        if count_only:
            cursor[u] += 1
            cursor[v] += 1
        else:
            adjncy[cursor[u]] = v
            cursor[u] += 1
            adjncy[cursor[v]] = u
            cursor[v] += 1


@numba.njit(parallel=True, cache=True)
def _dedup_rows(xadj: np.ndarray, adjncy: np.ndarray, kept: np.ndarray) -> None:
    for u in numba.prange(xadj.size - 1):
        row = np.sort(adjncy[xadj[u]:xadj[u + 1]])
        k = 0
        for j in range(row.size):
            if j == 0 or row[j] != row[j - 1]:
                adjncy[xadj[u] + k] = row[j]
                k += 1
        kept[u] = k


@numba.njit(cache=True)
def _compact(xadj: np.ndarray, adjncy: np.ndarray, kept: np.ndarray) -> np.ndarray:
    new_xadj = np.zeros(xadj.size, dtype=np.int64)
    pos = 0
    for u in range(xadj.size - 1):
        start = xadj[u]
        for j in range(kept[u]):
            adjncy[pos + j] = adjncy[start + j]
        pos += kept[u]
        new_xadj[u + 1] = pos
    return new_xadj


def undirected_csr(graph: GraphData, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric adjacency without self-loops or repeats, as METIS wants it."""
    n = graph.num_nodes
    degree = np.zeros(n, dtype=np.int64)
    empty = np.empty(0, dtype=np.int64)
    chunks = 1 << 24
    for _, src, dst in iter_edge_chunks(graph.edge_index, chunks):
        _fill_symmetric(src, dst, degree, empty, True)
    xadj = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(degree, out=xadj[1:])
    adjncy = np.empty(int(xadj[-1]), dtype=np.int64)
    cursor = xadj[:-1].copy()
    with tqdm(total=graph.num_edges, desc="adjacency", unit="edge", unit_scale=True,
              disable=not progress) as bar:
        for _, src, dst in iter_edge_chunks(graph.edge_index, chunks):
            _fill_symmetric(src, dst, cursor, adjncy, False)
            bar.update(src.size)
    kept = np.empty(n, dtype=np.int64)
    _dedup_rows(xadj, adjncy, kept)
    new_xadj = _compact(xadj, adjncy, kept)
    return new_xadj, adjncy[: int(new_xadj[-1])].copy()
