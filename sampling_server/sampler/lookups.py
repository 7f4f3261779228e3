"""Look-ups by ID beside sampling: the original IDs of sampled nodes and whether pairs of
nodes are edges (for negative draws), of the nodes here read directly and of the others
asked of their owners (:meth:`~sampling_server.sampler.holdings.Holdings.from_owners`)."""

from __future__ import annotations

import numpy as np
import torch

from partitioner.graph import EdgeType
from sampling_server.sampler import negatives
from sampling_server.sampler.holdings import Holdings
from sampling_server.sampler.peers import Remote
from sampling_server.sampler.rows import is_identity, original_ids, take


class Lookups(Holdings):
    """Original IDs and edge tests of one partition's sampler."""

    def orig_ids_local(self, node_type: str, nodes: torch.Tensor) -> torch.Tensor:
        """int64 original IDs (CPU) of nodes of ``node_type`` whose in-edges are here
        (every owned node, and more with a wider structure)."""
        ids = nodes.detach().cpu()
        self.check_drawable(node_type, ids, "nodes")
        return self._orig_ids_here(node_type, ids)

    def _orig_ids_here(self, node_type: str, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`orig_ids_local` of CPU IDs already known to be drawable here."""
        start = self.draw[node_type][0]
        orig = self.structure.orig_ids[node_type]
        if node_type not in self._identity:  # one pass over the IDs, on first use
            self._identity[node_type] = is_identity(orig, start)
        return torch.from_numpy(original_ids(orig, ids.numpy(), start, self._identity[node_type]))

    def orig_ids_of(self, node_type: str, n_id: torch.Tensor, remote: Remote | None = None) -> torch.Tensor:
        """Original IDs of ``n_id``'s nodes of ``node_type`` (CPU int64), in order; those
        of nodes whose in-edges are elsewhere via ``remote``."""
        nodes = n_id.detach().cpu()
        if self.draws_all(node_type, nodes):
            return self._orig_ids_here(node_type, nodes)
        if remote is None:
            raise RuntimeError("orig_ids_of: nodes of other partitions but no remote was given")
        out = torch.empty(nodes.numel(), dtype=torch.int64)
        def put(_: int, pos: torch.Tensor, answer: torch.Tensor) -> None:
            out[pos] = answer.to(torch.int64)

        self.from_owners(self.owner_of(node_type, nodes), lambda pos: take(nodes, pos),
                         lambda asked: remote.orig_ids(node_type, asked),
                         lambda pos: put(-1, pos, self._orig_ids_here(node_type, take(nodes, pos))), put)
        return out

    def has_edges_local(self, edge_type: EdgeType, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """bool ``[M]``: whether each ``src[i] -> dst[i]`` (global IDs) is an edge of
        ``edge_type``, for destinations whose in-edges are here."""
        dst_t = torch.from_numpy(np.ascontiguousarray(dst, dtype=np.int64))
        self.check_drawable(edge_type[2], dst_t, "dst")
        out = np.zeros(dst_t.numel(), dtype=np.bool_)
        if out.size:
            negatives.has_edges(np.asarray(self.structure.indptr[edge_type]),
                                np.asarray(self.structure.indices[edge_type]), self.draw[edge_type[2]][0],
                                np.ascontiguousarray(src, dtype=np.int64), dst_t.numpy(), out)
        return out

    def has_edges(self, edge_type: EdgeType, src: np.ndarray, dst: np.ndarray, remote: Remote | None
                  ) -> np.ndarray:
        """bool ``[M]``: whether each ``src[i] -> dst[i]`` (global IDs) is an edge of
        ``edge_type``, asking the owners of destinations whose in-edges are elsewhere."""
        dst_t = torch.from_numpy(np.ascontiguousarray(dst, dtype=np.int64))
        if self.draws_all(edge_type[2], dst_t):
            return self.has_edges_local(edge_type, src, dst)
        if remote is None:
            raise RuntimeError("has_edges: destinations of other partitions but no remote was given")
        out = np.zeros(dst_t.numel(), dtype=np.bool_)

        def put(_: int, pos: torch.Tensor, answer: np.ndarray) -> None:
            out[pos.numpy()] = answer

        self.from_owners(self.owner_of(edge_type[2], dst_t), lambda pos: (src[pos.numpy()], dst[pos.numpy()]),
                         lambda asked: remote.has_edges(edge_type, asked),
                         lambda pos: put(-1, pos, self.has_edges_local(edge_type, src[pos.numpy()],
                                                                       dst[pos.numpy()])), put)
        return out
