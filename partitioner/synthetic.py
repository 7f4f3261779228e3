"""Reproducible synthetic graphs with planted classes, plain and typed (:func:`generate`).

Plain presets (``small``, ``products-like``): a degree-corrected planted-partition model
(Chung-Lu with classes): every node gets a class and a power-law weight; each edge picks
its source in proportion to the weights and, with probability ``homophily``, a target of
the same class (else any node), again in proportion to the weights. Features are a class
centroid plus Gaussian noise, so a GNN learns the classes from structure and features
together while features alone are only partly informative.

Plain presets with edge features (``edge-feat-small``, ``edge-feat-like``): the same
graph model with edges that ignore classes and noise node features, plus features on every
directed edge that decide the labels (:mod:`partitioner.synthetic_edges`), so that only a
model that sees edge features learns the classes.

Plain presets with link splits (``citation2-small``, ``citation2-like``), shaped like
ogbl-citation2, for link prediction: :mod:`partitioner.synthetic_links`.

A plain preset at any scale (``papers-like``), shaped like ogbn-papers100M, a citation
graph written by streaming at large scales: :mod:`partitioner.synthetic_papers`.

Typed presets (``mag-small``, ``mag-like``), shaped like ogbn-mag: every node of every
type belongs to one of ``num_classes`` communities; a paper's community is its class.
Each relation's edges are drawn one at a time: an *anchor* node (the paper for
``writes``, ``cites`` and ``has_topic``, the author for ``affiliated_with``) is picked in
proportion to its power-law weight, and the other end, with probability ``homophily``,
from the anchor's community, else from all nodes of its type, again by weight. So a
paper's class follows its authors' and topics' communities, while its features (a class
centroid plus strong Gaussian noise) are only weakly informative: a relational model
beats a feature-only MLP by a clear margin. Papers get a synthetic year; the split is by
year as ogbn-mag's ``time`` split (train up to 2017, validation 2018, test 2019).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numba
import numpy as np
from tqdm import tqdm

from partitioner.graph import EdgeType, GraphData, TypedGraphData
from partitioner.synthetic_draws import (
    class_features,
    counter_uniform,
    distinct_keys,
    draw_classes,
    power_law_weights,
)
from partitioner.synthetic_edges import edge_features_and_labels
from partitioner.synthetic_links import LINK_PRESETS, LinkPreset, generate_links
from partitioner.synthetic_papers import PAPERS_LIKE, PapersPreset, generate_papers

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class SyntheticPreset:
    """Parameters of a synthetic graph."""

    #: Number of nodes.
    num_nodes: int
    #: Target number of undirected edges (each stored in both directions).
    num_undirected_edges: int
    #: Number of planted classes.
    num_classes: int
    #: Feature dimension.
    feature_dim: int
    #: Power-law exponent of the expected degree distribution (2 < gamma < 3 is typical).
    gamma: float
    #: Largest expected degree, as a fraction of the number of nodes.
    max_degree_fraction: float
    #: Probability that an edge joins two nodes of the same class.
    homophily: float
    #: Norm of the class centroids relative to unit Gaussian feature noise.
    feature_signal: float
    #: Sizes of the train / val / test splits.
    split_sizes: tuple[int, int, int]
    #: Skew of class sizes (0 = equal sizes; class k has size proportional to (k+1)^-skew).
    class_skew: float = 0.0
    #: Features per directed edge (0: no edge features); with them, the labels are those
    #: the edges' features decide (:mod:`partitioner.synthetic_edges`).
    edge_feature_dim: int = 0
    #: numpy dtype name of the edge features.
    edge_feature_dtype: str = "float32"
    #: Norm of each edge's class mean relative to its unit Gaussian noise.
    edge_feature_signal: float = 1.0
    #: Fraction of the labels replaced by a uniformly drawn class (presets with edge features).
    label_noise: float = 0.0


PLAIN_PRESETS: dict[str, SyntheticPreset | LinkPreset | PapersPreset] = {
    # A few thousand nodes: trains to high accuracy in seconds, the embedded default.
    "small": SyntheticPreset(
        num_nodes=4000, num_undirected_edges=20000, num_classes=6, feature_dim=32,
        gamma=2.5, max_degree_fraction=0.05, homophily=0.8, feature_signal=0.9,
        split_sizes=(1200, 800, 2000),
    ),
    # The size of ogbn-products: 2,449,029 nodes, ~61.9M undirected edges, 47 classes.
    "products-like": SyntheticPreset(
        num_nodes=2_449_029, num_undirected_edges=61_859_140, num_classes=47,
        feature_dim=100, gamma=2.3, max_degree_fraction=0.007, homophily=0.8,
        feature_signal=1.5, split_sizes=(196_615, 39_323, 2_213_091), class_skew=1.0,
    ),
    # Labels only edge features tell (the node features are noise, edges ignore classes):
    # a few thousand nodes, 8 float32 features per directed edge; for tests and the demo.
    "edge-feat-small": SyntheticPreset(
        num_nodes=4000, num_undirected_edges=20000, num_classes=6, feature_dim=16,
        gamma=2.5, max_degree_fraction=0.05, homophily=0.0, feature_signal=0.0,
        split_sizes=(1200, 800, 2000), edge_feature_dim=8, label_noise=0.05,
    ),
    # The same rule at the size of ogbn-products (2,449,029 nodes, ~123.7M directed
    # edges), with 8 float16 features per directed edge as ogbn-proteins has 8 per edge.
    "edge-feat-like": SyntheticPreset(
        num_nodes=2_449_029, num_undirected_edges=61_859_140, num_classes=12, feature_dim=32,
        gamma=2.3, max_degree_fraction=0.007, homophily=0.0, feature_signal=0.0,
        split_sizes=(196_615, 39_323, 2_213_091), edge_feature_dim=8, edge_feature_dtype="float16",
        label_noise=0.05,
    ),
    # Link prediction (citation2-small, citation2-like): see partitioner.synthetic_links.
    **LINK_PRESETS,
    # ogbn-papers100M's shape at any --scale: see partitioner.synthetic_papers.
    "papers-like": PAPERS_LIKE,
}
#: The presets that take a scale other than 1.
SCALABLE_PRESETS = ("papers-like",)


def resolve_preset(preset: str | AnyPreset, scale: float = 1.0) -> tuple[str, AnyPreset]:
    """The graph's name and the parameters of ``preset`` (a name in :data:`PRESETS` or a
    preset) at ``scale`` of its size; only papers-like scales (``scale`` 1 for the others)."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
        name, params = preset, PRESETS[preset]
    else:
        name = "typed-synthetic" if isinstance(preset, TypedPreset) else "synthetic"
        params = preset
    if isinstance(params, PapersPreset):
        params = params.scaled(scale) if scale != 1 else params
        return params.name(name), params
    if scale != 1:
        raise ValueError(f"scale: only {', '.join(SCALABLE_PRESETS)} scales; expected 1 for {name!r}, "
                         f"got {scale!r}")
    return name, params


def generate(preset: str | AnyPreset, seed: int = 0, progress: bool = True,
             scale: float = 1.0) -> GraphData | TypedGraphData:
    """Generate the synthetic graph ``preset`` (a name in :data:`PRESETS` or a preset) at
    ``scale`` (:func:`resolve_preset`): a plain :class:`GraphData`, or a
    :class:`TypedGraphData` for a typed preset.

    The same ``(preset, scale, seed)`` always gives the same graph.
    """
    name, params = resolve_preset(preset, scale)
    if isinstance(params, TypedPreset):
        return _generate_typed(name, params, seed, progress)
    if isinstance(params, LinkPreset):
        return generate_links(name, params, seed, progress)
    if isinstance(params, PapersPreset):
        return generate_papers(params, seed, progress)
    return _generate_plain(name, params, seed, progress)


def generate_plain(preset: str | SyntheticPreset | LinkPreset | PapersPreset, seed: int = 0,
                   progress: bool = True, scale: float = 1.0) -> GraphData:
    """:func:`generate` of a plain preset (refuses a typed one)."""
    graph = generate(preset, seed, progress, scale)
    if not isinstance(graph, GraphData):
        raise ValueError(f"preset: expected a plain preset {sorted(PLAIN_PRESETS)}, got {preset!r}")
    return graph


def generate_typed(preset: str | TypedPreset, seed: int = 0, progress: bool = True) -> TypedGraphData:
    """:func:`generate` of a typed preset (refuses a plain one)."""
    graph = generate(preset, seed, progress)
    if not isinstance(graph, TypedGraphData):
        raise ValueError(f"preset: expected a typed preset {sorted(TYPED_PRESETS)}, got {preset!r}")
    return graph


def _generate_plain(name: str, params: SyntheticPreset, seed: int, progress: bool) -> GraphData:
    if sum(params.split_sizes) > params.num_nodes:
        raise ValueError(f"split_sizes: expected at most {params.num_nodes} nodes in all")
    rng = np.random.default_rng(seed)
    n = params.num_nodes
    y = draw_classes(rng, n, params.num_classes, params.class_skew)
    weights = power_law_weights(rng, n, params.gamma,
                                 params.max_degree_fraction * n / (2.0 * params.num_undirected_edges))
    src, dst = _draw_edges(rng, y, weights, params, progress)
    edge_index = np.empty((2, 2 * src.size), dtype=np.int64)
    edge_index[0, : src.size], edge_index[0, src.size :] = src, dst
    edge_index[1, : src.size], edge_index[1, src.size :] = dst, src
    del src, dst
    x = class_features(rng, y, params.num_classes, params.feature_dim, params.feature_signal)
    perm = rng.permutation(n)
    a, b, _ = params.split_sizes
    splits = {
        "train": np.sort(perm[:a]),
        "val": np.sort(perm[a : a + b]),
        "test": np.sort(perm[a + b : sum(params.split_sizes)]),
    }
    edge_attr: np.ndarray | None = None
    if params.edge_feature_dim:
        edge_attr, y = edge_features_and_labels(
            edge_index, y, params.num_classes, dim=params.edge_feature_dim, dtype=params.edge_feature_dtype,
            signal=params.edge_feature_signal, label_noise=params.label_noise, seed=seed, progress=progress)
    graph = GraphData(name=name, num_nodes=n, edge_index=edge_index, x=x, y=y,
                      num_classes=params.num_classes, splits=splits, edge_attr=edge_attr)
    graph.validate(check_values=n <= 100_000)
    log.info("generated %s: %d nodes, %d directed edges", name, n, graph.num_edges)
    return graph


@numba.njit(cache=True)
def _alias_table(prob: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vose's alias table for sampling index i with probability prob[i]."""
    n = prob.size
    scaled = prob * n
    accept = np.ones(n, dtype=np.float64)
    alias = np.arange(n, dtype=np.int64)
    small = np.empty(n, dtype=np.int64)
    large = np.empty(n, dtype=np.int64)
    ns, nl = 0, 0
    for i in range(n):
        if scaled[i] < 1.0:
            small[ns] = i
            ns += 1
        else:
            large[nl] = i
            nl += 1
    while ns > 0 and nl > 0:
        ns -= 1
        s = small[ns]
        g = large[nl - 1]
        accept[s] = scaled[s]
        alias[s] = g
        scaled[g] = scaled[g] + scaled[s] - 1.0
        if scaled[g] < 1.0:
            nl -= 1
            small[ns] = g
            ns += 1
    return accept, alias


@numba.njit(inline="always")
def _alias_draw(accept: np.ndarray, alias: np.ndarray, lo: int, size: int,
                u1: float, u2: float) -> int:
    pos = lo + min(int(u1 * size), size - 1)
    return pos if u2 < accept[pos] else alias[pos]


def _class_alias_tables(
    w: np.ndarray, y: np.ndarray, num_classes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Members of each class (by ID), their offsets, and per-class alias tables whose
    entries are positions in ``members``."""
    members = np.argsort(y, kind="stable")
    ptr = np.searchsorted(y[members], np.arange(num_classes + 1)).astype(np.int64)
    accept = np.empty(members.size, dtype=np.float64)
    alias = np.empty(members.size, dtype=np.int64)
    for k in range(num_classes):
        lo, hi = int(ptr[k]), int(ptr[k + 1])
        if hi > lo:
            cw = w[members[lo:hi]]
            accept[lo:hi], alias[lo:hi] = _alias_table(cw / cw.sum())
            alias[lo:hi] += lo
    return members, ptr, accept, alias


def _draw_edges(
    rng: np.random.Generator, y: np.ndarray, w: np.ndarray, params: SyntheticPreset,
    progress: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Draw distinct undirected edges ``(u < v)`` until the target count."""
    n = y.size
    g_accept, g_alias = _alias_table(w)
    members, c_ptr, c_accept, c_alias = _class_alias_tables(w, y, params.num_classes)
    target = params.num_undirected_edges
    with tqdm(total=target, desc="edges", unit="edge", unit_scale=True,
              disable=not progress) as bar:
        keys = distinct_keys(rng, target, 1.05, lambda seed, first, count: _relation_keys(
            seed, first, count, y, params.homophily, g_accept, g_alias, g_accept, g_alias, members,
            c_ptr, c_accept, c_alias, n, True, True, True), bar)
    return keys // n, keys % n


#: First year of each split: train papers are older than 2018, test papers from 2019.
_SPLIT_YEARS = (2010, 2018, 2019, 2020)


@dataclass(frozen=True)
class RelationSpec:
    """How one relation's edges are drawn."""

    #: ``(src_type, relation, dst_type)``.
    edge_type: EdgeType
    #: Target number of distinct edges.
    num_edges: int
    #: Which end is drawn first and drives the other (``"src"`` or ``"dst"``).
    anchor: str
    #: Probability that the other end is drawn from the anchor's community.
    homophily: float


@dataclass(frozen=True)
class TypedPreset:
    """Parameters of a synthetic typed graph."""

    #: Node type to count, in the graph's node-type order.
    num_nodes: dict[str, int]
    #: The relations, in the graph's edge-type order.
    relations: tuple[RelationSpec, ...]
    #: The labelled node type (its community is its class).
    target_type: str
    #: Feature dimension of the target type (the only type with features).
    feature_dim: int
    #: Number of classes (communities).
    num_classes: int
    #: Norm of the class centroids relative to unit Gaussian feature noise, per dimension
    #: scale ``sqrt(F)/4``: small values make features weakly informative.
    feature_signal: float
    #: Sizes of the train / val / test splits (by synthetic year), summing to at most
    #: the number of target nodes.
    split_sizes: tuple[int, int, int]
    #: Power-law exponent of every type's expected degree.
    gamma: float = 2.5
    #: Largest expected degree of a node over its type's mean degree.
    max_weight_ratio: float = 200.0
    #: Skew of class sizes (class k has size proportional to (k+1)^-skew).
    class_skew: float = 0.6


def _mag_relations(
    writes: int, cites: int, topics: int, affiliated: int, homophily: float
) -> tuple[RelationSpec, ...]:
    """ogbn-mag's four relations; citations are a little noisier than authorship and
    topics, affiliations follow the author's community more closely."""
    return (
        RelationSpec(("author", "writes", "paper"), writes, "dst", homophily),
        RelationSpec(("paper", "cites", "paper"), cites, "src", 0.8 * homophily),
        RelationSpec(("paper", "has_topic", "field_of_study"), topics, "src", homophily),
        RelationSpec(("author", "affiliated_with", "institution"), affiliated, "src",
                     min(1.0, 1.6 * homophily)),
    )


TYPED_PRESETS: dict[str, TypedPreset] = {
    # A few thousand papers: for tests and the demo; trains in seconds.
    "mag-small": TypedPreset(
        num_nodes={"paper": 4000, "author": 6000, "institution": 60, "field_of_study": 400},
        relations=_mag_relations(38_000, 29_000, 40_000, 5_500, homophily=0.4),
        target_type="paper", feature_dim=32, num_classes=8, feature_signal=0.6,
        split_sizes=(3400, 360, 240), max_weight_ratio=30.0,
    ),
    # ogbn-mag's shape: node counts, edge counts per relation, 128-dim paper features,
    # 349 classes, and the time split's sizes.
    "mag-like": TypedPreset(
        num_nodes={"paper": 736_389, "author": 1_134_649, "institution": 8_740,
                   "field_of_study": 59_965},
        relations=_mag_relations(7_145_660, 5_416_271, 7_505_078, 1_043_998, homophily=0.3),
        target_type="paper", feature_dim=128, num_classes=349, feature_signal=0.8,
        split_sizes=(629_571, 64_879, 41_939),
    ),
}


def _generate_typed(name: str, params: TypedPreset, seed: int, progress: bool) -> TypedGraphData:
    n_target = params.num_nodes[params.target_type]
    if sum(params.split_sizes) > n_target:
        raise ValueError(f"split_sizes: expected at most {n_target} {params.target_type} nodes")
    rng = np.random.default_rng(seed)
    community = {t: draw_classes(rng, n, params.num_classes, params.class_skew)
                 for t, n in params.num_nodes.items()}
    # the largest weight of a type capped at max_weight_ratio times the mean
    weights = {t: power_law_weights(rng, n, params.gamma, params.max_weight_ratio / n)
               for t, n in params.num_nodes.items()}
    edges: dict[EdgeType, np.ndarray] = {}
    for spec in tqdm(params.relations, desc="relations", unit="rel", disable=not progress):
        edges[spec.edge_type] = _draw_relation(rng, spec, community, weights, params)
    y = community[params.target_type]
    x = class_features(rng, y, params.num_classes, params.feature_dim, params.feature_signal)
    graph = TypedGraphData(
        name=name, num_nodes=dict(params.num_nodes), edge_index=edges,
        x={params.target_type: x}, target_type=params.target_type, y=y,
        num_classes=params.num_classes, splits=_time_splits(rng, n_target, params.split_sizes),
    )
    graph.validate(check_values=graph.total_nodes <= 200_000)
    log.info("generated %s: %d nodes, %d edges in %d relations", name, graph.total_nodes,
             graph.num_edges(), len(edges))
    return graph


def _years(rng: np.random.Generator, n: int, split_sizes: tuple[int, int, int]) -> np.ndarray:
    """A year per target node: the train share before 2018 (uniform over 2010-2017), the
    validation share 2018, the test share 2019, any others 2020 (in no split)."""
    order = rng.permutation(n)
    years = np.empty(n, dtype=np.int64)
    a, b, c = split_sizes
    first, val_year, test_year, _ = _SPLIT_YEARS
    years[order[:a]] = rng.integers(first, val_year, a)
    years[order[a:a + b]] = val_year
    years[order[a + b:a + b + c]] = test_year
    years[order[a + b + c:]] = _SPLIT_YEARS[3]  # outside every split
    return years


def _time_splits(
    rng: np.random.Generator, n: int, split_sizes: tuple[int, int, int]
) -> dict[str, np.ndarray]:
    years = _years(rng, n, split_sizes)
    return {
        "train": np.flatnonzero(years < _SPLIT_YEARS[1]).astype(np.int64),
        "val": np.flatnonzero(years == _SPLIT_YEARS[1]).astype(np.int64),
        "test": np.flatnonzero(years == _SPLIT_YEARS[2]).astype(np.int64),
    }


@numba.njit(parallel=True, cache=True)
def _relation_keys(
    seed: np.uint64, first: int, count: int, anchor_comm: np.ndarray, homophily: float,
    a_accept: np.ndarray, a_alias: np.ndarray, o_accept: np.ndarray, o_alias: np.ndarray,
    members: np.ndarray, c_ptr: np.ndarray, c_accept: np.ndarray, c_alias: np.ndarray,
    n_other: int, anchor_is_src: bool, no_self_loops: bool, undirected: bool = False,
) -> np.ndarray:
    """Candidate edges ``first .. first+count-1`` as keys ``src * n_dst + dst`` (of an
    ``undirected`` relation within one type: ``min * n + max``); a refused self-loop gets
    key -1."""
    n_anchor = anchor_comm.size
    keys = np.empty(count, dtype=np.int64)
    for i in numba.prange(count):
        e = first + i
        u = _alias_draw(a_accept, a_alias, 0, n_anchor, counter_uniform(seed, e, 0),
                        counter_uniform(seed, e, 1))
        k = anchor_comm[u]
        lo, hi = c_ptr[k], c_ptr[k + 1]
        if counter_uniform(seed, e, 2) < homophily and hi > lo:
            pos = _alias_draw(c_accept, c_alias, lo, hi - lo, counter_uniform(seed, e, 3),
                              counter_uniform(seed, e, 4))
            v = members[pos]
        else:
            v = _alias_draw(o_accept, o_alias, 0, n_other, counter_uniform(seed, e, 3),
                            counter_uniform(seed, e, 4))
        if no_self_loops and u == v:
            keys[i] = -1
        elif undirected:
            keys[i] = min(u, v) * n_other + max(u, v)
        elif anchor_is_src:
            keys[i] = u * n_other + v
        else:
            keys[i] = v * n_anchor + u
    return keys


def _draw_relation(
    rng: np.random.Generator, spec: RelationSpec, community: dict[str, np.ndarray],
    weights: dict[str, np.ndarray], params: TypedPreset,
) -> np.ndarray:
    """``[2, E]`` distinct edges of one relation, sorted by (source, destination)."""
    if spec.anchor not in ("src", "dst"):
        raise ValueError(f"anchor: expected 'src' or 'dst', got {spec.anchor!r}")
    src_t, _, dst_t = spec.edge_type
    anchor_t, other_t = (src_t, dst_t) if spec.anchor == "src" else (dst_t, src_t)
    n_dst = params.num_nodes[dst_t]
    a_accept, a_alias = _alias_table(weights[anchor_t])
    o_accept, o_alias = _alias_table(weights[other_t])
    members, c_ptr, c_accept, c_alias = _class_alias_tables(
        weights[other_t], community[other_t], params.num_classes)
    keys = distinct_keys(rng, spec.num_edges, 1.1, lambda seed, first, count: _relation_keys(
        seed, first, count, community[anchor_t], spec.homophily, a_accept, a_alias, o_accept,
        o_alias, members, c_ptr, c_accept, c_alias, params.num_nodes[other_t], spec.anchor == "src",
        src_t == dst_t))
    return np.stack([keys // n_dst, keys % n_dst])


#: Any preset's parameters.
AnyPreset = SyntheticPreset | TypedPreset | LinkPreset | PapersPreset
#: Every preset by name: plain and typed.
PRESETS: dict[str, AnyPreset] = {**PLAIN_PRESETS, **TYPED_PRESETS}
