"""Partition a graph end to end: assign nodes, then write format v1."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from partitioner.algorithms import assign
from partitioner.format import Manifest
from partitioner.graph import SPLITS, GraphData
from partitioner.writer import DEFAULT_EDGE_CHUNK, write_partitions

log = logging.getLogger(__name__)


def warn_empty_splits(graph: GraphData) -> list[str]:
    """Warn about every split the graph lacks or has empty (a trainer refuses to iterate
    it); returns their names."""
    empty = [s for s in SPLITS if graph.splits.get(s) is None or len(graph.splits[s]) == 0]
    for split in empty:
        log.warning("%s: the %r split is empty; graphfeed-train needs train and val nodes and a "
                    "loader refuses an empty split (give %s_idx or %s_mask, or OGB's valid_idx for val)",
                    graph.name, split, split, split)
    return empty


def partition_graph(
    graph: GraphData, num_parts: int, out_dir: str | Path, *, method: str = "metis",
    seed: int = 0, overwrite: bool = False, edge_chunk: int = DEFAULT_EDGE_CHUNK,
    progress: bool = True,
) -> Manifest:
    """Split ``graph`` into ``num_parts`` partitions with ``method`` and write them to
    ``out_dir``; returns the manifest (its ``algorithm`` records method, seed, time)."""
    warn_empty_splits(graph)
    started = time.perf_counter()
    part_of = assign(graph, num_parts, method, seed=seed, edge_chunk=edge_chunk,
                     progress=progress)
    assign_seconds = time.perf_counter() - started
    algorithm = {"method": method, "num_parts": num_parts, "seed": seed,
                 "assign_seconds": round(assign_seconds, 3)}
    return write_partitions(graph, part_of, out_dir, algorithm=algorithm, overwrite=overwrite,
                            edge_chunk=edge_chunk, progress=progress, started=started)
