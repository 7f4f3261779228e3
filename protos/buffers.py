"""Reusable receive buffers for tensors assembled from several chunks.

A tensor spread over several stream messages is copied once, from the received
messages into one buffer (:class:`protos.assembler.TensorAssembler`). A products-sized
batch needs ~170 MB of such buffers; allocated afresh per batch, every batch pays the
allocator and, unless glibc was told to keep freed memory
(:func:`protos.allocator.keep_freed_memory`), the kernel's page faults and zeroing
again. A :class:`BufferPool` hands the same buffers out again, batch after batch.

A pooled buffer is handed out again only when nothing outside the pool refers to it:
every array or tensor made from a buffer (``buffer[:n]``, ``torch.from_numpy``, any
view of those, ``.numpy()`` of such a tensor) keeps a reference to the buffer object,
so a batch the user still holds is never overwritten. The pool only grows while all its
buffers are in use, so it never holds more memory than the batches alive at one time
held (plus :attr:`BufferPool.headroom`).
"""

from __future__ import annotations

import sys

import numpy as np

#: References to a pooled buffer that nobody else holds, as ``sys.getrefcount`` counts
#: them for ``self._buffers[i]``: the pool's list slot and the call's own argument.
_IDLE_REFS = 2


class BufferPool:
    """Byte buffers for assembled tensors, reused once the tensors made from them are gone.

    Not thread-safe: one pool per assembler (per reader thread). Other threads may drop
    their references at any time; that only makes a buffer free sooner.
    """

    def __init__(self, max_buffers: int = 16, headroom: float = 0.125) -> None:
        """Keep at most ``max_buffers`` buffers; a new one has ``headroom`` (a fraction)
        more bytes than asked, so that the next batch's slightly bigger tensor fits."""
        if max_buffers < 0:
            raise ValueError(f"max_buffers: expected >= 0, got {max_buffers}")
        if headroom < 0:
            raise ValueError(f"headroom: expected >= 0, got {headroom}")
        self.max_buffers = max_buffers
        self.headroom = headroom
        self._buffers: list[np.ndarray] = []
        #: Buffers handed out again instead of allocated (for tests and benchmarks).
        self.reused = 0

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def pooled_bytes(self) -> int:
        """Bytes held by the pool's buffers, in use or not."""
        return sum(b.size for b in self._buffers)

    def _free(self, i: int) -> bool:
        return sys.getrefcount(self._buffers[i]) <= _IDLE_REFS

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of exactly ``nbytes`` (uninitialized): a view of the
        smallest free pooled buffer that fits, else of a new pooled buffer, else (the
        pool full and busy) a plain new array."""
        free = [i for i in range(len(self._buffers)) if self._free(i)]
        fits = [i for i in free if self._buffers[i].size >= nbytes]
        if fits:
            self.reused += 1
            return self._buffers[min(fits, key=lambda i: self._buffers[i].size)][:nbytes]
        buffer = np.empty(nbytes + int(nbytes * self.headroom), dtype=np.uint8)
        if free:  # a free buffer too small for this tensor: replace it by a bigger one
            self._buffers[free[0]] = buffer
        elif len(self._buffers) < self.max_buffers:
            self._buffers.append(buffer)
        return buffer[:nbytes]
