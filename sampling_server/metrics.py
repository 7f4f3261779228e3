"""Prometheus metrics of one sampling server (``--metrics-port``).

Each server has its own registry (several servers may share a process in tests):
streams open, batches/bytes/seeds sent, per-stage latency histograms (sample, gather,
encode, and the peer calls), peer call errors and rejected requests by reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

#: Latency buckets, seconds (1 ms .. 30 s).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    """The counters of one server; every method is cheap and thread-safe."""

    def __init__(self, partition: int) -> None:
        self.registry = CollectorRegistry()
        labels = {"partition": str(partition)}
        r = self.registry
        self.streams_open = Gauge("graphfeed_streams_open", "Trainer streams running now",
                                  ["partition"], registry=r).labels(**labels)
        self.batches = Counter("graphfeed_batches_sent", "Batches sent to trainers",
                               ["partition"], registry=r).labels(**labels)
        self.bytes = Counter("graphfeed_bytes_sent", "Stream message bytes sent to trainers",
                             ["partition"], registry=r).labels(**labels)
        self.seeds = Counter("graphfeed_seeds_served", "Seed nodes of the batches sent",
                             ["partition"], registry=r).labels(**labels)
        self._stage = Histogram("graphfeed_stage_seconds",
                                "Seconds per batch stage (sample, gather, encode) and per peer "
                                "call (peer_sample, peer_fetch)", ["partition", "stage"],
                                buckets=BUCKETS, registry=r)
        self._peer_errors = Counter("graphfeed_peer_errors", "Failed calls to peer servers",
                                    ["partition", "peer", "code"], registry=r)
        self._rejected = Counter("graphfeed_requests_rejected",
                                 "Requests answered with an error status, by method and code",
                                 ["partition", "method", "code"], registry=r)
        self._partition = str(partition)
        self._http: Any = None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage ``name``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._stage.labels(self._partition, name).observe(time.perf_counter() - started)

    def observe(self, name: str, seconds: float) -> None:
        self._stage.labels(self._partition, name).observe(seconds)

    def peer_error(self, peer: int, code: str) -> None:
        self._peer_errors.labels(self._partition, str(peer), code).inc()

    def rejected(self, method: str, code: str) -> None:
        self._rejected.labels(self._partition, method, code).inc()

    def sent_message(self, nbytes: int) -> None:
        self.bytes.inc(nbytes)

    def sent_batch(self, seeds: int, encode_seconds: float) -> None:
        """A batch's last message was handed to gRPC; its messages took
        ``encode_seconds`` to encode in all (stage "encode")."""
        self.batches.inc()
        self.seeds.inc(seeds)
        self.observe("encode", encode_seconds)

    # -- endpoint ----------------------------------------------------------------------
    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP on ``host:port`` (0: a free port); the port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = int(self._http.server_port)
        log.info("partition=%s: metrics on http://%s:%d/metrics", self._partition, host, bound)
        return bound

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
