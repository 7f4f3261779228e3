"""Partition a graph end to end: assign nodes, then write format v1."""

from __future__ import annotations

import time
from pathlib import Path

from partitioner.algorithms import assign
from partitioner.format import Manifest
from partitioner.graph import GraphData
from partitioner.writer import DEFAULT_EDGE_CHUNK, write_partitions


def partition_graph(
    graph: GraphData, num_parts: int, out_dir: str | Path, *, method: str = "metis",
    seed: int = 0, overwrite: bool = False, edge_chunk: int = DEFAULT_EDGE_CHUNK,
    progress: bool = True,
) -> Manifest:
    """Split ``graph`` into ``num_parts`` partitions with ``method`` and write them to
    ``out_dir``; returns the manifest (its ``algorithm`` records method, seed, time)."""
    started = time.perf_counter()
    part_of = assign(graph, num_parts, method, seed=seed, edge_chunk=edge_chunk,
                     progress=progress)
    assign_seconds = time.perf_counter() - started
    algorithm = {"method": method, "num_parts": num_parts, "seed": seed,
                 "assign_seconds": round(assign_seconds, 3)}
    return write_partitions(graph, part_of, out_dir, algorithm=algorithm, overwrite=overwrite,
                            edge_chunk=edge_chunk, progress=progress, started=started)
