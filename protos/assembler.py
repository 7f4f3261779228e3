"""Reassembly of tensors spread over several stream messages (the receiving side of
:func:`protos.codec.split_tensors`): :class:`TensorAssembler`.

A tensor that arrived in one chunk is decoded without a copy; one spread over several
chunks is copied once, into one preallocated buffer (optionally from a
:class:`~protos.buffers.BufferPool`, optionally pinned, optionally by the process's
decode threads while the stream's next message is read).

Malformed input raises :class:`protos.codec.CodecError` naming the field, what was
expected and what was received.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from protos.buffers import BufferPool
from protos.codec import (
    _LITTLE_ENDIAN_HOST,
    CodecError,
    WireDType,
    _check_dtype,
    _check_shape,
    _check_values,
    _nbytes,
    _numpy_view,
    _torch_view,
    dtype_name,
    dtype_to_torch,
)


class ChunkLike(Protocol):
    """What :class:`TensorAssembler` reads of a chunk: a ``pb.TensorChunk``, or a
    :class:`protos.fastwire.WireTensorChunk` whose data is a view of its message."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> int: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def offset(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    @property
    def data(self) -> bytes | memoryview: ...


#: Pieces from this size up are copied into their tensor's buffer by the decode threads
#: when an assembler has ``background_copies`` (smaller ones where they arrive: handing
#: them over would cost more than the copy).
BACKGROUND_COPY_MIN_BYTES = 256 << 10
#: Threads that copy received pieces into their buffers (shared by every assembler of
#: the process; a copy releases the GIL).
DECODE_THREADS = 2
#: Seconds a finished tensor waits for its pieces' copies (memory copies: far less).
COPY_WAIT_SECONDS = 60.0
_copier: ThreadPoolExecutor | None = None
_copier_lock = threading.Lock()


def _decode_threads() -> ThreadPoolExecutor:
    global _copier
    with _copier_lock:
        if _copier is None:
            _copier = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="graphfeed-decode")
        return _copier


def _forget_decode_threads() -> None:
    """In a forked child: the parent's threads are not there."""
    global _copier, _copier_lock
    _copier, _copier_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_decode_threads)


@dataclass
class _Partial:
    """A tensor being received."""

    #: Wire dtype of the tensor.
    dtype: WireDType
    #: Shape of the whole tensor.
    shape: tuple[int, ...]
    #: Byte size of the whole tensor.
    total: int
    #: Bytes received so far (also the offset the next chunk must have).
    received: int = 0
    #: The data of a tensor that arrived in one chunk (decoded without a copy).
    whole: bytes | memoryview | None = None
    #: The preallocated buffer of a tensor spread over several chunks.
    buffer: np.ndarray | None = None
    #: The same buffer as a pinned torch tensor (assemblers with ``pinned``).
    pinned: torch.Tensor | None = None

    @property
    def source(self) -> bytes | memoryview | np.ndarray:
        """The bytes received: the single chunk's data, or the assembled buffer."""
        if self.buffer is not None:
            return self.buffer
        return self.whole if self.whole is not None else b""


class TensorAssembler:
    """Reassembles named tensors from ``TensorChunk``s received in order.

    Feed every chunk of one batch (or answer) with :meth:`add`, then call
    :meth:`finish` (NumPy) or :meth:`finish_torch`; both check that every tensor is
    complete, return the tensors by name and reset the assembler for the next batch.
    A tensor that arrived in one chunk is a view of that chunk's bytes; one spread over
    several chunks is copied once into a buffer taken at its first chunk, from ``pool``
    when one is given (buffers of earlier batches that nothing refers to any more, see
    :class:`protos.buffers.BufferPool`), else newly allocated.

    With ``background_copies`` those copies run on the process's decode threads
    (:data:`DECODE_THREADS`) while the caller reads the stream's next message; the
    tensors are returned once every copy is done. A stream's reader thread then only
    parses messages, which is what bounds one stream's rate on a machine with cores to
    spare.

    With ``pinned`` (a trainer that moves batches to a GPU) those buffers are page-locked
    memory from PyTorch's caching host allocator, not the pool: the tensors come out
    ready for ``non_blocking`` transfers, without a second copy into pinned memory, and
    the allocator reuses a buffer only once the transfers that read it are done.
    """

    def __init__(self, *, max_tensor_bytes: int | None = None, pool: BufferPool | None = None,
                 background_copies: bool = False, pinned: bool = False) -> None:
        """``max_tensor_bytes`` rejects chunks announcing a bigger tensor (no limit: None)."""
        self._max_tensor_bytes = max_tensor_bytes
        self._pool = pool
        self._pinned = pinned and _LITTLE_ENDIAN_HOST
        self._partials: dict[str, _Partial] = {}
        self._background = background_copies
        self._copies: list[Future[None]] = []

    def reset(self) -> None:
        """Drop the tensors started so far (e.g. after a broken stream)."""
        self._wait_for_copies(raise_errors=False)  # no copy may write a buffer given back
        self._partials = {}

    def _wait_for_copies(self, raise_errors: bool = True) -> None:
        copies, self._copies = self._copies, []
        for i, copy in enumerate(copies):
            try:
                copy.result(timeout=COPY_WAIT_SECONDS)
            except Exception as exc:
                if raise_errors:
                    for rest in copies[i + 1:]:  # let the others finish before the error
                        rest.exception(timeout=COPY_WAIT_SECONDS)
                    raise CodecError(f"TensorChunk.data: copying a received piece failed: "
                                     f"{type(exc).__name__}: {exc}") from exc

    @property
    def background_copies(self) -> bool:
        """Whether pieces are copied on the decode threads."""
        return self._background

    @property
    def names(self) -> list[str]:
        """Names of the tensors started so far, in arrival order."""
        return list(self._partials)

    def add_all(self, chunks: Iterable[ChunkLike]) -> None:
        """Add several chunks in order (e.g. the ``tensors`` field of one message)."""
        for chunk in chunks:
            self.add(chunk)

    def add(self, chunk: ChunkLike) -> None:
        """Add the next chunk of one tensor; raise :class:`CodecError` if it is malformed."""
        name = chunk.name
        if not name:
            raise CodecError("TensorChunk.name: expected a non-empty name, got ''")
        partial = self._partials.get(name)
        if partial is None:
            partial = self._start(chunk)
        else:
            self._check_same(partial, chunk)
        data = chunk.data  # read once: protobuf copies on every read
        self._check_slice(name, partial, chunk.offset, len(data))
        if partial.received == 0 and len(data) == partial.total:
            partial.whole = data
        else:
            if partial.buffer is None:
                if self._pinned:
                    partial.pinned = torch.empty(partial.total, dtype=torch.uint8, pin_memory=True)
                    partial.buffer = partial.pinned.numpy()
                else:
                    partial.buffer = (self._pool.take(partial.total) if self._pool is not None
                                      else np.empty(partial.total, dtype=np.uint8))
            # the one copy: from the received message straight into the final buffer
            dest = partial.buffer[partial.received : partial.received + len(data)]
            if self._background and len(data) >= BACKGROUND_COPY_MIN_BYTES:
                self._copies.append(_decode_threads().submit(
                    np.copyto, dest, np.frombuffer(data, dtype=np.uint8)))
            else:
                dest[:] = np.frombuffer(data, dtype=np.uint8)
        partial.received += len(data)

    def _start(self, chunk: ChunkLike) -> _Partial:
        """Validate the first chunk of a tensor and register the tensor."""
        dtype = _check_dtype(chunk.dtype, f"TensorChunk.dtype of {chunk.name!r}")
        shape = _check_shape(chunk.shape, f"TensorChunk.shape of {chunk.name!r}")
        total = _nbytes(dtype, shape)
        if chunk.total_bytes != total:
            raise CodecError(
                f"TensorChunk.total_bytes of {chunk.name!r}: expected {total} for "
                f"{dtype_name(dtype)} of shape {list(shape)}, got {chunk.total_bytes}"
            )
        limit = self._max_tensor_bytes
        if limit is not None and total > limit:
            raise CodecError(
                f"TensorChunk.total_bytes of {chunk.name!r}: expected at most {limit}, got {total}"
            )
        partial = _Partial(dtype=dtype, shape=shape, total=total)
        self._partials[chunk.name] = partial
        return partial

    @staticmethod
    def _check_same(partial: _Partial, chunk: ChunkLike) -> None:
        """Raise unless a later chunk repeats the dtype, shape and size of the first."""
        name = chunk.name
        if partial.received == partial.total:
            raise CodecError(
                f"TensorChunk.offset of {name!r}: expected no more chunks (all "
                f"{partial.total} bytes received), got one at offset {chunk.offset}"
            )
        for field, want, got in (("dtype", dtype_name(partial.dtype), dtype_name(chunk.dtype)),
                                 ("shape", list(partial.shape), list(chunk.shape)),
                                 ("total_bytes", partial.total, chunk.total_bytes)):
            if got != want:
                raise CodecError(f"TensorChunk.{field} of {name!r}: expected {want} as in its "
                                 f"first chunk, got {got}")

    @staticmethod
    def _check_slice(name: str, partial: _Partial, offset: int, size: int) -> None:
        """Raise unless ``[offset, offset + size)`` continues the tensor exactly."""
        if offset != partial.received:
            kind = "gap" if offset > partial.received else "overlap"
            raise CodecError(
                f"TensorChunk.offset of {name!r}: expected {partial.received} (the next "
                f"byte), got {offset} ({kind})"
            )
        if offset + size > partial.total:
            raise CodecError(
                f"TensorChunk.data of {name!r}: expected at most {partial.total - offset} "
                f"bytes at offset {offset} (total_bytes {partial.total}), got {size}"
            )
        if size == 0 and partial.total > 0:
            raise CodecError(
                f"TensorChunk.data of {name!r}: expected at least 1 byte at offset {offset}, got 0"
            )

    def _take(self, expected: Collection[str] | None) -> dict[str, _Partial]:
        """Check completeness (and the expected names), reset, return the partials."""
        try:
            self._wait_for_copies()
        except CodecError:
            self._partials = {}
            raise
        partials, self._partials = self._partials, {}
        for name, p in partials.items():
            if p.received != p.total:
                raise CodecError(
                    f"TensorChunk.data of {name!r}: expected {p.total} bytes in all, got "
                    f"{p.received} (missing chunks)"
                )
            _check_values(p.source, p.dtype, f"TensorChunk.data of {name!r}")
        missing = sorted(set(expected or ()) - set(partials))
        if missing:
            raise CodecError(
                f"TensorChunk.name: expected tensors {sorted(expected or ())}, got "
                f"{sorted(partials)} (missing {missing})"
            )
        return partials

    def finish(
        self, *, writable: bool = False, expected: Collection[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Return the complete tensors as NumPy arrays (BFLOAT16 as ``uint16`` bits).

        Arrays are read-only unless ``writable``; ``expected`` names tensors that must
        be present. Raises :class:`CodecError` on missing chunks or tensors.
        """
        out = {}
        for name, p in self._take(expected).items():
            array = _numpy_view(p.source, p.dtype, p.shape, writable)
            if not writable and array.flags.writeable:
                array.flags.writeable = False
            out[name] = array
        return out

    def finish_torch(
        self, *, writable: bool = False, expected: Collection[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Return the complete tensors as CPU torch tensors (BFLOAT16 as bfloat16).

        Without ``writable``, single-chunk tensors share the message's immutable bytes:
        do not write to them. Raises :class:`CodecError` on missing chunks or tensors.
        """
        return {  # an assembled buffer is already owned and writable: never copy it
            name: p.pinned.view(dtype_to_torch(p.dtype)).reshape(p.shape) if p.pinned is not None
            else _torch_view(p.source, p.dtype, p.shape, writable and p.buffer is None)
            for name, p in self._take(expected).items()
        }
