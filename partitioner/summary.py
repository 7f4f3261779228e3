"""Human-readable summary of a partitioned graph."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partitioner.format import Manifest
from partitioner.hetero_format import HeteroManifest


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


def format_hetero_summary(manifest: HeteroManifest) -> str:
    """Per-type and per-relation tables of a typed (format v2) partition."""
    algo = manifest.algorithm
    lines = [
        f"graph {manifest.graph_name} (typed, format v2): {manifest.num_nodes:,} nodes of "
        f"{len(manifest.node_types)} types, {manifest.num_edges:,} edges of "
        f"{len(manifest.edge_types)} types; target {manifest.target_type!r}, "
        f"{manifest.num_classes} classes",
        f"method {algo.get('method', '?')} into {manifest.num_partitions} partitions "
        f"in {algo.get('seconds', 0.0):.1f} s",
        f"{'node type':<24} {'nodes':>12} {'features':>13}  nodes per partition",
    ]
    for t, info in manifest.node_types.items():
        per = ", ".join(f"{p.num_nodes[t]:,}" for p in manifest.partitions)
        feats = f"{info.feature_dim} {info.feature_dtype}" if info.feature_dim else "none"
        lines.append(f"{t:<24} {info.num_nodes:>12,} {feats:>13}  {per}")
    lines.append(f"{'edge type':<48} {'edges':>12} {'cut':>7}  edges per partition")
    for et, total in manifest.edge_types.items():
        cut = manifest.edge_cut(et)
        per = ", ".join(f"{p.num_edges[et]:,}" for p in manifest.partitions)
        frac = cut / total if total else 0.0
        lines.append(f"{'/'.join(et):<48} {total:>12,} {frac:>7.1%}  {per}")
    splits = "; ".join(
        f"{p.id}: " + ", ".join(f"{s} {n:,}" for s, n in p.split_sizes.items())
        for p in manifest.partitions)
    lines.append(f"{manifest.target_type} splits per partition: {splits}")
    cut = manifest.edge_cut()
    lines.append(f"edge cut: {cut:,} of {manifest.num_edges:,} edges "
                 f"({cut / max(manifest.num_edges, 1):.1%})")
    return "\n".join(lines)
