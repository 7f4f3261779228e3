"""Cross-partition work between sampling servers.

* :class:`PeerServicer` answers ``PeerService``: one hop of neighbor sampling
  (``SampleNeighbors`` -> ``NeighborSampler.sample_neighbors``) and feature/label rows
  (``FetchNodeData`` -> ``NeighborSampler.gather_local``) for nodes this server owns,
  streamed as chunks.
* :class:`PeerClient` is the calling side: its :meth:`~PeerClient.neighbors` and
  :meth:`~PeerClient.node_data` are the sampler's ``RemoteNeighbors`` and
  ``RemoteNodeData`` callbacks. One batched call per peer per hop, peers called
  concurrently, every call with a deadline; any failure raises
  :class:`~protos.channel.PeerError` naming the peer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
import torch
from google.protobuf.message import Message

from protos import codec, fastwire
from protos import sampling_pb2 as pb
from protos.channel import GraphfeedError, PeerError, ProtocolError, create_channel, rpc_errors
from protos.security import Security
from sampling_server.expectation import check_expectation
from sampling_server.hetero_store import HeteroPartitionStore
from sampling_server.limits import check_peer_limits
from sampling_server.metrics import ServerMetrics
from sampling_server.sampler import HopSample
from sampling_server.store import (
    PartitionStore,
    RequestError,
    abort_on_error,
    cast_features,
    decode_node_ids,
    wire_feature_dtype,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

NodeData = tuple[torch.Tensor | None, torch.Tensor | None]
#: Most node IDs one request carries (their tensor must fit in one message).
MAX_NODES_PER_CALL = codec.MAX_CHUNK_BYTES // 8
#: Attempts of one peer call that fails with UNAVAILABLE (within its one deadline).
PEER_CALL_ATTEMPTS = 3
#: Pause before the second attempt (x4 before each later one).
PEER_RETRY_BACKOFF_S = 0.05
#: Seconds past its deadline a caller waits for a pooled peer call's answer at most.
RESULT_GRACE_S = 5.0


def chunk_messages(
    make: Callable[..., Message], named: Mapping[str, codec.TensorLike], chunk_bytes: int
) -> list[bytes]:
    """The serialized stream messages (``make(chunk_index=, num_chunks=)`` plus their
    tensors) carrying ``named`` in groups of at most ``chunk_bytes`` (see
    :mod:`protos.fastwire`: each payload byte is copied once)."""
    return fastwire.encode_chunks(lambda i, n: make(chunk_index=i, num_chunks=n), named,
                                  chunk_bytes)


# -- serving side ----------------------------------------------------------------------
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

    def SampleNeighbors(
        self, request: pb.SampleNeighborsRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        self.last_call = time.monotonic()
        with abort_on_error(context, "SampleNeighbors", self.store.partition_id,
                            self._rejected("SampleNeighbors")):
            check_expectation(request, self.store, hot_order=False)
            started = time.perf_counter()
            messages = self._sample(request)
            self._answered("answer_sample", time.perf_counter() - started)
        yield from messages

    def FetchNodeData(
        self, request: pb.FetchNodeDataRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        self.last_call = time.monotonic()
        with abort_on_error(context, "FetchNodeData", self.store.partition_id,
                            self._rejected("FetchNodeData")):
            check_expectation(request, self.store, hot_order=False)
            nodes, dtype, rows = self._check_fetch(request)
            messages = self._fetch(request, nodes, dtype, rows)
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

    def _answered(self, stage: str, seconds: float) -> None:
        """Count the work of one peer answer (its reading, sampling or gathering, and
        encoding; not its wait in gRPC's queues or on the network)."""
        if self.metrics is not None:
            self.metrics.observe(stage, seconds)

    def _sample(self, request: pb.SampleNeighborsRequest) -> list[bytes]:
        field = "SampleNeighborsRequest"
        self.store.partition  # noqa: B018 - raises NotLoaded (UNAVAILABLE) while loading
        nodes = decode_node_ids(request.nodes, f"{field}.nodes")
        store = self.store
        if isinstance(store, HeteroPartitionStore):
            et = store.edge_type_of(request.edge_type, f"{field}.edge_type")
            check_peer_limits(store.config, nodes.size, request.fanout, store.manifest.edge_types[et],
                              field, request.replace)
            store.check_owned(nodes, f"{field}.nodes", et[2])
        elif request.edge_type:
            raise RequestError(f"{field}.edge_type: expected none, the graph is homogeneous, got "
                               f"{request.edge_type[:100]!r}")
        else:
            check_peer_limits(store.config, nodes.size, request.fanout, store.manifest.num_edges,
                              field, request.replace)
            store.check_owned(nodes, f"{field}.nodes")
        if request.fanout < -1:
            raise RequestError(f"{field}.fanout: expected an integer >= 0, or -1 for all "
                               f"neighbors; got {request.fanout}")
        if request.hop < 0:
            raise RequestError(f"{field}.hop: expected an integer >= 0, got {request.hop}")
        if request.weighted and (isinstance(store, HeteroPartitionStore)
                                 or not store.manifest.has_edge_weight):
            raise RequestError(f"{field}.weighted: expected false, the graph has no edge weights",
                               grpc.StatusCode.FAILED_PRECONDITION)
        if isinstance(store, HeteroPartitionStore):
            typed = store.typed_sampler(replace=request.replace)
            drawn = typed.sample_relation(et, torch.from_numpy(nodes).to(typed.device),
                                          request.fanout, request.random_seed, request.hop)
        else:
            sampler = store.sampler(replace=request.replace, weighted=request.weighted)
            drawn = sampler.sample_neighbors(torch.from_numpy(nodes).to(sampler.device),
                                             request.fanout, request.random_seed, request.hop)
        named = {"counts": drawn.counts, "neighbors": drawn.neighbors}
        return chunk_messages(pb.SampleNeighborsChunk, named, self.chunk_bytes)

    def _check_fetch(self, request: pb.FetchNodeDataRequest
                     ) -> tuple[np.ndarray, codec.WireDType, NodeRows]:
        """The request's nodes, the features' wire dtype and what reads their rows."""
        field = "FetchNodeDataRequest"
        self.store.partition  # noqa: B018 - raises NotLoaded (UNAVAILABLE) while loading
        nodes = decode_node_ids(request.nodes, f"{field}.nodes")
        check_peer_limits(self.store.config, nodes.size, None, 0, field)
        store = self.store
        if isinstance(store, HeteroPartitionStore):
            return (nodes, *typed_node_rows(store, request, nodes, field))
        if request.node_type:
            raise RequestError(f"{field}.node_type: expected none, the graph is homogeneous, got "
                               f"{request.node_type[:100]!r}")
        store.check_owned(nodes, f"{field}.nodes")
        dtype = wire_feature_dtype(request.feature_dtype, store.feature_dtype,
                                   f"{field}.feature_dtype")
        sampler = store.sampler()
        return nodes, dtype, NodeRows(
            store.manifest.feature_dim,
            # cast on the way where the sampler can (a CPU gather into bfloat16)
            lambda ids, wire: sampler.gather(ids.to(sampler.device),
                                             features=request.want_features,
                                             labels=request.want_labels,
                                             dtype=codec.dtype_to_torch(wire)),
            sampler.orig_ids_of)

    def _fetch(self, request: pb.FetchNodeDataRequest, nodes: np.ndarray,
               dtype: codec.WireDType, reader: NodeRows) -> Iterator[bytes]:
        """The answer's messages, gathered and encoded slice by slice of the nodes (at
        most about ``chunk_bytes`` of rows each), so the whole answer is never built."""
        row_bytes = (reader.feature_dim * codec.dtype_to_numpy(dtype).itemsize
                     if request.want_features else 0) + (8 if request.want_labels else 0) \
            + (8 if request.want_original_ids else 0)
        rows = max(1, self.chunk_bytes // max(row_bytes, 1))
        slices = [(i, min(i + rows, nodes.size)) for i in range(0, max(nodes.size, 1), rows)]
        for k, (a, b) in enumerate(slices):
            x, y = reader.gather(torch.from_numpy(nodes[a:b]), dtype)
            orig = (reader.orig_ids(torch.from_numpy(nodes[a:b]))
                    if request.want_original_ids else None)
            pieces = [codec.row_piece(name, cast_features(part, dtype) if name == "x" else part,
                                      a, nodes.size)
                      for name, part in (("x", x), ("y", y), ("orig_id", orig)) if part is not None]
            # the rows' bytes copied once, into the message (protos.fastwire)
            yield fastwire.encode_message(pb.NodeDataChunk(chunk_index=k, num_chunks=len(slices)),
                                          pieces)


@dataclass(frozen=True)
class NodeRows:
    """How a FetchNodeData answer reads its rows (homogeneous or of one node type)."""

    #: Feature columns of the nodes (0: none).
    feature_dim: int
    #: Owned global IDs (CPU int64) and the features' wire dtype -> features (in that
    #: dtype, or as stored: the caller casts) and labels, as asked.
    gather: Callable[[torch.Tensor, codec.WireDType], NodeData]
    #: Owned global IDs -> original IDs.
    orig_ids: Callable[[torch.Tensor], torch.Tensor]


def typed_node_rows(store: HeteroPartitionStore, request: pb.FetchNodeDataRequest,
                    nodes: np.ndarray, field: str) -> tuple[codec.WireDType, NodeRows]:
    """Check a typed FetchNodeData request; its wire dtype and row reader."""
    if not request.node_type:
        raise RequestError(f"{field}.node_type: expected one of "
                           f"{list(store.manifest.node_types)} (the graph is typed), got none")
    node_type = store.node_type_of(request.node_type, f"{field}.node_type")
    store.check_owned(nodes, f"{field}.nodes", node_type)
    info = store.manifest.node_types[node_type]
    if request.want_features and not info.feature_dim:
        raise RequestError(f"{field}.want_features: expected false, node type {node_type!r} has "
                           "no features")
    if request.want_labels and node_type != store.manifest.target_type:
        raise RequestError(f"{field}.want_labels: expected false, only the target type "
                           f"{store.manifest.target_type!r} has labels, got node type {node_type!r}")
    dtype = wire_feature_dtype(request.feature_dtype,
                               store.feature_dtypes.get(node_type, pb.FLOAT32),
                               f"{field}.feature_dtype")
    sampler = store.typed_sampler()
    return dtype, NodeRows(
        info.feature_dim,
        lambda ids, _wire: sampler.gather_local(node_type, ids.to(sampler.device),
                                                request.want_features, request.want_labels),
        lambda ids: sampler.orig_ids_local(node_type, ids))


# -- calling side ----------------------------------------------------------------------
@dataclass(frozen=True)
class PeerCallOptions:
    """Per-stream options of the peer calls."""

    #: Sample with replacement.
    replace: bool = False
    #: Sample in proportion to edge weights.
    weighted: bool = False
    #: Wire dtype of fetched features (DTYPE_UNSPECIFIED: the stored dtype).
    feature_dtype: codec.WireDType = pb.DTYPE_UNSPECIFIED


class PeerClient:
    """Calls the other partitions' servers for remote frontiers and remote rows.

    ``addresses[p]`` is partition ``p``'s server; this server's own entry is never
    called. Thread-safe: every stream's sampling threads share one client. Use
    :meth:`bind` for the ``remote``/``remote_data`` callbacks of one stream.
    """

    def __init__(
        self, addresses: Sequence[str], own_partition: int, *, timeout: float = 30.0,
        client_id: str = "", max_workers: int | None = None, security: Security | None = None,
        fingerprint: str = "",
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout: expected seconds > 0, got {timeout}")
        self.addresses = tuple(addresses)
        self.own_partition = own_partition
        #: Deadline of every call, in seconds.
        self.timeout = timeout
        self.client_id = client_id or f"server-{own_partition}"
        #: This server's graph fingerprint, sent with every call (``expect``) so that a
        #: peer restarted on another graph refuses instead of answering; "": not sent.
        self.fingerprint = fingerprint
        #: Where peer call latencies and errors are counted (None: nowhere).
        self.metrics: ServerMetrics | None = None
        self._channels = {p: create_channel(a, security=security)
                          for p, a in enumerate(self.addresses) if p != own_partition}
        self._stubs = {p: _RawPeerStub(ch) for p, ch in self._channels.items()}
        workers = max_workers or max(4, 4 * len(self._channels))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="peer-call")

    def _expect(self, partition: int) -> pb.ServerExpectation | None:
        return pb.ServerExpectation(graph_fingerprint=self.fingerprint, partition_id=partition) \
            if self.fingerprint else None

    def channel(self, partition: int) -> grpc.Channel:
        """The channel to ``partition``'s server (e.g. for health probes)."""
        return self._channels[partition]

    @property
    def peers(self) -> list[int]:
        """Partition IDs of the other servers."""
        return sorted(self._channels)

    def close(self) -> None:
        """Close the channels and the call pool."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        for ch in self._channels.values():
            ch.close()

    def bind(self, options: PeerCallOptions) -> BoundPeers:
        """The callbacks of one stream, with its options."""
        return BoundPeers(self, options)

    # -- the two calls -----------------------------------------------------------------
    def neighbors(
        self, nodes_by_partition: Mapping[int, torch.Tensor], fanout: int, key: int, hop: int,
        options: PeerCallOptions = PeerCallOptions(), edge_type: str = "",
    ) -> dict[int, HopSample]:
        """One hop of sampling on each partition's nodes (``RemoteNeighbors``); on a typed
        graph along ``edge_type`` (``src__rel__dst``)."""
        def call(p: int, nodes: np.ndarray) -> HopSample:
            request = pb.SampleNeighborsRequest(
                nodes=codec.encode_tensor(nodes), fanout=fanout, random_seed=key & _MASK64,
                replace=options.replace, weighted=options.weighted, hop=hop,
                client_id=self.client_id, edge_type=edge_type, expect=self._expect(p))
            with self._errors(p, "SampleNeighbors"), self._timed("peer_sample"):
                got = self._retrying(lambda timeout: _receive(
                    self._stubs[p].SampleNeighbors(request, timeout=timeout),
                    {"counts", "neighbors"}))
                counts, neighbors = got["counts"], got["neighbors"]
                _check_answer(counts.shape == (nodes.size,) and int(counts.sum()) == neighbors.numel(),
                              f"counts {list(counts.shape)} summing to {int(counts.sum())} for "
                              f"{nodes.size} nodes and {neighbors.numel()} neighbors")
            return HopSample(counts=counts, neighbors=neighbors)

        parts = self._run(nodes_by_partition, call)
        return {p: HopSample(_joined([h.counts for h in hs]), _joined([h.neighbors for h in hs]))
                for p, hs in parts.items()}

    def node_data(
        self, nodes_by_partition: Mapping[int, torch.Tensor], features: bool, labels: bool,
        options: PeerCallOptions = PeerCallOptions(), node_type: str = "",
    ) -> dict[int, NodeData]:
        """Features and/or labels of each partition's nodes (``RemoteNodeData``), of
        ``node_type`` on a typed graph."""
        if not features and not labels:
            return {p: (None, None) for p in nodes_by_partition}

        def call(p: int, nodes: np.ndarray) -> NodeData:
            request = pb.FetchNodeDataRequest(
                nodes=codec.encode_tensor(nodes), want_features=features, want_labels=labels,
                feature_dtype=options.feature_dtype, client_id=self.client_id,
                node_type=node_type, expect=self._expect(p))
            expected = {n for n, want in (("x", features), ("y", labels)) if want}
            with self._errors(p, "FetchNodeData"), self._timed("peer_fetch"):
                got = self._retrying(lambda timeout: _receive(
                    self._stubs[p].FetchNodeData(request, timeout=timeout), expected))
                x, y = got.get("x"), got.get("y")
                _check_answer((x is None or x.shape[0] == nodes.size)
                              and (y is None or y.shape == (nodes.size,)),
                              f"rows {None if x is None else list(x.shape)} / "
                              f"{None if y is None else list(y.shape)} for {nodes.size} nodes")
            return x, y

        parts = self._run(nodes_by_partition, call)
        return {p: (_cat([x for x, _ in rows]), _cat([y for _, y in rows]))
                for p, rows in parts.items()}

    def orig_ids(self, nodes_by_partition: Mapping[int, torch.Tensor],
                 node_type: str = "") -> dict[int, torch.Tensor]:
        """Original IDs of each partition's nodes (``RemoteOrigIds``), of ``node_type`` on
        a typed graph."""
        def call(p: int, nodes: np.ndarray) -> torch.Tensor:
            request = pb.FetchNodeDataRequest(nodes=codec.encode_tensor(nodes),
                                              want_original_ids=True, client_id=self.client_id,
                                              node_type=node_type, expect=self._expect(p))
            with self._errors(p, "FetchNodeData"), self._timed("peer_fetch"):
                got = self._retrying(lambda timeout: _receive(
                    self._stubs[p].FetchNodeData(request, timeout=timeout), {"orig_id"}))
                orig = got["orig_id"]
                _check_answer(orig.shape == (nodes.size,),
                              f"orig_id {list(orig.shape)} for {nodes.size} nodes")
            return orig

        parts = self._run(nodes_by_partition, call)
        return {p: _joined(ids) for p, ids in parts.items()}

    # -- plumbing --------------------------------------------------------------------
    def _run(
        self, nodes_by_partition: Mapping[int, torch.Tensor], call: Callable[[int, np.ndarray], T]
    ) -> dict[int, list[T]]:
        """``call(p, slice)`` for every partition's nodes (sliced to fit a message),
        concurrently; the answers per partition, in slice order."""
        jobs: list[tuple[int, np.ndarray]] = []
        for p, nodes in nodes_by_partition.items():
            if p not in self._stubs:
                raise ValueError(f"nodes_by_partition: expected peer partitions {self.peers}, got {p}")
            # (a CPU int64 tensor needs no torch call, each of which releases the
            # interpreter lock and waits to get it back)
            ids = np.ascontiguousarray((nodes if nodes.device.type == "cpu" else nodes.cpu()).numpy(),
                                       dtype=np.int64)
            jobs.extend((p, ids[i:i + MAX_NODES_PER_CALL])
                        for i in range(0, max(ids.size, 1), MAX_NODES_PER_CALL))
        futures: list[Future[T]] = [self._pool.submit(call, p, ids) for p, ids in jobs[1:]]
        try:
            results = [call(*jobs[0])] if jobs else []
            results.extend(self._result(f, p) for f, (p, _) in zip(futures, jobs[1:], strict=True))
        finally:
            for f in futures:
                f.cancel()  # a failed hop needs none of the other answers
        out: dict[int, list[T]] = {}
        for (p, _), result in zip(jobs, results, strict=True):
            out.setdefault(p, []).append(result)
        return out

    def _retrying(self, attempt: Callable[[float], T]) -> T:
        """``attempt(timeout)`` until it succeeds, again after ``UNAVAILABLE`` (a
        connection that broke or was not up) at most :data:`PEER_CALL_ATTEMPTS` times,
        all within one :attr:`timeout`. The calls are pure functions of the request, so
        a repeated one gives the same answer."""
        deadline = time.monotonic() + self.timeout
        backoff = PEER_RETRY_BACKOFF_S
        for attempts_left in range(PEER_CALL_ATTEMPTS - 1, -1, -1):
            remaining = deadline - time.monotonic()
            try:
                return attempt(max(remaining, 0.001))
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                remaining = deadline - time.monotonic()
                if code is not grpc.StatusCode.UNAVAILABLE or not attempts_left \
                        or remaining <= backoff:
                    raise
            time.sleep(backoff)
            backoff *= 4
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _result(self, future: Future[T], partition: int) -> T:
        """A pool call's answer; never waits much past the calls' own deadline."""
        try:
            return future.result(timeout=self.timeout + RESULT_GRACE_S)
        except FutureTimeout:
            address = self.addresses[partition]
            raise PeerError(f"peer partition {partition} ({address}): no answer within "
                            f"{self.timeout + RESULT_GRACE_S:g} s (--peer-timeout)",
                            partition=partition, address=address,
                            code=grpc.StatusCode.DEADLINE_EXCEEDED) from None

    def _timed(self, stage: str) -> AbstractContextManager[None]:
        return self.metrics.stage(stage) if self.metrics is not None else nullcontext()

    @contextmanager
    def _errors(self, partition: int, what: str) -> Iterator[None]:
        address = self.addresses[partition]
        try:
            with rpc_errors(what, address):
                yield
        except GraphfeedError as exc:
            if self.metrics is not None:
                self.metrics.peer_error(partition, exc.code.name if exc.code else "PROTOCOL")
            raise PeerError(f"peer partition {partition} ({address}): {exc}",
                            partition=partition, address=address, code=exc.code,
                            details=exc.details, what=what) from exc


class BoundPeers:
    """A :class:`PeerClient` with one stream's options: :attr:`neighbors` is the
    sampler's ``remote`` callback and :attr:`node_data` its ``remote_data``."""

    def __init__(self, client: PeerClient, options: PeerCallOptions):
        self.client = client
        self.options = options

    def neighbors(self, nodes_by_partition: Mapping[int, torch.Tensor], fanout: int, key: int,
                  hop: int) -> dict[int, HopSample]:
        return self.client.neighbors(nodes_by_partition, fanout, key, hop, self.options)

    def node_data(self, nodes_by_partition: Mapping[int, torch.Tensor], features: bool,
                  labels: bool) -> dict[int, NodeData]:
        return self.client.node_data(nodes_by_partition, features, labels, self.options)

    def orig_ids(self, nodes_by_partition: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return self.client.orig_ids(nodes_by_partition)


_MASK64 = (1 << 64) - 1


class _RawPeerStub:
    """``PeerService`` calls whose answers keep tensor bytes as views (fastwire)."""

    def __init__(self, channel: grpc.Channel) -> None:
        def call(method: str, request: type[Message], answer: type[Message]) -> Any:
            return channel.unary_stream(
                f"/graphfeed.v1.PeerService/{method}",
                request_serializer=request.SerializeToString,
                response_deserializer=lambda raw: fastwire.parse_chunk(answer, raw))

        self.SampleNeighbors = call("SampleNeighbors", pb.SampleNeighborsRequest,
                                    pb.SampleNeighborsChunk)
        self.FetchNodeData = call("FetchNodeData", pb.FetchNodeDataRequest, pb.NodeDataChunk)


def _receive(
    responses: Iterable[fastwire.WireMessage], expected: set[str]
) -> dict[str, torch.Tensor]:
    """Assemble one chunked answer; raises CodecError / ProtocolError when malformed."""
    assembler = codec.TensorAssembler()
    count, total = 0, None
    for msg in responses:
        if msg.chunk_index != count or msg.num_chunks < 1 or (total not in (None, msg.num_chunks)):
            raise codec.CodecError(f"chunk_index/num_chunks: expected chunk {count} of "
                                   f"{total or 'n'}, got {msg.chunk_index} of {msg.num_chunks}")
        total = msg.num_chunks
        assembler.add_all(msg.tensors)
        count += 1
    if total is None or count != total:
        raise codec.CodecError(f"num_chunks: expected {total or 'at least 1'} messages, got {count}")
    return assembler.finish_torch(expected=expected)


def _check_answer(ok: bool, what: str) -> None:
    if not ok:
        raise ProtocolError(f"malformed peer answer: {what}")


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The answers of one partition's slices as one tensor: the answer itself when there
    is one slice (as almost always), which ``torch.cat`` would copy."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    if any(p is None for p in parts):
        return None
    return _joined([p for p in parts if p is not None])
