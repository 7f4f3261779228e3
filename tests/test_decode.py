"""Tests for trainer_client/decode.py: MinibatchChunk messages → PyG Data.

``encode_batch`` and ``fake_batch`` are also the fake servers' batch builders in
test_loader.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
import pytest
import torch

from protos import codec
from protos import sampling_pb2 as pb
from trainer_client import decode
from trainer_client.decode import (
    BatchAssembler,
    BatchDecodeError,
    BatchSpec,
    decode_batch,
    to_device,
)

FEATURE_DIM = 4
NUM_CLASSES = 3


def fake_batch(
    seeds: np.ndarray, num_hops: int = 2, feature_dim: int = FEATURE_DIM,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor | list[int]]:
    """A well-formed batch around ``seeds``: each node of a hop's frontier gets one new
    in-neighbor at the next hop. Features encode the node ID, labels are ``ID % 3``."""
    n_id = [torch.as_tensor(seeds, dtype=torch.int64)]
    frontier = torch.arange(len(seeds))
    src, dst, nodes, edges = [], [], [len(seeds)], []
    for hop in range(1, num_hops + 1):
        first = sum(nodes)
        new = torch.arange(first, first + len(frontier))
        n_id.append(n_id[-1] + 100_000 * hop)
        src.append(new)
        dst.append(frontier)
        nodes.append(len(frontier))
        edges.append(len(frontier))
        frontier = new
    all_ids = torch.cat(n_id)
    x = (all_ids % 97).to(torch.float32)[:, None] + torch.arange(feature_dim) / 8
    return {
        "n_id": all_ids,
        "edge_index": torch.stack([torch.cat(src), torch.cat(dst)]),
        "x": x.to(dtype),
        "y": all_ids % NUM_CLASSES,
        "num_sampled_nodes": nodes,
        "num_sampled_edges": edges,
    }


def encode_batch(
    index: int, batch: Mapping[str, object], *, num_batches: int = 1,
    chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
) -> list[pb.MinibatchChunk]:
    """The MinibatchChunk messages a server sends for ``batch``."""
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor | np.ndarray)}
    nodes = list(batch["num_sampled_nodes"])  # type: ignore[call-overload]
    header = pb.MinibatchHeader(
        num_batches=num_batches, num_seed_nodes=nodes[0], num_sampled_nodes=nodes,
        num_sampled_edges=list(batch["num_sampled_edges"]),  # type: ignore[call-overload]
    )
    groups = list(codec.split_tensors(tensors, chunk_bytes))
    return [
        pb.MinibatchChunk(batch_index=index, chunk_index=k, num_chunks=len(groups),
                          header=header if k == 0 else None, tensors=group)
        for k, group in enumerate(groups)
    ]


SEEDS = np.array([7, 3, 11, 5, 2])


def test_round_trip_single_chunk_matches_pyg_layout() -> None:
    batch = fake_batch(SEEDS)
    messages = encode_batch(0, batch)
    assert len(messages) == 1
    decoded = decode_batch(messages, BatchSpec(num_hops=2, feature_dim=FEATURE_DIM, num_batches=1))
    data = decoded.data
    assert decoded.index == 0
    assert data.batch_size == len(SEEDS)
    assert data.num_sampled_nodes == batch["num_sampled_nodes"]
    assert data.num_sampled_edges == batch["num_sampled_edges"]
    assert data.num_nodes == sum(batch["num_sampled_nodes"])  # type: ignore[arg-type]
    for key in ("n_id", "edge_index", "x", "y"):
        assert torch.equal(data[key], batch[key]), key
    assert data.n_id[: data.batch_size].tolist() == SEEDS.tolist()
    assert decoded.nbytes == sum(m.ByteSize() for m in messages)  # what came over the wire
    assert decoded.nbytes >= sum(t.numel() * t.element_size() for t in
                                 (data.n_id, data.edge_index, data.x, data.y))


def test_single_chunk_tensors_share_the_message_bytes() -> None:
    msg = encode_batch(0, fake_batch(SEEDS))[0]
    data = BatchAssembler().add(msg).data  # type: ignore[union-attr]
    # torch.frombuffer views of the received bytes: their storage is not torch's own
    # (not resizable), unlike any tensor torch allocated for a copy.
    for key in ("n_id", "edge_index", "x", "y"):
        assert not data[key].untyped_storage().resizable(), key
    assert data.x.clone().untyped_storage().resizable()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_half_precision_features_are_cast_on_the_device(dtype: torch.dtype) -> None:
    batch = fake_batch(SEEDS, dtype=dtype)
    data = decode_batch(encode_batch(0, batch)).data
    assert data.x.dtype == dtype
    assert torch.equal(data.x, batch["x"])
    kept = to_device(data.clone(), "cpu", feature_dtype=None)
    assert kept.x.dtype == dtype
    cast = to_device(data, "cpu")
    assert cast.x.dtype == torch.float32
    assert torch.equal(cast.x, batch["x"].to(torch.float32))  # type: ignore[union-attr]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_chunk_batches_are_reassembled(dtype: torch.dtype) -> None:
    batch = fake_batch(np.arange(40), num_hops=3, dtype=dtype)
    messages = encode_batch(5, batch, num_batches=9, chunk_bytes=256)
    assert len(messages) > 5
    assembler = BatchAssembler(BatchSpec(num_hops=3, feature_dim=FEATURE_DIM, num_batches=9))
    results = [assembler.add(m) for m in messages]
    assert all(r is None for r in results[:-1])
    done = results[-1]
    assert done is not None and done.index == 5 and not assembler.pending
    for key in ("n_id", "edge_index", "x", "y"):
        assert torch.equal(done.data[key], batch[key]), key


@pytest.mark.parametrize(("cpus", "background"), [(1, False), (2, False), (3, False), (4, True), (16, True)])
def test_copies_run_on_the_decode_threads_only_with_cores_to_spare(
    monkeypatch: pytest.MonkeyPatch, cpus: int, background: bool
) -> None:
    monkeypatch.setattr(decode, "usable_cpus", lambda: cpus)
    assembler = BatchAssembler()
    assert assembler.background_copies is background
    assert BatchAssembler(background_copies=not background).background_copies is not background
    batch = fake_batch(np.arange(40), num_hops=3)  # the same batch either way
    done = [assembler.add(m) for m in encode_batch(0, batch, num_batches=1, chunk_bytes=256)][-1]
    assert done is not None
    for key in ("n_id", "edge_index", "x", "y"):
        assert torch.equal(done.data[key], batch[key]), key


def test_one_assembler_decodes_consecutive_batches() -> None:
    assembler = BatchAssembler()
    out = []
    for i in range(3):
        for msg in encode_batch(i, fake_batch(SEEDS + i), num_batches=3, chunk_bytes=64):
            got = assembler.add(msg)
            if got is not None:
                out.append(got)
    assert [b.index for b in out] == [0, 1, 2]
    assert [b.data.n_id[0].item() for b in out] == [7, 8, 9]


def test_optional_features_and_labels() -> None:
    batch = {k: v for k, v in fake_batch(SEEDS).items() if k not in ("x", "y")}
    spec = BatchSpec(include_features=False, include_labels=False)
    data = decode_batch(encode_batch(0, batch), spec).data
    assert "x" not in data and "y" not in data
    with pytest.raises(BatchDecodeError, match=r"tensor 'x': expected it \(include_features is set\)"):
        decode_batch(encode_batch(0, batch), BatchSpec())


# ---- malformed input ---------------------------------------------------------------------


def _messages(**changes: object) -> list[pb.MinibatchChunk]:
    batch: dict[str, object] = dict(fake_batch(SEEDS))
    batch.update(changes)
    return encode_batch(0, batch, num_batches=2, chunk_bytes=64)


def _expect_error(messages: list[pb.MinibatchChunk], pattern: str, spec: BatchSpec | None = None) -> None:
    spec = spec or BatchSpec(num_hops=2, feature_dim=FEATURE_DIM, num_batches=2)
    with pytest.raises(BatchDecodeError, match=pattern):
        decode_batch(messages, spec)


def test_first_message_must_carry_the_header() -> None:
    messages = _messages()
    messages[0].ClearField("header")
    _expect_error(messages, r"header: expected a MinibatchHeader on chunk 0, got none")


def test_missing_or_reordered_chunks_are_named() -> None:
    messages = _messages()
    _expect_error(messages[1:], r"chunk_index: expected 0 \(first message of a batch\), got 1")
    _expect_error([messages[0], *messages[2:]], r"chunk_index: expected 1, got 2")
    _expect_error(messages[:-1], r"expected every message of one batch, got only part of them")
    messages[1].batch_index = 1
    _expect_error(messages, r"batch_index: expected 0 \(chunk 1 of \d+\), got 1")


def test_num_chunks_must_stay_the_same() -> None:
    messages = _messages()
    messages[1].num_chunks += 1
    _expect_error(messages, r"num_chunks: expected \d+ as in chunk 0, got \d+")


def test_extra_messages_after_a_complete_batch_are_rejected() -> None:
    messages = _messages()
    _expect_error(messages + messages[:1], r"got more after batch 0 was complete")


def test_truncated_tensor_bytes_raise_codec_errors() -> None:
    messages = _messages()
    last = messages[-1].tensors[-1]
    last.data = last.data[:-1]
    with pytest.raises(codec.CodecError, match=r"expected \d+ bytes in all, got \d+ \(missing chunks\)"):
        decode_batch(messages)


@pytest.mark.parametrize(
    ("changes", "spec", "pattern"),
    [
        ({"num_sampled_nodes": [5, 5, 4]}, None,
         r"tensor 'n_id': expected sum\(num_sampled_nodes\) = 14 nodes, got 15"),
        ({"num_sampled_edges": [5]}, None, r"num_sampled_edges: expected 2 entries \(one per hop\), got 1"),
        ({"num_sampled_nodes": [5, 5], "num_sampled_edges": [5]}, None,
         r"num_sampled_nodes: expected 3 entries \(seeds \+ one per hop\), got 2"),
        ({"edge_index": torch.tensor([[0, 99], [1, 2]])}, None,
         r"tensor 'edge_index': expected shape \[2, 10\], got \[2, 2\]"),
        ({"x": torch.zeros(15, 3)}, None, r"tensor 'x': expected shape \[15, 4\], got \[15, 3\]"),
        ({"x": torch.zeros(15, 4, dtype=torch.int32)}, None, r"tensor 'x': expected dtype torch.float32"),
        ({"y": torch.zeros(15)}, None, r"tensor 'y': expected dtype torch.int64"),
        ({"n_id": torch.zeros(15, dtype=torch.int32)}, None, r"tensor 'n_id': expected dtype torch.int64"),
        ({"extra": torch.zeros(1)}, None, r"tensor names: expected among .*got \['extra'\]"),
        ({}, BatchSpec(num_batches=3), r"num_batches: expected 3 .*got 2"),
    ],
)
def test_inconsistent_batches_name_the_field(
    changes: dict[str, object], spec: BatchSpec | None, pattern: str
) -> None:
    _expect_error(_messages(**changes), pattern, spec)


def test_edge_indices_outside_the_batch_are_rejected() -> None:
    edge_index = fake_batch(SEEDS)["edge_index"].clone()  # type: ignore[union-attr]
    edge_index[0, 3] = 15
    _expect_error(_messages(edge_index=edge_index),
                  re.escape("tensor 'edge_index': expected local indices in 0 .. 14, got values in 0 .. 15"))
