"""The sampling threads' queue, served fairly among clients.

Every stream of a server submits its batches, at most ``prefetch`` ahead of the one being
sent, to one pool of sampling threads. Served first come, first served, a client with
many streams whose gRPC windows are still filling (say one that opened every stream slot
and reads none) keeps that queue full, and a newcomer's first batch waits behind all of
it. :class:`FairPool` keeps one queue per client instead and hands its threads the next
task of each client in turn (round robin), so a batch waits for at most one task of every
other client with work queued. Within one client it takes the next task of each of the
client's streams in turn the same way, so a client's new stream does not wait behind its
own older streams' prefetched batches either; within one stream, tasks run in the order
submitted.

Its threads are daemon threads, so a pool nobody shut down never keeps a process from
exiting; but like ``ThreadPoolExecutor``'s, every live pool is shut down and its threads
joined (for at most :data:`EXIT_JOIN_S`) when the interpreter starts to exit, before it
finalizes. A daemon thread still running a kernel, or waking, at finalization is ended
by the interpreter mid-frame, and a native frame that does not expect that aborts the
process ("terminate called without an active exception") after a clean drain.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]
#: A client's queued tasks: one queue per stream, in the order the streams take turns.
_Streams = OrderedDict[Hashable, deque[_Task]]

#: Seconds the interpreter's exit waits, in all, for every live pool's threads.
EXIT_JOIN_S = 10.0

_live: weakref.WeakSet[FairPool] = weakref.WeakSet()


def _join_all_at_exit() -> None:
    deadline = time.monotonic() + EXIT_JOIN_S
    for pool in list(_live):
        pool.shutdown(wait=True, cancel_futures=True, timeout=max(0.0, deadline - time.monotonic()))


# Run where concurrent.futures runs its own: after the main thread ends, before the
# interpreter finalizes (plain atexit handlers run after that, too late for threads).
getattr(threading, "_register_atexit", atexit.register)(_join_all_at_exit)


class FairPool:
    """``workers`` threads running submitted tasks, one client's next task after
    another's, and within a client one stream's after another's (see the module doc);
    ``submit`` returns a ``concurrent.futures.Future``."""

    def __init__(self, workers: int, thread_name_prefix: str = "fair",
                 initializer: Callable[..., object] | None = None, initargs: tuple[Any, ...] = ()) -> None:
        if workers < 1:
            raise ValueError(f"workers: expected an integer >= 1, got {workers}")
        self._queues: OrderedDict[Hashable, _Streams] = OrderedDict()
        self._cond = threading.Condition()
        self._shutdown = False
        self._threads = [threading.Thread(target=self._work, args=(initializer, initargs), daemon=True,
                                          name=f"{thread_name_prefix}_{i}") for i in range(workers)]
        for thread in self._threads:
            thread.start()
        _live.add(self)

    @property
    def workers(self) -> int:
        return len(self._threads)

    def submit(self, client: Hashable, fn: Callable[..., T], *args: Any,
               stream: Hashable = None) -> Future[T]:
        """Queue ``fn(*args)`` as the next task of ``client``'s ``stream``."""
        future: Future[T] = Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new tasks after shutdown")
            streams = self._queues.setdefault(client, OrderedDict())
            streams.setdefault(stream, deque()).append((future, fn, args))
            self._cond.notify()
        return future

    def queued(self) -> dict[Hashable, int]:
        """Tasks waiting per client."""
        with self._cond:
            return {client: sum(map(len, streams.values())) for client, streams in self._queues.items()}

    def _next(self) -> _Task | None:
        """The next task in turn (None once shut down): the first client's first
        stream's first task; that stream goes to the back of its client's line, and the
        client to the back of the line of clients."""
        with self._cond:
            while not self._queues and not self._shutdown:
                self._cond.wait()
            if not self._queues:
                return None
            client, streams = next(iter(self._queues.items()))
            stream, queue = next(iter(streams.items()))
            task = queue.popleft()
            if queue:
                streams.move_to_end(stream)
            else:
                del streams[stream]
            if streams:
                self._queues.move_to_end(client)
            else:
                del self._queues[client]
            return task

    def _work(self, initializer: Callable[..., object] | None, initargs: tuple[Any, ...]) -> None:
        if initializer is not None:
            initializer(*initargs)
        while (task := self._next()) is not None:
            future, fn, args = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # the future carries it to whoever waits
                future.set_exception(exc)

    def shutdown(self, wait: bool = False, cancel_futures: bool = True, timeout: float | None = None) -> None:
        """Take no more tasks; cancel the queued ones (``cancel_futures``) or let the
        threads finish them; ``wait``: join the threads, for at most ``timeout`` seconds
        in all (None: until they end)."""
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                for streams in self._queues.values():
                    for queue in streams.values():
                        for future, _, _ in queue:
                            future.cancel()
                self._queues.clear()
            self._cond.notify_all()
        if wait:
            deadline = None if timeout is None else time.monotonic() + timeout
            for thread in self._threads:
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
