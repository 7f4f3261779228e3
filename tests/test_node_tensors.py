"""Node tensors on the servers: learnable embeddings trained through the servers equal a
dense ``nn.Embedding(sparse=True)`` trained in one process (Adagrad and Adam, 1 and 2
ranks, 1 and 3 partitions, plain and typed graphs), row by row; the initial rows are the
same whatever the partitioning; a retried push adds nothing; a restore goes back to the
snapshot and a resumed run equals an unbroken one bit for bit; a server restarted with
its snapshot refuses a trainer that counted on the rows it lost, naming --resume; bad
requests are refused naming the field and change nothing; memory is limited and
reported."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from in_process_servers import server_config, serving
from prometheus_client import generate_latest

from partitioner import partition_graph
from partitioner.synthetic import generate
from protos import codec
from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.channel import GraphfeedError, ServerUnavailable
from protos.row_init import initial_rows
from sampling_server.server import create_server
from trainer_client import Cluster
from trainer_client.embeddings import RemoteEmbedding, SparseAdagrad, SparseAdam, SparseOptimizer
from trainer_client.node_tensors import RemoteNodeTensor, restore_all, row_init, snapshot_all

DIM = 8
STEPS = 4
#: Per kind: the preset, and the featureless node type the embedding is for.
KINDS = {"plain": ("small", None), "typed": ("mag-small", "author")}
OPTIMIZERS: dict[str, tuple[Callable[[list[RemoteEmbedding]], SparseOptimizer],
                            Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]]] = {
    "adagrad": (lambda p: SparseAdagrad(p, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.05),
                lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.05)),
    "adam": (lambda p: SparseAdam(p, lr=0.05), lambda p: torch.optim.SparseAdam(p, lr=0.05)),
}


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Path]:
    out = {}
    for kind, (preset, _) in KINDS.items():
        graph = generate(preset, progress=False)
        for parts in (1, 3):
            root = tmp_path_factory.mktemp(f"{kind}-{parts}")
            partition_graph(graph, parts, root, method="random", progress=False)
            out[kind, parts] = root
    return out


@pytest.fixture(scope="module")
def clusters(graphs: dict[tuple[str, int], Path], tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[dict[tuple[str, int], list[str]]]:
    """Servers of every graph, each with its own state directory."""
    with ThreadPoolExecutor(4) as pool:
        contexts = {key: serving(root, key[1], state_dir=tmp_path_factory.mktemp(f"state-{key[0]}-{key[1]}"))
                    for key, root in graphs.items()}
        entered = dict(zip(contexts, pool.map(lambda c: c.__enter__(), contexts.values()), strict=True))
    try:
        yield {key: addresses for key, (addresses, _) in entered.items()}
    finally:
        for context in contexts.values():
            context.__exit__(None, None, None)


def _batches(num_nodes: int, ranks: int, seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, per rank: distinct global IDs and a weight per row (the loss is
    ``(rows * weights).sum()``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        out.append([(torch.randperm(num_nodes, generator=g)[:num_nodes // 5],
                     torch.randn(num_nodes // 5, DIM, generator=g)) for _ in range(ranks)])
    return out


def _train_remote(addresses: list[str], node_type: str | None, optimizer: str, ranks: int, job: str,
                  batches: list[list[tuple[torch.Tensor, torch.Tensor]]], steps: range) -> None:
    """``ranks`` trainers (threads, each its own cluster) training the embedding ``job``."""
    def rank(r: int) -> None:
        with Cluster(addresses, client_id=f"{job}-rank{r}") as cluster:
            emb = RemoteEmbedding(cluster, job, DIM, node_type=node_type, init="normal", scale=0.5, seed=7,
                                  job_id=job, rank=r, world_size=ranks)
            opt = OPTIMIZERS[optimizer][0]([emb])
            for s in steps:
                nodes, weights = batches[s][r]
                opt.zero_grad()
                (emb(nodes) * weights).sum().backward()
                opt.step()
            assert emb.table is not None
            emb.table.close()

    with ThreadPoolExecutor(ranks) as pool:
        for f in [pool.submit(rank, r) for r in range(ranks)]:
            f.result(timeout=300)


def _reference(addresses: list[str], node_type: str | None, optimizer: str, ranks: int,
               batches: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> torch.Tensor:
    """The same training of a dense ``nn.Embedding(sparse=True)`` in one process, on the
    union of the ranks' batches (the loss averaged over the ranks, as DDP averages)."""
    with Cluster(addresses) as cluster:
        t = node_type or cluster.graph.target_type
        table = cluster.node_table(t)
        assert table is not None
        orig = table.orig.numpy()
    init = torch.from_numpy(initial_rows(row_init("normal", 0.5, 7), orig, (DIM,), np.float64)).float()
    emb = torch.nn.Embedding(orig.size, DIM, sparse=True)
    emb.weight.data.copy_(init)
    opt = OPTIMIZERS[optimizer][1](list(emb.parameters()))
    for step in batches:
        opt.zero_grad()
        sum((emb(nodes) * weights).sum() for nodes, weights in step).div(ranks).backward()  # type: ignore[union-attr]
        opt.step()
    return emb.weight.detach()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("parts", [1, 3])
def test_training_through_the_servers_equals_a_dense_embedding_in_one_process(
    clusters: dict[tuple[str, int], list[str]], kind: str, optimizer: str, ranks: int, parts: int
) -> None:
    addresses, node_type = clusters[kind, parts], KINDS[kind][1]
    job = f"exact-{kind}-{optimizer}-{ranks}-{parts}"
    with Cluster(addresses) as cluster:
        num_nodes = cluster.graph.num_nodes[node_type or cluster.graph.target_type]
    batches = _batches(num_nodes, ranks, seed=ranks * 10 + parts)
    _train_remote(addresses, node_type, optimizer, ranks, job, batches, range(STEPS))
    got = _read_all(addresses, job, STEPS)
    want = _reference(addresses, node_type, optimizer, ranks, batches)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    touched = torch.unique(torch.cat([n for step in batches for n, _ in step]))
    untouched = torch.ones(num_nodes, dtype=torch.bool)
    untouched[touched] = False
    assert not torch.equal(got[touched], _read_initial(addresses, node_type, num_nodes)[touched])
    assert torch.equal(got[untouched], _read_initial(addresses, node_type, num_nodes)[untouched])


def _read_all(addresses: list[str], name: str, step: int) -> torch.Tensor:
    """Every row of the node tensor ``name`` by global ID, once ``step`` steps are applied."""
    with Cluster(addresses) as cluster:
        table = RemoteNodeTensor.find(cluster, name)
        try:
            return table.read(torch.arange(table.shape[0]), after_step=step)
        finally:
            table.close()


def _read_initial(addresses: list[str], node_type: str | None, num_nodes: int) -> torch.Tensor:
    with Cluster(addresses) as cluster:
        t = node_type or cluster.graph.target_type
        table = cluster.node_table(t)
        assert table is not None
        return torch.from_numpy(initial_rows(row_init("normal", 0.5, 7), table.orig.numpy(), (DIM,),
                                             np.float64)).float()


def test_initial_rows_are_the_same_whatever_the_partitioning(
    clusters: dict[tuple[str, int], list[str]]
) -> None:
    for kind, (_, node_type) in KINDS.items():
        tables = []
        for parts in (1, 3):
            with Cluster(clusters[kind, parts]) as cluster:
                t = node_type or cluster.graph.target_type
                node_table = cluster.node_table(t)
                assert node_table is not None
                table = RemoteNodeTensor(cluster, f"init-{kind}", (2, 3), node_type=node_type,
                                         init=row_init("uniform", 0.1, 3))
                rows = table.read(torch.arange(table.shape[0]))
                order = torch.argsort(node_table.orig.to(torch.int64))
                tables.append(rows[order])  # by original ID
                table.drop()
                table.close()
        assert torch.equal(tables[0], tables[1])
        assert float(tables[0].abs().max()) <= 0.1 and float(tables[0].std()) > 0.03


# -- pushes, snapshots, restarts --------------------------------------------------------------
def _one_rank_steps(cluster: Cluster, job: str, node_type: str | None, batches: list[list[Any]],
                    steps: range, optimizer: str = "adam") -> RemoteEmbedding:
    emb = RemoteEmbedding(cluster, job, DIM, node_type=node_type, init="normal", scale=0.5, seed=7,
                          job_id=job)
    opt = OPTIMIZERS[optimizer][0]([emb])
    emb.steps = steps.start
    for s in steps:
        nodes, weights = batches[s][0]
        opt.zero_grad()
        (emb(nodes) * weights).sum().backward()
        opt.step()
    return emb


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_pushed_step_counts_once_however_often_it_is_pushed(
    clusters: dict[tuple[str, int], list[str]], kind: str
) -> None:
    addresses, node_type = clusters[kind, 3], KINDS[kind][1]
    job = f"retry-{kind}"
    with Cluster(addresses) as cluster:
        num_nodes = cluster.graph.num_nodes[node_type or cluster.graph.target_type]
        batches = _batches(num_nodes, 1, seed=5)
        emb = _one_rank_steps(cluster, job, node_type, batches, range(2))
        once = _read_all(addresses, job, 2)
        table = emb.table
        assert table is not None
        nodes, weights = batches[1][0]
        where = table.owners(nodes)
        for p in range(cluster.num_partitions):  # step 2 of rank 0, pushed again
            header = pb.RowsHeader(tensor=job, job_id=job, step=2, rank=0, world_size=1)
            reply = table._upload(p, "PushGradients", header, nodes[where[p]], weights[where[p]])
            assert reply.duplicate and reply.step == 2
        assert torch.equal(_read_all(addresses, job, 2), once)
        table.drop()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_resumed_run_equals_an_unbroken_one_bit_for_bit(
    clusters: dict[tuple[str, int], list[str]], kind: str
) -> None:
    addresses, node_type = clusters[kind, 3], KINDS[kind][1]
    with Cluster(addresses) as cluster:
        num_nodes = cluster.graph.num_nodes[node_type or cluster.graph.target_type]
        batches = _batches(num_nodes, 1, seed=9)
        _one_rank_steps(cluster, f"unbroken-{kind}", node_type, batches, range(STEPS))
        unbroken = _read_all(addresses, f"unbroken-{kind}", STEPS)
        job = f"resumed-{kind}"
        emb = _one_rank_steps(cluster, job, node_type, batches, range(2))
        infos = snapshot_all(cluster, job, 2)
        assert all(info.tensors[0].step == 2 for info in infos)
        at_snapshot = _read_all(addresses, job, 2)
        _one_rank_steps(cluster, job, node_type, batches, range(2, 3))  # a step lost with a crash
        assert not torch.equal(_read_all(addresses, job, 3), at_snapshot)
        restored = restore_all(cluster, job, 2)
        assert {info.tensors[0].step for info in restored} == {2}
        assert torch.equal(_read_all(addresses, job, 2), at_snapshot)
        with pytest.raises(GraphfeedError, match="--resume"):  # the old handle counted on step 3's rows
            emb(torch.arange(3))
        emb.refresh()
        assert emb.steps == 2
        opt = OPTIMIZERS["adam"][0]([emb])
        for s in range(2, STEPS):
            nodes, weights = batches[s][0]
            opt.zero_grad()
            (emb(nodes) * weights).sum().backward()
            opt.step()
        assert torch.equal(_read_all(addresses, job, STEPS), unbroken)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_restarted_server_reloads_its_snapshot_and_a_trainer_is_told_what_was_lost(
    graphs: dict[tuple[str, int], Path], tmp_path: Path, kind: str
) -> None:
    root, node_type = graphs[kind, 3], KINDS[kind][1]
    job = f"restart-{kind}"
    with serving(root, 3, state_dir=tmp_path) as (addresses, servers), Cluster(addresses) as cluster:
        num_nodes = cluster.graph.num_nodes[node_type or cluster.graph.target_type]
        batches = _batches(num_nodes, 1, seed=3)
        emb = _one_rank_steps(cluster, job, node_type, batches, range(2))
        snapshot_all(cluster, job, 2)
        at_snapshot = _read_all(addresses, job, 2)
        emb = _one_rank_steps(cluster, job, node_type, batches, range(2, 3))
        port = servers[1].port
        servers[1].stop(None).wait(10)
        config = server_config(root, 1, listen=f"127.0.0.1:{port}", state_dir=tmp_path)
        servers[1], _ = create_server(config)
        servers[1].set_peers(addresses)
        servers[1].start()
        assert servers[1].wait_until_serving(60)
        # the reloaded server is at the snapshot; the trainer counted on step 3's rows
        with pytest.raises(GraphfeedError, match=r"partition 1 .*step 2\).*lost.*--resume"):
            emb(torch.arange(num_nodes))
        restore_all(cluster, job, 2)  # what --resume does, with the model's checkpoint
        assert torch.equal(_read_all(addresses, job, 2), at_snapshot)


def test_a_lost_server_is_named_within_the_reconnect_time(graphs: dict[tuple[str, int], Path],
                                                          tmp_path: Path) -> None:
    root = graphs["plain", 3]
    with serving(root, 3, state_dir=tmp_path) as (addresses, servers), Cluster(addresses) as cluster:
        table = RemoteNodeTensor(cluster, "lost", DIM, reconnect=2.0)
        servers[2].stop(None).wait(10)
        started = time.monotonic()
        with pytest.raises(ServerUnavailable) as info:
            table.read(torch.arange(int(table.book[-1])))
        assert time.monotonic() - started < 30
        message = str(info.value)
        assert addresses[2] in message and "partition 2" in message and "--resume" in message
        table.close()


@pytest.mark.parametrize("kind", list(KINDS))
def test_bad_requests_are_refused_naming_the_field_and_change_nothing(
    clusters: dict[tuple[str, int], list[str]], kind: str
) -> None:
    addresses, node_type = clusters[kind, 1], KINDS[kind][1]
    job = f"bad-{kind}"
    with Cluster(addresses) as cluster:
        emb = RemoteEmbedding(cluster, job, DIM, node_type=node_type, job_id=job)
        SparseAdagrad([emb], lr=0.1)
        table = emb.table
        assert table is not None
        before = _read_all(addresses, job, 0)
        n = int(table.book[-1])
        stub = pb_grpc.NodeTensorServiceStub(cluster.channel(0))

        def status(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
            try:
                result = call()
                if isinstance(result, Iterator):
                    list(result)
            except grpc.RpcError as exc:
                return exc.code(), exc.details() or ""
            except GraphfeedError as exc:
                assert exc.code is not None
                return exc.code, exc.details
            return grpc.StatusCode.OK, ""

        def push(nodes: torch.Tensor, rows: torch.Tensor, **header: Any) -> tuple[grpc.StatusCode, str]:
            fields = {"tensor": job, "job_id": job, "step": 1, "rank": 0, "world_size": 1, **header}
            return status(lambda: table._upload(0, "PushGradients", pb.RowsHeader(**fields), nodes, rows))

        ids = torch.arange(4)
        cases = [
            (status(lambda: list(stub.ReadRows(pb.ReadRowsRequest(tensor="nope", nodes=codec.encode_tensor(
                ids.numpy())), timeout=30))), grpc.StatusCode.NOT_FOUND, "ReadRowsRequest.tensor"),
            (status(lambda: list(stub.ReadRows(pb.ReadRowsRequest(tensor=job, nodes=codec.encode_tensor(
                np.array([n + 5])), incarnation=table.incarnations[0]), timeout=30))),
             grpc.StatusCode.INVALID_ARGUMENT, "ReadRowsRequest.nodes"),
            (push(ids, torch.full((4, DIM), float("nan"))), grpc.StatusCode.INVALID_ARGUMENT,
             "RowsUpload.rows: expected finite gradients"),
            (push(ids, torch.ones(4, DIM + 1)), grpc.StatusCode.INVALID_ARGUMENT, "RowsUpload.rows: expected "
             f"shape [4, {DIM}]"),
            (push(ids, torch.ones(4, DIM), job_id="other"), grpc.StatusCode.FAILED_PRECONDITION,
             "RowsHeader.job_id"),
            (push(ids, torch.ones(4, DIM), rank=3), grpc.StatusCode.INVALID_ARGUMENT, "RowsHeader.rank"),
            (status(lambda: stub.CreateNodeTensor(pb.CreateNodeTensorRequest(spec=pb.NodeTensorSpec(
                name=job, node_type=table.spec.node_type, dims=[DIM + 1], dtype=pb.FLOAT32)), timeout=30)),
             grpc.StatusCode.ALREADY_EXISTS, f"[{table.spec.node_type or 'nodes'}, {DIM}] FLOAT32"),
            (status(lambda: stub.CreateNodeTensor(pb.CreateNodeTensorRequest(spec=pb.NodeTensorSpec(
                name="bad name!", dims=[2], dtype=pb.FLOAT32)), timeout=30)),
             grpc.StatusCode.INVALID_ARGUMENT, "NodeTensorSpec.name"),
            (status(lambda: stub.CreateNodeTensor(pb.CreateNodeTensorRequest(spec=pb.NodeTensorSpec(
                name="adam16", dims=[2], dtype=pb.FLOAT16, optimizer=pb.SparseOptimizer(
                    kind=pb.SparseOptimizer.ADAM, lr=0.1))), timeout=30)), grpc.StatusCode.INVALID_ARGUMENT,
             "NodeTensorSpec.dtype: expected FLOAT32 for a trainable tensor"),
        ]
        for (code, details), want_code, want in cases:
            assert code == want_code, details
            assert want in details, details
        assert torch.equal(_read_all(addresses, job, 0), before)  # nothing changed
        emb.table.drop()


def test_memory_is_limited_and_reported(graphs: dict[tuple[str, int], Path], tmp_path: Path) -> None:
    with serving(graphs["typed", 1], 1, state_dir=tmp_path, node_tensor_memory="1MiB") \
            as (addresses, servers), Cluster(addresses) as cluster:
        small = RemoteNodeTensor(cluster, "fits", 8, node_type="author",
                                 optimizer=pb.SparseOptimizer(kind=pb.SparseOptimizer.ADAM, lr=0.1))
        with pytest.raises(GraphfeedError, match=r"'too-big' needs .* expected at most 1.0 MiB in all "
                                                 r"\(server limit --node-tensor-memory\)"):
            RemoteNodeTensor(cluster, "too-big", 64, node_type="author")
        page = generate_latest(servers[0].metrics.registry).decode()
        rows = 6000 * 8 * 4
        metric = 'graphfeed_node_tensor_bytes{{part="{}",partition="0",tensor="fits"}} {}'
        assert metric.format("rows", float(rows)) in page
        assert metric.format("optimizer", 2.0 * rows) in page
        small.close()
