"""What a loader is asked to iterate, checked before anything is streamed: the split name
(``valid`` is taken for ``val``), the input nodes (original IDs or a boolean mask, as
PyG's ``NeighborLoader`` takes them, and on a typed graph PyG's typed forms: a node type,
``(node_type, IDs)``), ``num_neighbors`` (a list, or per edge type) and the
``NeighborLoader`` keywords that have no meaning here (each refused with what to use
instead)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import torch

from partitioner.graph import EdgeType, GraphDataError, edge_type_name, parse_edge_type
from protos import sampling_pb2 as pb
from protos.codec import MAX_CHUNK_BYTES
from trainer_client.graph import TypedGraph

log = logging.getLogger(__name__)

#: Split names a loader may iterate.
SPLITS = ("train", "val", "test")
#: Other names of splits (OGB calls the validation split ``valid``).
SPLIT_ALIASES = {"valid": "val", "validation": "val", "training": "train", "testing": "test"}

#: Input nodes: original node IDs (a 1-d integer tensor, array or sequence), or a
#: boolean mask over the graph's nodes.
InputNodes: TypeAlias = torch.Tensor | np.ndarray | Sequence[int] | Sequence[bool]
#: PyG's ``num_neighbors``: one fanout list for every edge type, or per edge type (a
#: ``(src, rel, dst)`` tuple or ``"src__rel__dst"``; edge types left out draw nothing).
NumNeighbors = Sequence[int] | Mapping[EdgeType | str, Sequence[int]]
#: Batch layouts: one ordering of all seeds across partitions, or per partition.
BATCH_LAYOUTS = ("global", "partition")
#: Feature dtypes on the wire, by name; "stored" keeps the partition's own dtype.
WIRE_FEATURE_DTYPES: dict[str, int] = {
    "float32": pb.FLOAT32,
    "float16": pb.FLOAT16,
    "bfloat16": pb.BFLOAT16,
    "stored": pb.DTYPE_UNSPECIFIED,
}
#: Most explicit seeds one loader may have (they travel in one message of the request).
MAX_SEEDS = MAX_CHUNK_BYTES // 8

#: ``torch_geometric.loader.NeighborLoader`` keywords the loader does not take, and what
#: to do instead.
UNSUPPORTED_KEYWORDS: Mapping[str, str] = {
    "num_workers": "sampling runs on the sampling servers; use prefetch= for batches in flight",
    "persistent_workers": "sampling runs on the sampling servers; nothing to keep alive here",
    "worker_init_fn": "sampling runs on the sampling servers; there are no loader workers",
    "collate_fn": "batches arrive as PyG Data; transform them in the training loop",
    "transform": "apply the transform to each batch in the training loop",
    "filter_per_worker": "filtering happens on the servers; there are no loader workers",
    "neighbor_sampler": "the sampling servers sample; pass num_neighbors=, replace=, weighted=",
    "subgraph_type": "batches are directional sampled subgraphs, as PyG's default",
    "disjoint": "disjoint subgraphs per seed are not supported",
    "temporal_strategy": "temporal sampling is not supported",
    "time_attr": "temporal sampling is not supported",
    "input_time": "temporal sampling is not supported",
    "weight_attr": "edge weights come from the partition; pass weighted=True",
    "is_sorted": "the partitions are stored sorted by target (CSC); nothing to say",
    "directed": "batches are directional sampled subgraphs (directed=True)",
    "data": "pass the sampling servers' addresses as the first argument",
    "sampler": "the sampling servers sample; pass num_neighbors=",
}


def is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``low .. high``; raises naming the field otherwise."""
    if not is_int(value) or int(value) < low or (high is not None and int(value) > high):  # type: ignore[call-overload]
        bound = f"an integer >= {low}" if high is None else f"an integer in {low} .. {high}"
        raise ValueError(f"{name}: expected {bound}, got {value!r}")
    return int(value)  # type: ignore[call-overload]


def check_keywords(kwargs: Mapping[str, object], loader: str) -> None:
    """Refuse keywords the ``loader`` class does not take, saying what to use instead."""
    for name in kwargs:
        if name in UNSUPPORTED_KEYWORDS:
            raise TypeError(f"{name}: not supported by {loader} ({UNSUPPORTED_KEYWORDS[name]})")
        raise TypeError(f"{loader} got an unexpected keyword argument {name!r}")


def edge_attr_name(edge_features: bool | str) -> str:
    """The attribute a loader's ``edge_features`` puts edge features in ("" for none)."""
    if isinstance(edge_features, bool):
        return "edge_attr" if edge_features else ""
    if not isinstance(edge_features, str) or not edge_features.isidentifier():
        raise ValueError(f"edge_features: expected True, False or an attribute name such as "
                         f"'edge_attr', got {edge_features!r}")
    if edge_features in RESERVED_BATCH_ATTRIBUTES:
        raise ValueError(f"edge_features: expected an attribute name a batch does not use already, "
                         f"got {edge_features!r}")
    return edge_features


#: Attributes of a batch an edge feature name may not take.
RESERVED_BATCH_ATTRIBUTES = frozenset({
    "x", "y", "edge_index", "n_id", "e_id", "batch_size", "input_id", "num_nodes", "num_sampled_nodes",
    "num_sampled_edges", "internal_n_id", "x_cached"})


def check_edge_options(graph: TypedGraph, features: bool, ids: bool) -> None:
    """Refuse edge features or IDs the servers cannot send, saying why."""
    if (features or ids) and not graph.has_edge_ids:
        asked = "edge_features" if features else "edge_ids"
        raise ValueError(f"{asked}: expected a graph whose partitions store edge IDs, but the servers' "
                         f"were written without them (ClusterInfo.has_edge_ids); partition it again")
    if features and not graph.edge_feature_shapes:
        raise ValueError("edge_features: expected a graph with edge features, but the servers' has none "
                         "(ClusterInfo.edge_features)")


def split_name(split: str) -> str:
    """``split`` checked, with ``valid`` and the like taken for their split."""
    if split in SPLIT_ALIASES:
        log.info("split %r: using the %r split", split, SPLIT_ALIASES[split])
        return SPLIT_ALIASES[split]
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {list(SPLITS)} (or 'valid' for 'val'), got {split!r}")
    return split


def input_array(nodes: InputNodes | None, name: str) -> np.ndarray | None:
    """Input nodes (integer IDs or a boolean mask) as a 1-d array, form checked; None stays None."""
    if nodes is None:
        return None
    array = nodes.detach().cpu().numpy() if isinstance(nodes, torch.Tensor) else np.asarray(nodes)
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a 1-d array of node IDs or a boolean mask, got shape "
                         f"{list(array.shape)}")
    if array.size == 0:
        raise ValueError(f"{name}: expected at least one node, got an empty array (nothing to iterate)")
    if array.dtype != np.bool_ and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name}: expected integer node IDs or a boolean mask, got dtype {array.dtype}")
    return array


def original_ids(array: np.ndarray, num_nodes: int, name: str, max_nodes: int) -> np.ndarray:
    """Original node IDs of checked input nodes (a mask's ``True`` positions)."""
    if array.dtype == np.bool_:
        if array.size != num_nodes:
            raise ValueError(f"{name}: expected a boolean mask of {num_nodes} entries (one per node), "
                             f"got {array.size}")
        array = np.flatnonzero(array)
        if array.size == 0:
            raise ValueError(f"{name}: expected a mask with at least one True entry, got none")
    ids = array.astype(np.int64, copy=False)
    bad = ids[(ids < 0) | (ids >= num_nodes)]
    if bad.size:
        raise ValueError(f"{name}: expected node IDs in 0 .. {num_nodes - 1}, got {bad[:5].tolist()}")
    uniq, counts = np.unique(ids, return_counts=True)
    if uniq.size != ids.size:
        raise ValueError(f"{name}: expected each node ID once, got {ids.size - uniq.size} repeats "
                         f"(e.g. {int(uniq[counts > 1][0])})")
    if ids.size > max_nodes:
        raise ValueError(f"{name}: expected at most {max_nodes} nodes (one message), got {ids.size}")
    return ids


@dataclass(frozen=True)
class GivenInput:
    """``input_nodes`` as given, sorted out before connecting."""

    #: The node type named (``("author", ids)`` or ``"author"``); None: not named.
    node_type: str | None = None
    #: Checked node IDs (original IDs or a mask); None: a split, or every node of ``node_type``.
    nodes: np.ndarray | None = None
    #: A split named through ``input_nodes`` (``"train"``, ``"valid"`` ...).
    split: str | None = None


def seeds_source(split: str | None, input_nodes: object, seeds: object) -> tuple[str | None, GivenInput]:
    """The split to iterate (None: the input nodes' own) and the input nodes, from a
    loader's ``split``, ``input_nodes`` and ``seeds`` (another name for ``input_nodes``) in
    PyG's forms: IDs or a mask, a split name, a node type (every node of it), or
    ``(node_type, IDs or mask or None)``."""
    if input_nodes is not None and seeds is not None:
        raise ValueError("input_nodes, seeds: expected one of them (seeds is another name for "
                         "input_nodes), got both")
    nodes = input_nodes if input_nodes is not None else seeds
    if isinstance(nodes, str):
        named = nodes in SPLITS or nodes in SPLIT_ALIASES
        given = GivenInput(split=nodes) if named else GivenInput(node_type=nodes)
    elif isinstance(nodes, tuple) and len(nodes) == 2 and isinstance(nodes[0], str):
        given = GivenInput(node_type=nodes[0], nodes=input_array(nodes[1], "input_nodes"))
    else:
        given = GivenInput(nodes=input_array(nodes, "input_nodes"))  # type: ignore[arg-type]
    if split is not None and (given.nodes is not None or given.node_type or given.split):
        raise ValueError(f"split, input_nodes: expected one of them, got split={split!r} and nodes")
    split = split if split is not None else given.split
    if split is not None:
        return split_name(split), given
    return ("train" if given.nodes is None and given.node_type is None else None), given


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


def request_fanouts(seed_type: str, num_neighbors: NumNeighbors, graph: TypedGraph
                    ) -> tuple[list[int], pb.TypedEpochOptions | None]:
    """``EpochRequest.fanouts`` and ``EpochRequest.typed`` (None on a plain graph)."""
    if isinstance(num_neighbors, Mapping):
        return [], pb.TypedEpochOptions(seed_type=seed_type, edge_fanouts=edge_fanouts(num_neighbors, graph))
    return [int(f) for f in num_neighbors], pb.TypedEpochOptions(seed_type=seed_type) if graph.typed else None


def check_settings(num_neighbors: NumNeighbors, batch_size: int, rank: int, world_size: int, prefetch: int,
                   seed: int, feature_dtype: str) -> None:
    """Check the plain arguments; errors name the field."""
    for fanouts in fanout_lists(num_neighbors):
        if not fanouts or not all(is_int(f) for f in fanouts):
            raise ValueError(f"num_neighbors: expected a non-empty list of integers (or a dict of "
                             f"them per edge type), got {num_neighbors!r}")
        if any(f < -1 for f in fanouts):
            raise ValueError(f"num_neighbors: expected fanouts >= -1 (-1 = all neighbors), got {fanouts}")
    check_int("batch_size", batch_size, 1, 2**31 - 1)
    check_int("world_size", world_size, 1)
    check_int("rank", rank, 0, int(world_size) - 1)
    check_int("prefetch", prefetch, 1)
    check_int("seed", seed, 0, 2**64 - 1)
    if feature_dtype not in WIRE_FEATURE_DTYPES:
        raise ValueError(f"feature_dtype: expected one of {list(WIRE_FEATURE_DTYPES)}, got {feature_dtype!r}")
