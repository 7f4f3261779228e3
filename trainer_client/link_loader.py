"""``RemoteLinkNeighborLoader``: PyG ``LinkNeighborLoader`` batches, sampled by graphfeed
servers.

Seed edges come from a link split stored with the partitions (``"train"``, ``"val"``,
``"test"``, ...: ``ClusterInfo.link_splits``) or from ``edge_label_index`` in original node
IDs. They are planned like the node loader's seeds (:mod:`protos.plan`: one global
ordering across partitions, shuffled per epoch with ``shuffle``, equal batch counts on
every rank, each seed edge in exactly one batch per epoch); the server that samples a
batch draws its negatives (keyed by the edges' original IDs and the batch key, so a
batch is the same whatever the partitioning and after a resume), samples the
neighborhood of the distinct ends of its edges, and drops the excluded edges.

::

    loader = RemoteLinkNeighborLoader(servers, "train", num_neighbors=[15, 10], batch_size=1024,
                                      neg_sampling="binary", shuffle=True, rank=rank,
                                      world_size=world_size, device="cuda:0")
    for batch in loader:   # Data: x, edge_index, edge_label_index, edge_label, n_id, input_id
        h = model(batch.x, batch.edge_index)
        score = (h[batch.edge_label_index[0]] * h[batch.edge_label_index[1]]).sum(-1)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from partitioner.graph import EdgeType, edge_type_name, parse_edge_type
from protos import sampling_pb2 as pb
from protos.codec import encode_tensor
from trainer_client import inputs
from trainer_client.batch_checks import LinkSpec
from trainer_client.cluster import Cluster
from trainer_client.loader import RemoteLoader

#: ``neg_sampling`` modes by name.
NEGATIVE_MODES = {"binary": pb.NegativeSampling.BINARY, "triplet": pb.NegativeSampling.TRIPLET,
                  "given": pb.NegativeSampling.GIVEN}
#: ``exclude`` options by name (DGL's names too).
EXCLUDE = {None: pb.LinkSeeds.EXCLUDE_NONE, "none": pb.LinkSeeds.EXCLUDE_NONE,
           "self": pb.LinkSeeds.EXCLUDE_SELF, "reverse": pb.LinkSeeds.EXCLUDE_REVERSE,
           "reverse_id": pb.LinkSeeds.EXCLUDE_REVERSE, "reverse_types": pb.LinkSeeds.EXCLUDE_REVERSE}


@dataclass(frozen=True)
class Negatives:
    """A loader's negative sampling: mode (``NegativeSampling.Mode``), negatives per
    positive edge, and whether those that are edges are redrawn."""

    mode: int = pb.NegativeSampling.NEGATIVES_NONE
    amount: float = 1.0
    strict: bool = False

    @property
    def triplet(self) -> bool:
        return self.mode in (pb.NegativeSampling.TRIPLET, pb.NegativeSampling.GIVEN)


def parse_negatives(neg_sampling: object, neg_sampling_ratio: float | None, strict: bool) -> Negatives:
    """``neg_sampling`` in PyG's forms (None, ``"binary"``, ``"triplet"``, ``"given"``, a
    ``NegativeSampling`` or a dict with ``mode`` and ``amount``); PyG's older
    ``neg_sampling_ratio`` means binary negatives of that amount."""
    if neg_sampling is None:
        if neg_sampling_ratio is None:
            if strict:
                raise ValueError("strict_negatives: expected False without neg_sampling (no negatives)")
            return Negatives()
        neg_sampling = {"mode": "binary", "amount": neg_sampling_ratio}
    elif neg_sampling_ratio is not None:
        raise ValueError("neg_sampling_ratio: expected None with neg_sampling (it is its older spelling)")
    if isinstance(neg_sampling, str):
        mode, amount, weight = neg_sampling, 1.0, None  # type: str | None, Any, object
    elif isinstance(neg_sampling, dict):
        unknown = set(neg_sampling) - {"mode", "amount"}
        if unknown:
            raise ValueError(f"neg_sampling: expected keys mode and amount, got {sorted(unknown)}")
        mode, amount, weight = neg_sampling.get("mode"), neg_sampling.get("amount", 1.0), None
    elif hasattr(neg_sampling, "mode") and hasattr(neg_sampling, "amount"):  # PyG's NegativeSampling
        mode = getattr(neg_sampling.mode, "value", neg_sampling.mode)
        amount = neg_sampling.amount
        weights = [getattr(neg_sampling, w, None) for w in ("weight", "src_weight", "dst_weight")]
        weight = next((w for w in weights if w is not None), None)
    else:
        raise ValueError(f"neg_sampling: expected None, 'binary', 'triplet', 'given', a NegativeSampling or "
                         f"a dict, got {type(neg_sampling).__name__}")
    if weight is not None:
        raise ValueError("neg_sampling.weight: not supported (negatives are drawn uniformly over the "
                         "destination type, as without weights)")
    if mode not in NEGATIVE_MODES:
        raise ValueError(f"neg_sampling: expected mode one of {sorted(NEGATIVE_MODES)}, got {mode!r}")
    try:
        amount = float(amount)
    except (TypeError, ValueError):
        raise ValueError(f"neg_sampling.amount: expected a number > 0, got {amount!r}") from None
    if not amount > 0:
        raise ValueError(f"neg_sampling.amount: expected a number > 0, got {amount}")
    if mode == "triplet" and amount != int(amount):
        raise ValueError(f"neg_sampling.amount: expected a whole number of negatives per edge in triplet "
                         f"mode, got {amount}")
    if mode == "given" and strict:
        raise ValueError("strict_negatives: expected False with 'given' negatives (they are stored)")
    return Negatives(NEGATIVE_MODES[mode], amount, bool(strict))


class RemoteLinkNeighborLoader(RemoteLoader):
    """Yields PyG ``LinkNeighborLoader`` minibatches of one rank's epoch, sampled by
    graphfeed servers.

    Each batch has the node loader's attributes (``x``, ``edge_index``, ``n_id`` in
    original IDs, ``num_sampled_nodes`` ...) for the neighborhood of the distinct ends of
    its seed edges (the batch's first nodes, in order of first appearance), and, as
    PyG's ``LinkNeighborLoader`` gives them: ``edge_label_index`` (local indices into the
    batch's nodes; the positives, then binary negatives) and ``edge_label`` (the labels
    given or stored, ones when none, zeros for negatives), or with ``"triplet"`` /
    ``"given"`` negatives ``src_index``, ``dst_pos_index`` and ``dst_neg_index``
    ``[P, K]``; ``input_id``: the positions of the positive seed edges in the split (or
    in ``edge_label_index`` as given). On a typed graph ``HeteroData``:
    ``batch[edge_type].edge_label_index`` / ``edge_label`` / ``input_id``,
    ``batch[src_type].src_index``, ``batch[dst_type].dst_pos_index`` / ``dst_neg_index``.
    """

    def __init__(
        self, servers: Sequence[str] | str | Cluster, split: str | None = None, *,
        edge_label_index: object = None, edge_label: object = None, edge_type: EdgeType | str | None = None,
        neg_sampling: object = None, neg_sampling_ratio: float | None = None, strict_negatives: bool = False,
        exclude: str | None = None, reverse_edge_type: EdgeType | str | None = None, **options: Any,
    ) -> None:
        """``split``: a stored link split (``"valid"`` is taken for ``"val"``; default
        ``"train"`` unless ``edge_label_index`` is given); ``edge_label_index``: seed edges
        ``[2, M]`` in original node IDs (typed: ``(edge_type, [2, M])`` as PyG, or with
        ``edge_type=``), ``edge_label`` their labels. ``neg_sampling``: ``"binary"``
        (``amount`` random pairs per positive, labelled 0), ``"triplet"`` (``amount``
        random destinations per positive), ``"given"`` (the split's stored negatives:
        OGB's ranking protocol), a PyG ``NegativeSampling`` or a dict; negatives are
        uniform over the destination (and, binary, source) type's nodes as PyG draws them,
        or, with ``strict_negatives``, redrawn while they are edges of the graph.
        ``exclude``: ``"self"`` drops each batch's positive seed edges from its sampled
        edges, ``"reverse"`` their reverses too (``reverse_edge_type``, default the
        ``rev_`` type, a ``rev_`` type's forward type, or the seed type itself on a
        one-type graph); PyG keeps them.
        Labels that use 0 are shifted by one with binary negatives, as PyG shifts them.
        The other arguments are :class:`~trainer_client.loader.RemoteLoader`'s
        (``batch_size`` counts positive seed edges)."""
        if isinstance(edge_label_index, tuple) and len(edge_label_index) == 2 and \
                isinstance(edge_label_index[0], (str, tuple)):
            if edge_type is not None:
                raise ValueError("edge_type: expected None when edge_label_index names the edge type")
            edge_type, edge_label_index = edge_label_index
        if split is not None and edge_label_index is not None:
            raise ValueError("split, edge_label_index: expected one of them")
        #: The link split iterated (None: the given seed edges, :attr:`edge_label_index`).
        self.split = None if edge_label_index is not None else \
            "train" if split is None else "val" if split == "valid" else split
        self.negatives = parse_negatives(neg_sampling, neg_sampling_ratio, strict_negatives)
        if exclude not in EXCLUDE:
            raise ValueError(f"exclude: expected one of {[k for k in EXCLUDE if k]} or None, got {exclude!r}")
        self.exclude = exclude
        self._link_given = (edge_label_index, edge_label)
        self._link_type_arg, self._reverse_arg = edge_type, reverse_edge_type
        super().__init__(servers, **options)

    # ---- seed edges ------------------------------------------------------------------

    def _open_seeds(self) -> None:
        """The seed edges' type (its source type stands for the seeds' in the batches'
        layout; typed batches hold ``input_id`` on it), the request's seed edges and the
        batches' link layout."""
        self.edge_type = self._input_key = self._resolve_edge_type()
        self._seeds_of = self.edge_type[0]
        self._links, labelled, stored_negatives = self._link_seeds()
        negatives = self.negatives
        per_edge = int(negatives.amount) if negatives.mode == pb.NegativeSampling.TRIPLET else \
            stored_negatives if negatives.mode == pb.NegativeSampling.GIVEN else None
        labels = (negatives.mode == pb.NegativeSampling.BINARY or labelled) and not negatives.triplet
        self._link_layout = LinkSpec(self.edge_type, negatives.triplet, labels, per_edge)

    def _resolve_edge_type(self) -> EdgeType:
        graph = self.graph
        named = self._link_type_arg
        et: EdgeType | None = None if named is None else \
            parse_edge_type(named) if isinstance(named, str) else tuple(named)  # type: ignore[assignment]
        if et is not None:
            if not graph.typed:
                raise ValueError("edge_type: expected None, the graph is homogeneous (plain)")
            if et not in graph.edge_types:
                known = [edge_type_name(e) for e in graph.edge_types]
                raise ValueError(f"edge_type: expected one of {known}, got {named!r}")
        if self.split is not None:
            facts = graph.link_splits.get(self.split)
            if facts is None:
                raise ValueError(f"split: expected a link split of the graph {sorted(graph.link_splits)} "
                                 f"(partition with link splits: --link-split), got {self.split!r}")
            if et is not None and et != facts.edge_type:
                raise ValueError(f"edge_type: link split {self.split!r} holds "
                                 f"{edge_type_name(facts.edge_type)!r} edges, got {edge_type_name(et)!r}")
            return facts.edge_type
        if et is None:
            if graph.typed and len(graph.edge_types) > 1:
                raise ValueError("edge_label_index: expected (edge_type, edge_label_index) on a typed graph "
                                 "with several edge types (or pass edge_type=)")
            et = graph.edge_types[0]
        return et

    def _link_seeds(self) -> tuple[pb.LinkSeeds, bool, int]:
        """The request's ``links`` (its seed edges and options), whether the seed edges
        have labels and how many negatives each has stored; counts the seed edges."""
        et = self.edge_type
        links = pb.LinkSeeds(edge_type=edge_type_name(et) if self.graph.typed else "",
                             negatives=pb.NegativeSampling(mode=self.negatives.mode,  # type: ignore[arg-type]
                                                           amount=self.negatives.amount,
                                                           strict=self.negatives.strict),
                             exclude=EXCLUDE[self.exclude])
        if self._reverse_arg is not None:
            rev = self._reverse_arg
            links.reverse_edge_type = rev if isinstance(rev, str) else edge_type_name(rev)
        index, label = self._link_given
        self._input_edges: np.ndarray | None = None  # the given seed edges
        if self.split is not None:
            facts = self.graph.link_splits[self.split]
            links.split = self.split
            self._num_edges = int(facts.num_edges)
            if self.negatives.mode == pb.NegativeSampling.GIVEN and not facts.num_negatives:
                raise ValueError(f"neg_sampling: 'given' needs a split stored with negatives; "
                                 f"{self.split!r} has none")
            if self.negatives.triplet and facts.label_dtype is not None:
                raise ValueError(f"neg_sampling: triplet negatives take no labels, but split {self.split!r} "
                                 "has them")
            return links, facts.label_dtype is not None, int(facts.num_negatives)
        if self.negatives.mode == pb.NegativeSampling.GIVEN:
            raise ValueError("neg_sampling: 'given' needs split= (negatives stored with a link split)")
        pairs = index if isinstance(index, np.ndarray) else torch.as_tensor(index).cpu().numpy()
        if pairs.ndim != 2 or pairs.shape[0] != 2 or pairs.dtype.kind not in "iu":
            raise ValueError(f"edge_label_index: expected integer node IDs of shape [2, M], got "
                             f"{pairs.dtype} of shape {list(pairs.shape)}")
        src, dst = (self._end_ids(pairs[row], et[end], f"edge_label_index[{row}]")
                    for row, end in ((0, 0), (1, 2)))
        links.given.src.CopyFrom(encode_tensor(src))
        links.given.dst.CopyFrom(encode_tensor(dst))
        if label is not None:
            labels = np.ascontiguousarray(torch.as_tensor(label).cpu().numpy())
            if labels.ndim < 1 or labels.shape[0] != src.size:
                raise ValueError(f"edge_label: expected one label per seed edge ({src.size}), got shape "
                                 f"{list(labels.shape)}")
            if self.negatives.triplet:
                raise ValueError("edge_label: expected None with triplet negatives (as PyG)")
            links.given.label.CopyFrom(encode_tensor(labels))
        self._num_edges = int(src.size)
        self._input_edges = np.stack([src, dst])
        return links, label is not None, 0

    def _end_ids(self, ids: np.ndarray, node_type: str, name: str) -> np.ndarray:
        """Checked original IDs of one end of the given seed edges (repeats allowed)."""
        n = self.graph.num_nodes[node_type]
        out = ids.astype(np.int64, copy=False)
        bad = out[(out < 0) | (out >= n)]
        if bad.size:
            raise ValueError(f"{name}: expected original IDs of {node_type!r} nodes in 0 .. {n - 1}, got "
                             f"{bad[:5].tolist()}")
        if out.size == 0:
            raise ValueError(f"{name}: expected at least one seed edge, got none")
        if out.size > inputs.MAX_SEEDS:
            raise ValueError(f"{name}: expected at most {inputs.MAX_SEEDS} seed edges (one message; use a "
                             f"stored link split for more), got {out.size}")
        return out

    @property
    def num_seeds(self) -> int:
        """Seed edges of one epoch, over all ranks."""
        return self._num_edges

    @property
    def edge_label_index(self) -> torch.Tensor | None:
        """The given seed edges (original IDs) that ``input_id`` indexes; None for a split."""
        return None if self._input_edges is None else torch.from_numpy(self._input_edges)

    def _put_seeds(self, request: pb.EpochRequest) -> None:
        request.links.CopyFrom(self._links)
