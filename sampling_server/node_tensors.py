"""Node tensors on a server: model state that grows with the graph (learnable embeddings
of featureless node types, layer outputs), held as the graph is, each server the rows of
the nodes its partition owns (DGL's ``DistTensor`` / ``DistEmbedding``).

A :class:`NodeTensor` is a table ``[num_owned_nodes(type), *dims]`` addressed by global
node ID (row ``id - first``), started from :func:`protos.row_init.initial_rows` of the
nodes' original IDs. A trainable one has a sparse optimizer (:mod:`.sparse_optim`):
every rank of its job pushes each step's gradient rows (:meth:`NodeTensors.push`), the
step is applied once all ``world_size`` ranks have pushed it, as the mean of their
gradients (as DDP averages dense gradients), to exactly the rows they touched; a read
names the steps it must see applied (:meth:`NodeTensors.read` waits for them, bounded by
the call's deadline), so nothing is stale. A push of a (step, rank) already counted adds
nothing. Snapshots (:mod:`.tensor_snapshots`) keep the tables and their optimizer state
beside the partition; a restarted server reloads a tensor's last one when the tensor is
first asked for, under a new incarnation, so a trainer that counted on the rows updated
since is told they are gone.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch

from protos import codec
from protos import sampling_pb2 as pb
from protos.row_init import BLOCK_ROWS, initial_rows
from sampling_server import sparse_optim
from sampling_server.errors import RequestError
from sampling_server.store import PartitionStore
from sampling_server.tensor_snapshots import (
    SnapshotFiles,
    read_snapshot,
    snapshot_job,
    snapshots,
    tensor_dir_name,
    write_snapshot,
)

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9._/-]{1,200}$")
_DTYPES = (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16, pb.FLOAT64, pb.INT32, pb.INT64)
_FAILED = grpc.StatusCode.FAILED_PRECONDITION
#: Steps a tensor may hold pushed and not yet applied (ranks a step or more ahead).
MAX_PENDING_STEPS = 8
#: Most values in one node tensor (a row's values times the rows of the whole graph).
MAX_VALUES = 1 << 40


@dataclass(eq=False)
class NodeTensor:
    """One node tensor as this server holds it."""

    spec: pb.NodeTensorSpec
    #: The node type, resolved, and the first global ID of its rows here.
    node_type: str
    first: int
    rows: torch.Tensor
    #: The optimizer's per-row state, by name (empty when not trainable).
    state: dict[str, torch.Tensor]
    #: Optimizer steps applied.
    step: int = 0
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    #: Pushed, not yet applied: step to rank to (local rows, gradient rows), and each
    #: step's world size.
    pending: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    world: dict[int, int] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def trainable(self) -> bool:
        return self.spec.optimizer.kind != pb.SparseOptimizer.OPTIMIZER_NONE

    @property
    def row_bytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def info(self, created: bool = False) -> pb.NodeTensorInfo:
        return pb.NodeTensorInfo(spec=self.spec, num_rows=self.rows.shape[0], step=self.step,
                                 row_bytes=self.row_bytes, state_bytes=self.state_bytes,
                                 incarnation=self.incarnation, created=created)


class NodeTensors:
    """The node tensors of one server (see the module doc)."""

    def __init__(self, store: PartitionStore, state_dir: Path, memory_limit: int) -> None:
        self.store = store
        #: Where snapshots are written (``--state-dir``).
        self.state_dir = state_dir
        #: Bytes all node tensors and their optimizer state may take (``--node-tensor-memory``).
        self.memory_limit = memory_limit
        self._tensors: dict[str, NodeTensor] = {}
        self._lock = threading.Lock()
        self._loading = threading.Lock()  # one snapshot read at a time
        #: Called with (tensor, rows) per read and per push, and per step applied.
        self.on_read: Callable[[str, int], None] | None = None
        self.on_push: Callable[[str, int], None] | None = None

    # -- creation ------------------------------------------------------------------------
    def create(self, spec: pb.NodeTensorSpec) -> tuple[NodeTensor, bool]:
        """The tensor ``spec`` names, made here unless one of the same spec exists;
        another spec under the name is ALREADY_EXISTS naming both."""
        spec = self._checked(spec)
        self._held(spec.name)  # a snapshot of it is loaded first
        with self._lock:
            found = self._tensors.get(spec.name)
            if found is not None:
                if found.spec != spec:
                    raise RequestError(
                        f"CreateNodeTensorRequest.spec: a node tensor {spec.name!r} exists here with "
                        f"another spec: expected {_describe(found.spec)} (the existing one), got "
                        f"{_describe(spec)}; drop it first or use another name",
                        grpc.StatusCode.ALREADY_EXISTS)
                return found, False
            node_type = self.store.node_type_of(spec.node_type, "NodeTensorSpec.node_type")
            start, stop = self.store.type_range(node_type)
            shape = (stop - start, *spec.dims)
            self._check_memory(spec, shape)
            rows = self._initial_table(spec, node_type, start, shape)
            tensor = NodeTensor(spec, node_type, start, rows, sparse_optim.new_state(spec.optimizer, shape))
            self._tensors[spec.name] = tensor
        log.info("node tensor %r created: %s rows of %s %s, %s", spec.name, shape[0], list(spec.dims),
                 pb.DType.Name(spec.dtype), "trainable" if tensor.trainable else "not trainable")
        return tensor, True

    def _initial_table(self, spec: pb.NodeTensorSpec, node_type: str, start: int,
                       shape: tuple[int, ...]) -> torch.Tensor:
        """The rows ``spec.init`` starts this server's nodes with, made a block at a time:
        drawn (:func:`initial_rows`), or the nodes' in-degrees (``IN_DEGREE``)."""
        rows = torch.empty(shape, dtype=codec.dtype_to_torch(spec.dtype))
        for first in range(0, shape[0], BLOCK_ROWS):
            ids = np.arange(start + first, start + min(shape[0], first + BLOCK_ROWS), dtype=np.int64)
            if spec.init.kind == pb.RowInit.IN_DEGREE:
                block = self._in_degrees(node_type, first, ids).reshape(ids.size, *spec.dims)
            else:
                block = initial_rows(spec.init, self.store.original_ids_of(ids, node_type), tuple(spec.dims),
                                     np.float64)
            rows[first:first + ids.size] = torch.from_numpy(block)
        return rows

    def _in_degrees(self, node_type: str, first: int, ids: np.ndarray) -> np.ndarray:
        """The in-degrees of the owned nodes ``ids`` (local rows from ``first``): their
        in-edges of every edge type ending at ``node_type``, self-loops not counted."""
        part = self.store.partition
        degrees = np.zeros(ids.size, dtype=np.int64)
        for et in part.edge_types:
            if et[2] != node_type:
                continue
            indptr = np.asarray(part.indptr[et][first:first + ids.size + 1], dtype=np.int64)
            counts = np.diff(indptr)
            degrees += counts
            if et[0] == node_type:  # self-loops: a source equal to its target
                sources = np.asarray(part.indices[et][indptr[0]:indptr[-1]])
                loops = sources == np.repeat(ids, counts)
                degrees -= np.bincount(np.repeat(np.arange(ids.size), counts)[loops], minlength=ids.size)
        return degrees

    def _checked(self, spec: pb.NodeTensorSpec) -> pb.NodeTensorSpec:
        if not _NAME.match(spec.name):
            raise RequestError(f"NodeTensorSpec.name: expected 1 .. 200 letters, digits and ._-/, got "
                               f"{spec.name[:100]!r}")
        if any(d < 1 for d in spec.dims) or len(spec.dims) > 8:
            raise RequestError(f"NodeTensorSpec.dims: expected at most 8 sizes >= 1, got {list(spec.dims)}")
        if spec.dtype not in _DTYPES:
            raise RequestError(f"NodeTensorSpec.dtype: expected one of "
                               f"{[pb.DType.Name(d) for d in _DTYPES]}, got {spec.dtype}")
        scale, kind = spec.init.scale, spec.init.kind
        if kind in (pb.RowInit.UNIFORM, pb.RowInit.NORMAL) and not (math.isfinite(scale) and scale > 0):
            raise RequestError(f"NodeTensorSpec.init.scale: expected a finite value > 0, got {scale}")
        if kind not in pb.RowInit.Kind.values():
            raise RequestError(f"NodeTensorSpec.init.kind: expected ZEROS, UNIFORM, NORMAL or IN_DEGREE, got "
                               f"{kind}")
        if kind == pb.RowInit.IN_DEGREE and math.prod(spec.dims) != 1:
            raise RequestError(f"NodeTensorSpec.dims: expected one value per node with IN_DEGREE ([] or "
                               f"[1]), got {list(spec.dims)}")
        out = pb.NodeTensorSpec()
        out.CopyFrom(spec)
        out.optimizer.CopyFrom(sparse_optim.with_defaults(spec.optimizer))
        try:
            sparse_optim.check_optimizer(out.optimizer, "NodeTensorSpec.optimizer")
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        if out.optimizer.kind != pb.SparseOptimizer.OPTIMIZER_NONE and spec.dtype != pb.FLOAT32:
            raise RequestError(f"NodeTensorSpec.dtype: expected FLOAT32 for a trainable tensor, got "
                               f"{pb.DType.Name(spec.dtype)}")
        return out

    def _check_memory(self, spec: pb.NodeTensorSpec, shape: tuple[int, ...]) -> None:
        values = math.prod(shape)
        if values > MAX_VALUES:
            raise RequestError(f"NodeTensorSpec.dims: expected at most {MAX_VALUES} values in all, got "
                               f"{values}", grpc.StatusCode.RESOURCE_EXHAUSTED)
        itemsize = codec.dtype_to_numpy(spec.dtype).itemsize
        wanted = values * (itemsize + 4 * len(sparse_optim.STATE_NAMES[spec.optimizer.kind]))
        held = sum(t.row_bytes + t.state_bytes for t in self._tensors.values())
        if held + wanted > self.memory_limit:
            raise RequestError(
                f"CreateNodeTensorRequest.spec: node tensor {spec.name!r} needs {_mib(wanted)} here (its "
                f"rows and optimizer state), and the node tensors held take {_mib(held)}; expected at "
                f"most {_mib(self.memory_limit)} in all (server limit --node-tensor-memory)",
                grpc.StatusCode.RESOURCE_EXHAUSTED)

    def get(self, name: str, incarnation: str, field: str) -> NodeTensor:
        """The tensor named ``name``; refused when the caller counts on another
        incarnation (the rows it counted on are gone)."""
        tensor = self._held(name)
        if tensor is None:
            raise RequestError(f"{field}: expected the name of a node tensor on this server "
                               f"({sorted(self._tensors)[:20]}), got {name[:100]!r}",
                               grpc.StatusCode.NOT_FOUND)
        self._check_incarnation(tensor, incarnation, field)
        return tensor

    def _check_incarnation(self, tensor: NodeTensor, incarnation: str, field: str) -> None:
        """Refuse a caller that counts on another incarnation of ``tensor`` (empty: any)."""
        if incarnation and incarnation != tensor.incarnation:
            raise RequestError(
                f"{field}: node tensor {tensor.spec.name!r} on partition {self.store.partition_id} is not "
                f"the one the caller used (incarnation {incarnation}, now {tensor.incarnation}, at step "
                f"{tensor.step}): the server restarted and reloaded its last snapshot, or it was "
                "restored, so the rows updated since are lost; resume the job from its last "
                "checkpoint (--resume)", _FAILED)

    def _held(self, name: str) -> NodeTensor | None:
        """The tensor ``name`` in memory, else its last snapshot loaded (a server started
        again loads a tensor's snapshot when it is first asked for), else None."""
        with self._lock:
            tensor = self._tensors.get(name)
        if tensor is not None:
            return tensor
        steps = self._files(name).steps()
        if not steps:
            return None
        with self._loading:
            with self._lock:
                if name in self._tensors:
                    return self._tensors[name]
            spec, rows, state = self._read(name, steps[-1])
            tensor = self._install(spec, rows, state, steps[-1])
        log.info("node tensor %r reloaded from its snapshot at step %d (%d rows)", name, steps[-1],
                 tensor.rows.shape[0])
        return tensor

    def drop(self, name: str, forget: bool = False) -> bool:
        """Remove the tensor from memory (``forget``: its snapshots too); whether there
        was one."""
        with self._lock:
            tensor = self._tensors.pop(name, None)
        if tensor is not None:
            with tensor.cond:
                tensor.cond.notify_all()
        files = self._files(name)
        if forget and files.root.is_dir():
            shutil.rmtree(files.root, ignore_errors=True)
            return True
        return tensor is not None

    def tensors(self) -> list[NodeTensor]:
        with self._lock:
            return list(self._tensors.values())

    # -- rows ----------------------------------------------------------------------------
    def local_rows(self, tensor: NodeTensor, nodes: np.ndarray, field: str) -> torch.Tensor:
        """The rows of ``nodes`` (global IDs of the tensor's type owned here)."""
        self.store.check_owned(nodes, field, tensor.node_type)
        return torch.from_numpy(nodes - tensor.first)

    def read(self, tensor: NodeTensor, nodes: np.ndarray, after_step: int,
             timeout: float | None) -> torch.Tensor:
        """The rows of ``nodes`` once ``after_step`` steps are applied (waiting at most
        ``timeout`` seconds: DEADLINE_EXCEEDED naming the step after that)."""
        index = self.local_rows(tensor, nodes, "ReadRowsRequest.nodes")
        with tensor.cond:
            self._wait_step(tensor, after_step, timeout, "ReadRowsRequest.after_step")
            out = tensor.rows.index_select(0, index)
        if self.on_read is not None:
            self.on_read(tensor.spec.name, int(nodes.size))
        return out

    def write(self, tensor: NodeTensor, nodes: np.ndarray, rows: torch.Tensor) -> None:
        index = self.local_rows(tensor, nodes, "RowsUpload.nodes")
        _check_rows(tensor, rows, nodes.size, "RowsUpload.rows")
        with tensor.cond:
            tensor.rows.index_copy_(0, index, rows.to(tensor.rows.dtype))

    def _wait_step(self, tensor: NodeTensor, step: int, timeout: float | None, field: str) -> None:
        if step < 0:
            raise RequestError(f"{field}: expected a step >= 0, got {step}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while tensor.step < step:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise RequestError(
                    f"{field}: node tensor {tensor.spec.name!r} reached step {tensor.step} on partition "
                    f"{self.store.partition_id}, not {step}, within the call's deadline: a rank of the "
                    "job has not pushed its gradients", grpc.StatusCode.DEADLINE_EXCEEDED)
            tensor.cond.wait(remaining if remaining is None else min(remaining, 1.0))

    # -- gradients -----------------------------------------------------------------------
    def push(self, tensor: NodeTensor, header: pb.RowsHeader, nodes: np.ndarray,
             grads: torch.Tensor) -> tuple[int, bool]:
        """Count one rank's gradient rows of one step; apply every step all ranks have
        pushed. The applied step count, and whether this (step, rank) was counted before."""
        self._check_push(tensor, header)
        index = self.local_rows(tensor, nodes, "RowsUpload.nodes")
        _check_rows(tensor, grads, nodes.size, "RowsUpload.rows")
        grads = grads.to(torch.float32)
        if not bool(torch.isfinite(grads).all()):
            raise RequestError(f"RowsUpload.rows: expected finite gradients, got "
                               f"{int((~torch.isfinite(grads)).sum())} NaN or infinite values")
        with tensor.cond:
            step = header.step
            if step <= tensor.step or header.rank in tensor.pending.get(step, {}):
                return tensor.step, True
            if step > tensor.step + MAX_PENDING_STEPS:
                raise RequestError(f"RowsHeader.step: expected at most {tensor.step + MAX_PENDING_STEPS} "
                                   f"(the steps applied, {tensor.step}, plus {MAX_PENDING_STEPS}), got "
                                   f"{step}", _FAILED)
            known = tensor.world.setdefault(step, header.world_size)
            if known != header.world_size:
                raise RequestError(f"RowsHeader.world_size: expected {known} (what the step's other ranks "
                                   f"pushed with), got {header.world_size}")
            tensor.pending.setdefault(step, {})[header.rank] = (index, grads)
            self._apply_ready(tensor)
            applied = tensor.step
        if self.on_push is not None:
            self.on_push(tensor.spec.name, int(nodes.size))
        return applied, False

    def _check_push(self, tensor: NodeTensor, header: pb.RowsHeader) -> None:
        if not tensor.trainable:
            raise RequestError(f"RowsHeader.tensor: expected a trainable node tensor (one with an "
                               f"optimizer), got {tensor.spec.name!r}", _FAILED)
        if header.job_id != tensor.spec.job_id:
            raise RequestError(f"RowsHeader.job_id: expected {tensor.spec.job_id!r} (the job training "
                               f"{tensor.spec.name!r}), got {header.job_id[:100]!r}", _FAILED)
        if not 1 <= header.world_size <= 1 << 16 or not 0 <= header.rank < header.world_size:
            raise RequestError(f"RowsHeader.rank: expected 0 <= rank < world_size <= 65536, got rank "
                               f"{header.rank} of {header.world_size}")
        if header.step < 1:
            raise RequestError(f"RowsHeader.step: expected a step >= 1, got {header.step}")

    def _apply_ready(self, tensor: NodeTensor) -> None:
        """Apply, in order, every next step whose ranks have all pushed (under the lock)."""
        while True:
            step = tensor.step + 1
            pushes = tensor.pending.get(step, {})
            if len(pushes) < tensor.world.get(step, 1 << 30):
                return
            index = torch.cat([pushes[r][0] for r in sorted(pushes)])
            grads = torch.cat([pushes[r][1] for r in sorted(pushes)])
            unique, inverse = torch.unique(index, return_inverse=True)
            total = torch.zeros((unique.numel(), *grads.shape[1:]), dtype=torch.float32)
            total.index_add_(0, inverse, grads)
            total.div_(len(pushes))
            sparse_optim.apply(tensor.spec.optimizer, tensor.rows, tensor.state, step, unique, total)
            tensor.step = step
            del tensor.pending[step], tensor.world[step]
            tensor.cond.notify_all()

    # -- snapshots -----------------------------------------------------------------------
    def snapshot(self, job_id: str, step: int, timeout: float | None, pin: bool = False,
                 incarnations: Mapping[str, str] | None = None) -> list[NodeTensor]:
        """Write the job's tensors at ``step`` beside the partition (waiting, bounded, for
        the step to be applied); ``pin``: keep it until another is pinned;
        ``incarnations``: what the caller counts on, per tensor name."""
        tensors = self._of_job(job_id, "NodeTensorsAtStep.job_id")
        for tensor in tensors:
            self._check_incarnation(tensor, (incarnations or {}).get(tensor.spec.name, ""),
                                    "NodeTensorsAtStep.incarnations")
        for tensor in tensors:
            with tensor.cond:
                self._wait_step(tensor, step, timeout, "NodeTensorsAtStep.step")
                if tensor.step != step:
                    raise RequestError(f"NodeTensorsAtStep.step: node tensor {tensor.spec.name!r} is at "
                                       f"step {tensor.step} here, past {step}", _FAILED)
                write_snapshot(self._files(tensor.spec.name), tensor.spec, step, tensor.rows, tensor.state,
                               self._identity(), pin)
        return tensors

    def restore(self, job_id: str, step: int) -> list[NodeTensor]:
        """Reload the job's tensors from their snapshots at ``step`` (new incarnations)."""
        if not job_id:
            raise RequestError("NodeTensorsAtStep.job_id: expected the job's ID, got an empty one")
        names = [name for name, steps in snapshots(self.state_dir).items()
                 if step in steps and snapshot_job(self._files(name), step) == job_id]
        missing = [t.spec.name for t in self._of_job(job_id, "NodeTensorsAtStep.job_id")
                   if t.spec.name not in names]
        if missing or not names:
            raise RequestError(f"NodeTensorsAtStep.step: no snapshot at step {step} of job "
                               f"{job_id[:100]!r}'s node tensors {missing or ''} on partition "
                               f"{self.store.partition_id} under {self.state_dir} (--state-dir)", _FAILED)
        loaded = []
        for name in names:
            spec, rows, state = self._read(name, step)
            loaded.append(self._install(spec, rows, state, step))
        return loaded

    def _read(self, name: str, step: int) -> tuple[pb.NodeTensorSpec, torch.Tensor, dict[str, torch.Tensor]]:
        try:
            return read_snapshot(self._files(name), step, self._identity())
        except (OSError, ValueError) as exc:
            raise RequestError(f"NodeTensorsAtStep.step: no usable snapshot of node tensor {name!r} at step "
                               f"{step} on partition {self.store.partition_id} under {self.state_dir} "
                               f"(--state-dir): {exc}", _FAILED) from None

    def _install(self, spec: pb.NodeTensorSpec, rows: torch.Tensor, state: dict[str, torch.Tensor],
                 step: int) -> NodeTensor:
        node_type = self.store.node_type_of(spec.node_type, "NodeTensorSpec.node_type")
        start, stop = self.store.type_range(node_type)
        if rows.shape[0] != stop - start:
            raise RequestError(f"snapshot of {spec.name!r}: expected {stop - start} rows (this partition's "
                               f"{node_type!r} nodes), got {rows.shape[0]}", _FAILED)
        tensor = NodeTensor(spec, node_type, start, rows, state, step=step)
        with self._lock:
            old = self._tensors.get(spec.name)
            self._tensors[spec.name] = tensor
        if old is not None:
            with old.cond:
                old.cond.notify_all()
        return tensor

    def _of_job(self, job_id: str, field: str) -> list[NodeTensor]:
        if not job_id:
            raise RequestError(f"{field}: expected the job's ID, got an empty one")
        return [t for t in self.tensors() if t.spec.job_id == job_id]

    def _files(self, name: str) -> SnapshotFiles:
        return SnapshotFiles(self.state_dir / tensor_dir_name(name))

    def _identity(self) -> dict[str, object]:
        return {"graph_fingerprint": self.store.graph_fingerprint, "partition": self.store.partition_id}


def _check_rows(tensor: NodeTensor, rows: torch.Tensor, count: int, field: str) -> None:
    want = (count, *tensor.spec.dims)
    if tuple(rows.shape) != want:
        raise RequestError(f"{field}: expected shape {list(want)} (one row of {list(tensor.spec.dims)} per "
                           f"node), got {list(rows.shape)}")


def _describe(spec: pb.NodeTensorSpec) -> str:
    opt = pb.SparseOptimizer.Kind.Name(spec.optimizer.kind)
    return (f"[{spec.node_type or 'nodes'}, {', '.join(map(str, spec.dims))}] "
            f"{pb.DType.Name(spec.dtype)} optimizer {opt} job {spec.job_id!r}")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
