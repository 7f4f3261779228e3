"""The trainer-side feature cache on random graphs: for any graph, partitioning, wire
dtype, cache size and batch layout, every batch equals the batch without the cache.

Each seed draws a graph of random shape (8-200 nodes, isolated ones, repeated edges and
self loops, a hub on odd seeds, features in float32 or float16 with 1-8 columns, edge
weights on every third seed, unlabeled nodes; typed: 2-4 node types of 1-40 nodes, some
without features, relations drawn at random, and on even seeds none into the last type),
partitions it in 1-3 parts and serves it in-process; the batches of four (dtype, cache
size, layout) settings are compared bit for bit with the uncached loader's.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from in_process_servers import served
from test_feature_cache import _raw
from test_loader import TIMEOUTS, RealServers

from partitioner import partition_graph
from partitioner.graph import GraphData, TypedGraphData
from trainer_client.loader import RemoteNeighborLoader

SEEDS = range(6)
#: (wire dtype, cache size, batch layout): fractions, a size in bytes, every row.
SETTINGS = [("float32", 0.5, "partition"), ("bfloat16", 1.0, "global"),
            ("stored", "200B", "partition"), ("bfloat16", 0.2, "global")]


def _splits(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    perm = rng.permutation(n)
    return {"train": np.sort(perm[: max(2, n // 2)]), "val": np.sort(perm[n // 2: 3 * n // 4]),
            "test": np.sort(perm[3 * n // 4:])}


def random_graph(seed: int) -> GraphData:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(8, 200))
    m = int(rng.integers(0, 6 * n))
    edges = [np.stack([rng.integers(0, n, m), rng.integers(0, n, m)])]
    if seed % 2:  # a hub every node points at
        edges.append(np.stack([rng.permutation(n), np.zeros(n, np.int64)]))
    edge_index = np.concatenate(edges, axis=1).astype(np.int64)
    x = rng.standard_normal((n, int(rng.integers(1, 9)))).astype(rng.choice([np.float32, np.float16]))
    classes = int(rng.integers(2, 6))
    y = rng.integers(0, classes, n).astype(np.int64)
    y[rng.random(n) < 0.1] = -1
    weight = rng.uniform(0.1, 3, edge_index.shape[1]).astype(np.float32) if seed % 3 == 0 else None
    graph = GraphData(name=f"random-{seed}", num_nodes=n, edge_index=edge_index, x=x, y=y,
                      num_classes=classes, splits=_splits(rng, n), edge_weight=weight)
    graph.validate()
    return graph


def random_typed_graph(seed: int) -> TypedGraphData:
    rng = np.random.default_rng(seed)
    types = ["a", "b", "c", "d"][: int(rng.integers(2, 5))]
    n = {t: int(rng.integers(1, 40)) for t in types}
    n["a"] = max(n["a"], 12)
    relations = {}
    for s, d in itertools.product(types, types):
        if seed % 2 == 0 and len(types) > 2 and d == types[-1]:
            continue  # a type no relation reaches
        if rng.random() < 0.4 or (s, d) == ("b", "a"):
            m = int(rng.integers(0, 80))
            relations[(s, f"{s}_to_{d}", d)] = np.stack(
                [rng.integers(0, n[s], m), rng.integers(0, n[d], m)]).astype(np.int64)
    x = {t: rng.standard_normal((n[t], int(rng.integers(1, 7)))).astype(rng.choice([np.float32, np.float16]))
         for t in types if t == "a" or rng.random() < 0.5}
    return TypedGraphData(name=f"random-typed-{seed}", num_nodes=n, edge_index=relations, x=x,
                           target_type="a", y=rng.integers(0, 3, n["a"]).astype(np.int64), num_classes=3,
                           splits=_splits(rng, n["a"]))


def _batches(addresses: list[str], input_nodes: Any, **kw: Any) -> list[Any]:
    settings = {"num_neighbors": [4, 3], "batch_size": 7, "shuffle": True, "seed": 2, **TIMEOUTS, **kw}
    with RemoteNeighborLoader(addresses, input_nodes=input_nodes, **settings) as loader:
        return list(loader)


def _assert_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Same dtype and the same values, floats bit for bit."""
    assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    if a.is_floating_point():
        a, b = _raw(a), _raw(b)
    assert torch.equal(a, b), what


@pytest.mark.parametrize("seed", SEEDS)
def test_homogeneous_batches_equal_without_the_cache(seed: int, tmp_path: Path) -> None:
    graph = random_graph(seed)
    parts = 1 + seed % 3
    partition_graph(graph, parts, tmp_path, method="hash" if seed % 2 else "range", progress=False)
    cluster = RealServers(tmp_path, parts)
    try:
        for dtype, cache, layout in SETTINGS:
            common = {"feature_dtype": dtype, "batches": layout, "cast_features": layout == "global"}
            plain = _batches(cluster.addresses, "train", cache_size=0, **common)
            cached = _batches(cluster.addresses, "train", cache_size=cache, **common)
            assert len(plain) == len(cached) > 0
            for a, b in zip(plain, cached, strict=True):
                for key in ("n_id", "edge_index", "x", "y", "edge_weight", "orig_id"):
                    assert (key in a) == (key in b), key
                    if key in a:
                        _assert_equal(a[key], b[key], f"{key} ({dtype}, {cache}, {layout})")
    finally:
        cluster.stop()


@pytest.mark.parametrize("seed", SEEDS)
def test_typed_batches_equal_without_the_cache(seed: int, tmp_path: Path) -> None:
    graph = random_typed_graph(seed)
    parts = 1 + seed % 3
    partition_graph(graph, parts, tmp_path, method="hash", seed=seed, progress=False)
    with served(tmp_path, parts) as addresses:
        for dtype, cache, layout in SETTINGS:
            seeds = "train" if layout == "partition" else ("a", None)
            plain = _batches(addresses, seeds, cache_size=0, feature_dtype=dtype, batches=layout)
            cached = _batches(addresses, seeds, cache_size=cache, feature_dtype=dtype, batches=layout)
            assert len(plain) == len(cached) > 0
            for a, b in zip(plain, cached, strict=True):
                assert a.node_types == b.node_types and set(a.edge_types) == set(b.edge_types)
                for t in a.node_types:
                    for key in ("n_id", "x", "y"):
                        assert (key in a[t]) == (key in b[t]), (t, key)
                        if key in a[t]:
                            _assert_equal(a[t][key], b[t][key], f"{t}.{key} ({dtype}, {cache}, {layout})")
                for et in a.edge_types:
                    _assert_equal(a[et].edge_index, b[et].edge_index, f"{et} ({dtype}, {cache}, {layout})")
