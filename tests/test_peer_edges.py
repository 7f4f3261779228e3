"""The peer wire carries internal edge IDs, on both kinds of graph: a peer asked for them
(``SampleNeighborsRequest.want_edges``) answers the edge IDs its own sampler draws, with
the same neighbors as without; a batch drawn through real peer servers has the edge IDs
of one drawn through in-process peers; a peer older than edge IDs, which answers
without them, is a clear error."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import grpc
import numpy as np
import pytest
import torch
from graph_fixtures import AnyGraph, assert_same_batch, check_edge_ids, write_and_load
from in_process_servers import served

from partitioner.graph import edge_type_name
from partitioner.partition import Partition
from protos import codec, fastwire
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.channel import PeerError, server_options
from sampling_server.peer_client import PeerCallOptions, PeerClient, PeerRemote
from sampling_server.sampler import CpuNeighborSampler, InProcessPeers, Minibatch, batch_key


class Cluster(NamedTuple):
    """Two random partitions of the graph and their servers' addresses."""

    parts: list[Partition]
    addresses: list[str]


@pytest.fixture(scope="module")
def cluster(graph: AnyGraph, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("peer-edges")
    parts = write_and_load(graph, root, 2, method="random")
    with served(root, 2) as addresses:
        yield Cluster(parts, addresses)


def _name(part: Partition, et: tuple[str, str, str]) -> str:
    """How the wire names a relation: not at all on a plain graph."""
    return edge_type_name(et) if part.manifest.typed else ""


@pytest.mark.parametrize(("replace", "weighted"), [(False, False), (True, True)],
                         ids=["uniform", "weighted-replace"])
def test_a_peer_answers_the_edge_ids_of_its_draws(cluster: Cluster, replace: bool, weighted: bool) -> None:
    parts = cluster.parts
    client = PeerClient(cluster.addresses, 0, timeout=20.0)
    own = CpuNeighborSampler(parts[1], replace=replace, weighted=weighted)
    options = PeerCallOptions(replace=replace, weighted=weighted)
    try:
        for et, (fanout, hop) in itertools.product(parts[1].edge_types, [(3, 0), (-1, 1)]):
            nodes = torch.arange(*parts[1].node_range(et[2]))
            key = batch_key(3, 0, 0, hop)
            want = own.sample_relation(et, nodes, fanout, key, hop, edges=True)
            got = client.neighbors({1: nodes}, fanout, key, hop, options, _name(parts[1], et), edges=True)[1]
            assert torch.equal(got.counts, want.counts) and torch.equal(got.neighbors, want.neighbors)
            assert got.edges is not None and want.edges is not None and torch.equal(got.edges, want.edges)
            assert want.edges.numel() == 0 or int(want.edges.min()) >= parts[1].edge_start[et] > 0
            plain = client.neighbors({1: nodes}, fanout, key, hop, options, _name(parts[1], et))[1]
            assert plain.edges is None and torch.equal(plain.neighbors, want.neighbors)
    finally:
        client.close()


def test_a_batch_through_peer_servers_has_the_in_process_edge_ids(cluster: Cluster) -> None:
    parts = cluster.parts
    client = PeerClient(cluster.addresses, 0, timeout=20.0)
    remote = PeerRemote(client, PeerCallOptions(), parts[0].manifest.typed, frozenset(parts[0].x))
    samplers = [CpuNeighborSampler(p) for p in parts]
    t = parts[0].target_type
    seeds = np.arange(*parts[0].node_range(t))[:12]
    try:
        for key in range(3):
            got = samplers[0].sample(seeds, t, [3, 2], key, remote, edges=True)
            want = samplers[0].sample(seeds, t, [3, 2], key, InProcessPeers(samplers), edges=True)
            assert_same_batch(Minibatch(got, t), Minibatch(want, t))
            check_edge_ids(got, parts)
    finally:
        client.close()


class _OlderPeer(pb_grpc.PeerServiceServicer):
    """A peer from before edge IDs: it knows no ``want_edges`` and answers the draws alone."""

    def __init__(self, sampler: CpuNeighborSampler) -> None:
        self.sampler = sampler

    def SampleNeighbors(self, request: pb.SampleNeighborsRequest,
                        context: grpc.ServicerContext) -> Iterator[pb.SampleNeighborsChunk]:
        nodes = torch.from_numpy(codec.decode_tensor(request.nodes).astype(np.int64))
        drawn = self.sampler.sample_relation(self.sampler.edge_types[0], nodes, request.fanout,
                                             request.random_seed, request.hop)
        raw = fastwire.encode_chunks(lambda i, n: pb.SampleNeighborsChunk(chunk_index=i, num_chunks=n),
                                     {"counts": drawn.counts, "neighbors": drawn.neighbors})
        return iter([pb.SampleNeighborsChunk.FromString(r) for r in raw])


def test_an_older_peer_without_edge_ids_is_a_clear_error(graph: AnyGraph, tmp_path: Path) -> None:
    parts = write_and_load(graph, tmp_path, 2)
    server = grpc.server(ThreadPoolExecutor(2), options=server_options())
    pb_grpc.add_PeerServiceServicer_to_server(_OlderPeer(CpuNeighborSampler(parts[1])), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = PeerClient(["127.0.0.1:1", f"127.0.0.1:{port}"], 0, timeout=10.0)
    et = parts[1].edge_types[0]
    nodes = {1: torch.arange(*parts[1].node_range(et[2]))}
    try:
        assert client.neighbors(nodes, 3, 1, 0, edge_type=_name(parts[1], et))[1].edges is None
        with pytest.raises(PeerError, match=r"peer partition 1 .*SampleNeighborsChunk\.tensors: expected "
                                            r"\"edges\" .*want_edges.*older than edge IDs") as info:
            client.neighbors(nodes, 3, 1, 0, edge_type=_name(parts[1], et), edges=True)
        assert info.value.partition == 1
    finally:
        client.close()
        server.stop(None)


def test_a_peer_tests_the_pairs_it_owns_and_refuses_others_by_field(cluster: Cluster) -> None:
    """``HasEdges``: whether each pair is an edge, as the owner's own sampler says (its
    in-edges and random pairs); a destination owned elsewhere is refused by field."""
    parts = cluster.parts
    client = PeerClient(cluster.addresses, 0, timeout=20.0)
    own = CpuNeighborSampler(parts[1])
    rng = np.random.default_rng(0)
    try:
        for et in parts[1].edge_types:
            (start, stop), n_src = parts[1].node_range(et[2]), int(own.books[et[0]][-1])
            indptr = np.asarray(parts[1].indptr[et])
            real_dst = start + np.repeat(np.arange(stop - start), np.diff(indptr))
            src = np.concatenate([np.asarray(parts[1].indices[et])[:40], rng.integers(0, n_src, 40)])
            dst = np.concatenate([real_dst[:40], rng.integers(start, stop, 40)])
            got = client.has_edges({1: (src, dst)}, _name(parts[1], et))[1]
            want = own.has_edges_local(et, src, dst)
            assert np.array_equal(got, want) and bool(got[:min(40, real_dst.size)].all())
            elsewhere = np.array([parts[0].node_range(et[2])[0]])
            with pytest.raises(PeerError, match=r"HasEdgesRequest\.dst: expected .* owned by partition 1"):
                client.has_edges({1: (src[:1], elsewhere)}, _name(parts[1], et))
    finally:
        client.close()
