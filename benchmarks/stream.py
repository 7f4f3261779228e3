"""Stream benchmark (not a test): graphfeed's minibatch stream on loopback beside two
floors measured in the same run.

Rows (each server in its own process, the client in this one):

- ``tcp``: raw TCP loopback, ``sendall`` of 4 MiB buffers (the ceiling);
- ``grpc-bytes(S)``: a bare gRPC server stream of raw ``bytes`` messages of S bytes;
- ``graphfeed-replay(S)``: graphfeed's encoding and decoding only: real ``products-like``
  batches, sampled once by a real partition's sampler, encoded per send as the server
  does (``protos.fastwire``) in ``MinibatchChunk`` messages of S bytes and decoded by the
  trainer's ``BatchAssembler`` into PyG ``Data``;
- ``graphfeed-server``: the real ``sampling_server`` (sampling included) read by
  ``RemoteNeighborLoader``, and the fraction of a trainer step spent waiting for data
  with a model step of a few fixed lengths (a sleep standing for GPU work).

Target: graphfeed-replay reaches >= 90 % of grpc-bytes at the same message size.
Writes ``benchmarks/results/stream.json`` and ``stream.png``.

    python benchmarks/stream.py --data data/bench
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
from common import RESULTS, machine, write_json

log = logging.getLogger("bench.stream")

FANOUTS = [15, 10, 5]
BATCH = 1024
SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20]
_METHOD = "/bench.Bytes/Stream"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- raw TCP ------------------------------------------------------------------------------
def _tcp_sender(port: int, total: int) -> None:
    buf = b"\0" * (4 << 20)
    with socket.create_connection(("127.0.0.1", port)) as s:
        sent = 0
        while sent < total:
            s.sendall(buf)
            sent += len(buf)


def tcp_row(total: int) -> dict[str, Any]:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        proc = mp.get_context("spawn").Process(target=_tcp_sender, args=(srv.getsockname()[1], total))
        proc.start()
        conn, _ = srv.accept()
        buf = bytearray(4 << 20)
        got, started = 0, time.perf_counter()
        with conn:
            while got < total:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                got += n
        wall = time.perf_counter() - started
        proc.join(30)
    return _row("tcp", got, wall, got // (4 << 20))


def _serve(handler: Any, port: int, ready: Any, seconds: float) -> None:
    """Serve ``handler`` on 127.0.0.1:``port`` (graphfeed's server options) until killed or
    ``seconds`` pass; ``ready`` is set once it listens."""
    from protos.channel import server_options

    server = grpc.server(futures.ThreadPoolExecutor(2), options=server_options())
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    server.wait_for_termination(seconds)


# -- bare gRPC bytes stream ------------------------------------------------------------
def _bytes_server(port: int, size: int, count: int, ready: Any) -> None:

    payload = b"\1" * size

    def stream(request: bytes, context: grpc.ServicerContext) -> Any:
        for _ in range(count):
            yield payload

    handler = grpc.method_handlers_generic_handler("bench.Bytes", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=None,
                                                       response_serializer=None)})
    _serve(handler, port, ready, 600)


def grpc_bytes_row(size: int, total: int) -> dict[str, Any]:
    from protos.channel import create_channel

    count = max(total // size, 8)
    port, ctx = free_port(), mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_bytes_server, args=(port, size, count, ready), daemon=True)
    proc.start()
    ready.wait(60)
    try:
        channel = create_channel(f"127.0.0.1:{port}")
        call = channel.unary_stream(_METHOD, request_serializer=None, response_deserializer=None)
        got, started = 0, time.perf_counter()
        for msg in call(b"", timeout=300):
            got += len(msg)
        wall = time.perf_counter() - started
        channel.close()
    finally:
        proc.terminate()
        proc.join(10)
    return _row(f"grpc-bytes({size >> 10} KiB)", got, wall, count)


# -- graphfeed encode/decode replay --------------------------------------------------------
def _replay_server(part_dir: str, size: int, rounds: int, num_batches: int, port: int,
                   ready: Any) -> None:
    """Sample real batches once, then stream their messages ``rounds`` times."""
    import numpy as np
    import torch

    from partitioner import load_partition
    from protos import fastwire
    from protos import sampling_pb2 as pb
    from protos.allocator import keep_freed_memory
    from sampling_server.sampler import create_sampler
    from sampling_server.sampler.rng import batch_key

    keep_freed_memory()
    part = load_partition(part_dir, 0, verify="size", mmap=False)
    sampler = create_sampler(part, device="cpu")
    train = np.asarray(part.splits["train"])
    rng = np.random.default_rng(0)
    batches: list[tuple[dict[str, torch.Tensor], Any]] = []
    for i in range(num_batches):
        mb = sampler.minibatch(rng.choice(train, BATCH, replace=False), FANOUTS, batch_key(0, 0, 0, i))
        assert mb.x is not None and mb.y is not None
        batches.append(({"n_id": mb.structure.n_id, "edge_index": mb.structure.edge_index,
                         "x": mb.x, "y": mb.y}, mb.structure))

    def stream(request: Any, context: Any) -> Any:
        index = 0
        for _ in range(rounds):
            for named, out in batches:  # encoded per send, as the real pipeline does

                def head(i: int, n: int, out: Any = out, index: int = index) -> Any:
                    msg = pb.MinibatchChunk(batch_index=index, chunk_index=i, num_chunks=n)
                    if i == 0:
                        msg.header.CopyFrom(pb.MinibatchHeader(
                            num_batches=rounds * len(batches), num_seed_nodes=out.batch_size,
                            num_sampled_nodes=out.num_sampled_nodes,
                            num_sampled_edges=out.num_sampled_edges))
                    return msg

                index += 1
                yield from fastwire.encode_chunks(head, named, size)

    handler = grpc.method_handlers_generic_handler("graphfeed.v1.SamplingService", {
        "StreamMinibatches": grpc.unary_stream_rpc_method_handler(
            stream, pb.EpochRequest.FromString, fastwire.passthrough)})
    _serve(handler, port, ready, 900)


def replay_row(part_dir: Path, size: int, rounds: int, num_batches: int) -> dict[str, Any]:
    from protos import fastwire
    from protos import sampling_pb2 as pb
    from protos.channel import create_channel
    from trainer_client.decode import BatchAssembler

    port, ctx = free_port(), mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_replay_server,
                       args=(str(part_dir), size, rounds, num_batches, port, ready), daemon=True)
    proc.start()
    ready.wait(600)
    try:
        channel = create_channel(f"127.0.0.1:{port}")
        stub = fastwire.MinibatchStreamStub(channel)  # as the trainer's loader reads
        assembler = BatchAssembler()
        got = batches = 0
        started = time.perf_counter()
        for msg in stub.StreamMinibatches(pb.EpochRequest(split="train"), timeout=600):
            done = assembler.add(msg)
            if done is not None:
                got += done.nbytes
                batches += 1
        wall = time.perf_counter() - started
        channel.close()
    finally:
        proc.terminate()
        proc.join(10)
    return _row(f"graphfeed-replay({size >> 10} KiB)", got, wall, batches)


# -- the real server ------------------------------------------------------------------------
def server_rows(part_dir: Path, num_batches: int, steps: list[float], server_device: str = "auto",
                trainer_device: str = "cpu") -> list[dict[str, Any]]:
    from trainer_client.loader import RemoteNeighborLoader

    address = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "sampling_server", "--partition-dir", str(part_dir),
           "--partition", "0", "--listen", address, "--verify", "size", "--no-mmap",
           "--device", server_device, "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rows = []
    try:
        for step in [0.0, *steps]:
            loader = RemoteNeighborLoader([address], "train", num_neighbors=FANOUTS,
                                          batch_size=BATCH, shuffle=True, prefetch=4,
                                          device=trainer_device,
                                          connect_timeout=600, stall_timeout=300)
            if len(loader) < num_batches:
                log.warning("an epoch has only %d batches; measuring those", len(loader))
                num_batches = len(loader)
            batches = 0
            started = time.perf_counter()
            it = iter(loader)
            while batches < num_batches:
                next(it)
                batches += 1
                if step:
                    time.sleep(step)
            wall = time.perf_counter() - started
            stats = loader.last_stats
            got, wait = stats.bytes, stats.wait_seconds
            del it
            loader.close()
            row = _row(f"graphfeed-server (step {step * 1e3:.0f} ms)", got, wall, batches)
            row.update(server_device=server_device, trainer_device=trainer_device)
            row["wait_fraction"] = round(wait / wall, 3)
            rows.append(row)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return rows


def _row(label: str, nbytes: int, wall: float, messages: int) -> dict[str, Any]:
    row = {"label": label, "bytes": nbytes, "seconds": round(wall, 3),
           "mib_per_s": round(nbytes / wall / (1 << 20), 1), "items": messages,
           "items_per_s": round(messages / wall, 2)}
    log.info("%-36s %9.1f MiB/s %8.2f items/s", label, row["mib_per_s"], row["items_per_s"])
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--preset", default="products-like")
    parser.add_argument("--gib", type=float, default=2.0, help="GiB per floor row")
    parser.add_argument("--replay-batches", type=int, default=6)
    parser.add_argument("--replay-rounds", type=int, default=3)
    parser.add_argument("--server-batches", type=int, default=12)
    parser.add_argument("--steps-ms", type=float, nargs="*", default=[100.0, 250.0])
    parser.add_argument("--server-device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="the sampling server's --device (default auto: CUDA when usable)")
    parser.add_argument("--trainer-device", default="cpu",
                        help="where the trainer's loader puts batches (cpu, cuda, cuda:i)")
    parser.add_argument("--results-name", default="stream",
                        help="benchmarks/results/<name>.json and .png (default: stream)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from sampler import ensure_partition

    from protos.allocator import keep_freed_memory

    keep_freed_memory()  # this process is the trainer: as graphfeed-train does

    part_dir = ensure_partition(args.data, args.preset)
    total = int(args.gib * (1 << 30))
    rows = [tcp_row(total)]
    for size in SIZES:
        rows.append(grpc_bytes_row(size, total))
        rows.append(replay_row(part_dir, size, args.replay_rounds, args.replay_batches))
    rows += server_rows(part_dir, args.server_batches, [s / 1e3 for s in args.steps_ms],
                        args.server_device, args.trainer_device)
    ratios = {}
    by = {r["label"]: r for r in rows}
    for size in SIZES:
        k = f"{size >> 10} KiB"
        ratios[f"replay_vs_grpc_bytes({k})"] = round(
            by[f"graphfeed-replay({k})"]["mib_per_s"] / by[f"grpc-bytes({k})"]["mib_per_s"], 3)
        ratios[f"grpc_bytes_vs_tcp({k})"] = round(
            by[f"grpc-bytes({k})"]["mib_per_s"] / by["tcp"]["mib_per_s"], 3)
    payload = {"benchmark": "stream", "preset": args.preset, "fanouts": FANOUTS,
               "batch_size": BATCH, "machine": machine(), "rows": rows, "ratios": ratios}
    path = write_json(args.results_name, payload)
    plot(rows, RESULTS / f"{args.results_name}.png")
    for r in rows:
        extra = f"  wait {r['wait_fraction']:.0%}" if "wait_fraction" in r else ""
        print(f"{r['label']:<36} {r['mib_per_s']:>9.1f} MiB/s {r['items_per_s']:>8.2f}/s{extra}")
    for k, v in ratios.items():
        print(f"{k}: {v}")
    print(f"wrote {path}")
    return 0


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        log.warning("no plot: matplotlib is not installed")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.5))
    ax.barh([r["label"] for r in rows], [r["mib_per_s"] for r in rows], color="tab:green")
    ax.set_xlabel("MiB/s (loopback, 2 cores)")
    ax.invert_yaxis()
    ax.set_title("minibatch stream vs bare gRPC and raw TCP")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
