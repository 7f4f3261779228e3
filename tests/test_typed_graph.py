"""The graph model: validation naming the field (plain GraphData and TypedGraphData),
a plain graph's one-type view, reverse relations carrying edge weights, and the
homogeneous view METIS partitions."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from graph_fixtures import tiny_typed

from partitioner.graph import (
    PLAIN_EDGE_TYPE,
    PLAIN_NODE_TYPE,
    GraphData,
    GraphDataError,
    edge_type_name,
    parse_edge_type,
    plain_view,
)
from partitioner.npyio import load_npy
from tests.graph_fixtures import AnyGraph, mixed, mixed_graph, mixed_typed

WRITES = ("author", "writes", "paper")


def test_valid_graph_passes_and_reports_sizes() -> None:
    g = tiny_typed()
    g.validate()
    assert g.node_types == ("paper", "author", "topic") and g.typed
    assert g.total_nodes == 56
    assert g.num_edges() == 150
    assert g.num_edges(("paper", "cites", "paper")) == 50
    assert g.feature_dim("paper") == 4 and g.feature_dim("author") == 0
    assert g.node_offsets() == {"paper": 0, "author": 30, "topic": 50}
    assert "author/writes/paper: 60 edges" in g.summary()


def _set(array: np.ndarray, index: Any, value: Any) -> None:
    array[index] = value


#: (kind, change, the message's needle): every malformed field is named with what was
#: expected and what was received.
BAD_FIELDS: list[tuple[str, Callable[[AnyGraph], object], str]] = [
    ("plain", lambda g: setattr(g, "num_nodes", 0), "num_nodes: expected a positive integer, got 0"),
    ("plain", lambda g: setattr(g, "edge_index", g.edge_index[:1]),
     "edge_index: expected shape [2, E], got [1,"),
    ("plain", lambda g: setattr(g, "edge_index", g.edge_index.astype(np.int32)),
     "edge_index: expected dtype int64, got int32"),
    ("plain", lambda g: _set(g.edge_index, (1, 0), 48),
     "edge_index: expected node IDs in [0, 48), got values in"),
    ("plain", lambda g: setattr(g, "x", g.x[:-1]), "x: expected shape [48, F], got [47, 6]"),
    ("plain", lambda g: setattr(g, "x", g.x.astype(np.int64)), "x: expected a float dtype, got int64"),
    ("plain", lambda g: setattr(g, "y", g.y[:-1]), "y: expected int64 of shape [48]"),
    ("plain", lambda g: _set(g.y, 0, 4), "y: expected labels in [-1, 4)"),
    ("plain", lambda g: setattr(g, "num_classes", 0), "num_classes: expected a positive integer, got 0"),
    ("plain", lambda g: g.splits.update(dev=np.zeros(1, np.int64)), "splits: expected names among"),
    ("plain", lambda g: g.splits.update(train=np.array([0, 0], np.int64)),
     "splits['train']: node IDs repeat"),
    ("plain", lambda g: g.splits.update(test=np.array([48], np.int64)),
     "splits['test']: expected node IDs in [0, 48)"),
    ("plain", lambda g: setattr(g, "edge_weight", g.edge_weight[:-1]),
     "edge_weight: expected float32 of shape ["),
    ("plain", lambda g: setattr(g, "edge_weight", -g.edge_weight), "edge_weight: expected positive weights"),
    ("typed", lambda g: g.num_nodes.update(author=0), "num_nodes['author']: expected a positive"),
    ("typed", lambda g: setattr(g, "target_type", "venue"), "target_type: expected one of"),
    ("typed", lambda g: g.edge_index.update({("paper", "in", "venue"): np.zeros((2, 1), np.int64)}),
     "expected node types among"),
    ("typed", lambda g: g.edge_index.update({("paper", "cites", "paper"): np.zeros((3, 2), np.int64)}),
     "expected shape [2, E], got [3, 2]"),
    ("typed", lambda g: g.edge_index.update({("paper", "cites", "paper"): np.zeros((2, 2), np.int32)}),
     "expected dtype int64, got int32"),
    ("typed", lambda g: _set(g.edge_index[WRITES], (1, 0), 40),
     "expected destination IDs of 'paper' in [0, 40), got values in "),
    ("typed", lambda g: _set(g.edge_index[WRITES], (0, 0), -1), "expected source IDs of 'author' in [0, 30)"),
    ("typed", lambda g: g.x.update(author=np.zeros((29, 2), np.float32)),
     "x['author']: expected shape [30, F], got [29, 2]"),
    ("typed", lambda g: g.x.update(paper=np.zeros((40, 2), np.int64)), "x['paper']: expected a float"),
    ("typed", lambda g: setattr(g, "y", np.zeros(39, np.int64)), "y: expected int64 of shape [40]"),
    ("typed", lambda g: _set(g.y, 0, 4), "y: expected labels in [-1, 4)"),
    ("typed", lambda g: g.splits.update(dev=np.zeros(1, np.int64)), "splits: expected names among"),
    ("typed", lambda g: g.splits.update(train=np.array([0, 0], np.int64)),
     "splits['train']: node IDs repeat"),
    ("typed", lambda g: g.splits.update(test=np.array([40], np.int64)),
     "splits['test']: expected 'paper' IDs in [0, 40)"),
    ("typed", lambda g: g.num_nodes.update({"a__b": 3}), "without '__'"),
    ("typed", lambda g: g.edge_weight.update({("paper", "in", "paper"): np.ones(1, np.float32)}),
     "edge_weight: expected edge types among"),
    ("typed", lambda g: g.edge_weight.update({WRITES: g.edge_weight[WRITES][:-1]}),
     "edge_weight[('author', 'writes', 'paper')]: expected float32 of shape ["),
    ("typed", lambda g: g.edge_weight.update({WRITES: g.edge_weight[WRITES].astype(np.float64)}),
     "expected float32 of shape"),
    ("typed", lambda g: _set(g.edge_weight[WRITES], 3, 0.0),
     "edge_weight[('author', 'writes', 'paper')]: expected positive weights"),
    ("plain", lambda g: setattr(g, "edge_attr", np.zeros((g.num_edges - 1, 2), np.float32)),
     "edge_attr: expected numbers of shape ["),
    ("plain", lambda g: setattr(g, "edge_attr", np.zeros((g.num_edges, 2, 2), np.float32)),
     "edge_attr: expected numbers of shape ["),
    ("plain", lambda g: setattr(g, "edge_attr", np.zeros(g.num_edges, np.complex64)),
     "edge_attr: expected numbers of shape ["),
    ("typed", lambda g: g.edge_attr.update({("paper", "in", "paper"): np.ones(1, np.float32)}),
     "edge_attr: expected edge types among"),
    ("typed", lambda g: g.edge_attr.update({WRITES: np.ones((3, 4), np.float32)}),
     "edge_attr[('author', 'writes', 'paper')]: expected numbers of shape ["),
]


@pytest.mark.parametrize(("kind", "mutate", "needle"), BAD_FIELDS,
                         ids=[f"{k}-{n[:30]}" for k, _, n in BAD_FIELDS])
def test_validate_names_the_bad_field(kind: str, mutate: Callable[[AnyGraph], object], needle: str) -> None:
    g = mixed(kind)
    g.validate()
    mutate(g)
    with pytest.raises(GraphDataError) as err:
        g.validate()
    assert needle in str(err.value)


def test_edge_type_names_round_trip() -> None:
    assert parse_edge_type(edge_type_name(WRITES)) == WRITES
    with pytest.raises(GraphDataError, match="src__relation__dst"):
        parse_edge_type("author__writes")


def test_a_plain_graph_is_the_typed_graph_of_one_type_sharing_its_arrays(tmp_path: Path) -> None:
    graph = mixed_graph()
    np.save(tmp_path / "edges.npy", graph.edge_index)
    graph.edge_index = load_npy(tmp_path / "edges.npy", mmap=True)
    view = plain_view(graph)
    view.validate()
    assert not view.typed and view.node_types == (PLAIN_NODE_TYPE,) and view.edge_types == (PLAIN_EDGE_TYPE,)
    assert view.target_type == PLAIN_NODE_TYPE and view.num_nodes == {PLAIN_NODE_TYPE: graph.num_nodes}
    assert view.edge_index[PLAIN_EDGE_TYPE] is graph.edge_index, "a memory map stays a memory map"
    assert view.x[PLAIN_NODE_TYPE] is graph.x and view.y is graph.y
    assert view.edge_weight[PLAIN_EDGE_TYPE] is graph.edge_weight
    assert view.splits == graph.splits and view.splits is not graph.splits
    assert view.num_classes == graph.num_classes and view.name == graph.name
    assert plain_view(mixed_graph(weighted=False)).edge_weight == {}


def test_add_reverse_mirrors_cross_type_and_symmetrizes_same_type() -> None:
    g = tiny_typed()
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


def test_add_reverse_carries_edge_weights() -> None:
    """A reverse relation's edges keep their weights; a same-type relation made undirected
    keeps, for each edge, the weight of its first occurrence among the edges followed by
    their reverses; a relation whose reverse is present keeps its own."""
    g = mixed_typed()
    r = g.add_reverse()
    r.validate()
    assert set(r.edge_weight) == set(r.edge_types)
    np.testing.assert_array_equal(r.edge_weight[("paper", "rev_writes", "author")], g.edge_weight[WRITES])
    for et in (WRITES, ("topic", "rev_has_topic", "paper")):
        assert r.edge_weight[et] is g.edge_weight[et]
    cites = ("paper", "cites", "paper")
    ei, w = g.edge_index[cites], g.edge_weight[cites]
    both, both_w = np.concatenate([ei, ei[::-1]], axis=1), np.concatenate([w, w])
    first: dict[tuple[int, int], float] = {}
    for (s, d), weight in zip(both.T.tolist(), both_w.tolist(), strict=True):
        first.setdefault((s, d), weight)
    kept = map(tuple, r.edge_index[cites].T.tolist())
    got = dict(zip(kept, r.edge_weight[cites].tolist(), strict=True))
    assert got == first
    assert mixed_typed(weighted=False).add_reverse().edge_weight == {}


def test_add_reverse_carries_edge_features() -> None:
    """A reverse relation's edge i copies edge i's features (PyG's ToUndirected); a
    same-type relation made undirected gives each kept edge the features of its first
    occurrence among the edges followed by their reverses; dtypes and widths are kept."""
    g = mixed_typed()
    cites = ("paper", "cites", "paper")
    g.edge_attr = {WRITES: np.arange(2 * g.num_edges(WRITES), dtype=np.int16).reshape(-1, 2),
                   cites: np.arange(g.num_edges(cites), dtype=np.float64) / 4}
    r = g.add_reverse()
    r.validate()
    assert set(r.edge_attr) == {WRITES, ("paper", "rev_writes", "author"), cites}
    assert r.edge_attr[WRITES] is g.edge_attr[WRITES]
    np.testing.assert_array_equal(r.edge_attr[("paper", "rev_writes", "author")], g.edge_attr[WRITES])
    ei, attr = g.edge_index[cites], g.edge_attr[cites]
    both = np.concatenate([ei, ei[::-1]], axis=1).T.tolist()
    first: dict[tuple[int, int], float] = {}
    for (src, dst), value in zip(both, np.concatenate([attr, attr]).tolist(), strict=True):
        first.setdefault((src, dst), value)
    kept = map(tuple, r.edge_index[cites].T.tolist())
    assert dict(zip(kept, r.edge_attr[cites].tolist(), strict=True)) == first
    assert r.edge_attr[cites].dtype == np.float64
    assert "edge author/writes/paper: " in r.summary() and "edge features [2] int16" in r.summary()


def test_plain_view_carries_edge_features() -> None:
    g = mixed_graph()
    assert plain_view(g).edge_attr == {}
    g.edge_attr = np.ones((g.num_edges, 3), np.uint8)
    assert plain_view(g).edge_attr[PLAIN_EDGE_TYPE] is g.edge_attr
    g.validate()


def test_homogeneous_view_offsets_every_edge() -> None:
    g = tiny_typed()
    h = g.to_homogeneous()
    h.validate()
    assert isinstance(h, GraphData)
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
