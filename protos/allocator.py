"""Process-wide allocator tuning for the sampling hot path.

A minibatch's arrays are large (a products-sized batch gathers ~170 MB of features).
glibc serves allocations above its mmap threshold (at most 32 MiB by default) with fresh
``mmap`` pages and returns them on free, so every batch pays the kernel's page faults and
zeroing again: on a 2-core VM that costs as much as the gather itself. Raising the mmap
threshold and the trim threshold keeps freed blocks in the heap for the next batch. The
price is that the process keeps its peak heap instead of returning it to the system,
which suits a long-running server whose batches are alike.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 31) -> bool:
    """Make glibc reuse freed large blocks instead of unmapping them. Returns whether the
    setting took (False off Linux/glibc). Idempotent."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    except (OSError, AttributeError):
        ok = False
    log.debug("glibc mallopt (keep freed memory): %s", "set" if ok else "unavailable")
    _done = ok
    return ok
