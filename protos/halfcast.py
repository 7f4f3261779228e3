"""Feature casts between float32 and bfloat16 on the CPU, bit-identical to ``Tensor.to``.

Features travel as bfloat16 when a trainer asks for it (``EpochRequest.feature_dtype``):
a server narrows the float32 rows it stores, a trainer widens the rows it receives. Each
is one Numba pass over the 32-bit words here, instead of a kernel on torch's intra-op
thread pool, whose workers spin at their barriers on the cores a process shares (a
trainer with its model, a server with its sampling threads and gRPC):

* narrowing: round to nearest, ties to even, as torch does (and every NaN becomes
  ``0xFFFF``, as in torch's CPU cast); parallel, for servers. A products-sized batch's ``x``
  (43 M values) takes 7-8 ms on 2 threads, as long as torch's own cast once the
  allocator keeps freed blocks (:mod:`protos.allocator`);
* widening: exact (the 16 bits move to the top); on the calling thread, for trainers.

:func:`cast` runs either, or ``Tensor.to`` for every other case (other dtypes, other
devices).
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
import torch

from protos import allocator

_INF = np.uint32(0x7F800000)
_ABS = np.uint32(0x7FFFFFFF)
_NAN = np.uint16(0xFFFF)  # what torch's CPU cast makes of every NaN
_BIAS = np.uint32(0x7FFF)


@numba.njit(inline="always", nogil=True, cache=True)
def narrow_word(w: np.uint32) -> np.uint16:
    """The bfloat16 bits of the float32 bits ``w`` (Numba; for kernels that narrow as
    they copy)."""
    if w & _ABS > _INF:  # NaN
        return _NAN
    # ties to even: add 0x7FFF plus the lowest kept bit, drop the low 16 bits
    return np.uint16((w + _BIAS + ((w >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@numba.njit(inline="always", nogil=True, cache=True)
def single_of_half(h: np.uint16) -> np.uint32:
    """The float32 bits of the float16 bits ``h``, exactly (Numba; subnormals, infinities
    and NaNs included)."""
    w = np.uint32(h)
    sign = (w & np.uint32(0x8000)) << np.uint32(16)
    exp = (w >> np.uint32(10)) & np.uint32(0x1F)
    mant = w & np.uint32(0x3FF)
    if exp == np.uint32(0x1F):  # infinity or NaN
        return sign | np.uint32(0x7F800000) | (mant << np.uint32(13))
    if exp == np.uint32(0):
        if mant == np.uint32(0):
            return sign
        e = np.uint32(113)  # a subnormal: 2^-14 * mant / 1024, normalized
        while mant & np.uint32(0x400) == np.uint32(0):
            mant <<= np.uint32(1)
            e -= np.uint32(1)
        return sign | (e << np.uint32(23)) | ((mant & np.uint32(0x3FF)) << np.uint32(13))
    return sign | ((exp + np.uint32(112)) << np.uint32(23)) | (mant << np.uint32(13))


_HALF_NAN = np.uint16(0x7FC0)  # what torch's CPU cast makes of every float16 NaN


@numba.njit(inline="always", nogil=True, cache=True)
def narrow_half_word(h: np.uint16) -> np.uint16:
    """The bfloat16 bits of the float16 bits ``h``, as torch's CPU cast rounds (Numba)."""
    if h & np.uint16(0x7FFF) > np.uint16(0x7C00):  # NaN
        return _HALF_NAN
    return narrow_word(single_of_half(h))


@numba.njit(nogil=True, cache=True)
def _half_table() -> np.ndarray:
    out = np.empty(1 << 16, np.uint16)
    for h in range(1 << 16):
        out[h] = narrow_half_word(np.uint16(h))
    return out


@functools.cache
def half_to_bfloat16() -> np.ndarray:
    """The bfloat16 bits of every float16 bit pattern (:func:`narrow_half_word` of each,
    128 KiB): a kernel that narrows float16 rows looks each word up, a load from a table
    that stays in the core's cache, where the conversion branches on every word (2.6x
    slower). Made on first use: a Numba call at import would cost every process that
    imports this module (trainers included) the start of Numba's compiled-code loading."""
    return _half_table()


@numba.njit(parallel=True, nogil=True, cache=True)
def _narrow(words: np.ndarray, out: np.ndarray) -> None:
    for i in numba.prange(words.size):
        out[i] = narrow_word(words[i])


@numba.njit(nogil=True, cache=True)
def _widen(words: np.ndarray, out: np.ndarray) -> None:
    for i in range(words.size):
        out[i] = np.uint32(words[i]) << 16


#: Item size -> (torch integer dtype, NumPy unsigned word) of that size.
_WORDS = {2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32), 8: (torch.int64, np.uint64)}


def words(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a NumPy array of the same shape, of unsigned
    words of its item size (2, 4 or 8 bytes; NumPy has no bfloat16)."""
    signed, word = _WORDS[t.element_size()]
    return t.view(signed).numpy().view(word)


def _convert(kernel: Any, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new ``dtype`` tensor shaped as ``x``, filled by ``kernel(x's words, its words)``
    (both flat)."""
    src = x.contiguous()
    out = allocator.empty(src.shape, dtype)
    if src.numel():
        kernel(words(src).reshape(-1), words(out).reshape(-1))
    return out


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, bit for bit (``x`` itself when it already has ``dtype``); the
    float32 <-> bfloat16 casts of CPU tensors run in Numba."""
    if x.dtype == dtype:
        return x
    if x.device.type == "cpu":
        if x.dtype == torch.float32 and dtype == torch.bfloat16:
            return _convert(_narrow, x, dtype)
        if x.dtype == torch.bfloat16 and dtype == torch.float32:
            return _convert(_widen, x, dtype)
    return x.to(dtype)
