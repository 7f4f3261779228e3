"""The initial rows of a node tensor (``RowInit``), a pure function of the seed, the
node's original ID and the column, so that the table a server starts with, and so every
batch's rows, are the same whatever the partitioning; a trainer computes the same rows to
check against (or to start a dense copy from).

Each value is drawn from a counter-based stream: the counter is ``original_id * width +
column`` (``width``: the values per row), hashed with the seed by SplitMix64's finalizer
into 53 random bits. ``UNIFORM`` is uniform in ``[-scale, scale)``; ``NORMAL`` is a
Box-Muller normal of two such draws (counters ``2c`` and ``2c + 1``), with standard
deviation ``scale``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from protos import sampling_pb2 as pb

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_INV_2_53 = 1.0 / 9007199254740992.0
#: Rows drawn at a time (bounds the temporaries of a large table).
BLOCK_ROWS = 1 << 16


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _uniform(seed: int, counters: np.ndarray) -> np.ndarray:
    """Floats in [0, 1), one per uint64 counter."""
    z = _mix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ _mix64(counters * _GOLDEN))
    return (z >> np.uint64(11)).astype(np.float64) * _INV_2_53


def initial_rows(init: pb.RowInit, original_ids: np.ndarray, dims: Sequence[int],
                 dtype: np.dtype | type = np.float32) -> np.ndarray:
    """The rows ``[len(original_ids), *dims]`` of ``dtype`` that ``init`` starts the
    nodes ``original_ids`` with."""
    ids = np.asarray(original_ids, dtype=np.int64).reshape(-1)
    width = math.prod(dims)
    out = np.zeros((ids.size, width), dtype=dtype)
    if init.kind != pb.RowInit.ZEROS and width:
        cols = np.arange(width, dtype=np.uint64)
        for first in range(0, ids.size, BLOCK_ROWS):
            block = ids[first:first + BLOCK_ROWS].astype(np.uint64)
            counters = block[:, None] * np.uint64(width) + cols[None, :]
            out[first:first + block.size] = _draw(init, counters)
    return out.reshape(ids.size, *dims)


def _draw(init: pb.RowInit, counters: np.ndarray) -> np.ndarray:
    if init.kind == pb.RowInit.UNIFORM:
        return (2.0 * _uniform(init.seed, counters) - 1.0) * init.scale
    if init.kind == pb.RowInit.NORMAL:
        u1 = _uniform(init.seed, counters * np.uint64(2))
        u2 = _uniform(init.seed, counters * np.uint64(2) + np.uint64(1))
        return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * math.pi * u2) * init.scale
    raise ValueError(f"RowInit.kind: expected ZEROS, UNIFORM or NORMAL (IN_DEGREE is filled by the "
                     f"servers from the graph), got {init.kind}")
