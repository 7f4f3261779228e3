"""Synthetic typed presets: shape, ranges, time split, reproducibility, planted structure."""

from __future__ import annotations

import numpy as np
import pytest

from partitioner.typed import TypedGraphData
from partitioner.synthetic import TYPED_PRESETS, generate


@pytest.fixture(scope="module")
def small() -> TypedGraphData:
    return generate("mag-small", seed=3, progress=False)


def test_mag_small_matches_its_preset(small: TypedGraphData) -> None:
    preset = TYPED_PRESETS["mag-small"]
    small.validate()
    assert small.num_nodes == preset.num_nodes
    assert small.target_type == "paper" and small.num_classes == preset.num_classes
    assert set(small.x) == {"paper"}
    assert small.x["paper"].shape == (4000, preset.feature_dim)
    assert small.x["paper"].dtype == np.float32
    for spec in preset.relations:
        ei = small.edge_index[spec.edge_type]
        # Distinct edges, at least 97% of the target count.
        assert spec.num_edges * 0.97 <= ei.shape[1] <= spec.num_edges
        s, _, d = spec.edge_type
        assert ei.dtype == np.int64 and ei.min() >= 0
        assert ei[0].max() < small.num_nodes[s] and ei[1].max() < small.num_nodes[d]
        keys = ei[0] * small.num_nodes[d] + ei[1]
        assert np.unique(keys).size == keys.size
    cites = small.edge_index[("paper", "cites", "paper")]
    assert not (cites[0] == cites[1]).any()
    assert small.y.min() >= 0 and small.y.max() < small.num_classes


def test_time_split_sizes_and_disjointness(small: TypedGraphData) -> None:
    sizes = TYPED_PRESETS["mag-small"].split_sizes
    assert tuple(small.splits[s].size for s in ("train", "val", "test")) == sizes
    joined = np.concatenate(list(small.splits.values()))
    assert np.unique(joined).size == joined.size


def test_mag_like_preset_has_ogbn_mag_shape() -> None:
    p = TYPED_PRESETS["mag-like"]
    assert p.num_nodes == {"paper": 736_389, "author": 1_134_649, "institution": 8_740,
                           "field_of_study": 59_965}
    assert p.feature_dim == 128 and p.num_classes == 349
    assert sum(p.split_sizes) == 736_389
    edges = {spec.edge_type[1]: spec.num_edges for spec in p.relations}
    assert edges == {"writes": 7_145_660, "cites": 5_416_271, "has_topic": 7_505_078,
                     "affiliated_with": 1_043_998}


def test_same_seed_same_graph_other_seed_other_graph(small: TypedGraphData) -> None:
    again = generate("mag-small", seed=3, progress=False)
    other = generate("mag-small", seed=4, progress=False)
    for et, ei in small.edge_index.items():
        np.testing.assert_array_equal(ei, again.edge_index[et])
    np.testing.assert_array_equal(small.x["paper"], again.x["paper"])
    np.testing.assert_array_equal(small.splits["test"], again.splits["test"])
    assert not np.array_equal(small.y, other.y)


def _neighbour_vote(g: TypedGraphData) -> np.ndarray:
    """Predict each paper's class from its authors' and topics' majority training labels."""
    y, c = g.y, g.num_classes
    known = np.full(y.size, -1)
    train = g.splits["train"]
    known[train] = y[train]
    score = np.zeros((y.size, c))
    for et, other_row in ((("author", "writes", "paper"), 0),
                          (("paper", "has_topic", "field_of_study"), 1)):
        ei = g.edge_index[et]
        other, paper = ei[other_row], ei[1 - other_row]
        n_other = g.num_nodes[et[0] if other_row == 0 else et[2]]
        lab = known[paper] >= 0
        counts = np.zeros((n_other, c))
        np.add.at(counts, (other[lab], known[paper][lab]), 1)
        seen = counts.sum(1)[other] > 0
        np.add.at(score, (paper[seen], counts.argmax(1)[other[seen]]), 1)
    return score.argmax(1)


def test_labels_follow_typed_structure_more_than_features(small: TypedGraphData) -> None:
    y, test = small.y, small.splits["test"]
    majority = np.bincount(y[test]).max() / test.size
    structure = float((_neighbour_vote(small)[test] == y[test]).mean())
    train = small.splits["train"]
    x = small.x["paper"]
    cent = np.zeros((small.num_classes, x.shape[1]))
    np.add.at(cent, y[train], x[train])
    cent /= np.maximum(np.bincount(y[train], minlength=small.num_classes), 1)[:, None]
    dist = ((x[test][:, None, :] - cent[None]) ** 2).sum(-1)
    features = float((dist.argmin(1) == y[test]).mean())
    # Structure alone is far above chance; features alone only weakly informative.
    assert structure > majority + 0.35
    assert structure > features + 0.25
    assert features < majority + 0.25


def test_unknown_preset_is_refused() -> None:
    with pytest.raises(ValueError, match="preset: expected one of"):
        generate("mag-huge")
