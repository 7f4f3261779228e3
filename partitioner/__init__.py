"""Dataset readers, partition algorithms and the on-disk partition format (v1)."""

from partitioner.format import (
    FORMAT_VERSION,
    Manifest,
    Partition,
    PartitionFormatError,
    load_node_map,
    load_partition,
    read_manifest,
)
from partitioner.graph import SPLITS, GraphData, GraphDataError
from partitioner.partition import partition_graph

__all__ = [
    "FORMAT_VERSION",
    "SPLITS",
    "GraphData",
    "GraphDataError",
    "Manifest",
    "Partition",
    "PartitionFormatError",
    "load_node_map",
    "load_partition",
    "partition_graph",
    "read_manifest",
]
