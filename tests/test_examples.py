"""The scripts of examples/ run as a user runs them, against real sampling servers on
loopback (in this process), and print their final metrics: a plain graph (small) and a
typed one (mag-small), a few epochs each."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
from test_loader import RealServers

REPO = Path(__file__).resolve().parents[1]


def example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (its ``main(argv)`` is the script)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPO / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def typed_parts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from partitioner.synthetic import generate_typed
    from partitioner.writer import partition_graph

    out = tmp_path_factory.mktemp("typed") / "mag-small-2"
    graph = generate_typed("mag-small", progress=False).add_reverse()
    partition_graph(graph, 2, out, progress=False)
    return out


@pytest.mark.parametrize(("name", "epochs", "chance"), [("node_classification", 3, 1 / 6),
                                                         ("typed_graph", 2, 1 / 8),
                                                         ("sparse_embeddings", 3, 1 / 8)])
def test_an_example_trains_and_prints_its_final_metrics(
    name: str, epochs: int, chance: float, tmp_path: Path, typed_parts: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    parts = tmp_path / "small-2" if name == "node_classification" else typed_parts  # small: partitioned here
    cluster = RealServers(parts, 2)
    try:
        metrics_path = tmp_path / "metrics.json"
        metrics = example(name).main(["--servers", ",".join(cluster.addresses), "--epochs", str(epochs),
                                      "--metrics-json", str(metrics_path)])
    finally:
        cluster.stop()
    out = capsys.readouterr().out
    assert out.count("val acc") == epochs + 1  # a line per epoch, then the result
    last = out.strip().splitlines()[-1]
    assert last == (f"best val acc {metrics['best_val_acc']:.4f} (epoch {metrics['best_epoch']}), "
                    f"test acc {metrics['test_acc']:.4f}")
    assert json.loads(metrics_path.read_text()) == metrics
    assert 0 <= metrics["best_epoch"] < epochs
    assert metrics["test_acc"] > 2 * chance and metrics["best_val_acc"] > 2 * chance  # it learned
