"""Every public name of both loaders answers: each property, attribute and method of
``RemoteNeighborLoader`` and of ``RemoteLinkNeighborLoader`` (over a stored link split and
over given ``edge_label_index``), walked on a plain and a typed graph served by two
in-process servers. The walk covers exactly the names each loader has, so a name added
to a loader without a check here fails the test; names that mean nothing for a loader
(the node loader's ``input_nodes`` on the link loader, the link loader's
``edge_label_index`` on the node loader) are not there at all."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from graph_fixtures import KINDS, AnyGraph, mixed, typed_view
from in_process_servers import served
from torch_geometric.data import Data, HeteroData

from partitioner.graph import EdgeType, GraphData
from partitioner.links import random_link_split
from partitioner.writer import partition_graph
from protos import sampling_pb2 as pb
from protos.plan import EpochProgress, GlobalPlan
from trainer_client.cache import FeatureCache
from trainer_client.cluster import Cluster
from trainer_client.decode import DecodedBatch
from trainer_client.graph import TypedGraph
from trainer_client.link_loader import Negatives, RemoteLinkNeighborLoader
from trainer_client.loader import RemoteLoader, RemoteNeighborLoader
from trainer_client.node_table import NodeTable
from trainer_client.stream import StreamStats, StreamTimeouts

#: The typed graph's seed edge type (the plain graph has one edge type).
WRITES: EdgeType = ("author", "writes", "paper")
#: Arguments every loader of the walk gets (a cache, so that caches and node tables are there).
COMMON = {"num_neighbors": [3, 2], "batch_size": 4, "cache_size": 0.5, "edge_features": True,
          "stall_timeout": 30.0}


@dataclass
class Served:
    """A graph with edge features and link splits, served by two partitions' servers."""

    kind: str
    graph: AnyGraph
    cluster: Cluster

    @property
    def seed_type(self) -> EdgeType:
        return typed_view(self.graph).edge_types[0] if self.kind == "plain" else WRITES


@pytest.fixture(scope="module", params=KINDS)
def served_graph(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Served]:
    kind = str(request.param)
    graph = mixed(kind, weighted=False)
    gen = np.random.default_rng(0)
    if isinstance(graph, GraphData):
        graph.edge_attr = gen.standard_normal((graph.edge_index.shape[1], 2)).astype(np.float32)
    else:
        count = graph.edge_index[WRITES].shape[1]
        graph.edge_attr = {WRITES: gen.standard_normal((count, 2)).astype(np.float32)}
    graph = random_link_split(graph, edge_type=None if kind == "plain" else WRITES, val=0.2, test=0.2,
                              num_negatives=3, seed=0)
    root: Path = tmp_path_factory.mktemp(kind)
    partition_graph(graph, 2, root, method="random", progress=False)
    with served(root, 2) as addresses, Cluster(addresses) as cluster:
        yield Served(kind, graph, cluster)


def given_edges(s: Served) -> torch.Tensor:
    """Ten seed edges of the seed type, in original IDs (message-passing edges or not)."""
    ei = typed_view(s.graph).edge_index[s.seed_type]
    return torch.from_numpy(np.ascontiguousarray(ei[:, :10]))


def node_loader(s: Served, **kw: object) -> RemoteNeighborLoader:
    return RemoteNeighborLoader(s.cluster, "train", **{**COMMON, **kw})  # type: ignore[arg-type]


def link_loader(s: Served, given: bool) -> RemoteLinkNeighborLoader:
    if not given:
        return RemoteLinkNeighborLoader(s.cluster, "train", neg_sampling="binary", exclude="self",
                                        **COMMON)  # type: ignore[arg-type]
    index: object = given_edges(s) if s.kind == "plain" else (WRITES, given_edges(s))
    return RemoteLinkNeighborLoader(s.cluster, edge_label_index=index, edge_label=torch.arange(10) % 2 + 1,
                                    neg_sampling="binary", **COMMON)  # type: ignore[arg-type]


Check = Callable[[RemoteLoader, Served], None]


def _plan(loader: RemoteLoader, s: Served) -> None:
    plan = loader.plan(loader.epoch)
    assert plan.batches_per_rank == len(loader) > 0
    assert loader.plan(loader.epoch + 1).batches_per_rank == len(loader)  # equal on every epoch here


def _set_epoch(loader: RemoteLoader, s: Served) -> None:
    before = len(loader)
    loader.set_epoch(3)
    assert loader.epoch == 3 and len(loader) == before
    with pytest.raises(ValueError, match="epoch: expected an integer >= 0"):
        loader.set_epoch(-1)
    loader.set_epoch(0)


def _progress_after(loader: RemoteLoader, s: Served) -> None:
    """The progress after one step counts that step's seeds over all ranks, and a pass
    set from it streams the rest of the epoch."""
    loader.set_epoch(0)
    plan, total = loader.plan(0), len(loader)
    done = loader.progress_after(1)
    assert done == EpochProgress(1, len(plan.positions(0)))
    loader.set_epoch(0, done)
    assert len(loader) == total - 1
    assert loader.plan(0, done).progress_after(total - 1) == EpochProgress(total, loader.num_seeds)
    loader.set_epoch(0)


def _input_ids(loader: RemoteLoader, s: Served) -> None:
    """Over this one rank's batches, every seed's position exactly once."""
    plan = loader.plan(loader.epoch)
    got = np.concatenate([loader.input_ids(ref) for ref in plan.rank_batches(loader.rank)])
    assert np.array_equal(np.sort(got), np.arange(loader.num_seeds))


def _stream(loader: RemoteLoader, s: Served) -> None:
    with loader.stream() as stream:
        batches = list(stream)
    assert len(batches) == len(loader) and all(isinstance(b, DecodedBatch) for b in batches)
    assert [b.index for b in batches] == list(range(len(loader)))


def _metadata(loader: RemoteLoader, s: Served) -> None:
    if s.kind == "plain":
        with pytest.raises(ValueError, match="metadata: the graph is homogeneous"):
            loader.metadata()
    else:
        node_types, edge_types = loader.metadata()
        graph = typed_view(s.graph)
        assert sorted(node_types) == sorted(graph.num_nodes)
        assert sorted(edge_types) == sorted(graph.edge_index)


def _close(loader: RemoteLoader, s: Served) -> None:
    """Closing twice is fine, and leaves the Cluster passed in open for other loaders."""
    loader.close()
    loader.close()
    with node_loader(s) as other:
        assert len(list(other)) == len(other)


#: What each name shared by both loaders answers, given the arguments of the walk.
SHARED: dict[str, Check] = {
    "batch_size": lambda lo, s: _eq(lo.batch_size, 4),
    "shuffle": lambda lo, s: _eq(lo.shuffle, False),
    "drop_last": lambda lo, s: _eq(lo.drop_last, False),
    "rank": lambda lo, s: _eq(lo.rank, 0),
    "world_size": lambda lo, s: _eq(lo.world_size, 1),
    "prefetch": lambda lo, s: _eq(lo.prefetch, 4),
    "seed": lambda lo, s: _eq(lo.seed, 0),
    "epoch": lambda lo, s: _eq(lo.epoch, 0),
    "feature_dtype": lambda lo, s: _eq(lo.feature_dtype, "float32"),
    "cast_features": lambda lo, s: _eq(lo.cast_features, True),
    "replace": lambda lo, s: _eq(lo.replace, False),
    "weighted": lambda lo, s: _eq(lo.weighted, False),
    "return_internal_ids": lambda lo, s: _eq(lo.return_internal_ids, False),
    "compact_indices": lambda lo, s: _eq(lo.compact_indices, True),
    "edge_attr_name": lambda lo, s: _eq(lo.edge_attr_name, "edge_attr"),
    "edge_ids": lambda lo, s: _eq(lo.edge_ids, True),
    "pin_memory": lambda lo, s: _eq(lo.pin_memory, False),
    "include_features": lambda lo, s: _eq(lo.include_features, True),
    "node_tensors": lambda lo, s: _eq(lo.node_tensors, {}),
    "device": lambda lo, s: _eq(lo.device, torch.device("cpu")),
    "num_neighbors": lambda lo, s: _eq(lo.num_neighbors, [3, 2]),
    "timeouts": lambda lo, s: _eq(lo.timeouts, StreamTimeouts(stall=30.0, reconnect=15.0)),
    "cluster": lambda lo, s: _eq(lo.cluster, s.cluster),
    "client_id": lambda lo, s: _eq(lo.client_id, f"{s.cluster.client_id}-rank0"),
    "graph": lambda lo, s: _eq((type(lo.graph), lo.graph.typed), (TypedGraph, s.kind == "typed")),
    "typed_graph": lambda lo, s: _eq(lo.typed_graph, lo.graph if s.kind == "typed" else None),
    "cluster_info": lambda lo, s: _eq((type(lo.cluster_info), lo.cluster_info.num_partitions),
                                      (pb.ClusterInfo, 2)),
    "num_features": lambda lo, s: _eq(lo.num_features, 6),
    "caches": lambda lo, s: _true(bool(lo.caches) and all(
        isinstance(c, FeatureCache) for c in lo.caches.values())),
    "cache": lambda lo, s: _true(
        isinstance(lo.cache, FeatureCache) if s.kind == "plain" else lo.cache is None),
    "typed_caches": lambda lo, s: _eq(lo.typed_caches, lo.caches if s.kind == "typed" else {}),
    "node_tables": lambda lo, s: _true(set(lo.node_tables) == set(lo.graph.node_types) and all(
        isinstance(t, NodeTable) for t in lo.node_tables.values())),
    "typed_node_tables": lambda lo, s: _eq(lo.typed_node_tables, lo.node_tables if s.kind == "typed" else {}),
    "last_stats": lambda lo, s: _true(isinstance(lo.last_stats, StreamStats)),
    "plan": _plan,
    "set_epoch": _set_epoch,
    "progress_after": _progress_after,
    "input_ids": _input_ids,
    "stream": _stream,
    "metadata": _metadata,
    "close": _close,  # walked last
}


def _eq(got: object, want: object) -> None:
    assert got == want, (got, want)


def _true(holds: bool) -> None:
    assert holds


def _node_seeds(lo: RemoteNeighborLoader, s: Served) -> None:
    train = typed_view(s.graph).splits["train"]
    assert lo.num_seeds == train.size and torch.equal(lo.input_nodes, torch.from_numpy(np.sort(train)))
    assert sum(lo.seeds_per_partition) == lo.num_seeds and len(lo.seeds_per_partition) == 2


NODE: dict[str, Callable[[RemoteNeighborLoader, Served], None]] = {
    "split": lambda lo, s: _eq(lo.split, "train"),
    "batches": lambda lo, s: _eq(lo.batches, "global"),
    "include_labels": lambda lo, s: _eq(lo.include_labels, True),
    "every_node": lambda lo, s: _eq(lo.every_node, False),
    "num_classes": lambda lo, s: _eq(lo.num_classes, 4),
    "num_seeds": _node_seeds,
    "input_nodes": _node_seeds,
    "seeds_per_partition": _node_seeds,
}


def _link_seeds(lo: RemoteLinkNeighborLoader, s: Served) -> None:
    if lo.split is None:
        assert lo.num_seeds == 10 and torch.equal(lo.edge_label_index, given_edges(s))  # type: ignore[arg-type]
    else:
        assert lo.num_seeds == s.graph.link_splits["train"].num_edges and lo.edge_label_index is None


LINK: dict[str, Callable[[RemoteLinkNeighborLoader, Served], None]] = {
    "split": lambda lo, s: _true(lo.split in ("train", None)),
    "negatives": lambda lo, s: _eq(lo.negatives, Negatives(pb.NegativeSampling.BINARY, 1.0, False)),
    "exclude": lambda lo, s: _eq(lo.exclude, "self" if lo.split else None),
    "edge_type": lambda lo, s: _eq(lo.edge_type, s.seed_type),
    "num_seeds": _link_seeds,
    "edge_label_index": _link_seeds,
}


def public_names(loader: RemoteLoader) -> set[str]:
    return {name for name in dir(loader) if not name.startswith("_")}


def walk(loader: RemoteLoader, checks: dict[str, Callable], s: Served) -> None:  # type: ignore[type-arg]
    """Check every public name of ``loader``; each name must have a check."""
    assert public_names(loader) == set(checks), public_names(loader) ^ set(checks)
    for name in sorted(checks, key=lambda n: n == "close"):
        getattr(loader, name)  # no property raises
        try:
            checks[name](loader, s)
        except AssertionError as exc:
            raise AssertionError(f"{type(loader).__name__}.{name}: {exc}") from exc


def iterate(loader: RemoteLoader) -> list[Data | HeteroData]:
    """The epoch's batches, checking len(), the counters and the context manager."""
    with loader as same:
        assert same is loader
        batches = list(loader)
    assert len(batches) == len(loader) == loader.last_stats.batches
    assert loader.last_stats.bytes > 0 and 0.0 < loader.last_stats.hit_rate <= 1.0
    return batches


def test_every_public_name_of_the_node_loader_answers(served_graph: Served) -> None:
    s = served_graph
    loader = node_loader(s)
    assert repr(loader).startswith("RemoteNeighborLoader(split='train', num_neighbors=[3, 2], batch_size=4")
    batches = iterate(loader)
    for batch in batches:  # input_id indexes input_nodes, and the seeds lead n_id
        store = batch if isinstance(batch, Data) else batch[typed_view(s.graph).target_type]
        assert torch.equal(loader.input_nodes[store.input_id], store.n_id[: store.batch_size])
    walk(loader, {**SHARED, **NODE}, s)


def test_the_node_loaders_batches_per_partition_say_their_seeds(served_graph: Served) -> None:
    s = served_graph
    with node_loader(s, batches="partition") as loader:
        plan = loader.plan(0)
        assert not isinstance(plan, GlobalPlan)
        _input_ids(loader, s)
        target = typed_view(s.graph).target_type
        sizes = [b.batch_size if isinstance(b, Data) else b[target].batch_size for b in loader]
        assert sum(sizes) == loader.num_seeds


@pytest.mark.parametrize("given", [False, True], ids=["stored-split", "edge_label_index"])
def test_every_public_name_of_the_link_loader_answers(served_graph: Served, given: bool) -> None:
    s = served_graph
    loader = link_loader(s, given)
    source = "10 seeds given" if given else "split='train'"
    assert repr(loader).startswith(f"RemoteLinkNeighborLoader({source}, num_neighbors=[3, 2], batch_size=4")
    batches = iterate(loader)
    seen = []
    for batch in batches:  # input_id on the seed edge type (as PyG), indexing the seed edges
        store = batch if isinstance(batch, Data) else batch[s.seed_type]
        positives = store.input_id.numel()
        seen.append(store.input_id)
        if given:
            src = (batch if isinstance(batch, Data) else batch[s.seed_type[0]]).n_id
            dst = (batch if isinstance(batch, Data) else batch[s.seed_type[2]]).n_id
            pairs = torch.stack([src[store.edge_label_index[0, :positives]],
                                 dst[store.edge_label_index[1, :positives]]])
            assert torch.equal(pairs, given_edges(s)[:, store.input_id])
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(loader.num_seeds))
    walk(loader, {**SHARED, **LINK}, s)


def test_neither_loader_takes_the_others_arguments(served_graph: Served) -> None:
    s = served_graph
    for name, value in (("input_nodes", [1, 2]), ("seeds", [1]), ("batches", "global"),
                        ("include_labels", False)):
        with pytest.raises(TypeError, match=f"RemoteLinkNeighborLoader got an unexpected keyword argument "
                                            f"'{name}'"):
            RemoteLinkNeighborLoader(s.cluster, **COMMON, **{name: value})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="RemoteNeighborLoader got an unexpected keyword argument 'neg_"):
        RemoteNeighborLoader(s.cluster, **COMMON, neg_sampling="binary")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"num_workers: not supported by RemoteLinkNeighborLoader \(sampling"):
        RemoteLinkNeighborLoader(s.cluster, **COMMON, num_workers=2)  # type: ignore[arg-type]
