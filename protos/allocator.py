"""Process-wide allocator tuning for the sampling hot path.

A minibatch's arrays are large (a products-sized batch gathers ~170 MB of features).
glibc serves allocations above its mmap threshold (at most 32 MiB by default) with fresh
``mmap`` pages and returns them on free, so every batch pays the kernel's page faults and
zeroing again: on a 2-core VM that costs as much as the gather itself. Raising the mmap
threshold and the trim threshold keeps freed blocks in the heap for the next batch. The
price is that the process keeps its peak heap instead of returning it to the system,
which suits a long-running server whose batches are alike.

The thresholds only govern glibc's main arena. A thread other than the main one gets an
arena of its own, whose heaps are at most 64 MiB, and a block larger than that is always
``mmap``-ed and unmapped on free, whatever the threshold: a server's sampling workers
and a trainer's stream reader allocate their ~170 MB blocks in such threads. So the
number of arenas is also limited to one (``M_ARENA_MAX``), which puts every thread's
blocks in the main heap (small allocations are served from per-thread caches first, so
threads contend little for it). Measured on products-like ([15, 10, 5], batch 1024,
float32, one CPU server and one trainer on 2 cores): the server's CPU per batch fell from
~250 to ~190 ms and the trainer's from ~160 to ~125 ms.

The other side of that policy: while a server streams, it keeps what its batches freed for
the next ones; once its streams have all ended (an epoch's end, a trainer gone) nothing
will reuse it, and :func:`release_free_memory` (glibc's ``malloc_trim``, at most once per
:data:`MIN_TRIM_INTERVAL` seconds) hands the free pages back, so a server's resident memory
does not stay near its busiest moment's (``docs/operations.md`` "Sizing").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_done = False


def _libc() -> ctypes.CDLL | None:
    """The C library (glibc on Linux), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


_INT_MAX = (1 << 31) - 1  # mallopt(int param, int value)


def keep_freed_memory(mmap_threshold: int = 1 << 30, trim_threshold: int = _INT_MAX,
                      arena_max: int = 1) -> bool:
    """Make glibc reuse freed large blocks instead of unmapping them, in every thread
    (threads created before the call keep the arena they already have). Returns whether
    the setting took (False off Linux/glibc). Idempotent. Each value is a C ``int``
    (at most 2**31 - 1)."""
    for field, value in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold),
                        ("arena_max", arena_max)):
        if not 0 < value <= _INT_MAX:
            raise ValueError(f"{field}: expected an integer in [1, {_INT_MAX}] (mallopt takes a "
                             f"C int), got {value}")
    global _done
    if _done:
        return True
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)) and bool(mallopt(_M_ARENA_MAX, arena_max))
    log.debug("glibc mallopt (keep freed memory): %s", "set" if ok else "unavailable")
    _done = ok
    return ok


#: Seconds between two trims at least (an epoch's streams ending one after another).
MIN_TRIM_INTERVAL = 1.0


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _find_malloc_trim()
_trim_lock = threading.Lock()
_last_trim = -MIN_TRIM_INTERVAL


def release_free_memory(now: float | None = None) -> bool:
    """Hand the allocator's free pages back to the system (at most once per
    :data:`MIN_TRIM_INTERVAL` s); whether it was done (False where there is no glibc)."""
    global _last_trim
    if _malloc_trim is None:
        return False
    now = time.monotonic() if now is None else now
    with _trim_lock:
        if now - _last_trim < MIN_TRIM_INTERVAL:
            return False
        _last_trim = now
    started = time.perf_counter()
    released = _malloc_trim(0)
    log.debug("malloc_trim: %s in %.3f s", "pages released" if released else "nothing to release",
              time.perf_counter() - started)
    return True


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose memory comes from ``malloc`` (through NumPy).

    For the large tensors made anew per batch. torch takes CPU memory with
    ``posix_memalign``, and glibc (2.36) serves a request of that kind from a freed block
    only if the block has room for the alignment too: a block freed by a tensor of the
    same size does not, so each new tensor lands on fresh heap pages and pays the
    kernel's page faults and zeroing again (~27,000 faults for a products-sized batch's
    172 MB ``x`` while five such tensors are alive). A plain ``malloc`` of the same size
    takes the freed block again, without faults, once :func:`keep_freed_memory` keeps
    freed memory in the heap.

    NumPy also asks the kernel for transparent huge pages (``madvise``) for blocks of
    4 MiB and more, which torch's allocator does not: a large table read at random (the
    trainer's feature cache) then misses the TLB far less.
    """
    count = math.prod(shape)
    if count == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    # NumPy's allocation keeps the interpreter lock and torch's views release it (each
    # costs a wait to get it back in a busy server): a NumPy array of the dtype, or of
    # same-size words for a dtype NumPy lacks (bfloat16), and one view at most.
    np_dtype = _NUMPY_OF.get(dtype)
    if np_dtype is not None:
        return torch.from_numpy(np.empty(tuple(shape), dtype=np_dtype))
    words = _WORDS_OF.get(dtype.itemsize)
    if words is not None:
        array = np.empty(tuple(shape), dtype=words)
        tensor = torch.from_numpy(array).view(dtype)
        setattr(tensor, _WORDS_ATTR, array)  # for words_of: NumPy has no bfloat16
        return tensor
    raw = np.empty(count * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(tuple(shape))


_WORDS_ATTR = "_graphfeed_words"


def words_of(tensor: torch.Tensor) -> np.ndarray | None:
    """The NumPy words (``uint16`` for bfloat16) of a tensor that :func:`empty` made of a
    dtype NumPy lacks, without a torch call (a ``view`` releases the interpreter lock);
    None for any other tensor, a view or slice of one included."""
    words = getattr(tensor, _WORDS_ATTR, None)
    return words if isinstance(words, np.ndarray) else None


#: torch dtypes NumPy has, and NumPy's words of each item size (for those it lacks).
_NUMPY_OF: dict[torch.dtype, Any] = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
    torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
    torch.uint8: np.uint8, torch.bool: np.bool_}
_WORDS_OF: dict[int, Any] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
