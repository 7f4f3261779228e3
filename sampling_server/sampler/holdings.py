"""What one sampler holds (the IDs whose in-edges, node rows and edge rows are here) and
who holds the rest (the partition and edge books); the checks of given IDs against them,
naming the field; and the one way anything that spans partitions is read
(:meth:`Holdings.from_owners`)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np
import torch

from partitioner.graph import EdgeType, edge_type_name
from partitioner.partition import NodeData, Partition, Structure
from protos import allocator
from sampling_server.sampler import cpu_glue
from sampling_server.sampler.rows import begin, owner_groups

A = TypeVar("A")
R = TypeVar("R")


def owners_in(book: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The partition holding each ID (``book``: a partition or edge book): a binary search,
    on the CPU in one call that keeps the interpreter lock."""
    if ids.device.type == "cpu":
        return torch.from_numpy(cpu_glue.owners(book.numpy(), ids.numpy()))
    return torch.searchsorted(book.to(ids.device), ids, right=True) - 1


class Holdings(abc.ABC):
    """What a sampler of one partition holds (see the module doc)."""

    #: Where the sampler's tensors live.
    device: torch.device
    #: Whether requests to the peers run while this sampler does its own share (:func:`begin`).
    overlap_peers: bool = True

    def __init__(self, partition: Partition, *, replace: bool = False, weighted: bool = False,
                 structure: Structure | None = None, node_data: NodeData | None = None):
        """``structure``: the in-edges this sampler draws from (default: the partition's
        own, :attr:`Partition.structure`); one of wider ranges, such as the whole graph's
        (:func:`partitioner.joins.load_structure`), draws those nodes' neighbors here
        instead of asking their owners, with the same draws. ``node_data``: likewise the
        features and labels it gathers from (default: the partition's own; the whole
        graph's, :func:`partitioner.joins.load_node_data`, gathers every row here)."""
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
        #: Edge type to its int64 ``[P+1]`` edge book: partition p holds the rows of the
        #: internal edge IDs ``[book[p], book[p+1])`` (:meth:`~partitioner.manifest.Manifest.edge_book`).
        self.edge_books = {et: torch.tensor(m.edge_book(et), dtype=torch.int64) for et in self.edge_types}
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

    @abc.abstractmethod
    def node_ids(self, nodes: torch.Tensor, field: str) -> torch.Tensor:
        """``nodes`` as a 1-D int64 tensor on :attr:`device` (a ``ValueError`` naming
        ``field`` if they are not node IDs)."""

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor on :attr:`device` (on the CPU from ``malloc``, which
        reuses the last batch's block, with no torch call: :func:`protos.allocator.empty`)."""
        if self.device.type == "cpu":
            return allocator.empty(shape, dtype)
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    # -- owners ------------------------------------------------------------------------
    @property
    def num_partitions(self) -> int:
        return int(self.books[self.target_type].numel()) - 1

    def owner_of(self, node_type: str, nodes: torch.Tensor) -> torch.Tensor:
        """Partition ID of each global ID of ``node_type`` (a binary search of its book)."""
        return owners_in(self.books[node_type], nodes)

    def edge_range(self, edge_type: EdgeType) -> tuple[int, int]:
        """``[start, stop)`` of the internal edge IDs of ``edge_type`` whose rows are here."""
        book = self.edge_books[edge_type]
        return int(book[self.partition_id]), int(book[self.partition_id + 1])

    def from_owners(self, owner: torch.Tensor, select: Callable[[torch.Tensor], A],
                    ask: Callable[[dict[int, A]], Mapping[int, R]], here: Callable[[torch.Tensor], object],
                    put: Callable[[int, torch.Tensor, R], object]) -> None:
        """The one way a sampler reads what spans partitions. ``owner``: the partition of
        each ID. The other owners are asked first, ``ask`` getting per owner
        ``select(its positions)`` (made here, before the call starts) on a thread of its
        own (:func:`~sampling_server.sampler.rows.begin`); meanwhile ``here(positions)``
        does this partition's share; then each owner's answer is put in its place,
        ``put(owner, its positions, answer)``. The wait has no timeout of its own: peer
        calls carry their deadlines."""
        groups = owner_groups(owner, self.num_partitions)
        local = groups.pop(self.partition_id, None)
        asked = {p: select(pos) for p, pos in groups.items()}
        pending = begin(lambda: ask(asked), self.overlap_peers)
        if local is not None:
            here(local)
        answers = pending.result()
        for p, pos in groups.items():
            put(p, pos, answers[p])

    # -- checks --------------------------------------------------------------------------
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

    def check_edges_held(self, edge_type: EdgeType, edges: torch.Tensor, field: str) -> None:
        """Raise ``ValueError`` naming ``field`` unless every internal edge ID of the CPU
        tensor ``edges`` has its rows here (:meth:`edge_range`)."""
        start, stop = self.edge_range(edge_type)
        if not self._within(edges, (start, stop)):
            bad = edges[(edges < start) | (edges >= stop)]
            raise ValueError(f"{field}: expected internal edge IDs of {edge_type_name(edge_type)} in "
                             f"[{start}, {stop}) (the edges held here), got {bad[:5].tolist()}")

    def check_node_type(self, node_type: str, field: str) -> None:
        if node_type not in self.node_types:
            raise ValueError(f"{field}: expected one of {list(self.node_types)}, got {node_type!r}")

    def check_edge_type(self, edge_type: EdgeType, field: str) -> EdgeType:
        et = tuple(edge_type)
        if et not in self.edge_types:
            raise ValueError(f"{field}: expected one of {list(self.edge_types)}, got {edge_type!r}")
        return et
