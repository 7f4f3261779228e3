"""Typed minibatches sampled in the trainer's own process, from a partitioned typed graph
on this machine (``graphfeed-train --partition-dir``, no servers).

:class:`LocalTypedGraph` loads every partition of a format-v2 directory with the typed
sampler (:func:`~sampling_server.sampler.create_hetero_sampler`), the partitions
answering each other's remote nodes in process; :class:`InProcessTypedLoader` plans its
epochs exactly as the sampling servers plan global batches
(:func:`~protos.plan.plan_global_epoch`, keys from
:func:`~sampling_server.sampler.batch_key`), so its batches are those a typed service
would stream for the same arguments. It is a batch source of the trainer's loop
(:class:`trainer_client.loop.BatchSource`): ``len()`` batches per epoch (equal on every
rank), ``set_epoch``, iteration yielding ``HeteroData`` laid out as PyG's hetero
``NeighborLoader`` lays out its batches, and ``meta``, the graph's facts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch_geometric.data import HeteroData

from partitioner.hetero import EdgeType
from partitioner.hetero_format import (
    HETERO_FORMAT_VERSION,
    HeteroManifest,
    load_hetero_partition,
    read_format_version,
    read_hetero_manifest,
)
from protos.plan import plan_global_epoch
from sampling_server.sampler import HeteroNeighborSampler, HopSample, batch_key, create_hetero_sampler
from sampling_server.sampler.hetero_convert import to_hetero_data
from sampling_server.store import manifest_fingerprint
from trainer_client.graph import TypedGraph

log = logging.getLogger(__name__)


def graph_of_manifest(m: HeteroManifest) -> TypedGraph:
    """The graph facts of a format-v2 manifest (its fingerprint is the servers')."""
    return TypedGraph(
        node_types=tuple(m.node_types), edge_types=tuple(m.edge_types),
        num_nodes={t: i.num_nodes for t, i in m.node_types.items()},
        feature_dims={t: i.feature_dim for t, i in m.node_types.items()},
        target_type=m.target_type, num_classes=m.num_classes, name=m.graph_name,
        fingerprint=manifest_fingerprint(m.to_json()))


class _Peers:
    """The ``remote`` of each partition's typed sampler: the other partitions' samplers
    in this process."""

    def __init__(self, samplers: Sequence[HeteroNeighborSampler]) -> None:
        self.samplers = list(samplers)

    def sample(self, edge_type: EdgeType, nodes_by_partition: Mapping[int, torch.Tensor], fanout: int,
               key: int, hop: int) -> dict[int, HopSample]:
        return {p: self.samplers[p].sample_relation(edge_type, nodes, fanout, key, hop)
                for p, nodes in nodes_by_partition.items()}

    def node_data(self, node_type: str, nodes_by_partition: Mapping[int, torch.Tensor], features: bool,
                  labels: bool) -> dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]:
        return {p: self.samplers[p].gather_local(node_type, nodes, features, labels)
                for p, nodes in nodes_by_partition.items()}

    def orig_ids(self, node_type: str,
                 nodes_by_partition: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {p: self.samplers[p].orig_ids_local(node_type, nodes)
                for p, nodes in nodes_by_partition.items()}


class LocalTypedGraph:
    """Every partition of a format-v2 directory, each with its CPU typed sampler."""

    def __init__(self, partition_dir: str | Path, *, verify: str = "size") -> None:
        """``verify``: ``'full'`` checks every file's SHA-256, ``'size'`` sizes and headers."""
        self.root = Path(partition_dir)
        if read_format_version(self.root) != HETERO_FORMAT_VERSION:
            raise ValueError(f"partition_dir: expected a typed graph (format v2) in {self.root}, got a "
                             "homogeneous one (format v1); train it through servers (graphfeed-local)")
        self.manifest = read_hetero_manifest(self.root)
        parts = [load_hetero_partition(self.root, p, verify=verify)  # type: ignore[arg-type]
                 for p in range(self.manifest.num_partitions)]
        self.samplers = [create_hetero_sampler(part, "cpu") for part in parts]
        self.peers = _Peers(self.samplers)
        self.meta = graph_of_manifest(self.manifest)
        target = self.manifest.target_type
        self._orig_target = [np.asarray(part.orig_ids[target], dtype=np.int64) for part in parts]
        self._starts = [part.node_range(target)[0] for part in parts]
        self._parts = parts
        log.info("typed graph %s: %d partitions sampled in this process",
                 self.manifest.graph_name, self.manifest.num_partitions)

    @property
    def num_partitions(self) -> int:
        return self.manifest.num_partitions

    def split_nodes(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(original IDs, global IDs) of the target type's ``split`` nodes, in original-ID
        order (as ``RemoteNeighborLoader`` takes a split)."""
        glob, orig = [], []
        for part, start, ids in zip(self._parts, self._starts, self._orig_target, strict=True):
            if split not in part.splits:
                raise ValueError(f"split: expected one of {sorted(part.splits)}, got {split!r}")
            g = np.asarray(part.splits[split], dtype=np.int64)
            glob.append(g)
            orig.append(ids[g - start])
        g_all, o_all = np.concatenate(glob), np.concatenate(orig)
        order = np.argsort(o_all, kind="stable")
        return o_all[order], g_all[order]


class InProcessTypedLoader:
    """Typed minibatches of one rank's epoch, sampled in this process (see the module doc)."""

    def __init__(self, graph: LocalTypedGraph | str | Path, split: str = "train", *,
                 num_neighbors: Sequence[int], batch_size: int, shuffle: bool = False,
                 drop_last: bool = False, rank: int = 0, world_size: int = 1,
                 device: str | torch.device = "cpu", seed: int = 0) -> None:
        self.graph = graph if isinstance(graph, LocalTypedGraph) else LocalTypedGraph(graph)
        if split == "valid":
            split = "val"
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected an integer >= 1, got {batch_size!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
        self.split, self.num_neighbors = split, [int(f) for f in num_neighbors]
        self.batch_size, self.shuffle, self.drop_last = batch_size, bool(shuffle), bool(drop_last)
        self.rank, self.world_size, self.seed = rank, world_size, int(seed)
        self.device = torch.device(device)
        self._orig, self._seeds = self.graph.split_nodes(split)
        self.epoch = 0
        self._plan = self._make_plan(0)

    @property
    def meta(self) -> TypedGraph:
        """The graph's facts."""
        return self.graph.meta

    @property
    def input_nodes(self) -> torch.Tensor:
        """Original IDs of the seeds (target type), in the order ``input_id`` indexes."""
        return torch.from_numpy(self._orig)

    def _make_plan(self, epoch: int):  # type: ignore[no-untyped-def]
        return plan_global_epoch(int(self._seeds.size), self.batch_size, self.world_size,
                                 self.graph.num_partitions, shuffle=self.shuffle, seed=self.seed,
                                 epoch=epoch, drop_last=self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Plan epoch ``epoch`` (its shuffle and draws); the same on every rank."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch: expected an integer >= 0, got {epoch!r}")
        self.epoch, self._plan = epoch, self._make_plan(epoch)

    def __len__(self) -> int:
        return int(self._plan.batches_per_rank)

    def __iter__(self) -> Iterator[HeteroData]:
        target = self.graph.meta.target_type
        for ref in self._plan.rank_batches(self.rank):
            positions = self._plan.positions(ref.part_batch)
            sampler = self.graph.samplers[ref.partition]
            batch = sampler.minibatch(self._seeds[positions], target, self.num_neighbors,
                                      batch_key(self.seed, self.epoch, self.rank, ref.index),
                                      remote=self.graph.peers)
            data = to_hetero_data(batch)
            data[target].input_id = torch.from_numpy(np.asarray(positions, dtype=np.int64))
            yield data.to(self.device) if self.device.type != "cpu" else data

    def __repr__(self) -> str:
        return (f"InProcessTypedLoader({str(self.graph.root)!r}, {self.split!r}, "
                f"num_neighbors={self.num_neighbors}, batch_size={self.batch_size}, "
                f"rank={self.rank}/{self.world_size}, batches={len(self)})")
