"""Peer fetch benchmark (not a test): one ``FetchNodeData`` call between servers, the
remote-row half of a batch's gather.

``products-like`` in 2 ``range`` partitions, a real sampling server for each (its own
process, on the CPU). This process asks partition 1's server, as partition 0's server
does when a batch holds partition 1's nodes (``PeerClient.node_data``), for the features
and labels of ``--nodes`` random nodes that partition 1 owns (by default half a
products batch: the remote share of ~430,000 sampled nodes), in float32 and in bfloat16.
Rows alternate within each of ``--passes`` passes; each pass times ``--calls`` calls per
row and keeps their median. Reports ms per call and MB/s of rows received, with the CPU
seconds the serving process spent per call. Writes ``benchmarks/results/peer_fetch.json``.

    python benchmarks/experiments/peer_fetch.py --data data/bench
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, sampler
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
import torch
from common import ensure_partitions, held_port, machine, write_json

log = logging.getLogger("bench.peer_fetch")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/bench"))
    parser.add_argument("--preset", default="products-like")
    parser.add_argument("--nodes", type=int, default=215_000,
                        help="remote nodes per call (default: half a products batch's)")
    parser.add_argument("--calls", type=int, default=8, help="timed calls per row and pass")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--results-name", default="peer_fetch")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    from partitioner.graph import PLAIN_NODE_TYPE
    from partitioner.manifest import read_manifest
    from protos import sampling_pb2 as pb
    from sampling_server.peer_client import PeerCallOptions, PeerClient
    from trainer_client.local import wait_serving

    part_dir = ensure_partitions(args.data, args.preset, 2)
    book = np.asarray(read_manifest(part_dir).partition_book[PLAIN_NODE_TYPE], dtype=np.int64)
    addresses = [f"127.0.0.1:{held_port()}" for _ in range(2)]
    logdir = Path(tempfile.mkdtemp(prefix="peer-fetch-"))
    logs = [logdir / f"server{p}.log" for p in range(2)]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "sampling_server", "--partition-dir", str(part_dir.resolve()),
         "--partition", str(p), "--listen", addresses[p], "--peers", ",".join(addresses),
         "--verify", "size", "--no-mmap", "--device", "cpu", "--log-level", "WARNING"],
        stdout=logs[p].open("w"), stderr=subprocess.STDOUT) for p in range(2)]
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    try:
        wait_serving(addresses, procs, logs, 600)
        client = PeerClient(addresses, 0, timeout=120)
        lo, hi = int(book[1]), int(book[2])
        options = {"float32": PeerCallOptions(feature_dtype=pb.FLOAT32),
                   "bfloat16": PeerCallOptions(feature_dtype=pb.BFLOAT16)}
        for opts in options.values():  # warm-up: one call of each
            client.node_data({1: _nodes(rng, lo, hi, args.nodes)}, True, True, opts)
        per_pass: dict[str, list[tuple[float, float, int]]] = {name: [] for name in options}
        for p in range(args.passes):
            for name in (list(options) if p % 2 == 0 else list(options)[::-1]):
                times, cpu, nbytes = [], [], 0
                for _ in range(args.calls):
                    nodes = _nodes(rng, lo, hi, args.nodes)
                    began, cpu0 = time.perf_counter(), _cpu_seconds(procs[1].pid)
                    x, y = client.node_data({1: nodes}, True, True, options[name])[1]
                    times.append(time.perf_counter() - began)
                    cpu.append(_cpu_seconds(procs[1].pid) - cpu0)
                    nbytes = sum(t.numel() * t.element_size() for t in (x, y) if t is not None)
                per_pass[name].append((statistics.median(times), statistics.median(cpu), nbytes))
                log.info("pass %d %-9s %7.1f ms per call, %7.1f MB/s", p, name,
                         1e3 * per_pass[name][-1][0], nbytes / per_pass[name][-1][0] / 1e6)
        client.close()
        for name, passes in per_pass.items():
            secs = statistics.median(s for s, _, _ in passes)
            rows.append({"label": name, "nodes": args.nodes, "bytes": passes[0][2],
                         "ms_per_call": round(1e3 * secs, 2),
                         "ms_per_call_passes": [round(1e3 * s, 2) for s, _, _ in passes],
                         "mb_per_s": round(passes[0][2] / secs / 1e6, 1),
                         "server_cpu_s_per_call": round(statistics.median(c for _, c, _ in passes), 4)})
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    path = write_json(args.results_name, {"benchmark": "peer_fetch", "preset": args.preset,
                                          "machine": machine(), "passes": args.passes,
                                          "calls": args.calls, "rows": rows})
    for r in rows:
        print(f"{r['label']:<9} {r['ms_per_call']:>8.1f} ms per call  {r['mb_per_s']:>8.1f} MB/s  "
              f"server CPU {r['server_cpu_s_per_call']:.3f} s per call  passes {r['ms_per_call_passes']}")
    print(f"wrote {path}")
    return 0


def _nodes(rng: np.random.Generator, lo: int, hi: int, count: int) -> torch.Tensor:
    return torch.from_numpy(np.sort(rng.choice(np.arange(lo, hi), size=min(count, hi - lo),
                                               replace=False)))


if __name__ == "__main__":
    raise SystemExit(main())
