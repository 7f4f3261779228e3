"""The trainer-side hot-feature cache.

A trainer holds the features of the hottest nodes of the graph on its own device, so
the servers send per batch only the rows it lacks. Which nodes are hot is a plan every
party agrees on without talking: each partition orders its nodes by the rule named in
``ClusterInfo.hot_order`` (sampling_server/hot.py: expected draws per batch from the
training nodes, or in-degree), which the trainer reads from the servers, and the plan is
one count per partition (``EpochRequest.cache_counts``): the trainer holds the first
``counts[p]`` nodes of partition ``p``'s order. The budget (``cache_size``: a fraction
of all nodes, or bytes) is split across partitions in proportion to their node counts.

The cache fills once per job (:meth:`FeatureCache.fill`, ``StreamHotNodes`` from every
partition's server at once, streamed in blocks, with a progress bar on a terminal) and
is shared by every loader of one
:class:`~trainer_client.cluster.Cluster` with the same plan, dtype and device.
Per batch, :meth:`FeatureCache.assemble` rebuilds the full ``x`` on the device: cached
rows by index, received rows scattered in; the result is bit-identical to the ``x`` a
trainer without the cache receives.

On a typed graph there is one :class:`FeatureCache` per node type with features, each
by that type's own hot order and partition book (``HotNodesRequest.node_type``), planned
alike for every type (:func:`plan_typed_counts`, ``EpochRequest.typed_cache_counts``).
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import grpc
import numba
import numpy as np
import torch
from tqdm import tqdm

from protos import allocator
from protos import sampling_pb2 as pb
from protos.channel import ServerUnavailable, error_from_rpc
from protos.codec import decode_tensor_torch, dtype_name, dtype_to_torch
from protos.halfcast import words
from protos.prefetch import LINE, prefetch
from protos.sizes import parse_cache_amount

if TYPE_CHECKING:
    from trainer_client.cluster import Cluster

log = logging.getLogger(__name__)

#: Hot-order rules this trainer understands (``ClusterInfo.hot_order``).
KNOWN_HOT_ORDERS = ("visits_v1", "in_degree_v1")
#: Share of a CUDA device's free memory (when the first loader of a cluster asks) that
#: ``cache_size="auto"``, the default, fills with the hottest rows: every row when the
#: features fit. The rest is the model's. On the CPU "auto" is 0 (no cache).
AUTO_FREE_FRACTION = 0.25
#: Most partitions whose rows a fill receives at once (one stream each).
MAX_FILL_STREAMS = 8
#: First and longest pause before a partition's broken fill stream is opened again.
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
_CPU_ASSEMBLY = {
    (torch.float32, torch.float32): 0,
    (torch.float64, torch.float64): 0,
    (torch.float16, torch.float16): 0,
    (torch.bfloat16, torch.bfloat16): 0,
    (torch.bfloat16, torch.float32): 16,
}


def parse_cache_size(value: object, field: str = "cache_size") -> tuple[str, float]:
    """``("auto", 0)``, ``("fraction", f)`` with ``0 <= f <= 1`` or ``("bytes", b)``;
    raises naming ``field``.

    Numbers are fractions of all nodes (``0.2``); strings may be ``"auto"``, a fraction, a
    percentage (``"20%"``) or a size with a unit (``"2GiB"``, ``"512MB"``, ``"1000B"``):
    the syntax of the server's ``gpu_cache_size``.
    """
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


def type_facts(info: pb.ClusterInfo, node_type: str) -> tuple[np.ndarray, int, int]:
    """``(partition book, feature columns, stored feature dtype)`` of ``node_type``'s nodes
    on a typed graph (``ClusterInfo.typed``)."""
    for t in info.typed.node_types:
        if t.name == node_type:
            return np.asarray(t.partition_book, dtype=np.int64), int(t.feature_dim), int(t.feature_dtype)
    raise ValueError(f"node_type: expected one of {[t.name for t in info.typed.node_types]}, "
                     f"got {node_type!r}")


def plan_counts(size: tuple[str, float], partition_book: Sequence[int], row_bytes: int) -> list[int]:
    """Nodes to cache per partition: the budget (a fraction of all nodes, or bytes at
    ``row_bytes`` per row) split in proportion to the partitions' node counts."""
    kind, amount = size
    if kind not in ("fraction", "bytes"):
        raise ValueError(f"cache_size: expected a fraction or bytes here ('auto' resolved by the "
                         f"loader: auto_cache_bytes), got {kind!r}")
    book = np.asarray(partition_book, dtype=np.int64)
    total = int(book[-1])
    budget = math.floor(amount * total) if kind == "fraction" else int(amount) // max(row_bytes, 1)
    budget = min(budget, total)
    if total == 0 or budget <= 0:
        return [0] * (book.size - 1)
    return [int(n) * budget // total for n in np.diff(book)]


def plan_typed_counts(size: tuple[str, float], info: pb.ClusterInfo, wire_dtype: int | None
                      ) -> dict[str, tuple[list[int], int]]:
    """A typed graph's cache plan: for each node type with features, its nodes to cache
    per partition and its wire dtype (``wire_dtype``, or the type's stored one when None
    or 0). A fraction caches that share of every type's nodes; a size in bytes the same
    share of every type, the largest that fits at each type's row size on the wire."""
    kind, amount = size
    if kind not in ("fraction", "bytes"):
        raise ValueError(f"cache_size: expected a fraction or bytes here ('auto' resolved by the "
                         f"loader: auto_cache_bytes), got {kind!r}")
    types = [t for t in info.typed.node_types if t.feature_dim > 0]
    wires = {t.name: int(wire_dtype or t.feature_dtype) for t in types}
    fraction = amount
    if kind == "bytes":
        total = sum(int(t.num_nodes) * int(t.feature_dim) * dtype_to_torch(wires[t.name]).itemsize
                    for t in types)
        fraction = min(1.0, amount / total) if total else 0.0
    return {t.name: (plan_counts(("fraction", fraction), list(t.partition_book), 1), wires[t.name])
            for t in types}


class FeatureCache:
    """Features of the hottest nodes on one device, by global node ID (of one node type
    on a typed graph)."""

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
        #: The node type whose rows these are, on a typed graph (its own IDs); else None.
        self.node_type = node_type

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])

    @property
    def nbytes(self) -> int:
        """Device memory the cache takes (rows plus the slot index)."""
        return self.rows.numel() * self.rows.element_size() + self.slot.numel() * self.slot.element_size()

    @classmethod
    def fill(cls, cluster: Cluster, counts: Sequence[int], wire_dtype: int, device: torch.device,
             *, progress: bool | None = None, timeout: float = 600.0,
             reconnect: float = 15.0, node_type: str | None = None) -> FeatureCache:
        """Stream the plan's rows from every server (``StreamHotNodes``) onto ``device``;
        on a typed graph those of ``node_type`` (by its own IDs and partition book).
        A partition whose stream breaks with ``UNAVAILABLE`` (its server restarting) is
        filled again from its first row, with growing pauses, for up to ``reconnect``
        seconds after the break, as the loader's streams resume; any other failure ends
        the whole fill at once. ``timeout``: the deadline of each stream."""
        counts = [int(c) for c in counts]
        book, dim = (cluster.partition_book, int(cluster.info.feature_dim)) if node_type is None \
            else type_facts(cluster.info, node_type)[:2]
        # On the CPU both tables come from NumPy's allocator, which asks the kernel for
        # transparent huge pages: each batch reads rows at random, and with 4 KiB pages
        # nearly every read also misses the TLB.
        shape = (sum(counts), dim)
        rows = (allocator.empty(shape, dtype_to_torch(wire_dtype)) if device.type == "cpu" else
                torch.empty(shape, dtype=dtype_to_torch(wire_dtype), device=device))
        index_dtype = torch.int32 if sum(counts) < 2**31 else torch.int64
        slot = allocator.empty((int(book[-1]),), index_dtype).fill_(-1)
        show = sys.stderr.isatty() if progress is None else progress
        starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        parts = [p for p, k in enumerate(counts) if k]
        lock = threading.Lock()
        calls: list[grpc.Future] = []
        stopping = threading.Event()

        def started(call: grpc.Future) -> None:
            with lock:
                calls.append(call)
                if stopping.is_set():
                    call.cancel()

        def progress_by(b: int) -> None:
            with lock:
                bar.update(b)

        def fill_one(p: int) -> None:
            lo, hi = starts[p], starts[p + 1]
            failed_at, pause = None, FILL_RETRY_PAUSE[0]
            received = [0]  # rows of the current attempt

            def counted(b: int) -> None:
                received[0] += b
                progress_by(b)

            while True:
                received[0] = 0
                try:
                    order = cls._fill_partition(cluster, p, hi - lo, wire_dtype, rows[lo:hi],
                                                timeout, started, counted, node_type)
                    break
                except ServerUnavailable as exc:
                    failed_at = failed_at if failed_at is not None else time.monotonic()
                    if time.monotonic() - failed_at + pause > reconnect:
                        raise ServerUnavailable(
                            f"{exc} (the feature cache's fill of partition {p} was retried for "
                            f"{reconnect:g} s)", what=exc.what, address=exc.address,
                            code=exc.code, details=exc.details) from exc
                    log.warning("feature cache: partition %d's stream broke after %d of %d nodes "
                                "(%s); filling it again in %.1f s", p, received[0], hi - lo, exc,
                                pause)
                    progress_by(-received[0])
                    if stopping.wait(pause):  # another partition failed meanwhile
                        raise
                    pause = min(2 * pause, FILL_RETRY_PAUSE[1])
            if int(order.min()) < book[p] or int(order.max()) >= book[p + 1]:
                raise CacheError(f"StreamHotNodes at partition {p}: HotNodesChunk.n_id: "
                                 f"expected IDs in {int(book[p])} .. {int(book[p + 1]) - 1}")
            slot[order] = torch.arange(lo, hi, dtype=index_dtype)

        # every partition at once: each server gathers and sends its own rows into its own
        # slice of the table, so the fill goes at the pace of the links, not of one server
        desc = "feature cache" if node_type is None else f"feature cache of {node_type!r}"
        with tqdm(total=sum(counts), desc=desc, unit="node", unit_scale=True,
                  disable=not show) as bar, \
                ThreadPoolExecutor(min(len(parts), MAX_FILL_STREAMS) or 1,
                                   thread_name_prefix="cache-fill") as pool:
            futures = [pool.submit(fill_one, p) for p in parts]
            try:
                wait(futures, return_when=FIRST_EXCEPTION)  # bounded: the streams' deadline
                for future in futures:
                    if future.done() and future.exception() is not None:
                        future.result()  # raises the first failure
            except BaseException:  # a failure or an interrupt: end the other streams now
                with lock:
                    stopping.set()
                    for call in calls:
                        call.cancel()
                for future in futures:
                    future.cancel()
                raise
        cache = cls(counts, rows, slot.to(device), wire_dtype, node_type)
        log.info("feature cache: %d %s (%s of %d) in %s on %s, %.1f MiB", cache.num_rows,
                 "nodes" if node_type is None else f"{node_type!r} nodes", counts, int(book[-1]),
                 dtype_name(wire_dtype), device, cache.nbytes / 2**20)
        return cache

    @classmethod
    def _fill_partition(cls, cluster: Cluster, p: int, k: int, wire_dtype: int, out: torch.Tensor,
                        timeout: float, started: Callable[[grpc.Future], None],
                        progress: Callable[[int], None], node_type: str | None = None
                        ) -> torch.Tensor:
        """Receive partition ``p``'s first ``k`` hot nodes' rows into ``out``; return their
        IDs. Checks every block. ``started`` gets the call (to cancel it when another
        partition's fill fails), ``progress`` each block's node count."""
        where = f"StreamHotNodes at {cluster.addresses[p]}"
        # the stored dtype is asked for as such (servers before it could be named refuse
        # float64 by name)
        stored = int(cluster.info.feature_dtype) if node_type is None else \
            type_facts(cluster.info, node_type)[2]
        asked = pb.DTYPE_UNSPECIFIED if wire_dtype == stored else wire_dtype
        request = pb.HotNodesRequest(count=k, include_features=True, client_id=cluster.client_id,
                                     feature_dtype=asked,  # type: ignore[arg-type]
                                     expect=cluster.expectation(p), node_type=node_type or "")
        order = torch.empty(k, dtype=torch.int64)
        done = 0
        try:
            responses = cluster.stubs[p].StreamHotNodes(request, timeout=timeout)
            started(responses)
            for msg in responses:
                ids = decode_tensor_torch(msg.n_id)
                x = decode_tensor_torch(msg.x)
                b = ids.numel()
                if msg.first_row != done or msg.count != k or done + b > k:
                    raise CacheError(f"{where}: HotNodesChunk.first_row: expected {done} of {k} "
                                     f"nodes, got first_row {msg.first_row} with {b} nodes of "
                                     f"count {msg.count}")
                if x.dtype != out.dtype or list(x.shape) != [b, out.shape[1]]:
                    raise CacheError(f"{where}: HotNodesChunk.x: expected {out.dtype} of shape "
                                     f"[{b}, {out.shape[1]}], got {x.dtype} of shape {list(x.shape)}")
                order[done:done + b] = ids
                out[done:done + b] = x.to(out.device)
                done += b
                progress(b)
        except grpc.RpcError as err:
            raise error_from_rpc(err, "StreamHotNodes", cluster.addresses[p]) from err
        if done != k:
            raise CacheError(f"{where}: expected {k} nodes, got {done}")
        return order

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
        shift = _CPU_ASSEMBLY.get((self.rows.dtype, out_dtype))
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
