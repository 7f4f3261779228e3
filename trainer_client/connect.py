"""Reaching the servers at start: every server's ``ClusterInfo``, fetched in parallel,
each server waited for until it answers (it may start after the trainer, or still be
loading its partition), all within the connect timeout.

While it waits, the trainer says every :data:`REPORT_EVERY` seconds what for: which
servers refuse connections, which host names do not resolve, which servers are still
loading, how long is left. When every server has refused connections, or its host name
has not resolved, for longer than a short grace (:data:`REFUSED_GRACE`), nothing is
running at those addresses: the wait ends at once, naming the fix.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import grpc

from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.channel import Backoff, RetryFailure, ServerUnavailable, error_from_rpc, retry, status_in

log = logging.getLogger("trainer_client.cluster")

#: Seconds between the lines that say what the trainer still waits for.
REPORT_EVERY = 5.0
#: Seconds every server may refuse connections (or not resolve) before the trainer stops waiting.
REFUSED_GRACE = 10.0
#: Pauses between GetClusterInfo tries of one server.
BACKOFF = Backoff(0.05, 2.0, 1.0)
#: Words of gRPC's status details (its own resolver's, c-ares') for a name that does not resolve.
UNRESOLVED = ("errors resolving", "dns resolution failed", "lookup failed")
#: States in which nothing runs at an address: no answer will come by waiting.
NOTHING_THERE = ("refused", "unresolved")


class _Waiting:
    """What one server said last: ``state`` "refused" (nothing listens), "unresolved"
    (its host name does not resolve), "loading" (it answers, not ready) or "down" (any
    other failure), since ``since``, as ``error``."""

    def __init__(self) -> None:
        self.state, self.since, self.error = "down", time.monotonic(), "no answer yet"

    def heard(self, error: str) -> bool:
        """Take ``error`` in; whether it is news: a new state, or another reason for "down"."""
        text = error.lower()
        state = "refused" if "connection refused" in text else \
            "unresolved" if any(w in text for w in UNRESOLVED) else \
            "loading" if "loading" in text or "not_serving" in text else "down"
        new = state != self.state or (state == "down" and error != self.error)
        if state != self.state:
            self.state, self.since = state, time.monotonic()
        self.error = error
        return new

    def describe(self, now: float) -> str:
        if self.state in NOTHING_THERE:
            what = "refuses connections" if self.state == "refused" else "does not resolve"
            return f"{what} (for {now - self.since:.0f} s)"
        return f"{'is still loading' if self.state == 'loading' else 'does not answer'} ({self.error})"


def _nothing_there(waiting: Mapping[str, _Waiting], grace: float) -> str:
    """Why the wait ends where nothing has run at any address ``waiting`` names for
    ``grace`` seconds: each address and the fix."""
    why = []
    refused = [a for a, s in waiting.items() if s.state == "refused"]
    if refused:
        each = f"at {refused[0]}" if len(refused) == 1 else "at each"
        why.append(f"server{'s' * (len(refused) > 1)} {', '.join(refused)} refused connections for "
                   f"{grace:g} s: is a server running {each}? Start it with graphfeed-server "
                   "--partition-dir DIR --partition P --listen HOST:PORT, or check --servers")
    for address in (a for a, s in waiting.items() if s.state == "unresolved"):
        why.append(f"server {address}: its host name did not resolve for {grace:g} s "
                   f"({waiting[address].error}): check the address in --servers")
    return "; ".join(why)


def fetch_infos(channels: Mapping[str, grpc.Channel], client_id: str, deadline: float,
                connect_timeout: float, rpc_timeout: float,
                refused_grace: float = REFUSED_GRACE) -> dict[str, pb.ClusterInfo]:
    """ClusterInfo of every address of ``channels``, fetched in parallel, each retried
    until ``deadline`` (a ``time.monotonic()`` time) while its server is down or loading;
    ServerUnavailable names every server that did not answer in time, or (after
    ``refused_grace`` seconds of refusals from every one) the fix."""
    states = {a: _Waiting() for a in channels}
    abandon = threading.Event()
    with ThreadPoolExecutor(max_workers=min(32, len(channels)), thread_name_prefix="cluster-info") as pool:
        futures = {a: pool.submit(_fetch_info, a, ch, client_id, deadline, connect_timeout, rpc_timeout,
                                  states[a], abandon.wait) for a, ch in channels.items()}
        try:
            _watch(futures, states, deadline, refused_grace)
        finally:
            abandon.set()  # a failure here: the others stop waiting too
    down = [e for f in futures.values() if (e := f.exception()) is not None]
    if len(down) == 1:
        raise down[0]
    if down:
        raise ServerUnavailable(f"{len(down)} servers unavailable: " + "; ".join(str(e) for e in down),
                                what="GetClusterInfo", code=grpc.StatusCode.UNAVAILABLE)
    return {a: f.result() for a, f in futures.items()}


def _watch(futures: Mapping[str, Future[pb.ClusterInfo]], states: Mapping[str, _Waiting], deadline: float,
           refused_grace: float) -> None:
    """Wait for every fetch; say every :data:`REPORT_EVERY` seconds what for; raise at
    once when every server refused connections for ``refused_grace`` seconds, or when a
    fetch failed for another reason than its server being down."""
    next_report = time.monotonic() + REPORT_EVERY
    pending = set(futures.values())
    while pending:
        done, pending = wait(pending, timeout=0.25, return_when=FIRST_EXCEPTION)
        error = next((f.exception() for f in done if not isinstance(f.exception(), ServerUnavailable | None)),
                     None)
        if error is not None:
            raise error
        now = time.monotonic()
        waiting = {a: states[a] for a, f in futures.items() if f in pending}
        if len(waiting) == len(futures) and all(s.state in NOTHING_THERE and now - s.since >= refused_grace
                                                 for s in waiting.values()):
            raise ServerUnavailable(_nothing_there(waiting, refused_grace), what="GetClusterInfo",
                                    code=grpc.StatusCode.UNAVAILABLE)
        if waiting and now >= next_report:
            next_report = now + REPORT_EVERY
            (log.info if all(s.state == "loading" for s in waiting.values()) else log.warning)(
                "waiting for %d server%s (%.0f s left): %s", len(waiting), "s" * (len(waiting) > 1),
                max(deadline - now, 0.0), "; ".join(f"{a} {s.describe(now)}" for a, s in waiting.items()))


def _fetch_info(address: str, channel: grpc.Channel, client_id: str, deadline: float, connect_timeout: float,
                rpc_timeout: float, state: _Waiting, sleep: Callable[[float], bool]) -> pb.ClusterInfo:
    """GetClusterInfo from ``address``, retried until ``deadline`` while it is down
    (``sleep``: the pause, which ends early, with the last failure, once the watcher
    gave up)."""
    stub = pb_grpc.SamplingServiceStub(channel)
    request = pb.ClusterInfoRequest(client_id=client_id)

    def attempt(left: float) -> pb.ClusterInfo:
        # no wait_for_ready: a server that is down answers at once with the connect
        # error (e.g. connection refused), which is logged below
        info: pb.ClusterInfo = stub.GetClusterInfo(request, timeout=min(left, rpc_timeout))
        return info

    def failed(f: RetryFailure) -> None:
        error = _status(f.error)
        if state.heard(error):  # the first failure, and every change of reason
            log.warning("waiting up to %.0f s more for server %s: %s", f.left, address, error)

    try:
        return retry(attempt, backoff=BACKOFF, deadline=deadline, on_failure=failed,
                     retryable=status_in(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED),
                     on_give_up=lambda f: ServerUnavailable(
                         f"server {address}: no ClusterInfo within {connect_timeout:g} s (--timeout, a "
                         f"loader's connect_timeout; last error: {_status(f.error)})", what="GetClusterInfo",
                         address=address, code=grpc.StatusCode.UNAVAILABLE), sleep=sleep)
    except grpc.RpcError as err:
        raise error_from_rpc(err, "GetClusterInfo", address) from err


def _status(error: BaseException) -> str:
    """A failed call's ``CODE: details``."""
    return f"{error.code().name}: {error.details()}" if isinstance(error, grpc.Call) else str(error)
