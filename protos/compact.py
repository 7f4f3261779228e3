"""The compact structure of a batch (``EpochRequest.compact_indices``).

A trainer that sets ``compact_indices`` receives a batch's index and label tensors in the
narrowest integer dtype that holds their values, and ``edge_index`` as its sources plus
the number of edges sampled per target node (the targets of a batch are its frontier
nodes in ``n_id`` order, so row 1 of ``edge_index`` is determined by those counts).
the server builds the tensors (:func:`sampling_server.produce.structure_tensors`); :func:`expand_edges`,
:func:`widen` and :func:`unpack_mask` give the trainer back exactly the tensors of the
non-compact form (int64 ``edge_index``, ``n_id``, ``orig_id`` and ``y``, a bool mask).
The layout is documented in ``docs/wire.md`` ("Compact structure").

The trainer's side runs in NumPy, on the stream's reader thread: torch's CPU kernels
would wake its intra-op thread pool for each of these passes, and those threads spin at
their barriers (OpenMP's default wait policy), taking the cores from the stream itself
(measured: a third of a trainer process's CPU time).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numba
import numpy as np
import torch

__all__ = [
    "COUNT_DTYPES",
    "INDEX_DTYPES",
    "LABEL_DTYPES",
    "edges_per_target",
    "expand_edges",
    "expand_sources",
    "narrowest",
    "pack_mask",
    "unpack_mask",
    "widen",
]

#: Dtypes of "n_id", "orig_id" and "edge_src", narrowest first.
INDEX_DTYPES = (torch.int32, torch.int64)
#: Dtypes of "y" (signed: -1 marks unlabeled nodes), narrowest first.
LABEL_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
#: Dtypes of "edge_count", narrowest first.
COUNT_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


def narrowest(t: torch.Tensor, dtypes: Sequence[torch.dtype]) -> torch.Tensor:
    """``t`` in the first of ``dtypes`` that holds every value of it (the last otherwise)."""
    if t.numel() == 0:
        return t.to(dtypes[0])
    low, high = int(t.min()), int(t.max())
    for dtype in dtypes:
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return t.to(dtype)
    return t.to(dtypes[-1])


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool ``[N]`` mask as uint8 ``[ceil(N / 8)]`` bits, node ``i`` in bit ``i % 8``
    (least significant first) of byte ``i // 8``."""
    bits = np.packbits(mask.cpu().numpy().astype(bool, copy=False), bitorder="little")
    return torch.from_numpy(bits)


def _check_bits(bits: torch.Tensor, num: int) -> None:
    """Raise unless ``bits`` is :func:`pack_mask`'s uint8 ``[ceil(num / 8)]``."""
    want = (num + 7) // 8
    if bits.dtype != torch.uint8 or list(bits.shape) != [want]:
        raise ValueError(f"expected uint8 of shape [{want}] (the bits of {num} nodes), got "
                         f"{bits.dtype} of shape {list(bits.shape)}")


def unpack_mask(bits: torch.Tensor, num: int) -> torch.Tensor:
    """The bool ``[num]`` mask of :func:`pack_mask`'s bits (raises when the size is wrong)."""
    _check_bits(bits, num)
    mask = np.unpackbits(bits.numpy(), count=num, bitorder="little").view(np.bool_)
    return torch.from_numpy(mask)


def edges_per_target(col: torch.Tensor, num_targets: int) -> torch.Tensor | None:
    """"edge_count": the edges per target (the narrowest of :data:`COUNT_DTYPES`) when
    ``col`` (on the CPU) lists targets ``0 .. num_targets-1`` in order, as the samplers
    produce them; None otherwise."""
    ordered = col.numel() == 0 or (bool((col[1:] >= col[:-1]).all()) and int(col[0]) >= 0
                                   and int(col[-1]) < num_targets)
    if not ordered:
        return None
    counts = torch.bincount(col, minlength=num_targets) if col.numel() \
        else torch.zeros(num_targets, dtype=torch.int64)
    return narrowest(counts, COUNT_DTYPES)


@numba.njit(nogil=True, cache=True)
def _split_sources(src: np.ndarray, num_seeds: int, num_nodes: int, rest: np.ndarray,
                   bits: np.ndarray) -> int:
    """One pass of :func:`_sources`: edge ``i`` is new when its source is above every
    earlier one (and above the seeds); the new edges get their bit set in ``bits``
    (zeroed, ``[ceil(E / 8)]``), the others' sources go to ``rest`` in order. Returns how
    many went to ``rest``, or -1 unless the new edges' sources are exactly
    ``num_seeds, num_seeds + 1, ..., num_nodes - 1`` (then ``rest`` and ``bits`` are
    incomplete)."""
    best = num_seeds - 1
    k = 0
    for i in range(src.size):
        v = src[i]
        if v > best:
            if v != best + 1:
                return -1
            best = v
            bits[i >> 3] |= np.uint8(1 << (i & 7))
        else:
            rest[k] = v
            k += 1
    return k if best == num_nodes - 1 else -1


def _sources(row: torch.Tensor, num_seeds: int, num_nodes: int) -> dict[str, torch.Tensor]:
    """"edge_src", and "edge_new" when every non-seed node is numbered by the edge that
    first reaches it (as the samplers number them): then "edge_src" holds only the other
    edges' sources."""
    src = np.ascontiguousarray(row.numpy(), dtype=np.int64)
    rest = np.empty(src.size, dtype=np.int64)
    bits = np.zeros((src.size + 7) // 8, dtype=np.uint8)
    kept = _split_sources(src, num_seeds, num_nodes, rest, bits)
    if kept >= 0:
        return {"edge_src": narrowest(torch.from_numpy(rest[:kept]), INDEX_DTYPES),
                "edge_new": torch.from_numpy(bits)}
    return {"edge_src": narrowest(row, INDEX_DTYPES)}


def expand_sources(src: torch.Tensor, new_bits: torch.Tensor, num_edges: int,
                   num_seeds: int) -> torch.Tensor:
    """int64 ``[num_edges]`` sources from "edge_src" (the other edges' sources) and
    "edge_new" (bit ``i``: edge ``i`` reaches node ``num_seeds + (set bits before i)``),
    in one pass."""
    _check_bits(new_bits, num_edges)
    bits = new_bits.numpy()
    out = np.empty(num_edges, dtype=np.int64)
    rest = np.ascontiguousarray(src.numpy())
    if _expand_sources(bits, rest, num_seeds, out) != rest.size:
        num_new = int(np.unpackbits(bits, count=num_edges, bitorder="little").sum())
        raise ValueError(f"expected {num_edges - num_new} entries in edge_src (the edges not marked "
                         f"in edge_new), got {src.numel()}")
    return torch.from_numpy(out)


@numba.njit(nogil=True, cache=True)
def _expand_sources(bits: np.ndarray, rest: np.ndarray, num_seeds: int, out: np.ndarray) -> int:
    """Fill ``out`` as :func:`expand_sources` describes; the entries of ``rest`` taken
    (``rest.size + 1`` when it holds too few)."""
    k, nxt = 0, num_seeds
    for i in range(out.size):
        if (bits[i >> 3] >> (i & 7)) & 1:
            out[i] = nxt
            nxt += 1
        elif k < rest.size:
            out[i] = rest[k]
            k += 1
        else:
            return rest.size + 1
    return k


def _segments(num_edges: Mapping[str, Sequence[int]], relations: Sequence[str]
              ) -> list[tuple[str, int, int]]:
    """``(relation, start, stop)`` of each relation's edges hop by hop, in the order a typed
    sampler numbers the new nodes: hop after hop, the relations in the given order."""
    starts = {r: np.concatenate([[0], np.cumsum(num_edges[r])]).astype(np.int64) for r in relations}
    hops = max((len(num_edges[r]) for r in relations), default=0)
    return [(r, int(starts[r][h]), int(starts[r][h + 1])) for h in range(hops) for r in relations]


def split_typed_sources(rows: Mapping[str, torch.Tensor], num_edges: Mapping[str, Sequence[int]],
                        num_seeds: int, num_nodes: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The typed form of "edge_new" for the relations ``rows`` (their sources, local IDs
    of one node type) whose new nodes the sampler numbered together: hop after hop, the
    relations in ``rows``' order, each new node by the edge that first reaches it, after
    ``num_seeds`` seeds, ``num_nodes`` in all. Per relation: its other edges' sources and
    its bits (as :func:`_sources`); {} unless the numbering is exactly that."""
    names = list(rows)
    if len(names) == 1:  # one relation (a plain graph's): one pass that keeps the interpreter lock
        (name,) = names
        row = rows[name].cpu()
        if row.numel() != sum(num_edges[name]):
            return {}
        split = _sources(row, num_seeds, num_nodes)
        return {name: (split["edge_src"], split["edge_new"])} if "edge_new" in split else {}
    segments = _segments(num_edges, names)
    src = {r: np.ascontiguousarray(rows[r].cpu().numpy(), dtype=np.int64) for r in names}
    if any(src[r].size != sum(num_edges[r]) for r in names):
        return {}
    seq = np.concatenate([src[r][a:b] for r, a, b in segments]) if segments else np.empty(0, np.int64)
    earlier = np.maximum.accumulate(np.concatenate([[num_seeds - 1], seq]))[:-1]
    new = seq > earlier
    count = int(new.sum())
    if num_seeds + count != num_nodes or not np.array_equal(
            seq[new], np.arange(num_seeds, num_nodes, dtype=np.int64)):
        return {}
    flags = {r: np.zeros(src[r].size, dtype=bool) for r in names}
    pos = 0
    for r, a, b in segments:
        flags[r][a:b] = new[pos:pos + b - a]
        pos += b - a
    return {r: (narrowest(torch.from_numpy(src[r][~flags[r]]), INDEX_DTYPES),
                torch.from_numpy(np.packbits(flags[r], bitorder="little"))) for r in names}


def expand_typed_sources(rest: Mapping[str, torch.Tensor], bits: Mapping[str, torch.Tensor],
                         num_edges: Mapping[str, Sequence[int]], num_seeds: int,
                         num_nodes: int) -> dict[str, torch.Tensor]:
    """The int64 sources of every relation of :func:`split_typed_sources` (one source
    type), from their "edge_src" and "edge_new"; raises ``ValueError`` naming the
    relation when the sizes or the numbering disagree."""
    names = list(bits)
    flags, out, taken = {}, {}, dict.fromkeys(names, 0)
    for r in names:
        total = sum(num_edges[r])
        try:
            _check_bits(bits[r], total)
        except ValueError as exc:
            raise ValueError(f"edge_new/{r}: {exc}") from None
        flags[r] = np.unpackbits(bits[r].numpy(), count=total, bitorder="little").view(np.bool_)
        out[r] = np.empty(total, dtype=np.int64)
    nxt = num_seeds
    for r, a, b in _segments(num_edges, names):
        mark = flags[r][a:b]
        k = int(mark.sum())
        segment = out[r][a:b]
        segment[mark] = np.arange(nxt, nxt + k, dtype=np.int64)
        nxt += k
        others = rest[r].numpy()[taken[r]:taken[r] + (b - a - k)]
        if others.size != b - a - k:
            raise ValueError(f"edge_src/{r}: expected more entries (the edges not marked in "
                             f"edge_new/{r}), got {rest[r].numel()}")
        segment[~mark] = others
        taken[r] += b - a - k
    for r in names:
        if taken[r] != rest[r].numel():
            raise ValueError(f"edge_src/{r}: expected {taken[r]} entries (the edges not marked "
                             f"in edge_new/{r}), got {rest[r].numel()}")
    if nxt != num_nodes:
        raise ValueError(f"edge_new/{names[0] if names else ''}: expected {num_nodes - num_seeds} "
                         f"marked edges over the relations {names} (the new nodes), got "
                         f"{nxt - num_seeds}")
    return {r: torch.from_numpy(v) for r, v in out.items()}


def expand_edges(src: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """int64 ``[2, E]`` ``edge_index`` from its sources and the edges per target (the
    targets ``0 .. len(counts)-1`` in order); raises when the sizes disagree."""
    per_target = counts.numpy().astype(np.int64, copy=False)
    total = int(per_target.sum()) if per_target.size else 0
    if total != src.numel() or (per_target.size and int(per_target.min()) < 0):
        raise ValueError(f"expected edge_count >= 0 summing to the {src.numel()} entries of "
                         f"edge_src, got a sum of {total}")
    out = np.empty((2, total), dtype=np.int64)
    out[0] = src.numpy()
    out[1] = np.repeat(np.arange(per_target.size, dtype=np.int64), per_target)
    return torch.from_numpy(out)


def widen(t: torch.Tensor) -> torch.Tensor:
    """``t`` as int64 (itself when it already is)."""
    if t.dtype == torch.int64:
        return t
    if t.device.type != "cpu":
        return t.to(torch.int64)
    return torch.from_numpy(t.numpy().astype(np.int64))
