"""PyG's in-process ``LinkNeighborLoader`` over a graph held in memory, shaped like the
service's link loader: the reference the service's link training is compared with
(``benchmarks/link_accuracy.py``) and the batch source of the link trainer's tests.

:class:`PygLinkGraph` holds a ``Data`` / ``HeteroData`` (its message-passing edges) and
link splits in original IDs; :meth:`PygLinkGraph.loader` takes the service loader's
arguments (a split name, ``num_neighbors``, ``batch_size``, ``shuffle``, ``neg_sampling``
``None`` / ``"binary"`` / ``"triplet"`` / ``"given"`` / ``dict(mode=, amount=)``, ``rank``,
``world_size``, ``seed``) and gives :class:`PygLinkSource`: like the service, each seed edge
lies in exactly one batch per epoch over the ranks, every rank gets the same number of
batches, and a batch is a pure function of (seed, epoch, rank, batch index). PyG has no
strict negatives and no seed-edge exclusion: those options are refused.

``"given"`` negatives (a split's stored ``neg_dst``, OGB citation2's protocol) are sampled
as PyG would sample the pairs ``(s, d)`` and ``(s, n_1) .. (s, n_K)`` of each positive
together, then laid out as triplet mode lays them out (``src_index``, ``dst_pos_index``,
``dst_neg_index`` ``[P, K]``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch_geometric.data import Data, HeteroData
from torch_geometric.loader import LinkNeighborLoader
from torch_geometric.sampler import NegativeSampling

from partitioner.graph import PLAIN_EDGE_TYPE, PLAIN_NODE_TYPE, EdgeType
from trainer_client.graph import TypedGraph
from trainer_client.link_loader import NEGATIVE_MODES, parse_negatives


@dataclass(frozen=True)
class StoredLinkSplit:
    """One link split in memory, in original node IDs of the edge type's end types."""

    #: The seed edges' type (a plain graph's: :data:`PLAIN_EDGE_TYPE`).
    edge_type: EdgeType
    #: Sources ``[E]``.
    src: Tensor
    #: Destinations ``[E]``.
    dst: Tensor
    #: Given negative destinations ``[E, K]`` per edge (None: none).
    neg_dst: Tensor | None = None

    @property
    def num_edges(self) -> int:
        return int(self.src.numel())

    @property
    def num_negatives(self) -> int:
        return 0 if self.neg_dst is None else int(self.neg_dst.shape[1])


#: ``NegativeSampling.Mode`` to the mode name PyG takes.
MODE_NAMES: dict[int, str] = {int(mode): name for name, mode in NEGATIVE_MODES.items()}


def _negatives(neg_sampling: Any) -> tuple[str | None, float]:
    """``(mode, amount)`` of a ``neg_sampling`` argument, read as the service loader reads
    it (:func:`~trainer_client.link_loader.parse_negatives`)."""
    negatives = parse_negatives(neg_sampling, None, False)
    return MODE_NAMES.get(negatives.mode), negatives.amount


@dataclass
class PygLinkGraph:
    """A graph in memory and its link splits (see the module doc)."""

    #: The message-passing graph (``x`` per node type; ``Data`` for a plain graph).
    data: Data | HeteroData
    #: Split name to its edges.
    splits: dict[str, StoredLinkSplit]
    #: The graph's name, for messages and metrics.
    name: str = "in-memory"
    _typed: bool = field(init=False)

    def __post_init__(self) -> None:
        self._typed = isinstance(self.data, HeteroData)
        for name, split in self.splits.items():
            if split.src.shape != split.dst.shape or split.src.dim() != 1:
                raise ValueError(f"splits[{name!r}]: expected src and dst of one shape [E], got "
                                 f"{list(split.src.shape)} and {list(split.dst.shape)}")

    @property
    def link_splits(self) -> dict[str, StoredLinkSplit]:
        """Split name to its facts (``edge_type``, ``num_edges``, ``num_negatives``), as the
        service's ``TypedGraph.link_splits``."""
        return self.splits

    def facts(self) -> TypedGraph:
        """The graph's facts, as a trainer builds its model from them."""
        if not self._typed:
            data = self.data
            return TypedGraph(node_types=(PLAIN_NODE_TYPE,), edge_types=(PLAIN_EDGE_TYPE,),
                              target_type=PLAIN_NODE_TYPE, num_nodes={PLAIN_NODE_TYPE: int(data.num_nodes)},
                              feature_dims={PLAIN_NODE_TYPE: int(data.x.shape[1])}, num_classes=0,
                              typed=False, name=self.name)
        data = self.data
        types = tuple(data.node_types)
        return TypedGraph(node_types=types, edge_types=tuple(data.edge_types), target_type=types[0],
                          num_nodes={t: int(data[t].num_nodes) for t in types},
                          feature_dims={t: int(data[t].x.shape[1]) if "x" in data[t] else 0 for t in types},
                          num_classes=0, name=self.name)

    def loader(self, split: str, *, num_neighbors: list[int], batch_size: int, shuffle: bool = False,
               drop_last: bool = False, neg_sampling: Any = None, strict_negatives: bool = False,
               exclude: str | None = None, rank: int = 0, world_size: int = 1, seed: int = 0,
               device: str | torch.device = "cpu", **_ignored: Any) -> PygLinkSource:
        """The batches of one split for one rank on ``device`` (the service loader's
        arguments; the service-only ones, e.g. ``prefetch``, are ignored)."""
        if split not in self.splits:
            raise ValueError(f"split: expected one of {sorted(self.splits)}, got {split!r}")
        if strict_negatives:
            raise ValueError("strict_negatives: PyG's LinkNeighborLoader draws negatives uniformly; "
                             "expected False")
        if exclude not in (None, "none"):
            raise ValueError(f"exclude: PyG's LinkNeighborLoader excludes no seed edges; expected None, "
                             f"got {exclude!r}")
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"batch_size, rank, world_size: expected >= 1 and 0 <= rank < world_size, got "
                             f"{batch_size}, {rank}, {world_size}")
        mode, amount = _negatives(neg_sampling)
        s = self.splits[split]
        if mode == "given" and s.neg_dst is None:
            raise ValueError(f"neg_sampling 'given': split {split!r} stores no negatives")
        given = s.neg_dst if mode == "given" else None
        per_edge = 1 if given is None else 1 + given.shape[1]
        if given is not None:  # each positive with its K negatives, consecutive pairs
            src = s.src.repeat_interleave(per_edge)
            dst = torch.cat([s.dst.reshape(-1, 1), given], dim=1).reshape(-1)
        else:
            src, dst = s.src, s.dst
        index = torch.stack([src, dst])
        sampling = None if mode in (None, "given") else NegativeSampling(mode, amount)
        pyg = LinkNeighborLoader(self.data, num_neighbors=num_neighbors, batch_size=batch_size,
                                 edge_label_index=(s.edge_type, index) if self._typed else index,
                                 neg_sampling=sampling)
        return PygLinkSource(pyg, s.num_edges, per_edge, s.edge_type if self._typed else None,
                             batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, rank=rank,
                             world_size=world_size, seed=seed, device=torch.device(device))


class PygLinkSource:
    """One rank's batches of one split (see the module doc): ``set_epoch``, ``len``, iteration."""

    def __init__(self, loader: LinkNeighborLoader, num_edges: int, per_edge: int, edge_type: EdgeType | None,
                 *, batch_size: int, shuffle: bool, drop_last: bool, rank: int, world_size: int,
                 seed: int, device: torch.device | None = None) -> None:
        self.loader, self.num_edges, self.per_edge, self.edge_type = loader, num_edges, per_edge, edge_type
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.rank, self.world_size, self.seed, self.epoch = rank, world_size, seed, 0
        self.device = device or torch.device("cpu")
        share = -(-num_edges // world_size)
        self.num_batches = share // batch_size if drop_last else -(-share // batch_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_batches

    def _my_chunks(self) -> list[np.ndarray]:
        """This rank's batches of positive positions: one order over all ranks (shuffled
        by (seed, epoch)), a near-equal share per rank, cut in ``len(self)`` batches."""
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_edges) if self.shuffle \
            else np.arange(self.num_edges)
        mine = np.array_split(order, self.world_size)[self.rank]
        if self.drop_last:
            mine = mine[: self.num_batches * self.batch_size]
        return [c for c in np.array_split(mine, self.num_batches) if c.size] if self.num_batches else []

    def __iter__(self) -> Iterator[Data | HeteroData]:
        for i, chunk in enumerate(self._my_chunks()):
            rows = (chunk[:, None] * self.per_edge + np.arange(self.per_edge)[None, :]).reshape(-1)
            with torch.random.fork_rng():
                torch.manual_seed(hash((self.seed, self.epoch, self.rank, i)) & 0x7FFF_FFFF)
                batch = self.loader.collate_fn(torch.from_numpy(rows))
                if not self.loader.filter_per_worker:  # else collate_fn filtered already
                    batch = self.loader.filter_fn(batch)
            if self.per_edge > 1:
                batch = self._triplet_layout(batch)
            yield batch.to(self.device)

    def _triplet_layout(self, batch: Data | HeteroData) -> Data | HeteroData:
        """A batch of pairs ``(s, d), (s, n_1) .. (s, n_K)`` per positive as triplet mode
        lays it out."""
        store = batch if self.edge_type is None else batch[self.edge_type]
        pairs = store.edge_label_index.reshape(2, -1, self.per_edge)
        del store.edge_label_index
        if "edge_label" in store:
            del store.edge_label
        src_store = batch if self.edge_type is None else batch[self.edge_type[0]]
        dst_store = batch if self.edge_type is None else batch[self.edge_type[2]]
        src_store.src_index = pairs[0, :, 0].contiguous()
        dst_store.dst_pos_index = pairs[1, :, 0].contiguous()
        dst_store.dst_neg_index = pairs[1, :, 1:].contiguous()
        store.input_id = store.input_id[:: self.per_edge] // self.per_edge
        return batch
