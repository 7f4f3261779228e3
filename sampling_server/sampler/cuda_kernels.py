"""Numba CUDA kernels of the GPU sampler, each with its host launcher beside it.

Kernels are module-level ``@cuda.jit`` functions with one thread per item (frontier
node, sampled neighbor, hash slot, feature element) and a bounds check first. Their
launchers allocate outputs as torch tensors on :func:`cuda_launch.torch_device`, return early on
empty input, size the grid and launch on PyTorch's current stream, so kernels and torch
ops stay ordered without a synchronisation. Tensors reach the kernels without a copy
(:func:`kernel_arg`).

Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, no GPU) the same kernels run
on torch CPU tensors through their ``.numpy()`` views; that is how CI tests them.

The draws follow :mod:`rng` exactly as the CPU kernels do, so both devices return the
same neighbors for the same ``(batch key, hop, node)``. :data:`SIGNATURES` lists the
argument types every launcher passes; :mod:`ptx_check` compiles each kernel with them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numba import cuda
from numba import types as nbt

from sampling_server.sampler import rng
from sampling_server.sampler.cuda_launch import kernel_arg, launch
from sampling_server.sampler.rng import clone

#: Hash-table slot marker: no key.
EMPTY = -1
#: ``first`` of a slot not seen in the current hop.
NEVER = np.iinfo(np.int64).max


def _device(fn: Callable[..., Any], **callees: Any) -> Any:
    """Compile the plain-Python helper ``fn`` as an inlined device function whose calls to
    ``callees`` (by global name) go to their device versions."""
    return cuda.jit(device=True, inline="always")(clone(fn, **callees))


_mix64 = _device(rng.mix64)
_node_stream = _device(rng.node_stream, mix64=_mix64)
_uniform = _device(rng.uniform, mix64=_mix64)
_uniform_below = _device(rng.uniform_below, uniform=_uniform)

# Argument types as the launchers pass them (C-contiguous arrays, int64/uint64 scalars).
I64 = nbt.int64[::1]
_F32 = nbt.float32[::1]
_F64 = nbt.float64[::1]
S64 = nbt.int64
_KEY = nbt.uint64
FEATURE_DTYPES = (nbt.float32, nbt.float16, nbt.float64)

#: Kernel name -> the argument-type tuples its launcher uses (what ptx_check compiles).
SIGNATURES: dict[str, list[tuple[Any, ...]]] = {}
#: Kernel name -> kernel.
KERNELS: dict[str, Any] = {}


def register(kernel: Any, *sigs: tuple[Any, ...]) -> None:
    """Add ``kernel`` and its launchers' argument types to :data:`KERNELS` and :data:`SIGNATURES`."""
    name = kernel.__name__
    KERNELS[name] = kernel
    SIGNATURES[name] = list(sigs)


# -- neighbor sampling -------------------------------------------------------------------
@dataclass
class CscArgs:
    """The partition's CSC as kernel arguments (in device or mapped host memory)."""

    #: int64 ``[n_p+1]`` CSC offsets.
    indptr: Any
    #: int64 ``[e_p]`` global source IDs.
    indices: Any
    #: int64 ``[n_p]`` original ID of each owned node (the key of its draws).
    orig_ids: Any
    #: First global ID owned by the partition.
    node_start: int
    #: float32 ``[e_p]`` edge weights (weighted sampling without replacement), or None.
    weight: Any = None
    #: float64 ``[e_p]`` running sums of the weights within each node's in-edges
    #: (weighted, with replacement), or None.
    cumweight: Any = None
    #: Internal edge ID of ``indices[0]`` (:attr:`partitioner.partition.Structure.edge_start`).
    edge_start: int = 0


@cuda.jit
def count_kernel(nodes, indptr, node_start, fanout, replace, counts):  # type: ignore[no-untyped-def]
    """counts[i] = how many neighbors frontier node i draws."""
    i = cuda.grid(1)
    if i >= nodes.size:
        return
    v = nodes[i] - node_start
    d = indptr[v + 1] - indptr[v]
    if fanout < 0:
        counts[i] = d
    elif replace:
        counts[i] = fanout if d > 0 else 0
    else:
        counts[i] = min(d, fanout)


register(count_kernel, (I64, I64, S64, S64, nbt.boolean, I64))


def count_draws(
    nodes: torch.Tensor, indptr: Any, node_start: int, fanout: int, replace: bool
) -> torch.Tensor:
    """int64 ``[F]`` number of neighbors each frontier node draws."""
    counts = torch.empty(nodes.numel(), dtype=torch.int64, device=nodes.device)
    if nodes.numel():
        launch(count_kernel, nodes.numel(), kernel_arg(nodes), indptr, np.int64(node_start),
               np.int64(fanout), bool(replace), kernel_arg(counts))
    return counts


@cuda.jit(device=True, inline="always")
def _put(indices, lo, p, out, at, edges, edge_first):  # type: ignore[no-untyped-def]
    """Position ``p`` of the CSC range from ``lo`` as a draw: its source into ``out[at]``
    and, when ``edges`` is not empty, its internal edge ID (``edge_first + p``) into
    ``edges[at]``."""
    out[at] = indices[lo + p]
    if edges.size:
        edges[at] = edge_first + p


@cuda.jit(device=True, inline="always")
def _copy_all(indices, lo, d, out, off, edges, edge_first):  # type: ignore[no-untyped-def]
    """All ``d`` in-edges from ``lo``, in CSC order, as draws into ``out[off:]``."""
    for t in range(d):
        _put(indices, lo, t, out, off + t, edges, edge_first)


@cuda.jit(device=True, inline="always")
def _to_sources(indices, lo, out, off, k, edges, edge_first):  # type: ignore[no-untyped-def]
    """``out[off:off+k]``, positions in the CSC range from ``lo``, as draws there."""
    for t in range(k):
        _put(indices, lo, out[off + t], out, off + t, edges, edge_first)


@cuda.jit(device=True, inline="always")
def _frontier_node(nodes, indptr, node_start, offsets, i):  # type: ignore[no-untyped-def]
    """Frontier node i's row among the owned nodes, its first in-edge, its in-degree and
    where its draws go in the output."""
    v = nodes[i] - node_start
    lo = indptr[v]
    return v, lo, indptr[v + 1] - lo, offsets[i]


@cuda.jit
def fill_uniform_kernel(nodes, indptr, indices, orig_ids, node_start, fanout, key, hop, offsets, out,  # type: ignore[no-untyped-def]
                        edge_start, edges):
    """Uniform draws without replacement (Robert Floyd's algorithm) of frontier node i;
    their internal edge IDs into ``edges`` unless it is empty (as in every fill kernel)."""
    i = cuda.grid(1)
    if i >= nodes.size:
        return
    v, lo, d, off = _frontier_node(nodes, indptr, node_start, offsets, i)
    if fanout < 0 or d <= fanout:
        _copy_all(indices, lo, d, out, off, edges, edge_start + lo)
        return
    stream = _node_stream(key, hop, orig_ids[v])
    # Floyd: the t-th pick is uniform in [0, j]; a position already taken becomes j.
    # The picks so far sit in out[off:off+t], which is the membership set.
    for t in range(fanout):
        j = d - fanout + t
        r = _uniform_below(stream, np.int64(t), j + 1)
        for s in range(t):
            if out[off + s] == r:
                r = j
                break
        out[off + t] = r
    _to_sources(indices, lo, out, off, fanout, edges, edge_start + lo)


@cuda.jit
def fill_uniform_replace_kernel(nodes, indptr, indices, orig_ids, node_start, fanout, key, hop, offsets,  # type: ignore[no-untyped-def]
                                out, edge_start, edges):
    """Uniform draws with replacement of frontier node i."""
    i = cuda.grid(1)
    if i >= nodes.size:
        return
    v, lo, d, off = _frontier_node(nodes, indptr, node_start, offsets, i)
    if d == 0:
        return
    if fanout < 0:
        _copy_all(indices, lo, d, out, off, edges, edge_start + lo)
        return
    stream = _node_stream(key, hop, orig_ids[v])
    for t in range(fanout):
        _put(indices, lo, _uniform_below(stream, np.int64(t), d), out, off + t, edges, edge_start + lo)


_FILL_SIG = (I64, I64, I64, I64, S64, S64, _KEY, S64, I64, I64, S64, I64)
register(fill_uniform_kernel, _FILL_SIG)
register(fill_uniform_replace_kernel, _FILL_SIG)


@cuda.jit(device=True, inline="always")
def _worse(score, out, a, b):  # type: ignore[no-untyped-def]
    """Whether heap entry a ranks below entry b: a lower score, ties to the later position."""
    return score[a] < score[b] or (score[a] == score[b] and out[a] > out[b])


@cuda.jit(device=True, inline="always")
def _swap(score, out, a, b):  # type: ignore[no-untyped-def]
    s = score[a]
    score[a] = score[b]
    score[b] = s
    p = out[a]
    out[a] = out[b]
    out[b] = p


@cuda.jit(device=True, inline="always")
def _sift_down(score, out, off, n):  # type: ignore[no-untyped-def]
    """Restore the heap (worst entry at ``off``) after its root was replaced."""
    at = 0
    while True:
        low = at
        left = 2 * at + 1
        if left < n and _worse(score, out, off + left, off + low):
            low = left
        if left + 1 < n and _worse(score, out, off + left + 1, off + low):
            low = left + 1
        if low == at:
            return
        _swap(score, out, off + at, off + low)
        at = low


@cuda.jit(device=True, inline="always")
def _sift_up(score, out, off, at):  # type: ignore[no-untyped-def]
    while at > 0:
        parent = (at - 1) // 2
        if not _worse(score, out, off + at, off + parent):
            return
        _swap(score, out, off + at, off + parent)
        at = parent


@cuda.jit
def fill_weighted_kernel(nodes, indptr, indices, orig_ids, weight, node_start, fanout, key, hop, offsets,  # type: ignore[no-untyped-def]
                         out, edge_start, edges, score):
    """Weighted draws without replacement (Efraimidis–Spirakis) of frontier node i: the
    ``fanout`` highest ``log(1 - u_e) / w_e``, output in CSC order.

    ``out[off:off+k]`` and ``score[off:off+k]`` hold a heap of the best ``k`` so far with
    the worst at the root, so any fanout works without a local array.
    """
    i = cuda.grid(1)
    if i >= nodes.size:
        return
    v, lo, d, off = _frontier_node(nodes, indptr, node_start, offsets, i)
    if fanout < 0 or d <= fanout:
        _copy_all(indices, lo, d, out, off, edges, edge_start + lo)
        return
    if fanout == 0:
        return
    stream = _node_stream(key, hop, orig_ids[v])
    for e in range(d):
        s = math.log(1.0 - _uniform(stream, np.int64(e))) / weight[lo + e]
        if e < fanout:
            score[off + e] = s
            out[off + e] = e
            _sift_up(score, out, off, e)
        elif s > score[off]:  # e comes after every kept position, so ties keep the old one
            score[off] = s
            out[off] = e
            _sift_down(score, out, off, fanout)
    # ascending CSC positions (insertion sort), then positions -> source IDs
    for t in range(1, fanout):
        p = out[off + t]
        s = t
        while s > 0 and out[off + s - 1] > p:
            out[off + s] = out[off + s - 1]
            s -= 1
        out[off + s] = p
    _to_sources(indices, lo, out, off, fanout, edges, edge_start + lo)


register(fill_weighted_kernel, (I64, I64, I64, I64, _F32, S64, S64, _KEY, S64, I64, I64, S64, I64, _F64))


@cuda.jit
def fill_weighted_replace_kernel(nodes, indptr, indices, orig_ids, cumweight, node_start, fanout, key, hop,  # type: ignore[no-untyped-def]
                                 offsets, out, edge_start, edges):
    """Weighted draws with replacement of frontier node i: inverse CDF over ``cumweight``,
    the float64 running sums of the weights restarted at every node (``cumweight[e]`` =
    weights of the node's in-edges up to and including e, in CSC order)."""
    i = cuda.grid(1)
    if i >= nodes.size:
        return
    v, lo, d, off = _frontier_node(nodes, indptr, node_start, offsets, i)
    if d == 0:
        return
    if fanout < 0:
        _copy_all(indices, lo, d, out, off, edges, edge_start + lo)
        return
    stream = _node_stream(key, hop, orig_ids[v])
    total = cumweight[lo + d - 1]
    for t in range(fanout):
        u = _uniform(stream, np.int64(t)) * total
        # the first position whose cumulative weight exceeds u; the last if none does
        a = lo
        b = lo + d - 1
        while a < b:
            mid = (a + b) >> 1
            if cumweight[mid] > u:
                b = mid
            else:
                a = mid + 1
        _put(indices, lo, a - lo, out, off + t, edges, edge_start + lo)


register(fill_weighted_replace_kernel, (I64, I64, I64, I64, _F64, S64, S64, _KEY, S64, I64, I64, S64, I64))


def fill_draws(
    nodes: torch.Tensor, counts: torch.Tensor, csc: CscArgs, fanout: int, key: int, hop: int,
    *, replace: bool, weighted: bool, edges: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """int64 ``[sum(counts)]`` drawn neighbors (global IDs), node after node, and with
    ``edges`` the drawn edges' internal IDs (``csc.edge_start`` + position in
    ``indices``), aligned with them (else None). The draws are the same either way."""
    ends = torch.cumsum(counts, 0)
    total = int(ends[-1]) if counts.numel() else 0
    offsets = ends - counts
    out = torch.empty(total, dtype=torch.int64, device=nodes.device)
    # not asked: an output without entries, which the kernels skip (_put)
    edge_ids = torch.empty(total if edges else 0, dtype=torch.int64, device=nodes.device)
    if total == 0:
        return out, (edge_ids if edges else None)
    head = (kernel_arg(nodes), csc.indptr, csc.indices, csc.orig_ids)
    tail = (np.int64(csc.node_start), np.int64(fanout), np.uint64(key), np.int64(hop),
            kernel_arg(offsets), kernel_arg(out), np.int64(csc.edge_start), kernel_arg(edge_ids))
    n = nodes.numel()
    if not weighted:
        kernel = fill_uniform_replace_kernel if replace else fill_uniform_kernel
        launch(kernel, n, *head, *tail)
    elif replace:
        launch(fill_weighted_replace_kernel, n, *head, csc.cumweight, *tail)
    else:
        score = torch.empty(total, dtype=torch.float64, device=nodes.device)
        launch(fill_weighted_kernel, n, *head, csc.weight, *tail, kernel_arg(score))
    return out, (edge_ids if edges else None)


# -- dedup / relabel: an open-addressing hash table on int64 keys -----------------------
@cuda.jit(device=True, inline="always")
def _slot_of(key, mask):  # type: ignore[no-untyped-def]
    return np.int64(_mix64(np.uint64(key)) >> np.uint64(1)) & mask


@cuda.jit(device=True, inline="always")
def _insert(keys, key):  # type: ignore[no-untyped-def]
    """Slot holding ``key``, claiming an empty one (linear probing) if it is absent."""
    mask = keys.size - 1
    slot = _slot_of(key, mask)
    old = cuda.atomic.cas(keys, slot, EMPTY, key)
    while old != EMPTY and old != key:
        slot = (slot + 1) & mask
        old = cuda.atomic.cas(keys, slot, EMPTY, key)
    return slot


@cuda.jit(device=True, inline="always")
def _find(keys, key):  # type: ignore[no-untyped-def]
    """Slot holding ``key``, which must be present."""
    mask = keys.size - 1
    slot = _slot_of(key, mask)
    while keys[slot] != key:
        slot = (slot + 1) & mask
    return slot


@cuda.jit
def hash_seed_kernel(seeds, keys, local, repeated):  # type: ignore[no-untyped-def]
    """Insert the seeds with local IDs 0 .. B-1; ``repeated[0] = 1`` if one repeats."""
    i = cuda.grid(1)
    if i >= seeds.size:
        return
    key = seeds[i]
    slot = _slot_of(key, keys.size - 1)
    while True:
        old = cuda.atomic.cas(keys, slot, EMPTY, key)
        if old == EMPTY:
            local[slot] = i
            return
        if old == key:
            repeated[0] = 1
            return
        slot = (slot + 1) & (keys.size - 1)


@cuda.jit
def hash_rehash_kernel(old_keys, old_local, keys, local):  # type: ignore[no-untyped-def]
    """Move slot i of a smaller table into a larger one."""
    i = cuda.grid(1)
    if i < old_keys.size and old_keys[i] != EMPTY:
        local[_insert(keys, old_keys[i])] = old_local[i]


@cuda.jit
def hash_first_kernel(nodes, keys, first):  # type: ignore[no-untyped-def]
    """Insert nodes[j] and record the first position it occurs at in this hop."""
    j = cuda.grid(1)
    if j < nodes.size:
        cuda.atomic.min(first, _insert(keys, nodes[j]), j)


@cuda.jit
def hash_flag_new_kernel(nodes, keys, local, first, is_new):  # type: ignore[no-untyped-def]
    """is_new[j] = 1 where nodes[j] had no local ID before this hop and first occurs at j."""
    j = cuda.grid(1)
    if j < nodes.size:
        slot = _find(keys, nodes[j])
        is_new[j] = 1 if local[slot] == EMPTY and first[slot] == j else 0


@cuda.jit
def hash_number_new_kernel(nodes, keys, local, is_new, rank, base, new_nodes):  # type: ignore[no-untyped-def]
    """Give the new node at j local ID ``base + rank[j] - 1`` (rank = inclusive scan)."""
    j = cuda.grid(1)
    if j < nodes.size and is_new[j]:
        p = rank[j] - 1
        local[_find(keys, nodes[j])] = base + p
        new_nodes[p] = nodes[j]


@cuda.jit
def hash_lookup_kernel(nodes, keys, local, out):  # type: ignore[no-untyped-def]
    """out[j] = local ID of nodes[j]."""
    j = cuda.grid(1)
    if j < nodes.size:
        out[j] = local[_find(keys, nodes[j])]


register(hash_seed_kernel, (I64, I64, I64, I64))
register(hash_rehash_kernel, (I64, I64, I64, I64))
register(hash_first_kernel, (I64, I64, I64))
register(hash_flag_new_kernel, (I64, I64, I64, I64, I64))
register(hash_number_new_kernel, (I64, I64, I64, I64, I64, S64, I64))
register(hash_lookup_kernel, (I64, I64, I64, I64))


class NodeTable:
    """Global ID -> local ID of one batch's nodes, in device memory (keys, local IDs, and
    the first position of each key within the hop being added)."""

    def __init__(self, capacity: int, device: torch.device):
        if capacity < 1 or capacity & (capacity - 1):
            raise ValueError(f"capacity: expected a power of two, got {capacity}")
        self.keys = torch.full((capacity,), EMPTY, dtype=torch.int64, device=device)
        self.local = torch.full((capacity,), EMPTY, dtype=torch.int64, device=device)
        self.first = torch.empty(capacity, dtype=torch.int64, device=device)
        #: Nodes numbered so far.
        self.size = 0

    @property
    def capacity(self) -> int:
        return int(self.keys.numel())


def table_capacity(nodes: int) -> int:
    """Smallest power of two >= 2 * nodes (at least 64)."""
    return max(64, 1 << max(0, 2 * nodes - 1).bit_length())


def table_insert_seeds(table: NodeTable, seeds: torch.Tensor) -> None:
    """Number ``seeds`` 0 .. B-1 (the table must be empty); ``ValueError`` if one repeats."""
    if seeds.numel():
        repeated = torch.zeros(1, dtype=torch.int64, device=seeds.device)
        launch(hash_seed_kernel, seeds.numel(), kernel_arg(seeds), kernel_arg(table.keys),
               kernel_arg(table.local), kernel_arg(repeated))
        if int(repeated[0]):
            ids = seeds.cpu().numpy()
            _, first = np.unique(ids, return_index=True)
            dup = np.setdiff1d(np.arange(ids.size), first)[0]
            raise ValueError(f"seeds: expected unique node IDs; {int(ids[dup])} repeats")
    table.size = int(seeds.numel())


def table_grow(table: NodeTable, capacity: int) -> None:
    """Rehash ``table`` into ``capacity`` slots (in place)."""
    bigger = NodeTable(capacity, table.keys.device)
    launch(hash_rehash_kernel, table.capacity, kernel_arg(table.keys), kernel_arg(table.local),
           kernel_arg(bigger.keys), kernel_arg(bigger.local))
    table.keys, table.local, table.first = bigger.keys, bigger.local, bigger.first


def table_add(table: NodeTable, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Number the nodes of ``nodes`` not in ``table`` in first-seen order; return
    ``(new_nodes, local IDs of all of nodes)``. The table must have room (see
    :func:`table_capacity`)."""
    m = nodes.numel()
    device = nodes.device
    if m == 0:
        return nodes.new_empty(0), nodes.new_empty(0)
    keys, local = kernel_arg(table.keys), kernel_arg(table.local)
    c = kernel_arg(nodes)
    table.first.fill_(NEVER)
    launch(hash_first_kernel, m, c, keys, kernel_arg(table.first))
    is_new = torch.empty(m, dtype=torch.int64, device=device)
    launch(hash_flag_new_kernel, m, c, keys, local, kernel_arg(table.first), kernel_arg(is_new))
    rank = torch.cumsum(is_new, 0)
    num_new = int(rank[-1])
    new_nodes = torch.empty(num_new, dtype=torch.int64, device=device)
    if num_new:
        launch(hash_number_new_kernel, m, c, keys, local, kernel_arg(is_new), kernel_arg(rank),
               np.int64(table.size), kernel_arg(new_nodes))
    out = torch.empty(m, dtype=torch.int64, device=device)
    launch(hash_lookup_kernel, m, c, keys, local, kernel_arg(out))
    table.size += num_new
    return new_nodes, out


# -- feature and label gathering ---------------------------------------------------------
@cuda.jit
def gather_labels_kernel(nodes, node_start, y, out):  # type: ignore[no-untyped-def]
    """out[r] = y[nodes[r] - node_start]."""
    r = cuda.grid(1)
    if r < nodes.size:
        out[r] = y[nodes[r] - node_start]


register(gather_labels_kernel, (I64, S64, I64, I64))


def gather_labels(nodes: torch.Tensor, node_start: int, y: Any) -> torch.Tensor:
    """int64 ``[len(nodes)]`` labels of owned nodes (``y`` a kernel argument)."""
    out = torch.empty(nodes.numel(), dtype=torch.int64, device=nodes.device)
    if nodes.numel():
        launch(gather_labels_kernel, nodes.numel(), kernel_arg(nodes), np.int64(node_start), y,
               kernel_arg(out))
    return out
