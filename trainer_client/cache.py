"""The trainer-side hot-feature cache.

A trainer holds the features of the hottest nodes of the graph on its own device, so
the servers send per batch only the rows it lacks. Which nodes are hot is a plan every
party agrees on without talking: each partition orders its nodes by the rule named in
``ClusterInfo.hot_order`` (sampling_server/hot.py: expected draws per batch from the
training nodes, or in-degree), which the trainer reads from the servers, and the plan is
one count per partition (``EpochRequest.cache_counts``): the trainer holds the first
``counts[p]`` nodes of partition ``p``'s order. The budget (``cache_size``: a fraction
of all nodes, or bytes) is split across partitions in proportion to their node counts.

The cache fills once per job and is shared by the loaders of one
:class:`~trainer_client.cluster.Cluster` (:meth:`~trainer_client.cluster.Cluster.feature_cache`,
:mod:`trainer_client.fills`); this module holds the plan and the table and makes no calls.
Per batch, :meth:`FeatureCache.assemble` rebuilds the full ``x`` on the device: cached
rows by index, received rows scattered in; the result is bit-identical to the ``x`` a
trainer without the cache receives.

There is one :class:`FeatureCache` per node type with features (a plain graph has one
node type), each by that type's own hot order and partition book
(``HotNodesRequest.node_type`` on a typed graph), planned alike for every type
(:func:`plan_caches`; ``EpochRequest.typed_cache_counts`` on a typed graph).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numba
import numpy as np
import torch

from protos import allocator
from protos.codec import dtype_to_torch
from protos.halfcast import words
from protos.prefetch import LINE, prefetch
from protos.sizes import parse_cache_amount
from trainer_client.graph import TypedGraph

#: Hot-order rules this trainer understands (``ClusterInfo.hot_order``).
KNOWN_HOT_ORDERS = ("visits_v1", "in_degree_v1")
#: Share of a CUDA device's free memory (when the first loader of a cluster asks) that
#: ``cache_size="auto"``, the default, fills with the hottest rows: every row when the
#: features fit. The rest is the model's. On the CPU "auto" is 0 (no cache).
AUTO_FREE_FRACTION = 0.25
#: Most partitions whose rows a fill receives at once (one stream each; read by
#: :mod:`trainer_client.fills` at each fill).
MAX_FILL_STREAMS = 8
#: First and longest pause before a partition's broken fill stream is opened again
#: (doubling in between).
FILL_RETRY_PAUSE = (0.1, 2.0)
_EXPECTED = ("'auto', a fraction of the nodes in [0, 1] (e.g. 0.2), a percentage ('20%') or a "
             "size in bytes with a unit ('2GiB', '512MB')")


class CacheError(ValueError):
    """A cache fill or a cached batch disagrees with the cache plan."""


#: Nodes ahead of the one being written whose cached row is requested early.
_PREFETCH_DISTANCE = 8
#: Nodes ahead whose ``slot`` entry is requested early: the row's prefetch reads that
#: entry, a random access of its own, which would otherwise stall every row.
_SLOT_PREFETCH_DISTANCE = 32


@numba.njit(nogil=True, cache=True)
def _assemble_rows(rows: np.ndarray, flat: np.ndarray, slot: np.ndarray, n_id: np.ndarray,
                   cached: np.ndarray, missing: np.ndarray, out: np.ndarray, shift: int) -> int:
    """Row ``i`` of ``out`` from ``rows[slot[n_id[i]]]`` where ``cached[i]``, else from the
    next row of ``missing``, each word shifted left by ``shift`` bits (16: bfloat16 words
    into float32 ones, exact; 0: a copy); ``flat`` is ``rows`` as 1-D. Prefetched: the
    ``slot`` entry of the node :data:`_SLOT_PREFETCH_DISTANCE` ahead, and the cached row
    of the node :data:`_PREFETCH_DISTANCE` ahead (whose ``slot`` entry is then at hand).
    Returns the first cached node the cache does not hold, or -1 (then ``out`` is
    incomplete). One thread: OpenMP's pool would spin in the trainer, whose cores the
    model needs."""
    width = out.shape[1]
    step = max(1, LINE // rows.itemsize)  # words per cache line
    n = n_id.size
    j = 0
    for i in range(n):
        b = i + _SLOT_PREFETCH_DISTANCE
        if b < n:
            prefetch(slot, n_id[b])  # type: ignore[call-arg]
        a = i + _PREFETCH_DISTANCE
        if a < n and cached[a]:
            ra = slot[n_id[a]]
            if ra >= 0:
                for q in range(0, width, step):
                    prefetch(flat, ra * width + q)  # type: ignore[call-arg]
        if cached[i]:
            r = slot[n_id[i]]
            if r < 0:
                return i
            for c in range(width):
                out[i, c] = rows[r, c] << shift
        else:
            for c in range(width):
                out[i, c] = missing[j, c] << shift
            j += 1
    return -1


#: (wire dtype, output dtype) -> the shift of the conversions :func:`_assemble_rows` does
#: exactly on the dtypes' words (:func:`protos.halfcast.words`): a copy, or bfloat16 ->
#: float32.
CPU_ASSEMBLY = {(t, t): 0 for t in (torch.float32, torch.float64, torch.float16, torch.bfloat16)} | \
    {(torch.bfloat16, torch.float32): 16}


def parse_cache_size(value: object, field: str = "cache_size") -> tuple[str, float]:
    """``("auto", 0)``, ``("fraction", f)`` with ``0 <= f <= 1`` or ``("bytes", b)``;
    raises naming ``field``. The syntax of the server's ``gpu_cache_size``
    (:func:`protos.sizes.parse_cache_amount`): ``"auto"``, a fraction of all nodes
    (``0.2``), a percentage (``"20%"``) or a size with a unit (``"2GiB"``)."""
    size = parse_cache_amount(value, field, _EXPECTED)
    return size.kind, size.amount


def auto_cache_bytes(device: torch.device, num_nodes: int) -> int:
    """The budget of ``cache_size="auto"`` on ``device``: on a CUDA device, the rows that
    fit in :data:`AUTO_FREE_FRACTION` of its free memory after the per-node index; 0
    (no cache) elsewhere."""
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, math.floor(AUTO_FREE_FRACTION * free) - 4 * num_nodes)


def plan_counts(size: tuple[str, float], partition_book: Sequence[int] | np.ndarray,
                row_bytes: int) -> list[int]:
    """Nodes to cache per partition: the budget (a fraction of all nodes, bytes at
    ``row_bytes`` per row, or ``("rows", n)``) split in proportion to the partitions'
    node counts."""
    kind, amount = size
    if kind not in ("fraction", "bytes", "rows"):
        raise ValueError(f"cache_size: expected a fraction or bytes here ('auto' resolved by the "
                         f"loader: auto_cache_bytes), got {kind!r}")
    book = np.asarray(partition_book, dtype=np.int64)
    total = int(book[-1])
    budget = min(total, math.floor(amount * total) if kind == "fraction" else
                 int(amount) // max(row_bytes, 1) if kind == "bytes" else int(amount))
    if total == 0 or budget <= 0:
        return [0] * (book.size - 1)
    return [int(n) * budget // total for n in np.diff(book)]


def plan_caches(size: tuple[str, float], graph: TypedGraph, wire_dtype: int | None
                ) -> dict[str, tuple[list[int], int]]:
    """The cache plan: for each node type with features, its nodes to cache per partition
    and its wire dtype (``wire_dtype``, or the type's stored one when None or 0). A
    fraction caches that share of every type's nodes; a size in bytes the same share of
    every type, the largest that fits at each type's row size on the wire (on a plain
    graph: the bytes' worth of rows)."""
    kind, amount = size
    if kind not in ("fraction", "bytes"):
        raise ValueError(f"cache_size: expected a fraction or bytes here ('auto' resolved by the "
                         f"loader: auto_cache_bytes), got {kind!r}")
    types = [t for t in graph.node_types if graph.feature_dims.get(t, 0) > 0]
    wires = {t: int(wire_dtype or graph.feature_dtypes[t]) for t in types}
    row_bytes = {t: graph.feature_dims[t] * dtype_to_torch(wires[t]).itemsize for t in types}
    total = sum(graph.num_nodes[t] * row_bytes[t] for t in types)
    plan = {}
    for t in types:
        n = graph.num_nodes[t]
        # bytes: floor(amount / total) of every type's nodes, in whole numbers
        rows = math.floor(amount * n) if kind == "fraction" else int(amount) * n // max(total, 1)
        plan[t] = (plan_counts(("rows", min(rows, n)), graph.books[t], 1), wires[t])
    return plan


class FeatureCache:
    """Features of the hottest nodes of one node type on one device, by global node ID."""

    def __init__(self, counts: Sequence[int], rows: torch.Tensor, slot: torch.Tensor,
                 wire_dtype: int, node_type: str | None = None) -> None:
        #: The plan: nodes held per partition (``EpochRequest.cache_counts``).
        self.counts = tuple(int(c) for c in counts)
        #: ``[K, F]`` cached rows, in the wire dtype.
        self.rows = rows
        #: int32 ``[num_nodes]`` (int64 past 2**31 rows): the row of each global node ID,
        #: -1 when not cached.
        self.slot = slot
        #: The wire feature dtype the rows are in (a ``DType`` value).
        self.wire_dtype = wire_dtype
        #: The node type whose rows these are (by its own IDs; a plain graph's
        #: :data:`~trainer_client.graph.PLAIN_NODE_TYPE`); None when not told.
        self.node_type = node_type

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])

    @property
    def nbytes(self) -> int:
        """Device memory the cache takes (rows plus the slot index)."""
        return self.rows.numel() * self.rows.element_size() + self.slot.numel() * self.slot.element_size()

    def assemble(self, x_missing: torch.Tensor, cached: torch.Tensor, n_id: torch.Tensor,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full ``x`` of a batch: rows marked in ``cached`` from the cache, the others
        from ``x_missing`` (in ``n_id`` order); all on the cache's device, in ``dtype``
        (default: the wire dtype; the conversion is the one ``Tensor.to`` makes)."""
        num = cached.numel()
        num_missing = num - int(cached.sum()) if cached.is_cuda else \
            num - int(np.count_nonzero(cached.numpy()))
        if x_missing.shape[0] != num_missing or x_missing.dtype != self.rows.dtype:
            raise CacheError(f"tensor 'x': expected {self.rows.dtype} with {num_missing} rows "
                             f"(the nodes not marked in 'x_cached'), got {x_missing.dtype} with "
                             f"{x_missing.shape[0]}")
        out_dtype = dtype or self.rows.dtype
        shift = CPU_ASSEMBLY.get((self.rows.dtype, out_dtype))
        if self.rows.device.type == "cpu" and shift is not None:
            return self._assemble_cpu(x_missing, cached, n_id, out_dtype, shift)
        cached_pos = torch.nonzero(cached).flatten()
        missing_pos = torch.nonzero(~cached).flatten()
        slots = self.slot.index_select(0, n_id.index_select(0, cached_pos))
        if slots.numel() and bool((slots < 0).any()):
            raise self._unknown(int((slots < 0).sum()))
        x = torch.empty((num, self.rows.shape[1]), dtype=self.rows.dtype, device=self.rows.device)
        x.index_copy_(0, cached_pos, self.rows.index_select(0, slots))
        x.index_copy_(0, missing_pos, x_missing)
        return x.to(out_dtype)

    def _assemble_cpu(self, x_missing: torch.Tensor, cached: torch.Tensor, n_id: torch.Tensor,
                      out_dtype: torch.dtype, shift: int) -> torch.Tensor:
        """:meth:`assemble` on the CPU: one pass, one thread (:func:`_assemble_rows`)."""
        ids = n_id.numpy()
        if ids.size != cached.numel():
            raise CacheError(f"tensor 'x_cached': expected {ids.size} entries (one per node), "
                             f"got {cached.numel()}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.slot.numel()):
            raise CacheError(f"tensor 'n_id': expected node IDs in 0 .. {self.slot.numel() - 1}, "
                             f"got values in {int(ids.min())} .. {int(ids.max())}")
        if x_missing.dim() != 2 or x_missing.shape[1] != self.rows.shape[1]:
            raise CacheError(f"tensor 'x': expected {self.rows.shape[1]} columns, got shape "
                             f"{list(x_missing.shape)}")
        x = allocator.empty((cached.numel(), self.rows.shape[1]), out_dtype)
        rows = words(self.rows)
        bad = _assemble_rows(rows, rows.reshape(-1), self.slot.numpy(), ids, cached.numpy(),
                             words(x_missing), words(x), shift)
        if bad >= 0:
            raise self._unknown(int((self.slot.numpy()[ids[cached.numpy()]] < 0).sum()))
        return x

    def _unknown(self, count: int) -> CacheError:
        return CacheError(f"tensor 'x_cached': marks {count} nodes this cache does not hold "
                          f"(plan {list(self.counts)}); do the servers follow another hot order?")
