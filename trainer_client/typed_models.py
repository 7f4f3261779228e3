"""Node classifiers for typed minibatches (``HeteroData``), built from the graph's facts
(:class:`~trainer_client.graph.TypedGraph`); ``docs/training.md`` ("Typed graphs: R-GCN")
describes them. Both read a batch as PyG's hetero ``NeighborLoader`` lays it out
(:func:`typed_batch_inputs`), turn every node type into a ``hidden``-wide vector
(:class:`TypedInput`: a ``Linear`` for types with features, a learnable ``nn.Embedding``
indexed by ``n_id`` for types without, as PyG's and DGL's ogbn-mag examples do) and
return the target type's seeds' logits.

* :class:`RGCN`: ``h_i' = W_root[t] h_i + sum_r W_r mean_{j in N_r(i)} h_j`` per layer
  (DGL's ``RelGraphConvLayer``, ``norm='right'``). Each layer computes only what reaches
  the target type's output (:func:`layer_plan`), so every parameter takes part in every
  step (DDP needs no ``find_unused_parameters``); ``trim_to_layer`` trims the outer hops.
* :class:`TypedSAGE` (``--model hetero-sage``): PyG's GraphSAGE stack made typed by
  ``to_hetero``, which computes every type at every layer, so it needs
  ``find_unused_parameters=True`` (:data:`FIND_UNUSED_PARAMETERS`); its channel
  counts are explicit, so its parameters exist before DDP wraps it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import Data, HeteroData
from torch_geometric.nn import SAGEConv, to_hetero
from torch_geometric.utils import trim_to_layer

from partitioner.graph import EdgeType
from trainer_client.featureless import dense_embedding, featureless_rows
from trainer_client.graph import TypedGraph
from trainer_client.models import batch_inputs, check_sizes

#: Typed model names and whether DDP must search for unused parameters.
FIND_UNUSED_PARAMETERS: dict[str, bool] = {"rgcn": False, "hetero-sage": True}
TYPED_MODELS: tuple[str, ...] = tuple(FIND_UNUSED_PARAMETERS)

#: What a typed model reads of a batch: features, edges and ``n_id`` per type, the
#: number of seeds, and the per-hop counts (None when the batch has none).
TypedBatchInputs = tuple[dict[str, Tensor], dict[EdgeType, Tensor], dict[str, Tensor], int,
                         dict[str, list[int]] | None, dict[EdgeType, list[int]] | None]


def check_graph(graph: TypedGraph, hidden_channels: int, num_layers: int, dropout: float) -> None:
    """Refuse sizes a typed model cannot take, or a graph it cannot be built for: a
    featureless type without its node count (its embedding's rows), or no classes."""
    check_sizes(dropout, hidden_channels=hidden_channels, num_layers=num_layers)
    for t in graph.node_types:
        if graph.feature_dims.get(t, 0) <= 0 and graph.num_nodes.get(t, 0) <= 0:
            raise ValueError(f"num_nodes[{t!r}]: a node type without features needs its node "
                             f"count (> 0) for its embedding, got {graph.num_nodes.get(t)}")
    if graph.num_classes < 1:
        raise ValueError(f"num_classes: expected an integer >= 1, got {graph.num_classes}")


def layer_plan(graph: TypedGraph, num_layers: int,
               out_types: Sequence[str] | None = None) -> list[tuple[list[EdgeType], list[str]]]:
    """Per layer, the relations it computes and the node types it outputs, so that only
    what reaches the last-layer output of ``out_types`` (default: the target type) is
    computed (see the module doc)."""
    plan: list[tuple[list[EdgeType], list[str]]] = []
    wanted = set(out_types) if out_types else {graph.target_type}
    for _ in range(num_layers):
        relations = [et for et in graph.edge_types if et[2] in wanted]
        plan.append((relations, [t for t in graph.node_types if t in wanted]))
        wanted = wanted | {et[0] for et in relations}
    plan.reverse()
    return plan


#: Makes the input module of a featureless node type, ``hidden`` channels wide (a
#: server-held embedding, :class:`~trainer_client.featureless.ServerEmbeddings`).
EmbeddingFactory = Callable[[str, int], nn.Module]


class TypedInput(nn.Module):
    """Every node type to ``hidden`` channels: a ``Linear`` for types with features, an
    embedding (indexed by the batch's node IDs) for types without: ``embeddings``' module
    of the type where given, else a dense ``nn.Embedding``."""

    def __init__(self, graph: TypedGraph, hidden: int, types: Sequence[str] | None = None,
                 embeddings: EmbeddingFactory | None = None) -> None:
        super().__init__()
        types = list(graph.node_types if types is None else types)
        self.lins = nn.ModuleDict({t: nn.Linear(graph.feature_dims[t], hidden)
                                   for t in types if graph.feature_dims.get(t, 0) > 0})
        featureless = [t for t in types if graph.feature_dims.get(t, 0) <= 0]
        self.embs = nn.ModuleDict({t: embeddings(t, hidden) if embeddings is not None
                                   else dense_embedding(graph.num_nodes[t], hidden) for t in featureless})

    def forward(self, x_dict: Mapping[str, Tensor], n_id_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
        for t in self.embs:
            if t not in n_id_dict:
                raise ValueError(f"batch[{t!r}].n_id: expected the node IDs of node type {t!r}, got none")
        return self.of({**x_dict, **{t: n_id_dict[t] for t in self.embs}})

    def of(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Every type's rows from ``inputs``: features of the types with them; node IDs, or
        the server-held table's rows of them, of the others (:func:`featureless_rows`)."""
        out = {}
        for t, lin in self.lins.items():
            if t not in inputs:
                raise ValueError(f"batch[{t!r}].x: expected features of node type {t!r}, got none")
            out[t] = lin(inputs[t])
        for t, emb in self.embs.items():
            out[t] = featureless_rows(emb, inputs[t])
        return out


class RGCNLayer(nn.Module):
    """One R-GCN layer over the given relations, output for ``out_types``."""

    def __init__(self, relations: Sequence[EdgeType], out_types: Sequence[str], in_channels: int,
                 out_channels: int) -> None:
        super().__init__()
        self.relations: list[EdgeType] = [(et[0], et[1], et[2]) for et in relations]
        # ModuleDict keys may not contain '.': '__'-joined edge type names.
        self.rel = nn.ModuleDict({"__".join(et): SAGEConv(in_channels, out_channels, aggr="mean",
                                                          root_weight=False, bias=False)
                                  for et in self.relations})
        self.root = nn.ModuleDict({t: nn.Linear(in_channels, out_channels) for t in out_types})

    def forward(self, h: Mapping[str, Tensor],
                edge_index_dict: Mapping[EdgeType, Tensor]) -> dict[str, Tensor]:
        out = {t: lin(h[t]) for t, lin in self.root.items()}
        for et in self.relations:
            ei = edge_index_dict.get(et)
            if ei is None or et[0] not in h:
                continue
            src, _, dst = et
            out[dst] = out[dst] + self.rel["__".join(et)]((h[src], h[dst]), ei)
        return out


class RGCN(nn.Module):
    """R-GCN node classifier for typed minibatches (see the module doc); ``out_types``:
    the node types whose last-layer outputs :meth:`embed` returns (default: the target
    type; a link predictor's source and destination types)."""

    def __init__(self, graph: TypedGraph, *, hidden_channels: int = 64, num_layers: int = 2,
                 dropout: float = 0.5, out_types: Sequence[str] | None = None,
                 embeddings: EmbeddingFactory | None = None) -> None:
        super().__init__()
        check_graph(graph, hidden_channels, num_layers, dropout)
        self.target_type, self.dropout, self.num_layers = graph.target_type, dropout, num_layers
        plan = layer_plan(graph, num_layers, out_types)
        used = set(plan[0][1]) | {et[0] for et in plan[0][0]}  # the first layer's outputs and sources
        self.input = TypedInput(graph, hidden_channels, [t for t in graph.node_types if t in used],
                                embeddings)
        widths = [hidden_channels] * num_layers + [graph.num_classes]
        self.layers = nn.ModuleList([RGCNLayer(rels, outs, widths[i], widths[i + 1])
                                     for i, (rels, outs) in enumerate(plan)])

    def forward(self, x_dict: dict[str, Tensor], edge_index_dict: dict[EdgeType, Tensor],
                n_id_dict: dict[str, Tensor], batch_size: int,
                num_sampled_nodes: dict[str, list[int]] | None = None,
                num_sampled_edges: dict[EdgeType, list[int]] | None = None) -> Tensor:
        """Logits ``[batch_size, num_classes]`` of the target type's seeds."""
        return self.embed(x_dict, edge_index_dict, n_id_dict, num_sampled_nodes,
                          num_sampled_edges)[self.target_type][:batch_size]

    def output_types(self, layer: int) -> list[str]:
        """The node types layer ``layer`` outputs (:func:`layer_plan`)."""
        conv: RGCNLayer = self.layers[layer]  # type: ignore[assignment]
        return list(conv.root)

    def inference_per_layer(self, layer: int, x_dict: Mapping[str, Tensor],
                            edge_index_dict: Mapping[EdgeType, Tensor], seed_type: str, batch_size: int
                            ) -> Tensor:
        """Layer ``layer``'s outputs of the first ``batch_size`` nodes of ``seed_type``,
        from every node's layer inputs (layer 0: :meth:`TypedInput.of`'s inputs) and the
        edges into them (all of them; see :mod:`trainer_client.layerwise`)."""
        h = self.input.of(x_dict) if layer == 0 else x_dict
        conv: RGCNLayer = self.layers[layer]  # type: ignore[assignment]
        out = conv.root[seed_type](h[seed_type][:batch_size])
        for et in conv.relations:
            ei = edge_index_dict.get(et)
            if et[2] == seed_type and ei is not None and et[0] in h:
                out = out + conv.rel["__".join(et)]((h[et[0]], h[seed_type]), ei)[:batch_size]
        return F.relu(out) if layer < self.num_layers - 1 else out

    def embed(self, x_dict: Mapping[str, Tensor], edge_index_dict: Mapping[EdgeType, Tensor],
              n_id_dict: Mapping[str, Tensor], num_sampled_nodes: dict[str, list[int]] | None = None,
              num_sampled_edges: dict[EdgeType, list[int]] | None = None) -> dict[str, Tensor]:
        """The last layer's outputs per output type, every node the layers keep (the
        seeds first; trimming drops only the outermost hops)."""
        h = self.input(x_dict, n_id_dict)
        edges: dict[EdgeType, Tensor] = dict(edge_index_dict)
        for i, layer in enumerate(self.layers):
            if i > 0 and num_sampled_nodes and num_sampled_edges and \
                    all(len(v) >= self.num_layers for v in num_sampled_edges.values()):
                h, edges, _ = trim_to_layer(i, num_sampled_nodes, num_sampled_edges, h, edges)
            h = layer(h, edges)
            if i < self.num_layers - 1:
                h = {t: F.dropout(F.relu(v), self.dropout, self.training) for t, v in h.items()}
        return h


class _SAGEStack(nn.Module):
    """Homogeneous GraphSAGE layers for ``to_hetero`` to make typed."""

    def __init__(self, hidden: int, out: int, num_layers: int, dropout: float) -> None:
        super().__init__()
        widths = [hidden] * num_layers + [out]
        self.convs = nn.ModuleList([SAGEConv(widths[i], widths[i + 1]) for i in range(num_layers)])
        # A module, not F.dropout(training=self.training): to_hetero's tracing would bake
        # the training flag of the moment in as a constant.
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = self.dropout(F.relu(x))
        return x


class TypedSAGE(nn.Module):
    """GraphSAGE made typed by ``to_hetero`` (aggregation ``sum`` over relations);
    ``out_types``: the node types whose last-layer outputs layer-wise inference computes
    (default: the target type)."""

    def __init__(self, graph: TypedGraph, *, hidden_channels: int = 64, num_layers: int = 2,
                 dropout: float = 0.5, embeddings: EmbeddingFactory | None = None,
                 out_types: Sequence[str] | None = None) -> None:
        super().__init__()
        check_graph(graph, hidden_channels, num_layers, dropout)
        self.target_type, self.num_layers = graph.target_type, num_layers
        self.edge_types: list[EdgeType] = list(graph.edge_types)
        self._plan = layer_plan(graph, num_layers, out_types)
        self.input = TypedInput(graph, hidden_channels, embeddings=embeddings)
        stack = _SAGEStack(hidden_channels, graph.num_classes, num_layers, dropout)
        self.gnn = to_hetero(stack, (list(graph.node_types), list(graph.edge_types)), aggr="sum")

    def output_types(self, layer: int) -> list[str]:
        """The node types layer ``layer`` must output for the last layer's ``out_types``."""
        return list(self._plan[layer][1])

    def inference_per_layer(self, layer: int, x_dict: Mapping[str, Tensor],
                            edge_index_dict: Mapping[EdgeType, Tensor], seed_type: str, batch_size: int
                            ) -> Tensor:
        """As :meth:`RGCN.inference_per_layer`: the layer's ``SAGEConv`` of every relation
        into ``seed_type``, summed as ``to_hetero`` sums them, ReLU between layers."""
        h = self.input.of(x_dict) if layer == 0 else x_dict
        convs = self.gnn.convs[layer]
        parts = [convs["__".join(et)]((h[et[0]], h[seed_type]), edge_index_dict[et])[:batch_size]
                 for et in self.edge_types if et[2] == seed_type and et in edge_index_dict]
        if not parts:
            raise ValueError(f"{seed_type!r}: expected a node type with in-edges (to_hetero computes no "
                             "output for one without), got none")
        out = sum(parts[1:], parts[0])
        return F.relu(out) if layer < self.num_layers - 1 else out

    def forward(self, x_dict: dict[str, Tensor], edge_index_dict: dict[EdgeType, Tensor],
                n_id_dict: dict[str, Tensor], batch_size: int,
                num_sampled_nodes: dict[str, list[int]] | None = None,
                num_sampled_edges: dict[EdgeType, list[int]] | None = None) -> Tensor:
        """Logits ``[batch_size, num_classes]`` of the target type's seeds (no trimming)."""
        return self.embed(x_dict, edge_index_dict, n_id_dict)[self.target_type][:batch_size]

    def embed(self, x_dict: Mapping[str, Tensor], edge_index_dict: Mapping[EdgeType, Tensor],
              n_id_dict: Mapping[str, Tensor], num_sampled_nodes: dict[str, list[int]] | None = None,
              num_sampled_edges: dict[EdgeType, list[int]] | None = None) -> dict[str, Tensor]:
        """The last layer's outputs of every node of every type (no trimming)."""
        out: dict[str, Tensor] = self.gnn(self.input(x_dict, n_id_dict), dict(edge_index_dict))
        return out


def typed_batch_inputs(batch: HeteroData) -> TypedBatchInputs:
    """The inputs of a typed model's ``forward`` for a batch laid out as PyG's hetero
    ``NeighborLoader`` lays it out (``batch_size`` on the target type)."""
    x_dict, edges, sizes = (batch.collect(key, allow_empty=True) for key in ("x", "edge_index", "batch_size"))
    n_id = node_ids_of(batch)
    if len(sizes) != 1:
        raise ValueError(f"batch: expected batch_size on exactly one node type (the seeds'), found it "
                         f"on {list(sizes)}")
    nodes = batch.num_sampled_nodes if "num_sampled_nodes" in batch else None
    sampled = batch.num_sampled_edges if "num_sampled_edges" in batch else None
    return (x_dict, edges, n_id, int(next(iter(sizes.values()))),
            dict(nodes) if isinstance(nodes, dict) else None,
            {tuple(k): v for k, v in sampled.items()} if isinstance(sampled, dict) else None)


def model_inputs(batch: Data | HeteroData) -> tuple[Any, ...]:
    """The positional inputs of a model's ``forward`` for a batch of either kind: a
    plain graph's ``Data`` (:func:`~trainer_client.models.batch_inputs`) or a typed one
    (:func:`typed_batch_inputs`)."""
    return typed_batch_inputs(batch) if isinstance(batch, HeteroData) else batch_inputs(batch)


def node_ids_of(batch: HeteroData) -> dict[str, Tensor]:
    """Per node type, the IDs its embedding is indexed by
    (:func:`~trainer_client.featureless.node_ids`)."""
    return {**batch.collect("n_id", allow_empty=True), **batch.collect("internal_n_id", allow_empty=True)}


def build_typed_model(name: str, graph: TypedGraph, *, hidden_channels: int = 64, num_layers: int = 2,
                      dropout: float = 0.5, embeddings: EmbeddingFactory | None = None) -> RGCN | TypedSAGE:
    """A typed node classifier by name (``rgcn`` or ``hetero-sage``); ``embeddings``: the
    featureless types' input modules (default: dense embeddings)."""
    classes: dict[str, type[RGCN] | type[TypedSAGE]] = {"rgcn": RGCN, "hetero-sage": TypedSAGE}
    if name not in classes:
        raise ValueError(f"model: expected one of {list(TYPED_MODELS)}, got {name!r}")
    return classes[name](graph, hidden_channels=hidden_channels, num_layers=num_layers, dropout=dropout,
                         embeddings=embeddings)
