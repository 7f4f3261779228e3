"""Human-readable summary of a partitioned graph."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partitioner.manifest import Manifest


@dataclass(frozen=True)
class Balance:
    """Largest part over the mean part (1.0 = perfectly balanced) per quantity."""

    nodes: float
    edges: float
    train: float


def _ratio(values: list[int]) -> float:
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.max() / arr.mean()) if arr.size and arr.mean() > 0 else 1.0


def balance(manifest: Manifest) -> Balance:
    """Balance of nodes and edges (every type summed) and of the training nodes."""
    parts = manifest.partitions
    return Balance(nodes=_ratio([sum(p.num_nodes.values()) for p in parts]),
                   edges=_ratio([sum(p.num_edges.values()) for p in parts]),
                   train=_ratio([p.split_sizes.get("train", 0) for p in parts]))


def _edge_features(m: Manifest, et: tuple[str, str, str]) -> str:
    """An edge type's features as the summary shows them: ``[8] float32``, or ``none``."""
    info = m.edge_features.get(et)
    return "none" if info is None else f"{list(info.shape)} {info.dtype}"


def format_summary(manifest: Manifest) -> str:
    """A table of nodes, edges and split sizes per partition (per type and relation for
    a typed graph), the edge cut and the balance."""
    m = manifest
    algo = m.algorithm
    target = m.target
    plain_edges = "".join(f"edge features {_edge_features(m, et)}, " for et in m.edge_features)
    kind = (f" (typed, format v2): {m.num_nodes:,} nodes of {len(m.node_types)} types, "
            f"{m.num_edges:,} edges of {len(m.edge_types)} types; target {m.target_type!r}, "
            if m.typed else f": {m.num_nodes:,} nodes, {m.num_edges:,} edges, {target.feature_dim} "
            f"features ({target.feature_dtype}), {plain_edges}")
    lines = [f"graph {m.graph_name}{kind}{m.num_classes} classes",
             f"method {algo.get('method', '?')} into {m.num_partitions} partitions "
             f"in {algo.get('seconds', 0.0):.1f} s"]
    if m.typed:
        lines.append(f"{'node type':<24} {'nodes':>12} {'features':>13}  nodes per partition")
        for t, info in m.node_types.items():
            per = ", ".join(f"{p.num_nodes[t]:,}" for p in m.partitions)
            feats = f"{info.feature_dim} {info.feature_dtype}" if info.feature_dim else "none"
            lines.append(f"{t:<24} {info.num_nodes:>12,} {feats:>13}  {per}")
        lines.append(f"{'edge type':<48} {'edges':>12} {'cut':>7} {'edge features':>15}  edges per partition")
        for et, total in m.edge_types.items():
            per = ", ".join(f"{p.num_edges[et]:,}" for p in m.partitions)
            lines.append(f"{'/'.join(et):<48} {total:>12,} {m.edge_cut(et) / max(total, 1):>7.1%} "
                         f"{_edge_features(m, et):>15}  {per}")
    lines.append(f"{'part':>4} {'nodes':>12} {'edges':>14} {'train':>9} {'val':>9} {'test':>10} "
                 f"{'remote in-edges':>16}")
    for p in m.partitions:
        s = p.split_sizes
        lines.append(f"{p.id:>4} {sum(p.num_nodes.values()):>12,} {sum(p.num_edges.values()):>14,} "
                     f"{s.get('train', 0):>9,} {s.get('val', 0):>9,} {s.get('test', 0):>10,} "
                     f"{sum(p.num_remote_edges.values()):>16,}")
    ids = ("stored for every edge (e_id)" if m.has_edge_ids else
           "not stored (written before edge IDs were)" if not m.edge_ids else
           f"stored for {len(m.edge_ids)} of {len(m.edge_types)} edge types")
    lines.append(f"original edge IDs: {ids}")
    lines.extend(_link_split_lines(m))
    cut = m.edge_cut()
    b = balance(m)
    lines.append(f"edge cut: {cut:,} of {m.num_edges:,} edges ({cut / max(m.num_edges, 1):.1%})")
    lines.append(f"balance (max/mean): nodes {b.nodes:.3f}, edges {b.edges:.3f}, train {b.train:.3f}")
    return "\n".join(lines)


def _link_split_lines(m: Manifest) -> list[str]:
    """One line per link split: its edges, edge type (typed graphs), negatives and labels."""
    if not m.link_splits:
        return []
    lines = [f"link splits: {len(m.link_splits)}"]
    for name, info in m.link_splits.items():
        of = f" of {'/'.join(info.edge_type)}" if m.typed else ""
        neg = f", {info.num_negatives} negatives each" if info.num_negatives else ""
        label = f", labels {list(info.label_shape)} {info.label_dtype}" if info.label_dtype else ""
        lines.append(f"  {name:<12} {info.num_edges:>12,} edges{of}{neg}{label}")
    return lines
