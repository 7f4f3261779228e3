"""Synthetic citation graphs with learnable links: the presets ``citation2-small`` and
``citation2-like`` (:mod:`partitioner.synthetic` lists them), shaped like ogbl-citation2,
and ``citation2-bare-small``, whose papers have no features.

Every node (a paper) belongs to one of ``num_clusters`` latent clusters and is "published"
in ID order (a lower ID is older). Each citation picks its citing paper ``v`` uniformly
and, with probability ``homophily``, cites a paper drawn uniformly among the **older
papers of its own cluster**, else one among all older papers. Features are the cluster's
centroid plus Gaussian noise, and the node label is the cluster. So whether ``v`` cites
``u`` is predictable from features (same cluster: close features) and from structure
(papers of one cluster cite each other): a GraphSAGE encoder with a dot-product decoder
ranks a true citation far above random papers, while a random ranking has an MRR of
about ``1 / (K + 1)`` against ``K`` negatives.

``num_citations`` distinct citations are drawn (counter-based draws, reproducible on any
thread count); ``held_out`` of them become the ``val`` and the ``test`` link split each,
with ``num_negatives`` negative destinations per edge drawn uniformly among the papers
the source does not cite (OGB citation2's protocol); the rest are the ``train`` link split
(citing -> cited). The message-passing graph is the train citations stored in both
directions, so a paper's in-neighbors are the papers it cites and those citing it, and no
held-out citation (in either direction) is among them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numba
import numpy as np
from tqdm import tqdm

from partitioner.graph import PLAIN_EDGE_TYPE, GraphData, LinkSplit
from partitioner.links import negative_destinations
from partitioner.synthetic_draws import class_features, counter_uniform, distinct_keys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkPreset:
    """Parameters of a synthetic citation graph with link splits."""

    #: Number of papers.
    num_nodes: int
    #: Distinct directed citations drawn (held-out ones included); each kept one is
    #: stored in both directions as a message-passing edge.
    num_citations: int
    #: Number of latent clusters (also the node labels' classes).
    num_clusters: int
    #: Feature dimension (0: the papers have no features).
    feature_dim: int
    #: Probability that a citation stays within the citing paper's cluster.
    homophily: float
    #: Norm of the cluster centroids, per dimension scale ``sqrt(F) / 4``, relative to
    #: unit Gaussian feature noise.
    feature_signal: float
    #: Citations held out as the ``val`` and as the ``test`` link split (each).
    held_out: int
    #: Negative destinations per held-out citation.
    num_negatives: int


def generate_links(name: str, params: LinkPreset, seed: int, progress: bool) -> GraphData:
    """The citation graph ``params`` describes (see the module doc); the same ``seed``
    always gives the same graph."""
    n = params.num_nodes
    if 2 * params.held_out >= params.num_citations:
        raise ValueError(f"held_out: expected fewer than half of num_citations ({params.num_citations}), "
                         f"got {params.held_out}")
    rng = np.random.default_rng([seed, 0xC17E])
    cluster = rng.integers(0, params.num_clusters, n).astype(np.int64)
    members = np.argsort(cluster, kind="stable")
    ptr = np.searchsorted(cluster[members], np.arange(params.num_clusters + 1)).astype(np.int64)
    rank = np.empty(n, dtype=np.int64)  # position among the older papers of its cluster
    rank[members] = np.arange(n) - ptr[cluster[members]]
    keys = _distinct_citations(rng, params, cluster, members, ptr, rank, progress)
    order = rng.permutation(keys.size)
    h = params.held_out
    held = {"val": np.sort(keys[order[:h]]), "test": np.sort(keys[order[h:2 * h]])}
    train = np.sort(keys[order[2 * h:]])
    del order
    src, dst = train // n, train % n
    edge_index = np.empty((2, 2 * train.size), dtype=np.int64)
    edge_index[0, :train.size], edge_index[1, :train.size] = src, dst
    edge_index[0, train.size:], edge_index[1, train.size:] = dst, src
    splits = {"train": LinkSplit(PLAIN_EDGE_TYPE, src, dst)}
    for split, pos in held.items():
        neg = negative_destinations(rng, pos // n, keys, n, params.num_negatives, undirected=False)
        splits[split] = LinkSplit(PLAIN_EDGE_TYPE, pos // n, pos % n, neg_dst=neg)
    del keys, train
    x = (class_features(rng, cluster, params.num_clusters, params.feature_dim, params.feature_signal)
         if params.feature_dim else None)
    graph = GraphData(name=name, num_nodes=n, edge_index=edge_index, x=x, y=cluster,
                      num_classes=params.num_clusters, link_splits=splits)
    graph.validate(check_values=n <= 100_000)
    log.info("generated %s: %d papers, %d message-passing edges, link splits %s", name, n,
             graph.num_edges, {k: v.num_edges for k, v in splits.items()})
    return graph


@numba.njit(parallel=True, cache=True)
def _citation_keys(seed: np.uint64, first: int, count: int, cluster: np.ndarray, members: np.ndarray,
                   ptr: np.ndarray, rank: np.ndarray, homophily: float) -> np.ndarray:
    """Candidate citations ``first .. first+count-1`` as keys ``citing * n + cited``
    (-1: the citing paper has no older paper to cite)."""
    n = cluster.size
    keys = np.empty(count, dtype=np.int64)
    for i in numba.prange(count):
        e = first + i
        v = min(int(counter_uniform(seed, e, 0) * n), n - 1)
        u = -1
        if counter_uniform(seed, e, 1) < homophily:
            older = rank[v]
            if older > 0:
                u = members[ptr[cluster[v]] + min(int(counter_uniform(seed, e, 2) * older), older - 1)]
        elif v > 0:
            u = min(int(counter_uniform(seed, e, 2) * v), v - 1)
        keys[i] = v * n + u if u >= 0 else -1
    return keys


def _distinct_citations(rng: np.random.Generator, params: LinkPreset, cluster: np.ndarray,
                        members: np.ndarray, ptr: np.ndarray, rank: np.ndarray, progress: bool) -> np.ndarray:
    """``num_citations`` distinct citation keys, sorted (drawn, deduplicated and topped up
    until there are enough, then a random subset of that many)."""
    target = params.num_citations
    with tqdm(total=target, desc="citations", unit="edge", unit_scale=True, disable=not progress) as bar:
        keys = distinct_keys(rng, target, 1.1, lambda seed, first, count: _citation_keys(
            seed, first, count, cluster, members, ptr, rank, params.homophily), bar, rounds=16)
    if keys.size < target:
        raise ValueError(f"num_citations: could draw only {keys.size} distinct citations of {target} asked "
                         f"(too many for {params.num_nodes} papers)")
    return keys


#: The link-prediction presets, by name.
LINK_PRESETS: dict[str, LinkPreset] = {
    # A few thousand papers, 8 citations per paper (16 message-passing edges), 5 % val and
    # 5 % test citations with 100 negatives each: for tests and the demo.
    "citation2-small": LinkPreset(
        num_nodes=4000, num_citations=32_000, num_clusters=40, feature_dim=32, homophily=0.85,
        feature_signal=2.0, held_out=1600, num_negatives=100),
    # citation2-small without features: only a node's learnable embedding (and the
    # structure) can tell its links, as on OGB's featureless ogbl-ddi and ogbl-ppa.
    "citation2-bare-small": LinkPreset(
        num_nodes=4000, num_citations=32_000, num_clusters=40, feature_dim=0, homophily=0.85,
        feature_signal=2.0, held_out=1600, num_negatives=100),
    # The size of ogbl-citation2: 2,927,963 papers, 30,561,187 citations, 128 float32
    # features, 86,956 val and test citations with 1000 negatives each, as OGB's.
    "citation2-like": LinkPreset(
        num_nodes=2_927_963, num_citations=30_561_187, num_clusters=300, feature_dim=128,
        homophily=0.85, feature_signal=2.0, held_out=86_956, num_negatives=1000),
}
