"""Giving freed memory back to the system once a server's streams have all ended.

A stream's batches are built in buffers of megabytes (feature rows, stream messages) by
several threads at once; glibc's allocator keeps what they free in its per-thread arenas,
so without this a server's resident memory stays near its busiest moment's long after
the batches are gone (``docs/operations.md`` "Sizing"). ``malloc_trim(0)`` hands the arenas' free pages back;
it is called when the last open stream of the server ends (an epoch's end, a trainer
gone), at most once per :data:`MIN_INTERVAL` seconds. Elsewhere than glibc it is a no-op.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Seconds between two trims at least (an epoch's streams ending one after another).
MIN_INTERVAL = 1.0


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: its C library's
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _find_malloc_trim()
_lock = threading.Lock()
_last = -MIN_INTERVAL


def release_free_memory(now: float | None = None) -> bool:
    """Hand the allocator's free pages back to the system (at most once per
    :data:`MIN_INTERVAL` s); whether it was done."""
    global _last
    if _malloc_trim is None:
        return False
    now = time.monotonic() if now is None else now
    with _lock:
        if now - _last < MIN_INTERVAL:
            return False
        _last = now
    started = time.perf_counter()
    released = _malloc_trim(0)
    log.debug("malloc_trim: %s in %.3f s", "pages released" if released else "nothing to release",
              time.perf_counter() - started)
    return True
