"""benchmarks/scale_model.py, the cost model behind docs/operations.md "Sizing": fitted on
the runs the documentation cites it reproduces every one within its tolerance, checking
a model against runs gives the errors its fit reports, and it counts the batches a
stream samples ahead as the server does."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FIGURES = ("start_memory", "runs_memory", "peak_memory", "startup")


@pytest.fixture
def model_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("scale_model")


@pytest.mark.parametrize("name", ["scale.json", "scale-float32.json"])
def test_the_model_fitted_on_a_cited_run_reproduces_it_within_the_tolerance(
        model_module: ModuleType, name: str) -> None:
    payload = importlib.import_module("common").read_results(RESULTS / name)
    model = model_module.fit(payload["rows"])
    assert model["within_tolerance"], {k: model[k]["max_error"] for k in FIGURES}
    assert {k: model[k]["max_error"] for k in FIGURES} == {k: payload["model"][k]["max_error"]
                                                          for k in FIGURES}  # as written
    # check() computes each figure from the coefficients as the docs state them: the
    # same errors, but for the coefficients' rounding.
    checked = model_module.check(model, payload["rows"])
    worst = max(model[k]["max_error"] for k in FIGURES)
    assert checked["max_error"] == pytest.approx(worst, abs=0.01)
    assert len(checked["points"]) == len(payload["rows"])


def test_predictions_shrink_per_server_with_more_partitions_and_half_features(
        model_module: ModuleType) -> None:
    model = importlib.import_module("common").read_results(RESULTS / "scale.json")["model"]
    p = model_module.PAPERS100M
    at = {(parts, size): model_module.predict(model, p["nodes"], p["edges"], p["feature_bytes"] * size / 4,
                                             parts, prefetch_bytes=128 << 20)
          for parts in (8, 16) for size in (2, 4)}
    for size in (2, 4):
        for key in ("held_gib", "start_memory_gib", "peak_memory_gib", "runs_memory_gib", "startup_seconds"):
            assert at[(16, size)][key] < at[(8, size)][key], key
    for parts in (8, 16):
        assert at[(parts, 2)]["held_gib"] < at[(parts, 4)]["held_gib"]
        assert at[(parts, 2)]["peak_memory_gib"] < at[(parts, 4)]["peak_memory_gib"]
        assert at[(parts, 2)]["start_memory_gib"] == at[(parts, 4)]["start_memory_gib"]  # reads no features


@pytest.mark.parametrize(("prefetch", "prefetch_bytes", "batch_bytes"),
                         [(4, None, 10), (4, 100, 30), (4, 100, 1000), (2, 1 << 30, 5), (4, 64, 64)])
def test_the_batches_ahead_are_the_servers(model_module: ModuleType, prefetch: int,
                                          prefetch_bytes: int | None, batch_bytes: int) -> None:
    from concurrent.futures import Future

    from sampling_server.pipeline import Ahead

    ahead = Ahead(prefetch, prefetch_bytes)
    done: Future[object] = Future()
    done.set_result(type("Batch", (), {"sizes": [batch_bytes]})())
    ahead.produced(done)
    assert model_module.ahead(batch_bytes, prefetch, prefetch_bytes) == ahead.batches()
