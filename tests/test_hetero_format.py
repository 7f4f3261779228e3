"""Partition format v2: writer and validating reader for typed graphs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from partitioner.format import PartitionFormatError, load_partition
from partitioner.graph import edge_type_name
from partitioner.typed import TypedGraphData
from partitioner.hetero_format import (
    load_hetero_node_map,
    load_hetero_partition,
    read_format_version,
    read_hetero_manifest,
)
from partitioner.synthetic import generate
from partitioner.hetero_writer import partition_hetero_graph, write_hetero_partitions
from partitioner.partition import partition_graph
from partitioner.synthetic import generate
from tests.hetero_fixtures import tiny_hetero


@pytest.fixture(scope="module")
def small() -> TypedGraphData:
    return generate("mag-small", seed=1, progress=False).add_reverse()


@pytest.fixture(scope="module")
def small_parts(small: TypedGraphData, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mag-small-2")
    partition_hetero_graph(small, 2, out, method="metis", seed=0, progress=False)
    return out


def _check_round_trip(graph: TypedGraphData, root: Path) -> None:
    """Every edge, feature row, label and split member comes back under its new IDs."""
    m = read_hetero_manifest(root)
    parts = [load_hetero_partition(root, p) for p in range(m.num_partitions)]
    maps = {t: np.asarray(load_hetero_node_map(root, t)) for t in graph.node_types}
    for t, n in graph.num_nodes.items():
        orig = np.concatenate([p.orig_ids[t] for p in parts])
        np.testing.assert_array_equal(np.sort(orig), np.arange(n))
        np.testing.assert_array_equal(maps[t][orig], np.arange(n))  # global IDs in order
        if t in graph.x:
            x = np.concatenate([p.x[t] for p in parts])
            np.testing.assert_array_equal(x, np.asarray(graph.x[t])[orig])
    tgt = graph.target_type
    np.testing.assert_array_equal(np.concatenate([p.y for p in parts]),
                                  graph.y[np.concatenate([p.orig_ids[tgt] for p in parts])])
    for et, ei in graph.edge_index.items():
        s, _, d = et
        got = []
        for part in parts:
            start, _ = part.node_range(d)
            deg = np.diff(part.indptr[et])
            dst = start + np.repeat(np.arange(deg.size), deg)
            got.append(np.stack([part.indices[et], dst]))
        have = np.concatenate(got, axis=1)
        want = np.stack([maps[s][ei[0]], maps[d][ei[1]]])
        # Same multiset of edges, each stored once.
        n_dst = graph.num_nodes[d]
        np.testing.assert_array_equal(np.sort(have[0] * n_dst + have[1]),
                                      np.sort(want[0] * n_dst + want[1]))
    for split, ids in graph.splits.items():
        back = np.concatenate([p.splits[split] for p in parts])
        np.testing.assert_array_equal(np.sort(back), np.sort(maps[tgt][ids]))


def test_mag_small_round_trips_through_v2(small: TypedGraphData, small_parts: Path) -> None:
    assert read_format_version(small_parts) == 2
    _check_round_trip(small, small_parts)
    m = read_hetero_manifest(small_parts)
    assert m.num_partitions == 2 and m.target_type == "paper"
    assert m.node_types["paper"].feature_dim == 32 and m.node_types["author"].feature_dim == 0
    assert m.num_edges == small.num_edges()
    assert ("paper", "rev_writes", "author") in m.edge_types
    assert not (small_parts / "part-0" / "author" / "x.npy").exists()
    # METIS keeps most edges inside a partition and balances the training papers.
    assert m.edge_cut() < 0.5 * m.num_edges
    train = [p.split_sizes["train"] for p in m.partitions]
    assert max(train) / (sum(train) / 2) < 1.15


def test_in_edges_keep_input_order_for_a_fixed_assignment(tmp_path: Path) -> None:
    g = tiny_hetero()
    rng = np.random.default_rng(0)
    part_of = {t: rng.integers(0, 3, n) for t, n in g.num_nodes.items()}
    m = write_hetero_partitions(g, part_of, tmp_path, num_parts=3, progress=False)
    _check_round_trip(g, tmp_path)
    et = ("author", "writes", "paper")
    ei = g.edge_index[et]
    maps = {t: np.asarray(load_hetero_node_map(tmp_path, t)) for t in g.node_types}
    dst0 = 5
    part = load_hetero_partition(tmp_path, int(part_of["paper"][dst0]))
    local = maps["paper"][dst0] - part.node_range("paper")[0]
    got = part.indices[et][part.indptr[et][local]:part.indptr[et][local + 1]]
    np.testing.assert_array_equal(got, maps["author"][ei[0][ei[1] == dst0]])
    remote = int((part_of["author"][ei[0]] != part_of["paper"][ei[1]]).sum())
    assert m.edge_cut(et) == remote


def test_a_type_may_be_absent_from_a_partition(tmp_path: Path) -> None:
    g = tiny_hetero()
    part_of = {t: np.zeros(n, dtype=np.int64) for t, n in g.num_nodes.items()}
    part_of["paper"][15:] = 1
    write_hetero_partitions(g, part_of, tmp_path, num_parts=2, progress=False)
    p1 = load_hetero_partition(tmp_path, 1)
    assert p1.num_nodes("author") == 0 and p1.num_nodes("paper") == 15
    assert p1.indptr[("paper", "has_topic", "topic")].tolist() == [0]
    _check_round_trip(g, tmp_path)


def test_v1_still_loads_and_v2_is_named_when_misused(tmp_path: Path, small_parts: Path) -> None:
    v1 = tmp_path / "v1"
    partition_graph(generate("small", seed=0, progress=False), 2, v1, method="random",
                    progress=False)
    assert read_format_version(v1) == 1
    assert load_partition(v1, 1).num_nodes > 0
    with pytest.raises(PartitionFormatError, match="load_hetero_partition"):
        load_partition(small_parts, 0)
    with pytest.raises(PartitionFormatError, match="load version 1 with load_partition"):
        load_hetero_partition(v1, 0)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_reader_refuses_damaged_files_naming_them(tmp_path: Path, small_parts: Path) -> None:
    root = _copy(small_parts, tmp_path / "c")
    name = edge_type_name(("author", "writes", "paper"))
    target = root / "part-1" / name / "indices.npy"
    arr = np.load(target)
    arr[0] += 1
    np.save(target, arr)
    with pytest.raises(PartitionFormatError, match=f"part-1/{name}/indices.npy: SHA-256 mismatch"):
        load_hetero_partition(root, 1)
    load_hetero_partition(root, 0)  # the other partition is fine
    (root / "part-0" / "paper" / "x.npy").unlink()
    with pytest.raises(PartitionFormatError, match=r"part-0/paper/x\.npy: missing"):
        load_hetero_partition(root, 0)


def test_reader_checks_structure_beyond_checksums(tmp_path: Path, small_parts: Path) -> None:
    root = _copy(small_parts, tmp_path / "s")
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["partition_book"]["author"][1] += 1
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PartitionFormatError, match=r"num_nodes\['author'\]"):
        load_hetero_partition(root, 0)
    with pytest.raises(PartitionFormatError, match=r"expected an ID in \[0, 2\)"):
        load_hetero_partition(small_parts, 2)


def test_writer_refuses_bad_assignments(tmp_path: Path) -> None:
    g = tiny_hetero()
    good = {t: np.zeros(n, dtype=np.int64) for t, n in g.num_nodes.items()}
    with pytest.raises(ValueError, match=r"part_of\['author'\]: expected integers of shape \[20\]"):
        write_hetero_partitions(g, {**good, "author": np.zeros(3, np.int64)}, tmp_path / "a",
                                num_parts=1, progress=False)
    with pytest.raises(ValueError, match="must own at least one node"):
        write_hetero_partitions(g, good, tmp_path / "b", num_parts=2, progress=False)
    with pytest.raises(ValueError, match="expected one array per node type"):
        write_hetero_partitions(g, {"paper": good["paper"]}, tmp_path / "c", num_parts=1,
                                progress=False)


def test_manifest_without_a_file_role_is_refused(tmp_path: Path, small_parts: Path) -> None:
    root = _copy(small_parts, tmp_path / "r")
    manifest = json.loads((root / "manifest.json").read_text())
    del manifest["partitions"][0]["files"]["paper/y"]
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PartitionFormatError, match=r"expected a record for 'paper/y'"):
        load_hetero_partition(root, 0)


def test_partitioning_refuses_out_of_range_ids_naming_the_relation(tmp_path: Path) -> None:
    from partitioner.graph import GraphDataError

    g = tiny_hetero()
    g.edge_index[("paper", "has_topic", "topic")][1, 0] = 6
    with pytest.raises(GraphDataError, match=r"has_topic.*expected destination IDs of 'topic'"):
        partition_hetero_graph(g, 2, tmp_path, method="random", progress=False)
