"""Human-readable summary of a partitioned graph."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partitioner.format import Manifest


@dataclass(frozen=True)
class Balance:
    """Largest part over the mean part (1.0 = perfectly balanced) per quantity."""

    nodes: float
    edges: float
    train: float


def balance(manifest: Manifest) -> Balance:
    def ratio(values: list[int]) -> float:
        arr = np.asarray(values, dtype=np.float64)
        return float(arr.max() / arr.mean()) if arr.size and arr.mean() > 0 else 1.0

    parts = manifest.partitions
    return Balance(
        nodes=ratio([p.num_nodes for p in parts]),
        edges=ratio([p.num_edges for p in parts]),
        train=ratio([p.split_sizes.get("train", 0) for p in parts]),
    )


def format_summary(manifest: Manifest) -> str:
    """A table of nodes, edges and split sizes per partition, edge cut and balance."""
    algo = manifest.algorithm
    lines = [
        f"graph {manifest.graph_name}: {manifest.num_nodes:,} nodes, "
        f"{manifest.num_edges:,} edges, {manifest.feature_dim} features "
        f"({manifest.feature_dtype}), {manifest.num_classes} classes",
        f"method {algo.get('method', '?')} into {manifest.num_partitions} partitions "
        f"in {algo.get('seconds', 0.0):.1f} s",
        f"{'part':>4} {'nodes':>12} {'edges':>14} {'train':>9} {'val':>9} {'test':>10} "
        f"{'remote in-edges':>16}",
    ]
    for p in manifest.partitions:
        s = p.split_sizes
        lines.append(
            f"{p.id:>4} {p.num_nodes:>12,} {p.num_edges:>14,} {s.get('train', 0):>9,} "
            f"{s.get('val', 0):>9,} {s.get('test', 0):>10,} {p.num_remote_edges:>16,}"
        )
    cut = manifest.edge_cut
    frac = cut / manifest.num_edges if manifest.num_edges else 0.0
    b = balance(manifest)
    lines.append(f"edge cut: {cut:,} of {manifest.num_edges:,} edges ({frac:.1%})")
    lines.append(
        f"balance (max/mean): nodes {b.nodes:.3f}, edges {b.edges:.3f}, train {b.train:.3f}"
    )
    return "\n".join(lines)
