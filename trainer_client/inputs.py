"""What a loader is asked to iterate, checked before anything is streamed: the split name
(``valid`` is taken for ``val``), the input nodes (original IDs or a boolean mask, as
PyG's ``NeighborLoader`` takes them) and the ``NeighborLoader`` keywords that have no
meaning here (each refused with what to use instead)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TypeAlias

import numpy as np
import torch

log = logging.getLogger(__name__)

#: Split names a loader may iterate.
SPLITS = ("train", "val", "test")
#: Other names of splits (OGB calls the validation split ``valid``).
SPLIT_ALIASES = {"valid": "val", "validation": "val", "training": "train", "testing": "test"}

#: Input nodes: original node IDs (a 1-d integer tensor, array or sequence), or a
#: boolean mask over the graph's nodes.
InputNodes: TypeAlias = torch.Tensor | np.ndarray | Sequence[int] | Sequence[bool]

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


def check_keywords(kwargs: Mapping[str, object]) -> None:
    """Refuse keywords the loader does not take, saying what to use instead."""
    for name in kwargs:
        if name in UNSUPPORTED_KEYWORDS:
            raise TypeError(f"{name}: not supported by RemoteNeighborLoader ({UNSUPPORTED_KEYWORDS[name]})")
        raise TypeError(f"RemoteNeighborLoader got an unexpected keyword argument {name!r}")


def split_name(split: str) -> str:
    """``split`` checked, with ``valid`` and the like taken for their split."""
    if split in SPLIT_ALIASES:
        log.info("split %r: using the %r split", split, SPLIT_ALIASES[split])
        return SPLIT_ALIASES[split]
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {list(SPLITS)} (or 'valid' for 'val'), got {split!r}")
    return split


def input_array(nodes: InputNodes, name: str) -> np.ndarray:
    """Input nodes as a 1-d array (integer IDs, or a boolean mask); checks the form only."""
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
