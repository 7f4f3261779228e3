"""Node features stored in another dtype than the source's (``partition_graph(...,
feature_dtype=)``, ``graphfeed-partition partition --feature-dtype``): the partitions hold
the cast rows, servers serve them as stored (cast on the wire as asked), a value that does
not fit is refused naming the field; plain and typed graphs alike."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from graph_fixtures import AnyGraph, typed_view
from in_process_servers import served
from test_loader import TIMEOUTS

from partitioner import load_partition, partition_graph, read_manifest
from trainer_client.loader import RemoteNeighborLoader

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def half(graph: AnyGraph, kind: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(f"half-{kind}")
    partition_graph(graph, 2, root, method="hash", progress=False, feature_dtype="float16")
    return root


def test_partitions_hold_the_features_in_the_dtype_asked(graph: AnyGraph, half: Path) -> None:
    typed = typed_view(graph)
    manifest = read_manifest(half)
    assert manifest.algorithm["feature_dtype"] == "float16"
    for t, x in typed.x.items():
        assert manifest.node_types[t].feature_dtype == "float16"
        for p, data in enumerate(load_partition(half, p) for p in range(2)):
            stored = np.asarray(data.x[t])
            orig = np.asarray(data.orig_ids[t])
            assert stored.dtype == np.float16, (p, t)
            np.testing.assert_array_equal(stored, x[orig].astype(np.float16))


@pytest.mark.parametrize("cache_size", [0.0, 0.5], ids=["no-cache", "cache"])
@pytest.mark.parametrize("wire", ["float32", "bfloat16", "stored"])
def test_servers_serve_the_stored_rows_in_the_dtype_asked(graph: AnyGraph, half: Path, wire: str,
                                                          cache_size: float) -> None:
    typed = typed_view(graph)
    want = {"float32": torch.float32, "bfloat16": torch.bfloat16, "stored": torch.float16}[wire]
    with served(half, 2) as addresses, RemoteNeighborLoader(
            addresses, "train", num_neighbors=[3, 2], batch_size=6, feature_dtype=wire,
            cast_features=False, cache_size=cache_size, **TIMEOUTS) as loader:
        batches = list(loader)
    assert batches
    for batch in batches:
        stores = {t: batch[t] for t in batch.node_types} if typed.typed else {typed.target_type: batch}
        for t, store in stores.items():
            if t not in typed.x:
                continue
            rows = torch.from_numpy(typed.x[t][store.n_id.numpy()].astype(np.float16))
            assert store.x.dtype == want
            assert torch.equal(store.x, rows.to(want)), t


def test_a_value_that_does_not_fit_is_refused_naming_the_field(graph: AnyGraph, tmp_path: Path) -> None:
    typed = typed_view(graph)
    t = next(iter(typed.x))
    big = typed.x[t].copy()
    big[3, 1] = 1e6
    broken = dataclasses.replace(graph, x={**typed.x, t: big} if isinstance(graph.x, dict) else big)
    with pytest.raises(ValueError, match=r"feature_dtype: float16 holds values up to .* node 3 .* 1e\+06"):
        partition_graph(broken, 2, tmp_path, method="hash", progress=False, feature_dtype="float16")


def test_an_unknown_dtype_is_refused(graph: AnyGraph, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"feature_dtype: expected one of \['float16', 'float32', "
                                         r"'float64'\] .* got 'int8'"):
        partition_graph(graph, 2, tmp_path, method="hash", progress=False, feature_dtype="int8")


def test_the_cli_stores_half_precision_and_tells_a_different_dtype_apart(tmp_path: Path) -> None:
    out = tmp_path / "parts"
    base = [sys.executable, "-m", "partitioner", "partition", "--synthetic", "small", "--num-parts", "2",
            "--method", "hash", "--out", str(out), "--no-progress"]
    subprocess.run([*base, "--feature-dtype", "float16"], check=True, capture_output=True, cwd=ROOT)
    assert read_manifest(out).node_types[read_manifest(out).target_type].feature_dtype == "float16"
    again = subprocess.run([*base, "--skip-existing"], capture_output=True, text=True, cwd=ROOT)
    assert again.returncode != 0
    assert "--feature-dtype float16 there, None asked" in again.stderr
