"""Hot orders: the rules ordering a partition's nodes of one type from hottest to coldest,
and the node sets of cache plans. Pure functions of a partition, for the sampler (the
CUDA feature table keeps its hottest rows in GPU memory) and the service above it
(trainers' feature caches, :mod:`sampling_server.hot`; the server's ``--hot-order``).

Each rule is computed alike by every party from the partition alone (``--hot-order``,
:data:`HOT_ORDERS`):

* ``"visits_v1"`` (the default, :data:`HOT_ORDER`): the expected
  number of times a batch holds the node, estimated with one pass over the partition's
  CSC per relation and hop. Seeds are drawn uniformly from the partition's training nodes
  of the target type (``BATCH`` per batch); at hop ``k`` every relation ``s -> d`` draws
  ``min(fanout_k, degree)`` in-neighbors of each frontier node of type ``d``
  (``FANOUTS``), so in-neighbor ``v`` of a frontier node ``u`` is drawn with probability
  ``min(fanout, d_u) / d_u``; a node joins the next frontier with probability
  ``exp(-earlier draws) * (1 - exp(-draws this hop))`` (Poisson). Only edges between nodes
  the partition owns are followed (a partition holds its own nodes' in-edges), so with
  several partitions it is an estimate of the local share. Ties (e.g. nodes no training
  node reaches): in-degree, highest first, then lower global ID.
* ``"in_degree_v1"``: in-degree of the owned node summed over every relation ending at its
  type, highest first, ties by lower global ID.

A trainer's cache plan is one count per partition per cached node type: it holds the
features of the first ``counts[p]`` nodes of partition ``p``'s order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np

from partitioner.partition import Partition

#: The rules a server may order its nodes by (``--hot-order``), and the default one.
HOT_ORDERS: tuple[str, ...] = ("visits_v1", "in_degree_v1")
HOT_ORDER = HOT_ORDERS[0]

#: Fanouts per hop and seeds per batch that ``"visits_v1"`` assumes (PyG's usual
#: ``[15, 10, 5]`` and batch 1024; the order is a fixed rule, not a per-request one).
FANOUTS = (15, 10, 5)
BATCH = 1024
#: Cache plans whose node set a server keeps (as a bitset, one bit per node of the type).
PLAN_BITSETS = 8


def in_degree(indptrs: Sequence[np.ndarray], num_nodes: int) -> np.ndarray:
    """int64 ``[num_nodes]``: the in-degree of each node summed over the CSC offsets
    ``indptrs`` (one per relation ending at the nodes' type, each over the same nodes)."""
    degree = np.zeros(num_nodes, dtype=np.int64)
    for indptr in indptrs:
        degree += np.diff(np.asarray(indptr, dtype=np.int64)).astype(np.int64)
    return degree


def in_degree_order(indptrs: Sequence[np.ndarray], node_start: int, num_nodes: int) -> np.ndarray:
    """Global IDs of ``num_nodes`` nodes from ``node_start``, hottest first: in-degree
    (:func:`in_degree`) descending, ties by lower global ID (a stable sort)."""
    return np.argsort(-in_degree(indptrs, num_nodes), kind="stable").astype(np.int64) + node_start


@numba.njit(cache=True)
def _spread(indptr: np.ndarray, indices: np.ndarray, node_start: int, frontier: np.ndarray,
            fanout: int, out: np.ndarray) -> None:
    """``out[v] +=`` the expected draws of owned node ``v`` (global ID ``node_start + v``)
    in one hop from ``frontier`` (one entry per column of the CSC; serial, in CSC order:
    the same sums on every run)."""
    n = indptr.size - 1
    m = out.size
    for u in range(n):
        f = frontier[u]
        degree = indptr[u + 1] - indptr[u]
        if f == 0.0 or degree == 0:
            continue
        take = degree if fanout < 0 or fanout >= degree else fanout
        w = f * take / degree
        for e in range(indptr[u], indptr[u + 1]):
            v = indices[e] - node_start
            if 0 <= v < m:
                out[v] += w


def visit_scores(partition: Partition, fanouts: tuple[int, ...] = FANOUTS,
                 batch: int = BATCH) -> dict[str, np.ndarray]:
    """Per node type, float64 ``[n_t]``: the expected draws of each owned node per batch
    (seeds counted once), under the model of ``"visits_v1"`` (module doc)."""
    ranges = {t: partition.node_range(t) for t in partition.node_types}
    size = {t: stop - start for t, (start, stop) in ranges.items()}
    target = partition.target_type
    start = ranges[target][0]
    seeds = np.asarray(partition.splits.get("train", np.empty(0, np.int64)), dtype=np.int64) - start
    seeds = seeds[(seeds >= 0) & (seeds < size[target])]
    frontier = {t: np.zeros(n, dtype=np.float64) for t, n in size.items()}
    if seeds.size:
        frontier[target][seeds] = min(1.0, batch / seeds.size)
    else:  # no training nodes: seeds anywhere
        frontier[target][:] = min(1.0, batch / max(size[target], 1))
    total = {t: f.copy() for t, f in frontier.items()}
    for fanout in fanouts:
        drawn = {t: np.zeros(n, dtype=np.float64) for t, n in size.items()}
        for (src, rel, dst), indptr in partition.indptr.items():
            _spread(np.asarray(indptr, dtype=np.int64), np.asarray(partition.indices[(src, rel, dst)]),
                    ranges[src][0], frontier[dst], int(fanout), drawn[src])
        for t in size:
            frontier[t] = np.exp(-total[t]) * -np.expm1(-drawn[t])
            total[t] += drawn[t]
    return total


def hot_order(partition: Partition, node_type: str, rule: str = HOT_ORDER) -> np.ndarray:
    """Global IDs of ``partition``'s owned nodes of ``node_type``, hottest first, by
    ``rule`` (one of :data:`HOT_ORDERS`)."""
    if rule not in HOT_ORDERS:
        raise ValueError(f"rule: expected one of {list(HOT_ORDERS)}, got {rule!r}")
    start, stop = partition.node_range(node_type)
    indptrs = [indptr for et, indptr in partition.indptr.items() if et[2] == node_type]
    if rule == "in_degree_v1":
        return in_degree_order(indptrs, start, stop - start)
    score = visit_scores(partition)[node_type]
    ids = np.arange(stop - start, dtype=np.int64)
    return np.lexsort((ids, -in_degree(indptrs, stop - start), -score)).astype(np.int64) + start


def plan_bitset(num_nodes: int, hot: Sequence[np.ndarray]) -> np.ndarray:
    """uint8 ``[ceil(num_nodes / 8)]``: bit ``v % 8`` of byte ``v // 8`` is set for each
    global ID ``v`` in any of ``hot`` (little-endian bit order, as ``np.packbits``)."""
    flags = np.zeros(num_nodes, dtype=bool)
    for ids in hot:
        flags[ids] = True
    return np.packbits(flags, bitorder="little")


@numba.njit(nogil=True, cache=True)
def _test_bits(bits: np.ndarray, ids: np.ndarray, num_nodes: int, out: np.ndarray) -> int:
    """``out[i]`` = bit ``ids[i]`` of ``bits``; returns the first ``i`` whose ID is not in
    ``0 .. num_nodes - 1`` (then ``out`` is incomplete), else -1."""
    for i in range(ids.size):
        v = ids[i]
        if v < 0 or v >= num_nodes:
            return i
        out[i] = (bits[v >> 3] >> (v & 7)) & 1
    return -1


def plan_flags(bits: np.ndarray, ids: np.ndarray, num_nodes: int) -> np.ndarray:
    """Bool ``[len(ids)]``: whether each global ID's bit is set in ``bits``
    (:func:`plan_bitset` of ``num_nodes`` nodes); one pass."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    mask = np.empty(ids.size, dtype=bool)
    bad = _test_bits(bits, ids, num_nodes, mask.view(np.uint8))
    if bad >= 0:
        raise ValueError(f"n_id: expected global node IDs in 0 .. {num_nodes - 1}, got "
                         f"{int(ids[bad])} at position {bad}")
    return mask
