"""``graphfeed-train --task link``: OGB's metric rules (by hand and against OGB's own
evaluator), the decoders, how link batches are read, the in-memory PyG reference source,
and link runs on tiny graphs (plain and typed) that learn, select by validation, resume,
and train over two DDP ranks with every seed edge and every evaluated positive counted
once. PyG's ``LinkNeighborLoader`` (:mod:`trainer_client.link_pyg`) stands in for the
service's link loader: it yields batches of the same layout."""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from in_process_servers import served
from link_ddp_worker import fixed_scores
from link_fixtures import NUM_NEGATIVES, WRITES, ServedLinkGraph, link_args, link_graph, served_link_graph
from torch_geometric.data import HeteroData

from partitioner.graph import PLAIN_EDGE_TYPE
from trainer_client import train
from trainer_client.ddp import BEST_NAME, CHECKPOINT_NAME, DistEnv
from trainer_client.link_metrics import global_kth_largest, hits_at_k, ogb_ranks, ranking_metrics
from trainer_client.link_models import (
    DotDecoder,
    LinkPredictor,
    MLPDecoder,
    build_link_model,
    link_inputs,
    link_targets,
)
from trainer_client.link_task import build_link_task, evaluation_protocol, link_splits_of
from trainer_client.loop import run

REPO = Path(__file__).resolve().parents[1]
KINDS = ("plain", "typed")
ONE = DistEnv(0, 1, 0, torch.device("cpu"))
#: PyG's LinkNeighborLoader (the reference source) samples with pyg-lib or torch-sparse,
#: which only the benchmarks install (``make bench-peers``).
needs_pyg_sampling = pytest.mark.skipif(
    not any(importlib.util.find_spec(m) is not None for m in ("pyg_lib", "torch_sparse")),
    reason="PyG's LinkNeighborLoader needs pyg-lib or torch-sparse (make bench-peers)")


def _edge_type(kind: str) -> tuple[str, str, str]:
    return PLAIN_EDGE_TYPE if kind == "plain" else WRITES


def _random_mrr(k: int) -> float:
    """Expected MRR of a random scorer against ``k`` negatives: rank uniform in 1..k+1."""
    return sum(1.0 / r for r in range(1, k + 2)) / (k + 1)


# ---- metrics ---------------------------------------------------------------------------


def test_ranks_follow_ogbs_rule_with_ties_costing_half_a_place() -> None:
    pos = torch.tensor([3.0, 1.0, 2.0, 1.0])
    neg = torch.tensor([[1.0, 2.0, 4.0], [1.0, 1.0, 0.0], [5.0, 6.0, 7.0], [1.0, 1.0, 1.0]])
    # row 0: one negative above -> 2; row 1: two ties -> 1 + (0 + 2) / 2 = 2;
    # row 2: all above -> 4; row 3: three ties -> 1 + 3 / 2 = 2.5
    assert ogb_ranks(pos, neg).tolist() == [2.0, 2.0, 4.0, 2.5]
    m = ranking_metrics(pos, neg)
    assert m["mrr"] == pytest.approx((0.5 + 0.5 + 0.25 + 0.4) / 4)
    assert (m["hits@1"], m["hits@3"], m["hits@10"], m["count"]) == (0.0, 0.75, 1.0, 4)


def test_hits_at_k_counts_positives_strictly_above_the_kth_negative() -> None:
    pos, neg = torch.tensor([5.0, 3.0, 1.0]), torch.tensor([4.0, 2.0, 0.0, 3.0])
    assert hits_at_k(pos, neg, 2) == {"hits@2": pytest.approx(1 / 3), "count": 3}  # 2nd negative: 3
    assert hits_at_k(pos, neg, 5)["hits@5"] == 1.0  # fewer negatives than K: OGB says 1
    assert global_kth_largest(neg, 1) == (4.0, 4)
    with pytest.raises(ValueError, match="scores: expected positives"):
        ogb_ranks(pos, neg)
    with pytest.raises(ValueError, match="k: expected"):
        hits_at_k(pos, neg, 0)


def test_the_metrics_equal_ogbs_evaluators() -> None:
    ogb = pytest.importorskip("ogb.linkproppred")
    gen = torch.Generator().manual_seed(3)
    pos = torch.randint(0, 8, (300,), generator=gen).float()
    neg = torch.randint(0, 8, (300, 50), generator=gen).float()
    theirs = ogb.Evaluator("ogbl-citation2").eval({"y_pred_pos": pos, "y_pred_neg": neg})
    mine = ranking_metrics(pos, neg)
    for key in ("mrr", "hits@1", "hits@3", "hits@10"):
        assert mine[key] == pytest.approx(float(theirs[f"{key}_list"].mean()))
    shared = torch.randn(400, generator=gen)
    collab = ogb.Evaluator("ogbl-collab")  # Hits@50
    positives = torch.randn(120, generator=gen) + 2.0
    assert hits_at_k(positives, shared, 50)["hits@50"] == pytest.approx(
        collab.eval({"y_pred_pos": positives, "y_pred_neg": shared})["hits@50"])


# ---- models and batches ----------------------------------------------------------------


@pytest.mark.parametrize("decoder", [DotDecoder(), MLPDecoder(16)], ids=["dot", "mlp"])
def test_decoders_score_pairs_and_broadcast_over_negatives(decoder: torch.nn.Module) -> None:
    h = torch.randn(10, 16)
    assert decoder(h[:4], h[4:8]).shape == (4,)
    assert decoder(h[:4].unsqueeze(1), h[torch.randint(0, 10, (4, 7))]).shape == (4, 7)
    model = LinkPredictor(torch.nn.Identity(), decoder, PLAIN_EDGE_TYPE, typed=False)
    src, dst, negs = torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([[4, 5, 6], [7, 8, 9]])
    # one source row against its negatives scores as the pairs one by one
    pairwise = torch.stack([model.score(h, h, src, negs[:, j]) for j in range(3)], dim=1)
    assert torch.allclose(model.score(h, h, src, negs), pairwise, atol=1e-6)
    assert model.score(h, h, src, dst).shape == (2,)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["binary", "triplet", "given"])
def test_batches_name_their_pairs_by_original_ids(kind: str, mode: str, tmp_path: Path) -> None:
    """The pairs a batch asks to score are the split's edges (and negatives), read back
    through ``n_id``; binary negatives are labelled 0; each edge in one batch."""
    with served_link_graph(link_graph(kind), tmp_path) as graph:
        _check_pairs(graph, kind, mode)


def _check_pairs(graph: ServedLinkGraph, kind: str, mode: str) -> None:
    split = graph.link_splits["val"]
    sampling = {"binary": "binary", "triplet": dict(mode="triplet", amount=3), "given": "given"}[mode]
    source = graph.loader("val", num_neighbors=[3, 2], batch_size=10, neg_sampling=sampling)
    et = _edge_type(kind)
    seen: Counter[int] = Counter()
    for batch in source:
        t = link_targets(batch, et)
        src_ids = batch[et[0]].n_id if isinstance(batch, HeteroData) else batch.n_id
        dst_ids = batch[et[2]].n_id if isinstance(batch, HeteroData) else batch.n_id
        ids = (batch[et] if isinstance(batch, HeteroData) else batch).input_id
        seen.update(ids.tolist())
        if mode == "binary":
            assert t.label is not None and t.dst_neg is None
            positives = int(t.label.sum())
            assert positives == ids.numel() and t.label.numel() == 2 * positives
            assert torch.equal(src_ids[t.src[:positives]], split.src[ids])
            assert torch.equal(dst_ids[t.dst[:positives]], split.dst[ids])
            continue
        assert t.label is None and t.dst_neg is not None
        assert torch.equal(src_ids[t.src], split.src[ids]) and torch.equal(dst_ids[t.dst], split.dst[ids])
        assert t.dst_neg.shape == (ids.numel(), NUM_NEGATIVES if mode == "given" else 3)
        if mode == "given":
            assert split.neg_dst is not None
            assert torch.equal(dst_ids[t.dst_neg], split.neg_dst[ids])
        inputs = link_inputs(batch)
        assert len(inputs) == 5
    assert sorted(seen) == list(range(split.num_edges)) and set(seen.values()) == {1}


@needs_pyg_sampling
@pytest.mark.parametrize("kind", KINDS)
def test_the_reference_source_covers_each_seed_edge_once_over_ranks(kind: str) -> None:
    graph = link_graph(kind)
    n = graph.link_splits["train"].num_edges
    for epoch in (0, 1):
        seen: Counter[int] = Counter()
        sources = [graph.loader("train", num_neighbors=[2], batch_size=50, shuffle=True,
                                neg_sampling="binary", rank=r, world_size=3, seed=4) for r in range(3)]
        assert len({len(s) for s in sources}) == 1
        orders = []
        for s in sources:
            s.set_epoch(epoch)
            batches = list(s)
            assert len(batches) == len(s)
            ids = [b[_edge_type(kind)].input_id if kind == "typed" else b.input_id for b in batches]
            orders.append(torch.cat(ids))
            seen.update(torch.cat(ids).tolist())
        assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}
    again = graph.loader("train", num_neighbors=[2], batch_size=50, shuffle=True, neg_sampling="binary",
                         rank=2, world_size=3, seed=4)
    again.set_epoch(1)
    assert torch.equal(torch.cat([b[_edge_type(kind)].input_id if kind == "typed" else b.input_id
                                  for b in again]), orders[2])  # a pure function of (seed, epoch, rank)


def test_the_reference_source_refuses_what_pyg_cannot_do() -> None:
    graph = link_graph("plain")
    with pytest.raises(ValueError, match="exclude"):
        graph.loader("train", num_neighbors=[2], batch_size=8, exclude="self")
    with pytest.raises(ValueError, match="strict_negatives"):
        graph.loader("train", num_neighbors=[2], batch_size=8, strict_negatives=True)
    with pytest.raises(ValueError, match="stores no negatives"):
        graph.loader("train", num_neighbors=[2], batch_size=8, neg_sampling="given")
    with pytest.raises(ValueError, match="split: expected one of"):
        graph.loader("nope", num_neighbors=[2], batch_size=8)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("model", "decoder"), [("sage", "dot"), ("rgcn", "mlp"), ("hetero-sage", "dot")])
def test_link_models_build_for_their_kind_and_score_a_batch(kind: str, model: str, decoder: str,
                                                           tmp_path: Path) -> None:
    graph = link_graph(kind)
    typed_model = model != "sage"
    if typed_model != (kind == "typed"):
        with pytest.raises(ValueError, match="model: expected one of"):
            build_link_model(model, graph.facts(), _edge_type(kind))
        return
    predictor = build_link_model(model, graph.facts(), _edge_type(kind), decoder=decoder, hidden_channels=8)
    with served_link_graph(graph, tmp_path) as served:
        batch = next(iter(served.loader("val", num_neighbors=[3, 3], batch_size=10, neg_sampling="given")))
    t = link_targets(batch, _edge_type(kind))
    assert t.dst_neg is not None
    h_src, h_dst = predictor.embed(link_inputs(batch))
    assert h_src.shape[1] == h_dst.shape[1] == 8
    assert predictor.score(h_src, h_dst, t.src, t.dst_neg).shape == t.dst_neg.shape


def test_link_batches_without_pairs_are_refused_naming_the_field(tmp_path: Path) -> None:
    with served_link_graph(link_graph("typed"), tmp_path) as graph:
        batch = next(iter(graph.loader("val", num_neighbors=[2], batch_size=4, neg_sampling="binary")))
    del batch[WRITES].edge_label_index
    with pytest.raises(ValueError, match=r"expected edge_label_index \(binary\)"):
        link_targets(batch, WRITES)


# ---- protocols and runs ----------------------------------------------------------------


def test_the_protocol_follows_the_stored_splits() -> None:
    given, hits = link_graph("plain").link_splits, link_graph("plain", with_hits=True).link_splits
    assert evaluation_protocol(given, "val", eval_negatives=100, hits_k=50) == ("given", NUM_NEGATIVES)
    assert evaluation_protocol(hits, "val", eval_negatives=100, hits_k=50) == ("hits", 50)
    assert evaluation_protocol(given, "train", eval_negatives=30, hits_k=50) == ("sampled", 30)
    with pytest.raises(ValueError, match="link split 'nope': expected the graph to store it"):
        evaluation_protocol(given, "nope", eval_negatives=1, hits_k=1)
    with pytest.raises(ValueError, match="has no link splits"):
        link_splits_of(object(), "the servers'")


@pytest.mark.parametrize("kind", KINDS)
def test_a_link_run_learns_and_keeps_the_best_validation_model(kind: str, tmp_path: Path) -> None:
    with served_link_graph(link_graph(kind), tmp_path / "parts") as graph:
        _learns_and_keeps_the_best(graph, kind, tmp_path)


def _learns_and_keeps_the_best(graph: ServedLinkGraph, kind: str, tmp_path: Path) -> None:
    args = link_args(kind, "--checkpoint-dir", str(tmp_path / "ckpt"))
    metrics = run(args, ONE, graph.task(args, ONE))
    epochs = metrics["epochs"]
    assert epochs[-1]["loss"] < epochs[0]["loss"] - 0.05
    assert metrics["val_metric"] == metrics["test_metric"] == "mrr"
    assert metrics["test_count"] == graph.link_splits["test"].num_edges  # every positive once
    assert metrics["test_mrr"] > 2 * _random_mrr(NUM_NEGATIVES)
    best = max(epochs, key=lambda h: h["val_mrr"])
    assert metrics["selected_epoch"] == best["epoch"] and metrics["selected_val_mrr"] == best["val_mrr"]
    assert all(e["seeds"] == graph.link_splits["train"].num_edges for e in epochs)
    saved = torch.load(tmp_path / "ckpt" / BEST_NAME, weights_only=True)
    assert saved["epoch"] == best["epoch"] and saved["config"]["task"] == "link"
    # the selected model, tested again, gives the reported figures
    model = build_link_model(args.model, graph.facts(), _edge_type(kind), decoder=args.decoder,
                             hidden_channels=args.hidden, num_layers=args.layers, dropout=args.dropout)
    model.load_state_dict(saved["model"])
    again = graph.task(args, ONE).evaluate(model, "test")
    assert set(again) == {"mrr", "hits@1", "hits@3", "hits@10", "count"}
    assert again == pytest.approx({k: metrics[f"test_{k}"] for k in again})


@pytest.mark.parametrize("kind", KINDS)
def test_hits_at_k_selects_on_collab_style_splits_and_resume_continues(kind: str, tmp_path: Path) -> None:
    with served_link_graph(link_graph(kind, with_hits=True), tmp_path / "parts") as graph:
        _hits_and_resume(graph, kind, tmp_path)


def _hits_and_resume(graph: ServedLinkGraph, kind: str, tmp_path: Path) -> None:
    args = link_args(kind, "--epochs", "2", "--hits-k", "20", "--decoder", "mlp",
                     "--checkpoint-dir", str(tmp_path / "ckpt"))
    first = run(args, ONE, graph.task(args, ONE))
    assert first["val_metric"] == "hits@20" and 0.0 <= first["test_hits@20"] <= 1.0
    assert first["test_count"] == graph.link_splits["test"].num_edges
    more = link_args(kind, "--epochs", "3", "--hits-k", "20", "--decoder", "mlp", "--resume",
                     "--checkpoint-dir", str(tmp_path / "ckpt"))
    resumed = run(more, ONE, graph.task(more, ONE))
    assert resumed["start_epoch"] == 2 and [e["epoch"] for e in resumed["epochs"]] == [0, 1, 2]
    # a checkpoint whose epochs lack the selecting figure is refused in one line
    path = tmp_path / "ckpt" / CHECKPOINT_NAME
    state = torch.load(path, weights_only=True)
    torch.save({**state, "history": [{k: v for k, v in h.items() if k != "val_hits@20"}
                                     for h in state["history"]]}, path)
    with pytest.raises(ValueError, match=r"--resume: checkpoint .* has no 'val_hits@20' in its epochs"):
        run(more, ONE, graph.task(more, ONE))
    other = link_args(kind, "--epochs", "3", "--decoder", "dot", "--resume",
                      "--checkpoint-dir", str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match=r"--resume: checkpoint .* was written for"):
        run(other, ONE, graph.task(other, ONE))


def test_the_link_flags_are_checked_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    args = train.parse_args(["--servers", "a:1", "--task", "link"])
    assert (args.decoder, args.neg_ratio, args.exclude, args.strict_negatives, args.hits_k) == \
        ("dot", 1.0, "none", False, 50)
    assert train.parse_args(["--servers", "a:1"]).task == "node"
    for bad, says in ((["--partition-dir", "x"], "expected --servers"),
                      (["--servers", "a:1", "--neg-ratio", "0"], "expected a value > 0"),
                      (["--servers", "a:1", "--exclude", "both"], "invalid choice")):
        with pytest.raises(SystemExit):
            train.parse_args(["--task", "link", *bad])
        assert says in capsys.readouterr().err


@pytest.mark.parametrize("kind", KINDS)
def test_two_ddp_ranks_count_every_seed_edge_and_positive_once(kind: str, tmp_path: Path) -> None:
    """torchrun with 2 gloo ranks: the metrics gathered from uneven shares equal one
    process's, every training seed edge and every evaluated positive is counted once,
    and the replicas stay identical."""
    with served_link_graph(link_graph(kind), tmp_path / "parts") as graph:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(REPO / "tests" / "link_ddp_worker.py"), kind, str(tmp_path),
               ",".join(graph.cluster.addresses)]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    gathered = json.loads((tmp_path / "metrics-gathered.json").read_text())
    pos, neg, shared = fixed_scores()
    assert gathered["ranking"] == pytest.approx(ranking_metrics(pos, neg))
    assert gathered["hits"] == pytest.approx(hits_at_k(pos, shared, 5))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    graph = link_graph(kind)
    assert metrics["world_size"] == 2 and len(set(metrics["param_fingerprints"])) == 1
    assert all(e["seeds"] == graph.link_splits["train"].num_edges for e in metrics["epochs"])
    assert all(e["val_count"] == graph.link_splits["val"].num_edges for e in metrics["epochs"])
    assert metrics["test_count"] == graph.link_splits["test"].num_edges


# ---- benchmarks/link_accuracy.py -------------------------------------------------------


@pytest.fixture
def link_accuracy(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``benchmarks/link_accuracy.py``, imported as it runs (its folder on the path)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    return importlib.import_module("link_accuracy")


def test_welchs_test_without_scipy_gives_scipys_figures(link_accuracy: ModuleType,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    stats = pytest.importorskip("scipy.stats")
    a, b = [0.61, 0.64, 0.59, 0.66, 0.62], [0.58, 0.6, 0.57, 0.63]
    expected = stats.ttest_ind(a, b, equal_var=False)
    monkeypatch.setitem(sys.modules, "scipy", None)  # import scipy now fails
    mine = link_accuracy.welch(a, b)
    assert mine["t"] == pytest.approx(float(expected.statistic))
    assert mine["p"] == pytest.approx(float(expected.pvalue), rel=1e-6)
    assert link_accuracy.welch([0.5, 0.5], [0.5, 0.5])["p"] == 1.0


@needs_pyg_sampling
@pytest.mark.parametrize("kind", KINDS)
def test_the_accuracy_harness_trains_both_sides_alike(kind: str, link_accuracy: ModuleType) -> None:
    """With PyG standing in for the service both sides draw alike: equal figures, p = 1;
    a generated graph's link splits (numpy, original IDs) convert as they are."""
    graph = link_graph(kind)
    generated = SimpleNamespace(
        typed=kind == "typed", name=graph.name, link_splits={
            n: SimpleNamespace(edge_type=s.edge_type, src=s.src.numpy(), dst=s.dst.numpy(),
                               neg_dst=None if s.neg_dst is None else s.neg_dst.numpy())
            for n, s in graph.link_splits.items()},
        **({"x": {t: graph.data[t].x.numpy() for t in graph.data.node_types},
            "num_nodes": {t: graph.data[t].num_nodes for t in graph.data.node_types},
            "edge_index": {et: graph.data[et].edge_index.numpy() for et in graph.data.edge_types}}
           if kind == "typed" else {"x": graph.data.x.numpy(), "num_nodes": graph.data.num_nodes,
                                    "edge_index": graph.data.edge_index.numpy()}))
    pyg = link_accuracy.pyg_graph(generated)
    assert pyg.facts() == graph.facts() and set(pyg.link_splits) == set(graph.link_splits)
    flags = [*link_accuracy.TRAIN_FLAGS, "--model", "sage" if kind == "plain" else "rgcn", "--epochs", "1",
             "--fanouts", "3,3", "--batch-size", "64", "--hidden", "16"]
    report = link_accuracy.compare(pyg, partial(link_accuracy.pyg_job, pyg), [0, 1], flags)
    assert report["pyg"]["test"] == report["service"]["test"] and report["welch"]["p"] == 1.0
    assert report["pyg"]["metric"] == "mrr" and len(report["pyg"]["test"]) == 2


def test_the_cli_refuses_served_graphs_it_cannot_train_links_on(parts2: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """``graphfeed-train --task link`` against real servers: a model of the other kind, and
    a graph partitioned without link splits, end the run with one line naming the fix."""
    flags = ["--task", "link", "--device", "cpu", "--no-progress", "--timeout", "30"]
    with served(parts2, 2) as addresses:
        assert train.main(["--servers", ",".join(addresses), *flags, "--model", "rgcn"]) == 1
        assert "--task link on the plain graph" in caplog.text and "expects one of" in caplog.text
        assert train.main(["--servers", ",".join(addresses), *flags]) == 1
        assert "has no link splits; partition it with --link-split" in caplog.text


@pytest.mark.parametrize("kind", KINDS)
def test_the_task_asks_the_loader_for_each_split_as_its_protocol_needs(kind: str) -> None:
    """What the service's loader is asked for: the training split shuffled with binary
    negatives, ``--strict-negatives`` and ``--exclude``; evaluation splits in order, with
    their stored negatives, the ``_neg`` split or sampled triplets."""
    asked: list[tuple[str, dict[str, object]]] = []

    class NoBatches:
        def set_epoch(self, epoch: int) -> None: ...

        def __len__(self) -> int:
            return 0

        def __iter__(self) -> Iterator[object]:
            return iter(())

    def make(split: str, **kw: object) -> NoBatches:
        asked.append((split, kw))
        return NoBatches()

    graph = link_graph(kind)
    splits = dict(graph.link_splits)
    splits["test_neg"] = splits.pop("test")  # test: collab-style; val: given negatives
    splits["test"] = type(splits["val"])(splits["val"].edge_type, splits["val"].src, splits["val"].dst)
    args = link_args(kind, "--neg-ratio", "3", "--strict-negatives", "--exclude", "reverse",
                     "--eval-fanouts", "full", "--eval-batch-size", "7")
    task = build_link_task(make, splits, graph.facts(), args, ONE)
    assert (task.val.protocol, task.test.protocol) == ("given", "hits")
    assert asked[0] == ("train", dict(num_neighbors=[5, 5], batch_size=64, shuffle=True,
                                      neg_sampling=dict(mode="binary", amount=3.0), strict_negatives=True,
                                      exclude="reverse"))
    each = dict(num_neighbors=[-1, -1], batch_size=7, shuffle=False)
    assert asked[1:] == [("val", dict(neg_sampling="given", **each)),
                         ("test", dict(neg_sampling=None, **each)),
                         ("test_neg", dict(neg_sampling=None, **each))]
    del splits["test_neg"]
    asked.clear()
    task = build_link_task(make, splits, graph.facts(), link_args(kind, "--eval-negatives", "9"), ONE)
    assert task.test.protocol == "sampled" and asked[-1] == (
        "test", dict(neg_sampling=dict(mode="triplet", amount=9), strict_negatives=False,
                     num_neighbors=[5, 5], batch_size=64, shuffle=False))


def test_a_link_predictor_trains_on_edge_features_through_the_servers(tmp_path: Path) -> None:
    """``--task link --model gine``: the servers send each batch's edge features and the
    encoder takes them; a graph without edge features refuses GINE by name."""
    from partitioner.links import random_link_split
    from partitioner.synthetic import generate_plain
    from partitioner.writer import partition_graph

    graph = random_link_split(generate_plain("edge-feat-small", progress=False), val=0.05, test=0.05,
                              num_negatives=20, seed=0)
    root = tmp_path / "p2"
    partition_graph(graph, 2, root, method="random", progress=False)
    metrics = tmp_path / "m.json"
    flags = ["--task", "link", "--model", "gine", "--fanouts", "5,5", "--batch-size", "512", "--epochs", "1",
             "--hidden", "16", "--eval-batch-size", "64", "--device", "cpu", "--no-progress",
             "--timeout", "60", "--metrics-json", str(metrics)]
    with served(root, 2) as addresses:
        assert train.main(["--servers", ",".join(addresses), *flags]) == 0
    result = json.loads(metrics.read_text())
    assert result["model"]["model"] == "gine" and 0.0 < result["test_mrr"] <= 1.0


def _loop_figures(entry: dict[str, object]) -> set[str]:
    """The keys of a metrics entry that are not a split's figures (``val_<figure>``, ...)."""
    return {k for k in entry if not k.startswith(("val_", "test_", "selected_val_"))}


def test_a_link_run_reports_every_figure_a_node_run_does(parts2: Path, tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The one loop: the metrics of both tasks hold the same figures (a link run's traffic,
    cache, waits and stream resumes too), and both epoch lines give the evaluation's
    seconds beside the training's."""
    caplog.set_level(logging.INFO, "trainer_client.train")
    flags = ["--fanouts", "5,5", "--epochs", "1", "--hidden", "16", "--device", "cpu", "--no-progress",
             "--timeout", "60"]
    with served(parts2, 2) as addresses:
        assert train.main(["--servers", ",".join(addresses), *flags, "--batch-size", "300",
                           "--metrics-json", str(tmp_path / "node.json")]) == 0
    with served_link_graph(link_graph("plain"), tmp_path / "parts") as graph:
        assert train.main(["--servers", ",".join(graph.cluster.addresses), "--task", "link", *flags,
                           "--batch-size", "64", "--metrics-json", str(tmp_path / "link.json")]) == 0
    node, link = (json.loads((tmp_path / f"{task}.json").read_text()) for task in ("node", "link"))
    assert (node["task"], link["task"]) == ("node", "link")
    assert _loop_figures(node["epochs"][0]) == _loop_figures(link["epochs"][0])
    assert _loop_figures(node) <= _loop_figures(link)
    link_only = {"edge_type", "neg_ratio", "strict_negatives", "exclude"}  # LinkTask.facts
    assert _loop_figures(link) - _loop_figures(node) == link_only
    for metrics in (node, link):
        epoch = metrics["epochs"][0]
        assert epoch["received_mb"] > 0 and epoch["resumes"] == 0 and epoch["cache_hit_rate"] is None
        assert epoch["eval_seconds"] > 0 and epoch["seeds"] > 0
        metric = metrics["val_metric"]
        assert metrics[f"selected_val_{metric}"] == epoch[f"val_{metric}"]
        line = re.search(rf"epoch 0: .*, val {re.escape(metric)} \d\.\d{{4}} \(best so far\); "
                         r"(\d+\.\d) s training \+ (\d+\.\d) s evaluation, \d+ seeds/s \(rank 0: waited "
                         r"\d+\.\d s for data, received \d+\.\d MB\)", caplog.text)
        assert line, caplog.text
        seconds = (f"{epoch['train_seconds']:.1f}", f"{epoch['eval_seconds']:.1f}")
        assert (line.group(1), line.group(2)) == seconds
