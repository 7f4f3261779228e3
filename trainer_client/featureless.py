"""The inputs of node types without features (ogbn-mag's authors, institutions and fields
of study; every node of a plain graph without features): a learnable embedding per type,
indexed by the batch's node IDs.

* **Dense** (the default): an ``nn.Embedding`` in the model, replicated on every rank
  and all-reduced whole by DDP every step; cheap while the table is small.
* **On the servers** (``--sparse-embedding``, :class:`ServerEmbeddings`): a
  :class:`~trainer_client.embeddings.RemoteEmbedding` per type, partitioned like the nodes,
  read for each batch's nodes (by their internal IDs, which the loaders then keep) and
  updated on the servers by a sparse optimizer from the rows each step touched. The run's
  tables are named ``emb/<job>/<type>``; the job's ID is drawn at a fresh start and kept
  in the checkpoints, so ``--resume`` finds them again. Checkpoints snapshot them on the
  servers (the best epoch's snapshot pinned), ``--resume`` and the final selection of the
  best epoch restore them, and a finished run drops them from the servers' memory.

A plain model on a graph without features is wrapped in :class:`EmbeddingInput`: the
batch gives its node IDs where it would give features (:func:`node_ids`), and the
embedding's rows of them are the model's input.
"""

from __future__ import annotations

import argparse
import logging
import math
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from protos import sampling_pb2 as pb
from trainer_client.cluster import Cluster
from trainer_client.ddp import CHECKPOINT_NAME, DistEnv
from trainer_client.embeddings import RemoteEmbedding, SparseOptimizer
from trainer_client.graph import TypedGraph
from trainer_client.node_tensors import restore_all, snapshot_all

log = logging.getLogger(__name__)

#: ``--sparse-optimizer`` choices and what each asks the servers for.
SPARSE_OPTIMIZERS = {"adagrad": pb.SparseOptimizer.ADAGRAD, "adam": pb.SparseOptimizer.ADAM}


def node_ids(store: Any) -> Tensor:
    """The IDs a batch's embeddings are indexed by: graphfeed's internal ones where the
    loader keeps them (server-held tables are addressed by them), else ``n_id``."""
    ids: Tensor = store.internal_n_id if "internal_n_id" in store else store.n_id
    return ids


def featureless_types(graph: TypedGraph) -> list[str]:
    """The node types without features."""
    return [t for t in graph.node_types if graph.feature_dims.get(t, 0) <= 0]


def dense_embedding(num_nodes: int, dim: int) -> nn.Embedding:
    """A dense embedding of ``num_nodes`` rows, Glorot-uniform as the typed models' are."""
    emb = nn.Embedding(num_nodes, dim)
    nn.init.xavier_uniform_(emb.weight)
    return emb


def featureless_rows(module: nn.Module, given: Tensor) -> Tensor:
    """The input rows a featureless type's ``module`` gives: of node IDs (an integer
    tensor), or, where a loader delivered the server-held table's rows of them with the
    batch (a float tensor), those rows through what follows the table in ``module`` (the
    projection of :meth:`ServerEmbeddings.module`)."""
    if not given.is_floating_point():
        out: Tensor = module(given)
        return out
    if isinstance(module, RemoteEmbedding):
        return given
    if isinstance(module, nn.Sequential) and isinstance(module[0], RemoteEmbedding):
        projected: Tensor = module[1:](given)
        return projected
    raise ValueError(f"a featureless type's input: expected node IDs for {type(module).__name__} (rows are "
                     "delivered only for server-held tables), got float rows")


def server_tables(model: nn.Module) -> dict[str | None, RemoteEmbedding]:
    """The server-held embeddings in ``model``, by node type (None: a plain graph's)."""
    return {m.node_type: m for m in model.modules() if isinstance(m, RemoteEmbedding)}


class EmbeddingInput(nn.Module):
    """A plain model on a graph without features: its input rows are ``embedding``'s rows
    of the batch's node IDs, passed where the model takes ``x``."""

    def __init__(self, embedding: nn.Module, model: nn.Module) -> None:
        super().__init__()
        self.embedding, self.model = embedding, model

    def forward(self, ids: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        out: Tensor = self.model(self.embedding(ids), *args, **kwargs)
        return out

    @property
    def num_layers(self) -> int:
        return int(getattr(self.model, "num_layers"))  # noqa: B009 - a module attribute mypy cannot see

    @property
    def layerwise_inputs(self) -> frozenset[str]:
        return frozenset(getattr(self.model, "layerwise_inputs", ()))

    def inference_per_layer(self, layer: int, x: Tensor, edge_index: Tensor, batch_size: int,
                            **inputs: Tensor) -> Tensor:
        """The model's layer ``layer``; layer 0's ``x``: node IDs, or the server-held
        table's rows of them (:func:`featureless_rows`)."""
        rows = featureless_rows(self.embedding, x) if layer == 0 else x
        step = getattr(self.model, "inference_per_layer")  # noqa: B009 - see num_layers
        out: Tensor = step(layer, rows, edge_index, batch_size, **inputs)
        return out


def plain_embedding(graph: TypedGraph, width: int, embeddings: Callable[[str, int], nn.Module] | None
                    ) -> nn.Module:
    """The embedding of a plain graph without features, ``width`` wide: ``embeddings``'
    module where given, else a dense one."""
    t = graph.node_types[0]
    return embeddings(t, width) if embeddings is not None else dense_embedding(graph.num_nodes[t], width)


def input_width(args: argparse.Namespace) -> int:
    """The width of a featureless type's embedding (``--embedding-dim``, else ``--hidden``)."""
    return int(getattr(args, "embedding_dim", None) or args.hidden)


class ServerEmbeddings:
    """The server-held embeddings of a run (see the module doc): made per featureless
    type as the model asks for them (:meth:`module`), updated by one sparse optimizer
    (:meth:`start`, then :meth:`step` after every optimizer step)."""

    def __init__(self, args: argparse.Namespace, env: DistEnv, cluster: Cluster, graph: TypedGraph) -> None:
        self.args, self.env, self.cluster, self.graph = args, env, cluster, graph
        self.dim = input_width(args)
        #: The job's ID: from the checkpoint when resuming, else drawn (the same on every rank).
        self.job_id = _resumed_job(args) or shared_token(env)
        self.tables: dict[str, RemoteEmbedding] = {}
        self.optimizer: SparseOptimizer | None = None
        self._spec = pb.SparseOptimizer(kind=SPARSE_OPTIMIZERS[args.sparse_optimizer], lr=args.sparse_lr)

    def module(self, node_type: str, width: int) -> nn.Module:
        """The input module of ``node_type``: its table, projected to ``width`` channels
        when ``--embedding-dim`` differs."""
        if node_type not in self.tables:
            n = self.graph.num_nodes[node_type]
            self.tables[node_type] = RemoteEmbedding(
                self.cluster, f"emb/{self.job_id}/{node_type}", self.dim, node_type=node_type,
                init="uniform", scale=math.sqrt(6.0 / (n + self.dim)), seed=self.args.seed,
                job_id=self.job_id, rank=self.env.rank, world_size=self.env.world_size,
                device=self.env.device, reconnect=self.args.reconnect_timeout)
        table = self.tables[node_type]
        return table if width == self.dim else nn.Sequential(table, nn.Linear(self.dim, width))

    def start(self) -> None:
        """Create the tables on the servers with their optimizer (once the model asked for
        them all)."""
        if self.optimizer is None and self.tables:
            self.optimizer = SparseOptimizer(list(self.tables.values()), self._spec)
            log.info("server-held embeddings (job %s): %s, %d wide, %s lr %g", self.job_id,
                     {t: self.graph.num_nodes[t] for t in self.tables}, self.dim, self.args.sparse_optimizer,
                     self.args.sparse_lr)

    def step(self) -> None:
        """Push this step's gradient rows (every rank, every step)."""
        if self.optimizer is not None:
            self.optimizer.step()

    @property
    def steps(self) -> int:
        return next(iter(self.tables.values())).steps if self.tables else 0

    def state_dict(self, selected: bool = False) -> dict[str, Any]:
        """Snapshot the tables on the servers at this step (rank 0; ``selected``: pinned,
        the best epoch so far); what the checkpoint records of them."""
        if not self.tables:
            return {}
        if self.env.rank == 0:
            counted = [{t.name: t.table.incarnations[p] for t in self.tables.values() if t.table is not None}
                       for p in range(self.cluster.num_partitions)]
            snapshot_all(self.cluster, self.job_id, self.steps, pin=selected, incarnations=counted,
                         reconnect=self.args.reconnect_timeout)
        return {"node_tensors": {"job_id": self.job_id, "step": self.steps}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put the tables back as a checkpoint's snapshot has them (rank 0 asks the
        servers; every rank then counts on the restored tables)."""
        saved = state.get("node_tensors")
        if not saved or not self.tables:
            return
        if saved["job_id"] != self.job_id:
            raise ValueError(f"--resume: the checkpoint's server-held embeddings are job "
                             f"{saved['job_id']}'s, this run's are {self.job_id}'s")
        if self.env.rank == 0:
            restore_all(self.cluster, self.job_id, int(saved["step"]),
                        reconnect=self.args.reconnect_timeout)
        _barrier(self.env)
        for table in self.tables.values():
            table.refresh()
        log.info("server-held embeddings restored to step %d", self.steps)

    def close(self) -> None:
        """Drop the tables from the servers' memory (rank 0, once every rank is done);
        their snapshots stay where a checkpoint may resume from them."""
        _barrier(self.env)
        for table in (t.table for t in self.tables.values() if t.table is not None):
            if self.env.rank == 0:
                table.drop(forget=self.args.checkpoint_dir is None)
            table.close()


def server_embeddings(args: argparse.Namespace, env: DistEnv, cluster: Cluster) -> ServerEmbeddings | None:
    """The run's server-held embeddings with ``--sparse-embedding`` (None without);
    refused on a graph whose every type has features."""
    if not getattr(args, "sparse_embedding", False):
        return None
    if not featureless_types(cluster.graph):
        raise ValueError(f"--sparse-embedding: expected a graph with node types without features, but every "
                         f"type of {cluster.graph.name!r} has features")
    return ServerEmbeddings(args, env, cluster, cluster.graph)


def embedding_config(args: argparse.Namespace, graph: TypedGraph) -> dict[str, Any]:
    """What the checkpoints record of the featureless types' embeddings (nothing for the
    dense default of ``--hidden`` width, which checkpoints have always meant)."""
    sparse = bool(getattr(args, "sparse_embedding", False))
    if not featureless_types(graph) or not (sparse or getattr(args, "embedding_dim", None)):
        return {}
    return {"embedding": {"dim": input_width(args), "sparse": sparse}}


def _barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def shared_token(env: DistEnv) -> str:
    """A random ID drawn by rank 0 and given to every rank (as bytes, no pickle)."""
    token = torch.tensor(list(uuid.uuid4().bytes[:8]), dtype=torch.uint8)
    if env.distributed:
        token = token.to(env.comm_device)
        dist.broadcast(token, 0)
    return bytes(token.cpu().tolist()).hex()


def _resumed_job(args: argparse.Namespace) -> str | None:
    """The job ID the checkpoint ``--resume`` continues from records, if any."""
    if not args.resume or args.checkpoint_dir is None:
        return None
    path = args.checkpoint_dir / CHECKPOINT_NAME
    if not path.exists():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("task") or {}
    job = (saved.get("node_tensors") or {}).get("job_id")
    return str(job) if job else None
