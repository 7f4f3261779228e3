"""The server's health (``grpc.health.v1``), kept true by :class:`HealthMonitor`:
``graphfeed.v1.PeerService`` is SERVING once the partition is loaded (what peers probe,
so servers never wait on each other in a circle); the overall status ``""`` and
``graphfeed.v1.SamplingService`` are SERVING once the partition is loaded **and** every
peer's PeerService answers SERVING and serves its partition of this graph. A background
thread keeps probing the peers (with a deadline, backing off while one is down), so a
lost peer turns this server NOT_SERVING too.
"""

from __future__ import annotations

import logging
import threading

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.channel import GraphfeedError, rpc_errors
from sampling_server.peer_client import PeerClient

log = logging.getLogger(__name__)

SAMPLING_SERVICE = "graphfeed.v1.SamplingService"
PEER_SERVICE = "graphfeed.v1.PeerService"
#: Longest deadline of one peer health probe.
MAX_PROBE_TIMEOUT_S = 5.0
#: First wait between probes while a peer is down (doubles up to ``health_interval``).
PROBE_BACKOFF_S = 0.1

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthMonitor:
    """Keeps the health statuses true: probes the peers' PeerService in the background
    once the partition is loaded."""

    def __init__(self, servicer: health.HealthServicer, partition: int, peers: PeerClient | None,
                 *, probe_timeout: float, interval: float, fingerprint: str = "") -> None:
        self.servicer = servicer
        self.partition = partition
        #: This server's graph fingerprint, which every peer must share.
        self.fingerprint = fingerprint
        self.problem: str | None = None
        self._wrong: set[int] = set()
        self.peers = peers
        self.probe_timeout = min(probe_timeout, MAX_PROBE_TIMEOUT_S)
        self.interval = interval
        #: Set while the overall status is SERVING.
        self.serving = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None  # set once started
        self._thread_lock = threading.Lock()
        self._down: dict[int, str] | None = None
        for service in ("", SAMPLING_SERVICE, PEER_SERVICE):
            servicer.set(service, _NOT_SERVING)

    def loaded(self) -> None:
        """The partition is loaded: serve peers, start probing them."""
        self.servicer.set(PEER_SERVICE, _SERVING)
        with self._thread_lock:  # a stop racing the end of the load joins a started thread
            if self._stop.is_set():
                return
            thread = threading.Thread(target=self._run, name="health-probe", daemon=True)
            thread.start()
            self._thread = thread

    def drain(self) -> None:
        """Stop probing; NOT_SERVING for trainers, PeerService stays SERVING (the other
        servers' streams still need this partition while this server drains)."""
        self._join()
        self.serving.clear()
        for service in ("", SAMPLING_SERVICE):
            self.servicer.set(service, _NOT_SERVING)

    def shutdown(self) -> None:
        """NOT_SERVING for good (later sets are ignored), and stop probing."""
        self.servicer.enter_graceful_shutdown()
        self.serving.clear()
        self._join()

    def _join(self) -> None:
        """Stop probing and wait (bounded) for the probe thread, if it was started."""
        with self._thread_lock:
            self._stop.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.probe_timeout + 1)

    def _run(self) -> None:
        backoff = PROBE_BACKOFF_S
        while not self._stop.is_set():
            down = self._probe()
            self._update(down)
            if down:
                wait, backoff = backoff, min(2 * backoff, self.interval)
            else:
                wait, backoff = self.interval, PROBE_BACKOFF_S
            self._stop.wait(wait)

    def _probe(self) -> dict[int, str]:
        """The peers that are not ready, each with the reason: its PeerService does
        not answer SERVING, or it serves another partition or another graph."""
        if self.peers is None:
            return {}
        request = health_pb2.HealthCheckRequest(service=PEER_SERVICE)
        calls = {p: (health_pb2_grpc.HealthStub(self.peers.channel(p)).Check.future(
                         request, timeout=self.probe_timeout),
                     pb_grpc.SamplingServiceStub(self.peers.channel(p)).GetClusterInfo.future(
                         pb.ClusterInfoRequest(client_id=f"server-{self.partition}"),
                         timeout=self.probe_timeout))
                 for p in self.peers.peers}
        down: dict[int, str] = {}
        self._wrong = set()
        for p, (health_call, info_call) in calls.items():
            address = self.peers.addresses[p]
            try:
                with rpc_errors("Health.Check", address):
                    serving = health_call.result().status == _SERVING
                with rpc_errors("GetClusterInfo", address):
                    info = info_call.result()
            except GraphfeedError as exc:
                log.debug("partition=%d: peer probe failed: %s", self.partition, exc)
                down[p] = f"{p} ({address}) is not reachable or not loaded yet"
                continue
            wrong = self.identity_problem(p, address, info)
            if wrong:
                down[p] = wrong
                self._wrong.add(p)
            elif not serving:
                down[p] = f"{p} ({address}) is still loading"
        return down

    def identity_problem(self, p: int, address: str, info: pb.ClusterInfo) -> str | None:
        """A plain sentence when the server at ``address`` (position ``p`` of --peers)
        does not serve partition ``p`` of this graph; None when it does."""
        if info.graph_fingerprint != self.fingerprint:
            return (f"{p} ({address}) serves another graph ({info.graph_name!r}, fingerprint "
                    f"{info.graph_fingerprint[:12] or 'none'}; this server: fingerprint "
                    f"{self.fingerprint[:12]}): start every server on the same partitioned "
                    "graph directory")
        if info.partition_id != p:
            return (f"{p} ({address}) serves partition {info.partition_id}, but --peers lists it "
                    f"at position {p}: list every server's address in partition order")
        return None

    def _update(self, down: dict[int, str]) -> None:
        status = _NOT_SERVING if down else _SERVING
        for service in ("", SAMPLING_SERVICE):
            self.servicer.set(service, status)
        problems = [why for p, why in down.items() if p in self._wrong]
        #: Why the peers are wrong (None when every reachable peer is the right one).
        self.problem = ("; ".join(f"peer partition {why}" for why in problems)
                        if problems else None)
        if down:
            self.serving.clear()
        else:
            self.serving.set()
        if down != self._down:
            if down:
                names = "; ".join(f"peer partition {why}" for why in down.values())
                log.warning("partition=%d: NOT_SERVING: %s", self.partition, names)
            else:
                log.info("partition=%d: SERVING (partition loaded, %d peers reachable)",
                         self.partition, len(self.peers.peers) if self.peers else 0)
            self._down = down
