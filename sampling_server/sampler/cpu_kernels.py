"""Numba CPU kernels of the sampler: neighbor draws, dedup/relabel, row gathers.

Every kernel is a module-level ``@njit`` function over NumPy arrays; :mod:`cpu_sampler`
wraps them in the :class:`~sampling_server.sampler.base.NeighborSampler` interface. The
random numbers are :mod:`rng`'s functions compiled here, and the draw algorithms follow
``docs/sampling.md`` step by step, so these kernels draw exactly what the CUDA kernels
draw. Float expressions are single operations (no multiply-add), so FMA contraction on
the GPU cannot change a result.

Draw kernels run in two passes: draw counts per frontier node, an exclusive prefix sum
of them (the output offsets), then a parallel fill (``prange``) of each node's slice.
Asked for them (``want_edges``), they also write each drawn edge's internal edge ID
(``edge_start`` + its position in ``indices``) into an array aligned with the neighbors;
otherwise that array has no entries and the draws skip it, one test per node
(:func:`positions_to_sources`). Either way the same positions are drawn.
"""

from __future__ import annotations

import logging
import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numba
import numpy as np

from protos.prefetch import LINE, prefetch
from sampling_server.sampler import rng
from sampling_server.sampler.cpu_glue import exclusive_offsets
from sampling_server.sampler.rng import clone

#: Floyd's algorithm checks earlier picks by a linear scan up to this fanout, and with
#: a small hash set above it.
SCAN_MAX = 32
#: Load limit of the relabel hash table: it doubles before more than half is full.
MAX_LOAD_DIVISOR = 2
#: Frontiers smaller than this are drawn on one thread: starting the thread pool costs
#: more than it saves.
PARALLEL_MIN_NODES = 256
#: Draws with fanouts up to this go in one pass into fixed slots per node.
STRIDE_MAX_FANOUT = 64
#: Row gathers smaller than this run on one thread.
PARALLEL_MIN_ROWS = 1024
#: Empty-slot marker of the hash tables (global IDs and positions are >= 0).
EMPTY = -1
#: Frontier nodes ahead of the one being drawn whose offsets (``indptr``) and original
#: ID are requested early; at half this distance the node's offsets, by then in the
#: cache, are read and the start of its neighbor list is requested.
NODE_PREFETCH_DISTANCE = 32
#: Neighbor-list entries requested ahead per node (of a longer list, the first ones).
LIST_PREFETCH_ENTRIES = 64


mix64 = numba.njit(nogil=True)(clone(rng.mix64))
node_stream = numba.njit(nogil=True)(clone(rng.node_stream, mix64=mix64))
uniform = numba.njit(nogil=True)(clone(rng.uniform, mix64=mix64))
uniform_below = numba.njit(nogil=True)(clone(rng.uniform_below, uniform=uniform))

_WORKQUEUE_LOCK = threading.Lock()


def parallel_guard() -> AbstractContextManager[Any]:
    """What to hold while a parallel kernel runs.

    Numba's ``workqueue`` threading layer (the fallback when neither TBB nor OpenMP is
    installed) aborts the process if two threads enter parallel code at once, so then
    parallel kernels take turns; with ``omp`` or ``tbb`` they run concurrently.
    """
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet: the layer is not chosen
        return _WORKQUEUE_LOCK
    return _WORKQUEUE_LOCK if layer == "workqueue" else nullcontext()


def log_threading_layer(logger: logging.Logger, prefix: str = "") -> str:
    """Log :func:`threading_layer` with what it means (a warning for ``workqueue``);
    returns it."""
    layer = threading_layer()
    (logger.warning if layer == "workqueue" else logger.info)(
        "%sNumba threading layer %r: %s", prefix, layer, LAYER_NOTES.get(layer, ""))
    return layer


#: What each of Numba's threading layers means for a server, as its log says it.
LAYER_NOTES = {
    "omp": "OpenMP: concurrent batches and peer calls run their parallel kernels at once",
    "tbb": "TBB: concurrent batches and peer calls run their parallel kernels at once",
    "workqueue": ("neither OpenMP (libgomp.so.1) nor TBB could be loaded, so the parallel "
                  "kernels of concurrent batches and peer calls run one at a time; install "
                  "libgomp1 (Debian/Ubuntu: apt-get install libgomp1) for the omp layer"),
}


def threading_layer() -> str:
    """The Numba threading layer of this process's parallel kernels (``omp``, ``tbb`` or
    ``workqueue``), loaded now by a trivial parallel kernel if none has run yet. Numba
    picks TBB, else OpenMP, else its own ``workqueue``, which cannot run two parallel
    kernels at once (:func:`parallel_guard`); ``NUMBA_THREADING_LAYER`` overrides it."""
    try:
        return str(numba.threading_layer())
    except ValueError:  # not chosen yet
        _parallel_sum(2)
        return str(numba.threading_layer())


@numba.njit(parallel=True, nogil=True, cache=True)
def _parallel_sum(n: int) -> int:
    total = 0
    for i in numba.prange(n):
        total += i
    return total


# -- draw counts ---------------------------------------------------------------------
@numba.njit(nogil=True, cache=True)
def num_draws(degree: int, fanout: int, replace: bool) -> int:
    """Neighbors drawn for a node of in-degree ``degree`` (``fanout == -1``: all)."""
    if degree == 0 or fanout == 0:
        return 0
    if fanout < 0:
        return degree
    if replace:
        return fanout
    return min(degree, fanout)


@numba.njit(nogil=True, cache=True)
def takes_all(degree: int, fanout: int, replace: bool) -> bool:
    """Whether a node's draw is simply all its in-neighbors, in CSC order."""
    return fanout < 0 or (not replace and degree <= fanout)


@numba.njit(nogil=True, cache=True)
def _node_draws(indptr: np.ndarray, nodes: np.ndarray, node_start: int, fanout: int,
                replace: bool, i: int) -> int:
    lv = nodes[i] - node_start
    return num_draws(indptr[lv + 1] - indptr[lv], fanout, replace)


# -- without replacement, unweighted: Floyd's algorithm -------------------------------
@numba.njit(nogil=True, cache=True)
def _set_slot(table: np.ndarray, value: int) -> np.int64:
    """Slot of ``value`` in an open-addressing set (power-of-two size, linear probing):
    where it is, or the empty slot where it would go."""
    mask = table.size - 1
    slot = np.int64(mix64(np.uint64(value)) & np.uint64(mask))
    while table[slot] != EMPTY and table[slot] != value:
        slot = (slot + 1) & mask
    return slot


@numba.njit(nogil=True, cache=True)
def _floyd_scan(stream: np.uint64, degree: int, k: int, out: np.ndarray, o: int) -> None:
    """:func:`floyd_positions` for small ``k``: earlier picks are found by a scan of
    ``out`` (no allocation: this runs once per frontier node)."""
    for t in range(k):
        j = degree - k + t
        r = uniform_below(stream, t, j + 1)
        for s in range(o, o + t):
            if out[s] == r:
                r = j
                break
        out[o + t] = r


@numba.njit(nogil=True, cache=True)
def _floyd_table(stream: np.uint64, degree: int, k: int, out: np.ndarray, o: int) -> None:
    """:func:`floyd_positions` for large ``k``: earlier picks in an open-addressing set."""
    size = 1
    while size < 2 * k:
        size *= 2
    table = np.full(size, EMPTY, dtype=np.int64)
    for t in range(k):
        j = degree - k + t
        r = uniform_below(stream, t, j + 1)
        slot = _set_slot(table, r)
        if table[slot] == r:
            r = j
            slot = _set_slot(table, r)
        table[slot] = r
        out[o + t] = r


@numba.njit(nogil=True, cache=True)
def floyd_positions(stream: np.uint64, degree: int, k: int, out: np.ndarray, o: int) -> None:
    """Floyd's uniform ``k``-subset of ``range(degree)`` into ``out[o:o+k]``, in draw
    order: draw ``t`` picks ``r = uniform_below(stream, t, j+1)`` with ``j = degree-k+t``,
    or ``j`` itself when ``r`` was picked before."""
    if k <= SCAN_MAX:
        _floyd_scan(stream, degree, k, out, o)
    else:
        _floyd_table(stream, degree, k, out, o)


@numba.njit(inline="always", nogil=True, cache=True)
def _all_edges(indices: np.ndarray, first: int, c: int, out: np.ndarray, o: int, edges: np.ndarray,
               edge_first: int) -> None:
    """A node's draw of all its ``c`` in-edges: their sources into ``out[o:o+c]``, in CSC
    order, and (``edges`` not empty) their internal IDs from ``edge_first`` into ``edges``."""
    for t in range(c):  # (a loop: slice assignment costs seconds of compile time)
        out[o + t] = indices[first + t]
    if edges.size:
        for t in range(c):
            edges[o + t] = edge_first + t


@numba.njit(inline="always", nogil=True, cache=True)
def positions_to_sources(indices: np.ndarray, first: int, out: np.ndarray, o: int, c: int,
                         edges: np.ndarray, edge_first: int) -> None:
    """``out[o:o+c]``, positions in a node's CSC range (from ``first``), into the sources
    there; first, when ``edges`` is not empty, each position's internal edge ID
    (``edge_first`` + position) into ``edges[o:o+c]``."""
    if edges.size:
        for t in range(o, o + c):
            edges[t] = edge_first + out[t]
    for t in range(o, o + c):
        out[t] = indices[first + out[t]]


# (inlined into the kernels' loops: a call per node cost 3-8 % of a hop once the edge IDs'
# tests were in its body, measured against the draws without them)
@numba.njit(inline="always", nogil=True, cache=True)
def _draw_uniform(
    indptr: np.ndarray, indices: np.ndarray, orig_ids: np.ndarray, node_start: int, v: int,
    fanout: int,
    key: np.uint64, hop: int, replace: bool, out: np.ndarray, o: int, edges: np.ndarray,
    edge_start: int,
) -> int:
    """Node ``v``'s unweighted draw into ``out[o:]`` (its edges' internal IDs into
    ``edges[o:]`` when that is not empty); returns how many it drew. The draw is keyed
    by ``v``'s original ID (``orig_ids[v - node_start]``)."""
    first = indptr[v - node_start]
    degree = indptr[v - node_start + 1] - first
    c = num_draws(degree, fanout, replace)
    if c > 0 and takes_all(degree, fanout, replace):
        _all_edges(indices, first, c, out, o, edges, edge_start + first)
    elif c > 0:
        stream = node_stream(key, hop, orig_ids[v - node_start])
        if replace and not edges.size:  # one pass
            for t in range(c):
                out[o + t] = indices[first + uniform_below(stream, t, degree)]
            return c
        if replace:
            for t in range(c):
                out[o + t] = uniform_below(stream, t, degree)
        else:
            floyd_positions(stream, degree, c, out, o)
        positions_to_sources(indices, first, out, o, c, edges, edge_start + first)
    return c


@numba.njit(inline="always", nogil=True, cache=True)
def _prefetch_nodes(indptr: np.ndarray, indices: np.ndarray, orig_ids: np.ndarray, node_start: int,
                    nodes: np.ndarray, i: int) -> None:
    """While node ``i`` of ``nodes`` is drawn, ask for what later nodes' draws read at
    random: offsets and original ID :data:`NODE_PREFETCH_DISTANCE` nodes ahead, the
    neighbor list half as far ahead (each a cache miss that would otherwise stall its
    node's draw)."""
    a = i + NODE_PREFETCH_DISTANCE
    if a < nodes.size:
        prefetch(indptr, nodes[a] - node_start)  # type: ignore[call-arg]
        prefetch(orig_ids, nodes[a] - node_start)
    b = i + NODE_PREFETCH_DISTANCE // 2
    if b < nodes.size:
        lv = nodes[b] - node_start
        first = indptr[lv]
        for e in range(first, min(indptr[lv + 1], first + LIST_PREFETCH_ENTRIES),
                       max(1, LINE // indices.itemsize)):
            prefetch(indices, e)  # type: ignore[call-arg]


@numba.njit(inline="always", nogil=True, cache=True)
def edge_buffer(size: int, want_edges: bool) -> np.ndarray:
    """The internal edge IDs' output: ``size`` entries when asked for, else none."""
    return np.empty(size if want_edges else 0, dtype=np.int64)


@numba.njit(parallel=True, nogil=True, cache=True)
def sample_uniform_parallel(
    indptr: np.ndarray, indices: np.ndarray, orig_ids: np.ndarray, node_start: int,
    nodes: np.ndarray, fanout: int, key: np.uint64, hop: int, replace: bool, edge_start: int,
    want_edges: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unweighted draws for ``nodes``: ``(offsets [F+1], neighbors, edges)``, neighbors in
    global IDs, edges their internal edge IDs (``want_edges``; else empty)."""
    n = nodes.size
    counts = np.empty(n, dtype=np.int64)
    if 0 <= fanout <= STRIDE_MAX_FANOUT:  # then compact: each node's offsets read once, not twice
        slots = np.empty(n * fanout, dtype=np.int64)
        edge_slots = edge_buffer(n * fanout, want_edges)
        for i in numba.prange(n):
            _prefetch_nodes(indptr, indices, orig_ids, node_start, nodes, i)
            counts[i] = _draw_uniform(indptr, indices, orig_ids, node_start, nodes[i], fanout, key, hop,
                                      replace, slots, i * fanout, edge_slots, edge_start)
        offsets = exclusive_offsets(counts)
        out = np.empty(offsets[n], dtype=np.int64)
        edges = edge_buffer(offsets[n], want_edges)
        for i in numba.prange(n):
            for t in range(counts[i]):
                out[offsets[i] + t] = slots[i * fanout + t]
            if want_edges:
                for t in range(counts[i]):
                    edges[offsets[i] + t] = edge_slots[i * fanout + t]
        return offsets, out, edges
    for i in numba.prange(n):
        counts[i] = _node_draws(indptr, nodes, node_start, fanout, replace, i)
    offsets = exclusive_offsets(counts)
    out = np.empty(offsets[n], dtype=np.int64)
    edges = edge_buffer(offsets[n], want_edges)
    for i in numba.prange(n):
        _prefetch_nodes(indptr, indices, orig_ids, node_start, nodes, i)
        _draw_uniform(indptr, indices, orig_ids, node_start, nodes[i], fanout, key, hop, replace, out,
                      offsets[i], edges, edge_start)
    return offsets, out, edges


@numba.njit(nogil=True, cache=True)
def _grown(buf: np.ndarray, used: int, need: int) -> np.ndarray:
    """``buf``, or a copy of its first ``used`` entries with room for ``need``."""
    if need <= buf.size:
        return buf
    grown = np.empty(max(need, 2 * buf.size), dtype=buf.dtype)
    for t in range(used):
        grown[t] = buf[t]
    return grown


@numba.njit(nogil=True, cache=True)
def sample_uniform_serial(
    indptr: np.ndarray, indices: np.ndarray, orig_ids: np.ndarray, node_start: int,
    nodes: np.ndarray, fanout: int, key: np.uint64, hop: int, replace: bool, edge_start: int,
    want_edges: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`sample_uniform_parallel` on one thread (small frontiers): one pass, the
    outputs grown as needed."""
    offsets = np.zeros(nodes.size + 1, dtype=np.int64)
    cap = max(16, nodes.size * (fanout if fanout > 0 else 8))
    out = np.empty(cap, dtype=np.int64)
    edges = edge_buffer(cap, want_edges)
    for i in range(nodes.size):
        need = offsets[i] + _node_draws(indptr, nodes, node_start, fanout, replace, i)
        out = _grown(out, offsets[i], need)
        if want_edges:
            edges = _grown(edges, offsets[i], need)
        offsets[i + 1] = offsets[i] + _draw_uniform(indptr, indices, orig_ids, node_start, nodes[i],
                                                    fanout, key, hop, replace, out, offsets[i], edges,
                                                    edge_start)
    end = offsets[nodes.size]
    return offsets, out[:end], edges[:end if want_edges else 0]


# -- weighted ------------------------------------------------------------------------
@numba.njit(parallel=True, nogil=True, cache=True)
def segmented_cumsum(indptr: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """float64 ``[E]``: the inclusive prefix sum of ``weight`` within each node's CSC
    range (restarting at every node, so it does not depend on the partitioning)."""
    out = np.empty(weight.size, dtype=np.float64)
    for lv in numba.prange(indptr.size - 1):
        acc = 0.0
        for e in range(indptr[lv], indptr[lv + 1]):
            acc += np.float64(weight[e])
            out[e] = acc
    return out


@numba.njit(nogil=True, cache=True)
def _worse(score: np.ndarray, pos: np.ndarray, a: int, b: int) -> bool:
    """Heap order of the ES top-k: ``a`` ranks below ``b`` (lower score, or equal
    score and higher position)."""
    return score[a] < score[b] or (score[a] == score[b] and pos[a] > pos[b])


@numba.njit(nogil=True, cache=True)
def _sift_down(score: np.ndarray, pos: np.ndarray, i: int) -> None:
    n = score.size
    while True:
        low, left, right = i, 2 * i + 1, 2 * i + 2
        if left < n and _worse(score, pos, left, low):
            low = left
        if right < n and _worse(score, pos, right, low):
            low = right
        if low == i:
            return
        score[i], score[low] = score[low], score[i]
        pos[i], pos[low] = pos[low], pos[i]
        i = low


@numba.njit(nogil=True, cache=True)
def _heapsort(a: np.ndarray) -> None:
    """Sort ``a`` in place, ascending (``ndarray.sort`` costs seconds of compile time)."""
    n = a.size
    for start in range(n // 2 - 1, -1, -1):
        _sift_down_values(a, start, n)
    for end in range(n - 1, 0, -1):
        a[0], a[end] = a[end], a[0]
        _sift_down_values(a, 0, end)


@numba.njit(nogil=True, cache=True)
def _sift_down_values(a: np.ndarray, i: int, n: int) -> None:
    while True:
        big, left, right = i, 2 * i + 1, 2 * i + 2
        if left < n and a[left] > a[big]:
            big = left
        if right < n and a[right] > a[big]:
            big = right
        if big == i:
            return
        a[i], a[big] = a[big], a[i]
        i = big


@numba.njit(nogil=True, cache=True)
def es_positions(
    stream: np.uint64, weight: np.ndarray, first: int, degree: int, k: int,
    out: np.ndarray, o: int,
) -> None:
    """Efraimidis–Spirakis: the ``k`` positions with the highest
    ``log(1 - uniform(stream, e)) / w_e`` (ties: the lower position) into
    ``out[o:o+k]``, ascending. A min-heap of the best ``k`` so far; root = worst."""
    score = np.empty(k, dtype=np.float64)
    pos = out[o:o + k]
    for e in range(degree):
        s = np.log(1.0 - uniform(stream, e)) / np.float64(weight[first + e])
        if e < k:  # heap push, then sift up
            i = e
            score[i], pos[i] = s, e
            while i > 0 and _worse(score, pos, i, (i - 1) // 2):
                p = (i - 1) // 2
                score[i], score[p] = score[p], score[i]
                pos[i], pos[p] = pos[p], pos[i]
                i = p
        elif s > score[0]:  # e is after every kept position, so a tie keeps the root
            score[0], pos[0] = s, e
            _sift_down(score, pos, 0)
    _heapsort(pos)


@numba.njit(nogil=True, cache=True)
def weighted_position(cum: np.ndarray, first: int, degree: int, u: float) -> int:
    """First position ``e`` of the range whose inclusive cumulative weight
    ``cum[first+e]`` exceeds ``u`` (binary search); the last one if none does."""
    lo, hi = first, first + degree - 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if cum[mid] > u:
            hi = mid
        else:
            lo = mid + 1
    return lo - first


@numba.njit(nogil=True, cache=True)
def _fill_weighted(
    indptr: np.ndarray, indices: np.ndarray, weight: np.ndarray, cum: np.ndarray,
    orig_ids: np.ndarray, node_start: int, nodes: np.ndarray, fanout: int, key: np.uint64, hop: int,
    replace: bool,
    offsets: np.ndarray, out: np.ndarray, i: int, edges: np.ndarray, edge_start: int,
) -> None:
    """Pass 2 for frontier node ``i``: its edge-weighted draw into its slice of ``out`` (and
    of ``edges``, the internal edge IDs, when that is not empty)."""
    v = nodes[i]
    first = indptr[v - node_start]
    degree = indptr[v - node_start + 1] - first
    o, c = offsets[i], offsets[i + 1] - offsets[i]
    if c > 0 and takes_all(degree, fanout, replace):
        _all_edges(indices, first, c, out, o, edges, edge_start + first)
    elif c > 0:
        stream = node_stream(key, hop, orig_ids[v - node_start])
        if replace:
            total = cum[first + degree - 1]
            for t in range(c):
                u = uniform(stream, t) * total
                out[o + t] = weighted_position(cum, first, degree, u)
        else:
            es_positions(stream, weight, first, degree, c, out, o)
        positions_to_sources(indices, first, out, o, c, edges, edge_start + first)


@numba.njit(parallel=True, nogil=True, cache=True)
def sample_weighted_parallel(
    indptr: np.ndarray, indices: np.ndarray, weight: np.ndarray, cum: np.ndarray,
    orig_ids: np.ndarray, node_start: int, nodes: np.ndarray, fanout: int, key: np.uint64, hop: int,
    replace: bool, edge_start: int, want_edges: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Edge-weighted draws for ``nodes``: ``(offsets [F+1], neighbors, edges)`` as
    :func:`sample_uniform_parallel`'s."""
    counts = np.empty(nodes.size, dtype=np.int64)
    for i in numba.prange(nodes.size):
        counts[i] = _node_draws(indptr, nodes, node_start, fanout, replace, i)
    offsets = exclusive_offsets(counts)
    out = np.empty(offsets[nodes.size], dtype=np.int64)
    edges = edge_buffer(offsets[nodes.size], want_edges)
    for i in numba.prange(nodes.size):
        _fill_weighted(indptr, indices, weight, cum, orig_ids, node_start, nodes, fanout, key, hop,
                       replace, offsets, out, i, edges, edge_start)
    return offsets, out, edges


#: :func:`sample_weighted_parallel` on one thread (small frontiers): its ``prange`` loops
#: are plain loops without ``parallel``.
sample_weighted_serial = numba.njit(nogil=True, cache=True)(
    clone(sample_weighted_parallel.py_func, "sample_weighted_serial"))


def sample_neighbors(
    indptr: np.ndarray, indices: np.ndarray, orig_ids: np.ndarray, node_start: int, nodes: np.ndarray,
    fanout: int, key: np.uint64, hop: int, replace: bool,
    weights: tuple[np.ndarray, np.ndarray] | None = None, *, edge_start: int = 0, edges: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Host launcher: the draws of ``nodes`` (global IDs; ``fanout`` -1 = all), ``(offsets
    [F+1], neighbors, edge IDs)``, unweighted or in proportion to ``weights`` (the edge
    weights and their :func:`segmented_cumsum`); parallel over nodes for large frontiers.
    With ``edges``, the third is each drawn edge's internal ID (``edge_start`` plus its
    position in ``indices``), aligned with the neighbors; else None."""
    args: tuple[Any, ...] = (indptr, indices, orig_ids, node_start, nodes, fanout, key, hop, replace,
                             int(edge_start), bool(edges))
    kernels: tuple[Any, Any] = (sample_uniform_serial, sample_uniform_parallel)
    if weights is not None:
        args = (indptr, indices, *weights, *args[2:])
        kernels = (sample_weighted_serial, sample_weighted_parallel)
    if nodes.size < PARALLEL_MIN_NODES:
        offsets, out, edge_ids = kernels[0](*args)
    else:
        with parallel_guard():
            offsets, out, edge_ids = kernels[1](*args)
    return offsets, out, (edge_ids if edges else None)


# -- dedup / relabel ------------------------------------------------------------------
@numba.njit(nogil=True, cache=True)
def table_insert_unique(keys: np.ndarray, values: np.ndarray, ids: np.ndarray, first: int) -> int:
    """Insert ``ids[i]`` with value ``first + i``; the index of the first ID already in
    the table, or -1. The table must have room for all of them."""
    for i in range(ids.size):
        slot = _set_slot(keys, ids[i])
        if keys[slot] == ids[i]:
            return i
        keys[slot] = ids[i]
        values[slot] = first + i
    return -1


@numba.njit(nogil=True, cache=True)
def table_add(
    keys: np.ndarray, values: np.ndarray, count: int, limit: int, ids: np.ndarray,
    start: int, first_new: int, new_ids: np.ndarray, local: np.ndarray,
) -> tuple[int, int]:
    """Relabel ``ids[start:]``: ``local[i]`` is the value of ``ids[i]``, inserting unseen
    IDs with the next value ``count`` (and listing them in ``new_ids[count - first_new]``).
    Stops before the table would hold more than ``limit`` keys; returns where it stopped
    and the new count."""
    for i in range(start, ids.size):
        slot = _set_slot(keys, ids[i])
        if keys[slot] == EMPTY:
            if count >= limit:
                return i, count
            keys[slot] = ids[i]
            values[slot] = count
            new_ids[count - first_new] = ids[i]
            count += 1
        local[i] = values[slot]
    return ids.size, count


@numba.njit(nogil=True, cache=True)
def table_rehash(keys: np.ndarray, values: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The same table with ``size`` slots (a power of two larger than its count)."""
    new_keys = np.full(size, EMPTY, dtype=np.int64)
    new_values = np.empty(size, dtype=np.int64)
    for s in range(keys.size):
        if keys[s] != EMPTY:
            slot = _set_slot(new_keys, keys[s])
            new_keys[slot] = keys[s]
            new_values[slot] = values[s]
    return new_keys, new_values
