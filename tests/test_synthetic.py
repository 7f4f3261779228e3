"""Synthetic graphs: reproducible from the seed, simple undirected graphs with the
preset's sizes, and learnable from structure and features together."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.linear_model import LogisticRegression

from partitioner.graph import SPLITS, GraphData
from partitioner.synthetic import PRESETS, SyntheticPreset, generate

#: Fraction of edges joining two nodes of the same class on `small` (preset: 0.8).
HOMOPHILY_RANGE = (0.7, 0.95)
#: Test accuracy that 2-hop propagated features must add over features alone.
MIN_PROPAGATION_GAIN = 0.2
#: Test accuracy that features alone must add over chance (1 / num_classes).
MIN_FEATURE_GAIN_OVER_CHANCE = 0.15


@pytest.fixture(scope="module")
def small() -> GraphData:
    return generate("small", seed=0, progress=False)


def _assert_same_graph(a: GraphData, b: GraphData) -> None:
    np.testing.assert_array_equal(a.edge_index, b.edge_index)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    assert a.splits.keys() == b.splits.keys()
    for split in a.splits:
        np.testing.assert_array_equal(a.splits[split], b.splits[split])


def test_same_seed_gives_the_same_graph(small: GraphData) -> None:
    _assert_same_graph(small, generate("small", seed=0, progress=False))


def test_a_different_seed_gives_a_different_graph(small: GraphData) -> None:
    other = generate("small", seed=1, progress=False)
    assert other.num_edges == small.num_edges  # same preset, same sizes...
    assert not np.array_equal(other.edge_index, small.edge_index)  # ...different draws
    assert not np.array_equal(other.x, small.x)
    assert not np.array_equal(other.y, small.y)
    assert not np.array_equal(other.splits["train"], small.splits["train"])


def test_small_has_the_preset_sizes_and_types(small: GraphData) -> None:
    preset = PRESETS["small"]
    assert small.name == "small" and small.num_nodes == preset.num_nodes
    assert small.num_edges == 2 * preset.num_undirected_edges
    assert small.x.shape == (preset.num_nodes, preset.feature_dim) and small.x.dtype == np.float32
    assert small.y.dtype == np.int64 and small.num_classes == preset.num_classes
    assert set(np.unique(small.y).tolist()) == set(range(preset.num_classes))
    assert small.edge_weight is None
    small.validate()


def test_small_is_a_simple_symmetric_graph(small: GraphData) -> None:
    src, dst = small.edge_index
    n = small.num_nodes
    assert not (src == dst).any(), "self-loop"
    directed = src * n + dst
    assert np.unique(directed).size == directed.size, "repeated directed edge"
    undirected = np.minimum(src, dst) * n + np.maximum(src, dst)
    assert np.unique(undirected).size == undirected.size // 2, "repeated undirected edge"
    np.testing.assert_array_equal(np.sort(directed), np.sort(dst * n + src))  # reverses present


def test_splits_have_the_preset_sizes_and_are_disjoint(small: GraphData) -> None:
    assert tuple(small.splits) == SPLITS
    assert tuple(small.splits[s].size for s in SPLITS) == PRESETS["small"].split_sizes
    every = np.concatenate([small.splits[s] for s in SPLITS])
    assert np.unique(every).size == every.size
    assert every.min() >= 0 and every.max() < small.num_nodes
    for split in SPLITS:
        assert (np.diff(small.splits[split]) > 0).all()  # sorted


def test_small_is_homophilous(small: GraphData) -> None:
    src, dst = small.edge_index
    homophily = float((small.y[src] == small.y[dst]).mean())
    assert HOMOPHILY_RANGE[0] <= homophily <= HOMOPHILY_RANGE[1], homophily


def _test_accuracy(features: np.ndarray, graph: GraphData) -> float:
    train, test = graph.splits["train"], graph.splits["test"]
    model = LogisticRegression(max_iter=500).fit(features[train], graph.y[train])
    return float(model.score(features[test], graph.y[test]))


def test_small_is_learnable_from_structure_and_features(small: GraphData) -> None:
    """Features alone are partly informative; two hops of propagation over the graph
    (the simplest GNN, SGC) add much more."""
    n = small.num_nodes
    src, dst = small.edge_index
    adj = sp.csr_matrix((np.ones(src.size), (dst, src)), shape=(n, n)) + sp.identity(n)
    inv_sqrt = sp.diags(1.0 / np.sqrt(np.asarray(adj.sum(axis=1)).ravel()))
    norm = inv_sqrt @ adj @ inv_sqrt
    x = small.x.astype(np.float64)
    propagated = norm @ (norm @ x)

    chance = 1.0 / small.num_classes
    features_only = _test_accuracy(x, small)
    with_graph = _test_accuracy(propagated, small)
    assert features_only >= chance + MIN_FEATURE_GAIN_OVER_CHANCE, features_only
    assert with_graph >= features_only + MIN_PROPAGATION_GAIN, (features_only, with_graph)


def test_a_custom_preset_generates_a_valid_graph() -> None:
    preset = dataclasses.replace(PRESETS["small"], num_nodes=300, num_undirected_edges=900,
                                 num_classes=3, feature_dim=4, split_sizes=(30, 20, 50),
                                 class_skew=1.0)
    g = generate(preset, seed=5, progress=False)
    assert g.name == "synthetic" and g.num_nodes == 300 and g.num_edges == 1800
    assert g.x.shape == (300, 4)
    assert tuple(g.splits[s].size for s in SPLITS) == (30, 20, 50)
    counts = np.bincount(g.y, minlength=3)
    assert counts[0] > counts[2]  # class_skew > 0: smaller classes further down
    g.validate()
    _assert_same_graph(g, generate(preset, seed=5, progress=False))


def test_unknown_preset_is_refused() -> None:
    with pytest.raises(ValueError, match=r"preset: expected one of .*'tiny'"):
        generate("tiny", progress=False)


def test_splits_larger_than_the_graph_are_refused() -> None:
    preset = SyntheticPreset(num_nodes=10, num_undirected_edges=10, num_classes=2, feature_dim=2,
                             gamma=2.5, max_degree_fraction=0.5, homophily=0.5,
                             feature_signal=1.0, split_sizes=(5, 5, 5))
    with pytest.raises(ValueError, match="split_sizes"):
        generate(preset, progress=False)
