"""``EpochRequest.links`` validated into a :class:`LinkJob`: the epoch's seed edges (a
stored link split, or edges the caller gave in original IDs), their negatives and what
is excluded from message passing. Every refusal is a
:class:`~sampling_server.errors.RequestError` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from partitioner.graph import EdgeType, edge_type_name
from partitioner.links import reverse_edge_type
from protos import codec
from protos import sampling_pb2 as pb
from sampling_server.errors import RequestError, printable
from sampling_server.fields import decode_node_ids
from sampling_server.sampler.links import BINARY, GIVEN, NO_NEGATIVES, TRIPLET, LinkOptions
from sampling_server.store import PartitionStore

_FIELD = "EpochRequest.links"
_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
_MODE_NAMES = {BINARY: "BINARY", TRIPLET: "TRIPLET", GIVEN: "GIVEN"}
#: Most negatives per positive edge a request may ask for.
MAX_NEGATIVES_PER_EDGE = 1000
#: Most seed edges a request may give (``EdgeList``: they travel in one message).
MAX_GIVEN_EDGES = 1 << 22


@dataclass(frozen=True)
class LinkJob:
    """A link epoch: its seed edges and how each batch of them is made."""

    options: LinkOptions
    #: int64 ``[E]`` global IDs of every seed edge's source and destination, in order.
    src: np.ndarray
    dst: np.ndarray
    #: ``[E, ...]`` labels (None: none), already shifted as PyG shifts them (see
    #: :func:`link_job`) when :attr:`shift_labels`.
    label: np.ndarray | None
    #: int64 ``[E, K]`` stored negative destinations (GIVEN), else None.
    given: np.ndarray | None
    #: The sampled edges dropped, as ``(edge type, swapped)``: a seed edge's copies of
    #: the seed edge type (EXCLUDE_SELF), and with EXCLUDE_REVERSE also its reverses, of
    #: the reverse type with the ends swapped (the seed type itself on a one-type graph).
    exclude: tuple[tuple[EdgeType, bool], ...] = ()
    #: Add 1 to the labels (BINARY negatives with labels that use 0: 0 marks negatives).
    shift_labels: bool = False

    @property
    def num_edges(self) -> int:
        return int(self.src.size)

    def seed_nodes_bound(self, batch_size: int) -> int:
        """Most seed nodes a batch of ``batch_size`` seed edges can have (both ends of its
        positive and negative edges), for the server's limits."""
        o = self.options
        per_edge = {BINARY: 2 * math.ceil(o.amount), TRIPLET: int(o.amount)}.get(o.mode, 0)
        if o.mode == GIVEN and self.given is not None:
            per_edge = int(self.given.shape[1])
        return batch_size * (2 + per_edge)

    def excluded_pairs(self, src: torch.Tensor, dst: torch.Tensor
                       ) -> dict[EdgeType, tuple[torch.Tensor, torch.Tensor]]:
        """Per edge type, the ``(source, destination)`` pairs of the sampled edges
        :func:`~sampling_server.sampler.links.exclude_edges` drops for a batch whose
        positive seed edges are ``src -> dst``."""
        pairs: dict[EdgeType, tuple[torch.Tensor, torch.Tensor]] = {}
        for et, swapped in self.exclude:
            a, b = (dst, src) if swapped else (src, dst)
            found = pairs.get(et)
            pairs[et] = (a, b) if found is None else (torch.cat([found[0], a]), torch.cat([found[1], b]))
        return pairs

    def labels_of(self, positions: np.ndarray) -> np.ndarray | None:
        if self.label is None:
            return None
        out = np.asarray(self.label[positions])
        return out + 1 if self.shift_labels else out


def link_job(links: pb.LinkSeeds, store: PartitionStore) -> LinkJob:
    """Validate ``EpochRequest.links`` against the graph."""
    m = store.manifest
    if store.typed and not links.edge_type:
        raise RequestError(f"{_FIELD}.edge_type: expected one of "
                           f"{[edge_type_name(et) for et in m.edge_types]} (the graph is typed), got none")
    et = store.edge_type_of(links.edge_type, f"{_FIELD}.edge_type")
    src, dst, label, given_negatives = _edges(links, store, et)
    negatives = links.negatives
    mode = int(negatives.mode)
    if mode not in (NO_NEGATIVES, BINARY, TRIPLET, GIVEN):
        raise RequestError(f"{_FIELD}.negatives.mode: expected BINARY, TRIPLET, GIVEN or none, got {mode}")
    amount = float(negatives.amount) or 1.0
    if not (math.isfinite(amount) and 0 < amount <= MAX_NEGATIVES_PER_EDGE):
        raise RequestError(f"{_FIELD}.negatives.amount: expected a number in (0, {MAX_NEGATIVES_PER_EDGE}], "
                           f"got {negatives.amount}")
    if mode == TRIPLET and amount != int(amount):
        raise RequestError(f"{_FIELD}.negatives.amount: expected a whole number of negatives per edge in "
                           f"TRIPLET mode, got {amount}")
    if mode in (TRIPLET, GIVEN) and label is not None:
        raise RequestError(f"{_FIELD}: expected no labels with {_MODE_NAMES[mode]} "
                           "negatives (PyG's triplet mode takes none)")
    if mode == GIVEN and given_negatives is None:
        raise RequestError(f"{_FIELD}.negatives.mode: GIVEN needs a link split stored with negatives "
                           "(LinkSplitInfo.num_negatives > 0)", _PRECONDITION)
    if mode != NO_NEGATIVES and negatives.strict and mode == GIVEN:
        raise RequestError(f"{_FIELD}.negatives.strict: expected false with GIVEN negatives (stored ones)")
    shift = mode == BINARY and label is not None and label.size > 0 and float(np.min(label)) == 0
    options = LinkOptions(et, mode, amount, bool(negatives.strict), m.node_types[et[0]].num_nodes,
                          m.node_types[et[2]].num_nodes)
    return LinkJob(options, src, dst, label, given_negatives if mode == GIVEN else None,
                   _exclusion(links, store, et), shift)


def _edges(links: pb.LinkSeeds, store: PartitionStore, et: EdgeType
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The seed edges (global IDs), their labels and stored negatives."""
    which = links.WhichOneof("edges")
    if which == "split":
        splits = store.link_splits
        name = links.split
        if name not in splits:
            raise RequestError(f"{_FIELD}.split: expected a link split of the graph {sorted(splits)} "
                               f"(ClusterInfo.link_splits), got {printable(name, 100)!r}",
                               _PRECONDITION if not splits else grpc.StatusCode.INVALID_ARGUMENT)
        info = splits[name]
        if info.edge_type != et:
            raise RequestError(f"{_FIELD}.edge_type: link split {name!r} holds edges of type "
                               f"{edge_type_name(info.edge_type)!r}, got {edge_type_name(et)!r}")
        arrays = store.link_split(name)
        if arrays.src.size == 0:
            raise RequestError(f"{_FIELD}.split: link split {name!r} has no edges")
        return arrays.src, arrays.dst, arrays.label, arrays.neg_dst
    if which != "given":
        raise RequestError(f"{_FIELD}.edges: expected a link split name or given edges, got neither")
    field = f"{_FIELD}.given"
    src_orig = decode_node_ids(links.given.src, f"{field}.src", "original node IDs")
    dst_orig = decode_node_ids(links.given.dst, f"{field}.dst", "original node IDs")
    if src_orig.size != dst_orig.size:
        raise RequestError(f"{field}.dst: expected {src_orig.size} IDs (as many as src), got {dst_orig.size}")
    if src_orig.size == 0:
        raise RequestError(f"{field}.src: expected at least one seed edge, got none")
    if src_orig.size > MAX_GIVEN_EDGES:
        raise RequestError(f"{field}.src: expected at most {MAX_GIVEN_EDGES} seed edges (use a stored "
                           f"link split for more), got {src_orig.size}")
    ends = []
    for name, ids, t in (("src", src_orig, et[0]), ("dst", dst_orig, et[2])):
        n = store.manifest.node_types[t].num_nodes
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= n:
            raise RequestError(f"{field}.{name}: expected original IDs of {t!r} nodes in [0, {n}), got "
                               f"values in [{lo}, {hi}]")
        ends.append(np.asarray(store.node_map(t)[ids], dtype=np.int64))
    label = None
    if links.given.HasField("label"):
        try:
            label = codec.decode_tensor(links.given.label)
        except codec.CodecError as exc:
            raise RequestError(f"{field}.label: {exc}") from exc
        if label.ndim < 1 or label.shape[0] != src_orig.size or label.dtype.kind not in "biuf":
            raise RequestError(f"{field}.label: expected numbers of shape [{src_orig.size}, ...] (one "
                               f"per seed edge), got {label.dtype} of shape {list(label.shape)}")
    return ends[0], ends[1], label, None


def _exclusion(links: pb.LinkSeeds, store: PartitionStore, et: EdgeType
               ) -> tuple[tuple[EdgeType, bool], ...]:
    """:attr:`LinkJob.exclude` of the request."""
    mode = int(links.exclude)
    if mode != pb.LinkSeeds.EXCLUDE_REVERSE and links.reverse_edge_type:
        raise RequestError(f"{_FIELD}.reverse_edge_type: expected none without exclude EXCLUDE_REVERSE")
    if mode == pb.LinkSeeds.EXCLUDE_NONE:
        return ()
    if mode == pb.LinkSeeds.EXCLUDE_SELF:
        return ((et, False),)
    if mode != pb.LinkSeeds.EXCLUDE_REVERSE:
        raise RequestError(f"{_FIELD}.exclude: expected EXCLUDE_NONE, EXCLUDE_SELF or EXCLUDE_REVERSE, "
                           f"got {mode}")
    field = f"{_FIELD}.reverse_edge_type"
    if links.reverse_edge_type:
        reverse = store.edge_type_of(links.reverse_edge_type, field)
        if (reverse[0], reverse[2]) != (et[2], et[0]):
            raise RequestError(f"{field}: expected an edge type from {et[2]!r} to {et[0]!r} (the reverse "
                               f"of {edge_type_name(et)!r}), got {edge_type_name(reverse)!r}")
        return (et, False), (reverse, True)
    named = reverse_edge_type(store.manifest.edge_types, et)
    if named is not None:
        return (et, False), (named, True)
    if et[0] == et[2]:
        return (et, False), (et, True)  # the reverse edges are of the seed type itself (an undirected graph)
    raise RequestError(f"{field}: expected the reverse edge type of {edge_type_name(et)!r} (the graph has "
                       f"none: no {edge_type_name((et[2], 'rev_' + et[1], et[0]))!r}), got none")
