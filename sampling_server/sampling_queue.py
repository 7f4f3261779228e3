"""The sampling threads' queue, served fairly among clients.

Every stream of a server submits its batches, at most ``prefetch`` ahead of the one being
sent, to one pool of sampling threads. Served first come, first served, a client with
many streams whose gRPC windows are still filling (say one that opened every stream slot
and reads none) keeps that queue full, and a newcomer's first batch waits behind all of
it. :class:`FairPool` keeps one queue per client instead and shares its threads' time
fairly among the clients with work queued (start-time fair queuing): each client has a
virtual time, the thread seconds its tasks have taken (at least :data:`MIN_CHARGE_S`
each), and the next task is the one of the client whose virtual time is least. A client
whose batches are expensive (say whole 2-hop neighbourhoods) thus gets as much thread
time as the others, not as many tasks; a client that starts (or comes back) begins at
the least virtual time of those waiting, so it is served next, and idle time earns no
credit. Within one client the next task of each of its streams is taken in turn, so a
client's new stream does not wait behind its own older streams' prefetched batches;
within one stream, tasks run in the order submitted. Clients come in groups (a server's:
the principal, one host or certificate, whose clients are its trainer ranks): a group's
clients with work queued share one client's part, so a host gets no more thread time by
sending more client IDs, as it gets no more stream slots by them.

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
#: The least thread time a task is charged to its client (so that tasks too quick to
#: time still take turns, and equal ones tie).
MIN_CHARGE_S = 0.001
#: Weight of the newest task in a client's running estimate of its tasks' cost (charged
#: when a task starts, corrected when it ends, so a client's long tasks do not take every
#: thread before the first of them ends).
COST_EWMA = 0.3

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
        #: Per client: virtual time (thread seconds charged), estimated task cost, group.
        self._vtime: dict[Hashable, float] = {}
        self._cost: dict[Hashable, float] = {}
        self._group: dict[Hashable, Hashable] = {}
        #: The pool's virtual time: the virtual time of the last client served.
        self._now = 0.0
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

    def submit(self, client: Hashable, fn: Callable[..., T], *args: Any, stream: Hashable = None,
               group: Hashable = None, future: Future[T] | None = None) -> Future[T]:
        """Queue ``fn(*args)`` as the next task of ``client``'s ``stream``; ``client``
        belongs to ``group`` (None: a group of its own). ``future``: the future to
        complete (one handed out before the task could be queued), else a new one."""
        future = Future() if future is None else future
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new tasks after shutdown")
            if client not in self._queues:  # starts waiting: no credit for the time it did not
                self._vtime[client] = max(self._vtime.get(client, 0.0), self._now)
            self._group[client] = client if group is None else group
            streams = self._queues.setdefault(client, OrderedDict())
            streams.setdefault(stream, deque()).append((future, fn, args))
            self._cond.notify()
        return future

    def queued(self) -> dict[Hashable, int]:
        """Tasks waiting per client."""
        with self._cond:
            return {client: sum(map(len, streams.values())) for client, streams in self._queues.items()}

    def virtual_times(self) -> dict[Hashable, float]:
        """Thread seconds charged per client with work queued (relative to one another)."""
        with self._cond:
            return {client: self._vtime[client] - self._now for client in self._queues}

    def _next(self) -> tuple[Hashable, float, float, _Task] | None:
        """The next task (None once shut down), its client, what it was charged and the
        weight of the charge: of the client with the least virtual time (ties: the one
        waiting longest), its next stream's first task; that stream goes to the back of
        its client's line, and the client to the back of the line of clients. A client
        is charged its cost times the clients of its group with work queued."""
        with self._cond:
            while not self._queues and not self._shutdown:
                self._cond.wait()
            if not self._queues:
                return None
            vtime = self._vtime
            client = min(self._queues, key=vtime.__getitem__)
            streams = self._queues[client]
            self._now = vtime[client]
            group = self._group[client]
            weight = float(sum(self._group[c] == group for c in self._queues))
            charge = self._cost.get(client, MIN_CHARGE_S) * weight
            vtime[client] += charge
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
            return client, charge, weight, task

    def _charge(self, client: Hashable, charged: float, weight: float, seconds: float | None) -> None:
        """Correct the charge of a task of ``client`` that took ``seconds`` (None: it was
        cancelled before it ran, and costs nothing), charged with ``weight``."""
        cost = 0.0 if seconds is None else max(seconds, MIN_CHARGE_S)
        with self._cond:
            if client in self._vtime:
                self._vtime[client] += cost * weight - charged
            if seconds is not None:
                self._cost[client] = (1 - COST_EWMA) * self._cost.get(client, cost) + COST_EWMA * cost
            if len(self._vtime) > 2 * len(self._queues) + 64:  # forget what carries no debt
                for c in [c for c, v in self._vtime.items() if c not in self._queues and v <= self._now]:
                    del self._vtime[c]
                    self._cost.pop(c, None)
                    self._group.pop(c, None)

    def _work(self, initializer: Callable[..., object] | None, initargs: tuple[Any, ...]) -> None:
        if initializer is not None:
            initializer(*initargs)
        while (taken := self._next()) is not None:
            client, charged, weight, (future, fn, args) = taken
            if not future.set_running_or_notify_cancel():
                self._charge(client, charged, weight, None)
                continue
            started = time.perf_counter()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # the future carries it to whoever waits
                future.set_exception(exc)
            finally:
                self._charge(client, charged, weight, time.perf_counter() - started)

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
