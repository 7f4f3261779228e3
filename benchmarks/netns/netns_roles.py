"""The processes that ``benchmarks/netns/netns_link.py`` runs inside the namespaces; each prints
one JSON object on its last line of stdout (or writes it to ``--out``).

- ``tcp-sink`` / ``tcp-source``: a raw TCP transfer (the link's own throughput);
- ``tcp-echo`` / ``tcp-ping``: 1-byte round trips (the link's latency);
- ``trainer``: one trainer rank reading with ``RemoteNeighborLoader``, a fixed sleep
  standing for the model step, timed after a start barrier shared with the other rank.

    python benchmarks/netns/netns_roles.py trainer --servers 10.231.78.1:50051,... --rank 0 ...
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import wait_for

BUFFER = 1 << 20


def _emit(result: dict[str, Any], out: Path | None = None) -> None:
    text = json.dumps(result)
    if out is not None:
        out.write_text(text + "\n")
    print(text, flush=True)


def _listen(port: int, timeout: float) -> socket.socket:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    srv.settimeout(timeout)
    return srv


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    """Connect, retrying while the listener starts (up to ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((host, port), timeout=timeout)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def tcp_sink(port: int, timeout: float) -> dict[str, Any]:
    """Receive one connection until EOF; bytes and seconds from the first byte."""
    with _listen(port, timeout) as srv:
        conn, _ = srv.accept()
    buf = bytearray(BUFFER)
    got, started = 0, 0.0
    with conn:
        conn.settimeout(timeout)
        while True:
            n = conn.recv_into(buf)
            if n == 0:
                break
            if got == 0:
                started = time.perf_counter()
            got += n
    wall = time.perf_counter() - started if got else 0.0
    return {"bytes": got, "seconds": round(wall, 4),
            "gbit_per_s": round(8 * got / wall / 1e9, 3) if wall else 0.0}


def tcp_source(host: str, port: int, seconds: float, timeout: float) -> dict[str, Any]:
    """Send zeros to ``host:port`` for ``seconds``."""
    payload = bytes(BUFFER)
    sent = 0
    with _connect(host, port, timeout) as s:
        s.settimeout(timeout)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            s.sendall(payload)
            sent += len(payload)
    return {"bytes": sent}


def tcp_echo(port: int, count: int, timeout: float) -> dict[str, Any]:
    with _listen(port, timeout) as srv:
        conn, _ = srv.accept()
    with conn:
        conn.settimeout(timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            conn.sendall(conn.recv(1))
    return {"echoed": count}


def tcp_ping(host: str, port: int, count: int, timeout: float) -> dict[str, Any]:
    """``count`` 1-byte round trips; median and 10th percentile in microseconds."""
    rtts = []
    with _connect(host, port, timeout) as s:
        s.settimeout(timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            started = time.perf_counter()
            s.sendall(b"x")
            if s.recv(1) != b"x":
                raise RuntimeError("tcp-ping: the echo closed the connection early")
            rtts.append((time.perf_counter() - started) * 1e6)
    rtts.sort()
    return {"round_trips": count, "rtt_median_us": round(statistics.median(rtts), 1),
            "rtt_p10_us": round(rtts[len(rtts) // 10], 1)}


def trainer(args: argparse.Namespace) -> dict[str, Any]:
    """Fill the cache, take ``warmup`` batches, signal ready, wait for the start, take the
    ``prefetch`` batches the readers got ready meanwhile (untimed: they were made before
    the start), then time ``batches`` batches, sleeping ``step_ms`` after each (the model
    step)."""
    from protos.allocator import keep_freed_memory
    from trainer_client.loader import RemoteNeighborLoader

    keep_freed_memory()  # as graphfeed-train does
    started = time.perf_counter()
    loader = RemoteNeighborLoader(
        args.servers.split(","), "train", num_neighbors=args.fanouts, batch_size=args.batch_size,
        shuffle=True, rank=args.rank, world_size=args.world_size, prefetch=args.prefetch,
        feature_dtype=args.dtype, cache_size=args.cache, cache_progress=False,
        connect_timeout=args.timeout, stall_timeout=args.timeout, rpc_timeout=args.timeout)
    fill = time.perf_counter() - started
    untimed = args.warmup + args.prefetch
    if len(loader) < untimed + args.batches:
        raise ValueError(f"batches: an epoch has {len(loader)} batches per rank, fewer than "
                         f"--warmup + --prefetch + --batches = {untimed + args.batches}")
    with loader:
        it = iter(loader)
        for _ in range(args.warmup):
            next(it)
        args.ready.touch()
        wait_for(args.go, args.timeout, "trainer: the start signal")
        for _ in range(args.prefetch):  # the backlog of the prefetch window
            next(it)
            time.sleep(args.step_ms / 1e3)
        s0 = loader.last_stats
        b0, w0, r0, c0 = s0.bytes, s0.wait_seconds, s0.rows, s0.cached_rows
        cpu0, t0 = time.process_time(), time.perf_counter()
        for _ in range(args.batches):
            next(it)
            time.sleep(args.step_ms / 1e3)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        s = loader.last_stats
        nbytes, wait, rows, hits = s.bytes - b0, s.wait_seconds - w0, s.rows - r0, s.cached_rows - c0
        del it
    return {"rank": args.rank, "dtype": args.dtype, "cache": args.cache, "batches": args.batches,
            "seconds": round(wall, 3), "batches_per_s": round(args.batches / wall, 3),
            "bytes_per_batch": round(nbytes / args.batches),
            "received_gbit_per_s": round(8 * nbytes / wall / 1e9, 3),
            "wait_fraction": round(wait / wall, 3),
            "step_fraction": round(args.batches * args.step_ms / 1e3 / wall, 3),
            "hit_rate": round(hits / rows, 4) if rows else 0.0,
            "cpu_seconds_per_batch": round(cpu / args.batches, 3),
            "cache_fill_seconds": round(fill, 2)}


def _fanouts(text: str) -> list[int]:
    return [int(f) for f in text.split(",")]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="role", required=True)
    for role in ("tcp-sink", "tcp-echo"):
        r = sub.add_parser(role)
        r.add_argument("--port", type=int, required=True)
        r.add_argument("--count", type=int, default=200)
        r.add_argument("--timeout", type=float, default=60.0)
    for role in ("tcp-source", "tcp-ping"):
        r = sub.add_parser(role)
        r.add_argument("--host", required=True)
        r.add_argument("--port", type=int, required=True)
        r.add_argument("--seconds", type=float, default=3.0)
        r.add_argument("--count", type=int, default=200)
        r.add_argument("--timeout", type=float, default=60.0)
    t = sub.add_parser("trainer")
    t.add_argument("--servers", required=True)
    t.add_argument("--rank", type=int, required=True)
    t.add_argument("--world-size", type=int, required=True)
    t.add_argument("--dtype", required=True)
    t.add_argument("--cache", type=float, required=True)
    t.add_argument("--fanouts", type=_fanouts, required=True)
    t.add_argument("--batch-size", type=int, required=True)
    t.add_argument("--batches", type=int, required=True)
    t.add_argument("--warmup", type=int, default=1)
    t.add_argument("--step-ms", type=float, required=True)
    t.add_argument("--prefetch", type=int, default=4)
    t.add_argument("--ready", type=Path, required=True, help="file created once warmed up")
    t.add_argument("--go", type=Path, required=True, help="file whose creation starts the timing")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--timeout", type=float, default=900.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.role == "tcp-sink":
        _emit(tcp_sink(args.port, args.timeout))
    elif args.role == "tcp-source":
        _emit(tcp_source(args.host, args.port, args.seconds, args.timeout))
    elif args.role == "tcp-echo":
        _emit(tcp_echo(args.port, args.count, args.timeout))
    elif args.role == "tcp-ping":
        _emit(tcp_ping(args.host, args.port, args.count, args.timeout))
    else:
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
        _emit(trainer(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
