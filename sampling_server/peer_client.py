"""The calling side of cross-partition work: :class:`PeerClient` asks the other
partitions' servers (``PeerService``) to draw one hop of a frontier, for node rows
(features, labels, original IDs) and edge rows (original IDs, features), and whether
pairs are edges; :class:`PeerRemote` is one stream's view of it, the sampler's
:class:`~sampling_server.sampler.peers.Remote`. One batched call per peer per relation
and hop (per type for rows), peers called concurrently, every call with a deadline; any
failure raises :class:`~protos.channel.PeerError` naming the peer.
"""

from __future__ import annotations

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

from partitioner.graph import EdgeType, edge_type_name
from protos import codec, fastwire
from protos import sampling_pb2 as pb
from protos.assembler import TensorAssembler
from protos.channel import GraphfeedError, PeerError, ProtocolError, create_channel, rpc_errors
from protos.security import Security
from sampling_server.metrics import ServerMetrics
from sampling_server.sampler import HopSample
from sampling_server.sampler.peers import EdgeRows, NodeRows

T = TypeVar("T")

#: Most node IDs one request carries (their tensor must fit in one message).
MAX_NODES_PER_CALL = codec.MAX_CHUNK_BYTES // 8
#: Attempts of one peer call that fails with UNAVAILABLE (within its one deadline).
PEER_CALL_ATTEMPTS = 3
#: Pause before the second attempt (x4 before each later one).
PEER_RETRY_BACKOFF_S = 0.05
#: Seconds past its deadline a caller waits for a pooled peer call's answer at most.
RESULT_GRACE_S = 5.0


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
    called. Thread-safe: every stream's sampling threads share one client, each through
    a :class:`PeerRemote` with its options.
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

    # -- the two calls -----------------------------------------------------------------
    def neighbors(
        self, nodes_by_partition: Mapping[int, torch.Tensor], fanout: int, key: int, hop: int,
        options: PeerCallOptions = PeerCallOptions(), edge_type: str = "", edges: bool = False,
    ) -> dict[int, HopSample]:
        """One hop of sampling on each partition's nodes; on a typed graph along
        ``edge_type`` (``src__rel__dst``); with ``edges``, the drawn edges' internal IDs too
        (a peer that answers without them raises :class:`~protos.channel.PeerError`)."""
        def call(p: int, nodes: np.ndarray) -> HopSample:
            request = pb.SampleNeighborsRequest(
                nodes=codec.encode_tensor(nodes), fanout=fanout, random_seed=key & _MASK64,
                replace=options.replace, weighted=options.weighted, hop=hop,
                client_id=self.client_id, edge_type=edge_type, expect=self._expect(p),
                want_edges=edges)
            with self._errors(p, "SampleNeighbors"), self._timed("peer_sample"):
                got = self._retrying(lambda timeout: _receive(
                    self._stubs[p].SampleNeighbors(request, timeout=timeout),
                    {"counts", "neighbors"}))
                counts, neighbors = got["counts"], got["neighbors"]
                _check_answer(counts.shape == (nodes.size,) and int(counts.sum()) == neighbors.numel(),
                              f"counts {list(counts.shape)} summing to {int(counts.sum())} for "
                              f"{nodes.size} nodes and {neighbors.numel()} neighbors")
                edge_ids = got.get("edges") if edges else None
                if edges and edge_ids is None:
                    raise ProtocolError(
                        "SampleNeighborsChunk.tensors: expected \"edges\" (SampleNeighborsRequest."
                        "want_edges was set), got none: the peer runs a graphfeed older than edge IDs; "
                        "run one version on every server")
                if edge_ids is not None:
                    _check_answer(edge_ids.shape == neighbors.shape,
                                  f"edges {list(edge_ids.shape)} for {neighbors.numel()} neighbors")
            return HopSample(counts=counts, neighbors=neighbors, edges=edge_ids)

        parts = self._run(nodes_by_partition, call)
        return {p: HopSample(_joined([h.counts for h in hs]), _joined([h.neighbors for h in hs]),
                             _joined([h.edges for h in hs if h.edges is not None]) if edges else None)
                for p, hs in parts.items()}

    def node_data(
        self, nodes_by_partition: Mapping[int, torch.Tensor], features: bool, labels: bool,
        options: PeerCallOptions = PeerCallOptions(), node_type: str = "",
    ) -> dict[int, NodeRows]:
        """Features and/or labels of each partition's nodes, of ``node_type`` on a typed graph."""
        if not features and not labels:
            return {p: (None, None) for p in nodes_by_partition}
        got = self._rows("FetchNodeData", nodes_by_partition, lambda p, nodes: pb.FetchNodeDataRequest(
            nodes=codec.encode_tensor(nodes), want_features=features, want_labels=labels,
            feature_dtype=options.feature_dtype, client_id=self.client_id, node_type=node_type,
            expect=self._expect(p)), {n for n, want in (("x", features), ("y", labels)) if want})
        return {p: (rows.get("x"), rows.get("y")) for p, rows in got.items()}

    def node_tensor_rows(self, name: str, nodes_by_partition: Mapping[int, torch.Tensor],
                         node_type: str = "") -> dict[int, torch.Tensor]:
        """The rows of node tensor ``name`` of each partition's nodes (of ``node_type``,
        the tensor's, on a typed graph)."""
        got = self._rows("FetchNodeData", nodes_by_partition, lambda p, nodes: pb.FetchNodeDataRequest(
            nodes=codec.encode_tensor(nodes), node_tensor=name, client_id=self.client_id,
            node_type=node_type, expect=self._expect(p)), {"rows"})
        return {p: rows["rows"] for p, rows in got.items()}

    def orig_ids(self, nodes_by_partition: Mapping[int, torch.Tensor],
                 node_type: str = "") -> dict[int, torch.Tensor]:
        """Original IDs of each partition's nodes, of ``node_type`` on a typed graph."""
        got = self._rows("FetchNodeData", nodes_by_partition, lambda p, nodes: pb.FetchNodeDataRequest(
            nodes=codec.encode_tensor(nodes), want_original_ids=True, client_id=self.client_id,
            node_type=node_type, expect=self._expect(p)), {"orig_id"})
        return {p: rows["orig_id"] for p, rows in got.items()}

    def edge_data(
        self, edges_by_partition: Mapping[int, torch.Tensor], ids: bool, features: bool,
        feature_dtype: codec.WireDType = pb.DTYPE_UNSPECIFIED, edge_type: str = "",
    ) -> dict[int, EdgeRows]:
        """Original IDs and/or features of each partition's edges (internal edge IDs), of
        ``edge_type`` (``src__rel__dst``) on a typed graph."""
        if not ids and not features:
            return {p: (None, None) for p in edges_by_partition}
        got = self._rows("FetchEdgeData", edges_by_partition, lambda p, edges: pb.FetchEdgeDataRequest(
            edges=codec.encode_tensor(edges), edge_type=edge_type, want_edge_ids=ids,
            want_features=features, feature_dtype=feature_dtype, client_id=self.client_id,
            expect=self._expect(p)), {n for n, want in (("e_id", ids), ("edge_attr", features)) if want})
        return {p: (rows.get("e_id"), rows.get("edge_attr")) for p, rows in got.items()}

    def has_edges(self, pairs_by_partition: Mapping[int, tuple[np.ndarray, np.ndarray]], edge_type: str = ""
                  ) -> dict[int, np.ndarray]:
        """Whether each partition's ``(src, dst)`` pairs (global IDs, ``dst`` owned there)
        are edges, of ``edge_type`` (``src__rel__dst``) on a typed graph."""
        def call(p: int, positions: np.ndarray) -> np.ndarray:
            src, dst = pairs_by_partition[p]
            request = pb.HasEdgesRequest(
                src=codec.encode_tensor(np.ascontiguousarray(src[positions], np.int64)),
                dst=codec.encode_tensor(np.ascontiguousarray(dst[positions], np.int64)),
                edge_type=edge_type, client_id=self.client_id, expect=self._expect(p))
            with self._errors(p, "HasEdges"), self._timed("peer_sample"):
                reply = self._retrying(lambda timeout: self._stubs[p].HasEdges(request, timeout=timeout))
                found = codec.decode_tensor(reply.found)
                _check_answer(found.dtype == np.bool_ and found.shape == (positions.size,),
                              f"found {found.dtype} {list(found.shape)} for {positions.size} pairs")
            return np.asarray(found)

        parts = self._run({p: torch.arange(len(src)) for p, (src, _) in pairs_by_partition.items()}, call)
        return {p: np.concatenate(found) for p, found in parts.items()}

    # -- plumbing --------------------------------------------------------------------
    def _rows(self, method: str, ids_by_partition: Mapping[int, torch.Tensor],
              request: Callable[[int, np.ndarray], Message], names: set[str]
              ) -> dict[int, dict[str, torch.Tensor]]:
        """The rows ``names`` that ``method`` (``FetchNodeData`` or ``FetchEdgeData``)
        answers for each partition's IDs, one row per ID, in their order: features
        (``x``, ``edge_attr``) and node tensor rows of any width, the others one value each."""
        def call(p: int, ids: np.ndarray) -> dict[str, torch.Tensor]:
            with self._errors(p, method), self._timed("peer_fetch"):
                got = self._retrying(lambda timeout: _receive(
                    getattr(self._stubs[p], method)(request(p, ids), timeout=timeout), names))
                shapes = {n: list(t.shape) for n, t in got.items()}
                _check_answer(all(s[:1] == [ids.size] and (len(s) == 1 or n in ("x", "edge_attr", "rows"))
                                  for n, s in shapes.items()), f"{shapes} for {ids.size} IDs")
            return got

        parts = self._run(ids_by_partition, call)
        return {p: {n: _joined([r[n] for r in rows]) for n in names} for p, rows in parts.items()}

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


class PeerRemote:
    """One stream's :class:`~sampling_server.sampler.peers.Remote`: a :class:`PeerClient`
    with the stream's options. On a plain graph (not ``typed``) the calls name no type
    (the wire's plain form); on a typed one they name the relation or node type.
    ``feature_types``: the node types with features."""

    def __init__(self, client: PeerClient, options: PeerCallOptions, typed: bool,
                 feature_types: frozenset[str]) -> None:
        self.client = client
        self.options = options
        self.typed = typed
        #: Node types with features (only they are asked for "x").
        self.feature_types = feature_types

    def sample(self, edge_type: EdgeType, nodes_by_partition: Mapping[int, torch.Tensor], fanout: int,
               key: int, hop: int, edges: bool = False) -> dict[int, HopSample]:
        return self.client.neighbors(nodes_by_partition, fanout, key, hop, self.options,
                                     edge_type=edge_type_name(edge_type) if self.typed else "",
                                     edges=edges)

    def node_data(self, node_type: str, nodes_by_partition: Mapping[int, torch.Tensor],
                  features: bool, labels: bool) -> dict[int, NodeRows]:
        return self.client.node_data(nodes_by_partition, features and node_type in self.feature_types,
                                     labels, self.options, node_type=node_type if self.typed else "")

    def orig_ids(self, node_type: str, nodes_by_partition: Mapping[int, torch.Tensor]
                 ) -> dict[int, torch.Tensor]:
        return self.client.orig_ids(nodes_by_partition, node_type=node_type if self.typed else "")

    def node_tensor_rows(self, name: str, node_type: str, nodes_by_partition: Mapping[int, torch.Tensor]
                         ) -> dict[int, torch.Tensor]:
        """The rows of node tensor ``name`` (of ``node_type``) of each partition's nodes."""
        return self.client.node_tensor_rows(name, nodes_by_partition, node_type if self.typed else "")

    def has_edges(self, edge_type: EdgeType, pairs_by_partition: Mapping[int, tuple[np.ndarray, np.ndarray]]
                  ) -> dict[int, np.ndarray]:
        return self.client.has_edges(pairs_by_partition, edge_type_name(edge_type) if self.typed else "")

    def edge_data(self, edge_type: EdgeType, edges_by_partition: Mapping[int, torch.Tensor], ids: bool,
                  features: bool, dtype: torch.dtype | None) -> dict[int, EdgeRows]:
        return self.client.edge_data(edges_by_partition, ids, features,
                                     pb.DTYPE_UNSPECIFIED if dtype is None else codec.torch_to_dtype(dtype),
                                     edge_type=edge_type_name(edge_type) if self.typed else "")


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
        self.FetchEdgeData = call("FetchEdgeData", pb.FetchEdgeDataRequest, pb.EdgeDataChunk)
        self.HasEdges = channel.unary_unary("/graphfeed.v1.PeerService/HasEdges",
                                            request_serializer=pb.HasEdgesRequest.SerializeToString,
                                            response_deserializer=pb.HasEdgesReply.FromString)


def _receive(
    responses: Iterable[fastwire.WireMessage], expected: set[str]
) -> dict[str, torch.Tensor]:
    """Assemble one chunked answer; raises CodecError / ProtocolError when malformed."""
    assembler = TensorAssembler()
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

