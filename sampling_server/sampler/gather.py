"""The rows of a batch, node or edge: features and labels by global node ID, original
edge IDs (PyG's ``e_id``) and edge features (``edge_attr``) by internal edge ID. Those
held here are read into their places while their owners read the others
(:meth:`~sampling_server.sampler.holdings.Holdings.from_owners`)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from partitioner.graph import EdgeType, edge_type_name
from protos import halfcast
from sampling_server.sampler import cpu_gather, cpu_glue
from sampling_server.sampler.holdings import Holdings, owners_in
from sampling_server.sampler.peers import EdgeRows, NodeRows, Remote
from sampling_server.sampler.rows import (
    assign_rows,
    assign_rows_to_blocks,
    by_block,
    int64_array,
    layout_of,
    take,
    torch_dtype,
)

#: ``(a, b, rows)``: rows ``a`` to ``b`` of a gather's result go to ``rows``.
Blocks = Sequence[tuple[int, int, torch.Tensor]]


class Gatherer(Holdings):
    """Node rows and edge rows of one partition's sampler, here or from their owners."""

    @abc.abstractmethod
    def gather_owned(self, node_type: str, nodes: torch.Tensor, features: bool, labels: bool) -> NodeRows:
        """:meth:`gather_local` of nodes already known to have their rows here."""

    def gather_local(self, node_type: str, nodes: torch.Tensor, features: bool,
                     labels: bool) -> NodeRows:
        """Features ``[len(nodes), F_t]`` (None for featureless types) and labels (None
        unless ``node_type`` is the target type) of nodes whose rows are here (:attr:`hold`)."""
        self.check_node_type(node_type, "node_type")
        ids = self.node_ids(nodes, "nodes")
        self.check_held(node_type, ids, "nodes")
        return self.gather_owned(node_type, ids, features, labels)

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
        place, from their owners (:meth:`from_owners`)."""
        def here(pos: torch.Tensor, nodes: torch.Tensor) -> None:
            if x is not None or y is not None:
                self.gather_local_into(node_type, nodes, pos, x, y)
            if blocks:
                self.gather_local_into_blocks(node_type, nodes, pos, blocks, layout)

        def put(p: int, pos: torch.Tensor, answer: NodeRows) -> None:
            rx, ry = answer
            assign_rows(x, pos, rx)
            assign_rows(y, pos, ry)
            if blocks:
                if rx is None:
                    raise RuntimeError(f"gather: partition {p} answered without the features asked for")
                assign_rows_to_blocks(blocks, layout, pos, rx)

        if held:
            here(torch.from_numpy(cpu_glue.positions(n_id.numel())), n_id)
            return
        if remote is None:
            raise RuntimeError("gather: nodes of other partitions but no remote fetcher was given")
        self.from_owners(self.owner_of(node_type, n_id), lambda pos: take(n_id, pos).cpu(),
                         lambda asked: remote.node_data(node_type, asked, x is not None or bool(blocks),
                                                        y is not None),
                         lambda pos: here(pos, take(n_id, pos)), put)

    def rows_from_owners(self, node_type: str, n_id: torch.Tensor, row: Sequence[int], dtype: torch.dtype,
                         here: Callable[[torch.Tensor], torch.Tensor],
                         ask: Callable[[dict[int, torch.Tensor]], Mapping[int, torch.Tensor]]
                         ) -> torch.Tensor:
        """The rows ``[len(n_id), *row]`` of a table partitioned like the nodes of
        ``node_type`` (a node tensor, each server the rows of the nodes it owns), on the
        CPU, in order: ``here(ids)`` reads the owned ones while ``ask`` (per owner, its
        IDs) brings the others' (:meth:`from_owners`), as the features are gathered."""
        ids = n_id.cpu()
        out = torch.empty((ids.numel(), *row), dtype=dtype)

        def put(_: int, pos: torch.Tensor, rows: torch.Tensor) -> None:
            assign_rows(out, pos, rows)

        self.from_owners(self.owner_of(node_type, ids), lambda pos: take(ids, pos), ask,
                         lambda pos: put(-1, pos, here(take(ids, pos))), put)
        return out

    # -- edge rows ---------------------------------------------------------------------
    def edge_rows_local(self, edge_type: EdgeType, edges: torch.Tensor, ids: bool, features: bool,
                        dtype: torch.dtype | None = None, field: str = "edges") -> EdgeRows:
        """Original IDs (int64 ``[E]``) and/or features (``[E, ...]`` in ``dtype``; None:
        as stored) of ``edges`` (internal IDs) whose rows are here (:meth:`edge_range`);
        a ``ValueError`` naming ``field`` for another edge, or for features of a relation
        without them. This is what a peer serves."""
        et = self.check_edge_type(edge_type, "edge_type")
        local = edges.cpu()
        self.check_edges_held(et, local, field)
        return self._edge_rows_here(et, int64_array(local) - self.edge_range(et)[0], ids, features, dtype,
                                    field)

    def _edge_rows_here(self, edge_type: EdgeType, local: np.ndarray, ids: bool, features: bool,
                        dtype: torch.dtype | None, field: str) -> EdgeRows:
        """:meth:`edge_rows_local` of positions in this partition's edge rows."""
        e_id = torch.from_numpy(np.asarray(self.partition.e_id[edge_type][local], dtype=np.int64)) \
            if ids else None
        attr = None
        if features:
            rows = torch.from_numpy(np.ascontiguousarray(self._edge_attr(edge_type, field)[local]))
            attr = rows if dtype is None else halfcast.cast(rows, dtype)
        return e_id, attr

    def _edge_attr(self, edge_type: EdgeType, field: str) -> np.ndarray:
        stored = self.partition.edge_attr.get(edge_type)
        if stored is None:
            raise ValueError(f"{field}: expected a relation with edge features, "
                             f"{edge_type_name(edge_type)} has none")
        return stored

    def edge_rows(self, edge_type: EdgeType, edges: torch.Tensor, *, ids: bool = True, features: bool = False,
                  dtype: torch.dtype | None = None, remote: Remote | None = None) -> EdgeRows:
        """Original IDs (int64 ``[E]``, with ``ids``) and/or features (``[E, ...]`` in
        ``dtype``, None: as stored; with ``features``) of the sampled ``edges`` (internal
        IDs, any device), on the CPU, in order; the others' rows through ``remote``."""
        wanted = edges.cpu()
        start, stop = self.edge_range(edge_type)
        if self._within(wanted, (start, stop)):
            return self._edge_rows_here(edge_type, int64_array(wanted) - start, ids, features, dtype, "edges")
        if remote is None:
            raise RuntimeError(f"edges of {edge_type_name(edge_type)} held by other partitions but no "
                               "remote was given")
        count = wanted.numel()
        e_id = torch.empty(count, dtype=torch.int64) if ids else None
        attr = None
        if features:
            stored = self._edge_attr(edge_type, "edges")
            attr = torch.empty((count, *stored.shape[1:]), dtype=dtype or torch_dtype(stored.dtype))

        def put(_: int, pos: torch.Tensor, answer: EdgeRows) -> None:
            assign_rows(e_id, pos, answer[0])
            assign_rows(attr, pos, answer[1])

        def here(pos: torch.Tensor) -> None:
            local = int64_array(take(wanted, pos)) - start
            put(-1, pos, self._edge_rows_here(edge_type, local, ids, features, dtype, "edges"))

        self.from_owners(owners_in(self.edge_books[edge_type], wanted), lambda pos: take(wanted, pos),
                         lambda asked: remote.edge_data(edge_type, asked, ids, features, dtype), here, put)
        return e_id, attr
