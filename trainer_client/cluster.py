"""``Cluster``: channels to every sampling server of one partitioned graph, with their
ClusterInfo checked against each other (same graph, each partition served once), the
graph's facts (:class:`~trainer_client.graph.TypedGraph`, for both kinds), the node
lookups a loader needs (a split's nodes, original IDs to graphfeed's own), and the
tables it fills from every server once per job and shares: the feature caches and the
node tables (:mod:`trainer_client.fills`)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Self

import grpc
import numpy as np
import torch

from protos import fastwire
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.channel import create_channel, error_from_rpc
from protos.codec import decode_tensor, encode_tensor
from trainer_client.cache import FeatureCache, auto_cache_bytes
from trainer_client.connect import REFUSED_GRACE, fetch_infos
from trainer_client.fills import HotRowsCall, fill_feature_cache, read_node_table
from trainer_client.graph import TypedGraph
from trainer_client.node_table import NodeTable

log = logging.getLogger(__name__)

#: ClusterInfo fields every server of one cluster must agree on.
SHARED_FIELDS = ("format_version", "graph_name", "num_nodes", "num_edges", "partition_book",
                 "num_partitions", "feature_dim", "feature_dtype", "num_classes", "split_sizes",
                 "has_edge_weights", "label_dtype", "graph_fingerprint", "typed")


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


class Closing:
    """A resource that ``with`` closes (:meth:`close`) when the block ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class Cluster(Closing):
    """Channels to every sampling server of a cluster, with their checked ClusterInfo.

    ``servers`` may list the servers in any order (their ClusterInfo says which
    partition each holds); when fewer addresses than partitions are given, the others
    are taken from ``ClusterInfo.peer_addresses``. Servers that are not up yet are
    waited for, up to ``connect_timeout`` seconds in all, saying every few seconds what
    for; when every server has refused connections for ``refused_grace`` seconds
    (nothing listens at those addresses), it stops waiting at once, naming the fix
    (:mod:`trainer_client.connect`). Methods that take a ``node_type`` default to the
    target type (a plain graph's one node type).
    """

    def __init__(self, servers: Sequence[str] | str, *, connect_timeout: float = 60.0,
                 rpc_timeout: float = 30.0, client_id: str | None = None,
                 refused_grace: float = REFUSED_GRACE) -> None:
        addresses = _parse_servers(servers)
        for name, value in (("connect_timeout", connect_timeout), ("rpc_timeout", rpc_timeout),
                            ("refused_grace", refused_grace)):
            if not value > 0:
                raise ValueError(f"{name}: expected seconds > 0, got {value}")
        self.client_id = client_id or f"trainer-{socket.gethostname()}-{os.getpid()}"
        self._rpc_timeout = rpc_timeout
        self._channels: dict[str, grpc.Channel] = {}
        self._caches: dict[tuple[tuple[int, ...], int, str, str], FeatureCache] = {}
        self._cache_lock = threading.Lock()
        self._auto_budgets: dict[str, int] = {}
        self._node_tables: dict[str, NodeTable | None] = {}
        deadline = time.monotonic() + connect_timeout

        def fetch(wanted: list[str]) -> dict[str, pb.ClusterInfo]:
            for address in wanted:
                self._channels.setdefault(address, create_channel(address))
            return fetch_infos({a: self._channels[a] for a in wanted}, self.client_id, deadline,
                               connect_timeout, rpc_timeout, refused_grace)

        try:
            infos = fetch(addresses)
            first = infos[addresses[0]]
            served = {int(i.partition_id) for i in infos.values()}
            missing = {p: a for p, a in enumerate(first.peer_addresses) if p not in served and a not in infos}
            if len(infos) < first.num_partitions and missing:
                log.info("partitions %s: no address given; using their peer addresses %s",
                         sorted(missing), sorted(missing.values()))
                infos.update(fetch(list(missing.values())))
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
        self.stream_stubs = [fastwire.MinibatchStreamStub(self._channels[a]) for a in self.addresses]
        #: The graph's facts (a plain graph as one node type and one edge type).
        self.graph = TypedGraph.from_info(self.info)

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

    def channel(self, partition: int) -> grpc.Channel:
        """The channel to ``partition``'s server."""
        return self._channels[self.addresses[partition]]

    @property
    def num_partitions(self) -> int:
        return int(self.info.num_partitions)

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

    def _type(self, node_type: str | None) -> str:
        """``node_type``, checked (None: the target type)."""
        t = node_type or self.graph.target_type
        if t not in self.graph.books:
            raise ValueError(f"node_type: expected one of {list(self.graph.node_types)}, got {node_type!r}")
        return t

    def global_ids(self, original: np.ndarray, node_type: str | None = None) -> np.ndarray:
        """Global IDs of original node IDs (integers, of ``node_type``); every one must be
        in the graph."""
        original = np.asarray(original)
        if original.dtype == np.bool_ or not np.issubdtype(original.dtype, np.integer):
            raise ValueError(f"original: expected integer node IDs, got dtype {original.dtype}")
        tensor = encode_tensor(np.ascontiguousarray(original, dtype=np.int64))
        wire_type = self.graph.wire_type(self._type(node_type))
        replies = self._lookup_all(lambda: pb.LookupNodesRequest(original_ids=tensor, node_type=wire_type))
        found = np.stack([decode_tensor(r.global_ids) for r in replies]).max(axis=0)
        missing = original[found < 0]
        if missing.size:
            raise ValueError(f"input_nodes: expected node IDs of the graph, got {missing[:5].tolist()} "
                             "that no server holds")
        return found.astype(np.int64)

    def partition_of(self, nodes: np.ndarray, node_type: str | None = None) -> np.ndarray:
        """Partition owning each global node ID (of ``node_type``)."""
        return np.searchsorted(self.graph.books[self._type(node_type)], nodes, side="right") - 1

    def feature_cache(self, counts: list[int], wire_dtype: int, device: torch.device, *,
                      progress: bool | None = None, reconnect: float = 15.0,
                      node_type: str | None = None) -> FeatureCache:
        """The feature cache of this plan, dtype and device (of ``node_type``): filled on
        first use, then shared (so it fills once per job, not per loader or epoch).
        ``reconnect``: seconds a partition's broken fill stream is retried
        (:meth:`fill_feature_cache`)."""
        t = self._type(node_type)
        key = (tuple(counts), int(wire_dtype), str(device), t)
        with self._cache_lock:
            if key not in self._caches:
                self._caches[key] = self.fill_feature_cache(counts, wire_dtype, device, progress=progress,
                                                            reconnect=reconnect, node_type=t)
            return self._caches[key]

    def fill_feature_cache(self, counts: Sequence[int], wire_dtype: int, device: torch.device, *,
                           progress: bool | None = None, reconnect: float = 15.0,
                           node_type: str | None = None) -> FeatureCache:
        """A new feature cache of the plan ``counts`` (the hottest ``counts[p]`` nodes of
        partition ``p``, of ``node_type``), streamed from every server at once
        (:func:`trainer_client.fills.fill_feature_cache`: a partition whose stream breaks
        is filled again for up to ``reconnect`` seconds)."""
        graph, t = self.graph, self._type(node_type)
        # the stored dtype is asked for as such (servers before it could be named refuse
        # float64 by name)
        asked = pb.DTYPE_UNSPECIFIED if wire_dtype == graph.feature_dtypes[t] else wire_dtype

        def open_stream(p: int, count: int, timeout: float) -> HotRowsCall:
            request = pb.HotNodesRequest(count=count, include_features=True, client_id=self.client_id,
                                         feature_dtype=asked,  # type: ignore[arg-type]
                                         expect=self.expectation(p), node_type=graph.wire_type(t))
            call: HotRowsCall = self.stubs[p].StreamHotNodes(request, timeout=timeout)
            return call

        return fill_feature_cache(open_stream, self.addresses, counts, graph.books[t], graph.feature_dims[t],
                                  wire_dtype, device, node_type=t, of_type=graph.of_type(t),
                                  progress=progress, reconnect=reconnect)

    def auto_cache_budget(self, device: torch.device) -> int:
        """Bytes of ``cache_size="auto"`` on ``device`` (:func:`auto_cache_bytes`, after
        an index entry per node of every type with features), measured when the first
        loader asks and then kept, so that every loader of this cluster on that device
        plans the same cache (and shares it)."""
        with self._cache_lock:
            key = str(device)
            if key not in self._auto_budgets:
                self._auto_budgets[key] = auto_cache_bytes(device, self.graph.featured_nodes)
            return self._auto_budgets[key]

    def node_table(self, node_type: str | None = None) -> NodeTable | None:
        """Every node's original ID and label (:mod:`trainer_client.node_table`; of
        ``node_type``'s nodes), read on first use, then shared; None when the servers
        cannot answer it."""
        t = self._type(node_type)
        with self._cache_lock:
            if t not in self._node_tables:
                self._node_tables[t] = read_node_table(self.lookup, self.addresses, self.graph.books[t],
                                                       self.graph.wire_type(t), self.graph.of_type(t))
            return self._node_tables[t]

    def close(self) -> None:
        """Close every channel."""
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


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
                raise ValueError(f"ClusterInfo.{name}: servers disagree: {first_address} says {mine!r}, "
                                 f"{address} says {theirs!r} (are they serving the same partitioning?)")
    num_parts = int(first.num_partitions)
    book = list(first.partition_book)
    if len(book) != num_parts + 1 or book[0] != 0 or book[-1] != first.num_nodes or book != sorted(book):
        raise ValueError(f"ClusterInfo.partition_book: expected {num_parts + 1} non-decreasing offsets from "
                         f"0 to {first.num_nodes}, got {book}")
    if len(first.split_sizes) != num_parts:
        raise ValueError(f"ClusterInfo.split_sizes: expected {num_parts} entries, got "
                         f"{len(first.split_sizes)}")
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
        raise ValueError(f"servers: expected one server per partition 0 .. {num_parts - 1}, missing "
                         f"{missing} (got {sorted(infos)})")
    return [by_partition[p] for p in range(num_parts)]
