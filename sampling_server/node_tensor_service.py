"""``NodeTensorService``: thin handlers over a server's node tensors
(:class:`~sampling_server.node_tensors.NodeTensors`): every request checked into a call
on them, every failure a status naming the field, rows chunked into messages of the
server's chunk size both ways; and the metrics of the tensors held."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import torch
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from protos import codec
from protos import sampling_pb2 as pb
from protos.assembler import TensorAssembler
from sampling_server.errors import MalformedRequest, RequestError, abort_on_error, printable
from sampling_server.node_tensors import NodeTensor, NodeTensors
from sampling_server.store import PartitionStore

log = logging.getLogger(__name__)

#: Largest upload (rows and node IDs) one WriteRows or PushGradients call may carry.
MAX_UPLOAD_BYTES = 1 << 31


def node_ids(msg: pb.Tensor | torch.Tensor, field: str) -> np.ndarray:
    """INT64 ``[n]`` node IDs of a request."""
    try:
        ids = codec.decode_tensor(msg) if isinstance(msg, pb.Tensor) else msg.numpy()
    except codec.CodecError as exc:
        raise RequestError(f"{field}: {exc}") from None
    if ids.dtype != np.int64 or ids.ndim != 1:
        raise RequestError(f"{field}: expected INT64 [n] node IDs, got {ids.dtype} {list(ids.shape)}")
    return ids


class NodeTensorServicer:
    """``NodeTensorService``: node tensors, their sparse optimizers and snapshots."""

    def __init__(self, store: PartitionStore, tensors: NodeTensors, chunk_bytes: int) -> None:
        self.store = store
        self.tensors = tensors
        self.chunk_bytes = chunk_bytes

    def _loaded(self) -> None:
        self.store.partition  # noqa: B018 - raises NotLoaded (UNAVAILABLE) while loading

    def CreateNodeTensor(self, request: pb.CreateNodeTensorRequest,
                         context: grpc.ServicerContext) -> pb.NodeTensorInfo:
        with abort_on_error(context, "CreateNodeTensor", self.store.partition_id):
            self._loaded()
            tensor, created = self.tensors.create(request.spec)
            return tensor.info(created)

    def FindNodeTensor(self, request: pb.FindNodeTensorRequest,
                       context: grpc.ServicerContext) -> pb.NodeTensorInfo:
        with abort_on_error(context, "FindNodeTensor", self.store.partition_id):
            self._loaded()
            return self.tensors.get(request.name, "", "FindNodeTensorRequest.name").info()

    def ReadRows(self, request: pb.ReadRowsRequest, context: grpc.ServicerContext) -> Iterator[pb.RowsChunk]:
        with abort_on_error(context, "ReadRows", self.store.partition_id):
            self._loaded()
            tensor = self.tensors.get(request.tensor, request.incarnation, "ReadRowsRequest.tensor")
            nodes = node_ids(request.nodes, "ReadRowsRequest.nodes")
            rows = self.tensors.read(tensor, nodes, request.after_step, context.time_remaining())
            groups = list(codec.split_tensors({"rows": rows}, self.chunk_bytes))
        for i, group in enumerate(groups):
            yield pb.RowsChunk(chunk_index=i, num_chunks=len(groups), tensors=group)

    def WriteRows(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.WriteRowsReply:
        with abort_on_error(context, "WriteRows", self.store.partition_id):
            self._loaded()
            header, nodes, rows = _upload(requests)
            tensor = self.tensors.get(header.tensor, header.incarnation, "RowsHeader.tensor")
            self.tensors.write(tensor, nodes, rows)
            return pb.WriteRowsReply(rows=int(nodes.size))

    def PushGradients(self, requests: Iterator[Any], context: grpc.ServicerContext) -> pb.PushGradientsReply:
        with abort_on_error(context, "PushGradients", self.store.partition_id):
            self._loaded()
            header, nodes, grads = _upload(requests)
            tensor = self.tensors.get(header.tensor, header.incarnation, "RowsHeader.tensor")
            step, duplicate = self.tensors.push(tensor, header, nodes, grads)
            if duplicate:
                log.info("partition=%d client=%s: push of %r step %d rank %d again: counted before",
                         self.store.partition_id, printable(header.client_id), header.tensor,
                         header.step, header.rank)
            return pb.PushGradientsReply(step=step, duplicate=duplicate)

    def SnapshotNodeTensors(self, request: pb.NodeTensorsAtStep,
                            context: grpc.ServicerContext) -> pb.NodeTensorsReply:
        return self._at_step("SnapshotNodeTensors", "snapshotted at", request, context,
                             lambda: self.tensors.snapshot(request.job_id, request.step,
                                                           context.time_remaining(), request.pin,
                                                           dict(request.incarnations)))

    def RestoreNodeTensors(self, request: pb.NodeTensorsAtStep,
                           context: grpc.ServicerContext) -> pb.NodeTensorsReply:
        return self._at_step("RestoreNodeTensors", "restored to", request, context,
                             lambda: self.tensors.restore(request.job_id, request.step))

    def _at_step(self, method: str, done: str, request: pb.NodeTensorsAtStep, context: grpc.ServicerContext,
                 act: Callable[[], list[NodeTensor]]) -> pb.NodeTensorsReply:
        """A job's tensors snapshotted or restored by ``act``; the reply lists them."""
        with abort_on_error(context, method, self.store.partition_id):
            self._loaded()
            tensors = act()
            log.info("partition=%d: node tensors of job %s %s step %d: %s", self.store.partition_id,
                     printable(request.job_id), done, request.step, [t.spec.name for t in tensors])
            return pb.NodeTensorsReply(tensors=[t.info() for t in tensors])

    def DropNodeTensor(self, request: pb.DropNodeTensorRequest,
                       context: grpc.ServicerContext) -> pb.DropNodeTensorReply:
        with abort_on_error(context, "DropNodeTensor", self.store.partition_id):
            return pb.DropNodeTensorReply(dropped=self.tensors.drop(request.name, request.forget))


def _upload(requests: Iterator[Any]) -> tuple[pb.RowsHeader, np.ndarray, torch.Tensor]:
    """The header, node IDs and rows of a WriteRows or PushGradients call."""
    header: pb.RowsHeader | None = None
    assembler = TensorAssembler(max_tensor_bytes=MAX_UPLOAD_BYTES)
    for message in requests:
        if isinstance(message, MalformedRequest):
            raise RequestError(message.describe())
        if header is None:
            if not message.HasField("header"):
                raise RequestError("RowsUpload.header: expected the header in the call's first message, "
                                   "got none")
            header = message.header
        try:
            assembler.add_all(message.tensors)
        except codec.CodecError as exc:
            raise RequestError(f"RowsUpload.tensors: {exc}") from None
    if header is None:
        raise RequestError("RowsUpload: expected at least one message, got none")
    try:
        named = assembler.finish_torch(expected={"nodes", "rows"})
    except codec.CodecError as exc:
        raise RequestError(f"RowsUpload.tensors: {exc}") from None
    return header, node_ids(named["nodes"], "RowsUpload.nodes"), named["rows"]


class NodeTensorCollector(Collector):
    """Per node tensor: the bytes of its rows and of its optimizer state, and its step."""

    def __init__(self, tensors: NodeTensors, partition: int) -> None:
        self._tensors = tensors
        self._partition = str(partition)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held = GaugeMetricFamily("graphfeed_node_tensor_bytes", "Bytes of a node tensor on this server: "
                                 "its rows, or its optimizer state", labels=["partition", "tensor", "part"])
        steps = GaugeMetricFamily("graphfeed_node_tensor_step", "Optimizer steps applied to a node tensor",
                                  labels=["partition", "tensor"])
        for tensor in self._tensors.tensors():
            name = tensor.spec.name
            held.add_metric([self._partition, name, "rows"], tensor.row_bytes)
            held.add_metric([self._partition, name, "optimizer"], tensor.state_bytes)
            steps.add_metric([self._partition, name], tensor.step)
        yield held
        yield steps
