"""The epoch plan (protos/plan.py) that servers and trainers compute independently:
equal batch counts on every rank, every seed exactly once per epoch, determinism,
shuffling by epoch, and clear errors."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from protos.plan import EPOCH_START, EpochPlan, EpochProgress, plan_epoch, plan_global_epoch, shuffled_seeds

COUNTS = [[10], [0, 10], [7, 0, 3], [100, 1], [33, 34, 35], [5, 5, 5, 5], [1000, 17, 250],
          [1, 1, 1], [64, 64]]
BATCH_SIZES = [1, 3, 8, 64]
WORLD_SIZES = [1, 2, 3, 4, 7]
CASES = list(itertools.product(range(len(COUNTS)), BATCH_SIZES, WORLD_SIZES, [False, True]))


def _seeds(counts: list[int]) -> list[np.ndarray]:
    """Distinct global IDs per partition (contiguous ranges, as the partition book gives)."""
    starts = np.concatenate([[0], np.cumsum(counts)])
    return [np.arange(starts[p], starts[p] + c, dtype=np.int64) for p, c in enumerate(counts)]


def _plan(counts: list[int], batch: int, world: int, drop_last: bool, *, shuffle: bool = True,
          seed: int = 1, epoch: int = 0) -> EpochPlan | None:
    try:
        return plan_epoch(counts, batch, world, shuffle=shuffle, seed=seed, epoch=epoch,
                          drop_last=drop_last)
    except ValueError as exc:
        # Refused only when equal counts would need more batches than there are seeds
        # (each batch holds at least one seed and at most `batch`): never made uneven.
        batches = sum(-(-c // batch) for c in counts)
        assert not drop_last and -(-batches // world) * world > sum(counts), exc
        assert "world_size" in str(exc)
        return None


def _epoch_seeds(plan: EpochPlan, counts: list[int], shuffle: bool, seed: int, epoch: int,
                 world: int) -> list[list[np.ndarray]]:
    """Per rank, the seeds of each of its batches, cut as a server cuts them."""
    parts = [shuffled_seeds(s, shuffle=shuffle, seed=seed, epoch=epoch, partition=p)
             for p, s in enumerate(_seeds(counts))]
    return [[plan.seeds_of(b.partition, b.part_batch, parts[b.partition])
             for b in plan.rank_batches(r)] for r in range(world)]


@pytest.mark.parametrize(("ci", "batch", "world", "drop_last"), CASES)
def test_every_rank_gets_the_same_number_of_batches(ci: int, batch: int, world: int,
                                                    drop_last: bool) -> None:
    counts = COUNTS[ci]
    plan = _plan(counts, batch, world, drop_last)
    if plan is None:
        return
    lengths = {len(plan.rank_batches(r)) for r in range(world)}
    assert lengths == {plan.batches_per_rank}
    assert [b.index for b in plan.rank_batches(world - 1)] == list(range(plan.batches_per_rank))
    per_rank = _epoch_seeds(plan, counts, True, 1, 0, world)
    sizes = [s.size for rank in per_rank for s in rank]
    assert all(1 <= s <= batch for s in sizes)
    if drop_last:
        assert all(s == batch for s in sizes)


@pytest.mark.parametrize(("ci", "batch", "world"),
                         list(itertools.product(range(len(COUNTS)), BATCH_SIZES, WORLD_SIZES)))
def test_every_seed_exactly_once_per_epoch(ci: int, batch: int, world: int) -> None:
    counts = COUNTS[ci]
    plan = _plan(counts, batch, world, drop_last=False)
    if plan is None:
        return
    got = np.concatenate([s for rank in _epoch_seeds(plan, counts, True, 1, 0, world)
                          for s in rank])
    assert np.array_equal(np.sort(got), np.arange(sum(counts)))


@pytest.mark.parametrize(("ci", "batch", "world"),
                         list(itertools.product(range(len(COUNTS)), BATCH_SIZES, WORLD_SIZES)))
def test_drop_last_drops_only_what_it_must(ci: int, batch: int, world: int) -> None:
    counts = COUNTS[ci]
    plan = _plan(counts, batch, world, drop_last=True)
    assert plan is not None
    got = np.concatenate([np.empty(0, np.int64)] + [
        s for rank in _epoch_seeds(plan, counts, True, 1, 0, world) for s in rank])
    assert np.unique(got).size == got.size  # never a seed twice
    full = sum(c // batch for c in counts)
    assert plan.batches_per_rank == full // world  # only the remainder is dropped


def test_batches_stay_in_their_partition() -> None:
    counts = [37, 12, 90]
    plan = plan_epoch(counts, 8, 3, shuffle=True, seed=5, epoch=2)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    for rank in range(3):
        parts = [shuffled_seeds(s, shuffle=True, seed=5, epoch=2, partition=p)
                 for p, s in enumerate(_seeds(counts))]
        for b in plan.rank_batches(rank):
            seeds = plan.seeds_of(b.partition, b.part_batch, parts[b.partition])
            assert seeds.min() >= bounds[b.partition] and seeds.max() < bounds[b.partition + 1]


def test_plan_is_deterministic() -> None:
    a = plan_epoch([50, 70], 8, 4, shuffle=True, seed=11, epoch=3)
    b = plan_epoch([50, 70], 8, 4, shuffle=True, seed=11, epoch=3)
    assert a == b
    seeds = np.arange(50)
    assert np.array_equal(shuffled_seeds(seeds, shuffle=True, seed=11, epoch=3, partition=0),
                          shuffled_seeds(seeds, shuffle=True, seed=11, epoch=3, partition=0))


def test_shuffle_changes_with_epoch_and_seed() -> None:
    seeds = np.arange(200)
    base = plan_epoch([100, 100], 4, 2, shuffle=True, seed=1, epoch=0)
    assert plan_epoch([100, 100], 4, 2, shuffle=True, seed=1, epoch=1).order != base.order
    assert plan_epoch([100, 100], 4, 2, shuffle=True, seed=2, epoch=0).order != base.order
    s0 = shuffled_seeds(seeds, shuffle=True, seed=1, epoch=0, partition=0)
    s1 = shuffled_seeds(seeds, shuffle=True, seed=1, epoch=1, partition=0)
    other = shuffled_seeds(seeds, shuffle=True, seed=1, epoch=0, partition=1)
    assert not np.array_equal(s0, s1) and not np.array_equal(s0, other)
    assert np.array_equal(np.sort(s0), seeds)


def test_without_shuffle_order_is_round_robin_and_seeds_keep_their_order() -> None:
    plan = plan_epoch([4, 4], 2, 1, shuffle=False, seed=0, epoch=0)
    assert plan.order == ((0, 0), (1, 0), (0, 1), (1, 1))
    seeds = np.array([9, 3, 7, 1])
    assert np.array_equal(shuffled_seeds(seeds, shuffle=False, seed=0, epoch=5, partition=0), seeds)
    assert plan == plan_epoch([4, 4], 2, 1, shuffle=False, seed=3, epoch=9)


def test_uneven_partitions_are_split_not_padded() -> None:
    # 3 batches of <= 4 from 10 seeds for 2 ranks: one batch is split to make 4.
    plan = plan_epoch([10], 4, 2, shuffle=False, seed=0, epoch=0)
    assert plan.batches_per_rank == 2
    assert sorted(plan.sizes[0]) == [2, 2, 3, 3]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"batch_size": 0}, "batch_size"),
    ({"batch_size": -3}, "batch_size"),
    ({"world_size": 0}, "world_size"),
    ({"world_size": 5, "counts": [2, 2]}, "world_size"),
])
def test_bad_arguments_name_the_field(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"counts": [10, 10], "batch_size": 4, "world_size": 2}
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        plan_epoch(args["counts"], args["batch_size"], args["world_size"],  # type: ignore[arg-type]
                   shuffle=True, seed=0, epoch=0)


def test_no_seeds_gives_an_empty_epoch_on_every_rank() -> None:
    plan = plan_epoch([0, 0], 4, 3, shuffle=True, seed=0, epoch=0)
    assert plan.batches_per_rank == 0
    assert all(plan.rank_batches(r) == [] for r in range(3))
    assert plan_epoch([3, 2], 4, 2, shuffle=True, seed=0, epoch=0, drop_last=True).batches_per_rank == 0


# ---- global batches ------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("num_seeds", "batch_size", "world_size", "servers"),
                         [(10, 4, 1, 3), (103, 10, 4, 3), (64, 8, 2, 2), (9, 1, 3, 1), (50, 64, 1, 4)])
def test_global_plan_covers_every_seed_once_with_equal_rank_counts(
    num_seeds: int, batch_size: int, world_size: int, servers: int, drop_last: bool
) -> None:
    for shuffle in (False, True):
        plan = plan_global_epoch(num_seeds, batch_size, world_size, servers, shuffle=shuffle, seed=5,
                                 epoch=1, drop_last=drop_last)
        seen = []
        for rank in range(world_size):
            refs = plan.rank_batches(rank)
            assert len(refs) == plan.batches_per_rank
            assert [r.index for r in refs] == list(range(len(refs)))
            assert {r.partition for r in refs} <= set(range(servers))
            for ref in refs:
                pos = plan.positions(ref.part_batch)
                assert 0 < pos.size <= batch_size
                seen += pos.tolist()
        if drop_last:
            kept = num_seeds // batch_size // world_size * world_size * batch_size
            assert len(seen) == len(set(seen)) == kept
        else:
            assert sorted(seen) == list(range(num_seeds))
        if not shuffle:
            order = [p for g in range(len(plan.sizes)) for p in plan.positions(g).tolist()]
            assert order == sorted(order)


def test_global_plan_spreads_each_rank_over_every_server_and_shuffles_per_epoch() -> None:
    plan = plan_global_epoch(1000, 10, 2, 2, shuffle=True, seed=0, epoch=0)
    for rank in range(2):
        servers = [r.partition for r in plan.rank_batches(rank)]
        assert servers.count(0) == servers.count(1) == 25
    other = plan_global_epoch(1000, 10, 2, 2, shuffle=True, seed=0, epoch=1)
    assert not np.array_equal(plan.order, other.order)
    again = plan_global_epoch(1000, 10, 2, 2, shuffle=True, seed=0, epoch=0)
    assert np.array_equal(plan.order, again.order)


def test_global_plan_refuses_more_ranks_than_seeds() -> None:
    with pytest.raises(ValueError, match=r"world_size: giving 8 ranks equal batch counts needs 8 batches"):
        plan_global_epoch(5, 2, 8, 1, shuffle=False, seed=0, epoch=0)


# ---- an epoch resumed part way ---------------------------------------------------------------


def _train(plan: Any, steps: int) -> list[list[int]]:
    """The seeds each of the plan's first ``steps`` steps trains, over all ranks."""
    return [[p for rank in range(plan.world_size)
             for p in plan.positions(plan.rank_batches(rank)[i].part_batch).tolist()] for i in range(steps)]


@pytest.mark.parametrize(("num_seeds", "batch_size"), [(103, 4), (64, 8), (1000, 7), (12, 1)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_an_epoch_resumed_on_other_world_sizes_trains_every_seed_once(
    num_seeds: int, batch_size: int, shuffle: bool
) -> None:
    """Any sequence of world sizes, each taking some steps and leaving a progress the next
    plan starts from: equal batches per rank in every plan, every seed once in the epoch,
    the progress counts the steps and the seeds trained, and batch keys continue the steps."""
    rng = np.random.default_rng(num_seeds + batch_size)
    for _ in range(20):
        start, trained, steps = EPOCH_START, [], 0
        while True:
            rest = num_seeds - start.seeds  # world sizes that can give every rank equal batches of it:
            batches = -(-rest // batch_size)
            worlds = [w for w in range(1, 6) if -(-batches // w) * w <= rest]
            world = int(rng.choice(worlds))
            plan = plan_global_epoch(num_seeds, batch_size, world, 3, shuffle=shuffle, seed=4, epoch=2,
                                     steps_done=start.steps, seeds_done=start.seeds)
            assert {len(plan.rank_batches(r)) for r in range(world)} == {plan.batches_per_rank}
            last = rng.random() < 0.3 or plan.batches_per_rank <= 1
            taken = plan.batches_per_rank if last else int(rng.integers(0, plan.batches_per_rank))
            step_seeds = _train(plan, taken)
            trained += [p for s in step_seeds for p in s]
            steps += taken
            start = plan.progress_after(taken)
            assert start == EpochProgress(steps, len(trained))
            if last:
                break
        assert sorted(trained) == list(range(num_seeds))
        whole = plan_global_epoch(num_seeds, batch_size, 1, 3, shuffle=shuffle, seed=4, epoch=2)
        assert trained == whole.order.tolist()  # a prefix of the epoch's ordering at every step


def test_a_plan_from_the_start_is_the_whole_epochs() -> None:
    whole = plan_global_epoch(103, 4, 3, 2, shuffle=True, seed=1, epoch=5)
    again = plan_global_epoch(103, 4, 3, 2, shuffle=True, seed=1, epoch=5, steps_done=0, seeds_done=0)
    assert whole.sizes == again.sizes and np.array_equal(whole.order, again.order)
    assert whole.start == EPOCH_START
    assert whole.progress_after(whole.batches_per_rank) == EpochProgress(9, 103)


@pytest.mark.parametrize(("steps", "seeds", "message"), [
    (0, 104, r"seeds_done: expected 0 \.\. 103 \(the epoch's seeds\), got 104"),
    (0, -1, r"seeds_done: expected 0 \.\. 103 \(the epoch's seeds\), got -1"),
    (-1, 0, r"steps_done: expected >= 0, got -1"),
])
def test_a_start_outside_the_epoch_is_refused(steps: int, seeds: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_global_epoch(103, 4, 3, 2, shuffle=True, seed=1, epoch=5, steps_done=steps, seeds_done=seeds)
