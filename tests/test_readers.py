"""Dataset readers, one per source, each returning the kind its input is (a plain
``GraphData`` or a ``TypedGraphData``): OGB on tiny fixtures in OGB's raw layout, npz,
PyG and graph directories."""

from __future__ import annotations

import builtins
import io
import json
import logging
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.data import Data, HeteroData

from partitioner.format import load_partition
from partitioner.graph import GraphData, GraphDataError, TypedGraphData, make_undirected, undirected_columns
from partitioner.npyio import _memmap_source
from partitioner.readers.graphdir import read_graph_dir, save_graph_dir
from partitioner.readers.npz import is_typed_npz, read_npz, write_npz
from partitioner.readers.ogb import SUPPORTED, DatasetNotFoundError, ogb_metadata, read_ogb
from partitioner.readers.pyg import from_pyg, to_pyg
from partitioner.writer import partition_graph
from tests.edge_fixtures import check_edge_data, with_edge_attr
from tests.fixtures_ogb import (
    OGB_TO_OURS,
    OgbFixture,
    write_binary_dataset,
    write_csv_dataset,
    write_mag_dataset,
)
from tests.graph_fixtures import KINDS, AnyGraph, mixed, typed_view


@pytest.fixture(autouse=True)
def _no_prompts_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any read of stdin, prompt or network connection fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"readers must not prompt or connect (called with {args})")

    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stdin", closed)
    monkeypatch.setattr(builtins, "input", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def assert_same_graph(a: AnyGraph, b: AnyGraph, *, sort_splits: bool = False, order: bool = True) -> None:
    """``a`` and ``b`` are the same graph of the same kind: node and edge types (in the
    same order unless ``order`` is off), edges and their weights and features, features
    (and their dtype), labels, classes and splits (int64; as sets with ``sort_splits``)."""
    assert type(a) is type(b)
    ta, tb = typed_view(a), typed_view(b)
    assert ta.num_nodes == tb.num_nodes and ta.target_type == tb.target_type
    if order:
        assert list(ta.num_nodes) == list(tb.num_nodes) and ta.edge_types == tb.edge_types
    assert set(ta.edge_types) == set(tb.edge_types) and set(ta.edge_weight) == set(tb.edge_weight)
    for et, ei in ta.edge_index.items():
        assert tb.edge_index[et].dtype == np.int64
        np.testing.assert_array_equal(ei, tb.edge_index[et])
    for et, w in ta.edge_weight.items():
        assert tb.edge_weight[et].dtype == np.float32
        np.testing.assert_array_equal(w, tb.edge_weight[et])
    assert set(ta.edge_attr) == set(tb.edge_attr)
    for et, attr in ta.edge_attr.items():
        assert tb.edge_attr[et].dtype == attr.dtype and tb.edge_attr[et].shape == attr.shape
        np.testing.assert_array_equal(attr, tb.edge_attr[et])
    assert set(ta.x) == set(tb.x)
    for t, x in ta.x.items():
        assert x.dtype == tb.x[t].dtype
        np.testing.assert_array_equal(x, tb.x[t])
    assert ta.num_classes == tb.num_classes and tb.y.dtype == np.int64
    np.testing.assert_array_equal(ta.y, tb.y)
    assert set(ta.splits) == set(tb.splits)
    for split, ids in ta.splits.items():
        assert tb.splits[split].dtype == np.int64
        np.testing.assert_array_equal(np.sort(ids) if sort_splits else ids, tb.splits[split])


def _files_under(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def _edge_set(edge_index: np.ndarray) -> set[tuple[int, int]]:
    return {(int(s), int(d)) for s, d in edge_index.T}


def _assert_nodes_match(graph: GraphData | TypedGraphData, fixture: OgbFixture) -> None:
    assert isinstance(graph, GraphData)
    assert graph.name == fixture.name and graph.num_nodes == fixture.num_nodes
    assert graph.x.dtype == np.float32 and graph.y.dtype == np.int64
    np.testing.assert_array_equal(graph.x, fixture.x)
    np.testing.assert_array_equal(graph.y, fixture.y)
    assert set(graph.splits) == {"train", "val", "test"}
    for ogb_split, ids in fixture.splits.items():
        np.testing.assert_array_equal(graph.splits[OGB_TO_OURS[ogb_split]], ids)


# --- OGB --------------------------------------------------------------------------------


def test_products_mirrors_edges_like_ogb(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fixture = write_csv_dataset(tmp_path, "ogbn-products")
    before = _files_under(tmp_path)
    graph = read_ogb("ogbn-products", tmp_path)
    assert isinstance(graph, GraphData)
    written = fixture.edge_index
    expected = np.empty((2, 2 * written.shape[1]), dtype=np.int64)  # ogb interleaves (s,d),(d,s)
    expected[:, 0::2] = written
    expected[:, 1::2] = written[::-1]
    np.testing.assert_array_equal(graph.edge_index, expected)
    assert graph.num_classes == 47
    _assert_nodes_match(graph, fixture)
    assert _files_under(tmp_path) == before, "read_ogb must not write under root"
    assert capsys.readouterr().out == "", "ogb's prints must go to logging, not stdout"


def _first_occurrence_features(edge_index: np.ndarray,
                               feats: np.ndarray) -> dict[tuple[int, int], list[float]]:
    """Each edge of ``edge_index`` or of its reverse to the features of its first
    occurrence among the edges followed by their reverses."""
    both = np.concatenate([edge_index, edge_index[::-1]], axis=1)
    first: dict[tuple[int, int], list[float]] = {}
    for (src, dst), row in zip(both.T.tolist(), np.concatenate([feats, feats]).tolist(), strict=True):
        first.setdefault((src, dst), row)
    return first


def test_products_edge_features_follow_ogb_s_mirrored_edges(tmp_path: Path) -> None:
    """``raw/edge-feat.csv.gz`` (8 per edge, as ogbn-proteins): edge 2i is the stored edge
    i and 2i+1 its reverse, both with its features; partitioned, every in-edge's e_id and
    edge_attr are those edges'."""
    fixture = write_csv_dataset(tmp_path, "ogbn-products", edge_feat_dim=8)
    graph = read_ogb("ogbn-products", tmp_path)
    assert isinstance(graph, GraphData) and graph.edge_attr is not None and fixture.edge_feat is not None
    assert graph.edge_attr.shape == (2 * fixture.edge_index.shape[1], 8)
    assert graph.edge_attr.dtype == np.float32
    np.testing.assert_array_equal(graph.edge_attr[0::2], fixture.edge_feat)
    np.testing.assert_array_equal(graph.edge_attr[1::2], fixture.edge_feat)
    partition_graph(graph, 2, tmp_path / "parts", method="random", progress=False)
    check_edge_data(graph, [load_partition(tmp_path / "parts", p) for p in range(2)])


def test_arxiv_to_undirected_keeps_each_edge_s_features(tmp_path: Path) -> None:
    fixture = write_csv_dataset(tmp_path, "ogbn-arxiv", edge_feat_dim=3)
    directed = read_ogb("ogbn-arxiv", tmp_path)
    assert isinstance(directed, GraphData) and fixture.edge_feat is not None
    np.testing.assert_array_equal(directed.edge_attr, fixture.edge_feat)
    graph = read_ogb("ogbn-arxiv", tmp_path, to_undirected=True)
    assert isinstance(graph, GraphData) and graph.edge_attr is not None
    np.testing.assert_array_equal(graph.edge_index, make_undirected(fixture.edge_index, fixture.num_nodes)[0])
    first = _first_occurrence_features(fixture.edge_index, fixture.edge_feat)
    assert {(s, d): row for (s, d), row in zip(graph.edge_index.T.tolist(), graph.edge_attr.tolist(),
                                                strict=True)} == first


def test_papers100m_edge_features_from_data_npz(tmp_path: Path) -> None:
    fixture = write_binary_dataset(tmp_path, edge_feat_dim=2)
    graph = read_ogb("ogbn-papers100M", tmp_path)
    assert isinstance(graph, GraphData)
    np.testing.assert_array_equal(graph.edge_attr, fixture.edge_feat)
    assert write_binary_dataset(tmp_path / "none").edge_feat is None
    assert read_ogb("ogbn-papers100M", tmp_path / "none").edge_attr is None  # type: ignore[union-attr]


def test_mag_edge_features_of_a_relation(tmp_path: Path) -> None:
    """``relations/paper___cites___paper/edge-feat.csv.gz``: that relation's edge_attr in
    the typed read and in the papers-only view; other relations have none."""
    fixture = write_mag_dataset(tmp_path, edge_feat_dim=4)
    assert fixture.typed is not None
    typed = read_ogb("ogbn-mag", tmp_path)
    assert_same_graph(fixture.typed, typed, order=False)
    assert set(typed.edge_attr) == {("paper", "cites", "paper")}  # type: ignore[union-attr]
    papers = read_ogb("ogbn-mag", tmp_path, papers_only=True)
    np.testing.assert_array_equal(papers.edge_attr, fixture.edge_feat)  # type: ignore[union-attr]


def test_arxiv_keeps_directed_edges(tmp_path: Path) -> None:
    fixture = write_csv_dataset(tmp_path, "ogbn-arxiv")
    graph = read_ogb("ogbn-arxiv", tmp_path)
    assert isinstance(graph, GraphData)
    np.testing.assert_array_equal(graph.edge_index, fixture.edge_index)
    assert graph.edge_index.flags.c_contiguous and graph.num_classes == 40
    _assert_nodes_match(graph, fixture)


def test_arxiv_to_undirected(tmp_path: Path) -> None:
    fixture = write_csv_dataset(tmp_path, "ogbn-arxiv")
    graph = read_ogb("ogbn-arxiv", tmp_path, to_undirected=True)
    assert isinstance(graph, GraphData)
    edges = _edge_set(graph.edge_index)
    assert edges == _edge_set(fixture.edge_index) | _edge_set(fixture.edge_index[::-1])
    assert graph.num_edges == len(edges), "duplicate edges must be removed"
    _assert_nodes_match(graph, fixture)


def test_papers100m_binary_with_nan_labels(tmp_path: Path) -> None:
    fixture = write_binary_dataset(tmp_path)
    graph = read_ogb("ogbn-papers100M", tmp_path)
    assert isinstance(graph, GraphData)
    np.testing.assert_array_equal(graph.edge_index, fixture.edge_index)
    assert graph.num_classes == 172 and (graph.y == -1).sum() == 3
    _assert_nodes_match(graph, fixture)


def test_mag_is_read_typed_with_every_type_and_relation(tmp_path: Path) -> None:
    fixture = write_mag_dataset(tmp_path)
    before = _files_under(tmp_path)
    graph = read_ogb("ogbn-mag", tmp_path)
    assert isinstance(graph, TypedGraphData) and fixture.typed is not None
    assert graph.node_types[0] == "paper"  # the target type first
    assert_same_graph(fixture.typed, graph, order=False)
    assert graph.num_classes == 349 and set(graph.x) == {"paper"}
    assert _files_under(tmp_path) == before


def test_mag_papers_only_takes_paper_cites_paper(tmp_path: Path) -> None:
    fixture = write_mag_dataset(tmp_path)
    graph = read_ogb("ogbn-mag", tmp_path, papers_only=True)
    np.testing.assert_array_equal(graph.edge_index, fixture.edge_index)  # type: ignore[arg-type]
    assert graph.num_classes == 349
    _assert_nodes_match(graph, fixture)
    undirected = read_ogb("ogbn-mag", tmp_path, papers_only=True, to_undirected=True)
    assert isinstance(undirected, GraphData)
    both_ways = _edge_set(fixture.edge_index) | _edge_set(fixture.edge_index[::-1])
    assert _edge_set(undirected.edge_index) == both_ways
    with pytest.raises(GraphDataError, match=r"to_undirected: for plain graphs; ogbn-mag is typed"):
        read_ogb("ogbn-mag", tmp_path, to_undirected=True)


@pytest.mark.parametrize(("write", "name", "zip_folder"), [
    (write_binary_dataset, "OGBN_PAPERS100M", "papers100M-bin"),
    (write_mag_dataset, "Ogbn_Mag", "mag"),
])
def test_zip_folder_name_accepted_and_names_forgiven(
    tmp_path: Path, write: Callable[[Path], OgbFixture], name: str, zip_folder: str
) -> None:
    fixture = write(tmp_path)
    fixture.path.rename(tmp_path / zip_folder)
    graph = read_ogb(name, tmp_path)
    assert graph.name == fixture.name
    np.testing.assert_array_equal(graph.y, fixture.y)


def test_missing_release_file_only_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fixture = write_mag_dataset(tmp_path)
    (fixture.path / "RELEASE_v2.txt").unlink()
    with caplog.at_level(logging.WARNING, logger="partitioner.readers.ogb"):
        read_ogb("ogbn-mag", tmp_path)
    assert "RELEASE_v2.txt" in caplog.text


@pytest.mark.parametrize("name", SUPPORTED)
def test_missing_dataset_fails_fast_with_instructions(tmp_path: Path, name: str) -> None:
    meta = ogb_metadata(name)
    start = time.perf_counter()
    with pytest.raises(DatasetNotFoundError) as info:
        read_ogb(name, tmp_path)
    assert time.perf_counter() - start < 10.0
    message = str(info.value)
    ds_dir = tmp_path / meta.dir_name
    first = "num-node-dict.csv.gz" if meta.typed else "edge.csv.gz"
    first = "data.npz" if meta.binary else first
    assert f"{name} not found" in message
    assert str(ds_dir / "raw" / first) in message
    assert meta.url in message and meta.url.startswith("http")
    assert isinstance(info.value, FileNotFoundError)
    assert list(tmp_path.iterdir()) == []


def test_incomplete_copy_names_only_missing_file(tmp_path: Path) -> None:
    fixture = write_csv_dataset(tmp_path, "ogbn-products")
    missing = fixture.path / "split" / "sales_ranking" / "valid.csv.gz"
    missing.unlink()
    with pytest.raises(DatasetNotFoundError) as info:
        read_ogb("ogbn-products", tmp_path)
    listed = [line.strip() for line in str(info.value).splitlines() if line.startswith("  ")]
    assert listed == [str(missing)]


@pytest.mark.parametrize("papers_only", [False, True])
def test_mag_relation_without_its_files_is_named(tmp_path: Path, papers_only: bool) -> None:
    fixture = write_mag_dataset(tmp_path)
    rel = fixture.path / "raw" / "relations" / "paper___has_topic___field_of_study"
    (rel / "edge.csv.gz").unlink()
    with pytest.raises(GraphDataError, match=r"paper___has_topic___field_of_study/edge\.csv\.gz"):
        read_ogb("ogbn-mag", tmp_path, papers_only=papers_only)


def test_pickled_split_dict_is_refused(tmp_path: Path) -> None:
    fixture = write_binary_dataset(tmp_path)
    split_dir = fixture.path / "split" / "time"
    for path in split_dir.glob("*.csv.gz"):
        path.unlink()
    (split_dir / "split_dict.pt").write_bytes(b"not to be opened")
    with pytest.raises(DatasetNotFoundError, match=r"split_dict\.pt") as info:
        read_ogb("ogbn-papers100M", tmp_path)
    assert "pickle" in str(info.value)
    assert str(split_dir / "train.csv.gz") in str(info.value)


def test_unknown_and_unsupported_names(tmp_path: Path) -> None:
    with pytest.raises(GraphDataError) as info:
        read_ogb("ogbn-foo", tmp_path)
    assert "'ogbn-foo'" in str(info.value)
    assert all(name in str(info.value) for name in SUPPORTED)
    with pytest.raises(GraphDataError, match="multi-label"):
        read_ogb("ogbn-proteins", tmp_path)


def test_make_undirected() -> None:
    edges = np.array([[0, 1, 1, 2, 3], [1, 0, 0, 2, 1]], dtype=np.int64)
    out, kept = make_undirected(edges, 4)
    np.testing.assert_array_equal(out, [[0, 1, 1, 2, 3], [1, 0, 3, 2, 1]])
    assert out.dtype == np.int64 and kept is None
    # with weights: each kept edge its first occurrence's weight, a reverse its edge's
    _, kept = make_undirected(edges, 4, np.array([1, 2, 3, 4, 5], dtype=np.float32))
    np.testing.assert_array_equal(kept, [1, 2, 5, 4, 5])
    # the input column of each kept edge, for any per-edge array (edge features)
    same, columns = undirected_columns(edges, 4)
    np.testing.assert_array_equal(same, out)
    np.testing.assert_array_equal(columns, [0, 1, 4, 3, 4])
    empty, none = undirected_columns(np.empty((2, 0), dtype=np.int64), 4)
    assert empty.shape == (2, 0) and none.size == 0


def test_fixture_copies_are_independent(tmp_path: Path) -> None:
    """Fixtures written twice into separate roots read identically (no hidden cache)."""
    first = write_csv_dataset(tmp_path / "a", "ogbn-arxiv")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (first.path / "raw" / "edge.csv.gz").unlink()
    graph = read_ogb("ogbn-arxiv", tmp_path / "b")
    np.testing.assert_array_equal(graph.edge_index, first.edge_index)  # type: ignore[arg-type]
    with pytest.raises(DatasetNotFoundError):
        read_ogb("ogbn-arxiv", tmp_path / "a")


# --- npz --------------------------------------------------------------------------------


def _arrays(graph: AnyGraph, tmp_path: Path) -> dict[str, np.ndarray]:
    """What ``write_npz`` writes, read back as a dict of arrays."""
    write_npz(graph, tmp_path / "source.npz")
    with np.load(tmp_path / "source.npz", allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


#: The archive key of each role, per kind.
KEYS = {"plain": {"edge_index": "edge_index", "x": "x", "y": "y", "edge_weight": "edge_weight",
                  "edge_attr": "edge_attr"},
        "typed": {"edge_index": "edge_index__author__writes__paper", "x": "x__paper", "y": "y__paper",
                  "edge_weight": "edge_weight__author__writes__paper",
                  "edge_attr": "edge_attr__author__writes__paper"}}


def _save(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_npz_round_trip(tmp_path: Path, kind: str, compress: bool) -> None:
    graph = with_edge_attr(mixed(kind))
    path = tmp_path / "g.graph"
    write_npz(graph, path, compress=compress)
    assert path.is_file() and is_typed_npz(path) == (kind == "typed")
    back = read_npz(path, name=graph.name)
    assert_same_graph(graph, back)
    assert back.name == graph.name and read_npz(path).name == "g"


@pytest.mark.parametrize("kind", KINDS)
def test_npz_with_masks_column_labels_and_defaults(tmp_path: Path, kind: str) -> None:
    graph = mixed(kind, weighted=False)
    arrays = {k: v for k, v in _arrays(graph, tmp_path).items()
              if not k.endswith("_idx") and k not in ("num_classes", "num_nodes")}
    n = typed_view(graph).num_nodes[typed_view(graph).target_type]
    for split, ids in graph.splits.items():
        arrays[f"{split}_mask"] = np.zeros(n, dtype=bool)
        arrays[f"{split}_mask"][ids] = True
    arrays[KEYS[kind]["y"]] = arrays[KEYS[kind]["y"]][:, None]
    read = read_npz(_save(tmp_path / "masked.npz", arrays))
    assert read.name == "masked" and read.num_classes == int(graph.y.max()) + 1
    graph.num_classes = read.num_classes
    assert_same_graph(graph, read, sort_splits=True)


@pytest.mark.parametrize("kind", KINDS)
def test_npz_ogb_valid_idx_is_the_val_split_and_empty_splits_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    graph = mixed(kind)
    arrays = {k: v for k, v in _arrays(graph, tmp_path).items() if not k.endswith("_idx")}
    arrays["valid_idx"] = graph.splits["val"]
    read = read_npz(_save(tmp_path / "ogb-style.npz", arrays))
    np.testing.assert_array_equal(read.splits["val"], graph.splits["val"])
    assert "train" not in read.splits and "ignoring keys" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="partitioner.writer"):
        partition_graph(read, 1, tmp_path / "parts", method="range", progress=False)
    assert "the 'train' split is empty; graphfeed-train needs train and val nodes" in caplog.text
    assert "the 'test' split is empty" in caplog.text and "the 'val' split is empty" not in caplog.text


@pytest.mark.parametrize("kind", KINDS)
def test_npz_edge_list_orientation(tmp_path: Path, kind: str) -> None:
    graph = mixed(kind)
    arrays = _arrays(graph, tmp_path)
    key = KEYS[kind]["edge_index"]
    arrays[key] = arrays[key].T.astype(np.int32)
    assert_same_graph(graph, read_npz(_save(tmp_path / "edges.npz", arrays), name=graph.name))


@pytest.mark.parametrize("kind", KINDS)
def test_npz_missing_key_names_it(tmp_path: Path, kind: str) -> None:
    arrays = _arrays(mixed(kind), tmp_path)
    del arrays[KEYS[kind]["y"]]
    path = _save(tmp_path / "noy.npz", arrays)
    with pytest.raises(GraphDataError) as info:
        read_npz(path)
    message = str(info.value)
    assert str(path) in message
    assert ("missing required key 'y'" if kind == "plain" else "expected exactly one y__<type> key") \
        in message
    assert f"the file has the keys {sorted(arrays)}" in message  # every key, to spot a misnamed one


#: Corruptions of one role's array (:data:`KEYS`) and the message that must name them.
MALFORMED: list[tuple[str, Callable[[np.ndarray], np.ndarray | None], str]] = [
    ("x", lambda x: x.astype(np.int64), "expected float16, float32 or float64, got int64"),
    ("edge_index", lambda e: np.zeros((3, 4), dtype=np.int64), "expected shape [2, E] or [E, 2]"),
    ("edge_index", lambda e: e.astype(np.float32), "expected an integer dtype"),
    ("y", lambda y: np.array([None] * y.size, dtype=object), "pickle"),
    ("y", lambda y: y + 0.5, "expected whole-number labels (or NaN"),
    ("y", lambda y: np.full(y.size, np.inf), "expected whole-number labels"),
    ("y", lambda y: np.ones(y.size, dtype=bool), "expected integer labels"),
    ("y", lambda y: y[:-1], "y: expected int64 of shape"),
    ("edge_weight", lambda w: w[:-1], "expected ["),
    ("edge_weight", lambda w: -w, "expected positive weights"),
    ("edge_attr", lambda a: a[:-1], "one row per edge"),
    ("edge_attr", lambda a: a.reshape(a.shape[0], 1, -1), "expected numbers of shape"),
    ("edge_attr", lambda a: a.astype(np.complex64), "expected numbers of shape"),
]


@pytest.mark.parametrize(("role", "change", "needle"), MALFORMED, ids=[m[2][:24] for m in MALFORMED])
@pytest.mark.parametrize("kind", KINDS)
def test_npz_malformed_array_is_refused_naming_it(
    tmp_path: Path, kind: str, role: str, change: Callable[[np.ndarray], np.ndarray], needle: str
) -> None:
    arrays = _arrays(with_edge_attr(mixed(kind)), tmp_path)
    key = KEYS[kind][role]
    arrays[key] = change(arrays[key])
    with pytest.raises(GraphDataError) as info:
        read_npz(_save(tmp_path / "bad.npz", arrays))
    assert needle in str(info.value) and role in str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_npz_split_given_twice_is_refused(tmp_path: Path, kind: str) -> None:
    arrays = _arrays(mixed(kind), tmp_path)
    arrays["train_mask"] = np.ones(typed_view(mixed(kind)).y.size, dtype=bool)
    with pytest.raises(GraphDataError, match="expected train_idx or train_mask, got both"):
        read_npz(_save(tmp_path / "bad.npz", arrays))


@pytest.mark.parametrize(
    ("arrays", "needle"),
    [
        ({"edge_index__a__r__b": np.zeros((2, 1), np.int64)}, "expected num_nodes__<type> keys"),
        ({"num_nodes__a": 2, "edge_index__a__r__a": np.zeros((2, 1), np.int64)},
         "expected exactly one y__<type> key"),
        ({"num_nodes__a": 2, "edge_index__a__r__a": np.zeros((2, 1), np.int64),
          "y__b": np.zeros(2, np.int64)}, "y__b: expected a node type among ['a']"),
        ({"num_nodes__a": 2, "edge_index__a__r__b": np.zeros((2, 1), np.int64),
          "y__a": np.zeros(2, np.int64)}, "expected node types among"),
        ({"num_nodes__a": 2, "edge_index__a__r": np.zeros((2, 1), np.int64),
          "y__a": np.zeros(2, np.int64)}, "edge_index__a__r: edge type: expected 'src__relation__dst'"),
        ({"num_nodes__a": 2, "edge_index__a__r__a": np.zeros((2, 1), np.int64),
          "y__a": np.zeros(2, np.int64), "edge_weight__a__s__a": np.ones(1)},
         "edge_weight__a__s__a: expected a relation with an edge_index"),
        ({"num_nodes__a": 2, "edge_index__a__r__a": np.zeros((2, 1), np.int64),
          "y__a": np.zeros(2, np.int64), "edge_attr__a__s__a": np.ones((1, 3))},
         "edge_attr__a__s__a: expected a relation with an edge_index"),
    ],
)
def test_typed_npz_structure_errors_name_the_key(
    tmp_path: Path, arrays: dict[str, np.ndarray], needle: str
) -> None:
    with pytest.raises(GraphDataError) as err:
        read_npz(_save(tmp_path / "bad.npz", arrays))
    assert needle in str(err.value)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", KINDS)
def test_npz_float_labels_with_nan_for_unlabeled(tmp_path: Path, kind: str, dtype: type) -> None:
    """Labels as OGB stores papers100M's: floats, NaN for unlabeled nodes."""
    graph = mixed(kind)
    arrays = _arrays(graph, tmp_path)
    arrays.pop("num_classes")
    arrays[KEYS[kind]["y"]] = np.where(graph.y < 0, np.nan, graph.y).astype(dtype)[:, None]
    got = read_npz(_save(tmp_path / "float-y.npz", arrays))
    assert got.y.dtype == np.int64 and np.array_equal(got.y, graph.y)
    assert got.num_classes == int(graph.y.max()) + 1


def test_npz_unknown_keys_are_ignored_with_a_warning(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    arrays = {**_arrays(mixed("typed"), tmp_path), "edge_index": np.zeros((2, 1), np.int64),
              "z__paper": np.zeros(1)}
    with caplog.at_level(logging.WARNING, logger="partitioner.readers.npz"):
        read_npz(_save(tmp_path / "extra.npz", arrays))
    assert "ignoring keys graphfeed does not read: ['edge_index', 'z__paper']" in caplog.text


# --- PyG --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_pyg_round_trip(kind: str) -> None:
    graph = with_edge_attr(mixed(kind))
    data = to_pyg(graph)
    assert isinstance(data, Data if kind == "plain" else HeteroData)
    target = data if kind == "plain" else data["paper"]
    assert target.train_mask.dtype == torch.bool
    assert int(target.train_mask.sum()) == graph.splits["train"].size
    assert_same_graph(graph, from_pyg(data, name=graph.name), sort_splits=True)


def _by_hand(kind: str, dtype: torch.dtype) -> Data | HeteroData:
    """A graph built in PyG directly: int32 edges, ``[N, 1]`` labels, ``*_idx`` splits and
    a 1-D float64 ``edge_attr`` as the edge weights."""
    edges = {"edge_index": torch.tensor([[0, 1, 2, 5], [1, 2, 3, 0]], dtype=torch.int32),
             "edge_attr": torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64)}
    nodes = {"x": torch.arange(12, dtype=dtype).view(6, 2),
             "y": torch.tensor([[0], [2], [1], [-1], [1], [0]]), "train_idx": torch.tensor([0, 1]),
             "val_idx": torch.tensor([2]), "test_idx": torch.tensor([4, 5])}
    if kind == "plain":
        return Data(**nodes, **edges)
    data = HeteroData()
    for key, value in nodes.items():
        data["paper"][key] = value
    data["author"].num_nodes = 3
    for key, value in edges.items():
        data["paper", "cites", "paper"][key] = value
    data["author", "writes", "paper"].edge_index = torch.tensor([[0, 2], [5, 5]])
    return data


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
@pytest.mark.parametrize("kind", KINDS)
def test_from_pyg_idx_column_labels_and_edge_attr(kind: str, dtype: torch.dtype) -> None:
    graph = typed_view(from_pyg(_by_hand(kind, dtype)))
    assert graph.x[graph.target_type].dtype == torch.empty(0, dtype=dtype).numpy().dtype
    np.testing.assert_array_equal(graph.y, [0, 2, 1, -1, 1, 0])
    assert graph.num_classes == 3
    np.testing.assert_array_equal(graph.splits["test"], [4, 5])
    assert len(graph.edge_weight) == 1, "weights only where the source has them"
    (weight,) = graph.edge_weight.values()
    assert weight.dtype == np.float32
    np.testing.assert_array_equal(weight, [1.0, 2.0, 0.5, 3.0])
    assert from_pyg(_by_hand(kind, dtype), num_classes=10).num_classes == 10


@pytest.mark.parametrize("kind", KINDS)
def test_from_pyg_edge_attr_of_any_width_is_edge_features(kind: str) -> None:
    """``edge_attr`` ``[E, F]`` (int, bool, bfloat16 -> float32) becomes edge_attr and not a
    weight; a 1-D one is a weight only when every value is positive; a wrong shape is
    refused naming the store."""
    data = _by_hand(kind, torch.float32)
    store = data if kind == "plain" else data["paper", "cites", "paper"]
    field = r"data\." if kind == "plain" else r"data\[\('paper', 'cites', 'paper'\)\]\."
    cases = [(torch.arange(8).view(4, 2), np.int64), (torch.ones(4, 3, dtype=torch.bool), np.bool_),
             (torch.ones(4, 5, dtype=torch.bfloat16), np.float32)]
    for attr, dtype in cases:
        store.edge_attr = attr
        graph = typed_view(from_pyg(data))
        (got,) = graph.edge_attr.values()
        assert got.dtype == dtype and got.shape == tuple(attr.shape) and graph.edge_weight == {}
    store.edge_attr = torch.tensor([1.0, -2.0, 0.0, 3.0])
    graph = typed_view(from_pyg(data))
    assert graph.edge_weight == {} and next(iter(graph.edge_attr.values())).tolist() == [1.0, -2.0, 0.0, 3.0]
    store.edge_attr = torch.ones(3, 2)
    with pytest.raises(GraphDataError, match=field + r"edge_attr: expected numbers of shape \[4\] or \[4,"):
        from_pyg(data)


def test_from_pyg_errors() -> None:
    with pytest.raises(GraphDataError, match=r"expected a torch_geometric\.data\.Data or HeteroData, got"):
        from_pyg({})  # type: ignore[arg-type]
    no_x = Data(edge_index=torch.tensor([[0], [1]]), y=torch.tensor([0, 1]), num_nodes=2)
    with pytest.raises(GraphDataError, match=r"data\.x: expected a tensor.*edge_index"):
        from_pyg(no_x)
    with pytest.raises(GraphDataError, match="target_type: only for a HeteroData"):
        from_pyg(_by_hand("plain", torch.float32), target_type="paper")
    data = to_pyg(mixed("typed"))
    data["author"].y = torch.zeros(30, dtype=torch.long)
    with pytest.raises(GraphDataError, match="expected one node type with y"):
        from_pyg(data)
    assert from_pyg(data, target_type="paper").target_type == "paper"
    with pytest.raises(GraphDataError, match=r"data\['topic'\]\.y: expected labels, got none"):
        from_pyg(data, target_type="topic")
    data["paper", "cites", "paper"].edge_weight = torch.ones(3)
    weights = r"data\[\('paper', 'cites', 'paper'\)\]\.edge_weight: expected \[1\d\d\] edge weights"
    with pytest.raises(GraphDataError, match=weights):
        from_pyg(data, target_type="paper")


@pytest.mark.parametrize("kind", KINDS)
def test_from_pyg_refuses_bad_labels_and_features_naming_the_store(kind: str) -> None:
    data = to_pyg(mixed(kind))
    store, field = (data, r"data\.") if kind == "plain" else (data["paper"], r"data\['paper'\]\.")
    y = store.y
    store.y = y + 0.5
    with pytest.raises(GraphDataError, match=field + "y: expected whole-number labels"):
        from_pyg(data)
    store.y = y
    store.x = store.x.long()
    with pytest.raises(GraphDataError, match=field + "x: expected float16, float32 or float64"):
        from_pyg(data)


@pytest.mark.parametrize("kind", KINDS)
def test_from_pyg_float_labels_with_nan_for_unlabeled(kind: str) -> None:
    """Labels as PyG's OGB datasets may hold them: float, NaN for unlabeled nodes."""
    graph = mixed(kind)
    data = to_pyg(graph)
    store = data if kind == "plain" else data["paper"]
    store.y = torch.where(store.y < 0, torch.nan, store.y.double()).float()[:, None]
    got = from_pyg(data)
    assert got.y.dtype == np.int64 and np.array_equal(got.y, graph.y)


# --- graph directories ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_graph_dir_round_trips_memory_mapped(tmp_path: Path, kind: str) -> None:
    graph = with_edge_attr(mixed(kind))
    save_graph_dir(graph, tmp_path / "g")
    mapped = read_graph_dir(tmp_path / "g")
    assert_same_graph(graph, mapped)
    typed = typed_view(mapped)
    arrays = [*typed.edge_index.values(), *typed.edge_weight.values(), *typed.edge_attr.values(),
              *typed.x.values(), typed.y]
    assert all(_memmap_source(a) is not None and not a.flags.writeable for a in arrays)
    assert_same_graph(graph, read_graph_dir(tmp_path / "g", mmap=False))


@pytest.mark.parametrize("kind", KINDS)
def test_graph_dir_missing_file_or_key_is_named(tmp_path: Path, kind: str) -> None:
    graph = mixed(kind)
    root = save_graph_dir(graph, tmp_path / "g")
    (root / "val_idx.npy").rename(root / "valid_idx.npy")  # OGB's name
    np.testing.assert_array_equal(read_graph_dir(root).splits["val"], graph.splits["val"])
    edges = root / ("edge_index.npy" if kind == "plain" else "edge_index/author__writes__paper.npy")
    edges.unlink()
    with pytest.raises(GraphDataError, match=re.escape(f"{edges}: missing from the graph directory")):
        read_graph_dir(root)
    meta = json.loads((root / "graph.json").read_text())
    del meta["num_classes"]
    (root / "graph.json").write_text(json.dumps(meta))
    with pytest.raises(GraphDataError, match=r"graph\.json: expected the key 'num_classes'"):
        read_graph_dir(root)
    with pytest.raises(FileNotFoundError, match=r"graph\.json: not found"):
        read_graph_dir(tmp_path)
