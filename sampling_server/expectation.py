"""What a caller expects of the server it calls (``ServerExpectation``): the graph, the
partition and the hot order it read of the server when its job began. A server
restarted since with another graph must not serve into a running job: trainers'
streams and cache fills (``EpochRequest.expect``, ``HotNodesRequest.expect``) and other
servers' peer calls (``SampleNeighborsRequest.expect``, ``FetchNodeDataRequest.expect``)
carry it, and a server that no longer matches refuses with ``FAILED_PRECONDITION``."""

from __future__ import annotations

import grpc

from protos import sampling_pb2 as pb
from sampling_server.errors import RequestError, printable
from sampling_server.store import PartitionStore

#: The requests that carry a ``ServerExpectation``.
ExpectingRequest = (pb.EpochRequest | pb.HotNodesRequest | pb.SampleNeighborsRequest
                    | pb.FetchNodeDataRequest | pb.FetchEdgeDataRequest | pb.HasEdgesRequest)


def check_expectation(request: ExpectingRequest, store: PartitionStore, hot_order: bool) -> None:
    """Refuse (FAILED_PRECONDITION) a call whose ``request.expect`` (what the caller read
    of this server when it began, or its own graph for a peer) no longer holds: a server
    was restarted with another graph or partition since, or with another hot order where
    the call relies on it (``hot_order``). Batches of another graph must not enter a job.
    A request without ``expect`` (an old client) is not checked."""
    if not request.HasField("expect"):
        return
    expect = request.expect
    checks: list[tuple[str, str | int, str | int, str]] = [
        ("graph_fingerprint", expect.graph_fingerprint, store.graph_fingerprint, "graph"),
        ("partition_id", expect.partition_id, store.partition_id, "partition")]
    if hot_order:
        checks.append(("hot_order", expect.hot_order, store.hot_order, "hot order"))
    for name, given, served, what in checks:
        if given == served:
            continue
        if name == "graph_fingerprint":  # SHA-256 hex: 12 digits tell them apart
            shown = (f"'{printable(str(given)[:12])}...'", f"'{str(served)[:12]}...'")
        elif name == "partition_id":
            shown = (str(given), str(served))
        else:  # the caller's string: escaped and bounded
            shown = (f"'{printable(str(given), 80)}'", f"'{served}'")
        raise RequestError(
            f"{type(request).__name__}.expect.{name}: expected {shown[1]} (the {what} this "
            f"server holds now), got {shown[0]} (the one the caller began with): this server "
            f"or the caller was restarted with another {what}; start the job again on the "
            f"cluster as it is",
            grpc.StatusCode.FAILED_PRECONDITION)


__all__ = ["check_expectation"]
