"""``structure: auto`` and ``features: auto``: when a server takes the whole graph's
structure, or every node's features and labels (every partition's files present, the
graph partitioned, the arrays small against the memory they would live in), and how many
bytes they take."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from graph_fixtures import mixed_graph, write_and_load

from partitioner.format import read_manifest
from partitioner.joins import load_node_data, load_structure, node_data_bytes
from sampling_server.structure import (
    AUTO_MEMORY_FRACTION,
    StructureChoice,
    available_host_memory,
    choose_features,
    choose_structure,
    structure_bytes,
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mixed-2")
    write_and_load(mixed_graph(), out, 2)
    return out


def test_the_structure_s_bytes_are_what_load_structure_holds(root: Path) -> None:
    m = read_manifest(root)
    full = load_structure(root)
    assert structure_bytes(m) == full.nbytes
    assert full.edge_weight is not None  # the mixed graph has weights: 4 bytes an edge counted


def test_auto_takes_the_whole_structure_where_it_fits(root: Path) -> None:
    m = read_manifest(root)
    need = structure_bytes(m)
    enough = int(need / AUTO_MEMORY_FRACTION) + 1
    choice = choose_structure("auto", m, root, host_free=enough)
    assert choice.mode == "full" and "every partition's structure files" in choice.reason
    assert f"take {need / 2**20:.1f} MiB" in choice.reason  # a small graph's size in MiB
    assert choose_structure("auto", m, root, host_free=None).mode == "full"  # unknown: no limit
    small = choose_structure("auto", m, root, host_free=enough - 8)
    assert small.mode == "partition" and "of host memory" in small.reason
    gpu = choose_structure("auto", m, root, host_free=enough, gpu_free=enough - 8)
    assert gpu.mode == "partition" and "of GPU memory" in gpu.reason
    assert choose_structure("auto", m, root, host_free=enough, gpu_free=enough).mode == "full"


CHOICES = [(choose_structure, "indptr"), (choose_features, "y")]


@pytest.mark.parametrize(("choose", "role"), CHOICES, ids=["structure", "features"])
def test_auto_keeps_the_partition_s_own_where_a_file_is_missing(
        root: Path, tmp_path: Path, choose: Callable[..., StructureChoice], role: str) -> None:
    copy = tmp_path / "parts"
    shutil.copytree(root, copy)
    (copy / "part-1" / f"{role}.npy").unlink()
    choice = choose("auto", read_manifest(copy), copy, host_free=None)
    assert choice.mode == "partition" and f"part-1/{role}.npy" in choice.reason


@pytest.mark.parametrize(("choose", "role"), CHOICES, ids=["structure", "features"])
def test_one_partition_is_its_own_whole_graph(
        tmp_path: Path, choose: Callable[..., StructureChoice], role: str) -> None:
    write_and_load(mixed_graph(), tmp_path, 1)
    m = read_manifest(tmp_path)
    for setting in ("auto", "full", "partition"):
        assert choose(setting, m, tmp_path, host_free=None).mode == "partition"


def test_explicit_settings_are_kept_and_others_refused(root: Path) -> None:
    m = read_manifest(root)
    assert choose_structure("full", m, root, host_free=1).mode == "full"
    assert choose_structure("partition", m, root, host_free=None).mode == "partition"
    with pytest.raises(ValueError, match=r"^structure: expected one of"):
        choose_structure("halo", m, root, host_free=None)


def test_available_host_memory_is_a_positive_byte_count() -> None:
    free = available_host_memory()
    assert free is None or free > 0


# -- every node's features and labels ---------------------------------------------------
def test_the_features_bytes_are_what_load_node_data_holds(root: Path) -> None:
    assert node_data_bytes(read_manifest(root)) == load_node_data(root).nbytes


def test_auto_takes_every_feature_where_it_fits_on_the_cpu(root: Path, tmp_path: Path) -> None:
    """``features: auto``: every row where the files are there and they fit in a quarter of
    the host memory; the partition's own rows where a file is missing, or on a CUDA server
    without the whole structure (its feature table's order), where ``full`` is refused,
    naming the field."""
    m = read_manifest(root)
    enough = int(node_data_bytes(m) / AUTO_MEMORY_FRACTION) + 4
    choice = choose_features("auto", m, root, host_free=enough)
    assert choice.mode == "full" and "feature and label files" in choice.reason
    small = choose_features("auto", m, root, host_free=enough - 8)
    assert small.mode == "partition" and "host memory" in small.reason
    gpu = choose_features("auto", m, root, host_free=enough, cuda_partition_structure=True)
    assert gpu.mode == "partition" and "CUDA" in gpu.reason
    with pytest.raises(ValueError, match=r"^features: 'full' on a CUDA server needs the whole"):
        choose_features("full", m, root, host_free=None, cuda_partition_structure=True)
    assert choose_features("full", m, root, host_free=1).mode == "full"
    assert choose_features("partition", m, root, host_free=None).mode == "partition"
    with pytest.raises(ValueError, match=r"^features: expected one of"):
        choose_features("hot", m, root, host_free=None)
    one = tmp_path / "one"
    write_and_load(mixed_graph(), one, 1)
    assert choose_features("full", read_manifest(one), one, host_free=None,
                           cuda_partition_structure=True).mode == "partition"
