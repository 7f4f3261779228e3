"""Dataset readers, partition algorithms and the on-disk partition format (one model for
plain and typed graphs: v1 files for a plain graph, v2 for a typed one)."""

from partitioner.format import (
    FORMAT_VERSION,
    TYPED_FORMAT_VERSION,
    EdgeData,
    Manifest,
    NodeData,
    Partition,
    PartitionFormatError,
    Structure,
    load_edge_data,
    load_node_data,
    load_node_map,
    load_partition,
    load_structure,
    read_format_version,
    read_manifest,
)
from partitioner.graph import (
    PLAIN_EDGE_TYPE,
    PLAIN_NODE_TYPE,
    SPLITS,
    EdgeType,
    GraphData,
    GraphDataError,
    TypedGraphData,
)
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
    "Manifest",
    "NodeData",
    "Partition",
    "PartitionFormatError",
    "Structure",
    "TypedGraphData",
    "load_edge_data",
    "load_node_data",
    "load_node_map",
    "load_partition",
    "load_structure",
    "partition_graph",
    "read_format_version",
    "read_manifest",
    "write_partitions",
]
