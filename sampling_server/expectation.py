"""What a caller expects of the server it calls (``ServerExpectation``): the graph, the
partition and the hot order it read of the server when its job began. A server
restarted since with another graph must not serve into a running job: trainers'
streams and cache fills (``EpochRequest.expect``, ``HotNodesRequest.expect``) and other
servers' peer calls (``SampleNeighborsRequest.expect``, ``FetchNodeDataRequest.expect``)
carry it, and a server that no longer matches refuses with ``FAILED_PRECONDITION``."""

from __future__ import annotations

import grpc

from protos import sampling_pb2 as pb
from sampling_server.hetero_store import HeteroPartitionStore
from sampling_server.limits import printable
from sampling_server.store import PartitionStore, RequestError


def check_expectation(expect: pb.ServerExpectation, store: PartitionStore, field: str,
                      hot_order: bool) -> None:
    """Refuse (FAILED_PRECONDITION) a call whose ``expect`` (what the caller read of this
    server when it began, or its own graph for a peer) no longer holds: a server was
    restarted with another graph or partition since, or with another hot order where the
    call relies on it (``hot_order``). Batches of another graph must not enter a job."""
    served_order = "" if isinstance(store, HeteroPartitionStore) else store.config.hot_order
    checks = [("graph_fingerprint", expect.graph_fingerprint, store.graph_fingerprint,
               "graph"),
              ("partition_id", expect.partition_id, store.partition_id, "partition")]
    if hot_order:
        checks.append(("hot_order", expect.hot_order, served_order, "hot order"))
    for name, given, served, what in checks:
        if given != served:
            shown = (given, served) if isinstance(given, int) else \
                (f"'{printable(str(given), 80)}'", f"'{served}'")  # the caller's: bounded
            if name == "graph_fingerprint":  # SHA-256 hex: 12 digits tell them apart
                shown = (f"'{printable(str(given)[:12])}...'", f"'{str(served)[:12]}...'")
            raise RequestError(
                f"{field}.expect.{name}: expected {shown[1]} (the {what} this server holds "
                f"now), got {shown[0]} (the one the caller began with): this server or the "
                f"caller was restarted with another {what}; start the job again on the "
                f"cluster as it is",
                grpc.StatusCode.FAILED_PRECONDITION)


__all__ = ["check_expectation"]
