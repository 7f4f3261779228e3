"""The hot orders of every partition, for the trainer-side feature cache.

Each partition's nodes of each type are ordered from hottest to coldest by a rule every
party computes alike from the partition alone (:mod:`sampling_server.sampler.hot_order`,
``ClusterInfo.hot_order``). A trainer's cache plan is one count per partition per cached
node type (``EpochRequest.cache_counts`` for a plain graph's one type,
``EpochRequest.typed_cache_counts`` per type): it holds the features of the first
``counts[p]`` nodes of partition ``p``'s order. Only the partition's own server computes
its order; trainers and the other servers read it through ``StreamHotNodes`` (a server
once, on first need), so every party holds the same order without coordination, and a
server computes the same order again after a restart. :class:`HotNodes` serves one node
type's orders.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import grpc
import numpy as np
import torch

from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.codec import decode_tensor, encode_tensor
from sampling_server.errors import RequestError
from sampling_server.fields import cast_features
from sampling_server.peer_client import PeerClient
from sampling_server.sampler.hot_order import PLAN_BITSETS, hot_order, plan_bitset, plan_flags
from sampling_server.store import PartitionStore

__all__ = ["HotNodes"]

log = logging.getLogger(__name__)


class HotNodes:
    """This server's view of every partition's hot order of one node type (thread-safe,
    lazily built)."""

    def __init__(self, store: PartitionStore, node_type: str, peers: Callable[[], PeerClient | None],
                 chunk_bytes: int = 4 * 1024 * 1024) -> None:
        """``peers`` gives the peer client when needed (servers set it when they start)."""
        self.store = store
        self.node_type = node_type
        self._what = f"{node_type!r} nodes" if store.typed else "nodes"  # (in logs)
        self.peers = peers
        self.chunk_bytes = chunk_bytes
        self._orders: dict[int, np.ndarray] = {}
        self._own_order: np.ndarray | None = None
        self._plans: OrderedDict[tuple[int, ...], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._fetch_lock = threading.Lock()  # other partitions' orders: read and kept under it

    def own_order(self) -> np.ndarray:
        """This partition's hot order (global IDs, hottest first)."""
        with self._lock:
            if self._own_order is None:
                started = time.perf_counter()
                rule = self.store.hot_order
                self._own_order = hot_order(self.store.partition, self.node_type, rule)
                log.info("partition=%d: hot order %s of %d %s in %.1f s", self.store.partition_id,
                         rule, self._own_order.size, self._what, time.perf_counter() - started)
            return self._own_order

    @property
    def book(self) -> np.ndarray:
        """The partition book of the ordered nodes."""
        return self.store.books[self.node_type]

    def prefix(self, partition: int, count: int) -> np.ndarray:
        """The first ``count`` nodes of ``partition``'s hot order (global IDs, hottest
        first). Another partition's are read from its server on first need, one read at a
        time, and only the longest prefix a cache plan asked for is kept: a trainer caches
        a share of the nodes, while every partition's whole order would be 8 bytes per node
        of the graph on every server."""
        if partition == self.store.partition_id:
            return self.own_order()[:count]
        with self._fetch_lock:
            found = self._orders.get(partition)
            if found is None or found.size < count:
                found = self._orders[partition] = self._fetch_order(partition, count)
        return found[:count]

    def _fetch_order(self, partition: int, count: int) -> np.ndarray:
        peers = self.peers()
        if peers is None:
            raise RuntimeError(f"hot order of partition {partition}: no peers to ask")
        stub = pb_grpc.SamplingServiceStub(peers.channel(partition))
        request = pb.HotNodesRequest(count=count, client_id=peers.client_id,
                                     node_type=self.node_type if self.store.typed else "")
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
        log.info("partition=%d: read the %d hottest %s of partition %d", self.store.partition_id, count,
                 self._what, partition)
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
        hot = [self.prefix(p, k) for p, k in enumerate(key) if k > 0]
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
            features = self.store.partition.x[self.node_type]
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
        """Features of owned nodes."""
        sampler = self.store.sampler()
        x, _ = sampler.gather_local(self.node_type, ids.to(sampler.device), True, False)
        assert x is not None
        return x
