"""Tests for trainer_client/decode.py and batch_checks.py: MinibatchChunk messages → a
PyG ``Data`` (plain graph) or ``HeteroData`` (typed graph), each test on both kinds.

The typed batches have papers (the seeds, with features and labels) and featureless
authors; each hop gives every frontier paper one new cited paper and one new author.
``encode_batch`` and ``fake_batch`` are also the fake servers' batch builders in
test_loader.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest
import torch
from torch_geometric.data import Data, HeteroData

from partitioner.graph import EdgeType, edge_type_name
from protos import codec, compact
from protos import sampling_pb2 as pb
from sampling_server.produce import structure_tensors
from sampling_server.sampler.types import SamplerOutput
from trainer_client import decode
from trainer_client.batch_checks import TypedSpec
from trainer_client.decode import BatchAssembler, BatchDecodeError, BatchSpec, decode_batch, to_device
from trainer_client.graph import PLAIN_EDGE_TYPE, PLAIN_NODE_TYPE, to_plain_data

FEATURE_DIM = 4
NUM_CLASSES = 3
KINDS = ["plain", "typed"]
CITES, WRITES = ("paper", "cites", "paper"), ("author", "writes", "paper")
TYPED = TypedSpec(node_types=("paper", "author"), edge_types=(CITES, WRITES),
                  feature_dims={"paper": FEATURE_DIM, "author": 0}, target_type="paper", seed_type="paper")


def fake_batch(
    seeds: np.ndarray, num_hops: int = 2, feature_dim: int = FEATURE_DIM,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor | list[int]]:
    """A well-formed plain batch around ``seeds``: each node of a hop's frontier gets one
    new in-neighbor at the next hop. Features encode the node ID, labels are ``ID % 3``."""
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
    return {
        "n_id": all_ids,
        "edge_index": torch.stack([torch.cat(src), torch.cat(dst)]),
        "x": _features(all_ids, feature_dim, dtype),
        "y": all_ids % NUM_CLASSES,
        "num_sampled_nodes": nodes,
        "num_sampled_edges": edges,
    }


def _features(ids: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return ((ids % 97).to(torch.float32)[:, None] + torch.arange(dim) / 8).to(dtype)


def fake_typed_batch(
    seeds: np.ndarray, num_hops: int = 2, feature_dim: int = FEATURE_DIM,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The typed batch around ``seeds`` (papers): per hop, every frontier paper gets one
    new cited paper and one new author (see the module doc)."""
    s = len(seeds)
    papers = [torch.as_tensor(seeds, dtype=torch.int64)]
    authors: list[torch.Tensor] = []
    rows: dict[tuple[str, str, str], list[torch.Tensor]] = {CITES: [], WRITES: []}
    cols: dict[tuple[str, str, str], list[torch.Tensor]] = {CITES: [], WRITES: []}
    for hop in range(1, num_hops + 1):
        frontier = torch.arange(s * (hop - 1), s * hop)
        papers.append(papers[0] + 100_000 * hop)
        authors.append(papers[0] + 500_000 * hop)
        rows[CITES].append(frontier + s)
        rows[WRITES].append(torch.arange(s * (hop - 1), s * hop))
        cols[CITES].append(frontier)
        cols[WRITES].append(frontier)
    paper_ids = torch.cat(papers)
    names = {e: edge_type_name(e) for e in (CITES, WRITES)}
    return {
        "n_id/paper": paper_ids,
        "n_id/author": torch.cat(authors) if authors else torch.zeros(0, dtype=torch.int64),
        **{f"edge_index/{names[e]}": torch.stack([torch.cat(rows[e]), torch.cat(cols[e])]) if num_hops
           else torch.zeros((2, 0), dtype=torch.int64) for e in (CITES, WRITES)},
        "x/paper": _features(paper_ids, feature_dim, dtype),
        "y/paper": paper_ids % NUM_CLASSES,
        "typed_sampled_nodes": {"paper": [s] * (num_hops + 1), "author": [0] + [s] * num_hops},
        "typed_sampled_edges": {names[e]: [s] * num_hops for e in (CITES, WRITES)},
    }


def encode_batch(
    index: int, batch: Mapping[str, object], *, num_batches: int = 1,
    chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
) -> list[pb.MinibatchChunk]:
    """The MinibatchChunk messages a server sends for ``batch`` (plain or typed)."""
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor | np.ndarray)}
    if "typed_sampled_nodes" in batch:
        nodes: Mapping[str, list[int]] = batch["typed_sampled_nodes"]  # type: ignore[assignment]
        edges: Mapping[str, list[int]] = batch["typed_sampled_edges"]  # type: ignore[assignment]
        header = pb.MinibatchHeader(
            num_batches=num_batches, num_seed_nodes=nodes["paper"][0],
            typed_sampled_nodes=[pb.TypedCounts(name=k, counts=v) for k, v in nodes.items()],
            typed_sampled_edges=[pb.TypedCounts(name=k, counts=v) for k, v in edges.items()])
    else:
        counts = list(batch["num_sampled_nodes"])  # type: ignore[call-overload]
        header = pb.MinibatchHeader(
            num_batches=num_batches, num_seed_nodes=counts[0], num_sampled_nodes=counts,
            num_sampled_edges=list(batch["num_sampled_edges"]),  # type: ignore[call-overload]
        )
    groups = list(codec.split_tensors(tensors, chunk_bytes))
    return [
        pb.MinibatchChunk(batch_index=index, chunk_index=k, num_chunks=len(groups),
                          header=header if k == 0 else None, tensors=group)
        for k, group in enumerate(groups)
    ]


SEEDS = np.array([7, 3, 11, 5, 2])


def make(kind: str, seeds: np.ndarray = SEEDS, **kw: Any) -> dict[str, Any]:
    return dict(fake_batch(seeds, **kw) if kind == "plain" else fake_typed_batch(seeds, **kw))


def spec(kind: str, **kw: Any) -> BatchSpec:
    return BatchSpec(typed=TYPED, **kw) if kind == "typed" else BatchSpec(feature_dim=FEATURE_DIM, **kw)


def name(kind: str, what: str, key: str | tuple[str, str, str] = "paper") -> str:
    """The wire name of tensor ``what`` (of the papers, or of a relation) in a batch of ``kind``."""
    if kind == "plain":
        return what
    return f"{what}/{key if isinstance(key, str) else edge_type_name(key)}"


def papers(data: Data | HeteroData) -> Any:
    """The seeds' store: a plain batch itself, a typed batch's papers."""
    return data if isinstance(data, Data) else data["paper"]


def edge_index(data: Data | HeteroData) -> torch.Tensor:
    return data.edge_index if isinstance(data, Data) else data[CITES].edge_index


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_single_chunk_matches_pyg_layout(kind: str) -> None:
    batch = make(kind)
    messages = encode_batch(0, batch)
    assert len(messages) == 1
    decoded = decode_batch(messages, spec(kind, num_hops=2, num_batches=1))
    data, seeds = decoded.data, papers(decoded.data)
    assert decoded.index == 0
    assert seeds.batch_size == len(SEEDS)
    assert seeds.n_id[: seeds.batch_size].tolist() == SEEDS.tolist()
    assert decoded.nbytes == sum(m.ByteSize() for m in messages)  # what came over the wire
    if kind == "plain":
        assert isinstance(data, Data)
        assert data.num_sampled_nodes == batch["num_sampled_nodes"]
        assert data.num_sampled_edges == batch["num_sampled_edges"]
        assert data.num_nodes == sum(batch["num_sampled_nodes"])
        for key in ("n_id", "edge_index", "x", "y"):
            assert torch.equal(data[key], batch[key]), key
        return
    assert isinstance(data, HeteroData) and data.node_types == ["paper", "author"]
    assert data.num_sampled_nodes == batch["typed_sampled_nodes"]  # as PyG's to_hetero_data sets them
    assert data.num_sampled_nodes_dict == batch["typed_sampled_nodes"]
    assert data.num_sampled_edges_dict == {e: batch["typed_sampled_edges"][edge_type_name(e)]
                                           for e in (CITES, WRITES)}
    for t in ("paper", "author"):
        assert torch.equal(data[t].n_id, batch[f"n_id/{t}"]) and data[t].num_nodes == data[t].n_id.numel()
    assert torch.equal(seeds.x, batch["x/paper"]) and torch.equal(seeds.y, batch["y/paper"])
    assert "x" not in data["author"] and "y" not in data["author"] and "batch_size" not in data["author"]
    for e in (CITES, WRITES):
        assert torch.equal(data[e].edge_index, batch[name(kind, "edge_index", e)]), e


@pytest.mark.parametrize("kind", KINDS)
def test_single_chunk_tensors_share_the_message_bytes(kind: str) -> None:
    msg = encode_batch(0, make(kind))[0]
    decoded = BatchAssembler(spec(kind)).add(msg)
    assert decoded is not None
    seeds = papers(decoded.data)
    # torch.frombuffer views of the received bytes: their storage is not torch's own
    # (not resizable), unlike any tensor torch allocated for a copy.
    for key in ("n_id", "x", "y"):
        assert not seeds[key].untyped_storage().resizable(), key
    assert not edge_index(decoded.data).untyped_storage().resizable()
    assert seeds.x.clone().untyped_storage().resizable()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_half_precision_features_travel_to_the_device_as_they_are(kind: str, dtype: torch.dtype) -> None:
    """The loader casts them there (test_feature_cache.py checks its batches' dtypes)."""
    batch = make(kind, dtype=dtype)
    x = batch[name(kind, "x")]
    data = decode_batch(encode_batch(0, batch), spec(kind)).data
    assert papers(data).x.dtype == dtype and torch.equal(papers(data).x, x)
    moved = to_device(data, "cpu")
    assert papers(moved).x.dtype == dtype and torch.equal(papers(moved).x, x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_chunk_batches_are_reassembled(kind: str, dtype: torch.dtype) -> None:
    batch = make(kind, np.arange(40), num_hops=3, dtype=dtype)
    messages = encode_batch(5, batch, num_batches=9, chunk_bytes=256)
    assert len(messages) > 5
    assembler = BatchAssembler(spec(kind, num_hops=3, num_batches=9))
    results = [assembler.add(m) for m in messages]
    assert all(r is None for r in results[:-1])
    done = results[-1]
    assert done is not None and done.index == 5 and not assembler.pending
    for key in ("n_id", "x", "y"):
        assert torch.equal(papers(done.data)[key], batch[name(kind, key)]), key
    assert torch.equal(edge_index(done.data), batch[name(kind, "edge_index", CITES)])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("cpus", "background"), [(1, False), (2, False), (3, False), (4, True), (16, True)])
def test_copies_run_on_the_decode_threads_only_with_cores_to_spare(
    monkeypatch: pytest.MonkeyPatch, kind: str, cpus: int, background: bool
) -> None:
    monkeypatch.setattr(decode, "usable_cpus", lambda: cpus)
    assembler = BatchAssembler(spec(kind))
    assert assembler.background_copies is background
    assert BatchAssembler(background_copies=not background).background_copies is not background
    batch = make(kind, np.arange(40), num_hops=3)  # the same batch either way
    done = [assembler.add(m) for m in encode_batch(0, batch, num_batches=1, chunk_bytes=256)][-1]
    assert done is not None
    for key in ("n_id", "x", "y"):
        assert torch.equal(papers(done.data)[key], batch[name(kind, key)]), key


@pytest.mark.parametrize("kind", KINDS)
def test_one_assembler_decodes_consecutive_batches(kind: str) -> None:
    assembler = BatchAssembler(spec(kind))
    out = []
    for i in range(3):
        for msg in encode_batch(i, make(kind, SEEDS + i), num_batches=3, chunk_bytes=64):
            got = assembler.add(msg)
            if got is not None:
                out.append(got)
    assert [b.index for b in out] == [0, 1, 2]
    assert [papers(b.data).n_id[0].item() for b in out] == [7, 8, 9]


@pytest.mark.parametrize("kind", KINDS)
def test_optional_features_and_labels(kind: str) -> None:
    batch = {k: v for k, v in make(kind).items() if k not in (name(kind, "x"), name(kind, "y"))}
    data = decode_batch(encode_batch(0, batch), spec(kind, include_features=False, include_labels=False)).data
    assert "x" not in papers(data) and "y" not in papers(data)
    x = re.escape(name(kind, "x"))
    with pytest.raises(BatchDecodeError, match=rf"tensor '{x}': expected it \(include_features is set\)"):
        decode_batch(encode_batch(0, batch), spec(kind))


def compact_form(kind: str, batch: Mapping[str, Any]) -> dict[str, Any]:
    """``batch`` as a server sends it with ``compact_indices`` (the server's own
    :func:`~sampling_server.produce.structure_tensors`, labels narrowed)."""
    if kind == "plain":
        t, et = PLAIN_NODE_TYPE, PLAIN_EDGE_TYPE
        nodes, edges = {t: list(batch["num_sampled_nodes"])}, {et: list(batch["num_sampled_edges"])}
        n_id, edge_index = {t: batch["n_id"]}, {et: batch["edge_index"]}
        y, rest = batch["y"], {k: v for k, v in batch.items() if k in ("x", "num_sampled_nodes",
                                                                        "num_sampled_edges")}
    else:
        types: dict[str, EdgeType] = {edge_type_name(e): e for e in (CITES, WRITES)}
        nodes = dict(batch["typed_sampled_nodes"])
        edges = {types[k]: v for k, v in batch["typed_sampled_edges"].items()}
        n_id = {t: batch[f"n_id/{t}"] for t in nodes}
        edge_index = {e: batch[f"edge_index/{k}"] for k, e in types.items()}
        y, rest = batch["y/paper"], {k: v for k, v in batch.items() if k.startswith("x/") or
                                     k.startswith("typed_sampled_")}
    out = SamplerOutput(input_type=TYPED.seed_type if kind == "typed" else PLAIN_NODE_TYPE, node=n_id,
                        row={e: ei[0] for e, ei in edge_index.items()},
                        col={e: ei[1] for e, ei in edge_index.items()},
                        num_sampled_nodes=nodes, num_sampled_edges=edges)

    def name(what: str, key: str | EdgeType) -> str:
        if kind == "plain":
            return what
        return f"{what}/{key if isinstance(key, str) else edge_type_name(key)}"

    return {**structure_tensors(out, name, compact_form=True), **rest,
            name("y", "paper"): compact.narrowest(y, compact.LABEL_DTYPES)}


@pytest.mark.parametrize("kind", KINDS)
def test_compact_structure_decodes_to_the_same_batch(kind: str) -> None:
    """The compact forms (narrow IDs, sources and edges per target, the edges that reach a
    new node as bits): the same batch, value for value and dtype for dtype."""
    batch = make(kind, np.arange(30), num_hops=3)
    lean = compact_form(kind, batch)
    assert name(kind, "edge_new", CITES) in lean and name(kind, "edge_index", CITES) not in lean
    assert lean[name(kind, "n_id")].dtype == torch.int32
    full = decode_batch(encode_batch(0, batch), spec(kind, num_hops=3)).data
    got = decode_batch(encode_batch(0, lean), spec(kind, num_hops=3, compact_indices=True)).data
    pairs = [(full, got)] if kind == "plain" else \
        [(full[t], got[t]) for t in full.node_types] + [(full[e], got[e]) for e in full.edge_types]
    for a, b in pairs:
        for key, value in a.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
    if kind == "plain":  # a decoder that did not ask for the compact forms refuses them
        with pytest.raises(BatchDecodeError, match=r"tensor names: expected among .*got \['edge_count"):
            decode_batch(encode_batch(0, lean), spec(kind, num_hops=3))


def test_a_plain_batch_is_the_data_of_its_one_type_hetero_data() -> None:
    """A plain batch's Data is what to_plain_data makes of the typed batch of one node type
    and one edge type with the same attributes."""
    data = decode_batch(encode_batch(0, make("plain")), spec("plain", num_hops=2)).data
    assert isinstance(data, Data)
    edge_keys = ("edge_index", "num_sampled_edges")
    typed = HeteroData()
    for key in data.keys():  # noqa: SIM118 - Data's keys() is a method of its own
        typed[PLAIN_EDGE_TYPE if key in edge_keys else PLAIN_NODE_TYPE][key] = data[key]
    again = to_plain_data(typed)
    assert isinstance(again, Data) and sorted(again.keys()) == sorted(data.keys())
    for key in data.keys():  # noqa: SIM118 - Data's keys() is a method of its own
        value = data[key]
        assert torch.equal(again[key], value) if isinstance(value, torch.Tensor) else again[key] == value, key
    with pytest.raises(ValueError, match=r"batch: expected one node type and one edge type"):
        to_plain_data(decode_batch(encode_batch(0, make("typed")), spec("typed")).data)


# ---- malformed input ---------------------------------------------------------------------


def _messages(kind: str, change: Callable[[dict[str, Any]], None] | None = None) -> list[pb.MinibatchChunk]:
    batch = make(kind)
    if change is not None:
        change(batch)
    return encode_batch(0, batch, num_batches=2, chunk_bytes=64)


def _expect_error(kind: str, messages: list[pb.MinibatchChunk], pattern: str,
                  batch_spec: BatchSpec | None = None) -> None:
    with pytest.raises(BatchDecodeError, match=pattern):
        decode_batch(messages, batch_spec or spec(kind, num_hops=2, num_batches=2))


@pytest.mark.parametrize("kind", KINDS)
def test_first_message_must_carry_the_header(kind: str) -> None:
    messages = _messages(kind)
    messages[0].ClearField("header")
    _expect_error(kind, messages, r"header: expected a MinibatchHeader on chunk 0, got none")


@pytest.mark.parametrize("kind", KINDS)
def test_missing_or_reordered_chunks_are_named(kind: str) -> None:
    messages = _messages(kind)
    _expect_error(kind, messages[1:], r"chunk_index: expected 0 \(first message of a batch\), got 1")
    _expect_error(kind, [messages[0], *messages[2:]], r"chunk_index: expected 1, got 2")
    _expect_error(kind, messages[:-1], r"expected every message of one batch, got only part of them")
    messages[1].batch_index = 1
    _expect_error(kind, messages, r"batch_index: expected 0 \(chunk 1 of \d+\), got 1")


@pytest.mark.parametrize("kind", KINDS)
def test_num_chunks_must_stay_the_same(kind: str) -> None:
    messages = _messages(kind)
    messages[1].num_chunks += 1
    _expect_error(kind, messages, r"num_chunks: expected \d+ as in chunk 0, got \d+")


@pytest.mark.parametrize("kind", KINDS)
def test_extra_messages_after_a_complete_batch_are_rejected(kind: str) -> None:
    messages = _messages(kind)
    _expect_error(kind, messages + messages[:1], r"got more after batch 0 was complete")


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_tensor_bytes_raise_codec_errors(kind: str) -> None:
    messages = _messages(kind)
    last = messages[-1].tensors[-1]
    last.data = last.data[:-1]
    with pytest.raises(codec.CodecError, match=r"expected \d+ bytes in all, got \d+ \(missing chunks\)"):
        decode_batch(messages, spec(kind))


def _set(key: str, value: object, typed_key: str | None = None, typed_value: object = None
         ) -> Callable[[str], Callable[[dict[str, Any]], None]]:
    """A change of a batch of either kind: ``key`` of a plain one, ``typed_key`` (a tensor
    name or a header field's entry, "field:entry") of a typed one."""
    def of(kind: str) -> Callable[[dict[str, Any]], None]:
        def change(batch: dict[str, Any]) -> None:
            k, v = (key, value) if kind == "plain" else (typed_key or key, value if typed_value is None
                                                          else typed_value)
            if ":" in k:
                field, entry = k.split(":")
                batch[field][entry] = v
            else:
                batch[k] = v
        return change
    return of


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("change", "batch_spec", "plain", "typed"),
    [
        (_set("num_sampled_nodes", [5, 5, 4], "typed_sampled_nodes:paper"), None,
         r"tensor 'n_id': expected sum\(num_sampled_nodes\) = 14 nodes, got 15",
         r"tensor 'n_id/paper': expected sum\(typed_sampled_nodes\['paper'\]\) = 14 nodes, got 15"),
        (_set("num_sampled_edges", [5], "typed_sampled_edges:paper__cites__paper"), None,
         r"MinibatchHeader.num_sampled_edges: expected 2 entries \(one per hop\), got 1",
         r"typed_sampled_edges\['paper__cites__paper'\]: expected 2 entries \(one per hop\), got 1"),
        (_set("num_sampled_nodes", [5, 5], "typed_sampled_nodes:author", [0, 5]), None,
         r"num_sampled_nodes: expected 3 entries \(seeds \+ one per hop\), got 2",
         r"typed_sampled_nodes\['author'\]: expected 3 entries \(seeds \+ one per hop\), got 2"),
        (_set("num_sampled_nodes", [5, -5, 15], "typed_sampled_nodes:author", [0, -5, 10]), None,
         r"MinibatchHeader: expected counts >= 0, got num_seed_nodes 5, num_sampled_nodes \[5, -5, 15\]",
         r"MinibatchHeader: expected counts >= 0, got num_seed_nodes 5, typed_sampled_nodes \{"),
        (_set("edge_index", torch.tensor([[0, 99], [1, 2]]), "edge_index/author__writes__paper"), None,
         r"tensor 'edge_index': expected shape \[2, 10\], got \[2, 2\]",
         r"tensor 'edge_index/author__writes__paper': expected shape \[2, 10\], got \[2, 2\]"),
        (_set("x", torch.zeros(15, 3), "x/paper"), None,
         r"tensor 'x': expected shape \[15, 4\], got \[15, 3\]",
         r"tensor 'x/paper': expected shape \[15, 4\], got \[15, 3\]"),
        (_set("x", torch.zeros(15, 4, dtype=torch.int32), "x/paper"), None,
         r"tensor 'x': expected dtype torch.float32", r"tensor 'x/paper': expected dtype torch.float32"),
        (_set("y", torch.zeros(15), "y/paper"), None,
         r"tensor 'y': expected dtype torch.int64", r"tensor 'y/paper': expected dtype torch.int64"),
        (_set("n_id", torch.zeros(15, dtype=torch.int32), "n_id/paper", torch.zeros(15)), None,
         r"tensor 'n_id': expected dtype torch.int64",
         r"tensor 'n_id/paper': expected dtype torch.int32 or torch.int64"),
        (_set("extra", torch.zeros(1), "x/author", torch.zeros(10, 2)), None,
         r"tensor names: expected among .*got \['extra'\]",
         r"tensor names: expected among .*got \['x/author'\]"),
        (None, BatchSpec(num_batches=3), r"num_batches: expected 3 .*got 2",
         r"num_batches: expected 3 .*got 2"),
    ],
)
def test_inconsistent_batches_name_the_field(kind: str, change: Any, batch_spec: BatchSpec | None,
                                             plain: str, typed: str) -> None:
    if batch_spec is not None and kind == "typed":
        batch_spec = BatchSpec(num_batches=3, typed=TYPED)
    messages = _messages(kind, change and change(kind))
    _expect_error(kind, messages, plain if kind == "plain" else typed, batch_spec)


@pytest.mark.parametrize("kind", KINDS)
def test_the_seeds_are_counted_first_and_only_for_their_type(kind: str) -> None:
    messages = _messages(kind)
    messages[0].header.num_seed_nodes = 6
    field = "num_sampled_nodes" if kind == "plain" else r"typed_sampled_nodes\['paper'\]"
    _expect_error(kind, messages, rf"MinibatchHeader.{field}\[0\]: expected num_seed_nodes \(6\), got \[5\]")
    if kind == "typed":
        def authors_first(batch: dict[str, Any]) -> None:
            batch["typed_sampled_nodes"]["author"] = [5, 0, 5]

        _expect_error(kind, _messages(kind, authors_first),
                      r"typed_sampled_nodes\['author'\]\[0\]: expected 0 \(the seeds are of type 'paper'\), "
                      r"got \[5\]")


def test_a_typed_header_names_each_type_once() -> None:
    def drop_author(batch: dict[str, Any]) -> None:
        del batch["typed_sampled_nodes"]["author"]

    _expect_error("typed", _messages("typed", drop_author),
                  r"MinibatchHeader.typed_sampled_nodes: expected one entry per type \['paper', 'author'\], "
                  r"got \['paper'\]")


@pytest.mark.parametrize("kind", KINDS)
def test_edge_indices_outside_the_batch_are_rejected(kind: str) -> None:
    def out_of_range(batch: dict[str, Any]) -> None:
        ei = batch[name(kind, "edge_index", CITES)].clone()
        ei[0, 3] = 15
        batch[name(kind, "edge_index", CITES)] = ei

    key = re.escape(name(kind, "edge_index", CITES))
    _expect_error(kind, _messages(kind, out_of_range),
                  rf"tensor '{key}': expected local indices in 0 .. 14, got values in 0 .. 15")
    if kind == "typed":  # a relation between two types: each row against its own type

        def author_out_of_range(batch: dict[str, Any]) -> None:
            ei = batch["edge_index/author__writes__paper"].clone()
            ei[0, 1] = 10
            batch["edge_index/author__writes__paper"] = ei

        _expect_error(kind, _messages(kind, author_out_of_range),
                      re.escape("tensor 'edge_index/author__writes__paper': expected row 0 in 0 .. 9 (local "
                                "'author' IDs), got 0 .. 10"))
