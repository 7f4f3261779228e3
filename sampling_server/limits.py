"""Request limits: every request's cost is checked against the server's limits before
anything is allocated for it (client text is bounded in replies and escaped in logs by
:mod:`sampling_server.errors`).

A request over a limit gets ``INVALID_ARGUMENT`` with a message naming the limit and
the flag that raises it (not ``RESOURCE_EXHAUSTED``, which trainers retry: a server at
its stream limit frees a slot, but a request over a limit never passes); the worst
case a request allows is what counts, so a request that passes cannot grow past the
limits however the graph answers it.
"""

from __future__ import annotations

import grpc

from sampling_server.config import ServerConfig
from sampling_server.errors import RequestError

_OVER_LIMIT = grpc.StatusCode.INVALID_ARGUMENT

__all__ = ["check_epoch_limits", "check_peer_edge_limits", "check_peer_limits", "worst_case_edges"]


def _over(what: str, got: int, limit: int, flag: str) -> RequestError:
    return RequestError(f"{what}: expected at most {limit}, got {got} (server limit {flag})",
                        _OVER_LIMIT)


def _hop_edges(frontier: int, fanout: int, num_edges: int, replace: bool) -> int:
    """Most edges one hop from ``frontier`` nodes can sample (draws with replacement
    may repeat an edge, so only they can exceed the graph's edges)."""
    if fanout < 0:
        return num_edges
    return frontier * fanout if replace else min(frontier * fanout, num_edges)


def worst_case_edges(batch_size: int, fanouts: list[int], num_nodes: int, num_edges: int,
                     replace: bool = False, first_hop: int | None = None) -> int:
    """Most edges a batch of ``batch_size`` seeds can sample with ``fanouts`` (-1: all
    neighbors) in a graph of ``num_nodes`` nodes and ``num_edges`` edges; ``first_hop``:
    the most the first hop can draw, where the seeds' in-degrees tell it."""
    frontier, total = batch_size, 0
    for hop, fanout in enumerate(fanouts):
        edges = _hop_edges(frontier, fanout, num_edges, replace) if hop or first_hop is None else first_hop
        total += edges
        frontier = min(frontier + edges, num_nodes)
    return total


def check_epoch_limits(
    config: ServerConfig, num_hops: int, fanouts: list[int] | None, batch_size: int,
    num_nodes: int, num_edges: int, replace: bool = False, field: str = "EpochRequest",
    first_hop: int | None = None,
) -> None:
    """Raise INVALID_ARGUMENT when an epoch request asks for more than the limits.
    ``fanouts`` is read only once ``num_hops`` passed (so a huge list is never copied);
    ``first_hop``: the most edges the first hop of any of its batches can draw, where
    that is known (the seeds' own in-degrees)."""
    if num_hops > config.max_hops:
        raise _over(f"{field}.fanouts: number of hops", num_hops, config.max_hops, "--max-hops")
    if batch_size > config.max_batch_size:
        raise _over(f"{field}.batch_size", batch_size, config.max_batch_size, "--max-batch-size")
    if fanouts is None:
        return
    largest = max(fanouts, default=0)
    if largest > config.max_fanout:
        raise _over(f"{field}.fanouts: fanout", largest, config.max_fanout, "--max-fanout")
    edges = worst_case_edges(max(batch_size, 0), [f for f in fanouts if f >= -1], num_nodes,
                             num_edges, replace, first_hop)
    if edges > config.max_batch_edges:
        raise RequestError(
            f"{field}: batch_size {batch_size} with fanouts {fanouts} may sample {edges} edges "
            f"per batch; expected at most {config.max_batch_edges} (server limit "
            "--max-batch-edges; a fanout of -1 counts every edge of the graph, in the first hop of batches "
            "per partition the seeds' in-degrees)", _OVER_LIMIT)


def check_peer_edge_limits(config: ServerConfig, num_edges: int, field: str) -> None:
    """Raise INVALID_ARGUMENT when a FetchEdgeData request carries more edge IDs than a
    peer request may carry IDs."""
    if num_edges > config.max_peer_nodes:
        raise _over(f"{field}.edges: number of edge IDs", num_edges, config.max_peer_nodes,
                    "--max-peer-nodes")


def check_peer_limits(
    config: ServerConfig, num_nodes: int, fanout: int | None, graph_edges: int, field: str,
    replace: bool = False,
) -> None:
    """Raise INVALID_ARGUMENT when a peer request carries too many nodes, or (for
    SampleNeighbors, ``fanout`` given) may sample too many edges."""
    if num_nodes > config.max_peer_nodes:
        raise _over(f"{field}.nodes: number of node IDs", num_nodes, config.max_peer_nodes,
                    "--max-peer-nodes")
    if fanout is None:
        return
    if fanout > config.max_fanout:
        raise _over(f"{field}.fanout", fanout, config.max_fanout, "--max-fanout")
    edges = _hop_edges(num_nodes, fanout, graph_edges, replace)
    if edges > config.max_batch_edges:
        raise _over(f"{field}: edges the call may sample", edges, config.max_batch_edges,
                    "--max-batch-edges")
