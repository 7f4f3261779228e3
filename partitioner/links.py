"""Link splits: the edges a link-prediction model trains and is evaluated on.

A graph before partitioning holds its link splits as :class:`LinkSplit` objects in
:attr:`~partitioner.graph.TypedGraphData.link_splits` (original IDs of their types):
``train``, ``val`` and ``test``, and any other the dataset defines (OGB collab's
``val_neg`` / ``test_neg``, its negative edges for Hits@K). :func:`random_link_split` makes
them as PyG's ``RandomLinkSplit`` does, taking the held-out edges (and their reverses) out
of the message-passing graph so that they never leak into training.

Partitioned, a link split is a set of **shared files** at the partition directory's root,
read by every server, with the IDs mapped to global (internal) IDs, the numbering the
partition books use::

    links/<split>/src.npy       int64 [E]     global IDs of the source type
    links/<split>/dst.npy       int64 [E]     global IDs of the destination type
    links/<split>/label.npy     [E, ...]      optional labels, any numeric dtype
    links/<split>/neg_dst.npy   int64 [E, K]  optional given negatives, global IDs

The manifest records each split's facts (:class:`LinkSplitInfo`) and each file's size and
SHA-256; :func:`load_link_split` refuses a file that does not match, naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Container
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from partitioner.format import Verify, check_files
from partitioner.graph import (
    PLAIN_EDGE_TYPE,
    REVERSE_PREFIX,
    EdgeType,
    GraphData,
    GraphDataError,
    LinkSplit,
    TypedGraphData,
    plain_view,
    sorted_unique,
)
from partitioner.manifest import LinkSplitInfo, Manifest, PartitionFormatError, link_role
from partitioner.npyio import FileRecord, load_npy, save_npy

__all__ = [
    "LinkSplit",
    "LinkSplitArrays",
    "LinkSplitInfo",
    "link_split_info",
    "load_link_split",
    "negative_destinations",
    "random_link_split",
    "reverse_edge_type",
    "write_link_splits",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkSplitArrays:
    """A partitioned graph's link split, loaded (read-only memory maps)."""

    #: The relation its edges belong to.
    edge_type: EdgeType
    #: int64 ``[E]`` global IDs of the edge type's source node type.
    src: np.ndarray
    #: int64 ``[E]`` global IDs of the edge type's destination node type.
    dst: np.ndarray
    #: ``[E, ...]`` labels, or None.
    label: np.ndarray | None
    #: int64 ``[E, K]`` global IDs of given negative destinations, or None.
    neg_dst: np.ndarray | None

    @property
    def num_edges(self) -> int:
        return int(self.src.shape[0])


def link_split_info(split: LinkSplit) -> LinkSplitInfo:
    """What the manifest records of ``split``."""
    label = split.label
    return LinkSplitInfo(
        edge_type=split.edge_type, num_edges=split.num_edges, num_negatives=split.num_negatives,
        label_shape=() if label is None else tuple(int(d) for d in label.shape[1:]),
        label_dtype=None if label is None else np.dtype(label.dtype).name)


def write_link_splits(graph: TypedGraphData, out: Path, node_maps: dict[str, np.ndarray]
                      ) -> tuple[dict[str, FileRecord], dict[str, LinkSplitInfo]]:
    """Write ``graph``'s link splits under ``out/links/`` with the IDs mapped to global IDs
    by ``node_maps`` (node type to its original-to-global map); returns the files' records
    by role and each split's facts."""
    files: dict[str, FileRecord] = {}
    infos: dict[str, LinkSplitInfo] = {}
    for name, split in graph.link_splits.items():
        s, _, d = split.edge_type
        arrays = {"src": node_maps[s][np.asarray(split.src)], "dst": node_maps[d][np.asarray(split.dst)]}
        if split.label is not None:
            arrays["label"] = np.asarray(split.label)
        if split.neg_dst is not None:
            arrays["neg_dst"] = node_maps[d][np.asarray(split.neg_dst)]
        for kind, array in arrays.items():
            files[link_role(name, kind)] = save_npy(out, f"{link_role(name, kind)}.npy",
                                                    np.ascontiguousarray(array))
        infos[name] = link_split_info(split)
    return files, infos


def load_link_split(root: str | Path, manifest: Manifest, name: str, *,
                    verify: Verify = "full") -> LinkSplitArrays:
    """Link split ``name`` of the partition directory ``root`` (whose manifest is
    ``manifest``): its files checked against the manifest (size, header and, with
    ``verify='full'``, SHA-256) and their IDs against the node types' sizes, then memory
    mapped read-only. Raises :class:`PartitionFormatError` naming the file."""
    base = Path(root)
    info = manifest.link_splits.get(name)
    if info is None:
        raise PartitionFormatError(f"link split: expected one of {sorted(manifest.link_splits)}, "
                                   f"got {name!r}")
    kinds = ["src", "dst", *(["label"] if info.label_dtype is not None else []),
             *(["neg_dst"] if info.num_negatives else [])]
    records = {k: manifest.files[link_role(name, k)] for k in kinds}
    check_files(base, list(records.values()), verify)
    e, (s, _, d) = info.num_edges, info.edge_type
    want = {"src": ((e,), "int64"), "dst": ((e,), "int64"),
            "label": ((e, *info.label_shape), info.label_dtype),
            "neg_dst": ((e, info.num_negatives), "int64")}
    arrays: dict[str, np.ndarray] = {}
    for kind, rec in records.items():
        shape, dtype = want[kind]
        if rec.shape != shape or rec.dtype != dtype:
            raise PartitionFormatError(f"{base / rec.path}: expected {dtype} of shape {list(shape)} (the "
                                       f"manifest's link_splits[{name!r}]), got {rec.dtype} of shape "
                                       f"{list(rec.shape)}")
        arrays[kind] = load_npy(base / rec.path, mmap=True)
    for kind, t in (("src", s), ("dst", d), ("neg_dst", d)):
        ids, n = arrays.get(kind), manifest.node_types[t].num_nodes
        if ids is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
            what = f"global {t!r} IDs" if manifest.typed else "global IDs"
            raise PartitionFormatError(f"{base / records[kind].path}: expected {what} in [0, {n}), got "
                                       f"[{int(ids.min())}, {int(ids.max())}]")
    return LinkSplitArrays(edge_type=info.edge_type, src=arrays["src"], dst=arrays["dst"],
                           label=arrays.get("label"), neg_dst=arrays.get("neg_dst"))


# -- random split -------------------------------------------------------------------------
def reverse_edge_type(edge_types: Container[EdgeType], edge_type: EdgeType) -> EdgeType | None:
    """The relation holding ``edge_type``'s reverse edges (``rev_<rel>`` as
    :meth:`TypedGraphData.add_reverse` names it, or the forward one of a ``rev_``
    relation), when ``edge_types`` (a graph's) has it."""
    s, r, d = edge_type
    rev = (d, r[len(REVERSE_PREFIX):], s) if r.startswith(REVERSE_PREFIX) else (d, REVERSE_PREFIX + r, s)
    return rev if rev in edge_types and rev != edge_type else None


def _member(keys: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """``keys`` in ``sorted_set`` (sorted, distinct), as a bool mask."""
    if not sorted_set.size:
        return np.zeros(keys.shape, dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_set, keys), sorted_set.size - 1)
    return sorted_set[pos] == keys


def _pair_keys(src: np.ndarray, dst: np.ndarray, n_dst: int, undirected: bool) -> np.ndarray:
    """Edge keys ``src * n_dst + dst`` (``min * n + max`` when ``undirected``)."""
    if undirected:
        return np.minimum(src, dst) * np.int64(n_dst) + np.maximum(src, dst)
    return src * np.int64(n_dst) + dst


def _without(graph: TypedGraphData, et: EdgeType, held: np.ndarray, undirected: bool) -> tuple[
        dict[EdgeType, np.ndarray], dict[EdgeType, np.ndarray], dict[EdgeType, np.ndarray],
        dict[EdgeType, np.ndarray]]:
    """``graph``'s edges, weights, features and original edge IDs with the edges of ``et``
    whose keys are in ``held`` (sorted) removed, and their reverses from ``et``'s reverse
    relation."""
    edges, weights, attrs = dict(graph.edge_index), dict(graph.edge_weight), dict(graph.edge_attr)
    ids = dict(graph.edge_ids)
    n_dst = graph.num_nodes[et[2]]

    def drop(rel: EdgeType, keep: np.ndarray) -> None:
        edges[rel] = np.ascontiguousarray(np.asarray(graph.edge_index[rel])[:, keep])
        for arrays in (weights, attrs):
            if rel in arrays:
                arrays[rel] = np.ascontiguousarray(np.asarray(arrays[rel])[keep])
        # the kept edges keep their original IDs: their columns in the given graph
        given = ids.get(rel)
        ids[rel] = np.flatnonzero(keep) if given is None else np.ascontiguousarray(np.asarray(given)[keep])

    ei = np.asarray(graph.edge_index[et])
    drop(et, ~_member(_pair_keys(ei[0], ei[1], n_dst, undirected), held))
    rev = reverse_edge_type(graph.edge_index, et)
    if rev is not None:  # its edge (a, b) is the reverse of (b, a) of et
        rei = np.asarray(graph.edge_index[rev])
        drop(rev, ~_member(_pair_keys(rei[1], rei[0], n_dst, undirected), held))
    return edges, weights, attrs, ids


def _check_fractions(val: float, test: float, num_negatives: int) -> None:
    if not (0.0 <= val < 1.0 and 0.0 <= test < 1.0 and val + test < 1.0):
        raise ValueError(f"val/test: expected fractions >= 0 with val + test < 1, got val={val}, test={test}")
    if num_negatives < 0:
        raise ValueError(f"num_negatives: expected an integer >= 0, got {num_negatives}")


def random_link_split(graph: GraphData | TypedGraphData, *, edge_type: EdgeType | None = None,
                      val: float = 0.05, test: float = 0.1, num_negatives: int = 0, seed: int = 0,
                      undirected: bool | None = None) -> GraphData | TypedGraphData:
    """A copy of ``graph`` with link splits ``train``, ``val`` and ``test`` of
    ``edge_type`` (default: the first), as PyG's ``RandomLinkSplit``.

    A fraction ``val`` and ``test`` of the edge type's distinct edges (of its undirected
    pairs when ``undirected``) is drawn, those edges are **removed** from the graph's
    message-passing edges together with their reverses (both directions of an undirected
    relation, and the matching edges of the reverse relation ``rev_<rel>``), and the
    remaining distinct edges become ``train`` (one direction, ``u <= v``, when undirected).
    ``undirected=None`` detects it: a relation within one node type whose edge set is
    symmetric. With ``num_negatives=K > 0``, every val and test edge gets ``K`` negative
    destinations drawn uniformly among the destination type's nodes that are not its
    source's true destinations (OGB citation2's protocol). The same ``seed`` always gives
    the same split. Edge weights and features of the kept edges stay aligned with them;
    the removed edges vanish, and the kept edges keep their original IDs (their columns
    in the input, or its ``edge_ids``), recorded as the returned graph's ``edge_ids``.
    """
    _check_fractions(val, test, num_negatives)
    typed = plain_view(graph) if isinstance(graph, GraphData) else graph
    et = edge_type or typed.edge_types[0]
    if et not in typed.edge_index:
        raise GraphDataError(f"edge_type: expected one of {list(typed.edge_index)}, got {et!r}")
    s, _, d = et
    n_dst = typed.num_nodes[d]
    if typed.num_nodes[s] * n_dst >= 2**62:
        raise GraphDataError(f"edge_type {et!r}: too many node pairs to key ({typed.num_nodes[s]} x {n_dst})")
    ei = np.asarray(typed.edge_index[et])
    if undirected is None:
        reverse = sorted_unique(_pair_keys(ei[1], ei[0], n_dst, False))
        undirected = s == d and bool(np.array_equal(sorted_unique(_pair_keys(ei[0], ei[1], n_dst, False)),
                                                    reverse))
    elif undirected and s != d:
        raise GraphDataError(f"undirected: only for a relation within one node type, got {et!r}")
    canon = _pair_keys(ei[0], ei[1], n_dst, undirected)
    distinct = sorted_unique(canon)
    rng = np.random.default_rng(seed)
    order = rng.permutation(distinct.size)
    n_val, n_test = round(val * distinct.size), round(test * distinct.size)
    held = {"val": np.sort(distinct[order[:n_val]]), "test": np.sort(distinct[order[n_val:n_val + n_test]])}
    held_all = sorted_unique(np.concatenate(list(held.values())))
    edges, weights, attrs, ids = _without(typed, et, held_all, undirected)
    train = distinct[~_member(distinct, held_all)]
    splits = {"train": LinkSplit(et, train // n_dst, train % n_dst)}
    for name, fraction in (("val", val), ("test", test)):
        if fraction > 0:
            pos = held[name]
            src, dst = pos // n_dst, pos % n_dst
            neg = negative_destinations(rng, src, distinct, n_dst, num_negatives, undirected=undirected) \
                if num_negatives else None
            splits[name] = LinkSplit(et, src, dst, neg_dst=neg)
    log.info("link split of %s: %d train, %d val, %d test edges%s; %d -> %d message-passing edges",
             "/".join(et), train.size, held["val"].size, held["test"].size,
             f", {num_negatives} negatives each" if num_negatives else "", typed.num_edges(),
             sum(e.shape[1] for e in edges.values()))
    link_splits = {**typed.link_splits, **splits}
    if isinstance(graph, GraphData):
        return replace(graph, edge_index=edges[PLAIN_EDGE_TYPE], edge_weight=weights.get(PLAIN_EDGE_TYPE),
                       edge_attr=attrs.get(PLAIN_EDGE_TYPE), link_splits=link_splits,
                       edge_ids=ids.get(PLAIN_EDGE_TYPE))
    return replace(typed, edge_index=edges, edge_weight=weights, edge_attr=attrs, link_splits=link_splits,
                   edge_ids=ids)


#: Rounds of redrawing the negatives that hit a true destination before drawing the rest
#: from their sources' complements.
_NEGATIVE_ROUNDS = 16
#: Rows whose negatives are drawn at once (bounds the temporaries to a few times 8 x rows x K bytes).
_NEGATIVE_ROWS = 1 << 14


def negative_destinations(rng: np.random.Generator, src: np.ndarray, true_keys: np.ndarray, n_dst: int,
                          k: int, *, undirected: bool) -> np.ndarray:
    """int64 ``[E, k]`` destinations drawn uniformly from ``0 .. n_dst-1``, none a true
    destination of its row's source ``src[i]``: ``true_keys`` holds the relation's
    sorted distinct keys ``src * n_dst + dst`` (canonical ``min * n + max`` when
    ``undirected``, where either direction counts). Drawn in blocks of rows from ``rng``,
    so the same generator state gives the same negatives."""
    out = np.empty((src.size, k), dtype=np.int64)
    for lo in range(0, src.size, _NEGATIVE_ROWS):
        block = np.asarray(src[lo:lo + _NEGATIVE_ROWS], dtype=np.int64)
        out[lo:lo + block.size] = _negative_block(rng, block, true_keys, n_dst, k, undirected)
    return out


def _negative_block(rng: np.random.Generator, src: np.ndarray, true_keys: np.ndarray, n_dst: int, k: int,
                    undirected: bool) -> np.ndarray:
    """:func:`negative_destinations` of one block of rows."""
    def is_edge(cand: np.ndarray, u: np.ndarray) -> np.ndarray:
        return _member(_pair_keys(u, cand, n_dst, undirected), true_keys)

    neg = rng.integers(0, n_dst, (src.size, k), dtype=np.int64)
    bad_r, bad_c = np.nonzero(is_edge(neg, src[:, None]))
    for _ in range(_NEGATIVE_ROUNDS):
        if not bad_r.size:
            return neg
        neg[bad_r, bad_c] = rng.integers(0, n_dst, bad_r.size, dtype=np.int64)
        still = is_edge(neg[bad_r, bad_c], src[bad_r])
        bad_r, bad_c = bad_r[still], bad_c[still]
    # sources with (almost) every node as a true destination: draw from their complement
    for u in sorted_unique(src[bad_r]) if bad_r.size else []:
        allowed = np.flatnonzero(~is_edge(np.arange(n_dst, dtype=np.int64), np.full(n_dst, u)))
        if not allowed.size:
            raise GraphDataError(f"num_negatives: node {int(u)} has every node of the destination type as "
                                 "a true destination; no negatives can be drawn for it")
        mine = src[bad_r] == u
        neg[bad_r[mine], bad_c[mine]] = allowed[rng.integers(0, allowed.size, int(mine.sum()))]
    return neg
