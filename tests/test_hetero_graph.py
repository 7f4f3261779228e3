"""TypedGraphData: validation naming the field, reverse relations, homogeneous view."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from partitioner.graph import GraphDataError
from partitioner.graph import edge_type_name, parse_edge_type
from partitioner.typed import TypedGraphData
from tests.hetero_fixtures import tiny_hetero


def test_valid_graph_passes_and_reports_sizes() -> None:
    g = tiny_hetero()
    g.validate()
    assert g.node_types == ("paper", "author", "topic")
    assert g.total_nodes == 56
    assert g.num_edges() == 150
    assert g.num_edges(("paper", "cites", "paper")) == 50
    assert g.feature_dim("paper") == 4 and g.feature_dim("author") == 0
    assert g.node_offsets() == {"paper": 0, "author": 30, "topic": 50}
    assert "author/writes/paper: 60 edges" in g.summary()


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda g: g.num_nodes.update(author=0), "num_nodes['author']: expected a positive"),
        (lambda g: setattr(g, "target_type", "venue"), "target_type: expected one of"),
        (lambda g: g.edge_index.update({("paper", "in", "venue"): np.zeros((2, 1), np.int64)}),
         "expected node types among"),
        (lambda g: g.edge_index.update({("paper", "cites", "paper"): np.zeros((3, 2), np.int64)}),
         "expected shape [2, E], got [3, 2]"),
        (lambda g: g.edge_index.update({("paper", "cites", "paper"): np.zeros((2, 2), np.int32)}),
         "expected dtype int64, got int32"),
        (lambda g: g.edge_index[("author", "writes", "paper")].__setitem__((1, 0), 30),
         "expected destination IDs of 'paper' in [0, 30), got values in "),
        (lambda g: g.edge_index[("author", "writes", "paper")].__setitem__((0, 0), -1),
         "expected source IDs of 'author' in [0, 20)"),
        (lambda g: g.x.update(author=np.zeros((19, 2), np.float32)),
         "x['author']: expected shape [20, F], got [19, 2]"),
        (lambda g: g.x.update(paper=np.zeros((30, 2), np.int64)), "x['paper']: expected a float"),
        (lambda g: setattr(g, "y", np.zeros(29, np.int64)), "y: expected int64 of shape [30]"),
        (lambda g: g.y.__setitem__(0, 3), "y: expected labels in [-1, 3)"),
        (lambda g: g.splits.update(dev=np.zeros(1, np.int64)), "splits: expected names among"),
        (lambda g: g.splits.update(train=np.array([0, 0], np.int64)), "splits['train']: node IDs repeat"),
        (lambda g: g.splits.update(test=np.array([30], np.int64)),
         "splits['test']: expected 'paper' IDs in [0, 30)"),
        (lambda g: g.num_nodes.update({"a__b": 3}), "without '__'"),
    ],
)
def test_validate_names_the_bad_field(
    mutate: Callable[[TypedGraphData], object], needle: str
) -> None:
    g = tiny_hetero()
    mutate(g)
    with pytest.raises(GraphDataError) as err:
        g.validate()
    assert needle in str(err.value)


def test_edge_type_names_round_trip() -> None:
    et = ("author", "writes", "paper")
    assert parse_edge_type(edge_type_name(et)) == et
    with pytest.raises(GraphDataError, match="src__relation__dst"):
        parse_edge_type("author__writes")


def test_add_reverse_mirrors_cross_type_and_symmetrizes_same_type() -> None:
    g = tiny_hetero()
    r = g.add_reverse()
    r.validate()
    assert set(r.edge_types) == {
        ("author", "writes", "paper"), ("paper", "rev_writes", "author"),
        ("paper", "cites", "paper"), ("paper", "has_topic", "topic"),
        ("topic", "rev_has_topic", "paper"),
    }
    np.testing.assert_array_equal(r.edge_index[("paper", "rev_writes", "author")],
                                  g.edge_index[("author", "writes", "paper")][::-1])
    cites = r.edge_index[("paper", "cites", "paper")]
    pairs = set(map(tuple, cites.T.tolist()))
    original = set(map(tuple, g.edge_index[("paper", "cites", "paper")].T.tolist()))
    assert pairs == original | {(d, s) for s, d in original}
    assert len(pairs) == cites.shape[1]  # no repeats
    # A second call adds nothing.
    again = r.add_reverse()
    assert again.edge_types == r.edge_types
    assert again.num_edges() == r.num_edges()
    # The input is left as it was.
    assert len(g.edge_types) == 3


def test_homogeneous_view_offsets_every_edge() -> None:
    g = tiny_hetero()
    h = g.to_homogeneous()
    h.validate()
    off = g.node_offsets()
    assert h.num_nodes == g.total_nodes and h.num_edges == g.num_edges()
    pos = 0
    for (s, _r, d), ei in g.edge_index.items():
        e = ei.shape[1]
        np.testing.assert_array_equal(h.edge_index[0, pos:pos + e], ei[0] + off[s])
        np.testing.assert_array_equal(h.edge_index[1, pos:pos + e], ei[1] + off[d])
        pos += e
    np.testing.assert_array_equal(h.y[:30], g.y)
    assert (h.y[30:] == -1).all()
    np.testing.assert_array_equal(h.splits["train"], g.splits["train"] + off["paper"])
    assert h.feature_dim == 0
