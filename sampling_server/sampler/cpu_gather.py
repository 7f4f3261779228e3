"""Numba CPU kernels of the row gathers: features and labels of a batch's nodes.

Rows move as unsigned words of the item size, so one compiled kernel serves
float16/32/64 features and int64 labels alike. The rows of a batch are scattered over
the feature matrix, so a gather is a stream of cache misses: each thread walks its block
of rows and asks for the cache lines of the row :data:`PREFETCH_DISTANCE` rows ahead
(``llvm.prefetch``) while it copies the current one, so the misses of several rows are
in flight at once instead of one row's at a time.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from protos.halfcast import half_to_bfloat16, narrow_word
from protos.prefetch import LINE, prefetch
from sampling_server.sampler.cpu_kernels import PARALLEL_MIN_ROWS, parallel_guard
from sampling_server.sampler.rng import clone

#: Rows ahead of the copied one whose cache lines are requested.
PREFETCH_DISTANCE = 8
#: Rows per block of the parallel gathers (a thread prefetches within its block).
ROW_BLOCK = 256

_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
#: An empty array of each word type (what tells the block kernels the words' type).
_LIKE = {np.dtype(word): np.empty(0, dtype=word) for word in _UINT_OF_SIZE.values()}


@numba.njit(inline="always", nogil=True, cache=True)
def _prefetch_ahead(flat: np.ndarray, nodes: np.ndarray, node_start: int, width: int, step: int,
                    i: int, hi: int) -> None:
    """Ask for the cache lines of the row of ``nodes[i + PREFETCH_DISTANCE]`` (if ``< hi``)."""
    if i + PREFETCH_DISTANCE < hi:
        ahead = (nodes[i + PREFETCH_DISTANCE] - node_start) * width
        for q in range(0, width, step):
            prefetch(flat, ahead + q)  # type: ignore[call-arg]


@numba.njit(inline="always", nogil=True, cache=True)
def _copy_rows(src: np.ndarray, flat: np.ndarray, nodes: np.ndarray, node_start: int,
               out: np.ndarray, lo: int, hi: int) -> None:
    """``out[i] = src[nodes[i] - node_start]`` for ``i`` in ``lo:hi``, prefetching ahead
    (``flat`` is ``src`` as 1-D)."""
    width = src.shape[1]
    step = max(1, LINE // src.itemsize)
    for i in range(lo, hi):
        _prefetch_ahead(flat, nodes, node_start, width, step, i, hi)
        r = nodes[i] - node_start
        for j in range(width):
            out[i, j] = src[r, j]


@numba.njit(parallel=True, nogil=True, cache=True)
def gather_rows(src: np.ndarray, flat: np.ndarray, nodes: np.ndarray, node_start: int,
                out: np.ndarray) -> None:
    """``out[i] = src[nodes[i] - node_start]`` for 2-D ``src`` (blocks of rows copied in
    parallel; ``flat`` is ``src`` as 1-D)."""
    n = nodes.size
    for b in numba.prange((n + ROW_BLOCK - 1) // ROW_BLOCK):
        _copy_rows(src, flat, nodes, node_start, out, b * ROW_BLOCK, min(n, (b + 1) * ROW_BLOCK))


#: :func:`gather_rows` on one thread (few rows): its ``prange`` is a plain loop without
#: ``parallel``.
gather_rows_serial = numba.njit(nogil=True, cache=True)(clone(gather_rows.py_func, "gather_rows_serial"))


@numba.njit(parallel=True, nogil=True, cache=True)
def gather_rows_and_labels(
    src: np.ndarray, flat: np.ndarray, labels: np.ndarray, nodes: np.ndarray, node_start: int,
    out: np.ndarray, out_labels: np.ndarray,
) -> None:
    """:func:`gather_rows` and the 1-D ``labels`` of the same rows, in one parallel pass."""
    n = nodes.size
    for b in numba.prange((n + ROW_BLOCK - 1) // ROW_BLOCK):
        lo, hi = b * ROW_BLOCK, min(n, (b + 1) * ROW_BLOCK)
        for i in range(lo, hi):
            out_labels[i] = labels[nodes[i] - node_start]
        _copy_rows(src, flat, nodes, node_start, out, lo, hi)


def _as_words(arr: np.ndarray, ndims: tuple[int, ...] = (1, 2)) -> np.ndarray | None:
    """A C-contiguous array of ``ndims`` dimensions as 2-D unsigned words of its item
    size, a row per entry along its first axis (None if it is not one)."""
    word = _UINT_OF_SIZE.get(arr.dtype.itemsize)
    if word is None or arr.ndim not in ndims or not arr.flags.c_contiguous:
        return None
    return arr.reshape(arr.shape[0], math.prod(arr.shape[1:])).view(word)  # (not -1: 0 rows)


def gather_with_labels(
    src: np.ndarray, labels: np.ndarray, nodes: np.ndarray, node_start: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``src`` and entries of ``labels`` for ``nodes`` (as :func:`gather` each)."""
    arr, lab = np.asarray(src), np.asarray(labels)
    words = _as_words(arr, (2,))
    if nodes.size < PARALLEL_MIN_ROWS or words is None or lab.ndim != 1 or not lab.flags.c_contiguous:
        return gather(arr, nodes, node_start), gather(lab, nodes, node_start)
    out = np.empty((nodes.size, arr.shape[1]), dtype=words.dtype)
    out_labels = np.empty(nodes.size, dtype=lab.dtype)
    with parallel_guard():
        gather_rows_and_labels(words, words.reshape(-1), lab, nodes, node_start, out, out_labels)
    return out.view(arr.dtype), out_labels


def gather(src: np.ndarray, nodes: np.ndarray, node_start: int) -> np.ndarray:
    """Rows ``nodes - node_start`` of ``src`` (C-contiguous, possibly a read-only memmap),
    read in place."""
    arr = np.asarray(src)
    words = _as_words(arr, (max(arr.ndim, 1),))  # (any number of dimensions)
    if words is None:
        return arr[nodes - node_start]
    out = np.empty((nodes.size, words.shape[1]), dtype=words.dtype)
    if nodes.size >= PARALLEL_MIN_ROWS:
        with parallel_guard():
            gather_rows(words, words.reshape(-1), nodes, node_start, out)
    elif nodes.size:
        gather_rows_serial(words, words.reshape(-1), nodes, node_start, out)
    return out.view(arr.dtype).reshape((nodes.size, *arr.shape[1:]))


# -- into place: rows written where they go (a batch that mixes owned and remote nodes),
# in one array or in blocks of rows (the stream messages that carry them) --------------
@intrinsic
def _pointer(typingctx: Any, address: Any, like: Any) -> Any:
    """``address`` (an integer) as a pointer to ``like``'s item type."""
    if not (isinstance(address, types.Integer) and isinstance(like, types.Array)):
        return None
    sig = types.CPointer(like.dtype)(address, like)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


#: What :func:`gather_rows_to` does to each word: copy it, or narrow float32 or float16
#: words to bfloat16 ones.
COPY, FROM_SINGLE, FROM_HALF = 0, 1, 2


@numba.njit(inline="always", nogil=True, cache=True)
def _block_row(addresses: np.ndarray, per_block: int, like: np.ndarray, p: int, width: int) -> np.ndarray:
    """Row ``p`` of rows laid out in blocks of ``per_block`` rows of ``width`` words, block
    ``b`` at ``addresses[b]`` (``like``: an array of the words' type)."""
    b = p // per_block if addresses.size > 1 else 0  # (one block, one array: no division)
    address = addresses[b] + (p - b * per_block) * width * like.itemsize
    return numba.carray(_pointer(address, like), (width,))  # type: ignore[call-arg]


@numba.njit(parallel=True, nogil=True, cache=True)
def gather_rows_to(src: np.ndarray, flat: np.ndarray, nodes: np.ndarray, node_start: int,
                   positions: np.ndarray, addresses: np.ndarray, per_block: int,
                   like: np.ndarray, narrow: int, half_table: np.ndarray) -> None:
    """Row ``positions[i]`` of rows laid out in blocks (:func:`_block_row`) = row
    ``nodes[i] - node_start`` of ``src``, blocks of :data:`ROW_BLOCK` rows in parallel,
    prefetching ahead; ``narrow``: :data:`COPY`, or ``src`` holds float32 (:data:`FROM_SINGLE`)
    or float16 (:data:`FROM_HALF`) words and the rows take their bfloat16 words
    (:func:`protos.halfcast.narrow_word`; float16 ones looked up in ``half_table``,
    :func:`protos.halfcast.half_to_bfloat16`)."""
    n = nodes.size
    width = src.shape[1]
    step = max(1, LINE // src.itemsize)
    for b in numba.prange((n + ROW_BLOCK - 1) // ROW_BLOCK):
        hi = min(n, (b + 1) * ROW_BLOCK)
        for i in range(b * ROW_BLOCK, hi):
            _prefetch_ahead(flat, nodes, node_start, width, step, i, hi)
            r = nodes[i] - node_start
            row = _block_row(addresses, per_block, like, positions[i], width)
            if narrow == FROM_SINGLE:
                for j in range(width):
                    row[j] = narrow_word(src[r, j])
            elif narrow == FROM_HALF:
                for j in range(width):
                    row[j] = half_table[src[r, j]]
            else:
                for j in range(width):
                    row[j] = src[r, j]


@numba.njit(parallel=True, nogil=True, cache=True)
def scatter_rows_to(rows: np.ndarray, positions: np.ndarray, addresses: np.ndarray,
                    per_block: int, like: np.ndarray) -> None:
    """Row ``positions[i]`` of rows laid out in blocks (:func:`_block_row`) = ``rows[i]``
    (the same word type), blocks of rows in parallel."""
    n, width = rows.shape
    for b in numba.prange((n + ROW_BLOCK - 1) // ROW_BLOCK):
        for i in range(b * ROW_BLOCK, min(n, (b + 1) * ROW_BLOCK)):
            row = _block_row(addresses, per_block, like, positions[i], width)
            for j in range(width):
                row[j] = rows[i, j]


class RowBlocks:
    """Rows ``0 .. n`` laid out in blocks of equal size (the last may be shorter), each a
    C-contiguous 1-D or 2-D array of its own (e.g. the rows of the stream messages that
    carry them): what :func:`gather_into` and :func:`scatter_into` write into in one call."""

    __slots__ = ("addresses", "arrays", "like", "num_rows", "per_block", "width")

    def __init__(self, arrays: list[np.ndarray]) -> None:
        """``arrays``: the blocks in order, of one dtype and width, all but the last of
        the first's number of rows."""
        if not arrays:
            raise ValueError("RowBlocks: expected at least one block, got none")
        first = arrays[0]
        words = [_as_words(a) for a in arrays]
        if any(w is None for w in words) or any(a.dtype != first.dtype or a.shape[1:] != first.shape[1:]
                                                for a in arrays) \
                or any(a.shape[0] != first.shape[0] for a in arrays[:-1]) \
                or arrays[-1].shape[0] > first.shape[0] or first.shape[0] == 0:
            raise ValueError(f"RowBlocks: expected C-contiguous 1-D or 2-D blocks of one dtype and "
                             f"width, all but the last of the first's rows, got "
                             f"{[(a.shape, str(a.dtype)) for a in arrays]}")
        self.arrays = [w for w in words if w is not None]  # (the words keep the blocks alive)
        self.per_block = int(first.shape[0])
        self.width = int(self.arrays[0].shape[1])
        self.num_rows = sum(int(a.shape[0]) for a in arrays)
        self.like = _LIKE[self.arrays[0].dtype]  # (one Numba type per word type)
        self.addresses = np.array([a.ctypes.data for a in self.arrays], dtype=np.int64)


def _row_words(out: np.ndarray | RowBlocks) -> tuple[int, np.dtype[Any]] | None:
    """Words per row and their dtype of ``out`` (None: not C-contiguous 1-D or 2-D)."""
    if isinstance(out, RowBlocks):
        return out.width, out.like.dtype
    words = _as_words(out)
    return None if words is None else (int(words.shape[1]), words.dtype)


def _shown(out: np.ndarray | RowBlocks) -> str:
    return f"{out.shape} {out.dtype}" if isinstance(out, np.ndarray) else \
        f"blocks of {out.width} {out.like.dtype} words"


def gather_into(src: np.ndarray, nodes: np.ndarray, node_start: int, positions: np.ndarray,
                out: np.ndarray | RowBlocks, bfloat16: bool = False) -> None:
    """``out[positions] = src[nodes - node_start]`` (1-D or 2-D, row for row), in one
    parallel pass; ``out`` an array or :class:`RowBlocks`. float32 ``src`` into bfloat16
    rows (given as their uint16 words, NumPy has no bfloat16), and float16 ``src`` into
    rows that ``bfloat16`` says are bfloat16 words, are narrowed on the way, as
    ``Tensor.to`` rounds. Other dtype pairs are a ``ValueError``. The rows and positions
    are not range-checked: callers pass owned nodes (checked) and positions they computed."""
    arr = np.asarray(src)
    src_words, dest = _as_words(arr), _row_words(out)
    if src_words is None or dest is None or src_words.shape[1] != dest[0] or nodes.size != positions.size:
        raise ValueError(f"gather_into: expected C-contiguous rows of one width and as many "
                         f"positions as nodes, got {arr.shape} -> {_shown(out)}, "
                         f"{nodes.size} nodes, {positions.size} positions")
    narrow = COPY
    if dest[1] == np.uint16 and (arr.dtype == np.float32 or (bfloat16 and arr.dtype == np.float16)):
        narrow = FROM_SINGLE if arr.dtype == np.float32 else FROM_HALF
    if narrow == COPY and src_words.dtype != dest[1]:
        raise ValueError(f"gather_into: expected rows of {arr.dtype}'s item size (or bfloat16 "
                         f"words for float32 rows), got {_shown(out)}")
    if nodes.size:
        blocks = out if isinstance(out, RowBlocks) else RowBlocks([out])
        with parallel_guard():
            gather_rows_to(src_words, src_words.reshape(-1), nodes, node_start, positions,
                           blocks.addresses, blocks.per_block, blocks.like, narrow, half_to_bfloat16())


def scatter_into(rows: np.ndarray, positions: np.ndarray, out: np.ndarray | RowBlocks) -> None:
    """``out[positions] = rows`` (1-D or 2-D, the same item size; ``out`` an array or
    :class:`RowBlocks`), in parallel; the positions are not range-checked (callers pass
    positions they computed)."""
    words, dest = _as_words(np.asarray(rows)), _row_words(out)
    if words is None or dest is None or (int(words.shape[1]), words.dtype) != dest \
            or rows.shape[0] != positions.size:
        raise ValueError(f"scatter_into: expected C-contiguous rows of out's width and item "
                         f"size, one per position, got {rows.shape} {rows.dtype} -> "
                         f"{_shown(out)}, {positions.size} positions")
    if positions.size:
        blocks = out if isinstance(out, RowBlocks) else RowBlocks([out])
        with parallel_guard():
            scatter_rows_to(words, positions, blocks.addresses, blocks.per_block, blocks.like)


@numba.njit(nogil=True, cache=True)
def place_runs(positions: np.ndarray, counts: np.ndarray, values: np.ndarray, offsets: np.ndarray,
               out: np.ndarray) -> None:
    """Run ``i`` of ``values`` (``counts[i]`` entries, runs back to back) to
    ``out[offsets[positions[i]]:]``: one owner's answer to a hop put back in frontier
    order (one pass, one thread)."""
    j = 0
    for i in range(positions.size):
        start = offsets[positions[i]]
        for k in range(counts[i]):
            out[start + k] = values[j + k]
        j += counts[i]
