"""Tiny graphs for sampler tests, written as real partitions (format v1) and loaded back.

Every graph's features encode the original node ID (``x[v, j] = v + j / 100``) so a test
can tell which node a gathered row belongs to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from partitioner.format import Partition, load_node_map, load_partition, read_manifest
from partitioner.graph import GraphData
from partitioner.partition import partition_graph
from sampling_server.sampler.base import NeighborSampler
from sampling_server.sampler.types import HopSample

#: Node of :func:`mixed_graph` whose in-neighbors are (almost) all other active nodes.
HUB = 5
#: Nodes of :func:`mixed_graph` with no edges at all.
NUM_ISOLATED = 3
#: Edges of :func:`mixed_graph` that appear more than once (source, target, times).
REPEATED_EDGES = ((1, 2, 3), (3, 4, 2))


def _node_data(num_nodes: int, feature_dim: int, num_classes: int) -> dict[str, np.ndarray]:
    v = np.arange(num_nodes, dtype=np.int64)
    x = (v[:, None] + np.arange(feature_dim)[None, :] / 100).astype(np.float32)
    y = v % num_classes
    y[v % 7 == 6] = -1
    return {"x": x, "y": y}


def mixed_graph(num_nodes: int = 48, *, weighted: bool = True, seed: int = 0) -> GraphData:
    """A small directed graph with the cases samplers get wrong: a high-degree hub
    (:data:`HUB`, in-degree ~ ``num_nodes``), isolated nodes (the last
    :data:`NUM_ISOLATED`), repeated edges (:data:`REPEATED_EDGES`), a self loop, and
    positive float32 edge weights (when ``weighted``). Edges are shuffled."""
    gen = np.random.default_rng(seed)
    active = num_nodes - NUM_ISOLATED
    src = [gen.integers(0, active, 3 * active)]
    dst = [gen.integers(0, active, 3 * active)]
    others = np.setdiff1d(np.arange(active), [HUB])
    src.append(others)
    dst.append(np.full(others.size, HUB))
    for s, t, times in REPEATED_EDGES:
        src.append(np.full(times, s))
        dst.append(np.full(times, t))
    src.append(np.array([7]))
    dst.append(np.array([7]))
    edge_index = np.stack([np.concatenate(src), np.concatenate(dst)]).astype(np.int64)
    edge_index = np.ascontiguousarray(edge_index[:, gen.permutation(edge_index.shape[1])])
    weight = np.asarray(gen.uniform(0.1, 5.0, edge_index.shape[1]), np.float32) if weighted else None
    train = np.arange(0, num_nodes, 2, dtype=np.int64)
    splits = {"train": train, "val": np.arange(1, num_nodes, 4, dtype=np.int64),
              "test": np.arange(3, num_nodes, 4, dtype=np.int64)}
    graph = GraphData(name="mixed", num_nodes=num_nodes, edge_index=edge_index, num_classes=4,
                      splits=splits, edge_weight=weight, **_node_data(num_nodes, 6, 4))
    graph.validate()
    return graph


def star_graph(degree: int = 20, weights: Sequence[float] | None = None) -> GraphData:
    """Node 0 with in-edges from ``1 .. degree`` (in that CSC order), optionally
    weighted (``weights[i]`` on the edge from ``i + 1``)."""
    if weights is not None:
        degree = len(weights)
    src = np.arange(1, degree + 1, dtype=np.int64)
    edge_index = np.stack([src, np.zeros(degree, dtype=np.int64)])
    weight = None if weights is None else np.asarray(weights, dtype=np.float32)
    graph = GraphData(name="star", num_nodes=degree + 1, edge_index=edge_index, num_classes=2,
                      splits={"train": np.array([0], dtype=np.int64)}, edge_weight=weight,
                      **_node_data(degree + 1, 3, 2))
    graph.validate()
    return graph


def write_and_load(
    graph: GraphData, root: Path, num_parts: int, method: str = "range"
) -> list[Partition]:
    """Partition ``graph`` into ``root`` (``partition_graph``) and load every partition
    (read-only memory maps, as a server loads them)."""
    partition_graph(graph, num_parts, root, method=method, progress=False)
    return [load_partition(root, p) for p in range(read_manifest(root).num_partitions)]


def node_map_of(partitions: Sequence[Partition]) -> np.ndarray:
    """Original ID -> global ID of a partitioned graph (from its ``orig_ids``)."""
    node_map = np.empty(partitions[0].manifest.num_nodes, dtype=np.int64)
    for part in partitions:
        start, stop = part.node_range
        node_map[np.asarray(part.orig_ids)] = np.arange(start, stop)
    return node_map


def check_node_map(root: Path, partitions: Sequence[Partition]) -> np.ndarray:
    """The written ``node_map.npy``, asserted to agree with the partitions' ``orig_ids``."""
    node_map = np.asarray(load_node_map(root))
    assert np.array_equal(node_map, node_map_of(partitions))
    return node_map


def global_adjacency(partitions: Sequence[Partition]) -> dict[int, list[int]]:
    """Every global node ID -> its in-neighbors (global IDs, CSC order, repeats kept)."""
    adj: dict[int, list[int]] = {}
    for part in partitions:
        start = part.node_range[0]
        indptr, indices = np.asarray(part.indptr), np.asarray(part.indices)
        for i in range(part.num_nodes):
            adj[start + i] = indices[indptr[i]:indptr[i + 1]].tolist()
    return adj


class LocalPeers:
    """In-process stand-ins for the peer servers: the ``remote`` and ``remote_data``
    callbacks of :meth:`NeighborSampler.minibatch`, answered by the samplers of the
    other partitions (what a peer's servicer would call)."""

    def __init__(self, samplers: Sequence[NeighborSampler]):
        self.samplers = list(samplers)
        #: Frontier nodes asked of each partition, across calls.
        self.asked: dict[int, int] = {}
        #: Nodes whose rows were asked of each partition, across calls.
        self.fetched: dict[int, int] = {}

    def neighbors(self, nodes_by_partition: Mapping[int, torch.Tensor], fanout: int, key: int,
                  hop: int) -> dict[int, HopSample]:
        out = {}
        for p, nodes in nodes_by_partition.items():
            self.asked[p] = self.asked.get(p, 0) + int(nodes.numel())
            peer = self.samplers[p]
            hop_sample = peer.sample_neighbors(nodes.to(peer.device), fanout, key, hop)
            out[p] = HopSample(hop_sample.counts.cpu(), hop_sample.neighbors.cpu())
        return out

    def node_data(self, nodes_by_partition: Mapping[int, torch.Tensor], features: bool,
                  labels: bool) -> dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]:
        out: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        for p, nodes in nodes_by_partition.items():
            self.fetched[p] = self.fetched.get(p, 0) + int(nodes.numel())
            peer = self.samplers[p]
            x, y = peer.gather_local(nodes.to(peer.device), features, labels)
            out[p] = (None if x is None else x.cpu(), None if y is None else y.cpu())
        return out
