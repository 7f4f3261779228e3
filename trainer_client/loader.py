"""``RemoteNeighborLoader``: PyG ``NeighborLoader`` batches, sampled by graphfeed servers.

One loader per DDP rank. It connects to every sampling server (:class:`Cluster`: the
servers may start after the trainer; it waits up to ``connect_timeout``), checks that
they serve the same graph and that each partition is served exactly once, plans each
epoch exactly as the servers do (:func:`protos.plan.plan_epoch`, from the split sizes
of ``ClusterInfo``), and streams the epoch from every server at once
(:class:`~trainer_client.stream.EpochStream`). ``len(loader)`` is the number of batches
of this rank, equal on every rank by construction, so DDP never waits on a rank that
ran out of batches.

::

    loader = RemoteNeighborLoader(["node0:50051", "node1:50051"], "train",
                                  num_neighbors=[10, 5], batch_size=1024, shuffle=True,
                                  rank=rank, world_size=world_size, device="cuda:0")
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:          # torch_geometric.data.Data on cuda:0
            out = model(batch.x, batch.edge_index)[: batch.batch_size]
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import TypeAlias

import grpc
import numpy as np
import torch
from torch_geometric.data import Data

from protos import fastwire
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.channel import ServerUnavailable, create_channel, error_from_rpc
from protos.codec import MAX_CHUNK_BYTES, encode_tensor
from protos.plan import EpochPlan, plan_epoch
from trainer_client.decode import BatchSpec, to_device
from trainer_client.stream import EpochStream, ServerStream, StreamStats, StreamTimeouts

log = logging.getLogger(__name__)

#: Split names a loader may iterate.
SPLITS = ("train", "val", "test")
#: Feature dtypes on the wire, by name; "stored" keeps the partition's own dtype.
WIRE_FEATURE_DTYPES: dict[str, int] = {
    "float32": pb.FLOAT32,
    "float16": pb.FLOAT16,
    "bfloat16": pb.BFLOAT16,
    "stored": pb.DTYPE_UNSPECIFIED,
}
#: ClusterInfo fields every server of one cluster must agree on.
SHARED_FIELDS = (
    "format_version", "graph_name", "num_nodes", "num_edges", "partition_book",
    "num_partitions", "feature_dim", "feature_dtype", "num_classes", "split_sizes",
    "has_edge_weights", "label_dtype", "graph_fingerprint",
)
#: Most explicit seeds one loader may have (they travel in one message of the request).
MAX_SEEDS = MAX_CHUNK_BYTES // 8

#: Seed node IDs: a 1-d integer tensor, NumPy array or sequence.
Seeds: TypeAlias = torch.Tensor | np.ndarray | Sequence[int]


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

    def split_sizes(self, split: str) -> list[int]:
        """Seeds of ``split`` owned by each partition."""
        return [int(getattr(s, split)) for s in self.info.split_sizes]

    def partition_of(self, nodes: np.ndarray) -> np.ndarray:
        """Partition owning each global node ID."""
        return np.searchsorted(self.partition_book, nodes, side="right") - 1

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


def _seeds_array(seeds: Seeds) -> np.ndarray:
    """Seeds as a 1-d int64 array; raises naming ``seeds``."""
    array = seeds.detach().cpu().numpy() if isinstance(seeds, torch.Tensor) else np.asarray(seeds)
    if array.dtype == np.bool_ or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise ValueError(f"seeds: expected integer global node IDs, got dtype {array.dtype}")
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"seeds: expected a non-empty 1-d array of node IDs, got shape {list(array.shape)}")
    return array.astype(np.int64, copy=False)


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``low .. high``; raises naming the field otherwise."""
    if not _is_int(value) or int(value) < low or (high is not None and int(value) > high):  # type: ignore[call-overload]
        bound = f"an integer >= {low}" if high is None else f"an integer in {low} .. {high}"
        raise ValueError(f"{name}: expected {bound}, got {value!r}")
    return int(value)  # type: ignore[call-overload]


class RemoteNeighborLoader:
    """Yields PyG ``Data`` minibatches of one rank's epoch, sampled by graphfeed servers.

    Each batch has ``x``, ``edge_index``, ``y``, ``n_id``, ``batch_size``,
    ``num_sampled_nodes`` and ``num_sampled_edges``, as PyG's ``NeighborLoader`` gives;
    the first ``batch_size`` nodes are the seeds. Tensors that stay on the CPU share the
    received messages' bytes: treat them as read-only.
    """

    def __init__(
        self,
        servers: Sequence[str] | str | Cluster,
        split: str | None = None,
        *,
        seeds: Seeds | None = None,
        num_neighbors: Sequence[int],
        batch_size: int,
        shuffle: bool = False,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
        prefetch: int = 4,
        seed: int = 0,
        feature_dtype: str = "float32",
        cast_features: bool = True,
        include_labels: bool = True,
        replace: bool = False,
        weighted: bool = False,
        pin_memory: bool | None = None,
        connect_timeout: float = 60.0,
        stall_timeout: float = 60.0,
        reconnect_timeout: float = 15.0,
        rpc_timeout: float = 30.0,
        client_id: str | None = None,
    ) -> None:
        """Check the arguments, connect to the servers and plan epoch 0.

        ``servers``: addresses (any order, or one comma-separated string), or a
        :class:`Cluster` to share channels between loaders (the loader does not close
        it). Seeds come from ``split`` (default ``"train"``) or ``seeds`` (global node
        IDs), not both. ``feature_dtype`` is the features' dtype on the wire
        (``float32``, ``float16``, ``bfloat16`` or ``stored``); ``cast_features`` casts
        them to float32 on ``device``. ``stall_timeout``: seconds without a message
        before a stream is resumed; ``reconnect_timeout``: seconds a broken stream is
        retried before ServerUnavailable.
        """
        if split is not None and seeds is not None:
            raise ValueError(f"split, seeds: expected one of them, got split={split!r} and seeds")
        split = split if split is not None or seeds is not None else "train"
        if split is not None and split not in SPLITS:
            raise ValueError(f"split: expected one of {list(SPLITS)}, got {split!r}")
        self._validate(num_neighbors, batch_size, rank, world_size, prefetch, seed, feature_dtype)
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"device: expected a torch device such as 'cpu' or 'cuda:0', got {device!r}"
            ) from exc
        self.timeouts = StreamTimeouts(stall=stall_timeout, reconnect=reconnect_timeout)
        self.split = split
        self.num_neighbors = [int(f) for f in num_neighbors]
        self.batch_size = int(batch_size)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.rank, self.world_size = int(rank), int(world_size)
        self.prefetch, self.seed = int(prefetch), int(seed)
        self.feature_dtype = feature_dtype
        self.cast_features, self.include_labels = bool(cast_features), bool(include_labels)
        self.replace, self.weighted = bool(replace), bool(weighted)
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else bool(pin_memory)
        seed_array = _seeds_array(seeds) if seeds is not None else None
        self._seeds_tensor: pb.Tensor | None = None
        self._owns_cluster = not isinstance(servers, Cluster)
        self.cluster = (
            servers if isinstance(servers, Cluster)
            else Cluster(servers, connect_timeout=connect_timeout, rpc_timeout=rpc_timeout,
                         client_id=client_id)
        )
        self.client_id = client_id or f"{self.cluster.client_id}-rank{self.rank}"
        try:
            self._seed_counts = self._count_seeds(seed_array)
            if self.weighted and not self.cluster.info.has_edge_weights:
                raise ValueError("weighted: expected a graph with edge weights, but the servers have none")
            self.epoch = 0
            self._plan = self.plan(0)
        except BaseException:
            self.close()
            raise
        #: Counters of the last epoch streamed.
        self.last_stats = StreamStats()

    @staticmethod
    def _validate(
        num_neighbors: Sequence[int], batch_size: int, rank: int, world_size: int, prefetch: int,
        seed: int, feature_dtype: str,
    ) -> None:
        """Check the plain arguments; errors name the field."""
        fanouts = list(num_neighbors) if isinstance(num_neighbors, Sequence) else None
        if not fanouts or not all(_is_int(f) for f in fanouts):
            raise ValueError(f"num_neighbors: expected a non-empty list of integers, got {num_neighbors!r}")
        if any(f < -1 for f in fanouts):
            raise ValueError(f"num_neighbors: expected fanouts >= -1 (-1 = all neighbors), got {fanouts}")
        _check_int("batch_size", batch_size, 1, 2**31 - 1)
        _check_int("world_size", world_size, 1)
        _check_int("rank", rank, 0, int(world_size) - 1)
        _check_int("prefetch", prefetch, 1)
        _check_int("seed", seed, 0, 2**64 - 1)
        if feature_dtype not in WIRE_FEATURE_DTYPES:
            raise ValueError(
                f"feature_dtype: expected one of {list(WIRE_FEATURE_DTYPES)}, got {feature_dtype!r}"
            )

    def _count_seeds(self, seeds: np.ndarray | None) -> list[int] | None:
        """Explicit seeds' count per owning partition (None for a split); checks them.

        Every server receives all the seeds and takes its own through the partition
        book, so every server (and this loader) plans the epoch from the same counts.
        """
        if seeds is None:
            return None
        num_nodes = int(self.cluster.info.num_nodes)
        bad = seeds[(seeds < 0) | (seeds >= num_nodes)]
        if bad.size:
            raise ValueError(
                f"seeds: expected global node IDs in 0 .. {num_nodes - 1}, got {bad[:5].tolist()}"
            )
        uniq, counts = np.unique(seeds, return_counts=True)
        if uniq.size != seeds.size:
            raise ValueError(
                f"seeds: expected each node ID once, got {seeds.size - uniq.size} repeats "
                f"(e.g. {int(uniq[counts > 1][0])})"
            )
        if seeds.size > MAX_SEEDS:
            raise ValueError(f"seeds: expected at most {MAX_SEEDS} seeds (one message), got {seeds.size}")
        self._seeds_tensor = encode_tensor(seeds)
        owner = self.cluster.partition_of(seeds)
        return [int(c) for c in np.bincount(owner, minlength=self.cluster.num_partitions)]

    # ---- facts -----------------------------------------------------------------------

    @property
    def num_features(self) -> int:
        """Feature columns of every node."""
        return int(self.cluster.info.feature_dim)

    @property
    def num_classes(self) -> int:
        """Number of classes (labels are 0 .. num_classes-1; -1 = unlabeled)."""
        return int(self.cluster.info.num_classes)

    @property
    def cluster_info(self) -> pb.ClusterInfo:
        """The servers' ClusterInfo (partition 0's)."""
        return self.cluster.info

    @property
    def seeds_per_partition(self) -> list[int]:
        """Seeds of the epoch owned by each partition."""
        if self._seed_counts is not None:
            return list(self._seed_counts)
        assert self.split is not None
        return self.cluster.split_sizes(self.split)

    @property
    def num_seeds(self) -> int:
        """Seeds of one epoch, over all ranks."""
        return sum(self.seeds_per_partition)

    def plan(self, epoch: int) -> EpochPlan:
        """The plan of ``epoch`` (the same as every server and rank computes)."""
        return plan_epoch(
            self.seeds_per_partition, self.batch_size, self.world_size, shuffle=self.shuffle,
            seed=self.seed, epoch=epoch, drop_last=self.drop_last,
        )

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration streams (shuffling and sampling draws)."""
        self.epoch = _check_int("epoch", epoch, 0)
        self._plan = self.plan(self.epoch)

    def __len__(self) -> int:
        """Batches of this rank in the current epoch (equal on every rank)."""
        return self._plan.batches_per_rank

    # ---- streaming -------------------------------------------------------------------

    def _request(self) -> pb.EpochRequest:
        request = pb.EpochRequest(
            fanouts=self.num_neighbors, batch_size=self.batch_size, shuffle=self.shuffle,
            drop_last=self.drop_last, seed=self.seed, epoch=self.epoch, rank=self.rank,
            world_size=self.world_size, resume_from=0,
            feature_dtype=WIRE_FEATURE_DTYPES[self.feature_dtype],  # type: ignore[arg-type]
            sampling=pb.SamplingOptions(replace=self.replace, weighted=self.weighted),
            include_features=True, include_labels=self.include_labels, client_id=self.client_id,
        )
        if self._seeds_tensor is not None:
            request.seeds.CopyFrom(self._seeds_tensor)
        else:
            assert self.split is not None
            request.split = self.split
        return request

    def stream(self) -> EpochStream:
        """The current epoch's stream of decoded CPU batches (use it as a context manager)."""
        num_batches = len(self)
        request = self._request()
        servers = []
        for p, address in enumerate(self.cluster.addresses):
            indices = tuple(b.index for b in self._plan.rank_batches(self.rank) if b.partition == p)
            if indices:
                servers.append(ServerStream(
                    partition=p, address=address, stub=self.cluster.stream_stubs[p],
                    request=request, indices=indices,
                ))
        spec = BatchSpec(
            num_hops=len(self.num_neighbors), feature_dim=self.num_features, include_features=True,
            include_labels=self.include_labels, num_batches=num_batches,
        )
        return EpochStream(servers, num_batches, spec, prefetch=self.prefetch, timeouts=self.timeouts,
                           pin_memory=self.pin_memory)

    def __iter__(self) -> Iterator[Data]:
        """The current epoch's batches, in order, on ``device``."""
        dtype = torch.float32 if self.cast_features else None
        with self.stream() as stream:
            self.last_stats = stream.stats
            for batch in stream:
                yield to_device(batch.data, self.device, feature_dtype=dtype, non_blocking=self.pin_memory)

    def close(self) -> None:
        """Close the channels (unless the Cluster was passed in)."""
        if self._owns_cluster and hasattr(self, "cluster"):
            self.cluster.close()

    def __enter__(self) -> RemoteNeighborLoader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        source = f"split={self.split!r}" if self.split else f"seeds={self.num_seeds}"
        return (
            f"{type(self).__name__}({source}, num_neighbors={self.num_neighbors}, "
            f"batch_size={self.batch_size}, rank={self.rank}/{self.world_size}, "
            f"servers={self.cluster.addresses})"
        )
