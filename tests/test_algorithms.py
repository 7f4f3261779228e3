"""Partition algorithms: balance within stated bounds, METIS cuts far fewer edges than
random, argument checks, and per-method properties (determinism, contiguity,
statelessness)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from partitioner.algorithms import (
    METHODS,
    assign,
    hash_partition,
    range_partition,
    undirected_csr,
)
from partitioner.graph import GraphData
from partitioner.manifest import Manifest, NodeTypeInfo, PartitionInfo
from partitioner.summary import Balance, balance
from partitioner.synthetic import generate, generate_plain
from partitioner.writer import partition_graph

# Balance bounds as max part / mean part (summary.balance, every type summed) on the
# `small` preset (4,000 nodes) and on `mag-small` with reverse relations (10,460 nodes of
# 4 types; a typed graph is assigned on its homogeneous view); P = 2 and 4.
#: random deals a permutation round-robin: node counts differ by at most one.
RANDOM_MAX_NODE_RATIO = 1.001
#: hash is a fixed function of the ID; thousands of draws over 4 parts stay within 10%.
HASH_MAX_NODE_RATIO = 1.10
#: range balances the *sum* of node, edge and train costs over contiguous ID ranges, so
#: each quantity alone may drift; each stays within 25% of the mean.
RANGE_MAX_RATIO = 1.25
#: METIS balances a combined node + edge + train weight with its own 0.1-3% tolerance
#: per bisection; each quantity stays within 10% of the mean (15% on the typed graph,
#: whose combined weight mixes four node types).
METIS_MAX_RATIO = {"small": 1.10, "mag-small": 1.15}
#: METIS must cut well under the edges random assignment cuts: under half on `small`,
#: under 70% on `mag-small`, whose relations are only weakly homophilous (0.4 by design).
METIS_MAX_CUT_FRACTION_OF_RANDOM = {"small": 0.5, "mag-small": 0.7}
#: The graph of each kind the balance tests partition.
PRESETS = ("small", "mag-small")


@pytest.fixture(scope="module")
def small() -> GraphData:
    return generate_plain("small", seed=0, progress=False)


@pytest.fixture(scope="module", params=PRESETS)
def preset(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def manifests(preset: str, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Manifest]:
    """The preset partitioned by every method into 2 and 4 parts."""
    graph = generate(preset, seed=0, progress=False)
    if preset == "mag-small":
        graph = graph.add_reverse()  # type: ignore[union-attr]
    out: dict[tuple[str, int], Manifest] = {}
    for method in METHODS:
        for num_parts in (2, 4):
            root = tmp_path_factory.mktemp(f"{preset}-{method}-{num_parts}")
            out[method, num_parts] = partition_graph(graph, num_parts, root, method=method, progress=False)
    return out


def _ratios(b: Balance) -> dict[str, float]:
    return {"nodes": b.nodes, "edges": b.edges, "train": b.train}


@pytest.mark.parametrize("num_parts", [2, 4])
def test_random_balances_node_counts_exactly(manifests: dict, num_parts: int) -> None:
    m = manifests["random", num_parts]
    counts = [sum(p.num_nodes.values()) for p in m.partitions]
    assert max(counts) - min(counts) <= 1
    assert balance(m).nodes <= RANDOM_MAX_NODE_RATIO


@pytest.mark.parametrize("num_parts", [2, 4])
def test_hash_balances_nodes(manifests: dict, num_parts: int) -> None:
    assert balance(manifests["hash", num_parts]).nodes <= HASH_MAX_NODE_RATIO


#: Why range does not balance a typed graph (a known limit, checked to hold: strict).
RANGE_ON_TYPED = pytest.mark.xfail(
    strict=True, reason="range cuts a typed graph's homogeneous view, where each node type is one "
    "block of IDs: the first parts get the papers and every training node, the last ones the "
    "authors, institutions and fields of study")


@pytest.mark.parametrize("num_parts", [2, 4])
def test_range_balances_nodes_edges_and_train(request: pytest.FixtureRequest, manifests: dict, preset: str,
                                              num_parts: int) -> None:
    if preset == "mag-small":
        request.applymarker(RANGE_ON_TYPED)
    ratios = _ratios(balance(manifests["range", num_parts]))
    assert all(r <= RANGE_MAX_RATIO for r in ratios.values()), ratios


@pytest.mark.parametrize("num_parts", [2, 4])
def test_metis_balances_nodes_edges_and_train(manifests: dict, preset: str, num_parts: int) -> None:
    ratios = _ratios(balance(manifests["metis", num_parts]))
    assert all(r <= METIS_MAX_RATIO[preset] for r in ratios.values()), ratios


@pytest.mark.parametrize("num_parts", [2, 4])
def test_metis_cuts_far_fewer_edges_than_random(manifests: dict, preset: str, num_parts: int) -> None:
    metis, random = manifests["metis", num_parts], manifests["random", num_parts]
    assert metis.edge_cut() < METIS_MAX_CUT_FRACTION_OF_RANDOM[preset] * random.edge_cut(), (
        metis.edge_cut(), random.edge_cut())
    for et in metis.edge_types:  # every relation, not only the sum
        assert metis.edge_cut(et) < random.edge_cut(et), et


def test_balance_reports_max_over_mean() -> None:
    """summary.balance itself, on hand-set sizes (every type summed)."""
    et = ("a", "r", "b")

    def info(pid: int, nodes: tuple[int, int], edges: int, train: int) -> PartitionInfo:
        return PartitionInfo(id=pid, num_nodes={"a": nodes[0], "b": nodes[1]}, num_edges={et: edges},
                             num_remote_edges={et: 0}, split_sizes={"train": train}, files={})

    types = {"a": NodeTypeInfo(20, 1, "float32"), "b": NodeTypeInfo(20, 0, "")}
    m = Manifest(graph_name="g", node_types=types, edge_types={et: 30}, target_type="a", num_classes=2,
                 partition_book={"a": (0, 5, 20), "b": (0, 5, 20)},
                 partitions=(info(0, (5, 5), 10, 3), info(1, (15, 15), 20, 1)), files={})
    b = balance(m)
    assert b.nodes == pytest.approx(1.5) and b.edges == pytest.approx(20 / 15)
    assert b.train == pytest.approx(1.5)


# ------------------------------------------------------------------ argument checks


def _tiny(num_nodes: int = 6) -> GraphData:
    ring = np.arange(num_nodes, dtype=np.int64)
    edge_index = np.stack([ring, np.roll(ring, -1)])
    return GraphData(name="ring", num_nodes=num_nodes, edge_index=edge_index,
                     x=np.zeros((num_nodes, 2), np.float32), y=np.zeros(num_nodes, np.int64),
                     num_classes=1, splits={"train": np.array([0, 1], dtype=np.int64)})


@pytest.mark.parametrize("num_parts", [0, -2])
def test_num_parts_below_one_is_refused(num_parts: int) -> None:
    with pytest.raises(ValueError, match=r"num_parts: expected an integer >= 1"):
        assign(_tiny(), num_parts, "random")


def test_more_parts_than_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match=r"num_parts: expected at most num_nodes \(6\), got 7"):
        assign(_tiny(), 7, "random")


def test_unknown_method_is_refused() -> None:
    with pytest.raises(ValueError, match=r"method: expected one of .*'spectral'"):
        assign(_tiny(), 2, "spectral")


def test_partition_left_empty_is_refused_not_silently_dropped(tmp_path: Path) -> None:
    """hash of 4 nodes into 4 parts leaves a part empty: asking for 4 partitions must not
    quietly write 3."""
    assert (np.bincount(hash_partition(4, 4, 0), minlength=4) == 0).any()
    with pytest.raises(ValueError, match="empty"):
        partition_graph(_tiny(4), 4, tmp_path / "out", method="hash", progress=False)
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_each_node_one_valid_part(small: GraphData, method: str) -> None:
    part_of = assign(small, 3, method, progress=False)
    assert part_of.shape == (small.num_nodes,) and part_of.dtype == np.int32
    assert set(np.unique(part_of).tolist()) == {0, 1, 2}


@pytest.mark.parametrize("method", METHODS)
def test_one_part_puts_every_node_in_it(method: str) -> None:
    assert not assign(_tiny(), 1, method, progress=False).any()


# ------------------------------------------------------------------ per-method properties


@pytest.mark.parametrize("method", METHODS)
def test_same_seed_gives_the_same_assignment(small: GraphData, method: str) -> None:
    a = assign(small, 4, method, seed=3, progress=False)
    b = assign(small, 4, method, seed=3, progress=False)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("method", ["random", "hash"])
def test_seed_changes_random_and_hash(small: GraphData, method: str) -> None:
    a = assign(small, 4, method, seed=0, progress=False)
    b = assign(small, 4, method, seed=1, progress=False)
    assert (a != b).mean() > 0.5  # about 3/4 of the nodes move


def test_hash_is_a_function_of_the_node_id_alone() -> None:
    """Any process computes a node's part alone: the first m nodes of a bigger graph get
    the parts they get in a graph of m nodes."""
    np.testing.assert_array_equal(hash_partition(1000, 5, 9)[:300], hash_partition(300, 5, 9))


@pytest.mark.parametrize("num_parts", [2, 3, 7])
def test_range_gives_contiguous_original_id_ranges(small: GraphData, num_parts: int) -> None:
    part_of = range_partition(small, num_parts, edge_chunk=4096, progress=False)
    assert part_of[0] == 0 and part_of[-1] == num_parts - 1
    assert set(np.diff(part_of).tolist()) <= {0, 1}


def test_range_keeps_every_part_non_empty_on_a_skewed_graph() -> None:
    """All the cost on the last node: the cuts would collapse, but each part keeps a node."""
    n = 10
    edge_index = np.stack([np.arange(n - 1), np.full(n - 1, n - 1)]).astype(np.int64)
    g = GraphData(name="star", num_nodes=n, edge_index=edge_index,
                  x=np.zeros((n, 1), np.float32), y=np.zeros(n, np.int64), num_classes=1,
                  splits={"train": np.array([n - 1], dtype=np.int64)})
    part_of = range_partition(g, 4, progress=False)
    np.testing.assert_array_equal(np.bincount(part_of, minlength=4) > 0, True)
    assert set(np.diff(part_of).tolist()) <= {0, 1}


def test_range_chunking_does_not_change_the_result(small: GraphData) -> None:
    np.testing.assert_array_equal(range_partition(small, 4, edge_chunk=999, progress=False),
                                  range_partition(small, 4, progress=False))


def test_undirected_csr_is_symmetric_without_loops_or_repeats() -> None:
    edge_index = np.array([[0, 1, 1, 2, 2, 3, 4, 0],
                           [1, 0, 2, 2, 1, 0, 4, 1]], dtype=np.int64)
    g = GraphData(name="g", num_nodes=6, edge_index=edge_index, x=np.zeros((6, 1), np.float32),
                  y=np.zeros(6, np.int64), num_classes=1)
    xadj, adjncy = undirected_csr(g, progress=False)
    rows = [sorted(adjncy[xadj[u]:xadj[u + 1]].tolist()) for u in range(6)]
    assert rows == [[1, 3], [0, 2], [1], [0], [], []]
