"""The plumbing the samplers share: calls to the peers started ahead, per-owner grouping
of node IDs, answers put back in frontier order, and rows scattered into their places
(features into stream messages' row blocks, on the CPU in parallel Numba passes that keep
the interpreter lock)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from protos import allocator, halfcast
from sampling_server.sampler import cpu_gather, cpu_glue
from sampling_server.sampler.types import HopSample

T = TypeVar("T")

#: Most peer requests in flight at once while their callers do their own share.
PEER_WAIT_THREADS = 64
_peer_waits: ThreadPoolExecutor | None = None
_peer_waits_lock = threading.Lock()


def begin(call: Callable[[], T], overlap: bool = True, pool: Executor | None = None) -> Future[T]:
    """Start ``call`` (a request to the peers) on a thread of its own and return at once,
    so that the caller's share of the same hop or gather overlaps the round trip. The
    caller waits on the future without a timeout of its own: peer calls carry their
    deadlines. Threads are made as calls need them (at most :data:`PEER_WAIT_THREADS`),
    or taken from ``pool`` when given. ``overlap=False`` runs ``call`` here, before
    returning."""
    global _peer_waits
    if not overlap:
        done: Future[T] = Future()
        try:
            done.set_result(call())
        except Exception as exc:  # re-raised by done.result(), as a pool's future does
            done.set_exception(exc)
        return done
    if pool is not None:
        return pool.submit(call)
    with _peer_waits_lock:
        if _peer_waits is None:
            _peer_waits = ThreadPoolExecutor(PEER_WAIT_THREADS, thread_name_prefix="peer-wait")
        return _peer_waits.submit(call)


def torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    """The torch dtype of a NumPy dtype (float16/32/64, the integer types)."""
    return torch.from_numpy(np.empty(0, dtype)).dtype


def is_identity(orig_ids: np.ndarray, start: int) -> bool:
    """Whether the owned nodes' original IDs are their global IDs (``start`` onwards): so
    in every part of a ``range`` partitioning, whose parts keep the graph's ID order."""
    ids = np.asarray(orig_ids)
    return bool(np.array_equal(ids, np.arange(start, start + ids.size, dtype=ids.dtype)))


def original_ids(orig_ids: np.ndarray, nodes: np.ndarray, start: int, identity: bool) -> np.ndarray:
    """int64 original IDs of owned ``nodes`` (global IDs; the first owned is ``start``): a
    copy of ``nodes`` when ``identity`` (:func:`is_identity`), else a parallel gather."""
    if identity:
        return np.array(nodes, dtype=np.int64)
    return cpu_gather.gather(np.asarray(orig_ids), np.ascontiguousarray(nodes, dtype=np.int64),
                             start).astype(np.int64, copy=False)


def owner_groups(owner: torch.Tensor, num_parts: int) -> dict[int, torch.Tensor]:
    """Per partition present in ``owner`` (partition IDs below ``num_parts``, one per
    node), the positions of its nodes, in order: on the CPU one counting sort that keeps
    the interpreter lock; on a GPU the partitions present come from a count per partition
    (one pass), not from sorting ``owner``."""
    if owner.numel() == 0:
        return {}
    if owner.device.type == "cpu":
        order, starts = cpu_glue.group_positions(owner.numpy(), num_parts)
        return {p: torch.from_numpy(order[starts[p]:starts[p + 1]]) for p in range(num_parts)
                if starts[p + 1] > starts[p]}
    present = torch.bincount(owner).nonzero().flatten().tolist()
    return {p: torch.nonzero(owner == p).flatten() for p in present}


def layout_of(blocks: Sequence[tuple[int, int, torch.Tensor]]) -> cpu_gather.RowBlocks | None:
    """CPU ``blocks`` of one size (the last may be shorter) as :class:`cpu_gather.RowBlocks`;
    None for others."""
    size = blocks[0][1] - blocks[0][0]
    if any(a != k * size or rows.device.type != "cpu" or not rows.is_contiguous() or rows.dim() != 2
           for k, (a, _, rows) in enumerate(blocks)):
        return None
    try:
        return cpu_gather.RowBlocks([numpy_words(rows) for _, _, rows in blocks])
    except ValueError:
        return None


def assign_rows_to_blocks(blocks: Sequence[tuple[int, int, torch.Tensor]],
                          layout: cpu_gather.RowBlocks | None, pos: torch.Tensor,
                          value: torch.Tensor) -> None:
    """:func:`assign_rows` into ``blocks`` (``pos`` increasing): in one parallel pass where
    ``layout`` says they are of one size and ``value`` comes in their dtype (peers answer
    in the wire dtype), else block by block."""
    value = on_device(value, torch.device("cpu"))
    if layout is not None and value.dtype == blocks[0][2].dtype and value.dim() == 2 \
            and value.is_contiguous():
        cpu_gather.scatter_into(numpy_words(value), int64_array(pos), layout)
        return
    for a, _, rows, s, e in by_block(pos, blocks):
        assign_rows(rows, pos[s:e] - a, value[s:e])


def by_block(positions: torch.Tensor, blocks: Sequence[tuple[int, int, torch.Tensor]]
              ) -> list[tuple[int, int, torch.Tensor, int, int]]:
    """Per block ``(a, b, rows)`` with any of the increasing ``positions`` in ``[a, b)``:
    ``(a, b, rows, s, e)``, those positions being ``positions[s:e]``."""
    bounds = np.searchsorted(positions.numpy(), [a for a, _, _ in blocks] + [blocks[-1][1]])
    return [(a, b, rows, int(bounds[k]), int(bounds[k + 1])) for k, (a, b, rows) in enumerate(blocks)
            if bounds[k + 1] > bounds[k]]


def take(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``values[positions]`` (1-D); on the CPU in a call that keeps the interpreter lock."""
    if values.device.type == "cpu" and positions.device.type == "cpu":
        return torch.from_numpy(cpu_glue.take(values.numpy(), positions.numpy()))
    return values[positions]


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, without a torch call (which releases the interpreter lock)
    when it is there already."""
    return t if t.device == device else t.to(device)


def assign_rows(dest: torch.Tensor | None, pos: torch.Tensor, value: torch.Tensor | None) -> None:
    """``dest[pos] = value`` in ``dest``'s dtype (cast as :mod:`protos.halfcast` does); on
    the CPU a parallel Numba scatter."""
    if dest is None or value is None:
        return
    value = on_device(value, dest.device)
    if value.dtype != dest.dtype:
        value = halfcast.cast(value, dest.dtype)
    if dest.device.type == "cpu" and value.dim() == dest.dim() <= 2 \
            and value.shape[1:] == dest.shape[1:] and dest.is_contiguous():
        words = numpy_words(value)
        cpu_gather.scatter_into(words if words.flags.c_contiguous else np.ascontiguousarray(words),
                                int64_array(pos),
                                numpy_words(dest))
    else:
        dest[pos] = value


def int64_array(t: torch.Tensor) -> np.ndarray:
    """A CPU integer tensor as an int64 NumPy array (no torch call when it is one)."""
    arr = t.numpy()
    return arr if arr.dtype == np.int64 else arr.astype(np.int64)


def numpy_words(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as NumPy (bfloat16, which NumPy lacks, as uint16 words)."""
    if t.dtype != torch.bfloat16:
        return t.numpy()
    words = allocator.words_of(t)
    return words if words is not None else t.view(torch.int16).numpy().view(np.uint16)


def merge_hop_samples(
    frontier_size: int, positions: Mapping[int, torch.Tensor], parts: Mapping[int, HopSample],
    device: torch.device,
) -> HopSample:
    """Put per-owner answers back in frontier order: ``parts[g]`` answers the frontier
    entries at ``positions[g]``. The edge IDs are merged alike when every part has them
    (else the merged hop has none)."""
    with_edges = all(parts[g].edges is not None for g in positions)
    if device.type == "cpu":  # calls that keep the interpreter lock, and one kernel a part
        none = np.zeros(0, np.int64)
        part_counts = {g: int64_array(parts[g].counts) for g in positions}
        full, offsets_np = cpu_glue.run_offsets(
            frontier_size, np.concatenate([pos.numpy() for pos in positions.values()] or [none]),
            np.concatenate(list(part_counts.values()) or [none]))
        size = cpu_glue.total(full)
        neighbors_np = np.empty(size, dtype=np.int64)
        edges_np = np.empty(size, dtype=np.int64) if with_edges else None
        for g, pos in positions.items():
            cpu_gather.place_runs(pos.numpy(), part_counts[g], int64_array(parts[g].neighbors),
                                  offsets_np, neighbors_np)
            part_edges = parts[g].edges
            if edges_np is not None and part_edges is not None:
                cpu_gather.place_runs(pos.numpy(), part_counts[g], int64_array(part_edges), offsets_np,
                                      edges_np)
        return HopSample(counts=torch.from_numpy(full), neighbors=torch.from_numpy(neighbors_np),
                         edges=None if edges_np is None else torch.from_numpy(edges_np))
    counts = torch.zeros(frontier_size, dtype=torch.int64, device=device)
    for g, pos in positions.items():
        counts[pos] = parts[g].counts
    offsets = torch.cumsum(counts, 0) - counts
    size = int(counts.sum())
    neighbors = torch.empty(size, dtype=torch.int64, device=device)
    edges = torch.empty(size, dtype=torch.int64, device=device) if with_edges else None
    for g, pos in positions.items():
        part = parts[g]
        if part.neighbors.numel() == 0:
            continue
        part_offsets = torch.cumsum(part.counts, 0) - part.counts
        within = torch.arange(part.neighbors.numel(), device=device) - torch.repeat_interleave(
            part_offsets, part.counts)
        at = torch.repeat_interleave(offsets[pos], part.counts) + within
        neighbors[at] = part.neighbors
        if edges is not None and part.edges is not None:
            edges[at] = part.edges
    return HopSample(counts=counts, neighbors=neighbors, edges=edges)
