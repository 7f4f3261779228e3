"""GNN node classifiers for sampled minibatches: GraphSAGE (default), GCN, GAT and GIN.

The layers are PyG's ``basic_gnn`` models. When a batch carries ``num_sampled_nodes`` /
``num_sampled_edges`` and the model has no more layers than the batch has hops, the
forward pass uses PyG's ``trim_to_layer``: layer ``k`` skips the nodes and edges of the
outermost ``k`` hops, which cannot reach the seeds any more. The seeds' logits are the
same as without trimming, with less work. GCN is the exception and never trims: its
symmetric normalization reads the *source* nodes' degrees, which trimming changes. The
output holds the logits of the first ``batch_size`` nodes (the seeds).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch_geometric.data import Data, HeteroData
from torch_geometric.nn.models import GAT, GCN, GIN, GraphSAGE
from torch_geometric.nn.models.basic_gnn import BasicGNN

#: Model names, and the PyG class each builds.
MODELS: dict[str, type[BasicGNN]] = {"sage": GraphSAGE, "gcn": GCN, "gat": GAT, "gin": GIN}


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
                 num_layers: int = 2, dropout: float = 0.5, heads: int = 4) -> None:
        """``model``: one of :data:`MODELS`; ``heads``: attention heads (GAT only;
        ``hidden_channels`` must be a multiple)."""
        super().__init__()
        if model not in MODELS:
            raise ValueError(f"model: expected one of {list(MODELS)}, got {model!r}")
        check_sizes(dropout, in_channels=in_channels, out_channels=out_channels,
                    hidden_channels=hidden_channels, num_layers=num_layers)
        if model == "gat" and (heads < 1 or hidden_channels % heads):
            raise ValueError(f"heads: expected an integer >= 1 dividing hidden_channels={hidden_channels}, "
                             f"got {heads}")
        self.num_layers = num_layers
        #: Whether forward uses trim_to_layer (never for GCN, see the module docstring).
        self.trim = model != "gcn"
        self.gnn = MODELS[model](in_channels, hidden_channels, num_layers, out_channels=out_channels,
                                 dropout=dropout, **({"heads": heads} if model == "gat" else {}))

    def forward(self, x: Tensor, edge_index: Tensor, batch_size: int | None = None,
                num_sampled_nodes: Sequence[int] | None = None,
                num_sampled_edges: Sequence[int] | None = None) -> Tensor:
        """Logits ``[batch_size, out_channels]`` of the first ``batch_size`` nodes (all
        nodes when ``batch_size`` is None)."""
        trim = self.trim and num_sampled_nodes is not None and num_sampled_edges is not None \
            and len(num_sampled_edges) >= self.num_layers
        nodes = list(num_sampled_nodes) if trim and num_sampled_nodes else None
        edges = list(num_sampled_edges) if trim and num_sampled_edges else None
        out = self.gnn(x, edge_index, num_sampled_nodes_per_hop=nodes, num_sampled_edges_per_hop=edges)
        return out if batch_size is None else out[:batch_size]


def batch_inputs(data: Data) -> tuple[Tensor, Tensor, int, list[int] | None, list[int] | None]:
    """The positional inputs of :meth:`NodeClassifier.forward` for a loader batch."""
    return (data.x, data.edge_index, int(data.batch_size),
            data.num_sampled_nodes if "num_sampled_nodes" in data else None,
            data.num_sampled_edges if "num_sampled_edges" in data else None)


def seed_labels(batch: Data | HeteroData) -> Tensor:
    """The labels of a loader batch's seeds (-1: unlabeled), of either kind: the first
    ``batch_size`` nodes of the store that has ``batch_size`` (a ``Data``'s own, a
    ``HeteroData``'s seed type)."""
    store = next(s for s in batch.node_stores if "batch_size" in s)
    y: Tensor = store.y[: int(store.batch_size)]
    return y


def build_model(name: str, in_channels: int, out_channels: int, *, hidden_channels: int = 256,
                num_layers: int = 2, dropout: float = 0.5, heads: int = 4) -> NodeClassifier:
    """A :class:`NodeClassifier` by model name (``sage``, ``gcn``, ``gat``, ``gin``)."""
    return NodeClassifier(name, in_channels, out_channels, hidden_channels=hidden_channels,
                          num_layers=num_layers, dropout=dropout, heads=heads)
