"""Turn the ``MinibatchChunk`` messages of one batch into a PyG ``Data``.

Decoding does not copy: every tensor that arrived in one chunk is a read-only view of
the message's bytes (:class:`protos.assembler.TensorAssembler`), and one spread over several
chunks is copied once, from the messages straight into its final buffer; those buffers
come from a :class:`protos.buffers.BufferPool` that hands a buffer out again once no
tensor of an earlier batch refers to it. The result mirrors what PyG's ``NeighborLoader``
yields: ``x``, ``edge_index``, ``y``, ``n_id``, ``batch_size``, ``num_sampled_nodes`` and
``num_sampled_edges`` (for ``trim_to_layer``).

Two steps, so that the cheap one runs where it belongs:

* :class:`BatchAssembler` (reader thread): chunks in, a CPU :class:`DecodedBatch` out,
  every message and tensor checked against the request (:class:`BatchSpec`);
* :func:`to_device` (consumer): move the batch to the training device and cast the
  features (half-precision features travel at half size and are cast on the device).

Anything malformed raises :class:`BatchDecodeError` (a :class:`protos.codec.CodecError`,
itself a ``ValueError``) naming the field, what was expected and what was received.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch_geometric.data import Data, HeteroData

from protos import compact, halfcast
from protos import sampling_pb2 as pb
from protos.assembler import TensorAssembler
from protos.buffers import BufferPool
from protos.codec import CodecError
from protos.cpus import usable_cpus
from protos.fastwire import WireMessage

if TYPE_CHECKING:
    from trainer_client.hetero_decode import TypedSpec

#: Tensor names a ``StreamMinibatches`` batch may carry.
BATCH_TENSORS = ("n_id", "edge_index", "x", "y", "orig_id", "x_cached")
#: And with ``EpochRequest.compact_indices`` (``edge_index`` as sources + counts per target).
COMPACT_TENSORS = (*BATCH_TENSORS, "edge_src", "edge_new", "edge_count")
_INT64 = (torch.int64,)
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


#: Feature dtypes a batch may carry.
FEATURE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class BatchDecodeError(CodecError):
    """A batch's messages or tensors are malformed or disagree with the request."""


@dataclass(frozen=True)
class BatchSpec:
    """What every batch of one epoch stream must look like (from the request and the
    cluster info); ``None`` skips a check."""

    #: Number of hops (``len(fanouts)``): ``num_sampled_nodes`` has one entry more.
    num_hops: int | None = None
    #: Feature columns ``F`` of ``x`` (``ClusterInfo.feature_dim``).
    feature_dim: int | None = None
    #: Whether ``x`` must be present (``EpochRequest.include_features``).
    include_features: bool = True
    #: Whether ``y`` must be present (``EpochRequest.include_labels``).
    include_labels: bool = True
    #: Batches of this rank's epoch (``MinibatchHeader.num_batches`` must match).
    num_batches: int | None = None
    #: Check that every ``edge_index`` entry lies in ``0 .. N-1`` (one pass over E).
    check_edges: bool = True
    #: A typed graph's batches (``EpochRequest.typed``); None: homogeneous.
    typed: TypedSpec | None = None
    #: The request set ``compact_indices``: accept the compact forms (protos/compact.py)
    #: beside the int64 ones; the Data is the same either way.
    compact_indices: bool = False


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
        if background_copies is None:
            background_copies = default_background_copies()
        self._tensors = TensorAssembler(pool=self.pool, background_copies=background_copies,
                                        pinned=pinned)
        self._header: pb.MinibatchHeader | None = None
        self._index = -1
        self._next_chunk = 0
        self._num_chunks = 0
        self._nbytes = 0

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
        self._header = None
        self._index = -1
        self._next_chunk = 0
        self._num_chunks = 0
        self._nbytes = 0

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
            raise BatchDecodeError(
                f"{where}: chunk_index: expected 0 (first message of a batch), got {msg.chunk_index}"
            )
        if msg.num_chunks < 1:
            raise BatchDecodeError(f"{where}: num_chunks: expected >= 1, got {msg.num_chunks}")
        if msg.batch_index < 0:
            raise BatchDecodeError(f"MinibatchChunk.batch_index: expected >= 0, got {msg.batch_index}")
        if not msg.HasField("header"):
            raise BatchDecodeError(f"{where}: header: expected a MinibatchHeader on chunk 0, got none")
        self._header = msg.header
        self._index = msg.batch_index
        self._num_chunks = msg.num_chunks

    def _check_next(self, msg: pb.MinibatchChunk | WireMessage) -> None:
        """Check that a later message continues the batch being received."""
        if msg.batch_index != self._index:
            raise BatchDecodeError(
                f"MinibatchChunk.batch_index: expected {self._index} (chunk {self._next_chunk} of "
                f"{self._num_chunks}), got {msg.batch_index} (batch {self._index} is incomplete)"
            )
        if msg.chunk_index != self._next_chunk:
            raise BatchDecodeError(
                f"MinibatchChunk of batch {self._index}: chunk_index: expected {self._next_chunk}, "
                f"got {msg.chunk_index}"
            )
        if msg.num_chunks != self._num_chunks:
            raise BatchDecodeError(
                f"MinibatchChunk of batch {self._index}: num_chunks: expected {self._num_chunks} as "
                f"in chunk 0, got {msg.num_chunks}"
            )


def decode_batch(messages: Iterable[pb.MinibatchChunk], spec: BatchSpec | None = None) -> DecodedBatch:
    """Decode the messages of exactly one batch (all of them, in order)."""
    assembler = BatchAssembler(spec)
    batch: DecodedBatch | None = None
    for msg in messages:
        if batch is not None:
            raise BatchDecodeError(
                f"MinibatchChunk: expected the messages of one batch, got more after batch "
                f"{batch.index} was complete (batch_index {msg.batch_index})"
            )
        batch = assembler.add(msg)
    if batch is None:
        got = "only part of them" if assembler.pending else "none"
        raise BatchDecodeError(f"MinibatchChunk: expected every message of one batch, got {got}")
    return batch


# ---- checking and building the Data ----------------------------------------------------


def _check_counts(header: pb.MinibatchHeader, spec: BatchSpec, where: str) -> tuple[list[int], list[int]]:
    """Check the header's per-hop counts; return them as lists."""
    nodes = [int(v) for v in header.num_sampled_nodes]
    edges = [int(v) for v in header.num_sampled_edges]
    if spec.num_batches is not None and header.num_batches != spec.num_batches:
        raise BatchDecodeError(
            f"{where}: MinibatchHeader.num_batches: expected {spec.num_batches} (this rank's "
            f"batches by the epoch plan), got {header.num_batches}"
        )
    if spec.num_hops is not None and len(nodes) != spec.num_hops + 1:
        raise BatchDecodeError(
            f"{where}: MinibatchHeader.num_sampled_nodes: expected {spec.num_hops + 1} entries "
            f"(seeds + one per hop), got {len(nodes)}"
        )
    if len(edges) != max(len(nodes) - 1, 0):
        raise BatchDecodeError(
            f"{where}: MinibatchHeader.num_sampled_edges: expected {max(len(nodes) - 1, 0)} entries "
            f"(one per hop), got {len(edges)}"
        )
    if any(v < 0 for v in nodes + edges) or header.num_seed_nodes < 0:
        raise BatchDecodeError(
            f"{where}: MinibatchHeader: expected counts >= 0, got num_seed_nodes "
            f"{header.num_seed_nodes}, num_sampled_nodes {nodes}, num_sampled_edges {edges}"
        )
    if not nodes or nodes[0] != header.num_seed_nodes:
        raise BatchDecodeError(
            f"{where}: MinibatchHeader.num_sampled_nodes[0]: expected num_seed_nodes "
            f"({header.num_seed_nodes}), got {nodes[:1] or 'no entries'}"
        )
    return nodes, edges


def _require(tensors: dict[str, torch.Tensor], name: str, where: str, why: str) -> torch.Tensor:
    """Return tensor ``name``; raise naming it when it is missing."""
    if name not in tensors:
        raise BatchDecodeError(f"{where}: tensor {name!r}: expected it ({why}), got {sorted(tensors)}")
    return tensors[name]


def _check_tensor(
    t: torch.Tensor, name: str, shape: Sequence[int | None], dtypes: Sequence[torch.dtype], where: str
) -> None:
    """Raise unless ``t`` has one of ``dtypes`` and ``shape`` (``None`` = any size)."""
    if t.dtype not in dtypes:
        raise BatchDecodeError(
            f"{where}: tensor {name!r}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}"
        )
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape, strict=False))
    if not ok:
        want = ["*" if s is None else s for s in shape]
        raise BatchDecodeError(f"{where}: tensor {name!r}: expected shape {want}, got {list(t.shape)}")


def _edge_index(tensors: dict[str, torch.Tensor], spec: BatchSpec, nodes: list[int],
                num_edges: int, where: str) -> torch.Tensor:
    """The batch's int64 ``edge_index``, from "edge_index" or (compact) "edge_src" and
    "edge_count"."""
    if spec.compact_indices and "edge_index" not in tensors:
        src = _require(tensors, "edge_src", where, "every compact batch has it or 'edge_index'")
        _check_tensor(src, "edge_src", [None], compact.INDEX_DTYPES, where)
        counts = _require(tensors, "edge_count", where, "it comes with 'edge_src'")
        _check_tensor(counts, "edge_count", [sum(nodes) - nodes[-1]], compact.COUNT_DTYPES, where)
        name = "edge_src"
        try:
            if "edge_new" in tensors:
                name = "edge_new"
                src = compact.expand_sources(src, tensors["edge_new"], num_edges, nodes[0])
            elif src.numel() != num_edges:
                raise ValueError(f"expected shape [{num_edges}], got {list(src.shape)}")
            name = "edge_count"
            return compact.expand_edges(src, counts)
        except ValueError as exc:
            raise BatchDecodeError(f"{where}: tensor {name!r}: {exc}") from None
    edge_index = _require(tensors, "edge_index", where, "every batch has it")
    dtypes = compact.INDEX_DTYPES if spec.compact_indices else _INT64
    _check_tensor(edge_index, "edge_index", [2, num_edges], dtypes, where)
    return compact.widen(edge_index)


def cached_mask(tensors: dict[str, torch.Tensor], name: str, num_nodes: int, where: str,
                bits: bool) -> torch.Tensor:
    """The cache mask ``name`` ("x_cached", "x_cached/<type>") as bool ``[N]``: sent as
    bools, or (``bits``: a compact batch) as packed bits."""
    cached = tensors[name]
    if bits and cached.dtype == torch.uint8:
        try:
            return compact.unpack_mask(cached, num_nodes)
        except ValueError as exc:
            raise BatchDecodeError(f"{where}: tensor {name!r}: {exc}") from None
    _check_tensor(cached, name, [num_nodes], [torch.bool], where)
    return cached


def build_data(
    header: pb.MinibatchHeader, tensors: dict[str, torch.Tensor], spec: BatchSpec, index: int = 0
) -> Data | HeteroData:
    """Check a batch's header and tensors against each other and ``spec``; build the Data
    (a HeteroData when ``spec.typed``: :func:`~trainer_client.hetero_decode.build_hetero_data`)."""
    if spec.typed is not None:
        from trainer_client.hetero_decode import build_hetero_data

        return build_hetero_data(header, tensors, spec, index)
    where = f"batch {index}"
    known = COMPACT_TENSORS if spec.compact_indices else BATCH_TENSORS
    unknown = sorted(set(tensors) - set(known))
    if unknown:
        raise BatchDecodeError(f"{where}: tensor names: expected among {list(known)}, got {unknown}")
    nodes, edges = _check_counts(header, spec, where)
    ids = compact.INDEX_DTYPES if spec.compact_indices else _INT64
    n_id = _require(tensors, "n_id", where, "every batch has it")
    _check_tensor(n_id, "n_id", [None], ids, where)
    n_id = compact.widen(n_id)
    num_nodes = n_id.numel()
    if sum(nodes) != num_nodes:
        raise BatchDecodeError(
            f"{where}: tensor 'n_id': expected sum(num_sampled_nodes) = {sum(nodes)} nodes, got {num_nodes}"
        )
    edge_index = _edge_index(tensors, spec, nodes, sum(edges), where)
    if spec.check_edges and edge_index.numel():
        # NumPy, single-threaded: torch's intra-op threads would wake for this one pass and
        # fight the trainer's own threads for the cores
        indices = edge_index.numpy()
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= num_nodes:
            raise BatchDecodeError(
                f"{where}: tensor 'edge_index': expected local indices in 0 .. {num_nodes - 1}, "
                f"got values in {low} .. {high}"
            )
    data = Data(edge_index=edge_index, n_id=n_id, num_nodes=num_nodes)
    if "orig_id" in tensors:  # users see original IDs; graphfeed's own stay on the side
        orig = tensors["orig_id"]
        _check_tensor(orig, "orig_id", [num_nodes], ids, where)
        data.internal_n_id, data.n_id = n_id, compact.widen(orig)
    if spec.include_features or "x" in tensors:
        x = _require(tensors, "x", where, "include_features is set")
        rows = num_nodes
        if "x_cached" in tensors:  # x holds only the rows the trainer's cache lacks
            cached = cached_mask(tensors, "x_cached", num_nodes, where, spec.compact_indices)
            rows = num_nodes - int(np.count_nonzero(cached.numpy()))
            data.x_cached = cached
        _check_tensor(x, "x", [rows, spec.feature_dim], FEATURE_DTYPES, where)
        data.x = x
    if spec.include_labels or "y" in tensors:
        y = _require(tensors, "y", where, "include_labels is set")
        _check_tensor(y, "y", [num_nodes], [torch.int64, torch.int32, torch.int16, torch.int8], where)
        data.y = compact.widen(y)
    data.batch_size = int(header.num_seed_nodes)
    data.num_sampled_nodes = nodes
    data.num_sampled_edges = edges
    return data


# ---- to the training device ------------------------------------------------------------


def pin_batch(data: Data | HeteroData) -> Data | HeteroData:
    """Copy a CPU batch's tensors into pinned memory (for ``non_blocking`` transfers);
    tensors already there (decoded into pinned buffers) are kept as they are."""
    if isinstance(data, HeteroData):
        return data.pin_memory()
    for key, value in list(data.items()):
        if isinstance(value, torch.Tensor):
            data[key] = value.pin_memory()
    return data


def to_device(
    data: Data,
    device: torch.device | str,
    *,
    feature_dtype: torch.dtype | None = torch.float32,
    non_blocking: bool = False,
) -> Data:
    """Move a batch to ``device`` and cast ``x`` to ``feature_dtype`` there (keep: None).

    Features are moved first and cast on the device, so half-precision features cross
    the bus at half size. ``non_blocking`` only helps for pinned tensors.
    """
    device = torch.device(device)
    for key, value in list(data.items()):
        if isinstance(value, torch.Tensor):
            data[key] = value.to(device, non_blocking=non_blocking)
    x = data.x if "x" in data else None
    if isinstance(x, torch.Tensor) and feature_dtype is not None and x.dtype != feature_dtype:
        data.x = halfcast.cast(x, feature_dtype)
    return data
