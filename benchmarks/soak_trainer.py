"""One trainer process of the soak (``benchmarks/soak.py``): a ``RemoteNeighborLoader``
over epoch after epoch until a set time, as one rank of a job, writing what it saw.

Each line of ``--log`` is a JSON object: ``batch`` (wall time, epoch, index, seconds the
loader kept it waiting), ``resume`` (a stream broke and was called again: the status code),
``epoch`` (an epoch done: batches, and its seeds checked against the epoch's plan: every
seed of this rank's batches exactly once, ``lost`` and ``doubled``), ``error`` (the
loader's error, which ends the process with exit 1) and ``done``. A restarted trainer (the
soak kills and restarts some) continues after the last epoch its log says it finished, as
a job restarted from its checkpoint would.

Usage: ``python benchmarks/soak_trainer.py --servers A,B --log t.jsonl --rank 0
--world-size 2 --stop-file F [--kind plain|typed] [--step-ms N]``: no epoch starts once
the file ``F`` exists (the soak makes it when its time is up).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from protos.channel import GraphfeedError
from trainer_client.loader import RemoteNeighborLoader

#: Batch size and fanouts of each kind of job (small graphs: a 2-core machine runs 16).
PRESETS: dict[str, dict[str, Any]] = {
    "plain": {"batch_size": 32, "num_neighbors": [10, 5]},
    "typed": {"batch_size": 64, "num_neighbors": [5, 5]},
}
_BROKE = re.compile(r"stream broke at batch \d+ \((\w+)")


class _Events:
    """Appends JSON lines to the log, flushed at once (the process may be killed)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out

    def write(self, event: str, **fields: Any) -> None:
        self._out.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
        self._out.flush()


class _ResumeCodes(logging.Handler):
    """Turns the loader's "stream broke ... (CODE: ...); resuming" warnings into events."""

    def __init__(self, events: _Events) -> None:
        super().__init__(logging.WARNING)
        self._events = events

    def emit(self, record: logging.LogRecord) -> None:
        match = _BROKE.search(record.getMessage())
        if match:
            code = match.group(1) if match.group(1) != "stalled" else "STALLED"
            self._events.write("resume", code=code)


def next_epoch(log: Path) -> int:
    """The epoch after the last one ``log`` records as finished (0 for a new log)."""
    last = -1
    if log.exists():
        for line in log.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill
                continue
            if event.get("event") == "epoch":
                last = max(last, int(event["epoch"]))
    return last + 1


def _seeds(batch: Any) -> np.ndarray:
    """The seeds (original IDs) of a batch: a ``Data``'s, or those of the ``HeteroData``'s
    node type that has ``batch_size`` (the seeds' type)."""
    store = next(s for s in batch.node_stores if "batch_size" in s)
    return store.n_id[: store.batch_size].numpy()


def expected_seeds(loader: RemoteNeighborLoader) -> np.ndarray:
    """The seeds of this rank's batches in the loader's current epoch, by its plan."""
    refs = loader.plan(loader.epoch).rank_batches(loader.rank)
    positions = np.concatenate([loader.input_ids(ref) for ref in refs]) if refs else \
        np.empty(0, np.int64)
    return loader.input_nodes.numpy()[positions]


def run_epoch(loader: RemoteNeighborLoader, events: _Events, step: float,
              stop: Path | None) -> bool:
    """Stream the loader's current epoch; write its batches and its seed check. False
    when the file ``stop`` appeared mid-epoch (a client stopped on purpose: the epoch is
    left out)."""
    got: list[np.ndarray] = []
    asked = time.perf_counter()
    for index, batch in enumerate(loader):
        events.write("batch", epoch=loader.epoch, i=index, wait=round(time.perf_counter() - asked, 4))
        got.append(_seeds(batch))
        if step:
            time.sleep(step)
        if stop is not None and stop.exists():
            return False
        asked = time.perf_counter()
    seeds = np.concatenate(got) if got else np.empty(0, np.int64)
    expected = expected_seeds(loader)
    unique = np.unique(seeds)
    lost = int(np.setdiff1d(expected, unique).size)
    doubled = int(seeds.size - unique.size + np.setdiff1d(unique, expected).size)
    events.write("epoch", epoch=loader.epoch, batches=len(got), seeds=int(expected.size), lost=lost,
                 doubled=doubled, resumes=loader.last_stats.resumes)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", required=True)
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--kind", choices=tuple(PRESETS), default="plain")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-file", type=Path, required=True,
                   help="no epoch starts once this file exists")
    p.add_argument("--stop-mid-epoch", action="store_true",
                   help="stop once --stop-file exists even mid-epoch (a slow client)")
    p.add_argument("--step-ms", type=float, default=0.0, help="pause after every batch")
    p.add_argument("--client-id", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with args.log.open("a") as out:
        events = _Events(out)
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
        logging.getLogger("trainer_client.stream").addHandler(_ResumeCodes(events))
        epoch = next_epoch(args.log)
        events.write("start", epoch=epoch, preset=args.kind, rank=args.rank)
        try:
            with RemoteNeighborLoader(args.servers, "train", shuffle=True, rank=args.rank,
                                      world_size=args.world_size, seed=args.seed,
                                      reconnect_timeout=120.0, connect_timeout=300.0,
                                      client_id=args.client_id, **PRESETS[args.kind]) as loader:
                while not args.stop_file.exists():
                    loader.set_epoch(epoch)
                    if not run_epoch(loader, events, args.step_ms / 1000,
                                     args.stop_file if args.stop_mid_epoch else None):
                        break
                    epoch += 1
        except GraphfeedError as exc:
            events.write("error", error=type(exc).__name__,
                         code=exc.code.name if exc.code is not None else None, message=str(exc)[:500])
            return 1
        events.write("done", epochs=epoch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
