"""Link batches: a batch of seed edges made into seed nodes, negatives and the labelled
edges PyG's ``LinkNeighborLoader`` gives, and the exclusion of the seed edges from the
sampled message-passing edges.

:func:`link_seeds` draws the batch's negatives (:mod:`negatives`, keyed by the seed edges'
original IDs and the batch key), collects the distinct ends of its positive and negative
edges per node type in order of first appearance (the batch's seed nodes, sampled as any
seeds are), and numbers its labelled edges into them. :func:`exclude_edges` removes edges
given by their ends from a sampled structure (DGL's ``exclude="self"`` /
``"reverse_id"``): they are drawn, then dropped, so a node may keep fewer than ``fanout``
in-neighbors and a node reached only through a dropped edge stays in the batch with no
edge to it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from partitioner.graph import EdgeType
from sampling_server.sampler import negatives
from sampling_server.sampler.base import NeighborSampler
from sampling_server.sampler.peers import Remote
from sampling_server.sampler.types import SamplerOutput

#: Negative modes (as ``NegativeSampling.Mode`` numbers them on the wire).
NO_NEGATIVES, BINARY, TRIPLET, GIVEN = 0, 1, 2, 3


@dataclass(frozen=True)
class LinkOptions:
    """How a link epoch's batches are made."""

    edge_type: EdgeType
    #: :data:`NO_NEGATIVES`, :data:`BINARY`, :data:`TRIPLET` or :data:`GIVEN`.
    mode: int = NO_NEGATIVES
    #: Negatives per positive edge (TRIPLET: a whole number).
    amount: float = 1.0
    #: Redraw negatives that are edges of the graph.
    strict: bool = False
    #: Nodes of the edge type's source and destination types (negatives are drawn among
    #: their original IDs).
    num_src_nodes: int = 0
    num_dst_nodes: int = 0

    def per_edge(self, positives: int) -> int:
        """Negatives drawn per positive edge: TRIPLET's amount; BINARY's
        ``ceil(amount * positives)`` spread over the positives."""
        if self.mode == TRIPLET:
            return int(self.amount)
        if self.mode == BINARY and positives:
            return -(-self.num_binary(positives) // positives)
        return 0

    def num_binary(self, positives: int) -> int:
        """BINARY's negatives for ``positives`` positive edges, as PyG counts them."""
        return math.ceil(positives * self.amount)


@dataclass
class LinkSeeds:
    """What one link batch adds to its sampled structure."""

    #: Node type to its seed nodes (global IDs): the distinct ends of the batch's edges.
    seeds: dict[str, np.ndarray]
    #: The link tensors, named as on the wire without their type ("edge_label_index", ...).
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


#: Maps original IDs of a node type to its global IDs.
NodeMap = Callable[[str, np.ndarray], np.ndarray]


def link_seeds(sampler: NeighborSampler, options: LinkOptions, key: int, src: np.ndarray, dst: np.ndarray,
               label: np.ndarray | None, given: np.ndarray | None, node_map: NodeMap,
               remote: Remote | None) -> LinkSeeds:
    """One link batch's seeds and link tensors, from its positive edges ``src -> dst``
    (global IDs), their ``label`` (None: none given) and ``given`` negatives (GIVEN mode,
    global destination IDs ``[P, K]``)."""
    s_type, _, d_type = options.edge_type
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    positives = src.size
    if options.mode in (BINARY, TRIPLET):
        src_orig = sampler.orig_ids_of(s_type, torch.from_numpy(src), remote).numpy()
        dst_orig = sampler.orig_ids_of(d_type, torch.from_numpy(dst), remote).numpy()
    if options.mode == BINARY:
        num = options.num_binary(positives)
        neg_src, neg_dst = _binary(sampler, options, key, src_orig, dst_orig, num, node_map, remote)
        ends_src, ends_dst = np.concatenate([src, neg_src]), np.concatenate([dst, neg_dst])
        seeds, (local_src, local_dst) = _number(s_type, d_type, [ends_src], [ends_dst])
        tensors = {"edge_label_index": torch.from_numpy(np.stack([local_src, local_dst]))}
        pos_label = torch.ones(positives, dtype=torch.float32) if label is None else torch.from_numpy(
            np.ascontiguousarray(label))
        tensors["edge_label"] = torch.cat([pos_label, pos_label.new_zeros((num, *pos_label.shape[1:]))])
        return LinkSeeds(seeds, tensors)
    if options.mode in (TRIPLET, GIVEN):
        if options.mode == TRIPLET:
            neg = _triplet(sampler, options, key, src, src_orig, dst_orig, node_map, remote)
        else:
            assert given is not None
            neg = np.asarray(given, np.int64).reshape(positives, -1)
        seeds, (local_src, local_dst) = _number(s_type, d_type, [src], [dst, neg.reshape(-1)])
        k = neg.shape[1]
        return LinkSeeds(seeds, {
            "src_index": torch.from_numpy(local_src),
            "dst_pos_index": torch.from_numpy(local_dst[:positives]),
            "dst_neg_index": torch.from_numpy(
                np.ascontiguousarray(local_dst[positives:].reshape(positives, k)))})
    seeds, (local_src, local_dst) = _number(s_type, d_type, [src], [dst])
    tensors = {"edge_label_index": torch.from_numpy(np.stack([local_src, local_dst]))}
    if label is not None:
        tensors["edge_label"] = torch.from_numpy(np.ascontiguousarray(label))
    return LinkSeeds(seeds, tensors)


def _binary(sampler: NeighborSampler, options: LinkOptions, key: int, src_orig: np.ndarray,
            dst_orig: np.ndarray, num: int, node_map: NodeMap, remote: Remote | None
            ) -> tuple[np.ndarray, np.ndarray]:
    """BINARY's ``num`` negative pairs (global IDs): negative ``k`` is draw ``k // P`` of
    positive ``k % P``'s streams, its source among the source type's nodes and its
    destination among the destination type's."""
    s_type, _, d_type = options.edge_type
    per_edge = options.per_edge(src_orig.size)

    def draw(attempt: int) -> tuple[np.ndarray, np.ndarray]:
        s = negatives.negative_draws(key, negatives.SRC_SALT, src_orig, dst_orig, per_edge,
                                     options.num_src_nodes, attempt)
        d = negatives.negative_draws(key, negatives.DST_SALT, src_orig, dst_orig, per_edge,
                                     options.num_dst_nodes, attempt)
        # negative k: row k % P, column k // P
        return (node_map(s_type, s.T.reshape(-1)[:num]), node_map(d_type, d.T.reshape(-1)[:num]))

    neg_src, neg_dst = draw(0)
    if options.strict:
        _redraw_edges(sampler, options.edge_type, neg_src, neg_dst, remote,
                      lambda attempt: draw(attempt))
    return neg_src, neg_dst


def _triplet(sampler: NeighborSampler, options: LinkOptions, key: int, src: np.ndarray, src_orig: np.ndarray,
             dst_orig: np.ndarray, node_map: NodeMap, remote: Remote | None) -> np.ndarray:
    """TRIPLET's ``[P, K]`` negative destinations (global IDs) of the positives."""
    d_type = options.edge_type[2]
    k = options.per_edge(src.size)

    def draw(attempt: int) -> tuple[np.ndarray, np.ndarray]:
        d = negatives.negative_draws(key, negatives.DST_SALT, src_orig, dst_orig, k, options.num_dst_nodes,
                                     attempt)
        return np.repeat(src, k), node_map(d_type, d.reshape(-1))

    sources, neg = draw(0)
    if options.strict:
        _redraw_edges(sampler, options.edge_type, sources, neg, remote, draw)
    return neg.reshape(src.size, k)


def _redraw_edges(sampler: NeighborSampler, edge_type: EdgeType, src: np.ndarray, dst: np.ndarray,
                  remote: Remote | None, draw: Callable[[int], tuple[np.ndarray, np.ndarray]]) -> None:
    """Strict negatives, in place: each pair that is an edge takes its next try's draw,
    up to :data:`~negatives.STRICT_TRIES` tries (the last is kept even if an edge)."""
    todo = np.arange(src.size)
    for attempt in range(1, negatives.STRICT_TRIES):
        if todo.size == 0:
            return
        edge = sampler.has_edges(edge_type, src[todo], dst[todo], remote)
        todo = todo[edge]
        if todo.size:
            s, d = draw(attempt)
            src[todo], dst[todo] = s[todo], d[todo]


def _number(s_type: str, d_type: str, src_parts: list[np.ndarray], dst_parts: list[np.ndarray]
            ) -> tuple[dict[str, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The distinct ends per node type in order of first appearance (sources first when
    both ends are of one type), and each end's local ID among them."""
    src_ids, dst_ids = np.concatenate(src_parts), np.concatenate(dst_parts)
    if s_type == d_type:
        seeds, local = _first_seen(np.concatenate([src_ids, dst_ids]))
        return {s_type: seeds}, (local[:src_ids.size], local[src_ids.size:])
    s_seeds, s_local = _first_seen(src_ids)
    d_seeds, d_local = _first_seen(dst_ids)
    return {s_type: s_seeds, d_type: d_seeds}, (s_local, d_local)


def _first_seen(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of ``ids`` in order of first appearance, and each entry's
    index among them."""
    uniq, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.arange(order.size, dtype=np.int64)
    return uniq[order], rank[inverse.reshape(-1)]


def exclude_edges(out: SamplerOutput, pairs: Mapping[EdgeType, tuple[torch.Tensor, torch.Tensor]],
                  num_nodes: Mapping[str, int]) -> None:
    """Drop, in place, every sampled edge of an edge type of ``pairs`` whose ends (global
    IDs) are one of its ``(src, dst)`` pairs; the per-hop edge counts follow."""
    for et, (src, dst) in pairs.items():
        rows, cols = out.row[et], out.col[et]
        if rows.numel() == 0 or src.numel() == 0:
            continue
        width = int(num_nodes[et[2]])
        device = rows.device
        sampled = out.node[et[0]][rows] * width + out.node[et[2]][cols]
        banned = src.to(device) * width + dst.to(device)
        keep = ~torch.isin(sampled, banned)
        if bool(keep.all()):
            continue
        bounds = np.cumsum([0, *out.num_sampled_edges[et]])
        out.num_sampled_edges[et] = [int(keep[a:b].sum()) for a, b in itertools.pairwise(bounds)]
        out.row[et], out.col[et] = rows[keep], cols[keep]
        if et in out.edge:
            out.edge[et] = out.edge[et][keep]
