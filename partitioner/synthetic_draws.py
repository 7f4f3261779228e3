"""The draws every synthetic preset shares: a counter-based uniform for parallel draws,
class sizes, power-law weights, class-centroid features and distinct edge keys."""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
from tqdm import tqdm

from partitioner.graph import sorted_unique


@numba.njit(inline="always")
def counter_uniform(seed: np.uint64, item: int, stream: int) -> float:
    """Uniform float in [0, 1) number ``stream`` (< 8) of draw ``item``, from a
    counter-based generator (SplitMix64 finalizer), so parallel draws are reproducible
    whatever the thread count; the synthetic graphs' edges are drawn with it too. (All
    arithmetic stays in uint64: mixing in int64 would give floats.)"""
    counter = np.uint64(item) * np.uint64(8) + np.uint64(stream)
    z = seed + counter * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return float(z >> np.uint64(11)) * (1.0 / 9007199254740992.0)


def draw_classes(rng: np.random.Generator, n: int, num_classes: int, skew: float) -> np.ndarray:
    """int64 ``[n]`` classes, class ``k`` drawn with probability proportional to ``(k+1)^-skew``."""
    sizes = (np.arange(1, num_classes + 1, dtype=np.float64)) ** -skew
    return rng.choice(num_classes, size=n, p=sizes / sizes.sum()).astype(np.int64)


def power_law_weights(rng: np.random.Generator, n: int, gamma: float, cap: float) -> np.ndarray:
    """Expected-degree weights ``w_i ~ rank^(-1/(gamma-1))`` summing to 1, in a random node
    order, none above ``cap`` (with 2M edges, a node's expected degree is 2M w_i)."""
    ranks = rng.permutation(n).astype(np.float64) + 1.0
    w = ranks ** (-1.0 / (gamma - 1.0))
    w /= w.sum()
    for _ in range(10):
        w = np.minimum(w, cap)
        w /= w.sum()
    return w


def class_centroids(rng: np.random.Generator, num_classes: int, dim: int, signal: float) -> np.ndarray:
    """float32 ``[C, F]`` random class centroids of norm ``signal * sqrt(F) / 4`` (against
    unit Gaussian noise per dimension)."""
    centroids = rng.standard_normal((num_classes, dim))
    centroids *= signal * np.sqrt(dim) / 4.0 / np.linalg.norm(centroids, axis=1, keepdims=True)
    return centroids.astype(np.float32)


def class_features(rng: np.random.Generator, classes: np.ndarray, num_classes: int, dim: int,
                   signal: float) -> np.ndarray:
    """float32 ``[n, F]`` features: each node's class centroid (:func:`class_centroids`)
    plus unit Gaussian noise."""
    centroids = class_centroids(rng, num_classes, dim, signal)
    x = rng.standard_normal((classes.size, dim), dtype=np.float32)
    x += centroids[classes]
    return x


def distinct_keys(rng: np.random.Generator, target: int, overdraw: float,
                  draw: Callable[[np.uint64, int, int], np.ndarray], bar: tqdm | None = None,
                  rounds: int = 8) -> np.ndarray:
    """At most ``target`` distinct edge keys, sorted: ``draw(seed, first, count)`` gives
    candidates ``first .. first+count-1`` (-1 for a refused one), drawn ``overdraw``
    times what is missing until none is (what refusals and repeats removed is topped up),
    for at most ``rounds`` rounds, then a random subset of ``target`` when more came."""
    seed = np.uint64(rng.integers(0, 2**63))
    keys = np.empty(0, dtype=np.int64)
    drawn = 0
    for _ in range(rounds):
        missing = target - keys.size
        if missing <= 0:
            break
        count = int(missing * overdraw) + 16
        new = draw(seed, drawn, count)
        drawn += count
        keys = sorted_unique(np.concatenate([keys, new[new >= 0]]))
        if bar is not None:
            bar.update(min(keys.size, target) - bar.n)
    if keys.size > target:
        keys = np.sort(rng.choice(keys, size=target, replace=False))
    return keys
