"""Link splits in the data path, on plain and typed graphs: random_link_split's
properties, the partition format (manifest, shared files, checksums), the CLI flag, the
readers (OGB link datasets in OGB's layout, .npz, PyG, graph directories), the
citation2 presets, and the facts servers and trainers share."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from partitioner.cli import main, parse_link_split
from partitioner.format import load_node_map, read_manifest
from partitioner.graph import (
    PLAIN_EDGE_TYPE,
    EdgeType,
    GraphData,
    GraphDataError,
    LinkSplit,
    TypedGraphData,
    undirected_columns,
)
from partitioner.links import (
    LinkSplitInfo,
    link_split_info,
    load_link_split,
    random_link_split,
    reverse_edge_type,
)
from partitioner.manifest import Manifest, PartitionFormatError
from partitioner.readers.graphdir import read_graph_dir, save_graph_dir
from partitioner.readers.npz import read_npz, write_npz
from partitioner.readers.ogb import DatasetNotFoundError
from partitioner.readers.ogb_links import load_pt_dict, read_ogb_link
from partitioner.readers.pyg import from_pyg
from partitioner.synthetic import PLAIN_PRESETS, generate_plain
from partitioner.synthetic_links import LINK_PRESETS
from partitioner.writer import partition_graph
from protos import sampling_pb2 as pb
from sampling_server.config import ServerConfig
from sampling_server.errors import RequestError
from sampling_server.store import PartitionStore
from tests.fixtures_ogb_links import NUM_NODES, write_citation2, write_collab
from tests.graph_fixtures import KINDS, mixed_graph, mixed_typed, typed_view
from trainer_client.graph import TypedGraph

AnyGraph = GraphData | TypedGraphData
#: The relation each kind's link splits are made on.
SPLIT_TYPE: dict[str, EdgeType] = {"plain": PLAIN_EDGE_TYPE, "typed": ("paper", "has_topic", "topic")}


def source_graph(kind: str) -> AnyGraph:
    """plain: the mixed graph made undirected (both directions stored, a self loop), with
    weights and per-edge features that name the edge's column; typed: the mixed typed
    graph whose ``has_topic`` relation has a reverse relation and such features."""
    if kind == "plain":
        g = mixed_graph()
        edges, cols = undirected_columns(g.edge_index, g.num_nodes)
        assert g.edge_weight is not None
        return dataclasses.replace(g, edge_index=edges, edge_weight=g.edge_weight[cols],
                                   edge_attr=np.arange(2 * edges.shape[1], dtype=np.float32).reshape(-1, 2))
    t = mixed_typed()
    et = SPLIT_TYPE["typed"]
    t.edge_attr = {et: np.arange(t.num_edges(et), dtype=np.int64)}
    return t


def split_of(kind: str, seed: int = 0, negatives: int = 4) -> AnyGraph:
    return random_link_split(source_graph(kind), edge_type=SPLIT_TYPE[kind] if kind == "typed" else None,
                             val=0.15, test=0.2, num_negatives=negatives, seed=seed)


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def split(kind: str) -> AnyGraph:
    return split_of(kind)


def pair_set(src: np.ndarray, dst: np.ndarray) -> set[tuple[int, int]]:
    return set(zip(np.asarray(src).tolist(), np.asarray(dst).tolist(), strict=True))


def negative_pairs(s: LinkSplit) -> set[tuple[int, int]]:
    """Every (source, given negative destination) pair of a split."""
    assert s.neg_dst is not None
    return {(u, int(c)) for u, row in zip(s.src.tolist(), s.neg_dst, strict=True) for c in row}


def undirected(pairs: set[tuple[int, int]]) -> set[tuple[int, int]]:
    return {(min(u, v), max(u, v)) for u, v in pairs}


# -- random_link_split ------------------------------------------------------------------
def test_held_out_edges_and_their_reverses_leave_the_graph(kind: str, split: AnyGraph) -> None:
    typed, et = typed_view(split), SPLIT_TYPE[kind]
    kept = pair_set(*typed.edge_index[et])
    held = pair_set(typed.link_splits["val"].src, typed.link_splits["val"].dst) | \
        pair_set(typed.link_splits["test"].src, typed.link_splits["test"].dst)
    assert held and not held & kept
    reversed_held = {(v, u) for u, v in held}
    rev = reverse_edge_type(typed.edge_index, et)
    if kind == "plain":
        assert rev is None and not reversed_held & kept
    else:
        assert rev == ("topic", "rev_has_topic", "paper")
        assert not reversed_held & pair_set(*typed.edge_index[rev])
        assert pair_set(*typed.edge_index[rev]) == {(v, u) for u, v in kept}  # only the held-out went
    others = [e for e in typed_view(source_graph(kind)).edge_types if e not in (et, rev)]
    for other in others:  # other relations untouched
        np.testing.assert_array_equal(typed.edge_index[other],
                                      typed_view(source_graph(kind)).edge_index[other])


def test_train_val_test_are_the_original_edges(kind: str, split: AnyGraph) -> None:
    typed, et = typed_view(split), SPLIT_TYPE[kind]
    original = pair_set(*typed_view(source_graph(kind)).edge_index[et])
    parts = {name: pair_set(s.src, s.dst) for name, s in typed.link_splits.items()}
    assert set(parts) == {"train", "val", "test"}
    if kind == "plain":  # symmetric: detected undirected, one direction (u <= v) per pair
        original = undirected(original)
        assert all(u <= v for p in parts.values() for u, v in p)
    assert parts["train"] | parts["val"] | parts["test"] == original
    assert sum(len(p) for p in parts.values()) == len(original)  # disjoint, no repeats
    total = len(original)
    assert len(parts["val"]) == round(0.15 * total) and len(parts["test"]) == round(0.2 * total)
    assert pair_set(*typed.edge_index[et]) <= (parts["train"] | {(v, u) for u, v in parts["train"]})


def test_kept_edges_keep_their_weights_and_features(kind: str, split: AnyGraph) -> None:
    before, after, et = typed_view(source_graph(kind)), typed_view(split), SPLIT_TYPE[kind]
    held = pair_set(after.link_splits["val"].src, after.link_splits["val"].dst) | \
        pair_set(after.link_splits["test"].src, after.link_splits["test"].dst)
    if kind == "plain":
        held = held | {(v, u) for u, v in held}
    keep = np.array([(u, v) not in held for u, v in before.edge_index[et].T.tolist()])
    assert 0 < keep.sum() < keep.size
    np.testing.assert_array_equal(after.edge_index[et], before.edge_index[et][:, keep])
    np.testing.assert_array_equal(after.edge_attr[et], before.edge_attr[et][keep])
    np.testing.assert_array_equal(after.edge_weight[et], before.edge_weight[et][keep])
    np.testing.assert_array_equal(after.edge_ids[et], np.flatnonzero(keep))  # their columns in the input
    rev = reverse_edge_type(after.edge_index, et)
    if rev is not None:
        kept_rev = np.array([(v, u) not in held for u, v in before.edge_index[rev].T.tolist()])
        np.testing.assert_array_equal(after.edge_ids[rev], np.flatnonzero(kept_rev))
    again = random_link_split(split, edge_type=et, val=0.1, test=0.1, seed=5)  # IDs survive a second split
    kept = typed_view(again).edge_ids[et]
    assert set(kept.tolist()) < set(after.edge_ids[et].tolist())
    after.validate()


def test_negatives_are_in_range_and_never_true_destinations(kind: str, split: AnyGraph) -> None:
    typed, et = typed_view(split), SPLIT_TYPE[kind]
    original = pair_set(*typed_view(source_graph(kind)).edge_index[et])
    if kind == "plain":
        original |= {(v, u) for u, v in original}
    n_dst = typed.num_nodes[et[2]]
    for name in ("val", "test"):
        s = typed.link_splits[name]
        assert s.neg_dst is not None and s.neg_dst.shape == (s.num_edges, 4) and s.neg_dst.dtype == np.int64
        assert s.neg_dst.min() >= 0 and s.neg_dst.max() < n_dst
        assert not negative_pairs(s) & original
    assert typed.link_splits["train"].neg_dst is None


def test_the_split_is_a_pure_function_of_the_seed(kind: str, split: AnyGraph) -> None:
    same, other = typed_view(split_of(kind)), typed_view(split_of(kind, seed=1))
    for name, s in typed_view(split).link_splits.items():
        for f in ("src", "dst", "neg_dst"):
            a, b = getattr(s, f), getattr(same.link_splits[name], f)
            assert (a is None and b is None) or np.array_equal(a, b)
    assert not np.array_equal(typed_view(split).link_splits["val"].src, other.link_splits["val"].src) or \
        not np.array_equal(typed_view(split).link_splits["val"].dst, other.link_splits["val"].dst)


def test_a_directed_relation_splits_its_distinct_edges() -> None:
    g = mixed_graph()  # directed, with repeated edges: a held-out edge leaves every copy
    out = random_link_split(g, val=0.2, test=0.2, seed=3)
    assert isinstance(out, GraphData)
    held = pair_set(out.link_splits["val"].src, out.link_splits["val"].dst) | \
        pair_set(out.link_splits["test"].src, out.link_splits["test"].dst)
    assert not held & pair_set(*out.edge_index)
    parts = [pair_set(s.src, s.dst) for s in out.link_splits.values()]
    every = pair_set(*g.edge_index)
    assert set().union(*parts) == every and sum(map(len, parts)) == len(every)
    assert any(u > v for u, v in parts[0])  # directed: not canonicalised


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"val": 0.6, "test": 0.5}, r"val/test: expected fractions >= 0 with val \+ test < 1"),
    ({"num_negatives": -1}, r"num_negatives: expected an integer >= 0, got -1"),
    ({"edge_type": ("paper", "nope", "paper")}, r"edge_type: expected one of"),
    ({"edge_type": ("author", "writes", "paper"), "undirected": True},
     r"undirected: only for a relation within one node type"),
])
def test_bad_split_arguments_are_refused_naming_them(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        random_link_split(mixed_typed(), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("change", "match"), [
    ({"edge_type": ("paper", "cites", "topic")}, r"link_splits\['val'\]\.edge_type: expected one of"),
    ({"dst": np.zeros(2, np.int64)}, r"link_splits\['val'\]\.dst: expected shape \[3\] \(as src\)"),
    ({"src": np.array([0, 1, 99])},
     r"link_splits\['val'\]\.src: expected .*IDs in \[0, \d+\), got values in \[0, 99\]"),
    ({"neg_dst": np.zeros((3,), np.int64)},
     r"link_splits\['val'\]\.neg_dst: expected int64 of shape \[3, K\]"),
    ({"label": np.zeros(2)}, r"link_splits\['val'\]\.label: expected numbers of shape \[3, \.\.\.\]"),
    ({"src": np.zeros(3, np.int32)}, r"link_splits\['val'\]\.src: expected 1-D int64"),
])
def test_malformed_link_splits_are_refused_naming_the_field(kind: str, change: dict[str, object],
                                                            match: str) -> None:
    graph = source_graph(kind)
    et = SPLIT_TYPE[kind]
    good = LinkSplit(et, np.array([0, 1, 2]), np.array([1, 2, 3]))
    if kind == "plain" and "edge_type" in change:
        change = {"edge_type": ("_N", "other", "_N")}
    graph.link_splits = {"val": dataclasses.replace(good, **change)}  # type: ignore[arg-type]
    with pytest.raises(GraphDataError, match=match):
        graph.validate()
    graph.link_splits = {"val/x": good}
    with pytest.raises(GraphDataError, match=r"link_splits: expected split names of ASCII letters"):
        graph.validate()


# -- partition format -------------------------------------------------------------------
@pytest.fixture(scope="module")
def parted(kind: str, split: AnyGraph, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("links") / kind
    graph = split
    if kind == "plain":  # a labelled split too, for the label facts
        assert isinstance(graph, GraphData)
        val = graph.link_splits["val"]
        labels = np.stack([np.arange(val.num_edges), -np.arange(val.num_edges)], 1).astype(np.float32)
        graph = dataclasses.replace(graph, link_splits={**graph.link_splits,
                                                        "val": dataclasses.replace(val, label=labels)})
    partition_graph(graph, 2, out, method="random", progress=False)
    return out


def test_partitioned_link_splits_map_back_to_original_ids(kind: str, split: AnyGraph, parted: Path) -> None:
    m = read_manifest(parted)
    typed = typed_view(split)
    assert list(m.link_splits) == list(typed.link_splits)
    for name, s in typed.link_splits.items():
        info = m.link_splits[name]
        assert (info.edge_type, info.num_edges, info.num_negatives) == \
            (s.edge_type, s.num_edges, s.num_negatives)
        arrays = load_link_split(parted, m, name)
        src_t, _, dst_t = s.edge_type
        maps = {t: np.asarray(load_node_map(parted, t if kind == "typed" else None)) for t in (src_t, dst_t)}
        np.testing.assert_array_equal(arrays.src, maps[src_t][s.src])
        np.testing.assert_array_equal(arrays.dst, maps[dst_t][s.dst])
        inverse = np.argsort(maps[dst_t])
        np.testing.assert_array_equal(inverse[arrays.dst], s.dst)  # global -> original
        if s.neg_dst is not None:
            assert arrays.neg_dst is not None
            np.testing.assert_array_equal(inverse[arrays.neg_dst], s.neg_dst)
        assert not arrays.src.flags.writeable
    if kind == "plain":
        val = load_link_split(parted, m, "val")
        assert m.link_splits["val"].label_shape == (2,) and m.link_splits["val"].label_dtype == "float32"
        assert val.label is not None and val.label.shape == (val.num_edges, 2)


def test_stored_edge_ids_are_the_columns_of_the_graph_before_the_split(kind: str, parted: Path) -> None:
    from partitioner.format import load_partition

    before, et = typed_view(source_graph(kind)), SPLIT_TYPE[kind]
    m = read_manifest(parted)
    assert m.edge_types[et] < m.edge_id_bound(et) <= before.num_edges(et)
    src_t, _, dst_t = et
    parts = [load_partition(parted, p) for p in range(2)]
    orig = {t: np.concatenate([part.orig_ids[t] for part in parts]) for t in (src_t, dst_t)}
    seen = []
    for part in parts:
        indptr, e_id = part.indptr[et], part.e_id[et]
        dst = np.repeat(np.arange(part.num_nodes(dst_t)) + part.node_range(dst_t)[0], np.diff(indptr))
        np.testing.assert_array_equal(before.edge_index[et][0, e_id], orig[src_t][part.indices[et]])
        np.testing.assert_array_equal(before.edge_index[et][1, e_id], orig[dst_t][dst])
        np.testing.assert_array_equal(part.edge_attr[et], before.edge_attr[et][e_id])
        seen.append(e_id)
    assert np.unique(np.concatenate(seen)).size == m.edge_types[et]


def test_the_manifest_round_trips_and_old_manifests_hash_as_before(kind: str, parted: Path,
                                                                   tmp_path: Path) -> None:
    m = read_manifest(parted)
    obj = m.to_json()
    assert "link_splits" in obj
    assert Manifest.from_json(json.loads(json.dumps(obj))) == m
    if kind == "plain":
        assert all("edge_type" not in e for e in obj["link_splits"].values())  # v1 names no type
    plain = partition_graph(source_graph(kind), 2, tmp_path / "none", method="random", progress=False)
    assert plain.link_splits == {} and "link_splits" not in plain.to_json()
    assert plain.edge_id_bounds == {} and "num_edge_ids" not in json.dumps(plain.to_json())
    assert m.edge_id_bounds and "num_edge_ids" in json.dumps(obj)
    assert not any(k.startswith("links/") for k in plain.files)


def test_a_corrupted_link_file_is_refused_naming_it(parted: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(parted, copy)
    path = copy / "links" / "test" / "dst.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    m = read_manifest(copy)
    load_link_split(copy, m, "val")  # the other splits still load
    with pytest.raises(PartitionFormatError, match=r"links/test/dst\.npy: SHA-256 mismatch"):
        load_link_split(copy, m, "test")
    assert main(["info", str(copy), "--verify"]) == 2
    assert "links/test/dst.npy" in capsys.readouterr().err
    with pytest.raises(PartitionFormatError, match=r"link split: expected one of .*got 'nope'"):
        load_link_split(copy, m, "nope")


def test_a_manifest_without_a_link_file_is_refused(parted: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(parted, copy)
    obj = json.loads((copy / "manifest.json").read_text())
    del obj["files"]["links/val/neg_dst"]
    (copy / "manifest.json").write_text(json.dumps(obj))
    with pytest.raises(PartitionFormatError,
                       match=r"files: expected 'links/val/neg_dst' \(link split 'val'\)"):
        read_manifest(copy)


# -- CLI --------------------------------------------------------------------------------
def test_the_cli_splits_before_partitioning_and_info_shows_it(kind: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "g.npz"
    write_npz(source_graph(kind), source)
    spec = "val=0.1,test=0.2,neg=3,seed=4" + (",edge-type=paper__has_topic__topic" if kind == "typed" else "")
    out = tmp_path / "out"
    assert main(["partition", "--npz", str(source), "--link-split", spec, "--num-parts", "2", "--method",
                 "random", "--out", str(out), "--no-progress"]) == 0
    m = read_manifest(out)
    assert set(m.link_splits) == {"train", "val", "test"} and m.link_splits["val"].num_negatives == 3
    assert m.algorithm["link_split"] == spec
    capsys.readouterr()
    assert main(["info", str(out), "--verify"]) == 0
    text = capsys.readouterr().out
    assert "link splits: 3" in text and "3 negatives each" in text
    assert ("paper/has_topic/topic" in text) == (kind == "typed")
    again = random_link_split(read_npz(source), val=0.1, test=0.2, num_negatives=3, seed=4,
                              edge_type=SPLIT_TYPE[kind] if kind == "typed" else None)
    val = load_link_split(out, m, "val")
    src_t = SPLIT_TYPE[kind][0]
    node_map = np.asarray(load_node_map(out, src_t if kind == "typed" else None))
    np.testing.assert_array_equal(val.src, node_map[typed_view(again).link_splits["val"].src])


@pytest.mark.parametrize(("spec", "match"), [
    ("val=x", r"--link-split: 'val': could not convert"),
    ("neg=1.5", r"--link-split: 'neg'"),
    ("folds=3", r"--link-split: 'folds': expected one of val, test, neg, edge-type, seed, undirected"),
    ("edge-type=a__b", r"--link-split: 'edge-type': edge type: expected 'src__relation__dst'"),
    ("undirected=maybe", r"--link-split: 'undirected': expected true or false"),
    ("val", r"--link-split: 'val': expected key=value"),
])
def test_a_malformed_link_split_flag_is_refused_naming_the_key(spec: str, match: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["partition", "--synthetic", "small", "--link-split", spec, "--num-parts", "2", "--out",
                 str(tmp_path / "o")])
    assert code == 2
    import re

    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_parse_link_split_gives_random_link_split_arguments() -> None:
    assert parse_link_split("val=0.1, test=0.2,neg=5,edge-type=a__r__b,undirected=false", seed=7) == {
        "seed": 7, "val": 0.1, "test": 0.2, "num_negatives": 5, "edge_type": ("a", "r", "b"),
        "undirected": False}


# -- graph directories, npz, PyG --------------------------------------------------------
def _assert_same_links(a: AnyGraph, b: AnyGraph) -> None:
    ta, tb = typed_view(a), typed_view(b)
    assert ta.edge_ids.keys() == tb.edge_ids.keys()
    for et, ids in ta.edge_ids.items():
        np.testing.assert_array_equal(ids, tb.edge_ids[et])
    assert a.link_splits.keys() == b.link_splits.keys()
    for name, s in a.link_splits.items():
        t = b.link_splits[name]
        assert s.edge_type == t.edge_type
        for f in ("src", "dst", "neg_dst", "label"):
            x, y = getattr(s, f), getattr(t, f)
            assert (x is None and y is None) or np.array_equal(x, y), (name, f)


def test_graph_directories_keep_link_splits_for_the_streaming_path(kind: str, split: AnyGraph,
                                                                   tmp_path: Path) -> None:
    save_graph_dir(split, tmp_path / "g")
    back = read_graph_dir(tmp_path / "g")
    _assert_same_links(split, back)
    assert main(["partition", "--graph-dir", str(tmp_path / "g"), "--num-parts", "2", "--method", "range",
                 "--out", str(tmp_path / "p"), "--no-progress"]) == 0
    want = {n: link_split_info(s) for n, s in split.link_splits.items()}
    assert read_manifest(tmp_path / "p").link_splits == want


def test_npz_archives_round_trip_link_splits(kind: str, split: AnyGraph, tmp_path: Path) -> None:
    write_npz(split, tmp_path / "g.npz")
    _assert_same_links(split, read_npz(tmp_path / "g.npz"))


def test_an_npz_with_link_splits_and_no_labels_is_a_link_graph(kind: str, split: AnyGraph,
                                                                tmp_path: Path) -> None:
    """Link graphs need no node labels (nor node splits): an archive without ``y`` is read
    as one, every node unlabeled, and partitions; without link splits it still needs ``y``,
    and the error lists every key the file has."""
    write_npz(split, tmp_path / "g.npz")
    with np.load(tmp_path / "g.npz") as npz:
        arrays = {k: npz[k] for k in npz.files
                  if k.partition("__")[0] != "y" and k != "num_classes" and not k.endswith("_idx")}
    np.savez(tmp_path / "links.npz", **arrays)  # type: ignore[arg-type]
    read = read_npz(tmp_path / "links.npz")
    _assert_same_links(split, read)
    assert (typed_view(read).y == -1).all() and read.num_classes == 1 and not read.splits
    assert typed_view(read).target_type == SPLIT_TYPE[kind][2]
    assert main(["partition", "--npz", str(tmp_path / "links.npz"), "--num-parts", "2", "--method", "range",
                 "--out", str(tmp_path / "p"), "--no-progress"]) == 0
    assert set(read_manifest(tmp_path / "p").link_splits) == set(split.link_splits)
    node_keys = {k: v for k, v in arrays.items() if not re.match(r".*_(pos|neg|neg_dst|label)(__|$)", k)}
    np.savez(tmp_path / "nothing.npz", **node_keys)  # type: ignore[arg-type]
    with pytest.raises(GraphDataError, match="y") as refused:
        read_npz(tmp_path / "nothing.npz")
    assert f"the file has the keys {sorted(node_keys)}" in str(refused.value)


def test_npz_link_keys_as_documented(tmp_path: Path) -> None:
    g = mixed_graph()
    arrays = {"edge_index": g.edge_index, "x": g.x, "y": g.y,
              "train_pos": np.array([[0, 1], [1, 2], [2, 3]]),  # [E, 2]
              "val_pos": np.array([[4, 5], [6, 7]]), "val_neg_dst": np.array([[9, 10, 11], [12, 13, 14]]),
              "val_neg": np.array([[1, 2, 3], [8, 9, 10]]), "test_pos": np.array([[3], [4]]),
              "test_label": np.array([1.5])}
    np.savez(tmp_path / "l.npz", **arrays)  # type: ignore[arg-type]
    out = read_npz(tmp_path / "l.npz")
    assert set(out.link_splits) == {"train", "val", "val_neg", "test"}
    assert pair_set(out.link_splits["train"].src, out.link_splits["train"].dst) == {(0, 1), (1, 2), (2, 3)}
    assert out.link_splits["val"].neg_dst.tolist() == [[9, 10, 11], [12, 13, 14]]  # type: ignore[union-attr]
    assert out.link_splits["val_neg"].src.tolist() == [1, 2, 3]
    assert out.link_splits["test"].label.tolist() == [1.5]  # type: ignore[union-attr]
    np.savez(tmp_path / "bad.npz", **{**arrays, "val_neg_dst": np.zeros((3, 2), np.int64)})  # type: ignore[arg-type]
    with pytest.raises(GraphDataError,
                       match=r"link_splits\['val'\]\.neg_dst: expected int64 of shape \[2, K\]"):
        read_npz(tmp_path / "bad.npz")


def test_a_typed_npz_link_key_must_name_its_edge_type(tmp_path: Path) -> None:
    write_npz(mixed_typed(), tmp_path / "t.npz")
    with np.load(tmp_path / "t.npz") as npz:
        arrays = dict(npz)
    np.savez(tmp_path / "t2.npz", **arrays, val_pos=np.array([[0], [1]]))  # type: ignore[arg-type]
    with pytest.raises(GraphDataError,
                       match=r"val_pos: link keys of a typed graph end in __<src>__<rel>__<dst>"):
        read_npz(tmp_path / "t2.npz")


def test_pyg_graphs_bring_their_link_splits(kind: str) -> None:
    from torch_geometric.data import Data, HeteroData

    pos, neg = torch.tensor([[1, 2], [3, 4]]), torch.tensor([[0], [5]])
    data: Data | HeteroData
    if kind == "plain":
        data = Data(x=torch.randn(10, 3), edge_index=torch.tensor([[0, 1], [1, 2]]),
                    y=torch.zeros(10, dtype=torch.long),
                    val_pos_edge_index=pos, val_neg_edge_index=neg)
    else:
        data = HeteroData()
        data["p"].x, data["p"].y = torch.randn(10, 3), torch.zeros(10, dtype=torch.long)
        data["a"].num_nodes = 8
        data["a", "w", "p"].edge_index = torch.tensor([[0, 1], [1, 2]])
        data["a", "w", "p"].val_pos_edge_index = pos
        data["a", "w", "p"].val_neg_edge_index = neg
    graph = from_pyg(data)
    links = graph.link_splits
    assert set(links) == {"val", "val_neg"}
    assert pair_set(links["val"].src, links["val"].dst) == {(1, 3), (2, 4)}
    assert pair_set(links["val_neg"].src, links["val_neg"].dst) == {(0, 5)}
    assert links["val"].edge_type == (PLAIN_EDGE_TYPE if kind == "plain" else ("a", "w", "p"))


# -- OGB link datasets ------------------------------------------------------------------
def test_ogbl_citation2_in_its_layout(tmp_path: Path) -> None:
    fx = write_citation2(tmp_path)
    g = read_ogb_link("ogbl-citation2", tmp_path)
    np.testing.assert_array_equal(g.edge_index, fx.train)  # the train edges, directed
    np.testing.assert_array_equal(g.x, fx.x)
    assert g.num_nodes == NUM_NODES and (g.y == -1).all()
    for name, stem in (("train", "train"), ("val", "valid"), ("test", "test")):
        s, d = g.link_splits[name], fx.splits[stem]
        np.testing.assert_array_equal(s.src, d["source_node"])
        np.testing.assert_array_equal(s.dst, d["target_node"])
        if name == "train":
            assert s.neg_dst is None
        else:
            np.testing.assert_array_equal(s.neg_dst, d["target_node_neg"])  # type: ignore[arg-type]
    both = read_ogb_link("ogbl-citation2", tmp_path, to_undirected=True)
    assert pair_set(*both.edge_index) == pair_set(*fx.train) | {(v, u) for u, v in pair_set(*fx.train)}
    out = tmp_path / "parts"
    partition_graph(g, 2, out, method="random", progress=False)
    m = read_manifest(out)
    assert m.link_splits["test"].num_negatives == 7
    node_map = np.asarray(load_node_map(out))
    test = load_link_split(out, m, "test")
    np.testing.assert_array_equal(test.neg_dst, node_map[fx.splits["test"]["target_node_neg"]])  # type: ignore[arg-type]


def test_ogbl_collab_in_its_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fx = write_collab(tmp_path)
    assert main(["partition", "--ogb", "ogbl-collab", "--ogb-root", str(tmp_path), "--num-parts", "2",
                 "--method", "random", "--out", str(tmp_path / "p"), "--no-progress"]) == 0
    g = read_ogb_link("ogbl-collab", tmp_path)
    # undirected as ogb mirrors it: edge 2i the stored one, 2i + 1 its reverse, with its weight
    np.testing.assert_array_equal(g.edge_index[:, 0::2], fx.train)
    np.testing.assert_array_equal(g.edge_index[:, 1::2], fx.train[::-1])
    assert fx.weight is not None and g.edge_weight is not None
    np.testing.assert_array_equal(g.edge_weight, np.repeat(fx.weight, 2).astype(np.float32))
    assert set(g.link_splits) == {"train", "val", "val_neg", "test", "test_neg"}
    for name, stem, key in (("train", "train", "edge"), ("val", "valid", "edge"),
                            ("val_neg", "valid", "edge_neg"), ("test", "test", "edge"),
                            ("test_neg", "test", "edge_neg")):
        s = g.link_splits[name]
        np.testing.assert_array_equal(np.stack([s.src, s.dst], 1), fx.splits[stem][key])
    assert set(read_manifest(tmp_path / "p").link_splits) == set(g.link_splits)


def test_ogb_link_files_are_never_unpickled(tmp_path: Path) -> None:
    fx = write_citation2(tmp_path)
    path = fx.path / "split" / "time" / "valid.pt"
    torch.save({"source_node": Fraction(1, 2)}, path)  # an arbitrary Python object
    with pytest.raises(GraphDataError,
                       match=r"valid\.pt: expected a dict of arrays readable without unpickling"):
        read_ogb_link("ogbl-citation2", tmp_path)
    path.write_bytes(pickle.dumps({"source_node": [1]}))  # a bare pickle, not torch.save's zip
    with pytest.raises(GraphDataError, match=r"valid\.pt"):
        load_pt_dict(path)
    torch.save({"source_node": torch.arange(3), "target_node": np.arange(3)}, path)  # tensors read too
    assert load_pt_dict(path)["source_node"].tolist() == [0, 1, 2]


def test_a_missing_ogb_link_file_is_named(tmp_path: Path) -> None:
    fx = write_collab(tmp_path)
    (fx.path / "split" / "time" / "test.pt").unlink()
    with pytest.raises(DatasetNotFoundError, match=r"split/time/test\.pt"):
        read_ogb_link("ogbl-collab", tmp_path)
    with pytest.raises(GraphDataError, match=r"name: expected one of the OGB link datasets"):
        read_ogb_link("ogbl-ppa", tmp_path)


# -- presets ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def citation2() -> GraphData:
    return generate_plain("citation2-small", progress=False)


def test_citation2_small_has_its_sizes_and_no_leak(citation2: GraphData) -> None:
    p = LINK_PRESETS["citation2-small"]
    assert PLAIN_PRESETS["citation2-small"] is p and "citation2-like" in PLAIN_PRESETS
    links = citation2.link_splits
    assert {k: v.num_edges for k, v in links.items()} == {
        "train": p.num_citations - 2 * p.held_out, "val": p.held_out, "test": p.held_out}
    assert citation2.num_nodes == p.num_nodes and citation2.x.shape == (p.num_nodes, p.feature_dim)
    assert citation2.num_edges == 2 * links["train"].num_edges  # both directions
    degree = citation2.num_edges / citation2.num_nodes
    assert 10 <= degree <= 20
    graph_pairs = pair_set(*citation2.edge_index)
    for name in ("val", "test"):
        s = links[name]
        assert s.neg_dst is not None and s.neg_dst.shape == (p.held_out, p.num_negatives)
        held = pair_set(s.src, s.dst)
        assert not held & graph_pairs and not {(v, u) for u, v in held} & graph_pairs
    assert (links["train"].src > links["train"].dst).all()  # a paper cites older papers
    cited = pair_set(*np.concatenate([np.stack([s.src, s.dst]) for s in links.values()], 1))
    val = links["val"]
    assert not negative_pairs(val) & cited


def test_citation2_small_links_are_learnable(citation2: GraphData) -> None:
    """Features alone rank a held-out citation well above random papers; one round of
    neighbor averaging (what a GNN layer does) ranks it far higher still."""
    x = citation2.x / np.linalg.norm(citation2.x, axis=1, keepdims=True)
    val = citation2.link_splits["val"]
    assert val.neg_dst is not None
    k = val.neg_dst.shape[1]
    random_mrr = float(np.mean(1.0 / np.arange(1, k + 2)))

    def mrr(h: np.ndarray) -> float:
        pos = (h[val.src] * h[val.dst]).sum(1)
        neg = np.einsum("ef,ekf->ek", h[val.src], h[val.neg_dst])
        return float(np.mean(1.0 / (1 + (neg >= pos[:, None]).sum(1))))

    pos_cos = (x[val.src] * x[val.dst]).sum(1).mean()
    neg_cos = np.einsum("ef,ekf->ek", x[val.src], x[val.neg_dst]).mean()
    assert pos_cos > neg_cos + 0.1
    features = mrr(x)
    sums = np.zeros_like(citation2.x)
    np.add.at(sums, citation2.edge_index[1], citation2.x[citation2.edge_index[0]])
    degree = np.bincount(citation2.edge_index[1], minlength=citation2.num_nodes)
    h = citation2.x + sums / np.maximum(degree, 1)[:, None]
    structure = mrr(h / np.linalg.norm(h, axis=1, keepdims=True))
    assert features > 2 * random_mrr and structure > features + 0.1, (random_mrr, features, structure)


def test_citation2_small_is_reproducible(citation2: GraphData) -> None:
    again = generate_plain("citation2-small", progress=False)
    np.testing.assert_array_equal(again.edge_index, citation2.edge_index)
    np.testing.assert_array_equal(again.x, citation2.x)
    _assert_same_links(again, citation2)
    other = generate_plain("citation2-small", seed=1, progress=False)
    assert not np.array_equal(other.link_splits["val"].src, citation2.link_splits["val"].src)


def test_citation2_like_has_ogbl_citation2s_shape() -> None:
    p = LINK_PRESETS["citation2-like"]
    assert (p.num_nodes, p.num_citations, p.feature_dim, p.held_out, p.num_negatives) == (
        2_927_963, 30_561_187, 128, 86_956, 1000)


# -- servers and trainers ---------------------------------------------------------------
def test_the_store_and_cluster_info_tell_the_link_splits(kind: str, parted: Path) -> None:
    m = read_manifest(parted)
    store = PartitionStore(ServerConfig(partition_dir=parted, partition=1, device="cpu",
                                        peers=("127.0.0.1:1", "127.0.0.1:2")))
    store.load()
    assert store.link_splits == m.link_splits
    val = store.link_split("val")
    assert store.link_split("val") is val  # loaded once
    np.testing.assert_array_equal(val.dst, load_link_split(parted, m, "val").dst)
    with pytest.raises(RequestError,
                       match=r"link split: expected one of \['test', 'train', 'val'\], got 'x'"):
        store.link_split("x")
    info = store.cluster_info()
    by_name = {ls.name: ls for ls in info.link_splits}
    assert set(by_name) == set(m.link_splits)
    assert by_name["val"].edge_type == ("" if kind == "plain" else "paper__has_topic__topic")
    assert by_name["val"].num_negatives == 4 and by_name["train"].num_negatives == 0
    facts = TypedGraph.from_info(info).link_splits
    assert facts["test"].edge_type == m.link_splits["test"].edge_type
    assert facts["test"].num_edges == m.link_splits["test"].num_edges and facts["test"].label_dtype is None
    if kind == "plain":
        assert by_name["val"].label_dtype == pb.FLOAT32 and list(by_name["val"].label_shape) == [2]
        assert facts["val"].label_dtype == torch.float32 and facts["val"].label_shape == (2,)
    else:
        assert by_name["val"].label_dtype == pb.DTYPE_UNSPECIFIED


def test_link_split_info_is_what_the_manifest_records() -> None:
    s = LinkSplit(PLAIN_EDGE_TYPE, np.arange(3), np.arange(3), label=np.zeros((3, 2, 2), np.int16),
                  neg_dst=np.zeros((3, 5), np.int64))
    assert link_split_info(s) == LinkSplitInfo(PLAIN_EDGE_TYPE, 3, 5, (2, 2), "int16")
