"""`graphfeed-partition` with typed graphs: presets, typed .npz and ogbn-mag, info, errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from partitioner.cli import main
from partitioner.hetero_format import load_hetero_partition, read_hetero_manifest
from partitioner.readers.npz_hetero import write_npz_hetero
from tests.fixtures_ogb import write_mag_dataset
from tests.fixtures_ogb_hetero import write_mag_typed_dataset
from tests.hetero_fixtures import tiny_hetero


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_mag_small_with_reverse_then_info_and_skip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ms"
    code, text, _ = run(capsys, "partition", "--synthetic", "mag-small", "--add-reverse",
                        "--num-parts", "2", "--out", out, "--no-progress")
    assert code == 0
    assert "typed, format v2" in text and "paper/rev_writes/author" in text
    m = read_hetero_manifest(out)
    assert m.algorithm["add_reverse"] is True and len(m.edge_types) == 7
    load_hetero_partition(out, 1)
    code, text, _ = run(capsys, "info", out, "--verify")
    assert code == 0 and "verified (SHA-256)" in text
    author = next(line for line in text.splitlines() if line.startswith("author "))
    assert author.split()[1:3] == ["6,000", "none"]
    code, text, _ = run(capsys, "partition", "--synthetic", "mag-small", "--add-reverse",
                        "--num-parts", "2", "--out", out, "--no-progress", "--skip-existing")
    assert code == 0 and "nothing to do" in text
    code, _, err = run(capsys, "partition", "--synthetic", "mag-small", "--num-parts", "2",
                       "--out", out, "--no-progress", "--skip-existing")
    assert code == 2 and "--add-reverse True there, False asked" in err


def test_typed_npz_is_detected_by_its_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.npz"
    write_npz_hetero(tiny_hetero(), path)
    code, text, _ = run(capsys, "partition", "--npz", path, "--num-parts", "2", "--method",
                        "random", "--out", tmp_path / "p", "--no-progress")
    assert code == 0 and "graph t (typed, format v2)" in text
    assert read_hetero_manifest(tmp_path / "p").node_types["topic"].num_nodes == 6


def test_ogbn_mag_is_read_typed_unless_papers_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ogb"
    want = write_mag_typed_dataset(root)
    code, text, _ = run(capsys, "partition", "--ogb", "ogbn-mag", "--ogb-root", root,
                        "--num-parts", "2", "--method", "random", "--out", tmp_path / "typed",
                        "--no-progress")
    assert code == 0, text
    m = read_hetero_manifest(tmp_path / "typed")
    assert {t: i.num_nodes for t, i in m.node_types.items()} == want.num_nodes
    assert m.num_edges == want.num_edges()
    root2 = tmp_path / "ogb2"
    write_mag_dataset(root2)
    code, text, _ = run(capsys, "partition", "--ogb", "ogbn-mag", "--ogb-root", root2,
                        "--mag-papers-only", "--num-parts", "2", "--method", "random",
                        "--out", tmp_path / "papers", "--no-progress")
    assert code == 0 and "format v2" not in text and "graph ogbn-mag: 14 nodes" in text


def test_add_reverse_is_refused_for_homogeneous_sources(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "partition", "--synthetic", "small", "--add-reverse",
                       "--num-parts", "2", "--out", tmp_path / "x", "--no-progress")
    assert code == 2 and "--add-reverse: only for typed graphs" in err
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_info_names_a_damaged_typed_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d"
    assert main(["partition", "--synthetic", "mag-small", "--num-parts", "2", "--method",
                 "random", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    target = out / "part-0" / "paper" / "y.npy"
    y = np.load(target)
    y[0] = (y[0] + 1) % 8
    np.save(target, y)
    code, _, err = run(capsys, "info", out, "--verify")
    assert code == 2 and "part-0/paper/y.npy: SHA-256 mismatch" in err
