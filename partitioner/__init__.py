"""Dataset readers, partition algorithms and the on-disk partition format (one model for
plain and typed graphs: v1 files for a plain graph, v2 for a typed one)."""

from partitioner.format import load_node_map, load_partition
from partitioner.graph import (
    PLAIN_EDGE_TYPE,
    PLAIN_NODE_TYPE,
    SPLITS,
    EdgeType,
    GraphData,
    GraphDataError,
    LinkSplit,
    TypedGraphData,
)
from partitioner.joins import load_edge_data, load_node_data, load_structure
from partitioner.links import LinkSplitArrays, LinkSplitInfo, load_link_split, random_link_split
from partitioner.manifest import (
    FORMAT_VERSION,
    TYPED_FORMAT_VERSION,
    Manifest,
    PartitionFormatError,
    read_format_version,
    read_manifest,
)
from partitioner.partition import EdgeData, NodeData, Partition, Structure
from partitioner.writer import partition_graph, write_partitions

__all__ = [
    "FORMAT_VERSION",
    "PLAIN_EDGE_TYPE",
    "PLAIN_NODE_TYPE",
    "SPLITS",
    "TYPED_FORMAT_VERSION",
    "EdgeData",
    "EdgeType",
    "GraphData",
    "GraphDataError",
    "LinkSplit",
    "LinkSplitArrays",
    "LinkSplitInfo",
    "Manifest",
    "NodeData",
    "Partition",
    "PartitionFormatError",
    "Structure",
    "TypedGraphData",
    "load_edge_data",
    "load_link_split",
    "load_node_data",
    "load_node_map",
    "load_partition",
    "load_structure",
    "partition_graph",
    "random_link_split",
    "read_format_version",
    "read_manifest",
    "write_partitions",
]
