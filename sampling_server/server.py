"""The sampling server process: gRPC server, health (:mod:`sampling_server.health`),
background load, shutdown.

:func:`create_server` builds and binds a server (port 0 picks a free one) and returns it
with its port, without starting it; :meth:`SamplingServer.start` starts serving at once
and loads the partition in the background, so the health service answers
``NOT_SERVING`` (rather than nothing) while a big partition loads. :func:`serve` is the
process's main loop: start, wait for SIGTERM/SIGINT, set health NOT_SERVING, let
running streams finish for ``grace`` seconds, exit.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2

from protos import fastwire
from protos import sampling_pb2 as pb
from protos.channel import server_options
from protos.ports import write_port_file
from protos.security import Security, SecurityError, read_token, require_credentials
from sampling_server.config import ConfigError, ServerConfig
from sampling_server.errors import MalformedRequest, bounded, lenient
from sampling_server.health import PEER_SERVICE, SAMPLING_SERVICE, HealthMonitor
from sampling_server.metrics import ServerMetrics
from sampling_server.node_tensor_service import NodeTensorCollector, NodeTensorServicer
from sampling_server.node_tensors import NodeTensors
from sampling_server.peer_client import PeerClient
from sampling_server.peer_service import PeerServicer
from sampling_server.pipeline import SamplingPipeline
from sampling_server.sampler import cpu_kernels
from sampling_server.servicer import SamplingServicer
from sampling_server.store import PartitionStore
from sampling_server.stream_slots import SlotCollector
from sampling_server.structure import total_host_memory
from sampling_server.threads import kernel_threads, limit_kernel_threads

log = logging.getLogger(__name__)

NODE_TENSOR_SERVICE = "graphfeed.v1.NodeTensorService"
#: gRPC handler threads beyond ``max_streams``: peer calls, health checks, cluster info.
EXTRA_HANDLER_THREADS = 32
#: Longest time a draining server gives peer calls in flight once it stops.
PEER_DRAIN_S = 2.0
#: A draining server whose own streams are done still answers its peers (their streams
#: may need this partition to the end of their epoch) until none has called for this
#: long, or the grace period is over.
PEER_QUIET_S = 5.0
#: Longest the main thread sleeps in one wait. CPython runs signal handlers in the main
#: thread only, and the kernel may hand SIGTERM to any thread: a main thread blocked on a
#: lock without a timeout is then not woken, and the handler waits until something else
#: wakes it (seen as a drain that never started). Waking this often bounds that delay.
SIGNAL_POLL_S = 0.2

# -- request handlers --------------------------------------------------------------------
def _guarded(method: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(request.describe()))
        return method(request, context)
    return handle


#: A method's handler factory by (client streaming, server streaming).
_HANDLER_OF = {(False, False): grpc.unary_unary_rpc_method_handler,
               (False, True): grpc.unary_stream_rpc_method_handler,
               (True, False): grpc.stream_unary_rpc_method_handler,
               (True, True): grpc.stream_stream_rpc_method_handler}


def _add_services(server: grpc.Server, servicers: dict[str, object]) -> None:
    """Serve every method of each service of ``sampling.proto`` by the servicer's method of
    the same name: requests parsed leniently (a malformed one is INVALID_ARGUMENT naming
    its type; a streamed request's handler checks each message), replies serialized, or
    passed on where the handler built their bytes itself."""
    for full_name, servicer in servicers.items():
        handlers = {}
        for m in pb.DESCRIPTOR.services_by_name[full_name.rsplit(".", 1)[1]].methods:
            impl = getattr(servicer, m.name)
            handlers[m.name] = _HANDLER_OF[m.client_streaming, m.server_streaming](
                impl if m.client_streaming else _guarded(impl), lenient(getattr(pb, m.input_type.name)),
                fastwire.passthrough)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(full_name, handlers),))
        server.add_registered_method_handlers(full_name, handlers)


def _add_health(server: grpc.Server, servicer: health.HealthServicer) -> None:
    """The standard health service, with the lenient request parser (a malformed
    request gets INVALID_ARGUMENT, not INTERNAL)."""
    request = health_pb2.HealthCheckRequest
    reply = health_pb2.HealthCheckResponse.SerializeToString
    handlers = {
        "Check": grpc.unary_unary_rpc_method_handler(_guarded(servicer.Check), lenient(request),
                                                     reply),
        "Watch": grpc.unary_stream_rpc_method_handler(_guarded(servicer.Watch), lenient(request),
                                                      reply),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(health.SERVICE_NAME, handlers),))


# -- the server ----------------------------------------------------------------------------
class SamplingServer(grpc.Server):
    """A bound sampling server (a ``grpc.Server``): :meth:`start` serves and loads the
    partition in the background; :meth:`stop` drains and releases everything."""

    def __init__(self, config: ServerConfig, store: PartitionStore, server: grpc.Server,
                 port: int, metrics: ServerMetrics | None = None, threads: int | None = None) -> None:
        self.config = config
        self.store = store
        #: The bound port.
        self.port = port
        #: Set when the process should shut down (a signal, or the partition failed to load).
        self.shutdown_requested = threading.Event()
        self._grpc = server
        self._health = health.HealthServicer()
        _add_health(server, self._health)
        self.pipeline = SamplingPipeline(store, None, workers=config.workers,
                                         prefetch=config.prefetch, chunk_bytes=config.chunk_bytes,
                                         threads=threads or config.threads,
                                         prefetch_bytes=config.prefetch_bytes)
        self.sampling = SamplingServicer(store, self.pipeline)
        #: Model state on this server (``NodeTensorService``), whose rows batches may carry.
        self.node_tensors = NodeTensors(store, config.node_tensor_dir,
                                        config.node_tensor_bytes(total_host_memory() or 0))
        self.pipeline.node_tensors = self.node_tensors
        self.peer_servicer = peer_servicer = PeerServicer(store, config.chunk_bytes, self.node_tensors)
        _add_services(server, {SAMPLING_SERVICE: self.sampling, PEER_SERVICE: peer_servicer,
                               NODE_TENSOR_SERVICE: NodeTensorServicer(store, self.node_tensors,
                                                                       config.chunk_bytes)})
        #: Counters and latencies (served over HTTP when ``metrics_port`` is set).
        self.metrics = metrics or ServerMetrics(store.partition_id)
        self.pipeline.metrics = self.sampling.metrics = peer_servicer.metrics = self.metrics
        self.metrics.watch(SlotCollector(self.sampling.slots, store.partition_id))
        self.metrics.watch(NodeTensorCollector(self.node_tensors, store.partition_id))
        #: The bound metrics port (None: no endpoint).
        self.metrics_port: int | None = None
        self.monitor: HealthMonitor | None = None
        self.peers: PeerClient | None = None
        self._started = False
        self._stopped = threading.Event()

    def set_peers(self, peers: Sequence[str]) -> None:
        """Set every partition's address (e.g. once all test servers know their ports);
        only before :meth:`start`."""
        if self._started:
            raise RuntimeError("set_peers: the server has started")
        self.store.set_peers(tuple(peers))

    def start(self) -> None:
        if self._started:
            raise RuntimeError("start: the server has started already")
        self._started = True
        addresses = self.store.peer_addresses
        if len(addresses) > 1:
            self.peers = PeerClient(addresses, self.store.partition_id,
                                    timeout=self.config.peer_timeout,
                                    security=server_security(self.config),
                                    fingerprint=self.store.graph_fingerprint)
            self.pipeline.peers = self.peers
            self.peers.metrics = self.metrics
        self.monitor = HealthMonitor(self._health, self.store.partition_id, self.peers,
                                     probe_timeout=self.config.peer_timeout,
                                     interval=self.config.health_interval,
                                     fingerprint=self.store.graph_fingerprint)
        monitor = self.monitor
        self.sampling.peer_problem = lambda: monitor.problem
        if self.config.metrics_port is not None:
            host = self.config.listen.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"
            self.metrics_port = self.metrics.serve(host, self.config.metrics_port)
        self._grpc.start()
        log.info("partition=%d: listening on port %d (bound to %s); loading %s",
                 self.store.partition_id, self.port, self.config.listen.rsplit(":", 1)[0],
                 self.config.partition_dir)
        threading.Thread(target=self._load, name="partition-load", daemon=True).start()

    def _load(self) -> None:
        try:
            self.store.load()
        except Exception:
            log.exception("partition=%d: failed to load %s; health stays NOT_SERVING",
                          self.store.partition_id, self.config.partition_dir)
            self.shutdown_requested.set()
            return
        try:  # metrics only: serve without them, say why
            for what, (extent, nbytes) in self.store.held_bytes().items():
                self.metrics.held(what, extent, nbytes)
        except Exception:
            log.exception("partition=%d: the held bytes could not be counted",
                          self.store.partition_id)
        self._report_threading_layer()
        try:  # before SERVING: a peer reading this order must not wait past its deadline
            for node_type in self.store.feature_dtypes:  # one order per featured type
                self.pipeline.hot_of(node_type).own_order()
        except Exception:  # the cache is an optimization: serve without it, say why
            log.exception("partition=%d: no hot order for trainers' feature caches",
                          self.store.partition_id)
        if self.monitor is not None and not self._stopped.is_set():
            self.monitor.loaded()

    def _report_threading_layer(self) -> None:
        """Log (a warning for ``workqueue``) and export the threading layer of the CPU
        kernels, which decides whether concurrent batches share the cores."""
        try:
            layer = cpu_kernels.log_threading_layer(log, f"partition={self.store.partition_id}: ")
        except Exception:  # no layer at all: the first parallel kernel will say why
            log.exception("partition=%d: no Numba threading layer could be loaded",
                          self.store.partition_id)
            return
        self.metrics.threading_layer(layer)

    def wait_until_loaded(self, timeout: float | None = None) -> bool:
        """Wait until the partition is loaded; False on timeout or failure."""
        return self.store.wait_loaded(timeout)

    def wait_until_serving(self, timeout: float | None = None) -> bool:
        """Wait until health is SERVING (loaded, peers reachable); False on timeout."""
        return self.monitor is not None and self.monitor.serving.wait(timeout)

    def drain(self, grace: float) -> threading.Event:
        """Shut down gently: refuse new trainer streams (UNAVAILABLE) and turn
        NOT_SERVING for trainers, but keep answering peers until this server's own
        streams are done and its peers have not called for :data:`PEER_QUIET_S` (or
        ``grace`` seconds passed: then streams are cancelled); then :meth:`stop`, giving
        peer calls in flight up to :data:`PEER_DRAIN_S`."""
        started = time.monotonic()
        self.sampling.draining.set()
        if self.monitor is not None:
            self.monitor.drain()
        finished = self.sampling.wait_streams_done(grace, poll=SIGNAL_POLL_S)
        if finished:  # the other servers' streams may still need this partition
            finished = self.peer_servicer.wait_quiet(PEER_QUIET_S, started + grace)
        waited = time.monotonic() - started
        log.info("partition=%d: %s after %.1f s; stopping", self.store.partition_id,
                 "streams done, peers quiet" if finished
                 else f"grace of {grace:g} s over, cancelling streams", waited)
        return self.stop(min(PEER_DRAIN_S, max(grace - waited, 0.0)))

    def stop(self, grace: float | None) -> threading.Event:
        """Health NOT_SERVING, refuse new calls, give running ones ``grace`` seconds
        (None: cancel them now), then release the worker pools and channels. The event
        is set once everything is released."""
        done = threading.Event()
        if self.monitor is not None:
            self.monitor.shutdown()
        self._stopped.set()
        stopped = self._grpc.stop(grace)

        def release() -> None:
            stopped.wait()
            self.pipeline.close()
            if self.peers is not None:
                self.peers.close()
            self.metrics.close()
            self.sampling.slots.close()
            done.set()

        threading.Thread(target=release, name="server-release", daemon=True).start()
        return done

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._grpc.wait_for_termination(timeout)

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Any) -> None:
        self._grpc.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers: Any) -> None:
        self._grpc.add_registered_method_handlers(service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._grpc.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self._grpc.add_secure_port(address, server_credentials)


def _advertised(listen: str, port: int) -> str:
    host = listen.rsplit(":", 1)[0]
    if host in ("0.0.0.0", "[::]", "::", ""):
        host = socket.getfqdn()
    return f"{host}:{port}"


def server_security(config: ServerConfig) -> Security:
    """The TLS files and token of ``config`` (used to serve, and to call the peers)."""
    try:
        return Security(ca=config.tls_ca, cert=config.tls_cert, key=config.tls_key,
                        token=read_token(config.token_file))
    except SecurityError as exc:
        raise ConfigError(str(exc)) from exc


def listening_security(config: ServerConfig) -> Security:
    """:func:`server_security`, refused (ConfigError) for a server that would listen
    beyond loopback without TLS or a token unless ``config.insecure`` says so."""
    security = server_security(config)
    try:
        require_credentials(config.listen, security, config.insecure)
    except SecurityError as exc:
        raise ConfigError(str(exc)) from exc
    if config.insecure and not (security.tls or security.token):
        log.warning("partition=%d: --insecure: serving %s without TLS or a token; anyone who "
                    "reaches it can read the whole graph", config.partition, config.listen)
    return security


def open_store(config: ServerConfig) -> PartitionStore:
    """The store of ``config``'s partition (plain or typed)."""
    return PartitionStore(config)


def create_server(config: ServerConfig) -> tuple[SamplingServer, int]:
    """Build and bind the server of ``config`` (not started). Returns it and the bound
    port (``listen`` may say port 0). Reads the manifest at once, so a wrong directory,
    partition ID or peer list fails here, before anything listens."""
    store = open_store(config)
    security = listening_security(config)
    metrics = ServerMetrics(config.partition)
    handlers = config.max_streams + EXTRA_HANDLER_THREADS
    threads = kernel_threads(config.threads)  # resolved once, for the pipeline too
    # Handlers run peers' gathers and samples: the same per-call thread limit.
    pool = ThreadPoolExecutor(handlers, thread_name_prefix="grpc", initializer=limit_kernel_threads,
                              initargs=(threads,))
    grpc_server = grpc.server(pool,
                              options=server_options(),
                              interceptors=security.interceptors(metrics.rejected))
    try:
        port = (grpc_server.add_secure_port(config.listen, security.server_credentials())
                if security.tls else grpc_server.add_insecure_port(config.listen))
    except RuntimeError as exc:
        raise ConfigError(f"listen: cannot bind {config.listen} ({exc}); is the port taken?") from exc
    if port == 0:
        raise ConfigError(f"listen: cannot bind {config.listen}; is the port taken?")
    if not config.peers and store.manifest.num_partitions == 1:
        store.set_peers((_advertised(config.listen, port),))
    return SamplingServer(config, store, grpc_server, port, metrics, threads), port


def wait_in_main_thread(event: threading.Event) -> None:
    """``event.wait()``, waking every :data:`SIGNAL_POLL_S` so that signal handlers run."""
    while not event.wait(SIGNAL_POLL_S):
        pass


def serve(config: ServerConfig, port_file: Path | None = None) -> int:
    """Run a server until SIGTERM/SIGINT; returns the exit code (0 after a clean drain,
    1 when the partition failed to load). A second signal cancels running streams.
    ``port_file``: where to write the bound port once the server has started."""
    server, port = create_server(config)
    # This process is the server's own: its torch ops (relabel, gathers) keep to the limit
    # too (torch's own default, physical cores, stays when no limit is lower).
    torch.set_num_threads(config.threads or min(torch.get_num_threads(), server.pipeline.threads))
    log.info("partition=%d: %d sampling workers x %d CPU threads per call",
             config.partition, server.pipeline.workers, server.pipeline.threads)
    signals = 0

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal signals
        signals += 1
        name = signal.Signals(signum).name
        if signals == 1:
            log.info("partition=%d: %s: draining (grace %g s)", config.partition, name, config.grace)
            server.shutdown_requested.set()
        else:
            log.warning("partition=%d: %s again: cancelling running streams", config.partition, name)
            server._grpc.stop(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    server.start()
    if port_file is not None:
        write_port_file(port_file, port)
    wait_in_main_thread(server.shutdown_requested)
    failed = server.store.load_error is not None
    wait_in_main_thread(server.stop(0) if failed else server.drain(config.grace))
    log.info("partition=%d: stopped", config.partition)
    return 1 if failed else 0
