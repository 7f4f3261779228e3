"""``Cluster``: channels to every sampling server of one partitioned graph, with their
ClusterInfo checked against each other (same graph, each partition served once), and
the node lookups a loader needs (a split's nodes, original IDs to graphfeed's own)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

import grpc
import numpy as np
import torch

from protos import fastwire
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.channel import ServerUnavailable, create_channel, error_from_rpc
from protos.codec import decode_tensor, encode_tensor
from trainer_client.cache import FeatureCache, auto_cache_bytes
from trainer_client.node_table import NodeTable

log = logging.getLogger(__name__)

#: ClusterInfo fields every server of one cluster must agree on.
SHARED_FIELDS = (
    "format_version", "graph_name", "num_nodes", "num_edges", "partition_book",
    "num_partitions", "feature_dim", "feature_dtype", "num_classes", "split_sizes",
    "has_edge_weights", "label_dtype", "graph_fingerprint", "typed",
)

def _default_client_id() -> str:
    return f"trainer-{socket.gethostname()}-{os.getpid()}"


def _parse_servers(servers: Sequence[str] | str) -> list[str]:
    """Addresses from a list or a comma-separated string; checks the form."""
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    addresses = [str(a).strip() for a in items if str(a).strip()]
    if not addresses:
        raise ValueError(f"servers: expected at least one 'host:port' address, got {servers!r}")
    for a in addresses:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"servers: expected 'host:port' addresses, got {a!r}")
    dupes = sorted({a for a in addresses if addresses.count(a) > 1})
    if dupes:
        raise ValueError(f"servers: expected each address once, got {dupes} more than once")
    return addresses


class Cluster:
    """Channels to every sampling server of a cluster, with their checked ClusterInfo.

    ``servers`` may list the servers in any order (their ClusterInfo says which
    partition each holds); when fewer addresses than partitions are given, the others
    are taken from ``ClusterInfo.peer_addresses``. Servers that are not up yet are
    waited for, up to ``connect_timeout`` seconds in all.
    """

    def __init__(
        self,
        servers: Sequence[str] | str,
        *,
        connect_timeout: float = 60.0,
        rpc_timeout: float = 30.0,
        client_id: str | None = None,
    ) -> None:
        addresses = _parse_servers(servers)
        for name, value in (("connect_timeout", connect_timeout), ("rpc_timeout", rpc_timeout)):
            if not value > 0:
                raise ValueError(f"{name}: expected seconds > 0, got {value}")
        self.client_id = client_id or _default_client_id()
        self._rpc_timeout = rpc_timeout
        self._channels: dict[str, grpc.Channel] = {}
        self._caches: dict[tuple[tuple[int, ...], int, str, str], FeatureCache] = {}
        self._cache_lock = threading.Lock()
        self._auto_budgets: dict[str, int] = {}
        self._node_tables: dict[str, NodeTable | None] = {}
        deadline = time.monotonic() + connect_timeout
        try:
            infos = self._fetch_all(addresses, deadline, connect_timeout)
            first = infos[addresses[0]]
            served = {int(i.partition_id) for i in infos.values()}
            missing = {p: a for p, a in enumerate(first.peer_addresses) if p not in served and a not in infos}
            if len(infos) < first.num_partitions and missing:
                log.info("partitions %s: no address given; using their peer addresses %s",
                         sorted(missing), sorted(missing.values()))
                infos.update(self._fetch_all(list(missing.values()), deadline, connect_timeout))
            #: Addresses of the servers, indexed by partition ID.
            self.addresses: list[str] = check_cluster(infos)
        except BaseException:
            self.close()
            raise
        #: Each partition's ClusterInfo, indexed by partition ID.
        self.infos: list[pb.ClusterInfo] = [infos[a] for a in self.addresses]
        #: Stubs of the servers, indexed by partition ID.
        self.stubs = [pb_grpc.SamplingServiceStub(self._channels[a]) for a in self.addresses]
        #: Per partition: the epoch stream whose tensors stay views of the received bytes.
        self.stream_stubs = [fastwire.MinibatchStreamStub(self._channels[a])
                             for a in self.addresses]
        #: Partition book: partition ``p`` owns global IDs ``book[p] .. book[p+1]-1``.
        self.partition_book = np.asarray(self.info.partition_book, dtype=np.int64)

    @property
    def info(self) -> pb.ClusterInfo:
        """The ClusterInfo of partition 0 (shared fields are equal on every server)."""
        return self.infos[0]

    def expectation(self, partition: int) -> pb.ServerExpectation:
        """What this job read of ``partition``'s server (``EpochRequest.expect``,
        ``HotNodesRequest.expect``): a server restarted since with another graph, partition
        or hot order refuses the call instead of serving another graph's rows."""
        info = self.infos[partition]
        return pb.ServerExpectation(graph_fingerprint=info.graph_fingerprint,
                                    partition_id=info.partition_id, hot_order=info.hot_order)

    @property
    def num_partitions(self) -> int:
        return int(self.info.num_partitions)

    def _fetch_all(
        self, addresses: list[str], deadline: float, connect_timeout: float
    ) -> dict[str, pb.ClusterInfo]:
        """ClusterInfo of every address, fetched in parallel; ServerUnavailable names
        every server that did not answer in time."""
        for address in addresses:
            self._channels.setdefault(address, create_channel(address))
        with ThreadPoolExecutor(max_workers=min(32, len(addresses))) as pool:
            futures = {a: pool.submit(self._fetch_info, a, deadline, connect_timeout) for a in addresses}
        infos: dict[str, pb.ClusterInfo] = {}
        down: list[ServerUnavailable] = []
        for address, future in futures.items():
            try:
                infos[address] = future.result()
            except ServerUnavailable as exc:
                down.append(exc)
        if len(down) == 1:
            raise down[0]
        if down:
            raise ServerUnavailable(
                f"{len(down)} servers unavailable: " + "; ".join(str(e) for e in down),
                what="GetClusterInfo", code=grpc.StatusCode.UNAVAILABLE,
            )
        return infos

    def _fetch_info(self, address: str, deadline: float, connect_timeout: float) -> pb.ClusterInfo:
        """GetClusterInfo from ``address``, retrying until ``deadline`` while it is down."""
        stub = pb_grpc.SamplingServiceStub(self._channels[address])
        request = pb.ClusterInfoRequest(client_id=self.client_id)
        backoff, last = 0.05, "no answer"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServerUnavailable(
                    f"server {address}: no ClusterInfo within connect_timeout={connect_timeout:g} s "
                    f"(last error: {last})",
                    what="GetClusterInfo", address=address, code=grpc.StatusCode.UNAVAILABLE,
                )
            try:
                # no wait_for_ready: a server that is down answers at once with the
                # connect error (e.g. connection refused), which is logged below
                return stub.GetClusterInfo(request, timeout=min(remaining, self._rpc_timeout))
            except grpc.RpcError as err:
                code = err.code()
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise error_from_rpc(err, "GetClusterInfo", address) from err
                error = f"{code.name}: {err.details()}"
                if error != last:  # the first failure, and every change of reason
                    log.warning("waiting up to %.0f s more for server %s: %s", remaining,
                                address, error)
                last = error
                time.sleep(max(0.0, min(backoff, deadline - time.monotonic())))
                backoff = min(backoff * 2, 1.0)

    def lookup(self, partition: int, request: pb.LookupNodesRequest) -> pb.LookupNodesReply:
        """LookupNodes on ``partition``'s server (with a deadline)."""
        request.client_id = self.client_id
        try:
            return self.stubs[partition].LookupNodes(request, timeout=self._rpc_timeout)
        except grpc.RpcError as err:
            raise error_from_rpc(err, "LookupNodes", self.addresses[partition]) from err

    def _lookup_all(self, make: Callable[[], pb.LookupNodesRequest]) -> list[pb.LookupNodesReply]:
        with ThreadPoolExecutor(max_workers=min(32, self.num_partitions)) as pool:
            return list(pool.map(lambda p: self.lookup(p, make()), range(self.num_partitions)))

    def split_nodes(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """``(original, global)`` IDs of every node of ``split``, sorted by original ID."""
        replies = self._lookup_all(lambda: pb.LookupNodesRequest(split=split))
        orig = np.concatenate([decode_tensor(r.original_ids) for r in replies]).astype(np.int64)
        glob = np.concatenate([decode_tensor(r.global_ids) for r in replies]).astype(np.int64)
        order = np.argsort(orig, kind="stable")
        return orig[order], glob[order]

    def global_ids(self, original: np.ndarray, node_type: str = "") -> np.ndarray:
        """Global IDs of original node IDs (of ``node_type`` on a typed graph; every one
        must be in the graph)."""
        tensor = encode_tensor(np.ascontiguousarray(original, dtype=np.int64))
        replies = self._lookup_all(lambda: pb.LookupNodesRequest(original_ids=tensor,
                                                                 node_type=node_type))
        found = np.stack([decode_tensor(r.global_ids) for r in replies]).max(axis=0)
        missing = original[found < 0]
        if missing.size:
            raise ValueError(f"input_nodes: expected node IDs of the graph, got {missing[:5].tolist()} "
                             "that no server holds")
        return found.astype(np.int64)

    def split_sizes(self, split: str) -> list[int]:
        """Seeds of ``split`` owned by each partition."""
        return [int(getattr(s, split)) for s in self.info.split_sizes]

    def partition_of(self, nodes: np.ndarray, node_type: str = "") -> np.ndarray:
        """Partition owning each global node ID (of ``node_type`` on a typed graph)."""
        book = self.partition_book
        if node_type:
            found = [t for t in self.info.typed.node_types if t.name == node_type]
            if not found:
                raise ValueError(f"node_type: expected one of "
                                 f"{[t.name for t in self.info.typed.node_types]}, got {node_type!r}")
            book = np.asarray(found[0].partition_book, dtype=np.int64)
        return np.searchsorted(book, nodes, side="right") - 1

    def feature_cache(self, counts: list[int], wire_dtype: int, device: torch.device, *,
                      progress: bool | None = None, reconnect: float = 15.0,
                      node_type: str | None = None) -> FeatureCache:
        """The feature cache of this plan, dtype and device (of ``node_type`` on a typed
        graph): filled on first use, then shared (so it fills once per job, not per loader
        or epoch). ``reconnect``: seconds a partition's broken fill stream is retried
        (:meth:`FeatureCache.fill`)."""
        key = (tuple(counts), int(wire_dtype), str(device), node_type or "")
        with self._cache_lock:
            if key not in self._caches:
                self._caches[key] = FeatureCache.fill(self, counts, wire_dtype, device,
                                                      progress=progress, reconnect=reconnect,
                                                      node_type=node_type)
            return self._caches[key]

    def auto_cache_budget(self, device: torch.device) -> int:
        """Bytes of ``cache_size="auto"`` on ``device`` (:func:`auto_cache_bytes`),
        measured when the first loader asks and then kept, so that every loader of this
        cluster on that device plans the same cache (and shares it)."""
        with self._cache_lock:
            key = str(device)
            if key not in self._auto_budgets:
                self._auto_budgets[key] = auto_cache_bytes(device, int(self.partition_book[-1]))
            return self._auto_budgets[key]

    def node_table(self, node_type: str | None = None) -> NodeTable | None:
        """Every node's original ID and label (:mod:`trainer_client.node_table`; of
        ``node_type``'s nodes on a typed graph), read on first use, then shared; None when
        the servers cannot answer it."""
        with self._cache_lock:
            key = node_type or ""
            if key not in self._node_tables:
                self._node_tables[key] = NodeTable.read(self, node_type)
            return self._node_tables[key]

    def close(self) -> None:
        """Close every channel."""
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def check_cluster(infos: dict[str, pb.ClusterInfo]) -> list[str]:
    """Check that the servers' ClusterInfo agree and cover each partition exactly once;
    return their addresses indexed by partition ID."""
    (first_address, first), *rest = infos.items()
    for address, info in rest:
        for name in SHARED_FIELDS:
            mine, theirs = getattr(first, name), getattr(info, name)
            if name in ("partition_book", "split_sizes"):
                mine, theirs = list(mine), list(theirs)
            if mine != theirs:
                raise ValueError(
                    f"ClusterInfo.{name}: servers disagree: {first_address} says {mine!r}, "
                    f"{address} says {theirs!r} (are they serving the same partitioning?)"
                )
    num_parts = int(first.num_partitions)
    book = list(first.partition_book)
    if len(book) != num_parts + 1 or book[0] != 0 or book[-1] != first.num_nodes or book != sorted(book):
        raise ValueError(
            f"ClusterInfo.partition_book: expected {num_parts + 1} non-decreasing offsets from 0 to "
            f"{first.num_nodes}, got {book}"
        )
    if len(first.split_sizes) != num_parts:
        raise ValueError(
            f"ClusterInfo.split_sizes: expected {num_parts} entries, got {len(first.split_sizes)}"
        )
    by_partition: dict[int, str] = {}
    for address, info in infos.items():
        p = int(info.partition_id)
        if not 0 <= p < num_parts:
            raise ValueError(f"ClusterInfo.partition_id of {address}: expected 0 .. {num_parts - 1}, got {p}")
        if p in by_partition:
            raise ValueError(f"servers: partition {p} is served by both {by_partition[p]} and {address}")
        by_partition[p] = address
    missing = [p for p in range(num_parts) if p not in by_partition]
    if missing:
        raise ValueError(
            f"servers: expected one server per partition 0 .. {num_parts - 1}, missing {missing} "
            f"(got {sorted(infos)})"
        )
    return [by_partition[p] for p in range(num_parts)]
