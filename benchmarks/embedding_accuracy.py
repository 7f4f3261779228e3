"""Accuracy with server-held embeddings (not a test).

* R-GCN on ``mag-small`` (its authors, institutions and fields of study have no
  features): the dense replicated embeddings against ``--sparse-embedding`` (the servers'
  tables, sparse Adagrad), the same model, batches and epochs, for every seed of
  ``--seeds``; each side's test accuracy per seed, mean and standard deviation, and
  Welch's t-test of the difference.
* Link prediction on ``citation2-bare-small`` (no features at all: the nodes' embeddings
  are all the encoder has), with ``--sparse-embedding``, per seed, against the MRR of a
  ranking that knows nothing of the graph (each positive ranked at random among its 100
  stored negatives: ``H(101) / 101``).

Both graphs are partitioned in 2 and served in this process. Writes
``benchmarks/results/embedding-accuracy.json``.

    python benchmarks/embedding_accuracy.py --seeds 0,1,2,3,4
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import machine, write_json
from link_accuracy import summary, welch

log = logging.getLogger("bench.embedding_accuracy")

NODE_FLAGS = ["--model", "rgcn", "--fanouts", "10,5", "--batch-size", "256", "--hidden", "32",
              "--lr", "0.01", "--device", "cpu", "--no-progress"]
LINK_FLAGS = ["--task", "link", "--model", "sage", "--fanouts", "10,5", "--batch-size", "512",
              "--hidden", "64", "--lr", "0.003", "--dropout", "0.0", "--device", "cpu", "--no-progress"]


def train(addresses: list[str], flags: Sequence[str], seed: int, out: Path) -> dict[str, Any]:
    """One ``graphfeed-train`` run; its metrics."""
    import json

    from trainer_client.train import main

    path = out / f"metrics-{seed}-{time.monotonic_ns()}.json"
    code = main(["--servers", ",".join(addresses), *flags, "--seed", str(seed), "--metrics-json", str(path)])
    if code != 0:
        raise RuntimeError(f"graphfeed-train {' '.join(flags)} --seed {seed} ended with {code}")
    metrics: dict[str, Any] = json.loads(path.read_text())
    return metrics


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("trainer_client").setLevel(logging.WARNING)
    logging.getLogger("sampling_server").setLevel(logging.WARNING)
    from in_process_servers import serving

    from partitioner import partition_graph
    from partitioner.synthetic import generate

    seeds = [int(s) for s in args.seeds.split(",")]
    epochs = ["--epochs", str(args.epochs)]
    report: dict[str, Any] = {"benchmark": "embedding-accuracy", "machine": machine(), "seeds": seeds}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for preset in ("mag-small", "citation2-bare-small"):
            partition_graph(generate(preset, progress=False), 2, root / preset, method="random",
                            progress=False)
        with serving(root / "mag-small", 2, state_dir=root / "state-mag") as (addresses, _):
            sides: dict[str, list[dict[str, Any]]] = {"dense": [], "sparse": []}
            for seed in seeds:
                for side, extra in (("dense", []), ("sparse", ["--sparse-embedding"])):
                    sides[side].append(train(addresses, [*NODE_FLAGS, *epochs, *extra], seed, root))
                    log.info("mag-small seed %d, %s embeddings: test acc %.4f", seed, side,
                             sides[side][-1]["test_acc"])
        node = {side: summary(runs) for side, runs in sides.items()}
        report["node"] = {**node, "welch": welch(node["dense"]["test"], node["sparse"]["test"]),
                          "flags": NODE_FLAGS + epochs}
        with serving(root / "citation2-bare-small", 2, state_dir=root / "state-bare") as (addresses, _):
            runs = []
            for seed in seeds:
                runs.append(train(addresses, [*LINK_FLAGS, *epochs, "--sparse-embedding"], seed, root))
                log.info("citation2-bare-small seed %d: test mrr %.4f", seed, runs[-1]["test_mrr"])
        negatives = 100
        random_mrr = sum(1.0 / r for r in range(1, negatives + 2)) / (negatives + 1)
        report["link"] = {"sparse": summary(runs), "random_ranking_mrr": random_mrr,
                          "flags": LINK_FLAGS + epochs + ["--sparse-embedding"]}
    path = write_json("embedding-accuracy", report)
    log.info("R-GCN on mag-small: dense %.4f ± %.4f, server-held %.4f ± %.4f (Welch p %.2f); "
             "citation2-bare-small MRR %.4f ± %.4f (random ranking %.4f) -> %s",
             node["dense"]["mean"], node["dense"]["std"], node["sparse"]["mean"], node["sparse"]["std"],
             report["node"]["welch"]["p"], report["link"]["sparse"]["mean"], report["link"]["sparse"]["std"],
             random_mrr, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
