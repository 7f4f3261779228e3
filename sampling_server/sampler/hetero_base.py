"""The heterogeneous sampler interface shared by the CPU and CUDA implementations.

A :class:`HeteroNeighborSampler` serves one partition of a typed graph (format v2). Seeds
are of one node type; per hop, every relation ``(src, rel, dst)`` draws in-neighbors of
the ``dst`` nodes the previous hop added (the seeds for hop 0), with the homogeneous
draw kernels run on that relation's CSC. New nodes are numbered per type, relation after
relation in the graph's edge-type order, as PyG's hetero ``NeighborLoader`` numbers
them. Draws are keyed by ``(batch key, relation, hop, original ID)``, so the same seeds
give the same batch for any partitioning of the graph (see ``docs/sampling.md``).

Nodes owned by other partitions go through a :class:`HeteroRemote` (the peers).
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import torch

from partitioner.hetero import EdgeType, GraphDataError, edge_type_name, parse_edge_type
from partitioner.hetero_format import HeteroPartition
from sampling_server.sampler.base import (
    Relabeler,
    assign_rows,
    begin,
    check_fanouts,
    is_identity,
    merge_hop_samples,
    original_ids,
    owner_groups,
)
from sampling_server.sampler.hetero_types import HeteroMinibatch, HeteroSamplerOutput
from sampling_server.sampler.types import HopSample

_MASK64 = (1 << 64) - 1

#: PyG's ``num_neighbors``: one fanout list for every edge type, or a dict from edge type
#: (a ``(src, rel, dst)`` tuple or ``"src__rel__dst"``) to its fanout list.
NumNeighbors = Sequence[int] | Mapping[EdgeType | str, Sequence[int]]

#: Per owner partition ID: the tensors asked of (or answered by) that partition.
ByPartition = Mapping[int, torch.Tensor]


class HeteroRemote(Protocol):
    """What a typed sampler asks of the partitions owning the rest of the graph.

    Every method gets, per partition, CPU int64 tensors of global IDs (of the type named
    by the call) and returns, per partition, what that partition's own sampler returned
    for them: :meth:`HeteroNeighborSampler.sample_relation`,
    :meth:`~HeteroNeighborSampler.gather_local` and
    :meth:`~HeteroNeighborSampler.orig_ids_local`. One call per relation and hop carries
    every peer's nodes, so an implementation can ask the peers concurrently.
    """

    def sample(self, edge_type: EdgeType, nodes_by_partition: ByPartition, fanout: int,
               key: int, hop: int) -> Mapping[int, HopSample]: ...

    def node_data(
        self, node_type: str, nodes_by_partition: ByPartition, features: bool, labels: bool
    ) -> Mapping[int, tuple[torch.Tensor | None, torch.Tensor | None]]: ...

    def orig_ids(self, node_type: str, nodes_by_partition: ByPartition) -> Mapping[int, torch.Tensor]: ...


def relation_key(key: int, edge_type: EdgeType) -> int:
    """The uint64 key of one relation's draws in batch ``key``: BLAKE2b of the key and the
    edge type's name, so a node that is the destination of several relations draws
    independently for each, and the key depends on names only (not on type order)."""
    digest = hashlib.blake2b((int(key) & _MASK64).to_bytes(8, "little")
                             + edge_type_name(edge_type).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def normalize_num_neighbors(
    num_neighbors: NumNeighbors, edge_types: Sequence[EdgeType]
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
            et = parse_edge_type(k) if isinstance(k, str) else tuple(k)
        except GraphDataError as exc:
            raise ValueError(f"num_neighbors: {exc}") from None
        if et not in edge_types:
            raise ValueError(f"num_neighbors: expected edge types of the graph "
                             f"{[edge_type_name(e) for e in edge_types]}; got {k!r}")
        given[et] = check_fanouts(v)  # type: ignore[index]
    lengths = {len(v) for v in given.values()}
    if len(lengths) != 1:
        raise ValueError(f"num_neighbors: expected the same number of hops for every edge "
                         f"type, got {({edge_type_name(k): v for k, v in given.items()})}")
    hops = lengths.pop()
    return {et: given.get(et, [0] * hops) for et in edge_types}


class HeteroNeighborSampler(abc.ABC):
    """Multi-hop typed neighbor sampling over one partition of a v2 graph, uniform with
    or without replacement, with PyG's hetero ``NeighborLoader`` semantics."""

    #: Where the sampler's tensors live.
    device: torch.device
    #: Whether requests to the peers run while this sampler does its own share (``begin``).
    overlap_peers: bool = True

    def __init__(self, partition: HeteroPartition, *, replace: bool = False):
        self.partition = partition
        self.replace = replace
        m = partition.manifest
        #: Node types and edge types, in the graph's order.
        self.node_types: tuple[str, ...] = tuple(m.node_types)
        self.edge_types: tuple[EdgeType, ...] = tuple(m.edge_types)
        self.target_type = m.target_type
        self.partition_id = partition.partition_id
        self.books = {t: torch.from_numpy(np.asarray(partition.partition_book[t], np.int64))
                      for t in self.node_types}
        #: Per node type, whether original ID = global ID for every owned node (filled
        #: on first use).
        self._orig_identity: dict[str, bool] = {}

    # -- what each device implements -------------------------------------------------
    @abc.abstractmethod
    def sample_relation(self, edge_type: EdgeType, nodes: torch.Tensor, fanout: int, key: int,
                        hop: int) -> HopSample:
        """Draw in-neighbors along ``edge_type`` of ``nodes`` (global IDs of its destination
        type owned here, on :attr:`device`) for batch ``key``; ``neighbors`` are global IDs
        of the source type. This is also what a peer serves for a remote frontier."""

    @abc.abstractmethod
    def new_relabeler(self, node_type: str, seeds: torch.Tensor) -> Relabeler:
        """A relabeler of ``node_type``'s nodes for one batch, ``seeds`` (may be empty) first."""

    @abc.abstractmethod
    def gather_local(self, node_type: str, nodes: torch.Tensor, features: bool,
                     labels: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Features ``[len(nodes), F_t]`` (None for featureless types) and labels (None
        unless ``node_type`` is the target type) of owned nodes of ``node_type``."""

    # -- ownership -------------------------------------------------------------------
    def node_range(self, node_type: str) -> tuple[int, int]:
        """``[start, stop)`` of the global IDs of ``node_type`` owned here."""
        return self.partition.node_range(node_type)

    def check_node_type(self, node_type: str, field: str) -> None:
        if node_type not in self.node_types:
            raise ValueError(f"{field}: expected one of {list(self.node_types)}, got {node_type!r}")

    def check_owned(self, node_type: str, nodes: torch.Tensor, field: str) -> None:
        """Raise ``ValueError`` naming ``field`` unless every ID is an owned ``node_type``."""
        if nodes.numel() == 0:
            return
        start, stop = self.node_range(node_type)
        lo, hi = int(nodes.min()), int(nodes.max())
        if lo < start or hi >= stop:
            raise ValueError(f"{field}: expected global {node_type!r} IDs owned by partition "
                             f"{self.partition_id}, in [{start}, {stop}); got values in [{lo}, {hi}]")

    def _by_owner(self, node_type: str, nodes: torch.Tensor
                  ) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
        """Positions of the owned nodes (None if all are owned) and, per other owner, the
        positions of its nodes."""
        start, stop = self.node_range(node_type)
        if nodes.numel() == 0 or (int(nodes.min()) >= start and int(nodes.max()) < stop):
            return None, {}
        book = self.books[node_type].to(nodes.device)
        owner = torch.searchsorted(book, nodes, right=True) - 1
        mine = owner == self.partition_id
        if bool(mine.all()):
            return None, {}
        groups = owner_groups(owner, self.partition_id)
        return torch.nonzero(mine).flatten(), groups

    # -- sampling --------------------------------------------------------------------
    def _seed_tensor(self, seeds: torch.Tensor | np.ndarray, seed_type: str,
                     remote: HeteroRemote | None) -> torch.Tensor:
        self.check_node_type(seed_type, "seed_type")
        if isinstance(seeds, np.ndarray):  # copies: split arrays are read-only memmaps
            seeds = torch.from_numpy(np.array(seeds, dtype=np.int64))
        if seeds.dim() != 1:
            raise ValueError(f"seeds: expected a 1-D array of node IDs, got shape {list(seeds.shape)}")
        out = seeds.to(device=self.device, dtype=torch.int64)
        if remote is None:
            self.check_owned(seed_type, out, "seeds")
        elif out.numel():
            n = int(self.books[seed_type][-1])
            if int(out.min()) < 0 or int(out.max()) >= n:
                raise ValueError(f"seeds: expected global {seed_type!r} IDs in [0, {n}); got "
                                 f"values in [{int(out.min())}, {int(out.max())}]")
        return out

    def sample(self, seeds: torch.Tensor | np.ndarray, seed_type: str,
               num_neighbors: NumNeighbors, key: int,
               remote: HeteroRemote | None = None) -> HeteroSamplerOutput:
        """Sample the typed multi-hop neighborhood of ``seeds`` (unique global IDs of
        ``seed_type``). Nodes owned by other partitions need ``remote``."""
        fanouts = normalize_num_neighbors(num_neighbors, self.edge_types)
        hops = len(next(iter(fanouts.values()))) if fanouts else 0
        seeds_t = self._seed_tensor(seeds, seed_type, remote)
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        frontier = {t: seeds_t if t == seed_type else empty for t in self.node_types}
        nodes = {t: [f] for t, f in frontier.items()}
        rows: dict[EdgeType, list[torch.Tensor]] = {et: [] for et in self.edge_types}
        cols: dict[EdgeType, list[torch.Tensor]] = {et: [] for et in self.edge_types}
        first_local = dict.fromkeys(self.node_types, 0)
        relabelers: dict[str, Relabeler] = {}
        try:
            for t, f in frontier.items():
                relabelers[t] = self.new_relabeler(t, f)
            for hop in range(hops):
                added: dict[str, list[torch.Tensor]] = {t: [] for t in self.node_types}
                for et in self.edge_types:
                    src, _, dst = et
                    drawn = self._sample_frontier(et, frontier[dst], fanouts[et][hop], key, hop,
                                                  remote)
                    new, local = (relabelers[src].add(drawn.neighbors) if drawn.neighbors.numel()
                                  else (empty, empty))
                    added[src].append(new)
                    targets = torch.arange(first_local[dst], first_local[dst] + frontier[dst].numel(),
                                           device=self.device)
                    rows[et].append(local)
                    cols[et].append(torch.repeat_interleave(targets, drawn.counts))
                for t in self.node_types:
                    first_local[t] += int(frontier[t].numel())
                    frontier[t] = torch.cat(added[t]) if added[t] else empty
                    nodes[t].append(frontier[t])
        finally:
            for r in relabelers.values():
                r.close()
        return HeteroSamplerOutput(
            input_type=seed_type, node={t: torch.cat(v) for t, v in nodes.items()},
            row={et: torch.cat(v) if v else empty for et, v in rows.items()},
            col={et: torch.cat(v) if v else empty for et, v in cols.items()},
            num_sampled_nodes={t: [int(n.numel()) for n in v] for t, v in nodes.items()},
            num_sampled_edges={et: [int(r.numel()) for r in v] for et, v in rows.items()})

    def _sample_frontier(self, edge_type: EdgeType, frontier: torch.Tensor, fanout: int, key: int,
                         hop: int, remote: HeteroRemote | None) -> HopSample:
        """In-neighbors along ``edge_type`` of a frontier that may span partitions, in
        frontier order."""
        if fanout == 0 or frontier.numel() == 0:
            zeros = torch.zeros(frontier.numel(), dtype=torch.int64, device=self.device)
            return HopSample(counts=zeros, neighbors=zeros[:0])
        local_pos, groups = self._by_owner(edge_type[2], frontier)
        if local_pos is None:
            return self.sample_relation(edge_type, frontier, fanout, key, hop)
        if remote is None:
            raise RuntimeError(f"frontier of hop {hop} along {edge_type_name(edge_type)} reaches "
                               f"other partitions but no remote sampler was given")
        asked = {p: frontier[pos].cpu() for p, pos in groups.items()}
        pending = begin(lambda: remote.sample(edge_type, asked, fanout, key, hop),
                        self.overlap_peers)
        parts: dict[int, HopSample] = {}
        if local_pos.numel():
            parts[-1] = self.sample_relation(edge_type, frontier[local_pos], fanout, key, hop)
        answers = pending.result()  # bounded: peer calls carry deadlines
        for p in groups:
            parts[p] = HopSample(answers[p].counts.to(self.device),
                                 answers[p].neighbors.to(self.device))
        positions = dict(groups)
        if local_pos.numel():
            positions[-1] = local_pos
        return merge_hop_samples(frontier.numel(), positions, parts, self.device)

    # -- node data -------------------------------------------------------------------
    def orig_ids_local(self, node_type: str, nodes: torch.Tensor) -> torch.Tensor:
        """int64 original IDs (CPU) of owned nodes of ``node_type``."""
        ids = nodes.detach().cpu()
        self.check_owned(node_type, ids, "nodes")
        start = self.node_range(node_type)[0]
        orig = self.partition.orig_ids[node_type]
        if node_type not in self._orig_identity:  # one pass over the IDs, on first use
            self._orig_identity[node_type] = is_identity(orig, start)
        return torch.from_numpy(original_ids(orig, ids.numpy(), start,
                                             self._orig_identity[node_type]))

    def orig_ids_of(self, node_type: str, nodes: torch.Tensor,
                    remote: HeteroRemote | None = None) -> torch.Tensor:
        """Original IDs (CPU int64) of ``nodes`` of ``node_type``; remote ones via ``remote``."""
        ids = nodes.detach().cpu()
        local_pos, groups = self._by_owner(node_type, ids)
        if local_pos is None:
            return self.orig_ids_local(node_type, ids)
        if remote is None:
            raise RuntimeError(f"orig_ids_of: {node_type!r} nodes of other partitions but no "
                               f"remote was given")
        out = torch.empty(ids.numel(), dtype=torch.int64)
        out[local_pos] = self.orig_ids_local(node_type, ids[local_pos])
        answers = remote.orig_ids(node_type, {p: ids[pos] for p, pos in groups.items()})
        for p, pos in groups.items():
            out[pos] = answers[p].to(torch.int64)
        return out

    def gather(self, node_type: str, nodes: torch.Tensor, *, features: bool = True,
               labels: bool = True, remote: HeteroRemote | None = None
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Features and labels of ``nodes`` of ``node_type``, in order (see
        :meth:`gather_local`); remote rows via ``remote``."""
        local_pos, groups = self._by_owner(node_type, nodes)
        if local_pos is None:
            return self.gather_local(node_type, nodes, features, labels)
        if remote is None:
            raise RuntimeError(f"gather: {node_type!r} nodes of other partitions but no remote "
                               f"was given")
        asked = {p: nodes[pos].cpu() for p, pos in groups.items()}
        pending = begin(lambda: remote.node_data(node_type, asked, features, labels),
                        self.overlap_peers)
        lx, ly = self.gather_local(node_type, nodes[local_pos], features, labels)
        x = None if lx is None else lx.new_empty((nodes.numel(), *lx.shape[1:]))
        y = None if ly is None else ly.new_empty(nodes.numel())
        assign_rows(x, local_pos, lx)
        assign_rows(y, local_pos, ly)
        answers = pending.result()  # bounded: peer calls carry deadlines
        for p, pos in groups.items():
            assign_rows(x, pos, answers[p][0])
            assign_rows(y, pos, answers[p][1])
        return x, y

    def minibatch(self, seeds: torch.Tensor | np.ndarray, seed_type: str,
                  num_neighbors: NumNeighbors, key: int, *, features: bool = True,
                  labels: bool = True, remote: HeteroRemote | None = None) -> HeteroMinibatch:
        """Sample, then gather per node type: the whole typed minibatch of ``seeds``."""
        out = self.sample(seeds, seed_type, num_neighbors, key, remote)
        xs: dict[str, torch.Tensor] = {}
        y = None
        for t, n_id in out.node.items():
            want_y = labels and t == self.target_type
            x, yt = self.gather(t, n_id, features=features, labels=want_y, remote=remote)
            if x is not None:
                xs[t] = x
            if want_y:
                y = yt
        orig = {t: self.orig_ids_of(t, n_id, remote) for t, n_id in out.node.items()}
        return HeteroMinibatch(structure=out, orig_id=orig, x=xs, y=y, target_type=self.target_type)
