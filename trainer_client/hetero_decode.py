"""Decode the tensors of one typed batch (``docs/wire.md``: ``n_id/<type>``,
``edge_index/<src__rel__dst>``, ``x/<type>``, ``y/<target>``, ``orig_id/<type>``) into a
PyG ``HeteroData`` laid out as PyG's hetero ``NeighborLoader`` lays out its batches.

Every tensor and the header's typed counts are checked against each other and the
cluster's typed facts (:class:`TypedSpec`); anything malformed raises
:class:`~trainer_client.decode.BatchDecodeError` naming the tensor or field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch_geometric.data import HeteroData

from partitioner.graph import EdgeType, edge_type_name
from protos import sampling_pb2 as pb
from protos.compact import COUNT_DTYPES, INDEX_DTYPES, expand_edges, expand_typed_sources, widen
from trainer_client.decode import FEATURE_DTYPES, BatchDecodeError, BatchSpec, cached_mask

_LABEL_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8]


@dataclass(frozen=True)
class TypedSpec:
    """What every typed batch of one epoch stream must look like."""

    #: Node types, in the graph's order.
    node_types: tuple[str, ...]
    #: Edge types ``(src, rel, dst)``, in the graph's order.
    edge_types: tuple[EdgeType, ...]
    #: Feature columns per node type (0: no features, no ``x``).
    feature_dims: dict[str, int]
    #: The labelled node type.
    target_type: str
    #: The node type of the seeds.
    seed_type: str


def _error(message: str) -> BatchDecodeError:
    return BatchDecodeError(message)


def _counts(entries: Sequence[pb.TypedCounts], names: list[str], length: int | None,
            field: str, where: str) -> dict[str, list[int]]:
    """The header's typed counts by name: one entry per name, ``length`` counts each."""
    got = {c.name: [int(v) for v in c.counts] for c in entries}
    if sorted(got) != sorted(names) or len(entries) != len(names):
        raise _error(f"{where}: MinibatchHeader.{field}: expected one entry per type {names}, got "
                     f"{[c.name for c in entries]}")
    for name, counts in got.items():
        if (length is not None and len(counts) != length) or any(v < 0 for v in counts):
            raise _error(f"{where}: MinibatchHeader.{field}[{name!r}]: expected "
                         f"{length if length is not None else 'some'} counts >= 0, got {counts}")
    return got


def _tensor(tensors: dict[str, torch.Tensor], name: str, shape: Sequence[int],
            dtypes: Sequence[torch.dtype], where: str) -> torch.Tensor:
    if name not in tensors:
        raise _error(f"{where}: tensor {name!r}: expected it, got {sorted(tensors)[:20]}")
    t = tensors[name]
    if t.dtype not in dtypes:
        raise _error(f"{where}: tensor {name!r}: expected dtype "
                     f"{' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if list(t.shape) != list(shape):
        raise _error(f"{where}: tensor {name!r}: expected shape {list(shape)}, got {list(t.shape)}")
    return t


def _allowed(t: TypedSpec) -> set[str]:
    names = {f"{k}/{n}" for n in t.node_types for k in ("n_id", "orig_id")}
    names |= {f"{k}/{n}" for n in t.node_types if t.feature_dims.get(n, 0) > 0
              for k in ("x", "x_cached")}
    names |= {f"y/{t.target_type}"} | {f"{k}/{edge_type_name(e)}" for e in t.edge_types
                                       for k in ("edge_index", "edge_src", "edge_new", "edge_count")}
    return names


def build_hetero_data(header: pb.MinibatchHeader, tensors: dict[str, torch.Tensor],
                      spec: BatchSpec, index: int = 0) -> HeteroData:
    """Check a typed batch's header and tensors against ``spec``; build the HeteroData.

    Per node type: ``n_id`` (original IDs when the batch carries them; graphfeed's own
    then in ``internal_n_id``), ``num_nodes``, ``x`` (types with features; with
    ``x_cached/<type>`` only the rows the trainer's cache lacks, the mask in
    ``x_cached``), ``y`` (the target type); ``batch_size`` on the seed type. Per edge type ``edge_index``.
    ``num_sampled_nodes`` / ``num_sampled_edges`` are set per type as PyG sets them
    (``batch.num_sampled_nodes_dict``) and as dicts on the batch itself.
    """
    t = spec.typed
    assert t is not None
    where = f"batch {index}"
    unknown = sorted(set(tensors) - _allowed(t))
    if unknown:
        raise _error(f"{where}: tensor names: expected typed names such as 'n_id/{t.target_type}', "
                     f"got {unknown[:10]}")
    if spec.num_batches is not None and header.num_batches != spec.num_batches:
        raise _error(f"{where}: MinibatchHeader.num_batches: expected {spec.num_batches} (this "
                     f"rank's batches by the epoch plan), got {header.num_batches}")
    hops = spec.num_hops
    nodes = _counts(header.typed_sampled_nodes, list(t.node_types),
                    None if hops is None else hops + 1, "typed_sampled_nodes", where)
    edges = {e: _counts(header.typed_sampled_edges, [edge_type_name(x) for x in t.edge_types],
                        hops, "typed_sampled_edges", where)[edge_type_name(e)] for e in t.edge_types}
    for n, counts in nodes.items():
        want = header.num_seed_nodes if n == t.seed_type else 0
        why = "num_seed_nodes" if n == t.seed_type else f"the seeds are of type {t.seed_type!r}"
        if not counts or counts[0] != want:
            raise _error(f"{where}: MinibatchHeader.typed_sampled_nodes[{n!r}][0]: expected {want} "
                         f"({why}), got {counts[:1]}")
    data = HeteroData()
    for n in t.node_types:
        _node_store(data, n, sum(nodes[n]), tensors, spec, where)
    sources = _marked_sources(tensors, t, nodes, edges, where)
    for e in t.edge_types:
        name = f"edge_index/{edge_type_name(e)}"
        ei = widen(_tensor(tensors, name, [2, sum(edges[e])], INDEX_DTYPES, where)) \
            if name in tensors or f"edge_src/{edge_type_name(e)}" not in tensors else \
            _expanded(tensors, e, sum(edges[e]), sum(nodes[e[2]]) - nodes[e[2]][-1], where,
                      sources.get(e))
        if spec.check_edges and ei.numel():
            for row, n in ((0, e[0]), (1, e[2])):
                low, high = int(ei[row].min()), int(ei[row].max())
                if low < 0 or high >= data[n].num_nodes:
                    raise _error(f"{where}: tensor {name!r}: expected row {row} in 0 .. "
                                 f"{data[n].num_nodes - 1} (local {n!r} IDs), got {low} .. {high}")
        data[e].edge_index = ei
    data[t.seed_type].batch_size = int(header.num_seed_nodes)
    data.set_value_dict("num_sampled_nodes", nodes)
    data.set_value_dict("num_sampled_edges", edges)
    data.num_sampled_nodes = nodes
    data.num_sampled_edges = edges
    return data


def _marked_sources(tensors: dict[str, torch.Tensor], t: TypedSpec, nodes: dict[str, list[int]],
                    edges: dict[EdgeType, list[int]], where: str) -> dict[EdgeType, torch.Tensor]:
    """The int64 sources of the relations sent with ``edge_new/E`` (compact batches: per
    source type, every relation from it or none)."""
    out: dict[EdgeType, torch.Tensor] = {}
    for s in t.node_types:
        rels = [e for e in t.edge_types if e[0] == s]
        marked = [e for e in rels if f"edge_new/{edge_type_name(e)}" in tensors]
        if not marked:
            continue
        if marked != rels:
            raise _error(f"{where}: tensor names: expected 'edge_new/<relation>' for every relation "
                         f"from {s!r} ({[edge_type_name(e) for e in rels]}) or none, got it for "
                         f"{[edge_type_name(e) for e in marked]}")
        rest, bits = {}, {}
        for e in rels:
            key = edge_type_name(e)
            src = tensors.get(f"edge_src/{key}")
            if src is None or src.dim() != 1 or src.dtype not in INDEX_DTYPES:
                raise _error(f"{where}: tensor 'edge_src/{key}': expected a 1-d int32 or int64 "
                             f"tensor beside 'edge_new/{key}', got "
                             f"{None if src is None else (src.dtype, list(src.shape))}")
            rest[key], bits[key] = src, tensors[f"edge_new/{key}"]
        try:
            got = expand_typed_sources(rest, bits, {edge_type_name(e): edges[e] for e in rels},
                                       nodes[s][0], sum(nodes[s]))
        except ValueError as exc:
            raise _error(f"{where}: tensor {exc}") from exc
        out.update({e: got[edge_type_name(e)] for e in rels})
    return out


def _expanded(tensors: dict[str, torch.Tensor], e: EdgeType, num_edges: int, num_targets: int,
              where: str, sources: torch.Tensor | None = None) -> torch.Tensor:
    """A relation's int64 ``edge_index`` from its compact ``edge_src`` (or ``sources``,
    already expanded from ``edge_new``) and ``edge_count`` (``num_targets``: the
    destination type's nodes of every hop but the last)."""
    key = edge_type_name(e)
    src = sources if sources is not None else \
        _tensor(tensors, f"edge_src/{key}", [num_edges], INDEX_DTYPES, where)
    counts = _tensor(tensors, f"edge_count/{key}", [num_targets], list(COUNT_DTYPES), where)
    try:
        return expand_edges(widen(src), counts)
    except ValueError as exc:
        raise _error(f"{where}: tensor 'edge_count/{key}': {exc}") from exc


def _node_store(data: HeteroData, n: str, num: int, tensors: dict[str, torch.Tensor],
                spec: BatchSpec, where: str) -> None:
    """Fill ``data[n]`` from the batch's tensors of node type ``n``."""
    t = spec.typed
    assert t is not None
    n_id = widen(_tensor(tensors, f"n_id/{n}", [num], INDEX_DTYPES, where))
    data[n].num_nodes = num
    if f"orig_id/{n}" in tensors:  # users see original IDs; graphfeed's own stay on the side
        data[n].n_id = widen(_tensor(tensors, f"orig_id/{n}", [num], INDEX_DTYPES, where))
        data[n].internal_n_id = n_id
    else:
        data[n].n_id = n_id
    dim = t.feature_dims.get(n, 0)
    rows = num
    if f"x_cached/{n}" in tensors:  # the trainer's feature cache holds the marked rows
        cached = cached_mask(tensors, f"x_cached/{n}", num, where, bits=True)
        rows = num - int(torch.count_nonzero(cached))
        if f"x/{n}" not in tensors:
            raise _error(f"{where}: tensor 'x/{n}': expected the {rows} rows not marked in "
                         f"'x_cached/{n}', got none")
        data[n].x_cached = cached
    if dim and (spec.include_features or f"x/{n}" in tensors):
        data[n].x = _tensor(tensors, f"x/{n}", [rows, dim], FEATURE_DTYPES, where)
    if n == t.target_type and (spec.include_labels or f"y/{n}" in tensors):
        y = _tensor(tensors, f"y/{n}", [num], _LABEL_DTYPES, where)
        data[n].y = y if y.dtype == torch.int64 else y.long()
