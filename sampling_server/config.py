"""Sampling server configuration: one :class:`ServerConfig` per server process, built
from command-line flags or from a ``cluster.yaml`` that names every server.

``cluster.yaml``::

    defaults:                 # optional; any ServerConfig field except partition/peers
      partition_dir: /data/products-4
      device: auto
      workers: 4
    servers:                  # one entry per partition; the list order does not matter
      - {partition: 0, address: node0:50051}
      - {partition: 1, address: node1:50051, device: cpu}   # per-server overrides

A server's ``listen`` address defaults to ``0.0.0.0:<port of its address>``; its
``peers`` are the servers' addresses indexed by partition ID.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from protos import codec
from protos.sizes import parse_cache_amount
from sampling_server.feature_placement import parse_gpu_cache_size
from sampling_server.sampler.hot_order import HOT_ORDER, HOT_ORDERS

#: Port a server listens on when nothing else is said.
DEFAULT_PORT = 50051
VERIFY_MODES: tuple[str, ...] = ("full", "size")
_DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
_TOPOLOGIES: tuple[str, ...] = ("device", "uva")
#: What graph structure a server samples from: its own partition's in-edges, every
#: node's, or the latter where it costs little (:mod:`sampling_server.structure`).
STRUCTURES: tuple[str, ...] = ("auto", "partition", "full")
#: Whose features and labels a server gathers itself: its own partition's nodes' (the
#: owners answer for the others), every node's, or the latter where it costs little.
FEATURE_HOLDINGS: tuple[str, ...] = STRUCTURES


class ConfigError(ValueError):
    """A server configuration (flags or cluster.yaml) is invalid; names the setting."""


@dataclass(frozen=True)
class ServerConfig:
    """Everything one sampling server needs to know."""

    #: Partition directory (holds ``manifest.json``), as written by the partitioner.
    partition_dir: Path
    #: The partition this server holds.
    partition: int
    #: ``host:port`` to bind; port 0 picks a free port (see ``create_server``).
    listen: str = f"0.0.0.0:{DEFAULT_PORT}"
    #: ``host:port`` of every partition's server, indexed by partition ID (this server's
    #: own entry included: the address others reach it at). May be empty for a graph of
    #: one partition.
    peers: tuple[str, ...] = ()
    #: Sampling device: ``auto`` (CUDA when usable, else CPU), ``cpu`` or ``cuda``.
    device: str = "auto"
    #: Where the CUDA sampler keeps the graph: ``device`` memory or pinned host memory
    #: read over ``uva`` (graphs bigger than the GPU). Ignored on the CPU.
    topology: str = "device"
    #: Where the CUDA sampler keeps the features, apart from the graph: the hottest rows
    #: (in-degree order) in GPU memory, the rest in pinned host memory read over UVA. A
    #: fraction of the partition's rows (0.2, "20%"), a size ("2GiB"), or "auto": every
    #: row when they fit in half the GPU's free memory, else the hot rows that do.
    #: Ignored on the CPU.
    gpu_cache_size: str | float = "auto"
    #: The in-edges the server samples from: ``partition`` (its own nodes'; the other
    #: partitions' servers draw their nodes' neighbors, one peer call per hop), ``full``
    #: (every partition's structure files, read from ``partition_dir`` at start-up and
    #: held in memory, ``8 E + 16 N`` bytes, ``4 E`` more with weights: every hop drawn
    #: here, the same draws, no peer asked; features still come from their owners), or
    #: ``auto``: ``full`` where every partition's files are there and the structure takes
    #: at most a quarter of the available memory (:mod:`sampling_server.structure`), else
    #: ``partition``. Typed graphs: ``partition`` (``auto`` means it there).
    structure: str = "auto"
    #: The features and labels the server gathers itself: ``partition`` (its own nodes';
    #: the other partitions' servers answer for theirs, one peer call per batch), ``full``
    #: (every partition's ``x`` and ``y``, read from ``partition_dir`` at start-up and held
    #: in memory, ``N F`` feature values and ``8 N`` bytes of labels: every row gathered
    #: here, no peer asked; a CUDA sampler's feature table then holds them all, and needs
    #: the whole structure too), or ``auto``: ``full`` where every partition's files are
    #: there and they take at most a quarter of the memory available once the structure
    #: is loaded (on a CUDA server: where it holds the whole structure), else
    #: ``partition``. Typed graphs: ``partition`` (``auto`` means it there).
    features: str = "auto"
    #: Threads sampling batches, shared by every stream. None: half the CPUs this process
    #: may use, from 2 to 6 (:func:`sampling_server.threads.sampling_workers`).
    workers: int | None = None
    #: CPU threads each sampling call may use (Numba kernels; torch ops too when the
    #: server runs as its own process). None: the CPUs this process may use (its CPU
    #: affinity and its cgroup's CPU quota, e.g. a container's limit).
    threads: int | None = None
    #: Batches each stream samples ahead of the one being sent (back-pressure bound).
    prefetch: int = 4
    #: Bytes of batches each stream samples ahead at most, besides ``prefetch`` (at least
    #: one batch; None: ``prefetch`` alone bounds it): a server's memory for batches
    #: sampled ahead is then about its streams times this, whatever a batch weighs.
    prefetch_bytes: int | None = None
    #: Tensor bytes per stream message (<= 63 MiB).
    chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES
    #: Deadline, in seconds, of every call to a peer (and of peer health probes, capped
    #: at 5 s): a dead or stuck peer fails a stream within this time.
    peer_timeout: float = 30.0
    #: Partition check at load: ``full`` (sizes, headers and SHA-256) or ``size``.
    verify: str = "full"
    #: Memory-map the partition's arrays (True) or read them into memory (False).
    mmap: bool = True
    #: The rule ordering this partition's nodes for trainers' feature caches (one of
    #: :data:`~sampling_server.sampler.hot_order.HOT_ORDERS`, ``ClusterInfo.hot_order``).
    hot_order: str = HOT_ORDER
    #: Trainer streams served at once; more get RESOURCE_EXHAUSTED (keeps gRPC threads
    #: free for peer calls, so servers never starve each other). They are shared fairly
    #: among clients (sampling_server/stream_slots.py).
    max_streams: int = 32
    #: Streams one client (a trainer rank: its authenticated identity or host, and its
    #: client ID) may hold; more get RESOURCE_EXHAUSTED. None: max_streams.
    max_client_streams: int | None = None
    #: Bytes of stream messages sent to one client and not yet acknowledged by it (its
    #: application reads slower than the server sends) above which its new streams are
    #: refused.
    max_client_inflight_bytes: int = 1 << 30
    #: Seconds a client below its fair share waits for a stream slot to come free before
    #: one is taken back from a client over its share (RESOURCE_EXHAUSTED; that trainer
    #: resumes the stream from its next batch). Less than ``admit_wait``.
    stream_evict_after: float = 1.0
    #: Seconds a new stream of a client below its fair share waits for a slot (freed, or
    #: taken back from a client over its share) before RESOURCE_EXHAUSTED.
    admit_wait: float = 5.0
    #: Seconds SIGTERM/SIGINT give running streams to finish before they are cancelled.
    grace: float = 30.0
    #: Seconds between peer health probes while every peer is up (probes back off from
    #: 0.1 s to this while a peer is down).
    health_interval: float = 2.0
    #: Most hops (fanouts) one request may ask for.
    max_hops: int = 8
    #: Largest fanout of one hop (-1, all neighbors, is bounded by max_batch_edges).
    max_fanout: int = 10_000
    #: Largest batch_size of an epoch request.
    max_batch_size: int = 1 << 17
    #: Most edges one batch (or one peer SampleNeighbors call) may sample in the worst
    #: case the request allows (batch_size x fanouts, a hop of -1 counting every edge of
    #: the graph); bounds the memory one request can take. Nodes per batch are at most
    #: batch_size plus this.
    max_batch_edges: int = 1 << 22
    #: Most node IDs one peer request (SampleNeighbors, FetchNodeData) may carry.
    max_peer_nodes: int = 1 << 22
    #: Seconds a stream's trainer may leave the batches sent to it unacknowledged (it
    #: does not read) before the stream is cancelled and its slot freed.
    stream_idle_timeout: float = 120.0
    #: TLS: this server's certificate chain and key (PEM); both or neither.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: TLS: the cluster's CA (PEM). Clients and peers must present certificates it
    #: signed (mutual TLS), and peers' certificates are checked against it.
    tls_ca: Path | None = None
    #: Port of the Prometheus endpoint (``/metrics``, on the listen host); None: off,
    #: 0: any free port.
    metrics_port: int | None = None
    #: File holding the bearer token every caller must send (also read from
    #: $GRAPHFEED_TOKEN_FILE or $GRAPHFEED_TOKEN; never a command-line value).
    token_file: Path | None = None
    #: Serve beyond loopback without TLS or a token. Off: such a server refuses to start
    #: (secure by default); on loopback a server starts either way.
    insecure: bool = False
    #: Where node tensors' snapshots are written and read, in its ``p<partition>``
    #: (None: ``partition_dir``'s ``state``); servers may share one.
    state_dir: Path | None = None
    #: Memory the node tensors and their optimizer state may take: a fraction of the
    #: host's memory (``0.5``, ``"50%"``) or a size (``"8GiB"``).
    node_tensor_memory: str | float = "50%"

    def __post_init__(self) -> None:
        object.__setattr__(self, "partition_dir", Path(self.partition_dir))
        object.__setattr__(self, "peers", tuple(str(p) for p in self.peers))
        for name in ("tls_cert", "tls_key", "tls_ca", "token_file", "state_dir"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
        _check((self.tls_cert is None) == (self.tls_key is None), "tls_cert, tls_key",
               "both or neither", (self.tls_cert, self.tls_key))
        _check(self.tls_ca is None or self.tls_cert is not None, "tls_ca",
               "tls_cert and tls_key too (mutual TLS)", self.tls_ca)
        _check(self.partition >= 0, "partition", "an ID >= 0", self.partition)
        _check(_is_address(self.listen), "listen", "'host:port'", self.listen)
        for i, peer in enumerate(self.peers):
            _check(_is_address(peer), f"peers[{i}]", "'host:port'", peer)
        for name, allowed in (("device", _DEVICES), ("topology", _TOPOLOGIES), ("structure", STRUCTURES),
                              ("features", FEATURE_HOLDINGS)):
            _check(getattr(self, name) in allowed, name, f"one of {list(allowed)}", getattr(self, name))
        _check(not (self.features == "full" and self.device == "cuda"
                    and self.structure == "partition"), "features",
               "'auto' or 'partition' with device 'cuda' and structure 'partition' (the CUDA "
               "sampler orders its feature table by the in-degree of the nodes it holds)",
               self.features)
        try:
            parse_gpu_cache_size(self.gpu_cache_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        _check(self.workers is None or (type(self.workers) is int and self.workers >= 1),
               "workers", "an integer >= 1 or None (automatic)", self.workers)
        _check(self.threads is None or (type(self.threads) is int and self.threads >= 1),
               "threads", "an integer >= 1 or None (automatic)", self.threads)
        _check(self.prefetch >= 1, "prefetch", "an integer >= 1", self.prefetch)
        _check(self.prefetch_bytes is None or self.prefetch_bytes >= 1, "prefetch_bytes",
               "bytes >= 1 or None (prefetch alone)", self.prefetch_bytes)
        _check(1 <= self.chunk_bytes <= codec.MAX_CHUNK_BYTES, "chunk_bytes",
               f"1 .. {codec.MAX_CHUNK_BYTES}", self.chunk_bytes)
        _check(self.peer_timeout > 0, "peer_timeout", "seconds > 0", self.peer_timeout)
        _check(self.verify in VERIFY_MODES, "verify", f"one of {list(VERIFY_MODES)}", self.verify)
        _check(self.hot_order in HOT_ORDERS, "hot_order", f"one of {list(HOT_ORDERS)}", self.hot_order)
        _check(self.max_streams >= 1, "max_streams", "an integer >= 1", self.max_streams)
        _check(self.max_client_streams is None or self.max_client_streams >= 1,
               "max_client_streams", "an integer >= 1 or None (max_streams)",
               self.max_client_streams)
        _check(self.max_client_inflight_bytes >= 1, "max_client_inflight_bytes", "bytes >= 1",
               self.max_client_inflight_bytes)
        _check(self.stream_evict_after > 0, "stream_evict_after", "seconds > 0",
               self.stream_evict_after)
        _check(self.admit_wait > 0, "admit_wait", "seconds > 0", self.admit_wait)
        _check(self.stream_evict_after < self.admit_wait, "stream_evict_after",
               f"seconds < admit_wait ({self.admit_wait:g}: a waiting client must get a slot "
               "taken back for it before its wait ends)", self.stream_evict_after)
        _check(isinstance(self.insecure, bool), "insecure", "true or false", self.insecure)
        _check(self.grace >= 0, "grace", "seconds >= 0", self.grace)
        _check(self.health_interval > 0, "health_interval", "seconds > 0", self.health_interval)
        for name in ("max_hops", "max_fanout", "max_batch_size", "max_batch_edges",
                     "max_peer_nodes"):
            _check(getattr(self, name) >= 1, name, "an integer >= 1", getattr(self, name))
        _check(self.metrics_port is None or 0 <= self.metrics_port < 65536, "metrics_port",
               "a port 0 .. 65535", self.metrics_port)
        _check(self.stream_idle_timeout > 0, "stream_idle_timeout", "seconds > 0",
               self.stream_idle_timeout)
        try:
            memory = parse_cache_amount(self.node_tensor_memory, "node_tensor_memory", _MEMORY)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        _check(memory.kind != "auto", "node_tensor_memory", _MEMORY, self.node_tensor_memory)

    @property
    def node_tensor_dir(self) -> Path:
        """Where this server's node tensor snapshots live (:attr:`state_dir`)."""
        return (self.state_dir or self.partition_dir / "state") / f"p{self.partition}"

    def node_tensor_bytes(self, host_memory: int) -> int:
        """The bytes :attr:`node_tensor_memory` allows on a host of ``host_memory`` bytes."""
        size = parse_cache_amount(self.node_tensor_memory, "node_tensor_memory", _MEMORY)
        return int(size.amount if size.kind == "bytes" else size.amount * host_memory)

    def replace(self, **changes: Any) -> ServerConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    @staticmethod
    def from_cluster_yaml(
        path: str | Path, partition: int, **overrides: Any
    ) -> ServerConfig:
        """The config of the server of ``partition`` in the cluster file ``path``;
        ``overrides`` (non-None values) win over the file."""
        return config_from_cluster(load_cluster_file(path), partition, source=str(path),
                                   **overrides)


_MEMORY = "a fraction of the host's memory (0.5, '50%') or a size ('8GiB')"


def _check(ok: bool, name: str, expected: str, got: object) -> None:
    if not ok:
        raise ConfigError(f"{name}: expected {expected}, got {got!r}")


def _is_address(address: object) -> bool:
    if not isinstance(address, str) or ":" not in address:
        return False
    host, port = address.rsplit(":", 1)
    return bool(host) and port.isdigit() and int(port) < 65536


def load_cluster_file(path: str | Path) -> dict[str, Any]:
    """Read a cluster YAML file (safe loader; no Python objects)."""
    p = Path(path)
    try:
        obj = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the cluster file ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({exc})") from exc
    if not isinstance(obj, dict):
        raise ConfigError(f"{p}: expected a mapping with 'servers', got {type(obj).__name__}")
    return obj


#: Fields a cluster file may set in ``defaults`` or per server.
_FILE_FIELDS = frozenset(f.name for f in dataclasses.fields(ServerConfig)) - {"partition", "peers"}


def config_from_cluster(
    cluster: Mapping[str, Any], partition: int, *, source: str = "cluster.yaml",
    **overrides: Any,
) -> ServerConfig:
    """The :class:`ServerConfig` of ``partition`` from a parsed cluster file."""
    unknown = sorted(set(cluster) - {"servers", "defaults"})
    if unknown:
        raise ConfigError(f"{source}: unknown top-level keys {unknown}; expected servers, defaults")
    defaults = cluster.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{source}: defaults: expected a mapping, got {defaults!r}")
    _check_keys(defaults, _FILE_FIELDS, f"{source}: defaults")
    servers = _servers_by_partition(cluster.get("servers"), source)
    if partition not in servers:
        raise ConfigError(f"{source}: servers: no entry for partition {partition} "
                          f"(partitions listed: {sorted(servers)})")
    peers = tuple(str(servers[p]["address"]) for p in range(len(servers)))
    own = {k: v for k, v in servers[partition].items() if k not in ("partition", "address")}
    _check_keys(own, _FILE_FIELDS, f"{source}: servers[partition={partition}]")
    settings: dict[str, Any] = {**defaults, **own}
    settings.setdefault("listen", f"0.0.0.0:{peers[partition].rsplit(':', 1)[1]}")
    settings.update({k: v for k, v in overrides.items() if v is not None})
    if "partition_dir" not in settings:
        raise ConfigError(f"{source}: partition_dir: not set (in defaults, the server's entry, "
                          "or --partition-dir)")
    try:
        return ServerConfig(partition=partition, peers=peers, **settings)
    except TypeError as exc:
        raise ConfigError(f"{source}: {exc}") from exc


def _check_keys(obj: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; expected some of {sorted(allowed)}")


def _servers_by_partition(servers: object, source: str) -> dict[int, dict[str, Any]]:
    if not isinstance(servers, list) or not servers:
        raise ConfigError(f"{source}: servers: expected a non-empty list of "
                          f"{{partition, address}} entries, got {servers!r}")
    out: dict[int, dict[str, Any]] = {}
    for i, entry in enumerate(servers):
        where = f"{source}: servers[{i}]"
        if not isinstance(entry, dict) or "partition" not in entry or "address" not in entry:
            raise ConfigError(f"{where}: expected a mapping with partition and address, got {entry!r}")
        p = entry["partition"]
        if not isinstance(p, int) or p < 0:
            raise ConfigError(f"{where}.partition: expected an integer >= 0, got {p!r}")
        if p in out:
            raise ConfigError(f"{where}.partition: {p} is listed twice")
        _check(_is_address(entry["address"]), f"{where}.address", "'host:port'", entry["address"])
        out[p] = dict(entry)
    missing = sorted(set(range(len(out))) - set(out))
    if missing:
        raise ConfigError(f"{source}: servers: expected partitions 0 .. {len(out) - 1}, "
                          f"missing {missing}")
    return out


def parse_peers(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"a:1,b:2"`` (or a list) as a tuple of addresses."""
    items = text.split(",") if isinstance(text, str) else list(text)
    return tuple(item.strip() for item in items if item.strip())
