"""The hot chunk messages on the wire without protobuf's copies.

``MinibatchChunk``, ``SampleNeighborsChunk`` and ``NodeDataChunk`` carry nearly all of
graphfeed's bytes in their ``repeated TensorChunk tensors`` field. Built and parsed with
the protobuf runtime, a tensor's bytes are copied into a ``bytes`` field, again on
serialization, again on parsing, and again on every read of the field. Here the encoder
writes the protobuf wire format itself (the small fields through protobuf, each data
field appended as ``tag, length, raw bytes``), so a payload is copied once, into the
message, without holding the GIL (:func:`join_released`: gRPC's threads and the sampler's
go on meanwhile); and the parser keeps every ``TensorChunk.data`` as a ``memoryview`` of
the received message, so a tensor that arrives in one chunk is decoded without any copy.

The bytes are ordinary protobuf: a peer built on the generated stubs reads and writes
the same messages (the tests check both directions).
"""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from google.protobuf.message import DecodeError, Message

from protos import codec
from protos import sampling_pb2 as pb
from protos.epoch_call import EpochCall, stream_minibatches

#: Field number of ``tensors`` in each chunk message.
TENSORS_FIELD = {pb.MinibatchChunk: 5, pb.SampleNeighborsChunk: 3, pb.NodeDataChunk: 3, pb.EdgeDataChunk: 3}
_DATA_FIELD = 6  # TensorChunk.data
_LEN = 2  # wire type of length-delimited fields


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


#: Messages from this size up are joined by :func:`join_released`; smaller ones by
#: ``bytes.join`` (the GIL is held for less than a few microseconds either way).
RELEASED_JOIN_MIN_BYTES = 64 << 10

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


class _Writable:
    """``size`` bytes at ``address`` as NumPy sees them (``np.asarray`` makes a view).
    Not ``np.ctypeslib.as_array``: that makes a ctypes array type per length, which
    ctypes caches for good, so every new message size would leak a few KiB. ``owner``:
    the object whose memory it is, kept alive as long as any view of it."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, address: int | None, size: int, owner: object = None) -> None:
        if not address:
            raise ValueError("join_released: expected the address of a new bytes object, got NULL")
        self.__array_interface__ = {"data": (address, False), "shape": (size,), "typestr": "|u1",
                                    "version": 3}
        self.owner = owner


def _new_message(size: int) -> tuple[bytes, np.ndarray]:
    """A new, uninitialized ``bytes`` object of ``size`` (> 1: the interpreter shares the
    objects of 0 and 1 bytes) and a writable uint8 view of it that keeps it alive. Only
    for objects nothing else has seen yet: ``bytes`` are immutable once shared."""
    if size <= 1:
        raise ValueError(f"size: expected more than 1 byte, got {size}")
    out: bytes = _new_bytes(None, size)
    address = ctypes.cast(ctypes.c_char_p(out), ctypes.c_void_p).value
    return out, np.asarray(_Writable(address, size, out))


def join_released(parts: Sequence[bytes | np.ndarray]) -> bytes:
    """``b"".join(parts)`` (``bytes`` and uint8 arrays), copying with the GIL released.

    ``bytes.join`` holds the GIL for the whole copy unless every part is ``bytes``, so
    joining a tensor's views would stop every other thread of the process (gRPC's
    senders, the sampler's pipeline) for the copy of each message. Here the ``bytes``
    object is created uninitialized (``PyBytes_FromStringAndSize(NULL, n)``, the C API's
    way of building one in place) and filled by NumPy copies, which release the GIL;
    nothing else sees the object before it is returned."""
    for part in parts:
        if not isinstance(part, bytes) and (part.dtype != np.uint8 or part.ndim != 1):
            raise TypeError(f"parts: expected bytes or 1-d uint8 arrays, got an array of "
                            f"{part.dtype} with shape {list(part.shape)}")
    total = sum(len(part) for part in parts)
    if total < RELEASED_JOIN_MIN_BYTES:
        return b"".join(part if isinstance(part, bytes) else part.data for part in parts)
    out, view = _new_message(total)
    pos = 0
    for part in parts:
        size = len(part)
        if size:
            view[pos : pos + size] = np.frombuffer(part, dtype=np.uint8) \
                if isinstance(part, bytes) else part
        pos += size
    return out


def encode_chunks(
    make_head: Callable[[int, int], Message], named: Mapping[str, codec.TensorLike],
    chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
) -> list[bytes]:
    """Serialized chunk messages carrying ``named``: message ``i`` of ``n`` is
    ``make_head(i, n)`` (its fields other than ``tensors``) plus its group of
    :func:`codec.iter_pieces`."""
    groups = list(codec.iter_pieces(named, chunk_bytes))
    return [encode_message(make_head(i, len(groups)), group) for i, group in enumerate(groups)]


def encode_message(head: Message, pieces: Iterable[codec.Piece]) -> bytes:
    """One serialized chunk message: ``head`` (its fields other than ``tensors``) plus a
    ``TensorChunk`` per piece, each piece's bytes copied once, into the message."""
    tensors_tag = _tag(TENSORS_FIELD[type(head)], _LEN)
    parts: list[bytes | np.ndarray] = [head.SerializeToString()]
    for piece in pieces:
        meta = pb.TensorChunk(name=piece.name, dtype=piece.dtype, shape=piece.shape,
                              offset=piece.offset, total_bytes=piece.total_bytes)
        meta_bytes = meta.SerializeToString()
        data = piece.data  # uint8 view of the tensor's bytes
        data_head = _tag(_DATA_FIELD, _LEN) + _varint(len(data)) if len(data) else b""
        size = len(meta_bytes) + len(data_head) + len(data)
        parts += [tensors_tag, _varint(size), meta_bytes, data_head, data]
    return join_released(parts)  # the one copy of the payload


class RowMessages:
    """The rows of one tensor written straight into the chunk messages that carry them.

    The messages are allocated first, each with room for :attr:`rows_per_message` whole
    rows (the last for the rest) and with every byte but its head and its rows written;
    the producer writes the rows into :attr:`blocks` (views of the messages' payloads,
    e.g. a feature gather's output); :meth:`finish` then writes each message's head
    (which can depend on how many messages the batch has in all) and returns the
    messages. The rows are copied into nothing else on their way to gRPC: this is the
    copy that :func:`encode_message` makes of a tensor, made by the producer instead.

    The messages are the bytes :func:`encode_message` would make of the same pieces
    (``codec.row_piece`` of each block): one ``TensorChunk`` each, ordinary protobuf."""

    __slots__ = ("_count", "_heads", "_make_head", "_messages", "_tails", "_views", "blocks",
                 "nbytes", "rows_per_message")

    def __init__(self, make_head: Callable[[int, int], Message], name: str, dtype: torch.dtype,
                 num_rows: int, row_shape: Sequence[int],
                 chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES) -> None:
        """Messages for a tensor ``name`` of ``num_rows`` rows of ``row_shape`` in
        ``dtype`` (its wire dtype), at most ``chunk_bytes`` of rows each (:meth:`fits`
        says whether one row does); message ``i`` of ``n`` in the stream gets the head
        ``make_head(i, n)`` (its fields other than ``tensors``)."""
        if not name:
            raise codec.CodecError("TensorChunk.name: expected a non-empty name, got ''")
        wire = codec.torch_to_dtype(dtype)
        item = codec.dtype_to_numpy(wire)
        row_bytes = self.row_bytes(dtype, row_shape)
        if num_rows < 1 or not 0 < row_bytes <= chunk_bytes:
            raise ValueError(f"RowMessages: expected rows of 1 .. {chunk_bytes} bytes and at least "
                             f"one of them, got {num_rows} rows of {row_bytes} bytes")
        self._make_head = make_head
        self.rows_per_message = per = chunk_bytes // row_bytes
        self._count = count = -(-num_rows // per)
        shape = (num_rows, *row_shape)
        tensors_tag = _tag(TENSORS_FIELD[type(make_head(0, 1))], _LEN)
        #: (first row, row after the last, the rows' view in the message) per message.
        self.blocks: list[tuple[int, int, torch.Tensor]] = []
        self._messages: list[bytes] = []
        self._views: list[np.ndarray] = []
        self._tails: list[bytes] = []
        self._heads: list[int] = []
        #: Bytes of rows in each message.
        self.nbytes: list[int] = []
        for j, start in enumerate(range(0, num_rows, per)):
            stop = min(start + per, num_rows)
            size = (stop - start) * row_bytes
            meta = pb.TensorChunk(name=name, dtype=wire, shape=shape, offset=start * row_bytes,
                                  total_bytes=num_rows * row_bytes).SerializeToString()
            body = meta + _tag(_DATA_FIELD, _LEN) + _varint(size)
            tail = tensors_tag + _varint(len(body) + size) + body
            # room for the head it most likely gets, with one message of other tensors
            # before these (finish() rebuilds a message whose head turns out longer)
            head = len(make_head(1 + j, 1 + count).SerializeToString())
            message, view = _new_message(head + len(tail) + size)
            view[head : head + len(tail)] = np.frombuffer(tail, dtype=np.uint8)
            rows = view[head + len(tail):].view(item).reshape(stop - start, *row_shape)
            block = torch.from_numpy(rows)
            self.blocks.append((start, stop, block.view(dtype) if block.dtype != dtype else block))
            self._messages.append(message)
            self._views.append(view)
            self._tails.append(tail)
            self._heads.append(head)
            self.nbytes.append(size)

    @staticmethod
    def row_bytes(dtype: torch.dtype, row_shape: Sequence[int]) -> int:
        """Bytes of one row of ``row_shape`` in ``dtype``."""
        return dtype.itemsize * math.prod(row_shape)

    @staticmethod
    def fits(dtype: torch.dtype, row_shape: Sequence[int], chunk_bytes: int) -> bool:
        """Whether rows of ``row_shape`` in ``dtype`` can travel whole, at most
        ``chunk_bytes`` of them a message (on a little-endian host: the wire's order)."""
        return sys.byteorder == "little" and 0 < RowMessages.row_bytes(dtype, row_shape) <= chunk_bytes

    @staticmethod
    def worth_it(dtype: torch.dtype, row_shape: Sequence[int], num_rows: int, chunk_bytes: int) -> bool:
        """Whether ``num_rows`` rows :meth:`fits` and span more than one message (fewer go
        in one message with a batch's other tensors)."""
        return RowMessages.fits(dtype, row_shape, chunk_bytes) \
            and num_rows * RowMessages.row_bytes(dtype, row_shape) > chunk_bytes

    def __len__(self) -> int:
        return self._count

    def finish(self, first: int, total: int) -> list[bytes]:
        """The messages, numbered from ``first`` of ``total``, their heads written in (a
        head longer or shorter than the room left for it costs a copy of its message).
        Call once, when the rows are in."""
        if not self._messages:
            raise RuntimeError("RowMessages.finish: called twice")
        if first < 0 or total < first + len(self):
            raise ValueError(f"RowMessages.finish: expected 0 <= first and first + {len(self)} <= total, "
                             f"got first {first}, total {total}")
        out = []
        for k, (message, view, tail, room) in enumerate(zip(self._messages, self._views, self._tails,
                                                            self._heads, strict=True)):
            raw = self._make_head(first + k, total).SerializeToString()
            if len(raw) == room:
                view[:room] = np.frombuffer(raw, dtype=np.uint8)
                out.append(message)
            else:
                out.append(join_released([raw, tail, view[room + len(tail):]]))
        self._messages, self._views = [], []  # finished: the views must not write any more
        self.blocks = []
        return out


class WireTensorChunk:
    """A parsed ``TensorChunk`` whose ``data`` is a view of the received message."""

    __slots__ = ("data", "dtype", "name", "offset", "shape", "total_bytes")

    def __init__(self, meta: pb.TensorChunk, data: memoryview) -> None:
        self.name = meta.name
        self.dtype = meta.dtype
        self.shape = tuple(meta.shape)
        self.offset = meta.offset
        self.total_bytes = meta.total_bytes
        self.data = data


class WireMessage:
    """A parsed chunk message: ``tensors`` as :class:`WireTensorChunk`, every other field
    read from the protobuf message ``head`` (``msg.batch_index``, ``msg.HasField(...)``)."""

    def __init__(self, head: Message, tensors: list[WireTensorChunk], size: int) -> None:
        self.head = head
        self.tensors = tensors
        self._size = size

    def __getattr__(self, name: str) -> Any:
        return getattr(self.head, name)

    def ByteSize(self) -> int:
        """Size of the serialized message."""
        return self._size


def _read_varint(buf: memoryview, pos: int, what: str) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise codec.CodecError(f"{what}: truncated varint at byte {pos}")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise codec.CodecError(f"{what}: varint longer than 10 bytes at byte {pos}")


def _skip(buf: memoryview, pos: int, wire_type: int, what: str) -> int:
    """Position after a field's value of ``wire_type`` starting at ``pos``."""
    if wire_type == 0:
        return _read_varint(buf, pos, what)[1]
    if wire_type == 1:
        end = pos + 8
    elif wire_type == 5:
        end = pos + 4
    elif wire_type == _LEN:
        size, pos = _read_varint(buf, pos, what)
        end = pos + size
    else:
        raise codec.CodecError(f"{what}: unsupported wire type {wire_type} at byte {pos}")
    if end > len(buf):
        raise codec.CodecError(f"{what}: field runs past the end ({end} > {len(buf)} bytes)")
    return end


def _fields(buf: memoryview, what: str) -> list[tuple[int, int, int, int]]:
    """``(field, wire_type, start of the field's tag, end of its value)`` of each field."""
    out, pos = [], 0
    while pos < len(buf):
        start = pos
        key, pos = _read_varint(buf, pos, what)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise codec.CodecError(f"{what}: field number 0 at byte {start}")
        pos = _skip(buf, pos, wire_type, what)
        out.append((field, wire_type, start, pos))
    return out


def _tensor_chunk(buf: memoryview) -> WireTensorChunk:
    """Parse one ``TensorChunk``: metadata through protobuf, ``data`` as a view."""
    meta = bytearray()
    data = memoryview(b"")
    for field, wire_type, start, end in _fields(buf, "TensorChunk"):
        if field == _DATA_FIELD and wire_type == _LEN:
            data = buf[_read_varint(buf, start + 1, "TensorChunk.data")[1]:end]
        else:
            meta += buf[start:end]
    try:
        return WireTensorChunk(pb.TensorChunk.FromString(bytes(meta)), data)
    except DecodeError as exc:
        raise codec.CodecError(f"TensorChunk: malformed fields ({exc})") from exc


def parse_chunk(cls: type[Message], raw: bytes) -> WireMessage:
    """Parse a serialized chunk message of type ``cls`` keeping tensor data as views."""
    buf = memoryview(raw)
    what = cls.DESCRIPTOR.name
    tensors_field = TENSORS_FIELD[cls]
    head = bytearray()
    tensors = []
    for field, wire_type, start, end in _fields(buf, what):
        if field == tensors_field and wire_type == _LEN:
            body = _read_varint(buf, start + 1, f"{what}.tensors")[1]
            tensors.append(_tensor_chunk(buf[body:end]))
        else:
            head += buf[start:end]
    try:
        return WireMessage(cls.FromString(bytes(head)), tensors, len(raw))
    except DecodeError as exc:
        raise codec.CodecError(f"{what}: malformed fields ({exc})") from exc


def minibatch_chunk_deserializer(raw: bytes) -> WireMessage:
    """gRPC response deserializer of ``StreamMinibatches``."""
    return parse_chunk(pb.MinibatchChunk, raw)


def passthrough(message: bytes | Message) -> bytes:
    """gRPC response serializer for messages already serialized by :func:`encode_chunks`."""
    return message if isinstance(message, bytes) else message.SerializeToString()


class MinibatchStreamStub:
    """``SamplingService.StreamMinibatches`` whose messages arrive as
    :class:`WireMessage` (tensor data as views of the received bytes), as an
    :class:`~protos.epoch_call.EpochCall` that the caller acknowledges batches on
    (``acknowledge``: see :func:`~protos.epoch_call.stream_minibatches`)."""

    def __init__(self, channel: Any) -> None:
        self._channel = channel

    def StreamMinibatches(self, request: pb.EpochRequest, *, timeout: float,
                          acknowledge: Callable[[Any], bool] | None = None) -> EpochCall:
        return stream_minibatches(self._channel, request, timeout=timeout,
                                  parse=minibatch_chunk_deserializer, acknowledge=acknowledge)
