"""The user's view of a partitioned graph, through real sampling servers: batches speak
original node IDs, ``input_id`` aligns them with the input, global batches mix the
partitions as a single-process loader does, and the same seeds give the same batch
whatever the partitioning (draws are keyed by original node IDs)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from test_loader import TIMEOUTS, RealServers

from partitioner import load_partition, partition_graph
from partitioner.graph import PLAIN_NODE_TYPE, GraphData
from partitioner.synthetic import SyntheticPreset, generate
from trainer_client.loader import RemoteNeighborLoader

FANOUTS = [4, 3]
#: Three equal classes whose edges never leave their class: METIS cuts along the classes.
CLASS_PURE = SyntheticPreset(
    num_nodes=900, num_undirected_edges=4500, num_classes=3, feature_dim=8, gamma=2.5,
    max_degree_fraction=0.05, homophily=1.0, feature_signal=1.0, split_sizes=(600, 150, 150),
)


@pytest.fixture(scope="module")
def small() -> GraphData:
    return generate("small", progress=False)


@contextlib.contextmanager
def served(graph: GraphData, root: Path, parts: int, method: str) -> Iterator[list[str]]:
    """``graph`` partitioned by ``method`` under ``root``, one real server per partition."""
    if not (root / "manifest.json").exists():
        partition_graph(graph, parts, root, method=method, progress=False)
    cluster = RealServers(root, parts)
    try:
        yield cluster.addresses
    finally:
        cluster.stop()


def edge_set(graph: GraphData) -> set[tuple[int, int]]:
    return set(zip(graph.edge_index[0].tolist(), graph.edge_index[1].tolist(), strict=True))


def test_batches_in_original_ids_are_rows_and_edges_of_the_original_graph(
    small: GraphData, tmp_path: Path
) -> None:
    edges = edge_set(small)
    seeds = np.random.default_rng(0).choice(small.num_nodes, 300, replace=False)
    with served(small, tmp_path / "metis-3", 3, "metis") as addresses, RemoteNeighborLoader(
            addresses, input_nodes=torch.from_numpy(seeds), num_neighbors=FANOUTS, batch_size=64,
            return_internal_ids=True, **TIMEOUTS) as loader:
        assert torch.equal(loader.input_nodes, torch.from_numpy(seeds))
        input_ids = []
        for batch in loader:
            n_id = batch.n_id.numpy()
            assert np.array_equal(n_id[: batch.batch_size], seeds[batch.input_id.numpy()])
            assert np.array_equal(batch.x.numpy(), small.x[n_id])
            assert np.array_equal(batch.y.numpy(), small.y[n_id])
            src, dst = n_id[batch.edge_index[0].numpy()], n_id[batch.edge_index[1].numpy()]
            assert all((int(s), int(d)) in edges for s, d in zip(src, dst, strict=True))
            assert not torch.equal(batch.internal_n_id, batch.n_id)  # METIS renumbered them
            input_ids.append(batch.input_id)
        # shuffle=False across 3 partitions: the batches follow the input order
        assert torch.equal(torch.cat(input_ids), torch.arange(seeds.size))


def test_a_boolean_mask_and_a_split_are_taken_in_original_id_order(small: GraphData, tmp_path: Path) -> None:
    mask = np.zeros(small.num_nodes, dtype=bool)
    mask[small.splits["val"]] = True
    with served(small, tmp_path / "hash-3", 3, "hash") as addresses:
        by_mask = RemoteNeighborLoader(addresses, input_nodes=torch.from_numpy(mask), num_neighbors=[2],
                                       batch_size=100, **TIMEOUTS)
        by_split = RemoteNeighborLoader(addresses, "valid", num_neighbors=[2], batch_size=100, **TIMEOUTS)
        expected = np.sort(small.splits["val"])
        for loader in (by_mask, by_split):
            assert np.array_equal(loader.input_nodes.numpy(), expected)
            got = torch.cat([b.n_id[: b.batch_size] for b in loader]).numpy()
            assert np.array_equal(got, expected)
            loader.close()


def _epoch(addresses: list[str], seeds: np.ndarray, shuffle: bool) -> list[dict[str, torch.Tensor]]:
    with RemoteNeighborLoader(addresses, input_nodes=seeds, num_neighbors=FANOUTS, batch_size=50,
                              shuffle=shuffle, seed=3, **TIMEOUTS) as loader:
        loader.set_epoch(2)
        return [{k: b[k].clone() for k in ("n_id", "edge_index", "x", "y", "input_id")} for b in loader]


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_same_seeds_give_identical_batches_for_any_partitioning(
    small: GraphData, tmp_path: Path, shuffle: bool
) -> None:
    seeds = np.random.default_rng(1).choice(small.num_nodes, 200, replace=False)
    runs = []
    for parts, method in ((1, "range"), (3, "metis"), (3, "hash")):
        with served(small, tmp_path / f"{method}-{parts}", parts, method) as addresses:
            runs.append(_epoch(addresses, seeds, shuffle))
    one, *others = runs
    for other in others:
        assert len(other) == len(one) == 4
        for a, b in zip(one, other, strict=True):
            for key in a:
                assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("stored", ["float64", "float16"])
def test_features_as_stored_cross_partitions_with_and_without_the_cache(
    small: GraphData, tmp_path: Path, stored: str
) -> None:
    """``feature_dtype="stored"`` on features stored in another dtype than float32: the
    servers name it to their peers and the cache fill asks for it; rows are bit-exact."""
    x = small.x.astype(stored)
    if stored == "float64":
        x += np.pi * 1e-12  # bits a float32 round trip would lose
    graph = dataclasses.replace(small, x=x)
    with served(graph, tmp_path / f"{stored}-3", 3, "hash") as addresses:
        for cache in (0, 0.3):
            with RemoteNeighborLoader(addresses, "train", num_neighbors=FANOUTS, batch_size=200,
                                      feature_dtype="stored", cast_features=False,
                                      cache_size=cache, **TIMEOUTS) as loader:
                assert (loader.cache is not None) == bool(cache)
                for batch in loader:
                    n_id = batch.n_id.numpy()
                    assert batch.x.dtype == getattr(torch, stored)
                    assert np.array_equal(batch.x.numpy(), x[n_id])
                    assert np.array_equal(batch.y.numpy(), graph.y[n_id])
                assert (loader.last_stats.hit_rate > 0) == bool(cache)


def test_a_new_pass_without_set_epoch_is_the_next_epoch(small: GraphData, tmp_path: Path) -> None:
    with served(small, tmp_path / "range-2", 2, "range") as addresses, RemoteNeighborLoader(
            addresses, "train", num_neighbors=[2], batch_size=200, shuffle=True, **TIMEOUTS) as loader:
        first = [b.input_id.clone() for b in loader]
        second = [b.input_id.clone() for b in loader]
        assert loader.epoch == 1
        loader.set_epoch(1)
        again = [b.input_id.clone() for b in loader]
        assert all(torch.equal(a, b) for a, b in zip(second, again, strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_global_batches_mix_class_pure_partitions_like_one_process(tmp_path: Path) -> None:
    graph = generate(CLASS_PURE, seed=0, progress=False)
    with served(graph, tmp_path / "pure-3", 3, "metis") as addresses:
        loaders = {layout: RemoteNeighborLoader(addresses, "train", num_neighbors=[2], batch_size=60,
                                                shuffle=True, batches=layout, **TIMEOUTS)
                   for layout in ("global", "partition")}
        # the premise: METIS cut the graph along its classes
        for p in range(3):
            owned = graph.y[np.asarray(load_partition(tmp_path / "pure-3", p).orig_ids[PLAIN_NODE_TYPE])]
            assert np.bincount(owned).max() >= 0.9 * owned.size
        split_mix = np.bincount(graph.y[graph.splits["train"]], minlength=3)
        counts = {layout: np.stack([np.bincount(b.y[: b.batch_size].numpy(), minlength=3) for b in loader])
                  for layout, loader in loaders.items()}
        for loader in loaders.values():
            loader.close()
    # Global batches: each batch's classes are a draw without replacement from the split
    # (hypergeometric), so the per-batch counts pass a chi-square test against its mix.
    expected = np.outer(counts["global"].sum(axis=1), split_mix / split_mix.sum())
    chi2 = float((((counts["global"] - expected) ** 2) / expected).sum())
    dof = (counts["global"].shape[0] - 1) * 2
    assert stats.chi2.sf(chi2, dof) > 1e-4, (chi2, dof)
    majority = counts["global"].max(axis=1) / counts["global"].sum(axis=1)
    assert majority.mean() < 0.5
    # Per-partition batches on class-pure partitions are (almost) one class each.
    majority = counts["partition"].max(axis=1) / counts["partition"].sum(axis=1)
    assert majority.mean() > 0.9


def test_original_id_lookup_equals_indexing_with_and_without_the_identity_shortcut() -> None:
    from sampling_server.sampler.rows import is_identity, original_ids

    rng = np.random.default_rng(0)
    start = 1000
    nodes = rng.integers(start, start + 5000, 20000)
    shuffled = rng.permutation(5000).astype(np.int64) + 7
    assert not is_identity(shuffled, start)
    assert np.array_equal(original_ids(shuffled, nodes, start, False), shuffled[nodes - start])
    same = np.arange(start, start + 5000, dtype=np.int64)
    assert is_identity(same, start) and not is_identity(same, start + 1)
    got = original_ids(same, nodes, start, True)
    assert got.dtype == np.int64 and np.array_equal(got, nodes) and got is not nodes
    for dtype in (np.int32, np.int64):  # stored narrower: widened
        assert np.array_equal(original_ids(shuffled.astype(dtype), nodes, start, False),
                              shuffled[nodes - start])
