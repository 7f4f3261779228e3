"""``PeerService``: what the other sampling servers ask of this partition, plain or typed.

``SampleNeighbors`` draws one hop of a relation for nodes whose in-edges are here
(:meth:`NeighborSampler.sample_relation`; with ``want_edges`` the drawn edges' internal
IDs too), ``FetchNodeData`` reads their feature and label rows and original IDs,
``FetchEdgeData`` the original IDs and features of edges held here
(:meth:`NeighborSampler.edge_rows_local`), ``HasEdges`` tests pairs. Every call opens
alike (:meth:`PeerServicer._opened`); rows, node or edge, are read and sent slice by
slice. A plain graph's requests name no type; a typed graph's name the relation
(``edge_type``) or the node type.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import grpc
import numpy as np
import torch
from google.protobuf.message import Message

from partitioner.graph import edge_type_name
from protos import codec, fastwire
from protos import sampling_pb2 as pb
from sampling_server.errors import RequestError, abort_on_error, printable
from sampling_server.expectation import ExpectingRequest, check_expectation
from sampling_server.fields import cast_features, decode_node_ids, edge_wire_dtype, wire_feature_dtype
from sampling_server.limits import check_peer_edge_limits, check_peer_limits
from sampling_server.metrics import ServerMetrics
from sampling_server.node_tensors import NodeTensors
from sampling_server.sampler.peers import edges_of
from sampling_server.store import PartitionStore


class PeerServicer:
    """``PeerService``: what the other sampling servers ask of this partition."""

    def __init__(self, store: PartitionStore, chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
                 node_tensors: NodeTensors | None = None):
        self.store = store
        self.chunk_bytes = chunk_bytes
        #: The node tensors whose rows ``FetchNodeData`` answers (None: none).
        self.node_tensors = node_tensors
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

    @contextmanager
    def _opened(self, method: str, request: ExpectingRequest, context: grpc.ServicerContext
                ) -> Iterator[None]:
        """The opening every peer call shares: the call noted (:attr:`last_call`), every
        failure inside answered with its status (:func:`abort_on_error`), the caller's
        expectation checked, and refused while the partition loads."""
        self.last_call = time.monotonic()
        with abort_on_error(context, method, self.store.partition_id, self._rejected(method)):
            check_expectation(request, self.store, hot_order=False)
            self.store.partition  # noqa: B018 - raises NotLoaded (UNAVAILABLE) while loading
            yield

    def _serve(self, method: str, request: ExpectingRequest, context: grpc.ServicerContext, stage: str,
               answer: Callable[[], Iterator[bytes]]) -> Iterator[bytes]:
        """A streamed peer call: after :meth:`_opened`, the messages of ``answer()`` (a
        generator: it checks the request, then makes them), sent until the caller goes away;
        the time spent making them (not waiting for gRPC to take one) counted as ``stage``."""
        with self._opened(method, request, context):
            messages, working = iter(answer()), 0.0
            while True:
                started = time.perf_counter()
                message = next(messages, None)
                working += time.perf_counter() - started
                if message is None:
                    break
                if not context.is_active():  # the caller went away: stop answering
                    return
                yield message
            self._answered(stage, working)

    def SampleNeighbors(self, request: pb.SampleNeighborsRequest, context: grpc.ServicerContext
                        ) -> Iterator[bytes]:
        return self._serve("SampleNeighbors", request, context, "answer_sample",
                           lambda: self._sample(request))

    def FetchNodeData(self, request: pb.FetchNodeDataRequest, context: grpc.ServicerContext
                      ) -> Iterator[bytes]:
        return self._serve("FetchNodeData", request, context, "answer_fetch",
                           lambda: self._fetch(request))

    def FetchEdgeData(self, request: pb.FetchEdgeDataRequest, context: grpc.ServicerContext
                      ) -> Iterator[bytes]:
        return self._serve("FetchEdgeData", request, context, "answer_fetch",
                           lambda: self._fetch_edges(request))

    def HasEdges(self, request: pb.HasEdgesRequest, context: grpc.ServicerContext) -> pb.HasEdgesReply:
        with self._opened("HasEdges", request, context):
            started = time.perf_counter()
            field = "HasEdgesRequest"
            store = self.store
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

    def _fetch_edges(self, request: pb.FetchEdgeDataRequest) -> Iterator[bytes]:
        """The request checked, then its answer's messages (:meth:`_in_slices`)."""
        field = "FetchEdgeDataRequest"
        store = self.store
        edges = torch.from_numpy(decode_node_ids(request.edges, f"{field}.edges", "internal edge IDs"))
        check_peer_edge_limits(store.config, edges.numel(), field)
        et = store.edge_type_of(request.edge_type, f"{field}.edge_type")
        if not store.has_edge_ids:
            raise RequestError(f"{field}: expected partitions with edge IDs, this graph's were written "
                               "without them (partition it again)", grpc.StatusCode.FAILED_PRECONDITION)
        info = store.edge_feature_info(et)
        if request.want_features and info is None:
            raise RequestError(f"{field}.want_features: expected false, edge type "
                               f"{edge_type_name(et)!r} has no edge features")
        stored = info.dtype if info is not None else pb.FLOAT32
        if request.want_features:
            wire_feature_dtype(request.feature_dtype, stored, f"{field}.feature_dtype")  # a bad one refused
        dtype = edge_wire_dtype(request.feature_dtype, stored)
        sampler = store.sampler()
        try:
            sampler.check_edges_held(et, edges, f"{field}.edges")
        except ValueError as exc:  # an edge not held here
            raise RequestError(str(exc)) from None
        width = int(np.prod(info.shape)) * codec.dtype_to_numpy(dtype).itemsize if info is not None else 0
        row_bytes = (8 if request.want_edge_ids else 0) + (width if request.want_features else 0)
        yield from self._in_slices(edges.numel(), row_bytes, pb.EdgeDataChunk, lambda a, b: dict(zip(
            ("e_id", "edge_attr"), sampler.edge_rows_local(et, edges[a:b], request.want_edge_ids,
                                                           request.want_features, codec.dtype_to_torch(dtype),
                                                           f"{field}.edges"), strict=True)))

    def _in_slices(self, count: int, row_bytes: int, chunk: type[Message],
                   rows_of: Callable[[int, int], Mapping[str, torch.Tensor | None]]) -> Iterator[bytes]:
        """An answer's messages, read and encoded slice by slice of the ``count`` IDs asked
        (``rows_of(a, b)``: the rows of IDs ``a`` to ``b`` by name, None where not asked; at
        most about ``chunk_bytes`` of rows a slice), so the whole answer is never built."""
        rows = max(1, self.chunk_bytes // max(row_bytes, 1))
        slices = [(i, min(i + rows, count)) for i in range(0, max(count, 1), rows)]
        for k, (a, b) in enumerate(slices):
            pieces = [codec.row_piece(name, part, a, count) for name, part in rows_of(a, b).items()
                      if part is not None]
            # the rows' bytes copied once, into the message (protos.fastwire)
            yield fastwire.encode_message(chunk(chunk_index=k, num_chunks=len(slices)), pieces)

    def _answered(self, stage: str, seconds: float) -> None:
        """Count the work of one peer answer (its reading, sampling or gathering, and
        encoding; not its wait in gRPC's queues or on the network)."""
        if self.metrics is not None:
            self.metrics.observe(stage, seconds)

    def _sample(self, request: pb.SampleNeighborsRequest) -> Iterator[bytes]:
        field = "SampleNeighborsRequest"
        store = self.store
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
        yield from fastwire.encode_chunks(lambda i, n: pb.SampleNeighborsChunk(chunk_index=i, num_chunks=n),
                                      named, self.chunk_bytes)

    def _fetch(self, request: pb.FetchNodeDataRequest) -> Iterator[bytes]:
        """The request checked, then its answer's messages (:meth:`_in_slices`)."""
        field = "FetchNodeDataRequest"
        store, m = self.store, self.store.manifest
        nodes = decode_node_ids(request.nodes, f"{field}.nodes")
        check_peer_limits(store.config, nodes.size, None, 0, field)
        if store.typed and not request.node_type:
            raise RequestError(f"{field}.node_type: expected one of {list(m.node_types)} (the graph "
                               "is typed), got none")
        node_type = store.node_type_of(request.node_type, f"{field}.node_type")
        store.check_owned(nodes, f"{field}.nodes", node_type)
        if request.node_tensor:
            yield from self._fetch_rows(request, nodes, node_type)
            return
        width = m.node_types[node_type].feature_dim
        if request.want_features and not width:
            raise RequestError(f"{field}.want_features: expected false, node type {node_type!r} has "
                               "no features")
        if request.want_labels and node_type != m.target_type:
            raise RequestError(f"{field}.want_labels: expected false, only the target type "
                               f"{m.target_type!r} has labels, got node type {node_type!r}")
        dtype = wire_feature_dtype(request.feature_dtype, store.feature_dtypes.get(node_type, pb.FLOAT32),
                                   f"{field}.feature_dtype")
        sampler = store.sampler()
        row_bytes = (width * codec.dtype_to_numpy(dtype).itemsize if request.want_features else 0) \
            + (8 if request.want_labels else 0) + (8 if request.want_original_ids else 0)

        def rows_of(a: int, b: int) -> dict[str, torch.Tensor | None]:
            ids = torch.from_numpy(nodes[a:b])
            # cast on the way where the sampler can (a CPU gather into bfloat16)
            x, y = sampler.gather(node_type, ids.to(sampler.device), features=request.want_features,
                                  labels=request.want_labels, dtype=codec.dtype_to_torch(dtype))
            orig = sampler.orig_ids_local(node_type, ids) if request.want_original_ids else None
            return {"x": None if x is None else cast_features(x, dtype), "y": y, "orig_id": orig}

        yield from self._in_slices(nodes.size, row_bytes, pb.NodeDataChunk, rows_of)

    def _fetch_rows(self, request: pb.FetchNodeDataRequest, nodes: np.ndarray, node_type: str
                    ) -> Iterator[bytes]:
        """A node tensor's rows of ``nodes`` (owned, of ``node_type``), slice by slice."""
        field = "FetchNodeDataRequest"
        if self.node_tensors is None or request.want_features or request.want_labels \
                or request.want_original_ids:
            raise RequestError(f"{field}.node_tensor: expected alone (no want_*), on a server holding node "
                               f"tensors; got {printable(request.node_tensor, 100)!r} with want_features="
                               f"{request.want_features}, want_labels={request.want_labels}, "
                               f"want_original_ids={request.want_original_ids}")
        tensors = self.node_tensors
        tensor = tensors.get(request.node_tensor, "", f"{field}.node_tensor")
        if tensor.node_type != node_type:
            raise RequestError(f"{field}.node_type: expected {tensor.node_type!r} (node tensor "
                               f"{tensor.spec.name!r}'s), got {node_type!r}")
        yield from self._in_slices(nodes.size, max(tensor.row_bytes // max(tensor.rows.shape[0], 1), 1),
                                   pb.NodeDataChunk,
                                   lambda a, b: {"rows": tensors.read(tensor, nodes[a:b], 0, None)})
