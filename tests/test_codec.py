"""Tests for protos/codec.py: dtype mapping, whole tensors, chunking and reassembly."""

from __future__ import annotations

import re
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from protos import assembler as assembler_module
from protos import codec
from protos import sampling_pb2 as pb
from protos.assembler import TensorAssembler
from protos.codec import CodecError, decode_tensor, encode_tensor

NUMPY_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
]
TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


def _numpy_sample(dtype: type, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """A random array of ``dtype`` and ``shape`` using the dtype's range."""
    rng = np.random.default_rng(seed)
    if dtype is np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


def _torch_sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A random tensor of ``dtype`` and ``shape``."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, generator=generator, dtype=dtype)
    return torch.randn(shape, generator=generator).to(dtype)


def _wire(msg: pb.Tensor) -> pb.Tensor:
    """Serialize and parse ``msg``, as gRPC does."""
    return pb.Tensor.FromString(msg.SerializeToString())


def _assemble(groups: list[list[pb.TensorChunk]], **options: bool) -> TensorAssembler:
    """Feed groups, each serialized and parsed as one stream message, to an assembler
    made with ``options``."""
    assembler = TensorAssembler(**options)
    for index, group in enumerate(groups):
        message = pb.MinibatchChunk(chunk_index=index, num_chunks=len(groups), tensors=group)
        parsed = pb.MinibatchChunk.FromString(message.SerializeToString())
        assembler.add_all(parsed.tensors)
    return assembler


def _owner(array: np.ndarray) -> object:
    """The object at the end of ``array``'s chain of bases (what owns its memory)."""
    base: object = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base


def _chunk(**fields: object) -> pb.TensorChunk:
    """A TensorChunk of a float32 [4] tensor named "x", with ``fields`` overriding."""
    base: dict[str, object] = {
        "name": "x",
        "dtype": pb.FLOAT32,
        "shape": [4],
        "offset": 0,
        "total_bytes": 16,
        "data": bytes(16),
    }
    base.update(fields)
    return pb.TensorChunk(**base)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------
# dtype mapping
# --------------------------------------------------------------------------------------


def test_dtype_mapping_is_a_bijection_over_supported_dtypes() -> None:
    for wire in codec.SUPPORTED_DTYPES:
        assert codec.torch_to_dtype(codec.dtype_to_torch(wire)) == wire
        if wire != pb.BFLOAT16:
            assert codec.numpy_to_dtype(codec.dtype_to_numpy(wire)) == wire
    assert codec.dtype_to_numpy(pb.BFLOAT16) == np.dtype("<u2")
    assert codec.numpy_to_dtype(np.dtype(">f4")) == pb.FLOAT32
    assert len(codec.SUPPORTED_DTYPES) == len(pb.DType.keys()) - 1


@pytest.mark.parametrize(
    "bad", [np.complex64, np.uint16, np.uint32, np.uint64, np.object_, np.str_]
)
def test_unsupported_numpy_dtype_is_rejected(bad: type) -> None:
    with pytest.raises(CodecError, match=r"^dtype: expected a NumPy dtype"):
        codec.numpy_to_dtype(bad)
    with pytest.raises(CodecError, match=r"^dtype:"):
        encode_tensor(np.zeros(2, dtype=bad))


def test_unsupported_torch_dtype_is_rejected() -> None:
    with pytest.raises(CodecError, match=r"^dtype: expected a torch dtype.*complex64"):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))


def test_dtype_override_must_match() -> None:
    with pytest.raises(CodecError, match=r"^dtype: expected the array's own dtype float32"):
        encode_tensor(np.zeros(2, np.float32), dtype=pb.FLOAT16)


# --------------------------------------------------------------------------------------
# whole tensors
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (), (0,), (4, 0, 2)])
def test_numpy_round_trip(dtype: type, shape: tuple[int, ...]) -> None:
    array = _numpy_sample(dtype, shape)
    msg = _wire(encode_tensor(array))
    assert msg.dtype == codec.numpy_to_dtype(np.dtype(dtype))
    assert tuple(msg.shape) == shape
    assert len(msg.data) == array.nbytes
    decoded = decode_tensor(msg)
    assert decoded.dtype == np.dtype(dtype)
    assert decoded.shape == shape
    np.testing.assert_array_equal(decoded, array)
    back = codec.decode_tensor_torch(msg)
    assert back.dtype == codec.dtype_to_torch(msg.dtype)
    np.testing.assert_array_equal(back.numpy(), array)


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("shape", [(7,), (3, 5), (), (0,), (0, 3)])
def test_torch_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = _torch_sample(dtype, shape)
    msg = _wire(encode_tensor(tensor))
    assert msg.dtype == codec.torch_to_dtype(dtype)
    assert tuple(msg.shape) == shape
    decoded = codec.decode_tensor_torch(msg)
    assert decoded.dtype == dtype
    assert decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)
    writable = codec.decode_tensor_torch(msg, writable=True)
    assert torch.equal(writable, tensor)


def test_byte_layout_is_little_endian_row_major() -> None:
    array = np.arange(6, dtype=">i4").reshape(2, 3)
    msg = encode_tensor(array)
    assert msg.data == np.arange(6, dtype="<i4").tobytes()
    assert decode_tensor(msg).dtype.isnative
    transposed = encode_tensor(np.arange(6, dtype=np.int16).reshape(2, 3).T)
    assert list(transposed.shape) == [3, 2]
    assert transposed.data == np.array([[0, 3], [1, 4], [2, 5]], "<i2").tobytes()


def test_bfloat16_is_the_high_half_of_float32() -> None:
    values = torch.tensor([1.0, -2.5, 3.140625, 0.0], dtype=torch.float32)
    msg = encode_tensor(values.to(torch.bfloat16))
    assert msg.dtype == pb.BFLOAT16
    high = (values.numpy().view("<u4") >> 16).astype("<u2")
    assert msg.data == high.tobytes()
    bits = decode_tensor(msg)
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, high)
    from_bits = encode_tensor(bits, dtype=pb.BFLOAT16)
    assert from_bits == msg
    assert torch.equal(codec.decode_tensor_torch(from_bits), values.to(torch.bfloat16))


def test_non_contiguous_inputs() -> None:
    base = np.arange(60, dtype=np.float32).reshape(6, 10)
    for view in (base.T, base[::2, 1::3], base[:, 5]):
        assert not view.flags.c_contiguous
        np.testing.assert_array_equal(decode_tensor(encode_tensor(view)), view)
    tensor = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for t in (tensor.T, tensor[:, ::2], tensor.to(torch.bfloat16).T, tensor.expand(2, 4, 6)):
        assert torch.equal(codec.decode_tensor_torch(encode_tensor(t)), t)


def test_torch_input_with_grad_is_encoded() -> None:
    tensor = torch.ones(3, requires_grad=True)
    assert torch.equal(codec.decode_tensor_torch(encode_tensor(tensor)), torch.ones(3))


def test_decode_is_zero_copy_and_read_only() -> None:
    data = np.arange(10, dtype="<f8").tobytes()
    msg = SimpleNamespace(dtype=pb.FLOAT64, shape=[2, 5], data=data)
    array = decode_tensor(msg)  # type: ignore[arg-type]
    assert not array.flags.owndata and not array.flags.writeable
    assert _owner(array) is data
    assert np.shares_memory(array, np.frombuffer(data, np.uint8))
    tensor = codec.decode_tensor_torch(msg)  # type: ignore[arg-type]
    assert tensor.data_ptr() == np.frombuffer(data, np.uint8).ctypes.data
    copy = decode_tensor(msg, writable=True)  # type: ignore[arg-type]
    assert copy.flags.writeable and not np.shares_memory(copy, np.frombuffer(data, np.uint8))
    owned = codec.decode_tensor_torch(msg, writable=True)  # type: ignore[arg-type]
    assert owned.data_ptr() != tensor.data_ptr()
    np.testing.assert_array_equal(owned.numpy(), array)


def test_decode_torch_does_not_warn() -> None:
    msg = encode_tensor(np.arange(3, dtype=np.int64))
    with warnings.catch_warnings(record=True) as caught:
        codec.decode_tensor_torch(msg)
    assert not [w for w in caught if "not writable" in str(w.message)]


# --------------------------------------------------------------------------------------
# malformed whole tensors
# --------------------------------------------------------------------------------------


def test_wrong_data_length_names_field_expected_and_got() -> None:
    msg = pb.Tensor(dtype=pb.FLOAT32, shape=[1000], data=bytes(3999))
    expected = "Tensor.data: expected 4000 bytes for float32 of shape [1000], got 3999"
    with pytest.raises(CodecError, match=re.escape(expected)):
        decode_tensor(msg)
    with pytest.raises(CodecError, match=re.escape(expected)):
        codec.decode_tensor_torch(msg)


@pytest.mark.parametrize(
    ("dtype", "got"), [(42, "42"), (pb.DTYPE_UNSPECIFIED, "DTYPE_UNSPECIFIED")]
)
def test_unknown_dtype(dtype: int, got: str) -> None:
    msg = pb.Tensor(dtype=dtype, shape=[1], data=bytes(4))  # type: ignore[arg-type]
    with pytest.raises(CodecError, match=rf"^Tensor\.dtype: expected one of BOOL, .*got {got}$"):
        decode_tensor(msg)


def test_negative_shape() -> None:
    msg = pb.Tensor(dtype=pb.INT64, shape=[3, -1], data=b"")
    with pytest.raises(
        CodecError, match=re.escape("Tensor.shape: expected every dimension >= 0, got [3, -1]")
    ):
        decode_tensor(msg)


def test_invalid_bool_bytes() -> None:
    msg = pb.Tensor(dtype=pb.BOOL, shape=[3], data=b"\x00\x01\x07")
    with pytest.raises(CodecError, match=r"^Tensor\.data: expected bool bytes 0 or 1, got 7"):
        decode_tensor(msg)
    with pytest.raises(CodecError, match=r"^Tensor\.data:"):
        codec.decode_tensor_torch(msg)


def test_too_big_for_one_message() -> None:
    big = np.broadcast_to(np.zeros(1, np.uint8), (codec.MAX_CHUNK_BYTES + 1,))
    with pytest.raises(CodecError, match=r"^Tensor\.data: expected at most .*split_tensors"):
        encode_tensor(big)


# --------------------------------------------------------------------------------------
# chunking and reassembly
# --------------------------------------------------------------------------------------


def _mixed_batch() -> dict[str, codec.TensorLike]:
    """A batch with a big tensor, small ones, a 0-d one, an empty one and bfloat16."""
    return {
        "n_id": np.arange(1000, dtype=np.int64),  # 8000 bytes
        "edge_index": np.arange(2 * 3000, dtype=np.int64).reshape(2, 3000),  # 48000
        "x": _numpy_sample(np.float32, (1000, 7), seed=1).T,  # 28000, non-contiguous
        "y": np.arange(10, dtype=np.int64),
        "scalar": np.array(2.5),
        "empty": np.zeros((0, 7), dtype=np.float16),
        "x16": _torch_sample(torch.bfloat16, (50, 7), seed=2),
        "mask": np.array([True, False, True]),
    }


def _assert_same(decoded: dict[str, np.ndarray], batch: dict[str, codec.TensorLike]) -> None:
    assert list(decoded) == list(batch)
    for name, value in batch.items():
        if isinstance(value, torch.Tensor):
            expected = value.view(torch.int16).numpy().view(np.uint16)
        else:
            expected = np.asarray(value)
        assert decoded[name].shape == expected.shape, name
        np.testing.assert_array_equal(decoded[name], expected, err_msg=name)


@pytest.mark.parametrize("chunk_bytes", [97, 1000, 4096, 8000, 100_000])
def test_split_and_assemble_round_trip(chunk_bytes: int) -> None:
    batch = _mixed_batch()
    groups = list(codec.split_tensors(batch, chunk_bytes))
    assert len(groups) == codec.count_groups(batch, chunk_bytes)
    for group in groups:
        assert sum(len(c.data) for c in group) <= chunk_bytes
    _assert_same(_assemble(groups).finish(), batch)
    decoded = _assemble(groups).finish_torch()
    assert decoded["x16"].dtype == torch.bfloat16
    assert torch.equal(decoded["x16"], batch["x16"])  # type: ignore[arg-type]
    assert torch.equal(decoded["x"], torch.from_numpy(np.asarray(batch["x"])))


def test_big_tensor_spans_groups_small_ones_share() -> None:
    big = np.arange(10_000, dtype=np.float32)  # 40000 bytes, ~10 chunks of 4096
    batch: dict[str, codec.TensorLike] = {
        "a": np.arange(3, dtype=np.int64),
        "big": big,
        "b": np.ones(5, np.int32),
    }
    groups = list(codec.split_tensors(batch, 4096))
    assert len(groups) == 10
    spans = [c.name for g in groups for c in g]
    assert spans.count("big") == 10 and spans.count("a") == 1 and spans.count("b") == 1
    assert [c.name for c in groups[0]] == ["a", "big"]
    offsets = [c.offset for g in groups for c in g if c.name == "big"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert all(c.total_bytes == big.nbytes for g in groups for c in g if c.name == "big")
    result = _assemble(groups).finish()
    np.testing.assert_array_equal(result["big"], big)


def test_tensor_that_fits_is_not_split() -> None:
    batch = {"a": np.zeros(3000, np.uint8), "b": np.zeros(2000, np.uint8)}
    groups = list(codec.split_tensors(batch, 4096))
    assert [[(c.name, c.offset, len(c.data)) for c in g] for g in groups] == [
        [("a", 0, 3000)],
        [("b", 0, 2000)],
    ]


def test_single_chunk_tensors_are_zero_copy_and_multi_chunk_copied_once() -> None:
    groups = list(codec.split_tensors({"small": np.arange(4), "big": np.arange(5000)}, 4096))
    result = _assemble(groups).finish()
    assert isinstance(_owner(result["small"]), bytes)  # a view of the chunk's bytes
    assert not result["small"].flags.writeable
    assert isinstance(_owner(result["big"]), np.ndarray)  # the preallocated buffer
    assert not result["big"].flags.writeable
    writable = _assemble(groups).finish(writable=True)
    assert all(a.flags.writeable for a in writable.values())
    tensors = _assemble(groups).finish_torch(writable=True)
    tensors["small"] += 1
    tensors["big"] += 1
    np.testing.assert_array_equal(tensors["big"].numpy(), np.arange(5000) + 1)


def test_empty_and_scalar_tensors_travel_as_one_chunk() -> None:
    batch: dict[str, codec.TensorLike] = {
        "empty": np.zeros((0, 3), np.float32),
        "none": torch.zeros(0),
        "s": np.array(7, np.int64),
    }
    groups = list(codec.split_tensors(batch, 4096))
    chunks = [c for g in groups for c in g]
    assert [(c.name, list(c.shape), c.total_bytes, len(c.data)) for c in chunks] == [
        ("empty", [0, 3], 0, 0),
        ("none", [0], 0, 0),
        ("s", [], 8, 8),
    ]
    result = _assemble(groups).finish_torch()
    assert result["empty"].shape == (0, 3) and result["none"].shape == (0,)
    assert result["s"].shape == () and int(result["s"]) == 7


def test_no_tensors_gives_one_empty_group() -> None:
    assert list(codec.split_tensors({}, 4096)) == [[]]
    assert codec.count_groups({}) == 1
    assert TensorAssembler().finish() == {}


def test_default_chunk_size_and_message_limit() -> None:
    big = np.zeros(codec.DEFAULT_CHUNK_BYTES * 2 + 10, np.uint8)
    groups = list(codec.split_tensors({"big": big, "x": np.ones(4, np.float32)}))
    assert len(groups) == 3
    for index, group in enumerate(groups):
        message = pb.MinibatchChunk(batch_index=0, chunk_index=index, num_chunks=3, tensors=group)
        assert message.ByteSize() <= codec.MAX_MESSAGE_BYTES
        assert sum(len(c.data) for c in group) <= codec.DEFAULT_CHUNK_BYTES
    np.testing.assert_array_equal(_assemble(groups).finish()["big"], big)


@pytest.mark.parametrize("chunk_bytes", [0, -1, codec.MAX_CHUNK_BYTES + 1])
def test_bad_chunk_bytes(chunk_bytes: int) -> None:
    with pytest.raises(CodecError, match=r"^chunk_bytes: expected 1 \.\. \d+, got"):
        list(codec.split_tensors({"x": np.zeros(1)}, chunk_bytes))


def test_split_rejects_bad_names_and_dtypes_before_yielding() -> None:
    with pytest.raises(CodecError, match=r"^TensorChunk\.name: expected a non-empty name"):
        next(codec.split_tensors({"": np.zeros(1)}))
    with pytest.raises(CodecError, match=r"^dtype:"):
        next(codec.split_tensors({"a": np.zeros(1), "b": np.zeros(1, np.complex64)}))


def test_assembler_is_reset_by_finish() -> None:
    assembler = TensorAssembler()
    assembler.add(_chunk())
    assert assembler.names == ["x"]
    assert list(assembler.finish()) == ["x"]
    assert assembler.names == [] and assembler.finish() == {}


# --------------------------------------------------------------------------------------
# malformed chunks
# --------------------------------------------------------------------------------------


def _two_halves() -> tuple[pb.TensorChunk, pb.TensorChunk]:
    data = np.arange(4, dtype="<f4").tobytes()
    return _chunk(data=data[:8]), _chunk(offset=8, data=data[8:])


def test_chunk_gap() -> None:
    first, _ = _two_halves()
    assembler = TensorAssembler()
    assembler.add(first)
    with pytest.raises(
        CodecError, match=r"^TensorChunk\.offset of 'x': expected 8 .*got 12 \(gap\)"
    ):
        assembler.add(_chunk(offset=12, data=bytes(4)))


def test_chunk_overlap() -> None:
    first, _ = _two_halves()
    assembler = TensorAssembler()
    assembler.add(first)
    with pytest.raises(
        CodecError, match=r"^TensorChunk\.offset of 'x': expected 8 .*got 4 \(overlap\)"
    ):
        assembler.add(_chunk(offset=4, data=bytes(8)))


def test_first_chunk_must_start_at_zero() -> None:
    with pytest.raises(
        CodecError, match=r"^TensorChunk\.offset of 'x': expected 0 .*got 8 \(gap\)"
    ):
        TensorAssembler().add(_chunk(offset=8, data=bytes(8)))


def test_missing_chunks() -> None:
    first, _ = _two_halves()
    assembler = TensorAssembler()
    assembler.add(first)
    with pytest.raises(
        CodecError,
        match=r"^TensorChunk\.data of 'x': expected 16 bytes in all, got 8 \(missing chunks\)",
    ):
        assembler.finish()


def test_missing_expected_tensor() -> None:
    assembler = TensorAssembler()
    assembler.add(_chunk())
    with pytest.raises(
        CodecError, match=r"^TensorChunk\.name: expected tensors \['x', 'y'\].*missing \['y'\]"
    ):
        assembler.finish_torch(expected=("x", "y"))


def test_chunk_after_complete() -> None:
    assembler = TensorAssembler()
    assembler.add(_chunk())
    with pytest.raises(CodecError, match=r"^TensorChunk\.offset of 'x': expected no more chunks"):
        assembler.add(_chunk(offset=16, data=b"\x00"))


def test_data_past_total() -> None:
    first, _ = _two_halves()
    assembler = TensorAssembler()
    assembler.add(first)
    with pytest.raises(
        CodecError, match=r"^TensorChunk\.data of 'x': expected at most 8 bytes at offset 8.*got 12"
    ):
        assembler.add(_chunk(offset=8, data=bytes(12)))


def test_empty_data_for_non_empty_tensor() -> None:
    with pytest.raises(CodecError, match=r"^TensorChunk\.data of 'x': expected at least 1 byte"):
        TensorAssembler().add(_chunk(data=b""))


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"dtype": pb.FLOAT64}, r"^TensorChunk\.dtype of 'x': expected float32 .*got float64"),
        ({"shape": [2, 2]}, r"^TensorChunk\.shape of 'x': expected \[4\] .*got \[2, 2\]"),
        ({"total_bytes": 20}, r"^TensorChunk\.total_bytes of 'x': expected 16 .*got 20"),
    ],
)
def test_later_chunk_must_match_first(fields: dict[str, object], pattern: str) -> None:
    first, second = _two_halves()
    assembler = TensorAssembler()
    assembler.add(first)
    bad = pb.TensorChunk()
    bad.CopyFrom(second)
    for key, value in fields.items():
        if key == "shape":
            del bad.shape[:]
            bad.shape.extend(value)  # type: ignore[arg-type]
        else:
            setattr(bad, key, value)
    with pytest.raises(CodecError, match=pattern):
        assembler.add(bad)


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"name": ""}, r"^TensorChunk\.name: expected a non-empty name, got ''"),
        ({"dtype": 99}, r"^TensorChunk\.dtype of 'x': expected one of BOOL.*got 99"),
        ({"dtype": pb.DTYPE_UNSPECIFIED}, r"^TensorChunk\.dtype of 'x': .*got DTYPE_UNSPECIFIED"),
        ({"shape": [-4]}, r"^TensorChunk\.shape of 'x': expected every dimension >= 0, got \[-4\]"),
        (
            {"total_bytes": 15},
            r"^TensorChunk\.total_bytes of 'x': expected 16 for float32 of shape \[4\], got 15",
        ),
    ],
)
def test_malformed_first_chunk(fields: dict[str, object], pattern: str) -> None:
    with pytest.raises(CodecError, match=pattern):
        TensorAssembler().add(_chunk(**fields))


def test_invalid_bool_bytes_in_chunks() -> None:
    chunk = _chunk(dtype=pb.BOOL, shape=[2], total_bytes=2, data=b"\x01\x02")
    assembler = TensorAssembler()
    assembler.add(chunk)
    with pytest.raises(
        CodecError, match=r"^TensorChunk\.data of 'x': expected bool bytes 0 or 1, got 2"
    ):
        assembler.finish()


def test_max_tensor_bytes() -> None:
    assembler = TensorAssembler(max_tensor_bytes=8)
    with pytest.raises(
        CodecError, match=r"^TensorChunk\.total_bytes of 'x': expected at most 8, got 16"
    ):
        assembler.add(_chunk())


def test_codec_error_is_a_value_error() -> None:
    assert issubclass(CodecError, ValueError)


@pytest.mark.parametrize(("shape", "message"), [
    ([0] * 65, "expected at most 64 dimensions, got 65"),
    ([0, 2**62], "expected at most 72057594037927936 elements"),
    ([0, 2**40, 2**40], "expected at most 72057594037927936 elements"),
])
def test_shapes_numpy_cannot_hold_are_codec_errors(shape: list[int], message: str) -> None:
    with pytest.raises(CodecError, match=re.escape(f"Tensor.shape: {message}")):
        decode_tensor(pb.Tensor(dtype=pb.INT64, shape=shape))
    with pytest.raises(CodecError, match=re.escape(message)):
        TensorAssembler().add(pb.TensorChunk(name="x", dtype=pb.INT64, shape=shape))


def test_the_largest_zero_size_shape_still_decodes() -> None:
    assert decode_tensor(pb.Tensor(dtype=pb.INT64, shape=[0, 2**56])).shape == (0, 2**56)


# -- background copies (the decode threads) -----------------------------------------------
def _spread(chunk_bytes: int = 1 << 20) -> tuple[dict[str, torch.Tensor], list[list[pb.TensorChunk]]]:
    """Tensors several MiB long, split into messages of ``chunk_bytes``, plus small ones."""
    generator = torch.Generator().manual_seed(5)
    named = {"x": torch.randn(3000, 700, generator=generator),
             "ids": torch.arange(100_000, dtype=torch.int64), "y": torch.arange(7, dtype=torch.int32)}
    return named, list(codec.split_tensors(named, chunk_bytes))


@pytest.mark.parametrize("background", [False, True])
def test_background_copies_give_the_same_tensors(background: bool) -> None:
    named, groups = _spread()
    assert len(groups) > 4
    for _ in range(3):  # the assembler is reused batch after batch
        out = _assemble(groups, background_copies=background).finish_torch()
        assert set(out) == set(named)
        for name, value in named.items():
            assert torch.equal(out[name], value), name


def test_finish_and_reset_wait_for_every_background_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    import time
    from concurrent.futures import ThreadPoolExecutor

    slow = ThreadPoolExecutor(1)
    started: list[float] = []

    def late_copy(dest: np.ndarray, src: np.ndarray) -> None:
        started.append(time.monotonic())
        time.sleep(0.05)
        np.copyto(dest, src)

    class Slow:
        @staticmethod
        def submit(fn: object, dest: np.ndarray, src: np.ndarray) -> object:
            return slow.submit(late_copy, dest, src)

    monkeypatch.setattr(assembler_module, "_decode_threads", lambda: Slow)
    named, groups = _spread()
    out = _assemble(groups, background_copies=True).finish_torch()  # only once the slow copies are done
    assert len(started) > 4 and torch.equal(out["x"], named["x"])

    started.clear()
    buffer_user = _assemble(groups[:3], background_copies=True)
    pending = list(buffer_user._copies)
    assert pending and not all(f.done() for f in pending)
    buffer_user.reset()  # a broken stream: nothing may still write the dropped buffers
    assert all(f.done() for f in pending)
    slow.shutdown()


def test_a_failed_background_copy_is_a_codec_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from concurrent.futures import Future

    class Failing:
        @staticmethod
        def submit(fn: object, dest: np.ndarray, src: np.ndarray) -> Future[None]:
            future: Future[None] = Future()
            future.set_exception(MemoryError("no room"))
            return future

    monkeypatch.setattr(assembler_module, "_decode_threads", lambda: Failing)
    _, groups = _spread()
    assembler = _assemble(groups, background_copies=True)
    with pytest.raises(CodecError, match="copying a received piece failed: MemoryError: no room"):
        assembler.finish_torch()
    assert assembler.names == []  # dropped: the next batch starts clean


def test_a_forked_child_starts_its_own_decode_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # what os.register_at_fork runs in a child: the parent's threads are not there
    parents = assembler_module._decode_threads()
    assert assembler_module._decode_threads() is parents
    monkeypatch.setattr(assembler_module, "_copier", parents)  # given back as it was after the test
    assembler_module._forget_decode_threads()
    childs = assembler_module._decode_threads()
    assert childs is not parents
    named, groups = _spread()
    assert torch.equal(_assemble(groups, background_copies=True).finish_torch()["x"], named["x"])
    childs.shutdown()


def test_pinned_assembly_returns_views_of_its_own_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    # without a GPU there is no page-locked memory: stand in plain tensors, recording them
    made: list[torch.Tensor] = []
    real_empty = torch.empty

    def empty(*args: object, pin_memory: bool = False, **kwargs: object) -> torch.Tensor:
        t = real_empty(*args, **kwargs)  # type: ignore[call-overload]
        if pin_memory:
            made.append(t)
        return t

    monkeypatch.setattr(codec.torch, "empty", empty)
    named = {"x": torch.randn(3000, 700).to(torch.bfloat16), "mask": torch.rand(2_000_000) < 0.5,
             "ids": torch.arange(700_000, dtype=torch.int64), "y": torch.arange(7, dtype=torch.int32)}
    out = _assemble(list(codec.split_tensors(named, 1 << 20)), background_copies=True,
                    pinned=True).finish_torch()
    assert len(made) == 3  # x, mask and ids span several messages; y arrives whole
    for name, value in named.items():
        assert out[name].dtype == value.dtype and torch.equal(out[name], value), name
    for name in ("x", "mask", "ids"):  # the returned tensors are the pinned buffers themselves
        assert any(out[name].untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                   for t in made), name


def test_a_bfloat16_tensor_from_the_allocator_encodes_as_any_other() -> None:
    from protos import allocator

    x = allocator.empty((5, 3), torch.bfloat16)
    x.copy_(torch.randn(5, 3))
    for t in (x, x[1:], x.clone()):  # its own words, a view, a tensor torch allocated
        back = decode_tensor(encode_tensor(t))  # bfloat16 comes back as its uint16 words
        assert np.array_equal(back, t.contiguous().view(torch.int16).numpy().view(np.uint16))
