"""Edge features that decide the node labels: the synthetic presets with edge features
(``edge-feat-small``, ``edge-feat-like``; :mod:`partitioner.synthetic` declares them).

Every directed edge ``u -> v`` gets ``F`` features ``signal * c[k_v] + noise``, where
``k_v`` is a class planted on its destination, ``c`` are ``C`` random unit centroids in
``F`` dimensions, and the noise is unit Gaussian, drawn by a counter-based generator keyed
by the seed and the edge's ID (so any thread count gives the same features). A node's
label is then a function of its in-edges' features alone::

    y[v] = argmax_k  c[k] . sum(edge_attr[e] for the in-edges e of v)

(the planted class for a node without in-edges), computed from the features as stored
(after rounding to the preset's dtype), and a fraction ``label_noise`` of the labels is
then replaced by a uniformly drawn class. Node features are pure noise and edges join
nodes regardless of class, so a model that does not see edge features does little better
than chance, while one that adds an embedding of each edge's features to its messages
and sums them (GINE, or any layer with that kind of ``edge_dim``) can learn the rule; a
layer that uses edge features only to weight its messages (GAT's ``edge_dim``) sees them
only through the weights.
"""

from __future__ import annotations

import numba
import numpy as np
from tqdm import tqdm

from partitioner.synthetic_draws import counter_uniform

#: Edges per chunk when drawing features (a float32 buffer of ``chunk x F``).
_CHUNK = 1 << 22


@numba.njit(parallel=True, cache=True)
def _draw_edge_features(seed: np.uint64, first: int, dst: np.ndarray, planted: np.ndarray,
                        means: np.ndarray, out: np.ndarray) -> None:
    """Features of edges ``first .. first + len(dst) - 1``: the mean of the destination's
    planted class plus unit Gaussian noise (Box-Muller), into float32 ``out``."""
    dim = out.shape[1]
    for i in numba.prange(dst.size):
        k = planted[dst[i]]
        for j in range(dim):
            item = (first + i) * dim + j
            u1, u2 = counter_uniform(seed, item, 0), counter_uniform(seed, item, 1)
            z = np.sqrt(-2.0 * np.log(1.0 - u1)) * np.cos(2.0 * np.pi * u2)
            out[i, j] = means[k, j] + z


@numba.njit(cache=True)
def _add_rows(sums: np.ndarray, dst: np.ndarray, rows: np.ndarray) -> None:
    """``sums[dst[i]] += rows[i]`` for every edge of a chunk."""
    for i in range(dst.size):
        for j in range(rows.shape[1]):
            sums[dst[i], j] += rows[i, j]


def edge_features_and_labels(
    edge_index: np.ndarray, planted: np.ndarray, num_classes: int, *, dim: int, dtype: str,
    signal: float, label_noise: float, seed: int, progress: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """``[E, dim]`` edge features of ``dtype`` for ``edge_index`` and the ``[N]`` int64
    labels they decide (see the module doc), from the ``[N]`` planted classes; the same
    ``seed`` always gives the same arrays."""
    if dim < 1 or not 0.0 <= label_noise <= 1.0:
        raise ValueError(f"edge features: expected dim >= 1 and label_noise in [0, 1], got {dim} and "
                         f"{label_noise}")
    rng = np.random.default_rng([seed, 0xED6E])
    centroids = rng.standard_normal((num_classes, dim))
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    noise_seed = np.uint64(rng.integers(0, 2**63))
    num_edges, n = int(edge_index.shape[1]), int(planted.size)
    attr = np.empty((num_edges, dim), dtype=dtype)
    sums = np.zeros((n, dim), dtype=np.float64)
    buffer = np.empty((min(_CHUNK, max(num_edges, 1)), dim), dtype=np.float32)
    means = signal * centroids
    for lo in tqdm(range(0, num_edges, _CHUNK), desc="edge features", unit="chunk", disable=not progress):
        hi = min(lo + _CHUNK, num_edges)
        dst = np.ascontiguousarray(edge_index[1, lo:hi])
        rows = buffer[:hi - lo]
        _draw_edge_features(noise_seed, lo, dst, planted, means, rows)
        attr[lo:hi] = rows
        _add_rows(sums, dst, attr[lo:hi].astype(np.float32, copy=False))
    y = np.argmax(sums @ centroids.T, axis=1).astype(np.int64)
    no_in_edges = np.bincount(edge_index[1], minlength=n) == 0
    y[no_in_edges] = planted[no_in_edges]
    noisy = np.flatnonzero(rng.random(n) < label_noise)
    y[noisy] = rng.integers(0, num_classes, noisy.size)
    return attr, y


def label_rule(edge_index: np.ndarray, edge_attr: np.ndarray, num_nodes: int, num_classes: int,
               seed: int) -> np.ndarray:
    """Each node's ``argmax_k c[k] . (sum of its in-edges' features)`` (-1 without
    in-edges), with the centroids of :func:`edge_features_and_labels` for ``seed``: the
    labels before label noise, recomputed from a graph's edges (for checks)."""
    rng = np.random.default_rng([seed, 0xED6E])
    centroids = rng.standard_normal((num_classes, edge_attr.shape[1]))
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    n = num_nodes
    sums = np.zeros((n, edge_attr.shape[1]), dtype=np.float64)
    np.add.at(sums, edge_index[1], edge_attr.astype(np.float32))
    y = np.argmax(sums @ centroids.T, axis=1).astype(np.int64)
    y[np.bincount(edge_index[1], minlength=n) == 0] = -1
    return y
