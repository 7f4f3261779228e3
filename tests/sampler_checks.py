"""Property checks every sampler's output must satisfy (CPU and CUDA alike)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from sampling_server.sampler.types import SamplerOutput


def in_neighbors(indptr: np.ndarray, indices: np.ndarray, start: int) -> dict[int, list[int]]:
    """Global target ID -> its in-neighbors (global IDs, CSC order, repeats kept)."""
    return {start + i: indices[indptr[i]:indptr[i + 1]].tolist() for i in range(indptr.size - 1)}


def check_sampler_output(
    out: SamplerOutput, seeds: np.ndarray, fanouts: list[int], adj: dict[int, list[int]],
    *, replace: bool = False,
) -> None:
    """Assert every structural property DESIGN.md promises of a sampled batch.

    ``adj`` maps every global node ID of the whole graph to its in-neighbors.
    """
    n_id = out.n_id.cpu().numpy()
    row, col = out.row.cpu().numpy(), out.col.cpu().numpy()
    # seeds first, nodes unique, per-hop counts add up
    assert np.array_equal(n_id[: seeds.size], seeds), "seeds must come first, in order"
    assert np.unique(n_id).size == n_id.size, "n_id repeats a node"
    assert out.num_sampled_nodes[0] == seeds.size == out.batch_size
    assert sum(out.num_sampled_nodes) == n_id.size
    assert len(out.num_sampled_edges) == len(fanouts) == len(out.num_sampled_nodes) - 1
    assert sum(out.num_sampled_edges) == row.size == col.size
    assert row.size == 0 or (row.min() >= 0 and row.max() < n_id.size)
    # hop by hop: targets are the previous hop's new nodes; sources exist; fanout bound
    node_lo, edge_lo = 0, 0
    for hop, fanout in enumerate(fanouts):
        width = out.num_sampled_nodes[hop]
        e = out.num_sampled_edges[hop]
        r, c = row[edge_lo:edge_lo + e], col[edge_lo:edge_lo + e]
        assert e == 0 or (c.min() >= node_lo and c.max() < node_lo + width), f"hop {hop} targets"
        assert np.all(np.diff(c) >= 0), f"hop {hop}: edges must be grouped by target in order"
        # new nodes of this hop are exactly the first appearances among its sources
        new_lo = node_lo + width
        assert e == 0 or r.max() < new_lo + out.num_sampled_nodes[hop + 1]
        for t in range(node_lo, node_lo + width):
            target = int(n_id[t])
            sources = [int(n_id[s]) for s in r[c == t]]
            neigh = adj[target]
            for s, k in Counter(sources).items():
                assert s in neigh, f"hop {hop}: edge {s}->{target} is not in the graph"
                if not replace:
                    assert k <= neigh.count(s), f"hop {hop}: neighbor {s} of {target} repeats"
            expected = len(neigh) if fanout < 0 else min(fanout, len(neigh))
            if replace and fanout >= 0 and neigh:
                expected = fanout
            assert len(sources) == expected, (
                f"hop {hop}: node {target} has {len(neigh)} in-neighbors and fanout {fanout}, "
                f"got {len(sources)} sampled"
            )
        node_lo, edge_lo = new_lo, edge_lo + e
    # relabelling agrees with n_id: first appearance order is increasing local ID
    seen = set(range(seeds.size))
    expect_next = seeds.size
    for s in row:
        if int(s) not in seen:
            assert int(s) == expect_next, "new nodes must be numbered in first-seen order"
            seen.add(int(s))
            expect_next += 1
