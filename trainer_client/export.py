"""Every node's output of a trained model, out of the servers and onto disk
(``graphfeed-train --export-embeddings DIR``; ``docs/training.md``, "Exporting every
node's output").

The selected model's last layer (a node classifier's logits, a link predictor's
embeddings) is computed for every node by layer-wise inference
(:mod:`trainer_client.layerwise`), then rank 0 reads the last layer's tables in
original-ID order and writes, per node type, ``<type>/part-00000.npy`` ... (at most
:data:`SHARD_ROWS` rows each, plain ``.npy``: ``numpy.load(path, mmap_mode="r")``, no
pickle) and ``manifest.json`` (per type its shape, dtype and shards with their first row
and SHA-256; the graph, the model's configuration and the checkpoint it came from).
Everything is written into a temporary directory beside ``DIR`` and renamed into place
once whole, so a crash leaves no directory that looks complete; an earlier export in
``DIR`` is replaced the same way. ``--keep-embeddings NAME`` also keeps the last layer's
tables on the servers, as node tensors ``NAME/<type>``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from partitioner.npyio import sha256_file
from trainer_client.ddp import BEST_NAME, DistEnv
from trainer_client.evaluate import LayerwiseEvaluation
from trainer_client.graph import TypedGraph
from trainer_client.node_tensors import RemoteNodeTensor

log = logging.getLogger(__name__)

#: Rows per shard file.
SHARD_ROWS = 1 << 20
#: Rows read from the servers at a time.
READ_ROWS = 1 << 16
#: The manifest's name, and what it says it is.
MANIFEST = "manifest.json"
FORMAT = "graphfeed-node-outputs"


def check_directory(directory: Path) -> None:
    """Refuse an export directory that holds anything but an earlier export (checked
    before any work)."""
    if directory.exists() and (not directory.is_dir() or (any(directory.iterdir())
                                                          and not (directory / MANIFEST).is_file())):
        raise ValueError(f"--export-embeddings: expected a new or empty directory, or one holding an earlier "
                         f"export ({MANIFEST}), got {directory}, which holds other files")


def export_outputs(layerwise: LayerwiseEvaluation, model: nn.Module, node_types: Sequence[str],
                   args: argparse.Namespace, env: DistEnv, config: Mapping[str, Any]) -> None:
    """Every node's last-layer output of ``model`` for ``node_types`` into
    ``--export-embeddings`` (rank 0 writes; every rank takes part in the pass), kept on
    the servers too with ``--keep-embeddings``."""
    directory, keep = getattr(args, "export_embeddings", None), getattr(args, "keep_embeddings", None)
    if directory is None and keep is None:
        return
    with layerwise.outputs(model, keep=keep) as tables:
        if directory is not None and env.rank == 0:
            graph = layerwise.cluster.graph
            record = {"graph": graph.name, "graph_fingerprint": graph.fingerprint, "model": dict(config),
                      "checkpoint": _checkpoint(args)}
            write_outputs({t: tables[t] for t in node_types}, graph, Path(directory), record)
    if keep is not None and env.rank == 0:
        log.info("every node's output kept on the servers as node tensors %s",
                 [f"{keep}/{t}" for t in node_types])


def _checkpoint(args: argparse.Namespace) -> dict[str, Any] | None:
    """The checkpoint the selected model's weights are kept in (None: no --checkpoint-dir)."""
    best = args.checkpoint_dir / BEST_NAME if getattr(args, "checkpoint_dir", None) is not None else None
    if best is None or not best.exists():
        return None
    saved = torch.load(best, map_location="cpu", weights_only=True, mmap=True)
    return {"path": str(best.resolve()), "epoch": int(saved["epoch"])}


def write_outputs(tables: Mapping[str, RemoteNodeTensor], graph: TypedGraph, directory: Path,
                  record: Mapping[str, Any]) -> Path:
    """Write ``tables`` (by node type) as sharded ``.npy`` files and a manifest into
    ``directory``, atomically (see the module doc); the directory."""
    check_directory(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        types = {t: _write_type(table, graph.num_nodes[t], tmp, t) for t, table in tables.items()}
        manifest = {"format": FORMAT, "version": 1, "node_types": types, **record}
        with (tmp / MANIFEST).open("w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _into_place(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("every node's output written to %s: %s", directory,
             {t: v["shape"] for t, v in types.items()})
    return directory


def _write_type(table: RemoteNodeTensor, num_nodes: int, root: Path, node_type: str) -> dict[str, Any]:
    """One node type's shards (rows in original-ID order); what the manifest says of them."""
    (root / node_type).mkdir()
    shards = []
    for index, first in enumerate(range(0, max(num_nodes, 1), SHARD_ROWS)):
        count = min(SHARD_ROWS, num_nodes - first)
        name = f"{node_type}/part-{index:05d}.npy"
        if count == 0:  # a type without nodes: one empty shard
            np.save(root / name, np.zeros((0, *table.dims), np.float32), allow_pickle=False)
            shards.append({"file": name, "first_row": 0, "rows": 0, "sha256": sha256_file(root / name)})
            continue
        array = np.lib.format.open_memmap(root / name, mode="w+", dtype=np.float32,
                                          shape=(count, *table.dims))
        for a in range(0, count, READ_ROWS):
            b = min(count, a + READ_ROWS)
            rows = table.read(table.global_ids(np.arange(first + a, first + b, dtype=np.int64)))
            array[a:b] = rows.float().numpy()
        array.flush()
        del array
        with (root / name).open("rb+") as f:
            os.fsync(f.fileno())
        shards.append({"file": name, "first_row": first, "rows": count, "sha256": sha256_file(root / name)})
    return {"shape": [num_nodes, *table.dims], "dtype": "float32", "shards": shards}


def _into_place(tmp: Path, directory: Path) -> None:
    """Rename the finished ``tmp`` to ``directory``; an earlier export there is moved
    aside first and removed after."""
    old = None
    if directory.exists():
        old = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(directory, old)
    os.replace(tmp, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_outputs(directory: Path, node_type: str) -> np.ndarray:
    """One node type's exported rows, whole (for small graphs and tests; each shard reads
    with ``numpy.load(path, mmap_mode="r")`` on its own)."""
    manifest = json.loads((directory / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{directory / MANIFEST}: expected format {FORMAT!r}, got "
                         f"{manifest.get('format')!r}")
    shards = manifest["node_types"][node_type]["shards"]
    return np.concatenate([np.load(directory / s["file"], mmap_mode="r", allow_pickle=False) for s in shards])
