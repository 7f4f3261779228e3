"""One DDP rank of the link trainer's tests (run by ``torch.distributed.run``):
``python -m torch.distributed.run --nproc-per-node 2 tests/link_ddp_worker.py KIND OUT SERVERS``.

1. The metric functions across ranks: fixed scores, cut unevenly over the ranks; rank 0
   writes what the ranks computed together to ``OUT/metrics-gathered.json``.
2. A link run on the tiny graph of KIND served by SERVERS (comma-separated addresses), each
   rank its share; rank 0 writes the run's metrics to ``OUT/metrics.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from link_fixtures import link_args  # noqa: E402

from trainer_client.cluster import Cluster  # noqa: E402
from trainer_client.ddp import setup_distributed, teardown_distributed  # noqa: E402
from trainer_client.link_metrics import hits_at_k, ranking_metrics  # noqa: E402
from trainer_client.link_task import cluster_link_task  # noqa: E402
from trainer_client.loop import run  # noqa: E402


def fixed_scores() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positives [12], their negatives [12, 6] (with ties) and shared negatives [40],
    ascending: the last rank's share holds the top ones, so a rank's own K-th largest is
    not the global one."""
    gen = torch.Generator().manual_seed(7)
    pos = torch.randint(0, 5, (12,), generator=gen).float()
    return pos, torch.randint(0, 5, (12, 6), generator=gen).float(), torch.linspace(-3.0, 4.0, 40)


def main() -> None:
    kind, out, servers = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    env = setup_distributed("cpu", 60.0, "gloo")
    try:
        pos, neg, shared = fixed_scores()
        cut, shared_cut = (0, 7, 12), (0, 31, 40)  # uneven shares
        mine = slice(cut[env.rank], cut[env.rank + 1])
        negatives = shared[shared_cut[env.rank]: shared_cut[env.rank + 1]]
        gathered = {"ranking": ranking_metrics(pos[mine], neg[mine], env),
                    "hits": hits_at_k(pos[mine], negatives, 5, env)}
        args = link_args(kind, "--epochs", "2", "--metrics-json", str(out / "metrics.json"))
        with Cluster(servers) as cluster:
            metrics = run(args, env, cluster_link_task(args, env, cluster))
        if env.rank == 0:
            (out / "metrics-gathered.json").write_text(json.dumps(gathered))
            (out / "metrics.json").write_text(json.dumps(metrics))
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main()
