"""The trainer's table of every node's original ID and label.

A trainer with a feature cache is one that counts bytes per batch. Each batch would
otherwise carry the original IDs (``orig_id``) and labels (``y``) of its nodes: with
int32 IDs and int8 labels, 5 bytes per node, every batch. The table holds them once per
job instead (5 bytes per node of the graph for most graphs, read with
``LookupNodes(owned_range=...)`` in blocks), and the loader looks each batch's nodes up
in it; the batch is the same, value for value.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numba
import numpy as np
import torch
from torch_geometric.data import Data
from torch_geometric.data.storage import NodeStorage

from protos import compact
from protos import sampling_pb2 as pb
from protos.channel import GraphfeedError
from protos.codec import decode_tensor
from trainer_client.cache import type_facts

if TYPE_CHECKING:
    from trainer_client.cluster import Cluster

log = logging.getLogger(__name__)

#: Nodes per LookupNodes call (the servers' limit, 16 bytes each in the reply).
BLOCK = 1 << 21


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
    """Original ID and label of every node, by global ID (on the CPU)."""

    #: ``[N]`` original IDs (int32 when they fit, else int64).
    orig: torch.Tensor
    #: ``[N]`` labels, -1 = unlabeled (the smallest signed dtype that holds them).
    labels: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.orig.numel() * self.orig.element_size() + self.labels.numel() * self.labels.element_size()

    @classmethod
    def read(cls, cluster: Cluster, node_type: str | None = None) -> NodeTable | None:
        """Read the table from every server (of ``node_type``'s nodes on a typed graph:
        its global IDs, and labels -1 but for the target type); None when a server does
        not answer ``owned_range`` (a server from before it)."""
        book = [int(b) for b in (cluster.partition_book if node_type is None else
                                 type_facts(cluster.info, node_type)[0])]
        orig = np.empty(book[-1], dtype=np.int64)
        labels = np.empty(book[-1], dtype=np.int64)
        for p in range(len(book) - 1):
            for first in range(book[p], book[p + 1], BLOCK):
                count = min(BLOCK, book[p + 1] - first)
                request = pb.LookupNodesRequest(owned_range=pb.NodeRange(first=first, count=count),
                                                node_type=node_type or "")
                try:
                    reply = cluster.lookup(p, request)
                except GraphfeedError as exc:
                    if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                        log.info("node table: %s; batches carry their original IDs and labels", exc)
                        return None
                    raise
                o, y = decode_tensor(reply.original_ids), decode_tensor(reply.labels)
                if o.shape != (count,) or y.shape != (count,):
                    raise NodeTableError(
                        f"LookupNodes(owned_range) at {cluster.addresses[p]}: expected original_ids "
                        f"and labels of shape [{count}], got {list(o.shape)} and {list(y.shape)}")
                orig[first:first + count] = o
                labels[first:first + count] = y
        table = cls(compact.narrowest(torch.from_numpy(orig), compact.INDEX_DTYPES),
                    compact.narrowest(torch.from_numpy(labels), compact.LABEL_DTYPES))
        log.info("node table: original IDs and labels of %d %s, %.1f MiB", book[-1],
                 "nodes" if node_type is None else f"{node_type!r} nodes", table.nbytes / 2**20)
        return table

    def complete(self, data: Data | NodeStorage, labels: bool) -> None:
        """Set a CPU batch's ``n_id`` (original IDs; graphfeed's own go to
        ``internal_n_id``) and, with ``labels``, its ``y`` (int64) from the table; on a
        typed graph, those of one node type's store (``batch[node_type]``)."""
        internal = data.n_id
        ids = internal.numpy()
        orig = np.empty(ids.size, dtype=np.int64)
        y = np.empty(ids.size if labels else 0, dtype=np.int64)
        # one thread: torch's pool would spin on the cores the model needs
        bad = _look_up(self.orig.numpy(), self.labels.numpy(), ids, labels, orig, y)
        if bad >= 0:
            raise NodeTableError(f"tensor 'n_id': expected node IDs in 0 .. {self.orig.numel() - 1} "
                                 f"(the graph's), got {int(ids[bad])} at position {bad}")
        data.internal_n_id = internal
        data.n_id = torch.from_numpy(orig)
        if labels:
            data.y = torch.from_numpy(y)
