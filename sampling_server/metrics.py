"""Prometheus metrics of one sampling server (``--metrics-port``).

Each server has its own registry (several servers may share a process in tests):
streams open, batches/bytes/seeds sent, per-stage latency histograms (sample, gather,
encode, and the peer calls), peer call errors, rejected requests by reason, how long
a waking thread waits for the interpreter lock (:class:`GilProbe`), the Numba
threading layer of the CPU kernels, the bytes of the graph the server holds, streams
ended to free their slots, and (:meth:`ServerMetrics.watch`) each client's streams,
in-flight bytes and fair share with the per-client limits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

#: Latency buckets, seconds (1 ms .. 30 s).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Buckets of the interpreter-lock wait, seconds (0.1 ms .. 100 ms; the lock's switch
#: interval is 5 ms).
GIL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class GilProbe:
    """How long a thread that wakes up waits for the interpreter lock.

    A daemon thread sleeps ``interval`` seconds, again and again, and reports to
    ``observe`` how much later than asked it ran again. A thread back from a wait (a
    sampling worker whose peer call answered, a gRPC sender whose message went out) needs
    the lock before it runs a line of Python: while the process's threads leave it free
    the probe is late by the clock's slack (~0.1 ms); while they keep it busy, by up to the
    switch interval (``sys.getswitchinterval()``, 5 ms) per thread ahead of it. A mean wait
    near the switch interval says the server is bound by its interpreter lock, whatever
    its cores and links have to spare. Where every core is busy the wait includes the
    wait for a core (the two are told apart by the machine's load). The probe itself holds
    the lock a few microseconds per wake.
    """

    def __init__(self, observe: Callable[[float], None], interval: float = 0.005) -> None:
        if interval <= 0:
            raise ValueError(f"interval: expected seconds > 0, got {interval!r}")
        self._observe = observe
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)

    def start(self) -> GilProbe:
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            asked = time.perf_counter()
            if self._stop.wait(self._interval):
                return
            self._observe(max(0.0, time.perf_counter() - asked - self._interval))

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


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
        self.gil_wait = Histogram("graphfeed_gil_wait_seconds",
                                  "How late a thread ran after a 5 ms sleep: its wait for the "
                                  "interpreter lock (probed while metrics are served)",
                                  ["partition"], buckets=GIL_BUCKETS, registry=r).labels(**labels)
        self._layer = Gauge("graphfeed_threading_layer",
                            "1 for the Numba threading layer the server's parallel CPU kernels "
                            "run on (omp, tbb, or workqueue: one parallel kernel at a time)",
                            ["partition", "layer"], registry=r)
        self._held = Gauge("graphfeed_held_bytes",
                           "Bytes of the graph the server holds, once loaded (memory-mapped "
                           "files count their size): what (structure, features) and whose "
                           "(extent: the partition's own, or the full graph's)",
                           ["partition", "what", "extent"], registry=r)
        self._evicted = Counter("graphfeed_streams_evicted",
                                "Streams a server ended to free their slot, by reason: fair_share "
                                "(taken back from a client over its share while another waited), "
                                "idle (--stream-idle-timeout)", ["partition", "reason"], registry=r)
        self._partition = str(partition)
        self._http: Any = None
        self._probe: GilProbe | None = None

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

    def evicted(self, reason: str) -> None:
        """A stream was ended to free its slot (``fair_share`` or ``idle``)."""
        self._evicted.labels(self._partition, reason).inc()

    def watch(self, collector: Collector) -> None:
        """Export what ``collector`` reports at every scrape (e.g. per-client usage)."""
        self.registry.register(collector)

    def threading_layer(self, layer: str) -> None:
        """The parallel CPU kernels run on Numba's threading layer ``layer``."""
        self._layer.labels(self._partition, layer).set(1)

    def held(self, what: str, extent: str, nbytes: int) -> None:
        """The loaded server holds ``nbytes`` of ``what`` (``structure``, ``features``),
        the partition's own or the full graph's (``extent``)."""
        self._held.labels(self._partition, what, extent).set(nbytes)

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
        self._probe = GilProbe(self.gil_wait.observe).start()
        bound = int(self._http.server_port)
        log.info("partition=%s: metrics on http://%s:%d/metrics", self._partition, host, bound)
        return bound

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
