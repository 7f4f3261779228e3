"""Write tiny OGB node-property datasets in OGB's real raw on-disk layout.

The layout follows ``ogb/io/read_graph_raw.py`` and ``ogb/nodeproppred/dataset.py``:

- csv (ogbn-products, ogbn-arxiv): ``raw/{edge,num-node-list,num-edge-list,node-feat,
  node-label}.csv.gz``, headerless, one row per edge / graph / node;
- binary (ogbn-papers100M): ``raw/data.npz`` (``edge_index``, ``node_feat``, ``node_year``,
  ``num_nodes_list``, ``num_edges_list``) and ``raw/node-label.npz`` (``node_label``,
  float ``[N, 1]`` with NaN for unlabeled papers);
- heterograph (ogbn-mag, typed): ``raw/num-node-dict.csv.gz`` (a header of node types and one
  row of counts), ``raw/triplet-type-list.csv.gz``, ``raw/relations/<h>___<r>___<t>/
  {edge,num-edge-list}.csv.gz``, ``raw/node-feat/<type>/node-feat.csv.gz``,
  ``raw/nodetype-has-label.csv.gz``, ``raw/node-label/<type>/node-label.csv.gz``, and
  ``split/<split>/nodetype-has-split.csv.gz`` with ``split/<split>/<type>/*.csv.gz``;
- every dataset: ``split/<split>/{train,valid,test}.csv.gz`` (per node type for mag) and
  ``RELEASE_v<version>.txt`` in the dataset folder;
- edge features, when asked for (``edge_feat_dim``), where OGB keeps them: csv
  ``raw/edge-feat.csv.gz`` beside ``raw/edge.csv.gz`` (as ogbn-proteins' 8 per edge),
  binary ``edge_feat`` in ``raw/data.npz``, heterograph
  ``raw/relations/<h>___<r>___<t>/edge-feat.csv.gz`` (here on ``paper cites paper``).

Every value is chosen so that it survives the CSV text round trip exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from partitioner.graph import EdgeType, TypedGraphData

#: OGB's split names to graphfeed's.
OGB_TO_OURS = {"train": "train", "valid": "val", "test": "test"}
#: Per dataset: folder name, split folder name, number of classes, release version.
_LAYOUT: dict[str, tuple[str, str, int, int]] = {
    "ogbn-products": ("ogbn_products", "sales_ranking", 47, 1),
    "ogbn-arxiv": ("ogbn_arxiv", "time", 40, 1),
    "ogbn-papers100M": ("ogbn_papers100M", "time", 172, 1),
    "ogbn-mag": ("ogbn_mag", "time", 349, 2),
}


@dataclass
class OgbFixture:
    """What a fixture wrote, in the form OGB stores it (before any reader touches it)."""

    #: OGB name.
    name: str
    #: The dataset folder, ``<root>/<dir_name>``.
    path: Path
    #: Number of (paper, for mag) nodes.
    num_nodes: int
    #: ``[2, E]`` int64 edges as written to disk (one direction only).
    edge_index: np.ndarray
    #: ``[N, F]`` float32 features.
    x: np.ndarray
    #: ``[N]`` int64 labels with ``-1`` where OGB stores NaN.
    y: np.ndarray
    #: OGB split names (``train``/``valid``/``test``) to node IDs.
    splits: dict[str, np.ndarray] = field(default_factory=dict)
    #: ogbn-mag: the whole typed graph (papers first), as a typed read gives it back.
    typed: TypedGraphData | None = None
    #: ``[E, F]`` float32 edge features as written (of ``paper cites paper`` for mag), if any.
    edge_feat: np.ndarray | None = None


def _write_csv(
    path: Path, rows: np.ndarray | Sequence[Sequence[object]], header: list[str] | None = None
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(np.asarray(rows) if header is None else rows, columns=header)
    frame.to_csv(path, header=header is not None, index=False, compression="gzip")


def _random_graph(seed: int, num_nodes: int, num_edges: int, num_classes: int) -> OgbFixture:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, num_nodes, num_edges)
    dst = rng.integers(0, num_nodes, num_edges)
    edge_index = np.stack([src, dst]).astype(np.int64)
    x = (rng.integers(-16, 16, (num_nodes, 5)) / 4).astype(np.float32)
    y = rng.integers(0, num_classes, num_nodes).astype(np.int64)
    order = rng.permutation(num_nodes)
    splits = {"train": order[:6], "valid": order[6:9], "test": order[9:13]}
    return OgbFixture("", Path(), num_nodes, edge_index, x, y, splits)


def _edge_feat(seed: int, num_edges: int, dim: int) -> np.ndarray | None:
    """Edge features that survive the CSV text round trip (multiples of 1/8), or None."""
    if not dim:
        return None
    return (np.random.default_rng(seed + 100).integers(0, 8, (num_edges, dim)) / 8).astype(np.float32)


def _finish(fixture: OgbFixture, name: str, root: Path) -> OgbFixture:
    dir_name, _, _, version = _LAYOUT[name]
    fixture.name = name
    fixture.path = Path(root) / dir_name
    fixture.path.mkdir(parents=True, exist_ok=True)
    (fixture.path / f"RELEASE_v{version}.txt").write_text(f"{name} v{version}\n")
    return fixture


def write_csv_dataset(root: Path, name: str = "ogbn-products", seed: int = 0,
                      edge_feat_dim: int = 0) -> OgbFixture:
    """ogbn-products or ogbn-arxiv: homogeneous, csv.gz files (``edge_feat_dim`` features
    per edge in ``raw/edge-feat.csv.gz``, as ogbn-proteins has)."""
    _, split, num_classes, _ = _LAYOUT[name]
    fixture = _finish(_random_graph(seed, 16, 30, num_classes), name, root)
    fixture.edge_index[:, 1] = fixture.edge_index[::-1, 0]  # a reciprocal pair
    fixture.edge_index[:, 2] = fixture.edge_index[:, 0]  # a duplicate edge
    raw = fixture.path / "raw"
    _write_csv(raw / "edge.csv.gz", fixture.edge_index.T)
    _write_csv(raw / "num-node-list.csv.gz", [[fixture.num_nodes]])
    _write_csv(raw / "num-edge-list.csv.gz", [[fixture.edge_index.shape[1]]])
    fixture.edge_feat = _edge_feat(seed, fixture.edge_index.shape[1], edge_feat_dim)
    if fixture.edge_feat is not None:
        _write_csv(raw / "edge-feat.csv.gz", fixture.edge_feat)
    _write_csv(raw / "node-feat.csv.gz", fixture.x)
    _write_csv(raw / "node-label.csv.gz", fixture.y[:, None])
    if name == "ogbn-arxiv":
        _write_csv(raw / "node_year.csv.gz", np.full((fixture.num_nodes, 1), 2019))
    _write_splits(fixture.path / "split" / split, fixture.splits)
    return fixture


def write_binary_dataset(root: Path, name: str = "ogbn-papers100M", seed: int = 1,
                         edge_feat_dim: int = 0) -> OgbFixture:
    """ogbn-papers100M: homogeneous, ``data.npz`` plus float labels with NaN (and
    ``edge_feat_dim`` features per edge as ``edge_feat`` in ``data.npz``)."""
    _, split, num_classes, _ = _LAYOUT[name]
    fixture = _finish(_random_graph(seed, 20, 40, num_classes), name, root)
    fixture.y[[0, 3, 17]] = -1
    raw = fixture.path / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    fixture.edge_feat = _edge_feat(seed, fixture.edge_index.shape[1], edge_feat_dim)
    np.savez_compressed(
        raw / "data.npz",
        **({} if fixture.edge_feat is None else {"edge_feat": fixture.edge_feat}),
        edge_index=fixture.edge_index,
        node_feat=fixture.x,
        node_year=np.full((fixture.num_nodes, 1), 2015, dtype=np.int64),
        num_nodes_list=np.array([fixture.num_nodes], dtype=np.int64),
        num_edges_list=np.array([fixture.edge_index.shape[1]], dtype=np.int64),
    )
    labels = np.where(fixture.y < 0, np.nan, fixture.y).astype(np.float64)[:, None]
    np.savez_compressed(raw / "node-label.npz", node_label=labels)
    labeled = np.flatnonzero(fixture.y >= 0)
    fixture.splits = {"train": labeled[:8], "valid": labeled[8:11], "test": labeled[11:15]}
    _write_splits(fixture.path / "split" / split, fixture.splits)
    return fixture


#: ogbn-mag fixture's node types and counts, in the order of ``num-node-dict.csv.gz``.
MAG_COUNTS = {"author": 9, "field_of_study": 5, "institution": 3, "paper": 14}


def write_mag_dataset(root: Path, seed: int = 5, edge_feat_dim: int = 0) -> OgbFixture:
    """ogbn-mag: a heterograph of four node types and four relations. The fixture's
    plain fields are its papers and ``paper cites paper``; ``typed`` is the whole graph a
    typed read must give back (OGB's ``valid`` split as ``val``); ``edge_feat_dim``
    features per edge of ``paper cites paper``."""
    name = "ogbn-mag"
    _, split, num_classes, _ = _LAYOUT[name]
    counts = MAG_COUNTS
    fixture = _finish(_random_graph(seed, counts["paper"], 25, num_classes), name, root)
    rng = np.random.default_rng(seed)
    raw = fixture.path / "raw"
    _write_csv(raw / "num-node-dict.csv.gz", [list(counts.values())], header=list(counts))

    def pairs(s: str, d: str, e: int) -> np.ndarray:
        return np.stack([rng.integers(0, counts[s], e), rng.integers(0, counts[d], e)]).astype(np.int64)

    relations: dict[EdgeType, np.ndarray] = {
        ("author", "affiliated_with", "institution"): pairs("author", "institution", 8),
        ("author", "writes", "paper"): pairs("author", "paper", 30),
        ("paper", "cites", "paper"): fixture.edge_index,
        ("paper", "has_topic", "field_of_study"): pairs("paper", "field_of_study", 20),
    }
    _write_csv(raw / "triplet-type-list.csv.gz", [list(t) for t in relations])
    for triplet, edges in relations.items():
        rel_dir = raw / "relations" / "___".join(triplet)
        _write_csv(rel_dir / "edge.csv.gz", edges.T)
        _write_csv(rel_dir / "num-edge-list.csv.gz", [[edges.shape[1]]])
        _write_csv(rel_dir / "edge_reltype.csv.gz", np.zeros((edges.shape[1], 1), dtype=np.int64))
    cites = ("paper", "cites", "paper")
    fixture.edge_feat = _edge_feat(seed, relations[cites].shape[1], edge_feat_dim)
    if fixture.edge_feat is not None:
        _write_csv(raw / "relations" / "___".join(cites) / "edge-feat.csv.gz", fixture.edge_feat)
    _write_csv(raw / "node-feat" / "paper" / "node-feat.csv.gz", fixture.x)
    _write_csv(raw / "node-feat" / "paper" / "node_year.csv.gz", np.full((counts["paper"], 1), 2010))
    has = [[t == "paper" for t in counts]]
    _write_csv(raw / "nodetype-has-label.csv.gz", has, header=list(counts))
    _write_csv(raw / "node-label" / "paper" / "node-label.csv.gz", fixture.y[:, None])
    split_dir = fixture.path / "split" / split
    _write_csv(split_dir / "nodetype-has-split.csv.gz", has, header=list(counts))
    _write_splits(split_dir / "paper", fixture.splits)
    fixture.typed = TypedGraphData(
        name=name, num_nodes={"paper": counts["paper"], **{t: n for t, n in counts.items() if t != "paper"}},
        edge_index=relations, x={"paper": fixture.x}, target_type="paper", y=fixture.y,
        num_classes=num_classes,
        splits={OGB_TO_OURS[k]: np.asarray(v, dtype=np.int64) for k, v in fixture.splits.items()},
        edge_attr={} if fixture.edge_feat is None else {cites: fixture.edge_feat},
    )
    return fixture


def _write_splits(split_dir: Path, splits: dict[str, np.ndarray]) -> None:
    for stem, ids in splits.items():
        _write_csv(split_dir / f"{stem}.csv.gz", np.asarray(ids, dtype=np.int64)[:, None])
