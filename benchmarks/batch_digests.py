"""SHA-256 digests of every batch a cluster streams, for comparing two versions of graphfeed.

Builds a small plain graph (with edge weights) and a small typed graph as ``.npz``
archives, partitions each into two parts with ``graphfeed-partition`` (hash), starts
in-process servers (CPU sampler) and streams epochs through ``RemoteNeighborLoader`` with
global and per-partition batches, shuffled, with and without replacement (and weighted
draws on the plain graph), float32 and bfloat16 with a feature cache. The same graphs with
edge features and held-out link splits (``--link-split``) stream link epochs through
``RemoteLinkNeighborLoader``: binary, triplet, stored and no negatives, strict draws,
excluded seed edges, given seed edges with labels, bfloat16 with a cache and edge
features. Numba's CUDA
simulator runs one thread at a time, so the CUDA sampler (simulated where there is no GPU)
is driven directly instead: both partitions' samplers in this process, answering each
other, on the seeds of the same global and per-partition plans (``--devices cpu,cuda``
runs the CPU sampler that way too). Each batch's tensors and counts are hashed; the JSON
written maps a case name to its batches' digests. Run it at two commits and compare the
files: equal digests mean bit-identical batches.

    python benchmarks/batch_digests.py --out /tmp/digests-new.json      # about a minute

The service cases use public entry points only (the partitioner's command line,
``ServerConfig``, ``create_server``, ``RemoteNeighborLoader``, ``RemoteLinkNeighborLoader``);
the sampler cases speak
both the sampler API of this version and the one before it (separate plain and typed
samplers), so the script runs on older versions too.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # the simulator must be chosen before Numba is imported
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


def plain_npz(path: Path, seed: int = 0) -> None:
    """A 300-node plain graph with edge weights, labels and splits."""
    rng = np.random.default_rng(seed)
    n, e = 300, 2400
    src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
    y = rng.integers(0, 4, n)
    y[rng.choice(n, 20, replace=False)] = -1
    order = rng.permutation(n)
    np.savez(path, edge_index=np.stack([src, dst]).astype(np.int64),
             x=rng.standard_normal((n, 8)).astype(np.float32), y=y.astype(np.int64),
             edge_weight=rng.uniform(0.1, 3.0, e).astype(np.float32), num_classes=np.int64(4),
             train_idx=np.sort(order[:120]), val_idx=np.sort(order[120:180]),
             test_idx=np.sort(order[180:240]))


def typed_npz(path: Path, seed: int = 0) -> None:
    """Papers (features, labels), authors and topics, three relations."""
    rng = np.random.default_rng(seed)
    counts = {"paper": 120, "author": 80, "topic": 12}
    rels = {("author", "writes", "paper"): (80, 120, 300), ("paper", "cites", "paper"): (120, 120, 250),
            ("paper", "has_topic", "topic"): (120, 12, 160),
            ("topic", "rev_has_topic", "paper"): (12, 120, 160)}
    arrays: dict[str, Any] = {f"num_nodes__{t}": np.int64(c) for t, c in counts.items()}
    for (s, r, d), (ns, nd, e) in rels.items():
        arrays[f"edge_index__{s}__{r}__{d}"] = np.stack(
            [rng.integers(0, ns, e), rng.integers(0, nd, e)]).astype(np.int64)
    arrays["x__paper"] = rng.standard_normal((120, 6)).astype(np.float32)
    arrays["x__author"] = rng.standard_normal((80, 3)).astype(np.float32)
    y = rng.integers(0, 3, 120).astype(np.int64)
    y[[1, 5, 9]] = -1
    arrays["y__paper"] = y
    order = rng.permutation(120)
    arrays.update(num_classes=np.int64(3), train_idx=np.sort(order[:60]), val_idx=np.sort(order[60:80]),
                  test_idx=np.sort(order[80:110]))
    np.savez(path, **arrays)


#: The link graphs' seed edge type (the typed graph's; the plain graph has one).
WRITES = ("author", "writes", "paper")


def link_npz(npz: Path, path: Path) -> None:
    """``npz`` with 3 float32 features on the plain graph's edges or the typed graph's
    ``writes`` edges (and, typed, ``rev_writes`` edges reversing those): the graph link
    splits are held out of."""
    with np.load(npz, allow_pickle=False) as f:
        arrays = dict(f)
    key = "edge_index" if "edge_index" in arrays else "edge_index__" + "__".join(WRITES)
    rng = np.random.default_rng(1)
    arrays[key.replace("edge_index", "edge_attr")] = rng.standard_normal((arrays[key].shape[1], 3)).astype(
        np.float32)
    if key != "edge_index":
        arrays["edge_index__paper__rev_writes__author"] = np.ascontiguousarray(arrays[key][::-1])
    np.savez(path, **arrays)


def partition(npz: Path, out: Path, *extra: str) -> None:
    subprocess.run([sys.executable, "-m", "partitioner", "partition", "--npz", str(npz),
                    "--num-parts", "2", "--method", "hash", "--out", str(out), "--no-progress", *extra],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def digest(batch: Any) -> str:
    """SHA-256 of every tensor and count of a ``Data`` or ``HeteroData`` batch."""
    h = hashlib.sha256()
    stores = [(("",), batch)] if not hasattr(batch, "node_types") else \
        [((t,), batch[t]) for t in sorted(batch.node_types)] + \
        [((*e,), batch[e]) for e in sorted(batch.edge_types)] + [(("graph",), batch)]
    for key, store in stores:
        items = store.items() if hasattr(store, "items") else []
        for name, value in sorted(items, key=lambda kv: kv[0]):
            h.update(repr((key, name)).encode())
            if isinstance(value, torch.Tensor):
                t = value.detach().cpu().contiguous()
                h.update(str(t.dtype).encode() + repr(list(t.shape)).encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            else:
                h.update(repr(value).encode())
    return h.hexdigest()


def serve(root: Path, device: str) -> tuple[list[Any], list[str]]:
    from sampling_server.config import ServerConfig
    from sampling_server.server import create_server

    built = [create_server(ServerConfig(partition_dir=root, partition=p, listen="127.0.0.1:0", device=device,
                                        structure="partition", features="partition", peer_timeout=60.0))
             for p in range(2)]
    addresses = [f"127.0.0.1:{port}" for _, port in built]
    servers = [s for s, _ in built]
    for s in servers:
        s.set_peers(addresses)
        s.start()
    assert all(s.wait_until_serving(300) for s in servers)
    return servers, addresses


def cases(typed: bool) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    fanouts: Any = [4, 3]
    for batches in ("global", "partition"):
        out[f"{batches}"] = dict(batches=batches)
        out[f"{batches}-replace"] = dict(batches=batches, replace=True)
        out[f"{batches}-bf16-cache"] = dict(batches=batches, feature_dtype="bfloat16", cache_size=0.3)
    if typed:
        fanouts = {("author", "writes", "paper"): [3, 2], ("paper", "cites", "paper"): [2, 2],
                   ("topic", "rev_has_topic", "paper"): [-1, 1], ("paper", "has_topic", "topic"): [2, 0]}
        out["global-dict-fanouts"] = dict(batches="global", num_neighbors=fanouts)
    else:
        out["global-weighted"] = dict(batches="global", weighted=True)
        out["partition-weighted-replace"] = dict(batches="partition", weighted=True, replace=True)
    return out


def link_cases(typed: bool) -> dict[str, dict[str, Any]]:
    """Link loader arguments by case name (``split`` or ``edge_label_index`` among them)."""
    given = np.random.default_rng(2).integers(0, 80 if typed else 300, (2, 40))
    index: Any = (WRITES, torch.from_numpy(given)) if typed else torch.from_numpy(given)
    binary2, triplet3 = {"mode": "binary", "amount": 2}, {"mode": "triplet", "amount": 3}
    return {
        "train-binary": dict(split="train", neg_sampling="binary"),
        "train-binary2-strict-exclude-reverse": dict(split="train", neg_sampling=binary2,
                                                     strict_negatives=True, exclude="reverse"),
        "train-triplet3-exclude-self": dict(split="train", neg_sampling=triplet3, exclude="self"),
        "train-none-replace": dict(split="train", replace=True),
        "val-given": dict(split="val", neg_sampling="given"),
        "train-binary-bf16-cache-edge-features": dict(split="train", neg_sampling="binary",
                                                      feature_dtype="bfloat16", cache_size=0.3,
                                                      edge_features=True),
        "given-edges-labels": dict(edge_label_index=index, edge_label=torch.arange(40) % 3,
                                   neg_sampling="binary"),
    }


def run(kind: str, root: Path, device: str, *, links: bool = False) -> dict[str, list[str]]:
    """The digests of every case's batches on both ranks: node batches of the "train" split,
    or (``links``) link batches."""
    from trainer_client.link_loader import RemoteLinkNeighborLoader
    from trainer_client.loader import RemoteNeighborLoader

    loader: Any = RemoteLinkNeighborLoader if links else RemoteNeighborLoader
    common = {"num_neighbors": [4, 3], "batch_size": 32 if links else 16, "shuffle": True, "seed": 7}
    servers, addresses = serve(root, device)
    results: dict[str, list[str]] = {}
    try:
        for name, kw in (link_cases if links else cases)(kind == "typed").items():
            if not links:
                kw = {"split": "train", "compact_indices": True, **kw}
            for rank in range(2):
                with loader(addresses, rank=rank, world_size=2, **{**common, **kw}) as batches:
                    batches.set_epoch(1)
                    key = f"link-{name}" if links else name
                    results[f"{kind}/{device}/{key}/rank{rank}"] = [digest(b) for b in batches]
    finally:
        for s in servers:
            s.stop(None).wait(10)
    return results


def sampler_digests(kind: str, root: Path, device: str) -> dict[str, list[str]]:
    """The batches of two plans' seeds, drawn by the samplers of both partitions in this
    process (each answering the other), as digests."""
    from protos.plan import plan_epoch, plan_global_epoch, shuffled_seeds
    from sampling_server.sampler import batch_key

    draw, seeds_of, orig_of = _samplers(kind, root, device)
    results: dict[str, list[str]] = {}
    train = [np.asarray(s, dtype=np.int64) for s in seeds_of]
    for batches in ("global", "partition"):
        for rank in range(2):
            out: list[Any] = []
            plan: Any
            if batches == "global":
                everything = np.concatenate(train)
                plan = plan_global_epoch(everything.size, 16, 2, 2, shuffle=True, seed=7, epoch=1)
                for ref in plan.rank_batches(rank):
                    seeds = everything[plan.positions(ref.part_batch)]
                    out.append(draw(ref.partition, seeds, batch_key(7, 1, rank, ref.index)))
            else:
                plan = plan_epoch([s.size for s in train], 16, 2, shuffle=True, seed=7, epoch=1)
                for ref in plan.rank_batches(rank):
                    order = shuffled_seeds(train[ref.partition], shuffle=True, seed=7, epoch=1,
                                           partition=ref.partition)
                    seeds = plan.seeds_of(ref.partition, ref.part_batch, order)
                    out.append(draw(ref.partition, seeds, batch_key(7, 1, rank, ref.index)))
            results[f"{kind}/sampler-{device}/{batches}/rank{rank}"] = [orig_of(b) for b in out]
    return results


def _samplers(kind: str, root: Path, device: str) -> tuple[Any, list[np.ndarray], Any]:
    """(draw(partition, seeds, key) -> batch, each partition's train seeds, digest(batch))
    for this version's sampler API or the one before it."""
    # two versions' APIs: typed as Any
    S: Any = importlib.import_module("sampling_server.sampler")

    fanouts: Any = [4, 3]
    if not hasattr(S, "create_hetero_sampler"):  # one sampler for both kinds
        from partitioner.format import load_partition

        parts: list[Any] = [load_partition(root, p) for p in range(2)]
        samplers: list[Any] = [S.create_sampler(part, device) for part in parts]
        peers = S.InProcessPeers(samplers)
        target = parts[0].manifest.target_type

        def draw(p: int, seeds: np.ndarray, key: int) -> Any:
            return samplers[p].minibatch(seeds, target, fanouts, key, remote=peers)

        def typed_digest(batch: Any) -> str:
            s = batch.structure
            return _digest_parts({t: (batch.orig_id[t], batch.x.get(t), batch.y if t == target else None,
                                      s.num_sampled_nodes[t]) for t in s.node},
                                 {e: (s.edge_index(e), s.num_sampled_edges[e]) for e in s.row})
        return draw, [part.splits["train"] for part in parts], typed_digest
    if kind == "typed":
        from partitioner.hetero_format import load_hetero_partition  # type: ignore[import-not-found]

        hparts = [load_hetero_partition(root, p) for p in range(2)]
        hsamplers = [S.create_hetero_sampler(part, device) for part in hparts]

        class Peers:
            def sample(self, et: Any, by: Any, fanout: int, key: int, hop: int) -> Any:
                return {p: hsamplers[p].sample_relation(et, n, fanout, key, hop) for p, n in by.items()}

            def node_data(self, t: str, by: Any, features: bool, labels: bool) -> Any:
                return {p: hsamplers[p].gather_local(t, n, features, labels) for p, n in by.items()}

            def orig_ids(self, t: str, by: Any) -> Any:
                return {p: hsamplers[p].orig_ids_local(t, n) for p, n in by.items()}

        peers = Peers()
        target = hparts[0].target_type

        def hdraw(p: int, seeds: np.ndarray, key: int) -> Any:
            return hsamplers[p].minibatch(seeds, target, fanouts, key, remote=peers)

        def hdigest(batch: Any) -> str:
            s = batch.structure
            return _digest_parts({t: (batch.orig_id[t], batch.x.get(t), batch.y if t == target else None,
                                      s.num_sampled_nodes[t]) for t in s.node},
                                 {e: (s.edge_index(e), s.num_sampled_edges[e]) for e in s.row})
        return hdraw, [part.splits["train"] for part in hparts], hdigest
    from partitioner.format import load_partition

    pparts: list[Any] = [load_partition(root, p) for p in range(2)]
    psamplers: list[Any] = [S.create_sampler(part, device) for part in pparts]

    def neighbors(by: Any, fanout: int, key: int, hop: int) -> Any:
        return {p: psamplers[p].sample_neighbors(n.to(psamplers[p].device), fanout, key, hop)
                for p, n in by.items()}

    def node_data(by: Any, features: bool, labels: bool) -> Any:
        return {p: psamplers[p].gather_local(n.to(psamplers[p].device), features, labels)
                for p, n in by.items()}

    def orig_ids(by: Any) -> Any:
        return {p: psamplers[p]._orig_ids_local(n.cpu()) for p, n in by.items()}

    def pdraw(p: int, seeds: np.ndarray, key: int) -> Any:
        batch = psamplers[p].minibatch(seeds, fanouts, key, remote=neighbors, remote_data=node_data)
        return batch, psamplers[p].orig_ids_of(batch.structure.n_id, orig_ids)

    def pdigest(drawn: Any) -> str:
        batch, orig = drawn
        s = batch.structure
        node = "_N"
        return _digest_parts({node: (orig, batch.x, batch.y, s.num_sampled_nodes)},
                             {(node, "_E", node): (s.edge_index, s.num_sampled_edges)})
    return pdraw, [part.splits["train"] for part in pparts], pdigest


def _digest_parts(nodes: dict[str, tuple[Any, ...]], edges: dict[Any, tuple[Any, ...]]) -> str:
    """SHA-256 over per-type (original IDs, x, y, counts) and per-relation (edges, counts);
    a plain graph's one type and relation count as "_N" and ("_N", "_E", "_N")."""
    h = hashlib.sha256()
    for key, values in [*sorted(nodes.items()), *sorted(edges.items())]:
        h.update(repr(key).encode())
        for v in values:
            if isinstance(v, torch.Tensor):
                t = v.detach().cpu().contiguous()
                h.update(str(t.dtype).encode() + repr(list(t.shape)).encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            else:
                h.update(repr(None if v is None else list(v)).encode())
    return h.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " Takes about a minute.")
    parser.add_argument("--out", type=Path, required=True, help="JSON file of the digests")
    parser.add_argument("--devices", default="cpu,cuda",
                        help="sampler devices driven directly (default cpu,cuda; the services "
                             "always sample on the CPU)")
    args = parser.parse_args()
    results: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="graphfeed-digests-") as tmp:
        base = Path(tmp)
        plain_npz(base / "plain.npz")
        typed_npz(base / "typed.npz")
        for kind in ("plain", "typed"):
            partition(base / f"{kind}.npz", base / kind)
            results.update(run(kind, base / kind, "cpu"))
            link_npz(base / f"{kind}.npz", base / f"{kind}-links.npz")
            spec = "val=0.1,test=0.1,neg=5" + (",edge-type=" + "__".join(WRITES) if kind == "typed" else "")
            partition(base / f"{kind}-links.npz", base / f"{kind}-links", "--link-split", spec)
            results.update(run(kind, base / f"{kind}-links", "cpu", links=True))
            for device in filter(None, args.devices.split(",")):
                results.update(sampler_digests(kind, base / kind, device))
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(f"{sum(len(v) for v in results.values())} batches in {len(results)} streams -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
