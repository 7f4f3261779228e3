"""The sampling threads' queue, served fairly among clients.

Every stream of a server submits its batches, at most ``prefetch`` ahead of the one being
sent, to one pool of sampling threads. Served first come, first served, a client with
many streams whose gRPC windows are still filling (say one that opened every stream slot
and reads none) keeps that queue full, and a newcomer's first batch waits behind all of
it. :class:`FairPool` keeps one queue per client instead and hands its threads the next
task of each client in turn (round robin), so a batch waits for at most one task of every
other client with work queued; within one client, tasks run in the order submitted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class FairPool:
    """``workers`` threads running submitted tasks, one client's next task after
    another's (see the module doc); ``submit`` returns a ``concurrent.futures.Future``."""

    def __init__(self, workers: int, thread_name_prefix: str = "fair",
                 initializer: Callable[..., object] | None = None, initargs: tuple[Any, ...] = ()) -> None:
        if workers < 1:
            raise ValueError(f"workers: expected an integer >= 1, got {workers}")
        self._queues: OrderedDict[Hashable, deque[_Task]] = OrderedDict()
        self._cond = threading.Condition()
        self._shutdown = False
        self._threads = [threading.Thread(target=self._work, args=(initializer, initargs), daemon=True,
                                          name=f"{thread_name_prefix}_{i}") for i in range(workers)]
        for thread in self._threads:
            thread.start()

    @property
    def workers(self) -> int:
        return len(self._threads)

    def submit(self, client: Hashable, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue ``fn(*args)`` as ``client``'s next task."""
        future: Future[T] = Future()
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new tasks after shutdown")
            self._queues.setdefault(client, deque()).append((future, fn, args))
            self._cond.notify()
        return future

    def queued(self) -> dict[Hashable, int]:
        """Tasks waiting per client."""
        with self._cond:
            return {client: len(q) for client, q in self._queues.items()}

    def _next(self) -> _Task | None:
        """The next task in turn (None once shut down): the first client's first task;
        that client goes to the back of the line."""
        with self._cond:
            while not self._queues and not self._shutdown:
                self._cond.wait()
            if not self._queues:
                return None
            client, queue = next(iter(self._queues.items()))
            task = queue.popleft()
            if queue:
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

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        """Take no more tasks; cancel the queued ones (``cancel_futures``) or let the
        threads finish them; ``wait``: join the threads."""
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                for queue in self._queues.values():
                    for future, _, _ in queue:
                        future.cancel()
                self._queues.clear()
            self._cond.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()
