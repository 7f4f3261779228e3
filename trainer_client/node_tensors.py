"""Node tensors on the servers, from the trainer's side (DGL's ``DistTensor``).

A :class:`RemoteNodeTensor` is a table with a row per node of one type, each server
holding the rows of the nodes its partition owns (``NodeTensorService``, docs/wire.md
"Node tensors"). Rows are read and written by global node ID (a batch's
``internal_n_id``; :meth:`RemoteNodeTensor.global_ids` maps original IDs), grouped by
owner and sent to every owner at once, in messages of bounded size, with deadlines. A
server that does not answer is asked again for ``reconnect`` seconds (reads, writes and
pushes are idempotent), then the call fails naming it; a server that restarted answers
with another incarnation of the tensor, and the call fails saying the rows it held since
its last snapshot are lost and that ``--resume`` continues from the last checkpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, Union

import grpc
import numpy as np
import torch

from protos import codec
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.assembler import TensorAssembler
from protos.channel import (
    Backoff,
    GraphfeedError,
    ServerUnavailable,
    error_from_rpc,
    retry,
    status_in,
)
from trainer_client.batch_checks import TensorRows
from trainer_client.cluster import Cluster
from trainer_client.inputs import RESERVED_BATCH_ATTRIBUTES

T = TypeVar("T")

#: Statuses after which a node tensor call is made again (within ``reconnect``).
RETRIED = status_in(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
#: How initial rows are made, by name (:class:`pb.RowInit`).
INITS = {"zeros": pb.RowInit.ZEROS, "uniform": pb.RowInit.UNIFORM, "normal": pb.RowInit.NORMAL,
         "in_degree": pb.RowInit.IN_DEGREE}
#: What a loader's ``node_tensors`` maps an attribute to: a tensor (or its name), or one
#: per node type.
TensorRef = Union[str, "RemoteNodeTensor"]


def row_init(kind: str = "zeros", scale: float = 1.0, seed: int = 0) -> pb.RowInit:
    """A ``RowInit`` by name: ``zeros``, ``uniform`` (in ``[-scale, scale)``),
    ``normal`` (standard deviation ``scale``) or ``in_degree`` (each node's in-degree,
    self-loops not counted, filled by the servers: one value per node)."""
    if kind not in INITS:
        raise ValueError(f"init: expected one of {list(INITS)}, got {kind!r}")
    return pb.RowInit(kind=INITS[kind], scale=scale, seed=seed)


class RemoteNodeTensor:
    """A node tensor on the servers of ``cluster``: created there (or found, when one of
    the same spec exists) at construction. ``dims``: the shape of one row; ``node_type``:
    the nodes it has a row for (None: a plain graph's, or the target type); ``init``:
    the rows it starts with (:func:`row_init`); ``optimizer``: a sparse optimizer that
    makes it trainable by ``job_id``'s pushes (:mod:`trainer_client.embeddings`)."""

    def __init__(self, cluster: Cluster, name: str, dims: Sequence[int] | int, *,
                 node_type: str | None = None, dtype: torch.dtype = torch.float32,
                 init: pb.RowInit | None = None, optimizer: pb.SparseOptimizer | None = None,
                 job_id: str = "", rpc_timeout: float = 60.0, reconnect: float = 15.0) -> None:
        self.cluster = cluster
        self.name = name
        self.node_type = cluster.graph.target_type if node_type is None else node_type
        if self.node_type not in cluster.graph.books:
            raise ValueError(f"node_type: expected one of {list(cluster.graph.node_types)}, got "
                             f"{node_type!r}")
        self.dims = (int(dims),) if isinstance(dims, int) else tuple(int(d) for d in dims)
        self.dtype = dtype
        self.rpc_timeout, self.reconnect = rpc_timeout, reconnect
        self.spec = pb.NodeTensorSpec(name=name, node_type=cluster.graph.wire_type(self.node_type),
                                      dims=self.dims, dtype=codec.torch_to_dtype(dtype),
                                      init=init or pb.RowInit(), optimizer=optimizer or pb.SparseOptimizer(),
                                      job_id=job_id)
        self.book = cluster.graph.books[self.node_type]
        parts = range(cluster.num_partitions)
        self._stubs = [pb_grpc.NodeTensorServiceStub(cluster.channel(p)) for p in parts]
        self._pool = ThreadPoolExecutor(min(16, len(parts)), thread_name_prefix=f"tensor-{name}")
        request = pb.CreateNodeTensorRequest(spec=self.spec, client_id=cluster.client_id)
        infos = self.each_partition(lambda p: self._call(
            p, "CreateNodeTensor", lambda stub, timeout: stub.CreateNodeTensor(request, timeout=timeout)))
        self.spec = infos[0].spec  # with the server's defaults filled in
        #: Per partition: the incarnation of the tensor this handle counts on.
        self.incarnations = [info.incarnation for info in infos]
        #: Optimizer steps applied, as the servers said at creation.
        self.step = int(infos[0].step)
        #: Bytes of rows (and their node IDs) this handle read and sent, in all.
        self.bytes_read = self.bytes_sent = 0
        self._count = threading.Lock()

    @classmethod
    def find(cls, cluster: Cluster, name: str, **options: Any) -> RemoteNodeTensor:
        """The node tensor ``name`` that exists on the servers, as it was made
        (``options``: ``rpc_timeout``, ``reconnect``)."""
        spec = _found(cluster, name, options.get("rpc_timeout", 60.0))
        return cls(cluster, name, tuple(spec.dims), node_type=spec.node_type or None,
                   dtype=codec.dtype_to_torch(spec.dtype), init=spec.init, optimizer=spec.optimizer,
                   job_id=spec.job_id, **options)

    @property
    def shape(self) -> tuple[int, ...]:
        return (int(self.book[-1]), *self.dims)

    def global_ids(self, original: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Global IDs of original node IDs of the tensor's type."""
        ids = original.numpy() if isinstance(original, torch.Tensor) else np.asarray(original)
        return torch.from_numpy(self.cluster.global_ids(ids, self.node_type))

    def owners(self, nodes: torch.Tensor) -> list[torch.Tensor]:
        """Per partition, the positions in ``nodes`` (global IDs) of the nodes it owns."""
        ids = nodes.detach().cpu().numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.book[-1]):
            raise ValueError(f"nodes: expected global {self.node_type!r} IDs in [0, {int(self.book[-1])}), "
                             f"got values in [{int(ids.min())}, {int(ids.max())}]")
        part = np.searchsorted(self.book, ids, side="right") - 1
        order = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[order], np.arange(len(self.book)))
        return [torch.from_numpy(order[bounds[p]:bounds[p + 1]]) for p in range(len(self.book) - 1)]

    # -- rows ----------------------------------------------------------------------------
    def read(self, nodes: torch.Tensor, *, after_step: int = 0, device: torch.device | str | None = None
             ) -> torch.Tensor:
        """The rows of ``nodes`` (global IDs), once ``after_step`` optimizer steps are
        applied, on ``device`` (the CPU by default)."""
        nodes = nodes.reshape(-1).to("cpu", torch.int64)
        where = self.owners(nodes)
        out = torch.empty((nodes.numel(), *self.dims), dtype=self.dtype)

        def read_one(p: int) -> None:
            if where[p].numel():
                out[where[p]] = self._read(p, nodes[where[p]], after_step)

        self.each_partition(read_one)
        return out if device is None else out.to(device, non_blocking=True)

    def _read(self, p: int, nodes: torch.Tensor, after_step: int) -> torch.Tensor:
        request = pb.ReadRowsRequest(tensor=self.name, nodes=codec.encode_tensor(nodes.numpy()),
                                     after_step=after_step, incarnation=self.incarnations[p],
                                     client_id=self.cluster.client_id)

        def call(stub: pb_grpc.NodeTensorServiceStub, timeout: float) -> torch.Tensor:
            assembler = TensorAssembler()
            for chunk in stub.ReadRows(request, timeout=timeout):
                assembler.add_all(chunk.tensors)
            return assembler.finish_torch(expected={"rows"})["rows"]

        rows = self._call(p, "ReadRows", call)
        with self._count:
            self.bytes_read += rows.numel() * rows.element_size() + nodes.numel() * 8
        want = (nodes.numel(), *self.dims)
        if tuple(rows.shape) != want:
            address = self.cluster.addresses[p]
            raise GraphfeedError(f"ReadRows at {address}: rows: expected shape {list(want)}, got "
                                 f"{list(rows.shape)}", what="ReadRows", address=address)
        return rows

    def write(self, nodes: torch.Tensor, rows: torch.Tensor) -> None:
        """Set the rows of ``nodes`` (global IDs)."""
        nodes = nodes.reshape(-1).to(torch.int64).cpu()
        rows = rows.detach().to("cpu", self.dtype).contiguous()
        where = self.owners(nodes)
        self.each_partition(lambda p: self._upload(p, "WriteRows", pb.RowsHeader(tensor=self.name),
                                                   nodes[where[p]], rows[where[p]])
                            if where[p].numel() else None)

    def _upload(self, p: int, method: str, header: pb.RowsHeader, nodes: torch.Tensor,
                rows: torch.Tensor) -> Any:
        """WriteRows or PushGradients of ``nodes`` and ``rows`` to partition ``p``."""
        header = _copy(header)
        header.incarnation, header.client_id = self.incarnations[p], self.cluster.client_id
        with self._count:
            self.bytes_sent += nodes.numel() * 8 + rows.numel() * rows.element_size()

        def messages() -> Iterator[pb.RowsUpload]:
            named = {"nodes": nodes.contiguous(), "rows": rows.contiguous()}
            for i, group in enumerate(codec.split_tensors(named)):
                message = pb.RowsUpload(tensors=group)
                if i == 0:
                    message.header.CopyFrom(header)
                yield message

        return self._call(p, method, lambda stub, timeout: getattr(stub, method)(messages(), timeout=timeout))

    # -- calls ---------------------------------------------------------------------------
    def each_partition(self, fn: Callable[[int], T]) -> list[T]:
        """``fn(p)`` for every partition at once; the results in partition order."""
        return list(self._pool.map(fn, range(len(self._stubs))))

    def _call(self, p: int, method: str, call: Callable[[pb_grpc.NodeTensorServiceStub, float], T]) -> T:
        """``call(stub, timeout)`` on partition ``p``'s server (:func:`call_server`)."""
        return call_server(self.cluster, p, method, lambda stub: call(stub, self.rpc_timeout),
                           reconnect=self.reconnect, what=f"node tensor {self.name!r}")

    def drop(self, forget: bool = False) -> None:
        """Remove the tensor from every server (``forget``: its snapshots too)."""
        request = pb.DropNodeTensorRequest(name=self.name, client_id=self.cluster.client_id, forget=forget)
        self.each_partition(lambda p: self._call(
            p, "DropNodeTensor", lambda stub, timeout: stub.DropNodeTensor(request, timeout=timeout)))

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, node_type={self.node_type!r}, "
                f"shape={list(self.shape)}, dtype={self.dtype})")


def _copy(header: pb.RowsHeader) -> pb.RowsHeader:
    out = pb.RowsHeader()
    out.CopyFrom(header)
    return out


def call_server(cluster: Cluster, p: int, method: str, call: Callable[[pb_grpc.NodeTensorServiceStub], T], *,
                reconnect: float, what: str) -> T:
    """``call(stub)`` on partition ``p``'s server, made again while it does not answer
    (for ``reconnect`` seconds: node tensor calls are idempotent); its failure as a
    :class:`GraphfeedError`, one that names the server and what its loss costs ``what``
    when it stays away."""
    address = cluster.addresses[p]

    def attempt(_: float) -> T:
        try:
            return call(pb_grpc.NodeTensorServiceStub(cluster.channel(p)))
        except grpc.RpcError as err:
            raise error_from_rpc(err, method, address) from err

    def gone(f: Any) -> GraphfeedError:
        return ServerUnavailable(
            f"{method} at {address} (partition {p}) failed for {reconnect:g} s: {f.error}; {what}: the rows "
            "that server held since its last snapshot cannot be recovered if it lost them; --resume "
            "continues from the last checkpoint", what=method, address=address,
            code=grpc.StatusCode.UNAVAILABLE)

    return retry(attempt, backoff=Backoff(0.1, 2.0, 2.0), retryable=RETRIED, window=reconnect,
                 on_give_up=gone)


def snapshot_all(cluster: Cluster, job_id: str, step: int, *, pin: bool = False,
                 incarnations: Sequence[Mapping[str, str]] | None = None, timeout: float = 600.0,
                 reconnect: float = 15.0) -> list[pb.NodeTensorsReply]:
    """Every server writes ``job_id``'s node tensors at ``step`` beside its partition
    (``pin``: kept until another is pinned, as well as the two newest; ``incarnations``:
    per partition, the tensors' incarnations the caller counts on)."""
    def one(p: int) -> pb.NodeTensorsReply:
        request = pb.NodeTensorsAtStep(job_id=job_id, step=step, client_id=cluster.client_id, pin=pin,
                                       incarnations=dict(incarnations[p]) if incarnations else {})
        return call_server(cluster, p, "SnapshotNodeTensors",
                           lambda stub: stub.SnapshotNodeTensors(request, timeout=timeout),
                           reconnect=reconnect, what=f"job {job_id}")

    return _each_partition(cluster, one)


def restore_all(cluster: Cluster, job_id: str, step: int, *, timeout: float = 600.0,
                reconnect: float = 15.0) -> list[pb.NodeTensorsReply]:
    """Every server reloads ``job_id``'s node tensors from their snapshots at ``step``."""
    request = pb.NodeTensorsAtStep(job_id=job_id, step=step, client_id=cluster.client_id)
    return _each_partition(cluster, lambda p: call_server(
        cluster, p, "RestoreNodeTensors", lambda stub: stub.RestoreNodeTensors(request, timeout=timeout),
        reconnect=reconnect, what=f"job {job_id}"))


def _each_partition(cluster: Cluster, fn: Callable[[int], T]) -> list[T]:
    with ThreadPoolExecutor(min(16, cluster.num_partitions)) as pool:
        return list(pool.map(fn, range(cluster.num_partitions)))


def delivered_rows(cluster: Cluster, node_tensors: Mapping[str, TensorRef | Sequence[TensorRef]]
                   ) -> tuple[TensorRows, ...]:
    """What a loader's ``node_tensors`` (attribute to a tensor, or to one tensor per node
    type; a tensor or its name) asks every batch to carry, as the servers hold it now."""
    out: list[TensorRows] = []
    for attr, refs in node_tensors.items():
        if not attr.isidentifier() or attr in RESERVED_BATCH_ATTRIBUTES | {"edge_attr"}:
            raise ValueError(f"node_tensors: expected attribute names a batch does not use already, got "
                             f"{attr!r}")
        seen: set[str] = set()
        for ref in [refs] if isinstance(refs, str | RemoteNodeTensor) else list(refs):
            spec = ref.spec if isinstance(ref, RemoteNodeTensor) else _found(cluster, ref)
            node_type = spec.node_type or cluster.graph.target_type
            if node_type in seen:
                raise ValueError(f"node_tensors[{attr!r}]: expected one tensor per node type, got two of "
                                 f"{node_type!r}")
            seen.add(node_type)
            out.append(TensorRows(attr, spec.name, node_type, tuple(int(d) for d in spec.dims),
                                  codec.dtype_to_torch(spec.dtype)))
    return tuple(out)


def _found(cluster: Cluster, name: str, timeout: float = 60.0) -> pb.NodeTensorSpec:
    """The spec of the node tensor ``name`` on the servers (partition 0's)."""
    try:
        return pb_grpc.NodeTensorServiceStub(cluster.channel(0)).FindNodeTensor(
            pb.FindNodeTensorRequest(name=name, client_id=cluster.client_id), timeout=timeout).spec
    except grpc.RpcError as err:
        raise error_from_rpc(err, "FindNodeTensor", cluster.addresses[0]) from err
