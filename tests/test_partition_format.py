"""Partition format v1: every method's output reassembles into exactly the input graph,
the streaming (memory-mapped, chunked) path writes the same bytes, and the validating
reader refuses corrupted, truncated and mismatched files, naming the file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from partitioner.algorithms import METHODS, assign
from partitioner.format import (
    MANIFEST_FILE,
    Manifest,
    Partition,
    PartitionFormatError,
    load_node_data,
    load_node_map,
    load_partition,
    load_structure,
    read_manifest,
)
from partitioner.graph import SPLITS, GraphData
from partitioner.npyio import _memmap_source, read_npy_header, sha256_file
from partitioner.partition import partition_graph
from partitioner.readers.graphdir import read_graph_dir, save_graph_dir
from partitioner.synthetic import generate


def make_weighted_graph(num_nodes: int = 90, num_edges: int = 420, seed: int = 7) -> GraphData:
    """A small directed graph with everything the format must carry: distinct edge weights,
    a repeated edge, self-loops, an isolated node, unlabeled nodes and three splits, with
    nodes that are in no split."""
    rng = np.random.default_rng(seed)
    src = rng.integers(0, num_nodes - 1, num_edges)  # node num_nodes-1 stays isolated
    dst = rng.integers(0, num_nodes - 1, num_edges)
    src = np.concatenate([src, [3, 3, 5, 5]])  # 3 -> 4 twice, 5 -> 5 twice (self-loop)
    dst = np.concatenate([dst, [4, 4, 5, 5]])
    edge_index = np.stack([src, dst]).astype(np.int64)
    # Distinct weights, so a weight that lands on the wrong edge shows up.
    weight = rng.permutation(edge_index.shape[1]).astype(np.float32) / 16.0 + 0.5
    y = rng.integers(0, 4, num_nodes).astype(np.int64)
    y[::11] = -1
    perm = rng.permutation(num_nodes)
    splits = {"train": np.sort(perm[:30]), "val": np.sort(perm[30:45]),
              "test": np.sort(perm[45:70])}
    graph = GraphData(
        name="weighted-tiny", num_nodes=num_nodes, edge_index=edge_index,
        x=rng.standard_normal((num_nodes, 5)).astype(np.float32), y=y, num_classes=4,
        splits=splits, edge_weight=weight,
    )
    graph.validate()
    return graph


@pytest.fixture(scope="module")
def weighted_graph() -> GraphData:
    return make_weighted_graph()


@pytest.fixture(scope="module")
def small_graph() -> GraphData:
    return generate("small", seed=0, progress=False)


def load_all(root: Path) -> tuple[Manifest, list[Partition]]:
    manifest = read_manifest(root)
    return manifest, [load_partition(root, p) for p in range(manifest.num_partitions)]


def sorted_rows(*columns: np.ndarray) -> np.ndarray:
    """The rows ``(c0, c1, ...)`` sorted lexicographically: a canonical multiset."""
    stacked = np.stack([np.asarray(c, dtype=np.float64) for c in columns], axis=1)
    order = np.lexsort(tuple(stacked[:, i] for i in reversed(range(stacked.shape[1]))))
    return stacked[order]


def check_round_trip(graph: GraphData, root: Path, num_parts: int, method: str) -> None:
    """Reassemble every partition under ``root`` and compare with ``graph``."""
    manifest, parts = load_all(root)
    n = graph.num_nodes
    assert manifest.num_partitions == num_parts == len(parts)

    # The partition book: P+1 increasing offsets from 0 to N, one contiguous range each.
    book = np.asarray(manifest.partition_book)
    assert book.shape == (num_parts + 1,) and book[0] == 0 and book[-1] == n
    assert (np.diff(book) > 0).all()
    for p, part in enumerate(parts):
        np.testing.assert_array_equal(part.partition_book, book)
        assert part.node_range == (book[p], book[p + 1])
        assert part.num_nodes == book[p + 1] - book[p]

    # node_map (original -> global) and the concatenated orig_ids (global -> original)
    # are inverse permutations.
    node_map = np.asarray(load_node_map(root))
    orig_of_global = np.concatenate([p.orig_ids for p in parts])
    assert node_map.shape == orig_of_global.shape == (n,)
    np.testing.assert_array_equal(np.sort(node_map), np.arange(n))
    np.testing.assert_array_equal(node_map[orig_of_global], np.arange(n))
    np.testing.assert_array_equal(orig_of_global[node_map], np.arange(n))

    # The assignment the files encode is the one the method computes.
    part_of = np.searchsorted(book, node_map, side="right") - 1
    np.testing.assert_array_equal(part_of, assign(graph, num_parts, method, progress=False))

    # CSC structure, then every input edge exactly once with its weight.
    src_orig, dst_orig, weights = [], [], []
    for part in parts:
        start, stop = part.node_range
        indptr, indices = np.asarray(part.indptr), np.asarray(part.indices)
        assert indptr.shape == (stop - start + 1,) and indptr[0] == 0
        assert indptr[-1] == indices.size and (np.diff(indptr) >= 0).all()
        assert indices.dtype == np.int64 and ((indices >= 0) & (indices < n)).all()
        targets = start + np.repeat(np.arange(stop - start), np.diff(indptr))
        src_orig.append(orig_of_global[indices])
        dst_orig.append(orig_of_global[targets])
        assert part.edge_weight is not None and part.edge_weight.shape == indices.shape
        weights.append(np.asarray(part.edge_weight))
    assert graph.edge_weight is not None
    np.testing.assert_array_equal(
        sorted_rows(np.concatenate(src_orig), np.concatenate(dst_orig), np.concatenate(weights)),
        sorted_rows(graph.edge_index[0], graph.edge_index[1], graph.edge_weight),
    )

    # Node data per original ID.
    x = np.concatenate([p.x for p in parts])
    y = np.concatenate([p.y for p in parts])
    assert x.dtype == graph.x.dtype and y.dtype == np.int64
    np.testing.assert_array_equal(x[node_map], graph.x)
    np.testing.assert_array_equal(y[node_map], graph.y)

    # Each split is preserved exactly: the parts' shares are disjoint and their union is
    # the input split.
    for split in SPLITS:
        shares = [orig_of_global[np.asarray(p.splits[split])] for p in parts]
        union = np.concatenate(shares)
        assert np.unique(union).size == union.size, f"{split}: a node is in two partitions"
        np.testing.assert_array_equal(np.sort(union), np.sort(graph.splits[split]))

    # The manifest's sizes, with the edge cut computed independently from the input edges.
    src, dst = graph.edge_index
    cut = part_of[src] != part_of[dst]
    remote = np.bincount(part_of[dst][cut], minlength=num_parts)
    in_edges = np.bincount(part_of[dst], minlength=num_parts)
    assert manifest.num_nodes == n and manifest.num_edges == graph.num_edges
    assert manifest.feature_dim == graph.feature_dim
    assert manifest.feature_dtype == graph.x.dtype.name
    assert manifest.num_classes == graph.num_classes and manifest.has_edge_weight
    assert manifest.algorithm["method"] == method
    assert manifest.edge_cut == int(cut.sum())
    for p, (info, part) in enumerate(zip(manifest.partitions, parts, strict=True)):
        assert info.id == p
        assert info.num_nodes == part.num_nodes
        assert info.num_edges == part.num_edges == in_edges[p]
        assert info.num_remote_edges == remote[p]
        assert info.split_sizes == {s: int(part.splits[s].size) for s in SPLITS}


@pytest.mark.parametrize("num_parts", [1, 2, 3])
@pytest.mark.parametrize("method", METHODS)
def test_round_trip_reassembles_the_input_graph(
    weighted_graph: GraphData, tmp_path: Path, method: str, num_parts: int
) -> None:
    partition_graph(weighted_graph, num_parts, tmp_path, method=method, progress=False)
    check_round_trip(weighted_graph, tmp_path, num_parts, method)


def test_round_trip_float16_features_without_weights(tmp_path: Path) -> None:
    """A graph without edge weights writes no weight files; float16 features stay float16."""
    g = make_weighted_graph(num_nodes=40, num_edges=120, seed=3)
    g.x = g.x.astype(np.float16)
    g.edge_weight = None
    manifest = partition_graph(g, 2, tmp_path, method="random", progress=False)
    assert not manifest.has_edge_weight and manifest.feature_dtype == "float16"
    assert not list(tmp_path.glob("part-*/edge_weight.npy"))
    parts = [load_partition(tmp_path, p) for p in range(2)]
    assert all(p.edge_weight is None and p.x.dtype == np.float16 for p in parts)
    node_map = np.asarray(load_node_map(tmp_path))
    np.testing.assert_array_equal(np.concatenate([p.x for p in parts])[node_map], g.x)


def recorded_files(manifest: Manifest) -> list[str]:
    names = [rec.path for rec in manifest.files.values()]
    for info in manifest.partitions:
        names.extend(rec.path for rec in info.files.values())
    return sorted(names)


def assert_same_output(a: Path, b: Path) -> None:
    """The two partition directories hold byte-identical files and equal manifests (the
    elapsed seconds aside)."""
    ma, mb = read_manifest(a), read_manifest(b)
    names = recorded_files(ma)
    assert names == recorded_files(mb)
    assert sorted(str(p.relative_to(a)) for p in a.rglob("*.npy")) == names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ja, jb = ma.to_json(), mb.to_json()
    for j in (ja, jb):
        j["algorithm"] = {k: v for k, v in j["algorithm"].items() if "seconds" not in k}
    assert ja == jb


@pytest.mark.parametrize("method", METHODS)
def test_memory_mapped_graph_dir_in_small_chunks_writes_identical_files(
    weighted_graph: GraphData, tmp_path: Path, method: str
) -> None:
    partition_graph(weighted_graph, 3, tmp_path / "memory", method=method, progress=False)
    save_graph_dir(weighted_graph, tmp_path / "graph")
    mapped = read_graph_dir(tmp_path / "graph", mmap=True)
    # The out-of-core path (pread of whole-file memory maps) is the one exercised.
    assert _memmap_source(mapped.edge_index) is not None
    assert mapped.edge_weight is not None and _memmap_source(mapped.edge_weight) is not None
    # 424 edges in chunks of 37: eleven full chunks and a partial one.
    partition_graph(mapped, 3, tmp_path / "mapped", method=method, edge_chunk=37, progress=False)
    assert_same_output(tmp_path / "memory", tmp_path / "mapped")
    check_round_trip(weighted_graph, tmp_path / "mapped", 3, method)


@pytest.mark.parametrize("method", ["range", "hash"])
def test_streaming_small_preset_from_graph_dir_matches_in_memory(
    small_graph: GraphData, tmp_path: Path, method: str
) -> None:
    partition_graph(small_graph, 4, tmp_path / "memory", method=method, progress=False)
    save_graph_dir(small_graph, tmp_path / "graph")
    mapped = read_graph_dir(tmp_path / "graph", mmap=True)
    assert _memmap_source(mapped.edge_index) is not None
    # 40,000 edges in chunks of 1,000.
    partition_graph(mapped, 4, tmp_path / "mapped", method=method, edge_chunk=1000,
                    progress=False)
    assert_same_output(tmp_path / "memory", tmp_path / "mapped")


# ---------------------------------------------------------------- refusing bad files


@pytest.fixture
def root(weighted_graph: GraphData, tmp_path: Path) -> Path:
    """A fresh two-partition directory of the weighted graph."""
    out = tmp_path / "parts"
    partition_graph(weighted_graph, 2, out, method="random", progress=False)
    return out


def manifest_json(root: Path) -> dict[str, Any]:
    return json.loads((root / MANIFEST_FILE).read_text())


def write_manifest_json(root: Path, obj: dict[str, Any]) -> None:
    (root / MANIFEST_FILE).write_text(json.dumps(obj))


def file_path(root: Path, partition: int, role: str) -> Path:
    return root / read_manifest(root).partitions[partition].files[role].path


def rerecord(root: Path, partition: int, role: str) -> None:
    """Make the manifest's record of a rewritten file match it again (size, checksum,
    dtype and shape), so that only the reader's structural checks can catch it."""
    obj = manifest_json(root)
    rec = obj["partitions"][partition]["files"][role]
    path = root / rec["path"]
    dtype, shape, _, _ = read_npy_header(path)
    rec.update(size_bytes=path.stat().st_size, sha256=sha256_file(path),
               dtype=dtype.name, shape=list(shape))
    write_manifest_json(root, obj)


def refused(root: Path, partition: int = 0, **kwargs: Any) -> str:
    with pytest.raises(PartitionFormatError) as info:
        load_partition(root, partition, **kwargs)
    return str(info.value)


def test_unmodified_partitions_load(root: Path) -> None:
    for p in range(2):
        assert load_partition(root, p, mmap=False).partition_id == p


def test_flipped_byte_fails_the_checksum_but_passes_a_size_check(root: Path) -> None:
    path = file_path(root, 0, "indices")
    _, _, _, offset = read_npy_header(path)
    indices = np.load(path)
    n = read_manifest(root).num_nodes
    k = int(np.flatnonzero((indices ^ 1) < n)[0])  # the flipped ID stays a valid node
    data = bytearray(path.read_bytes())
    data[offset + 8 * k] ^= 0x01  # lowest byte of element k (little-endian int64)
    path.write_bytes(bytes(data))

    message = refused(root)
    assert str(path) in message and "SHA-256" in message
    # The other partition's files are intact and it still loads.
    load_partition(root, 1)
    part = load_partition(root, 0, verify="size")
    assert int(part.indices[k]) == int(indices[k]) ^ 1


def test_truncated_file_is_refused(root: Path) -> None:
    path = file_path(root, 0, "x")
    path.write_bytes(path.read_bytes()[:-3])
    message = refused(root, verify="size")
    assert str(path) in message and "truncated" in message


def test_file_with_appended_bytes_is_refused(root: Path) -> None:
    path = file_path(root, 1, "orig_ids")
    with open(path, "ab") as f:
        f.write(b"\0" * 8)
    message = refused(root, 1, verify="size")
    assert str(path) in message and "larger than recorded" in message


@pytest.mark.parametrize(
    "replacement",
    [
        pytest.param(lambda y: y.astype(np.int32), id="int32"),
        pytest.param(lambda y: y.astype(np.float64), id="float64"),
        pytest.param(lambda y: y[:-1], id="shorter"),
        pytest.param(lambda y: y.reshape(-1, 1), id="2-d"),
    ],
)
def test_replaced_array_with_other_dtype_or_shape_is_refused(root: Path, replacement: Any) -> None:
    path = file_path(root, 0, "y")
    np.save(path, replacement(np.load(path)))
    # Fix the recorded size only: the header check, not the size check, must catch it.
    obj = manifest_json(root)
    obj["partitions"][0]["files"]["y"]["size_bytes"] = path.stat().st_size
    write_manifest_json(root, obj)
    message = refused(root, verify="size")
    assert str(path) in message and "expected int64 of shape" in message


def test_fortran_order_array_is_refused(root: Path) -> None:
    path = file_path(root, 0, "x")
    x = np.load(path)
    np.save(path, np.asfortranarray(x))  # same dtype, shape and size
    assert path.stat().st_size == read_manifest(root).partitions[0].files["x"].size_bytes
    message = refused(root, verify="size")
    assert str(path) in message and "Fortran" in message


def test_missing_file_is_refused_naming_it(root: Path) -> None:
    path = file_path(root, 1, "train_idx")
    path.unlink()
    message = refused(root, 1)
    assert str(path) in message and "missing" in message
    load_partition(root, 0)


def test_missing_node_map_is_refused(root: Path) -> None:
    (root / "node_map.npy").unlink()
    with pytest.raises(PartitionFormatError, match=r"node_map\.npy"):
        load_node_map(root)


def test_wrong_format_version_is_refused(root: Path) -> None:
    obj = manifest_json(root)
    obj["format_version"] = 2
    write_manifest_json(root, obj)
    message = refused(root)
    assert MANIFEST_FILE in message and "format_version" in message


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(lambda t: t[: len(t) // 2], id="truncated-json"),
        pytest.param(lambda t: "[]", id="json-list"),
        pytest.param(lambda t: t.replace('"partitions"', '"parts"'), id="missing-key"),
        pytest.param(lambda t: t.replace('"num_nodes": ', '"num_nodes": "many", "x": ', 1),
                     id="string-for-int"),
        pytest.param(lambda t: "", id="empty"),
    ],
)
def test_malformed_manifest_is_refused(root: Path, text: Any) -> None:
    path = root / MANIFEST_FILE
    path.write_text(text(path.read_text()))
    message = refused(root)
    assert str(path) in message


def test_manifest_whose_sizes_disagree_with_the_book_is_refused(root: Path) -> None:
    obj = manifest_json(root)
    obj["partitions"][0]["num_nodes"] += 1
    write_manifest_json(root, obj)
    assert "partition_book" in refused(root)


def test_missing_manifest_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PartitionFormatError, match="manifest not found"):
        load_partition(tmp_path, 0)


@pytest.mark.parametrize("partition", [-1, 2, 10])
def test_partition_id_out_of_range_is_refused(root: Path, partition: int) -> None:
    message = refused(root, partition)
    assert f"got {partition}" in message and "[0, 2)" in message


def test_decreasing_indptr_is_refused(root: Path) -> None:
    path = file_path(root, 0, "indptr")
    indptr = np.load(path)
    i = int(np.flatnonzero(np.diff(indptr[:-1]) > 0)[0]) + 1  # 0 < i < n_p
    indptr[i] = indptr[i + 1] + 1
    np.save(path, indptr)
    rerecord(root, 0, "indptr")
    message = refused(root)
    assert str(path) in message and "decrease" in message


def test_indptr_not_ending_at_the_edge_count_is_refused(root: Path) -> None:
    path = file_path(root, 1, "indptr")
    indptr = np.load(path)
    indptr[-1] -= 1
    np.save(path, indptr)
    rerecord(root, 1, "indptr")
    message = refused(root, 1)
    assert str(path) in message and "offsets from 0 to" in message


@pytest.mark.parametrize("bad_id", ["num_nodes", -1])
def test_source_ids_out_of_range_are_refused(root: Path, bad_id: Any) -> None:
    path = file_path(root, 0, "indices")
    indices = np.load(path)
    indices[len(indices) // 2] = read_manifest(root).num_nodes if bad_id == "num_nodes" else bad_id
    np.save(path, indices)
    rerecord(root, 0, "indices")
    message = refused(root)
    assert str(path) in message and "source IDs" in message


def test_split_ids_owned_by_another_partition_are_refused(root: Path) -> None:
    path = file_path(root, 0, "train_idx")
    train = np.load(path)
    train[-1] = read_manifest(root).partition_book[1]  # partition 1's first node
    np.save(path, train)
    rerecord(root, 0, "train_idx")
    message = refused(root)
    assert str(path) in message and "owned by partition 0" in message


def test_partition_book_file_disagreeing_with_manifest_is_refused(root: Path) -> None:
    path = root / "partition_book.npy"
    book = np.load(path)
    book[1] += 1
    np.save(path, book)
    obj = manifest_json(root)
    obj["files"]["partition_book"].update(size_bytes=path.stat().st_size,
                                          sha256=sha256_file(path))
    write_manifest_json(root, obj)
    assert "partition_book.npy" in refused(root)


def test_object_array_is_refused_without_unpickling(root: Path) -> None:
    path = file_path(root, 0, "y")
    n = len(np.load(path))
    np.save(path, np.array([{"pickled": i} for i in range(n)], dtype=object), allow_pickle=True)
    rerecord(root, 0, "y")  # the record now says "object", so only the object check refuses
    assert read_manifest(root).partitions[0].files["y"].dtype == "object"
    message = refused(root)
    assert str(path) in message and "object arrays are refused" in message


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("array", [np.arange(12, dtype=np.int64).reshape(3, 4),
                                   np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
                                   np.empty((0, 5), dtype=np.float32), np.array([True, False])])
def test_load_npy_equals_np_load(tmp_path: Path, array: np.ndarray, mmap: bool) -> None:
    from partitioner.npyio import load_npy

    path = tmp_path / "a.npy"
    np.save(path, array)
    got = load_npy(path, mmap)
    want = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    assert got.flags.writeable == want.flags.writeable


def test_load_npy_refuses_object_arrays_and_truncated_files(tmp_path: Path) -> None:
    from partitioner.npyio import load_npy

    path = tmp_path / "o.npy"
    np.save(path, np.array([1, "a"], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="object arrays need pickle"):
        load_npy(path)
    np.save(path, np.arange(100, dtype=np.int64))
    path.write_bytes(path.read_bytes()[:-80])
    with pytest.raises(ValueError, match="truncated file"):
        load_npy(path, mmap=False)


# -- the whole graph's structure ---------------------------------------------------------
def test_the_whole_structure_joins_every_partition_s_in_edges(root: Path) -> None:
    """``load_structure``: every node's in-edges (global IDs), weights and original IDs,
    in partition order, as each partition holds them."""
    full = load_structure(root)
    m = read_manifest(root)
    assert full.node_range == (0, m.num_nodes) and full.indices.size == m.num_edges
    assert full.edge_weight is not None and full.edge_weight.size == m.num_edges
    for p in range(2):
        part = load_partition(root, p)
        start, stop = part.node_range
        assert np.array_equal(full.orig_ids[start:stop], part.orig_ids)
        for v in range(part.num_nodes):
            lo, hi = full.indptr[start + v], full.indptr[start + v + 1]
            assert np.array_equal(full.indices[lo:hi], part.indices[part.indptr[v]:part.indptr[v + 1]])
            assert np.array_equal(full.edge_weight[lo:hi],
                                  part.edge_weight[part.indptr[v]:part.indptr[v + 1]])
    assert load_structure(root, weights=False).edge_weight is None
    assert not full.indices.flags.writeable


@pytest.mark.parametrize("fault", ["checksum", "decreasing", "source"])
def test_the_whole_structure_refuses_a_faulty_partition_naming_its_file(root: Path,
                                                                        fault: str) -> None:
    role = "indptr" if fault == "decreasing" else "indices"
    path = file_path(root, 1, role)
    values = np.load(path)
    if fault == "decreasing":
        i = int(np.flatnonzero(np.diff(values[:-1]) > 0)[0]) + 1
        values[i] = values[i + 1] + 1
    else:
        values[len(values) // 2] = read_manifest(root).num_nodes if fault == "source" else \
            (values[len(values) // 2] + 1) % read_manifest(root).num_nodes
    want = {"checksum": "SHA-256", "decreasing": "decrease", "source": "source IDs"}[fault]
    _refused_naming(root, role, values, fault != "checksum", load_structure, want)


def _refused_naming(root: Path, role: str, values: np.ndarray, rerecorded: bool,
                    load: Callable[[Path], object], want: str) -> None:
    """With ``values`` written to partition 1's ``role`` file (its manifest record made to
    match where ``rerecorded``), ``load(root)`` is refused naming the file and ``want``."""
    path = file_path(root, 1, role)
    np.save(path, values)
    if rerecorded:
        rerecord(root, 1, role)
    with pytest.raises(PartitionFormatError) as info:
        load(root)
    assert str(path) in str(info.value) and want in str(info.value)


# -- every node's features and labels ----------------------------------------------------
def test_every_node_s_rows_join_every_partition_s_features_and_labels(root: Path) -> None:
    """``load_node_data``: every node's feature row and label, in partition order, as each
    partition holds them; read-only."""
    full = load_node_data(root)
    m = read_manifest(root)
    assert full.node_range == (0, m.num_nodes) and full.x.shape == (m.num_nodes, m.feature_dim)
    assert full.x.dtype == np.dtype(m.feature_dtype) and full.y.dtype == np.int64
    for p in range(2):
        part = load_partition(root, p)
        start, stop = part.node_range
        assert np.array_equal(full.x[start:stop], part.x)
        assert np.array_equal(full.y[start:stop], part.y)
        assert part.node_data.node_range == (start, stop)
    assert not full.x.flags.writeable and not full.y.flags.writeable


@pytest.mark.parametrize("fault", ["checksum", "rows", "labels"])
def test_every_node_s_rows_refuse_a_faulty_partition_naming_its_file(root: Path,
                                                                     fault: str) -> None:
    role = "y" if fault == "labels" else "x"
    path = file_path(root, 1, role)
    values = np.load(path)
    if fault == "checksum":
        values[0] += 1
    else:
        values = values[:-1]  # one row short, the record rewritten to match
    want = {"checksum": "SHA-256", "rows": "rows of", "labels": "one per owned node"}[fault]
    _refused_naming(root, role, values, fault != "checksum", load_node_data, want)
