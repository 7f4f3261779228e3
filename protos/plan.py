"""The epoch plan: which seeds form which batch, and which rank gets which batch.

Servers and trainers compute the same plan independently from facts they all share (the
seeds, batch size, world size, seed, epoch), so nothing about it is negotiated at run
time. Two layouts:

**Global batches** (:func:`plan_global_epoch`, the loader's default): the batches are
cut from one ordering of all the seeds, across partitions: the given order, or one
permutation drawn from ``(seed, epoch)`` when ``shuffle``. A batch's seeds are as
i.i.d. as a single-process loader's whatever the partitioning, and with ``shuffle=False``
the batches follow the input order. Global batch ``g`` goes to rank ``g % world_size``
as its batch ``i = g // world_size`` and is sampled by server ``(i + rank) %
num_servers`` (so each rank draws from every server in turn), which asks the owners of
the other seeds for their neighbors. Batch counts per rank are equal as below.

Since rank ``r`` trains global batch ``i * world_size + r`` at step ``i``, the seeds an
epoch has trained after any number of steps are a prefix of its ordering, whatever the
world size: an :class:`EpochProgress`. An epoch resumed from one (an elastic restart,
perhaps with another world size) cuts its batches from the rest of that ordering alone,
equal per rank of the new world size, so every seed is still trained once in the epoch;
with no progress the plan is the whole epoch's.

**Per-partition batches** (:func:`plan_epoch`):

- each partition's seeds are batched by the server that owns them (a batch never spans
  partitions), shuffled with ``(seed, epoch, partition)`` when ``shuffle``;
- the number of batches is made a multiple of the world size by splitting batches (never
  by repeating or dropping seeds, unless ``drop_last``), so **every rank gets the same
  number of batches** and every seed lands in exactly one batch per epoch;
- global batch ``g`` goes to rank ``g % world_size`` as its batch ``g // world_size``; the
  global order interleaves partitions (shuffled when ``shuffle``) so that each rank draws
  from every partition.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class BatchRef:
    """One batch of one rank's epoch."""

    #: Index within the rank's epoch (``0 .. num_batches-1``), as on the wire.
    index: int
    #: Partition that owns (and samples) the batch's seeds.
    partition: int
    #: Position of the batch among that partition's batches.
    part_batch: int


@dataclass(frozen=True)
class EpochProgress:
    """How far an epoch's training went: a pure function of facts every rank shares."""

    #: Optimizer steps taken (each rank's batches trained).
    steps: int = 0
    #: Seeds those steps trained over all ranks: the first ``seeds`` of the epoch's ordering.
    seeds: int = 0


#: An epoch's progress before its first step (a whole epoch to train).
EPOCH_START = EpochProgress()


@dataclass(frozen=True)
class EpochPlan:
    """The batches of one epoch, for every partition and rank."""

    #: Number of seeds in each partition's batch ``k``: ``sizes[p][k]``.
    sizes: tuple[tuple[int, ...], ...]
    #: Global batch order: ``order[g] = (partition, part_batch)``.
    order: tuple[tuple[int, int], ...]
    world_size: int
    #: Where the plan starts: per-partition batches always cover whole epochs.
    start: EpochProgress = EPOCH_START

    @property
    def batches_per_rank(self) -> int:
        return len(self.order) // self.world_size

    def rank_batches(self, rank: int) -> list[BatchRef]:
        """The batches of ``rank``, in order."""
        return [BatchRef(i, *self.order[g])
                for i, g in enumerate(range(rank, len(self.order), self.world_size))]

    def seeds_of(self, partition: int, part_batch: int, seeds: np.ndarray) -> np.ndarray:
        """Seeds of a partition's batch, cut from its (already shuffled) seed array."""
        sizes = self.sizes[partition]
        start = int(sum(sizes[:part_batch]))
        return seeds[start:start + sizes[part_batch]]


def _mix(*parts: int) -> int:
    z = 0x2545F4914F6CDD1D
    for p in parts:
        z = ((z ^ (p & _MASK)) * 0x9E3779B97F4A7C15) & _MASK
        z ^= z >> 29
    return z


def plan_epoch(
    seeds_per_partition: list[int], batch_size: int, world_size: int, *, shuffle: bool,
    seed: int, epoch: int, drop_last: bool = False,
) -> EpochPlan:
    """Plan an epoch over ``seeds_per_partition[p]`` seeds owned by each partition."""
    _check_positive(batch_size=batch_size, world_size=world_size)
    counts = [int(c) for c in seeds_per_partition]
    if drop_last:
        per_part = [c // batch_size for c in counts]
        total = sum(per_part) // world_size * world_size
        per_part = _trim(per_part, total)
        sizes = [tuple([batch_size] * k) for k in per_part]
    else:
        per_part = [-(-c // batch_size) for c in counts]
        total = -(-sum(per_part) // world_size) * world_size
        _check_enough(total, sum(counts), batch_size, world_size)
        per_part = _grow(per_part, counts, total)
        sizes = [_even_sizes(c, k) for c, k in zip(counts, per_part, strict=True)]
    order = [(p, k) for p, n in enumerate(per_part) for k in range(n)]
    order = _interleave(order, per_part, shuffle, seed, epoch)
    return EpochPlan(sizes=tuple(sizes), order=tuple(order), world_size=world_size)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name}: expected an integer > 0, got {value}")


def _check_enough(total: int, seeds: int, batch_size: int, world_size: int) -> None:
    """Raise unless ``seeds`` fill ``total`` batches (equal counts per rank) of at most ``batch_size``."""
    if total > seeds:
        raise ValueError(f"world_size: giving {world_size} ranks equal batch counts needs {total} batches "
                         f"of at most {batch_size} seeds each, but there are only {seeds} seeds; use a "
                         "larger batch_size, fewer ranks or drop_last")


def _grow(per_part: list[int], counts: list[int], total: int) -> list[int]:
    """Add batches (to the partitions with the largest batches) until ``total``."""
    out = list(per_part)
    while sum(out) < total:
        p = max(range(len(out)), key=lambda i: (counts[i] / max(out[i], 1), -i))
        out[p] += 1
    return out


def _trim(per_part: list[int], total: int) -> list[int]:
    """Drop batches (from the partitions with the most) until ``total``."""
    out = list(per_part)
    while sum(out) > total:
        p = max(range(len(out)), key=lambda i: (out[i], -i))
        out[p] -= 1
    return out


def _even_sizes(count: int, batches: int) -> tuple[int, ...]:
    """``count`` seeds in ``batches`` batches, as even as possible (sizes differ by at
    most one, so none exceeds the batch size the count of batches was derived from)."""
    if batches == 0:
        return ()
    base, extra = divmod(count, batches)
    return tuple(base + (1 if k < extra else 0) for k in range(batches))


def _interleave(order: list[tuple[int, int]], per_part: list[int], shuffle: bool, seed: int,
                epoch: int) -> list[tuple[int, int]]:
    if shuffle:
        rng = np.random.default_rng(_mix(seed, epoch, 0x5EED))
        return [order[i] for i in rng.permutation(len(order))]
    # Round-robin over partitions, so consecutive batches come from different servers.
    queues = [[(p, k) for k in range(n)] for p, n in enumerate(per_part)]
    out: list[tuple[int, int]] = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def shuffled_seeds(seeds: np.ndarray, *, shuffle: bool, seed: int, epoch: int,
                   partition: int) -> np.ndarray:
    """A partition's seeds in the order its batches cut them."""
    if not shuffle:
        return np.asarray(seeds)
    rng = np.random.default_rng(_mix(seed, epoch, partition + 1))
    return np.asarray(seeds)[rng.permutation(len(seeds))]


@dataclass(frozen=True, eq=False)
class GlobalPlan:
    """The batches of one epoch cut from one ordering of all the seeds."""

    #: Number of seeds of global batch ``g``: ``sizes[g]``.
    sizes: tuple[int, ...]
    #: Where each batch starts in :attr:`order`.
    offsets: tuple[int, ...]
    #: int64 positions in the seed list, in the order the batches cut them.
    order: np.ndarray
    world_size: int
    #: Servers that sample batches (one per partition).
    num_servers: int
    #: Where the plan starts in the epoch (its batches cut the rest of the ordering).
    start: EpochProgress = EPOCH_START

    @property
    def batches_per_rank(self) -> int:
        return len(self.sizes) // self.world_size

    def rank_batches(self, rank: int) -> list[BatchRef]:
        """The batches of ``rank``, in order; ``partition`` is the server that samples
        the batch and ``part_batch`` its global batch number."""
        return [BatchRef(i, (i + rank) % self.num_servers, i * self.world_size + rank)
                for i in range(self.batches_per_rank)]

    def positions(self, global_batch: int) -> np.ndarray:
        """Positions in the seed list of global batch ``global_batch``'s seeds, in order."""
        start = self.offsets[global_batch]
        return self.order[start:start + self.sizes[global_batch]]

    def progress_after(self, steps: int) -> EpochProgress:
        """The epoch's progress once every rank has trained its first ``steps`` batches."""
        return EpochProgress(self.start.steps + steps,
                             self.start.seeds + sum(self.sizes[:steps * self.world_size]))


def plan_global_epoch(
    num_seeds: int, batch_size: int, world_size: int, num_servers: int, *, shuffle: bool,
    seed: int, epoch: int, drop_last: bool = False, steps_done: int = 0, seeds_done: int = 0,
) -> GlobalPlan:
    """Plan an epoch of global batches over ``num_seeds`` seeds, from its progress
    ``EpochProgress(steps_done, seeds_done)`` on: the rest of the epoch's ordering (see
    the module doc)."""
    _check_positive(batch_size=batch_size, world_size=world_size, num_servers=num_servers)
    if not 0 <= seeds_done <= num_seeds:
        raise ValueError(f"seeds_done: expected 0 .. {num_seeds} (the epoch's seeds), got {seeds_done}")
    if steps_done < 0:
        raise ValueError(f"steps_done: expected >= 0, got {steps_done}")
    start = EpochProgress(int(steps_done), int(seeds_done))
    n = int(num_seeds) - start.seeds
    if drop_last:
        total = n // batch_size // world_size * world_size
        sizes = (batch_size,) * total
    else:
        needed = -(-n // batch_size)
        total = -(-needed // world_size) * world_size
        _check_enough(total, n, batch_size, world_size)
        if total == needed:  # as PyG cuts: full batches, then the rest
            sizes = (batch_size,) * (total - 1) + ((n - batch_size * (total - 1),) if total else ())
        else:
            sizes = _even_sizes(n, total)
    offsets = tuple(int(o) for o in np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])[:-1])
    if shuffle:
        order = np.random.default_rng(_mix(seed, epoch, 0x610BA1)).permutation(int(num_seeds))
    else:
        order = np.arange(int(num_seeds))
    return GlobalPlan(sizes=tuple(int(x) for x in sizes), offsets=offsets,
                      order=order[start.seeds:].astype(np.int64), world_size=world_size,
                      num_servers=num_servers, start=start)
