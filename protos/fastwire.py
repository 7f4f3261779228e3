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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError, Message

from protos import codec
from protos import sampling_pb2 as pb

#: Field number of ``tensors`` in each chunk message.
TENSORS_FIELD = {pb.MinibatchChunk: 5, pb.SampleNeighborsChunk: 3, pb.NodeDataChunk: 3}
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
    ctypes caches for good, so every new message size would leak a few KiB."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int | None, size: int) -> None:
        if not address:
            raise ValueError("join_released: expected the address of a new bytes object, got NULL")
        self.__array_interface__ = {"data": (address, False), "shape": (size,), "typestr": "|u1",
                                    "version": 3}


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
    out: bytes = _new_bytes(None, total)
    view = np.asarray(_Writable(ctypes.cast(ctypes.c_char_p(out), ctypes.c_void_p).value, total))
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
    :class:`WireMessage` (tensor data as views of the received bytes)."""

    def __init__(self, channel: Any) -> None:
        self.StreamMinibatches = channel.unary_stream(
            "/graphfeed.v1.SamplingService/StreamMinibatches",
            request_serializer=pb.EpochRequest.SerializeToString,
            response_deserializer=minibatch_chunk_deserializer,
        )
