"""Edge features for the tiny graphs of :mod:`tests.graph_fixtures`, and the check that a
partitioned graph's edge IDs and edge features are those of its input.

Features of several widths and dtypes, and a relation without any, so that one check
covers what the format must keep: :func:`with_edge_attr` gives the plain graph
``float32 [E, 3]`` features and the typed graph ``float32 [E, 3]`` on ``author writes
paper``, 1-D ``int64`` on ``paper cites paper``, ``float16 [E, 2]`` on ``paper has_topic
topic``, and none on ``topic rev_has_topic paper``. The float32 features encode the
edge's column (``attr[e, j] = e + j / 8``) so a test can tell which edge a row is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from partitioner.graph import EdgeType, GraphData, TypedGraphData
from partitioner.partition import Partition
from tests.graph_fixtures import AnyGraph, typed_view


def column_features(num_edges: int, width: int = 3) -> np.ndarray:
    """``float32 [E, width]`` with ``[e, j] = e + j / 8``: each row names its edge."""
    return (np.arange(num_edges)[:, None] + np.arange(width)[None, :] / 8).astype(np.float32)


def with_edge_attr(graph: AnyGraph, seed: int = 0) -> AnyGraph:
    """``graph`` (changed in place and returned) with the edge features of the module doc."""
    gen = np.random.default_rng(seed)
    if isinstance(graph, GraphData):
        graph.edge_attr = column_features(graph.num_edges)
        graph.validate()
        return graph
    typed: TypedGraphData = graph
    for et, ei in typed.edge_index.items():
        e = int(ei.shape[1])
        if et[1] == "writes":
            typed.edge_attr[et] = column_features(e)
        elif et[1] == "cites":
            typed.edge_attr[et] = 7 * np.arange(e, dtype=np.int64) + 3
        elif et[1] == "has_topic":
            typed.edge_attr[et] = gen.standard_normal((e, 2)).astype(np.float16)
    typed.validate()
    return typed


def check_edge_data(graph: AnyGraph, partitions: Sequence[Partition]) -> None:
    """Every partition's ``e_id`` names, for each in-edge, the input edge it is (same
    original source and destination: ``edge_index[:, e_id]`` of the input, through the
    node maps), every input edge once over all partitions; its ``edge_attr`` rows are the
    input's rows at ``e_id`` (same dtype and width); the manifest says so."""
    typed = typed_view(graph)
    m = partitions[0].manifest
    assert m.edge_ids == frozenset(typed.edge_types) and m.has_edge_ids
    assert {et: (i.shape, i.dtype) for et, i in m.edge_features.items()} == {
        et: (a.shape[1:], a.dtype.name) for et, a in typed.edge_attr.items()}
    for et in typed.edge_types:
        _check_relation(typed, et, partitions)


def _check_relation(typed: TypedGraphData, et: EdgeType, partitions: Sequence[Partition]) -> None:
    s, _, d = et
    ei = typed.edge_index[et]
    seen = []
    for part in partitions:
        e_id = np.asarray(part.e_id[et])
        indptr, indices = np.asarray(part.indptr[et]), np.asarray(part.indices[et])
        assert e_id.dtype == np.int64 and e_id.shape == indices.shape
        start = part.node_range(d)[0]
        dst_global = start + np.repeat(np.arange(indptr.size - 1), np.diff(indptr))
        np.testing.assert_array_equal(_orig(partitions, s, indices), ei[0][e_id])
        np.testing.assert_array_equal(_orig(partitions, d, dst_global), ei[1][e_id])
        assert (et in part.edge_attr) == (et in typed.edge_attr)
        if et in typed.edge_attr:
            attr = np.asarray(part.edge_attr[et])
            assert attr.dtype == typed.edge_attr[et].dtype
            np.testing.assert_array_equal(attr, typed.edge_attr[et][e_id])
        lo, hi = part.edge_data.edge_range(et)
        assert (lo, hi) == (part.edge_start[et], part.edge_start[et] + e_id.size)
        seen.append(e_id)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(ei.shape[1]))


def _orig(partitions: Sequence[Partition], node_type: str, global_ids: np.ndarray) -> np.ndarray:
    """Original IDs of global IDs of ``node_type`` (each partition's ``orig_ids`` joined)."""
    orig = np.concatenate([np.asarray(p.orig_ids[node_type]) for p in partitions])
    return orig[global_ids]
