"""Layer-wise inference as the tests and the inference benchmark run it: a pass on
ranks that are threads of this process (each its own cluster), and the one-process
full-graph forwards it is compared with."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from partitioner.graph import GraphData, TypedGraphData
from trainer_client import Cluster
from trainer_client.layerwise import LayerwiseInference


def run_pass(addresses: list[str], model: nn.Module, ranks: int, *, batch_size: int = 7, name: str = "",
         on_batch: Callable[[int, int], None] | None = None, reconnect: float = 15.0) -> dict[str, Tensor]:
    """The pass on ``ranks`` threads (each its own cluster, the one model shared: it is
    only read); every node's output by original ID, per output type (rank 0 reads them
    before the tables are dropped)."""
    meeting = ThreadMeeting(ranks, timeout=120)
    name = name or f"lw/test-{time.monotonic_ns()}"
    outputs: dict[str, Tensor] = {}

    def rank(r: int) -> None:
        with Cluster(addresses, client_id=f"rank{r}") as cluster:
            inference = LayerwiseInference(
                model, cluster, meeting, batch_size,
                dict(rank=r, world_size=ranks, reconnect_timeout=reconnect, stall_timeout=30.0),
                name=name, on_batch=on_batch if r == 0 else None)
            try:
                tables = inference.run()
                if r == 0:
                    for t, table in tables.items():
                        outputs[t] = table.read(table.global_ids(np.arange(cluster.graph.num_nodes[t])))
            finally:
                inference.close()

    with ThreadPoolExecutor(ranks) as pool:
        for done in [pool.submit(rank, r) for r in range(ranks)]:
            done.result(timeout=300)
    return outputs


def plain_forward(model: nn.Module, graph: GraphData, x: Tensor | None = None) -> Tensor:
    edge_attr = torch.from_numpy(graph.edge_attr) if graph.edge_attr is not None else None
    inputs = x if x is not None else torch.from_numpy(graph.x)
    with torch.no_grad():
        out: Tensor = model(inputs, torch.from_numpy(graph.edge_index), edge_attr=edge_attr)
    return out


def typed_forward(model: Any, graph: TypedGraphData) -> dict[str, Tensor]:
    with torch.no_grad():
        out: dict[str, Tensor] = model.embed({t: torch.from_numpy(x) for t, x in graph.x.items()},
                                             {et: torch.from_numpy(e) for et, e in graph.edge_index.items()},
                                             {t: torch.arange(n) for t, n in graph.num_nodes.items()})
    return out


class ThreadMeeting:
    """The ranks' meeting (``trainer_client.layerwise.Meeting``) when they are threads of one
    process."""

    def __init__(self, ranks: int, timeout: float = 600.0) -> None:
        self._barrier = threading.Barrier(ranks, timeout=timeout)
        self._values: list[int] = []
        self._lock = threading.Lock()

    def most(self, value: int) -> int:
        with self._lock:
            self._values.append(value)
        self._barrier.wait()
        top = max(self._values)
        if self._barrier.wait() == 0:
            self._values.clear()
        self._barrier.wait()
        return top
