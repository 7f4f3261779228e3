"""The edge rows of a batch: each sampled edge's original edge ID (PyG's ``e_id``) and
its features (``edge_attr``), looked up by internal edge ID.

A sampler reports every sampled edge by its internal edge ID
(:meth:`~partitioner.manifest.Manifest.edge_book`): partition p holds the in-edges of a
relation with IDs ``[book[p], book[p+1])``, in the order of its CSC, so the owner of an
edge is found in the edge book as the owner of a node is in the partition book. The rows
held here (the partition's own, or every edge's on a server that loaded every
partition's edge data) are read directly; the others are asked of their owners
(``PeerService/FetchEdgeData``, :class:`EdgeRemote`), one call per owner and relation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np
import torch

from partitioner.format import EdgeData
from partitioner.graph import EdgeType, edge_type_name
from protos import codec, halfcast
from protos import sampling_pb2 as pb

#: Per owner partition: the original IDs (or None) and features (or None) of its edges.
EdgeRowsByPartition = Mapping[int, tuple[torch.Tensor | None, torch.Tensor | None]]

#: The dtypes edge features may travel in when they are floating point (as node features).
_FLOAT = (pb.FLOAT16, pb.BFLOAT16, pb.FLOAT32, pb.FLOAT64)


class EdgeRemote(Protocol):
    """What :func:`edge_rows` asks of the partitions that hold the other edges."""

    def edge_data(self, edge_type: EdgeType, edges_by_partition: Mapping[int, torch.Tensor], ids: bool,
                  features: bool, feature_dtype: codec.WireDType) -> EdgeRowsByPartition: ...


def edge_wire_dtype(requested: codec.WireDType, stored: codec.WireDType) -> codec.WireDType:
    """The dtype edge features travel in: floating-point features in ``requested`` (the
    batch's feature dtype; unspecified: as stored), other features as stored."""
    if stored not in _FLOAT or requested == pb.DTYPE_UNSPECIFIED:
        return stored
    return requested


def owners(book: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The partition holding each internal edge ID (``book``: the edge book)."""
    return np.searchsorted(book, edges, side="right") - 1


def local_edge_rows(data: EdgeData, edge_type: EdgeType, edges: np.ndarray, ids: bool, features: bool,
                    dtype: codec.WireDType, field: str = "edges"
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The original IDs and/or features of edges ``data`` holds (``dtype``: the features'
    wire dtype); a ``ValueError`` naming ``field`` for an edge it does not hold, or for
    features of a relation without them."""
    start, stop = data.edge_range(edge_type)
    if edges.size and (int(edges.min()) < start or int(edges.max()) >= stop):
        bad = edges[(edges < start) | (edges >= stop)]
        raise ValueError(f"{field}: expected internal edge IDs of {edge_type_name(edge_type)} in "
                           f"[{start}, {stop}) (the edges held here), got {bad[:5].tolist()}")
    local = edges - start
    e_id = torch.from_numpy(np.asarray(data.e_id[edge_type][local], dtype=np.int64)) if ids else None
    attr = None
    if features:
        stored = data.edge_attr.get(edge_type)
        if stored is None:
            raise ValueError(f"{field}: expected a relation with edge features, "
                               f"{edge_type_name(edge_type)} has none")
        rows = torch.from_numpy(np.ascontiguousarray(stored[local]))
        attr = halfcast.cast(rows, codec.dtype_to_torch(dtype))
    return e_id, attr


def edge_rows(data: EdgeData, book: np.ndarray, edge_type: EdgeType, edges: torch.Tensor, ids: bool,
              features: bool, dtype: codec.WireDType, remote: EdgeRemote | None
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Original IDs (int64 ``[E]``) and/or features (``[E, ...]`` in ``dtype``) of the
    sampled ``edges`` (internal IDs, any device), in their order: the ones ``data`` holds
    read here, the others asked of their owners through ``remote``."""
    ids_np = np.ascontiguousarray(edges.cpu().numpy(), dtype=np.int64)
    start, stop = data.edge_range(edge_type)
    here = (ids_np >= start) & (ids_np < stop)
    if bool(here.all()):
        return local_edge_rows(data, edge_type, ids_np, ids, features, dtype)
    if remote is None:
        raise RuntimeError(f"edges of {edge_type_name(edge_type)} held by other partitions but no "
                           "remote was given")
    away = np.flatnonzero(~here)
    owner = owners(book, ids_np[away])
    positions = {int(p): away[owner == p] for p in np.unique(owner)}
    asked = {p: torch.from_numpy(ids_np[where]) for p, where in positions.items()}
    parts = dict(remote.edge_data(edge_type, asked, ids, features, dtype))
    parts[-1] = local_edge_rows(data, edge_type, ids_np[here], ids, features, dtype)
    positions[-1] = np.flatnonzero(here)
    return _placed(parts, positions, ids_np.size)


def _placed(parts: Mapping[int, tuple[torch.Tensor | None, torch.Tensor | None]],
            positions: Mapping[int, np.ndarray], count: int
            ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Each part's rows put back at its ``positions`` of the ``count`` edges."""
    out: list[torch.Tensor | None] = []
    for k in range(2):
        pieces = [(positions[p], part[k]) for p, part in parts.items()]
        if any(piece is None for _, piece in pieces):
            out.append(None)
            continue
        first = next(piece for _, piece in pieces if piece is not None)
        assert first is not None
        whole = torch.empty((count, *first.shape[1:]), dtype=first.dtype)
        for where, piece in pieces:
            assert piece is not None
            whole[torch.from_numpy(where)] = piece
        out.append(whole)
    return out[0], out[1]
