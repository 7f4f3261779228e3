"""What :class:`~trainer_client.loader.RemoteNeighborLoader` adds on a typed cluster
(``ClusterInfo.typed``): the graph's typed facts, PyG's typed ``input_nodes`` and
``num_neighbors`` forms, the typed part of the epoch request, and the last steps of a
``HeteroData`` batch (device, feature dtype, ``input_id``).

The batch plan, streaming, resuming and decoding checks are the homogeneous loader's
own; only these pieces differ.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch_geometric.data import HeteroData

from partitioner.graph import EdgeType, GraphDataError, edge_type_name, parse_edge_type
from protos import sampling_pb2 as pb
from protos.channel import ProtocolError
from trainer_client.cache import CacheError, FeatureCache
from trainer_client.hetero_decode import TypedSpec
from trainer_client.inputs import SPLIT_ALIASES, SPLITS, InputNodes

log = logging.getLogger(__name__)

#: PyG's ``num_neighbors``: one fanout list for every edge type, or per edge type (a
#: ``(src, rel, dst)`` tuple or ``"src__rel__dst"``; edge types left out draw nothing).
NumNeighbors = Sequence[int] | Mapping[EdgeType | str, Sequence[int]]


@dataclass(frozen=True)
class TypedGraph:
    """The typed facts of a cluster (``ClusterInfo.typed``), for building a model."""

    #: Node types, in the graph's order.
    node_types: tuple[str, ...]
    #: Edge types ``(src, rel, dst)``, in the graph's order.
    edge_types: tuple[EdgeType, ...]
    #: The labelled node type (its splits are the loader's ``"train"``, ...).
    target_type: str
    #: Nodes per type (``n_id`` of a type lies in ``0 .. num_nodes[t]-1``).
    num_nodes: dict[str, int]
    #: Feature columns per type; 0 for featureless types (their batches carry ``n_id``
    #: only: index a learnable embedding with it).
    feature_dims: dict[str, int]
    #: Number of classes of the target type's labels.
    num_classes: int
    #: Node type to its partition book (global IDs per type).
    books: dict[str, np.ndarray]

    @staticmethod
    def from_info(info: pb.ClusterInfo) -> TypedGraph:
        t = info.typed
        return TypedGraph(
            node_types=tuple(n.name for n in t.node_types),
            edge_types=tuple((e.src, e.rel, e.dst) for e in t.edge_types),
            target_type=t.target_type,
            num_nodes={n.name: int(n.num_nodes) for n in t.node_types},
            feature_dims={n.name: int(n.feature_dim) for n in t.node_types},
            num_classes=int(info.num_classes),
            books={n.name: np.asarray(n.partition_book, dtype=np.int64) for n in t.node_types})

    def metadata(self) -> tuple[list[str], list[EdgeType]]:
        """``(node_types, edge_types)``, as PyG's ``HeteroData.metadata()`` (for ``to_hetero``)."""
        return list(self.node_types), list(self.edge_types)


@dataclass(frozen=True)
class TypedInput:
    """``input_nodes`` as given, sorted out before connecting."""

    #: The node type named (``("author", ids)`` or ``"author"``); None: not named.
    node_type: str | None = None
    #: Node IDs (original IDs or a mask); None: a split, or every node of ``node_type``.
    nodes: InputNodes | None = None
    #: A split named through ``input_nodes`` (``"train"``, ``"valid"`` ...).
    split: str | None = None


def sort_input(nodes: object) -> TypedInput:
    """PyG's ``input_nodes`` forms: IDs or a mask, a split name, a node type (every node
    of it), or ``(node_type, IDs or mask or None)``."""
    if isinstance(nodes, str):
        if nodes in SPLITS or nodes in SPLIT_ALIASES:
            return TypedInput(split=nodes)
        return TypedInput(node_type=nodes)
    if isinstance(nodes, tuple) and len(nodes) == 2 and isinstance(nodes[0], str):
        return TypedInput(node_type=nodes[0], nodes=nodes[1])
    return TypedInput(nodes=nodes)  # type: ignore[arg-type]


def fanout_lists(num_neighbors: object) -> list[list[int]]:
    """The fanout lists of ``num_neighbors`` (one, or one per edge type given); checks the
    dict form's keys and lengths only."""
    if not isinstance(num_neighbors, Mapping):
        return [list(num_neighbors)] if isinstance(num_neighbors, Sequence) \
            and not isinstance(num_neighbors, str) else [[]]
    if not num_neighbors:
        raise ValueError("num_neighbors: expected fanouts for at least one edge type, got {}")
    lists = []
    for key, value in num_neighbors.items():
        if not (isinstance(key, str) or (isinstance(key, tuple) and len(key) == 3)):
            raise ValueError(f"num_neighbors: expected edge types ('src', 'rel', 'dst') or "
                             f"'src__rel__dst' as keys, got {key!r}")
        lists.append(list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [])
    if len({len(v) for v in lists}) != 1:
        raise ValueError(f"num_neighbors: expected the same number of hops for every edge type, "
                         f"got {dict(num_neighbors)}")
    return lists


def edge_fanouts(num_neighbors: Mapping[EdgeType | str, Sequence[int]], graph: TypedGraph
                 ) -> list[pb.EdgeTypeFanouts]:
    """The dict form as ``TypedEpochOptions.edge_fanouts``, keys checked against the graph."""
    out = []
    for key, fanouts in num_neighbors.items():
        try:
            et = parse_edge_type(key) if isinstance(key, str) else (key[0], key[1], key[2])
        except GraphDataError:
            et = None
        if et not in graph.edge_types:
            raise ValueError(f"num_neighbors: expected edge types of the graph "
                             f"{[edge_type_name(e) for e in graph.edge_types]}, got {key!r}")
        out.append(pb.EdgeTypeFanouts(edge_type=edge_type_name(et), fanouts=[int(f) for f in fanouts]))
    return out


def typed_options(seed_type: str, num_neighbors: NumNeighbors, graph: TypedGraph
                  ) -> tuple[list[int], pb.TypedEpochOptions]:
    """``EpochRequest.fanouts`` and ``EpochRequest.typed`` of a typed loader."""
    if isinstance(num_neighbors, Mapping):
        return [], pb.TypedEpochOptions(seed_type=seed_type,
                                        edge_fanouts=edge_fanouts(num_neighbors, graph))
    return [int(f) for f in num_neighbors], pb.TypedEpochOptions(seed_type=seed_type)


def typed_spec(graph: TypedGraph, seed_type: str) -> TypedSpec:
    return TypedSpec(node_types=graph.node_types, edge_types=graph.edge_types,
                     feature_dims=dict(graph.feature_dims), target_type=graph.target_type,
                     seed_type=seed_type)


def finish_typed(data: HeteroData, seed_type: str, input_id: np.ndarray, device: torch.device, *,
                 feature_dtype: torch.dtype | None, non_blocking: bool, keep_internal_ids: bool,
                 caches: Mapping[str, FeatureCache] | None = None) -> tuple[HeteroData, int, int]:
    """A decoded typed batch on ``device``: ``input_id`` on the seed type, the rows of
    ``x`` that the trainer's feature cache holds filled in from ``caches`` (per node
    type), features cast there (they cross the bus in their wire dtype),
    ``internal_n_id`` dropped unless kept. Also returns the batch's feature rows and how
    many of them came from the caches."""
    data[seed_type].input_id = torch.from_numpy(input_id)
    data = data.to(device, non_blocking=non_blocking)
    rows = cached_rows = 0
    for t in data.node_types:
        store = data[t]
        if "x" not in store:
            continue
        rows += store.num_nodes
        if "x_cached" in store:
            cached = store.x_cached
            del store.x_cached
            cache = (caches or {}).get(t)
            if cache is None:
                raise ProtocolError(f"StreamMinibatches: tensor 'x_cached/{t}': expected none (this "
                                    f"loader caches no {t!r} features), got one",
                                    what="StreamMinibatches")
            ids = store.internal_n_id if "internal_n_id" in store else store.n_id
            cached_rows += int(cached.sum()) if cached.is_cuda else int(np.count_nonzero(cached.numpy()))
            try:
                store.x = cache.assemble(store.x, cached, ids, feature_dtype)
            except CacheError as exc:
                raise ProtocolError(f"StreamMinibatches: node type {t!r}: {exc}",
                                    what="StreamMinibatches") from exc
        if feature_dtype is not None and store.x.dtype != feature_dtype:
            store.x = store.x.to(feature_dtype)
    if not keep_internal_ids:
        for store in data.node_stores:
            if "internal_n_id" in store:
                del store.internal_n_id
    return data, rows, cached_rows
