"""Write a tiny ogbn-mag with all four relations in OGB's raw on-disk layout.

The layout is ``read_csv_heterograph_raw``'s (``ogb/io/read_graph_raw.py``): see
:mod:`tests.fixtures_ogb`. The returned graph is what a typed reader must give back
(OGB's ``valid`` split as ``val``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from partitioner.graph import EdgeType
from partitioner.typed import TypedGraphData
from tests.fixtures_ogb import _finish, _random_graph, _write_csv, _write_splits

MAG_COUNTS = {"author": 9, "field_of_study": 5, "institution": 3, "paper": 14}


def write_mag_typed_dataset(root: Path, seed: int = 5) -> TypedGraphData:
    """ogbn-mag with authors, papers, fields of study and institutions, four relations."""
    fixture = _finish(_random_graph(seed, MAG_COUNTS["paper"], 25, 349), "ogbn-mag", root)
    rng = np.random.default_rng(seed)
    raw = fixture.path / "raw"
    counts = MAG_COUNTS
    _write_csv(raw / "num-node-dict.csv.gz", [list(counts.values())], header=list(counts))

    def pairs(s: str, d: str, e: int) -> np.ndarray:
        return np.stack([rng.integers(0, counts[s], e), rng.integers(0, counts[d], e)])

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
    _write_csv(raw / "node-feat" / "paper" / "node-feat.csv.gz", fixture.x)
    _write_csv(raw / "node-feat" / "paper" / "node_year.csv.gz",
               np.full((counts["paper"], 1), 2010))
    has = [[t == "paper" for t in counts]]
    _write_csv(raw / "nodetype-has-label.csv.gz", has, header=list(counts))
    _write_csv(raw / "node-label" / "paper" / "node-label.csv.gz", fixture.y[:, None])
    split_dir = fixture.path / "split" / "time"
    _write_csv(split_dir / "nodetype-has-split.csv.gz", has, header=list(counts))
    _write_splits(split_dir / "paper", fixture.splits)
    ours = {"train": "train", "valid": "val", "test": "test"}
    return TypedGraphData(
        name="ogbn-mag", num_nodes=dict(counts),
        edge_index={k: v.astype(np.int64) for k, v in relations.items()},
        x={"paper": fixture.x}, target_type="paper", y=fixture.y, num_classes=349,
        splits={ours[k]: np.asarray(v, dtype=np.int64) for k, v in fixture.splits.items()},
    )
