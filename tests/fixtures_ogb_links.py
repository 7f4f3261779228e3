"""Write tiny OGB link-property datasets (ogbl-citation2, ogbl-collab) in OGB's real
on-disk layout (``ogb/linkproppred/dataset.py``, ``ogb/io/read_graph_raw.py``):

- ``raw/{edge,num-node-list,num-edge-list,node-feat}.csv.gz``, headerless; ``raw/edge.csv.gz``
  holds the train edges only (one direction); collab also ``raw/edge_weight.csv.gz`` and
  ``raw/edge_year.csv.gz`` (one row per train edge), citation2 ``raw/node_year.csv.gz``;
- ``split/time/{train,valid,test}.pt``: ``torch.save``'d dicts of numpy arrays, as OGB ships
  them: citation2 ``source_node``, ``target_node`` (+ ``target_node_neg`` [E, K] in
  valid/test); collab ``edge`` [E, 2], ``weight``, ``year`` (+ ``edge_neg`` [E', 2] in
  valid/test);
- ``RELEASE_v1.txt`` in the dataset folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tests.fixtures_ogb import _write_csv

#: Nodes of each fixture.
NUM_NODES = 20


@dataclass
class OgbLinkFixture:
    """What a fixture wrote, as OGB stores it."""

    #: OGB name.
    name: str
    #: The dataset folder.
    path: Path
    #: ``[N, F]`` float32 node features.
    x: np.ndarray
    #: ``[2, E]`` train edges as written (one direction).
    train: np.ndarray
    #: Each ``.pt`` file's dict, by OGB split stem (``train``, ``valid``, ``test``).
    splits: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    #: collab: ``[E]`` weights of the train edges.
    weight: np.ndarray | None = None


def _pairs(rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` distinct pairs ``(u, v)``, ``u != v``, as ``[2, count]``."""
    keys = rng.choice(NUM_NODES * NUM_NODES, size=4 * count, replace=False)
    keys = keys[keys // NUM_NODES != keys % NUM_NODES][:count]
    return np.stack([keys // NUM_NODES, keys % NUM_NODES]).astype(np.int64)


def _common(root: Path, name: str, seed: int) -> tuple[OgbLinkFixture, np.ndarray, np.random.Generator]:
    rng = np.random.default_rng(seed)
    path = root / name.replace("-", "_")
    path.mkdir(parents=True, exist_ok=True)
    (path / "RELEASE_v1.txt").write_text(f"{name} v1\n")
    edges = _pairs(rng, 60)
    x = (rng.integers(-16, 16, (NUM_NODES, 4)) / 4).astype(np.float32)
    raw = path / "raw"
    train = edges[:, :40]
    _write_csv(raw / "edge.csv.gz", train.T)
    _write_csv(raw / "num-node-list.csv.gz", [[NUM_NODES]])
    _write_csv(raw / "num-edge-list.csv.gz", [[train.shape[1]]])
    _write_csv(raw / "node-feat.csv.gz", x)
    return OgbLinkFixture(name, path, x, train), edges, rng


def _save(fixture: OgbLinkFixture, splits: dict[str, dict[str, np.ndarray]]) -> None:
    split_dir = fixture.path / "split" / "time"
    split_dir.mkdir(parents=True, exist_ok=True)
    for stem, part in splits.items():
        torch.save(part, split_dir / f"{stem}.pt")
    fixture.splits = splits


def write_citation2(root: Path, seed: int = 0, num_negatives: int = 7) -> OgbLinkFixture:
    """ogbl-citation2: 40 train, 10 valid, 10 test citations, ``num_negatives`` given
    negatives per valid/test citation."""
    fixture, edges, rng = _common(root, "ogbl-citation2", seed)
    _write_csv(fixture.path / "raw" / "node_year.csv.gz", rng.integers(2000, 2020, (NUM_NODES, 1)))
    parts = {"train": edges[:, :40], "valid": edges[:, 40:50], "test": edges[:, 50:60]}
    splits = {}
    for stem, e in parts.items():
        d = {"source_node": e[0].copy(), "target_node": e[1].copy()}
        if stem != "train":
            d["target_node_neg"] = rng.integers(0, NUM_NODES, (e.shape[1], num_negatives)).astype(np.int64)
        splits[stem] = d
    _save(fixture, splits)
    return fixture


def write_collab(root: Path, seed: int = 0) -> OgbLinkFixture:
    """ogbl-collab: 40 train, 10 valid, 10 test collaborations (weights, years), 12
    negative edges for each of valid and test."""
    fixture, edges, rng = _common(root, "ogbl-collab", seed)
    fixture.weight = rng.integers(1, 4, 40).astype(np.int64)
    _write_csv(fixture.path / "raw" / "edge_weight.csv.gz", fixture.weight[:, None])
    _write_csv(fixture.path / "raw" / "edge_year.csv.gz", rng.integers(2000, 2018, (40, 1)))
    parts = {"train": edges[:, :40], "valid": edges[:, 40:50], "test": edges[:, 50:60]}
    splits = {}
    for stem, e in parts.items():
        d = {"edge": np.ascontiguousarray(e.T), "weight": rng.integers(1, 4, e.shape[1]).astype(np.int64),
             "year": rng.integers(2000, 2020, e.shape[1]).astype(np.int64)}
        if stem != "train":
            d["edge_neg"] = rng.integers(0, NUM_NODES, (12, 2)).astype(np.int64)
        splits[stem] = d
    _save(fixture, splits)
    return fixture
