"""The sampler interface shared by the CPU and CUDA implementations.

A :class:`NeighborSampler` serves one partition. Per hop it splits the frontier by
owner (the partition book), draws the neighbors of its own nodes with its kernels, asks
the owners of the other nodes through a :class:`RemoteNeighbors` callback, merges the
parts back into frontier order, and dedups/relabels the new nodes. Draws depend only on
``(batch key, hop, node)``, so the split changes nothing: a multi-partition batch equals
the batch one sampler holding the whole graph would draw.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from partitioner.format import NodeData, Partition, Structure
from protos import allocator, halfcast
from sampling_server.sampler import cpu_gather, cpu_kernels
from sampling_server.sampler.types import HopSample, Minibatch, SamplerOutput

T = TypeVar("T")

#: Most peer requests in flight at once while their callers do their own share.
PEER_WAIT_THREADS = 64
_peer_waits: ThreadPoolExecutor | None = None
_peer_waits_lock = threading.Lock()


def begin(call: Callable[[], T], overlap: bool = True, pool: Executor | None = None) -> Future[T]:
    """Start ``call`` (a request to the peers) on a thread of its own and return at once,
    so that the caller's share of the same hop or gather overlaps the round trip. The
    caller waits on the future without a timeout of its own: peer calls carry their
    deadlines. Threads are made as calls need them (at most :data:`PEER_WAIT_THREADS`),
    or taken from ``pool`` when given. ``overlap=False`` runs ``call`` here, before
    returning."""
    global _peer_waits
    if not overlap:
        done: Future[T] = Future()
        try:
            done.set_result(call())
        except Exception as exc:  # re-raised by done.result(), as a pool's future does
            done.set_exception(exc)
        return done
    if pool is not None:
        return pool.submit(call)
    with _peer_waits_lock:
        if _peer_waits is None:
            _peer_waits = ThreadPoolExecutor(PEER_WAIT_THREADS, thread_name_prefix="peer-wait")
        return _peer_waits.submit(call)


def torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    """The torch dtype of a NumPy dtype (float16/32/64, the integer types)."""
    return torch.from_numpy(np.empty(0, dtype)).dtype


def is_identity(orig_ids: np.ndarray, start: int) -> bool:
    """Whether the owned nodes' original IDs are their global IDs (``start`` onwards): so
    in every part of a ``range`` partitioning, whose parts keep the graph's ID order."""
    ids = np.asarray(orig_ids)
    return bool(np.array_equal(ids, np.arange(start, start + ids.size, dtype=ids.dtype)))


def original_ids(orig_ids: np.ndarray, nodes: np.ndarray, start: int, identity: bool) -> np.ndarray:
    """int64 original IDs of owned ``nodes`` (global IDs; the first owned is ``start``): a
    copy of ``nodes`` when ``identity`` (:func:`is_identity`), else a parallel gather."""
    if identity:
        return np.array(nodes, dtype=np.int64)
    return cpu_gather.gather(np.asarray(orig_ids), np.ascontiguousarray(nodes, dtype=np.int64),
                             start).astype(np.int64, copy=False)


class RemoteNeighbors(Protocol):
    """Draws the neighbors of frontier nodes owned by other partitions.

    Called once per hop with every remote partition's nodes (CPU int64 tensors of global
    IDs), so an implementation can call the peers concurrently; returns, per partition,
    what that partition's own :meth:`NeighborSampler.sample_neighbors` returned.
    """

    def __call__(
        self, nodes_by_partition: Mapping[int, torch.Tensor], fanout: int, key: int, hop: int
    ) -> Mapping[int, HopSample]: ...


class RemoteNodeData(Protocol):
    """Fetches features and labels of nodes owned by other partitions (CPU tensors)."""

    def __call__(
        self, nodes_by_partition: Mapping[int, torch.Tensor], features: bool, labels: bool
    ) -> Mapping[int, tuple[torch.Tensor | None, torch.Tensor | None]]: ...


class RemoteOrigIds(Protocol):
    """Looks up the original IDs of nodes owned by other partitions (CPU int64 tensors
    of global IDs in, of original IDs out, per partition)."""

    def __call__(self, nodes_by_partition: Mapping[int, torch.Tensor]) -> Mapping[int, torch.Tensor]: ...


class Relabeler(abc.ABC):
    """Dedups sampled nodes across the hops of one batch and numbers them in first-seen
    order, after the seeds (local IDs ``0 .. batch_size-1``)."""

    @abc.abstractmethod
    def add(self, neighbors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(new_nodes, local_ids)``: the global IDs in ``neighbors`` not seen
        before, in first-seen order (they get the next local IDs), and the local ID of
        every entry of ``neighbors``."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release what the relabeler holds (called once the batch is done)."""


def check_fanouts(fanouts: Sequence[int]) -> list[int]:
    """Fanouts as ints; ``-1`` means all neighbors (as in PyG)."""
    out = [int(f) for f in fanouts]
    if not out:
        raise ValueError("fanouts: expected at least one hop, got []")
    bad = [f for f in out if f < -1]
    if bad:
        raise ValueError(f"fanouts: expected integers >= 0, or -1 for all neighbors; got {out}")
    return out


class NeighborSampler(abc.ABC):
    """Multi-hop neighbor sampling over one partition, with PyG ``NeighborLoader``
    semantics: per hop each frontier node draws up to ``fanout`` in-neighbors uniformly
    without replacement (all of them when it has fewer), or with replacement, or in
    proportion to edge weights."""

    #: Where the sampler's tensors live.
    device: torch.device
    #: Whether requests to the peers run while this sampler does its own share (:func:`begin`).
    overlap_peers: bool = True

    def __init__(self, partition: Partition, *, replace: bool = False, weighted: bool = False,
                 structure: Structure | None = None, node_data: NodeData | None = None):
        """``structure``: the in-edges this sampler draws from (default: the partition's
        own, :attr:`Partition.structure`); one of a wider range, such as the whole graph's
        (:func:`partitioner.format.load_structure`), draws those nodes' neighbors here
        instead of asking their owners, with the same draws. ``node_data``: likewise the
        features and labels it gathers from (default: the partition's own,
        :attr:`Partition.node_data`; the whole graph's, :func:`partitioner.format.load_node_data`,
        gathers every row here)."""
        structure = partition.structure if structure is None else structure
        node_data = partition.node_data if node_data is None else node_data
        if weighted and structure.edge_weight is None:
            raise ValueError("weighted: the partition has no edge weights (edge_weight.npy)")
        self.partition = partition
        self.replace = replace
        self.weighted = weighted
        self.partition_book = torch.from_numpy(np.asarray(partition.partition_book, np.int64))
        self.node_start, self.node_stop = partition.node_range
        own_start, own_stop = self.node_start, self.node_stop
        lo, hi = structure.node_range
        if lo > own_start or hi < own_stop:
            raise ValueError(f"structure: expected the in-edges of at least the owned nodes "
                             f"[{own_start}, {own_stop}), got those of [{lo}, {hi})")
        #: The in-edges drawn from here.
        self.structure = structure
        #: ``[start, stop)`` of the global IDs whose neighbors are drawn here (the owned
        #: range, or more with a wider :attr:`structure`).
        self.draw_start, self.draw_stop = lo, hi
        lo, hi = node_data.node_range
        if lo > own_start or hi < own_stop or node_data.x.shape[1:] != partition.x.shape[1:] \
                or node_data.x.dtype != partition.x.dtype:
            raise ValueError(f"node_data: expected the {partition.x.dtype} features of at least "
                             f"the owned nodes [{own_start}, {own_stop}), rows of "
                             f"{list(partition.x.shape[1:])}, got those of [{lo}, {hi}), "
                             f"{node_data.x.dtype} rows of {list(node_data.x.shape[1:])}")
        #: The features and labels gathered from here.
        self.node_data = node_data
        #: ``[start, stop)`` of the global IDs whose rows are gathered here (the owned
        #: range, or more with a wider :attr:`node_data`).
        self.hold_start, self.hold_stop = lo, hi
        #: Whether original ID = global ID for every node of a wider structure (None: not
        #: checked yet).
        self._structure_identity: bool | None = None
        #: Whether original ID = global ID for every owned node (None: not checked yet).
        self._orig_identity: bool | None = None

    # -- what each device implements -------------------------------------------------
    @abc.abstractmethod
    def sample_neighbors(self, nodes: torch.Tensor, fanout: int, key: int, hop: int) -> HopSample:
        """Draw in-neighbors of ``nodes`` (global IDs in :attr:`structure`'s range: owned
        by this partition unless the structure is wider; on :attr:`device`). This is also
        what a peer serves for a remote frontier."""

    @abc.abstractmethod
    def new_relabeler(self, seeds: torch.Tensor) -> Relabeler:
        """A relabeler for one batch whose seeds (unique, on :attr:`device`) come first."""

    @abc.abstractmethod
    def gather_local(
        self, nodes: torch.Tensor, features: bool, labels: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Features ``[len(nodes), F]`` and labels ``[len(nodes)]`` of nodes whose rows are
        here (:attr:`node_data`: the owned ones, or more)."""

    def sample_owned(self, nodes: torch.Tensor, fanout: int, key: int, hop: int) -> HopSample:
        """:meth:`sample_neighbors` of nodes already known to have their in-edges here (a
        sampler may skip its check of them)."""
        return self.sample_neighbors(nodes, fanout, key, hop)

    def gather_owned(
        self, nodes: torch.Tensor, features: bool, labels: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """:meth:`gather_local` of nodes already known to have their rows here."""
        return self.gather_local(nodes, features, labels)

    def gather_local_into(self, nodes: torch.Tensor, positions: torch.Tensor,
                          x: torch.Tensor | None, y: torch.Tensor | None) -> None:
        """``x[positions]`` and ``y[positions]`` (each None: skipped) = the features, in
        ``x``'s dtype, and labels of ``nodes`` (their rows here). This default gathers, then
        scatters; a sampler may do both in one pass."""
        lx, ly = self.gather_local(nodes, x is not None, y is not None)
        assign_rows(x, positions, lx)
        assign_rows(y, positions, ly)

    # -- shared logic ----------------------------------------------------------------
    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor on :attr:`device` (on the CPU from ``malloc``, which
        reuses the last batch's block, with no torch call: :func:`protos.allocator.empty`)."""
        if self.device.type == "cpu":
            return allocator.empty(shape, dtype)
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def empty_rows(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized ``[count, F]`` feature tensor on :attr:`device`."""
        return self.empty((count, self.node_data.x.shape[1]), dtype)

    @property
    def num_partitions(self) -> int:
        """Partitions of the graph (the partition book's entries, less one)."""
        return int(self.partition_book.numel()) - 1

    def owner_of(self, nodes: torch.Tensor) -> torch.Tensor:
        """Partition ID of each global node ID (a binary search of the partition book)."""
        if nodes.device.type == "cpu":  # one call that keeps the interpreter lock
            return torch.from_numpy(cpu_kernels.owners(self.partition_book.numpy(), nodes.numpy()))
        book = self.partition_book.to(nodes.device)
        return torch.searchsorted(book, nodes, right=True) - 1

    @staticmethod
    def id_range(nodes: torch.Tensor) -> tuple[int, int]:
        """``(min, max)`` of a non-empty ID tensor, read back in one transfer (one
        synchronisation on a GPU, where each read is one); on the CPU in one call that
        keeps the interpreter lock (:func:`cpu_kernels.id_min_max`)."""
        if nodes.device.type == "cpu":
            lo_cpu, hi_cpu = cpu_kernels.id_min_max(nodes.numpy())
            return int(lo_cpu), int(hi_cpu)
        lo, hi = torch.aminmax(nodes)
        first, last = torch.stack((lo, hi)).tolist()
        return int(first), int(last)

    def _within(self, nodes: torch.Tensor, start: int, stop: int) -> bool:
        """Whether every ID of ``nodes`` is in ``[start, stop)`` (one range test)."""
        if nodes.numel() == 0:
            return True
        lo, hi = self.id_range(nodes)
        return lo >= start and hi < stop

    def _check_within(self, nodes: torch.Tensor, field: str, start: int, stop: int,
                      what: str) -> None:
        """Raise ``ValueError`` naming ``field`` unless every ID is in ``[start, stop)``,
        the nodes whose ``what`` this sampler holds (the owned range: :meth:`check_owned`)."""
        if start == self.node_start and stop == self.node_stop:
            self.check_owned(nodes, field)
        elif nodes.numel():
            lo, hi = self.id_range(nodes)
            if lo < start or hi >= stop:
                raise ValueError(f"{field}: expected global node IDs in [{start}, {stop}) (the "
                                 f"nodes whose {what} this sampler holds); got values in "
                                 f"[{lo}, {hi}]")

    def owns_all(self, nodes: torch.Tensor) -> bool:
        """Whether every ID of ``nodes`` is owned here (a range test: a partition owns
        one contiguous range of global IDs)."""
        return self._within(nodes, self.node_start, self.node_stop)

    def check_owned(self, nodes: torch.Tensor, field: str) -> None:
        """Raise ``ValueError`` naming ``field`` unless every ID is owned here."""
        if nodes.numel() == 0:
            return
        lo, hi = self.id_range(nodes)
        if lo < self.node_start or hi >= self.node_stop:
            raise ValueError(
                f"{field}: expected global node IDs owned by partition "
                f"{self.partition.partition_id}, in [{self.node_start}, {self.node_stop}); "
                f"got values in [{lo}, {hi}]"
            )

    def holds_all(self, nodes: torch.Tensor) -> bool:
        """Whether every ID of ``nodes`` has its features and labels here (:attr:`node_data`)."""
        return self._within(nodes, self.hold_start, self.hold_stop)

    def check_held(self, nodes: torch.Tensor, field: str) -> None:
        """Raise ``ValueError`` naming ``field`` unless every ID has its rows here."""
        self._check_within(nodes, field, self.hold_start, self.hold_stop, "features")

    def draws_all(self, nodes: torch.Tensor) -> bool:
        """Whether every ID of ``nodes`` has its in-edges here (:attr:`structure`)."""
        return self._within(nodes, self.draw_start, self.draw_stop)

    def check_drawable(self, nodes: torch.Tensor, field: str) -> None:
        """Raise ``ValueError`` naming ``field`` unless every ID has its in-edges here."""
        self._check_within(nodes, field, self.draw_start, self.draw_stop, "in-edges")

    def check_in_graph(self, nodes: torch.Tensor, field: str) -> None:
        """Raise ``ValueError`` naming ``field`` unless every ID is a node of the graph."""
        if nodes.numel() == 0:
            return
        num_nodes = int(self.partition_book[-1])
        lo, hi = self.id_range(nodes)
        if lo < 0 or hi >= num_nodes:
            raise ValueError(f"{field}: expected global node IDs in [0, {num_nodes}); got values "
                             f"in [{lo}, {hi}]")

    def orig_ids_of(self, n_id: torch.Tensor, remote: RemoteOrigIds | None = None) -> torch.Tensor:
        """Original IDs of ``n_id``'s nodes (CPU int64), in order; remote ones via ``remote``."""
        nodes = n_id.detach().cpu()
        if nodes.numel() == 0 or (int(nodes.min()) >= self.node_start
                                  and int(nodes.max()) < self.node_stop):
            return self._orig_ids_local(nodes)
        if self.draws_all(nodes):  # a wider structure has every node's original ID
            if self._structure_identity is None:
                self._structure_identity = is_identity(self.structure.orig_ids, self.draw_start)
            return torch.from_numpy(original_ids(self.structure.orig_ids, nodes.numpy(),
                                                 self.draw_start, self._structure_identity))
        owner = self.owner_of(nodes)
        mine = owner == self.partition.partition_id
        if remote is None:
            raise RuntimeError("orig_ids_of: nodes of other partitions but no remote lookup was given")
        groups = owner_groups(owner, self.partition.partition_id)
        asked = {p: nodes[pos] for p, pos in groups.items()}
        pending = begin(lambda: remote(asked), self.overlap_peers)
        out = torch.empty(nodes.numel(), dtype=torch.int64)
        local = torch.nonzero(mine).flatten()
        out[local] = self._orig_ids_local(nodes[local])
        answers = pending.result()  # bounded: peer calls carry deadlines
        for p, pos in groups.items():
            out[pos] = answers[p].to(torch.int64)
        return out

    def _orig_ids_local(self, nodes: torch.Tensor) -> torch.Tensor:
        """int64 original IDs of owned ``nodes`` (a CPU tensor)."""
        if self._orig_identity is None:  # one pass over the IDs, on first use
            self._orig_identity = is_identity(self.partition.orig_ids, self.node_start)
        return torch.from_numpy(original_ids(self.partition.orig_ids, nodes.numpy(),
                                             self.node_start, self._orig_identity))

    def sample(
        self, seeds: torch.Tensor | np.ndarray, fanouts: Sequence[int], key: int,
        remote: RemoteNeighbors | None = None,
    ) -> SamplerOutput:
        """Sample the multi-hop neighborhood of ``seeds`` (unique global IDs). Seeds owned
        by other partitions need ``remote``: their neighbors are drawn by their owners,
        exactly as for a remote frontier node."""
        hops = check_fanouts(fanouts)
        if isinstance(seeds, np.ndarray):  # copies: split arrays are read-only memmaps
            seeds = torch.from_numpy(np.array(seeds, dtype=np.int64))
        seeds_t = seeds.to(device=self.device, dtype=torch.int64)
        if remote is None:
            self.check_drawable(seeds_t, "seeds")
        else:
            self.check_in_graph(seeds_t, "seeds")
        relabeler = self.new_relabeler(seeds_t)
        nodes, rows, cols = [seeds_t], [], []
        num_nodes, num_edges = [int(seeds_t.numel())], []
        frontier, first_local = seeds_t, 0
        try:
            for hop, fanout in enumerate(hops):
                drawn = self.sample_frontier(frontier, fanout, key, hop, remote)
                new_nodes, local = relabeler.add(drawn.neighbors)
                targets = torch.arange(first_local, first_local + frontier.numel(),
                                       device=self.device)
                rows.append(local)
                # output_size: known here, so a GPU need not read the sum back
                cols.append(torch.repeat_interleave(targets, drawn.counts,
                                                    output_size=int(local.numel())))
                first_local += frontier.numel()
                nodes.append(new_nodes)
                num_nodes.append(int(new_nodes.numel()))
                num_edges.append(int(local.numel()))
                frontier = new_nodes
        finally:
            relabeler.close()
        return SamplerOutput(n_id=torch.cat(nodes), row=torch.cat(rows), col=torch.cat(cols),
                             num_sampled_nodes=num_nodes, num_sampled_edges=num_edges)

    def sample_frontier(
        self, frontier: torch.Tensor, fanout: int, key: int, hop: int,
        remote: RemoteNeighbors | None,
    ) -> HopSample:
        """Neighbors of a frontier that may span partitions, in frontier order."""
        if self.draws_all(frontier):
            return self.sample_owned(frontier, fanout, key, hop)
        owner = self.owner_of(frontier)
        if remote is None:
            raise RuntimeError(
                f"frontier of hop {hop} reaches other partitions but no remote sampler was given"
            )
        groups = owner_groups(owner, num_parts=self.num_partitions)
        local_pos = groups.pop(self.partition.partition_id, None)
        asked = {p: _take(frontier, pos).cpu() for p, pos in groups.items()}
        # the owners draw while this partition draws its own share
        pending = begin(lambda: remote(asked, fanout, key, hop), self.overlap_peers)
        parts: dict[int, HopSample] = {}
        if local_pos is not None:
            parts[-1] = self.sample_neighbors(_take(frontier, local_pos), fanout, key, hop)
        answers = pending.result()  # bounded: peer calls carry deadlines
        for p in groups:
            parts[p] = HopSample(_on(answers[p].counts, self.device),
                                 _on(answers[p].neighbors, self.device))
        if local_pos is not None:
            groups[-1] = local_pos
        return merge_hop_samples(frontier.numel(), groups, parts, self.device)

    def gather(
        self, n_id: torch.Tensor, *, features: bool = True, labels: bool = True,
        remote: RemoteNodeData | None = None, dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Features (in ``dtype``; None: as stored) and labels of ``n_id``'s nodes, in
        order; remote rows via ``remote``, asked for first, so that the owned rows are
        gathered straight into their places while the peers gather theirs; the remote
        rows are scattered in once they arrive (a peer answers in ``dtype``)."""
        if self.holds_all(n_id):
            stored = torch_dtype(self.node_data.x.dtype)
            if features and dtype is not None and dtype != stored and self.device.type == "cpu":
                # cast on the way (one pass over the rows) rather than gather, then cast
                rows = self.empty_rows(n_id.numel(), dtype)
                ys = self.empty((n_id.numel(),), torch.int64) if labels else None
                self.gather_local_into(n_id, torch.from_numpy(cpu_kernels.positions(n_id.numel())),
                                       rows, ys)
                return rows, ys
            lx, ly = self.gather_owned(n_id, features, labels)
            return (halfcast.cast(lx, dtype) if lx is not None and dtype is not None else lx), ly
        owner = self.owner_of(n_id)
        if remote is None:
            raise RuntimeError("gather: nodes of other partitions but no remote fetcher was given")
        x = self.empty_rows(n_id.numel(), dtype or torch_dtype(self.node_data.x.dtype)) \
            if features else None
        y = self.empty((n_id.numel(),), torch.int64) if labels else None
        groups = owner_groups(owner, num_parts=self.num_partitions)
        local_pos = groups.pop(self.partition.partition_id, None)
        asked = {p: _take(n_id, pos).cpu() for p, pos in groups.items()}
        # the owners gather while this partition gathers its own rows
        pending = begin(lambda: remote(asked, features, labels), self.overlap_peers)
        if local_pos is not None:
            self.gather_local_into(_take(n_id, local_pos), local_pos, x, y)
        answers = pending.result()  # bounded: peer calls carry deadlines
        for p, pos in groups.items():
            rx, ry = answers[p]
            assign_rows(x, pos, rx)
            assign_rows(y, pos, ry)
        return x, y

    def gather_to(
        self, n_id: torch.Tensor, blocks: Sequence[tuple[int, int, torch.Tensor]], *,
        labels: bool = True, remote: RemoteNodeData | None = None,
    ) -> torch.Tensor | None:
        """:meth:`gather` with the features written into ``blocks`` instead of a new
        tensor: ``(a, b, rows)`` holds rows ``a`` to ``b`` of the result, in ``rows``'
        dtype (e.g. :class:`protos.fastwire.RowMessages`' views of the stream messages
        that will carry them, so that no other copy of the rows is made). The blocks
        cover the rows in order. Returns the labels (None without ``labels``). On a GPU
        the rows are gathered there and copied into the blocks."""
        dtype = blocks[0][2].dtype if blocks else None
        if self.device.type != "cpu" or not blocks:
            x, y = self.gather(n_id, features=bool(blocks), labels=labels, remote=remote, dtype=dtype)
            for a, b, rows in blocks:
                rows.copy_(x[a:b])  # type: ignore[index]
            return y
        y = self.empty((n_id.numel(),), torch.int64) if labels else None
        layout = _layout(blocks)
        if self.holds_all(n_id):
            everywhere = torch.from_numpy(cpu_kernels.positions(n_id.numel()))
            if y is not None:  # the labels in one pass, the rows in another
                self.gather_local_into(n_id, everywhere, None, y)
            self.gather_local_into_blocks(n_id, everywhere, blocks, layout)
            return y
        if remote is None:
            raise RuntimeError("gather: nodes of other partitions but no remote fetcher was given")
        groups = owner_groups(self.owner_of(n_id), num_parts=self.num_partitions)
        local_pos = groups.pop(self.partition.partition_id, None)
        asked = {p: _take(n_id, pos).cpu() for p, pos in groups.items()}
        pending = begin(lambda: remote(asked, True, labels), self.overlap_peers)
        if local_pos is not None:
            nodes = _take(n_id, local_pos)
            if y is not None:
                self.gather_local_into(nodes, local_pos, None, y)
            self.gather_local_into_blocks(nodes, local_pos, blocks, layout)
        answers = pending.result()  # bounded: peer calls carry deadlines
        for p, pos in groups.items():
            rx, ry = answers[p]
            assign_rows(y, pos, ry)
            if rx is None:
                raise RuntimeError(f"gather: partition {p} answered without the features asked for")
            assign_rows_to_blocks(blocks, layout, pos, rx)
        return y

    def gather_local_into_blocks(self, nodes: torch.Tensor, positions: torch.Tensor,
                                 blocks: Sequence[tuple[int, int, torch.Tensor]],
                                 layout: cpu_gather.RowBlocks | None) -> None:
        """:meth:`gather_local_into` of the features into ``blocks`` (see :meth:`gather_to`;
        ``positions`` increasing; ``layout``: the blocks as :class:`cpu_gather.RowBlocks`,
        None where they are not of one size). This default fills one block after another;
        a sampler may fill them all in one pass."""
        for a, _, rows, s, e in _by_block(positions, blocks):
            self.gather_local_into(nodes[s:e], positions[s:e] - a, rows, None)

    def minibatch(
        self, seeds: torch.Tensor | np.ndarray, fanouts: Sequence[int], key: int, *,
        features: bool = True, labels: bool = True, remote: RemoteNeighbors | None = None,
        remote_data: RemoteNodeData | None = None,
    ) -> Minibatch:
        """Sample, then gather: the whole minibatch of ``seeds``."""
        out = self.sample(seeds, fanouts, key, remote)
        x, y = self.gather(out.n_id, features=features, labels=labels, remote=remote_data)
        return Minibatch(structure=out, x=x, y=y)


def owner_groups(owner: torch.Tensor, skip: int | None = None,
                 num_parts: int | None = None) -> dict[int, torch.Tensor]:
    """Per partition present in ``owner`` (partition IDs, one per node; ``skip`` left
    out), the positions of its nodes, in order. The partitions present come from a count
    per partition (one pass), not from sorting ``owner``; on the CPU, with ``num_parts``
    (more than any ID in ``owner``), one counting sort that keeps the interpreter lock."""
    if owner.numel() == 0:
        return {}
    if owner.device.type == "cpu" and num_parts is not None:
        order, starts = cpu_kernels.group_positions(owner.numpy(), num_parts)
        return {p: torch.from_numpy(order[starts[p]:starts[p + 1]]) for p in range(num_parts)
                if starts[p + 1] > starts[p] and p != skip}
    present = torch.bincount(owner).nonzero().flatten().tolist()
    return {p: torch.nonzero(owner == p).flatten() for p in present if p != skip}


def _layout(blocks: Sequence[tuple[int, int, torch.Tensor]]) -> cpu_gather.RowBlocks | None:
    """CPU ``blocks`` of one size (the last may be shorter) as :class:`cpu_gather.RowBlocks`;
    None for others."""
    size = blocks[0][1] - blocks[0][0]
    if any(a != k * size or rows.device.type != "cpu" or not rows.is_contiguous() or rows.dim() != 2
           for k, (a, _, rows) in enumerate(blocks)):
        return None
    try:
        return cpu_gather.RowBlocks([numpy_words(rows) for _, _, rows in blocks])
    except ValueError:
        return None


def assign_rows_to_blocks(blocks: Sequence[tuple[int, int, torch.Tensor]],
                          layout: cpu_gather.RowBlocks | None, pos: torch.Tensor,
                          value: torch.Tensor) -> None:
    """:func:`assign_rows` into ``blocks`` (``pos`` increasing): in one parallel pass where
    ``layout`` says they are of one size and ``value`` comes in their dtype (peers answer
    in the wire dtype), else block by block."""
    value = _on(value, torch.device("cpu"))
    if layout is not None and value.dtype == blocks[0][2].dtype and value.dim() == 2 \
            and value.is_contiguous():
        cpu_gather.scatter_into_blocks(numpy_words(value),
                                       int64_array(pos),
                                       layout)
        return
    for a, _, rows, s, e in _by_block(pos, blocks):
        assign_rows(rows, pos[s:e] - a, value[s:e])


def _by_block(positions: torch.Tensor, blocks: Sequence[tuple[int, int, torch.Tensor]]
              ) -> list[tuple[int, int, torch.Tensor, int, int]]:
    """Per block ``(a, b, rows)`` with any of the increasing ``positions`` in ``[a, b)``:
    ``(a, b, rows, s, e)``, those positions being ``positions[s:e]``."""
    bounds = np.searchsorted(positions.numpy(), [a for a, _, _ in blocks] + [blocks[-1][1]])
    return [(a, b, rows, int(bounds[k]), int(bounds[k + 1])) for k, (a, b, rows) in enumerate(blocks)
            if bounds[k + 1] > bounds[k]]


def _take(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``values[positions]`` (1-D); on the CPU in a call that keeps the interpreter lock."""
    if values.device.type == "cpu" and positions.device.type == "cpu":
        return torch.from_numpy(cpu_kernels.take(values.numpy(), positions.numpy()))
    return values[positions]


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, without a torch call (which releases the interpreter lock)
    when it is there already."""
    return t if t.device == device else t.to(device)


def assign_rows(dest: torch.Tensor | None, pos: torch.Tensor, value: torch.Tensor | None) -> None:
    """``dest[pos] = value`` in ``dest``'s dtype (cast as :mod:`protos.halfcast` does); on
    the CPU a parallel Numba scatter."""
    if dest is None or value is None:
        return
    value = _on(value, dest.device)
    if value.dtype != dest.dtype:
        value = halfcast.cast(value, dest.dtype)
    if dest.device.type == "cpu" and value.dim() == dest.dim() \
            and value.shape[1:] == dest.shape[1:] and dest.is_contiguous():
        words = numpy_words(value)
        cpu_gather.scatter_into(words if words.flags.c_contiguous else np.ascontiguousarray(words),
                                int64_array(pos),
                                numpy_words(dest))
    else:
        dest[pos] = value


def int64_array(t: torch.Tensor) -> np.ndarray:
    """A CPU integer tensor as an int64 NumPy array (no torch call when it is one)."""
    arr = t.numpy()
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)


def numpy_words(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as NumPy (bfloat16, which NumPy lacks, as uint16 words)."""
    if t.dtype != torch.bfloat16:
        return t.numpy()
    words = allocator.words_of(t)
    return words if words is not None else t.view(torch.int16).numpy().view(np.uint16)


def merge_hop_samples(
    frontier_size: int, positions: Mapping[int, torch.Tensor], parts: Mapping[int, HopSample],
    device: torch.device,
) -> HopSample:
    """Put per-owner answers back in frontier order: ``parts[g]`` answers the frontier
    entries at ``positions[g]``."""
    if device.type == "cpu":  # calls that keep the interpreter lock, and one kernel a part
        none = np.zeros(0, np.int64)
        part_counts = {g: int64_array(parts[g].counts) for g in positions}
        full, offsets_np = cpu_kernels.run_offsets(
            frontier_size, np.concatenate([pos.numpy() for pos in positions.values()] or [none]),
            np.concatenate(list(part_counts.values()) or [none]))
        neighbors_np = np.empty(cpu_kernels.total(full), dtype=np.int64)
        for g, pos in positions.items():
            cpu_gather.place_runs(pos.numpy(), part_counts[g], int64_array(parts[g].neighbors),
                                  offsets_np, neighbors_np)
        return HopSample(counts=torch.from_numpy(full), neighbors=torch.from_numpy(neighbors_np))
    counts = torch.zeros(frontier_size, dtype=torch.int64, device=device)
    for g, pos in positions.items():
        counts[pos] = parts[g].counts
    offsets = torch.cumsum(counts, 0) - counts
    neighbors = torch.empty(int(counts.sum()), dtype=torch.int64, device=device)
    for g, pos in positions.items():
        part = parts[g]
        if part.neighbors.numel() == 0:
            continue
        part_offsets = torch.cumsum(part.counts, 0) - part.counts
        within = torch.arange(part.neighbors.numel(), device=device) - torch.repeat_interleave(
            part_offsets, part.counts)
        neighbors[torch.repeat_interleave(offsets[pos], part.counts) + within] = part.neighbors
    return HopSample(counts=counts, neighbors=neighbors)
