"""A tiny typed graph for the heterogeneous data-layer tests."""

from __future__ import annotations

import numpy as np

from partitioner.typed import TypedGraphData as TypedGraphData


def tiny_hetero(seed: int = 0) -> TypedGraphData:
    """Papers (features, labels), authors and topics (no features), three relations."""
    rng = np.random.default_rng(seed)
    counts = {"paper": 30, "author": 20, "topic": 6}
    edges = {
        ("author", "writes", "paper"): np.stack(
            [rng.integers(0, 20, 60), rng.integers(0, 30, 60)]).astype(np.int64),
        ("paper", "cites", "paper"): np.stack(
            [rng.integers(0, 30, 50), rng.integers(0, 30, 50)]).astype(np.int64),
        ("paper", "has_topic", "topic"): np.stack(
            [rng.integers(0, 30, 40), rng.integers(0, 6, 40)]).astype(np.int64),
    }
    y = rng.integers(0, 3, 30).astype(np.int64)
    y[[3, 7]] = -1
    order = rng.permutation(np.setdiff1d(np.arange(30), [3, 7]))
    splits = {"train": np.sort(order[:14]), "val": np.sort(order[14:20]),
              "test": np.sort(order[20:28])}
    x = {"paper": rng.standard_normal((30, 4)).astype(np.float32)}
    return TypedGraphData(name="tiny-hetero", num_nodes=counts, edge_index=edges, x=x,
                           target_type="paper", y=y, num_classes=3, splits=splits)
