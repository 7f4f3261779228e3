"""Tiny graphs with learnable links for the link trainer's tests, plain and typed, held in
memory as :class:`~trainer_client.link_pyg.PygLinkGraph` (PyG's ``LinkNeighborLoader``,
where pyg-lib or torch-sparse is installed) and served by in-process servers
(:func:`served_link_graph`: the service's link loader), and the trainer's arguments for
them.

Nodes lie in latent clusters; a node's features are its cluster's one-hot code plus noise,
and edges join nodes of one cluster (a few join random nodes), so a GraphSAGE + dot
product predictor learns the links quickly. The seed edges are split into train / val /
test; val and test are not message-passing edges; val and test store ``NUM_NEGATIVES``
negative destinations per edge (ogbl-citation2's protocol); ``with_hits`` adds
``val_neg`` / ``test_neg`` splits of random pairs instead (ogbl-collab's).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from in_process_servers import served
from torch_geometric.data import Data, HeteroData

from partitioner.graph import PLAIN_EDGE_TYPE, EdgeType, GraphData, LinkSplit, TypedGraphData
from partitioner.writer import partition_graph
from trainer_client import train
from trainer_client.cluster import Cluster
from trainer_client.ddp import DistEnv
from trainer_client.graph import TypedGraph
from trainer_client.link_loader import RemoteLinkNeighborLoader
from trainer_client.link_pyg import PygLinkGraph, StoredLinkSplit
from trainer_client.link_task import LinkTask, build_link_task, cluster_link_task

CLUSTERS = 8
FEATURES = 8
NUM_NEGATIVES = 20
#: The typed graph's seed edge type.
WRITES: EdgeType = ("author", "writes", "paper")


def _features(gen: np.random.Generator, cluster: np.ndarray) -> torch.Tensor:
    x = gen.normal(0.0, 0.6, (cluster.size, FEATURES))
    x[np.arange(cluster.size), cluster] += 1.0
    return torch.from_numpy(x.astype(np.float32))


def _clustered_edges(gen: np.random.Generator, src_cluster: np.ndarray, dst_cluster: np.ndarray,
                     per_node: int) -> np.ndarray:
    """``per_node`` edges out of each source, 90 % into its own cluster, unique pairs."""
    src, dst = [], []
    for s, c in enumerate(src_cluster):
        same = np.flatnonzero(dst_cluster == c)
        picks = gen.choice(same, per_node, replace=False) if gen.random() < 0.9 else \
            gen.choice(dst_cluster.size, per_node, replace=False)
        src.extend([s] * per_node)
        dst.extend(picks.tolist())
    pairs = np.unique(np.stack([src, dst]), axis=1)
    return pairs[:, gen.permutation(pairs.shape[1])]


def _split(gen: np.random.Generator, pairs: np.ndarray, edge_type: EdgeType, num_src: int, num_dst: int,
           with_hits: bool) -> tuple[np.ndarray, dict[str, StoredLinkSplit]]:
    """Train / val / test of ``pairs`` (10 % each held out); returns the train pairs."""
    n = pairs.shape[1]
    held = max(n // 10, 8)
    parts = {"test": pairs[:, :held], "val": pairs[:, held:2 * held], "train": pairs[:, 2 * held:]}
    splits: dict[str, StoredLinkSplit] = {}
    for name, p in parts.items():
        src, dst = torch.from_numpy(p[0].copy()), torch.from_numpy(p[1].copy())
        neg = None
        if name != "train" and not with_hits:
            neg = torch.from_numpy(gen.integers(0, num_dst, (p.shape[1], NUM_NEGATIVES)))
        splits[name] = StoredLinkSplit(edge_type, src, dst, neg)
        if name != "train" and with_hits:
            m = 3 * p.shape[1]
            splits[f"{name}_neg"] = StoredLinkSplit(edge_type, torch.from_numpy(gen.integers(0, num_src, m)),
                                                    torch.from_numpy(gen.integers(0, num_dst, m)))
    return parts["train"], splits


def link_graph(kind: str, *, seed: int = 0, with_hits: bool = False, scale: int = 1) -> PygLinkGraph:
    """The tiny graph of ``kind`` ("plain" or "typed"), see the module doc; ``scale``
    multiplies its node counts."""
    gen = np.random.default_rng(seed)
    if kind == "plain":
        cluster = gen.integers(0, CLUSTERS, 240 * scale)
        pairs = _clustered_edges(gen, cluster, cluster, 4)
        train_pairs, splits = _split(gen, pairs, PLAIN_EDGE_TYPE, cluster.size, cluster.size, with_hits)
        both = np.concatenate([train_pairs, train_pairs[::-1]], axis=1)
        data = Data(x=_features(gen, cluster), edge_index=torch.from_numpy(both.copy()),
                    num_nodes=cluster.size)
        return PygLinkGraph(data, splits, name="tiny-links")
    papers, authors = gen.integers(0, CLUSTERS, 160 * scale), gen.integers(0, CLUSTERS, 120 * scale)
    writes = _clustered_edges(gen, authors, papers, 4)
    cites = _clustered_edges(gen, papers, papers, 3)
    train_pairs, splits = _split(gen, writes, WRITES, authors.size, papers.size, with_hits)
    data = HeteroData()
    data["paper"].x, data["author"].x = _features(gen, papers), _features(gen, authors)
    data[WRITES].edge_index = torch.from_numpy(train_pairs.copy())
    data["paper", "rev_writes", "author"].edge_index = torch.from_numpy(train_pairs[::-1].copy())
    data["paper", "cites", "paper"].edge_index = torch.from_numpy(cites)
    return PygLinkGraph(data, splits, name="tiny-typed-links")


def link_args(kind: str, *extra: str) -> argparse.Namespace:
    """``graphfeed-train --task link`` arguments for the tiny graph of ``kind``."""
    model = "sage" if kind == "plain" else "rgcn"
    return train.parse_args(["--servers", "unused:1", "--task", "link", "--model", model, "--fanouts", "5,5",
                             "--batch-size", "64", "--hidden", "32", "--lr", "0.01", "--dropout", "0.0",
                             "--epochs", "6", "--device", "cpu", "--no-progress", *extra])


def pyg_link_task(graph: PygLinkGraph, args: argparse.Namespace, env: DistEnv) -> LinkTask:
    """The link task of ``graph`` through PyG's loader for this rank."""
    make = partial(graph.loader, rank=env.rank, world_size=env.world_size, seed=args.seed, device=env.device)
    return build_link_task(make, graph.link_splits, graph.facts(), args, env, source="the in-memory")


def graph_data(graph: PygLinkGraph) -> GraphData | TypedGraphData:
    """``graph`` as the partitioner takes it (no node labels; its link splits in original
    IDs), to serve it."""
    splits = {n: LinkSplit(s.edge_type, s.src.numpy(), s.dst.numpy(),
                           neg_dst=None if s.neg_dst is None else s.neg_dst.numpy())
              for n, s in graph.splits.items()}
    data = graph.data
    if isinstance(data, Data):
        n = int(data.num_nodes)
        return GraphData(graph.name, n, data.edge_index.numpy(), data.x.numpy(), np.full(n, -1, np.int64), 1,
                         link_splits=splits)
    return TypedGraphData(graph.name, {t: int(data[t].num_nodes) for t in data.node_types},
                          {et: data[et].edge_index.numpy() for et in data.edge_types},
                          {t: data[t].x.numpy() for t in data.node_types}, "paper",
                          np.full(int(data["paper"].num_nodes), -1, np.int64), 1, link_splits=splits)


@dataclass
class ServedLinkGraph:
    """A tiny link graph partitioned in 2 and served by in-process servers: its link
    splits (original IDs, as :class:`PygLinkGraph` holds them), the service's loaders and
    link tasks."""

    graph: PygLinkGraph
    cluster: Cluster

    @property
    def link_splits(self) -> dict[str, StoredLinkSplit]:
        return self.graph.link_splits

    def facts(self) -> TypedGraph:
        return self.cluster.graph

    def loader(self, split: str, **kw: Any) -> RemoteLinkNeighborLoader:
        return RemoteLinkNeighborLoader(self.cluster, split, cache_size=0, **kw)

    def task(self, args: argparse.Namespace, env: DistEnv) -> LinkTask:
        return cluster_link_task(args, env, self.cluster)


@contextlib.contextmanager
def served_link_graph(graph: PygLinkGraph, root: Path) -> Iterator[ServedLinkGraph]:
    """``graph`` partitioned into ``root`` (2 parts) and served for the block."""
    partition_graph(graph_data(graph), 2, root, method="random", progress=False)
    with served(root, 2) as addresses, Cluster(addresses) as cluster:
        yield ServedLinkGraph(graph, cluster)
