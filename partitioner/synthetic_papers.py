"""The ``papers-like`` preset: a citation graph shaped like ogbn-papers100M at any scale,
built in memory (:func:`generate_papers`) or written as a graph directory by streaming
(:func:`write_papers_dir`); the same ``(scale, seed)`` gives the same graph either way.

Every paper has a publication time (its place in publication order), a year from it
(papers per year growing by ``growth`` a year, up to 2020), a subject class (sizes
skewed) and a power-law fitness. Paper ``t`` cites ``d_t`` older papers, ``d_t``
lognormal around the mean that gives ``num_citations``; each citation goes, with
probability ``homophily``, to an older paper of its own class, else to any older paper,
in proportion to fitness (an inverse-CDF draw over the older papers' cumulative fitness,
started from a bucket index: O(1)). So in-degrees follow the fitness power law, old
papers gather more, and classes form communities. A draw that repeats one of the paper's
citations is drawn again (a few times: the oldest papers keep fewer). Node IDs are the
publication order shuffled; the edges are the citations (citing -> cited) followed by
their reverses (edge ``C + i`` reverses citation ``i``), the undirected graph GNNs train
on. Features: the class centroid plus unit Gaussian noise (float32). Labels: the class,
for the split's papers only (-1 elsewhere, as OGB's unlabelled papers): train drawn
among the papers up to 2017, val from 2018, test from 2019 on, as OGB's time split of
papers100M.

Streaming: the citations are drawn by a counter-based generator keyed by the citing
paper's draws, one chunk of citing papers at a time, twice (first to count each chunk's
distinct citations, so that the file's layout is known; then to write them); the
features a chunk of rows at a time. Memory: a few 8-byte arrays per node plus one chunk.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
from tqdm import tqdm

from partitioner.graph import GraphData
from partitioner.synthetic_draws import class_centroids, counter_uniform, draw_classes, power_law_weights

log = logging.getLogger(__name__)

#: Smallest scale: every split keeps at least one paper.
MIN_SCALE = 1e-5
#: Last year of each split (train up to 2017, val 2018, test 2019-2020), as OGB's.
SPLIT_LAST_YEARS = (2017, 2018, 2020)
#: Citations drawn per chunk when streaming (scratch: ~24 bytes a citation).
_CHUNK_DRAWS = 1 << 23
#: Draws of a citation before it is given up as a repeat.
_TRIES = 7
#: Feature rows per chunk.
_CHUNK_ROWS = 1 << 16


@dataclass(frozen=True)
class PapersPreset:
    """Parameters of the papers-like citation graph (see the module doc)."""

    #: Number of papers.
    num_nodes: int
    #: Citations drawn (a draw that keeps repeating one of the paper's is dropped: a few fewer remain).
    num_citations: int
    #: Number of classes.
    num_classes: int
    #: Feature dimension.
    feature_dim: int
    #: Sizes of the train / val / test splits (the labelled papers).
    split_sizes: tuple[int, int, int]
    #: Fraction of ogbn-papers100M this is (for the graph's name).
    scale: float = 1.0
    #: Power-law exponent of the fitness (the in-degree tail).
    gamma: float = 2.2
    #: Largest fitness over the mean, and as a share of the whole (for tiny scales).
    max_weight_ratio: float = 5000.0
    max_weight_share: float = 0.005
    #: Spread (sigma of the log) of the number of citations per paper, and its cap.
    degree_sigma: float = 1.0
    max_citations: int = 1000
    #: Probability that a citation stays in the citing paper's class.
    homophily: float = 0.65
    #: Norm of the class centroids against unit noise, per dimension scale ``sqrt(F)/4``.
    feature_signal: float = 1.0
    #: Skew of class sizes (class k has size proportional to (k+1)^-skew).
    class_skew: float = 1.0
    #: First year, and the yearly growth of the number of papers.
    first_year: int = 1950
    growth: float = 0.07

    def scaled(self, scale: float) -> PapersPreset:
        """This preset at ``scale`` of its size (nodes, citations, splits)."""
        if not isinstance(scale, int | float) or not MIN_SCALE <= scale <= 1:
            raise ValueError(f"scale: expected a fraction of the full graph in [{MIN_SCALE:g}, 1] "
                             f"(0.1 or 1/10 for a tenth), got {scale!r}")
        sizes = tuple(max(1, round(s * scale)) for s in self.split_sizes)
        return dataclasses.replace(
            self, num_nodes=round(self.num_nodes * scale), scale=scale * self.scale,
            num_citations=round(self.num_citations * scale), split_sizes=sizes)  # type: ignore[arg-type]

    def name(self, preset: str = "papers-like") -> str:
        """The graph's name: ``papers-like``, ``papers-like@0.1`` at a tenth."""
        return preset if self.scale == 1 else f"{preset}@{self.scale:g}"


#: ogbn-papers100M's sizes: 111,059,956 papers, 1,615,685,872 citations, 128 float32
#: features, 172 arXiv classes, OGB's time split (1,207,179 / 125,265 / 214,338).
PAPERS_LIKE = PapersPreset(num_nodes=111_059_956, num_citations=1_615_685_872, num_classes=172,
                           feature_dim=128, split_sizes=(1_207_179, 125_265, 214_338))


def parse_scale(text: str) -> float:
    """A scale as given on a command line: ``0.1`` or ``1/10``."""
    num, slash, den = text.partition("/")
    try:
        value = float(num) / float(den) if slash else float(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"scale: expected a fraction such as 0.1 or 1/10, got {text!r}") from None
    PAPERS_LIKE.scaled(value)  # refuses one out of range, naming the field
    return value


@dataclass
class _Papers:
    """The per-paper facts the citations, features and labels are drawn from, by
    publication time ``t`` unless named by ID."""

    params: PapersPreset
    #: int64 ``[N]`` node ID of paper ``t``.
    node_id: np.ndarray
    #: int64 ``[N]`` class of paper ``t``.
    cls: np.ndarray
    #: int64 ``[N+1]``: paper ``t`` draws citations ``first[t] .. first[t+1]-1``.
    first: np.ndarray
    #: int64 ``[Y+1]``: the papers of year ``first_year + k`` are ``t`` in ``year_ptr[k] .. year_ptr[k+1]-1``.
    year_ptr: np.ndarray
    #: Split name to the sorted node IDs in it.
    splits: dict[str, np.ndarray]
    #: The fitness tables: all papers, and each class's papers (by time within the class).
    everyone: _Cumulative
    by_class: _Cumulative
    #: int64 ``[N]`` number of papers of ``t``'s class older than ``t``.
    older_same: np.ndarray
    #: Seed of the citation draws.
    seed: np.uint64

    @property
    def num_drawn(self) -> int:
        return int(self.first[-1])


@dataclass
class _Cumulative:
    """Inclusive cumulative fitness over groups of papers (``ptr[g] .. ptr[g+1]-1`` of
    ``members``, each group in time order) with a bucket index: bucket ``b`` of group
    ``g`` starts at the first member whose cumulative fitness exceeds ``b / K_g`` of the
    group's total."""

    members: np.ndarray
    ptr: np.ndarray
    cum: np.ndarray
    bucket_ptr: np.ndarray
    bucket_start: np.ndarray


def _cumulative(w: np.ndarray, groups: np.ndarray, num_groups: int) -> _Cumulative:
    members = np.argsort(groups, kind="stable")
    ptr = np.searchsorted(groups[members], np.arange(num_groups + 1)).astype(np.int64)
    cum = w[members]
    for g in range(num_groups):
        np.cumsum(cum[ptr[g]:ptr[g + 1]], out=cum[ptr[g]:ptr[g + 1]])
    sizes = np.diff(ptr)
    bucket_ptr = np.zeros(num_groups + 1, dtype=np.int64)
    np.cumsum(np.where(sizes > 0, np.maximum(sizes // 4, 1), 0), out=bucket_ptr[1:])
    return _Cumulative(members, ptr, cum, bucket_ptr, _bucket_starts(cum, ptr, bucket_ptr))


@numba.njit(cache=True)
def _bucket_starts(cum: np.ndarray, ptr: np.ndarray, bucket_ptr: np.ndarray) -> np.ndarray:
    out = np.empty(bucket_ptr[-1], dtype=np.int64)
    for g in range(ptr.size - 1):
        lo, hi = ptr[g], ptr[g + 1]
        k = bucket_ptr[g + 1] - bucket_ptr[g]
        i = lo
        for b in range(k):
            bound = cum[hi - 1] * b / k
            while i < hi - 1 and cum[i] <= bound:
                i += 1
            out[bucket_ptr[g] + b] = i
    return out


@numba.njit(inline="always")
def _draw_older(cum: np.ndarray, ptr: np.ndarray, bucket_ptr: np.ndarray, bucket_start: np.ndarray,
                g: int, older: int, u: float) -> int:
    """Position (in the group's members) of a draw by fitness among the ``older`` first
    members of group ``g``."""
    lo, hi = ptr[g], ptr[g + 1]
    last = lo + older - 1
    x = u * cum[last]
    k = bucket_ptr[g + 1] - bucket_ptr[g]
    i = bucket_start[bucket_ptr[g] + min(int(x / cum[hi - 1] * k), k - 1)]
    while i < last and cum[i] <= x:
        i += 1
    return i


@numba.njit(parallel=True, cache=True)
def _cite(seed: np.uint64, start: int, stop: int, first: np.ndarray, cls: np.ndarray, older_same: np.ndarray,
          homophily: float, e_cum: np.ndarray, e_ptr: np.ndarray, e_bptr: np.ndarray, e_bstart: np.ndarray,
          c_members: np.ndarray, c_cum: np.ndarray, c_ptr: np.ndarray, c_bptr: np.ndarray,
          c_bstart: np.ndarray, scratch: np.ndarray, kept: np.ndarray) -> None:
    """The citations of papers ``start .. stop-1``: paper ``t``'s distinct ones at
    ``scratch[first[t] - first[start]:]``, ``kept[t - start]`` of them (a draw that
    repeats one is drawn again, up to :data:`_TRIES` times)."""
    base = first[start]
    for i in numba.prange(stop - start):
        t = start + i
        lo, n = first[t] - base, 0
        for j in range(first[t + 1] - first[t]):
            item = first[t] + j
            same = counter_uniform(seed, item, 0) < homophily and older_same[t] > 0
            for stream in range(1, 1 + _TRIES):
                u = counter_uniform(seed, item, stream)
                if same:
                    v = c_members[_draw_older(c_cum, c_ptr, c_bptr, c_bstart, cls[t], older_same[t], u)]
                else:
                    v = _draw_older(e_cum, e_ptr, e_bptr, e_bstart, 0, t, u)
                seen = False
                for k in range(n):
                    if scratch[lo + k] == v:
                        seen = True
                        break
                if not seen:
                    scratch[lo + n] = v
                    n += 1
                    break
        kept[i] = n


@numba.njit(parallel=True, cache=True)
def _compact(start: int, first: np.ndarray, scratch: np.ndarray, kept: np.ndarray, node_id: np.ndarray,
             src: np.ndarray, dst: np.ndarray) -> None:
    """The kept citations of a chunk as node IDs, citing paper ``src``, cited ``dst``."""
    offsets = np.zeros(kept.size + 1, dtype=np.int64)
    for i in range(kept.size):
        offsets[i + 1] = offsets[i] + kept[i]
    base = first[start]
    for i in numba.prange(kept.size):
        lo = first[start + i] - base
        for j in range(kept[i]):
            src[offsets[i] + j] = node_id[start + i]
            dst[offsets[i] + j] = node_id[scratch[lo + j]]


def _degrees(rng: np.random.Generator, params: PapersPreset) -> np.ndarray:
    """int64 ``[N]`` citations paper ``t`` draws: lognormal, at most ``t`` and
    ``max_citations``, the log's mean set so that they sum to about ``num_citations``."""
    n = params.num_nodes
    z = params.degree_sigma * rng.standard_normal(n)
    cap = np.minimum(np.arange(n), params.max_citations).astype(np.float64)
    lo, hi = -10.0, 20.0
    for _ in range(50):
        mu = (lo + hi) / 2
        total = float(np.minimum(np.floor(np.exp(z + mu)), cap).sum())
        lo, hi = (mu, hi) if total < params.num_citations else (lo, mu)
    return np.minimum(np.floor(np.exp(z + lo)), cap).astype(np.int64)


def _plan(params: PapersPreset, seed: int) -> _Papers:
    n = params.num_nodes
    rng = np.random.default_rng([seed, 0x9A9E85])
    cls = draw_classes(rng, n, params.num_classes, params.class_skew)
    cap = min(params.max_weight_ratio / n, params.max_weight_share)
    w = power_law_weights(rng, n, params.gamma, cap)
    first = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(_degrees(rng, params), out=first[1:])
    node_id = rng.permutation(n).astype(np.int64)
    years = np.arange(params.first_year, SPLIT_LAST_YEARS[-1] + 1)
    share = np.exp(params.growth * (years - params.first_year))
    year_ptr = np.concatenate([[0], np.round(n * np.cumsum(share) / share.sum())]).astype(np.int64)
    splits, lo = {}, 0
    for name, size, last in zip(("train", "val", "test"), params.split_sizes, SPLIT_LAST_YEARS, strict=True):
        hi = int(year_ptr[last - params.first_year + 1])
        if size > hi - lo:
            raise ValueError(f"split_sizes: expected at most the {hi - lo} papers of the {name} years, "
                             f"got {size}")
        splits[name] = np.sort(node_id[lo + rng.choice(hi - lo, size, replace=False)])
        lo = hi
    by_class = _cumulative(w, cls, params.num_classes)
    older_same = np.empty(n, dtype=np.int64)
    older_same[by_class.members] = np.arange(n) - by_class.ptr[cls[by_class.members]]
    return _Papers(params, node_id, cls, first, year_ptr, splits, _cumulative(w, np.zeros(n, np.int64), 1),
                   by_class, older_same, np.uint64(rng.integers(0, 2**63)))


def _chunks(papers: _Papers) -> list[tuple[int, int]]:
    """Ranges of citing papers of about :data:`_CHUNK_DRAWS` draws each."""
    cuts = np.searchsorted(papers.first, np.arange(0, papers.num_drawn, _CHUNK_DRAWS), side="right") - 1
    bounds = sorted({0, *cuts.tolist(), papers.params.num_nodes})
    return list(itertools.pairwise(bounds))


def _draw_chunk(papers: _Papers, start: int, stop: int, scratch: np.ndarray) -> np.ndarray:
    """Draw the citations of papers ``start .. stop-1`` into ``scratch``; returns how many
    distinct ones each has (at the front of its draws)."""
    p, e, c = papers, papers.everyone, papers.by_class
    kept = np.empty(stop - start, dtype=np.int64)
    _cite(p.seed, start, stop, p.first, p.cls, p.older_same, p.params.homophily, e.cum, e.ptr, e.bucket_ptr,
          e.bucket_start, c.members, c.cum, c.ptr, c.bucket_ptr, c.bucket_start, scratch, kept)
    return kept


def _citations(papers: _Papers, start: int, stop: int, scratch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct citations of papers ``start .. stop-1`` as (citing, cited) node IDs."""
    kept = _draw_chunk(papers, start, stop, scratch)
    src, dst = np.empty(int(kept.sum()), dtype=np.int64), np.empty(int(kept.sum()), dtype=np.int64)
    _compact(start, papers.first, scratch, kept, papers.node_id, src, dst)
    return src, dst


class _Sink:
    """Where the arrays go: into memory, or into ``.npy`` files of a directory
    (written with ``pwrite``, so nothing written stays mapped in the process)."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        self.arrays: dict[str, np.ndarray] = {}
        self._files: dict[str, tuple[int, int, np.dtype]] = {}

    def create(self, name: str, dtype: type, shape: tuple[int, ...]) -> None:
        if self.root is None:
            self.arrays[name] = np.empty(shape, dtype=dtype)
            return
        path = self.root / f"{name}.npy"
        with open(path, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                     "fortran_order": False, "shape": shape})
            offset = f.tell()
            f.truncate(offset + int(np.prod(shape)) * np.dtype(dtype).itemsize)
        self._files[name] = (os.open(path, os.O_WRONLY), offset, np.dtype(dtype))

    def write(self, name: str, at: int, values: np.ndarray) -> None:
        """Write ``values`` at flat position ``at`` of array ``name``."""
        if self.root is None:
            self.arrays[name].reshape(-1)[at:at + values.size] = values.reshape(-1)
            return
        fd, offset, dtype = self._files[name]
        data = np.ascontiguousarray(values, dtype=dtype).data.cast("B")
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + at * dtype.itemsize + done)

    def close(self) -> None:
        for fd, _, _ in self._files.values():
            os.close(fd)
        self._files.clear()


def _write(params: PapersPreset, seed: int, sink: _Sink, progress: bool) -> None:
    """Draw the graph and write its arrays (``edge_index``, ``x``, ``y``, the splits) into ``sink``."""
    papers = _plan(params, seed)
    chunks = _chunks(papers)
    scratch = np.empty(max((int(papers.first[b] - papers.first[a]) for a, b in chunks), default=0), np.int64)
    with tqdm(total=2 * len(chunks), desc="citations", unit="chunk", disable=not progress) as bar:
        c = 0
        for a, b in chunks:
            c += int(_draw_chunk(papers, a, b, scratch).sum())
            bar.update()
        sink.create("edge_index", np.int64, (2, 2 * c))
        at = 0
        for a, b in chunks:
            src, dst = _citations(papers, a, b, scratch)
            for row, values in ((0, src), (1, dst), (2, dst), (3, src)):  # [citations | reverses] per row
                sink.write("edge_index", (row // 2) * 2 * c + (row % 2) * c + at, values)
            at += src.size
            bar.update()
    del scratch
    n, f = params.num_nodes, params.feature_dim
    cls = np.empty(n, dtype=np.int64)
    cls[papers.node_id] = papers.cls
    rng = np.random.default_rng([seed, 0xFEA7])
    centroids = class_centroids(rng, params.num_classes, f, params.feature_signal)
    sink.create("x", np.float32, (n, f))
    for k, lo in enumerate(tqdm(range(0, n, _CHUNK_ROWS), desc="features", unit="chunk",
                                disable=not progress)):
        rows = np.random.default_rng([seed, 0xFEA7, k]).standard_normal(
            (min(_CHUNK_ROWS, n - lo), f), dtype=np.float32)
        rows += centroids[cls[lo:lo + rows.shape[0]]]
        sink.write("x", lo * f, rows)
    y = np.full(n, -1, dtype=np.int64)
    for split, ids in papers.splits.items():
        y[ids] = cls[ids]
        sink.create(f"{split}_idx", np.int64, ids.shape)
        sink.write(f"{split}_idx", 0, ids)
    sink.create("y", np.int64, (n,))
    sink.write("y", 0, y)
    log.info("papers-like at scale %g: %d papers, %d citations (%d drawn), %d edges", params.scale, n, c,
             papers.num_drawn, 2 * c)


def generate_papers(params: PapersPreset = PAPERS_LIKE, seed: int = 0, progress: bool = True) -> GraphData:
    """The papers-like graph of ``params`` in memory (see the module doc)."""
    sink = _Sink(None)
    _write(params, seed, sink, progress)
    a = sink.arrays
    graph = GraphData(name=params.name(), num_nodes=params.num_nodes, edge_index=a["edge_index"], x=a["x"],
                      y=a["y"], num_classes=params.num_classes,
                      splits={s: a[f"{s}_idx"] for s in ("train", "val", "test")})
    graph.validate(check_values=params.num_nodes <= 100_000)
    return graph


def write_papers_dir(params: PapersPreset, out_dir: str | Path, seed: int = 0, progress: bool = True) -> Path:
    """Write the papers-like graph of ``params`` as a graph directory
    (:mod:`partitioner.readers.graphdir`), streaming: memory a few 8-byte arrays per node."""
    from partitioner.readers.graphdir import GRAPH_FILE

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sink = _Sink(out)
    try:
        _write(params, seed, sink, progress)
    finally:
        sink.close()
    meta = {"name": params.name(), "num_nodes": params.num_nodes, "num_classes": params.num_classes}
    (out / GRAPH_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return out


def node_years(params: PapersPreset, seed: int = 0) -> np.ndarray:
    """int64 ``[N]`` publication year of every node ID of the graph ``(params, seed)``."""
    papers = _plan(params, seed)
    years = np.empty(params.num_nodes, dtype=np.int64)
    years[papers.node_id] = params.first_year + np.searchsorted(
        papers.year_ptr, np.arange(params.num_nodes), side="right") - 1
    return years
