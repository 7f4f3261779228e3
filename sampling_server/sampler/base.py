"""The sampler interface shared by the CPU and CUDA implementations: one orchestrator for
plain and typed graphs (a plain graph is the typed graph of one node type and one edge
type).

A :class:`NeighborSampler` serves one partition. Seeds are of one node type; per hop,
every relation ``(src, rel, dst)`` draws in-neighbors of the ``dst`` nodes the previous
hop added (the seeds for hop 0). For each relation's frontier it splits the nodes by
owner (the partition books), draws the neighbors of the nodes whose in-edges it holds
with its kernels, asks the owners of the others through a
:class:`~sampling_server.sampler.peers.Remote`, merges the parts back into frontier
order, and dedups/relabels the new nodes per type. New nodes are numbered per type,
relation after relation in the graph's edge-type order, as PyG's (hetero)
``NeighborLoader`` numbers them. Draws depend only on ``(batch key, relation, hop,
original ID)`` (:meth:`NeighborSampler.draw_key`), so the split changes nothing: a
multi-partition batch equals the batch one sampler holding the whole graph would draw.

Asked for edges (``edges=True``), every sampled edge also carries its internal edge ID:
the ``edge_start`` of the structure it was drawn from plus its position in that
structure's ``indices`` (:meth:`~partitioner.manifest.Manifest.edge_book`), whichever
partition drew it; asking changes no draw.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping

import numpy as np
import torch

from partitioner.graph import EdgeType
from sampling_server.sampler.fanouts import NumNeighbors, normalize_num_neighbors, num_hops, relation_key
from sampling_server.sampler.gather import Gatherer
from sampling_server.sampler.lookups import Lookups
from sampling_server.sampler.peers import Remote, edges_of
from sampling_server.sampler.rows import merge_hop_samples, on_device, take
from sampling_server.sampler.types import HopSample, Minibatch, SamplerOutput

#: A batch's seeds: global IDs of the seed type, or per node type (a link batch's).
Seeds = torch.Tensor | np.ndarray | Mapping[str, torch.Tensor | np.ndarray]


class Relabeler(abc.ABC):
    """Dedups sampled nodes of one type across the hops of one batch and numbers them in
    first-seen order, after the seeds (local IDs ``0 .. batch_size-1``)."""

    @abc.abstractmethod
    def add(self, neighbors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(new_nodes, local_ids)``: the global IDs in ``neighbors`` not seen
        before, in first-seen order (they get the next local IDs), and the local ID of
        every entry of ``neighbors``."""


class NeighborSampler(Gatherer, Lookups):
    """Multi-hop neighbor sampling over one partition, with PyG ``NeighborLoader``
    semantics: per hop each frontier node draws up to ``fanout`` in-neighbors per relation
    uniformly without replacement (all of them when it has fewer), or with replacement,
    or in proportion to edge weights."""

    def draw_key(self, key: int, edge_type: EdgeType) -> int:
        """The uint64 key of ``edge_type``'s draws in batch ``key`` (:func:`relation_key`;
        the batch key itself on a plain graph)."""
        return int(key) & ((1 << 64) - 1) if self.plain else relation_key(key, edge_type)

    def sample_relation(self, edge_type: EdgeType, nodes: torch.Tensor, fanout: int, key: int,
                        hop: int, edges: bool = False) -> HopSample:
        """Draw in-neighbors along ``edge_type`` of ``nodes`` (global IDs of its destination
        type whose in-edges are here, :attr:`draw`) for batch ``key``; ``neighbors`` are
        global IDs of the source type, and with ``edges`` the drawn edges' internal IDs
        come too. This is also what a peer serves for a remote frontier."""
        et = self.check_edge_type(edge_type, "edge_type")
        ids = self.node_ids(nodes, "nodes")
        self.check_drawable(et[2], ids, "nodes")
        return self.sample_owned(et, ids, fanout, key, hop, edges)

    # -- what each device implements -------------------------------------------------
    @abc.abstractmethod
    def sample_owned(self, edge_type: EdgeType, nodes: torch.Tensor, fanout: int, key: int,
                     hop: int, edges: bool = False) -> HopSample:
        """:meth:`sample_relation` of nodes already known to have their in-edges here
        (:attr:`HopSample.edges`: the internal IDs of the drawn edges, with ``edges``;
        the same neighbors either way)."""

    @abc.abstractmethod
    def new_relabeler(self, node_type: str, seeds: torch.Tensor) -> Relabeler:
        """A relabeler of ``node_type``'s nodes for one batch, ``seeds`` (may be empty) first."""

    # -- sampling --------------------------------------------------------------------
    def _seed_tensor(self, seeds: torch.Tensor | np.ndarray, seed_type: str,
                     remote: Remote | None) -> torch.Tensor:
        """Seeds as an int64 tensor on :attr:`device`, checked: of the graph (with a
        ``remote``), else with their in-edges here."""
        self.check_node_type(seed_type, "seed_type")
        if isinstance(seeds, np.ndarray):  # copies: split arrays are read-only memmaps
            seeds = torch.from_numpy(np.array(seeds, dtype=np.int64))
        if seeds.dim() != 1:
            raise ValueError(f"seeds: expected a 1-D array of node IDs, got shape {list(seeds.shape)}")
        out = seeds.to(device=self.device, dtype=torch.int64)
        if remote is None:
            self.check_drawable(seed_type, out, "seeds")
        else:
            self.check_in_graph(seed_type, out, "seeds")
        return out

    def seed_tensors(self, seeds: Seeds, seed_type: str, remote: Remote | None) -> dict[str, torch.Tensor]:
        """Per node type (every one of the graph), its seeds as checked int64 tensors on
        :attr:`device`: ``seeds`` of ``seed_type``, or a mapping of node type to seeds
        (a link batch's: the ends of its edges, of one or two types)."""
        given = seeds if isinstance(seeds, Mapping) else {seed_type: seeds}
        self.check_node_type(seed_type, "seed_type")
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        out = dict.fromkeys(self.node_types, empty)
        for t, ids in given.items():
            out[t] = self._seed_tensor(ids, t, remote)
        return out

    def sample(self, seeds: Seeds, seed_type: str, num_neighbors: NumNeighbors,
               key: int, remote: Remote | None = None, edges: bool = False) -> SamplerOutput:
        """Sample the multi-hop neighborhood of ``seeds`` (unique global IDs of
        ``seed_type``, or per node type: :meth:`seed_tensors`). Nodes whose in-edges are
        elsewhere need ``remote``: their neighbors are drawn by their owners, exactly as
        here. With ``edges``, :attr:`SamplerOutput.edge` holds every sampled edge's
        internal ID."""
        fanouts = normalize_num_neighbors(num_neighbors, self.edge_types)
        hops = num_hops(fanouts)
        frontier = self.seed_tensors(seeds, seed_type, remote)
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        nodes = {t: [f] for t, f in frontier.items()}
        rows: dict[EdgeType, list[torch.Tensor]] = {et: [] for et in self.edge_types}
        cols: dict[EdgeType, list[torch.Tensor]] = {et: [] for et in self.edge_types}
        edge_ids: dict[EdgeType, list[torch.Tensor]] = {et: [] for et in self.edge_types}
        first_local = dict.fromkeys(self.node_types, 0)
        relabelers = {t: self.new_relabeler(t, f) for t, f in frontier.items()}
        for hop in range(hops):
            added: dict[str, list[torch.Tensor]] = {t: [] for t in self.node_types}
            for et in self.edge_types:
                src, _, dst = et
                drawn = self.sample_frontier(et, frontier[dst], fanouts[et][hop], key, hop, remote, edges)
                new, local = (relabelers[src].add(drawn.neighbors) if drawn.neighbors.numel()
                              else (empty, empty))
                added[src].append(new)
                targets = torch.arange(first_local[dst], first_local[dst] + frontier[dst].numel(),
                                       device=self.device)
                rows[et].append(local)
                if edges:
                    edge_ids[et].append(edges_of(drawn, "sample_frontier"))
                # output_size: known here, so a GPU need not read the sum back
                cols[et].append(torch.repeat_interleave(targets, drawn.counts,
                                                        output_size=int(local.numel())))
            for t in self.node_types:
                first_local[t] += int(frontier[t].numel())
                frontier[t] = added[t][0] if len(added[t]) == 1 else \
                    torch.cat(added[t]) if added[t] else empty
                nodes[t].append(frontier[t])
        return SamplerOutput(
            input_type=seed_type, node={t: torch.cat(v) for t, v in nodes.items()},
            row={et: torch.cat(v) if v else empty for et, v in rows.items()},
            col={et: torch.cat(v) if v else empty for et, v in cols.items()},
            num_sampled_nodes={t: [int(n.numel()) for n in v] for t, v in nodes.items()},
            num_sampled_edges={et: [int(r.numel()) for r in v] for et, v in rows.items()},
            edge={et: torch.cat(v) if v else empty for et, v in edge_ids.items()} if edges else {})

    def sample_frontier(self, edge_type: EdgeType, frontier: torch.Tensor, fanout: int, key: int,
                        hop: int, remote: Remote | None, edges: bool = False) -> HopSample:
        """In-neighbors along ``edge_type`` of a frontier that may span partitions, in
        frontier order (with their edges' internal IDs, with ``edges``)."""
        dst = edge_type[2]
        if fanout == 0 or frontier.numel() == 0:
            zeros = torch.zeros(frontier.numel(), dtype=torch.int64, device=self.device)
            return HopSample(counts=zeros, neighbors=zeros[:0], edges=zeros[:0] if edges else None)
        if self.draws_all(dst, frontier):
            return self.sample_owned(edge_type, frontier, fanout, key, hop, edges)
        if remote is None:
            raise RuntimeError(f"frontier of hop {hop} reaches other partitions but no remote sampler "
                               f"was given")
        positions: dict[int, torch.Tensor] = {}
        parts: dict[int, HopSample] = {}

        def put(p: int, pos: torch.Tensor, answer: HopSample) -> None:
            edge_ids = on_device(edges_of(answer, f"partition {p}"), self.device) if edges else None
            positions[p] = pos
            parts[p] = HopSample(on_device(answer.counts, self.device),
                                 on_device(answer.neighbors, self.device), edge_ids)

        self.from_owners(self.owner_of(dst, frontier), lambda pos: take(frontier, pos).cpu(),
                         lambda asked: remote.sample(edge_type, asked, fanout, key, hop, edges=edges),
                         lambda pos: put(-1, pos, self.sample_relation(edge_type, take(frontier, pos), fanout,
                                                                      key, hop, edges)), put)
        return merge_hop_samples(frontier.numel(), positions, parts, self.device)

    def minibatch(self, seeds: Seeds, seed_type: str, num_neighbors: NumNeighbors,
                  key: int, *, features: bool = True, labels: bool = True, original_ids: bool = True,
                  remote: Remote | None = None, edges: bool = False, edge_features: bool = False
                  ) -> Minibatch:
        """Sample, then gather per node type: the whole minibatch of ``seeds``; with
        ``edges``, its structure with the sampled edges' internal IDs and each relation's
        original edge IDs, and with ``edge_features`` too the features (as stored) of the
        relations with them."""
        out = self.sample(seeds, seed_type, num_neighbors, key, remote, edges or edge_features)
        batch = Minibatch(structure=out, target_type=self.target_type)
        for t, n_id in out.node.items():
            x, y = self.gather(t, n_id, features=features, labels=labels, remote=remote)
            if x is not None:
                batch.x[t] = x
            if y is not None:
                batch.y = y
            if original_ids:
                batch.orig_id[t] = self.orig_ids_of(t, n_id, remote)
        for et, edge_ids in out.edge.items():
            with_attr = edge_features and et in self.partition.edge_attr
            e_id, attr = self.edge_rows(et, edge_ids, features=with_attr, remote=remote)
            if e_id is not None:
                batch.e_id[et] = e_id
            if attr is not None:
                batch.edge_attr[et] = attr
        return batch
