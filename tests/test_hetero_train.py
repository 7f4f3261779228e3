"""Typed models (R-GCN, to_hetero GraphSAGE), the in-process typed batch source (the same
batches as the servers stream) and the trainer's typed path (``graphfeed-train`` on typed
servers and with ``--partition-dir``, one process and 2 DDP ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_hetero_service import served
from test_loader import TIMEOUTS

from partitioner.hetero import HeteroGraphData
from partitioner.hetero_synthetic import HeteroPreset, _mag_relations, generate_hetero
from partitioner.hetero_writer import partition_hetero_graph
from trainer_client import train
from trainer_client.hetero_models import (
    RGCN,
    HeteroMeta,
    HeteroSAGE,
    build_hetero_model,
    hetero_batch_inputs,
    layer_plan,
)
from trainer_client.hetero_source import InProcessHeteroLoader, LocalHeteroGraph
from trainer_client.loader import RemoteNeighborLoader

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")

#: An ogbn-mag-shaped graph of a few hundred papers (all four relations, reverses added).
MINI = HeteroPreset(
    num_nodes={"paper": 300, "author": 400, "institution": 12, "field_of_study": 40},
    relations=_mag_relations(2_400, 1_800, 2_400, 380, homophily=0.5),
    target_type="paper", feature_dim=8, num_classes=4, feature_signal=0.6,
    split_sizes=(160, 60, 60), max_weight_ratio=20.0,
)


@pytest.fixture(scope="module")
def mini(tmp_path_factory: pytest.TempPathFactory) -> tuple[HeteroGraphData, Path]:
    graph = generate_hetero(MINI, seed=0, progress=False).add_reverse()
    root = tmp_path_factory.mktemp("mini") / "parts-2"
    partition_hetero_graph(graph, 2, root, method="metis", progress=False)
    return graph, root


@pytest.fixture(scope="module")
def local(mini: tuple[HeteroGraphData, Path]) -> LocalHeteroGraph:
    return LocalHeteroGraph(mini[1])


def test_layer_plan_computes_only_what_reaches_the_target(local: LocalHeteroGraph) -> None:
    plan = layer_plan(local.meta, 2)
    last_relations, last_outputs = plan[1]
    assert last_outputs == ["paper"]
    assert {et[2] for et in last_relations} == {"paper"}
    first_relations, first_outputs = plan[0]
    # institution -> author -> paper: institutions feed layer 0, but no layer outputs them
    assert "institution" not in first_outputs
    assert ("author", "affiliated_with", "institution") not in first_relations
    assert ("institution", "rev_affiliated_with", "author") in first_relations


@pytest.mark.parametrize("name", ["rgcn", "hetero-sage"])
def test_every_rgcn_parameter_gets_a_gradient(name: str, local: LocalHeteroGraph) -> None:
    """R-GCN needs no unused-parameter search under DDP; to_hetero's stack does."""
    loader = InProcessHeteroLoader(local, "train", num_neighbors=[5, 3], batch_size=64, shuffle=True)
    batch = next(iter(loader))
    torch.manual_seed(0)
    model = build_hetero_model(name, local.meta, hidden_channels=16, num_layers=2, dropout=0.0)
    out = model(*hetero_batch_inputs(batch))
    assert out.shape == (batch["paper"].batch_size, local.meta.num_classes)
    F.cross_entropy(out, batch["paper"].y[: batch["paper"].batch_size]).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    if name == "rgcn":
        assert missing == []
    else:
        # exactly the convolutions whose outputs never reach the target type's logits
        plan = layer_plan(local.meta, 2)
        unused = {f"gnn.convs.{i}.{'__'.join(et)}" for i, (relations, _) in enumerate(plan)
                  for et in local.meta.edge_types if et not in relations}
        assert unused and {n.rsplit(".", 2)[0] for n in missing} == unused


def test_featureless_types_are_embedded_by_n_id(local: LocalHeteroGraph) -> None:
    model = RGCN(local.meta, hidden_channels=8, num_layers=2)
    assert set(model.input.lins) == {"paper"}
    assert set(model.input.embs) == {"author", "institution", "field_of_study"}
    assert model.input.embs["author"].num_embeddings == local.meta.num_nodes["author"]
    n_id = {"author": torch.tensor([5, 0, 5]), "institution": torch.tensor([1]),
            "field_of_study": torch.tensor([3]), "paper": torch.tensor([0])}
    h = model.input({"paper": torch.zeros(1, 8)}, n_id)
    assert torch.equal(h["author"], model.input.embs["author"].weight[[5, 0, 5]])
    with pytest.raises(ValueError, match=r"batch\['paper'\].x"):
        model.input({}, n_id)


def test_trimming_does_not_change_the_seeds_logits(local: LocalHeteroGraph) -> None:
    loader = InProcessHeteroLoader(local, "val", num_neighbors=[5, 3], batch_size=32)
    batch = next(iter(loader))
    inputs = hetero_batch_inputs(batch)
    assert inputs[4] is not None and inputs[5] is not None  # the counts trim_to_layer reads
    torch.manual_seed(0)
    model = RGCN(local.meta, hidden_channels=16, num_layers=2).eval()
    with torch.no_grad():
        trimmed = model(*inputs)
        full = model(*inputs[:4])
    torch.testing.assert_close(trimmed, full)


def test_hetero_sage_dropout_follows_train_and_eval(local: LocalHeteroGraph) -> None:
    """to_hetero traces the module: a training flag read at trace time would stick."""
    batch = next(iter(InProcessHeteroLoader(local, "val", num_neighbors=[5, 3], batch_size=32)))
    torch.manual_seed(0)
    model = HeteroSAGE(local.meta, hidden_channels=16, num_layers=2, dropout=0.5)
    inputs = hetero_batch_inputs(batch)
    with torch.no_grad():
        model.eval()
        assert torch.equal(model(*inputs), model(*inputs))
        model.train()
        assert not torch.equal(model(*inputs), model(*inputs))


def test_in_process_loader_covers_each_seed_once_over_ranks(mini: tuple[HeteroGraphData, Path],
                                                             local: LocalHeteroGraph) -> None:
    graph, _ = mini
    loaders = [InProcessHeteroLoader(local, "train", num_neighbors=[4, 2], batch_size=24, shuffle=True,
                                     rank=r, world_size=2, seed=3) for r in range(2)]
    assert len(loaders[0]) == len(loaders[1]) > 0
    seen = []
    for loader in loaders:
        loader.set_epoch(1)
        for batch in loader:
            store = batch["paper"]
            ids = store.n_id[: store.batch_size]
            assert torch.equal(ids, loader.input_nodes[store.input_id])
            assert torch.equal(store.y[: store.batch_size], torch.from_numpy(graph.y)[ids])
            assert "x" not in batch["author"] and batch["author"].n_id.numel() == batch["author"].num_nodes
            seen.append(ids)
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.from_numpy(np.sort(graph.splits["train"])))


def test_in_process_batches_are_the_servers_batches(mini: tuple[HeteroGraphData, Path],
                                                    local: LocalHeteroGraph) -> None:
    """Same plan, same keys, same typed sampler: --partition-dir trains on exactly the
    batches the servers would stream."""
    _, root = mini
    with served(root, 2) as addresses:
        for rank in range(2):
            ours = InProcessHeteroLoader(local, "train", num_neighbors=[4, 2], batch_size=30, shuffle=True,
                                         rank=rank, world_size=2, seed=5)
            with RemoteNeighborLoader(addresses, "train", num_neighbors=[4, 2], batch_size=30, shuffle=True,
                                      rank=rank, world_size=2, seed=5, **TIMEOUTS) as theirs:
                for epoch in (0, 1):
                    ours.set_epoch(epoch)
                    theirs.set_epoch(epoch)
                    pairs = list(zip(ours, theirs, strict=True))
                    assert len(pairs) == len(theirs) > 0
                    for a, b in pairs:
                        _assert_same_batch(a, b)


def _assert_same_batch(a: object, b: object) -> None:
    from torch_geometric.data import HeteroData

    assert isinstance(a, HeteroData) and isinstance(b, HeteroData)
    assert a["paper"].batch_size == b["paper"].batch_size
    assert torch.equal(a["paper"].input_id, b["paper"].input_id)
    assert torch.equal(a["paper"].y, b["paper"].y)
    assert torch.equal(a["paper"].x, b["paper"].x)
    for t in a.node_types:
        assert torch.equal(a[t].n_id, b[t].n_id), t
    for et in a.edge_types:
        assert torch.equal(a[et].edge_index, b[et].edge_index), et


def test_bad_loader_arguments_name_the_field(local: LocalHeteroGraph) -> None:
    with pytest.raises(ValueError, match="split"):
        InProcessHeteroLoader(local, "nope", num_neighbors=[2], batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        InProcessHeteroLoader(local, "train", num_neighbors=[2], batch_size=0)
    with pytest.raises(ValueError, match="target_type"):
        HeteroMeta(("a",), (), {"a": 1}, {"a": 1}, "b", 2)


def _train_args(root: Path, out: Path, *extra: str) -> list[str]:
    return ["--partition-dir", str(root), "--model", "rgcn", "--fanouts", "5,3", "--batch-size", "40",
            "--hidden", "16", "--lr", "0.02", "--epochs", "2", "--no-progress", "--device", "cpu",
            "--metrics-json", str(out / "m.json"), "--checkpoint-dir", str(out / "ckpt"), *extra]


def test_trainer_in_process_trains_checkpoints_and_resumes(mini: tuple[HeteroGraphData, Path],
                                                           tmp_path: Path) -> None:
    _, root = mini
    assert train.main(_train_args(root, tmp_path)) == 0
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["typed"] and m["model"]["model"] == "rgcn" and len(m["epochs"]) == 2
    assert m["eval_fanouts"] == [5, 3]
    assert 0.0 <= m["test_acc"] <= 1.0 and m["selected_epoch"] in (0, 1)
    assert (tmp_path / "ckpt" / "checkpoint.pt").exists() and (tmp_path / "ckpt" / "best.pt").exists()
    resumed = _train_args(root, tmp_path, "--resume")
    resumed[resumed.index("--epochs") + 1] = "3"
    assert train.main(resumed) == 0
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["start_epoch"] == 2 and len(m["epochs"]) == 3
    other = _train_args(root, tmp_path, "--resume", "--hidden", "8")
    assert train.main(other) == 1  # a checkpoint of another model configuration is refused


def test_trainer_flag_errors(mini: tuple[HeteroGraphData, Path], tmp_path: Path, parts2: Path,
                             capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    _, root = mini
    assert train.main(["--partition-dir", str(parts2), "--model", "rgcn", "--no-progress"]) == 1
    assert "expected a typed graph (format v2)" in caplog.text
    with pytest.raises(SystemExit):
        train.parse_args(["--partition-dir", str(root), "--model", "sage"])
    assert "--partition-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "rgcn"])
    assert "--servers or --partition-dir" in capsys.readouterr().err
    args = train.parse_args(["--partition-dir", str(root), "--model", "rgcn", "--eval-fanouts", "full"])
    assert args.eval_fanouts_given and args.eval_fanouts is None


def test_trainer_on_typed_servers(mini: tuple[HeteroGraphData, Path], tmp_path: Path, parts2: Path,
                                  caplog: pytest.LogCaptureFixture) -> None:
    _, root = mini
    with served(root, 2) as addresses:
        args = _train_args(root, tmp_path)
        args[:2] = ["--servers", ",".join(addresses)]
        assert train.main([*args, "--timeout", "30"]) == 0
        m = json.loads((tmp_path / "m.json").read_text())
        assert m["typed"] and m["graph"] == "hetero-synthetic" and len(m["epochs"]) == 2
        assert m["epochs"][-1]["seeds"] == 160 and m["test_acc"] > 0.0
        assert m["epochs"][-1]["cache_hit_rate"] is None  # the CPU default: no cache
        # with the trainer's feature cache: the same batches, so the same weights
        cached_dir = tmp_path / "cached"
        cached = _train_args(root, cached_dir)
        cached[:2] = ["--servers", ",".join(addresses)]
        assert train.main([*cached, "--timeout", "30", "--cache-size", "0.5"]) == 0
        c = json.loads((cached_dir / "m.json").read_text())
        assert 0.0 < c["epochs"][-1]["cache_hit_rate"] < 1.0
        assert c["param_fingerprints"] == m["param_fingerprints"]
        caplog.clear()
        args[args.index("rgcn")] = "sage"
        assert train.main(args) == 1
        assert "expected a typed model" in caplog.text
    with served(parts2, 2) as addresses:
        caplog.clear()
        assert train.main(["--servers", ",".join(addresses), "--model", "rgcn", "--epochs", "1",
                           "--no-progress", "--timeout", "30"]) == 1
        assert "expected a typed graph (format v2)" in caplog.text


@pytest.mark.parametrize("model", ["rgcn", "hetero-sage"])
def test_two_ddp_ranks_stay_identical(model: str, mini: tuple[HeteroGraphData, Path], tmp_path: Path) -> None:
    """gloo DDP over 2 processes: equal batch counts, one set of weights."""
    _, root = mini
    args = _train_args(root, tmp_path)
    args[args.index("rgcn")] = model
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "trainer_client.train", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["world_size"] == 2 and m["model"]["model"] == model
    assert len(set(m["param_fingerprints"])) == 1
    assert m["epochs"][-1]["seeds"] == 160  # every training seed once per epoch, over both ranks
