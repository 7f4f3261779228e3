"""Stream benchmark (not a test): graphfeed's minibatch stream on loopback beside two
floors measured in the same run.

Rows (servers in their own processes, the client in this one):

- ``tcp``: raw TCP loopback, ``sendall`` of 4 MiB buffers (the ceiling);
- ``grpc-bytes(S)``: a bare gRPC server stream of raw ``bytes`` messages of S bytes (one
  ``bytes`` object sent again and again: no per-message work at all, and the payload stays
  in the CPU cache);
- ``grpc-bytes-uncached(S)``: the same, cycling through 512 MiB of distinct messages, so
  that the payload comes from memory as a real batch's does (still no per-message work);
- ``graphfeed-replay(S)``: graphfeed's encoding and decoding only: real ``products-like``
  batches, sampled once by a real partition's sampler, sent as the server sends them in
  ``MinibatchChunk`` messages of S bytes of tensor data and decoded by the trainer's
  ``BatchAssembler`` into PyG ``Data``: the features (``x``, where they span several
  messages) in the messages the server's gather writes them into
  (``protos.fastwire.RowMessages``; written once per batch before the timed rows, as
  the replay starts from gathered batches), the batch's other tensors encoded per send
  by ``protos.fastwire``, each message just before it is sent, as the server does
  (``sampling_server.messages.encode_ahead``);
- five diagnostic rows at the default message size, to say where the replay's gap to
  the bare stream goes: ``graphfeed-replay, x encoded per send``: ``x`` encoded like the
  other tensors, a copy per send (the server's way until its gather wrote into the
  messages); ``graphfeed-replay, encoded once``: the server sends each batch's messages as encoded
  the first time (no per-send copy of the tensors into the messages; the trainer decodes
  as usual), ``graphfeed-replay, encoded per batch``: each batch's messages all encoded
  by the sampling worker, batches ahead of the one being sent (the server's earlier way:
  the messages have left the CPU's cache when gRPC copies them), and
  ``graphfeed-replay, not decoded``: the trainer parses every message
  (fastwire) but assembles no tensor (no copy out of the messages); and
  ``graphfeed-replay, copies inline`` or ``graphfeed-replay, decode threads``: the
  trainer's copies out of the messages made the other way than its default (which
  depends on the CPUs it may use, ``decode.BACKGROUND_COPIES_MIN_CPUS``): on the thread
  that reads the stream, or on the decode threads;
- ``graphfeed-server``: the real ``sampling_server`` (sampling included) read by
  ``RemoteNeighborLoader``, and the fraction of a trainer step spent waiting for data
  with a model step of a few fixed lengths (a sleep standing for GPU work).

The bare and replay streams come from one server process (the same gRPC options); at each
size they run back to back, in alternating order, ``--passes`` times; every figure is
reported as the median over the passes, the ratio as the median of the per-pass ratios.
Each row also gives the CPU seconds per GiB that each end's process spent (all its
threads, gRPC's included), which says where the time goes on a machine whose cores are
shared.

Target: graphfeed-replay reaches >= 90 % of grpc-bytes at the default message size
(``codec.DEFAULT_CHUNK_BYTES``). Writes ``benchmarks/results/stream.json`` and ``stream.png``:
the real server's delivered batches/s against what each model step time allows.

    python benchmarks/stream.py --data data/bench

Takes 5-10 minutes on a 2-core machine with the defaults (every message size, the
diagnostic rows, the real server at three step times); ``--sizes-kib 4096
--no-diagnostics`` a few. ``--plot-only JSON`` redraws the plot from results already
written (a stream JSON, or ``gpu-check.json``, whose model step it marks).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
from common import (
    RESULTS,
    describe_machine,
    held_port,
    machine,
    pyplot,
    read_results,
    report_step,
    write_json,
)

log = logging.getLogger("bench.stream")

FANOUTS = [15, 10, 5]
BATCH = 1024
PREFETCH = 2  # batches prepared ahead of the one being sent (the server's default is 4)
SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20]
_METHOD = "/bench.Bytes/Stream"


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


# -- bare gRPC bytes stream and graphfeed replay, served by one process ------------------
def _sample_batches(part_dir: str, num_batches: int) -> list[tuple[dict[str, Any], Any]]:
    """``num_batches`` real products-like batches (structure, features, labels)."""
    import numpy as np

    from partitioner import load_partition
    from sampling_server.sampler import create_sampler
    from sampling_server.sampler.rng import batch_key

    part = load_partition(part_dir, 0, verify="size", mmap=False)
    sampler = create_sampler(part, device="cpu")
    t, (et,) = part.target_type, part.edge_types
    train = np.asarray(part.splits["train"])
    rng = np.random.default_rng(0)
    batches = []
    for i in range(num_batches):
        mb = sampler.minibatch(rng.choice(train, BATCH, replace=False), t, FANOUTS, batch_key(0, 0, 0, i),
                               original_ids=False)
        assert t in mb.x and mb.y is not None
        batches.append(({"n_id": mb.structure.node[t], "edge_index": mb.structure.edge_index(et),
                         "x": mb.x[t], "y": mb.y}, mb.structure))
    return batches


def batch_head(out: Any, index: int, total: int) -> Any:
    """The message heads of batch ``index`` of ``total`` (its sampler output ``out``), as
    the server's pipeline makes them (``sampling_server.messages.chunk_head``)."""
    from protos import sampling_pb2 as pb
    from sampling_server.messages import chunk_head

    (nodes,), (edges,) = out.num_sampled_nodes.values(), out.num_sampled_edges.values()
    return chunk_head(index, pb.MinibatchHeader(
        num_batches=total, num_seed_nodes=out.batch_size, num_sampled_nodes=nodes,
        num_sampled_edges=edges))


def prepare_batch(named: dict[str, Any], out: Any, index: int, total: int, size: int) -> Any:
    """Batch ``index`` of ``total`` (its tensors ``named``, its sampler output ``out``) as
    the server's pipeline prepared it before its gather wrote ``x`` into the stream
    messages (``sampling_server.messages.Prepared``): ``MinibatchChunk`` messages of
    ``size`` bytes of tensor data, the first with the batch's header, each encoded by
    ``protos.fastwire`` when asked for."""
    from sampling_server.messages import Prepared

    return Prepared.of(batch_head(out, index, total), named, size)


def gathered_rows(named: dict[str, Any], out: Any, index: int, total: int,
                  size: int) -> tuple[list[bytes], list[int]] | None:
    """``x`` of batch ``index`` in the messages the server's gather writes it into
    (``protos.fastwire.RowMessages``, after the batch's other messages), finished; None
    where the server sends ``x`` with the other tensors (it fits one message)."""
    from protos import codec, fastwire

    x = named["x"]
    others = {k: v for k, v in named.items() if k != "x"}
    row = tuple(x.shape[1:])
    if not fastwire.RowMessages.worth_it(x.dtype, row, x.shape[0], size):
        return None
    rows = fastwire.RowMessages(batch_head(out, index, total), "x", x.dtype, x.shape[0], row, size)
    for a, b, block in rows.blocks:
        block.copy_(x[a:b])  # the gather's own write, in the server
    first = codec.count_groups(others, size)
    return rows.finish(first, first + len(rows)), list(rows.nbytes)


class _ThreadTimed(futures.Executor):
    """``pool``, adding the CPU seconds of every call it runs to ``spent``."""

    def __init__(self, pool: futures.Executor, spent: list[float]) -> None:
        self.pool, self.spent = pool, spent

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        def timed() -> Any:
            began = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent.append(time.thread_time() - began)
        return self.pool.submit(timed)


def _bench_server(part_dir: str, num_batches: int, port: int, ready: Any) -> None:
    """Serve both streams from one process (graphfeed's server options):

    - ``Bytes``: ``count`` messages of ``size`` bytes, one ``bytes`` object sent again and
      again (no per-message work at all: the floor);
    - ``Replay``: real batches, sampled once here, sent ``rounds`` times as the server's
      pipeline sends them: ``x``, where it spans several messages, in the messages the
      server's gather writes it into (made once per batch and message size, as the
      gather would, before the timed rows: the replay starts from gathered batches);
      the batch's other tensors prepared (split in messages of ``size`` bytes of tensor
      data) by a worker thread ``PREFETCH`` batches ahead of the one being sent, each
      message encoded (``protos.fastwire``) on the encode threads
      ``ENCODE_AHEAD_BYTES`` before gRPC sends it (``sampling_server.pipeline``'s own
      ``Prepared`` and ``encode_ahead``). Every message of batch ``i`` of the stored
      ones carries batch index ``i``, in every round. Diagnostics (``mode``): ``x
      encoded per send``: ``x`` encoded like the other tensors (the server's way until
      its gather wrote into the messages); ``encoded once``: each batch's messages
      resent as first encoded; ``encoded per batch``: whole batches encoded by the
      worker, ``PREFETCH`` ahead (the server's way until 2026-11-27).

    Each call's request is JSON; its trailing metadata carries the CPU seconds this process
    spent while the call ran (``server-cpu-s``: every thread, gRPC's own included).
    """
    from protos import codec, fastwire
    from protos.allocator import keep_freed_memory
    from sampling_server.messages import encode_ahead, taken_in_order

    keep_freed_memory()  # as the server's CLI does at start-up
    batches = _sample_batches(part_dir, num_batches)
    workers = futures.ThreadPoolExecutor(1, thread_name_prefix="sample")
    encoders = futures.ThreadPoolExecutor(2, thread_name_prefix="encode")  # the server's least
    encode_cpu: list[float] = []
    encoded_once: dict[tuple[int, int], list[bytes]] = {}  # (batch, size) -> its messages
    gathered: dict[tuple[int, int], tuple[list[bytes], list[int]] | None] = {}  # -> x's

    def bytes_stream(request: bytes, context: grpc.ServicerContext) -> Any:
        ask = json.loads(request)
        size = ask["size"]
        if ask.get("uncached"):  # distinct messages, 512 MiB in all: none stays in the CPU cache
            payloads = [bytes([i % 251]) * size for i in range(max(1, (512 << 20) // size))]
        else:
            payloads = [b"\1" * size]
        cpu = time.process_time()
        for i in range(ask["count"]):
            yield payloads[i % len(payloads)]
        context.set_trailing_metadata((("server-cpu-s", f"{time.process_time() - cpu:.4f}"),))

    def prepare(index: int, total: int, size: int) -> Any:
        """The server's way: x in the messages its gather wrote, the rest encoded late."""
        from sampling_server.messages import Prepared

        b = index % len(batches)
        named, out = batches[b]
        if (b, size) not in gathered:  # built by the untimed first call of each size
            gathered[b, size] = gathered_rows(named, out, b, total, size)
        rows = gathered[b, size]
        if rows is None:
            return prepare_batch(named, out, b, total, size)
        others = {k: v for k, v in named.items() if k != "x"}
        return Prepared(batch_head(out, b, total), list(codec.iter_pieces(others, size)), 0, *rows)

    def x_per_send(index: int, total: int, size: int) -> Any:
        named, out = batches[index % len(batches)]
        return prepare_batch(named, out, index % len(batches), total, size)

    def encode_whole(index: int, total: int, size: int) -> list[bytes]:
        began = time.thread_time()
        messages: list[bytes] = x_per_send(index, total, size).messages()
        encode_cpu.append(time.thread_time() - began)
        return messages

    def encode_once(index: int, total: int, size: int) -> list[bytes]:
        key = (index % len(batches), size)
        if key not in encoded_once:
            encoded_once[key] = encode_whole(index, total, size)
        return encoded_once[key]

    def replay_stream(request: bytes, context: grpc.ServicerContext) -> Any:
        ask = json.loads(request)
        total, size, cpu = ask["rounds"] * len(batches), ask["size"], time.process_time()
        mode = ask.get("mode", "")
        encode_cpu.clear()
        jobs = iter(range(total))
        pending: deque[Future[Any]] = deque()

        def submit_next() -> None:
            index = next(jobs, None)
            if index is not None:
                work = {"": prepare, "x encoded per send": x_per_send, "encoded once": encode_once,
                        "encoded per batch": encode_whole}[mode]
                pending.append(workers.submit(work, index, total, size))

        for _ in range(PREFETCH):
            submit_next()
        if mode.startswith("encoded"):
            for future in taken_in_order(pending, submit_next):
                yield from future.result()
        else:
            for message, _ in encode_ahead(taken_in_order(pending, submit_next),
                                           _ThreadTimed(encoders, encode_cpu)):
                yield message
        context.set_trailing_metadata((("server-cpu-s", f"{time.process_time() - cpu:.4f}"),
                                       ("server-encode-cpu-s", f"{sum(encode_cpu):.4f}")))

    handler = grpc.method_handlers_generic_handler("bench.Stream", {
        "Bytes": grpc.unary_stream_rpc_method_handler(bytes_stream, None, None),
        "Replay": grpc.unary_stream_rpc_method_handler(replay_stream, None, fastwire.passthrough)})
    _serve(handler, port, ready, 3600)


def _server_cpu(call: Any, key: str = "server-cpu-s") -> float:
    for name, value in call.trailing_metadata() or ():
        if name == key:
            return float(value)
    return float("nan")


def bare_row(channel: grpc.Channel, size: int, nbytes: int, uncached: bool = False) -> dict[str, Any]:
    """Read ``nbytes`` (rounded up to whole messages) of ``size``-byte messages: one
    ``bytes`` object sent again and again, or (``uncached``) 512 MiB of distinct ones."""
    call_of = channel.unary_stream("/bench.Stream/Bytes", request_serializer=None,
                                   response_deserializer=None)
    count = max(-(-nbytes // size), 8)
    call = call_of(json.dumps({"size": size, "count": count, "uncached": uncached}).encode(),
                   timeout=900)
    got, cpu, started = 0, time.process_time(), 0.0
    for msg in call:
        if not got:  # the clock starts at the first message (after the server built its payloads)
            started, cpu = time.perf_counter(), time.process_time()
        got += len(msg)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    got -= size  # the first message arrived before the clock started
    label = f"grpc-bytes{'-uncached' if uncached else ''}({size >> 10} KiB)"
    server_cpu = _server_cpu(call) * got / (got + size)  # its share of the bytes counted
    return _row(label, got, wall, count - 1, cpu, server_cpu)


def replay_row(channel: grpc.Channel, size: int, rounds: int, variant: str = "") -> dict[str, Any]:
    """Read ``rounds`` replays of the server's batches and decode them as the trainer's
    reader thread does (``BatchAssembler``: fastwire views, one copy of split tensors).

    ``variant`` (diagnostics): ``"x encoded per send"``: the server encodes ``x`` with
    the batch's other tensors, not from the messages its gather wrote; ``"encoded
    once"``: the server resends each batch's messages as first encoded; ``"encoded per
    batch"``: the server encodes whole batches ahead, as it did until 2026-11-27; ``"not
    decoded"``: messages are parsed, no batch assembled (the bytes counted are the
    messages'); ``"copies inline"``, ``"decode threads"``: the pieces are copied into
    their tensors by the reading thread itself, or by the decode threads (without
    either: the trainer's default for this machine)."""
    from protos import fastwire
    from trainer_client.decode import BatchAssembler

    call_of = channel.unary_stream("/bench.Stream/Replay", request_serializer=None,
                                   response_deserializer=fastwire.minibatch_chunk_deserializer)
    assembler = BatchAssembler(background_copies={"copies inline": False, "decode threads": True}
                               .get(variant))
    got = batches = 0
    cpu, started = time.process_time(), time.perf_counter()
    server_modes = ("encoded once", "encoded per batch", "x encoded per send")
    call = call_of(json.dumps({"size": size, "rounds": rounds,
                               "mode": variant if variant in server_modes else ""}).encode(),
                   timeout=900)
    decode = 0.0
    for msg in call:
        if variant == "not decoded":
            got += msg.ByteSize()
            batches += msg.chunk_index == msg.num_chunks - 1
            continue
        began = time.thread_time()
        done = assembler.add(msg)
        decode += time.thread_time() - began
        if done is not None:
            got += done.nbytes
            batches += 1
            del done  # as a trainer that is through with the batch: its buffers are reused
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    label = f"graphfeed-replay{', ' + variant if variant else ''}({size >> 10} KiB)"
    row = _row(label, got, wall, batches, cpu, _server_cpu(call))
    gib = got / (1 << 30)
    row["encode_cpu_s_per_gib"] = round(_server_cpu(call, "server-encode-cpu-s") / gib, 3)
    if variant != "not decoded":
        row["copies"] = "decode threads" if assembler.background_copies else "inline"
        row["decode_cpu_s_per_gib"] = round(decode / gib, 3)
        row["buffers_reused"] = assembler.pool.reused
    return row


#: Every diagnostic replay (:func:`replay_row`'s ``variant``).
DIAGNOSTICS = ("x encoded per send", "encoded once", "encoded per batch", "not decoded",
               "copies inline", "decode threads")


def variants() -> tuple[str, ...]:
    """The diagnostic replays (see the module's docstring), run at the default message
    size: the last makes the trainer's copies the other way than its default here."""
    from trainer_client.decode import default_background_copies

    other = "copies inline" if default_background_copies() else "decode threads"
    return ("x encoded per send", "encoded once", "encoded per batch", "not decoded", other)


def stream_passes(part_dir: Path, sizes: list[int], passes: int, rounds: int,
                  num_batches: int, tcp_bytes: int, diagnose: int | None = None,
                  diagnostics: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Per pass: raw TCP, then at each size the bare stream and the replay back to back
    (their order alternates between passes), all against one server process; at size
    ``diagnose`` the ``diagnostics`` (default: every one of :func:`variants`) of the replay
    follow them on even passes and precede them, in reverse order, on odd ones (their
    ratio: to that pass's bare stream)."""
    from protos.channel import create_channel

    port, ctx = held_port(), mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_bench_server, args=(str(part_dir), num_batches, port, ready),
                       daemon=True)
    proc.start()
    rows: list[dict[str, Any]] = []
    try:
        if not ready.wait(1800):
            raise RuntimeError("the benchmark server did not sample its batches within 30 min")
        channel = create_channel(f"127.0.0.1:{port}")
        for size in sizes:  # x of every batch in its messages, as gathered, before the timed rows
            replay_row(channel, size, 1)
        if diagnose in sizes:  # every batch encoded once before the timed rows
            replay_row(channel, diagnose, 1, "encoded once")
        for p in range(passes):
            rows.append({**tcp_row(tcp_bytes), "pass": p})
            for size in sizes:
                replay: dict[str, Any] | None = None
                bare: dict[str, Any] = {}
                uncached: dict[str, Any] = {}
                chosen = (variants() if diagnostics is None else tuple(diagnostics)) \
                    if size == diagnose else ()
                # the diagnostics after the others on even passes, before them (in reverse
                # order) on odd ones, so that no row always runs later in a pass than another
                early = [replay_row(channel, size, rounds, v) for v in reversed(chosen)] \
                    if p % 2 else []
                for kind in (("replay", "bare", "uncached") if p % 2 == 0
                             else ("uncached", "bare", "replay")):
                    if kind == "replay":
                        replay = replay_row(channel, size, rounds)
                        continue
                    # as many bytes as the replay sends (pass 0 runs the replay first)
                    nbytes = replay["bytes"] if replay else _replay_bytes(rows, size)
                    if kind == "bare":
                        bare = bare_row(channel, size, nbytes)
                    else:
                        uncached = bare_row(channel, size, nbytes, uncached=True)
                assert replay is not None
                replay["ratio_to_bare"] = round(replay["mib_per_s"] / bare["mib_per_s"], 3)
                replay["ratio_to_uncached"] = round(replay["mib_per_s"] / uncached["mib_per_s"], 3)
                rows += [{**r, "pass": p} for r in (bare, uncached, replay)]
                log.info("pass %d, %d KiB: replay / bare gRPC = %.3f (/ uncached %.3f)", p,
                         size >> 10, replay["ratio_to_bare"], replay["ratio_to_uncached"])
                late = [] if p % 2 else [replay_row(channel, size, rounds, v) for v in chosen]
                for variant, row in zip(chosen, early[::-1] + late, strict=True):
                    row["ratio_to_bare"] = round(row["mib_per_s"] / bare["mib_per_s"], 3)
                    rows.append({**row, "pass": p})
                    log.info("pass %d, %d KiB: replay, %s / bare gRPC = %.3f", p, size >> 10,
                             variant, row["ratio_to_bare"])
        channel.close()
    finally:
        proc.terminate()
        proc.join(10)
    return rows


def _replay_bytes(rows: list[dict[str, Any]], size: int) -> int:
    label = f"graphfeed-replay({size >> 10} KiB)"
    return next((int(r["bytes"]) for r in rows if r["label"] == label), 0)


# -- the real server ------------------------------------------------------------------------
def server_rows(part_dir: Path, num_batches: int, steps: list[float], server_device: str = "auto",
                trainer_device: str = "cpu", warmup: int = 2,
                cache_sizes: Sequence[str] = ("0",)) -> list[dict[str, Any]]:
    """The real server's batches/s and the trainer's waiting, at each training-step time
    in ``steps`` (seconds) and each trainer cache size of ``cache_sizes`` (one server for
    all); each row's first ``warmup`` batches are taken untimed."""
    from trainer_client.loader import RemoteNeighborLoader
    from trainer_client.local import wait_serving

    address = f"127.0.0.1:{held_port()}"
    cmd = [sys.executable, "-m", "sampling_server", "--partition-dir", str(part_dir),
           "--partition", "0", "--listen", address, "--verify", "size", "--no-mmap",
           "--device", server_device, "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rows = []
    try:
        # fails at once if the server exits (its output is this benchmark's own)
        wait_serving([address], [proc], ["this benchmark's output"], timeout=600)
        for cache_size, step in [(c, s) for c in cache_sizes for s in [0.0, *steps]]:
            loader = RemoteNeighborLoader([address], "train", num_neighbors=FANOUTS,
                                          batch_size=BATCH, shuffle=True, prefetch=4,
                                          device=trainer_device, cache_size=cache_size,
                                          connect_timeout=600, stall_timeout=300)
            if len(loader) < num_batches:
                log.warning("an epoch has only %d batches; measuring those", len(loader))
                num_batches = len(loader)
            it = iter(loader)
            for _ in range(min(warmup, max(len(loader) - num_batches, 0))):
                next(it)  # untimed: the stream's start, the first batches' sampling
            stats = loader.last_stats  # counts batches as they are handed over
            got0, wait0 = stats.bytes, stats.wait_seconds
            batches = 0
            started = time.perf_counter()
            while batches < num_batches:
                next(it)
                batches += 1
                if step:
                    time.sleep(step)
            wall = time.perf_counter() - started
            got, wait = stats.bytes - got0, stats.wait_seconds - wait0
            del it
            loader.close()
            cache = "" if cache_size == "0" else f", cache {cache_size}"
            row = _row(f"graphfeed-server (step {step * 1e3:.0f} ms{cache})", got, wall, batches)
            row.update(server_device=server_device, trainer_device=trainer_device,
                       cache_size=cache_size)
            row["wait_fraction"] = round(wait / wall, 3)
            rows.append(row)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return rows


def _row(label: str, nbytes: int, wall: float, messages: int, client_cpu: float | None = None,
         server_cpu: float | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "label": label, "bytes": nbytes, "seconds": round(wall, 3),
        "mib_per_s": round(nbytes / wall / (1 << 20), 1), "items": messages,
        "items_per_s": round(messages / wall, 2)}
    gib = nbytes / (1 << 30)
    if client_cpu is not None:  # CPU seconds per GiB, each end's process (all its threads)
        row["client_cpu_s_per_gib"] = round(client_cpu / gib, 3)
    if server_cpu is not None:
        row["server_cpu_s_per_gib"] = round(server_cpu / gib, 3)
    log.info("%-36s %9.1f MiB/s %8.2f items/s", label, row["mib_per_s"], row["items_per_s"])
    return row


def summarize(rows: list[dict[str, Any]], sizes: list[int]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Median of every figure over the passes, per label; the ratios (medians of the
    per-pass ratios, each pass's rows measured back to back)."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    medians = []
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        row: dict[str, Any] = {"label": label, "passes": len(mine)}
        for key in ("mib_per_s", "items_per_s", "client_cpu_s_per_gib", "server_cpu_s_per_gib",
                    "encode_cpu_s_per_gib", "decode_cpu_s_per_gib", "ratio_to_bare",
                    "ratio_to_uncached"):
            values = [r[key] for r in mine if key in r]
            if values:
                row[key] = round(float(statistics.median(values)), 3)
        if "ratio_to_bare" in row:
            row["ratio_to_bare_range"] = [min(r["ratio_to_bare"] for r in mine),
                                          max(r["ratio_to_bare"] for r in mine)]
        medians.append(row)
    by = {r["label"]: r for r in medians}
    ratios: dict[str, Any] = {}
    for size in sizes:
        k = f"{size >> 10} KiB"
        ratios[f"replay_vs_grpc_bytes({k})"] = by[f"graphfeed-replay({k})"]["ratio_to_bare"]
        ratios[f"replay_vs_grpc_bytes_uncached({k})"] = by[f"graphfeed-replay({k})"]["ratio_to_uncached"]
        ratios[f"grpc_bytes_vs_tcp({k})"] = round(
            by[f"grpc-bytes({k})"]["mib_per_s"] / by["tcp"]["mib_per_s"], 3)
        for variant in variants():
            if f"graphfeed-replay, {variant}({k})" in by:
                ratios[f"replay_{variant.replace(' ', '_')}_vs_grpc_bytes({k})"] = \
                    by[f"graphfeed-replay, {variant}({k})"]["ratio_to_bare"]
    return medians, ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--preset", default="products-like")
    parser.add_argument("--gib", type=float, default=2.0, help="GiB of the raw TCP row")
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[s >> 10 for s in SIZES],
                        help="message sizes (tensor data per message), KiB")
    parser.add_argument("--passes", type=int, default=3,
                        help="passes over every row; medians are reported")
    parser.add_argument("--replay-batches", type=int, default=6)
    parser.add_argument("--replay-rounds", type=int, default=2)
    parser.add_argument("--no-diagnostics", action="store_true",
                        help="skip the diagnostic replays at the default message size")
    parser.add_argument("--diagnostics", nargs="+", default=None, choices=DIAGNOSTICS,
                        help="which diagnostic replays to run (default: all of them but the "
                             "trainer's default way of copying)")
    parser.add_argument("--server-batches", type=int, default=12,
                        help="batches of the real-server rows (0: skip them)")
    parser.add_argument("--server-warmup", type=int, default=2,
                        help="batches each real-server row takes untimed first")
    parser.add_argument("--steps-ms", type=float, nargs="*", default=[100.0, 250.0])
    parser.add_argument("--server-device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="the sampling server's --device (default auto: CUDA when usable)")
    parser.add_argument("--cache-size", nargs="+", default=["0"],
                        help="the trainer's feature cache in the graphfeed-server rows, one set of "
                             "rows per value (default 0: every row on the stream; 'auto' is a CUDA "
                             "trainer's default)")
    parser.add_argument("--trainer-device", default="cpu",
                        help="where the trainer's loader puts batches (cpu, cuda, cuda:i)")
    parser.add_argument("--results-name", default="stream",
                        help="benchmarks/results/<name>.json and .png (default: stream)")
    parser.add_argument("--plot-only", type=Path, metavar="JSON",
                        help="draw <results-name>.png beside these results instead of measuring")
    args = parser.parse_args()
    if args.plot_only:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        return plot_only(args.plot_only, args.results_name)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from sampler import ensure_partition

    from protos import codec
    from protos.allocator import keep_freed_memory

    keep_freed_memory()  # this process is the trainer: as graphfeed-train does

    sizes = [k << 10 for k in args.sizes_kib]
    part_dir = ensure_partition(args.data, args.preset)
    passes = stream_passes(part_dir, sizes, args.passes, args.replay_rounds, args.replay_batches,
                           int(args.gib * (1 << 30)),
                           None if args.no_diagnostics else codec.DEFAULT_CHUNK_BYTES,
                           args.diagnostics)
    rows, ratios = summarize(passes, sizes)
    if args.server_batches:
        rows += server_rows(part_dir, args.server_batches, [s / 1e3 for s in args.steps_ms],
                            args.server_device, args.trainer_device, args.server_warmup,
                            args.cache_size)
    default = f"{codec.DEFAULT_CHUNK_BYTES >> 10} KiB"
    target = ratios.get(f"replay_vs_grpc_bytes({default})")
    payload = {"benchmark": "stream", "preset": args.preset, "fanouts": FANOUTS,
               "batch_size": BATCH, "machine": machine(), "load_average": os.getloadavg(),
               "passes": args.passes, "default_chunk": default, "target": 0.9,
               "target_met": target is not None and target >= 0.9,
               "rows": rows, "ratios": ratios, "pass_rows": passes}
    path = write_json(args.results_name, payload)
    plot(rows, RESULTS / f"{args.results_name}.png", describe_machine(payload))
    for r in rows:
        extra = f"  wait {r['wait_fraction']:.0%}" if "wait_fraction" in r else ""
        cpu = "".join(f"  {k.split('_')[0]} {r[k]:.3f}" for k in
                      ("client_cpu_s_per_gib", "server_cpu_s_per_gib", "encode_cpu_s_per_gib",
                       "decode_cpu_s_per_gib") if k in r)
        print(f"{r['label']:<44} {r['mib_per_s']:>9.1f} MiB/s {r['items_per_s']:>8.2f}/s{cpu}{extra}")
    print("(cpu-s per GiB: client and server processes; encode and decode: the replay's own "
          "work inside them)")
    for k, v in ratios.items():
        print(f"{k}: {v}")
    print(f"wrote {path}")
    return 0


def plot(rows: list[dict[str, Any]], path: Path, where: str, model_step_ms: float | None = None) -> None:
    """The real server's delivered batches/s at each model step time, a bar per trainer
    cache, against the rate each step allows (1000 / step ms) and, where it is known
    (``make gpu-check`` measures it), the rate of the model's own step. Without
    real-server rows: the stream rows' MiB/s."""
    plt = pyplot()
    if plt is None:
        return
    served = [r for r in rows if r["label"].startswith("graphfeed-server")]
    if not served:
        fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.5))
        ax.barh([r["label"] for r in rows], [r["mib_per_s"] for r in rows], color="tab:green")
        ax.set_xlabel(f"MiB/s (loopback; {where})")
        ax.invert_yaxis()
        ax.set_title("minibatch stream vs bare gRPC and raw TCP")
    else:
        fig, ax = plt.subplots(figsize=(9, 5))
        _plot_server_rows(ax, served, model_step_ms)
        devices = (f"a {served[0]['server_device'].upper()} server to a "
                   f"{str(served[0]['trainer_device']).split(':')[0].upper()} trainer"
                   if "server_device" in served[0] else "one server to a trainer")
        ax.set_title(f"products-like batches from {devices} ({where})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log.info("wrote %s", path)


def _plot_server_rows(ax: Any, served: list[dict[str, Any]], model_step_ms: float | None) -> None:
    step_of = {id(r): float(re.search(r"step ([\d.]+) ms", r["label"]).group(1))  # type: ignore[union-attr]
               for r in served}
    steps = sorted(set(step_of.values()))
    caches = list(dict.fromkeys(str(r.get("cache_size", "0")) for r in served))
    width = 0.8 / len(caches)
    for k, cache in enumerate(caches):
        mine = {step_of[id(r)]: r for r in served if str(r.get("cache_size", "0")) == cache}
        mb = statistics.median(r["bytes"] / r["items"] / 1e6 for r in mine.values())
        xs = [i + (k - (len(caches) - 1) / 2) * width for i, st in enumerate(steps) if st in mine]
        values = [mine[st]["items_per_s"] for st in steps if st in mine]
        what = "no trainer cache" if cache == "0" else f"trainer cache {cache}"
        ax.bar(xs, values, width=width, label=f"{what}: {mb:,.1f} MB a batch")
        for x, v in zip(xs, values, strict=True):
            ax.text(x, v * 0.92, f"{v:.1f}", ha="center", va="top", fontsize=8, color="white")
    for i, st in enumerate(steps):
        if st > 0:
            ax.hlines(1000 / st, i - 0.45, i + 0.45, colors="black", linewidth=1.5,
                      label="what a step of that length allows" if i == 1 else None)
    if model_step_ms:
        ax.axhline(1000 / model_step_ms, color="tab:red", linestyle="--",
                   label=f"the model's own step on this GPU: {model_step_ms:g} ms, "
                         f"{1000 / model_step_ms:.0f} batches/s")
    ax.set_xticks(range(len(steps)), ["no model step" if st == 0 else f"{st:g} ms model step"
                                      for st in steps])
    ax.set_yscale("log")
    ax.set_ylim(1, ax.get_ylim()[1] * 6)  # room for the legend above the bars and lines
    ax.set_ylabel("batches/s delivered (log scale)")
    ax.legend(fontsize=8, loc="upper right")


def plot_only(path: Path, name: str) -> int:
    """The plot of results already written: a stream JSON, or a ``make gpu-check``
    report (its stream step's rows, and its model step's float32 time); ``<name>.png``
    beside it."""
    payload = read_results(path)
    stream, model = report_step(payload, "stream"), report_step(payload, "model step")
    rows = stream["rows"] if stream is not None else payload.get("rows", [])
    step_ms = model.get("float32 ms per step") if model is not None else None
    plot(rows, path.parent / f"{name}.png", describe_machine(payload), step_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
