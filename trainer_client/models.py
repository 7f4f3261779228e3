"""GNN node classifiers for sampled minibatches: GraphSAGE (default), GCN, GAT, GIN and
GINE.

Edge features: GINE (PyG's ``GINEConv``) needs them, and GAT uses them with ``edge_dim``
(``GATConv``'s edge attention); each then takes a batch's ``edge_attr`` (the loader's
``edge_features=True``), flattened to ``[E, edge_dim]`` and cast to float32.

The layers are PyG's ``basic_gnn`` models. When a batch carries ``num_sampled_nodes`` /
``num_sampled_edges`` and the model has no more layers than the batch has hops, the
forward pass uses PyG's ``trim_to_layer``: layer ``k`` skips the nodes and edges of the
outermost ``k`` hops, which cannot reach the seeds any more. The seeds' logits are the
same as without trimming, with less work. GCN is the exception and never trims: its
symmetric normalization reads the *source* nodes' degrees, which trimming changes. The
output holds the logits of the first ``batch_size`` nodes (the seeds).

Layer-wise inference (:mod:`trainer_client.layerwise`) runs one layer at a time over
one-hop batches with every neighbor: :meth:`NodeClassifier.inference_per_layer`, PyG's
``BasicGNN.inference_per_layer`` with what the batch cannot show: GINE's and GAT's edge
features, and GCN's normalization by the whole graph's degrees (``in_degree``), so each
seed's output equals the full-graph forward's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch_geometric.data import Data, HeteroData
from torch_geometric.nn import MLP, GCNConv, GINEConv
from torch_geometric.nn.conv import MessagePassing
from torch_geometric.nn.models import GAT, GCN, GIN, GraphSAGE
from torch_geometric.nn.models.basic_gnn import BasicGNN


class GINE(BasicGNN):
    """GIN with edge features (PyG's ``GINEConv``, "Strategies for Pre-training Graph
    Neural Networks"): each layer adds the edge's features, projected to the layer's
    input width, to the neighbor's before the sum. ``edge_dim`` is required;
    :class:`NodeClassifier` builds it with batch normalization."""

    supports_edge_weight = False
    supports_edge_attr = True
    supports_norm_batch = False

    def init_conv(self, in_channels: int | tuple[int, int], out_channels: int, **kwargs: object
                  ) -> MessagePassing:
        width = in_channels if isinstance(in_channels, int) else in_channels[0]
        mlp = MLP([width, out_channels, out_channels], act=self.act, act_first=self.act_first,
                  norm=self.norm, norm_kwargs=self.norm_kwargs)
        return GINEConv(mlp, **kwargs)


#: Model names, and the PyG class each builds.
MODELS: dict[str, type[BasicGNN]] = {"sage": GraphSAGE, "gcn": GCN, "gat": GAT, "gin": GIN, "gine": GINE}
#: Models that take edge features (GINE needs them; GAT uses them when given).
EDGE_MODELS = frozenset({"gat", "gine"})
#: Models that cannot run without edge features.
NEEDS_EDGE_FEATURES = frozenset({"gine"})


def check_sizes(dropout: float, **sizes: int) -> None:
    """Refuse a model's sizes that are not integers >= 1, or a dropout outside [0, 1)."""
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout: expected 0 <= dropout < 1, got {dropout}")


class NodeClassifier(torch.nn.Module):
    """A ``basic_gnn`` model that returns the seeds' logits of a sampled batch."""

    def __init__(self, model: str, in_channels: int, out_channels: int, *, hidden_channels: int = 256,
                 num_layers: int = 2, dropout: float = 0.5, heads: int = 4,
                 edge_dim: int | None = None) -> None:
        """``model``: one of :data:`MODELS`; ``heads``: attention heads (GAT only;
        ``hidden_channels`` must be a multiple); ``edge_dim``: edge feature columns, for
        the models of :data:`EDGE_MODELS` (None: no edge features)."""
        super().__init__()
        if model not in MODELS:
            raise ValueError(f"model: expected one of {list(MODELS)}, got {model!r}")
        check_sizes(dropout, in_channels=in_channels, out_channels=out_channels,
                    hidden_channels=hidden_channels, num_layers=num_layers)
        if model == "gat" and (heads < 1 or hidden_channels % heads):
            raise ValueError(f"heads: expected an integer >= 1 dividing hidden_channels={hidden_channels}, "
                             f"got {heads}")
        if model in NEEDS_EDGE_FEATURES and edge_dim is None:
            raise ValueError(f"model: {model!r} needs edge features (edge_dim), got none; use a graph "
                             "with edge features and a loader with edge_features=True")
        if edge_dim is not None and (model not in EDGE_MODELS or edge_dim < 1):
            raise ValueError(f"edge_dim: expected None for {model!r} (edge features are taken by "
                             f"{sorted(EDGE_MODELS)}), or an integer >= 1; got {edge_dim}")
        self.num_layers = num_layers
        #: Edge feature columns the model takes (None: it takes no edge features).
        self.edge_dim = edge_dim
        #: Whether forward uses trim_to_layer (never for GCN, see the module docstring).
        self.trim = model != "gcn"
        extra: dict[str, int | str] = {"heads": heads} if model == "gat" else {}
        if edge_dim is not None:
            extra["edge_dim"] = edge_dim
        if model == "gine":  # as PyG's GINE examples: without it, sums of sums blow up and the net dies
            extra["norm"] = "batch_norm"
        self.gnn = MODELS[model](in_channels, hidden_channels, num_layers, out_channels=out_channels,
                                 dropout=dropout, **extra)

    def forward(self, x: Tensor, edge_index: Tensor, batch_size: int | None = None,
                num_sampled_nodes: Sequence[int] | None = None,
                num_sampled_edges: Sequence[int] | None = None, edge_attr: Tensor | None = None) -> Tensor:
        """Logits ``[batch_size, out_channels]`` of the first ``batch_size`` nodes (all
        nodes when ``batch_size`` is None); ``edge_attr`` for a model with ``edge_dim``."""
        if self.edge_dim is not None and edge_attr is None:
            raise ValueError("edge_attr: expected the batch's edge features (the model was built with "
                             f"edge_dim={self.edge_dim}; load with edge_features=True), got none")
        trim = self.trim and num_sampled_nodes is not None and num_sampled_edges is not None \
            and len(num_sampled_edges) >= self.num_layers
        nodes = list(num_sampled_nodes) if trim and num_sampled_nodes else None
        edges = list(num_sampled_edges) if trim and num_sampled_edges else None
        attr = edge_features(edge_attr) if self.edge_dim is not None and edge_attr is not None else None
        out = self.gnn(x, edge_index, edge_attr=attr, num_sampled_nodes_per_hop=nodes,
                       num_sampled_edges_per_hop=edges)
        return out if batch_size is None else out[:batch_size]


    @property
    def layerwise_inputs(self) -> frozenset[str]:
        """What :meth:`inference_per_layer` takes besides PyG's arguments: ``edge_attr``
        (a model with edge features), ``in_degree`` (GCN)."""
        return frozenset({"edge_attr"} if self.edge_dim is not None else set()) | \
            frozenset({"in_degree"} if isinstance(self.gnn, GCN) else set())

    def inference_per_layer(self, layer: int, x: Tensor, edge_index: Tensor, batch_size: int,
                            edge_attr: Tensor | None = None, in_degree: Tensor | None = None) -> Tensor:
        """Layer ``layer``'s outputs ``[batch_size, width]`` of the first ``batch_size``
        nodes, from every node's layer inputs ``x`` and the edges into the first nodes (all
        of them): PyG's ``BasicGNN.inference_per_layer``, with ``edge_attr`` (the edges'
        features) for a model with ``edge_dim`` and, for GCN, ``in_degree``: every node's
        in-degree in the whole graph, self-loops not counted, which its normalization reads
        (the batch's edges show only the seeds' in-edges)."""
        gnn = self.gnn
        conv = gnn.convs[layer]
        if isinstance(conv, GCNConv):
            if in_degree is None:
                raise ValueError("in_degree: expected every node's in-degree in the whole graph (GCN's "
                                 "normalization reads it), got none")
            out = _gcn_layer(conv, x, edge_index, batch_size, in_degree)
        elif self.edge_dim is not None:
            if edge_attr is None:
                raise ValueError(f"edge_attr: expected the batch's edge features (edge_dim={self.edge_dim}), "
                                 "got none")
            out = conv(x, edge_index, edge_attr=edge_features(edge_attr))[:batch_size]
        else:
            out = conv(x, edge_index)[:batch_size]
        if layer == gnn.num_layers - 1 and gnn.jk_mode is None:
            return out
        if gnn.act is not None and gnn.act_first:
            out = gnn.act(out)
        if gnn.norms is not None:
            out = gnn.norms[layer](out)
        if gnn.act is not None and not gnn.act_first:
            out = gnn.act(out)
        return out


def _gcn_layer(conv: GCNConv, x: Tensor, edge_index: Tensor, batch_size: int, in_degree: Tensor) -> Tensor:
    """``GCNConv`` of the first ``batch_size`` nodes (the targets of ``edge_index``, every
    in-edge of theirs) normalized as on the whole graph: an edge ``j -> i`` weighs
    ``1/sqrt((d_j + 1)(d_i + 1))`` and the self-loop ``1/(d_i + 1)``, ``d`` the in-degree
    without self-loops (PyG's ``gcn_norm`` with ``add_remaining_self_loops``)."""
    inv_sqrt = (in_degree.reshape(-1).to(x.device, torch.float32) + 1.0).pow(-0.5)
    keep = edge_index[0] != edge_index[1]  # the graph's self-loops give way to one of weight 1
    seeds = torch.arange(batch_size, device=edge_index.device)
    index = torch.cat([edge_index[:, keep], torch.stack([seeds, seeds])], dim=1)
    weight = inv_sqrt[index[0]] * inv_sqrt[index[1]]
    out: Tensor = conv.propagate(index, x=conv.lin(x), edge_weight=weight)[:batch_size]
    return out if conv.bias is None else out + conv.bias


def edge_features(edge_attr: Tensor) -> Tensor:
    """A batch's edge features as a model takes them: float32 ``[E, columns]``."""
    return edge_attr.reshape(edge_attr.shape[0], -1).float()


def edge_dim_of(shape: Sequence[int]) -> int:
    """Edge feature columns of rows of ``shape`` (``()``: one value per edge)."""
    dim = 1
    for d in shape:
        dim *= int(d)
    return dim


def batch_inputs(data: Data) -> tuple[Tensor, Tensor, int, list[int] | None, list[int] | None, Tensor | None]:
    """The positional inputs of :meth:`NodeClassifier.forward` for a loader batch; on a
    graph without features, the batch's node IDs stand where its features would
    (:class:`~trainer_client.featureless.EmbeddingInput` reads them)."""
    x = data.x if "x" in data else data.internal_n_id if "internal_n_id" in data else data.n_id
    return (x, data.edge_index, int(data.batch_size),
            data.num_sampled_nodes if "num_sampled_nodes" in data else None,
            data.num_sampled_edges if "num_sampled_edges" in data else None,
            data.edge_attr if "edge_attr" in data else None)


def seed_labels(batch: Data | HeteroData) -> Tensor:
    """The labels of a loader batch's seeds (-1: unlabeled), of either kind: the first
    ``batch_size`` nodes of the store that has ``batch_size`` (a ``Data``'s own, a
    ``HeteroData``'s seed type)."""
    store = next(s for s in batch.node_stores if "batch_size" in s)
    y: Tensor = store.y[: int(store.batch_size)]
    return y


def build_model(name: str, in_channels: int, out_channels: int, *, hidden_channels: int = 256,
                num_layers: int = 2, dropout: float = 0.5, heads: int = 4,
                edge_dim: int | None = None) -> NodeClassifier:
    """A :class:`NodeClassifier` by model name (``sage``, ``gcn``, ``gat``, ``gin``, ``gine``)."""
    return NodeClassifier(name, in_channels, out_channels, hidden_channels=hidden_channels,
                          num_layers=num_layers, dropout=dropout, heads=heads, edge_dim=edge_dim)
