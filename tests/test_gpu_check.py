"""benchmarks/gpu_check.py (`make gpu-check`): its verdicts, deadlines and report, with
stand-in steps (no GPU here; the real steps run on a machine that has one)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "RESULTS", tmp_path / "results")
    return module


def test_without_gpu_says_so_and_exits_0(gpu_check: Any, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setattr(gpu_check, "gpu_info", lambda: None)
    assert gpu_check.main(["--data", str(tmp_path / "data")]) == 0
    assert "no usable CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "results").exists()


def test_steps_report_and_verdict(gpu_check: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    py = sys.executable
    gpu = {"name": "Stand-in GPU", "capability": [9, 0], "memory_gib": 80.0, "torch": "x",
           "torch_cuda": "12", "nccl": "2", "numba": "y"}
    monkeypatch.setattr(gpu_check, "gpu_info", lambda: gpu)
    rows = {"rows": [{"label": "graphfeed cuda/uva: structure", "seeds_per_s": 123.0}], "ratios": {"r": 2.0}}

    def steps(args: Any) -> list[tuple[Any, float]]:
        results = gpu_check.RESULTS
        write = (f"import json, pathlib; p = pathlib.Path({str(results)!r}); p.mkdir(parents=True, "
                 f"exist_ok=True); (p / 'gpu-check-sampler.json').write_text(json.dumps({rows!r}))")
        return [
            (gpu_check.Step("gpu tests", [py, "-c", "print('3 passed, 1 skipped in 1.0s')"]), 0.25),
            (gpu_check.Step("sampler", [py, "-c", write]), 0.25),
            (gpu_check.Step("stream", [py, "-c", "import sys; print('boom'); sys.exit(3)"]), 0.25),
            (gpu_check.Step("demo (1 GPU, NCCL)", [py, "-c", "import time; time.sleep(60)"]), 0.25),
        ]

    monkeypatch.setattr(gpu_check, "steps_for", steps)
    monkeypatch.setattr(gpu_check, "preflight", lambda env: [])
    assert gpu_check.main(["--data", str(tmp_path / "data"), "--budget", "12"]) == 1
    report = json.loads((tmp_path / "results" / "gpu-check.json").read_text())
    by = {s["name"]: s for s in report["steps"]}
    assert report["gpu"]["name"] == "Stand-in GPU"
    assert by["gpu tests"]["status"] == "passed"
    assert by["gpu tests"]["figures"] == {"passed": 3, "skipped": 1}
    assert by["sampler"]["figures"]["rows"][0]["seeds_per_s"] == 123.0
    assert (by["stream"]["status"], by["stream"]["returncode"]) == ("failed", 3)
    assert by["demo (1 GPU, NCCL)"]["status"] == "timed out"
    assert report["seconds"] < 12 + 5  # the budget bounds the whole run
    md = (tmp_path / "results" / "gpu-check.md").read_text()
    assert md.startswith("# gpu-check: Stand-in GPU")
    assert "| stream | failed |" in md and "boom" in md
    assert "| graphfeed cuda/uva: structure | 123.0 |" in md


def test_a_failed_preflight_names_the_problem_and_runs_no_step(
        gpu_check: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gpu = {"name": "Stand-in GPU", "capability": [9, 0], "memory_gib": 80.0, "torch": "x",
           "torch_cuda": "12", "nccl": "2", "numba": "y"}
    monkeypatch.setattr(gpu_check, "gpu_info", lambda: gpu)
    marker = tmp_path / "ran"
    step = gpu_check.Step("gpu tests", [sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    monkeypatch.setattr(gpu_check, "steps_for", lambda args: [(step, 1.0)])
    monkeypatch.setattr(gpu_check, "preflight",
                        lambda env: ["import grpc_health.v1.health: ModuleNotFoundError: x"])
    assert gpu_check.main(["--data", str(tmp_path / "data"), "--budget", "12"]) == 1
    assert not marker.exists()
    report = json.loads((tmp_path / "results" / "gpu-check.json").read_text())
    assert report["preflight_problems"] == ["import grpc_health.v1.health: ModuleNotFoundError: x"]
    assert [s["status"] for s in report["steps"]] == ["not run"]
    md = (tmp_path / "results" / "gpu-check.md").read_text()
    assert "Preflight failed" in md and "grpc_health" in md


def test_preflight_finds_a_missing_module_and_a_kernel_that_cannot_run(gpu_check: Any) -> None:
    """Here: a module that does not exist, and no GPU for the test kernel (the simulator off,
    as gpu-check runs its steps)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    problems = gpu_check.preflight(env, ("json", "graphfeed_no_such_module"))
    assert any(p.startswith("import graphfeed_no_such_module: ModuleNotFoundError") for p in problems)
    assert not any(p.startswith("import json") for p in problems)
    assert any(p.startswith("numba-cuda cannot compile and run a kernel") for p in problems)
    assert all(gpu_check.preflight(env, (m,)) == problems[-1:] for m in ("grpc", "yaml"))


def test_the_gpu_step_runs_every_file_with_gpu_tests(gpu_check: Any) -> None:
    mark = re.compile(r"^(@pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu)\b", re.M)
    marked = {f"tests/{path.name}" for path in (ROOT / "tests").glob("test_*.py")
              if mark.search(path.read_text())}
    assert "tests/test_gpu_trainer.py" in marked
    assert set(gpu_check.GPU_TEST_FILES) == marked


def test_the_plan_shares_the_budget_and_reads_the_model_step(gpu_check: Any, tmp_path: Path) -> None:
    import argparse

    plan = gpu_check.steps_for(argparse.Namespace(data=tmp_path / "data", preset="products-like",
                                                  link_preset="citation2-like"))
    assert [s.name for s, _ in plan] == ["gpu tests", "sampler", "stream", "link", "model step", "embeddings",
                                         "layer-wise inference", "demo (1 GPU, NCCL)"]
    assert sum(share for _, share in plan) == pytest.approx(1.0)
    step = next(s for s, _ in plan if s.name == "model step")
    assert "benchmarks/experiments/model_step.py" in step.command and "gpu-check-model-step" in step.command
    results = gpu_check.RESULTS
    results.mkdir(parents=True)
    (results / "gpu-check-model-step.json").write_text(json.dumps({
        "nodes_per_batch_median": 428513, "edges_per_batch_median": 694104,
        "rows": [{"label": "float32", "ms_median": 9.13},
                 {"label": "bfloat16 autocast", "ms_median": 5.73}]}))
    gpu_check.collect_figures(step, tmp_path / "data")
    assert step.figures == {"nodes_per_batch_median": 428513, "edges_per_batch_median": 694104,
                            "float32 ms per step": 9.13, "bfloat16 autocast ms per step": 5.73}
    embeddings = next(s for s, _ in plan if s.name == "embeddings")
    assert "benchmarks/embeddings.py" in embeddings.command and "cuda" in embeddings.command
    (results / "gpu-check-embeddings.json").write_text(json.dumps({
        "summary": {"dense": {"steps_per_s": 2.0}}, "embedding_bytes_ratio": 12.5, "speedup": 3.0}))
    gpu_check.collect_figures(embeddings, tmp_path / "data")
    assert embeddings.figures == {"summary": {"dense": {"steps_per_s": 2.0}}, "embedding_bytes_ratio": 12.5,
                                  "speedup": 3.0}
    layerwise = next(s for s, _ in plan if s.name == "layer-wise inference")
    assert "benchmarks/inference.py" in layerwise.command and layerwise.command.count("cuda") == 2
    runs = {"small": [{"mode": "servers", "layers": 2, "nodes_per_s": 900.0}]}
    (results / "gpu-check-inference.json").write_text(json.dumps({"runs": runs, "exactness": {"plain": {}}}))
    gpu_check.collect_figures(layerwise, tmp_path / "data")
    assert layerwise.figures == {"runs": runs, "exactness": {"plain": {}}}


def test_the_plots_are_redrawn_beside_the_report(gpu_check: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda cmd, **kw: ran.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0, "", ""))
    gpu_check.redraw_plots({})
    assert ran == []  # no results yet: nothing to draw
    gpu_check.RESULTS.mkdir(parents=True)
    for name in ("sampler.json", "gpu-check.json"):
        (gpu_check.RESULTS / name).write_text("{}")
    gpu_check.redraw_plots({})
    results = str(gpu_check.RESULTS)
    assert [(cmd[1], cmd[-1]) for cmd in ran] == [("benchmarks/sampler.py", "sampler"),
                                                  ("benchmarks/stream.py", "gpu-check-stream")]
    assert all((ROOT / cmd[1]).is_file() and cmd[3].startswith(results) for cmd in ran)
