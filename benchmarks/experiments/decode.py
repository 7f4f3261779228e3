"""Decode benchmark (not a test): what the trainer's decoding of a batch costs, without
the stream around it, with its copies made inline or on the decode threads.

Real ``products-like`` batches ([15, 10, 5], 1024 seeds, float32 features) are sampled
once by a real partition's sampler and encoded as the server does (``protos.fastwire``,
``--chunk-kib`` of tensor data per message, default ``codec.DEFAULT_CHUNK_BYTES``). Each
round then hands every message, as a new ``bytes`` object as gRPC delivers it, to a
``BatchAssembler`` that copies the pieces of multi-message tensors (``x`` spans ~45
messages of 4 MiB) either on the thread that reads the messages (``inline``) or on the
process's decode threads (``decode threads``), the two modes alternating round by round.

Per mode: the process's CPU seconds per GiB decoded (every thread's, the decode
threads' included) and the wall seconds per GiB, medians over the rounds. The trainer
picks the mode from the CPUs it may use (``decode.BACKGROUND_COPIES_MIN_CPUS``); this
says what each costs on the machine at hand. Writes ``benchmarks/results/decode.json``.

    python benchmarks/experiments/decode.py --data data/bench
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, sampler
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import machine, write_json

log = logging.getLogger("bench.decode")

MODES = {"inline": False, "decode threads": True}


def encode_batches(part_dir: Path, num_batches: int, chunk_bytes: int) -> list[list[bytes]]:
    """``num_batches`` real batches, each as the messages the server would send."""
    from stream import _sample_batches, prepare_batch

    return [prepare_batch(named, out, index, num_batches, chunk_bytes).messages()
            for index, (named, out) in enumerate(_sample_batches(str(part_dir), num_batches))]


def decode_round(encoded: list[list[bytes]], background: bool) -> tuple[float, float, int]:
    """Decode every batch once; return (process CPU s, wall s, bytes decoded)."""
    from protos import fastwire
    from trainer_client.decode import BatchAssembler

    assembler = BatchAssembler(background_copies=background)
    cpu = wall = 0.0
    nbytes = 0
    for messages in encoded:
        raws = [bytes(bytearray(m)) for m in messages]  # new objects, as gRPC hands them over
        c0, w0 = time.process_time(), time.perf_counter()
        done = None
        for raw in raws:
            done = assembler.add(fastwire.minibatch_chunk_deserializer(raw))
        cpu += time.process_time() - c0
        wall += time.perf_counter() - w0
        assert done is not None
        nbytes += done.nbytes
        del done  # as a trainer that is through with the batch: its buffers are reused
    return cpu, wall, nbytes


def main() -> int:
    from protos import codec

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--preset", default="products-like")
    parser.add_argument("--batches", type=int, default=3, help="distinct batches per round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per mode (alternating)")
    parser.add_argument("--chunk-kib", type=int, default=codec.DEFAULT_CHUNK_BYTES >> 10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from sampler import ensure_partition

    from protos.allocator import keep_freed_memory
    from protos.cpus import usable_cpus
    from trainer_client.decode import default_background_copies

    keep_freed_memory()  # as graphfeed-train does
    encoded = encode_batches(ensure_partition(args.data, args.preset), args.batches,
                             args.chunk_kib << 10)
    for background in MODES.values():  # untimed: the buffer pool's first buffers, the threads
        decode_round(encoded, background)
    per_mode: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (list(MODES) if r % 2 == 0 else list(reversed(MODES))):
            cpu, wall, nbytes = decode_round(encoded, MODES[mode])
            gib = nbytes / (1 << 30)
            per_mode[mode].append((cpu / gib, wall / gib))
    rows: list[dict[str, Any]] = [
        {"mode": mode, "cpu_s_per_gib": round(statistics.median(c for c, _ in v), 4),
         "wall_s_per_gib": round(statistics.median(w for _, w in v), 4),
         "cpu_s_per_gib_range": [round(min(c for c, _ in v), 4), round(max(c for c, _ in v), 4)]}
        for mode, v in per_mode.items()]
    cpus = usable_cpus()
    default = "decode threads" if default_background_copies() else "inline"
    payload = {"benchmark": "decode", "preset": args.preset, "machine": machine(),
               "load_average": os.getloadavg(), "usable_cpus": cpus, "default_mode": default,
               "chunk_kib": args.chunk_kib, "batches": args.batches, "rounds": args.rounds,
               "rows": rows}
    path = write_json("decode", payload)
    for row in rows:
        print(f"{row['mode']:<16} cpu {row['cpu_s_per_gib']:.3f} s/GiB "
              f"({row['cpu_s_per_gib_range'][0]:.3f}-{row['cpu_s_per_gib_range'][1]:.3f})  "
              f"wall {row['wall_s_per_gib']:.3f} s/GiB")
    print(f"usable CPUs {cpus}: the trainer's default here is {default}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
