"""Receive buffers: assembled tensors are copied once into reused buffers, tensors that
came in one message are views of its bytes, and a reused buffer never belongs to a batch
the user still holds."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from test_decode import encode_batch, fake_batch
from torch_geometric.data import Data

from protos import codec, fastwire
from protos import sampling_pb2 as pb
from protos.assembler import TensorAssembler
from protos.buffers import BufferPool
from trainer_client.decode import BatchAssembler

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def _wire_messages(named: dict[str, codec.TensorLike], chunk_bytes: int) -> list[bytes]:
    return fastwire.encode_chunks(
        lambda i, n: pb.MinibatchChunk(batch_index=0, chunk_index=i, num_chunks=n), named, chunk_bytes)


def _assemble(raw: list[bytes], pool: BufferPool | None) -> dict[str, torch.Tensor]:
    assembler = TensorAssembler(pool=pool)
    for r in raw:
        assembler.add_all(fastwire.minibatch_chunk_deserializer(r).tensors)
    return assembler.finish_torch()


def _inside(t: torch.Tensor, raw: bytes) -> bool:
    base = np.frombuffer(raw, dtype=np.uint8)
    return base.ctypes.data <= t.data_ptr() < base.ctypes.data + base.size


@pytest.mark.parametrize("dtype", DTYPES)
def test_any_dtype_split_across_messages_equals_its_source(dtype: torch.dtype) -> None:
    source = _tensor(dtype, (301, 7), seed=1)
    raw = _wire_messages({"t": source, "small": torch.arange(3)}, chunk_bytes=500)
    assert len(raw) > 3
    out = _assemble(raw, BufferPool())
    assert out["t"].dtype == dtype and out["t"].shape == source.shape
    assert torch.equal(out["t"], source)
    assert not any(_inside(out["t"], r) for r in raw)  # its own buffer, written once
    assert torch.equal(out["small"], torch.arange(3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_any_dtype_in_one_message_is_a_view_of_the_message_bytes(dtype: torch.dtype) -> None:
    source = _tensor(dtype, (40, 3), seed=2)
    raw = _wire_messages({"t": source}, chunk_bytes=1 << 20)
    assert len(raw) == 1
    pool = BufferPool()
    out = _assemble(raw, pool)
    assert torch.equal(out["t"], source)
    assert _inside(out["t"], raw[0])  # torch.frombuffer of the received bytes: no copy
    assert len(pool) == 0


def test_a_buffer_is_reused_once_its_tensor_is_gone() -> None:
    pool = BufferPool()
    first = torch.from_numpy(pool.take(1000))
    address = first.data_ptr()
    del first
    gc.collect()
    again = pool.take(900)
    assert again.ctypes.data == address and pool.reused == 1 and len(pool) == 1


@pytest.mark.parametrize("keep", ["tensor", "slice", "transpose", "numpy", "numpy_view"])
def test_a_buffer_is_not_reused_while_any_view_of_it_lives(keep: str) -> None:
    pool = BufferPool()
    tensor = torch.from_numpy(pool.take(64)).view(torch.float32).view(4, 4)
    tensor.fill_(1.5)
    views = {"tensor": lambda t: t, "slice": lambda t: t[1:3], "transpose": lambda t: t.t(),
             "numpy": lambda t: t.numpy(), "numpy_view": lambda t: t.numpy()[::2]}
    held = views[keep](tensor)
    del tensor
    gc.collect()
    other = pool.take(64)
    other[:] = 0
    assert float(np.asarray(held).sum()) == 1.5 * np.asarray(held).size
    assert pool.reused == 0 and len(pool) == 2


def test_the_pool_is_bounded_and_replaces_small_free_buffers() -> None:
    pool = BufferPool(max_buffers=2, headroom=0.0)
    held = [pool.take(100), pool.take(100), pool.take(100)]  # the third one is not pooled
    assert len(pool) == 2 and pool.pooled_bytes == 200
    del held
    gc.collect()
    bigger = pool.take(500)  # no free buffer fits: a free small one is replaced
    assert len(pool) == 2 and pool.pooled_bytes == 600 and bigger.size == 500
    with pytest.raises(ValueError, match="max_buffers: expected >= 0, got -1"):
        BufferPool(max_buffers=-1)


def _batches(count: int) -> list[list[pb.MinibatchChunk]]:
    return [encode_batch(i, fake_batch(np.arange(30) + 50 * i, num_hops=3), num_batches=count,
                         chunk_bytes=128) for i in range(count)]


def _feed(assembler: BatchAssembler, messages: list[pb.MinibatchChunk]) -> Data:
    done = None
    for m in messages:
        done = assembler.add(m)
    assert done is not None
    return done.data


def test_consecutive_batches_reuse_the_buffers_of_released_batches() -> None:
    assembler = BatchAssembler()
    batches = _batches(4)
    for i, messages in enumerate(batches):
        data = _feed(assembler, messages)
        expected = fake_batch(np.arange(30) + 50 * i, num_hops=3)
        for key in ("n_id", "edge_index", "x", "y"):
            assert torch.equal(data[key], expected[key]), (i, key)
        del data
        gc.collect()
    assert assembler.pool.reused > 0
    assert len(assembler.pool) <= 4  # the multi-chunk tensors of one batch


def test_buffers_reused_across_batches_never_alias_a_batch_still_held() -> None:
    assembler = BatchAssembler()
    held = []
    for messages in _batches(5):
        held.append(_feed(assembler, messages))
    for i, data in enumerate(held):  # every batch intact after the later ones were decoded
        expected = fake_batch(np.arange(30) + 50 * i, num_hops=3)
        for key in ("n_id", "edge_index", "x", "y"):
            assert torch.equal(data[key], expected[key]), (i, key)
    assert assembler.pool.reused == 0
    pointers = [data[key].data_ptr() for data in held for key in ("n_id", "edge_index", "x", "y")]
    assert len(set(pointers)) == len(pointers)
    keep_x = held[0].x  # a tensor of batch 0 outlives its Data
    del held
    gc.collect()
    data = _feed(assembler, _batches(1)[0])
    assert assembler.pool.reused > 0
    assert torch.equal(keep_x, fake_batch(np.arange(30), num_hops=3)["x"])
    assert keep_x.data_ptr() != data.x.data_ptr()


def test_a_broken_batch_keeps_the_pool_and_frees_its_buffers() -> None:
    assembler = BatchAssembler()
    first, second = _batches(2)
    for m in first[:-1]:
        assembler.add(m)
    pool = assembler.pool
    assembler.reset()
    assert assembler.pool is pool and not assembler.pending
    data = _feed(assembler, second)
    assert pool.reused > 0
    assert torch.equal(data.x, fake_batch(np.arange(30) + 50, num_hops=3)["x"])
