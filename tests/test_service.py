"""The service end to end for both kinds of graph (plain and typed, one path): in-process
servers on loopback ports, each the others' peer, spoken to through RemoteNeighborLoader.
Every test runs on :func:`graph_fixtures.mixed` graphs of each kind; the plain graph's
batches are ``Data``, the typed graph's ``HeteroData``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from graph_fixtures import AnyGraph, target, typed_view
from in_process_servers import serving
from test_loader import TIMEOUTS
from torch_geometric.data import Data, HeteroData

from partitioner import load_node_data, load_node_map, load_partition, load_structure, partition_graph
from partitioner.graph import PLAIN_EDGE_TYPE, PLAIN_NODE_TYPE
from sampling_server.sampler import CpuNeighborSampler, batch_key, to_pyg_data
from sampling_server.server import SamplingServer
from trainer_client.loader import RemoteNeighborLoader

Batch = Data | HeteroData


def served(root: Path, parts: int, **kw: object) -> contextlib.AbstractContextManager[
        tuple[list[str], list[SamplingServer]]]:
    """In-process servers asking their peers by default (``structure`` and ``features``
    ``partition``)."""
    return serving(root, parts, **{"structure": "partition", "features": "partition", **kw})


@pytest.fixture(scope="module")
def two(graph: AnyGraph, kind: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The graph in 2 hash partitions (global IDs relabelled)."""
    root = tmp_path_factory.mktemp(f"service-{kind}-2")
    partition_graph(graph, 2, root, method="hash", progress=False)
    return root


@pytest.fixture(scope="module")
def cluster(two: Path) -> Iterator[list[str]]:
    with served(two, 2) as (addresses, _):
        yield addresses


def stores(batch: Batch) -> dict[Any, Any]:
    """A batch's node and edge stores by type (a ``Data`` is its one type's and relation's)."""
    if isinstance(batch, HeteroData):
        return {key: batch[key] for key in [*batch.node_types, *batch.edge_types]}
    return {PLAIN_NODE_TYPE: batch, PLAIN_EDGE_TYPE: batch}


def assert_same(a: list[Batch], b: list[Batch]) -> None:
    """Two epochs' batches equal in every field of every store, bit for bit."""
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        sx, sy = stores(x), stores(y)
        assert sx.keys() == sy.keys()
        for key, store in sy.items():
            assert set(sx[key].keys()) == set(store.keys()), key
            for name, value in store.items():
                got = sx[key][name]
                same = got.dtype == value.dtype and torch.equal(got, value) \
                    if isinstance(value, torch.Tensor) else got == value
                assert same, (key, name)


def epoch(addresses: list[str], **kw: Any) -> list[Batch]:
    settings: dict[str, Any] = {"num_neighbors": [3, 2], "batch_size": 5, "shuffle": True, "seed": 3,
                                **TIMEOUTS, **kw}
    with RemoteNeighborLoader(addresses, "train", **settings) as loader:
        loader.set_epoch(1)
        return list(loader)


def check_batch(graph: AnyGraph, batch: Batch, input_nodes: torch.Tensor) -> None:
    """Every edge of the batch is an edge of the graph (by original IDs), features and
    labels are the original rows, the seeds are the inputs ``input_id`` names."""
    typed = typed_view(graph)
    by_type = stores(batch)
    t = typed.target_type
    seeds = by_type[t].n_id[: by_type[t].batch_size]
    assert torch.equal(seeds, input_nodes[by_type[t].input_id])
    for node_type in typed.node_types:
        store = by_type[node_type]
        assert store.n_id.dtype == torch.int64 and store.n_id.unique().numel() == store.num_nodes
        assert sum(store.num_sampled_nodes) == store.num_nodes
        if node_type in typed.x:
            assert torch.equal(store.x, torch.from_numpy(typed.x[node_type][store.n_id.numpy()]))
        else:
            assert "x" not in store
    assert torch.equal(by_type[t].y, torch.from_numpy(typed.y[by_type[t].n_id.numpy()]))
    for et, ei in typed.edge_index.items():
        edges = set(zip(ei[0].tolist(), ei[1].tolist(), strict=True))
        got = by_type[et].edge_index
        assert got.shape == (2, sum(by_type[et].num_sampled_edges))
        src, dst = by_type[et[0]].n_id[got[0]].tolist(), by_type[et[2]].n_id[got[1]].tolist()
        assert set(zip(src, dst, strict=True)) <= edges, et


@pytest.mark.parametrize(("world_size", "batches"), [(1, "global"), (3, "global"), (2, "partition")])
@pytest.mark.parametrize("weighted", [False, True], ids=["uniform", "weighted"])
def test_every_seed_once_every_rank_as_many_batches(
        cluster: list[str], graph: AnyGraph, world_size: int, batches: str, weighted: bool) -> None:
    """An epoch over every rank: each train seed in exactly one batch, every rank the same
    number of batches, every batch a subgraph of the graph with its original rows; weighted
    draws too (both kinds have edge weights)."""
    loaders = [RemoteNeighborLoader(cluster, "train", num_neighbors=[3, -1], batch_size=4, rank=r,
                                    world_size=world_size, shuffle=True, batches=batches,
                                    weighted=weighted, **TIMEOUTS) for r in range(world_size)]
    try:
        assert len({len(loader) for loader in loaders}) == 1
        seeds = []
        for loader in loaders:
            got = list(loader)
            assert len(got) == len(loader)
            for batch in got:
                check_batch(graph, batch, loader.input_nodes)
                store = stores(batch)[target(graph)]
                seeds.extend(store.n_id[: store.batch_size].tolist())
        assert sorted(seeds) == sorted(typed_view(graph).splits["train"].tolist())
    finally:
        for loader in loaders:
            loader.close()


def test_features_travel_in_the_requested_dtype(cluster: list[str], graph: AnyGraph) -> None:
    typed = typed_view(graph)
    for dtype in ("bfloat16", "float16"):
        for batch in epoch(cluster, feature_dtype=dtype, return_internal_ids=True):
            for t, store in stores(batch).items():
                if t not in typed.x:
                    continue
                want = torch.from_numpy(typed.x[t][store.n_id.numpy()])
                assert store.x.dtype == torch.float32  # cast back on the device
                assert torch.equal(store.x, want.to(getattr(torch, dtype)).float())
                assert store.internal_n_id.shape == store.n_id.shape  # graphfeed's own IDs on request


def test_batches_spread_over_many_small_messages_are_the_same(two: Path, cluster: list[str]) -> None:
    """Servers whose messages hold 256 bytes of tensor data (batches, peer answers and row
    blocks spread over many chunks) send the same batches."""
    with served(two, 2, chunk_bytes=256) as (small, _):
        assert_same(epoch(small), epoch(cluster))
        assert_same(epoch(small, feature_dtype="bfloat16", cache_size=0.3),
                    epoch(cluster, feature_dtype="bfloat16", cache_size=0.3))


def test_compact_batches_are_the_int64_batches(cluster: list[str]) -> None:
    for kw in ({}, {"cache_size": 0.3}, {"feature_dtype": "bfloat16", "cache_size": 1.0}):
        assert_same(epoch(cluster, compact_indices=True, **kw), epoch(cluster, compact_indices=False, **kw))


@pytest.mark.parametrize("replace", [False, True], ids=["uniform", "replace"])
def test_two_partitions_equal_the_whole_graph_sampler(
        cluster: list[str], graph: AnyGraph, tmp_path_factory: pytest.TempPathFactory, replace: bool) -> None:
    """Global batches across two partitions (peers over gRPC) are exactly what the
    whole-graph in-process sampler draws for the same seeds and keys, laid out as the
    in-process conversion lays them out."""
    root = tmp_path_factory.mktemp("whole")
    partition_graph(graph, 1, root, method="random", progress=False)
    whole = CpuNeighborSampler(load_partition(root, 0), replace=replace)
    t = target(graph)
    node_map = np.asarray(load_node_map(root, t))
    with RemoteNeighborLoader(cluster, "train", num_neighbors=[3, 2], batch_size=5, shuffle=True,
                              seed=7, replace=replace, **TIMEOUTS) as loader:
        loader.set_epoch(3)
        for i, batch in enumerate(loader):
            store = stores(batch)[t]
            seeds = node_map[store.n_id[: store.batch_size].numpy()]
            want = to_pyg_data(whole.minibatch(seeds, t, [3, 2], batch_key(7, 3, 0, i)),
                               plain=isinstance(batch, Data))
            for key, ref in stores(want).items():
                got = stores(batch)[key]
                assert set(got.keys()) - {"input_id"} == set(ref.keys()), key
                for name, value in ref.items():
                    assert torch.equal(got[name], value) if isinstance(value, torch.Tensor) \
                        else got[name] == value, (i, key, name)


@pytest.mark.parametrize("setting", ["full", "auto"])
def test_servers_holding_the_whole_graph_send_the_same_batches(
        two: Path, cluster: list[str], setting: str) -> None:
    """Servers holding every partition's structure and features (``full``; ``auto`` on
    this small graph) draw and gather every batch themselves, ask no peer, and send what
    servers asking their peers send, in every sampling mode and wire dtype; they count
    the whole graph's bytes in their metrics."""
    cases: list[dict[str, Any]] = [{}, {"replace": True}, {"weighted": True},
                                   {"feature_dtype": "bfloat16", "cache_size": 0.4}, {"batches": "partition"}]
    with served(two, 2, structure=setting, features=setting) as (holding, servers):
        assert {(s.store.structure_mode, s.store.features_mode) for s in servers} == {("full", "full")}
        for kw in cases:
            assert_same(epoch(holding, **kw), epoch(cluster, **kw))
        for s in servers:
            stage = {stage: s.metrics.registry.get_sample_value(
                "graphfeed_stage_seconds_count", {"partition": str(s.store.partition_id), "stage": stage})
                for stage in ("peer_sample", "peer_fetch")}
            assert not any(stage.values()), stage
            held = [s.metrics.registry.get_sample_value("graphfeed_held_bytes", {
                "partition": str(s.store.partition_id), "what": what, "extent": "full"})
                for what in ("structure", "features")]
            assert held == [load_structure(two).nbytes, load_node_data(two).nbytes]


def test_a_server_gives_freed_memory_back_once_its_last_stream_ends(
        cluster: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that streamed trims its allocator once its streams have all ended
    (protos/allocator.py release_free_memory)."""
    import threading

    from sampling_server import servicer

    trimmed = threading.Event()

    def record() -> bool:
        trimmed.set()
        return True

    monkeypatch.setattr(servicer, "release_free_memory", record)
    assert epoch(cluster)
    assert trimmed.wait(30), "no server gave its memory back after the epoch's streams ended"


def test_a_server_counts_the_bytes_of_its_partition_in_its_metrics(two: Path) -> None:
    """Every relation's in-edges and every type's original IDs; its features and labels."""
    with served(two, 2) as (_, servers):
        for s in servers:
            part = s.store.partition
            held = {what: s.metrics.registry.get_sample_value(
                "graphfeed_held_bytes", {"partition": str(part.partition_id), "what": what,
                                         "extent": "partition"}) for what in ("structure", "features")}
            edges = sum(part.indptr[et].nbytes + part.indices[et].nbytes + (
                part.edge_weight[et].nbytes if et in part.edge_weight else 0) for et in part.indices)
            assert held["structure"] == edges + sum(a.nbytes for a in part.orig_ids.values())
            assert held["features"] == sum(a.nbytes for a in part.x.values()) + part.y.nbytes > 0
