"""Read OGB's ogbn-mag as a typed graph from a local copy: no prompts, no downloads, no pickle.

The raw layout under ``<root>/ogbn_mag/`` (or the zip's own ``mag/``) is OGB's
(``ogb/io/read_graph_raw.py``, ``read_csv_heterograph_raw``)::

    raw/num-node-dict.csv.gz                       header of node types, one row of counts
    raw/triplet-type-list.csv.gz                   one (src, relation, dst) per row
    raw/relations/<src>___<rel>___<dst>/edge.csv.gz  one local (src, dst) pair per row
    raw/relations/<src>___<rel>___<dst>/num-edge-list.csv.gz
    raw/node-feat/paper/node-feat.csv.gz           128 floats per paper
    raw/nodetype-has-label.csv.gz, raw/node-label/paper/node-label.csv.gz
    split/time/nodetype-has-split.csv.gz, split/time/paper/{train,valid,test}.csv.gz

Every relation listed in ``triplet-type-list.csv.gz`` is read (ogbn-mag has four:
``author writes paper``, ``paper cites paper``, ``paper has_topic field_of_study``,
``author affiliated_with institution``); papers are the target type.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from partitioner.graph import EdgeType, GraphDataError
from partitioner.readers.ogb import (
    MAG_NODE_TYPE,
    _check_local_copy,
    _features_to_float32,
    _labels_to_int64,
    _locate_dataset_dir,
    _ogb_output_to_log,
    _raw_readers,
    _read_splits,
    ogb_metadata,
)
from partitioner.typed import TypedGraphData

log = logging.getLogger(__name__)


def read_ogb_hetero(name: str, root: str | Path) -> TypedGraphData:
    """Read the local copy of the heterogeneous OGB dataset ``name`` (ogbn-mag) under
    ``root`` with every node type and relation; papers carry features, labels and the
    ``time`` split (OGB's ``valid`` is graphfeed's ``val``).

    Raises :class:`~partitioner.readers.ogb.DatasetNotFoundError` naming the missing files
    when the local copy is incomplete, and :class:`GraphDataError` for a homogeneous
    dataset (read those with :func:`~partitioner.readers.ogb.read_ogb`).
    """
    meta = ogb_metadata(name)
    if not meta.is_hetero:
        raise GraphDataError(
            f"name: {meta.name} is homogeneous; read it with partitioner.readers.ogb.read_ogb"
        )
    root = Path(root)
    ds_dir = _locate_dataset_dir(meta, root)
    _check_local_copy(meta, root, ds_dir)
    raw_dir = ds_dir / "raw"
    _check_relation_files(raw_dir)
    start = time.perf_counter()
    readers = _raw_readers()
    with _ogb_output_to_log():
        raw = readers.read_csv_heterograph_raw(str(raw_dir), meta.add_inverse_edge)[0]
        labels = readers.read_node_label_hetero(str(raw_dir))
        splits = _read_splits(meta, ds_dir)
    counts = {str(t): int(n) for t, n in raw["num_nodes_dict"].items()}
    # The target type first: it comes first in the homogeneous view and in summaries.
    num_nodes = {MAG_NODE_TYPE: counts.pop(MAG_NODE_TYPE), **counts}
    edges: dict[EdgeType, np.ndarray] = {
        (str(s), str(r), str(d)): np.ascontiguousarray(ei, dtype=np.int64)
        for (s, r, d), ei in raw["edge_index_dict"].items()
    }
    x = {str(t): _features_to_float32(f, raw_dir / "node-feat" / str(t))
         for t, f in (raw["node_feat_dict"] or {}).items() if f is not None}
    if MAG_NODE_TYPE not in labels:
        raise GraphDataError(
            f"{raw_dir / 'nodetype-has-label.csv.gz'}: expected labels for node type "
            f"{MAG_NODE_TYPE!r}, got them for {sorted(labels)}"
        )
    label_file = raw_dir / "node-label" / MAG_NODE_TYPE / "node-label.csv.gz"
    graph = TypedGraphData(
        name=meta.name, num_nodes=num_nodes, edge_index=edges, x=x, target_type=MAG_NODE_TYPE,
        y=_labels_to_int64(labels[MAG_NODE_TYPE], num_nodes[MAG_NODE_TYPE], label_file),
        num_classes=meta.num_classes, splits=splits,
    )
    graph.validate()
    log.info("read %s (typed) from %s in %.1fs:\n%s", meta.name, ds_dir,
             time.perf_counter() - start, graph.summary())
    return graph


def _check_relation_files(raw_dir: Path) -> None:
    """Every relation the triplet list names must have its edge files (ogb would fail
    deep inside pandas otherwise)."""
    import pandas as pd

    triplets = pd.read_csv(raw_dir / "triplet-type-list.csv.gz", header=None).values
    missing = [
        raw_dir / "relations" / "___".join(map(str, t)) / stem
        for t in triplets for stem in ("edge.csv.gz", "num-edge-list.csv.gz")
        if not (raw_dir / "relations" / "___".join(map(str, t)) / stem).is_file()
    ]
    if missing:
        listing = "\n  ".join(str(p) for p in missing)
        raise GraphDataError(
            f"{raw_dir / 'triplet-type-list.csv.gz'} lists relations whose files are "
            f"missing:\n  {listing}"
        )
