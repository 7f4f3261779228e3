"""Dataset readers, partition algorithms and the on-disk partition formats (v1 homogeneous,
v2 typed)."""

from partitioner.format import (
    FORMAT_VERSION,
    Manifest,
    NodeData,
    Partition,
    PartitionFormatError,
    Structure,
    load_node_data,
    load_node_map,
    load_partition,
    load_structure,
    read_manifest,
)
from partitioner.graph import SPLITS, GraphData, GraphDataError
from partitioner.hetero import EdgeType, HeteroGraphData
from partitioner.hetero_format import (
    HeteroManifest,
    HeteroPartition,
    load_hetero_node_map,
    load_hetero_partition,
    read_format_version,
    read_hetero_manifest,
)
from partitioner.hetero_writer import partition_hetero_graph
from partitioner.partition import partition_graph

__all__ = [
    "FORMAT_VERSION",
    "SPLITS",
    "EdgeType",
    "GraphData",
    "GraphDataError",
    "HeteroGraphData",
    "HeteroManifest",
    "HeteroPartition",
    "Manifest",
    "NodeData",
    "Partition",
    "PartitionFormatError",
    "Structure",
    "load_hetero_node_map",
    "load_hetero_partition",
    "load_node_data",
    "load_node_map",
    "load_partition",
    "load_structure",
    "partition_graph",
    "partition_hetero_graph",
    "read_format_version",
    "read_hetero_manifest",
    "read_manifest",
]
