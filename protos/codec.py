"""Encode and decode tensors for the graphfeed wire (``protos/sampling.proto``).

A tensor travels as raw little-endian, C-contiguous bytes plus a :class:`DType` and a
shape (see the ``Tensor`` message for the exact layout), never pickled. This module is
the only place that turns arrays into those messages and back:

* dtype mapping both ways for NumPy and PyTorch (:func:`numpy_to_dtype`,
  :func:`dtype_to_numpy`, :func:`torch_to_dtype`, :func:`dtype_to_torch`);
* one whole tensor per message: :func:`encode_tensor`, :func:`decode_tensor`,
  :func:`decode_tensor_torch`;
* tensors spread over several stream messages: :func:`split_tensors` (and
  :func:`count_groups`, :func:`iter_pieces`) on the sending side;
  :class:`protos.assembler.TensorAssembler` reassembles them on the receiving side.

Decoding does not copy: arrays are read-only views of the ``bytes`` object that
protobuf hands out for a ``bytes`` field (protobuf itself makes that object; this
module adds no copy), unless ``writable=True`` asks for an owned copy. A tensor spread
over several chunks is copied once, into one preallocated buffer.

NumPy has no bfloat16: BFLOAT16 decodes to a ``torch.bfloat16`` tensor, or to a
``uint16`` NumPy array of the raw bits when NumPy is asked for; such a ``uint16`` array
encodes back as BFLOAT16 with ``encode_tensor(bits, dtype=DType.BFLOAT16)``.

Malformed input raises :class:`CodecError` (a ``ValueError``) whose message names the
field, what was expected and what was received.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias, cast

import numpy as np
import torch

from protos import allocator
from protos import sampling_pb2 as pb

#: Hard ceiling on the serialized size of any one graphfeed message (64 MiB); channels
#: are configured with it as their send/receive limit.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Room left in every message for everything but tensor data (names, shapes, headers).
MESSAGE_HEADROOM_BYTES = 1024 * 1024
#: Largest allowed ``chunk_bytes``: the tensor data one message may carry.
MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - MESSAGE_HEADROOM_BYTES
#: Default tensor data per message of a chunked stream (4 MiB).
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
#: A batch's tensor of a node tensor's rows is named this, then the tensor's name
#: (``EpochRequest.node_tensors``).
ROWS_PREFIX = "rows:"

#: A NumPy array or a PyTorch tensor.
TensorLike: TypeAlias = np.ndarray | torch.Tensor
#: A value of the ``DType`` enum.
WireDType: TypeAlias = "pb.DType.ValueType"

DType = pb.DType

_LITTLE_ENDIAN_HOST = sys.byteorder == "little"


class CodecError(ValueError):
    """A tensor message is malformed, or an array cannot be put on the wire.

    The message names the field, what was expected and what was received.
    """


# ---- dtype mapping -------------------------------------------------------------------

#: Each wire dtype's little-endian NumPy dtype (BFLOAT16: its raw bits, as NumPy has no
#: bfloat16) and PyTorch dtype.
_DTYPES: dict[WireDType, tuple[np.dtype, torch.dtype]] = {
    pb.BOOL: (np.dtype(np.bool_), torch.bool),
    pb.UINT8: (np.dtype(np.uint8), torch.uint8),
    pb.INT8: (np.dtype(np.int8), torch.int8),
    pb.INT16: (np.dtype("<i2"), torch.int16),
    pb.INT32: (np.dtype("<i4"), torch.int32),
    pb.INT64: (np.dtype("<i8"), torch.int64),
    pb.FLOAT16: (np.dtype("<f2"), torch.float16),
    pb.BFLOAT16: (np.dtype("<u2"), torch.bfloat16),
    pb.FLOAT32: (np.dtype("<f4"), torch.float32),
    pb.FLOAT64: (np.dtype("<f8"), torch.float64),
}
_NUMPY_OF = {k: numpy for k, (numpy, _) in _DTYPES.items()}
_TORCH_OF = {k: torch_dtype for k, (_, torch_dtype) in _DTYPES.items()}
_DTYPE_OF_NUMPY: dict[np.dtype, WireDType] = {
    np.dtype(d).newbyteorder("="): k for k, d in _NUMPY_OF.items() if k != pb.BFLOAT16
}
_DTYPE_OF_TORCH: dict[torch.dtype, WireDType] = {d: k for k, d in _TORCH_OF.items()}

#: Every dtype that may travel in a Tensor or TensorChunk.
SUPPORTED_DTYPES: tuple[WireDType, ...] = tuple(_NUMPY_OF)


_NAME_OF: dict[int, str] = {value: name for name, value in pb.DType.items()}


def dtype_name(dtype: int) -> str:
    """Return the lower-case name of a ``DType`` value (``"float32"``), or the number."""
    return _NAME_OF.get(dtype, str(dtype)).lower()


def _check_dtype(dtype: int, field: str) -> WireDType:
    """Return ``dtype`` if it may travel in a tensor; raise :class:`CodecError` otherwise."""
    if dtype not in _NUMPY_OF:
        names = ", ".join(_NAME_OF[d] for d in SUPPORTED_DTYPES)
        got = _NAME_OF[dtype] if dtype == pb.DTYPE_UNSPECIFIED else str(dtype)
        raise CodecError(f"{field}: expected one of {names}, got {got}")
    return cast(WireDType, dtype)


def dtype_to_numpy(dtype: int) -> np.dtype:
    """Return the little-endian NumPy dtype of a wire dtype (BFLOAT16 gives ``<u2``)."""
    return _NUMPY_OF[_check_dtype(dtype, "dtype")]


def dtype_to_torch(dtype: int) -> torch.dtype:
    """Return the PyTorch dtype of a wire dtype."""
    return _TORCH_OF[_check_dtype(dtype, "dtype")]


def numpy_to_dtype(dtype: np.dtype | type) -> WireDType:
    """Return the wire dtype of a NumPy dtype, of either byte order.

    ``uint16`` is not mapped (it is BFLOAT16 only when the caller says so, see
    :func:`encode_tensor`); unsupported dtypes raise :class:`CodecError`.
    """
    key = np.dtype(dtype).newbyteorder("=")
    if key not in _DTYPE_OF_NUMPY:
        raise CodecError(
            f"dtype: expected a NumPy dtype among "
            f"{sorted(str(d) for d in _DTYPE_OF_NUMPY)}, got {np.dtype(dtype)}"
        )
    return _DTYPE_OF_NUMPY[key]


def torch_to_dtype(dtype: torch.dtype) -> WireDType:
    """Return the wire dtype of a PyTorch dtype; unsupported ones raise CodecError."""
    if dtype not in _DTYPE_OF_TORCH:
        raise CodecError(
            f"dtype: expected a torch dtype among {[str(d) for d in _DTYPE_OF_TORCH]}, got {dtype}"
        )
    return _DTYPE_OF_TORCH[dtype]


# ---- arrays to wire bytes ------------------------------------------------------------


def _torch_to_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, WireDType]:
    """View a tensor as a NumPy array (no copy for CPU tensors) and give its wire dtype."""
    wire = torch_to_dtype(tensor.dtype)
    # (each torch call releases the interpreter lock and waits to get it back: no detach
    # of a tensor that needs none)
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        words = allocator.words_of(t)
        return (words if words is not None else t.view(torch.int16).numpy().view(np.uint16)), wire
    return t.numpy(), wire


def _wire_array(value: TensorLike, dtype: int | None) -> tuple[np.ndarray, WireDType]:
    """Return a little-endian NumPy view/copy of ``value`` and its wire dtype.

    The result may still be non-contiguous; callers serialize it in C order.
    """
    if isinstance(value, torch.Tensor):
        array, wire = _torch_to_numpy(value)
    else:
        array = np.asarray(value)
        if dtype == pb.BFLOAT16 and array.dtype.newbyteorder("=") == np.dtype(np.uint16):
            wire = pb.BFLOAT16
        else:
            wire = numpy_to_dtype(array.dtype)
    if dtype is not None and dtype != wire:
        raise CodecError(
            f"dtype: expected the array's own dtype {dtype_name(wire)} (or uint16 bits for "
            f"bfloat16), got a request for {dtype_name(dtype)}"
        )
    if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and not _LITTLE_ENDIAN_HOST):
        array = array.astype(array.dtype.newbyteorder("<"))
    return array, wire


def _flat_bytes(array: np.ndarray) -> np.ndarray:
    """Return the C-order bytes of ``array`` as a 1-d uint8 array (copy only if needed)."""
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    return array.reshape(-1).view(np.uint8)


def encode_tensor(value: TensorLike, *, dtype: int | None = None) -> pb.Tensor:
    """Encode an array or tensor as a whole ``Tensor`` message.

    Non-contiguous and big-endian inputs are laid out C-contiguous little-endian; CPU
    torch tensors are read through ``.numpy()`` without a copy, other devices are moved
    to the CPU. ``dtype`` optionally states the wire dtype; it must match the input's,
    except that a ``uint16`` NumPy array with ``dtype=DType.BFLOAT16`` is sent as
    bfloat16 bits. The data must fit in :data:`MAX_CHUNK_BYTES`; bigger tensors go
    through :func:`split_tensors`.
    """
    array, wire = _wire_array(value, dtype)
    if array.nbytes > MAX_CHUNK_BYTES:
        raise CodecError(
            f"Tensor.data: expected at most {MAX_CHUNK_BYTES} bytes in one message, got "
            f"{array.nbytes} (use split_tensors)"
        )
    return pb.Tensor(dtype=wire, shape=array.shape, data=array.tobytes(order="C"))


# ---- wire bytes to arrays ------------------------------------------------------------


#: Most dimensions a tensor may have (NumPy's own limit).
MAX_DIMS = 64
#: Largest element count any shape may describe, counting the non-zero dimensions only,
#: so that a zero-size shape such as ``[0, 2**62]`` cannot overflow NumPy either.
MAX_ELEMENTS = 2**56


def _check_shape(shape: Sequence[int], field: str) -> tuple[int, ...]:
    """Return ``shape`` as a tuple if it has at most :data:`MAX_DIMS` dimensions, each
    >= 0, whose non-zero ones multiply to at most :data:`MAX_ELEMENTS`; raise otherwise."""
    if len(shape) > MAX_DIMS:
        raise CodecError(f"{field}: expected at most {MAX_DIMS} dimensions, got {len(shape)}")
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise CodecError(f"{field}: expected every dimension >= 0, got {list(dims)}")
    if math.prod(d for d in dims if d) > MAX_ELEMENTS:
        raise CodecError(f"{field}: expected at most {MAX_ELEMENTS} elements (not counting "
                         f"zero dimensions), got shape {list(dims)}")
    return dims


def _nbytes(dtype: WireDType, shape: tuple[int, ...]) -> int:
    """Return the byte size of a tensor of ``dtype`` and ``shape``."""
    return math.prod(shape) * _NUMPY_OF[dtype].itemsize


def _check_values(buffer: bytes | memoryview | np.ndarray, dtype: WireDType, field: str) -> None:
    """Raise if the bytes of a BOOL tensor hold anything but 0 and 1."""
    if dtype != pb.BOOL:
        return
    raw = np.frombuffer(buffer, dtype=np.uint8)
    if raw.size and int(raw.max()) > 1:
        raise CodecError(f"{field}: expected bool bytes 0 or 1, got {int(raw.max())}")


def _numpy_view(
    buffer: bytes | memoryview | np.ndarray, dtype: WireDType, shape: tuple[int, ...], writable: bool
) -> np.ndarray:
    """Interpret validated bytes as a NumPy array; copy only when ``writable``."""
    array = np.frombuffer(buffer, dtype=np.uint8).view(_NUMPY_OF[dtype]).reshape(shape)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    elif writable and not array.flags.writeable:
        array = array.copy()
    return array


def _torch_view(
    buffer: bytes | memoryview | np.ndarray, dtype: WireDType, shape: tuple[int, ...], writable: bool
) -> torch.Tensor:
    """Interpret validated bytes as a torch tensor; copy only when ``writable``.

    A read-only buffer gives a tensor sharing it unless ``writable``; a writable NumPy
    buffer is always shared.
    """
    if isinstance(buffer, bytes | memoryview) and len(buffer) and _LITTLE_ENDIAN_HOST:
        # the tensors made here are documented as read-only: PyTorch's warning would repeat it
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            tensor = torch.frombuffer(buffer, dtype=_TORCH_OF[dtype]).reshape(shape)
        return tensor.clone() if writable else tensor
    numpy_dtype = pb.INT16 if dtype == pb.BFLOAT16 else dtype
    array = _numpy_view(buffer, numpy_dtype, shape, writable=False)
    if writable or not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == pb.BFLOAT16 else tensor


def _checked_tensor(msg: pb.Tensor) -> tuple[bytes, WireDType, tuple[int, ...]]:
    """Validate a ``Tensor`` message; return its data (read once), dtype and shape."""
    dtype = _check_dtype(msg.dtype, "Tensor.dtype")
    shape = _check_shape(msg.shape, "Tensor.shape")
    data = msg.data  # protobuf makes a new bytes object on every read
    expected = _nbytes(dtype, shape)
    if len(data) != expected:
        raise CodecError(
            f"Tensor.data: expected {expected} bytes for {dtype_name(dtype)} of shape "
            f"{list(shape)}, got {len(data)}"
        )
    _check_values(data, dtype, "Tensor.data")
    return data, dtype, shape


def decode_tensor(msg: pb.Tensor, *, writable: bool = False) -> np.ndarray:
    """Decode a ``Tensor`` message to a NumPy array without copying.

    The array is a read-only view of the message's bytes unless ``writable`` is true
    (then it is an owned copy). BFLOAT16 decodes to the ``uint16`` bits.
    """
    data, dtype, shape = _checked_tensor(msg)
    return _numpy_view(data, dtype, shape, writable)


def decode_tensor_torch(msg: pb.Tensor, *, writable: bool = False) -> torch.Tensor:
    """Decode a ``Tensor`` message to a CPU torch tensor without copying.

    Without ``writable`` the tensor shares the message's immutable bytes: do not write
    to it. With ``writable`` it owns a copy.
    """
    data, dtype, shape = _checked_tensor(msg)
    return _torch_view(data, dtype, shape, writable)


# ---- chunking ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Slice:
    """Bytes ``[start, stop)`` of the tensor at position ``index`` of the mapping."""

    #: Position of the tensor in the mapping's iteration order.
    index: int
    #: First byte of the slice.
    start: int
    #: One past the last byte of the slice.
    stop: int


def _plan(sizes: Sequence[int], chunk_bytes: int) -> list[list[_Slice]]:
    """Group tensor byte ranges into messages carrying at most ``chunk_bytes`` each.

    A tensor that fits in one message is never split (it starts a new group if the
    current one lacks room); bigger tensors fill the current group and span the next
    ones. Empty tensors take one slice and no room. There is always at least one group.
    """
    if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise CodecError(f"chunk_bytes: expected 1 .. {MAX_CHUNK_BYTES}, got {chunk_bytes}")
    groups: list[list[_Slice]] = [[]]
    room = chunk_bytes
    for index, size in enumerate(sizes):
        if 0 < size <= chunk_bytes and size > room:
            groups.append([])
            room = chunk_bytes
        start = 0
        while True:
            if room == 0 and size > start:
                groups.append([])
                room = chunk_bytes
            stop = start + min(room, size - start)
            groups[-1].append(_Slice(index, start, stop))
            room -= stop - start
            start = stop
            if start >= size:
                break
    return groups


def _byte_size(value: TensorLike) -> int:
    """Return the number of data bytes ``value`` takes on the wire."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return int(np.asarray(value).nbytes)


def count_groups(named: Mapping[str, TensorLike], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Return how many groups :func:`split_tensors` yields, without building them.

    Use it to fill ``num_chunks`` of the first message before sending.
    """
    return len(_plan([_byte_size(v) for v in named.values()], chunk_bytes))


def split_tensors(
    named: Mapping[str, TensorLike], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[list[pb.TensorChunk]]:
    """Split named tensors into groups of ``TensorChunk``s, one group per message.

    Every group carries at most ``chunk_bytes`` (<= :data:`MAX_CHUNK_BYTES`) of data.
    Tensors go in mapping order; small tensors share a group, a tensor larger than
    ``chunk_bytes`` spans several groups, and an empty tensor travels as one chunk with
    its shape. At least one group (possibly empty) is yielded. All inputs are checked
    before the first group is yielded.
    """
    for group in iter_pieces(named, chunk_bytes):
        yield [pb.TensorChunk(name=c.name, dtype=c.dtype, shape=c.shape, offset=c.offset,
                              total_bytes=c.total_bytes, data=c.data.tobytes()) for c in group]


@dataclass(frozen=True)
class Piece:
    """One ``TensorChunk``'s worth of a tensor, its data still a view of the tensor."""

    name: str
    dtype: WireDType
    shape: tuple[int, ...]
    #: Byte offset of ``data`` in the whole tensor.
    offset: int
    #: Bytes of the whole tensor.
    total_bytes: int
    #: uint8 view of the bytes (no copy).
    data: np.ndarray


def row_piece(name: str, rows: TensorLike, start: int, total_rows: int) -> Piece:
    """Rows ``start .. start + len(rows)`` of a tensor of ``total_rows`` rows, as the
    piece at their byte offset (a view of ``rows`` when it is C-contiguous)."""
    if not name:
        raise CodecError("TensorChunk.name: expected a non-empty name, got ''")
    array, wire = _wire_array(rows, None)
    if array.ndim == 0:
        raise CodecError(f"{name}: expected rows (at least 1-d), got a scalar")
    row_bytes = array.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
    return Piece(name, wire, (total_rows, *array.shape[1:]), start * row_bytes,
                 total_rows * row_bytes, _flat_bytes(array))


def iter_pieces(
    named: Mapping[str, TensorLike], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[list[Piece]]:
    """The groups of :func:`split_tensors` as views (what :mod:`protos.fastwire` sends
    without building ``TensorChunk`` messages). All inputs are checked first."""
    names = list(named)
    for name in names:
        if not name:
            raise CodecError("TensorChunk.name: expected a non-empty name, got ''")
    arrays = [_wire_array(named[name], None) for name in names]
    flats = [_flat_bytes(array) for array, _ in arrays]
    for group in _plan([flat.size for flat in flats], chunk_bytes):
        yield [Piece(names[s.index], arrays[s.index][1], tuple(arrays[s.index][0].shape),
                     s.start, int(flats[s.index].size), flats[s.index][s.start:s.stop])
               for s in group]
