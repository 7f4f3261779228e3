"""The partition a server holds, plain or typed: manifest facts (read at once), the
validated partition and its samplers (loaded once the port is bound, see
:meth:`PartitionStore.load`).

A plain graph is the typed graph of one node type and one edge type; requests that name
no type (a plain graph's) resolve to them (:meth:`PartitionStore.node_type_of`,
:meth:`~PartitionStore.edge_type_of`), and the plain ``ClusterInfo`` fields describe the
target type of a typed graph.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from importlib import metadata
from typing import TypeVar, cast

import numpy as np
import torch

from partitioner.format import (
    PartitionFormatError,
    Verify,
    check_files,
    load_node_map,
    load_partition,
    read_manifest,
)
from partitioner.graph import SPLITS, EdgeType, GraphDataError, edge_type_name, parse_edge_type
from partitioner.joins import load_node_data, load_structure, node_data_records, structure_records
from partitioner.links import LinkSplitArrays, LinkSplitInfo, load_link_split
from partitioner.partition import NodeData, Partition, Structure
from protos import codec
from protos import sampling_pb2 as pb
from sampling_server.config import ConfigError, ServerConfig
from sampling_server.errors import NotLoaded, RequestError
from sampling_server.sampler import NeighborSampler, create_sampler, cuda_usable, uses_cuda
from sampling_server.structure import (
    StructureChoice,
    available_host_memory,
    choose_features,
    choose_structure,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


def server_version() -> str:
    """The installed graphfeed version (``0+unknown`` when not installed)."""
    try:
        return metadata.version("graphfeed")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def check_partition_count(config: ServerConfig, num_partitions: int) -> None:
    """Refuse a partition ID or a peer list that does not fit the graph's partitions."""
    if config.partition >= num_partitions:
        raise ConfigError(f"partition: expected an ID in [0, {num_partitions}) for "
                          f"{config.partition_dir}, got {config.partition}")
    if config.peers and len(config.peers) != num_partitions:
        raise ConfigError(f"peers: expected {num_partitions} addresses (one per partition, "
                          f"this server's own included), got {len(config.peers)}")


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
    for t in part.node_types:
        start, stop = part.node_range(t)
        if node_data is not None:
            s0 = node_data.node_start[t]
            if t in part.x:
                part.x[t] = node_data.x[t][start - s0:stop - s0]
            if t == part.target_type:
                part.y = node_data.y[start - s0:stop - s0]
        if structure is not None:
            s0 = structure.node_start[t]
            part.orig_ids[t] = structure.orig_ids[t][start - s0:stop - s0]
    if structure is None:
        return
    for et in part.edge_types:
        start, stop = part.node_range(et[2])
        s0 = structure.node_start[et[2]]
        first, last = int(structure.indptr[et][start - s0]), int(structure.indptr[et][stop - s0])
        part.indices[et] = structure.indices[et][first:last]
        if et in part.edge_weight and et in structure.edge_weight:
            part.edge_weight[et] = structure.edge_weight[et][first:last]


class PartitionStore:
    """One partition and its samplers.

    Construction reads and checks the manifest only (fast), so a bad directory, partition
    ID or peer list fails before the server binds its port. :meth:`load` does the slow
    part (file checks, memory maps, sampler set-up); samplers for the other sampling
    options (with replacement, weighted) are created on first use.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        #: The partitioned graph's manifest.
        self.manifest = m = read_manifest(config.partition_dir)
        check_partition_count(config, m.num_partitions)
        self.partition_id = config.partition
        #: Whether the graph is typed (``ClusterInfo.typed``), not plain.
        self.typed = m.typed
        #: Node type to its int64 ``[P+1]`` partition book.
        self.books = {t: np.asarray(b, dtype=np.int64) for t, b in m.partition_book.items()}
        #: Node type to its stored feature dtype on the wire (types with features only).
        self.feature_dtypes: dict[str, codec.WireDType] = {
            t: codec.numpy_to_dtype(np.dtype(d)) for t, d in m.feature_dtypes.items()}
        #: The target type's (FLOAT32 when it has no features).
        self.feature_dtype = self.feature_dtypes.get(m.target_type, pb.FLOAT32)
        #: Hex SHA-256 of the manifest's canonical JSON: equal on every server of the graph.
        self.graph_fingerprint = m.fingerprint
        #: The whole graph's in-edges / features and labels when the server holds them
        #: (None: the partition's own).
        self._structure: Structure | None = None
        self._node_data: NodeData | None = None
        if config.structure == "full":  # every partition's files here (sizes and headers)
            check_files(config.partition_dir, structure_records(m), "size")
        if config.features == "full":
            if config.structure == "partition":  # not on a GPU then
                self._choose_features()
            check_files(config.partition_dir, node_data_records(m), "size")
        self._partition: Partition | None = None
        self._samplers: dict[tuple[bool, bool], NeighborSampler] = {}
        self._orig_orders: dict[str, np.ndarray] = {}
        self._node_maps: dict[str, np.ndarray] = {}
        self._link_splits: dict[str, LinkSplitArrays] = {}
        self._links_lock = threading.Lock()  # loading a split reads it whole: not under _lock
        self._lock = threading.Lock()
        self._loaded = threading.Event()
        #: Why the load failed (None while loading or once loaded).
        self.load_error: BaseException | None = None

    # -- loading ---------------------------------------------------------------------
    def load(self) -> None:
        """Load and validate the partition and create the default sampler. Records the
        error (and re-raises) when it fails."""
        started = time.perf_counter()
        verify = cast(Verify, self.config.verify)
        try:
            part = load_partition(self.config.partition_dir, self.partition_id, mmap=self.config.mmap,
                                  verify=verify)
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
        nodes = {t: part.num_nodes(t) for t in part.node_types}
        edges = {edge_type_name(et): part.num_edges(et) for et in part.edge_types}
        log.info("partition=%d: loaded in %.2f s: %s nodes, %s in-edges, sampling on %s%s",
                 self.partition_id, time.perf_counter() - started,
                 nodes if self.typed else sum(nodes.values()),
                 edges if self.typed else sum(edges.values()), self.device,
                 ("" if self._structure is None else
                  f" from the full graph's structure ({self.manifest.num_nodes} nodes, "
                  f"{self.manifest.num_edges} in-edges, {self._structure.nbytes / 2**20:.1f} MiB)")
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
                                host_free=self._host_share() if config.structure == "auto" else None,
                                gpu_free=gpu_free)

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
        if weighted and not self.weighted:
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
    def weighted(self) -> bool:
        """Whether every relation has edge weights (``ClusterInfo.has_edge_weights``)."""
        return set(self.manifest.edge_types) <= self.manifest.weighted

    @property
    def has_edge_ids(self) -> bool:
        """Whether the partition stores every edge's original ID (``ClusterInfo.has_edge_ids``):
        partitions written before edge IDs were stored do not."""
        part = self.partition
        return all(et in part.e_id for et in part.edge_types)

    @property
    def edge_feature_dtypes(self) -> dict[EdgeType, codec.WireDType]:
        """Edge type to its stored edge features' dtype on the wire (types with them only)."""
        return {et: codec.numpy_to_dtype(a.dtype) for et, a in self.partition.edge_attr.items()}

    def edge_feature_info(self, edge_type: EdgeType) -> pb.EdgeFeatureInfo | None:
        """What ``ClusterInfo`` says of ``edge_type``'s edge features (None: it has none)."""
        attr = self.partition.edge_attr.get(edge_type)
        if attr is None:
            return None
        return pb.EdgeFeatureInfo(shape=[int(d) for d in attr.shape[1:]],
                                  dtype=codec.numpy_to_dtype(attr.dtype))

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

    @property
    def hot_order(self) -> str:
        """The rule of this partition's hot orders (``ClusterInfo.hot_order``)."""
        return self.config.hot_order

    def split_seeds(self, split: str) -> np.ndarray:
        """Global IDs of this partition's seeds of ``split`` (empty when absent)."""
        ids = self.partition.splits.get(split)
        return np.asarray(ids, dtype=np.int64) if ids is not None else np.empty(0, np.int64)

    def cluster_info(self) -> pb.ClusterInfo:
        """The facts every trainer and peer share (see ``ClusterInfo``): the plain fields
        describe the target type of a typed graph, whose types are in ``typed``."""
        m = self.manifest
        target = m.target
        sizes = [pb.SplitSizes(**{s: int(p.split_sizes.get(s, 0)) for s in SPLITS}) for p in m.partitions]
        info = pb.ClusterInfo(
            format_version=m.format_version, graph_name=m.graph_name, num_nodes=target.num_nodes,
            num_edges=m.num_edges, partition_book=[int(v) for v in self.books[m.target_type]],
            partition_id=self.partition_id, num_partitions=m.num_partitions,
            feature_dim=target.feature_dim, feature_dtype=self.feature_dtype,
            num_classes=m.num_classes, split_sizes=sizes, peer_addresses=list(self.peer_addresses),
            has_edge_weights=self.weighted, server_version=server_version(), device=self.device,
            label_dtype=pb.INT64, graph_fingerprint=self.graph_fingerprint, hot_order=self.hot_order,
            has_edge_ids=self.has_edge_ids, link_splits=self.link_split_infos())
        if not self.typed:
            found = self.edge_feature_info(next(iter(m.edge_types)))
            if found is not None:
                info.edge_features.CopyFrom(found)
        if self.typed:
            info.typed.CopyFrom(pb.TypedGraphInfo(
                node_types=[pb.NodeTypeInfo(name=t, num_nodes=i.num_nodes, feature_dim=i.feature_dim,
                                            feature_dtype=self.feature_dtypes.get(t, pb.DTYPE_UNSPECIFIED),
                                            partition_book=[int(v) for v in self.books[t]])
                            for t, i in m.node_types.items()],
                edge_types=[pb.EdgeTypeInfo(src=s, rel=r, dst=d, num_edges=n,
                                            edge_features=self.edge_feature_info((s, r, d)))
                            for (s, r, d), n in m.edge_types.items()],
                target_type=m.target_type))
        return info

    @property
    def link_splits(self) -> dict[str, LinkSplitInfo]:
        """Link split name to its facts (the manifest's; empty without link splits)."""
        return self.manifest.link_splits

    def link_split(self, name: str) -> LinkSplitArrays:
        """Link split ``name``'s edges in global IDs (the shared ``links/<name>/`` files,
        checked as the server's ``--verify`` says), loaded on first use and kept; a name
        the graph lacks raises :class:`RequestError` naming the field."""
        if name not in self.manifest.link_splits:
            raise RequestError(f"link split: expected one of {sorted(self.manifest.link_splits)}, "
                               f"got {name!r}")
        with self._links_lock:
            if name not in self._link_splits:
                self._link_splits[name] = load_link_split(self.config.partition_dir, self.manifest, name,
                                                          verify=cast(Verify, self.config.verify))
            return self._link_splits[name]

    def link_split_infos(self) -> list[pb.LinkSplitInfo]:
        """``ClusterInfo.link_splits``: each split's facts (edge type "" on a plain graph)."""
        return [pb.LinkSplitInfo(
            name=name, edge_type=edge_type_name(info.edge_type) if self.typed else "",
            num_edges=info.num_edges, num_negatives=info.num_negatives,
            label_shape=list(info.label_shape),
            label_dtype=codec.numpy_to_dtype(np.dtype(info.label_dtype)) if info.label_dtype
            else pb.DTYPE_UNSPECIFIED) for name, info in self.manifest.link_splits.items()]

    def set_peers(self, peers: tuple[str, ...]) -> None:
        """Set every partition's server address (before the server starts)."""
        if len(peers) != self.manifest.num_partitions:
            raise ConfigError(f"peers: expected {self.manifest.num_partitions} addresses (one per "
                              f"partition, this server's own included), got {len(peers)}")
        self.config = self.config.replace(peers=tuple(peers))

    # -- types -----------------------------------------------------------------------
    def node_type_of(self, name: str, field: str) -> str:
        """The node type a request names: on a typed graph ``name`` checked (empty: the
        target type); on a plain graph its one type, which a request names by no name."""
        m = self.manifest
        if not name:
            return m.target_type
        if not self.typed:
            raise RequestError(f"{field}: expected none, the graph is homogeneous (ClusterInfo.typed "
                               f"is absent), got {name[:100]!r}")
        if name not in m.node_types:
            raise RequestError(f"{field}: expected one of {list(m.node_types)} (or empty for the "
                               f"target type {m.target_type!r}), got {name[:100]!r}")
        return name

    def edge_type_of(self, name: str, field: str) -> EdgeType:
        """The edge type a request names (``src__rel__dst``); a plain graph's one relation,
        which a request names by no name."""
        m = self.manifest
        if not self.typed:
            if name:
                raise RequestError(f"{field}: expected none, the graph is homogeneous, got {name[:100]!r}")
            return next(iter(m.edge_types))
        known = [edge_type_name(et) for et in m.edge_types]
        try:
            et = parse_edge_type(name)
        except GraphDataError:
            et = None
        if et is None or et not in m.edge_types:
            raise RequestError(f"{field}: expected one of {known}, got {name[:100]!r}")
        return et

    def ids_of(self, node_type: str) -> str:
        """How errors name IDs of ``node_type``."""
        return f"global {node_type!r} IDs" if self.typed else "global node IDs"

    def type_range(self, node_type: str) -> tuple[int, int]:
        """``[start, stop)`` of the owned global IDs of ``node_type``."""
        book = self.books[node_type]
        return int(book[self.partition_id]), int(book[self.partition_id + 1])

    def check_owned(self, nodes: np.ndarray, field: str, node_type: str) -> None:
        """Raise :class:`RequestError` naming ``field`` unless every ID is owned here."""
        start, stop = self.type_range(node_type)
        if nodes.size and (int(nodes.min()) < start or int(nodes.max()) >= stop):
            raise RequestError(
                f"{field}: expected {self.ids_of(node_type)} owned by partition {self.partition_id}, in "
                f"[{start}, {stop}); got values in [{int(nodes.min())}, {int(nodes.max())}]")

    def global_ids_of(self, original: np.ndarray, node_type: str) -> np.ndarray:
        """Global ID of each original ID of ``node_type`` owned here, -1 for the others."""
        orig = np.asarray(self.partition.orig_ids[node_type])
        with self._lock:
            if node_type not in self._orig_orders:
                self._orig_orders[node_type] = np.argsort(orig, kind="stable")
            order = self._orig_orders[node_type]
        out = np.full(original.size, -1, dtype=np.int64)
        if order.size == 0:
            return out
        pos = np.minimum(np.searchsorted(orig[order], original), order.size - 1)
        found = orig[order[pos]] == original
        out[found] = order[pos[found]] + self.type_range(node_type)[0]
        return out

    def node_map(self, node_type: str) -> np.ndarray:
        """The int64 ``[N_t]`` map from every original ID of ``node_type`` to its global ID
        (the graph's shared node map, memory-mapped on first use)."""
        with self._lock:
            if node_type not in self._node_maps:
                self._node_maps[node_type] = load_node_map(
                    self.config.partition_dir, node_type if self.typed else None, verify="size")
            return self._node_maps[node_type]

    def original_ids_of(self, nodes: np.ndarray, node_type: str) -> np.ndarray:
        """Original IDs of owned global IDs of ``node_type``."""
        start = self.type_range(node_type)[0]
        return np.asarray(self.partition.orig_ids[node_type][nodes - start], dtype=np.int64)


__all__ = ["PartitionStore", "check_partition_count", "colocated_servers", "server_version", "share_arrays"]
