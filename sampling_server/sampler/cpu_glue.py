"""Numba CPU helpers of a batch's glue that keep the interpreter lock (small inputs) or
release it (large ones, :data:`RELEASE_MIN_ITEMS` items and up): ID ranges, owners by
partition book, each owner's positions, takes, merged offsets, sums; and the offsets of
runs laid back to back (:func:`exclusive_offsets`), which the kernels use too.

A call that releases the interpreter lock (a ``nogil`` kernel, nearly every torch op,
NumPy's loops over 500+ items) must take it back on return, and in a server whose other
threads run Python that wait is up to the switch interval (5 ms) each time: a batch's
many tiny torch calls (``aminmax``, ``stack``, ``detach``) each cost a wait. These
helpers take microseconds, so they keep the lock and cost none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numba
import numpy as np

from sampling_server.sampler.rng import clone


@numba.njit(cache=True)
def id_min_max(ids: np.ndarray) -> tuple[int, int]:
    """``(min, max)`` of a non-empty integer array, keeping the interpreter lock."""
    lo = hi = ids[0]
    for i in range(1, ids.size):  # branch-free: the compiler vectorizes it
        lo = min(lo, ids[i])
        hi = max(hi, ids[i])
    return lo, hi


@numba.njit(nogil=True, cache=True)
def exclusive_offsets(counts: np.ndarray, start: int = 0) -> np.ndarray:
    """int64 ``[n + 1]``: ``start``, then ``start`` plus the running sums of ``counts``
    (where each of ``n`` runs of ``counts[i]`` items begins, back to back)."""
    offsets = np.empty(counts.size + 1, dtype=np.int64)
    offsets[0] = start
    for i in range(counts.size):
        offsets[i + 1] = offsets[i] + counts[i]
    return offsets


@numba.njit(cache=True)
def positions(n: int) -> np.ndarray:
    """``0 .. n-1`` as int64, keeping the interpreter lock (NumPy's ``arange`` of many
    items releases it)."""
    return np.arange(n)


#: Inputs of at least this many items are read with the interpreter lock released: their
#: work (a few hundred microseconds and up) outweighs the wait to take it back, and other
#: threads need the lock meanwhile.
RELEASE_MIN_ITEMS = 65_536


def _by_size(kernel: Any, items: Callable[..., int]) -> Callable[..., Any]:
    """``kernel`` (which keeps the interpreter lock), called as its version that releases
    it (:func:`~sampling_server.sampler.rng.clone`, compiled with ``nogil``) when
    ``items(*args)`` is at least :data:`RELEASE_MIN_ITEMS`."""
    name = kernel.py_func.__name__ + "_released"
    released = numba.njit(nogil=True, cache=True)(clone(kernel.py_func, name))

    def call(*args: Any) -> Any:
        return (released if items(*args) >= RELEASE_MIN_ITEMS else kernel)(*args)

    return functools.wraps(kernel.py_func)(call)  # (its docstring and signature)


@numba.njit(cache=True)
def _owners(book: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Partition of each global ID (``book``: the partition book, the first ID of each
    partition and the node count last; IDs in ``[0, book[-1])``)."""
    if book.size > 65:  # many partitions: a binary search per ID
        return np.searchsorted(book, ids, side="right") - 1
    out = np.zeros(ids.size, dtype=np.int64)  # few: one vectorized compare per boundary
    for j in range(1, book.size - 1):
        bound = book[j]
        for i in range(ids.size):
            out[i] += ids[i] >= bound
    return out


owners = _by_size(_owners, lambda book, ids: ids.size)


@numba.njit(cache=True)
def _group_positions(owner: np.ndarray, num_parts: int) -> tuple[np.ndarray, np.ndarray]:
    """``(order, starts)``: the positions of partition ``p``'s entries of ``owner`` are
    ``order[starts[p]:starts[p + 1]]``, in order (a counting sort; an owner outside
    ``[0, num_parts)`` raises ``ValueError``)."""
    starts = np.zeros(num_parts + 1, dtype=np.int64)
    for i in range(owner.size):
        if owner[i] < 0 or owner[i] >= num_parts:
            raise ValueError("group_positions: an owner outside [0, num_parts)")
        starts[owner[i] + 1] += 1
    for p in range(num_parts):
        starts[p + 1] += starts[p]
    fill = starts[:-1].copy()
    order = np.empty(owner.size, dtype=np.int64)
    for i in range(owner.size):
        p = owner[i]
        order[fill[p]] = i
        fill[p] += 1
    return order, starts


group_positions = _by_size(_group_positions, lambda owner, num_parts: owner.size)


@numba.njit(cache=True)
def _take(values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``values[positions]`` (1-D)."""
    out = np.empty(positions.size, dtype=values.dtype)
    for i in range(positions.size):
        out[i] = values[positions[i]]
    return out


take = _by_size(_take, lambda values, positions: positions.size)


@numba.njit(cache=True)
def _run_offsets(frontier_size: int, positions: np.ndarray, counts: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, offsets)`` of a frontier whose entries ``positions[i]`` drew
    ``counts[i]`` neighbors (every entry once): per entry, in frontier order, and the
    exclusive prefix sum."""
    full = np.zeros(frontier_size, dtype=np.int64)
    for i in range(positions.size):
        full[positions[i]] = counts[i]
    return full, exclusive_offsets(full)[:-1]


run_offsets = _by_size(_run_offsets, lambda frontier_size, positions, counts: frontier_size)


@numba.njit(cache=True)
def total(counts: np.ndarray) -> int:
    """The sum of an integer array, keeping the interpreter lock."""
    acc = 0
    for i in range(counts.size):
        acc += counts[i]
    return acc
