"""Link batches through the service (RemoteLinkNeighborLoader and the servers' link
epochs): seed edges, negatives, exclusion, planning across ranks, and the same batches
whatever the partitioning and after a resume. Every test runs on a plain and a typed graph
(on the typed one, seed edges between two node types)."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from graph_fixtures import KINDS, AnyGraph, mixed, typed_view
from in_process_servers import served
from torch_geometric.data import Data, HeteroData

from partitioner.graph import EdgeType
from partitioner.writer import partition_graph
from protos import sampling_pb2 as pb
from protos.channel import InvalidRequest, create_channel
from protos.epoch_call import last_chunk
from protos.fastwire import MinibatchStreamStub
from protos.plan import EPOCH_START, EpochProgress
from trainer_client.decode import BatchAssembler
from trainer_client.link_loader import RemoteLinkNeighborLoader, parse_negatives

FANOUTS = [3, 2]


def seed_type_of(kind: str, graph: AnyGraph) -> EdgeType:
    return typed_view(graph).edge_types[0] if kind == "plain" else ("author", "writes", "paper")


def edge_set(graph: AnyGraph, et: EdgeType) -> set[tuple[int, int]]:
    ei = typed_view(graph).edge_index[et]
    return set(zip(ei[0].tolist(), ei[1].tolist(), strict=True))


def seed_edges(kind: str, graph: AnyGraph, count: int = 24) -> tuple[EdgeType, torch.Tensor]:
    et = seed_type_of(kind, graph)
    ei = typed_view(graph).edge_index[et]
    pick = np.random.default_rng(1).choice(ei.shape[1], size=min(count, ei.shape[1]), replace=False)
    return et, torch.from_numpy(ei[:, pick])


def loader_of(kind: str, addresses: list[str], et: EdgeType, index: torch.Tensor,
              **kw: object) -> RemoteLinkNeighborLoader:
    arg: object = index if kind == "plain" else (et, index)
    return RemoteLinkNeighborLoader(addresses, edge_label_index=arg, num_neighbors=FANOUTS, **kw)  # type: ignore[arg-type]


def parts_of(batch: Data | HeteroData, et: EdgeType) -> tuple:
    """(edge store, source node store, destination node store) of the seed edge type."""
    if isinstance(batch, Data):
        return batch, batch, batch
    return batch[et], batch[et[0]], batch[et[2]]


def sampled_pairs(batch: Data | HeteroData, et: EdgeType) -> set[tuple[int, int]]:
    edges, src, dst = parts_of(batch, et)
    ei = edges.edge_index
    return set(zip(src.n_id[ei[0]].tolist(), dst.n_id[ei[1]].tolist(), strict=True))


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def partitioned(kind: str, tmp_path: Path, parts: int = 2, method: str = "random") -> tuple[AnyGraph, Path]:
    graph = mixed(kind, weighted=False)
    root = tmp_path / f"{method}{parts}"
    partition_graph(graph, parts, root, method=method, progress=False)
    return graph, root


def test_binary_batches_hold_the_seed_edges_and_labelled_negatives(kind: str, tmp_path: Path) -> None:
    graph, root = partitioned(kind, tmp_path)
    et, index = seed_edges(kind, graph)
    edges = edge_set(graph, et)
    n_src, n_dst = (typed_view(graph).num_nodes[t] for t in (et[0], et[2]))
    with served(root, 2) as addresses:
        for amount, strict in ((1.0, False), (2.5, True)):
            seen = []
            negatives = {"mode": "binary", "amount": amount}
            with loader_of(kind, addresses, et, index, batch_size=5, neg_sampling=negatives,
                           strict_negatives=strict) as loader:
                for batch in loader:
                    store, src, dst = parts_of(batch, et)
                    positives = store.input_id.numel()
                    negatives = int(np.ceil(positives * amount))
                    assert store.edge_label_index.shape == (2, positives + negatives)
                    labels = torch.cat([torch.ones(positives), torch.zeros(negatives)])
                    assert torch.equal(store.edge_label, labels)
                    label_index = store.edge_label_index
                    ends = torch.stack([src.n_id[label_index[0]], dst.n_id[label_index[1]]])
                    # positives: the given edges, in input_id order
                    assert torch.equal(ends[:, :positives], index[:, store.input_id])
                    neg = ends[:, positives:]
                    assert int(neg[0].min()) >= 0 and int(neg[0].max()) < n_src
                    assert int(neg[1].min()) >= 0 and int(neg[1].max()) < n_dst
                    if strict:
                        assert not {(int(a), int(b)) for a, b in neg.T} & edges
                    # the seed nodes: the distinct ends, first
                    count = src.num_sampled_nodes[0]
                    assert int(store.edge_label_index[0].max()) < count
                    seen.append(store.input_id)
            # shuffle=False: the seed edges in input order, batch after batch
            assert torch.cat(seen).tolist() == list(range(index.shape[1]))


def test_triplet_batches_draw_amount_negative_destinations_per_edge(kind: str, tmp_path: Path) -> None:
    graph, root = partitioned(kind, tmp_path)
    et, index = seed_edges(kind, graph)
    edges = edge_set(graph, et)
    with served(root, 2) as addresses, \
            loader_of(kind, addresses, et, index, batch_size=7, neg_sampling={"mode": "triplet", "amount": 3},
                      strict_negatives=True) as loader:
        for batch in loader:
            store, src, dst = parts_of(batch, et)
            positives = store.input_id.numel()
            src_index, pos, neg = src.src_index, dst.dst_pos_index, dst.dst_neg_index
            assert src_index.shape == pos.shape == (positives,) and neg.shape == (positives, 3)
            assert torch.equal(torch.stack([src.n_id[src_index], dst.n_id[pos]]), index[:, store.input_id])
            for s, row in zip(src.n_id[src_index].tolist(), dst.n_id[neg].tolist(), strict=True):
                assert not {(s, d) for d in row} & edges
            assert "edge_label_index" not in store and "edge_label" not in store


@pytest.mark.parametrize(("exclude", "seeds_of_rev"),
                         [("self", False), ("reverse", False), ("reverse", True)])
def test_excluded_seed_edges_never_reach_message_passing(kind: str, exclude: str, seeds_of_rev: bool,
                                                         tmp_path: Path) -> None:
    """Excluded seed edges, and their reverses, are never sampled; on the typed graph also
    with seed edges of a ``rev_`` type, whose reverses are its forward type's."""
    if seeds_of_rev and kind == "plain":
        pytest.skip("a plain graph has no rev_ edge type")
    graph, root = partitioned(kind, tmp_path)
    et = ("paper", "has_topic", "topic") if kind == "typed" else seed_type_of(kind, graph)
    reverse = ("topic", "rev_has_topic", "paper") if kind == "typed" else et
    if seeds_of_rev:
        et, reverse = reverse, et
    ei = typed_view(graph).edge_index[et]
    index = torch.from_numpy(ei[:, :30])
    with served(root, 2) as addresses:
        found = {False: 0, True: 0}
        for excluded in (False, True):
            with loader_of(kind, addresses, et, index, batch_size=10,
                           exclude=exclude if excluded else None) as loader:
                for batch in loader:
                    store, _, _ = parts_of(batch, et)
                    seeds = {tuple(p) for p in index[:, store.input_id].T.tolist()}
                    hits = len(sampled_pairs(batch, et) & seeds)
                    if exclude == "reverse":
                        back = {(b, a) for a, b in seeds}
                        hits += len(sampled_pairs(batch, reverse) & back)
                    found[excluded] += hits
        assert found[False] > 0  # the seed edges are sampled unless excluded
        assert found[True] == 0


def test_equal_batches_per_rank_and_every_seed_edge_once(kind: str, tmp_path: Path) -> None:
    graph, root = partitioned(kind, tmp_path)
    et, index = seed_edges(kind, graph, 23)
    with served(root, 2) as addresses:
        ids, counts = [], []
        for rank in range(3):
            with loader_of(kind, addresses, et, index, batch_size=4, shuffle=True, rank=rank, world_size=3,
                           neg_sampling="binary") as loader:
                counts.append(len(loader))
                ids.extend(parts_of(b, et)[0].input_id for b in loader)
        assert len(set(counts)) == 1
        assert sorted(torch.cat(ids).tolist()) == list(range(23))


def test_a_link_epoch_resumed_part_way_trains_every_seed_edge_once(kind: str, tmp_path: Path) -> None:
    """One step of three ranks, then the rest of the epoch from their progress: on three
    ranks the unbroken run's batches (negatives too), on two every seed edge left once."""
    graph, root = partitioned(kind, tmp_path)
    et, index = seed_edges(kind, graph, 23)
    with served(root, 2) as addresses:
        def rank_batches(world: int, start: EpochProgress, steps: int | None = None) -> list[list]:
            out = []
            for rank in range(world):
                with loader_of(kind, addresses, et, index, batch_size=2, shuffle=True, rank=rank,
                               world_size=world, neg_sampling="binary") as loader:
                    loader.set_epoch(1, start)
                    out.append(list(loader)[:steps])
                    progress = loader.progress_after(steps or 0)
            return out, progress

        whole, _ = rank_batches(3, EPOCH_START)
        first, progress = rank_batches(3, EPOCH_START, 1)
        trained = [int(i) for r in first for b in r for i in parts_of(b, et)[0].input_id]
        assert progress == EpochProgress(1, len(trained)) and len(trained) == 6
        again, _ = rank_batches(3, progress)
        for resumed, unbroken in zip(again, whole, strict=True):
            for a, b in zip(resumed, unbroken[1:], strict=True):
                _same(a, b)
        rest, _ = rank_batches(2, progress)
        assert len({len(r) for r in rest}) == 1
        trained += [int(i) for r in rest for b in r for i in parts_of(b, et)[0].input_id]
        assert sorted(trained) == list(range(23))


def _batches(kind: str, addresses: list[str], et: EdgeType, index: torch.Tensor) -> list[Data | HeteroData]:
    with loader_of(kind, addresses, et, index, batch_size=6, shuffle=True, neg_sampling="binary",
                   strict_negatives=True, exclude="self") as loader:
        loader.set_epoch(3)
        return list(loader)


def _same(a: Data | HeteroData, b: Data | HeteroData) -> None:
    for sa, sb in zip(a.stores, b.stores, strict=True):
        for key, value in sa.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, sb[key]), key


def test_batches_are_the_same_whatever_the_partitioning(kind: str, tmp_path: Path) -> None:
    graph = mixed(kind, weighted=False)
    et, index = seed_edges(kind, graph)
    runs = []
    for parts, method in ((1, "range"), (3, "random")):
        root = tmp_path / f"p{parts}"
        partition_graph(graph, parts, root, method=method, progress=False)
        with served(root, parts) as addresses:
            runs.append(_batches(kind, addresses, et, index))
    assert len(runs[0]) == len(runs[1]) > 1
    for one, three in zip(*runs, strict=True):
        _same(one, three)


def test_a_resumed_link_stream_repeats_its_batches(kind: str, tmp_path: Path) -> None:
    graph, root = partitioned(kind, tmp_path)
    et, index = seed_edges(kind, graph)
    with served(root, 2) as addresses:
        with loader_of(kind, addresses, et, index, batch_size=3, neg_sampling="binary",
                       strict_negatives=True) as loader:
            whole = list(loader)
            loader.set_epoch(1)
            request, spec = loader._request(), loader._batch_spec(len(loader))
            request.epoch = 0
            refs = loader.plan(0).rank_batches(0)
        server = refs[-1].partition
        request.resume_from = refs[-1].index
        channel = create_channel(addresses[server])
        try:
            assembler = BatchAssembler(spec)
            call = MinibatchStreamStub(channel).StreamMinibatches(request, timeout=30,
                                                                  acknowledge=last_chunk)
            got = [b for msg in call if (b := assembler.add(msg)) is not None]
        finally:
            channel.close()
        assert [b.index for b in got] == [refs[-1].index]
        resumed = got[0].data
        for key in ("edge_label_index", "edge_label"):
            store, _, _ = parts_of(resumed, et)
            assert torch.equal(store[key], parts_of(whole[-1], et)[0][key])
        assert torch.equal(parts_of(resumed, et)[1].n_id, parts_of(whole[-1], et)[1].n_id)


def test_bad_link_requests_are_refused_by_name(kind: str, tmp_path: Path) -> None:
    graph, root = partitioned(kind, tmp_path)
    et, index = seed_edges(kind, graph)
    with served(root, 2) as addresses:
        with loader_of(kind, addresses, et, index, batch_size=4) as loader:
            good = loader._request()
        cases = []
        bad = pb.EpochRequest()
        bad.CopyFrom(good)
        bad.links.negatives.mode = pb.NegativeSampling.TRIPLET
        bad.links.negatives.amount = 1.5
        cases.append((bad, "EpochRequest.links.negatives.amount: expected a whole number"))
        bad = pb.EpochRequest()
        bad.CopyFrom(good)
        bad.links.negatives.mode = pb.NegativeSampling.GIVEN
        cases.append((bad, "EpochRequest.links.negatives.mode: GIVEN needs a link split"))
        bad = pb.EpochRequest()
        bad.CopyFrom(good)
        bad.links.given.dst.CopyFrom(bad.links.given.src)
        bad.links.given.dst.shape[0] = 1
        bad.links.given.dst.data = bad.links.given.dst.data[:8]
        cases.append((bad, "EpochRequest.links.given.dst: expected"))
        bad = pb.EpochRequest()
        bad.CopyFrom(good)
        bad.global_batches = False
        cases.append((bad, "EpochRequest.global_batches: expected true with links"))
        bad = pb.EpochRequest()
        bad.CopyFrom(good)
        bad.links.split = "nope"
        cases.append((bad, "EpochRequest.links.split: expected a link split"))
        bad = pb.EpochRequest()
        bad.CopyFrom(good)
        bad.links.exclude = pb.LinkSeeds.EXCLUDE_SELF
        bad.links.reverse_edge_type = "a__b__c"
        cases.append((bad, "EpochRequest.links.reverse_edge_type: expected none"))
        channel = create_channel(addresses[0])
        try:
            for request, message in cases:
                with pytest.raises(grpc.RpcError) as info:
                    list(MinibatchStreamStub(channel).StreamMinibatches(request, timeout=30,
                                                                        acknowledge=last_chunk))
                assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                             grpc.StatusCode.FAILED_PRECONDITION), info.value.details()
                assert message in (info.value.details() or ""), info.value.details()
            # the server keeps serving
            with loader_of(kind, addresses, et, index, batch_size=4) as loader:
                assert len(list(loader)) == len(loader)
        finally:
            channel.close()
        with pytest.raises(ValueError, match="edge_label_index\\[1\\]: expected original IDs"):
            loader_of(kind, addresses, et, torch.tensor([[0], [10**6]]), batch_size=4)
        with pytest.raises(ValueError, match="neg_sampling: 'given' needs split="):
            loader_of(kind, addresses, et, index, batch_size=4, neg_sampling="given")
        with pytest.raises(InvalidRequest, match="--max-batch-size"):
            loader_of(kind, addresses, et, index, batch_size=10**7).__iter__().__next__()


def test_negative_sampling_arguments_in_pyg_forms() -> None:
    from torch_geometric.sampler import NegativeSampling
    assert parse_negatives("binary", None, False).mode == pb.NegativeSampling.BINARY
    assert parse_negatives(NegativeSampling("triplet", 4), None, False).amount == 4
    assert parse_negatives(None, 2.0, True).amount == 2.0
    with pytest.raises(ValueError, match=r"neg_sampling\.amount: expected a whole number"):
        parse_negatives({"mode": "triplet", "amount": 0.5}, None, False)
    with pytest.raises(ValueError, match="neg_sampling: expected mode one of"):
        parse_negatives("ternary", None, False)
    with pytest.raises(ValueError, match=r"neg_sampling\.weight"):
        parse_negatives(NegativeSampling("binary", 1, dst_weight=torch.ones(3)), None, False)
