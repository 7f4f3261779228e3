"""The trainer's table of every node's original ID and label.

A trainer with a feature cache is one that counts bytes per batch. Each batch would
otherwise carry the original IDs (``orig_id``) and labels (``y``) of its nodes: with
int32 IDs and int8 labels, 5 bytes per node, every batch. The table holds them once per
job instead (one per node type, :func:`trainer_client.fills.read_node_table`), and the
loader looks each batch's nodes up in it; the batch is the same, value for value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch
from torch_geometric.data import Data
from torch_geometric.data.storage import NodeStorage


class NodeTableError(ValueError):
    """A server's answer disagrees with the range asked for, or a batch names a node the
    graph does not have."""


@numba.njit(nogil=True, cache=True)
def _look_up(orig: np.ndarray, labels: np.ndarray, ids: np.ndarray, with_labels: bool,
             out_orig: np.ndarray, out_labels: np.ndarray) -> int:
    """``out_orig[i] = orig[ids[i]]`` and, ``with_labels``, ``out_labels[i] =
    labels[ids[i]]``, in one pass over ``ids``. Returns the first ``i`` whose ID is not a
    node of the table, or -1 (then the outputs are incomplete)."""
    n = orig.size
    for i in range(ids.size):
        v = ids[i]
        if v < 0 or v >= n:
            return i
        out_orig[i] = orig[v]
        if with_labels:
            out_labels[i] = labels[v]
    return -1


@dataclass(frozen=True)
class NodeTable:
    """Original ID and label of every node of one node type, by global ID (on the CPU)."""

    #: ``[N]`` original IDs (int32 when they fit, else int64).
    orig: torch.Tensor
    #: ``[N]`` labels, -1 = unlabeled (the smallest signed dtype that holds them).
    labels: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.orig.numel() * self.orig.element_size() + self.labels.numel() * self.labels.element_size()

    def complete(self, data: Data | NodeStorage, labels: bool) -> None:
        """Set a CPU batch's ``n_id`` (original IDs; graphfeed's own go to
        ``internal_n_id``) and, with ``labels``, its ``y`` (int64) from the table: those of
        the table's node type (``batch[node_type]`` of a typed batch)."""
        internal = data.n_id
        ids = internal.numpy()
        orig = np.empty(ids.size, dtype=np.int64)
        y = np.empty(ids.size if labels else 0, dtype=np.int64)
        # one thread: torch's pool would spin on the cores the model needs
        bad = _look_up(self.orig.numpy(), self.labels.numpy(), ids, labels, orig, y)
        if bad >= 0:
            raise NodeTableError(f"tensor 'n_id': expected node IDs in 0 .. {self.orig.numel() - 1} "
                                 f"(the graph's), got {int(ids[bad])} at position {bad}")
        data.internal_n_id, data.n_id = internal, torch.from_numpy(orig)
        if labels:
            data.y = torch.from_numpy(y)
