"""Partition formats v1 (plain graphs) and v2 (typed graphs), one writer: every method's
output reassembles into exactly the input graph of either kind, edge weights, edge IDs and
edge features included; the streaming path (memory-mapped sources, small chunks) writes
the same bytes; and manifests round-trip byte for byte. (The reader's refusals:
test_partition_reader.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from partitioner.algorithms import METHODS, assign
from partitioner.format import MANIFEST_FILE, Manifest, load_partition, read_manifest
from partitioner.graph import SPLITS, GraphData, GraphDataError, TypedGraphData
from partitioner.manifest import read_format_version
from partitioner.npyio import _memmap_source
from partitioner.partition import Partition
from partitioner.readers.graphdir import read_graph_dir, save_graph_dir
from partitioner.synthetic import generate
from partitioner.writer import partition_graph, write_partitions
from tests.edge_fixtures import check_edge_data, with_edge_attr
from tests.graph_fixtures import HUB, NUM_ISOLATED, AnyGraph, check_node_maps, mixed, typed_view


def sorted_rows(*columns: np.ndarray) -> np.ndarray:
    """The rows ``(c0, c1, ...)`` sorted lexicographically: a canonical multiset."""
    stacked = np.stack([np.asarray(c, dtype=np.float64) for c in columns], axis=1)
    return stacked[np.lexsort(tuple(stacked[:, i] for i in reversed(range(stacked.shape[1]))))]


def expected_assignment(graph: AnyGraph, num_parts: int, method: str) -> dict[str, np.ndarray]:
    """Per node type, the partition ``method`` gives each node (a typed graph's on its
    homogeneous view, as the writer does)."""
    if isinstance(graph, GraphData):
        return {typed_view(graph).target_type: assign(graph, num_parts, method, progress=False)}
    whole, offsets = assign(graph.to_homogeneous(), num_parts, method, progress=False), graph.node_offsets()
    return {t: whole[offsets[t]:offsets[t] + n] for t, n in graph.num_nodes.items()}


def check_round_trip(graph: AnyGraph, root: Path, num_parts: int, method: str | None = None) -> None:
    """Reassemble every partition under ``root`` and compare with ``graph``, type by type
    (and the assignment with ``method``'s, when given)."""
    typed = typed_view(graph)
    m = read_manifest(root)
    parts = [load_partition(root, p) for p in range(m.num_partitions)]
    assert m.num_partitions == num_parts == len(parts)
    assert m.typed == typed.typed and read_format_version(root) == (2 if typed.typed else 1)
    maps = check_node_maps(root, parts)
    part_of = _check_books(typed, m, parts, maps)
    if method is not None:
        for t, want in expected_assignment(graph, num_parts, method).items():
            np.testing.assert_array_equal(part_of[t], want)
    orig = {t: np.concatenate([np.asarray(p.orig_ids[t]) for p in parts]) for t in typed.node_types}
    for et in typed.edge_types:
        _check_relation(typed, et, parts, orig)
    _check_node_data(typed, parts, maps)
    _check_manifest_facts(typed, m, parts, part_of)
    check_edge_data(graph, parts)
    assert m.algorithm.get("method") == method or method is None


def _check_books(typed: TypedGraphData, m: Manifest, parts: list[Partition],
                 maps: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per type: P+1 offsets from 0 to N_t, one contiguous range a partition; node maps
    (original -> global) and orig_ids (global -> original) inverse permutations. Returns
    each type's partition of every original ID."""
    part_of = {}
    for t, n in typed.num_nodes.items():
        book = np.asarray(m.partition_book[t])
        assert book.shape == (len(parts) + 1,) and book[0] == 0 and book[-1] == n
        assert (np.diff(book) >= 0).all()
        for p, part in enumerate(parts):
            np.testing.assert_array_equal(part.partition_book[t], book)
            assert part.node_range(t) == (book[p], book[p + 1])
        np.testing.assert_array_equal(np.sort(maps[t]), np.arange(n))
        orig = np.concatenate([np.asarray(p.orig_ids[t]) for p in parts])
        np.testing.assert_array_equal(maps[t][orig], np.arange(n))
        part_of[t] = np.searchsorted(book, maps[t], side="right") - 1
    return part_of


def _check_relation(typed: TypedGraphData, et: tuple[str, str, str], parts: list[Partition],
                    orig: dict[str, np.ndarray]) -> None:
    """CSC of ``et`` in every partition; every input edge exactly once, with its weight."""
    s, _, d = et
    src, dst, weights = [], [], []
    for part in parts:
        start, stop = part.node_range(d)
        indptr, indices = np.asarray(part.indptr[et]), np.asarray(part.indices[et])
        assert indptr.shape == (stop - start + 1,) and indptr[0] == 0 and indptr[-1] == indices.size
        assert (np.diff(indptr) >= 0).all() and indices.dtype == np.int64
        assert ((indices >= 0) & (indices < typed.num_nodes[s])).all()
        src.append(orig[s][indices])
        dst.append(orig[d][start + np.repeat(np.arange(stop - start), np.diff(indptr))])
        assert (et in part.edge_weight) == (et in typed.edge_weight)
        if et in typed.edge_weight:
            assert part.edge_weight[et].dtype == np.float32 and part.edge_weight[et].shape == indices.shape
            weights.append(np.asarray(part.edge_weight[et]))
    ei = typed.edge_index[et]
    have = [np.concatenate(src), np.concatenate(dst), *([np.concatenate(weights)] if weights else [])]
    want = [ei[0], ei[1], *([typed.edge_weight[et]] if et in typed.edge_weight else [])]
    np.testing.assert_array_equal(sorted_rows(*have), sorted_rows(*want))


def _check_node_data(typed: TypedGraphData, parts: list[Partition], maps: dict[str, np.ndarray]) -> None:
    """Features per type (same dtype; none for featureless types), labels, and each split:
    the partitions' shares are disjoint, sorted, and their union is the input split."""
    for t in typed.node_types:
        assert all((t in p.x) == (t in typed.x) for p in parts)
        if t in typed.x:
            x = np.concatenate([np.asarray(p.x[t]) for p in parts])
            assert x.dtype == typed.x[t].dtype
            np.testing.assert_array_equal(x[maps[t]], typed.x[t])
    target = typed.target_type
    y = np.concatenate([np.asarray(p.y) for p in parts])
    assert y.dtype == np.int64
    np.testing.assert_array_equal(y[maps[target]], typed.y)
    orig = np.concatenate([np.asarray(p.orig_ids[target]) for p in parts])
    for split in SPLITS:
        assert all((np.diff(p.splits[split]) > 0).all() for p in parts)
        union = np.concatenate([orig[np.asarray(p.splits[split])] for p in parts])
        assert np.unique(union).size == union.size, f"{split}: a node is in two partitions"
        np.testing.assert_array_equal(np.sort(union), np.sort(typed.splits[split]))


def _check_manifest_facts(typed: TypedGraphData, m: Manifest, parts: list[Partition],
                          part_of: dict[str, np.ndarray]) -> None:
    """The manifest's sizes per type, with the edge cut computed from the input edges."""
    assert m.target_type == typed.target_type and m.num_classes == typed.num_classes
    assert {t: i.num_nodes for t, i in m.node_types.items()} == typed.num_nodes
    assert {t: (i.feature_dim, i.feature_dtype) for t, i in m.node_types.items()} == {
        t: (typed.feature_dim(t), typed.x[t].dtype.name if t in typed.x else "") for t in typed.node_types}
    assert m.edge_types == {et: typed.num_edges(et) for et in typed.edge_types}
    assert m.weighted == frozenset(typed.edge_weight) and m.num_edges == typed.num_edges()
    for et, ei in typed.edge_index.items():
        dst_part = part_of[et[2]][ei[1]]
        cut = part_of[et[0]][ei[0]] != dst_part
        assert m.edge_cut(et) == int(cut.sum())
        remote = np.bincount(dst_part[cut], minlength=len(parts))
        in_edges = np.bincount(dst_part, minlength=len(parts))
        for p, (info, part) in enumerate(zip(m.partitions, parts, strict=True)):
            assert info.num_edges[et] == part.num_edges(et) == in_edges[p]
            assert info.num_remote_edges[et] == remote[p]
    for p, (info, part) in enumerate(zip(m.partitions, parts, strict=True)):
        assert info.id == p and info.num_nodes == {t: part.num_nodes(t) for t in typed.node_types}
        assert info.split_sizes == {s: int(part.splits[s].size) for s in SPLITS}


@pytest.mark.parametrize("num_parts", [1, 2, 3])
@pytest.mark.parametrize("method", METHODS)
def test_round_trip_reassembles_the_input_graph(tmp_path: Path, kind: str, method: str,
                                                 num_parts: int) -> None:
    graph = mixed(kind)
    manifest = partition_graph(graph, num_parts, tmp_path, method=method, progress=False)
    assert manifest == read_manifest(tmp_path)
    check_round_trip(graph, tmp_path, num_parts, method)


@pytest.mark.parametrize("method", METHODS)
def test_round_trip_carries_edge_ids_and_features(tmp_path: Path, kind: str, method: str) -> None:
    """Every in-edge's e_id names its input edge and its edge_attr row is that edge's, for
    features of several widths and dtypes (and a relation without any)."""
    graph = with_edge_attr(mixed(kind))
    manifest = partition_graph(graph, 3, tmp_path, method=method, progress=False)
    assert manifest == read_manifest(tmp_path)
    check_round_trip(graph, tmp_path, 3, method)


#: Edge features of other dtypes and widths, as a function of the number of edges.
EDGE_ATTRS = {
    "bool": lambda e: np.arange(e) % 3 == 0,
    "uint8-4": lambda e: (np.arange(4 * e) % 251).astype(np.uint8).reshape(e, 4),
    "float64-1": lambda e: np.linspace(-1.0, 1.0, e)[:, None],
    "int32": lambda e: np.arange(e, dtype=np.int32)[::-1].copy(),
    "float16-5": lambda e: np.random.default_rng(0).standard_normal((e, 5)).astype(np.float16),
}


@pytest.mark.parametrize("attr", EDGE_ATTRS)
def test_edge_features_of_any_dtype_and_width_round_trip(tmp_path: Path, kind: str, attr: str) -> None:
    graph = mixed(kind, weighted=False)
    typed = typed_view(graph)
    et = typed.edge_types[0]
    features = EDGE_ATTRS[attr](typed.num_edges(et))
    if isinstance(graph, GraphData):
        graph.edge_attr = features
    else:
        graph.edge_attr = {et: features}
    manifest = partition_graph(graph, 2, tmp_path, method="hash", progress=False)
    assert manifest.edge_feature_dtypes == {et: features.dtype.name}
    assert manifest.edge_feature_shapes == {et: features.shape[1:]}
    assert manifest.edge_feature_dims == {et: int(np.prod(features.shape[1:]))}
    check_round_trip(graph, tmp_path, 2, "hash")


def test_round_trip_float16_features_without_weights(tmp_path: Path, kind: str) -> None:
    """A graph without edge weights writes no weight files; float16 features stay float16."""
    graph = mixed(kind, weighted=False, seed=3)
    typed = typed_view(graph)
    for t in typed.x:
        typed.x[t] = typed.x[t].astype(np.float16)
    if isinstance(graph, GraphData):
        graph.x = typed.x[typed.target_type]
    manifest = partition_graph(graph, 2, tmp_path, method="random", progress=False)
    assert not manifest.weighted and set(manifest.feature_dtypes.values()) == {"float16"}
    assert not list(tmp_path.rglob("edge_weight.npy"))
    check_round_trip(graph, tmp_path, 2, "random")


def _fixed(graph: AnyGraph, rule: str) -> dict[str, np.ndarray]:
    """A hand-made assignment per node type: ``random`` over 3 parts, or ``last`` (the
    typed graph's last 25 papers, or the plain graph's isolated nodes, in partition 1)."""
    typed, gen = typed_view(graph), np.random.default_rng(0)
    if rule == "random":
        return {t: gen.integers(0, 3, n) for t, n in typed.num_nodes.items()}
    out = {t: np.zeros(n, dtype=np.int64) for t, n in typed.num_nodes.items()}
    out[typed.target_type][-(25 if typed.typed else NUM_ISOLATED):] = 1
    return out


def test_in_edges_keep_input_order_for_a_fixed_assignment(tmp_path: Path, kind: str) -> None:
    graph = mixed(kind)
    typed = typed_view(graph)
    part_of = _fixed(graph, "random")
    given = part_of if typed.typed else part_of[typed.target_type]  # a plain graph: one array
    m = write_partitions(graph, given, tmp_path, num_parts=3, progress=False)
    check_round_trip(graph, tmp_path, 3)
    maps = check_node_maps(tmp_path, [load_partition(tmp_path, p) for p in range(3)])
    et = typed.edge_types[0]  # the relation into the hub (a plain graph's one)
    s, _, d = et
    ei, w = typed.edge_index[et], typed.edge_weight[et]
    part = load_partition(tmp_path, int(part_of[d][HUB]))
    local = maps[d][HUB] - part.node_range(d)[0]
    span = slice(part.indptr[et][local], part.indptr[et][local + 1])
    np.testing.assert_array_equal(part.indices[et][span], maps[s][ei[0][ei[1] == HUB]])
    np.testing.assert_array_equal(part.edge_weight[et][span], w[ei[1] == HUB])
    assert m.edge_cut(et) == int((part_of[s][ei[0]] != part_of[d][ei[1]]).sum())


def test_a_partition_may_own_no_in_edges_of_a_relation(tmp_path: Path, kind: str) -> None:
    """A typed partition without authors or topics holds empty CSCs of the relations into
    them; a plain partition of isolated nodes holds no in-edges at all."""
    graph = mixed(kind)
    typed = typed_view(graph)
    part_of = _fixed(graph, "last")
    write_partitions(graph, part_of, tmp_path, num_parts=2, progress=False)
    p1 = load_partition(tmp_path, 1)
    if typed.typed:
        assert p1.num_nodes("author") == 0 and p1.num_nodes("paper") == 25
        assert p1.indptr[("paper", "has_topic", "topic")].tolist() == [0]
    else:
        assert p1.num_nodes(typed.target_type) == NUM_ISOLATED
        assert p1.indptr[typed.edge_types[0]].tolist() == [0] * (NUM_ISOLATED + 1)
    assert any(p1.num_edges(et) == 0 for et in typed.edge_types)
    check_round_trip(graph, tmp_path, 2)


def test_writer_refuses_bad_assignments(tmp_path: Path, kind: str) -> None:
    graph = mixed(kind)
    typed = typed_view(graph)
    good = {t: np.zeros(n, dtype=np.int64) for t, n in typed.num_nodes.items()}
    t = "author" if typed.typed else typed.target_type
    name = re.escape(f"part_of['{t}']" if typed.typed else "part_of")
    with pytest.raises(ValueError, match=rf"{name}: expected integers of shape \[{typed.num_nodes[t]}\]"):
        write_partitions(graph, {**good, t: good[t][:3]}, tmp_path / "a", num_parts=1, progress=False)
    with pytest.raises(ValueError, match=rf"{name}: expected partition IDs >= 0 in \[0, 1\)"):
        write_partitions(graph, {**good, t: good[t] + 1}, tmp_path / "b", num_parts=1, progress=False)
    with pytest.raises(ValueError, match="must own at least one node"):
        write_partitions(graph, good, tmp_path / "c", num_parts=2, progress=False)
    with pytest.raises(ValueError, match="expected one array per node type"):
        write_partitions(graph, {"nope": good[t]}, tmp_path / "d", num_parts=1, progress=False)
    assert not list(tmp_path.rglob(MANIFEST_FILE))


@pytest.mark.parametrize("method", [*METHODS, "fixed"])
def test_out_of_range_ids_are_refused_naming_the_relation(tmp_path: Path, kind: str, method: str) -> None:
    """Checked before assigning or writing: an ID past its type's count would otherwise
    be read and written out of bounds (METIS crashes the process)."""
    graph = mixed(kind)
    if isinstance(graph, GraphData):
        graph.edge_index[0, 3] = graph.num_nodes + 5
        needle = rf"edge_index: expected node IDs in \[0, {graph.num_nodes}\)"
    else:
        graph.edge_index[("paper", "has_topic", "topic")][1, 0] = 12
        needle = r"has_topic.*expected destination IDs of 'topic' in \[0, 12\)"
    with pytest.raises(GraphDataError, match=needle):
        if method == "fixed":
            write_partitions(graph, _fixed(graph, "last"), tmp_path, num_parts=2, progress=False)
        else:
            partition_graph(graph, 2, tmp_path, method=method, progress=False)
    assert not (tmp_path / MANIFEST_FILE).exists()


# ---------------------------------------------------------------- streaming, manifests


def recorded_files(manifest: Manifest) -> list[str]:
    return sorted(rec.path for rec in manifest.records())


def assert_same_output(a: Path, b: Path) -> None:
    """The two partition directories hold byte-identical files and equal manifests (the
    elapsed seconds aside)."""
    ma, mb = read_manifest(a), read_manifest(b)
    names = recorded_files(ma)
    assert names == recorded_files(mb)
    assert sorted(p.relative_to(a).as_posix() for p in a.rglob("*.npy")) == names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ja, jb = ma.to_json(), mb.to_json()
    for j in (ja, jb):
        j["algorithm"] = {k: v for k, v in j["algorithm"].items() if "seconds" not in k}
    assert ja == jb


def memory_mapped(graph: AnyGraph, graph_dir: Path) -> AnyGraph:
    """``graph`` written as a graph directory and read back as whole-file memory maps (the
    writer's out-of-core path: ``pread`` of the mapped files)."""
    save_graph_dir(graph, graph_dir)
    mapped = read_graph_dir(graph_dir, mmap=True)
    typed = typed_view(mapped)
    for array in [*typed.edge_index.values(), *typed.edge_weight.values(), *typed.edge_attr.values(),
                  *typed.x.values()]:
        assert _memmap_source(array) is not None
    return mapped


@pytest.mark.parametrize("method", METHODS)
def test_memory_mapped_graph_in_small_chunks_writes_identical_files(tmp_path: Path, kind: str,
                                                                      method: str) -> None:
    graph = with_edge_attr(mixed(kind))
    partition_graph(graph, 3, tmp_path / "memory", method=method, progress=False)
    mapped = memory_mapped(graph, tmp_path / "graph")
    # Chunks of 37 edges: several full chunks and a partial one per relation.
    partition_graph(mapped, 3, tmp_path / "mapped", method=method, edge_chunk=37, progress=False)
    assert_same_output(tmp_path / "memory", tmp_path / "mapped")
    check_round_trip(graph, tmp_path / "mapped", 3, method)


@pytest.mark.parametrize("method", ["range", "hash"])
@pytest.mark.parametrize("preset", ["small", "mag-small"])
def test_streaming_a_preset_from_a_graph_dir_matches_in_memory(tmp_path: Path, preset: str,
                                                                 method: str) -> None:
    graph = generate(preset, seed=0, progress=False)
    partition_graph(graph, 4, tmp_path / "memory", method=method, progress=False)
    mapped = memory_mapped(graph, tmp_path / "graph")
    # 40,000 (small) and 112,500 (mag-small) edges in chunks of 4,096.
    partition_graph(mapped, 4, tmp_path / "mapped", method=method, edge_chunk=4096, progress=False)
    assert_same_output(tmp_path / "memory", tmp_path / "mapped")


@pytest.mark.parametrize("edge_attr", [True, False])
@pytest.mark.parametrize("weighted", [True, False])
def test_manifests_round_trip_byte_for_byte(tmp_path: Path, kind: str, weighted: bool,
                                            edge_attr: bool) -> None:
    """v1 and v2 JSON are read into one Manifest and written back as they were (the
    graph's fingerprint is the hash of that JSON)."""
    graph = mixed(kind, weighted=weighted)
    partition_graph(with_edge_attr(graph) if edge_attr else graph, 2, tmp_path / "p", method="metis",
                    progress=False)
    text = (tmp_path / "p" / MANIFEST_FILE).read_text()
    manifest = read_manifest(tmp_path / "p")
    assert json.dumps(Manifest.from_json(json.loads(text)).to_json(), indent=1) + "\n" == text
    (tmp_path / "again").mkdir()
    manifest.write(tmp_path / "again")
    assert (tmp_path / "again" / MANIFEST_FILE).read_text() == text
    obj = json.loads(text)
    assert obj["format_version"] == (2 if kind == "typed" else 1)
    if kind == "typed":  # the flag only on the weighted relations
        flags = {k: "has_edge_weight" in v for k, v in obj["graph"]["edge_types"].items()}
        assert flags == {k: weighted for k in obj["graph"]["edge_types"]}
        assert all(v["has_edge_ids"] is True for v in obj["graph"]["edge_types"].values())
        feats = {k: (v["edge_feature_shape"], v["edge_feature_dtype"])
                 for k, v in obj["graph"]["edge_types"].items() if "edge_feature_dtype" in v}
        assert feats == ({"author__writes__paper": ([3], "float32"), "paper__cites__paper": ([], "int64"),
                          "paper__has_topic__topic": ([2], "float16")} if edge_attr else {})
    else:
        assert obj["graph"]["has_edge_weight"] is weighted and "_N" not in text
        assert obj["graph"]["has_edge_ids"] is True
        assert obj["graph"].get("edge_feature_shape") == ([3] if edge_attr else None)
        assert obj["graph"].get("edge_feature_dtype") == ("float32" if edge_attr else None)


def test_file_roles_and_paths_are_the_documented_layout(tmp_path: Path, kind: str) -> None:
    """Every file's manifest role and path are those of docs/partition-format.md, so
    that partitions written by earlier releases keep loading (format v1 names no type;
    v2 puts the kind first for the shared files, the type first for a partition's)."""
    graph = with_edge_attr(mixed(kind))
    partition_graph(graph, 2, tmp_path / "p", method="range", progress=False)
    obj = json.loads((tmp_path / "p" / MANIFEST_FILE).read_text())
    for name, rec in obj["files"].items():
        assert rec["path"] == f"{name}.npy"
    for name, rec in obj["partitions"][0]["files"].items():
        assert rec["path"] == f"part-0/{name}.npy"
    own = set(obj["partitions"][0]["files"])
    if kind == "plain":
        assert set(obj["files"]) == {"partition_book", "node_map"}
        assert {"indptr", "indices", "e_id", "edge_attr", "x", "orig_ids", "y", "train_idx"} <= own
        return
    types = list(obj["graph"]["node_types"])
    assert set(obj["files"]) == {f"{k}/{t}" for k in ("partition_book", "node_map") for t in types}
    target = obj["graph"]["target_type"]
    assert {f"{t}/orig_ids" for t in types} | {f"{target}/y", f"{target}/train_idx"} <= own
    assert {f"{et}/{k}" for et in obj["graph"]["edge_types"] for k in ("indptr", "e_id")} <= own
    with_attr = {et for et, v in obj["graph"]["edge_types"].items() if "edge_feature_dtype" in v}
    assert {k.rpartition("/")[0] for k in own if k.endswith("/edge_attr")} == with_attr
    assert "topic__rev_has_topic__paper/edge_attr" not in own and len(with_attr) == 3
