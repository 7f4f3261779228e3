"""The server's stream of prepared batches: messages encoded just before they are sent."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from protos import fastwire
from protos import sampling_pb2 as pb
from protos.assembler import TensorAssembler
from sampling_server.pipeline import Pace, Prepared, _Feed, encode_ahead
from sampling_server.sampling_queue import MIN_CHARGE_S, FairPool

REPO = Path(__file__).resolve().parents[1]


def _head(batch: int):  # type: ignore[no-untyped-def]
    return lambda i, n: pb.MinibatchChunk(batch_index=batch, chunk_index=i, num_chunks=n)


def _named(batch: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(batch)
    return {"n_id": torch.arange(rows, dtype=torch.int64) + batch,
            "x": torch.randn(rows, 16, generator=g)}


def _done(value: Prepared) -> Future[Prepared]:
    future: Future[Prepared] = Future()
    future.set_result(value)
    return future


def test_prepared_messages_are_the_bytes_encode_chunks_makes() -> None:
    named = _named(3, 1000)
    prepared = Prepared.of(_head(3), named, chunk_bytes=10_000, seeds=7)
    expected = fastwire.encode_chunks(_head(3), named, 10_000)
    assert len(prepared) == len(expected) > 3
    assert [prepared.message(i) for i in range(len(prepared))] == expected
    assert prepared.encode(1, 3) == expected[1:3]
    assert prepared.messages() == expected and prepared.seeds == 7
    assert sum(prepared.sizes) == 1000 * 8 + 1000 * 16 * 4
    assert all(size <= 10_000 for size in prepared.sizes)
    # one entry for splitting the tensors, one per encode() call
    assert len(prepared.encode_seconds) == 3


@pytest.mark.parametrize(("ahead_bytes", "task_bytes"), [(1, 1), (8192, 1), (1, 10_000),
                                                         (20_000, 9000), (1 << 30, 1 << 30)])
def test_encode_ahead_yields_every_message_in_order_and_marks_each_batch_s_last(
        ahead_bytes: int, task_bytes: int) -> None:
    batches = [Prepared.of(_head(b), _named(b, rows), chunk_bytes=4096)
               for b, rows in enumerate([300, 1, 0, 90])]
    batches.insert(2, Prepared(_head(9), []))  # a skipped batch: no message at all
    with ThreadPoolExecutor(3) as pool:
        got = list(encode_ahead(iter(_done(b) for b in batches), pool, ahead_bytes, task_bytes))
    expected = [(m, b if i == len(b) - 1 else None)
                for b in batches for i, m in enumerate(b.messages())]
    assert [m for m, _ in got] == [m for m, _ in expected]
    assert [d for _, d in got] == [d for _, d in expected]
    assert sum(d is not None for _, d in got) == 4  # the empty batch has no last message


def test_encode_ahead_keeps_a_bounded_number_of_bytes_encoded_and_waits_for_no_unfinished_batch(
) -> None:
    encoded: list[int] = []  # message indices, as encoded

    class Counting(Prepared):
        __slots__ = ()

        def message(self, index: int) -> bytes:
            encoded.append(index)
            return super().message(index)

    first = Counting.of(_head(0), _named(0, 400), chunk_bytes=4096)
    assert len(first) > 6 and max(first.sizes) == 4096
    second: Future[Prepared] = Future()  # not produced yet
    taken = threading.Event()

    def futures() -> Iterator[Future[Prepared]]:
        yield _done(first)
        taken.set()
        yield second

    with ThreadPoolExecutor(2) as pool:
        # tasks of two messages; at least two tasks queued, or 3 messages' worth of bytes
        stream = encode_ahead(futures(), pool, ahead_bytes=3 * 4096, task_bytes=2 * 4096)
        sent = []
        for _ in range(len(first)):  # the whole first batch goes out while the second is sampled
            sent.append(next(stream))
            # the task being sent from, and at most two tasks (or 3 messages' bytes) more
            assert len(encoded) <= len(sent) + 1 + 4
        assert taken.is_set() and not second.done()
        assert sent[-1][1] is first and [m for m, _ in sent] == first.messages()
        second.set_result(Counting.of(_head(1), _named(1, 50)))
        rest = list(stream)
    assert len(rest) == len(second.result()) and rest[-1][1] is second.result()


def test_encode_ahead_holds_two_batches_however_small_they_are() -> None:
    """Taking a batch lets the stream's producer start another, so a consumer that stops
    after one message must leave the rest untaken, even when every batch is tiny and
    already produced (well under ``ahead_bytes``)."""
    taken: list[int] = []
    batches = [Prepared.of(_head(b), _named(b, 3)) for b in range(30)]
    batches.insert(1, Prepared(_head(99), []))  # a skipped batch holds nothing

    def futures() -> Iterator[Future[Prepared]]:
        for index, batch in enumerate(batches):
            taken.append(index)
            yield _done(batch)

    with ThreadPoolExecutor(2) as pool:
        stream = encode_ahead(futures(), pool)
        first = next(stream)
        # the batch being sent, the next (the skipped one between them), and the one
        # after it looked at but not taken
        assert first[1] is batches[0] and taken == [0, 1, 2, 3]
        rest = list(stream)
    assert [d for _, d in rest if d is not None] == batches[2:]


def test_small_messages_are_encoded_a_few_at_a_time() -> None:
    calls: list[tuple[int, int]] = []

    class Counting(Prepared):
        __slots__ = ()

        def encode(self, start: int, stop: int) -> list[bytes]:
            calls.append((start, stop))
            return super().encode(start, stop)

    batch = Counting.of(_head(0), _named(0, 2000), chunk_bytes=1000)
    with ThreadPoolExecutor(2) as pool:
        got = [m for m, _ in encode_ahead(iter([_done(batch)]), pool, task_bytes=4000)]
    assert got == Prepared.of(_head(0), _named(0, 2000), chunk_bytes=1000).messages()
    assert all(stop - start == 4 for start, stop in calls[:-1])  # 4 messages of 1000 bytes
    assert [i for start, stop in calls for i in range(start, stop)] == list(range(len(batch)))


def test_encode_ahead_passes_on_a_failed_batch_and_cancels_what_it_queued() -> None:
    failed: Future[Prepared] = Future()
    failed.set_exception(RuntimeError("peer partition 1 is unavailable"))
    with ThreadPoolExecutor(1) as pool:
        stream = encode_ahead(iter([_done(Prepared.of(_head(0), _named(0, 50))), failed]), pool)
        assert next(stream)[1] is not None
        with pytest.raises(RuntimeError, match="peer partition 1"):
            next(stream)
        big = Prepared.of(_head(0), _named(0, 20_000), chunk_bytes=4096)
        stream = encode_ahead(iter([_done(big)]), pool, ahead_bytes=4 * 4096, task_bytes=4096)
        next(stream)
        stream.close()  # the client went away: nothing left queued runs to the end
    with pytest.raises(ValueError, match="ahead_bytes: expected an integer >= 1, got 0"):
        next(encode_ahead(iter([]), ThreadPoolExecutor(1), ahead_bytes=0))
    with pytest.raises(ValueError, match="task_bytes: expected an integer >= 1, got -1"):
        next(encode_ahead(iter([]), ThreadPoolExecutor(1), task_bytes=-1))


def test_messages_carry_the_tensors_exactly() -> None:
    named = _named(5, 2000)
    prepared = Prepared.of(_head(5), named, chunk_bytes=8192)
    assembler = TensorAssembler()
    for message in prepared.messages():
        for chunk in fastwire.minibatch_chunk_deserializer(message).tensors:
            assembler.add(chunk)
    out = assembler.finish()
    assert np.array_equal(out["x"], named["x"].numpy())
    assert np.array_equal(out["n_id"], named["n_id"].numpy())


# ---- the sampling threads' fair queue -------------------------------------------------


def _blocked_pool(client: str, stream: str | None = None) -> tuple[FairPool, threading.Event, Future[bool]]:
    """A one-thread :class:`FairPool` whose thread runs ``client``'s task until the
    returned gate is set: (pool, gate, that task's future)."""
    pool = FairPool(1)
    gate, started = threading.Event(), threading.Event()

    def block() -> bool:
        started.set()
        return gate.wait(30)

    blocker = pool.submit(client, block, stream=stream)
    assert started.wait(30)
    return pool, gate, blocker


def test_the_sampling_queue_takes_each_clients_next_task_in_turn() -> None:
    """One thread, blocked by a client's long task while three clients queue: the
    clients that have had no thread time go first, taking turns (a newcomer does not wait
    behind the others' backlog); the client whose task held the thread comes after; each
    client's own tasks run in the order submitted."""
    pool, gate, blocker = _blocked_pool("hog")
    ran: list[str] = []
    try:
        hog = [pool.submit("hog", ran.append, f"hog{i}") for i in range(5)]
        late = [pool.submit("late", ran.append, f"late{i}") for i in range(2)]
        new = pool.submit("new", ran.append, "new")
        assert pool.queued() == {"hog": 5, "late": 2, "new": 1}
        time.sleep(0.05)  # the hog's task holds the thread for 50 ms
        gate.set()
        for f in [blocker, *hog, *late, new]:
            f.result(timeout=30)
        assert ran == ["late0", "new", "late1", "hog0", "hog1", "hog2", "hog3", "hog4"]
        failing = pool.submit("x", lambda: 1 // 0)
        with pytest.raises(ZeroDivisionError):
            failing.result(timeout=30)
        assert pool.submit("x", lambda: 7).result(timeout=30) == 7  # a failed task leaves the thread
    finally:
        pool.shutdown(wait=True)


def test_a_clients_new_stream_does_not_wait_behind_its_own_older_streams() -> None:
    """Within one client, streams take turns too: a client that opened many streams
    (say one holding every slot, each with its batches prefetched) starting one more gets
    that stream's first batch after one task of each of its other streams, not all."""
    pool, gate, blocker = _blocked_pool("c", "s0")
    ran: list[str] = []
    try:
        futures = [pool.submit("c", ran.append, f"s{s}b{b}", stream=f"s{s}")
                   for s in (1, 2) for b in range(3)]
        futures.append(pool.submit("c", ran.append, "s3b0", stream="s3"))
        futures.append(pool.submit("other", ran.append, "o0"))
        assert pool.queued() == {"c": 7, "other": 1}
        time.sleep(0.05)
        gate.set()
        for f in [blocker, *futures]:
            f.result(timeout=30)
        assert ran == ["o0", "s1b0", "s2b0", "s3b0", "s1b1", "s2b1", "s1b2", "s2b2"]
    finally:
        pool.shutdown(wait=True)


def test_the_sampling_queue_shares_thread_time_not_task_counts() -> None:
    """A client whose tasks take 30 times as long as another's gets about as much thread
    time, so the other runs about 30 tasks for each of its: a client of expensive batches
    (whole neighbourhoods) cannot hold the threads by taking turns like the others."""
    pool = FairPool(1)
    gate, started, ran = threading.Event(), threading.Event(), []
    try:
        pool.submit("x", lambda: (started.set(), gate.wait(30)))
        assert started.wait(30)
        heavy = [pool.submit("heavy", lambda i=i: (time.sleep(30 * MIN_CHARGE_S), ran.append(f"h{i}")))
                 for i in range(3)]
        light = [pool.submit("light", ran.append, f"l{i}") for i in range(60)]
        gate.set()
        for f in [*heavy, *light]:
            f.result(timeout=60)
        # the heavy client's first task, then ~30 light tasks (its 30 ms), then its next
        assert ran.index("h0") < 3 and ran.index("h1") >= 25, ran
        times = pool.virtual_times()
        assert times == {}  # nothing queued any more
    finally:
        pool.shutdown(wait=True)


def test_a_principal_gets_one_share_of_the_threads_however_many_client_ids_it_sends() -> None:
    """Clients of one group (a server's: one host's trainer ranks) share one client's
    part of the threads: a host that sends four client IDs, each with a backlog, gets
    about as many tasks run as a host with one, not four times as many."""
    pool, gate, blocker = _blocked_pool("x")
    ran: list[str] = []
    try:
        many = [pool.submit(f"hog-{c}", ran.append, "hog", group="hog-host") for c in range(4)
                for _ in range(40)]
        one = [pool.submit("trainer", ran.append, "trainer", group="trainer-host") for _ in range(40)]
        gate.set()
        for f in [blocker, *many, *one]:
            f.result(timeout=60)
        first = ran[:40]  # while both hosts have work queued
        assert 16 <= first.count("trainer") <= 24, first
    finally:
        pool.shutdown(wait=True)


def test_a_stream_produces_no_further_ahead_of_its_client_than_its_pace_allows() -> None:
    """A stream whose client acknowledges nothing has ``ahead`` batches produced and no
    more, however fast its messages are taken; each acknowledged batch lets one more be
    produced; closing the pace (the call ended) ends the stream without error."""
    produced: list[int] = []
    pool = FairPool(2)
    try:
        pace = Pace(3)
        refs = list(range(20))

        def make(ref: int) -> Prepared:
            produced.append(ref)
            return Prepared(_head(ref), [[]])

        def start(ref: int, future: Future[Prepared]) -> None:
            pool.submit("c", make, ref, future=future)

        feed = _Feed(pace, start)  # type: ignore[arg-type]
        futures = [feed.next_future(ref) for ref in refs]  # type: ignore[arg-type]
        assert _wait_for(lambda: len(produced) == 3)
        time.sleep(0.1)
        assert sorted(produced) == [0, 1, 2] and not futures[3].done()
        pace.took(2)
        assert _wait_for(lambda: len(produced) == 5)
        assert sorted(produced) == [0, 1, 2, 3, 4]
        pace.took(1)  # counts only grow
        time.sleep(0.1)
        assert len(produced) == 5
        pace.close()
        assert all(f.cancelled() for f in futures[5:])
    finally:
        pool.shutdown(wait=True)


def _wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_shut_down_sampling_queue_cancels_what_waits_and_takes_nothing_new() -> None:
    pool = FairPool(1)
    gate, started = threading.Event(), threading.Event()
    running = pool.submit("a", lambda: (started.set(), gate.wait(30))[1])
    assert started.wait(30)
    queued = pool.submit("b", lambda: 1)
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    gate.set()
    assert running.result(timeout=30) is True
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit("a", lambda: 1)
    with pytest.raises(ValueError, match="workers: expected an integer >= 1, got 0"):
        FairPool(0)


def test_the_interpreter_joins_a_sampling_queue_s_threads_before_it_exits(tmp_path: Path) -> None:
    """A process that exits while a sampling thread still runs a task (nobody shut the
    pool down) lets the task finish first, as a ThreadPoolExecutor's would; a daemon
    thread ended mid-kernel at finalization aborted servers after a clean drain."""
    done = tmp_path / "done"
    script = (
        "import sys, time\n"
        "from sampling_server.sampling_queue import FairPool\n"
        "pool = FairPool(2)\n"
        "pool.submit('a', lambda: (time.sleep(0.5), open(sys.argv[1], 'w').write('ok')))\n"
        "pool.submit('b', lambda: None).result(timeout=30)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(done)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert done.read_text() == "ok"
