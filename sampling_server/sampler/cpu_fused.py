"""Numba CPU kernels of the fused hop: draw, relabel and edge output straight into the
batch's arrays.

The generic path (:meth:`NeighborSampler.sample`) draws a hop into a fresh array, looks
the drawn IDs up in the relabel map, numbers the unseen ones, builds the targets with
``repeat_interleave`` and concatenates the hops at the end. The fused hop writes into
the batch's preallocated ``n_id``, ``row`` and ``col`` in three passes:

1. (parallel, blocks of :data:`BLOCK` frontier nodes) draw each node's neighbors into
   ``fanout`` slots per node and look each drawn ID up in the dense map. The block is
   walked once per kind of memory read (CSC offsets and original IDs; then draw
   positions, computed without memory reads; then neighbor IDs; then map entries), so
   the random reads of a block are independent of each other and overlap in the memory
   system, instead of one node's reads waiting for the previous node's; and the reads of
   the node :data:`DRAW_LOOKAHEAD` places ahead are prefetched;
2. (parallel) write each node's edges at its output offset: local source (or -1 while
   unseen) and local target;
3. (sequential) number the unseen sources in slot order (frontier order, then draw
   order): first-seen order, as the generic relabeler numbers them; the map entries of
   the node :data:`NUMBER_LOOKAHEAD` places ahead are prefetched.

A batch that asks for edges (an :class:`EdgeList` made with ``edges=True``) also gets
each edge's internal edge ID, aligned with ``row`` and ``col``: pass 1 writes it beside
each drawn neighbor (``edge_start`` + the position drawn in ``indices``), pass 2 beside
each edge; a batch that does not ask passes arrays without entries, which the passes skip.

The draws are :func:`cpu_kernels.sample_neighbors`', position for position.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

from protos.prefetch import prefetch
from sampling_server.sampler.cpu_glue import exclusive_offsets, total
from sampling_server.sampler.cpu_kernels import (
    edge_buffer,
    floyd_positions,
    node_stream,
    num_draws,
    parallel_guard,
    positions_to_sources,
    takes_all,
    uniform_below,
)

#: Entry of a dense relabel map for a node the batch has not numbered (local IDs are >= 0).
UNSEEN = -1
#: Frontier nodes per block of pass 1.
BLOCK = 256
#: Frontier nodes ahead of the one being processed whose random reads are requested
#: early (``llvm.prefetch``), so that the cache misses of several nodes are in flight at
#: once. Pass 1's neighbor-ID and map-entry walks (products-like's last hop, [15, 10, 5],
#: one thread: 22.3 ms without, 15.8 ms with 16 ahead):
DRAW_LOOKAHEAD = 16
#: ... and pass 3's numbering (the same hop: 9.4 ms without, 5.3 ms with 4 to 32 ahead).
NUMBER_LOOKAHEAD = 8


@numba.njit(nogil=True, cache=True)
def _positions(stream_key: np.uint64, hop: int, orig: int, degree: int, fanout: int,
               replace: bool, slots: np.ndarray, o: int) -> int:
    """One node's draw as positions in its CSC range, into ``slots[o:]``; how many."""
    c = num_draws(degree, fanout, replace)
    if c > 0 and takes_all(degree, fanout, replace):
        for t in range(c):
            slots[o + t] = t
    elif c > 0:
        stream = node_stream(stream_key, hop, orig)
        if replace:
            for t in range(c):
                slots[o + t] = uniform_below(stream, t, degree)
        else:
            floyd_positions(stream, degree, c, slots, o)
    return c


@numba.njit(nogil=True, cache=True)
def _draw_block(
    indptr: np.ndarray, indices: np.ndarray, orig_ids: np.ndarray, node_start: int,
    orig_is_global: bool, frontier: np.ndarray, lo: int, hi: int, fanout: int, key: np.uint64,
    hop: int, replace: bool, local_of: np.ndarray, slots: np.ndarray, lid: np.ndarray,
    counts: np.ndarray, first: np.ndarray, orig: np.ndarray, edge_start: int, edge_slots: np.ndarray,
) -> None:
    """Pass 1 for frontier nodes ``lo:hi``: draws into ``slots`` (``fanout`` per node),
    their map entries into ``lid``, the number drawn into ``counts``; their internal edge
    IDs into ``edge_slots`` (slot for slot) when that is not empty."""
    for i in range(lo, hi):  # CSC ranges and original IDs: independent random reads
        v = frontier[i] - node_start
        first[i] = indptr[v]
        counts[i] = indptr[v + 1] - first[i]  # the degree, for now
        orig[i] = frontier[i] if orig_is_global else orig_ids[v]
    for i in range(lo, hi):  # positions: arithmetic only
        counts[i] = _positions(key, hop, orig[i], counts[i], fanout, replace, slots, i * fanout)
    for i in range(lo, hi):  # neighbor IDs (and edge IDs)
        a = i + DRAW_LOOKAHEAD
        if a < hi:
            for p in range(a * fanout, a * fanout + counts[a]):
                prefetch(indices, first[a] + slots[p])  # type: ignore[call-arg]
        positions_to_sources(indices, first[i], slots, i * fanout, counts[i], edge_slots,
                             edge_start + first[i])
    for i in range(lo, hi):  # map entries
        o = i * fanout
        a = i + DRAW_LOOKAHEAD
        if a < hi:
            for p in range(a * fanout, a * fanout + counts[a]):
                prefetch(local_of, slots[p])  # type: ignore[call-arg]
        for p in range(o, o + counts[i]):
            lid[p] = local_of[slots[p]]


@numba.njit(parallel=True, nogil=True, cache=True)
def draw_and_look_up(
    indptr: np.ndarray, indices: np.ndarray, orig_ids: np.ndarray, node_start: int,
    orig_is_global: bool, frontier: np.ndarray, fanout: int, key: np.uint64, hop: int,
    replace: bool, local_of: np.ndarray, edge_start: int, want_edges: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pass 1 of a hop drawn here (``0 <= fanout``). Returns ``(slots, lid, base,
    counts, edge_slots)``: node ``i``'s draws are ``slots[base[i]:][:counts[i]]`` (global
    IDs), their map entries the same slice of ``lid``, their internal edge IDs that of
    ``edge_slots`` (``want_edges``; else it is empty). ``orig_is_global``: every owned
    node's original ID is its global ID (one range partition), so ``orig_ids`` is not read."""
    n = frontier.size
    counts = np.empty(n, dtype=np.int64)
    first = np.empty(n, dtype=np.int64)
    orig = np.empty(n, dtype=np.int64)
    slots = np.empty(n * fanout, dtype=np.int64)
    lid = np.empty(n * fanout, dtype=local_of.dtype)
    edge_slots = edge_buffer(n * fanout, want_edges)
    for b in numba.prange((n + BLOCK - 1) // BLOCK):
        _draw_block(indptr, indices, orig_ids, node_start, orig_is_global, frontier, b * BLOCK,
                    min(n, (b + 1) * BLOCK), fanout, key, hop, replace, local_of, slots, lid,
                    counts, first, orig, edge_start, edge_slots)
    base = np.arange(n) * fanout
    return slots, lid, base, counts, edge_slots


@numba.njit(parallel=True, nogil=True, cache=True)
def look_up_drawn(local_of: np.ndarray, neighbors: np.ndarray, counts: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Pass 1 of a hop drawn elsewhere (``neighbors`` grouped by frontier node, ``counts``
    per node). Returns ``(lid, base)`` as :func:`draw_and_look_up`."""
    base = exclusive_offsets(counts)
    lid = np.empty(neighbors.size, dtype=local_of.dtype)
    for p in numba.prange(neighbors.size):
        lid[p] = local_of[neighbors[p]]
    return lid, base


@numba.njit(parallel=True, nogil=True, cache=True)
def write_edges(lid: np.ndarray, base: np.ndarray, counts: np.ndarray, first_target: int,
                row: np.ndarray, col: np.ndarray, e_start: int, edge_ids: np.ndarray,
                edge: np.ndarray) -> np.ndarray:
    """Pass 2: node ``i``'s edges at ``e_start + offsets[i]`` (sources as in ``lid``,
    negative while unseen), and when ``edge`` is not empty their internal edge IDs (from
    ``edge_ids``, laid out as ``lid``). Returns the offsets (``[n + 1]``, from ``e_start``)."""
    offsets = exclusive_offsets(counts, e_start)
    for i in numba.prange(counts.size):
        o, b, target = offsets[i], base[i], first_target + i
        for t in range(counts[i]):
            row[o + t] = lid[b + t]
            col[o + t] = target
        if edge.size:
            for t in range(counts[i]):
                edge[o + t] = edge_ids[b + t]
    return offsets


@numba.njit(nogil=True, cache=True)
def number_unseen(slots: np.ndarray, lid: np.ndarray, base: np.ndarray, counts: np.ndarray,
                  offsets: np.ndarray, local_of: np.ndarray, count: int, n_id: np.ndarray,
                  row: np.ndarray) -> int:
    """Pass 3: number the sources still unseen in slot order (from ``count``, listed in
    ``n_id``) and fill in their ``row`` entries; returns the new count."""
    n = counts.size
    for i in range(n):
        b, o = base[i], offsets[i]
        if i + NUMBER_LOOKAHEAD < n:  # the map entries a later node will read
            ahead = base[i + NUMBER_LOOKAHEAD]
            for t in range(counts[i + NUMBER_LOOKAHEAD]):
                if lid[ahead + t] < 0:
                    prefetch(local_of, slots[ahead + t])  # type: ignore[call-arg]
        for t in range(counts[i]):
            if lid[b + t] >= 0:
                continue
            u = slots[b + t]
            lv = local_of[u]
            if lv < 0:
                lv = count
                local_of[u] = count
                n_id[count] = u
                count += 1
            row[o + t] = lv
    return count


@numba.njit(nogil=True, cache=True)
def number_seeds(local_of: np.ndarray, seeds: np.ndarray, n_id: np.ndarray) -> int:
    """Number ``seeds`` ``0 .. len-1`` (into ``local_of`` and ``n_id``); the index of the
    first repeated seed (after undoing the inserts), or -1."""
    for i in range(seeds.size):
        if local_of[seeds[i]] >= 0:
            for j in range(i):
                local_of[seeds[j]] = UNSEEN
            return i
        local_of[seeds[i]] = i
        n_id[i] = seeds[i]
    return -1


@numba.njit(parallel=True, nogil=True, cache=True)
def forget(local_of: np.ndarray, ids: np.ndarray) -> None:
    """Reset the entries of ``ids`` (distinct) to :data:`UNSEEN`."""
    for i in numba.prange(ids.size):
        local_of[ids[i]] = UNSEEN


class CscView:
    """What a hop drawn here reads: one relation's CSC over the owned destination nodes
    (the first owned, ``node_start``), and their original IDs; ``edge_start``: the
    internal edge ID of ``indices[0]``."""

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, orig_ids: np.ndarray,
                 node_start: int, orig_is_global: bool, edge_start: int = 0):
        self.indptr, self.indices, self.orig_ids = indptr, indices, orig_ids
        self.node_start = node_start
        self.edge_start = edge_start
        #: Whether every original ID is the global ID (then draws need not read them;
        #: :func:`rows.is_identity`).
        self.orig_is_global = orig_is_global


def _grown(buf: np.ndarray, used: int, need: int) -> np.ndarray:
    """``buf``, or a copy of its first ``used`` entries with room for ``need``."""
    if need <= buf.size:
        return buf
    out = np.empty(max(need, 2 * buf.size), dtype=buf.dtype)
    out[:used] = buf[:used]
    return out


class DenseMaps:
    """Dense relabel maps (global ID -> local ID) of ``num_nodes`` entries, all
    :data:`UNSEEN`, one per batch being sampled at once; a batch resets the entries it
    set before it gives its map back (:meth:`NodeList.close`)."""

    def __init__(self, num_nodes: int):
        self.num_nodes = num_nodes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self) -> np.ndarray:
        with self._lock:
            if self._free:
                return self._free.pop()
        dtype = np.int32 if self.num_nodes < 2**31 else np.int64
        return np.full(self.num_nodes, UNSEEN, dtype=dtype)

    def give_back(self, table: np.ndarray) -> None:
        with self._lock:
            self._free.append(table)


class NodeList:
    """One batch's nodes of one type: ``n_id`` (numbered in first-seen order) and the
    dense map (global ID -> local ID) numbering them, taken from ``maps`` until
    :meth:`close`."""

    def __init__(self, maps: DenseMaps, seeds: np.ndarray, capacity: int):
        self.maps, self.local_of = maps, maps.take()
        self.n_id = np.empty(max(capacity, seeds.size, 1), dtype=np.int64)
        self.count = 0
        dup = number_seeds(self.local_of, seeds, self.n_id)
        if dup >= 0:  # (its inserts undone: the map is all UNSEEN again)
            maps.give_back(self.local_of)
            raise ValueError(f"seeds: expected unique node IDs; {int(seeds[dup])} repeats")
        self.count = int(seeds.size)
        self.closed = False

    def ids(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """``n_id[lo:hi]`` (a view; ``hi`` defaults to the count)."""
        return self.n_id[lo:self.count if hi is None else hi]

    def close(self) -> None:
        """Reset the map's entries of this batch (the map is all :data:`UNSEEN` again)
        and give it back."""
        if not self.closed:
            with parallel_guard():  # a parallel kernel: one at a time under workqueue
                forget(self.local_of, self.n_id[:self.count])
            self.maps.give_back(self.local_of)
            self.closed = True


#: The internal edge IDs of a batch that asks for none (no entries: the passes skip them).
NO_EDGES = np.empty(0, dtype=np.int64)


class EdgeList:
    """One batch's edges (of one relation): local ``row`` and ``col``, hop after hop, and
    with ``edges`` their internal edge IDs (``edge``, aligned with them; else None)."""

    def __init__(self, capacity: int, edges: bool = False):
        self.row = np.empty(max(capacity, 1), dtype=np.int64)
        self.col = np.empty(max(capacity, 1), dtype=np.int64)
        self.edge: np.ndarray | None = np.empty(max(capacity, 1), dtype=np.int64) if edges else None
        self.size = 0
        self.per_hop: list[int] = []


def add_hop(nodes: NodeList, edges: EdgeList, first_target: int, slots: np.ndarray,
            lid: np.ndarray, base: np.ndarray, counts: np.ndarray, edge_ids: np.ndarray | None) -> None:
    """Passes 2 and 3 of a hop (after :func:`draw_and_look_up` or :func:`look_up_drawn`)
    into ``nodes`` and ``edges``, growing them as needed; ``edge_ids``: the drawn edges'
    internal IDs, laid out as ``slots`` (needed when ``edges`` keeps them)."""
    drawn = int(total(counts))
    nodes.n_id = _grown(nodes.n_id, nodes.count, min(nodes.count + drawn, nodes.local_of.size))
    edges.row = _grown(edges.row, edges.size, edges.size + drawn)
    edges.col = _grown(edges.col, edges.size, edges.size + drawn)
    edge = NO_EDGES
    if edges.edge is not None:
        if edge_ids is None or edge_ids.size < slots.size:
            got = None if edge_ids is None else edge_ids.size
            raise ValueError(f"edge_ids: expected the internal IDs of the {slots.size} drawn edges "
                             f"(the batch asks for edges), got {got}")
        edges.edge = edge = _grown(edges.edge, edges.size, edges.size + drawn)
    before = nodes.count
    offsets = write_edges(lid, base, counts, first_target, edges.row, edges.col, edges.size,
                          NO_EDGES if edge_ids is None else edge_ids, edge)
    nodes.count = int(number_unseen(slots, lid, base, counts, offsets, nodes.local_of, before,
                                    nodes.n_id, edges.row))
    edges.size += drawn
    edges.per_hop.append(drawn)


#: Most entries the buffers start with (they grow past it when a batch needs more).
START_CAPACITY_MAX = 1 << 23


def draw_hop(nodes: NodeList, edges: EdgeList, first_target: int, csc: CscView,
             frontier: np.ndarray, fanout: int, key: np.uint64, hop: int, replace: bool) -> None:
    """A hop drawn here (every ``frontier`` node owned, ``0 <= fanout``): the three passes
    into ``nodes`` (the sources' type) and ``edges`` (with the edges' internal IDs when
    it keeps them); the frontier's local IDs start at ``first_target``."""
    want_edges = edges.edge is not None
    with parallel_guard():
        slots, lid, base, counts, edge_ids = draw_and_look_up(
            csc.indptr, csc.indices, csc.orig_ids, csc.node_start, csc.orig_is_global, frontier,
            fanout, key, hop, replace, nodes.local_of, csc.edge_start, want_edges)
        add_hop(nodes, edges, first_target, slots, lid, base, counts, edge_ids if want_edges else None)


def relabel_hop(nodes: NodeList, edges: EdgeList, first_target: int, neighbors: np.ndarray,
                counts: np.ndarray, hop: int, edge_ids: np.ndarray | None = None) -> None:
    """A hop drawn elsewhere (``counts[i]`` neighbors of frontier node ``i``, grouped in
    ``neighbors``; ``edge_ids``: their internal edge IDs, aligned with them, needed when
    ``edges`` keeps them): the relabel's passes into ``nodes`` and ``edges``."""
    with parallel_guard():
        lid, base = look_up_drawn(nodes.local_of, neighbors, counts)
        add_hop(nodes, edges, first_target, neighbors, lid, base, counts, edge_ids)
