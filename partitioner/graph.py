"""The in-memory (or memory-mapped) graph that readers produce and partitioners consume."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: The split names every part of graphfeed uses, in this order.
SPLITS: tuple[str, ...] = ("train", "val", "test")

#: A relation: ``(source node type, relation name, destination node type)``.
EdgeType = tuple[str, str, str]

#: The one node type and the one edge type of a plain graph, which every layer below the
#: user's API handles as a typed graph (users never see these names: a plain graph's
#: files, wire tensors and batches name no type).
PLAIN_NODE_TYPE = "_N"
PLAIN_EDGE_TYPE: EdgeType = ("_N", "_E", "_N")


def edge_type_name(edge_type: EdgeType) -> str:
    """``src__rel__dst``: the edge type as one string (file names, manifest keys)."""
    return "__".join(edge_type)


def parse_edge_type(name: str) -> EdgeType:
    """Inverse of :func:`edge_type_name`."""
    parts = name.split("__")
    if len(parts) != 3 or not all(parts):
        raise GraphDataError(
            f"edge type: expected 'src__relation__dst' (three non-empty names), got {name!r}"
        )
    return parts[0], parts[1], parts[2]


def sorted_unique(keys: np.ndarray) -> np.ndarray:
    """Sorted distinct values (sort + mask; far faster than ``np.unique`` on large int64)."""
    s = np.sort(keys)
    if s.size == 0:
        return s
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


class GraphDataError(ValueError):
    """A source graph is malformed; the message names the field."""


def check_classes_and_splits(num_classes: int, splits: dict[str, np.ndarray]) -> None:
    """Raise :class:`GraphDataError` unless ``num_classes`` is positive and every split is
    a known name with a 1-D int64 ID array (typed and homogeneous graphs alike)."""
    if num_classes <= 0:
        raise GraphDataError(f"num_classes: expected a positive integer, got {num_classes}")
    for name, idx in splits.items():
        if name not in SPLITS:
            raise GraphDataError(f"splits: expected names among {SPLITS}, got {name!r}")
        if idx.ndim != 1 or idx.dtype != np.int64:
            raise GraphDataError(
                f"splits[{name!r}]: expected 1-D int64, got {idx.dtype} of shape {list(idx.shape)}"
            )


def labels_to_int64(raw: np.ndarray, field: str) -> np.ndarray:
    """1-D labels as int64: integers as they are; floats (as OGB stores papers100M's, and
    PyG's ``Data.y`` then holds them) NaN for unlabeled, which becomes ``-1``, and whole
    numbers otherwise. ``field`` names the array in errors."""
    if np.issubdtype(raw.dtype, np.integer):
        return raw.astype(np.int64, copy=False)
    if not np.issubdtype(raw.dtype, np.floating):
        raise GraphDataError(f"{field}: expected integer labels (-1 for unlabeled) or float "
                             f"labels (NaN for unlabeled), got {raw.dtype}")
    unlabeled = np.isnan(raw)
    with np.errstate(invalid="ignore"):  # infinities and overflows are refused just below
        out = np.where(unlabeled, -1, raw).astype(np.int64)
    if not np.array_equal(out[~unlabeled], raw[~unlabeled]):
        raise GraphDataError(f"{field}: expected whole-number labels (or NaN for unlabeled), got "
                             f"fractions, infinities or values past int64")
    return out


@dataclass
class GraphData:
    """A homogeneous node-classification graph before partitioning.

    Arrays may be ``np.memmap`` views of ``.npy`` files, so graphs larger than memory
    pass through the streaming partitioner without being loaded.
    """

    #: Name of the graph (dataset name or preset), recorded in the partition manifest.
    name: str
    #: Number of nodes ``N``; node IDs are ``0 .. N-1``.
    num_nodes: int
    #: ``[2, E]`` int64, row 0 the source and row 1 the target of each directed edge.
    edge_index: np.ndarray
    #: ``[N, F]`` node features (float32, float16 or float64).
    x: np.ndarray
    #: ``[N]`` int64 class labels; ``-1`` marks an unlabeled node.
    y: np.ndarray
    #: Number of classes (labels lie in ``0 .. num_classes-1``).
    num_classes: int
    #: Split name (``train``/``val``/``test``) to the int64 IDs of its nodes.
    splits: dict[str, np.ndarray] = field(default_factory=dict)
    #: Optional ``[E]`` float32 positive edge weights, aligned with ``edge_index``.
    edge_weight: np.ndarray | None = None

    @property
    def num_edges(self) -> int:
        return int(self.edge_index.shape[1])

    @property
    def feature_dim(self) -> int:
        return int(self.x.shape[1])

    def validate(self, check_values: bool = True) -> None:
        """Raise :class:`GraphDataError` naming the first malformed field.

        ``check_values`` also scans the arrays' values (ID ranges, labels), which reads
        every edge once.
        """
        n = self.num_nodes
        if n <= 0:
            raise GraphDataError(f"num_nodes: expected a positive integer, got {n}")
        ei = self.edge_index
        if ei.ndim != 2 or ei.shape[0] != 2:
            raise GraphDataError(f"edge_index: expected shape [2, E], got {list(ei.shape)}")
        if ei.dtype != np.int64:
            raise GraphDataError(f"edge_index: expected dtype int64, got {ei.dtype}")
        if self.x.ndim != 2 or self.x.shape[0] != n:
            raise GraphDataError(f"x: expected shape [{n}, F], got {list(self.x.shape)}")
        if self.x.dtype not in (np.float16, np.float32, np.float64):
            raise GraphDataError(f"x: expected a float dtype, got {self.x.dtype}")
        if self.y.shape != (n,) or self.y.dtype != np.int64:
            raise GraphDataError(
                f"y: expected int64 of shape [{n}], got {self.y.dtype} of shape {list(self.y.shape)}"
            )
        check_classes_and_splits(self.num_classes, self.splits)
        if self.edge_weight is not None:
            w = self.edge_weight
            if w.shape != (self.num_edges,) or w.dtype != np.float32:
                raise GraphDataError(
                    f"edge_weight: expected float32 of shape [{self.num_edges}], "
                    f"got {w.dtype} of shape {list(w.shape)}"
                )
        if check_values:
            self._validate_values()

    def _validate_values(self) -> None:
        n = self.num_nodes
        if self.num_edges:
            lo, hi = int(self.edge_index.min()), int(self.edge_index.max())
            if lo < 0 or hi >= n:
                raise GraphDataError(
                    f"edge_index: expected node IDs in [0, {n}), got values in [{lo}, {hi}]"
                )
        if n and (int(self.y.min()) < -1 or int(self.y.max()) >= self.num_classes):
            raise GraphDataError(
                f"y: expected labels in [-1, {self.num_classes}), "
                f"got values in [{int(self.y.min())}, {int(self.y.max())}]"
            )
        for name, idx in self.splits.items():
            if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
                raise GraphDataError(f"splits[{name!r}]: expected node IDs in [0, {n})")
            if sorted_unique(idx).size != idx.size:
                raise GraphDataError(f"splits[{name!r}]: node IDs repeat")
        if self.edge_weight is not None and self.num_edges and not bool((self.edge_weight > 0).all()):
            raise GraphDataError("edge_weight: expected positive weights")
