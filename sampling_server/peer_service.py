"""``PeerService``: what the other sampling servers ask of this partition, plain or typed.

``SampleNeighbors`` draws one hop of a relation for nodes whose in-edges are here
(:meth:`NeighborSampler.sample_relation`; with ``want_edges`` the drawn edges' internal
IDs too), ``FetchNodeData`` reads their feature and label rows and original IDs,
``FetchEdgeData`` the original IDs and features of edges held here
(:mod:`sampling_server.sampler.edge_rows`); all answer in stream chunks. A plain graph's
requests name no type; a typed graph's name the relation (``edge_type``) or the node
type.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import torch

from partitioner.graph import edge_type_name
from protos import codec, fastwire
from protos import sampling_pb2 as pb
from sampling_server.errors import RequestError, abort_on_error
from sampling_server.expectation import check_expectation
from sampling_server.fields import cast_features, decode_node_ids, wire_feature_dtype
from sampling_server.limits import check_peer_edge_limits, check_peer_limits
from sampling_server.metrics import ServerMetrics
from sampling_server.sampler.base import edges_of
from sampling_server.sampler.edge_rows import edge_wire_dtype, local_edge_rows
from sampling_server.store import PartitionStore


class PeerServicer:
    """``PeerService``: what the other sampling servers ask of this partition."""

    def __init__(self, store: PartitionStore, chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES):
        self.store = store
        self.chunk_bytes = chunk_bytes
        #: Where rejections are counted (None: nowhere).
        self.metrics: ServerMetrics | None = None
        #: ``time.monotonic()`` when the last peer call came in (a draining server waits
        #: for its peers to fall quiet before it stops).
        self.last_call = time.monotonic()

    def wait_quiet(self, quiet: float, deadline: float) -> bool:
        """Wait until no peer call has come in for ``quiet`` seconds; False when the
        ``time.monotonic()`` deadline came first."""
        while True:
            now = time.monotonic()
            if now - self.last_call >= quiet:
                return True
            if now >= deadline:
                return False
            time.sleep(min(0.2, deadline - now, quiet - (now - self.last_call)))

    def _rejected(self, method: str) -> Callable[[str], None] | None:
        metrics = self.metrics
        return None if metrics is None else lambda code: metrics.rejected(method, code)

    def SampleNeighbors(self, request: pb.SampleNeighborsRequest, context: grpc.ServicerContext
                        ) -> Iterator[bytes]:
        self.last_call = time.monotonic()
        with abort_on_error(context, "SampleNeighbors", self.store.partition_id,
                            self._rejected("SampleNeighbors")):
            check_expectation(request, self.store, hot_order=False)
            started = time.perf_counter()
            messages = self._sample(request)
            self._answered("answer_sample", time.perf_counter() - started)
        yield from messages

    def FetchNodeData(self, request: pb.FetchNodeDataRequest, context: grpc.ServicerContext
                      ) -> Iterator[bytes]:
        self.last_call = time.monotonic()
        with abort_on_error(context, "FetchNodeData", self.store.partition_id,
                            self._rejected("FetchNodeData")):
            check_expectation(request, self.store, hot_order=False)
            nodes, dtype, node_type = self._check_fetch(request)
            messages = self._fetch(request, nodes, dtype, node_type)
            working = 0.0  # gathering and encoding, not waiting for gRPC to take a message
            while True:
                started = time.perf_counter()
                message = next(messages, None)
                working += time.perf_counter() - started
                if message is None:
                    break
                if not context.is_active():  # the caller went away: stop gathering
                    return
                yield message
            self._answered("answer_fetch", working)

    def FetchEdgeData(self, request: pb.FetchEdgeDataRequest, context: grpc.ServicerContext
                      ) -> Iterator[bytes]:
        self.last_call = time.monotonic()
        with abort_on_error(context, "FetchEdgeData", self.store.partition_id,
                            self._rejected("FetchEdgeData")):
            check_expectation(request, self.store, hot_order=False)
            started = time.perf_counter()
            messages = self._fetch_edges(request)
            self._answered("answer_fetch", time.perf_counter() - started)
        for message in messages:
            if not context.is_active():  # the caller went away
                return
            yield message

    def HasEdges(self, request: pb.HasEdgesRequest, context: grpc.ServicerContext) -> pb.HasEdgesReply:
        self.last_call = time.monotonic()
        with abort_on_error(context, "HasEdges", self.store.partition_id, self._rejected("HasEdges")):
            check_expectation(request, self.store, hot_order=False)
            started = time.perf_counter()
            field = "HasEdgesRequest"
            store = self.store
            store.partition  # noqa: B018 - raises NotLoaded (UNAVAILABLE) while loading
            src = decode_node_ids(request.src, f"{field}.src")
            dst = decode_node_ids(request.dst, f"{field}.dst")
            if src.size != dst.size:
                raise RequestError(f"{field}.dst: expected {src.size} IDs (as many as src), got {dst.size}")
            check_peer_edge_limits(store.config, src.size, field)
            et = store.edge_type_of(request.edge_type, f"{field}.edge_type")
            store.check_owned(dst, f"{field}.dst", et[2])
            n_src = store.manifest.node_types[et[0]].num_nodes
            if src.size and (int(src.min()) < 0 or int(src.max()) >= n_src):
                raise RequestError(f"{field}.src: expected {store.ids_of(et[0])} in [0, {n_src}), got "
                                   f"values in [{int(src.min())}, {int(src.max())}]")
            found = store.sampler().has_edges_local(et, src, dst)
            self._answered("answer_sample", time.perf_counter() - started)
            return pb.HasEdgesReply(found=codec.encode_tensor(found))
        return pb.HasEdgesReply()  # pragma: no cover - abort_on_error aborts

    def _fetch_edges(self, request: pb.FetchEdgeDataRequest) -> list[bytes]:
        field = "FetchEdgeDataRequest"
        store = self.store
        store.partition  # noqa: B018 - raises NotLoaded (UNAVAILABLE) while loading
        edges = decode_node_ids(request.edges, f"{field}.edges", "internal edge IDs")
        check_peer_edge_limits(store.config, edges.size, field)
        et = store.edge_type_of(request.edge_type, f"{field}.edge_type")
        if not store.has_edge_ids:
            raise RequestError(f"{field}: expected partitions with edge IDs, this graph's were written "
                               "without them (partition it again)", grpc.StatusCode.FAILED_PRECONDITION)
        if request.want_features and et not in store.edge_feature_dtypes:
            raise RequestError(f"{field}.want_features: expected false, edge type "
                               f"{edge_type_name(et)!r} has no edge features")
        stored = store.edge_feature_dtypes.get(et, pb.FLOAT32)
        if request.want_features:
            wire_feature_dtype(request.feature_dtype, stored, f"{field}.feature_dtype")  # a bad one refused
        dtype = edge_wire_dtype(request.feature_dtype, stored)
        data = store.edge_data
        try:
            e_id, attr = local_edge_rows(data, et, edges, request.want_edge_ids, request.want_features, dtype,
                                         f"{field}.edges")
        except ValueError as exc:  # an edge not held here
            raise RequestError(str(exc)) from None
        named = {name: t for name, t in (("e_id", e_id), ("edge_attr", attr)) if t is not None}
        return fastwire.encode_chunks(lambda i, n: pb.EdgeDataChunk(chunk_index=i, num_chunks=n),
                                      named, self.chunk_bytes)

    def _answered(self, stage: str, seconds: float) -> None:
        """Count the work of one peer answer (its reading, sampling or gathering, and
        encoding; not its wait in gRPC's queues or on the network)."""
        if self.metrics is not None:
            self.metrics.observe(stage, seconds)

    def _sample(self, request: pb.SampleNeighborsRequest) -> list[bytes]:
        field = "SampleNeighborsRequest"
        store = self.store
        store.partition  # noqa: B018 - raises NotLoaded (UNAVAILABLE) while loading
        nodes = decode_node_ids(request.nodes, f"{field}.nodes")
        et = store.edge_type_of(request.edge_type, f"{field}.edge_type")
        check_peer_limits(store.config, nodes.size, request.fanout, store.manifest.edge_types[et], field,
                          request.replace)
        store.check_owned(nodes, f"{field}.nodes", et[2])
        if request.fanout < -1:
            raise RequestError(f"{field}.fanout: expected an integer >= 0, or -1 for all "
                               f"neighbors; got {request.fanout}")
        if request.hop < 0:
            raise RequestError(f"{field}.hop: expected an integer >= 0, got {request.hop}")
        if request.weighted and not store.weighted:
            raise RequestError(f"{field}.weighted: expected false, the graph has no edge weights",
                               grpc.StatusCode.FAILED_PRECONDITION)
        sampler = store.sampler(replace=request.replace, weighted=request.weighted)
        drawn = sampler.sample_relation(et, torch.from_numpy(nodes).to(sampler.device), request.fanout,
                                        request.random_seed, request.hop, request.want_edges)
        named = {"counts": drawn.counts, "neighbors": drawn.neighbors}
        if request.want_edges:
            named["edges"] = edges_of(drawn, "sample_relation")
        # each payload byte copied once, into its message (protos.fastwire)
        return fastwire.encode_chunks(lambda i, n: pb.SampleNeighborsChunk(chunk_index=i, num_chunks=n),
                                      named, self.chunk_bytes)

    def _check_fetch(self, request: pb.FetchNodeDataRequest) -> tuple[np.ndarray, codec.WireDType, str]:
        """The request's nodes, the features' wire dtype and the nodes' type."""
        field = "FetchNodeDataRequest"
        store = self.store
        store.partition  # noqa: B018 - raises NotLoaded (UNAVAILABLE) while loading
        nodes = decode_node_ids(request.nodes, f"{field}.nodes")
        check_peer_limits(store.config, nodes.size, None, 0, field)
        m = store.manifest
        if store.typed and not request.node_type:
            raise RequestError(f"{field}.node_type: expected one of {list(m.node_types)} (the graph "
                               "is typed), got none")
        node_type = store.node_type_of(request.node_type, f"{field}.node_type")
        store.check_owned(nodes, f"{field}.nodes", node_type)
        info = m.node_types[node_type]
        if request.want_features and not info.feature_dim:
            raise RequestError(f"{field}.want_features: expected false, node type {node_type!r} has "
                               "no features")
        if request.want_labels and node_type != m.target_type:
            raise RequestError(f"{field}.want_labels: expected false, only the target type "
                               f"{m.target_type!r} has labels, got node type {node_type!r}")
        dtype = wire_feature_dtype(request.feature_dtype, store.feature_dtypes.get(node_type, pb.FLOAT32),
                                   f"{field}.feature_dtype")
        return nodes, dtype, node_type

    def _fetch(self, request: pb.FetchNodeDataRequest, nodes: np.ndarray, dtype: codec.WireDType,
               node_type: str) -> Iterator[bytes]:
        """The answer's messages, gathered and encoded slice by slice of the nodes (at
        most about ``chunk_bytes`` of rows each), so the whole answer is never built."""
        sampler, width = self.store.sampler(), self.store.manifest.node_types[node_type].feature_dim
        row_bytes = (width * codec.dtype_to_numpy(dtype).itemsize if request.want_features else 0) \
            + (8 if request.want_labels else 0) + (8 if request.want_original_ids else 0)
        rows = max(1, self.chunk_bytes // max(row_bytes, 1))
        slices = [(i, min(i + rows, nodes.size)) for i in range(0, max(nodes.size, 1), rows)]
        for k, (a, b) in enumerate(slices):
            ids = torch.from_numpy(nodes[a:b])
            # cast on the way where the sampler can (a CPU gather into bfloat16)
            x, y = sampler.gather(node_type, ids.to(sampler.device), features=request.want_features,
                                  labels=request.want_labels, dtype=codec.dtype_to_torch(dtype))
            orig = sampler.orig_ids_local(node_type, ids) if request.want_original_ids else None
            pieces = [codec.row_piece(name, cast_features(part, dtype) if name == "x" else part,
                                      a, nodes.size)
                      for name, part in (("x", x), ("y", y), ("orig_id", orig)) if part is not None]
            # the rows' bytes copied once, into the message (protos.fastwire)
            yield fastwire.encode_message(pb.NodeDataChunk(chunk_index=k, num_chunks=len(slices)), pieces)
