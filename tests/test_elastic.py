"""Elastic trainers: ranks of ``graphfeed-train`` under torchrun's elastic agent (one agent
per trainer node, c10d rendezvous, gloo on the CPU) lose a node mid-epoch, or gain one,
and the job goes on from the last checkpoint (``--checkpoint-every``) on the new world
size. Every rank records its batches step by step (tests/elastic_worker.py); the steps
the final model went through (each attempt's records up to where the next one resumed)
must train every training seed of every epoch exactly once, in as many steps as the
plans of the world sizes it ran on ask for, and only the steps since the last checkpoint
are trained again."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from in_process_servers import served

from trainer_client.in_process import LocalGraph
from trainer_client.local import ELASTIC_ENV, elastic_agent

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "elastic_worker.py"
BATCH, EVERY, EPOCHS = 64, 2, 3
#: graphfeed-train's arguments (the checkpoint directory and the metrics go after them).
TRAIN = ["--epochs", str(EPOCHS), "--fanouts", "5,3", "--batch-size", str(BATCH), "--hidden", "16",
         "--eval-fanouts", "5,3", "--device", "cpu", "--timeout", "60", "--no-progress",
         "--checkpoint-every", str(EVERY), "--resume"]
#: Generous: a loaded 2-core machine imports torch in every rank of every attempt, and a
#: late node costs a restart more.
WAIT_S = 600
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * WAIT_S)]


@pytest.fixture(scope="module")
def train_seeds(parts2: Path) -> list[int]:
    """The training seeds' original IDs."""
    return sorted(LocalGraph(parts2).split_nodes("train")[0].tolist())


def _env(records: Path, pause: str) -> dict[str, str]:
    return dict(os.environ, ELASTIC_RECORDS=str(records), ELASTIC_PAUSE=pause, OMP_NUM_THREADS="1",
                NUMBA_NUM_THREADS="1", PYTHONUNBUFFERED="1", **ELASTIC_ENV)


def _args(out: Path) -> list[str]:
    return [*TRAIN, "--checkpoint-dir", str(out / "ckpt"), "--metrics-json", str(out / "metrics.json")]


def _wait_for(found: Callable[[], Any], procs: list[subprocess.Popen[bytes]], what: str) -> Any:
    """What ``found`` returns once it is not None (the condition); fails when every
    process in ``procs`` has exited first, or after :data:`WAIT_S`."""
    deadline = time.monotonic() + WAIT_S
    while (value := found()) is None:
        assert any(p.poll() is None for p in procs), f"{what}: every process exited first"
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"
        time.sleep(0.1)
    return value


def _paused(records: Path) -> Callable[[], dict[str, int] | None]:
    def found() -> dict[str, int] | None:
        marker = next(records.glob("paused-*.json"), None)
        return None if marker is None else dict(json.loads(marker.read_text()))
    return found


@contextlib.contextmanager
def _groups(records: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes started each in a group of its own, killed with their groups at the end,
    and the ranks that recorded in ``records`` (torchrun starts each in a session of its
    own) with them."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        for rank in records.glob("*.jsonl"):
            with contextlib.suppress(OSError):
                if WORKER.name in Path(f"/proc/{rank.stem}/cmdline").read_text():
                    os.kill(int(rank.stem), signal.SIGKILL)


@dataclass
class Segment:
    """One attempt's part of an epoch, in the final model's lineage."""

    world: int
    #: The epoch's step it starts at, and the seeds the steps before it trained.
    step: int
    seeds_done: int


def lineage(records: Path) -> tuple[dict[tuple[int, int], list[dict[str, Any]]], int, int]:
    """The records of the steps the final model was trained on, per (epoch, step), one
    per rank; how many steps were trained and then lost; how many attempts there were.
    An attempt's records replace, from where it resumed, those of the attempts before
    it: every process of an attempt starts after the last one of the attempt before has
    died, and before any step of its own, so the attempts are the runs of "start"
    records in time order."""
    events = [json.loads(line) for f in records.glob("*.jsonl") for line in f.read_text().splitlines()]
    kept: dict[tuple[int, int, int], dict[str, Any]] = {}
    lost: set[tuple[int, int]] = set()
    attempt, previous = 0, "step"
    for e in sorted(events, key=lambda e: (e["t"], e["kind"] != "start")):
        if e["kind"] == "start":
            attempt += previous == "step"
            for key in [k for k in kept if k[:2] >= (e["epoch"], e["step"])]:
                lost.add(key[:2])
                del kept[key]
        else:
            kept[(e["epoch"], e["step"], e["rank"])] = {**e, "attempt": attempt}
        previous = e["kind"]
    steps: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for (epoch, step, _), e in sorted(kept.items()):
        steps.setdefault((epoch, step), []).append(e)
    return steps, len(lost), attempt


def check_lineage(records: Path, seeds: list[int], change: list[int]) -> None:
    """In the final model's lineage: every seed once per epoch; every step on every rank
    of its world; as many steps per epoch as the plan of the world size it ended on asks
    for the seeds left; the world sizes ending with ``change``; and at most
    :data:`EVERY` steps (and the one in flight) lost per restart."""
    steps, lost, attempts = lineage(records)
    worlds: list[int] = []
    for epoch in range(EPOCHS):
        numbers = sorted(s for e, s in steps if e == epoch)
        assert numbers == list(range(len(numbers))), (epoch, numbers)
        segments: list[Segment] = []
        done = 0
        for step in numbers:
            ranks = steps[(epoch, step)]
            world, by = ranks[0]["world"], {r["attempt"] for r in ranks}
            assert len(by) == 1 and [r["rank"] for r in ranks] == list(range(world)), (epoch, step)
            if step == 0 or by != {steps[(epoch, step - 1)][0]["attempt"]}:
                segments.append(Segment(world, step, done))
            done += sum(len(r["seeds"]) for r in ranks)
        last = segments[-1]
        rest = len(seeds) - last.seeds_done
        assert len(numbers) == last.step + math.ceil(math.ceil(rest / BATCH) / last.world), (epoch, segments)
        trained = Counter(s for step in numbers for r in steps[(epoch, step)] for s in r["seeds"])
        assert sorted(trained) == seeds and set(trained.values()) == {1}, f"epoch {epoch}"
        for seg in segments:
            worlds += [] if worlds and worlds[-1] == seg.world else [seg.world]
    assert worlds[-len(change):] == change, worlds
    assert 0 < lost <= (attempts - 1) * (EVERY + 1), (attempts, lost)


def _metrics(out: Path, seeds: int, world: int) -> None:
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == world and len(set(metrics["param_fingerprints"])) == 1
    assert [e["epoch"] for e in metrics["epochs"]] == list(range(EPOCHS))
    assert all(e["seeds"] == seeds for e in metrics["epochs"])  # the resumed epoch's too


def test_a_lost_trainer_node_costs_only_the_steps_since_the_checkpoint(
    parts2: Path, train_seeds: list[int], tmp_path: Path
) -> None:
    """graphfeed-local --nnodes 2:3: three nodes of one rank; rank 2 stops at step 3 of
    epoch 1 (checkpoints at steps 2, 4, ...) and its node is killed (SIGKILL to the
    agent's process group); the two left resume at step 2 and finish the job."""
    records = tmp_path / "records"
    records.mkdir()
    cmd = [sys.executable, "-m", "trainer_client.local", "--partition-dir", str(parts2),
           "--server-device", "cpu", "--log-dir", str(tmp_path / "logs"), "--nnodes", "2:3",
           "--max-restarts", "2", "--grace", "10", "--trainer-script", str(WORKER), "--", *_args(tmp_path)]
    with _groups(records) as procs, (tmp_path / "local.log").open("wb") as log:
        local = subprocess.Popen(cmd, cwd=tmp_path, env=_env(records, "3:2:1:3"), stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(local)
        paused = _wait_for(_paused(records), procs, "rank 2 reaching step 3 of epoch 1")
        os.kill(paused["agent"], signal.SIGKILL)  # the node: its agent, then its rank
        os.kill(paused["pid"], signal.SIGKILL)
        assert local.wait(timeout=WAIT_S) == 0, (tmp_path / "local.log").read_text()[-5000:]
    check_lineage(records, train_seeds, [3, 2])
    _metrics(tmp_path, len(train_seeds), 2)


def test_a_trainer_node_that_joins_is_given_its_share_at_the_restart(
    parts2: Path, train_seeds: list[int], tmp_path: Path
) -> None:
    """Two nodes of one rank (torchrun agents of graphfeed-local's command, servers in
    this process); rank 0 stops at step 3 of epoch 1, a third node starts, and the agents
    restart their ranks with it: the job resumes at step 2 on three ranks."""
    from torch.distributed import TCPStore

    records = tmp_path / "records"
    records.mkdir()
    with served(parts2, 2) as addresses, _groups(records) as procs:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        program = [str(WORKER), "--servers", ",".join(addresses), *_args(tmp_path)]
        cmd = elastic_agent(program, (2, 3), 1, 2, f"127.0.0.1:{store.port}", "test-join")
        env = _env(records, "2:0:1:3")

        def node() -> None:
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True))

        node()
        node()
        _wait_for(_paused(records), procs, "rank 0 reaching step 3 of epoch 1")
        node()
        assert [p.wait(timeout=WAIT_S) for p in procs] == [0, 0, 0]
    check_lineage(records, train_seeds, [2, 3])
    _metrics(tmp_path, len(train_seeds), 3)
