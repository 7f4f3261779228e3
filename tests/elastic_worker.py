"""One rank of the elastic tests (tests/test_elastic.py), run by torchrun's elastic agent:
``graphfeed-train`` itself (its arguments), with its training batches recorded step by
step and, once, a pause that the test ends by killing the rank or adding one.

Environment:

* ``ELASTIC_RECORDS``: a directory; this process makes ``<pid>.jsonl`` there at once,
  and appends JSON lines to it:
  ``{"kind": "start", "t", "epoch", "step", "seeds_done", "world", "rank"}`` where its
  first training pass starts (``t``: when this process started, before any step of its
  attempt), then ``{"kind": "step", "t", "epoch", "step", "world", "rank", "seeds"}``
  per training batch (the seeds' original IDs), written before the batch is trained.
* ``ELASTIC_PAUSE``: ``world:rank:epoch:step``: that rank of a job of that world size
  writes ``paused-<pid>.json`` (its agent's pid) there before that step and waits, until
  the test kills it or its agent restarts it (or 10 minutes pass: an error).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from protos.plan import EPOCH_START, EpochProgress  # noqa: E402
from trainer_client import train  # noqa: E402
from trainer_client.node_task import cluster_task  # noqa: E402

STARTED = time.monotonic()
RECORDS = Path(os.environ["ELASTIC_RECORDS"])
PAUSE = tuple(int(v) for v in os.environ.get("ELASTIC_PAUSE", "-1:-1:-1:-1").split(":"))
(RECORDS / f"{os.getpid()}.jsonl").touch()  # from the start: the test ends every rank it started


def record(**fields: Any) -> None:
    """Append one line in one write (a killed process leaves whole lines only)."""
    line = (json.dumps(fields) + "\n").encode()
    fd = os.open(RECORDS / f"{os.getpid()}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class Recorded:
    """A rank's training batches, recorded (see the module doc)."""

    def __init__(self, inner: Any, rank: int, world: int) -> None:
        self.inner, self.rank, self.world = inner, rank, world
        self.epoch = self.step = 0
        self.started = False

    def set_epoch(self, epoch: int, start: EpochProgress = EPOCH_START) -> None:
        self.inner.set_epoch(epoch, start)
        self.epoch, self.step = epoch, start.steps
        if not self.started:
            self.started = True
            record(kind="start", t=STARTED, epoch=epoch, step=start.steps, seeds_done=start.seeds,
                   world=self.world, rank=self.rank)

    def progress_after(self, steps: int) -> EpochProgress:
        return self.inner.progress_after(steps)  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        nodes = self.inner.input_nodes
        for batch in self.inner:
            if (self.world, self.rank, self.epoch, self.step) == PAUSE:
                pause()
            record(kind="step", t=time.monotonic(), epoch=self.epoch, step=self.step, world=self.world,
                   rank=self.rank, seeds=nodes[batch.input_id].tolist())
            self.step += 1
            yield batch


def pause() -> None:
    marker = RECORDS / f"paused-{os.getpid()}.json"
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps({"agent": os.getppid(), "pid": os.getpid()}))
    os.replace(tmp, marker)
    threading.Event().wait(600)  # until the test kills this rank or its agent restarts it
    raise SystemExit("elastic_worker: paused for 10 minutes, and nobody ended it")


def recorded_task(*args: Any) -> Any:
    task = cluster_task(*args)
    task.train = Recorded(task.train, task.env.rank, task.env.world_size)
    return task


if __name__ == "__main__":
    train.cluster_task = recorded_task  # type: ignore[assignment]
    sys.exit(train.main())
