"""The trainer's side on a real CUDA device: batches decoded onto the GPU (pinned staging),
the trainer-side hot-feature cache in GPU memory (fractions and ``"auto"``), and the same
bits as a CPU loader's. Real CPU servers on the ``small`` synthetic graph; every test is
``gpu``-marked (skipped without a usable GPU, see ``conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from test_feature_cache import ARGS, _raw
from test_loader import real_servers

from protos.assembler import TensorAssembler
from trainer_client.loader import Cluster, RemoteNeighborLoader

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    out = tmp_path_factory.mktemp("gpu-trainer") / "small-2"
    with real_servers(out, num_parts=2) as addresses:
        yield addresses


@pytest.mark.parametrize("cache_size", [0, 0.3, "auto"])
@pytest.mark.parametrize(("dtype", "cast"), [("float32", True), ("bfloat16", False),
                                             ("bfloat16", True)])
def test_cuda_batches_equal_cpu_batches_bit_for_bit(servers: list[str], cache_size: float | str,
                                                    dtype: str, cast: bool) -> None:
    with Cluster(servers, connect_timeout=30) as cluster:
        cpu = RemoteNeighborLoader(cluster, "train", feature_dtype=dtype, cast_features=cast,
                                   cache_size=0, device="cpu", **ARGS)
        gpu = RemoteNeighborLoader(cluster, "train", feature_dtype=dtype, cast_features=cast,
                                   cache_size=cache_size, device="cuda", **ARGS)
        if cache_size == 0:
            assert gpu.cache is None
        else:
            assert gpu.cache is not None and gpu.cache.rows.device.type == "cuda"
            if cache_size == "auto":  # the small graph fits: every row is cached
                assert gpu.cache.num_rows == cluster.info.num_nodes
        for epoch in range(2):
            cpu.set_epoch(epoch)
            gpu.set_epoch(epoch)
            count = 0
            for a, b in zip(cpu, gpu, strict=True):
                for key in ("x", "edge_index", "y", "n_id"):
                    assert b[key].device.type == "cuda", key
                assert torch.equal(a.n_id, b.n_id.cpu())
                assert torch.equal(a.edge_index, b.edge_index.cpu())
                assert torch.equal(a.y, b.y.cpu())
                assert a.x.dtype == b.x.dtype
                assert torch.equal(_raw(a.x), _raw(b.x.cpu()))
                count += 1
            assert count == len(cpu) > 1
            if cache_size != 0:
                assert gpu.last_stats.hit_rate > 0
                assert gpu.last_stats.bytes < cpu.last_stats.bytes


def test_a_gpu_loader_trains_a_model_on_the_gpu(servers: list[str]) -> None:
    from torch_geometric.nn import GraphSAGE

    with Cluster(servers, connect_timeout=30) as cluster:
        loader = RemoteNeighborLoader(cluster, "train", feature_dtype="bfloat16", device="cuda",
                                      **ARGS)
        model = GraphSAGE(cluster.info.feature_dim, 32, 2, cluster.info.num_classes).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        losses = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            total = 0.0
            for batch in loader:
                opt.zero_grad()
                out = model(batch.x, batch.edge_index)[:batch.batch_size]
                loss = torch.nn.functional.cross_entropy(out, batch.y[:batch.batch_size])
                loss.backward()
                opt.step()
                total += loss.item()
            losses.append(total)
        assert losses[-1] < losses[0]


def test_pieces_are_decoded_straight_into_pinned_memory() -> None:
    from protos import codec

    x = torch.randn(4000, 300)
    assembler = TensorAssembler(background_copies=True, pinned=True)
    for group in codec.split_tensors({"x": x}, 1 << 20):
        assembler.add_all(group)
    out = assembler.finish_torch()["x"]
    assert out.is_pinned() and torch.equal(out, x)
    moved = out.to("cuda", non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(moved.cpu(), x)
