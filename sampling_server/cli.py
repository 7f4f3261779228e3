"""Command line: ``graphfeed-server`` / ``python -m sampling_server``."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import functools
import io
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from partitioner.format import PartitionFormatError
from protos import allocator, codec
from sampling_server.config import (
    DEFAULT_PORT,
    FEATURE_HOLDINGS,
    STRUCTURES,
    VERIFY_MODES,
    ConfigError,
    ServerConfig,
    parse_peers,
)
from sampling_server.feature_placement import parse_gpu_cache_size
from sampling_server.sampler.hot_order import HOT_ORDERS

log = logging.getLogger("sampling_server")
#: Seconds the process may take to exit once the server stopped.
EXIT_TIMEOUT_S = 20.0

EXAMPLES = f"""\
examples:
  # one server per partition; every server lists all addresses, in partition order;
  # beyond loopback a server needs a token (or TLS), read from a file, or --insecure
  graphfeed-server --partition-dir data/small-2 --partition 0 --listen 0.0.0.0:{DEFAULT_PORT} \\
      --peers node0:{DEFAULT_PORT},node1:{DEFAULT_PORT} --token-file /etc/graphfeed/token
  # the same from a cluster file naming every server (see docs/operations.md)
  graphfeed-server --cluster cluster.yaml --partition 1
  # a graph of one partition needs no peers
  graphfeed-server --partition-dir data/small-1 --partition 0 --listen 127.0.0.1:{DEFAULT_PORT}

Secure by default: a server listening beyond loopback (0.0.0.0, a host's address) with
neither --tls-cert/--tls-key nor --token-file refuses to start unless given --insecure.
Health: grpc.health.v1 on the same port; NOT_SERVING until the partition is loaded and
every peer answers. SIGTERM/SIGINT: NOT_SERVING, running streams get --grace seconds,
exit 0. SIGUSR1: every thread's stack to stderr (the server keeps running).
"""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {value}")
    return value


def _gpu_cache_size(text: str) -> str:
    try:
        parse_gpu_cache_size(text, "--gpu-cache-size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _bytes(text: str, high: int) -> int:
    """``4194304``, ``512K``, ``4M``, ``4MiB``, ``1G``, at most ``high``."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        value = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a byte size such as 4M, got {text!r}") from None
    if not 1 <= value <= high:
        raise argparse.ArgumentTypeError(f"expected 1 .. {high} bytes, got {value}")
    return value


#: A message's tensor bytes (at most :data:`codec.MAX_CHUNK_BYTES`), and bytes of memory (up to 1 TiB).
_byte_size = functools.partial(_bytes, high=codec.MAX_CHUNK_BYTES)
_memory_size = functools.partial(_bytes, high=1 << 40)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphfeed-server",
        description="Serve one partition of a partitioned graph: sample minibatches for "
        "trainers (SamplingService) and frontiers/rows for the other servers (PeerService).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_argument_group("what to serve, where")
    where.add_argument("--partition", type=int, required=True, metavar="I",
                       help="partition ID this server holds")
    where.add_argument("--partition-dir", type=Path, metavar="DIR",
                       help="partition directory (holds manifest.json); may come from --cluster")
    where.add_argument("--listen", metavar="HOST:PORT",
                       help=f"address to bind (default 0.0.0.0:{DEFAULT_PORT}, or the port of "
                       "this server's --cluster address); port 0 picks a free port")
    where.add_argument("--port-file", type=Path, metavar="PATH",
                       help="write the port this server listens on to PATH (atomically) once it "
                       "accepts calls (health says when it serves): how whoever started it with "
                       "port 0 learns the port")
    peers = where.add_mutually_exclusive_group()
    peers.add_argument("--peers", metavar="ADDR0,ADDR1,...",
                       help="every partition's server address, in partition order (this "
                       "server's own included); not needed for a single partition")
    peers.add_argument("--cluster", type=Path, metavar="FILE",
                       help="cluster YAML naming every server (servers: [{partition, address}], "
                       "optional defaults:); flags given here win over it")
    tune = parser.add_argument_group("sampling and tuning (defaults in parentheses)")
    tune.add_argument("--device", choices=("auto", "cpu", "cuda"),
                      help="sampling device (auto: CUDA when usable, else CPU)")
    tune.add_argument("--topology", choices=("device", "uva"),
                      help="CUDA only: graph in GPU memory, or pinned host memory over UVA (device)")
    tune.add_argument("--gpu-cache-size", type=_gpu_cache_size, metavar="SIZE",
                      help="CUDA only: feature rows kept in GPU memory, hottest (in-degree) "
                      "first, the rest in pinned host memory read over UVA: a fraction of the "
                      "partition's rows (0.2, 20%%), a size (2GiB), or auto: every row when the "
                      "features fit in half the GPU's free memory, else the hot rows that do; "
                      "plus 8 bytes of GPU memory per node for the slot maps (auto)")
    tune.add_argument("--structure", choices=STRUCTURES,
                      help="graph structure to sample from: this partition's in-edges, asking "
                      "the owners to draw the other nodes' neighbors (one call per hop), or the "
                      "full graph's, read from every partition's files under --partition-dir "
                      "and held in memory (8 bytes per edge, 12 with weights, and 16 per node): "
                      "every hop drawn here, the same batches, no peer calls to sample; auto: "
                      "full where every partition's files are there and it takes at most a "
                      "quarter of the available memory (auto)")
    tune.add_argument("--features", choices=FEATURE_HOLDINGS,
                      help="features and labels to gather here: this partition's nodes', asking "
                      "the owners for the other nodes' rows (one call per batch), or every "
                      "node's, read from every partition's files under --partition-dir and held "
                      "in memory (the graph's features plus 8 bytes per node): no peer calls to "
                      "gather, the same batches (on a GPU, in its feature table, which needs the "
                      "full structure too); auto: full where every partition's files are there "
                      "and they take at most a quarter of the memory available after the "
                      "structure, on a GPU where the structure is full (auto)")
    tune.add_argument("--workers", type=_positive_int,
                      help="sampling threads, shared by all streams (half the usable CPUs, 2 to 6)")
    tune.add_argument("--threads", type=_positive_int,
                      help="CPU threads per sampling call (the CPUs this process may use)")
    tune.add_argument("--prefetch", type=_positive_int, help="batches each stream samples ahead (4)")
    tune.add_argument("--prefetch-bytes", type=_memory_size, metavar="SIZE",
                      help="bytes of batches each stream samples ahead at most, e.g. 256M, at least "
                      "one batch: bounds the memory of large batches (no bound beyond --prefetch)")
    tune.add_argument("--chunk-bytes", type=_byte_size, metavar="SIZE",
                      help="tensor bytes per stream message, e.g. 4M (4M; at most 63M)")
    tune.add_argument("--peer-timeout", type=_seconds, metavar="S",
                      help="deadline of every peer call; a dead peer fails a stream within it (30)")
    tune.add_argument("--hot-order", choices=HOT_ORDERS,
                      help="rule ordering the nodes for trainers' feature caches (visits_v1)")
    tune.add_argument("--max-streams", type=_positive_int,
                      help="trainer streams served at once, shared fairly among clients (32)")
    tune.add_argument("--grace", type=_seconds, metavar="S",
                      help="seconds running streams get to finish after SIGTERM (30)")
    tune.add_argument("--health-interval", type=_seconds, metavar="S",
                      help="seconds between peer health probes (2)")
    limits = parser.add_argument_group("request limits (defaults in parentheses)")
    limits.add_argument("--max-hops", type=_positive_int, help="hops per request (8)")
    limits.add_argument("--max-fanout", type=_positive_int, help="largest fanout of a hop (10000)")
    limits.add_argument("--max-batch-size", type=_positive_int, help="largest batch_size (131072)")
    limits.add_argument("--max-batch-edges", type=_positive_int,
                        help="edges a batch may sample in the worst case its request allows; a "
                        "hop of -1 counts every edge of the graph (4194304)")
    limits.add_argument("--max-peer-nodes", type=_positive_int,
                        help="node IDs per peer request (4194304)")
    limits.add_argument("--stream-idle-timeout", type=_seconds, metavar="S",
                        help="seconds a trainer may leave the batches sent to it unacknowledged "
                        "(it does not read) before its stream is cancelled (120)")
    share = parser.add_argument_group(
        "fair share of the streams (a client: its TLS identity or host, and its client ID)")
    share.add_argument("--max-client-streams", type=_positive_int, metavar="N",
                       help="streams one client may hold (--max-streams)")
    share.add_argument("--max-client-inflight-bytes", type=_memory_size, metavar="SIZE",
                       help="bytes sent to one client and not yet acknowledged by it above "
                       "which its new streams are refused, e.g. 512M (1G)")
    share.add_argument("--stream-evict-after", type=_seconds, metavar="S",
                       help="seconds a client below its fair share waits for a slot to come "
                       "free before one is taken back from a client over its share (the "
                       "stream it reads least); that trainer resumes it from its next batch; "
                       "less than --admit-wait (1)")
    share.add_argument("--admit-wait", type=_seconds, metavar="S",
                       help="seconds a new stream of a client below its fair share waits for "
                       "a slot before RESOURCE_EXHAUSTED (5)")
    sec = parser.add_argument_group("security (see docs/operations.md)")
    sec.add_argument("--tls-cert", type=Path, metavar="PEM", help="this server's certificate chain")
    sec.add_argument("--tls-key", type=Path, metavar="PEM", help="this server's private key")
    sec.add_argument("--tls-ca", type=Path, metavar="PEM",
                     help="the cluster's CA: clients and peers must present certificates it "
                     "signed (mutual TLS)")
    sec.add_argument("--token-file", type=Path, metavar="FILE",
                     help="file holding the bearer token every caller must send (or set "
                     "GRAPHFEED_TOKEN_FILE / GRAPHFEED_TOKEN)")
    sec.add_argument("--insecure", action="store_const", const=True,
                     help="serve beyond loopback without TLS or a token (a network you trust); "
                     "without it such a server refuses to start")
    logs_early = parser.add_argument_group("metrics")
    logs_early.add_argument("--metrics-port", type=int, metavar="PORT",
                            help="serve Prometheus metrics on http://<listen host>:PORT/metrics (off)")
    state = parser.add_argument_group("node tensors (model state on the servers, docs/training.md)")
    state.add_argument("--state-dir", type=Path, metavar="DIR",
                       help="where node tensors' snapshots are written and read, in its "
                       "pPARTITION; servers may share one (PARTITION_DIR/state)")
    state.add_argument("--node-tensor-memory", metavar="SIZE",
                       help="memory node tensors and their optimizer state may take: a fraction "
                       "of the host's memory or a size, e.g. 8GiB (50%%)")
    load = parser.add_argument_group("loading")
    load.add_argument("--verify", choices=VERIFY_MODES,
                      help="check files by SHA-256 (full) or by size and header only (full)")
    load.add_argument("--no-mmap", dest="mmap", action="store_const", const=False,
                      help="read the partition into memory instead of memory-mapping it")
    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-level", default="INFO",
                      choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="(INFO)")
    logs.add_argument("--log-format", default="text", choices=("text", "json"),
                      help="text lines, or one JSON object per line (text)")
    return parser


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, thread, message (+ traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "thread": record.threadName,
            "message": record.getMessage(),
        }
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj)


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The server config the flags (and the cluster file) describe."""
    # every field but partition and peers has its flag, of the same name
    overrides: dict[str, Any] = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)
                                 if f.name not in ("partition", "peers")}
    if args.cluster is not None:
        return ServerConfig.from_cluster_yaml(args.cluster, args.partition, **overrides)
    if args.partition_dir is None:
        raise ConfigError("--partition-dir: required (or give --cluster with partition_dir)")
    given = {k: v for k, v in overrides.items() if v is not None}
    return ServerConfig(partition=args.partition, peers=parse_peers(args.peers or ""), **given)


def check_device(config: ServerConfig) -> None:
    """Refuse a sampling device this machine cannot give, before anything starts."""
    from sampling_server.sampler import cuda_usable

    if config.device == "cuda" and not cuda_usable():
        raise ConfigError("--device cuda: no usable CUDA GPU here (torch or Numba sees none, or "
                          "NUMBA_ENABLE_CUDASIM=1); use --device cpu or auto")
    if config.topology == "uva" and (config.device == "cpu" or not cuda_usable()):
        raise ConfigError("--topology uva: only the CUDA sampler reads the graph over UVA, and this "
                          "server samples on the CPU; drop --topology or run it on a GPU")
    if str(config.gpu_cache_size).strip().lower() != "auto" and (
            config.device == "cpu" or not cuda_usable()):
        raise ConfigError(f"--gpu-cache-size: expected auto on a server that samples on the CPU "
                          f"(only the CUDA sampler caches features on a GPU), got "
                          f"{config.gpu_cache_size!r}; drop --gpu-cache-size or run it on a GPU")


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` writes every thread's stack to stderr (the server keeps
    running). Skipped where stderr is no file (``main`` called in a process that
    captures it)."""
    if not hasattr(signal, "SIGUSR1"):
        return
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, io.UnsupportedOperation):
        log.debug("stderr has no file descriptor: no stack dump on SIGUSR1")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    dump_stacks_on_sigusr1()
    allocator.keep_freed_memory()
    from sampling_server.server import serve  # after logging: imports Numba and torch

    try:
        config = config_from_args(args)
        check_device(config)
        code = serve(config, port_file=args.port_file)
        # Interpreter exit joins the worker threads; should one still be stuck, dump
        # every thread's stack to stderr and exit instead of hanging.
        faulthandler.dump_traceback_later(EXIT_TIMEOUT_S, exit=True)
        return code
    except (ConfigError, PartitionFormatError) as exc:
        print(f"graphfeed-server: error: {exc}", file=sys.stderr)
        return 2
