"""The `graphfeed-partition` command line, called in-process (plus one real subprocess),
on plain and typed graphs: summaries, verification, idempotent jobs, every source, and
clear errors with exit code 2."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from partitioner.cli import main
from partitioner.format import Manifest, load_partition, read_manifest
from partitioner.readers.graphdir import save_graph_dir
from partitioner.readers.npz import write_npz
from partitioner.summary import balance
from tests.fixtures_ogb import write_mag_dataset
from tests.graph_fixtures import KINDS, mixed, typed_view

REPO = Path(__file__).resolve().parents[1]
#: One row of the per-partition table: part, nodes, edges, train, val, test, remote.
ROW = re.compile(r"^\s*(\d+)" + r"\s+([\d,]+)" * 6 + r"\s*$")
#: The synthetic preset of each kind.
PRESET = {"plain": "small", "typed": "mag-small"}


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out: str) -> list[list[int]]:
    rows = []
    for line in out.splitlines():
        match = ROW.match(line)
        if match:
            rows.append([int(g.replace(",", "")) for g in match.groups()])
    return rows


def num_files(m: Manifest) -> int:
    """The files a manifest lists: a book and a node map per node type; per partition two
    CSC files and the edge IDs per relation (and the weights and edge features of the
    relations with them), features per type that has them, labels, original IDs per type
    and three splits."""
    per_part = (3 * len(m.edge_types) + len(m.weighted) + len(m.edge_features) + len(m.feature_dtypes) + 1
                + len(m.node_types) + 3)
    return 2 * len(m.node_types) + m.num_partitions * per_part


@pytest.fixture(scope="module", params=KINDS)
def parts_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each kind's preset partitioned into 3 by METIS through the CLI (shared, read-only)."""
    out = tmp_path_factory.mktemp("cli") / f"{request.param}-3"
    assert main(["partition", "--synthetic", PRESET[request.param], "--num-parts", "3", "--out", str(out),
                 "--no-progress"]) == 0
    return out


@pytest.fixture(params=KINDS)
def graph_npz(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """The mixed graph of each kind as an .npz file (typed: edge_index__* keys)."""
    path = tmp_path / f"{request.param}.npz"
    write_npz(mixed(request.param), path)
    return path


def test_help_runs_as_a_module() -> None:
    result = subprocess.run([sys.executable, "-m", "partitioner", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    for word in ("partition", "generate", "info", "examples:"):
        assert word in result.stdout


@pytest.mark.parametrize("kind", KINDS)
def test_partition_prints_a_summary_matching_the_manifest(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str
) -> None:
    out_dir = tmp_path / "out"
    reverse = ["--add-reverse"] if kind == "typed" else []
    code, out, _ = run(capsys, "partition", "--synthetic", PRESET[kind], *reverse, "--num-parts", "2",
                       "--method", "range", "--out", out_dir, "--no-progress")
    assert code == 0
    manifest = read_manifest(out_dir)
    rows = table_rows(out)
    assert [r[0] for r in rows] == [0, 1]
    for row, info in zip(rows, manifest.partitions, strict=True):
        assert row[1:] == [sum(info.num_nodes.values()), sum(info.num_edges.values()),
                           info.split_sizes["train"], info.split_sizes["val"], info.split_sizes["test"],
                           sum(info.num_remote_edges.values())]
    assert f"edge cut: {manifest.edge_cut():,} of {manifest.num_edges:,} edges" in out
    b = balance(manifest)
    assert f"balance (max/mean): nodes {b.nodes:.3f}, edges {b.edges:.3f}, train {b.train:.3f}" in out
    assert re.search(r"method range into 2 partitions in \d+\.\d s", out)
    assert re.search(rf"total time \d+\.\d s; written to {re.escape(str(out_dir))}", out)
    if kind == "plain":
        assert "graph small: 4,000 nodes, 40,000 edges" in out and "typed" not in out
    else:
        assert "graph mag-small (typed, format v2)" in out and "paper/rev_writes/author" in out
        assert manifest.algorithm["add_reverse"] is True and len(manifest.edge_types) == 7
        author = next(line for line in out.splitlines() if line.startswith("author "))
        assert author.split()[1:3] == ["6,000", "none"]  # nodes, features
    load_partition(out_dir, 1)


def test_info_verify_prints_the_summary(capsys: pytest.CaptureFixture[str], parts_dir: Path) -> None:
    code, out, err = run(capsys, "info", parts_dir, "--verify")
    assert code == 0, err
    assert len(table_rows(out)) == 3 and "edge cut:" in out and "balance (max/mean)" in out
    m = read_manifest(parts_dir)
    assert num_files(m) == len(m.records()) == (29 if not m.typed else 71)
    assert "original edge IDs: stored for every edge (e_id)" in out
    assert f"{num_files(m)} files verified (SHA-256)" in out


def test_edge_features_are_summarised_where_node_features_are(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    code, out, err = run(capsys, "partition", "--synthetic", "edge-feat-small", "--num-parts", "2",
                         "--method", "hash", "--out", tmp_path / "p", "--no-progress")
    assert code == 0, err
    assert "graph edge-feat-small: 4,000 nodes, 40,000 edges, 16 features (float32), edge features [8] " \
           "float32, 6 classes" in out
    m = read_manifest(tmp_path / "p")
    assert m.edge_feature_dims == {next(iter(m.edge_types)): 8} and m.has_edge_ids
    code, out, err = run(capsys, "generate", "--preset", "edge-feat-small", "--out", tmp_path / "g")
    assert code == 0, err
    assert "16 features, edge features [8] float32, 6 classes" in out
    assert (tmp_path / "g" / "edge_attr.npy").is_file()


def test_info_verify_refuses_a_corrupted_file(capsys: pytest.CaptureFixture[str], parts_dir: Path,
                                              tmp_path: Path) -> None:
    copy = Path(shutil.copytree(parts_dir, tmp_path / "copy"))
    m = read_manifest(copy)
    x_path = copy / m.partitions[2].files[m.role("x", m.target_type)].path
    assert x_path.relative_to(copy).as_posix() == ("part-2/paper/x.npy" if m.typed else "part-2/x.npy")
    data = bytearray(x_path.read_bytes())
    data[-1] ^= 0xFF
    x_path.write_bytes(bytes(data))

    code, out, _ = run(capsys, "info", copy)  # sizes only: the flip goes unnoticed
    assert code == 0 and "checked (sizes)" in out
    code, out, err = run(capsys, "info", copy, "--verify")
    assert code == 2 and out == ""
    assert err.startswith("graphfeed-partition: error: ")
    assert str(x_path) in err and "SHA-256 mismatch" in err


def test_info_on_a_directory_without_manifest_fails_clearly(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run(capsys, "info", tmp_path)
    assert code == 2 and "manifest not found" in err


def test_an_npz_is_read_as_its_kind(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                    graph_npz: Path) -> None:
    code, out, err = run(capsys, "partition", "--npz", graph_npz, "--num-parts", "2", "--method", "random",
                         "--out", tmp_path / "p", "--no-progress")
    assert code == 0, err
    m = read_manifest(tmp_path / "p")
    typed = graph_npz.stem == "typed"
    assert m.typed == typed and m.weighted == frozenset(typed_view(mixed(graph_npz.stem)).edge_weight)
    assert f"graph {graph_npz.stem}{' (typed, format v2)' if typed else ':'}" in out


@pytest.mark.parametrize("num_parts", ["0", "-1"])
def test_num_parts_below_one_fails(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, graph_npz: Path, num_parts: str
) -> None:
    code, _, err = run(capsys, "partition", "--npz", graph_npz, "--num-parts", num_parts,
                       "--out", tmp_path / "out")
    assert code == 2
    assert f"--num-parts: expected an integer >= 1, got {num_parts}" in err
    assert not (tmp_path / "out").exists()


def test_more_parts_than_nodes_fails(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                     graph_npz: Path) -> None:
    n = typed_view(mixed(graph_npz.stem)).total_nodes
    code, _, err = run(capsys, "partition", "--npz", graph_npz, "--num-parts", str(n + 1),
                       "--out", tmp_path / "out", "--no-progress")
    assert code == 2 and f"num_parts: expected at most num_nodes ({n}), got {n + 1}" in err


def test_non_empty_out_needs_overwrite(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                       graph_npz: Path) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("user data")
    argv = ["partition", "--npz", graph_npz, "--num-parts", "2", "--method", "random",
            "--out", out_dir, "--no-progress"]
    code, _, err = run(capsys, *argv)
    assert code == 2 and str(out_dir) in err and "--overwrite" in err
    assert (out_dir / "keep.txt").read_text() == "user data"

    code, out, _ = run(capsys, *argv, "--overwrite")
    assert code == 0 and "edge cut:" in out
    assert not (out_dir / "keep.txt").exists()
    assert read_manifest(out_dir).num_partitions == 2


def test_skip_existing_makes_the_job_idempotent(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, graph_npz: Path
) -> None:
    out_dir = tmp_path / "out"
    argv = ["partition", "--npz", graph_npz, "--num-parts", "2", "--method", "random",
            "--out", out_dir, "--no-progress", "--skip-existing"]
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "edge cut:" in out  # nothing there yet: partitions
    manifest = out_dir / "manifest.json"
    before = (manifest.stat().st_mtime_ns, manifest.read_text())

    code, out, _ = run(capsys, *argv)  # the same job again: leaves the files alone
    assert code == 0 and "nothing to do" in out and "edge cut:" not in out
    assert (manifest.stat().st_mtime_ns, manifest.read_text()) == before

    changed = [a if a != "2" else "3" for a in argv]
    code, _, err = run(capsys, *changed)
    assert code == 2 and "--num-parts 2 there, 3 asked" in err and "--overwrite" in err
    assert read_manifest(out_dir).num_partitions == 2
    code, _, err = run(capsys, *argv[:-2], "--seed", "7", "--no-progress", "--skip-existing")
    assert code == 2 and "--seed 0 there, 7 asked" in err

    code, out, _ = run(capsys, *changed, "--overwrite")
    assert code == 0 and "edge cut:" in out and read_manifest(out_dir).num_partitions == 3

    # A damaged partition is never taken as done.
    next(out_dir.glob("part-0/**/*.npy")).unlink()
    code, _, err = run(capsys, *changed)
    assert code == 2 and "part-0" in err
    code, out, _ = run(capsys, *changed, "--overwrite")
    assert code == 0 and "edge cut:" in out
    load_partition(out_dir, 0)


def test_skip_existing_tells_a_typed_partition_by_its_reverse_relations(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["partition", "--synthetic", "mag-small", "--num-parts", "2", "--method", "random",
            "--out", tmp_path / "ms", "--no-progress", "--skip-existing"]
    assert run(capsys, *argv, "--add-reverse")[0] == 0
    code, out, _ = run(capsys, *argv, "--add-reverse")
    assert code == 0 and "nothing to do" in out
    code, _, err = run(capsys, *argv)
    assert code == 2 and "--add-reverse True there, False asked" in err


def test_missing_npz_fails_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nope.npz"
    code, _, err = run(capsys, "partition", "--npz", missing, "--num-parts", "2",
                       "--out", tmp_path / "out")
    assert code == 2 and str(missing) in err and "no such .npz file" in err


def test_missing_graph_dir_fails_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "no-graph"
    code, _, err = run(capsys, "partition", "--graph-dir", missing, "--num-parts", "2",
                       "--out", tmp_path / "out")
    assert code == 2 and str(missing / "graph.json") in err and "not found" in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param(["partition", "--synthetic", "small", "--num-parts", "2", "--out", "o",
                      "--method", "spectral"], "invalid choice: 'spectral'", id="unknown-method"),
        pytest.param(["partition", "--num-parts", "2", "--out", "o"],
                     "one of the arguments --synthetic --ogb --npz --graph-dir is required",
                     id="missing-source"),
        pytest.param(["partition", "--synthetic", "small", "--npz", "g.npz", "--num-parts", "2",
                      "--out", "o"], "not allowed with argument", id="two-sources"),
        pytest.param(["partition", "--synthetic", "small", "--out", "o"],
                     "the following arguments are required: --num-parts", id="missing-num-parts"),
        pytest.param(["partition", "--synthetic", "small", "--num-parts", "two", "--out", "o"],
                     "invalid int value: 'two'", id="non-integer-num-parts"),
        pytest.param([], "the following arguments are required: COMMAND", id="no-command"),
    ],
)
def test_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    argv: list[str], expected: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_generate_then_partition_the_graph_dir(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    graph_dir = tmp_path / "graph"
    code, out, _ = run(capsys, "generate", "--preset", "small", "--seed", "4", "--out", graph_dir)
    assert code == 0 and "small: 4,000 nodes, 40,000 edges" in out
    assert (graph_dir / "graph.json").is_file() and (graph_dir / "edge_index.npy").is_file()

    out_dir = tmp_path / "parts"
    code, out, err = run(capsys, "partition", "--graph-dir", graph_dir, "--num-parts", "2",
                         "--method", "hash", "--out", out_dir, "--no-progress")
    assert code == 0, err
    manifest = read_manifest(out_dir)
    assert manifest.graph_name == "small" and manifest.num_nodes == 4000
    assert manifest.num_edges == 40000 and manifest.algorithm["method"] == "hash"
    assert [r[1] for r in table_rows(out)] == [sum(p.num_nodes.values()) for p in manifest.partitions]
    code, _, err = run(capsys, "info", out_dir, "--verify")
    assert code == 0, err


def test_a_typed_graph_dir_streams_with_reverse_relations(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    graph = mixed("typed")
    save_graph_dir(graph, tmp_path / "graph")
    code, _, err = run(capsys, "partition", "--graph-dir", tmp_path / "graph", "--add-reverse",
                         "--num-parts", "2", "--method", "range", "--out", tmp_path / "p", "--no-progress")
    assert code == 0, err
    m = read_manifest(tmp_path / "p")
    assert m.typed and set(m.edge_types) == set(graph.add_reverse().edge_types)
    assert m.weighted == set(m.edge_types)


def test_ogbn_mag_is_read_typed_unless_papers_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fixture = write_mag_dataset(tmp_path / "ogb")
    assert fixture.typed is not None
    common = ["--ogb", "ogbn-mag", "--ogb-root", tmp_path / "ogb", "--num-parts", "2", "--method", "random",
              "--no-progress"]
    code, out, err = run(capsys, "partition", *common, "--out", tmp_path / "typed")
    assert code == 0, err
    m = read_manifest(tmp_path / "typed")
    assert {t: i.num_nodes for t, i in m.node_types.items()} == fixture.typed.num_nodes
    assert m.num_edges == fixture.typed.num_edges() and "format v2" in out
    code, out, err = run(capsys, "partition", *common, "--mag-papers-only", "--to-undirected",
                         "--out", tmp_path / "papers")
    assert code == 0, err
    assert "format v2" not in out and "graph ogbn-mag: 14 nodes" in out
    assert not read_manifest(tmp_path / "papers").typed
    code, _, err = run(capsys, "partition", *common, "--to-undirected", "--out", tmp_path / "undirected")
    assert code == 2 and "to_undirected: for plain graphs; ogbn-mag is typed" in err


def test_add_reverse_is_refused_for_plain_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "partition", "--synthetic", "small", "--add-reverse",
                       "--num-parts", "2", "--out", tmp_path / "x", "--no-progress")
    assert code == 2 and "--add-reverse: only for typed graphs" in err
    assert not (tmp_path / "x" / "manifest.json").exists()



def test_no_progress_bar_lines_into_a_pipe(tmp_path: Path) -> None:
    """Into a file or a pipe the partitioner writes log lines, not bar updates ('\r')."""
    cmd = [sys.executable, "-m", "partitioner", "partition", "--synthetic", "small",
           "--num-parts", "2", "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert b"\r" not in proc.stderr and b"wrote 2 partitions" in proc.stderr


@pytest.mark.parametrize(("terminal", "flag", "shown"),
                         [(True, False, True), (True, True, False), (False, False, False)])
def test_progress_bars_show_on_a_terminal_unless_hidden(
    monkeypatch: pytest.MonkeyPatch, terminal: bool, flag: bool, shown: bool
) -> None:
    from partitioner import cli

    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    args = cli.build_parser().parse_args(["partition", "--synthetic", "small", "--num-parts", "2",
                                          "--out", "x", *(["--no-progress"] if flag else [])])
    assert cli._progress(args) is shown
