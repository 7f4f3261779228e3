"""benchmarks/experiments/concurrency.py (sampling workers as threads against processes): its
arguments and ratios, and one real run of both modes on the `small` graph."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from protos.cpus import usable_cpus
from sampling_server.sampler.cpu_kernels import threading_layer as numba_layer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    """benchmarks/experiments/concurrency.py, imported as it runs (its folder and benchmarks/ on the path)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # common
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "experiments"))
    import concurrency

    return concurrency


def test_arguments_are_checked(bench: Any, capsys: pytest.CaptureFixture[str]) -> None:
    args = bench.parse_args([])
    assert args.workers == [1, 2, 4, 6] and args.modes == ["threads", "processes"]
    assert args.allocators == ["keep"] and args.dtype == "bfloat16"
    assert args.layers == ["default"]
    for bad, field in ((["--workers", "0"], "--workers"), (["--seconds", "0"], "--seconds"),
                       (["--layers", "gcd"], "--layers"), (["--spinners", "-1"], "--spinners"),
                       (["--threads", "0"], "--threads"), (["--fanouts", "5", "-1"], "--fanouts")):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        assert field in capsys.readouterr().err


def test_ratios_pair_each_process_row_with_its_thread_row(bench: Any) -> None:
    def row(mode: str, allocator: str, workers: int, rate: float, layer: str = "omp") -> dict[str, Any]:
        return {"mode": mode, "allocator": allocator, "threading_layer": layer, "workers": workers,
                "batches_per_s": rate}

    rows = [row("threads", "keep", 2, 10.0), row("processes", "keep", 2, 15.0),
            row("processes", "keep", 4, 9.0), row("threads", "default", 2, 8.0),
            row("processes", "default", 2, 4.0), row("threads", "keep", 2, 5.0, "workqueue"),
            row("processes", "keep", 2, 10.0, "workqueue")]
    assert bench.ratios(rows) == {"processes_vs_threads(keep, omp, 2)": 1.5,
                                  "processes_vs_threads(default, omp, 2)": 0.5,
                                  "processes_vs_threads(keep, workqueue, 2)": 2.0}
    tensor = [{**r, "x_into": "tensor", "batches_per_s": 5.0} for r in rows[:2]]
    assert bench.ratios(rows[:2] + tensor) == {
        "processes_vs_threads(keep, omp, 2)": 1.5,
        "processes_vs_threads(keep, omp, x into tensor, 2)": 1.0,
        "messages_vs_tensor(threads, keep, omp, 2)": 2.0,
        "messages_vs_tensor(processes, keep, omp, 2)": 3.0}


def test_both_modes_run_for_real(bench: Any, parts1: Path, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "write_json", lambda name, payload: _write(tmp_path, name, payload))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert bench.main(["--partition-dir", str(parts1), "--workers", "2", "--seconds", "0.5",
                       "--batch-size", "64", "--fanouts", "5", "3",
                       "--results-name", "concurrency-test"]) == 0
    result = json.loads((tmp_path / "concurrency-test.json").read_text())
    rows = result["rows"]
    assert [(r["mode"], r["workers"], r["allocator"]) for r in rows] == [
        ("threads", 2, "keep"), ("processes", 2, "keep")]
    for r in rows:
        assert r["batches"] > 0 and r["batches_per_s"] > 0 and r["edges_per_s"] > 0
        assert r["sample_ms"] > 0 and r["gather_ms"] > 0 and r["encode_ms"] > 0
    # kernel calls: every CPU for the threads (the server's default), split among processes
    assert rows[0]["kernel_threads"] == usable_cpus()
    assert rows[1]["kernel_threads"] == max(1, usable_cpus() // 2)
    layer = numba_layer()
    assert [r["threading_layer"] for r in rows] == [layer, layer]
    assert result["machine"]["numba_threading_layer"] == layer
    assert set(result["ratios"]) == {f"processes_vs_threads(keep, {layer}, 2)"}
    assert [p.name for p in tmp_path.iterdir()] == ["concurrency-test.json"]  # scratch removed


def test_a_row_runs_on_the_threading_layer_it_names(bench: Any, parts1: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "write_json", lambda name, payload: _write(tmp_path, name, payload))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert bench.main(["--partition-dir", str(parts1), "--workers", "2", "--seconds", "0.3",
                       "--batch-size", "64", "--fanouts", "5", "3", "--modes", "threads",
                       "--layers", "workqueue", "--spinners", "1",
                       "--results-name", "concurrency-layer"]) == 0
    rows = json.loads((tmp_path / "concurrency-layer.json").read_text())["rows"]
    assert [(r["threading_layer"], r["workers"], r["spinners"]) for r in rows] == [("workqueue", 2, 1)]
    assert rows[0]["batches"] > 0  # two threads took turns at the parallel kernels, no abort


def test_a_child_that_fails_is_reported(bench: Any, parts1: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError, match="exited before it was ready"):
        bench.main(["--partition-dir", str(tmp_path / "missing"), "--workers", "1",
                    "--modes", "threads", "--seconds", "0.5"])
    # a worker thread's error fails its child, with the error in the report
    with pytest.raises(RuntimeError, match="fewer than one batch"):
        bench.main(["--partition-dir", str(parts1), "--workers", "2", "--modes", "threads",
                    "--seconds", "0.5", "--threads", "1", "--batch-size", "100000"])
    assert list(tmp_path.iterdir()) == []  # scratch removed after failures too


def _write(folder: Path, name: str, payload: dict[str, Any]) -> Path:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(payload))
    return path
