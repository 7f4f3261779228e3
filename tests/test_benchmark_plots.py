"""The benchmarks' plots, drawn from the results the documentation cites (what
``--plot-only`` does)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``bench(name)``: ``benchmarks/<name>.py`` imported as it runs (its folder on the path)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))

    def load(name: str) -> ModuleType:
        return importlib.import_module(name)

    return load


def _png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_the_sampler_plot_compares_with_pyg_on_each_machine(bench: Any, tmp_path: Path) -> None:
    sampler, common = bench("sampler"), bench("common")
    cpu, gpu = (common.read_results(RESULTS / name) for name in ("sampler.json", "gpu-check.json"))
    picked = sampler.plot_rows(cpu["rows"])
    pyg = [r["seeds_per_s"] for r in cpu["rows"]
           if r["label"].startswith("pyg") and r["label"].endswith("structure")]
    assert picked["PyG NeighborLoader, CPU, best num_workers"]["structure"] == max(pyg)
    assert set(sampler.plot_rows(common.report_step(gpu, "sampler")["rows"])) == {
        "graphfeed CUDA, graph in GPU memory"}  # the GPU report has no PyG rows, nor the cache rows
    sampler.plot([(common.describe_machine(cpu), cpu["rows"]),
                  (common.describe_machine(gpu), common.report_step(gpu, "sampler")["rows"])],
                 tmp_path / "sampler.png")
    assert _png(tmp_path / "sampler.png")
    assert common.describe_machine(gpu) == "NVIDIA H200, 16 cores"
    assert common.describe_machine(cpu) == "2 cores, Intel Xeon"


def test_the_stream_plot_sets_delivered_batches_against_the_step(bench: Any, tmp_path: Path) -> None:
    stream, common = bench("stream"), bench("common")
    report = common.read_results(RESULTS / "gpu-check.json")
    rows = common.report_step(report, "stream")["rows"]
    assert {r.get("cache_size") for r in rows if r["label"].startswith("graphfeed-server")} == {"0", "auto"}
    stream.plot(rows, tmp_path / "with-server.png", "NVIDIA H200, 16 cores", 9.19)
    two_cores = common.read_results(RESULTS / "stream.json")  # no real-server rows: MiB/s bars
    stream.plot(two_cores["rows"], tmp_path / "replay.png", common.describe_machine(two_cores))
    assert _png(tmp_path / "with-server.png") and _png(tmp_path / "replay.png")


@pytest.mark.parametrize("name", ["feature_cache.json", "feature_cache_typed.json"])
def test_the_feature_cache_plot_draws_bytes_per_batch(bench: Any, tmp_path: Path, name: str) -> None:
    feature_cache, common = bench("feature_cache"), bench("common")
    feature_cache.plot(common.read_results(RESULTS / name), tmp_path / "cache.png")
    assert _png(tmp_path / "cache.png")

