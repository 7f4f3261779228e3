"""Multi-partition feature gather benchmark (not a test): what one server does to build a
batch's ``x`` and ``y`` when the batch mixes its own nodes and a peer's.

``products-like`` in 2 ``range`` partitions; the server holds partition 0. Each batch is a
sample of ``--nodes`` global IDs (about half owned, a real products batch's size by
default), in random order. The peer's answers (its rows, in the wire dtype) are computed
before the clock starts, so both rows time only the owning server's own work:

- ``graphfeed``: ``CpuNeighborSampler.gather(n_id, remote=..., dtype=wire)``: ``x`` in the
  wire dtype, owned rows gathered straight into place (narrowed to bfloat16 on the way),
  the peer's rows scattered in by a parallel Numba kernel;
- ``torch``: the same result the way vectorized PyTorch writes it: ``index_select`` of the
  owned rows, ``index_put`` of them and of the peer's rows (widened to the stored dtype)
  into ``x``, then ``Tensor.to`` the wire dtype;
- ``graphfeed + encode``: ``graphfeed``, then ``x`` encoded into 4 MiB stream messages
  (``protos.fastwire.encode_message``: a server's way until its gather wrote ``x`` into
  them);
- ``graphfeed into messages``: ``x`` gathered straight into its stream messages
  (``gather_to`` into ``protos.fastwire.RowMessages``, finished): a server's way now.

All rows give the same bits (checked on the first batch: the messages' ``x`` decoded).
Rows alternate within each of ``--passes`` passes; a ratio is the median of the per-pass
ratios. Writes ``benchmarks/results/gather.json``.

    python benchmarks/experiments/gather.py --data data/bench
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, sampler
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch
from common import ensure_partitions, machine, write_json

from partitioner.graph import PLAIN_NODE_TYPE

log = logging.getLogger("bench.gather")

WIRE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _Answers:
    """A stand-in peer (a ``Remote`` of the sampler) that answers node data with rows
    computed beforehand."""

    def __init__(self, answers: dict[int, Any]) -> None:
        self.answers = answers

    def node_data(self, node_type: str, nodes_by_partition: Any, features: bool,
                  labels: bool) -> dict[int, Any]:
        return self.answers

    def sample(self, *args: Any) -> Any:
        raise AssertionError("the gather benchmark samples nothing")

    def orig_ids(self, *args: Any) -> Any:
        raise AssertionError("the gather benchmark asks for no original IDs")

    def has_edges(self, *args: Any) -> Any:
        raise AssertionError("the gather benchmark tests no edges")

    def edge_data(self, *args: Any) -> Any:
        raise AssertionError("the gather benchmark reads no edge rows")


def peer_answers(peer: Any, peer_start: int, n_id: torch.Tensor, remote_pos: torch.Tensor,
                 wire: torch.dtype) -> dict[int, Any]:
    """Partition 1's answer for the nodes of ``n_id`` at ``remote_pos``: rows in ``wire``."""
    rows = n_id[remote_pos].numpy() - peer_start
    return {1: (torch.from_numpy(np.asarray(peer.x[PLAIN_NODE_TYPE])[rows]).to(wire),
                torch.from_numpy(np.asarray(peer.y)[rows]))}


def torch_gather(x_stored: torch.Tensor, y_stored: torch.Tensor, node_start: int,
                 n_id: torch.Tensor, mine: torch.Tensor, answers: dict[int, Any],
                 groups: dict[int, torch.Tensor], wire: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    local_pos = torch.nonzero(mine).flatten()
    rows = n_id[local_pos] - node_start
    x = torch.empty((n_id.numel(), x_stored.shape[1]), dtype=x_stored.dtype)
    y = torch.empty(n_id.numel(), dtype=torch.int64)
    x[local_pos] = x_stored.index_select(0, rows)
    y[local_pos] = y_stored.index_select(0, rows)
    for p, pos in groups.items():
        rx, ry = answers[p]
        x[pos] = rx.to(x.dtype)
        y[pos] = ry
    return x.to(wire), y


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--preset", default="products-like")
    parser.add_argument("--nodes", type=int, default=430_000,
                        help="nodes per batch (a products-like [15,10,5] batch of 1024 seeds has ~430,000)")
    parser.add_argument("--batches", type=int, default=5, help="batches per row and pass")
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    from partitioner import load_partition
    from protos import codec, fastwire
    from protos import sampling_pb2 as pb
    from protos.allocator import keep_freed_memory
    from protos.assembler import TensorAssembler
    from sampling_server.sampler import create_sampler

    T = PLAIN_NODE_TYPE  # a plain graph: one node type

    def head(i: int, n: int) -> pb.MinibatchChunk:
        return pb.MinibatchChunk(batch_index=0, chunk_index=i, num_chunks=n)

    chunk = codec.DEFAULT_CHUNK_BYTES

    def encoded(n_id: torch.Tensor, remote: Any, wire: torch.dtype) -> list[bytes]:
        x, _ = sampler.gather(T, n_id, remote=remote, dtype=wire)
        assert x is not None
        return fastwire.encode_chunks(head, {"x": x}, chunk)

    def into_messages(n_id: torch.Tensor, remote: Any, wire: torch.dtype) -> list[bytes]:
        width = tuple(np.asarray(mine_part.x[T]).shape[1:])
        out = fastwire.RowMessages(head, "x", wire, n_id.numel(), width, chunk)
        sampler.gather_to(T, n_id, out.blocks, remote=remote)
        return out.finish(0, len(out))

    def decoded_x(messages: list[bytes]) -> torch.Tensor:
        assembler = TensorAssembler()
        for m in messages:
            assembler.add_all(fastwire.parse_chunk(pb.MinibatchChunk, m).tensors)
        return assembler.finish_torch()["x"]

    keep_freed_memory()  # as the server's CLI does
    part_dir = ensure_partitions(args.data, args.preset, 2)
    mine_part = load_partition(part_dir, 0, verify="size", mmap=False)
    peer_part = load_partition(part_dir, 1, verify="size", mmap=False)
    sampler = create_sampler(mine_part, device="cpu")
    start, peer_start = mine_part.node_range(T)[0], peer_part.node_range(T)[0]
    x_stored = torch.from_numpy(np.asarray(mine_part.x[T]))
    y_stored = torch.from_numpy(np.asarray(mine_part.y))
    num_nodes = int(sampler.books[T][-1])
    rng = np.random.default_rng(0)
    # untimed: compile the kernels and grow the heap to a full batch's size, both rows
    warm = torch.from_numpy(rng.choice(num_nodes, args.nodes, replace=False))
    warm_mine = sampler.owner_of(T, warm) == 0
    warm_groups = {1: torch.nonzero(~warm_mine).flatten()}
    for wire in WIRE.values():
        warm_answers = peer_answers(peer_part, peer_start, warm, warm_groups[1], wire)
        sampler.gather(T, warm, remote=_Answers(warm_answers), dtype=wire)
        torch_gather(x_stored, y_stored, start, warm, warm_mine, warm_answers, warm_groups, wire)
        encoded(warm, _Answers(warm_answers), wire)
        into_messages(warm, _Answers(warm_answers), wire)
    rows: list[dict[str, Any]] = []
    ratios: dict[str, list[float]] = {w: [] for w in WIRE}
    into_ratios: dict[str, list[float]] = {w: [] for w in WIRE}
    labels = ("graphfeed", "torch", "graphfeed + encode", "graphfeed into messages")
    for p in range(args.passes):
        for wire_name, wire in WIRE.items():
            times: dict[str, list[float]] = {label: [] for label in labels}
            for b in range(args.batches):
                n_id = torch.from_numpy(rng.choice(num_nodes, args.nodes, replace=False))
                mine = sampler.owner_of(T, n_id) == 0
                groups = {1: torch.nonzero(~mine).flatten()}
                answers = peer_answers(peer_part, peer_start, n_id, groups[1], wire)
                remote = _Answers(answers)

                order = labels if (p + b) % 2 == 0 else labels[::-1]
                out: dict[str, Any] = {}
                for label in order:
                    began = time.perf_counter()
                    if label == "graphfeed":
                        x, y = sampler.gather(T, n_id, remote=remote, dtype=wire)
                        assert x is not None and y is not None
                        out[label] = (x, y)
                    elif label == "torch":
                        out[label] = torch_gather(x_stored, y_stored, start, n_id, mine, answers,
                                                  groups, wire)
                    elif label == "graphfeed + encode":
                        out[label] = encoded(n_id, remote, wire)
                    else:
                        out[label] = into_messages(n_id, remote, wire)
                    times[label].append(time.perf_counter() - began)
                if p == 0 and b == 0:
                    (gx, gy), (tx, ty) = out["graphfeed"], out["torch"]
                    same = torch.equal(gx.view(torch.uint8), tx.view(torch.uint8)) and torch.equal(gy, ty)
                    for label in ("graphfeed + encode", "graphfeed into messages"):
                        same = same and torch.equal(decoded_x(out[label]).view(torch.uint8),
                                                    gx.view(torch.uint8))
                    if not same:
                        raise SystemExit(f"{wire_name}: graphfeed's gathers differ from torch's")
                del out
            medians = {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in times.items()}
            ratio = medians["torch"] / medians["graphfeed"]
            ratios[wire_name].append(ratio)
            into_ratios[wire_name].append(medians["graphfeed + encode"] / medians["graphfeed into messages"])
            for label, secs in medians.items():
                rows.append({"pass": p, "wire": wire_name, "label": label,
                             "ms_per_batch": round(secs * 1e3, 2)})
            log.info("pass %d %s: graphfeed %.1f ms, torch %.1f ms per batch (%.2fx); x encoded after "
                     "%.1f ms, gathered into its messages %.1f ms", p, wire_name,
                     medians["graphfeed"] * 1e3, medians["torch"] * 1e3, ratio,
                     medians["graphfeed + encode"] * 1e3, medians["graphfeed into messages"] * 1e3)
    summary = {w: {"median_ratio_torch_over_graphfeed": round(statistics.median(r), 3),
                   "per_pass": [round(v, 3) for v in r],
                   "median_ratio_encode_over_into_messages": round(statistics.median(into_ratios[w]), 3),
                   "into_messages_per_pass": [round(v, 3) for v in into_ratios[w]]}
               for w, r in ratios.items()}
    path = write_json("gather", {"benchmark": "gather", "preset": args.preset, "nodes": args.nodes,
                                 "machine": machine(), "rows": rows, "ratios": summary})
    for w, s in summary.items():
        print(f"{w}: torch / graphfeed = {s['median_ratio_torch_over_graphfeed']}x "
              f"(per pass {s['per_pass']}); graphfeed + encode / into messages = "
              f"{s['median_ratio_encode_over_into_messages']}x (per pass {s['into_messages_per_pass']})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
