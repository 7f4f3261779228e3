"""The sampler interface shared by the CPU and CUDA implementations: one orchestrator for
plain and typed graphs (a plain graph is the typed graph of one node type and one edge
type).

A :class:`NeighborSampler` serves one partition. Seeds are of one node type; per hop,
every relation ``(src, rel, dst)`` draws in-neighbors of the ``dst`` nodes the previous
hop added (the seeds for hop 0). For each relation's frontier it splits the nodes by
owner (the partition books), draws the neighbors of the nodes whose in-edges it holds
with its kernels, asks the owners of the others through a :class:`Remote`, merges the
parts back into frontier order, and dedups/relabels the new nodes per type. New nodes
are numbered per type, relation after relation in the graph's edge-type order, as PyG's
(hetero) ``NeighborLoader`` numbers them. Draws depend only on ``(batch key, relation,
hop, original ID)`` (:meth:`NeighborSampler.draw_key`), so the split changes nothing:
a multi-partition batch equals the batch one sampler holding the whole graph would draw.

Asked for edges (``edges=True``), every sampled edge also carries its internal edge ID:
the ``edge_start`` of the structure it was drawn from plus its position in that
structure's ``indices`` (:meth:`~partitioner.manifest.Manifest.edge_book`), whichever
partition drew it; asking changes no draw.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Protocol, TypeVar

import numpy as np
import torch

from partitioner.format import NodeData, Partition, Structure
from partitioner.graph import EdgeType, edge_type_name
from protos import allocator, halfcast
from sampling_server.sampler import cpu_gather, cpu_glue, negatives
from sampling_server.sampler.fanouts import NumNeighbors, normalize_num_neighbors, num_hops, relation_key
from sampling_server.sampler.rows import (
    assign_rows,
    assign_rows_to_blocks,
    begin,
    by_block,
    is_identity,
    layout_of,
    merge_hop_samples,
    on_device,
    original_ids,
    owner_groups,
    take,
    torch_dtype,
)
from sampling_server.sampler.types import HopSample, Minibatch, SamplerOutput

T = TypeVar("T")
A = TypeVar("A")
#: Per owner partition ID: the tensors asked of (or answered by) that partition.
ByPartition = Mapping[int, torch.Tensor]
NodeRows = tuple[torch.Tensor | None, torch.Tensor | None]
#: ``(a, b, rows)``: rows ``a`` to ``b`` of a gather's result go to ``rows``.
Blocks = Sequence[tuple[int, int, torch.Tensor]]
#: A batch's seeds: global IDs of the seed type, or per node type (a link batch's).
Seeds = torch.Tensor | np.ndarray | Mapping[str, torch.Tensor | np.ndarray]


class Remote(Protocol):
    """What a sampler asks of the partitions owning the rest of the graph.

    Every method gets, per partition, CPU int64 tensors of global IDs (of the type the
    call names) and returns, per partition, what that partition's own sampler returned for
    them: :meth:`NeighborSampler.sample_relation`, :meth:`~NeighborSampler.gather_local`
    and :meth:`~NeighborSampler.orig_ids_local`. One call per relation and hop carries
    every peer's nodes, so an implementation can ask the peers concurrently.
    """

    def sample(self, edge_type: EdgeType, nodes_by_partition: ByPartition, fanout: int,
               key: int, hop: int, edges: bool = False) -> Mapping[int, HopSample]:
        """With ``edges``, each answer's :attr:`HopSample.edges` too."""
        ...

    def node_data(self, node_type: str, nodes_by_partition: ByPartition, features: bool,
                  labels: bool) -> Mapping[int, NodeRows]: ...

    def orig_ids(self, node_type: str, nodes_by_partition: ByPartition) -> Mapping[int, torch.Tensor]: ...

    def has_edges(self, edge_type: EdgeType, pairs_by_partition: Mapping[int, tuple[np.ndarray, np.ndarray]]
                  ) -> Mapping[int, np.ndarray]:
        """Per partition, whether each of its ``(src, dst)`` pairs (global IDs, every
        ``dst`` owned there) is an edge: :meth:`NeighborSampler.has_edges_local`."""
        ...


class InProcessPeers:
    """The :class:`Remote` of samplers of every partition in one process: each answers
    the others' nodes directly."""

    def __init__(self, samplers: Sequence[NeighborSampler]) -> None:
        self.samplers = list(samplers)

    def sample(self, edge_type: EdgeType, nodes_by_partition: ByPartition, fanout: int, key: int,
               hop: int, edges: bool = False) -> dict[int, HopSample]:
        return {p: self.samplers[p].sample_relation(edge_type, on_device(n, self.samplers[p].device),
                                                    fanout, key, hop, edges)
                for p, n in nodes_by_partition.items()}

    def node_data(self, node_type: str, nodes_by_partition: ByPartition, features: bool,
                  labels: bool) -> dict[int, NodeRows]:
        return {p: self.samplers[p].gather_local(node_type, on_device(n, self.samplers[p].device),
                                                 features, labels)
                for p, n in nodes_by_partition.items()}

    def orig_ids(self, node_type: str, nodes_by_partition: ByPartition) -> dict[int, torch.Tensor]:
        return {p: self.samplers[p].orig_ids_local(node_type, n) for p, n in nodes_by_partition.items()}

    def has_edges(self, edge_type: EdgeType, pairs_by_partition: Mapping[int, tuple[np.ndarray, np.ndarray]]
                  ) -> dict[int, np.ndarray]:
        return {p: self.samplers[p].has_edges_local(edge_type, src, dst)
                for p, (src, dst) in pairs_by_partition.items()}


def edges_of(drawn: HopSample, who: str) -> torch.Tensor:
    """``drawn.edges``, asked for of ``who``; a ``RuntimeError`` naming it if it answered
    without them."""
    if drawn.edges is None:
        raise RuntimeError(f"{who} answered without the edge IDs asked for")
    if drawn.edges.shape != drawn.neighbors.shape:
        raise RuntimeError(f"{who} answered {list(drawn.edges.shape)} edge IDs for "
                           f"{drawn.neighbors.numel()} neighbors")
    return drawn.edges


class Relabeler(abc.ABC):
    """Dedups sampled nodes of one type across the hops of one batch and numbers them in
    first-seen order, after the seeds (local IDs ``0 .. batch_size-1``)."""

    @abc.abstractmethod
    def add(self, neighbors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(new_nodes, local_ids)``: the global IDs in ``neighbors`` not seen
        before, in first-seen order (they get the next local IDs), and the local ID of
        every entry of ``neighbors``."""


class NeighborSampler(abc.ABC):
    """Multi-hop neighbor sampling over one partition, with PyG ``NeighborLoader``
    semantics: per hop each frontier node draws up to ``fanout`` in-neighbors per relation
    uniformly without replacement (all of them when it has fewer), or with replacement,
    or in proportion to edge weights."""

    #: Where the sampler's tensors live.
    device: torch.device
    #: Whether requests to the peers run while this sampler does its own share (:func:`begin`).
    overlap_peers: bool = True

    def __init__(self, partition: Partition, *, replace: bool = False, weighted: bool = False,
                 structure: Structure | None = None, node_data: NodeData | None = None):
        """``structure``: the in-edges this sampler draws from (default: the partition's
        own, :attr:`Partition.structure`); one of wider ranges, such as the whole graph's
        (:func:`partitioner.format.load_structure`), draws those nodes' neighbors here
        instead of asking their owners, with the same draws. ``node_data``: likewise the
        features and labels it gathers from (default: the partition's own; the whole
        graph's, :func:`partitioner.format.load_node_data`, gathers every row here)."""
        m = partition.manifest
        structure = partition.structure if structure is None else structure
        node_data = partition.node_data if node_data is None else node_data
        self.partition = partition
        #: Node types and edge types, in the graph's order.
        self.node_types: tuple[str, ...] = tuple(m.node_types)
        self.edge_types: tuple[EdgeType, ...] = tuple(m.edge_types)
        self.target_type = m.target_type
        #: A plain graph (one node and edge type; draws keyed by the batch key itself).
        self.plain = not m.typed
        self.partition_id = partition.partition_id
        self.replace, self.weighted = replace, weighted
        if weighted:
            missing = [edge_type_name(et) for et in self.edge_types if et not in structure.edge_weight]
            if missing:
                what = "the partition has no edge weights (edge_weight.npy)" if self.plain \
                    else f"edge types {missing} have no edge weights"
                raise ValueError(f"weighted: {what}")
        #: Node type to its int64 ``[P+1]`` partition book.
        self.books = {t: torch.from_numpy(np.asarray(partition.partition_book[t], np.int64))
                      for t in self.node_types}
        #: Node type to ``[start, stop)`` of its owned global IDs.
        self.own = {t: partition.node_range(t) for t in self.node_types}
        #: The in-edges drawn from here, and per node type the IDs whose in-edges they are
        #: (the owned range, or more with a wider :attr:`structure`).
        self.structure = structure
        self.draw = {t: self._wider(structure.node_range(t), t, "structure", "in-edges")
                     for t in self.node_types}
        #: Edge type to the internal edge ID of the first entry of its ``indices`` here.
        self.edge_start = {et: int(structure.edge_start.get(et, 0)) for et in self.edge_types}
        #: The features and labels gathered from here, and per node type the IDs whose
        #: rows they are.
        self.node_data = node_data
        self.hold = {t: self._wider(node_data.node_range(t), t, "node_data", "rows")
                     for t in self.node_types}
        for t, x in partition.x.items():
            held = node_data.x.get(t)
            if held is None or held.shape[1:] != x.shape[1:] or held.dtype != x.dtype:
                got = None if held is None else (held.dtype, list(held.shape[1:]))
                raise ValueError(f"node_data: expected {x.dtype} rows of {list(x.shape[1:])} for "
                                 f"{self.what(t)}, got {got}")
        #: Per node type, whether original ID = global ID for every node of the structure
        #: (filled on first use).
        self._identity: dict[str, bool] = {}

    def _wider(self, got: tuple[int, int], t: str, field: str, what: str) -> tuple[int, int]:
        start, stop = self.own[t]
        if got[0] > start or got[1] < stop:
            raise ValueError(f"{field}: expected the {what} of at least the owned {self.what(t)} "
                             f"[{start}, {stop}), got those of [{got[0]}, {got[1]})")
        return got

    def what(self, node_type: str) -> str:
        """How messages name nodes of ``node_type``: ``nodes`` on a plain graph."""
        return "nodes" if self.plain else f"{node_type!r} nodes"

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

    def gather_local(self, node_type: str, nodes: torch.Tensor, features: bool,
                     labels: bool) -> NodeRows:
        """Features ``[len(nodes), F_t]`` (None for featureless types) and labels (None
        unless ``node_type`` is the target type) of nodes whose rows are here (:attr:`hold`)."""
        self.check_node_type(node_type, "node_type")
        ids = self.node_ids(nodes, "nodes")
        self.check_held(node_type, ids, "nodes")
        return self.gather_owned(node_type, ids, features, labels)

    # -- what each device implements -------------------------------------------------
    @abc.abstractmethod
    def node_ids(self, nodes: torch.Tensor, field: str) -> torch.Tensor:
        """``nodes`` as a 1-D int64 tensor on :attr:`device` (a ``ValueError`` naming
        ``field`` if they are not node IDs)."""

    @abc.abstractmethod
    def sample_owned(self, edge_type: EdgeType, nodes: torch.Tensor, fanout: int, key: int,
                     hop: int, edges: bool = False) -> HopSample:
        """:meth:`sample_relation` of nodes already known to have their in-edges here
        (:attr:`HopSample.edges`: the internal IDs of the drawn edges, with ``edges``;
        the same neighbors either way)."""

    @abc.abstractmethod
    def gather_owned(self, node_type: str, nodes: torch.Tensor, features: bool, labels: bool) -> NodeRows:
        """:meth:`gather_local` of nodes already known to have their rows here."""

    @abc.abstractmethod
    def new_relabeler(self, node_type: str, seeds: torch.Tensor) -> Relabeler:
        """A relabeler of ``node_type``'s nodes for one batch, ``seeds`` (may be empty) first."""

    def gather_local_into(self, node_type: str, nodes: torch.Tensor, positions: torch.Tensor,
                          x: torch.Tensor | None, y: torch.Tensor | None) -> None:
        """``x[positions]`` and ``y[positions]`` (each None: skipped) = the features, in
        ``x``'s dtype, and labels of ``nodes`` (their rows here). This default gathers, then
        scatters; a sampler may do both in one pass."""
        lx, ly = self.gather_local(node_type, nodes, x is not None, y is not None)
        assign_rows(x, positions, lx)
        assign_rows(y, positions, ly)

    def gather_local_into_blocks(self, node_type: str, nodes: torch.Tensor, positions: torch.Tensor,
                                 blocks: Blocks, layout: cpu_gather.RowBlocks | None) -> None:
        """:meth:`gather_local_into` of the features into ``blocks`` (see :meth:`gather_to`;
        ``positions`` increasing; ``layout``: the blocks as :class:`cpu_gather.RowBlocks`,
        None where they are not of one size). This default fills one block after another;
        a sampler may fill them all in one pass."""
        for a, _, rows, s, e in by_block(positions, blocks):
            self.gather_local_into(node_type, nodes[s:e], positions[s:e] - a, rows, None)

    # -- ranges ------------------------------------------------------------------------
    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor on :attr:`device` (on the CPU from ``malloc``, which
        reuses the last batch's block, with no torch call: :func:`protos.allocator.empty`)."""
        if self.device.type == "cpu":
            return allocator.empty(shape, dtype)
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    @property
    def num_partitions(self) -> int:
        return int(self.books[self.target_type].numel()) - 1

    def owner_of(self, node_type: str, nodes: torch.Tensor) -> torch.Tensor:
        """Partition ID of each global ID of ``node_type`` (a binary search of its book)."""
        book = self.books[node_type]
        if nodes.device.type == "cpu":  # one call that keeps the interpreter lock
            return torch.from_numpy(cpu_glue.owners(book.numpy(), nodes.numpy()))
        return torch.searchsorted(book.to(nodes.device), nodes, right=True) - 1

    def _ask_owners(self, node_type: str, ids: torch.Tensor, ask: Callable[[ByPartition], T]
                    ) -> tuple[dict[int, torch.Tensor], torch.Tensor | None, Future[T]]:
        """Start ``ask`` (a call to the partitions owning the IDs of ``ids`` that are not
        this partition's: their CPU IDs per partition) and return at once, so that this
        partition does its share meanwhile: each such partition's positions in ``ids``,
        this partition's (None: none), and the pending answer."""
        return self._ask_owners_at(node_type, ids, lambda pos: take(ids, pos).cpu(), ask)

    def _ask_owners_at(self, node_type: str, ids: torch.Tensor, select: Callable[[torch.Tensor], A],
                       ask: Callable[[Mapping[int, A]], T]
                       ) -> tuple[dict[int, torch.Tensor], torch.Tensor | None, Future[T]]:
        """:meth:`_ask_owners`, asking each other owner ``select(its positions in ids)``
        (made here, before the call starts: a pair's two ends, say)."""
        groups = owner_groups(self.owner_of(node_type, ids), self.num_partitions)
        local_pos = groups.pop(self.partition_id, None)
        asked = {p: select(pos) for p, pos in groups.items()}
        return groups, local_pos, begin(lambda: ask(asked), self.overlap_peers)

    @staticmethod
    def id_range(nodes: torch.Tensor) -> tuple[int, int]:
        """``(min, max)`` of a non-empty ID tensor, read back in one transfer (one
        synchronisation on a GPU); on the CPU in one call that keeps the interpreter lock."""
        if nodes.device.type == "cpu":
            lo_cpu, hi_cpu = cpu_glue.id_min_max(nodes.numpy())
            return int(lo_cpu), int(hi_cpu)
        lo, hi = torch.aminmax(nodes)
        first, last = torch.stack((lo, hi)).tolist()
        return int(first), int(last)

    def _within(self, nodes: torch.Tensor, bounds: tuple[int, int]) -> bool:
        """Whether every ID of ``nodes`` is in ``[start, stop)`` (one range test)."""
        if nodes.numel() == 0:
            return True
        lo, hi = self.id_range(nodes)
        return lo >= bounds[0] and hi < bounds[1]

    def _check_within(self, node_type: str, nodes: torch.Tensor, field: str, bounds: tuple[int, int],
                      holds: str = "") -> None:
        """Raise ``ValueError`` naming ``field`` unless every ID is in ``bounds``: the nodes
        whose ``holds`` this sampler holds (said to be the owned ones when they are), or
        (no ``holds``) the graph's."""
        if nodes.numel() == 0:
            return
        lo, hi = self.id_range(nodes)
        if lo < bounds[0] or hi >= bounds[1]:
            ids = "global node IDs" if self.plain else f"global {node_type!r} IDs"
            where = f"[{bounds[0]}, {bounds[1]})"
            owned = bounds == self.own[node_type]
            expected = (f"{ids} in {where}" if not holds else
                        f"{ids} owned by partition {self.partition_id}, in {where}" if owned else
                        f"{ids} in {where} (the nodes whose {holds} this sampler holds)")
            raise ValueError(f"{field}: expected {expected}; got values in [{lo}, {hi}]")

    def holds_all(self, node_type: str, nodes: torch.Tensor) -> bool:
        """Whether every ID of ``nodes`` has its features and labels here (:attr:`hold`)."""
        return self._within(nodes, self.hold[node_type])

    def check_held(self, node_type: str, nodes: torch.Tensor, field: str) -> None:
        self._check_within(node_type, nodes, field, self.hold[node_type], holds="features")

    def draws_all(self, node_type: str, nodes: torch.Tensor) -> bool:
        """Whether every ID of ``nodes`` has its in-edges here (:attr:`draw`)."""
        return self._within(nodes, self.draw[node_type])

    def check_drawable(self, node_type: str, nodes: torch.Tensor, field: str) -> None:
        self._check_within(node_type, nodes, field, self.draw[node_type], holds="in-edges")

    def check_in_graph(self, node_type: str, nodes: torch.Tensor, field: str) -> None:
        n = int(self.books[node_type][-1])
        self._check_within(node_type, nodes, field, (0, n))

    def check_node_type(self, node_type: str, field: str) -> None:
        if node_type not in self.node_types:
            raise ValueError(f"{field}: expected one of {list(self.node_types)}, got {node_type!r}")

    def check_edge_type(self, edge_type: EdgeType, field: str) -> EdgeType:
        et = tuple(edge_type)
        if et not in self.edge_types:
            raise ValueError(f"{field}: expected one of {list(self.edge_types)}, got {edge_type!r}")
        return et

    # -- original IDs --------------------------------------------------------------------
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
        groups, local_pos, pending = self._ask_owners(node_type, nodes,
                                                      lambda asked: remote.orig_ids(node_type, asked))
        out = torch.empty(nodes.numel(), dtype=torch.int64)
        if local_pos is not None:
            out[local_pos] = self._orig_ids_here(node_type, take(nodes, local_pos))
        answers = pending.result()  # bounded: peer calls carry deadlines
        for p, pos in groups.items():
            out[pos] = answers[p].to(torch.int64)
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
        groups, local_pos, pending = self._ask_owners_at(
            edge_type[2], dst_t, lambda pos: (src[pos.numpy()], dst[pos.numpy()]),
            lambda asked: remote.has_edges(edge_type, asked))
        out = np.zeros(dst_t.numel(), dtype=np.bool_)
        if local_pos is not None:
            here = local_pos.numpy()
            out[here] = self.has_edges_local(edge_type, src[here], dst[here])
        answers = pending.result()  # bounded: peer calls carry deadlines
        for p, where in groups.items():
            out[where.numpy()] = answers[p]
        return out

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
        groups, local_pos, pending = self._ask_owners(
            dst, frontier, lambda asked: remote.sample(edge_type, asked, fanout, key, hop, edges=edges))
        parts: dict[int, HopSample] = {}
        if local_pos is not None:
            parts[-1] = self.sample_relation(edge_type, take(frontier, local_pos), fanout, key, hop, edges)
        answers = pending.result()  # bounded: peer calls carry deadlines
        for p in groups:
            answer = answers[p]
            edge_ids = on_device(edges_of(answer, f"partition {p}"), self.device) if edges else None
            parts[p] = HopSample(on_device(answer.counts, self.device),
                                 on_device(answer.neighbors, self.device), edge_ids)
        if local_pos is not None:
            groups[-1] = local_pos
        return merge_hop_samples(frontier.numel(), groups, parts, self.device)

    # -- node data --------------------------------------------------------------------
    def has_features(self, node_type: str) -> bool:
        return node_type in self.node_data.x

    def empty_rows(self, node_type: str, count: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized ``[count, F_t]`` feature tensor on :attr:`device`."""
        return self.empty((count, self.node_data.x[node_type].shape[1]), dtype)

    def gather(self, node_type: str, n_id: torch.Tensor, *, features: bool = True, labels: bool = True,
               remote: Remote | None = None, dtype: torch.dtype | None = None) -> NodeRows:
        """Features (in ``dtype``; None: as stored; None for featureless types) and labels
        (the target type's) of ``n_id``'s nodes, in order; remote rows via ``remote``, asked
        for first, so that the rows here are gathered straight into their places while the
        peers gather theirs; the remote rows are scattered in once they arrive (a peer
        answers in ``dtype``)."""
        features = features and self.has_features(node_type)
        labels = labels and node_type == self.target_type
        if not (features or labels):
            return None, None
        held = self.holds_all(node_type, n_id)
        stored = torch_dtype(self.node_data.x[node_type].dtype) if features else None
        # on the CPU, cast on the way (one pass over the rows) rather than gather, then cast
        if held and not (features and dtype not in (None, stored) and self.device.type == "cpu"):
            lx, ly = self.gather_owned(node_type, n_id, features, labels)
            return (halfcast.cast(lx, dtype) if lx is not None and dtype is not None else lx), ly
        x = self.empty_rows(node_type, n_id.numel(), dtype or stored) if stored is not None else None
        y = self.empty((n_id.numel(),), torch.int64) if labels else None
        self._gather_split(node_type, n_id, held, x, y, (), None, remote)
        return x, y

    def gather_to(self, node_type: str, n_id: torch.Tensor, blocks: Blocks, *, labels: bool = True,
                  remote: Remote | None = None) -> torch.Tensor | None:
        """:meth:`gather` with the features written into ``blocks`` instead of a new
        tensor: ``(a, b, rows)`` holds rows ``a`` to ``b`` of the result, in ``rows``'
        dtype (e.g. :class:`protos.fastwire.RowMessages`' views of the stream messages
        that will carry them, so that no other copy of the rows is made). The blocks
        cover the rows in order. Returns the labels (None without ``labels``). On a GPU
        the rows are gathered there and copied into the blocks."""
        dtype = blocks[0][2].dtype if blocks else None
        labels = labels and node_type == self.target_type
        if self.device.type != "cpu" or not blocks:
            x, y = self.gather(node_type, n_id, features=bool(blocks), labels=labels, remote=remote,
                               dtype=dtype)
            for a, b, rows in blocks:
                rows.copy_(x[a:b])  # type: ignore[index]
            return y
        y = self.empty((n_id.numel(),), torch.int64) if labels else None
        self._gather_split(node_type, n_id, self.holds_all(node_type, n_id), None, y, blocks,
                           layout_of(blocks), remote)
        return y

    def _gather_split(self, node_type: str, n_id: torch.Tensor, held: bool, x: torch.Tensor | None,
                      y: torch.Tensor | None, blocks: Blocks, layout: cpu_gather.RowBlocks | None,
                      remote: Remote | None) -> None:
        """``x`` (or ``blocks``, with their ``layout``) and ``y`` (each None or empty:
        not asked for) = the rows of ``n_id`` (``held``: all here, :meth:`holds_all`), in
        place: those held here gathered straight into their places while the owners of the
        others gather theirs (asked for first), which are scattered in once they arrive."""
        groups: dict[int, torch.Tensor] = {}
        pending: Future[Mapping[int, NodeRows]] | None = None
        if held:
            local_pos: torch.Tensor | None = torch.from_numpy(cpu_glue.positions(n_id.numel()))
        elif remote is None:
            raise RuntimeError("gather: nodes of other partitions but no remote fetcher was given")
        else:
            groups, local_pos, pending = self._ask_owners(node_type, n_id, lambda asked: remote.node_data(
                node_type, asked, x is not None or bool(blocks), y is not None))
        if local_pos is not None:
            nodes = take(n_id, local_pos) if groups else n_id
            if x is not None or y is not None:
                self.gather_local_into(node_type, nodes, local_pos, x, y)
            if blocks:
                self.gather_local_into_blocks(node_type, nodes, local_pos, blocks, layout)
        answers = pending.result() if pending is not None else {}  # bounded: peer calls carry deadlines
        for p, pos in groups.items():
            rx, ry = answers[p]
            assign_rows(x, pos, rx)
            assign_rows(y, pos, ry)
            if blocks:
                if rx is None:
                    raise RuntimeError(f"gather: partition {p} answered without the features asked for")
                assign_rows_to_blocks(blocks, layout, pos, rx)

    def minibatch(self, seeds: Seeds, seed_type: str, num_neighbors: NumNeighbors,
                  key: int, *, features: bool = True, labels: bool = True, original_ids: bool = True,
                  remote: Remote | None = None, edges: bool = False) -> Minibatch:
        """Sample, then gather per node type: the whole minibatch of ``seeds`` (its
        structure with the sampled edges' internal IDs, with ``edges``)."""
        out = self.sample(seeds, seed_type, num_neighbors, key, remote, edges)
        batch = Minibatch(structure=out, target_type=self.target_type)
        for t, n_id in out.node.items():
            x, y = self.gather(t, n_id, features=features, labels=labels, remote=remote)
            if x is not None:
                batch.x[t] = x
            if y is not None:
                batch.y = y
            if original_ids:
                batch.orig_id[t] = self.orig_ids_of(t, n_id, remote)
        return batch
