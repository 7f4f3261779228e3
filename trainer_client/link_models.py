"""Link predictors for sampled link batches: a GNN encoder that embeds the batch's nodes and
a decoder that scores (source, destination) pairs, as PyG's link-prediction examples and
OGB's ``ogbl-citation2`` / ``ogbl-collab`` baselines build them.

* Encoder: a plain graph's :class:`~trainer_client.models.NodeClassifier` (GraphSAGE by
  default) with ``hidden`` output channels, returning every kept node's embedding; a typed
  graph's R-GCN or ``to_hetero`` GraphSAGE (:mod:`trainer_client.typed_models`) with
  ``hidden`` output channels per node type, returning the source and destination types'.
* Decoder (``--decoder``): ``dot`` scores ``<h_s, h_d>``; ``mlp`` scores
  ``MLP(h_s * h_d)`` (OGB's ``LinkPredictor``: the Hadamard product, a hidden layer, one
  logit). Both broadcast, so one source row scores ``[P, K]`` negatives at once.

A batch is read as PyG's ``LinkNeighborLoader`` lays it out (:func:`link_targets`):
``edge_label_index`` / ``edge_label`` (binary mode, or no negatives), or ``src_index`` /
``dst_pos_index`` / ``dst_neg_index`` (triplet mode and given negatives); on a ``HeteroData``
the first two on the edge type's store, the others on the source / destination type's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch_geometric.data import Data, HeteroData

from partitioner.graph import PLAIN_NODE_TYPE, EdgeType
from trainer_client.featureless import EmbeddingInput, node_ids, plain_embedding
from trainer_client.graph import TypedGraph
from trainer_client.models import MODELS, NodeClassifier
from trainer_client.typed_models import RGCN, TYPED_MODELS, EmbeddingFactory, TypedSAGE, node_ids_of

#: ``--decoder`` choices.
DECODERS = ("dot", "mlp")
#: Plain-graph encoders a link predictor can use (GINE, and GAT with ``edge_dim``, on a
#: graph with edge features).
LINK_MODELS = tuple(sorted(MODELS))


class DotDecoder(nn.Module):
    """``score(s, d) = <h_s, h_d>`` (broadcasting over leading dimensions)."""

    def forward(self, h_src: Tensor, h_dst: Tensor) -> Tensor:
        return (h_src * h_dst).sum(dim=-1)


class MLPDecoder(nn.Module):
    """``score(s, d) = MLP(h_s * h_d)``: Linear, ReLU, dropout, Linear to one logit."""

    def __init__(self, channels: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.lin1 = nn.Linear(channels, channels)
        self.lin2 = nn.Linear(channels, 1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h_src: Tensor, h_dst: Tensor) -> Tensor:
        h = self.dropout(torch.relu(self.lin1(h_src * h_dst)))
        out: Tensor = self.lin2(h).squeeze(-1)
        return out


def build_decoder(name: str, channels: int, dropout: float = 0.0) -> nn.Module:
    """A decoder by name (:data:`DECODERS`)."""
    if name == "dot":
        return DotDecoder()
    if name == "mlp":
        return MLPDecoder(channels, dropout)
    raise ValueError(f"decoder: expected one of {list(DECODERS)}, got {name!r}")


@dataclass(frozen=True)
class LinkTargets:
    """The pairs a link batch asks to score, in the batch's local node numbering."""

    #: Source positions ``[M]`` (binary) or ``[P]`` (triplet / given negatives), into the
    #: source type's nodes.
    src: Tensor
    #: Destination positions ``[M]`` or ``[P]`` (the positives), into the destination type's.
    dst: Tensor
    #: Labels ``[M]`` (1 positive, 0 negative; all ones when the batch has none); None in
    #: triplet layout.
    label: Tensor | None = None
    #: Negative destinations ``[P, K]`` per positive (triplet layout); None in binary layout.
    dst_neg: Tensor | None = None


def link_targets(batch: Data | HeteroData, edge_type: EdgeType) -> LinkTargets:
    """What to score in ``batch`` (see the module doc); ``edge_type`` names a typed batch's
    seed edge type (ignored on a ``Data``)."""
    typed = isinstance(batch, HeteroData)
    edges = batch[edge_type] if typed else batch
    src_store = batch[edge_type[0]] if typed else batch
    dst_store = batch[edge_type[2]] if typed else batch
    if "edge_label_index" in edges:
        index = edges.edge_label_index
        label = edges.edge_label if "edge_label" in edges else torch.ones(index.shape[1], device=index.device)
        return LinkTargets(index[0], index[1], label.reshape(-1).float())
    if "src_index" in src_store and "dst_pos_index" in dst_store:
        neg = dst_store.dst_neg_index if "dst_neg_index" in dst_store else None
        if neg is not None and neg.dim() == 1:  # PyG's triplet layout with amount 1
            neg = neg.reshape(-1, 1)
        return LinkTargets(src_store.src_index, dst_store.dst_pos_index, dst_neg=neg)
    where = f"batch[{edge_type!r}]" if typed else "batch"
    raise ValueError(f"{where}: expected edge_label_index (binary) or src_index/dst_pos_index (triplet) of "
                     f"a link loader's batch, got {sorted(edges.keys())}")


def link_inputs(batch: Data | HeteroData) -> tuple[Any, ...]:
    """The encoder's inputs of a link batch: ``(x, edge_index, num_sampled_nodes,
    num_sampled_edges, edge_attr)`` of a ``Data`` (``edge_attr`` None when the batch has
    none); ``(x_dict, edge_index_dict, n_id_dict, num_sampled_nodes, num_sampled_edges)``
    of a ``HeteroData`` (counts None when absent)."""
    nodes = batch.num_sampled_nodes if "num_sampled_nodes" in batch else None
    sampled = batch.num_sampled_edges if "num_sampled_edges" in batch else None
    if not isinstance(batch, HeteroData):  # a graph without features: node IDs where x would be
        x = batch.x if "x" in batch else node_ids(batch)
        return x, batch.edge_index, nodes, sampled, batch.edge_attr if "edge_attr" in batch else None
    x_dict, edges = (batch.collect(key, allow_empty=True) for key in ("x", "edge_index"))
    n_id = node_ids_of(batch)
    return (x_dict, edges, n_id, dict(nodes) if isinstance(nodes, dict) else None,
            {tuple(k): v for k, v in sampled.items()} if isinstance(sampled, dict) else None)


class LinkPredictor(nn.Module):
    """Encoder and decoder; ``forward(inputs, src, dst)`` scores pairs of one batch
    (``inputs``: :func:`link_inputs`; ``dst`` ``[M]`` pairs with ``src`` ``[M]``, or
    ``[P, K]`` scores every row's K destinations against ``src`` ``[P]``)."""

    def __init__(self, encoder: nn.Module, decoder: nn.Module, edge_type: EdgeType, typed: bool) -> None:
        super().__init__()
        self.encoder, self.decoder = encoder, decoder
        self.edge_type, self.typed = edge_type, typed

    def embed(self, inputs: tuple[Any, ...]) -> tuple[Tensor, Tensor]:
        """Embeddings of the batch's source-type and destination-type nodes."""
        if not self.typed:
            x, edge_index, nodes, edges, edge_attr = inputs
            h: Tensor = self.encoder(x, edge_index, None, nodes, edges, edge_attr)
            return h, h
        assert isinstance(self.encoder, (RGCN, TypedSAGE))
        out = self.encoder.embed(*inputs)
        return out[self.edge_type[0]], out[self.edge_type[2]]

    def score(self, h_src: Tensor, h_dst: Tensor, src: Tensor, dst: Tensor) -> Tensor:
        """Scores of the pairs ``(src, dst)`` given the embeddings (see the class doc)."""
        left = h_src[src]
        if dst.dim() == 2:
            left = left.unsqueeze(1)
        out: Tensor = self.decoder(left, h_dst[dst])
        return out

    def forward(self, inputs: tuple[Any, ...], src: Tensor, dst: Tensor) -> Tensor:
        h_src, h_dst = self.embed(inputs)
        return self.score(h_src, h_dst, src, dst)


def build_link_model(name: str, graph: TypedGraph, edge_type: EdgeType, *, decoder: str = "dot",
                     hidden_channels: int = 256, num_layers: int = 2, dropout: float = 0.5,
                     edge_dim: int | None = None, embeddings: EmbeddingFactory | None = None,
                     embedding_dim: int | None = None) -> LinkPredictor:
    """A :class:`LinkPredictor` with encoder ``name`` (:data:`LINK_MODELS` on a plain
    graph, :data:`~trainer_client.typed_models.TYPED_MODELS` on a typed one) for seed
    edges of ``edge_type``; ``edge_dim``: the edge features' columns, for a plain
    encoder that takes them; ``embeddings``: the featureless types' input modules
    (default: dense embeddings, ``embedding_dim`` wide on a plain graph)."""
    if edge_type not in graph.edge_types:
        raise ValueError(f"edge_type: expected one of the graph's {list(graph.edge_types)}, "
                         f"got {edge_type!r}")
    if not graph.typed:
        if name not in LINK_MODELS:
            raise ValueError(f"model: expected one of {list(LINK_MODELS)} on a plain graph, got {name!r}")
        features = graph.feature_dims[PLAIN_NODE_TYPE]
        width = features or embedding_dim or hidden_channels
        encoder: nn.Module = NodeClassifier(name, width, hidden_channels, hidden_channels=hidden_channels,
                                            num_layers=num_layers, dropout=dropout, edge_dim=edge_dim)
        if not features:
            encoder = EmbeddingInput(plain_embedding(graph, width, embeddings), encoder)
    else:
        if name not in TYPED_MODELS:
            raise ValueError(f"model: expected one of {list(TYPED_MODELS)} on a typed graph, got {name!r}")
        # the encoder's "classes" are the embedding's channels
        facts = dataclasses.replace(graph, num_classes=hidden_channels)
        ends = list(dict.fromkeys([edge_type[0], edge_type[2]]))
        encoder = RGCN(facts, hidden_channels=hidden_channels, num_layers=num_layers, dropout=dropout,
                       out_types=ends, embeddings=embeddings) if name == "rgcn" else \
            TypedSAGE(facts, hidden_channels=hidden_channels, num_layers=num_layers, dropout=dropout,
                      embeddings=embeddings, out_types=ends)
    return LinkPredictor(encoder, build_decoder(decoder, hidden_channels, dropout), edge_type, graph.typed)
