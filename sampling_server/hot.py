"""The hot order of every partition, for the trainer-side feature cache.

Each partition's nodes are ordered from hottest to coldest by a rule every party
computes alike from the partition alone (:data:`HOT_ORDER`, see :func:`hot_order`):

* ``"visits_v1"`` (the default): the expected number of times a batch holds the node,
  estimated with one pass over the partition's CSC per hop. Seeds are drawn uniformly
  from the partition's training nodes (``BATCH`` per batch); hop ``k`` draws
  ``min(fanout_k, degree)`` of each frontier node's in-neighbors uniformly (``FANOUTS``),
  so in-neighbor ``v`` of a frontier node ``u`` is drawn with probability
  ``min(fanout, d_u) / d_u``; a node joins the next frontier with probability
  ``exp(-earlier draws) * (1 - exp(-draws this hop))`` (Poisson). Only edges between
  nodes the partition owns are followed (a partition holds its own nodes' in-edges), so
  with several partitions it is an estimate of the local share. Ties (e.g. nodes no
  training node reaches): in-degree, highest first, then lower global ID.
* ``"in_degree_v1"``: in-degree of the owned node (``diff(indptr)``), highest first,
  ties by lower global ID.

A trainer's cache plan is one count per partition (``EpochRequest.cache_counts``): it
holds the features of the first ``counts[p]`` nodes of partition ``p``'s order. Only the
partition's own server computes its order; trainers and the other servers read it
through ``StreamHotNodes`` (a server once, on first need), so every party holds the same
order without coordination, and a server computes the same order again after a restart.

On a typed graph every node type with features has an order of its own, by
:func:`typed_in_degree_order` (the rule ``"in_degree_v1"`` with the in-edges of every edge
type ending at the type), and the plan is one count per partition per cached type
(``EpochRequest.typed_cache_counts``); :class:`HotNodes` serves one type's orders.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import grpc
import numba
import numpy as np
import torch

from partitioner.format import Partition
from partitioner.hetero_format import HeteroPartition
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.codec import decode_tensor, encode_tensor
from sampling_server.config import HOT_ORDERS
from sampling_server.peer import PeerClient
from sampling_server.store import HOT_ORDER, PartitionStore, RequestError, cast_features

__all__ = ["HOT_ORDER", "HOT_ORDERS", "HotNodes", "check_counts", "hot_order", "in_degree_order",
           "typed_in_degree_order", "visit_scores"]

log = logging.getLogger(__name__)

#: Fanouts per hop and seeds per batch that ``"visits_v1"`` assumes (PyG's usual
#: ``[15, 10, 5]`` and batch 1024; the order is a fixed rule, not a per-request one).
FANOUTS = (15, 10, 5)
BATCH = 1024


def in_degree_order(indptr: np.ndarray, node_start: int) -> np.ndarray:
    """Global IDs of a partition's owned nodes, hottest first: in-degree descending, ties
    by lower global ID (a stable sort of the negated degrees)."""
    degree = np.diff(np.asarray(indptr, dtype=np.int64))
    return np.argsort(-degree, kind="stable").astype(np.int64) + node_start


def typed_in_degree_order(partition: HeteroPartition, node_type: str) -> np.ndarray:
    """Global IDs of ``node_type``'s owned nodes of a typed partition, hottest first: the
    in-degree summed over every edge type that ends at ``node_type`` (a partition holds
    its own nodes' in-edges of each), descending, ties by lower global ID. The rule of
    :data:`~sampling_server.config.TYPED_HOT_ORDER`."""
    start, stop = partition.node_range(node_type)
    degree = np.zeros(stop - start, dtype=np.int64)
    for edge_type, indptr in partition.indptr.items():
        if edge_type[2] == node_type:
            degree += np.diff(np.asarray(indptr, dtype=np.int64)).astype(np.int64)
    return np.argsort(-degree, kind="stable").astype(np.int64) + start


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


def visit_scores(indptr: np.ndarray, indices: np.ndarray, node_start: int, train: np.ndarray,
                 fanouts: tuple[int, ...] = FANOUTS, batch: int = BATCH) -> np.ndarray:
    """float64 ``[n]``: expected draws of each owned node per batch (seeds counted once),
    under the model of ``"visits_v1"`` (module docstring)."""
    n = int(indptr.size) - 1
    seeds = np.asarray(train, dtype=np.int64) - node_start
    seeds = seeds[(seeds >= 0) & (seeds < n)]
    frontier = np.zeros(n, dtype=np.float64)
    if seeds.size:
        frontier[seeds] = min(1.0, batch / seeds.size)
    else:  # no training nodes: seeds anywhere
        frontier[:] = min(1.0, batch / max(n, 1))
    total = frontier.copy()
    indptr64 = np.asarray(indptr, dtype=np.int64)
    for fanout in fanouts:
        drawn = np.zeros(n, dtype=np.float64)
        _spread(indptr64, np.asarray(indices), node_start, frontier, int(fanout), drawn)
        frontier = np.exp(-total) * -np.expm1(-drawn)
        total += drawn
    return total


def typed_visit_scores(partition: HeteroPartition, fanouts: tuple[int, ...] = FANOUTS,
                       batch: int = BATCH) -> dict[str, np.ndarray]:
    """Per node type, float64 ``[n_t]``: the expected draws of each owned node per batch,
    under the model of ``"visits_v1"`` on a typed graph: seeds drawn from the partition's
    training nodes of the target type, and at every hop each relation ``s -> d`` draws
    ``fanouts[k]`` in-neighbors of type ``s`` for each frontier node of type ``d`` (PyG's
    hetero semantics with one fanout list for every edge type)."""
    ranges = {t: partition.node_range(t) for t in partition.manifest.node_types}
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
        for (src, _, dst), indptr in partition.indptr.items():
            _spread(np.asarray(indptr, dtype=np.int64), np.asarray(partition.indices[(src, _, dst)]),
                    ranges[src][0], frontier[dst], int(fanout), drawn[src])
        for t in size:
            frontier[t] = np.exp(-total[t]) * -np.expm1(-drawn[t])
            total[t] += drawn[t]
    return total


def hot_order(partition: Partition, rule: str = HOT_ORDER) -> np.ndarray:
    """Global IDs of ``partition``'s owned nodes, hottest first, by ``rule`` (one of
    :data:`HOT_ORDERS`)."""
    start = int(partition.node_range[0])
    if rule == "in_degree_v1":
        return in_degree_order(partition.indptr, start)
    if rule != "visits_v1":
        raise ValueError(f"rule: expected one of {list(HOT_ORDERS)}, got {rule!r}")
    train = partition.splits.get("train", np.empty(0, dtype=np.int64))
    score = visit_scores(partition.indptr, partition.indices, start, np.asarray(train))
    degree = np.diff(np.asarray(partition.indptr, dtype=np.int64))
    ids = np.arange(score.size, dtype=np.int64)
    return np.lexsort((ids, -degree, -score)).astype(np.int64) + start


#: Cache plans whose node set a server keeps (as a bitset, one bit per node of the graph).
PLAN_BITSETS = 8


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
    (:func:`plan_bitset` of a graph of ``num_nodes`` nodes); one pass."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    mask = np.empty(ids.size, dtype=bool)
    bad = _test_bits(bits, ids, num_nodes, mask.view(np.uint8))
    if bad >= 0:
        raise ValueError(f"n_id: expected global node IDs in 0 .. {num_nodes - 1}, got "
                         f"{int(ids[bad])} at position {bad}")
    return mask


def check_counts(counts: Sequence[int], book: np.ndarray, field: str) -> tuple[int, ...]:
    """A cache plan's counts, checked against the partition book (empty: no cache)."""
    counts = tuple(int(c) for c in counts)
    if not counts:
        return counts
    sizes = np.diff(book)
    if len(counts) != sizes.size:
        raise RequestError(f"{field}: expected {sizes.size} entries (one per partition) or none, "
                           f"got {len(counts)}")
    bad = [p for p, c in enumerate(counts) if not 0 <= c <= sizes[p]]
    if bad:
        p = bad[0]
        raise RequestError(f"{field}[{p}]: expected 0 .. {int(sizes[p])} (the partition's nodes), "
                           f"got {counts[p]}")
    return counts


class HotNodes:
    """This server's view of every partition's hot order (thread-safe, lazily built), of
    one node type on a typed graph."""

    def __init__(self, store: PartitionStore, peers: Callable[[], PeerClient | None],
                 chunk_bytes: int = 4 * 1024 * 1024, node_type: str | None = None) -> None:
        """``peers`` gives the peer client when needed (servers set it when they start);
        ``node_type``: the node type of a typed graph's store whose order this is."""
        self.store = store
        self.peers = peers
        self.chunk_bytes = chunk_bytes
        self.node_type = node_type
        self._orders: dict[int, np.ndarray] = {}
        self._own_order: np.ndarray | None = None
        self._plans: OrderedDict[tuple[int, ...], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def own_order(self) -> np.ndarray:
        """This partition's hot order (global IDs, hottest first)."""
        with self._lock:
            if self._own_order is None:
                started = time.perf_counter()
                rule = self.store.hot_order
                if self.node_type is None:
                    self._own_order = hot_order(self.store.partition, rule)
                else:
                    self._own_order = typed_in_degree_order(
                        self.store.partition, self.node_type)  # type: ignore[arg-type]
                log.info("partition=%d: hot order %s of %d %s in %.1f s", self.store.partition_id,
                         rule, self._own_order.size, self._what, time.perf_counter() - started)
            return self._own_order

    @property
    def book(self) -> np.ndarray:
        """The partition book of the ordered nodes (of ``node_type`` on a typed graph)."""
        store = self.store
        book = store.partition_book if self.node_type is None else \
            store.books[self.node_type]  # type: ignore[attr-defined]
        return np.asarray(book, dtype=np.int64)

    @property
    def _what(self) -> str:
        return "nodes" if self.node_type is None else f"{self.node_type!r} nodes"

    def order(self, partition: int) -> np.ndarray:
        """``partition``'s hot order (global IDs, hottest first; another partition's is
        read from its server once)."""
        if partition == self.store.partition_id:
            return self.own_order()
        with self._lock:
            found = self._orders.get(partition)
        if found is not None:
            return found
        book = self.book
        order = self._fetch_order(partition, int(book[partition + 1]) - int(book[partition]))
        with self._lock:
            return self._orders.setdefault(partition, order)

    def _fetch_order(self, partition: int, count: int) -> np.ndarray:
        peers = self.peers()
        if peers is None:
            raise RuntimeError(f"hot order of partition {partition}: no peers to ask")
        stub = pb_grpc.SamplingServiceStub(peers.channel(partition))
        request = pb.HotNodesRequest(count=count, client_id=peers.client_id,
                                     node_type=self.node_type or "")
        try:
            blocks = [decode_tensor(m.n_id) for m in
                      stub.StreamHotNodes(request, timeout=peers.timeout)]
        except grpc.RpcError as err:
            raise RequestError(f"hot order of partition {partition}: peer call failed: "
                               f"{err.code().name}: {err.details()}",
                               grpc.StatusCode.UNAVAILABLE) from err
        order = np.concatenate(blocks).astype(np.int64) if blocks else np.empty(0, np.int64)
        if order.size != count:
            raise RequestError(f"hot order of partition {partition}: expected {count} nodes, got "
                               f"{order.size}", grpc.StatusCode.UNAVAILABLE)
        log.info("partition=%d: read the hot order of partition %d (%d %s)",
                 self.store.partition_id, partition, count, self._what)
        return order

    def plan_bits(self, counts: Sequence[int]) -> np.ndarray:
        """The node set of the cache plan ``counts`` as a bitset over the graph's global
        IDs (:func:`plan_bitset`): built on a plan's first batch, and kept for the
        :data:`PLAN_BITSETS` plans used last (one bit per node each: 0.3 MB for 2.4 M nodes)."""
        key = tuple(int(c) for c in counts)
        with self._lock:
            bits = self._plans.get(key)
            if bits is not None:
                self._plans.move_to_end(key)
                return bits
        hot = [self.order(p)[:k] for p, k in enumerate(key) if k > 0]
        bits = plan_bitset(int(self.book[-1]), hot)
        with self._lock:
            self._plans[key] = bits
            self._plans.move_to_end(key)
            while len(self._plans) > PLAN_BITSETS:
                self._plans.popitem(last=False)
        return bits

    def cached_mask(self, n_id: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Bool ``[N]`` on the CPU: which of ``n_id``'s nodes a trainer with the plan
        ``counts`` holds (one pass over ``n_id``, a bit test each)."""
        return torch.from_numpy(plan_flags(self.plan_bits(counts), n_id.cpu().numpy(),
                                           int(self.book[-1])))

    def blocks(self, request: pb.HotNodesRequest, dtype: int) -> Iterator[pb.HotNodesChunk]:
        """The answer to StreamHotNodes: the first ``count`` nodes, block by block."""
        order = self.own_order()
        count = int(request.count)
        if not 0 <= count <= order.size:
            raise RequestError(f"HotNodesRequest.count: expected 0 .. {order.size} (the partition's "
                               f"nodes), got {count}")
        row_bytes = 8
        if request.include_features:
            part = self.store.partition
            features = part.x if self.node_type is None else part.x[self.node_type]
            row_bytes += features.shape[1] * np.dtype(features.dtype).itemsize
        step = max(1, self.chunk_bytes // row_bytes)
        for first in range(0, max(count, 1), step):
            ids = order[first:min(first + step, count)]
            msg = pb.HotNodesChunk(first_row=first, count=count, n_id=encode_tensor(ids))
            if request.include_features:
                x = self._gather(torch.from_numpy(ids))
                msg.x.CopyFrom(encode_tensor(cast_features(x, dtype).cpu()))
            yield msg

    def _gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Features of owned nodes (of ``node_type`` on a typed graph)."""
        if self.node_type is None:
            sampler = self.store.sampler()
            x, _ = sampler.gather_local(ids.to(sampler.device), True, False)
        else:
            typed = self.store.typed_sampler()  # type: ignore[attr-defined]
            x, _ = typed.gather_local(self.node_type, ids.to(typed.device), True, False)
        assert x is not None
        return x
