"""The compact structure of a batch (protos/compact.py, ``EpochRequest.compact_indices``):
the trainer decodes it to the same tensors as the int64 form; a client without the flag
still gets the int64 form. And the hot order (sampling_server/hot.py): deterministic,
training-reachable nodes first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from graph_fixtures import _node_data, mixed_graph, write_and_load
from test_loader import TIMEOUTS, real_servers

from partitioner.format import load_partition
from partitioner.graph import PLAIN_EDGE_TYPE, PLAIN_NODE_TYPE, GraphData
from protos import compact
from protos import sampling_pb2 as pb
from protos.assembler import TensorAssembler
from protos.channel import GraphfeedError, create_channel
from protos.codec import dtype_to_torch
from protos.epoch_call import stream_minibatches
from sampling_server.config import ConfigError, ServerConfig
from sampling_server.hot import HotNodes
from sampling_server.produce import structure_tensors
from sampling_server.sampler import SamplerOutput, batch_key, create_sampler
from sampling_server.sampler.hot_order import HOT_ORDERS, hot_order, in_degree_order, visit_scores
from sampling_server.store import PartitionStore
from trainer_client.decode import BatchAssembler, BatchDecodeError, BatchSpec, DecodedBatch
from trainer_client.loader import Cluster, RemoteNeighborLoader

FANOUTS = [5, 3]
N, E = PLAIN_NODE_TYPE, PLAIN_EDGE_TYPE


def plain_compact(n_id: torch.Tensor, row: torch.Tensor, col: torch.Tensor,
                  num_sampled_nodes: list[int]) -> dict[str, torch.Tensor]:
    """The compact structure tensors of a plain batch, as a server names them."""
    out = SamplerOutput(input_type=N, node={N: n_id}, row={E: row}, col={E: col},
                        num_sampled_nodes={N: num_sampled_nodes},
                        num_sampled_edges={E: [int(row.numel())] + [0] * (len(num_sampled_nodes) - 2)})
    return {k: torch.as_tensor(v) for k, v in structure_tensors(out, lambda kind, _: kind, True).items()}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    out = tmp_path_factory.mktemp("compact") / "small-2"
    with real_servers(out, num_parts=2) as addresses:
        Cluster(addresses, connect_timeout=60).close()  # waits until every server serves
        yield out, addresses


# ---- the encoding itself ---------------------------------------------------------------


def test_narrowest_picks_the_smallest_dtype_that_holds_every_value() -> None:
    assert compact.narrowest(torch.tensor([0, 2**31 - 1]), compact.INDEX_DTYPES).dtype == torch.int32
    assert compact.narrowest(torch.tensor([0, 2**31]), compact.INDEX_DTYPES).dtype == torch.int64
    assert compact.narrowest(torch.tensor([-1, 46]), compact.LABEL_DTYPES).dtype == torch.int8
    assert compact.narrowest(torch.tensor([-1, 128]), compact.LABEL_DTYPES).dtype == torch.int16
    assert compact.narrowest(torch.tensor([0, 255]), compact.COUNT_DTYPES).dtype == torch.uint8
    assert compact.narrowest(torch.tensor([0, 256]), compact.COUNT_DTYPES).dtype == torch.int16
    assert compact.narrowest(torch.empty(0, dtype=torch.int64), compact.INDEX_DTYPES).dtype == torch.int32
    values = torch.tensor([-1, 0, 5, 46, -1])
    assert torch.equal(compact.widen(compact.narrowest(values, compact.LABEL_DTYPES)), values)


@pytest.mark.parametrize("num", [0, 1, 7, 8, 9, 1000])
def test_masks_round_trip_through_packed_bits(num: int) -> None:
    mask = torch.from_numpy(np.random.default_rng(num).random(num) < 0.4)
    bits = compact.pack_mask(mask)
    assert bits.dtype == torch.uint8 and bits.numel() == (num + 7) // 8
    assert torch.equal(compact.unpack_mask(bits, num), mask)
    if num:
        assert bool(bits[0] & 1) == bool(mask[0])  # node 0 in the least significant bit
    with pytest.raises(ValueError, match=r"expected uint8 of shape \[\d+\]"):
        compact.unpack_mask(torch.zeros(num // 8 + 2, dtype=torch.uint8), num)


def test_sampled_edges_round_trip_through_sources_and_counts(tmp_path: Path) -> None:
    part = write_and_load(mixed_graph(200, seed=4), tmp_path / "g", 1)[0]
    sampler = create_sampler(part, device="cpu")
    seeds = np.asarray(part.splits["train"])[:16]
    for i in range(3):
        out = sampler.sample(seeds, N, [4, 3, 2], batch_key(1, 0, 0, i))
        named = {k: torch.as_tensor(v) for k, v in structure_tensors(out, lambda kind, _: kind, True).items()}
        n_id, row = out.node[N], out.row[E]
        assert set(named) == {"n_id", "edge_src", "edge_new", "edge_count"}
        assert named["n_id"].dtype == named["edge_src"].dtype == torch.int32
        assert named["edge_count"].dtype == named["edge_new"].dtype == torch.uint8
        assert named["edge_count"].numel() == n_id.numel() - out.num_sampled_nodes[N][-1]
        num_new = n_id.numel() - out.batch_size
        assert named["edge_src"].numel() == row.numel() - num_new  # only the repeats
        src = compact.expand_sources(named["edge_src"], named["edge_new"], row.numel(), out.batch_size)
        edge_index = compact.expand_edges(src, named["edge_count"])
        assert edge_index.dtype == torch.int64 and torch.equal(edge_index, out.edge_index(E))
        assert torch.equal(compact.widen(named["n_id"]), n_id)


def test_sources_not_numbered_by_first_reach_travel_whole() -> None:
    # node 3 is reached before node 2: no "edge_new", every source in "edge_src"
    named = plain_compact(torch.arange(4), torch.tensor([3, 2, 0]), torch.tensor([0, 1, 1]),
                                  [2, 2])
    assert set(named) == {"n_id", "edge_src", "edge_count"}
    assert named["edge_src"].tolist() == [3, 2, 0]
    named = plain_compact(torch.arange(4), torch.tensor([2, 0, 3, 2]), torch.tensor([0, 0, 1, 1]),
                                  [2, 2])
    assert named["edge_src"].tolist() == [0, 2]
    src = compact.expand_sources(named["edge_src"], named["edge_new"], 4, 2)
    assert src.tolist() == [2, 0, 3, 2]
    with pytest.raises(ValueError, match=r"expected 2 entries in edge_src \(the edges not marked"):
        compact.expand_sources(torch.tensor([0]), named["edge_new"], 4, 2)


def _sources_by_numpy(row: torch.Tensor, num_seeds: int, num_nodes: int) -> dict[str, torch.Tensor]:
    """The rule of "edge_new" in whole-array NumPy passes (the reference for the kernel)."""
    src = row.numpy()
    before = np.maximum.accumulate(np.concatenate([[num_seeds - 1], src[:-1]])) if src.size else src
    new = src > before
    if int(new.sum()) == num_nodes - num_seeds and \
            np.array_equal(src[new], np.arange(num_seeds, num_nodes, dtype=src.dtype)):
        return {"edge_src": compact.narrowest(row[torch.from_numpy(~new)], compact.INDEX_DTYPES),
                "edge_new": compact.pack_mask(torch.from_numpy(new))}
    return {"edge_src": compact.narrowest(row, compact.INDEX_DTYPES)}


@pytest.mark.parametrize("seed", range(6))
def test_the_one_pass_source_split_equals_the_whole_array_rule(seed: int) -> None:
    """Random first-reach numberings (most valid, some broken by a swap, a gap or a
    number reached twice) and the edge cases: no edges, no new nodes, one edge."""
    rng = np.random.default_rng(seed)
    cases = [(torch.zeros(0, dtype=torch.int64), 3, 3), (torch.zeros(0, dtype=torch.int64), 3, 4),
             (torch.tensor([0, 1, 2]), 3, 3), (torch.tensor([3]), 3, 4), (torch.tensor([4]), 3, 5)]
    for _ in range(40):
        num_seeds, num_new = int(rng.integers(1, 50)), int(rng.integers(0, 200))
        num_nodes = num_seeds + num_new
        edges = np.concatenate([np.arange(num_seeds, num_nodes),
                                rng.integers(0, num_nodes, int(rng.integers(0, 300)))])
        row = np.empty_like(edges)
        # first reaches in order, the repeats anywhere after the node's first reach
        order = np.sort(rng.choice(edges.size, num_new, replace=False)) if num_new else np.zeros(0, int)
        others = np.setdiff1d(np.arange(edges.size), order)
        row[order] = np.arange(num_seeds, num_nodes)
        for i in others:
            reached = num_seeds + int(np.searchsorted(order, i))  # nodes numbered before edge i
            row[i] = rng.integers(0, reached)
        broken = rng.integers(0, 4)
        if broken == 1 and num_new >= 2:
            row[order[0]], row[order[1]] = row[order[1]], row[order[0]]
        elif broken == 2 and num_new:
            row[order[-1]] += 1
        cases.append((torch.from_numpy(row), num_seeds, num_nodes))
    for row, num_seeds, num_nodes in cases:
        got = compact._sources(row, num_seeds, num_nodes)
        want = _sources_by_numpy(row, num_seeds, num_nodes)
        assert set(got) == set(want), (row, num_seeds, num_nodes)
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
        if "edge_new" in got:  # and back, in one pass, as the whole-array rule expands it
            expanded = compact.expand_sources(got["edge_src"], got["edge_new"], row.numel(), num_seeds)
            assert torch.equal(expanded, _expand_by_numpy(got["edge_src"], got["edge_new"],
                                                          row.numel(), num_seeds))
            assert torch.equal(expanded, row)


def _expand_by_numpy(src: torch.Tensor, bits: torch.Tensor, num_edges: int,
                     num_seeds: int) -> torch.Tensor:
    """The expansion in whole-array NumPy passes (the reference for the kernel)."""
    new = compact.unpack_mask(bits, num_edges).numpy()
    out = np.empty(num_edges, dtype=np.int64)
    out[new] = np.arange(num_seeds, num_seeds + int(new.sum()), dtype=np.int64)
    out[~new] = src.numpy()
    return torch.from_numpy(out)


def test_expanding_sources_names_what_does_not_fit() -> None:
    bits = compact.pack_mask(torch.tensor([True, False, True, False]))
    assert compact.expand_sources(torch.tensor([0, 1], dtype=torch.int32), bits, 4, 2).tolist() \
        == [2, 0, 3, 1]
    for src in (torch.tensor([0]), torch.tensor([0, 1, 2])):  # too few, too many
        with pytest.raises(ValueError, match=r"expected 2 entries in edge_src \(the edges not marked"):
            compact.expand_sources(src, bits, 4, 2)
    with pytest.raises(ValueError, match=r"expected uint8 of shape \[1\]"):
        compact.expand_sources(torch.tensor([0, 1]), torch.zeros(2, dtype=torch.uint8), 4, 2)


def test_edges_out_of_target_order_travel_as_an_edge_index() -> None:
    n_id = torch.arange(4)
    named = plain_compact(n_id, torch.tensor([2, 3]), torch.tensor([1, 0]), [2, 2])
    assert set(named) == {"n_id", "edge_index"} and named["edge_index"].dtype == torch.int32
    assert named["edge_index"].tolist() == [[2, 3], [1, 0]]
    with pytest.raises(ValueError, match="summing to the 3 entries of edge_src, got a sum of 2"):
        compact.expand_edges(torch.tensor([1, 2, 3]), torch.tensor([1, 1]))


# ---- through real servers ----------------------------------------------------------------


def _request(compact_indices: bool, world_size: int = 1) -> pb.EpochRequest:
    return pb.EpochRequest(
        split="train", fanouts=FANOUTS, batch_size=64, shuffle=True, seed=5, world_size=world_size,
        feature_dtype=pb.BFLOAT16, include_features=True, include_labels=True,
        include_original_ids=True, compact_indices=compact_indices, cache_counts=[40, 40])


def _stream(address: str, request: pb.EpochRequest) -> Iterator[tuple[dict[str, torch.dtype], DecodedBatch]]:
    """Each batch's wire dtypes and its decoded form, through the generated stubs."""
    spec = BatchSpec(num_hops=len(FANOUTS), compact_indices=request.compact_indices)
    with create_channel(address) as channel:
        assembler, dtypes = BatchAssembler(spec), {}
        for msg in stream_minibatches(channel, request, timeout=60):
            dtypes.update({t.name: dtype_to_torch(t.dtype) for t in msg.tensors})
            batch = assembler.add(msg)
            if batch is not None:
                yield dtypes, batch
                dtypes = {}


def test_compact_batches_decode_to_the_int64_batches(servers: tuple[Path, list[str]]) -> None:
    _, addresses = servers
    count = 0
    for address in addresses:
        plain = _stream(address, _request(False))
        lean = _stream(address, _request(True))
        for (old_dtypes, a), (new_dtypes, b) in zip(plain, lean, strict=True):
            assert old_dtypes == {"n_id": torch.int64, "edge_index": torch.int64, "x": torch.bfloat16,
                                  "y": torch.int64, "orig_id": torch.int64, "x_cached": torch.bool}
            assert new_dtypes == {"n_id": torch.int32, "edge_src": torch.int32, "edge_count": torch.uint8,
                                  "edge_new": torch.uint8,
                                  "x": torch.bfloat16, "y": torch.int8, "orig_id": torch.int32,
                                  "x_cached": torch.uint8}
            assert b.nbytes < a.nbytes
            for key in ("n_id", "internal_n_id", "edge_index", "y", "x_cached"):
                assert a.data[key].dtype == b.data[key].dtype, key
                assert torch.equal(a.data[key], b.data[key]), key
            assert a.data.edge_index.dtype == a.data.n_id.dtype == a.data.y.dtype == torch.int64
            assert torch.equal(a.data.x.view(torch.int16), b.data.x.view(torch.int16))
            count += 1
    assert count > 2


def test_an_old_decoder_rejects_compact_tensors_it_did_not_ask_for(servers: tuple[Path, list[str]]) -> None:
    _, addresses = servers
    request = _request(True)
    with create_channel(addresses[0]) as channel:
        messages = list(stream_minibatches(channel, request, timeout=60))
    first = [m for m in messages if m.batch_index == messages[0].batch_index]
    old = BatchAssembler(BatchSpec())
    names = r"tensor names: expected among .*'edge_count', 'edge_new', 'edge_src'"
    with pytest.raises(BatchDecodeError, match=names):
        for m in first:
            old.add(m)
    tensors = TensorAssembler()
    for m in first:
        tensors.add_all(m.tensors)
    assert "edge_index" not in tensors.finish_torch()


def test_the_loader_yields_the_same_batches_with_compact_batches_and_the_node_table(
        servers: tuple[Path, list[str]]) -> None:
    _, addresses = servers
    args = {"num_neighbors": FANOUTS, "batch_size": 64, "shuffle": True, "cache_size": 0.25,
            "return_internal_ids": True, **TIMEOUTS}
    with Cluster(addresses, connect_timeout=30) as cluster:
        lean = RemoteNeighborLoader(cluster, "train", **args)
        plain = RemoteNeighborLoader(cluster, "train", compact_indices=False, **args)
        request = lean._request()
        assert request.compact_indices and not request.include_original_ids and not request.include_labels
        assert set(lean.node_tables) == {PLAIN_NODE_TYPE} and not plain.node_tables
        table = lean.node_tables[PLAIN_NODE_TYPE]
        assert table.orig.dtype == torch.int32 and table.labels.dtype == torch.int8
        count = 0
        for a, b in zip(lean, plain, strict=True):
            for key in ("n_id", "internal_n_id", "edge_index", "y", "x"):
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
            assert a.edge_index.dtype == a.n_id.dtype == a.y.dtype == torch.int64
            count += 1
        assert count == len(lean) > 1
        assert lean.last_stats.bytes < 0.8 * plain.last_stats.bytes
        without_cache = RemoteNeighborLoader(cluster, "train", **{**args, "cache_size": 0})
        assert not without_cache.node_tables and without_cache._request().include_original_ids


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("labels", [True, False])
def test_the_node_table_looks_batches_up_as_take_does(table_dtype: torch.dtype, id_dtype: torch.dtype,
                                                      labels: bool) -> None:
    from torch_geometric.data import Data

    from trainer_client.node_table import NodeTable, NodeTableError

    g = torch.Generator().manual_seed(3)
    orig = torch.randperm(5000, generator=g).to(table_dtype) * 7
    ys = torch.randint(-1, 40, (5000,), generator=g, dtype=torch.int8)
    table = NodeTable(orig, ys)
    n_id = torch.randint(0, 5000, (1234,), generator=g).to(id_dtype)
    data = Data(n_id=n_id)
    table.complete(data, labels)
    assert data.internal_n_id is n_id
    assert data.n_id.dtype == torch.int64 and torch.equal(data.n_id, orig.long()[n_id.long()])
    assert (data.y.dtype == torch.int64 and torch.equal(data.y, ys.long()[n_id.long()])) if labels \
        else "y" not in data
    for bad in (5000, -1):
        ids = n_id.clone()
        ids[17] = bad
        broken = Data(n_id=ids)
        with pytest.raises(NodeTableError, match=rf"tensor 'n_id': expected node IDs in 0 \.\. 4999 "
                                                 rf"\(the graph's\), got {bad} at position 17"):
            table.complete(broken, labels)
        assert broken.n_id is ids and "internal_n_id" not in broken  # left as it was


def test_owned_ranges_outside_the_partition_are_refused(servers: tuple[Path, list[str]]) -> None:
    _, addresses = servers
    with Cluster(addresses, connect_timeout=30) as cluster:
        start, stop = (int(v) for v in cluster.graph.books[PLAIN_NODE_TYPE][1:3])
        owned = "owned_range: expected global node IDs owned"
        for first, count, pattern in [(start, stop - start + 1, owned),
                                      (0, 1, "owned_range: expected global node IDs owned by partition 1"),
                                      (start, 1 << 22, r"owned_range.count: expected 0 \.\. 2097152")]:
            request = pb.LookupNodesRequest(owned_range=pb.NodeRange(first=first, count=count))
            with pytest.raises(GraphfeedError, match=pattern) as info:
                cluster.lookup(1, request)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


# ---- the hot order -------------------------------------------------------------------------


def test_the_hot_order_is_deterministic(servers: tuple[Path, list[str]]) -> None:
    out, _ = servers
    for p in range(2):
        a, b = hot_order(load_partition(out, p), N), hot_order(load_partition(out, p, mmap=False), N)
        part = load_partition(out, p)
        start, stop = part.node_range(N)
        assert a.dtype == np.int64 and np.array_equal(a, b)
        assert np.array_equal(np.sort(a), np.arange(start, stop))  # a permutation of the owned nodes
        assert np.array_equal(hot_order(part, N, "in_degree_v1"),
                              in_degree_order([part.indptr[E]], start, stop - start))
    with pytest.raises(ValueError, match="rule: expected one of"):
        hot_order(part, N, "pagerank")


def test_nodes_no_training_node_reaches_come_after_those_it_does(tmp_path: Path) -> None:
    # training node 0 <- 1 <- 2 <- 3 (a chain of in-edges); hub 10 with 20 in-neighbors,
    # highest in-degree, unreachable from node 0
    src = np.array([1, 2, 3, *range(11, 31)], dtype=np.int64)
    dst = np.array([0, 1, 2, *[10] * 20], dtype=np.int64)
    graph = GraphData(name="hub", num_nodes=31, edge_index=np.stack([src, dst]), num_classes=2,
                      splits={"train": np.array([0], dtype=np.int64)}, **_node_data(31, 3, 2))
    part = write_and_load(graph, tmp_path / "hub", 1)[0]
    assert in_degree_order([part.indptr[E]], 0, 31)[0] == 10
    order = hot_order(part, N)
    assert order[:5].tolist() == [0, 1, 2, 3, 10]  # reached (by score), then by in-degree


def test_every_node_a_batch_holds_has_a_positive_score(tmp_path: Path) -> None:
    part = write_and_load(mixed_graph(300, seed=2), tmp_path / "g", 1)[0]
    sampler = create_sampler(part, device="cpu")
    train = np.asarray(part.splits["train"])
    score = visit_scores(part, fanouts=(2, 2), batch=2)[N]
    assert np.array_equal(score, visit_scores(part, (2, 2), 2)[N])
    assert 0 < int((score > 0).sum()) < part.num_nodes(N)
    seen = np.zeros(part.num_nodes(N), dtype=bool)
    for i in range(40):
        seeds = np.random.default_rng(i).choice(train, size=2, replace=False)
        seen[sampler.sample(seeds, N, [2, 2], batch_key(0, 0, 0, i)).node[N].numpy()] = True
    assert (score[seen] > 0).all()
    assert (score[train] >= 2 / train.size).all()


def test_a_server_ranks_by_the_rule_its_config_names(servers: tuple[Path, list[str]]) -> None:
    out, addresses = servers
    with pytest.raises(ConfigError, match=r"hot_order: expected one of \['visits_v1', 'in_degree_v1'\]"):
        ServerConfig(partition_dir=out, partition=0, hot_order="pagerank")
    for rule in HOT_ORDERS:
        store = PartitionStore(ServerConfig(partition_dir=out, partition=1, hot_order=rule, device="cpu",
                                            peers=tuple(addresses)))
        store.load()
        assert store.cluster_info().hot_order == rule
        order = HotNodes(store, N, lambda: None).own_order()
        assert np.array_equal(order, hot_order(load_partition(out, 1), N, rule))
    assert not np.array_equal(hot_order(load_partition(out, 1), N, "visits_v1"),
                              hot_order(load_partition(out, 1), N, "in_degree_v1"))
