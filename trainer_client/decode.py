"""Turn the ``MinibatchChunk`` messages of one batch into a PyG ``Data`` (a ``HeteroData``
on a typed graph), laid out as PyG's ``NeighborLoader`` lays out its batches.

Decoding does not copy: every tensor that arrived in one chunk is a read-only view of
the message's bytes (:class:`protos.assembler.TensorAssembler`), and one spread over several
chunks is copied once, from the messages straight into its final buffer; those buffers
come from a :class:`protos.buffers.BufferPool` that hands a buffer out again once no
tensor of an earlier batch refers to it. Two steps, so that the cheap one runs where it
belongs:

* :class:`BatchAssembler` (reader thread): chunks in, a CPU :class:`DecodedBatch` out,
  every message checked here and every tensor against the request
  (:mod:`trainer_client.batch_checks`);
* :func:`to_device` (consumer): move the batch to the training device (half-precision
  features travel at half size; the loader casts them there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch_geometric.data import Data, HeteroData

from protos import sampling_pb2 as pb
from protos.assembler import TensorAssembler
from protos.buffers import BufferPool
from protos.cpus import usable_cpus
from protos.fastwire import WireMessage
from trainer_client.batch_checks import BatchDecodeError, BatchSpec, build_data

#: Usable CPUs from which an assembler copies pieces on the decode threads by default.
#: With fewer, the copies compete with gRPC's threads and the reader for the same cores,
#: and one made on another thread costs more CPU than one made where the piece arrived
#: (the piece is still in this core's cache): on 2 cores each GiB decoded cost 0.143
#: CPU-seconds on the decode threads against 0.097 inline (``benchmarks/experiments/decode.py``),
#: for the same stream rate within the noise; on 16 cores the threads made the replay
#: stream 13 % faster (docs/performance.md, "Minibatch stream").
BACKGROUND_COPIES_MIN_CPUS = 4


def default_background_copies() -> bool:
    """Whether an assembler copies pieces on the decode threads by default here: when
    the process may use at least :data:`BACKGROUND_COPIES_MIN_CPUS` CPUs."""
    return usable_cpus() >= BACKGROUND_COPIES_MIN_CPUS


@dataclass(frozen=True)
class DecodedBatch:
    """One decoded batch, still on the CPU."""

    #: Index of the batch within the rank's epoch (``MinibatchChunk.batch_index``).
    index: int
    #: The batch as PyG gives it (tensors share the messages' bytes: read-only); a
    #: ``HeteroData`` on a typed graph.
    data: Data | HeteroData
    #: Bytes received for the batch (serialized messages).
    nbytes: int
    #: Feature rows of the batch and how many came from the trainer's feature cache, once
    #: a reader thread completed it (counted in the stream's stats when the consumer
    #: takes it, with its bytes).
    rows: int = 0
    cached_rows: int = 0


class BatchAssembler:
    """Collects the messages of one batch after another and decodes each batch.

    Feed the stream's messages in order to :meth:`add`; it returns a
    :class:`DecodedBatch` when a batch's last message arrives, ``None`` before. After a
    broken stream call :meth:`reset` to drop a half-received batch.
    """

    def __init__(self, spec: BatchSpec | None = None, pool: BufferPool | None = None,
                 background_copies: bool | None = None, pinned: bool = False) -> None:
        """``spec`` says what every batch must contain (no checks beyond the wire's: None);
        ``pool`` holds the buffers of tensors spread over several messages (default: a
        new :class:`~protos.buffers.BufferPool`, kept for every batch of this assembler).
        ``background_copies``: copy those tensors' pieces on the decode threads while
        the next message is read (default None: :func:`default_background_copies`);
        ``pinned``: into page-locked memory instead of the pool, for a batch bound for a
        GPU (see :class:`~protos.assembler.TensorAssembler`)."""
        self.spec = spec or BatchSpec()
        self.pool = pool if pool is not None else BufferPool()
        copies = default_background_copies() if background_copies is None else background_copies
        self._tensors = TensorAssembler(pool=self.pool, background_copies=copies, pinned=pinned)
        self.reset()

    @property
    def background_copies(self) -> bool:
        """Whether pieces are copied on the decode threads."""
        return self._tensors.background_copies

    @property
    def pending(self) -> bool:
        """Whether part of a batch has been received."""
        return self._next_chunk > 0

    def reset(self) -> None:
        """Drop a partly received batch (e.g. after the stream broke)."""
        self._tensors.reset()
        self._header: pb.MinibatchHeader | None = None
        self._index, self._next_chunk, self._num_chunks, self._nbytes = -1, 0, 0, 0

    def add(self, msg: pb.MinibatchChunk | WireMessage) -> DecodedBatch | None:
        """Add the next message; return the batch when it is complete."""
        if self._next_chunk == 0:
            self._start(msg)
        else:
            self._check_next(msg)
        self._tensors.add_all(msg.tensors)
        # ByteSize, not len(t.data): each read of a bytes field copies it (upb)
        self._nbytes += msg.ByteSize()
        self._next_chunk += 1
        if self._next_chunk < self._num_chunks:
            return None
        header, index, nbytes = self._header, self._index, self._nbytes
        assert header is not None  # set by _start
        try:
            tensors = self._tensors.finish_torch()
        finally:
            self.reset()
        return DecodedBatch(index=index, data=build_data(header, tensors, self.spec, index), nbytes=nbytes)

    def _start(self, msg: pb.MinibatchChunk | WireMessage) -> None:
        """Check the first message of a batch and remember its header."""
        where = f"MinibatchChunk of batch {msg.batch_index}"
        if msg.chunk_index != 0:
            raise BatchDecodeError(f"{where}: chunk_index: expected 0 (first message of a batch), got "
                                   f"{msg.chunk_index}")
        if msg.num_chunks < 1:
            raise BatchDecodeError(f"{where}: num_chunks: expected >= 1, got {msg.num_chunks}")
        if msg.batch_index < 0:
            raise BatchDecodeError(f"MinibatchChunk.batch_index: expected >= 0, got {msg.batch_index}")
        if not msg.HasField("header"):
            raise BatchDecodeError(f"{where}: header: expected a MinibatchHeader on chunk 0, got none")
        self._header, self._index, self._num_chunks = msg.header, msg.batch_index, msg.num_chunks

    def _check_next(self, msg: pb.MinibatchChunk | WireMessage) -> None:
        """Check that a later message continues the batch being received."""
        if msg.batch_index != self._index:
            raise BatchDecodeError(f"MinibatchChunk.batch_index: expected {self._index} (chunk "
                                   f"{self._next_chunk} of {self._num_chunks}), got {msg.batch_index} (batch "
                                   f"{self._index} is incomplete)")
        if msg.chunk_index != self._next_chunk:
            raise BatchDecodeError(f"MinibatchChunk of batch {self._index}: chunk_index: expected "
                                   f"{self._next_chunk}, got {msg.chunk_index}")
        if msg.num_chunks != self._num_chunks:
            raise BatchDecodeError(f"MinibatchChunk of batch {self._index}: num_chunks: expected "
                                   f"{self._num_chunks} as in chunk 0, got {msg.num_chunks}")


def decode_batch(messages: Iterable[pb.MinibatchChunk], spec: BatchSpec | None = None) -> DecodedBatch:
    """Decode the messages of exactly one batch (all of them, in order)."""
    assembler = BatchAssembler(spec)
    batch: DecodedBatch | None = None
    for msg in messages:
        if batch is not None:
            raise BatchDecodeError(f"MinibatchChunk: expected the messages of one batch, got more after "
                                   f"batch {batch.index} was complete (batch_index {msg.batch_index})")
        batch = assembler.add(msg)
    if batch is None:
        got = "only part of them" if assembler.pending else "none"
        raise BatchDecodeError(f"MinibatchChunk: expected every message of one batch, got {got}")
    return batch


# ---- to the training device ------------------------------------------------------------


def _each_tensor(data: Data | HeteroData, change: Callable[[torch.Tensor], torch.Tensor]
                 ) -> Data | HeteroData:
    for store in data.stores:
        for key, value in list(store.items()):
            if isinstance(value, torch.Tensor):
                store[key] = change(value)
    return data


def pin_batch(data: Data | HeteroData) -> Data | HeteroData:
    """Copy a CPU batch's tensors into pinned memory (for ``non_blocking`` transfers);
    tensors already there (decoded into pinned buffers) are kept as they are."""
    return _each_tensor(data, lambda t: t if t.is_pinned() else t.pin_memory())


def to_device(data: Data | HeteroData, device: torch.device | str, *,
              non_blocking: bool = False) -> Data | HeteroData:
    """Move a batch to ``device``, features in their wire dtype (the loader casts them
    there, so half-precision features cross the bus at half size). ``non_blocking`` only
    helps for pinned tensors."""
    device = torch.device(device)
    return _each_tensor(data, lambda t: t.to(device, non_blocking=non_blocking))
