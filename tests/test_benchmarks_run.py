"""The benchmarks a user runs to size a deployment (``benchmarks/*.py``) run end to end on
small presets: a change to the product's API that a benchmark still uses the old way
fails here, not in the next measurement. Figures are not checked (machines are shared and
noisy; docs/performance.md holds them), only that each run ends well and writes its
report with rows in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

#: Each benchmark's arguments for a run of seconds (``{data}``: a fresh data directory).
RUNS: dict[str, list[str]] = {
    "sampler": ["--preset", "small", "--passes", "1", "--batches", "2", "--pyg-batches", "1",
                "--pyg-workers", "0", "--devices", "cpu"],
    "hetero": ["--preset", "mag-small", "--passes", "1", "--batches", "2", "--pyg-batches", "1",
               "--pyg-workers", "0"],
    "stream": ["--preset", "small", "--passes", "1", "--gib", "0.01", "--sizes-kib", "256",
               "--no-diagnostics", "--steps-ms"],
    "feature_cache": ["--preset", "small", "--batches", "1", "--compare-batches", "0", "0"],
    "embeddings": ["--preset", "mag-small", "--passes", "1", "--steps", "2", "--warmup", "1",
                   "--batch-size", "128"],
    "scale": ["--scales", "0.0002", "--parts", "2", "--extra-parts", "--trainers", "1", "--batches", "2",
              "--train-batches", "1", "--feature-dtype", "float16", "--startup-repeats", "1",
              "--prefetch-bytes", str(64 << 20)],
    "inference": ["--plain", "small", "--typed", "", "--quick", "--layers", "2", "--sample-batches", "1",
                  "--batch-size", "2048"],
}
#: The flag naming a benchmark's report (``benchmarks/results/<name>.json``).
NAME_FLAG = {"hetero": "--name"}


@pytest.mark.parametrize("bench", sorted(RUNS))
def test_benchmark_runs_and_writes_its_report(bench: str, tmp_path: Path) -> None:
    name = f"test-run-{bench}-{os.getpid()}"
    report = RESULTS / f"{name}.json"
    cmd = [sys.executable, f"benchmarks/{bench}.py", "--data", str(tmp_path), *RUNS[bench],
           NAME_FLAG.get(bench, "--results-name"), name]
    try:
        run(cmd)
        result = json.loads(report.read_text())
        if bench == "scale":  # start-up measured again, twice a server, into the same report
            run([*cmd, "--startup-only", "--startup-repeats", "2"])
            again = json.loads(report.read_text())
            assert all(len(s["loaded_seconds_each"]) == 2 for r in again["rows"] for s in r["servers"])
    finally:  # a report of this run is not a result the docs cite
        for path in (report, report.with_suffix(".png")):
            path.unlink(missing_ok=True)
    rows = [row for row in result["rows"] if not row.get("skipped")]
    assert rows, f"{bench}: no rows in its report"


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stderr[-4000:]}"
