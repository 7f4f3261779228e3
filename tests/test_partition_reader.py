"""The validating reader of partition formats v1 and v2: it refuses corrupted, truncated
and mismatched files and manifests, naming the file, for plain and typed graphs alike;
joins every partition's structure, rows or edge data (``load_structure``,
``load_node_data``, ``load_edge_data``) checked the same way; and loads partitions
written before edge IDs existed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from partitioner.format import (
    MANIFEST_FILE,
    Manifest,
    PartitionFormatError,
    load_node_map,
    load_partition,
    read_manifest,
)
from partitioner.graph import EdgeType
from partitioner.joins import (
    edge_data_bytes,
    edge_data_records,
    load_edge_data,
    load_node_data,
    load_structure,
)
from partitioner.npyio import load_npy, read_npy_header, sha256_file
from partitioner.writer import partition_graph
from tests.edge_fixtures import with_edge_attr
from tests.graph_fixtures import KINDS, mixed


@pytest.fixture(scope="module", params=KINDS)
def pristine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The weighted mixed graph of each kind, with edge features, in two random partitions
    (never modified)."""
    out = tmp_path_factory.mktemp(f"parts-{request.param}")
    partition_graph(with_edge_attr(mixed(request.param)), 2, out, method="random", overwrite=True,
                    progress=False)
    return out


@pytest.fixture
def root(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of :func:`pristine` for a test to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "parts"))


def relation(m: Manifest) -> EdgeType:
    """The relation the tests damage: a plain graph's one; in the typed graph, authors to
    papers (sources of another type than the destinations, so source IDs that are valid
    papers may be invalid authors)."""
    return ("author", "writes", "paper") if m.typed else next(iter(m.edge_types))


def role(root: Path, kind: str) -> str:
    """The manifest's role of file ``kind`` (``indices``, ``x``, ``train_idx`` ...): of
    :func:`relation` for edge files, of the target type for node files."""
    m = read_manifest(root)
    edge_file = kind in ("indptr", "indices", "edge_weight", "e_id", "edge_attr")
    return m.role(kind, relation(m) if edge_file else m.target_type)


def manifest_json(root: Path) -> dict[str, Any]:
    return json.loads((root / MANIFEST_FILE).read_text())


def write_manifest_json(root: Path, obj: dict[str, Any]) -> None:
    (root / MANIFEST_FILE).write_text(json.dumps(obj))


def file_path(root: Path, partition: int, kind: str) -> Path:
    return root / read_manifest(root).partitions[partition].files[role(root, kind)].path


def rerecord(root: Path, partition: int, kind: str) -> None:
    """Make the manifest's record of a rewritten file match it again (size, checksum,
    dtype and shape), so that only the reader's structural checks can catch it."""
    obj = manifest_json(root)
    rec = obj["partitions"][partition]["files"][role(root, kind)]
    path = root / rec["path"]
    dtype, shape, _, _ = read_npy_header(path)
    rec.update(size_bytes=path.stat().st_size, sha256=sha256_file(path), dtype=dtype.name, shape=list(shape))
    write_manifest_json(root, obj)


def refused(root: Path, partition: int = 0, **kwargs: Any) -> str:
    with pytest.raises(PartitionFormatError) as info:
        load_partition(root, partition, **kwargs)
    return str(info.value)


def test_unmodified_partitions_load(root: Path) -> None:
    for p in range(2):
        part = load_partition(root, p, mmap=False)
        assert part.partition_id == p and all(a.flags.writeable for a in part.indices.values())
        mapped = load_partition(root, p)
        assert all(isinstance(a, np.memmap) and not a.flags.writeable for a in mapped.indices.values())


def test_flipped_byte_fails_the_checksum_but_passes_a_size_check(root: Path) -> None:
    path = file_path(root, 0, "indices")
    _, _, _, offset = read_npy_header(path)
    indices = np.load(path)
    m = read_manifest(root)
    n = m.node_types[relation(m)[0]].num_nodes
    k = int(np.flatnonzero((indices ^ 1) < n)[0])  # the flipped ID stays a valid node
    data = bytearray(path.read_bytes())
    data[offset + 8 * k] ^= 0x01  # lowest byte of element k (little-endian int64)
    path.write_bytes(bytes(data))

    message = refused(root)
    assert str(path) in message and "SHA-256" in message
    load_partition(root, 1)  # the other partition's files are intact
    part = load_partition(root, 0, verify="size")
    assert int(part.indices[relation(m)][k]) == int(indices[k]) ^ 1


@pytest.mark.parametrize(("damage", "needle"), [(lambda b: b[:-3], "truncated"),
                                               (lambda b: b + b"\0" * 8, "larger than recorded")])
def test_a_file_of_another_size_is_refused(root: Path, damage: Callable[[bytes], bytes], needle: str) -> None:
    path = file_path(root, 1, "x")
    path.write_bytes(damage(path.read_bytes()))
    message = refused(root, 1, verify="size")
    assert str(path) in message and needle in message


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
    obj["partitions"][0]["files"][role(root, "y")]["size_bytes"] = path.stat().st_size
    write_manifest_json(root, obj)
    message = refused(root, verify="size")
    assert str(path) in message and "expected int64 of shape" in message


def test_fortran_order_array_is_refused(root: Path) -> None:
    path = file_path(root, 0, "x")
    np.save(path, np.asfortranarray(np.load(path)))  # same dtype, shape and size
    assert path.stat().st_size == read_manifest(root).partitions[0].files[role(root, "x")].size_bytes
    message = refused(root, verify="size")
    assert str(path) in message and "Fortran" in message


@pytest.mark.parametrize("kind", ["train_idx", "e_id", "edge_attr"])
def test_missing_file_is_refused_naming_it(root: Path, kind: str) -> None:
    path = file_path(root, 1, kind)
    path.unlink()
    message = refused(root, 1)
    assert str(path) in message and "missing" in message
    load_partition(root, 0)


@pytest.mark.parametrize("kind", ["y", "e_id", "edge_attr"])
def test_manifest_without_a_file_record_is_refused(root: Path, kind: str) -> None:
    obj = manifest_json(root)
    name = role(root, kind)
    del obj["partitions"][0]["files"][name]
    write_manifest_json(root, obj)
    assert f"expected a record for {name!r}" in refused(root)


@pytest.mark.parametrize("kind", ["partition_book", "node_map"])
def test_manifest_without_a_shared_file_record_is_refused_naming_it(root: Path, kind: str) -> None:
    name = read_manifest(root).shared_role(kind, read_manifest(root).target_type)
    obj = manifest_json(root)
    del obj["files"][name]
    write_manifest_json(root, obj)
    assert f"files: expected {name!r}" in refused(root)


def test_missing_node_map_is_refused(root: Path) -> None:
    m = read_manifest(root)
    path = root / m.files[m.shared_role("node_map", m.target_type)].path
    path.unlink()
    with pytest.raises(PartitionFormatError, match="node_map"):
        load_node_map(root)
    with pytest.raises(PartitionFormatError, match=r"node_type: expected one of"):
        load_node_map(root, "venue")


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("format_version", 0, "expected format_version 1 or 2, got 0"),
    ("format_version", 3, "expected format_version 1 or 2, got 3"),
    ("format_version", "2", "expected format_version 1 or 2, got '2'"),
    ("format", "other", "expected format 'graphfeed-partition', got 'other'"),
])
def test_unknown_format_or_version_is_refused(root: Path, key: str, value: object, needle: str) -> None:
    obj = manifest_json(root)
    obj[key] = value
    write_manifest_json(root, obj)
    message = refused(root)
    assert MANIFEST_FILE in message and needle in message


def test_the_other_version_s_layout_is_refused(root: Path) -> None:
    """A v1 manifest claiming v2, or the reverse, is malformed, not misread."""
    obj = manifest_json(root)
    obj["format_version"] = 3 - obj["format_version"]
    write_manifest_json(root, obj)
    message = refused(root)
    assert str(root / MANIFEST_FILE) in message and "malformed manifest" in message


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
    assert str(path) in refused(root)


def test_manifest_whose_sizes_disagree_with_the_book_is_refused(root: Path) -> None:
    obj = manifest_json(root)
    m = read_manifest(root)
    if m.typed:
        obj["partitions"][0]["num_nodes"][m.target_type] += 1
    else:
        obj["partitions"][0]["num_nodes"] += 1
    write_manifest_json(root, obj)
    assert "partitions[0].num_nodes" in refused(root) and "(from partition_book)" in refused(root)


def test_missing_manifest_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PartitionFormatError, match="manifest not found"):
        load_partition(tmp_path, 0)


@pytest.mark.parametrize("partition", [-1, 2, 10])
def test_partition_id_out_of_range_is_refused(root: Path, partition: int) -> None:
    message = refused(root, partition)
    assert f"got {partition}" in message and "[0, 2)" in message


def _rewrite(root: Path, partition: int, kind: str, change: Callable[[np.ndarray, Manifest], np.ndarray],
             rerecorded: bool = True) -> Path:
    """Rewrite partition ``partition``'s file ``kind`` as ``change`` makes it (its manifest
    record made to match where ``rerecorded``, so that only structural checks can catch it)."""
    path = file_path(root, partition, kind)
    np.save(path, change(np.load(path), read_manifest(root)))
    if rerecorded:
        rerecord(root, partition, kind)
    return path


def _set(values: np.ndarray, index: int, value: int) -> np.ndarray:
    values[index] = value
    return values


def _decrease(indptr: np.ndarray, m: Manifest) -> np.ndarray:
    i = int(np.flatnonzero(np.diff(indptr[:-1]) > 0)[0]) + 1  # 0 < i < n_p
    return _set(indptr, i, indptr[i + 1] + 1)


def _past_the_source_type(indices: np.ndarray, m: Manifest) -> np.ndarray:
    """A source ID one past its type's count (in the typed graph, a valid paper ID but no
    author's)."""
    return _set(indices, indices.size // 2, m.node_types[relation(m)[0]].num_nodes)


#: Rewrites of one file that pass every record check (file, kind, rewrite, the message).
STRUCTURAL = {
    "decreasing": ("indptr", _decrease, "offsets decrease"),
    "short-of-the-edges": ("indptr", lambda a, m: _set(a, -1, a[-1] - 1), "expected offsets from 0 to"),
    "source-past-its-type": ("indices", _past_the_source_type, "source IDs in [0, "),
    "negative-source": ("indices", lambda a, m: _set(a, a.size // 2, -1), "source IDs in [0, "),
    "weights-not-aligned": ("edge_weight", lambda a, m: a[:-1], "one per in-edge"),
    "split-of-another-partition": ("train_idx", lambda a, m: _set(a, -1, m.partition_book[m.target_type][1]),
                                   "owned by partition 0"),
    "labels-short": ("y", lambda a, m: a[:-1], "one per owned node"),
    "edge-ids-short": ("e_id", lambda a, m: a[:-1], "(one per in-edge)"),
    "edge-id-past-the-edges": ("e_id", lambda a, m: _set(a, 0, m.edge_types[relation(m)]),
                               "edge IDs in [0, "),
    "negative-edge-id": ("e_id", lambda a, m: _set(a, -1, -1), "edge IDs in [0, "),
    "edge-ids-int32": ("e_id", lambda a, m: a.astype(np.int32), "expected int64 of shape"),
    "edge-features-short": ("edge_attr", lambda a, m: a[:-1], "one row per in-edge"),
    "edge-features-float64": ("edge_attr", lambda a, m: a.astype(np.float64), "expected float32 of shape"),
    "edge-features-wider": ("edge_attr", lambda a, m: np.concatenate([a, a], axis=1), "edge_feature_shape"),
    "rows-short": ("x", lambda a, m: a[:-1], "rows of"),
}


@pytest.mark.parametrize("fault", STRUCTURAL)
def test_structure_beyond_the_checksums_is_checked(root: Path, fault: str) -> None:
    kind, change, needle = STRUCTURAL[fault]
    path = _rewrite(root, 0, kind, change)
    message = refused(root)
    assert str(path) in message and needle in message


def test_a_size_check_leaves_the_edge_ids_values_unread(root: Path) -> None:
    """``verify="size"`` reads no edge ID at load (a server reads them only for batches
    that ask for them): an ID out of range passes, as its shape and dtype are checked."""
    path = _rewrite(root, 0, "e_id", lambda a, m: _set(a, -1, -1))
    assert "edge IDs in [0, " in refused(root)
    assert load_partition(root, 0, verify="size").e_id  # loaded, not scanned
    _rewrite(root, 0, "e_id", lambda a, m: a.astype(np.int32))
    assert str(path) in refused(root, verify="size")


def test_partition_book_file_disagreeing_with_manifest_is_refused(root: Path) -> None:
    m = read_manifest(root)
    name = m.shared_role("partition_book", m.target_type)
    path = root / m.files[name].path
    book = np.load(path)
    book[1] += 1
    np.save(path, book)
    obj = manifest_json(root)
    obj["files"][name].update(size_bytes=path.stat().st_size, sha256=sha256_file(path))
    write_manifest_json(root, obj)
    message = refused(root)
    assert str(path) in message and "does not match the manifest's partition_book" in message


def test_object_array_is_refused_without_unpickling(root: Path) -> None:
    path = file_path(root, 0, "y")
    n = len(np.load(path))
    np.save(path, np.array([{"pickled": i} for i in range(n)], dtype=object), allow_pickle=True)
    rerecord(root, 0, "y")  # the record now says "object", so only the object check refuses
    assert read_manifest(root).partitions[0].files[role(root, "y")].dtype == "object"
    message = refused(root)
    assert str(path) in message and "object arrays are refused" in message


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("array", [np.arange(12, dtype=np.int64).reshape(3, 4),
                                   np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
                                   np.empty((0, 5), dtype=np.float32), np.array([True, False])])
def test_load_npy_equals_np_load(tmp_path: Path, array: np.ndarray, mmap: bool) -> None:
    path = tmp_path / "a.npy"
    np.save(path, array)
    got = load_npy(path, mmap)
    want = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    assert got.flags.writeable == want.flags.writeable


def test_load_npy_refuses_object_arrays_and_truncated_files(tmp_path: Path) -> None:
    path = tmp_path / "o.npy"
    np.save(path, np.array([1, "a"], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="object arrays need pickle"):
        load_npy(path)
    np.save(path, np.arange(100, dtype=np.int64))
    path.write_bytes(path.read_bytes()[:-80])
    with pytest.raises(ValueError, match="truncated file"):
        load_npy(path, mmap=False)


# -- the whole graph ----------------------------------------------------------------------
def test_the_whole_structure_joins_every_partition_s_in_edges(root: Path) -> None:
    """``load_structure``: per relation every node's in-edges (global IDs) and weights,
    and per type the original IDs, in partition order, as each partition holds them."""
    full = load_structure(root)
    m = read_manifest(root)
    assert set(full.edge_weight) == m.weighted and set(full.indptr) == set(m.edge_types)
    for et, total in m.edge_types.items():
        assert full.indices[et].size == total and full.edge_weight[et].size == total
        assert full.indptr[et].shape == (m.node_types[et[2]].num_nodes + 1,)
        assert not full.indices[et].flags.writeable and not full.indptr[et].flags.writeable
    for p in range(2):
        part = load_partition(root, p)
        for t in m.node_types:
            start, stop = part.node_range(t)
            assert full.node_range(t)[0] == 0
            np.testing.assert_array_equal(full.orig_ids[t][start:stop], part.orig_ids[t])
        for et in m.edge_types:
            start = part.node_range(et[2])[0]
            for v in range(part.num_nodes(et[2])):
                lo, hi = full.indptr[et][start + v], full.indptr[et][start + v + 1]
                mine = slice(part.indptr[et][v], part.indptr[et][v + 1])
                np.testing.assert_array_equal(full.indices[et][lo:hi], part.indices[et][mine])
                np.testing.assert_array_equal(full.edge_weight[et][lo:hi], part.edge_weight[et][mine])
    assert load_structure(root, weights=False).edge_weight == {}


def _bump_first(values: np.ndarray, m: Manifest) -> np.ndarray:
    values.reshape(-1)[0] += 1  # a valid value still: only the checksum can tell
    return values


@pytest.mark.parametrize(("load", "fault", "needle"), [
    (load_structure, "decreasing", "offsets decrease"),
    (load_structure, "source-past-its-type", "source IDs in [0, "),
    (load_structure, "indices", "SHA-256"),
    (load_node_data, "rows-short", "expected shape"),
    (load_node_data, "labels-short", "expected shape"),
    (load_node_data, "x", "SHA-256"),
    (load_edge_data, "edge-id-past-the-edges", "edge IDs in [0, "),
    (load_edge_data, "edge-features-short", "expected shape"),
    (load_edge_data, "e_id", "SHA-256"),
    (load_edge_data, "edge_attr", "SHA-256"),
])
def test_the_whole_graph_refuses_a_faulty_partition_naming_its_file(
    root: Path, load: Callable[[Path], object], fault: str, needle: str
) -> None:
    """``load_structure`` and ``load_node_data`` check each partition's files as
    ``load_partition`` does: a changed value (fault: the file's kind) or a structural fault."""
    if fault in STRUCTURAL:
        kind, change, _ = STRUCTURAL[fault]
        path = _rewrite(root, 1, kind, change)
    else:
        path = _rewrite(root, 1, fault, _bump_first, rerecorded=False)
    with pytest.raises(PartitionFormatError) as info:
        load(root)
    assert str(path) in str(info.value) and needle in str(info.value)


def test_every_node_s_rows_join_every_partition_s_features_and_labels(root: Path) -> None:
    """``load_node_data``: every node's feature row per type (types with features only)
    and every target node's label, in partition order, as each partition holds them;
    read-only."""
    full = load_node_data(root)
    m = read_manifest(root)
    assert set(full.x) == set(m.feature_dtypes) and full.target_type == m.target_type
    for t, dtype in m.feature_dtypes.items():
        info = m.node_types[t]
        assert full.x[t].shape == (info.num_nodes, info.feature_dim) and full.x[t].dtype == np.dtype(dtype)
        assert not full.x[t].flags.writeable and full.node_range(t) == (0, info.num_nodes)
    assert full.y.dtype == np.int64 and not full.y.flags.writeable
    for p in range(2):
        part = load_partition(root, p)
        for t in full.x:
            start, stop = part.node_range(t)
            np.testing.assert_array_equal(full.x[t][start:stop], part.x[t])
            assert part.node_data.node_range(t) == (start, stop)
        start, stop = part.node_range(m.target_type)
        np.testing.assert_array_equal(full.y[start:stop], part.y)


def test_every_edge_s_id_and_features_join_every_partition_s(root: Path) -> None:
    """``load_edge_data``: per edge type every partition's e_id and edge_attr in partition
    order (internal edge IDs, edge_start 0), read-only; every original edge ID once."""
    full = load_edge_data(root)
    m = read_manifest(root)
    assert set(full.e_id) == set(m.edge_types) and set(full.edge_attr) == set(m.edge_features)
    assert full.nbytes == edge_data_bytes(m) and len(edge_data_records(m)) == 2 * (
        len(m.edge_types) + len(m.edge_features))
    parts = [load_partition(root, p) for p in range(2)]
    for et, total in m.edge_types.items():
        assert full.edge_range(et) == (0, total) and not full.e_id[et].flags.writeable
        np.testing.assert_array_equal(np.sort(full.e_id[et]), np.arange(total))
        book = m.edge_book(et)
        for p, part in enumerate(parts):
            np.testing.assert_array_equal(full.e_id[et][book[p]:book[p + 1]], part.e_id[et])
            if et in m.edge_features:
                np.testing.assert_array_equal(full.edge_attr[et][book[p]:book[p + 1]], part.edge_attr[et])
        if et in m.edge_features:
            info = m.edge_features[et]
            assert full.edge_attr[et].shape == (total, *info.shape)
            assert full.edge_attr[et].dtype == np.dtype(info.dtype) and not full.edge_attr[et].flags.writeable


def _without_edge_data(root: Path) -> None:
    """Make ``root`` what a writer from before edge IDs wrote: no e_id or edge_attr files,
    records or manifest keys."""
    obj = manifest_json(root)
    entries = obj["graph"]["edge_types"].values() if obj["format_version"] == 2 else [obj["graph"]]
    for entry in entries:
        for key in ("has_edge_ids", "edge_feature_shape", "edge_feature_dtype"):
            entry.pop(key, None)
    for part in obj["partitions"]:
        for name in [n for n in part["files"] if n.rpartition("/")[2] in ("e_id", "edge_attr")]:
            (root / part["files"].pop(name)["path"]).unlink()
    (root / MANIFEST_FILE).write_text(json.dumps(obj, indent=1) + "\n")


def test_partitions_written_before_edge_ids_still_load(root: Path) -> None:
    """An older partition (no edge files or keys) loads with empty e_id and edge_attr,
    its manifest reads and writes back byte for byte, and nothing else changes."""
    before = load_partition(root, 1)
    _without_edge_data(root)
    text = (root / MANIFEST_FILE).read_text()
    m = read_manifest(root)
    assert not m.edge_ids and not m.edge_features and not m.has_edge_ids
    assert json.dumps(m.to_json(), indent=1) + "\n" == text
    assert "edge_id" not in text and "edge_feature" not in text and "e_id" not in text
    for p in range(2):
        part = load_partition(root, p)
        assert part.e_id == {} and part.edge_attr == {} and part.edge_data.e_id == {}
    after = load_partition(root, 1)
    for et in m.edge_types:
        np.testing.assert_array_equal(after.indices[et], before.indices[et])
    full = load_edge_data(root)
    assert full.e_id == {} and full.edge_attr == {} and edge_data_records(m) == [] and edge_data_bytes(m) == 0
    load_structure(root)
    load_node_data(root)


@pytest.mark.parametrize(("key", "value"), [("edge_feature_dtype", "object"), ("edge_feature_dtype", "nope"),
                                            ("edge_feature_shape", [-3])])
def test_a_manifest_with_bad_edge_feature_facts_is_refused(root: Path, key: str, value: object) -> None:
    obj = manifest_json(root)
    typed = obj["format_version"] == 2
    entry = obj["graph"]["edge_types"]["author__writes__paper"] if typed else obj["graph"]
    entry[key] = value
    write_manifest_json(root, obj)
    message = refused(root)
    assert str(root / MANIFEST_FILE) in message and ("edge_feature" in message or "malformed" in message)
