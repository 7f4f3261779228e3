"""Learnable node embeddings held by the servers (DGL's ``DistEmbedding``), and the sparse
optimizers that update them there (``SparseAdagrad``, ``SparseAdam``).

A :class:`RemoteEmbedding` is a module whose forward returns the rows of a batch's nodes
(global IDs: the batch's ``internal_n_id``) as a tensor that takes gradients; backward
keeps each row's gradient, and the optimizer's :meth:`~SparseOptimizer.step` sends them
to the rows' owners, which apply the update to exactly the rows the step touched, as the
mean over the job's ranks (as DDP averages dense gradients). The next forward reads its
rows only once every rank's push of the step before has been applied, so training
through the servers equals training an ``nn.Embedding(sparse=True)`` with
``torch.optim.Adagrad`` / ``SparseAdam`` in one process on the union of the ranks'
batches. Rows start from :func:`protos.row_init.initial_rows` of the nodes' original IDs
(``nn.Embedding``'s normal init by default), the same whatever the partitioning.

Every rank must call the optimizer's ``step()`` every step (a rank whose batch touched
no row pushes an empty gradient): a step is applied once all ``world_size`` ranks have
pushed it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from protos import sampling_pb2 as pb
from trainer_client.cluster import Cluster
from trainer_client.node_tensors import RemoteNodeTensor, row_init


class RemoteEmbedding(torch.nn.Module):
    """A ``[num_nodes(node_type), dim]`` embedding on the servers of ``cluster``, named
    ``name`` there; created on the servers when an optimizer takes it (or at the first
    forward, as a table no optimizer may take any more). ``init``/``scale``/``seed``:
    the starting rows (:func:`~trainer_client.node_tensors.row_init`); ``job_id``: what
    the ranks of one job share (default: ``name``); ``rank``/``world_size``: this
    process's (default: torch.distributed's, else 0 of 1); ``device``: where the rows
    arrive."""

    def __init__(self, cluster: Cluster, name: str, dim: int, *, node_type: str | None = None,
                 init: str = "normal", scale: float = 1.0, seed: int = 0, job_id: str | None = None,
                 rank: int | None = None, world_size: int | None = None,
                 device: torch.device | str = "cpu", reconnect: float = 15.0) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"dim: expected an integer >= 1, got {dim}")
        self.cluster, self.name, self.dim = cluster, name, int(dim)
        self.node_type = node_type
        self.init = row_init(init, scale, seed)
        self.job_id = name if job_id is None else job_id
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if distributed else 0)
        self.world_size = world_size if world_size is not None else \
            (dist.get_world_size() if distributed else 1)
        self.device = torch.device(device)
        #: Seconds a server that does not answer is asked again before the call fails.
        self.reconnect = reconnect
        #: The table on the servers (None until created).
        self.table: RemoteNodeTensor | None = None
        #: Optimizer steps this rank has pushed (the next read waits for them).
        self.steps = 0
        self._grads: list[tuple[torch.Tensor, torch.Tensor]] = []

    def create(self, optimizer: pb.SparseOptimizer | None = None) -> RemoteNodeTensor:
        """The table on the servers, created (or found) with ``optimizer``."""
        if self.table is None:
            self.table = RemoteNodeTensor(self.cluster, self.name, (self.dim,), node_type=self.node_type,
                                          init=self.init, optimizer=optimizer, job_id=self.job_id,
                                          reconnect=self.reconnect)
            self.steps = self.table.step
        elif optimizer is not None and self.table.spec.optimizer.kind == pb.SparseOptimizer.OPTIMIZER_NONE:
            raise ValueError(f"RemoteEmbedding {self.name!r}: its table was created without an optimizer (a "
                             "forward ran before one took it); create the optimizer first")
        return self.table

    def refresh(self) -> None:
        """Count on the servers' tables as they are now (after a restore): their
        incarnations and step."""
        if self.table is not None:
            spec = self.table.spec
            self.table.close()
            self.table = None
            self.create(spec.optimizer)

    def forward(self, nodes: torch.Tensor) -> torch.Tensor:
        """The rows of ``nodes`` (global IDs of the node type), on :attr:`device`,
        taking gradients in training."""
        table = self.create()
        anchor = torch.empty(0, requires_grad=self.training and torch.is_grad_enabled())
        out: torch.Tensor = _Rows.apply(anchor, self, table, nodes)
        return out

    def take_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct nodes the step touched and each one's gradient summed over the
        step's forwards, cleared for the next step."""
        grads, self._grads = self._grads, []
        if not grads:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, self.dim)
        nodes, inverse = torch.unique(torch.cat([n for n, _ in grads]), return_inverse=True)
        total = torch.zeros(nodes.numel(), self.dim).index_add_(0, inverse, torch.cat([g for _, g in grads]))
        return nodes, total

    def push(self) -> None:
        """Push this step's gradient rows to their owners (every server gets this rank's
        push, empty where the step touched none of its rows) and count the step."""
        table = self.create()
        nodes, grads = self.take_gradients()
        where = table.owners(nodes)
        header = pb.RowsHeader(tensor=self.name, job_id=self.job_id, step=self.steps + 1, rank=self.rank,
                               world_size=self.world_size)
        table.each_partition(lambda p: table._upload(p, "PushGradients", header,
                                                     nodes[where[p]], grads[where[p]]))
        self.steps += 1

    def extra_repr(self) -> str:
        return f"{self.name!r}, dim={self.dim}, node_type={self.node_type!r}, job_id={self.job_id!r}"


class _Rows(torch.autograd.Function):
    """Reads a batch's rows; backward keeps their gradient on the embedding."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, emb: RemoteEmbedding, table: RemoteNodeTensor,
                nodes: torch.Tensor) -> torch.Tensor:
        ctx.emb, ctx.nodes = emb, nodes.detach().reshape(-1).to("cpu", torch.int64)
        return table.read(ctx.nodes, after_step=emb.steps, device=emb.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.emb._grads.append((ctx.nodes, grad.detach().to("cpu", torch.float32)))
        return None, None, None, None


class SparseOptimizer:
    """A sparse optimizer of :class:`RemoteEmbedding` tables, applied on the servers
    (``spec``: what it asks them to keep); ``step()`` pushes each table's gradient rows
    of this step, ``zero_grad()`` drops them."""

    def __init__(self, params: Iterable[RemoteEmbedding], spec: pb.SparseOptimizer) -> None:
        self.embeddings = list(params)
        if not self.embeddings or not all(isinstance(e, RemoteEmbedding) for e in self.embeddings):
            raise TypeError(f"params: expected RemoteEmbedding modules, got "
                            f"{[type(e).__name__ for e in self.embeddings] or 'none'}")
        self.spec = spec
        for emb in self.embeddings:
            emb.create(spec)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for emb in self.embeddings:
            emb._grads.clear()

    def step(self) -> None:
        """Push every table's gradient rows of this step to their owners."""
        for emb in self.embeddings:
            emb.push()

    def state_dict(self) -> dict[str, Any]:
        """The steps each table has taken (the tables and their optimizer state are on the
        servers: snapshot them with :func:`~trainer_client.node_tensors.snapshot_all`)."""
        return {"steps": {emb.name: emb.steps for emb in self.embeddings}}


class SparseAdagrad(SparseOptimizer):
    """``torch.optim.Adagrad`` for :class:`RemoteEmbedding` tables, applied on the servers."""

    def __init__(self, params: Iterable[RemoteEmbedding], lr: float = 0.01, lr_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> None:
        super().__init__(params, pb.SparseOptimizer(kind=pb.SparseOptimizer.ADAGRAD, lr=lr, lr_decay=lr_decay,
                                                    initial_accumulator_value=initial_accumulator_value,
                                                    eps=eps))


class SparseAdam(SparseOptimizer):
    """``torch.optim.SparseAdam`` for :class:`RemoteEmbedding` tables, applied on the servers."""

    def __init__(self, params: Iterable[RemoteEmbedding], lr: float = 0.001,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        super().__init__(params, pb.SparseOptimizer(kind=pb.SparseOptimizer.ADAM, lr=lr, beta1=betas[0],
                                                    beta2=betas[1], eps=eps))
