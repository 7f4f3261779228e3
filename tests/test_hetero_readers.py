"""Typed-graph readers: ogbn-mag in OGB's raw layout, typed .npz, PyG HeteroData."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch_geometric.data import Data

from partitioner.graph import GraphDataError
from partitioner.typed import TypedGraphData
from partitioner.readers.npz import write_npz
from partitioner.readers.npz_hetero import is_hetero_npz, read_npz_hetero, write_npz_hetero
from partitioner.readers.ogb import DatasetNotFoundError
from partitioner.readers.ogb_hetero import read_ogb_hetero
from partitioner.readers.pyg_hetero import from_pyg_hetero, to_pyg_hetero
from partitioner.synthetic import generate
from tests.fixtures_ogb import write_csv_dataset
from tests.fixtures_ogb_hetero import write_mag_typed_dataset
from tests.hetero_fixtures import tiny_hetero


def assert_same_graph(a: TypedGraphData, b: TypedGraphData, *, order: bool = True) -> None:
    assert a.num_nodes == b.num_nodes
    if order:
        assert list(a.num_nodes) == list(b.num_nodes)
    assert set(a.edge_types) == set(b.edge_types)
    for et, ei in a.edge_index.items():
        np.testing.assert_array_equal(ei, b.edge_index[et])
    assert set(a.x) == set(b.x)
    for t, x in a.x.items():
        np.testing.assert_array_equal(x, b.x[t])
    assert a.target_type == b.target_type and a.num_classes == b.num_classes
    np.testing.assert_array_equal(a.y, b.y)
    assert set(a.splits) == set(b.splits)
    for s, ids in a.splits.items():
        np.testing.assert_array_equal(np.sort(ids), np.sort(b.splits[s]))


def test_ogbn_mag_raw_layout_reads_every_type_and_relation(tmp_path: Path) -> None:
    want = write_mag_typed_dataset(tmp_path)
    got = read_ogb_hetero("ogbn-mag", tmp_path)
    assert got.node_types[0] == "paper"  # the target type first
    assert_same_graph(want, got, order=False)
    assert got.x["paper"].dtype == np.float32 and set(got.x) == {"paper"}
    # The zip's own folder name is accepted too.
    (tmp_path / "ogbn_mag").rename(tmp_path / "mag")
    assert_same_graph(want, read_ogb_hetero("ogbn-mag", tmp_path), order=False)


def test_ogbn_mag_missing_files_are_named_and_nothing_is_downloaded(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match=r"raw/num-node-dict\.csv\.gz"):
        read_ogb_hetero("ogbn-mag", tmp_path)
    write_mag_typed_dataset(tmp_path)
    rel = tmp_path / "ogbn_mag" / "raw" / "relations" / "paper___has_topic___field_of_study"
    (rel / "edge.csv.gz").unlink()
    with pytest.raises(GraphDataError, match=r"paper___has_topic___field_of_study/edge\.csv\.gz"):
        read_ogb_hetero("ogbn-mag", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ogbn_mag"]


def test_homogeneous_ogb_dataset_is_refused_by_the_typed_reader(tmp_path: Path) -> None:
    write_csv_dataset(tmp_path, "ogbn-arxiv")
    with pytest.raises(GraphDataError, match="is homogeneous; read it with"):
        read_ogb_hetero("ogbn-arxiv", tmp_path)


def test_typed_npz_round_trips(tmp_path: Path) -> None:
    g = tiny_hetero()
    path = tmp_path / "g.npz"
    write_npz_hetero(g, path, compress=True)
    assert is_hetero_npz(path)
    back = read_npz_hetero(path)
    assert back.name == "g"
    assert_same_graph(g, back)
    plain = tmp_path / "plain.npz"
    write_npz(generate("small", seed=0, progress=False), plain)
    assert not is_hetero_npz(plain)


def test_typed_npz_accepts_masks_and_edge_lists_by_row(tmp_path: Path) -> None:
    g = tiny_hetero()
    path = tmp_path / "m.npz"
    mask = np.zeros(30, dtype=bool)
    mask[g.splits["train"]] = True
    np.savez(path, num_nodes__paper=30, num_nodes__author=20,
             **{"edge_index__author__writes__paper": g.edge_index[("author", "writes", "paper")].T,
                "y__paper": g.y[:, None], "x__paper": g.x["paper"]}, train_mask=mask)
    back = read_npz_hetero(path)
    assert back.num_classes == 3 and back.node_types == ("paper", "author")
    np.testing.assert_array_equal(back.splits["train"], g.splits["train"])
    np.testing.assert_array_equal(back.edge_index[("author", "writes", "paper")],
                                  g.edge_index[("author", "writes", "paper")])


@pytest.mark.parametrize(
    ("arrays", "needle"),
    [
        ({"edge_index__a__r__b": np.zeros((2, 1), np.int64)}, "expected num_nodes__<type> keys"),
        ({"num_nodes__a": 2, "edge_index__a__r__a": np.zeros((2, 1), np.int64)},
         "expected exactly one y__<type> key"),
        ({"num_nodes__a": 2, "edge_index__a__r__b": np.zeros((2, 1), np.int64),
          "y__a": np.zeros(2, np.int64)}, "expected node types among"),
        ({"num_nodes__a": 2, "edge_index__a__r": np.zeros((2, 1), np.int64),
          "y__a": np.zeros(2, np.int64)}, "src__relation__dst"),
        ({"num_nodes__a": 2, "edge_index__a__r__a": np.zeros((2, 1), np.float32),
          "y__a": np.zeros(2, np.int64)}, "edge_index: expected an integer dtype"),
        ({"num_nodes__a": 2, "edge_index__a__r__a": np.zeros((2, 1), np.int64),
          "y__a": np.zeros(3, np.int64)}, "y: expected int64 of shape [2]"),
    ],
)
def test_typed_npz_errors_name_the_key(
    tmp_path: Path, arrays: dict[str, object], needle: str
) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(GraphDataError) as err:
        read_npz_hetero(path)
    assert needle in str(err.value)


def test_pyg_heterodata_round_trips() -> None:
    g = tiny_hetero()
    data = to_pyg_hetero(g)
    assert data["paper"].train_mask.sum() == g.splits["train"].size
    back = from_pyg_hetero(data, name="tiny-hetero")
    assert_same_graph(g, back)
    y = data["paper"].y  # as PyG's OGB datasets may hold labels: float, NaN for unlabeled
    data["paper"].y = torch.where(y < 0, torch.nan, y.double())[:, None]
    assert_same_graph(g, from_pyg_hetero(data, name="tiny-hetero"))
    data["paper"].y = y + 0.5
    with pytest.raises(GraphDataError, match=r"data\['paper'\]\.y: expected whole-number labels"):
        from_pyg_hetero(data)


def test_pyg_heterodata_errors() -> None:
    with pytest.raises(GraphDataError, match=r"expected torch_geometric\.data\.HeteroData"):
        from_pyg_hetero(Data(x=torch.zeros(2, 1)))  # type: ignore[arg-type]
    data = to_pyg_hetero(tiny_hetero())
    data["author"].y = torch.zeros(20, dtype=torch.long)
    with pytest.raises(GraphDataError, match="expected one node type with y"):
        from_pyg_hetero(data)
    assert from_pyg_hetero(data, target_type="paper").target_type == "paper"
    data["paper"].x = torch.zeros(30, 2, dtype=torch.long)
    with pytest.raises(GraphDataError, match=r"data\['paper'\].x: expected float"):
        from_pyg_hetero(data, target_type="paper")
