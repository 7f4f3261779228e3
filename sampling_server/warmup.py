"""``python -m sampling_server.warmup``: compile and cache the Numba CPU kernels ahead of use.

Numba compiles a kernel the first time it runs (about 10 s for a server's kernels, and as
much for the partitioner's, on 2 cores) and stores the machine code of ``cache=True``
kernels in ``NUMBA_CACHE_DIR`` (else next to the sources, else in the user's cache
directory). Running this once where graphfeed is installed moves that work out of the
first partition job and the first minibatches of every server started later: the
container image runs it at build time.

It partitions the small synthetic graph with every streaming method into a temporary
directory, loads a partition the way the server does (memory-mapped), and samples and
gathers minibatches with and without replacement (and draws and relabels a hop the way a
server does for and from its peers). The kernels' argument types are the
same for every graph written in format v1, so the cache serves real graphs too.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from partitioner.partition import Partition

log = logging.getLogger("sampling_server.warmup")

#: Partitioning methods whose assignment runs Numba kernels (metis runs METIS itself).
METHODS = ("metis", "range", "hash", "random")


def warm_up() -> dict[str, float]:
    """Run every CPU kernel a server and a partition job use once; seconds per step."""
    import torch

    from partitioner import load_partition, partition_graph
    from partitioner.synthetic import generate_plain
    from protos import compact, halfcast
    from sampling_server.produce import structure_tensors
    from sampling_server.sampler import create_sampler
    from sampling_server.sampler.cpu_fused import UNSEEN, look_up_drawn
    from sampling_server.sampler.hot_order import hot_order, plan_bitset, plan_flags
    from sampling_server.sampler.rng import batch_key

    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="graphfeed-warmup-") as tmp:
        started = time.perf_counter()
        graph = generate_plain("small", progress=False)
        seconds["generate"] = time.perf_counter() - started
        for method in METHODS:
            started = time.perf_counter()
            partition_graph(graph, 2, Path(tmp) / method, method=method, progress=False)
            seconds[f"partition {method}"] = time.perf_counter() - started
        # One partition of the whole graph: every neighbor is local, no peers needed.
        started = time.perf_counter()
        partition_graph(graph, 1, Path(tmp) / "whole", method="range", progress=False)
        part = load_partition(Path(tmp) / "whole", 0, verify="size")
        t, (et,) = part.target_type, part.edge_types
        seeds = np.asarray(part.splits["train"])[:64]
        for replace in (False, True):
            sampler = create_sampler(part, device="cpu", replace=replace)
            batch = sampler.minibatch(seeds, t, [10, 5], batch_key(0, 0, 0, 0))
            # what a server draws for its peers, and relabels of hops drawn by peers
            drawn = sampler.sample_relation(et, batch.structure.node[t], 5, batch_key(0, 0, 0, 0), 1)
            look_up_drawn(np.full(part.num_nodes(t), UNSEEN, dtype=np.int32),
                          drawn.neighbors.numpy(), drawn.counts.numpy())
        if t in batch.x:  # bfloat16 on the wire: the server narrows, a trainer widens
            halfcast.cast(halfcast.cast(batch.x[t].float(), torch.bfloat16), torch.float32)
        warm_mixed_gathers(part)
        warm_glue()
        # a batch's compact structure, and its nodes looked up in a trainer's cache plan
        out = batch.structure
        named = structure_tensors(out, lambda kind, _key: kind, compact_form=True)
        if "edge_new" in named:  # and a trainer expands it again, for each index dtype
            src, new = torch.as_tensor(named["edge_src"]), torch.as_tensor(named["edge_new"])
            for dtype in compact.INDEX_DTYPES:
                compact.expand_sources(src.to(dtype), new, out.row[et].numel(), out.batch_size)
        n_id = out.node[t]
        plan_flags(plan_bitset(part.num_nodes(t), [n_id.numpy()[:8]]), n_id.numpy(), part.num_nodes(t))
        seconds["sample and gather"] = time.perf_counter() - started
        started = time.perf_counter()
        hot_order(part, t, "visits_v1")
        seconds["hot order"] = time.perf_counter() - started
    from sampling_server.sampler import cpu_kernels

    cpu_kernels.log_threading_layer(log)  # (its probe kernel compiled and cached too)
    return seconds


def warm_glue() -> None:
    """The small helpers of a batch's glue (:mod:`cpu_glue`: ID ranges, owners, each
    owner's positions, takes, merged offsets), in the variants that keep the interpreter
    lock and, from ``RELEASE_MIN_ITEMS`` items, those that release it."""
    from sampling_server.sampler import cpu_glue as k

    book = np.array([0, 1 << 20, 1 << 21], dtype=np.int64)
    for n in (8, k.RELEASE_MIN_ITEMS):
        ids = np.arange(n, dtype=np.int64) * 7 % (1 << 21)
        k.id_min_max(ids)
        k.total(ids)
        k.positions(n)
        owner = k.owners(book, ids)
        order, _ = k.group_positions(owner, book.size - 1)
        k.take(ids, order)
        k.run_offsets(n, order, np.ones(n, dtype=np.int64))


def warm_mixed_gathers(part: Partition) -> None:
    """The kernels of a batch that mixes owned and remote nodes: owned rows gathered into
    place (as stored, and narrowed to bfloat16; into one array or into the stream
    messages that carry them, by the same kernel), remote rows and labels scattered in,
    also from unaligned memory, as a peer's rows arrive (Numba compiles a kernel apart
    for arrays whose items are not aligned), and a hop's answers merged."""
    from sampling_server.sampler import cpu_gather

    t = part.target_type
    start = part.node_range(t)[0]
    n = min(8, part.num_nodes(t))
    owned, places = np.arange(start, start + n, dtype=np.int64), np.arange(n, dtype=np.int64)[::-1].copy()
    x, y = np.asarray(part.x[t]), np.asarray(part.y)
    outs = [np.empty((n, x.shape[1]), x.dtype)]
    if x.dtype == np.float32:
        outs.append(np.empty((n, x.shape[1]), np.uint16))  # bfloat16 words
    for out in outs:
        cpu_gather.gather_into(x, owned, start, places, out)
        for rows in (out, _unaligned(out)):  # a peer's rows: a view of the bytes received
            cpu_gather.scatter_into(rows, places, np.empty_like(out))
    labels = np.empty(n, y.dtype)
    cpu_gather.gather_into(y, owned, start, places, labels)
    cpu_gather.scatter_into(labels, places, np.empty_like(labels))
    # a hop's answers from several owners put back in frontier order
    cpu_gather.place_runs(places, np.ones(n, np.int64), owned, places, np.empty(n, np.int64))


def _unaligned(like: np.ndarray) -> np.ndarray:
    """An array of ``like``'s shape and dtype whose items are not aligned."""
    raw = np.empty(like.nbytes + like.itemsize, np.uint8)[1 : 1 + like.nbytes]
    return raw.view(like.dtype).reshape(like.shape)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sampling_server.warmup",
        description="Compile and cache graphfeed's Numba CPU kernels (set NUMBA_CACHE_DIR to "
        "choose where the cache goes).")
    parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("partitioner").setLevel(logging.WARNING)
    total = time.perf_counter()
    for step, took in warm_up().items():
        log.info("%-20s %6.1f s", step, took)
    log.info("kernels compiled and cached in %.1f s", time.perf_counter() - total)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
