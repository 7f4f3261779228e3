"""Where the CUDA sampler keeps a partition's features: the server-side GPU feature cache.

The hottest rows of the partition's feature matrix (its nodes in the hot order of
:mod:`sampling_server.hot`: in-degree, highest first, ties by lower ID) live in GPU
memory; the others in pinned host memory that the GPU reads over UVA. A batch's rows are
gathered by one kernel through two per-node maps, so no row makes a trip through the
host. ``gpu_cache_size`` (``--gpu-cache-size``) says how many rows are on the GPU, with
the syntax of the trainer's ``cache_size``: a fraction of the partition's rows (``0.2``,
``"20%"``), a size (``"2GiB"``), or ``"auto"`` (the default): every row when the
features fit in :data:`AUTO_FREE_FRACTION` of the GPU's free memory, else the hot rows
that do.

This module is plain numpy (the server's configuration checks values with it); the
tables and the kernel are in :mod:`sampling_server.sampler.cuda_features`.
"""

from __future__ import annotations

import math

import numpy as np

from protos.sizes import CacheSize, parse_cache_amount

#: The parsed ``gpu_cache_size``.
GpuCacheSize = CacheSize

#: Share of the GPU's free memory (measured once the graph structure is placed) that
#: ``gpu_cache_size="auto"`` may fill with feature rows; the rest is left to sampling.
AUTO_FREE_FRACTION = 0.5
_EXPECTED = ("'auto', a fraction of the partition's feature rows in [0, 1] (e.g. 0.2), a "
             "percentage ('20%') or a size in bytes with a unit ('2GiB', '512MB')")


def parse_gpu_cache_size(value: object, field: str = "gpu_cache_size") -> GpuCacheSize:
    """``value`` as a :class:`GpuCacheSize`; ``ValueError`` naming ``field``, what it
    expected and what it got."""
    return parse_cache_amount(value, field, _EXPECTED)


def rows_on_device(size: GpuCacheSize, num_rows: int, row_bytes: int,
                   free_bytes: int | None) -> int:
    """How many of ``num_rows`` rows (``row_bytes`` each) go to GPU memory.

    ``free_bytes`` is the GPU's free memory for ``"auto"`` (None: unknown, under the
    simulator, where every row is taken). Each node also costs 8 bytes of maps on the GPU
    (:func:`slot_maps`), whatever its place; ``"auto"`` counts them, a size in bytes is
    for the rows alone.
    """
    if size.kind == "fraction":
        return min(num_rows, math.floor(size.amount * num_rows))
    if size.kind == "bytes":
        return num_rows if row_bytes == 0 else min(num_rows, int(size.amount) // row_bytes)
    if free_bytes is None or row_bytes == 0:
        return num_rows
    budget = math.floor(AUTO_FREE_FRACTION * free_bytes) - 8 * num_rows
    return max(0, min(num_rows, budget // row_bytes))


def slot_maps(order: np.ndarray, node_start: int, cached: int) -> tuple[np.ndarray, np.ndarray]:
    """The two int32 per-node maps of a partition whose hot order is ``order`` (global
    IDs, hottest first) and whose first ``cached`` nodes of it are on the GPU:
    ``slot[v - node_start]``, the GPU row of node ``v`` (-1 when not cached), and
    ``host_slot[v - node_start]``, its row in pinned host memory (-1 when cached). Both
    tables hold their rows in hot order."""
    n = int(order.size)
    if n >= 2**31:
        raise ValueError(f"partition: expected fewer than 2**31 nodes for int32 feature slots, "
                         f"got {n}")
    if not 0 <= cached <= n:
        raise ValueError(f"cached: expected 0 .. {n} (the partition's nodes), got {cached}")
    local = np.asarray(order, dtype=np.int64) - node_start
    slot = np.full(n, -1, dtype=np.int32)
    host_slot = np.full(n, -1, dtype=np.int32)
    slot[local[:cached]] = np.arange(cached, dtype=np.int32)
    host_slot[local[cached:]] = np.arange(n - cached, dtype=np.int32)
    return slot, host_slot


def describe(cached: int, num_rows: int, row_bytes: int) -> str:
    """``"k of n rows (p %) in GPU memory (A MiB), m in pinned host memory (B MiB)"``."""
    share = 100.0 * cached / num_rows if num_rows else 100.0
    return (f"{cached} of {num_rows} feature rows ({share:.1f} %) in GPU memory "
            f"({cached * row_bytes / 2**20:.1f} MiB + {8 * num_rows / 2**20:.1f} MiB of slot "
            f"maps), {num_rows - cached} in pinned host memory over UVA "
            f"({(num_rows - cached) * row_bytes / 2**20:.1f} MiB)")
