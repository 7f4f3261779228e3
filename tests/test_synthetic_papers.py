"""The ``papers-like`` preset (ogbn-papers100M's shape) at a tiny scale: reproducible, the
same in memory and streamed to a graph directory, with papers100M's shape (classes,
features, about 1 % labelled, the split by year, a power-law degree tail, communities);
it partitions and serves; its scale is checked with errors that name it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from partitioner.cli import main as partition_cli
from partitioner.graph import SPLITS, GraphData
from partitioner.readers.graphdir import read_graph_dir
from partitioner.synthetic import generate, generate_plain, resolve_preset
from partitioner.synthetic_papers import (
    MIN_SCALE,
    PAPERS_LIKE,
    SPLIT_LAST_YEARS,
    node_years,
    parse_scale,
    write_papers_dir,
)
from tests.in_process_servers import served
from trainer_client.loader import RemoteNeighborLoader

#: 11,106 papers, about 160,000 citations: a second or two.
SCALE = 1e-4


@pytest.fixture(scope="module")
def graph() -> GraphData:
    return generate_plain("papers-like", seed=0, progress=False, scale=SCALE)


def test_the_same_scale_and_seed_give_the_same_graph(graph: GraphData) -> None:
    again = generate_plain("papers-like", seed=0, progress=False, scale=SCALE)
    other = generate_plain("papers-like", seed=1, progress=False, scale=SCALE)
    for name in ("edge_index", "x", "y"):
        np.testing.assert_array_equal(getattr(graph, name), getattr(again, name))
        assert not np.array_equal(getattr(graph, name), getattr(other, name)), name
    for split in graph.splits:
        np.testing.assert_array_equal(graph.splits[split], again.splits[split])


def test_streamed_to_a_directory_it_is_the_same_graph(graph: GraphData, tmp_path: Path) -> None:
    _, params = resolve_preset("papers-like", SCALE)
    on_disk = read_graph_dir(write_papers_dir(params, tmp_path / "g", seed=0, progress=False), mmap=False)
    assert isinstance(on_disk, GraphData) and on_disk.name == graph.name == "papers-like@0.0001"
    assert on_disk.num_nodes == graph.num_nodes and on_disk.num_classes == graph.num_classes
    for name in ("edge_index", "x", "y"):
        np.testing.assert_array_equal(getattr(on_disk, name), getattr(graph, name))
    for split in graph.splits:
        np.testing.assert_array_equal(on_disk.splits[split], graph.splits[split])


def test_it_has_papers100m_shape(graph: GraphData) -> None:
    """Sizes scaled from 111,059,956 papers and 1,615,685,872 citations; 128 float32
    features, 172 classes, OGB's split sizes, labels on the split's papers only."""
    n = round(PAPERS_LIKE.num_nodes * SCALE)
    assert graph.num_nodes == n and graph.x.shape == (n, 128) and graph.x.dtype == np.float32
    assert graph.num_classes == 172
    citations = round(PAPERS_LIKE.num_citations * SCALE)  # less the repeats given up (few at 1/10)
    assert 0.85 * 2 * citations <= graph.num_edges <= 2 * citations
    sizes = {s: round(k * SCALE) for s, k in zip(SPLITS, PAPERS_LIKE.split_sizes, strict=True)}
    assert {s: ids.size for s, ids in graph.splits.items()} == sizes
    labelled = np.flatnonzero(graph.y >= 0)
    np.testing.assert_array_equal(labelled, np.sort(np.concatenate(list(graph.splits.values()))))
    assert 0.01 <= labelled.size / n <= 0.02, "about 1.4 % of the papers labelled, as papers100M"
    assert set(np.unique(graph.y).tolist()) <= {-1, *range(172)}
    graph.validate()


def test_the_split_is_by_year(graph: GraphData) -> None:
    years = node_years(PAPERS_LIKE.scaled(SCALE))
    train, val, test = (years[graph.splits[s]] for s in ("train", "val", "test"))
    assert train.max() <= SPLIT_LAST_YEARS[0] < val.min() == val.max() == SPLIT_LAST_YEARS[1] < test.min()
    assert np.diff(np.bincount(years - years.min())[-20:]).min() >= 0, "more papers every year"


def test_citations_are_simple_point_to_older_papers_and_come_with_their_reverses(graph: GraphData) -> None:
    src, dst = graph.edge_index
    c = src.size // 2
    np.testing.assert_array_equal(src[c:], dst[:c])
    np.testing.assert_array_equal(dst[c:], src[:c])
    keys = src * graph.num_nodes + dst
    assert np.unique(keys).size == keys.size and not (src == dst).any()
    years = node_years(PAPERS_LIKE.scaled(SCALE))
    assert (years[src[:c]] >= years[dst[:c]]).all(), "a paper cites older papers"


def test_degrees_have_a_power_law_tail_and_classes_are_communities(graph: GraphData) -> None:
    degree = np.bincount(graph.edge_index[1], minlength=graph.num_nodes)
    assert degree.max() >= 20 * degree.mean()
    tail = np.sort(degree)[-graph.num_nodes // 20:].astype(np.float64)  # the top 5 %: Hill's estimator
    alpha = 1 + tail.size / np.log(tail / tail[0]).sum()
    assert 1.8 <= alpha <= 3.5, f"tail exponent {alpha:.2f}"
    src, dst = graph.edge_index
    both = (graph.y[src] >= 0) & (graph.y[dst] >= 0)
    assert both.sum() >= 20 and (graph.y[src][both] == graph.y[dst][both]).mean() >= 0.3


def test_it_partitions_and_serves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph_dir, parts = tmp_path / "graph", tmp_path / "parts"
    assert partition_cli(["generate", "--preset", "papers-like", "--scale", "1/10000",
                          "--out", str(graph_dir)]) == 0
    assert "papers-like@0.0001: 11,106 nodes" in capsys.readouterr().out
    assert partition_cli(["partition", "--graph-dir", str(graph_dir), "--num-parts", "2", "--method", "range",
                          "--out", str(parts), "--no-progress"]) == 0
    with served(parts, 2) as addresses:
        loader = RemoteNeighborLoader(addresses, "train", num_neighbors=[15, 10, 5], batch_size=64,
                                      shuffle=True, feature_dtype="bfloat16")
        batch = next(iter(loader))
        assert batch.batch_size == 64 and batch.x.shape[1] == 128
        assert (batch.y[:64] >= 0).all() and loader.num_classes == 172
        loader.close()


def test_skip_existing_knows_the_scale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["partition", "--synthetic", "papers-like", "--scale", "0.0001", "--num-parts", "2",
            "--method", "hash", "--out", str(tmp_path / "p"), "--no-progress", "--skip-existing"]
    assert partition_cli(args) == 0
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["graph"]["name"] == "papers-like@0.0001"
    assert partition_cli(args) == 0 and "nothing to do" in capsys.readouterr().out
    assert partition_cli([*args[:4], "0.0002", *args[5:]]) == 2
    assert "--synthetic papers-like@0.0001 there, papers-like@0.0002 asked" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["0", "1.5", "-0.1", "1/0", "a tenth", "1e-7"])
def test_a_scale_out_of_range_is_refused_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match=r"^scale: expected a fraction"):
        parse_scale(text)


def test_scales_read_as_fractions() -> None:
    assert parse_scale("1/10") == 0.1 == parse_scale("0.1") and parse_scale("1") == 1.0
    assert parse_scale(str(MIN_SCALE)) == MIN_SCALE
    tenth = PAPERS_LIKE.scaled(0.1)
    assert tenth.num_nodes == 11_105_996 and tenth.name() == "papers-like@0.1"


def test_only_papers_like_scales() -> None:
    with pytest.raises(ValueError, match=r"scale: only papers-like scales; expected 1 for 'small', got 0.5"):
        generate("small", scale=0.5)


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--preset", "small", "--scale", "0.5"], "--scale: only --preset papers-like scales"),
    (["partition", "--npz", "g.npz", "--scale", "0.5", "--num-parts", "2"],
     "--scale: only --synthetic papers-like scales; got --scale 0.5 with a graph read from its source"),
])
def test_the_cli_refuses_a_scale_it_cannot_apply(argv: list[str], message: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert partition_cli([*argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err


def test_the_cli_refuses_a_malformed_scale(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        partition_cli(["generate", "--preset", "papers-like", "--scale", "2", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "argument --scale: expected a fraction of the full graph in [1e-05, 1]" in capsys.readouterr().err
