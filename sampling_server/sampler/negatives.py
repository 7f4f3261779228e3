"""Numba CPU kernels of link batches: negative draws and edge tests.

A link batch's negatives are drawn among original node IDs, each from the random stream
of the positive seed edge it belongs to (:func:`~sampling_server.sampler.rng.pair_stream`
of the batch key and the edge's original end IDs), so a batch's negatives are the same
whatever the partitioning, and a resumed stream draws them again exactly. Negative ``j``
of a positive edge, at try ``t``, is draw ``t * per_edge + j`` of its stream: uniform over
``[0, num_nodes)``, the destination (or source) type's original IDs. Strict sampling
redraws a negative that is an edge of the graph (:func:`has_edges`, at the owner of its
destination), up to :data:`STRICT_TRIES` tries.

Both run on the host whatever the sampler's device: a batch has a few thousand
negatives, far less work than one hop's draws, and a kernel launch would cost more.
"""

from __future__ import annotations

import numba
import numpy as np

from sampling_server.sampler import rng
from sampling_server.sampler.cpu_kernels import mix64, uniform_below
from sampling_server.sampler.rng import clone

pair_stream = numba.njit(nogil=True)(clone(rng.pair_stream, mix64=mix64))

#: Salts of the draws of a negative's destination and (binary mode) source.
DST_SALT = 0x6E65675F647374  # "neg_dst"
SRC_SALT = 0x6E65675F737263  # "neg_src"
#: Draws a strict negative gets; a negative whose every draw is an edge keeps the last.
STRICT_TRIES = 8


@numba.njit(nogil=True, cache=True)
def draw_negatives(key: np.uint64, salt: np.uint64, src: np.ndarray, dst: np.ndarray, per_edge: int,
                   num_nodes: int, attempt: int, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out[i, j]``: negative ``j`` of seed edge ``(src[i], dst[i])`` (original IDs) at
    try ``attempt``, an original ID in ``[0, num_nodes)``."""
    for i in range(src.shape[0]):
        stream = pair_stream(key, salt, src[i], dst[i])
        for j in range(per_edge):
            out[i, j] = uniform_below(stream, attempt * per_edge + j, num_nodes)


@numba.njit(nogil=True, cache=True)
def has_edges(indptr: np.ndarray, indices: np.ndarray, start: int, src: np.ndarray,
              dst: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out[i]``: whether ``src[i] -> dst[i]`` is one of the in-edges of ``dst[i]`` (a
    global ID whose CSC row is ``dst[i] - start``)."""
    for i in range(src.shape[0]):
        row = dst[i] - start
        found = False
        for k in range(indptr[row], indptr[row + 1]):
            if indices[k] == src[i]:
                found = True
                break
        out[i] = found


def negative_draws(key: int, salt: int, src: np.ndarray, dst: np.ndarray, per_edge: int, num_nodes: int,
                   attempt: int = 0) -> np.ndarray:
    """int64 ``[len(src), per_edge]``: :func:`draw_negatives` into a new array."""
    out = np.empty((src.size, per_edge), dtype=np.int64)
    if src.size and per_edge:
        draw_negatives(np.uint64(key), np.uint64(salt), np.ascontiguousarray(src, np.int64),
                       np.ascontiguousarray(dst, np.int64), int(per_edge), int(num_nodes), int(attempt), out)
    return out
