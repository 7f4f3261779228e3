"""Fanouts and draw keys: PyG's ``num_neighbors`` forms checked into one fanout list per
edge type, and the key of one relation's draws in a batch."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from partitioner.graph import EdgeType, GraphDataError, edge_type_name, parse_edge_type

_MASK64 = (1 << 64) - 1

#: PyG's ``num_neighbors``: one fanout list for every edge type, or a dict from edge type
#: (a ``(src, rel, dst)`` tuple or ``"src__rel__dst"``) to its fanout list.
NumNeighbors = Sequence[int] | Mapping[Any, Sequence[int]]


def check_fanouts(fanouts: Sequence[int]) -> list[int]:
    """Fanouts as ints; ``-1`` means all neighbors (as in PyG)."""
    out = [int(f) for f in fanouts]
    if not out:
        raise ValueError("fanouts: expected at least one hop, got []")
    bad = [f for f in out if f < -1]
    if bad:
        raise ValueError(f"fanouts: expected integers >= 0, or -1 for all neighbors; got {out}")
    return out


def normalize_num_neighbors(num_neighbors: NumNeighbors, edge_types: Sequence[EdgeType]
                            ) -> dict[EdgeType, list[int]]:
    """Fanouts per edge type and hop, in ``edge_types`` order (PyG's ``num_neighbors``).

    A list applies to every edge type; in a dict, an edge type left out draws nothing
    (fanout 0 at every hop). All lists need the same number of hops.
    """
    if not isinstance(num_neighbors, Mapping):
        shared = check_fanouts(num_neighbors)
        return {et: list(shared) for et in edge_types}
    if not num_neighbors:
        raise ValueError("num_neighbors: expected fanouts for at least one edge type, got {}")
    given: dict[EdgeType, list[int]] = {}
    for k, v in num_neighbors.items():
        try:
            et = parse_edge_type(k) if isinstance(k, str) else (k[0], k[1], k[2])
        except (GraphDataError, IndexError, TypeError):
            et = None
        if et is None or et not in edge_types:
            raise ValueError(f"num_neighbors: expected edge types of the graph "
                             f"{[edge_type_name(e) for e in edge_types]}; got {k!r}")
        given[et] = check_fanouts(v)
    lengths = {len(v) for v in given.values()}
    if len(lengths) != 1:
        raise ValueError(f"num_neighbors: expected the same number of hops for every edge "
                         f"type, got {({edge_type_name(k): v for k, v in given.items()})}")
    hops = lengths.pop()
    return {et: given.get(et, [0] * hops) for et in edge_types}


def num_hops(fanouts: Mapping[EdgeType, Sequence[int]]) -> int:
    """Hops of normalized fanouts (0 for a graph without edge types)."""
    return len(next(iter(fanouts.values()))) if fanouts else 0


def relation_key(key: int, edge_type: EdgeType) -> int:
    """The uint64 key of one relation's draws in batch ``key`` of a typed graph: BLAKE2b of
    the key and the edge type's name, so a node that is the destination of several
    relations draws independently for each, and the key depends on names only (not on
    type order). A plain graph's one relation draws with the batch key itself."""
    digest = hashlib.blake2b((int(key) & _MASK64).to_bytes(8, "little")
                             + edge_type_name(edge_type).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")
