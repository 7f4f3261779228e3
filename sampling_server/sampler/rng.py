"""Counter-based random numbers shared by the CPU and CUDA samplers.

Every draw is a pure function of ``(batch key, hop, node ID, draw index)``, so a batch is
reproducible after a failure, the CPU and CUDA samplers draw the same neighbors, and a
peer that samples a remote frontier draws exactly what the owner of the whole graph
would. The functions below are plain Python; :mod:`cpu_kernels` compiles them with
``numba.njit`` and :mod:`cuda_kernels` with ``numba.cuda.jit(device=True)``, each a
:func:`clone` whose calls go to the compiled versions of its callees.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np

_MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
#: 2**-53, to turn the top 53 bits of a uint64 into a float in [0, 1).
INV_2_53 = 1.0 / 9007199254740992.0


def mix64(z: np.uint64) -> np.uint64:
    """SplitMix64's finalizer: a bijective avalanche mix of 64 bits."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def node_stream(key: np.uint64, hop: np.int64, node: np.int64) -> np.uint64:
    """The random stream of one node at one hop of one batch."""
    h = mix64(np.uint64(hop) * np.uint64(GOLDEN) + np.uint64(node))
    return mix64(key ^ h)


def pair_stream(key: np.uint64, salt: np.uint64, src: np.int64, dst: np.int64) -> np.uint64:
    """The random stream of one seed edge ``(src, dst)`` (original IDs) of one batch, for
    the draws named by ``salt`` (a link batch's negatives)."""
    h = mix64(mix64(np.uint64(src) * np.uint64(GOLDEN) + salt) + np.uint64(dst))
    return mix64(key ^ h)


def uniform(stream: np.uint64, j: np.int64) -> float:
    """The ``j``-th uniform float in ``[0, 1)`` of ``stream``."""
    z = mix64(stream + (np.uint64(j) + np.uint64(1)) * np.uint64(GOLDEN))
    return float(z >> np.uint64(11)) * INV_2_53


def uniform_below(stream: np.uint64, j: np.int64, bound: np.int64) -> np.int64:
    """The ``j``-th uniform integer in ``[0, bound)`` of ``stream`` (``bound >= 1``)."""
    r = np.int64(uniform(stream, j) * bound)
    return r if r < bound else bound - 1


def batch_key(seed: int, epoch: int, rank: int, batch_index: int) -> int:
    """The uint64 key of one batch: a pure function of (seed, epoch, rank, batch index)."""
    z = seed & _MASK
    for part in (epoch, rank, batch_index):
        z = _mix64_int((z ^ (part & _MASK)) * GOLDEN & _MASK)
    return z


def clone(fn: Callable[..., Any], name: str = "", **names: Any) -> Callable[..., Any]:
    """A copy of the plain function ``fn`` whose global ``names`` are rebound (an rng
    function's calls, to their compiled versions), called ``name`` when given: a kernel's
    code (``py_func``) compiled again with other options (``nogil``, no ``parallel``)
    under a name of its own, which Numba's cache keeps apart from the first."""
    env = {**fn.__globals__, **names} if names else fn.__globals__
    out = types.FunctionType(fn.__code__, env, name or fn.__name__, fn.__defaults__, fn.__closure__)
    out.__qualname__, out.__doc__ = name or fn.__qualname__, fn.__doc__
    return out


def _mix64_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)
