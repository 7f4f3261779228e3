"""The elastic demo: three trainer nodes of one rank each under ``graphfeed-local --nnodes
2:3`` on ``small`` in 2 partitions, one node killed (its agent and its rank, ``kill -9``)
in the middle of an epoch, against the same run left alone. Per seed: the test accuracy,
the world size at the end, where the job resumed and how long after the kill.

Writes ``benchmarks/results/elastic.json``. Usage (from the repository root)::

    python benchmarks/experiments/elastic.py [--seeds 0 1 2] [--epochs 10] [--kill-epoch 4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import ensure_partitions, machine, write_json

from trainer_client.ddp import last_saved

log = logging.getLogger("bench.elastic")
#: graphfeed-train's arguments of the demo (those of `make demo`), checkpointing every 2 steps.
TRAIN = ["--fanouts", "10,5", "--batch-size", "128", "--device", "cpu", "--no-progress",
         "--checkpoint-every", "2", "--resume"]
#: A log line's time, as graphfeed-train writes it.
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank0 INFO trainer_client.train: resumed from "
                   r"\S+ at (.+)$", re.MULTILINE)


def _kill_a_node(local_log: Path) -> int:
    """Kill the last trainer node graphfeed-local started: its agent, then its ranks."""
    agents = re.search(r"torchrun agents \[([\d, ]+)\]", local_log.read_text())
    assert agents, "graphfeed-local named no agents"
    agent = psutil.Process(int(agents.group(1).split(",")[-1]))
    ranks = agent.children()
    agent.kill()
    for rank in ranks:
        rank.kill()
    return agent.pid


def one_run(part_dir: Path, out: Path, seed: int, epochs: int, kill_epoch: int | None) -> dict[str, Any]:
    """One job; with ``kill_epoch``, a node is killed once the first checkpoint part way
    through that epoch is written."""
    cmd = [sys.executable, "-m", "trainer_client.local", "--partition-dir", str(part_dir),
           "--server-device", "cpu", "--nnodes", "2:3", "--log-dir", str(out / "logs"), "--",
           "--epochs", str(epochs), "--seed", str(seed), *TRAIN, "--checkpoint-dir", str(out / "ckpt"),
           "--metrics-json", str(out / "metrics.json")]
    local_log = out / "local.log"
    started = time.perf_counter()
    killed_at = None
    with local_log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
        try:
            while kill_epoch is not None and killed_at is None and proc.poll() is None:
                saved = last_saved(out / "ckpt") if (out / "ckpt").is_dir() else None
                if saved and saved[1].endswith(f" of epoch {kill_epoch}"):
                    _kill_a_node(local_log)
                    killed_at = (datetime.datetime.now(), saved[1])
                time.sleep(0.1)
            code = proc.wait(timeout=1800)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
    assert code == 0, local_log.read_text()[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    row: dict[str, Any] = {"seed": seed, "test_acc": metrics["test_acc"], "world_size": metrics["world_size"],
                           "selected_epoch": metrics["selected_epoch"],
                           "seconds": round(time.perf_counter() - started, 1)}
    if killed_at is not None:
        resumed = [m for m in STAMP.finditer(local_log.read_text())
                   if datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") > killed_at[0]]
        assert resumed, "the job never resumed after the kill"
        first = resumed[0]
        waited = datetime.datetime.strptime(first.group(1), "%Y-%m-%d %H:%M:%S,%f") - killed_at[0]
        row.update(killed_after=killed_at[1], resumed_at=first.group(2),
                   seconds_to_resume=round(waited.total_seconds(), 1))
    log.info("%s", row)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--kill-epoch", type=int, default=4, help="the epoch in which a node is killed")
    p.add_argument("--data", type=Path, default=Path("data/bench"))
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    part_dir = ensure_partitions(args.data, "small", 2)
    runs: dict[str, list[dict[str, Any]]] = {"unbroken": [], "one node killed": []}
    for seed in args.seeds:
        for name, kill in (("unbroken", None), ("one node killed", args.kill_epoch)):
            with tempfile.TemporaryDirectory(prefix="graphfeed-elastic-") as tmp:
                runs[name].append(one_run(part_dir, Path(tmp), seed, args.epochs, kill))
    summary = {name: {"test_acc_mean": round(statistics.mean(r["test_acc"] for r in rows), 4),
                      "test_acc_stdev": round(statistics.stdev(r["test_acc"] for r in rows), 4)
                      if len(rows) > 1 else 0.0} for name, rows in runs.items()}
    payload = {"benchmark": "elastic", "machine": machine(), "graph": "small, 2 partitions",
               "command": f"graphfeed-local --nnodes 2:3 -- --epochs {args.epochs} {' '.join(TRAIN)}",
               "kill_epoch": args.kill_epoch, "summary": summary, "runs": runs}
    path = write_json("elastic", payload)
    log.info("%s; wrote %s", summary, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
