"""One trainer rank of ``benchmarks/scale.py`` (a process of its own): reads ``--batches``
batches from the servers with ``RemoteNeighborLoader`` (epoch after epoch where an epoch
has fewer), optionally training a GraphSAGE model on each, and writes what it measured
to ``--out`` as JSON: the fill time of its feature cache and node table, batches/s,
bytes per batch, the cache's hit rate, its own memory, and with ``--train`` the losses.

    python benchmarks/scale_trainer.py --servers A,B,C,D --rank 0 --world-size 1 --out r0.json
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

log = logging.getLogger("bench.scale_trainer")


def rss_gib() -> float:
    """This process's resident memory now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from trainer_client.loader import RemoteNeighborLoader

    torch.set_num_threads(2 if args.train else 1)
    started = time.perf_counter()
    loader = RemoteNeighborLoader(args.servers, "train", num_neighbors=args.fanouts,
                                  batch_size=args.batch_size, shuffle=True, rank=args.rank,
                                  world_size=args.world_size, feature_dtype=args.feature_dtype,
                                  cache_size=args.cache_size, cache_progress=False, connect_timeout=900,
                                  stall_timeout=600)
    fill = time.perf_counter() - started
    model = optimizer = None
    if args.train:
        from torch_geometric.nn import GraphSAGE

        torch.manual_seed(args.rank)
        model = GraphSAGE(loader.num_features, args.hidden, num_layers=len(args.fanouts),
                          out_channels=loader.num_classes)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
    losses: list[float] = []
    done, nbytes, rows, hits, nodes, waited = 0, 0, 0, 0, 0, 0.0
    timed_from = None
    while done < args.batches + 1:
        for batch in loader:
            if model is not None and optimizer is not None:
                optimizer.zero_grad()
                out = model(batch.x, batch.edge_index)[:batch.batch_size]
                loss = torch.nn.functional.cross_entropy(out, batch.y[:batch.batch_size])
                loss.backward()
                optimizer.step()
                losses.append(round(loss.item(), 4))
            nodes += int(batch.num_nodes)
            done += 1
            if timed_from is None:  # the first batch pays the servers' one-time set-up
                timed_from, nodes = time.perf_counter(), 0
            if done == args.batches + 1:
                break
        stats = loader.last_stats
        nbytes, rows, hits = nbytes + stats.bytes, rows + stats.rows, hits + stats.cached_rows
        waited += stats.wait_seconds
    wall = time.perf_counter() - (timed_from or started)
    loader.close()
    timed = args.batches
    return {"rank": args.rank, "world_size": args.world_size, "batches": timed,
            "batches_per_s": round(timed / wall, 3), "seconds": round(wall, 2),
            "bytes_per_batch": round(nbytes / done), "nodes_per_batch": round(nodes / timed),
            "wait_seconds": round(waited, 2),
            "hit_rate": round(hits / rows, 4) if rows else 0.0, "fill_seconds": round(fill, 2),
            "rss_gib": round(rss_gib(), 3),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
            **({"losses": losses} if losses else {})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--fanouts", type=int, nargs="+", default=[15, 10, 5])
    p.add_argument("--feature-dtype", default="bfloat16")
    p.add_argument("--cache-size", default="0.1")
    p.add_argument("--train", action="store_true", help="a GraphSAGE step on every batch")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    args.out.write_text(json.dumps(run(args)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
