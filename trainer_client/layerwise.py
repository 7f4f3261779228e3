"""Exact inference over every node, layer by layer, with the layer tables on the servers
(DGL's distributed inference into a ``DistTensor``; ``docs/training.md``, "Layer-wise
inference").

For each layer ``l`` and each node type the layer outputs (a plain graph's one; a typed
model's :meth:`output_types`), every rank iterates its share of every node of the type in
one-hop batches with every neighbor (``batches="partition"``: each server batches the
nodes it owns, ``every_node``), the previous layer's table delivered with each batch
(layer 0: the features, the rows of server-held embeddings, or the node IDs of dense
ones), computes the layer for the batch's seeds (the model's ``inference_per_layer``)
and writes their rows into layer ``l``'s table, a node tensor partitioned like the nodes
(:class:`~trainer_client.node_tensors.RemoteNodeTensor`, by global ID). Then the ranks
meet; rank 0 has the servers snapshot the layer's tables (``SnapshotNodeTensors``) and
checks that every server held them throughout (their incarnations); the previous layer's
tables are dropped. A rank holds only its batches; each server two layers' rows of its
own nodes. The last layer's tables hold every node's output (logits or embeddings).

Faults: a layer's writes set each node's row to the same values however often they are
made, so a layer that lost rows (a server restarted mid-layer: its calls answer with
another incarnation, or without the table, and the snapshot says so) is made again by
every rank, reading the previous layer's table as the restarted server reloaded it from
its snapshot; the pass ends with the same output bit for bit. A server that does not come
back within the reconnect timeout ends the pass naming it (the loaders' and tables' own
bounded retries).

A model provides ``num_layers`` and ``inference_per_layer`` (:func:`layer_model` says
what exactly); the node and link tasks' models all do.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch_geometric.data import Data, HeteroData
from tqdm import tqdm

from protos.channel import GraphfeedError, ServerUnavailable
from trainer_client.cluster import Cluster
from trainer_client.ddp import DistEnv
from trainer_client.featureless import server_tables
from trainer_client.graph import TypedGraph
from trainer_client.loader import RemoteNeighborLoader
from trainer_client.node_tensors import RemoteNodeTensor, row_init, snapshot_all

log = logging.getLogger(__name__)

#: Status codes of a call that found a layer's rows gone (a server restarted): the layer
#: is made again.
LOST = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND})
#: Writes a rank keeps in flight while it computes the next batch.
WRITES_AHEAD = 2


class Meeting(Protocol):
    """How the ranks of a pass agree: every rank calls :meth:`most` at the same points."""

    def most(self, value: int) -> int:
        """The largest of the ranks' ``value`` (once every rank gave one)."""
        ...


@dataclass(frozen=True)
class ProcessGroup:
    """:class:`Meeting` of the job's ``torch.distributed`` process group (default: one
    rank, none)."""

    env: DistEnv = field(default_factory=lambda: DistEnv(0, 1, 0, torch.device("cpu")))

    def most(self, value: int) -> int:
        if not self.env.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.env.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())


class LayerModel:
    """A model as the pass runs it (see :func:`layer_model`)."""

    def __init__(self, model: nn.Module, graph: TypedGraph) -> None:
        self.model, self.graph = model, graph
        self.num_layers = int(getattr(model, "num_layers"))  # noqa: B009 - checked by layer_model
        #: What the model's layers take besides PyG's arguments ("edge_attr", "in_degree").
        self.needs = frozenset(getattr(model, "layerwise_inputs", ()))
        unknown = self.needs - {"edge_attr", "in_degree"}
        if unknown or (graph.typed and self.needs):
            raise ValueError(f"layerwise_inputs: expected 'edge_attr' or 'in_degree' (plain graphs), got "
                             f"{sorted(self.needs)}")
        #: Server-held embeddings of featureless types, by node type (their rows come with layer 0's batches).
        self.tables = {t or graph.target_type: e.create() for t, e in server_tables(model).items()}

    def output_types(self, layer: int) -> list[str]:
        if not self.graph.typed:
            return [self.graph.target_type]
        return list(self.model.output_types(layer))  # type: ignore[operator]

    def step(self, layer: int, batch: Data | HeteroData, seed_type: str) -> Tensor:
        """Layer ``layer``'s outputs of ``batch``'s seeds (of ``seed_type``)."""
        if isinstance(batch, HeteroData):
            inputs = {t: x for t in batch.node_types if (x := _inputs(batch[t], layer)) is not None}
            store = batch[seed_type]
            out: Tensor = self.model.inference_per_layer(  # type: ignore[operator]
                layer, inputs, batch.collect("edge_index"), seed_type, int(store.batch_size))
            return out
        x = _inputs(batch, layer)
        extra = {name: batch[name] for name in self.needs}
        out = self.model.inference_per_layer(layer, x, batch.edge_index, int(batch.batch_size),  # type: ignore[operator]
                                             **extra)
        return out


def _inputs(store: Any, layer: int) -> Tensor | None:
    """A node store's inputs of layer ``layer``: the previous layer's rows ("h"); layer
    0's features, or the server-held embedding's rows ("emb"), or the node IDs a dense
    embedding indexes (original IDs)."""
    if layer > 0:
        return store.h if "h" in store else None
    for name in ("x", "emb"):
        if name in store:
            found: Tensor = store[name]
            return found
    ids: Tensor = store.n_id
    return ids


def layer_model(model: nn.Module, graph: TypedGraph) -> LayerModel:
    """``model`` (a link predictor's encoder) as the pass runs it, refused naming what it
    lacks: ``num_layers`` and ``inference_per_layer(layer, x, edge_index, batch_size)``
    (PyG's ``BasicGNN`` shape; optional ``layerwise_inputs``, a set of ``"edge_attr"`` and
    ``"in_degree"`` passed as keywords), on a typed graph
    ``inference_per_layer(layer, x_dict, edge_index_dict, seed_type, batch_size)`` and
    ``output_types(layer)``. Layer 0's inputs are the features, and a featureless type's
    node IDs (or its server-held embedding's rows)."""
    model = getattr(model, "encoder", model)
    wanted = ["num_layers", "inference_per_layer"] + (["output_types"] if graph.typed else [])
    missing = [name for name in wanted if getattr(model, name, None) is None]
    if missing:
        shape = "inference_per_layer(layer, x_dict, edge_index_dict, seed_type, batch_size) -> Tensor " \
            "and output_types(layer)" if graph.typed else \
            "inference_per_layer(layer, x, edge_index, batch_size) -> Tensor (PyG's BasicGNN has it)"
        raise TypeError(f"layer-wise inference: {type(model).__name__} lacks {', '.join(missing)}; expected "
                        f"a model with num_layers and {shape} (docs/training.md, 'Layer-wise inference'), or "
                        "evaluate on samples (--eval sampled)")
    return LayerModel(model, graph)


@dataclass
class LayerStats:
    """What one layer cost this rank."""

    nodes: int = 0
    seconds: float = 0.0
    received: int = 0
    written: int = 0
    attempts: int = 1


@dataclass
class LayerwiseInference:
    """One pass over every node (see the module doc). ``meeting``: how the ranks agree
    (:class:`ProcessGroup` under DDP; default: one rank); ``loader_options``: what each
    layer's loaders take besides their seeds and tensors (rank, world size, device,
    timeouts ...); ``name``: the tables' prefix (default: drawn, the same on every rank);
    ``progress``: a bar per layer; ``on_batch(layer, index)``: called after each batch's
    rows are written."""

    model: nn.Module
    cluster: Cluster
    meeting: Meeting = field(default_factory=ProcessGroup)
    batch_size: int = 1024
    loader_options: Mapping[str, Any] = field(default_factory=dict)
    name: str = ""
    #: Keep the last layer's tables on the servers, as ``<keep>/<type>`` (empty: dropped
    #: by :meth:`close`).
    keep: str = ""
    progress: bool = False
    attempts: int = 3
    snapshot_timeout: float = 600.0
    on_batch: Callable[[int, int], None] | None = None
    #: Per layer, what it cost this rank.
    stats: list[LayerStats] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layers = layer_model(self.model, self.cluster.graph)
        self.rank = int(self.loader_options.get("rank", 0))
        #: The pass's own input tables (the in-degrees), by name.
        self._inputs: dict[str, RemoteNodeTensor] = {}
        #: The last layer's tables, by node type (once :meth:`run` has run).
        self.outputs: dict[str, RemoteNodeTensor] = {}

    def table_name(self, layer: int, node_type: str) -> str:
        if self.keep and layer == self.layers.num_layers - 1:
            return f"{self.keep}/{node_type}"
        return f"{self.name}/{layer}/{node_type}"

    @torch.no_grad()
    def run(self) -> dict[str, RemoteNodeTensor]:
        """Every layer over every node; the last layer's tables by node type."""
        if not self.name:  # one draw for all ranks: the largest of theirs
            self.name = f"lw/{self.meeting.most(secrets.randbits(62)):016x}"
        self.model.eval()
        previous: dict[str, RemoteNodeTensor] = {}
        for layer in range(self.layers.num_layers):
            tables = self._layer(layer, previous)
            self._drop(previous)
            previous = tables
        self.outputs = previous
        return previous

    def close(self) -> None:
        """Drop the last layer's tables and the pass's own inputs from the servers (every
        rank calls it; rank 0 drops)."""
        self.meeting.most(0)
        if self.keep:
            for table in self.outputs.values():
                table.close()
        else:
            self._drop(self.outputs)
        self._drop(self._inputs)
        self.outputs, self._inputs = {}, {}

    def _drop(self, tables: Mapping[str, RemoteNodeTensor]) -> None:
        """Drop ``tables`` from the servers (rank 0), and their snapshots; a server that
        does not answer keeps its copy until it restarts (said in the log)."""
        for table in tables.values():
            try:
                if self.rank == 0:
                    table.drop(forget=True)
            except GraphfeedError as exc:
                log.warning("layer-wise inference: node tensor %r not dropped everywhere: %s", table.name,
                            exc)
            finally:
                table.close()

    # -- a layer -------------------------------------------------------------------------
    def _layer(self, layer: int, previous: Mapping[str, RemoteNodeTensor]) -> dict[str, RemoteNodeTensor]:
        """Layer ``layer`` over every node, made again while it lost rows."""
        for attempt in range(1, self.attempts + 1):
            stats = LayerStats(attempts=attempt)
            started = time.perf_counter()
            tables: dict[str, RemoteNodeTensor] = {}
            lost: GraphfeedError | None = None
            total = self._rank_nodes(layer)
            with tqdm(total=total, unit="node", desc=f"layer {layer + 1}/{self.layers.num_layers}",
                      disable=not self.progress, leave=False) as bar:
                for node_type in self.layers.output_types(layer):
                    lost = self._type(layer, node_type, previous, tables, stats, bar, lost)
            stats.seconds = time.perf_counter() - started
            if self.meeting.most(int(lost is not None)) == 0 and self._keep(layer, tables):
                self.stats.append(stats)
                self._report(layer, stats)
                return tables
            log.warning("layer-wise inference: layer %d lost rows (%s); making it again (attempt %d of %d)",
                        layer + 1, lost or "a server restarted", attempt + 1, self.attempts)
            for table in tables.values():
                table.close()
        raise GraphfeedError(f"layer-wise inference: layer {layer + 1} lost rows {self.attempts} times "
                             "(servers restarting again and again); see their logs")

    def _type(self, layer: int, node_type: str, previous: Mapping[str, RemoteNodeTensor],
              tables: dict[str, RemoteNodeTensor], stats: LayerStats, bar: tqdm,
              lost: GraphfeedError | None) -> GraphfeedError | None:
        """Layer ``layer`` of every node of ``node_type`` into ``tables[node_type]``; the
        ranks agree on its width first (every rank once per type, even one that failed)."""
        batches = self._batches(layer, node_type, previous, stats)
        try:
            first = None
            if lost is None:
                try:
                    first = next(batches, None)
                except GraphfeedError as exc:
                    lost = _lost(exc)
            width = self.meeting.most(0 if first is None else int(first[1].shape[1]))
            if lost is not None or width == 0:
                return lost
            table = tables[node_type] = RemoteNodeTensor(
                self.cluster, self.table_name(layer, node_type), (width,), node_type=node_type,
                job_id=f"{self.name}/{layer}",
                reconnect=float(self.loader_options.get("reconnect_timeout", 15.0)))
            try:
                self._write(layer, table, _chain(first, batches), stats, bar)
            except GraphfeedError as exc:
                lost = _lost(exc)
            stats.written += table.bytes_sent
            return lost
        finally:
            batches.close()

    def _write(self, layer: int, table: RemoteNodeTensor, batches: Iterator[tuple[Tensor, Tensor]],
               stats: LayerStats, bar: tqdm) -> None:
        """Write each batch's rows, a few writes in flight while the next batch is made."""
        writes: deque[Future[None]] = deque()
        with ThreadPoolExecutor(1, thread_name_prefix="layer-write") as writer:
            for index, (seeds, out) in enumerate(batches):
                writes.append(writer.submit(table.write, seeds, out))
                while len(writes) > WRITES_AHEAD:
                    writes.popleft().result()
                stats.nodes += int(seeds.numel())
                bar.update(int(seeds.numel()))
                if self.on_batch is not None:
                    self.on_batch(layer, index)
            while writes:
                writes.popleft().result()

    def _batches(self, layer: int, node_type: str, previous: Mapping[str, RemoteNodeTensor],
                 stats: LayerStats) -> Generator[tuple[Tensor, Tensor], None, None]:
        """The seeds' global IDs and layer outputs of this rank's batches of ``node_type``."""
        loader = self._loader(layer, node_type, previous)
        try:
            for batch in loader:
                store = batch[node_type] if isinstance(batch, HeteroData) else batch
                out = self.layers.step(layer, batch, node_type)
                yield store.internal_n_id[: int(store.batch_size)].cpu(), out.detach().float().cpu()
        finally:
            stats.received += loader.last_stats.bytes
            loader.close()

    def _loader(self, layer: int, node_type: str, previous: Mapping[str, RemoteNodeTensor]
                ) -> RemoteNeighborLoader:
        tensors: dict[str, Any] = {}
        if layer > 0:
            tensors["h"] = list(previous.values())
        elif self.layers.tables:
            tensors["emb"] = list(self.layers.tables.values())
        if "in_degree" in self.layers.needs:
            tensors["in_degree"] = self._degrees(node_type)
        return RemoteNeighborLoader(
            self.cluster, input_nodes=node_type, num_neighbors=[-1], batch_size=self.batch_size,
            batches="partition", include_features=layer == 0, include_labels=False, node_tensors=tensors,
            return_internal_ids=True, edge_features="edge_attr" in self.layers.needs,
            **{k: v for k, v in self.loader_options.items() if k not in _OWN_OPTIONS})

    def _degrees(self, node_type: str) -> RemoteNodeTensor:
        """Every node's in-degree (GCN's normalization), filled by the servers; made again
        for each layer (found where it is, filled anew on a server that restarted)."""
        name = f"{self.name}/in_degree/{node_type}"
        table = RemoteNodeTensor(self.cluster, name, (), node_type=node_type, dtype=torch.int64,
                                 init=row_init("in_degree"))
        old = self._inputs.pop(name, None)
        if old is not None:
            old.close()
        self._inputs[name] = table
        return table

    def _rank_nodes(self, layer: int) -> int:
        """The nodes this rank's batches of layer ``layer`` hold (the bar's total)."""
        world = int(self.loader_options.get("world_size", 1))
        return sum(self.cluster.graph.num_nodes[t] for t in self.layers.output_types(layer)) // world

    # -- the end of a layer --------------------------------------------------------------
    def _keep(self, layer: int, tables: Mapping[str, RemoteNodeTensor]) -> bool:
        """Rank 0 has the servers snapshot the layer's tables and checks every server held
        them since they were made; every rank learns whether they did."""
        held = 1
        if self.rank == 0:
            replies = snapshot_all(self.cluster, f"{self.name}/{layer}", 0, timeout=self.snapshot_timeout)
            for p, reply in enumerate(replies):
                now = {info.spec.name: info.incarnation for info in reply.tensors}
                held &= all(now.get(t.name) == t.incarnations[p] for t in tables.values())
        return self.meeting.most(int(not held)) == 0

    def _report(self, layer: int, stats: LayerStats) -> None:
        rate = stats.nodes / max(stats.seconds, 1e-9)
        again = f", made {stats.attempts} times" if stats.attempts > 1 else ""
        log.info("layer-wise inference: layer %d/%d: %d nodes in %.1f s (%.0f nodes/s; rank %d: received "
                 "%.1f MB, wrote %.1f MB%s)", layer + 1, self.layers.num_layers, stats.nodes, stats.seconds,
                 rate, self.rank, stats.received / 1e6, stats.written / 1e6, again)


#: Loader options the pass sets itself.
_OWN_OPTIONS = frozenset({"edge_features", "return_internal_ids", "include_features", "node_tensors",
                          "input_nodes", "num_neighbors", "batch_size", "batches", "shuffle"})


def _chain(first: tuple[Tensor, Tensor] | None, rest: Iterator[tuple[Tensor, Tensor]]
           ) -> Iterator[tuple[Tensor, Tensor]]:
    if first is not None:
        yield first
        yield from rest


def _lost(exc: GraphfeedError) -> GraphfeedError:
    """``exc`` when it says a layer's rows were lost (the layer is made again); else it is
    raised (a server gone for good is named by it)."""
    if isinstance(exc, ServerUnavailable) or exc.code not in LOST:
        raise exc
    return exc
