"""Minibatches sampled in the trainer's own process, from a partitioned graph on this
machine (``graphfeed-train --partition-dir``, no servers), for both kinds of graph.

:class:`LocalGraph` loads every partition of a partition directory (format v1 or v2) with
the CPU sampler (:func:`~sampling_server.sampler.create_sampler`), the partitions
answering each other's remote nodes in process
(:class:`~sampling_server.sampler.InProcessPeers`); :class:`InProcessLoader` plans its
epochs exactly as the sampling servers plan global batches
(:func:`~protos.plan.plan_global_epoch`, keys from
:func:`~sampling_server.sampler.batch_key`), so its batches are those the servers would
stream for the same arguments. It is a batch source of the trainer's loop
(:class:`trainer_client.loop.BatchSource`) whose batches are a ``Data`` (a plain graph)
or a ``HeteroData`` (a typed one) as PyG's ``NeighborLoader`` lays them out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch_geometric.data import Data, HeteroData

from partitioner.format import load_partition
from partitioner.manifest import Manifest, read_manifest
from protos import codec
from protos.plan import plan_global_epoch
from sampling_server.sampler import InProcessPeers, batch_key, create_sampler, to_pyg_data
from trainer_client.graph import TypedGraph
from trainer_client.inputs import check_edge_options, check_int, split_name

log = logging.getLogger(__name__)


def graph_of_manifest(m: Manifest) -> TypedGraph:
    """The graph facts of a partitioning's manifest (its fingerprint is the servers')."""
    return TypedGraph(
        node_types=tuple(m.node_types), edge_types=tuple(m.edge_types),
        num_nodes={t: i.num_nodes for t, i in m.node_types.items()},
        feature_dims={t: i.feature_dim for t, i in m.node_types.items()},
        books={t: np.asarray(book, dtype=np.int64) for t, book in m.partition_book.items()},
        target_type=m.target_type, num_classes=m.num_classes, typed=m.typed, name=m.graph_name,
        fingerprint=m.fingerprint, has_edge_ids=m.has_edge_ids,
        edge_feature_shapes=dict(m.edge_feature_shapes),
        edge_feature_dtypes={et: int(codec.numpy_to_dtype(np.dtype(dtype)))
                             for et, dtype in m.edge_feature_dtypes.items()})


class LocalGraph:
    """Every partition of a partition directory, each with its CPU sampler."""

    def __init__(self, partition_dir: str | Path, *, verify: str = "size") -> None:
        """``verify``: ``'full'`` checks every file's SHA-256, ``'size'`` sizes and headers."""
        if verify not in ("full", "size"):
            raise ValueError(f"verify: expected 'full' or 'size', got {verify!r}")
        self.root = Path(partition_dir)
        self.manifest = read_manifest(self.root)
        self._parts = parts = [load_partition(self.root, p, verify=verify)  # type: ignore[arg-type]
                               for p in range(self.manifest.num_partitions)]
        self.samplers = [create_sampler(part, "cpu") for part in parts]
        self.peers = InProcessPeers(self.samplers)
        self.meta = graph_of_manifest(self.manifest)
        target = self.manifest.target_type
        self._orig_target = [np.asarray(part.orig_ids[target], dtype=np.int64) for part in parts]
        self._starts = [part.node_range(target)[0] for part in parts]
        log.info("%s graph %s: %d partitions sampled in this process",
                 "typed" if self.meta.typed else "plain", self.manifest.graph_name,
                 self.manifest.num_partitions)

    def split_nodes(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(original IDs, global IDs) of the target type's ``split`` nodes, in original-ID
        order (as ``RemoteNeighborLoader`` takes a split)."""
        for part in self._parts:
            if split not in part.splits:
                raise ValueError(f"split: expected one of {sorted(part.splits)}, got {split!r}")
        glob = [np.asarray(part.splits[split], dtype=np.int64) for part in self._parts]
        orig = [ids[g - start] for g, start, ids in zip(glob, self._starts, self._orig_target, strict=True)]
        g_all, o_all = np.concatenate(glob), np.concatenate(orig)
        order = np.argsort(o_all, kind="stable")
        return o_all[order], g_all[order]


class InProcessLoader:
    """Minibatches of one rank's epoch, sampled in this process (see the module doc)."""

    def __init__(self, graph: LocalGraph | str | Path, split: str = "train", *,
                 num_neighbors: Sequence[int], batch_size: int, shuffle: bool = False,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1,
                 device: str | torch.device = "cpu", seed: int = 0, edge_features: bool = False,
                 edge_ids: bool = False) -> None:
        """``edge_features`` / ``edge_ids``: batches carry ``edge_attr`` and ``e_id`` /
        ``e_id`` alone, as :class:`~trainer_client.loader.RemoteNeighborLoader`'s do."""
        self.graph = graph if isinstance(graph, LocalGraph) else LocalGraph(graph)
        self.edge_features = bool(edge_features)
        self.edge_ids = bool(edge_ids) or self.edge_features
        check_edge_options(self.graph.meta, self.edge_features, self.edge_ids)
        split = split_name(split)
        check_int("batch_size", batch_size, 1)
        check_int("rank", rank, 0, world_size - 1)
        self.split, self.num_neighbors = split, [int(f) for f in num_neighbors]
        self.batch_size, self.shuffle, self.drop_last = batch_size, bool(shuffle), bool(drop_last)
        self.rank, self.world_size, self.seed = rank, world_size, int(seed)
        self.device = torch.device(device)
        self._orig, self._seeds = self.graph.split_nodes(split)
        self.set_epoch(0)

    @property
    def input_nodes(self) -> torch.Tensor:
        """Original IDs of the seeds (target type), in the order ``input_id`` indexes."""
        return torch.from_numpy(self._orig)

    def _make_plan(self, epoch: int):  # type: ignore[no-untyped-def]
        return plan_global_epoch(int(self._seeds.size), self.batch_size, self.world_size,
                                 self.graph.manifest.num_partitions, shuffle=self.shuffle, seed=self.seed,
                                 epoch=epoch, drop_last=self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Plan epoch ``epoch`` (its shuffle and draws); the same on every rank."""
        self.epoch, self._plan = check_int("epoch", epoch, 0), self._make_plan(epoch)

    def __len__(self) -> int:
        return int(self._plan.batches_per_rank)

    def __iter__(self) -> Iterator[Data | HeteroData]:
        target, plain = self.graph.meta.target_type, not self.graph.meta.typed
        for ref in self._plan.rank_batches(self.rank):
            positions = self._plan.positions(ref.part_batch)
            batch = self.graph.samplers[ref.partition].minibatch(
                self._seeds[positions], target, self.num_neighbors,
                batch_key(self.seed, self.epoch, self.rank, ref.index), remote=self.graph.peers,
                edges=self.edge_ids, edge_features=self.edge_features)
            data = to_pyg_data(batch, plain=plain)
            for store in data.edge_stores:
                if "edge_attr" in store and store.edge_attr.is_floating_point():
                    store.edge_attr = store.edge_attr.float()
            seeds_store = data if plain else data[target]
            seeds_store.input_id = torch.from_numpy(np.asarray(positions, dtype=np.int64))
            yield data.to(self.device) if self.device.type != "cpu" else data

    def __repr__(self) -> str:
        return (f"InProcessLoader({str(self.graph.root)!r}, {self.split!r}, "
                f"num_neighbors={self.num_neighbors}, batch_size={self.batch_size}, "
                f"rank={self.rank}/{self.world_size}, batches={len(self)})")
