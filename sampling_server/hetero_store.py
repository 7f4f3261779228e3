"""The partition a server holds when the graph is typed (format v2): the typed manifest
(read at once), the validated :class:`~partitioner.hetero_format.HeteroPartition` and its
typed samplers (loaded in the background, as :class:`PartitionStore` does).

It is a :class:`PartitionStore` whose homogeneous facts (``partition_book``,
``node_range``, ``feature_dtype``, split counts) describe the graph's target type, so
the server's plumbing (health, peers' identity checks, drain) is shared; node lookups
take a node type. The typed paths of the servicer, pipeline and peers ask
:meth:`typed_sampler` for the sampler.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import cast

import grpc
import numpy as np
import torch

from partitioner.format import Verify
from partitioner.graph import SPLITS
from partitioner.graph import EdgeType, GraphDataError, parse_edge_type
from partitioner.hetero_format import (
    HeteroManifest,
    HeteroPartition,
    load_hetero_partition,
    read_hetero_manifest,
)
from protos import codec
from protos import sampling_pb2 as pb
from sampling_server.config import TYPED_HOT_ORDER, ConfigError, ServerConfig
from sampling_server.sampler import HeteroNeighborSampler, create_hetero_sampler
from sampling_server.store import (
    NotLoaded,
    PartitionStore,
    RequestError,
    check_partition_count,
    manifest_fingerprint,
    server_version,
)

log = logging.getLogger(__name__)

_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


class HeteroPartitionStore(PartitionStore):
    """One partition of a typed graph and its typed samplers (see the module doc)."""

    def __init__(self, config: ServerConfig) -> None:
        for field, what in (("structure", "in-edges"), ("features", "features and labels")):
            if getattr(config, field) == "full":
                raise ConfigError(f"{field}: expected 'partition' or 'auto' for a typed graph "
                                  f"(its servers hold their own partition's {what}), got 'full'")
        self.config = config
        #: The typed graph's manifest.
        self.manifest: HeteroManifest = read_hetero_manifest(config.partition_dir)  # type: ignore[assignment]
        m = self.manifest
        check_partition_count(config, m.num_partitions)
        self.partition_id = config.partition
        #: Node type to its int64 ``[P+1]`` partition book.
        self.books = {t: np.asarray(b, dtype=np.int64) for t, b in m.partition_book.items()}
        self.partition_book = self.books[m.target_type]
        self.node_range = self.type_range(m.target_type)
        #: Node type to its stored feature dtype on the wire (types with features only).
        self.feature_dtypes: dict[str, codec.WireDType] = {
            t: codec.numpy_to_dtype(np.dtype(i.feature_dtype))
            for t, i in m.node_types.items() if i.feature_dim > 0}
        self.feature_dtype = self.feature_dtypes.get(m.target_type, pb.FLOAT32)
        self.graph_fingerprint = manifest_fingerprint(m.to_json())
        self._partition: HeteroPartition | None = None  # type: ignore[assignment]
        self._typed_samplers: dict[bool, HeteroNeighborSampler] = {}
        self._orig_orders: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        self._loaded = threading.Event()
        self.load_error: BaseException | None = None

    # -- loading ---------------------------------------------------------------------
    def load(self) -> None:
        """Load and validate the typed partition and create the default typed sampler."""
        started = time.perf_counter()
        try:
            part = load_hetero_partition(self.config.partition_dir, self.partition_id,
                                         mmap=self.config.mmap,
                                         verify=cast(Verify, self.config.verify))
            sampler = create_hetero_sampler(part, self.config.device,
                                            topology=self.config.topology)
        except BaseException as exc:
            self.load_error = exc
            raise
        with self._lock:
            self._partition = part
            self._typed_samplers[False] = sampler
        self._loaded.set()
        log.info("partition=%d: typed partition loaded in %.2f s: nodes %s, sampling on %s",
                 self.partition_id, time.perf_counter() - started,
                 {t: part.num_nodes(t) for t in self.manifest.node_types}, self.device)

    @property
    def typed_partition(self) -> HeteroPartition:
        if self._partition is None:
            raise NotLoaded(self._not_loaded_reason())
        return self._partition

    @property
    def partition(self) -> HeteroPartition:  # type: ignore[override]
        return self.typed_partition

    def held_bytes(self) -> dict[str, tuple[str, int]]:
        """Every type's in-edges and original IDs, and its features and the labels: the
        partition's own (typed graphs hold no more)."""
        part = self.typed_partition
        structure = sum(int(a.nbytes) for arrays in (part.indptr, part.indices, part.orig_ids)
                        for a in arrays.values())
        features = sum(int(a.nbytes) for a in part.x.values()) + int(part.y.nbytes)
        return {"structure": ("partition", structure), "features": ("partition", features)}

    def typed_sampler(self, *, replace: bool = False) -> HeteroNeighborSampler:
        """The typed sampler for these options (created on first use; thread-safe)."""
        key = bool(replace)
        with self._lock:
            found = self._typed_samplers.get(key)
        if found is not None:
            return found
        part = self.typed_partition
        with self._lock:
            if key not in self._typed_samplers:
                self._typed_samplers[key] = create_hetero_sampler(
                    part, self.config.device, replace=replace, topology=self.config.topology)
            return self._typed_samplers[key]

    def sampler(self, *, replace: bool = False, weighted: bool = False):  # type: ignore[no-untyped-def]
        """Homogeneous sampling has no meaning on a typed graph."""
        raise RequestError("the server holds a typed graph (ClusterInfo.typed): ask with "
                           "EpochRequest.typed / the typed peer fields", _PRECONDITION)

    @property
    def device(self) -> str:
        dev = self.typed_sampler().device
        if dev.type == "cuda" and dev.index is None:
            return f"cuda:{torch.cuda.current_device()}"
        return str(dev)

    # -- types -----------------------------------------------------------------------
    def type_range(self, node_type: str) -> tuple[int, int]:
        """``[start, stop)`` of the owned global IDs of ``node_type``."""
        book = self.books[node_type]
        return int(book[self.partition_id]), int(book[self.partition_id + 1])

    def node_type_of(self, name: str, field: str) -> str:
        """``name`` checked as a node type (empty: the target type)."""
        m = self.manifest
        if not name:
            return m.target_type
        if name not in m.node_types:
            raise RequestError(f"{field}: expected one of {list(m.node_types)} (or empty for the "
                               f"target type {m.target_type!r}), got {name[:100]!r}")
        return name

    def edge_type_of(self, name: str, field: str) -> EdgeType:
        """``name`` (``src__rel__dst``) checked as an edge type of the graph."""
        known = [f"{s}__{r}__{d}" for s, r, d in self.manifest.edge_types]
        try:
            et = parse_edge_type(name)
        except GraphDataError:
            et = None
        if et is None or et not in self.manifest.edge_types:
            raise RequestError(f"{field}: expected one of {known}, got {name[:100]!r}")
        return et

    def num_nodes_of(self, node_type: str | None = None) -> int:
        """Nodes of ``node_type`` (the target type when None)."""
        return self.manifest.node_types[node_type or self.manifest.target_type].num_nodes

    def owner_of(self, nodes: np.ndarray, node_type: str | None = None) -> np.ndarray:
        """Partition ID of each global ID of ``node_type`` (the target type when None)."""
        book = self.books[node_type or self.manifest.target_type]
        return np.searchsorted(book, nodes, side="right") - 1

    def check_owned(self, nodes: np.ndarray, field: str, node_type: str | None = None) -> None:
        node_type = node_type or self.manifest.target_type
        start, stop = self.type_range(node_type)
        if nodes.size and (int(nodes.min()) < start or int(nodes.max()) >= stop):
            raise RequestError(
                f"{field}: expected global {node_type!r} IDs owned by partition "
                f"{self.partition_id}, in [{start}, {stop}); got values in "
                f"[{int(nodes.min())}, {int(nodes.max())}]")

    def global_ids_of(self, original: np.ndarray, node_type: str | None = None) -> np.ndarray:
        """Global ID of each original ID of ``node_type`` owned here, -1 for the others."""
        node_type = node_type or self.manifest.target_type
        orig = np.asarray(self.typed_partition.orig_ids[node_type])
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

    def original_ids_of(self, nodes: np.ndarray, node_type: str | None = None) -> np.ndarray:
        node_type = node_type or self.manifest.target_type
        start = self.type_range(node_type)[0]
        return np.asarray(self.typed_partition.orig_ids[node_type][nodes - start], dtype=np.int64)

    def split_seeds(self, split: str) -> np.ndarray:
        ids = self.typed_partition.splits.get(split)
        return np.asarray(ids, dtype=np.int64) if ids is not None else np.empty(0, np.int64)

    # -- facts -----------------------------------------------------------------------
    def typed_info(self) -> pb.TypedGraphInfo:
        """The typed facts of ``ClusterInfo.typed``."""
        m = self.manifest
        return pb.TypedGraphInfo(
            node_types=[pb.NodeTypeInfo(
                name=t, num_nodes=i.num_nodes, feature_dim=i.feature_dim,
                feature_dtype=self.feature_dtypes.get(t, pb.DTYPE_UNSPECIFIED),
                partition_book=[int(v) for v in self.books[t]])
                for t, i in m.node_types.items()],
            edge_types=[pb.EdgeTypeInfo(src=s, rel=r, dst=d, num_edges=n)
                        for (s, r, d), n in m.edge_types.items()],
            target_type=m.target_type)

    def cluster_info(self) -> pb.ClusterInfo:
        """ClusterInfo of a typed graph: the homogeneous fields describe the target type."""
        m = self.manifest
        target = m.node_types[m.target_type]
        sizes = [pb.SplitSizes(**{s: int(p.split_sizes.get(s, 0)) for s in SPLITS})
                 for p in m.partitions]
        return pb.ClusterInfo(
            format_version=m.format_version, graph_name=m.graph_name, num_nodes=target.num_nodes,
            num_edges=m.num_edges, partition_book=[int(v) for v in self.partition_book],
            partition_id=self.partition_id, num_partitions=m.num_partitions,
            feature_dim=target.feature_dim, feature_dtype=self.feature_dtype,
            num_classes=m.num_classes, split_sizes=sizes,
            peer_addresses=list(self.peer_addresses), has_edge_weights=False,
            server_version=server_version(), device=self.device, label_dtype=pb.INT64,
            graph_fingerprint=self.graph_fingerprint, hot_order=self.hot_order,
            typed=self.typed_info())

    @property
    def hot_order(self) -> str:
        """Every node type's hot order follows :data:`TYPED_HOT_ORDER`."""
        return TYPED_HOT_ORDER
