"""``RemoteNeighborLoader``: PyG ``NeighborLoader`` batches, sampled by graphfeed servers,
and :class:`RemoteLoader`, the core it shares with the link loader
(:mod:`trainer_client.link_loader`) as PyG's ``NodeLoader`` and ``LinkLoader`` share a
sampler; each supplies its seeds step.

One loader per DDP rank. Through a :class:`Cluster` (every server, checked), it
translates the input nodes (original IDs, or a split's nodes) to graphfeed's own IDs,
plans each epoch exactly as the servers do (:mod:`protos.plan`), and streams the epoch
from every server at once (:class:`~trainer_client.stream.EpochStream`).
``len(loader)`` is the number of batches of this rank, equal on every rank by
construction, so DDP never waits on a rank that ran out of batches.

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

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch_geometric.data import Data, HeteroData
from torch_geometric.data.storage import NodeStorage

from partitioner.graph import EdgeType
from protos import halfcast
from protos import sampling_pb2 as pb
from protos.channel import ProtocolError
from protos.codec import encode_tensor
from protos.plan import (
    EPOCH_START,
    BatchRef,
    EpochPlan,
    EpochProgress,
    GlobalPlan,
    plan_epoch,
    plan_global_epoch,
    shuffled_seeds,
)
from trainer_client import inputs
from trainer_client.batch_checks import LinkSpec, TensorRows, TypedSpec
from trainer_client.cache import KNOWN_HOT_ORDERS, CacheError, FeatureCache, parse_cache_size, plan_caches
from trainer_client.cluster import Closing, Cluster
from trainer_client.decode import BatchSpec, DecodedBatch, to_device
from trainer_client.graph import TypedGraph
from trainer_client.inputs import InputNodes, NumNeighbors
from trainer_client.node_table import NodeTable
from trainer_client.node_tensors import TensorRef, delivered_rows
from trainer_client.stream import EpochStream, ServerStream, StreamStats, StreamTimeouts

log = logging.getLogger(__name__)


class RemoteLoader(Closing, ABC):
    """What both loaders share: the cluster, the epoch's plan and stream (resumed after
    failures), the feature caches and node tables, iteration and closing; a loader supplies
    its seeds (:meth:`_open_seeds`, :meth:`_put_seeds`, :attr:`num_seeds`). Tensors that
    stay on the CPU share the received messages' bytes: treat them as read-only. Batches
    are ``HeteroData`` on a typed cluster (:attr:`typed_graph`, :meth:`metadata`)."""

    #: Set by each loader: the split iterated (None: seeds given); whether batches carry the
    #: target type's labels "y"; the link batches' layout (None: seed nodes); and in
    #: :meth:`_open_seeds` the seeds' node type (of a link loader: its seed edges' source
    #: type) and the node or edge type whose store holds typed batches' ``input_id``.
    split: str | None
    _labels_asked = False
    _link_layout: LinkSpec | None = None
    _seeds_of: str
    _input_key: str | EdgeType

    def __init__(
        self, servers: Sequence[str] | str | Cluster, *, num_neighbors: NumNeighbors, batch_size: int,
        shuffle: bool = False, drop_last: bool = False, rank: int = 0, world_size: int = 1,
        device: str | torch.device = "cpu", prefetch: int = 4, seed: int = 0, feature_dtype: str = "float32",
        cast_features: bool = True, replace: bool = False, weighted: bool = False,
        pin_memory: bool | None = None, return_internal_ids: bool = False, connect_timeout: float = 60.0,
        stall_timeout: float = 60.0, reconnect_timeout: float = 15.0, rpc_timeout: float = 30.0,
        client_id: str | None = None, cache_size: float | str | None = None,
        cache_progress: bool | None = None, compact_indices: bool = True, edge_features: bool | str = False,
        edge_ids: bool = False, include_features: bool = True,
        node_tensors: Mapping[str, TensorRef | Sequence[TensorRef]] | None = None, **unsupported: object,
    ) -> None:
        """Check the arguments, connect to the servers, open the seeds and plan epoch 0.

        ``servers``: addresses (any order, or one comma-separated string), or a
        :class:`Cluster` to share channels between loaders (the loader does not close
        it). ``num_neighbors``: fanouts per hop, a list for every edge type or (typed
        clusters) a dict per edge type (``(src, rel, dst)`` or ``"src__rel__dst"``; types
        left out draw nothing). ``feature_dtype`` is the features' dtype on the wire
        (``float32``, ``float16``, ``bfloat16`` or ``stored``); ``cast_features`` casts
        them to float32 on ``device``. ``return_internal_ids`` adds ``internal_n_id``
        (graphfeed's own node numbering) to each batch. ``stall_timeout``: seconds
        without a message before a stream is resumed; ``reconnect_timeout``: seconds a
        broken stream is retried before ServerUnavailable.
        ``cache_size``: the trainer-side hot-feature cache on ``device`` (see
        :mod:`trainer_client.cache`): a fraction of all nodes (``0.2``, ``"20%"``) or a
        size (``"2GiB"``); 0 turns it off; ``"auto"`` (the default): on a CUDA device
        every row when the features fit in a quarter of its free memory, else the hottest
        rows that do (:data:`~trainer_client.cache.AUTO_FREE_FRACTION`); 0 on the CPU.
        It fills once per :class:`Cluster` (progress bar on a terminal, or as
        ``cache_progress`` says) and is shared by its loaders with the same plan. On a
        typed cluster it caches every node type with features alike: a fraction caches
        that share of each type's nodes, a size the same share of every type, as many as
        fit (:func:`~trainer_client.cache.plan_caches`). ``compact_indices``: ask for the
        batches' structure in compact form (narrow integer dtypes,
        ``EpochRequest.compact_indices``); the batches are the same.

        Edges: ``edge_features=True`` adds each sampled edge's features as ``edge_attr``
        (per edge type with edge features on a typed graph), aligned with ``edge_index``,
        and its original edge ID as ``e_id``, as PyG's loaders give them; a string names
        the attribute the features go in instead of ``edge_attr``. Floating-point edge
        features travel in ``feature_dtype`` and are cast as node features are.
        ``edge_ids=True`` adds ``e_id`` alone. Both need partitions written with edge IDs
        (``ClusterInfo.has_edge_ids``).

        ``include_features=False``: batches carry no ``x`` (no feature cache either).
        ``node_tensors``: rows of node tensors on the servers
        (:class:`~trainer_client.node_tensors.RemoteNodeTensor`, or their names) that every
        batch carries, gathered by the servers as features are: attribute name to a tensor,
        or to one tensor per node type; the rows of the batch's nodes of the tensor's type
        go in that attribute of the type's store (``batch.h``, ``batch["paper"].h``), as
        the tables are when the batch is made. Names are looked up when each epoch starts.
        """
        inputs.check_keywords(unsupported, type(self).__name__)
        inputs.check_settings(num_neighbors, batch_size, rank, world_size, prefetch, seed, feature_dtype)
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda:0', got "
                             f"{device!r}") from exc
        self.timeouts = StreamTimeouts(stall=stall_timeout, reconnect=reconnect_timeout)
        #: Fanouts per hop: a list, or (typed graphs) a dict per edge type, as given.
        self.num_neighbors: list[int] | dict[EdgeType | str, list[int]] = (
            {k: [int(f) for f in v] for k, v in num_neighbors.items()}
            if isinstance(num_neighbors, Mapping) else [int(f) for f in num_neighbors])
        self.batch_size, self.shuffle, self.drop_last = int(batch_size), bool(shuffle), bool(drop_last)
        self.rank, self.world_size = int(rank), int(world_size)
        self.prefetch, self.seed, self.feature_dtype = int(prefetch), int(seed), feature_dtype
        self.cast_features, self.replace, self.weighted = bool(cast_features), bool(replace), bool(weighted)
        self.return_internal_ids, self.compact_indices = bool(return_internal_ids), bool(compact_indices)
        self.include_features = bool(include_features)
        #: The node tensors whose rows every batch carries, by attribute.
        self.node_tensors = dict(node_tensors or {})
        #: The attribute edge features go in ("" when not asked); whether e_id is asked.
        self.edge_attr_name = inputs.edge_attr_name(edge_features)
        self.edge_ids = bool(edge_ids) or bool(self.edge_attr_name)
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else bool(pin_memory)
        if self.pin_memory and not torch.cuda.is_available():  # as torch's DataLoader does
            log.warning("pin_memory=True: no CUDA device here, so no pinned memory; batches "
                        "stay in pageable memory")
            self.pin_memory = False
        size = parse_cache_size("auto" if cache_size is None else cache_size)
        self._owns_cluster = not isinstance(servers, Cluster)
        self.cluster = servers if isinstance(servers, Cluster) else \
            Cluster(servers, connect_timeout=connect_timeout, rpc_timeout=rpc_timeout, client_id=client_id)
        self.client_id = client_id or f"{self.cluster.client_id}-rank{self.rank}"
        #: The graph's facts (a plain graph as one node type and one edge type).
        self.graph: TypedGraph = self.cluster.graph
        try:
            self._open(size, cache_progress)
        except BaseException:
            self.close()
            raise
        #: Counters of the last epoch streamed.
        self.last_stats = StreamStats()

    def _open(self, size: tuple[str, float], progress: bool | None) -> None:
        """What needs the cluster: the seeds, the caches and node tables, epoch 0's plan."""
        if not self.graph.typed and isinstance(self.num_neighbors, dict):
            raise ValueError("num_neighbors is a dict, but the graph is homogeneous (plain: "
                             "ClusterInfo.typed is absent): pass a list of fanouts")
        self._open_seeds()
        if isinstance(self.num_neighbors, dict):
            inputs.edge_fanouts(self.num_neighbors, self.graph)  # checks the keys
        self._layout = TypedSpec.of(self.graph, self._seeds_of)
        #: The feature cache of each cached node type (empty: every batch carries all of x).
        self.caches: dict[str, FeatureCache] = self._open_caches(size, progress)
        #: Every node's original ID and label per node type, when batches leave them out
        #: (compact batches with a feature cache: trainer_client/node_table.py); empty:
        #: batches carry their "orig_id" and "y".
        self.node_tables: dict[str, NodeTable] = self._open_node_tables()
        if self.weighted and not self.cluster.info.has_edge_weights:
            raise ValueError("weighted: expected a graph with edge weights, but the servers have none")
        inputs.check_edge_options(self.graph, bool(self.edge_attr_name), self.edge_ids)
        self.set_epoch(0)
        if len(self) == 0:
            log.warning("drop_last: the epoch has no batches: %d seeds are fewer than batch_size=%d "
                        "x world_size=%d; use a smaller batch_size or drop_last=False",
                        self.num_seeds, self.batch_size, self.world_size)

    # ---- the seeds step, each loader's own ---------------------------------------------

    @abstractmethod
    def _open_seeds(self) -> None:
        """Resolve the seeds against the cluster; sets :attr:`_seeds_of` and
        :attr:`_input_key`."""

    @abstractmethod
    def _put_seeds(self, request: pb.EpochRequest) -> None:
        """Put the seeds (nodes, or seed edges and their options) in an epoch's request."""

    @property
    @abstractmethod
    def num_seeds(self) -> int:
        """Seeds of one epoch, over all ranks."""

    # ---- the graph's facts, as each kind of graph names them ---------------------------

    @property
    def typed_graph(self) -> TypedGraph | None:
        """The typed graph's facts (None on a plain graph, whose batches are ``Data``)."""
        return self.graph if self.graph.typed else None

    @property
    def cache(self) -> FeatureCache | None:
        """A plain graph's feature cache (None: none; a typed graph's: :attr:`typed_caches`)."""
        return None if self.graph.typed else self.caches.get(self._seeds_of)

    @property
    def typed_caches(self) -> dict[str, FeatureCache]:
        return self.caches if self.graph.typed else {}

    @property
    def typed_node_tables(self) -> dict[str, NodeTable]:
        return self.node_tables if self.graph.typed else {}

    def _open_caches(self, size: tuple[str, float], progress: bool | None) -> dict[str, FeatureCache]:
        """The plan's cache of each node type with features, each filled on first use per
        cluster; {} when the plan is empty, or when the servers do not all follow one hot
        order this trainer knows (e.g. older servers: the loader says so)."""
        if size[0] == "auto":  # after a 4-byte index per node of each type with features
            size = ("bytes", self.cluster.auto_cache_budget(self.device))
        plan = plan_caches(size, self.graph, inputs.WIRE_FEATURE_DTYPES[self.feature_dtype])
        if not self.include_features or not any(sum(counts) for counts, _ in plan.values()):
            return {}
        orders = {i.hot_order for i in self.cluster.infos}
        if len(orders) != 1 or not orders <= set(KNOWN_HOT_ORDERS):
            log.warning("cache_size: the servers' hot orders %s are not all one of %s (older "
                        "servers?); running without the feature cache", sorted(orders),
                        list(KNOWN_HOT_ORDERS))
            return {}
        return {t: self.cluster.feature_cache(counts, wire, self.device, progress=progress,
                                              reconnect=self.timeouts.reconnect, node_type=t)
                for t, (counts, wire) in plan.items() if sum(counts)}

    def _open_node_tables(self) -> dict[str, NodeTable]:
        """Every node type's table, when batches leave original IDs and labels out
        (compact batches with a feature cache); all types or none ({} when a server cannot
        answer)."""
        tables = {t: self.cluster.node_table(t) for t in self.graph.node_types} \
            if self.compact_indices and self.caches else {}
        return {t: table for t, table in tables.items() if table is not None} \
            if all(table is not None for table in tables.values()) else {}

    # ---- facts -----------------------------------------------------------------------

    @property
    def num_features(self) -> int:
        """Feature columns of every node (of the target type on a typed graph; see
        :attr:`typed_graph` for every type's)."""
        return int(self.cluster.info.feature_dim)

    def metadata(self) -> tuple[list[str], list[EdgeType]]:
        """A typed graph's ``(node_types, edge_types)``, as ``HeteroData.metadata()``."""
        if not self.graph.typed:
            raise ValueError("metadata: the graph is homogeneous (plain: ClusterInfo.typed is absent)")
        return self.graph.metadata()

    @property
    def cluster_info(self) -> pb.ClusterInfo:
        """The servers' ClusterInfo (partition 0's)."""
        return self.cluster.info

    def plan(self, epoch: int, start: EpochProgress = EPOCH_START) -> EpochPlan | GlobalPlan:
        """The plan of ``epoch`` from ``start`` on (the same as every server and rank
        computes): every batch cut from one ordering of all the seeds across partitions."""
        return plan_global_epoch(self.num_seeds, self.batch_size, self.world_size,
                                 self.cluster.num_partitions, shuffle=self.shuffle, seed=self.seed,
                                 epoch=epoch, drop_last=self.drop_last, steps_done=start.steps,
                                 seeds_done=start.seeds)

    def set_epoch(self, epoch: int, start: EpochProgress = EPOCH_START) -> None:
        """Select the epoch the next iteration streams (shuffling and sampling draws).
        Without it, each new iteration streams the epoch after the last one, so every
        pass is shuffled anew (as PyG reshuffles). ``start``: the epoch's progress so far
        (an elastic restart: :meth:`progress_after` of an earlier pass, of any world
        size); the pass then streams the rest of the epoch, equal per rank."""
        self.epoch = inputs.check_int("epoch", epoch, 0)
        self._plan = self.plan(self.epoch, start)
        self._iterated = False

    def progress_after(self, steps: int) -> EpochProgress:
        """The epoch's progress once every rank has trained the first ``steps`` batches of
        this pass (global batches only)."""
        if not isinstance(self._plan, GlobalPlan):
            raise ValueError("batches: an epoch of per-partition batches resumes whole; expected "
                             "batches='global' to resume one part way")
        return self._plan.progress_after(steps)

    def __len__(self) -> int:
        """Batches of this rank in the current epoch (equal on every rank)."""
        return self._plan.batches_per_rank

    def input_ids(self, ref: BatchRef) -> np.ndarray | None:
        """Positions among the epoch's seeds (what ``batch.input_id`` indexes) of the seeds
        of one of this rank's batches (None: the seeds' original IDs, read off the batch)."""
        assert isinstance(self._plan, GlobalPlan)  # (the node loader's batches per partition: its own)
        return self._plan.positions(ref.part_batch)

    # ---- streaming -------------------------------------------------------------------

    @property
    def _labels_on_wire(self) -> bool:
        """Whether batches carry "y" (not when node tables have the labels and original IDs)."""
        return self._labels_asked and not self.node_tables

    def _request(self, rows: Sequence[TensorRows] = ()) -> pb.EpochRequest:
        fanouts, typed = inputs.request_fanouts(self._seeds_of, self.num_neighbors, self.graph)
        request = pb.EpochRequest(
            fanouts=fanouts, batch_size=self.batch_size, shuffle=self.shuffle,
            drop_last=self.drop_last, seed=self.seed, epoch=self.epoch, rank=self.rank,
            world_size=self.world_size, resume_from=0, steps_done=self._plan.start.steps,
            seeds_done=self._plan.start.seeds,
            feature_dtype=inputs.WIRE_FEATURE_DTYPES[self.feature_dtype],  # type: ignore[arg-type]
            sampling=pb.SamplingOptions(replace=self.replace, weighted=self.weighted),
            include_features=self.include_features, include_labels=self._labels_on_wire,
            client_id=self.client_id, node_tensors=[r.name for r in rows],
            global_batches=isinstance(self._plan, GlobalPlan), include_original_ids=not self.node_tables,
            compact_indices=self.compact_indices, include_edge_ids=self.edge_ids,
            include_edge_features=bool(self.edge_attr_name))
        self._put_seeds(request)
        if typed is not None:
            request.typed.CopyFrom(typed)
        for t, cache in self.caches.items():
            if self.graph.typed:
                request.typed_cache_counts.add(name=t, counts=cache.counts)
            else:
                request.cache_counts.extend(cache.counts)
        return request

    def stream(self, finish: Callable[[DecodedBatch], DecodedBatch] | None = None) -> EpochStream:
        """The current epoch's stream of decoded CPU batches (use it as a context manager);
        ``finish`` runs on each batch in the reader threads (see :class:`EpochStream`)."""
        rows = delivered_rows(self.cluster, self.node_tensors) if self.node_tensors else ()
        num_batches, request, refs = len(self), self._request(rows), self._plan.rank_batches(self.rank)
        servers = [ServerStream(partition=p, address=address, stub=self.cluster.stream_stubs[p],
                                request=request, indices=indices, expect=self.cluster.expectation(p))
                   for p, address in enumerate(self.cluster.addresses)
                   if (indices := tuple(b.index for b in refs if b.partition == p))]
        spec = dataclasses.replace(self._batch_spec(num_batches), node_tensors=rows)
        return EpochStream(servers, num_batches, spec, prefetch=self.prefetch, timeouts=self.timeouts,
                           pin_memory=self.pin_memory, finish=finish)

    def _batch_spec(self, num_batches: int) -> BatchSpec:
        """What every batch of the current epoch must look like."""
        return BatchSpec(
            num_hops=len(inputs.fanout_lists(self.num_neighbors)[0]), feature_dim=self.num_features,
            include_features=self.include_features, include_labels=self._labels_on_wire,
            num_batches=num_batches,
            typed=self._layout if self.graph.typed else None, compact_indices=self.compact_indices,
            include_edge_ids=self.edge_ids, include_edge_features=bool(self.edge_attr_name),
            edge_feature_shapes=self.graph.edge_feature_shapes, link=self._link_layout)

    def __iter__(self) -> Iterator[Data | HeteroData]:
        """The current epoch's batches, in order, on ``device`` (``HeteroData`` on a typed
        graph); a second iteration without :meth:`set_epoch` moves on to the next epoch.

        On a CPU ``device`` the reader threads complete each batch (original IDs and labels
        from the node table, cached feature rows, the cast to float32) while the consumer
        trains on the one before; on a GPU the consumer does it, on the GPU."""
        if self._iterated:
            self.set_epoch(self.epoch + 1)
        self._iterated = True
        refs = self._plan.rank_batches(self.rank)

        def finish(batch: DecodedBatch) -> DecodedBatch:  # in a reader thread on the CPU
            return self._finish(batch, self.input_ids(refs[batch.index]))

        in_readers = self.device.type == "cpu"
        with self.stream(finish if in_readers else None) as stream:
            self.last_stats = stream.stats
            for batch in stream:
                if not in_readers:
                    batch = finish(batch)
                stream.stats.count_rows(batch.rows, batch.cached_rows)
                yield batch.data

    def _finish(self, batch: DecodedBatch, input_id: np.ndarray | None) -> DecodedBatch:
        """A decoded batch as the loader yields it, on ``device``, with its feature rows
        and how many came from the caches. Per node type (a plain batch's ``Data`` is its
        one node type's store): IDs and labels from the node tables, ``input_id`` (on the
        seed type, or the seed edge type), the cached rows of ``x`` from the caches,
        features cast there (they cross the bus in their wire dtype), ``internal_n_id``
        dropped unless kept."""
        data = batch.data
        stores = {t: data[t] for t in data.node_types} if isinstance(data, HeteroData) else \
            {self._seeds_of: data}
        for t, table in self.node_tables.items():
            table.complete(stores[t], self._labels_asked and t == self.graph.target_type)
        input_store = data[self._input_key] if isinstance(data, HeteroData) else data
        # every node of a type: the seeds' positions among them are their original IDs
        input_store.input_id = torch.from_numpy(input_id) if input_id is not None else \
            input_store.n_id[: int(input_store.batch_size)].clone()
        to_device(data, self.device, non_blocking=self.pin_memory)
        dtype = torch.float32 if self.cast_features else None
        rows = cached_rows = 0
        for t, store in stores.items():
            if "x" in store:
                rows += int(store.num_nodes)
                cached_rows += self._complete_features(store, t, dtype)
                if dtype is not None and store.x.dtype != dtype:
                    store.x = halfcast.cast(store.x, dtype)
            if not self.return_internal_ids and "internal_n_id" in store:
                del store.internal_n_id
        for store in [data[et] for et in data.edge_types] if isinstance(data, HeteroData) else [data]:
            if "edge_attr" in store:
                attr = store.edge_attr
                if dtype is not None and attr.is_floating_point() and attr.dtype != dtype:
                    attr = halfcast.cast(attr, dtype)
                del store.edge_attr
                store[self.edge_attr_name] = attr
        return dataclasses.replace(batch, rows=rows, cached_rows=cached_rows)

    def _complete_features(self, store: NodeStorage, node_type: str, dtype: torch.dtype | None) -> int:
        """Fill the cached rows of a node type's ``x`` from its feature cache (on the
        device), casting to ``dtype`` on the way where the cache can (else the caller
        casts); returns how many rows came from the cache."""
        if "x_cached" not in store:
            return 0
        cache = self.caches.get(node_type)
        name = self._layout.name("x_cached", node_type)
        if cache is None:
            raise ProtocolError(f"StreamMinibatches: tensor {name!r}: expected none (this loader sent "
                                f"no cache plan{self.graph.of_type(node_type)}), got one",
                                what="StreamMinibatches")
        cached = store.x_cached
        del store.x_cached
        hits = int(cached.sum()) if cached.is_cuda else int(np.count_nonzero(cached.numpy()))
        ids = store.internal_n_id if "internal_n_id" in store else store.n_id
        try:
            store.x = cache.assemble(store.x, cached, ids, dtype)
        except CacheError as exc:
            where = f"node type {node_type!r}: " if self.graph.typed else ""
            raise ProtocolError(f"StreamMinibatches: {where}{exc}", what="StreamMinibatches") from exc
        return hits

    def close(self) -> None:
        """Close the channels (unless the Cluster was passed in)."""
        if self._owns_cluster and hasattr(self, "cluster"):
            self.cluster.close()

    def __repr__(self) -> str:
        source = f"split={self.split!r}" if self.split else f"{self.num_seeds} seeds given"
        return (f"{type(self).__name__}({source}, num_neighbors={self.num_neighbors}, batch_size="
                f"{self.batch_size}, rank={self.rank}/{self.world_size}, servers={self.cluster.addresses})")


class RemoteNeighborLoader(RemoteLoader):
    """Yields PyG ``Data`` minibatches of one rank's epoch, sampled by graphfeed servers.

    Each batch has ``x``, ``edge_index``, ``y``, ``n_id``, ``batch_size``, ``input_id``,
    ``num_sampled_nodes`` and ``num_sampled_edges``, as PyG's ``NeighborLoader`` gives;
    the first ``batch_size`` nodes are the seeds. ``n_id`` holds original node IDs (the
    graph's own), and ``input_id`` the positions of the seeds in :attr:`input_nodes`.

    On a typed cluster (``ClusterInfo.typed``) it yields ``HeteroData`` as PyG's hetero
    ``NeighborLoader`` does: per node type ``n_id``, ``num_nodes``, ``x`` (types with
    features), ``num_sampled_nodes``; ``y`` on the target type; ``batch_size`` and
    ``input_id`` on the seed type; per edge type ``edge_index`` and
    ``num_sampled_edges`` (see ``docs/training.md``).
    """

    def __init__(
        self, servers: Sequence[str] | str | Cluster, split: str | None = None, *,
        input_nodes: InputNodes | str | tuple[str, InputNodes | None] | None = None,
        seeds: InputNodes | None = None, batches: str = "global", include_labels: bool = True, **options: Any,
    ) -> None:
        """Seeds come from ``split`` (default ``"train"``; ``"valid"`` is taken for
        ``"val"``) or ``input_nodes`` (original node IDs, or a boolean mask over the
        nodes; ``seeds`` is another name for it), not both. A split's nodes are taken in
        original-ID order. On a typed cluster ``input_nodes`` may also be a split name, a
        node type (all its nodes) or ``(node_type, IDs or mask or None)``; a plain graph's
        own node type (``graph.target_type``) names every node too. Every node of a type
        with ``batches="partition"`` travels as that, not as a list (``EveryNode``): the
        loader then holds no list of them, for a graph of any size.
        ``batches``: ``"global"`` cuts every batch from one ordering of all the seeds
        across partitions (as a single-process loader does; with ``shuffle=False`` the
        batches follow the input order), ``"partition"`` batches each partition's seeds on
        their own server (no seed's neighbors are drawn by another server; batches follow
        the partitioning). ``include_labels``: batches carry ``y``. The other arguments are
        :class:`RemoteLoader`'s."""
        self.split, self._given = inputs.seeds_source(split, input_nodes, seeds)
        if batches not in inputs.BATCH_LAYOUTS:
            raise ValueError(f"batches: expected one of {list(inputs.BATCH_LAYOUTS)}, got {batches!r}")
        self.batches, self.include_labels = batches, bool(include_labels)
        self._labels_asked = self.include_labels
        super().__init__(servers, **options)

    def _open_seeds(self) -> None:
        """The seeds' node type (a plain graph's one; refuses a node type on a plain graph),
        the epoch's seeds: original IDs (:attr:`input_nodes`) and their global IDs, and
        each partition's input positions."""
        graph, node_type, nodes = self.graph, self._given.node_type, self._given.nodes
        if not graph.typed and node_type not in (None, graph.target_type):
            raise ValueError("input_nodes names a node type, but the graph is homogeneous (plain: "
                             "ClusterInfo.typed is absent): pass node IDs")
        self._seeds_of = self._input_key = node_type or graph.target_type
        if self._seeds_of not in graph.node_types:
            raise ValueError(f"input_nodes: expected a node type of the graph "
                             f"{list(graph.node_types)}, got {self._seeds_of!r}")
        num_nodes = graph.num_nodes[self._seeds_of]
        #: Every node of the seed type, batched per partition: sent as EveryNode, not listed.
        self.every_node = node_type is not None and nodes is None and self.batches == "partition"
        if self.every_node:
            book = graph.books[self._seeds_of]
            self._sizes = [int(c) for c in np.diff(book)]
            return
        if node_type is not None and nodes is None:  # every node of the type
            nodes = np.arange(num_nodes, dtype=np.int64)
        if nodes is not None:
            original = inputs.original_ids(nodes, num_nodes, "input_nodes", inputs.MAX_SEEDS)
            internal = self.cluster.global_ids(original, self._seeds_of)
        else:
            assert self.split is not None
            original, internal = self.cluster.split_nodes(self.split)
            if original.size == 0:
                raise ValueError(f"split: the graph has no {self.split!r} nodes on any partition (nothing "
                                 "to iterate); pass input_nodes=, or partition the graph with a "
                                 f"{self.split!r} split")
            if original.size > inputs.MAX_SEEDS:
                raise ValueError(f"split: expected at most {inputs.MAX_SEEDS} nodes (one message), got "
                                 f"{original.size}; pass input_nodes= slices")
        self._input_nodes, self._seeds, self._seeds_tensor = original, internal, encode_tensor(internal)
        owner = self.cluster.partition_of(internal, self._seeds_of)
        self._positions = [np.flatnonzero(owner == p) for p in range(self.cluster.num_partitions)]
        self._sizes = [int(p.size) for p in self._positions]

    def _put_seeds(self, request: pb.EpochRequest) -> None:
        if self.every_node:
            request.every_node.SetInParent()
        else:
            request.seeds.CopyFrom(self._seeds_tensor)

    @property
    def num_classes(self) -> int:
        """Number of classes (labels are 0 .. num_classes-1; -1 = unlabeled)."""
        return int(self.cluster.info.num_classes)

    @property
    def seeds_per_partition(self) -> list[int]:
        """Seeds of the epoch owned by each partition."""
        return self._sizes

    @property
    def num_seeds(self) -> int:
        """Seeds of one epoch, over all ranks."""
        return sum(self._sizes)

    @property
    def input_nodes(self) -> torch.Tensor:
        """Original IDs of the epoch's seeds, in input order (a split's in ID order):
        ``batch.input_id`` indexes this."""
        if self.every_node:
            return torch.arange(self.num_seeds)
        return torch.from_numpy(self._input_nodes)

    def plan(self, epoch: int, start: EpochProgress = EPOCH_START) -> EpochPlan | GlobalPlan:
        """The plan of ``epoch`` from ``start`` on (the same as every server and rank computes)."""
        if self.batches == "global":
            return super().plan(epoch, start)
        if start != EPOCH_START:
            raise ValueError(f"start: batches='partition' resumes whole epochs, got {start}")
        return plan_epoch(self.seeds_per_partition, self.batch_size, self.world_size, shuffle=self.shuffle,
                          seed=self.seed, epoch=epoch, drop_last=self.drop_last)

    def input_ids(self, ref: BatchRef) -> np.ndarray | None:
        """Positions in :attr:`input_nodes` of the seeds of one of this rank's batches
        (None: every node, whose positions are the seeds' original IDs)."""
        plan = self._plan
        if self.every_node:
            return None
        if isinstance(plan, GlobalPlan):
            return plan.positions(ref.part_batch)
        order = shuffled_seeds(self._positions[ref.partition], shuffle=self.shuffle, seed=self.seed,
                               epoch=self.epoch, partition=ref.partition)
        return plan.seeds_of(ref.partition, ref.part_batch, order)
