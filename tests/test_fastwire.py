"""protos.fastwire writes and reads the same bytes protobuf does, with fewer copies."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from protos import codec, fastwire
from protos import sampling_pb2 as pb
from protos.assembler import TensorAssembler

HEADER = pb.MinibatchHeader(num_batches=3, num_seed_nodes=4, num_sampled_nodes=[4, 6, 9],
                            num_sampled_edges=[10, 20])


def _named() -> dict[str, codec.TensorLike]:
    g = torch.Generator().manual_seed(0)
    return {"n_id": torch.arange(19), "edge_index": torch.arange(60).reshape(2, 30),
            "x": torch.randn(2000, 33, generator=g).to(torch.bfloat16),
            "y": np.arange(19, dtype=np.int64), "empty": torch.zeros((0, 5))}


def _head(i: int, n: int) -> pb.MinibatchChunk:
    msg = pb.MinibatchChunk(batch_index=7, chunk_index=i, num_chunks=n)
    if i == 0:
        msg.header.CopyFrom(HEADER)
    return msg


def _reference(named: dict[str, codec.TensorLike], chunk_bytes: int) -> list[pb.MinibatchChunk]:
    groups = list(codec.split_tensors(named, chunk_bytes))
    msgs = [pb.MinibatchChunk(batch_index=7, chunk_index=i, num_chunks=len(groups), tensors=g)
            for i, g in enumerate(groups)]
    msgs[0].header.CopyFrom(HEADER)
    return msgs


@pytest.mark.parametrize("chunk_bytes", [100, 4096, 1 << 20])
def test_encoded_bytes_equal_protobufs_serialization(chunk_bytes: int) -> None:
    named = _named()
    ours = fastwire.encode_chunks(_head, named, chunk_bytes)
    ref = _reference(named, chunk_bytes)
    assert len(ours) == len(ref) and len(ours) >= (2 if chunk_bytes < 4096 * 8 else 1)
    assert ours == [m.SerializeToString() for m in ref]
    assert [pb.MinibatchChunk.FromString(b) for b in ours] == ref


@pytest.mark.parametrize("chunk_bytes", [100, 1 << 20])
def test_parsed_messages_decode_to_the_tensors_without_copies(chunk_bytes: int) -> None:
    named = _named()
    raw = [m.SerializeToString() for m in _reference(named, chunk_bytes)]
    parsed = [fastwire.minibatch_chunk_deserializer(r) for r in raw]
    assert parsed[0].HasField("header") and parsed[0].header == HEADER
    assert all(not p.HasField("header") for p in parsed[1:])
    assert [p.chunk_index for p in parsed] == list(range(len(raw)))
    assert all(p.batch_index == 7 and p.num_chunks == len(raw) for p in parsed)
    assert [p.ByteSize() for p in parsed] == [len(r) for r in raw]
    assembler = TensorAssembler()
    for p in parsed:
        assembler.add_all(p.tensors)
    out = assembler.finish_torch()
    for name, value in named.items():
        assert torch.equal(out[name], torch.as_tensor(value)), name
    if chunk_bytes == 1 << 20:  # one message: every tensor is a view of its bytes
        base = np.frombuffer(raw[0], dtype=np.uint8)
        lo, hi = base.ctypes.data, base.ctypes.data + base.size
        assert all(lo <= t.data_ptr() < hi for t in out.values() if t.numel())


def test_peer_chunks_round_trip() -> None:
    named = {"counts": torch.tensor([2, 0, 1]), "neighbors": torch.tensor([5, 6, 7])}
    raw = fastwire.encode_chunks(lambda i, n: pb.SampleNeighborsChunk(chunk_index=i, num_chunks=n),
                                 named, 8)
    assert len(raw) == 6
    parsed = [fastwire.parse_chunk(pb.SampleNeighborsChunk, r) for r in raw]
    assert [pb.SampleNeighborsChunk.FromString(r).chunk_index for r in raw] == list(range(6))
    assembler = TensorAssembler()
    for p in parsed:
        assembler.add_all(p.tensors)
    out = assembler.finish_torch()
    assert torch.equal(out["counts"], named["counts"])
    assert torch.equal(out["neighbors"], named["neighbors"])


def test_unknown_fields_are_skipped() -> None:
    msg = _reference({"n_id": torch.arange(3)}, 1 << 20)[0].SerializeToString()
    extra = bytes([0x78, 0x05]) + bytes([0x85, 0x01]) + b"\0" * 4  # field 15 varint, field 16 fixed32
    parsed = fastwire.minibatch_chunk_deserializer(msg + extra)
    assert parsed.batch_index == 7 and len(parsed.tensors) == 1


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x08", "truncated varint"),
        (b"\x2a\x10\x0a", "runs past the end"),
        (b"\x08" + b"\xff" * 11, "varint longer than 10 bytes"),
        (b"\x0b", "unsupported wire type 3"),
        (b"\x00\x01", "field number 0"),
        (b"\x2a\x03\x32\x05\x00", "runs past the end"),
        (b"\x22\x02\xff\xff", "malformed fields"),
    ],
)
def test_malformed_bytes_raise_codec_errors_naming_the_message(raw: bytes, message: str) -> None:
    with pytest.raises(codec.CodecError, match=message):
        fastwire.minibatch_chunk_deserializer(raw)


def test_passthrough_keeps_bytes_and_serializes_messages() -> None:
    msg = pb.MinibatchChunk(batch_index=3)
    assert fastwire.passthrough(b"abc") == b"abc"
    assert fastwire.passthrough(msg) == msg.SerializeToString()


@pytest.mark.parametrize("sizes", [[3, 0, 5], [7, fastwire.RELEASED_JOIN_MIN_BYTES, 0, 1, 300_001]])
def test_join_released_is_bytes_join_and_owns_its_bytes(sizes: list[int]) -> None:
    rng = np.random.default_rng(sum(sizes))
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    parts: list[bytes | np.ndarray] = [a.tobytes() if i % 2 else a for i, a in enumerate(arrays)]
    joined = fastwire.join_released(parts)
    expected = b"".join(a.tobytes() for a in arrays)
    assert type(joined) is bytes and joined == expected and hash(joined) == hash(expected)
    assert sys.getrefcount(joined) == 2  # this name and the call's argument: nothing leaks
    for a in arrays:  # a copy: later writes to the sources leave the message as it was
        a[:] = 0
    assert joined == expected


def test_join_released_refuses_arrays_that_are_not_flat_bytes() -> None:
    with pytest.raises(TypeError, match="parts: expected bytes or 1-d uint8 arrays, got an array of float32"):
        fastwire.join_released([b"a", np.zeros(4, dtype=np.float32)])
    with pytest.raises(TypeError, match=r"shape \[2, 2\]"):
        fastwire.join_released([np.zeros((2, 2), dtype=np.uint8)])


def test_join_released_keeps_nothing_per_message_size() -> None:
    """Messages of ever new sizes (every batch's last chunk) leave no memory behind
    (a ctypes array type per size would stay cached for good, a few KiB each)."""
    import tracemalloc

    data = np.arange(fastwire.RELEASED_JOIN_MIN_BYTES + 4000, dtype=np.uint8)
    fastwire.join_released([b"h", data])
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for extra in range(300):
            message = fastwire.join_released([b"h", data[: fastwire.RELEASED_JOIN_MIN_BYTES + extra]])
            assert len(message) == fastwire.RELEASED_JOIN_MIN_BYTES + extra + 1
            del message
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert grown < 64 << 10, f"{grown} bytes kept after 300 message sizes"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("first", [0, 1, 3, 200])
def test_rows_gathered_into_messages_are_the_bytes_encode_message_makes(dtype: torch.dtype,
                                                                         first: int) -> None:
    """Message k of RowMessages is encode_message of the rows of block k (one piece of
    whole rows at their offset) with the head of message first + k: also where the head
    is longer than the room kept for it (chunk 0's header, a 2-byte chunk index)."""
    rows = (torch.randn(301, 3, 5) * 1000).to(dtype)
    out = fastwire.RowMessages(_head, "x", dtype, 301, (3, 5), chunk_bytes=1000)
    per = 1000 // (15 * rows.element_size())
    assert out.rows_per_message == per and len(out) == -(-301 // per)
    assert [(a, b) for a, b, _ in out.blocks] == [(s, min(s + per, 301)) for s in range(0, 301, per)]
    for a, b, block in out.blocks:
        assert block.dtype == dtype and block.shape == (b - a, 3, 5)
        block.copy_(rows[a:b])
    total = first + len(out)
    messages = out.finish(first, total)
    blocks = [(s, min(s + per, 301)) for s in range(0, 301, per)]
    assert messages == [fastwire.encode_message(_head(first + k, total),
                                                [codec.row_piece("x", rows[a:b], a, 301)])
                        for k, (a, b) in enumerate(blocks)]
    assembler = TensorAssembler()
    for m in messages:
        assembler.add_all(fastwire.parse_chunk(pb.MinibatchChunk, m).tensors)
    assert torch.equal(assembler.finish_torch()["x"].view(torch.uint8), rows.view(torch.uint8))
    with pytest.raises(RuntimeError, match="called twice"):
        out.finish(first, total)


def test_rows_that_do_not_fit_a_message_are_refused() -> None:
    assert fastwire.RowMessages.fits(torch.float32, (256,), 1024)
    assert not fastwire.RowMessages.fits(torch.float32, (257,), 1024)
    assert not fastwire.RowMessages.fits(torch.float32, (0,), 1024)
    assert not fastwire.RowMessages.worth_it(torch.float32, (256,), 1, 1024)  # one message holds it
    assert fastwire.RowMessages.worth_it(torch.float32, (256,), 2, 1024)
    assert not fastwire.RowMessages.worth_it(torch.float32, (257,), 100, 1024)
    with pytest.raises(ValueError, match="at least one"):
        fastwire.RowMessages(_head, "x", torch.float32, 4, (257,), chunk_bytes=1024)
    with pytest.raises(ValueError, match="at least one"):
        fastwire.RowMessages(_head, "x", torch.float32, 0, (4,), chunk_bytes=1024)
    with pytest.raises(codec.CodecError, match=r"TensorChunk\.name"):
        fastwire.RowMessages(_head, "", torch.float32, 4, (4,), chunk_bytes=1024)
    out = fastwire.RowMessages(_head, "x", torch.float32, 4, (4,), chunk_bytes=1024)
    with pytest.raises(ValueError, match="first"):
        out.finish(2, 2)
