"""Dataset readers: OGB (on tiny fixtures in OGB's raw layout), npz and PyG."""

from __future__ import annotations

import builtins
import io
import logging
import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures_ogb import (
    OgbFixture,
    write_binary_dataset,
    write_csv_dataset,
    write_mag_dataset,
)
from torch_geometric.data import Data, HeteroData

from partitioner.graph import GraphData, GraphDataError
from partitioner.readers.npz import read_npz, write_npz
from partitioner.readers.ogb import (
    SUPPORTED,
    DatasetNotFoundError,
    make_undirected,
    ogb_metadata,
    read_ogb,
)
from partitioner.readers.pyg import from_pyg, to_pyg

OGB_TO_OURS = {"train": "train", "valid": "val", "test": "test"}


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


def _files_under(root: Path) -> set[Path]:
    return {path for path in root.rglob("*")}


def _edge_set(edge_index: np.ndarray) -> set[tuple[int, int]]:
    return {(int(s), int(d)) for s, d in edge_index.T}


def _assert_nodes_match(graph: GraphData, fixture: OgbFixture) -> None:
    assert graph.name == fixture.name
    assert graph.num_nodes == fixture.num_nodes
    assert graph.x.dtype == np.float32
    np.testing.assert_array_equal(graph.x, fixture.x)
    assert graph.y.dtype == np.int64
    np.testing.assert_array_equal(graph.y, fixture.y)
    assert set(graph.splits) == {"train", "val", "test"}
    for ogb_split, ids in fixture.splits.items():
        np.testing.assert_array_equal(graph.splits[OGB_TO_OURS[ogb_split]], ids)


# --- OGB --------------------------------------------------------------------------------


def test_products_mirrors_edges_like_ogb(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fixture = write_csv_dataset(tmp_path, "ogbn-products")
    before = _files_under(tmp_path)
    graph = read_ogb("ogbn-products", tmp_path)
    written = fixture.edge_index
    expected = np.empty((2, 2 * written.shape[1]), dtype=np.int64)  # ogb interleaves (s,d),(d,s)
    expected[:, 0::2] = written
    expected[:, 1::2] = written[::-1]
    np.testing.assert_array_equal(graph.edge_index, expected)
    assert _edge_set(written[::-1]) <= _edge_set(graph.edge_index)
    assert graph.num_classes == 47
    _assert_nodes_match(graph, fixture)
    assert _files_under(tmp_path) == before, "read_ogb must not write under root"
    assert capsys.readouterr().out == "", "ogb's prints must go to logging, not stdout"


def test_arxiv_keeps_directed_edges(tmp_path: Path) -> None:
    fixture = write_csv_dataset(tmp_path, "ogbn-arxiv")
    graph = read_ogb("ogbn-arxiv", tmp_path)
    np.testing.assert_array_equal(graph.edge_index, fixture.edge_index)
    assert graph.edge_index.flags.c_contiguous
    assert graph.num_classes == 40
    _assert_nodes_match(graph, fixture)


def test_arxiv_to_undirected(tmp_path: Path) -> None:
    fixture = write_csv_dataset(tmp_path, "ogbn-arxiv")
    graph = read_ogb("ogbn-arxiv", tmp_path, to_undirected=True)
    edges = _edge_set(graph.edge_index)
    assert edges == _edge_set(fixture.edge_index) | _edge_set(fixture.edge_index[::-1])
    assert graph.num_edges == len(edges), "duplicate edges must be removed"
    _assert_nodes_match(graph, fixture)


def test_papers100m_binary_with_nan_labels(tmp_path: Path) -> None:
    fixture = write_binary_dataset(tmp_path)
    graph = read_ogb("ogbn-papers100M", tmp_path)
    np.testing.assert_array_equal(graph.edge_index, fixture.edge_index)
    assert graph.num_classes == 172
    assert (graph.y == -1).sum() == 3
    _assert_nodes_match(graph, fixture)


def test_mag_takes_paper_cites_paper(tmp_path: Path) -> None:
    fixture = write_mag_dataset(tmp_path)
    graph = read_ogb("ogbn-mag", tmp_path)
    np.testing.assert_array_equal(graph.edge_index, fixture.edge_index)
    assert graph.num_classes == 349
    _assert_nodes_match(graph, fixture)


def test_zip_folder_name_accepted_and_names_forgiven(tmp_path: Path) -> None:
    fixture = write_binary_dataset(tmp_path)
    fixture.path.rename(tmp_path / "papers100M-bin")
    graph = read_ogb("OGBN_PAPERS100M", tmp_path)
    assert graph.name == "ogbn-papers100M"
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
    first = "num-node-dict.csv.gz" if meta.is_hetero else "edge.csv.gz"
    first = "data.npz" if meta.binary else first
    assert f"{name} not found" in message
    assert str(ds_dir / "raw" / first) in message
    assert meta.url in message and meta.url.startswith("http")
    assert str(ds_dir / "raw") in message
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
    out = make_undirected(edges, 4)
    np.testing.assert_array_equal(out, [[0, 1, 1, 2, 3], [1, 0, 3, 2, 1]])
    assert out.dtype == np.int64


# --- npz --------------------------------------------------------------------------------


def _small_graph(edge_weight: bool = True) -> GraphData:
    rng = np.random.default_rng(3)
    n, e = 12, 30
    return GraphData(
        name="small",
        num_nodes=n,
        edge_index=rng.integers(0, n, (2, e)).astype(np.int64),
        x=rng.standard_normal((n, 4)).astype(np.float32),
        y=np.where(np.arange(n) % 5 == 0, -1, np.arange(n) % 3).astype(np.int64),
        num_classes=4,
        splits={"train": np.array([5, 1, 2]), "val": np.array([3, 4]), "test": np.array([7])},
        edge_weight=rng.uniform(0.5, 2.0, e).astype(np.float32) if edge_weight else None,
    )


def _assert_same(a: GraphData, b: GraphData, sort_splits: bool = False) -> None:
    assert (a.name, a.num_nodes, a.num_classes) == (b.name, b.num_nodes, b.num_classes)
    np.testing.assert_array_equal(a.edge_index, b.edge_index)
    assert a.x.dtype == b.x.dtype
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    assert set(a.splits) == set(b.splits)
    for split, ids in a.splits.items():
        want = np.sort(ids) if sort_splits else ids
        np.testing.assert_array_equal(b.splits[split], want)
        assert b.splits[split].dtype == np.int64
    if a.edge_weight is None:
        assert b.edge_weight is None
    else:
        assert b.edge_weight is not None
        np.testing.assert_array_equal(a.edge_weight, b.edge_weight)


def test_npz_round_trip_with_idx(tmp_path: Path) -> None:
    graph = _small_graph()
    path = tmp_path / "small.graph"
    write_npz(graph, path)
    assert path.is_file()
    _assert_same(graph, read_npz(path, name="small"))


def test_npz_with_masks_column_labels_and_defaults(tmp_path: Path) -> None:
    graph = _small_graph(edge_weight=False)
    masks = {}
    for split, ids in graph.splits.items():
        masks[f"{split}_mask"] = np.zeros(graph.num_nodes, dtype=bool)
        masks[f"{split}_mask"][ids] = True
    path = tmp_path / "masked.npz"
    np.savez(path, edge_index=graph.edge_index, x=graph.x, y=graph.y[:, None], **masks)  # type: ignore[arg-type]
    read = read_npz(path)
    assert read.name == "masked"
    assert read.num_classes == int(graph.y.max()) + 1
    graph.num_classes, graph.name = read.num_classes, "masked"
    _assert_same(graph, read, sort_splits=True)


def test_npz_ogb_valid_idx_is_the_val_split_and_empty_splits_are_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from partitioner.partition import partition_graph

    graph = _small_graph(edge_weight=False)
    path = tmp_path / "ogb-style.npz"
    np.savez(path, edge_index=graph.edge_index, x=graph.x, y=graph.y, valid_idx=graph.splits["val"])
    read = read_npz(path)
    np.testing.assert_array_equal(read.splits["val"], graph.splits["val"])
    assert "train" not in read.splits and "ignoring keys" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="partitioner.partition"):
        partition_graph(read, 1, tmp_path / "parts", method="range", progress=False)
    assert "the 'train' split is empty; graphfeed-train needs train and val nodes" in caplog.text
    assert "the 'test' split is empty" in caplog.text and "the 'val' split is empty" not in caplog.text


def test_npz_edge_list_orientation(tmp_path: Path) -> None:
    graph = _small_graph()
    path = tmp_path / "edges.npz"
    np.savez(path, edge_index=graph.edge_index.T.astype(np.int32), x=graph.x, y=graph.y)
    read = read_npz(path)
    np.testing.assert_array_equal(read.edge_index, graph.edge_index)
    assert read.edge_index.dtype == np.int64


def test_npz_missing_key_names_it(tmp_path: Path) -> None:
    graph = _small_graph()
    path = tmp_path / "nox.npz"
    np.savez(path, edge_index=graph.edge_index, y=graph.y, train_idx=graph.splits["train"])
    with pytest.raises(GraphDataError) as info:
        read_npz(path)
    message = str(info.value)
    assert "'x'" in message and str(path) in message
    assert "edge_index" in message and "train_idx" in message


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: a.update(x=a["x"].astype(np.int64)), "x: expected float"),
        (lambda a: a.update(train_mask=np.ones(12, dtype=bool)), "train_idx or train_mask"),
        (lambda a: a.update(edge_index=np.zeros((3, 4), dtype=np.int64)), "edge_index"),
        (lambda a: a.update(y=np.array([None] * 12, dtype=object)), "pickle"),
        (lambda a: a.update(y=a["y"] + 0.5), r"y: expected whole-number labels \(or NaN"),
        (lambda a: a.update(y=np.full(12, np.inf)), "y: expected whole-number labels"),
        (lambda a: a.update(y=np.ones(12, dtype=bool)), "y: expected integer labels"),
    ],
)
def test_npz_malformed(
    tmp_path: Path, change: Callable[[dict[str, np.ndarray]], None], match: str
) -> None:
    graph = _small_graph()
    arrays = {"edge_index": graph.edge_index, "x": graph.x, "y": graph.y}
    arrays["train_idx"] = graph.splits["train"]
    change(arrays)
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)  # type: ignore[arg-type]
    with pytest.raises(GraphDataError, match=match):
        read_npz(path)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_npz_float_labels_with_nan_for_unlabeled(tmp_path: Path, dtype: type) -> None:
    """Labels as OGB stores papers100M's: floats, NaN for unlabeled nodes."""
    graph = _small_graph()
    labels = np.where(graph.y < 0, np.nan, graph.y).astype(dtype)[:, None]
    path = tmp_path / "float-y.npz"
    np.savez(path, edge_index=graph.edge_index, x=graph.x, y=labels, train_idx=graph.splits["train"])
    got = read_npz(path)
    assert got.y.dtype == np.int64 and np.array_equal(got.y, graph.y)
    assert got.num_classes == int(graph.y.max()) + 1


# --- PyG --------------------------------------------------------------------------------


def test_pyg_round_trip() -> None:
    graph = _small_graph()
    data = to_pyg(graph)
    assert isinstance(data, Data)
    assert data.train_mask.dtype == torch.bool and int(data.train_mask.sum()) == 3
    _assert_same(graph, from_pyg(data, name="small"), sort_splits=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_from_pyg_idx_column_labels_and_edge_attr(dtype: torch.dtype) -> None:
    data = Data(
        x=torch.arange(12, dtype=dtype).view(6, 2),
        edge_index=torch.tensor([[0, 1, 2, 5], [1, 2, 3, 0]], dtype=torch.int32),
        y=torch.tensor([[0], [2], [1], [-1], [1], [0]]),
        edge_attr=torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64),
        train_idx=torch.tensor([0, 1]),
        val_idx=torch.tensor([2]),
        test_idx=torch.tensor([4, 5]),
    )
    graph = from_pyg(data)
    assert graph.name == "pyg"
    assert graph.x.dtype == torch.empty(0, dtype=dtype).numpy().dtype
    assert graph.edge_index.dtype == np.int64
    np.testing.assert_array_equal(graph.y, [0, 2, 1, -1, 1, 0])
    assert graph.num_classes == 3
    np.testing.assert_array_equal(graph.splits["test"], [4, 5])
    assert graph.edge_weight is not None and graph.edge_weight.dtype == np.float32
    np.testing.assert_array_equal(graph.edge_weight, [1.0, 2.0, 0.5, 3.0])
    assert from_pyg(data, num_classes=10).num_classes == 10


def test_from_pyg_errors() -> None:
    with pytest.raises(GraphDataError, match="HeteroData"):
        from_pyg(HeteroData())
    no_x = Data(edge_index=torch.tensor([[0], [1]]), y=torch.tensor([0, 1]), num_nodes=2)
    with pytest.raises(GraphDataError, match=r"data\.x: expected a tensor.*edge_index"):
        from_pyg(no_x)
    fractions = Data(edge_index=torch.tensor([[0], [1]]), x=torch.zeros(2, 1),
                     y=torch.tensor([0.5, 1.0]), num_nodes=2)
    with pytest.raises(GraphDataError, match=r"data\.y: expected whole-number labels"):
        from_pyg(fractions)


def test_from_pyg_float_labels_with_nan_for_unlabeled() -> None:
    """``Data.y`` as PyG's ogbn-papers100M holds it: float, NaN for unlabeled nodes."""
    graph = _small_graph()
    data = to_pyg(graph)
    data.y = torch.where(data.y < 0, torch.nan, data.y.double()).float()[:, None]
    got = from_pyg(data, name="small")
    assert got.y.dtype == np.int64 and np.array_equal(got.y, graph.y)


def test_fixture_copies_are_independent(tmp_path: Path) -> None:
    """Fixtures written twice into separate roots read identically (no hidden cache)."""
    first = write_csv_dataset(tmp_path / "a", "ogbn-arxiv")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (first.path / "raw" / "edge.csv.gz").unlink()
    graph = read_ogb("ogbn-arxiv", tmp_path / "b")
    np.testing.assert_array_equal(graph.edge_index, first.edge_index)
    with pytest.raises(DatasetNotFoundError):
        read_ogb("ogbn-arxiv", tmp_path / "a")
