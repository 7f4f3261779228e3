"""Link-prediction metrics with OGB's rules, exact across DDP ranks.

* **MRR and Hits@1/3/10 against each positive's own negatives** (ogbl-citation2's
  protocol, ``ogb.linkproppred.Evaluator._eval_mrr``): a positive scored ``p`` with
  negatives ``n_1 .. n_K`` has rank ``1 + (#{n_k > p} + #{n_k >= p}) / 2``, the mean of the
  optimistic and the pessimistic rank, so ties cost half a place each; MRR is the mean of
  ``1 / rank``, Hits@k the share of ranks ``<= k``. Each positive's rank depends on its own
  row only: the ranks sum their rows' figures and counts (:func:`rank_metrics`).
* **Hits@K against one shared set of negative edges** (ogbl-collab's protocol, ``_eval_hits``):
  a positive counts when its score is *strictly above* the K-th highest negative score;
  with fewer than K negatives Hits@K is 1. The threshold needs every rank's negatives: each
  rank contributes its own top K (:func:`global_kth_largest`), which contain the global top K.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from trainer_client.ddp import DistEnv, all_reduce_sums

#: The Hits@k of the per-positive protocol (OGB's ``Evaluator('ogbl-citation2')``).
RANK_HITS = (1, 3, 10)


def _check_ranking_scores(pos: Tensor, neg: Tensor) -> None:
    if pos.dim() != 1 or neg.dim() != 2 or neg.shape[0] != pos.shape[0]:
        raise ValueError(f"scores: expected positives [P] and their negatives [P, K], got "
                         f"{list(pos.shape)} and {list(neg.shape)}")


def ogb_ranks(pos: Tensor, neg: Tensor) -> Tensor:
    """Each positive's rank among its own negatives, OGB's rule (float ``[P]``, >= 1):
    ``1 + (#neg > pos + #neg >= pos) / 2``. ``pos`` ``[P]``, ``neg`` ``[P, K]``."""
    _check_ranking_scores(pos, neg)
    column = pos.reshape(-1, 1)
    optimistic = (neg > column).sum(dim=1)
    pessimistic = (neg >= column).sum(dim=1)
    return 0.5 * (optimistic + pessimistic).to(torch.float64) + 1.0


def ranking_metrics(pos: Tensor, neg: Tensor, env: DistEnv | None = None) -> dict[str, float]:
    """MRR and Hits@1/3/10 of this rank's positives ``pos`` ``[P]`` against their own
    negatives ``neg`` ``[P, K]``, over every rank of ``env`` (each rank passes its own
    rows; every positive is counted once)."""
    return rank_metrics(ogb_ranks(pos, neg), env)


def rank_metrics(ranks: Tensor, env: DistEnv | None = None) -> dict[str, float]:
    """:func:`ranking_metrics` of this rank's positives' ``ranks`` (:func:`ogb_ranks`):
    ``mrr``, ``hits@k`` of :data:`RANK_HITS` (0.0 without positives) and ``count``. The
    ranks add their sums of ``1 / rank``, of ranks <= k and their counts."""
    ranks = ranks.to(torch.float64)
    sums = {"mrr": float((1.0 / ranks).sum()) if ranks.numel() else 0.0,
            **{f"hits@{k}": float((ranks <= k).sum()) for k in RANK_HITS}, "count": float(ranks.numel())}
    if env is not None:
        sums = dict(zip(sums, all_reduce_sums(list(sums.values()), env), strict=True))
    count = sums.pop("count")
    return {**{k: v / count if count else 0.0 for k, v in sums.items()}, "count": count}


def global_kth_largest(values: Tensor, k: int, env: DistEnv | None = None) -> tuple[float | None, int]:
    """The ``k``-th largest of the values of every rank (each passes its own), and how
    many values there are in all; None when fewer than ``k``."""
    if k < 1:
        raise ValueError(f"k: expected an integer >= 1, got {k}")
    flat = values.detach().reshape(-1).to(torch.float64)
    top = torch.topk(flat, min(k, flat.numel())).values
    total = int(flat.numel())
    if env is not None and env.distributed:
        total = int(all_reduce_sums([total], env)[0])
        padded = torch.full((k,), float("-inf"), dtype=torch.float64, device=env.comm_device)
        padded[: top.numel()] = top.to(env.comm_device)
        everyone = [torch.empty_like(padded) for _ in range(env.world_size)]
        dist.all_gather(everyone, padded)
        merged = torch.cat(everyone).cpu()
        top = torch.topk(merged, k).values
    if total < k:
        return None, total
    return float(top[k - 1]), total


def hits_at_k(pos: Tensor, neg: Tensor, k: int, env: DistEnv | None = None) -> dict[str, float]:
    """Hits@``k`` of ogbl-collab: the share of positives (every rank's ``pos``) scored
    strictly above the ``k``-th highest negative score (every rank's ``neg``); 1.0 with
    fewer than ``k`` negatives, as OGB's evaluator. Returns ``{"hits@k": ..., "count": P}``."""
    threshold, _ = global_kth_largest(neg, k, env)
    above = float((pos.detach().reshape(-1).to(torch.float64) > threshold).sum()) if threshold is not None \
        else float(pos.numel())
    hits, count = above, float(pos.numel())
    if env is not None:
        hits, count = all_reduce_sums([hits, count], env)
    return {f"hits@{k}": (hits / count if count else 0.0) if threshold is not None else 1.0, "count": count}
