"""The partition a server holds: manifest facts (read at once), the validated partition
and its samplers (loaded once the port is bound, see :meth:`PartitionStore.load`)."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from typing import Any, TypeVar, cast

import grpc
import numpy as np
import torch

from partitioner.format import (
    Manifest,
    NodeData,
    Partition,
    PartitionFormatError,
    Structure,
    Verify,
    check_files,
    load_node_data,
    load_partition,
    load_structure,
    node_data_records,
    read_manifest,
    structure_records,
)
from partitioner.graph import SPLITS
from protos import codec, halfcast
from protos import sampling_pb2 as pb
from protos.channel import PeerError
from sampling_server.config import HOT_ORDERS, ConfigError, ServerConfig
from sampling_server.sampler import NeighborSampler, create_sampler, cuda_usable, uses_cuda
from sampling_server.structure import (
    StructureChoice,
    available_host_memory,
    choose_features,
    choose_structure,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Feature dtypes a request may ask for on the wire (UNSPECIFIED: the stored one).
FEATURE_WIRE_DTYPES: tuple[codec.WireDType, ...] = (pb.DTYPE_UNSPECIFIED, pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16)


def server_version() -> str:
    """The installed graphfeed version (``0+unknown`` when not installed)."""
    try:
        return metadata.version("graphfeed")
    except metadata.PackageNotFoundError:
        return "0+unknown"


#: The default rule ordering each partition's nodes for trainers' feature caches
#: (sampling_server/hot.py; ``--hot-order``).
HOT_ORDER = HOT_ORDERS[0]


class NotLoaded(RuntimeError):
    """The partition is not loaded (yet, or its load failed)."""


class Stopping(RuntimeError):
    """The server is stopping: its worker pools are closed, so a call still running
    cannot finish here (the client retries on the restarted server)."""


def check_partition_count(config: ServerConfig, num_partitions: int) -> None:
    """Refuse a partition ID or a peer list that does not fit the graph's partitions."""
    if config.partition >= num_partitions:
        raise ConfigError(f"partition: expected an ID in [0, {num_partitions}) for "
                          f"{config.partition_dir}, got {config.partition}")
    if config.peers and len(config.peers) != num_partitions:
        raise ConfigError(f"peers: expected {num_partitions} addresses (one per partition, "
                          f"this server's own included), got {len(config.peers)}")


def manifest_fingerprint(manifest_json: dict[str, Any]) -> str:
    """Hex SHA-256 of a manifest's canonical JSON: equal on every server of the graph."""
    canonical = json.dumps(manifest_json, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def colocated_servers(peers: tuple[str, ...], partition: int) -> int:
    """How many of the graph's servers (``peers``, one address per partition) name the
    same host as ``partition``'s own address, itself included (1 without peers)."""
    if not peers:
        return 1
    host = peers[partition].rsplit(":", 1)[0]
    return sum(1 for address in peers if address.rsplit(":", 1)[0] == host)


def share_arrays(part: Partition, structure: Structure | None, node_data: NodeData | None) -> None:
    """Point ``part``'s arrays at its rows of the whole graph's ``structure`` and
    ``node_data`` (where loaded: they hold the same values), so that a partition loaded
    into memory (``mmap: false``) is not held twice; its ``indptr`` stays its own (the
    joined offsets are shifted)."""
    start, stop = part.node_range
    if node_data is not None:
        part.x = node_data.x[start - node_data.node_start:stop - node_data.node_start]
        part.y = node_data.y[start - node_data.node_start:stop - node_data.node_start]
    if structure is not None:
        first = int(structure.indptr[start - structure.node_start])
        last = int(structure.indptr[stop - structure.node_start])
        part.indices = structure.indices[first:last]
        part.orig_ids = structure.orig_ids[start - structure.node_start:stop - structure.node_start]
        if part.edge_weight is not None and structure.edge_weight is not None:
            part.edge_weight = structure.edge_weight[first:last]


class PartitionStore:
    """One partition and its samplers.

    Construction reads and checks the manifest only (fast), so a bad directory, partition
    ID or peer list fails before the server binds its port. :meth:`load` does the slow
    part (file checks, memory maps, sampler set-up); samplers for the other sampling
    options (with replacement, weighted) are created on first use.
    """

    #: The whole graph's in-edges when the server samples from them (None: the
    #: partition's own; always on a typed graph's store).
    _structure: Structure | None = None
    #: Every node's features and labels when the server gathers them all (None: the
    #: partition's own; always on a typed graph's store).
    _node_data: NodeData | None = None

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        #: The partitioned graph's manifest.
        self.manifest: Manifest = read_manifest(config.partition_dir)
        m = self.manifest
        check_partition_count(config, m.num_partitions)
        self.partition_id = config.partition
        #: int64 ``[P+1]`` partition book.
        self.partition_book = np.asarray(m.partition_book, dtype=np.int64)
        #: ``[start, stop)`` of the owned global IDs.
        self.node_range = (int(m.partition_book[self.partition_id]),
                           int(m.partition_book[self.partition_id + 1]))
        #: Stored feature dtype on the wire.
        self.feature_dtype = codec.numpy_to_dtype(np.dtype(m.feature_dtype))
        #: Hex SHA-256 of the manifest's canonical JSON: equal on every server of the graph.
        self.graph_fingerprint = manifest_fingerprint(m.to_json())
        if config.structure == "full":  # every partition's files here (sizes and headers)
            check_files(config.partition_dir, structure_records(m), "size")
        if config.features == "full":
            if config.structure == "partition":  # not on a GPU then
                self._choose_features()
            check_files(config.partition_dir, node_data_records(m), "size")
        self._partition: Partition | None = None
        self._samplers: dict[tuple[bool, bool], NeighborSampler] = {}
        self._orig_order: np.ndarray | None = None
        self._lock = threading.Lock()
        self._loaded = threading.Event()
        #: Why the load failed (None while loading or once loaded).
        self.load_error: BaseException | None = None

    # -- loading ---------------------------------------------------------------------
    def load(self) -> None:
        """Load and validate the partition and create the default sampler. Records the
        error (and re-raises) when it fails."""
        started = time.perf_counter()
        try:
            part = load_partition(self.config.partition_dir, self.partition_id,
                                  mmap=self.config.mmap,
                                  verify=cast(Verify, self.config.verify))
            verify = cast(Verify, self.config.verify)
            self._structure = self._load_whole(
                "structure", self.config.structure, self._choose_structure,
                lambda: load_structure(self.config.partition_dir, verify=verify))
            self._node_data = self._load_whole(
                "features", self.config.features, self._choose_features,
                lambda: load_node_data(self.config.partition_dir, verify=verify))
            share_arrays(part, self._structure, self._node_data)
            sampler = create_sampler(part, self.config.device, topology=self.config.topology,
                                     gpu_cache_size=self.config.gpu_cache_size,
                                     structure=self._structure, node_data=self._node_data)
        except BaseException as exc:
            self.load_error = exc
            raise
        with self._lock:
            self._partition = part
            self._samplers[(False, False)] = sampler
        self._loaded.set()
        log.info("partition=%d: loaded in %.2f s: %d nodes, %d in-edges, sampling on %s%s",
                 self.partition_id, time.perf_counter() - started, part.num_nodes,
                 part.num_edges, self.device,
                 ("" if self._structure is None else
                  f" from the full graph's structure ({self._structure.num_nodes} nodes, "
                  f"{self._structure.indices.size} in-edges, "
                  f"{self._structure.nbytes / 2**20:.1f} MiB)")
                 + ("" if self._node_data is None else
                    f", gathering every node's features and labels "
                    f"({self._node_data.nbytes / 2**20:.1f} MiB)"))

    def _load_whole(self, what: str, setting: str, choose: Callable[[], StructureChoice],
                    load: Callable[[], T]) -> T | None:
        """The whole graph's ``what`` (the structure, or the features and labels) where
        ``choose`` says so, else None. ``auto`` falls back to the partition's own, with a
        warning, where another partition's file fails its checks; ``full`` fails."""
        choice = choose()
        log.info("partition=%d: %s %s (%s)", self.partition_id, what, choice.mode, choice.reason)
        if choice.mode != "full":
            return None
        try:
            return load()
        except PartitionFormatError as exc:
            if setting != "auto":
                raise
            # another partition's file is bad: this server's own partition serves
            log.warning("partition=%d: %s partition (auto: the whole graph's %s could not be "
                        "read: %s)", self.partition_id, what, what, exc)
            return None

    def _choose_structure(self) -> StructureChoice:
        """``structure: auto`` resolved for this host (and GPU, where the CUDA sampler
        would keep the graph in its memory)."""
        config = self.config
        gpu_free = None
        if (config.structure == "auto" and self.manifest.num_partitions > 1
                and config.topology == "device" and config.device != "cpu" and cuda_usable()):
            gpu_free = int(torch.cuda.mem_get_info()[0])  # (not under Numba's simulator)
        return choose_structure(config.structure, self.manifest, config.partition_dir,
                                host_free=self._host_share() if config.structure == "auto"
                                else None, gpu_free=gpu_free)

    def _host_share(self) -> int | None:
        """The available host memory this server may weigh ``auto``'s choices against:
        an equal share among the servers of the graph whose peer addresses name this
        server's host (they start together and each sees the same free memory)."""
        free = available_host_memory()
        sharing = colocated_servers(self.config.peers, self.partition_id)
        if sharing > 1:
            log.debug("partition=%d: %d servers of the graph name this host: auto weighs a "
                      "1/%d share of the available memory", self.partition_id, sharing, sharing)
        return None if free is None else free // sharing

    def _choose_features(self) -> StructureChoice:
        """``features: auto`` resolved for this host, once the structure is loaded."""
        config = self.config
        try:
            return choose_features(
                config.features, self.manifest, config.partition_dir,
                host_free=self._host_share() if config.features == "auto" else None,
                cuda_partition_structure=self._structure is None and uses_cuda(config.device))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def features_mode(self) -> str:
        """``full`` when the server gathers every node's features and labels itself, else
        ``partition`` (known once loaded)."""
        return "full" if self._node_data is not None else "partition"

    @property
    def structure_mode(self) -> str:
        """``full`` when the server samples from the whole graph's structure, else
        ``partition`` (known once loaded)."""
        return "full" if self._structure is not None else "partition"

    def held_bytes(self) -> dict[str, tuple[str, int]]:
        """What the loaded server holds: for ``structure`` and ``features``, whose
        (:attr:`structure_mode`, :attr:`features_mode`) and its bytes (memory maps count
        their size)."""
        part = self.partition
        structure = part.structure if self._structure is None else self._structure
        node_data = part.node_data if self._node_data is None else self._node_data
        return {"structure": (self.structure_mode, structure.nbytes),
                "features": (self.features_mode, node_data.nbytes)}

    @property
    def loaded(self) -> bool:
        return self._loaded.is_set()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Wait until the partition is loaded; False on timeout."""
        return self._loaded.wait(timeout)

    @property
    def partition(self) -> Partition:
        if self._partition is None:
            raise NotLoaded(self._not_loaded_reason())
        return self._partition

    def _not_loaded_reason(self) -> str:
        if self.load_error is not None:
            return (f"partition {self.partition_id} failed to load: "
                    f"{type(self.load_error).__name__}: {self.load_error}")
        return f"partition {self.partition_id} is still loading"

    def sampler(self, *, replace: bool = False, weighted: bool = False) -> NeighborSampler:
        """The sampler for these options (created on first use; thread-safe)."""
        key = (bool(replace), bool(weighted))
        with self._lock:
            found = self._samplers.get(key)
        if found is not None:
            return found
        part = self.partition
        if weighted and part.edge_weight is None:
            raise ValueError("weighted: the partition has no edge weights")
        with self._lock:
            if key not in self._samplers:
                self._samplers[key] = create_sampler(
                    part, self.config.device, replace=replace, weighted=weighted,
                    topology=self.config.topology, gpu_cache_size=self.config.gpu_cache_size,
                    share_features_of=self._samplers.get((False, False)),
                    structure=self._structure, node_data=self._node_data)
            return self._samplers[key]

    # -- facts -----------------------------------------------------------------------
    @property
    def device(self) -> str:
        """The sampling device, e.g. ``cpu`` or ``cuda:0``."""
        dev = self.sampler().device
        if dev.type == "cuda" and dev.index is None:
            return f"cuda:{torch.cuda.current_device()}"
        return str(dev)

    @property
    def peer_addresses(self) -> tuple[str, ...]:
        """Every partition's server address, indexed by partition ID."""
        if not self.config.peers:
            raise ConfigError(f"peers: the graph has {self.manifest.num_partitions} partitions; "
                              "give every server's address (--peers or --cluster)")
        return self.config.peers

    def split_counts(self, split: str) -> list[int]:
        """Seeds of ``split`` owned by each partition (the manifest's split sizes)."""
        return [int(p.split_sizes.get(split, 0)) for p in self.manifest.partitions]

    def has_split(self, split: str) -> bool:
        return any(split in p.split_sizes for p in self.manifest.partitions)

    def split_seeds(self, split: str) -> np.ndarray:
        """Global IDs of this partition's seeds of ``split`` (empty when absent)."""
        ids = self.partition.splits.get(split)
        return np.asarray(ids, dtype=np.int64) if ids is not None else np.empty(0, np.int64)

    def global_ids_of(self, original: np.ndarray) -> np.ndarray:
        """Global ID of each original node ID this partition owns, -1 for the others."""
        with self._lock:
            if self._orig_order is None:
                self._orig_order = np.argsort(np.asarray(self.partition.orig_ids), kind="stable")
            order = self._orig_order
        orig = np.asarray(self.partition.orig_ids)
        out = np.full(original.size, -1, dtype=np.int64)
        if order.size == 0:
            return out
        pos = np.minimum(np.searchsorted(orig[order], original), order.size - 1)
        found = orig[order[pos]] == original
        out[found] = order[pos[found]] + self.node_range[0]
        return out

    def original_ids_of(self, nodes: np.ndarray) -> np.ndarray:
        """Original IDs of owned global node IDs."""
        return np.asarray(self.partition.orig_ids[nodes - self.node_range[0]], dtype=np.int64)

    def owner_of(self, nodes: np.ndarray, node_type: str | None = None) -> np.ndarray:
        """Partition ID of each global node ID (``node_type``: typed graphs only)."""
        return np.searchsorted(self.partition_book, nodes, side="right") - 1

    def num_nodes_of(self, node_type: str | None = None) -> int:
        """Nodes of the graph (of ``node_type`` on a typed graph)."""
        return self.manifest.num_nodes

    def cluster_info(self) -> pb.ClusterInfo:
        """The facts every trainer and peer share (see ``ClusterInfo``)."""
        m = self.manifest
        sizes = [pb.SplitSizes(**{s: int(p.split_sizes.get(s, 0)) for s in SPLITS})
                 for p in m.partitions]
        return pb.ClusterInfo(
            format_version=m.format_version, graph_name=m.graph_name, num_nodes=m.num_nodes,
            num_edges=m.num_edges, partition_book=list(m.partition_book),
            partition_id=self.partition_id, num_partitions=m.num_partitions,
            feature_dim=m.feature_dim, feature_dtype=self.feature_dtype,
            num_classes=m.num_classes, split_sizes=sizes,
            peer_addresses=list(self.peer_addresses), has_edge_weights=m.has_edge_weight,
            server_version=server_version(), device=self.device, label_dtype=pb.INT64,
            graph_fingerprint=self.graph_fingerprint, hot_order=self.hot_order,
        )

    @property
    def hot_order(self) -> str:
        """The rule of this partition's hot order (``ClusterInfo.hot_order``)."""
        return self.config.hot_order

    def check_owned(self, nodes: np.ndarray, field: str) -> None:
        """Raise :class:`RequestError` naming ``field`` unless every ID is owned here."""
        start, stop = self.node_range
        if nodes.size and (int(nodes.min()) < start or int(nodes.max()) >= stop):
            raise RequestError(
                f"{field}: expected global node IDs owned by partition {self.partition_id}, in "
                f"[{start}, {stop}); got values in [{int(nodes.min())}, {int(nodes.max())}]")

    def set_peers(self, peers: tuple[str, ...]) -> None:
        """Set every partition's server address (before the server starts)."""
        if len(peers) != self.manifest.num_partitions:
            raise ConfigError(f"peers: expected {self.manifest.num_partitions} addresses (one per "
                              f"partition, this server's own included), got {len(peers)}")
        self.config = self.config.replace(peers=tuple(peers))


# -- requests ---------------------------------------------------------------------------
class RequestError(Exception):
    """A request cannot be served; ``code`` is the gRPC status to answer with and the
    message names the field, what was expected and what was received."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


def decode_node_ids(msg: pb.Tensor, field: str) -> np.ndarray:
    """A request's 1-d INT64 node-ID tensor as an owned int64 array."""
    try:
        ids = codec.decode_tensor(msg, writable=True)
    except codec.CodecError as exc:
        raise RequestError(f"{field}: {exc}") from exc
    if msg.dtype != pb.INT64 or ids.ndim != 1:
        raise RequestError(f"{field}: expected a 1-d int64 tensor of node IDs, got "
                           f"{codec.dtype_name(msg.dtype)} of shape {list(ids.shape)}")
    return ids


def wire_feature_dtype(
    requested: int, stored: codec.WireDType, field: str
) -> codec.WireDType:
    """The dtype features travel in: ``requested``, or ``stored`` when unspecified. The
    stored dtype may also be named (float64 features: a server resolves "as stored" to it
    in the requests it makes of its peers)."""
    if requested not in FEATURE_WIRE_DTYPES and requested != stored:
        names = [codec.dtype_name(d) for d in FEATURE_WIRE_DTYPES[1:]]
        raise RequestError(f"{field}: expected one of {names}, the stored dtype "
                           f"({codec.dtype_name(stored)}) or dtype_unspecified, got "
                           f"{codec.dtype_name(requested)}")
    return stored if requested == pb.DTYPE_UNSPECIFIED else cast(codec.WireDType, requested)


def cast_features(x: torch.Tensor, dtype: int) -> torch.Tensor:
    """Features in the wire ``dtype`` (no copy when they already are; float32 ->
    bfloat16 on the CPU in one parallel Numba pass, :mod:`protos.halfcast`)."""
    return halfcast.cast(x, codec.dtype_to_torch(dtype))


@contextmanager
def abort_on_error(context: grpc.ServicerContext, what: str, partition: int,
                   rejected: Callable[[str], None] | None = None) -> Iterator[None]:
    """Answer a failure inside the block with the right status, naming the problem:
    a bad request its own code, a partition not loaded or a server stopping UNAVAILABLE,
    a lost peer UNAVAILABLE, a peer refusing for want of a precondition (e.g. serving
    another graph) FAILED_PRECONDITION, anything else INTERNAL (logged with its traceback). The
    server goes on serving other calls."""
    try:
        yield
    except RequestError as exc:
        if rejected is not None:
            rejected(exc.code.name)
        log.info("%s rejected: %s: %s", what, exc.code.name, bounded(repr(str(exc)), 300))
        context.abort(exc.code, bounded(str(exc)))
    except NotLoaded as exc:
        context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    except Stopping as exc:
        log.info("%s on partition %d: %s", what, partition, exc)
        context.abort(grpc.StatusCode.UNAVAILABLE, f"{what} on partition {partition}: {exc}")
    except PeerError as exc:
        log.warning("%s failed on partition %d: %s", what, partition, exc)
        lost = exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                            grpc.StatusCode.CANCELLED)
        code = grpc.StatusCode.UNAVAILABLE if lost else \
            grpc.StatusCode.FAILED_PRECONDITION if exc.code == grpc.StatusCode.FAILED_PRECONDITION \
            else grpc.StatusCode.INTERNAL  # e.g. a peer on another graph: not until fixed
        context.abort(code, bounded(f"{what} on partition {partition}: {exc}"))
    except MemoryError:
        log.warning("%s on partition %d: out of memory", what, partition)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"{what} on partition {partition}: the server ran out of memory for this "
                      "request; ask for smaller batches or fewer neighbors")
    except Exception as exc:
        log.exception("%s failed on partition %d", what, partition)
        context.abort(grpc.StatusCode.INTERNAL, bounded(
            f"{what} on partition {partition} failed: {type(exc).__name__}: {exc}"))


#: Longest status details a server sends (the rest is cut, saying how much).
MAX_DETAILS_CHARS = 1000


def bounded(text: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how many were left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"
