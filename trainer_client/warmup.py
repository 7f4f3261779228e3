"""``python -m trainer_client.warmup``: compile and cache a trainer's Numba CPU kernels
ahead of use.

Numba compiles a kernel the first time it runs (into ``NUMBA_CACHE_DIR`` for
``cache=True`` kernels); running this once where graphfeed is installed (the container
image does, after ``python -m sampling_server.warmup``) moves that work out of the first
batches of every trainer started later. The kernels run on the argument types of every
graph's batches (int32 and int64 IDs, int8 labels, the wire's feature dtypes), so the
cache serves real jobs.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import torch
from torch_geometric.data import Data

from protos import compact
from protos import sampling_pb2 as pb
from trainer_client.cache import CPU_ASSEMBLY, FeatureCache
from trainer_client.node_table import NodeTable

log = logging.getLogger("trainer_client.warmup")


def warm_node_table(n_id: torch.Tensor) -> None:
    """A trainer's node-table look-up of a batch's nodes, for int32 and int64 original IDs
    and node IDs (labels as int8, as most graphs' are)."""
    num = int(n_id.max()) + 1
    for table_dtype in compact.INDEX_DTYPES:
        table = NodeTable(torch.zeros(num, dtype=table_dtype), torch.zeros(num, dtype=torch.int8))
        for dtype in compact.INDEX_DTYPES:
            table.complete(Data(n_id=n_id.to(dtype)), labels=True)


def warm_cache_assembly(n_id: torch.Tensor) -> None:
    """The feature cache's one-pass rebuilding of a batch's ``x`` on the CPU, for each of its
    conversions (:data:`~trainer_client.cache.CPU_ASSEMBLY`), with int32 and int64 slots."""
    num = int(n_id.max()) + 1
    cached = n_id % 2 == 0
    for slot_dtype in (torch.int32, torch.int64):
        slot = torch.full((num,), -1, dtype=slot_dtype)
        held = torch.unique(n_id[cached])
        slot[held] = torch.arange(held.numel(), dtype=slot_dtype)
        for wire, out in CPU_ASSEMBLY:
            cache = FeatureCache([held.numel()], torch.zeros((held.numel(), 4), dtype=wire), slot, pb.FLOAT32)
            cache.assemble(torch.zeros((int((~cached).sum()), 4), dtype=wire), cached, n_id, out)


def warm_up() -> dict[str, float]:
    """Run every CPU kernel a trainer uses on a batch once; seconds per step."""
    n_id = torch.from_numpy(np.random.default_rng(0).permutation(64).astype(np.int64))
    seconds: dict[str, float] = {}
    for name, step in (("node table", warm_node_table), ("feature cache", warm_cache_assembly)):
        started = time.perf_counter()
        step(n_id)
        seconds[name] = time.perf_counter() - started
    return seconds


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m trainer_client.warmup",
        description="Compile and cache a graphfeed trainer's Numba CPU kernels (set NUMBA_CACHE_DIR to "
        "choose where the cache goes).").parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    seconds = warm_up()
    log.info("kernels compiled and cached in %.1f s (%s)", sum(seconds.values()),
             ", ".join(f"{step} {took:.1f} s" for step, took in seconds.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
