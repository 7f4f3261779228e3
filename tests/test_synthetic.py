"""Synthetic graphs, plain (``small``) and typed (``mag-small``): reproducible from the
seed, simple graphs with the preset's sizes and splits, and learnable from structure
more than from features alone; ``edge-feat-small``, whose labels only its edge features
tell."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.linear_model import LogisticRegression

from partitioner.graph import SPLITS, GraphData, TypedGraphData
from partitioner.synthetic import (
    PLAIN_PRESETS,
    PRESETS,
    TYPED_PRESETS,
    SyntheticPreset,
    TypedPreset,
    generate,
    generate_plain,
)
from partitioner.synthetic_edges import label_rule
from tests.graph_fixtures import AnyGraph, typed_view

#: The preset generated for each kind.
SMALL = ("small", "mag-small")
#: Fraction of edges joining two nodes of the same class on `small` (preset: 0.8).
HOMOPHILY_RANGE = (0.7, 0.95)


@pytest.fixture(scope="module", params=SMALL)
def preset(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def graph(preset: str) -> AnyGraph:
    return generate(preset, seed=0, progress=False)


def _assert_same_graph(a: AnyGraph, b: AnyGraph) -> None:
    ta, tb = typed_view(a), typed_view(b)
    assert ta.num_nodes == tb.num_nodes and ta.edge_types == tb.edge_types
    for et, ei in ta.edge_index.items():
        np.testing.assert_array_equal(ei, tb.edge_index[et])
    for t, x in ta.x.items():
        np.testing.assert_array_equal(x, tb.x[t])
    np.testing.assert_array_equal(ta.y, tb.y)
    assert ta.splits.keys() == tb.splits.keys()
    for split in ta.splits:
        np.testing.assert_array_equal(ta.splits[split], tb.splits[split])


def test_same_seed_gives_the_same_graph(preset: str, graph: AnyGraph) -> None:
    _assert_same_graph(graph, generate(preset, seed=0, progress=False))


def test_a_different_seed_gives_a_different_graph(preset: str, graph: AnyGraph) -> None:
    a, b = typed_view(graph), typed_view(generate(preset, seed=1, progress=False))
    assert a.num_nodes == b.num_nodes  # same preset, same sizes...
    assert all(not np.array_equal(ei, b.edge_index[et]) for et, ei in a.edge_index.items())  # ...other draws
    assert all(not np.array_equal(x, b.x[t]) for t, x in a.x.items())
    assert not np.array_equal(a.y, b.y)
    assert not np.array_equal(a.splits["train"], b.splits["train"])


def test_a_preset_has_its_sizes_and_types(preset: str, graph: AnyGraph) -> None:
    params, typed = PRESETS[preset], typed_view(graph)
    assert typed.name == preset and isinstance(graph, TypedGraphData) == (preset in TYPED_PRESETS)
    counts = params.num_nodes if isinstance(params, TypedPreset) else {typed.target_type: params.num_nodes}
    assert typed.num_nodes == counts
    assert set(typed.x) == {typed.target_type}, "features on the target type only"
    x = typed.x[typed.target_type]
    assert x.shape == (counts[typed.target_type], params.feature_dim) and x.dtype == np.float32
    assert typed.y.dtype == np.int64 and typed.num_classes == params.num_classes
    assert set(np.unique(typed.y).tolist()) == set(range(params.num_classes))
    assert typed.edge_weight == {}
    graph.validate()


def test_every_relation_is_simple_with_its_preset_size(preset: str, graph: AnyGraph) -> None:
    """No repeated edge, no self loop; a plain graph is symmetric with twice the preset's
    undirected edges, each typed relation has at least 97% of its preset's distinct edges."""
    typed, params = typed_view(graph), PRESETS[preset]
    for (s, r, d), ei in typed.edge_index.items():
        keys = ei[0] * typed.num_nodes[d] + ei[1]
        assert np.unique(keys).size == keys.size, f"{r}: repeated edge"
        assert s != d or not (ei[0] == ei[1]).any(), f"{r}: self loop"
    if isinstance(params, SyntheticPreset):
        (ei,) = typed.edge_index.values()
        n = typed.total_nodes
        assert ei.shape[1] == 2 * params.num_undirected_edges
        reverses = np.sort(ei[1] * n + ei[0])
        np.testing.assert_array_equal(np.sort(ei[0] * n + ei[1]), reverses)
    else:
        for spec in params.relations:
            assert spec.num_edges * 0.97 <= typed.num_edges(spec.edge_type) <= spec.num_edges


def test_splits_have_the_preset_sizes_and_are_disjoint(preset: str, graph: AnyGraph) -> None:
    typed = typed_view(graph)
    assert tuple(typed.splits) == SPLITS
    assert tuple(typed.splits[s].size for s in SPLITS) == PRESETS[preset].split_sizes
    every = np.concatenate([typed.splits[s] for s in SPLITS])
    assert np.unique(every).size == every.size
    assert every.min() >= 0 and every.max() < typed.num_nodes[typed.target_type]
    for split in SPLITS:
        assert (np.diff(typed.splits[split]) > 0).all()  # sorted


def test_small_is_homophilous() -> None:
    graph = generate_plain("small", seed=0, progress=False)
    src, dst = graph.edge_index
    homophily = float((graph.y[src] == graph.y[dst]).mean())
    assert HOMOPHILY_RANGE[0] <= homophily <= HOMOPHILY_RANGE[1], homophily


def _logistic(features: np.ndarray, graph: AnyGraph) -> float:
    train, test = graph.splits["train"], graph.splits["test"]
    model = LogisticRegression(max_iter=500).fit(features[train], graph.y[train])
    return float(model.score(features[test], graph.y[test]))


def _plain_accuracies(graph: GraphData) -> tuple[float, float]:
    """Test accuracy of logistic regression on the features, and on the features after
    two hops of propagation over the graph (the simplest GNN, SGC)."""
    n = graph.num_nodes
    src, dst = graph.edge_index
    adj = sp.csr_matrix((np.ones(src.size), (dst, src)), shape=(n, n)) + sp.identity(n)
    inv_sqrt = sp.diags(1.0 / np.sqrt(np.asarray(adj.sum(axis=1)).ravel()))
    norm = inv_sqrt @ adj @ inv_sqrt
    x = graph.x.astype(np.float64)
    return _logistic(x, graph), _logistic(norm @ (norm @ x), graph)


def _typed_accuracies(g: TypedGraphData) -> tuple[float, float]:
    """Test accuracy of the nearest class centroid of the paper features, and of a vote
    of the training labels seen through each paper's authors and topics."""
    y, c, train, test = g.y, g.num_classes, g.splits["train"], g.splits["test"]
    x = g.x["paper"]
    cent = np.zeros((c, x.shape[1]))
    np.add.at(cent, y[train], x[train])
    cent /= np.maximum(np.bincount(y[train], minlength=c), 1)[:, None]
    features = (((x[test][:, None, :] - cent[None]) ** 2).sum(-1).argmin(1) == y[test]).mean()
    known = np.full(y.size, -1)
    known[train] = y[train]
    score = np.zeros((y.size, c))
    for et, other_row in ((("author", "writes", "paper"), 0), (("paper", "has_topic", "field_of_study"), 1)):
        ei = g.edge_index[et]
        other, paper = ei[other_row], ei[1 - other_row]
        counts = np.zeros((g.num_nodes[et[0] if other_row == 0 else et[2]], c))
        lab = known[paper] >= 0
        np.add.at(counts, (other[lab], known[paper][lab]), 1)
        seen = counts.sum(1)[other] > 0
        np.add.at(score, (paper[seen], counts.argmax(1)[other[seen]]), 1)
    return float(features), float((score.argmax(1)[test] == y[test]).mean())


#: Per preset, test accuracies over a baseline (chance on `small`, the majority class on
#: `mag-small`): features alone within (low, high) over it (partly informative on
#: `small`, weakly on `mag-small`); with the structure, at least so much over the
#: features and over the baseline.
BOUNDS = {"small": {"features": (0.15, 1.0), "structure_over_features": 0.2, "structure": 0.35},
          "mag-small": {"features": (-1.0, 0.25), "structure_over_features": 0.25, "structure": 0.35}}


def test_labels_are_learnable_from_structure_more_than_from_features(preset: str, graph: AnyGraph) -> None:
    if isinstance(graph, GraphData):
        baseline = 1.0 / graph.num_classes
        features, structure = _plain_accuracies(graph)
    else:
        test = graph.splits["test"]
        baseline = float(np.bincount(graph.y[test]).max() / test.size)
        features, structure = _typed_accuracies(graph)
    bounds, got = BOUNDS[preset], (baseline, features, structure)
    low, high = bounds["features"]
    assert baseline + low <= features <= baseline + high, got
    assert structure >= features + bounds["structure_over_features"], got
    assert structure >= baseline + bounds["structure"], got


def _custom(preset: str) -> SyntheticPreset | TypedPreset:
    params = PRESETS[preset]
    if isinstance(params, SyntheticPreset):
        return dataclasses.replace(params, num_nodes=300, num_undirected_edges=900, num_classes=3,
                                   feature_dim=4, split_sizes=(30, 20, 50), class_skew=1.0)
    relations = tuple(dataclasses.replace(r, num_edges=r.num_edges // 50) for r in params.relations)
    return dataclasses.replace(params, num_nodes={t: max(n // 20, 10) for t, n in params.num_nodes.items()},
                               relations=relations, num_classes=3, feature_dim=4, split_sizes=(30, 20, 50),
                               class_skew=1.0)


def test_a_custom_preset_generates_a_valid_graph(preset: str) -> None:
    params = _custom(preset)
    g = typed_view(generate(params, seed=5, progress=False))
    assert g.name == ("typed-synthetic" if preset in TYPED_PRESETS else "synthetic")
    assert g.x[g.target_type].shape == (g.num_nodes[g.target_type], 4)
    assert tuple(g.splits[s].size for s in SPLITS) == (30, 20, 50)
    counts = np.bincount(g.y, minlength=3)
    assert counts[0] > counts[2]  # class_skew > 0: smaller classes further down
    g.validate()
    _assert_same_graph(g, typed_view(generate(params, seed=5, progress=False)))


def test_splits_larger_than_the_graph_are_refused(preset: str) -> None:
    params = _custom(preset)
    n = params.num_nodes if isinstance(params, SyntheticPreset) else params.num_nodes[params.target_type]
    with pytest.raises(ValueError, match="split_sizes: expected at most"):
        generate(dataclasses.replace(params, split_sizes=(n, 1, 1)), progress=False)


def test_unknown_or_typed_preset_where_plain_is_needed_is_refused() -> None:
    with pytest.raises(ValueError, match=r"preset: expected one of .*'tiny'"):
        generate("tiny", progress=False)
    assert {"small", "products-like", "papers-like", "edge-feat-small"} <= set(PLAIN_PRESETS)
    plain = re.escape(f"preset: expected a plain preset {sorted(PLAIN_PRESETS)}")
    with pytest.raises(ValueError, match=plain):
        generate_plain(dataclasses.replace(_custom("mag-small"), split_sizes=(1, 1, 1)), progress=False)
    assert set(PRESETS) == set(PLAIN_PRESETS) | set(TYPED_PRESETS)


def test_large_presets_have_their_datasets_shape() -> None:
    """products-like: ogbn-products' sizes; mag-like: ogbn-mag's, relation by relation."""
    products = PLAIN_PRESETS["products-like"]
    assert (products.num_nodes, products.num_undirected_edges) == (2_449_029, 61_859_140)
    assert (products.num_classes, products.feature_dim) == (47, 100)
    mag = TYPED_PRESETS["mag-like"]
    assert mag.num_nodes == {"paper": 736_389, "author": 1_134_649, "institution": 8_740,
                             "field_of_study": 59_965}
    assert mag.feature_dim == 128 and mag.num_classes == 349 and sum(mag.split_sizes) == 736_389
    edges = {spec.edge_type[1]: spec.num_edges for spec in mag.relations}
    assert edges == {"writes": 7_145_660, "cites": 5_416_271, "has_topic": 7_505_078,
                     "affiliated_with": 1_043_998}


# -- edge-feat-small: labels that only the edge features tell ------------------------------


@pytest.fixture(scope="module")
def edge_graph() -> GraphData:
    return generate_plain("edge-feat-small", seed=0, progress=False)


def test_edge_feature_preset_is_reproducible_with_its_sizes(edge_graph: GraphData) -> None:
    params = PLAIN_PRESETS["edge-feat-small"]
    attr = edge_graph.edge_attr
    assert attr is not None and attr.dtype == np.float32
    assert attr.shape == (2 * params.num_undirected_edges, 8)
    e = params.num_undirected_edges  # edge e + E is the reverse of edge e, with its own features
    np.testing.assert_array_equal(edge_graph.edge_index[:, e:], edge_graph.edge_index[::-1, :e])
    again = generate_plain("edge-feat-small", seed=0, progress=False)
    np.testing.assert_array_equal(again.edge_attr, attr)
    np.testing.assert_array_equal(again.y, edge_graph.y)
    other = generate_plain("edge-feat-small", seed=1, progress=False)
    assert not np.array_equal(other.edge_attr, attr) and not np.array_equal(other.y, edge_graph.y)
    assert set(np.unique(edge_graph.y).tolist()) == set(range(params.num_classes))
    edge_graph.validate()


def test_edge_features_decide_the_labels_up_to_the_label_noise(edge_graph: GraphData) -> None:
    """The labels are the rule of the summed in-edge features (synthetic_edges), except
    for about label_noise * (C-1)/C of them (about 4% here)."""
    params = PLAIN_PRESETS["edge-feat-small"]
    assert edge_graph.edge_attr is not None
    rule = label_rule(edge_graph.edge_index, edge_graph.edge_attr, edge_graph.num_nodes, params.num_classes,
                      seed=0)
    has_in_edges = rule >= 0
    differ = float((rule[has_in_edges] != edge_graph.y[has_in_edges]).mean())
    assert 0.01 <= differ <= 0.08, differ


def test_only_a_model_that_sees_edge_features_learns_the_labels(edge_graph: GraphData) -> None:
    """Logistic regression on each node's summed in-edge features learns the classes;
    on the node features, or on them propagated over the graph (SGC), it does no better
    than always answering the most frequent class (about 1/6)."""
    assert edge_graph.edge_attr is not None
    sums = np.zeros((edge_graph.num_nodes, edge_graph.edge_attr.shape[1]))
    np.add.at(sums, edge_graph.edge_index[1], edge_graph.edge_attr)
    test = edge_graph.y[edge_graph.splits["test"]]
    majority = float(np.bincount(test).max() / test.size)
    features, structure = _plain_accuracies(edge_graph)
    with_edges = _logistic(sums, edge_graph)
    got = (majority, features, structure, with_edges)
    assert majority < 0.25 and features <= majority + 0.04 and structure <= majority + 0.04, got
    assert with_edges >= 0.8, got


def test_the_full_size_edge_feature_preset_has_products_shape() -> None:
    params = PLAIN_PRESETS["edge-feat-like"]
    assert (params.num_nodes, params.num_undirected_edges) == (2_449_029, 61_859_140)
    assert (params.edge_feature_dim, params.edge_feature_dtype) == (8, "float16")
    assert params.homophily == 0.0 and params.feature_signal == 0.0 and params.label_noise > 0
