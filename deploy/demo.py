"""The local demo: partition the embedded `small` graph in 2, start 2 sampling servers and
a 2-process DDP trainer on this machine (CPU, gloo), train a few epochs, shut down.

    python deploy/demo.py [--epochs 5] [--data data/demo]

Every child process has a deadline; on any failure everything started is stopped and
the exit code is non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("demo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def servers(part_dir: Path, num_parts: int, env: dict[str, str],
            device: str = "auto") -> Iterator[list[str]]:
    """Start one sampling server per partition; SIGTERM them all on the way out."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(num_parts)]
    procs = []
    try:
        for p, address in enumerate(addresses):
            cmd = [sys.executable, "-m", "sampling_server", "--partition-dir", str(part_dir),
                   "--partition", str(p), "--listen", address, "--peers", ",".join(addresses),
                   "--device", device, "--log-level", "WARNING"]
            log.info("starting server %d: %s", p, " ".join(cmd))
            procs.append(subprocess.Popen(cmd, env=env))
        yield addresses
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=30))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait(timeout=10))
        log.info("servers exited with %s", codes)
        if any(c != 0 for c in codes):
            raise RuntimeError(f"a sampling server exited with {codes}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/demo"))
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--trainers", type=int, default=2, help="DDP processes (default 2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="deadline for training (s)")
    parser.add_argument("--device", default="cpu",
                        help="trainers' device: cpu (gloo, default) or cuda (NCCL, cuda:LOCAL_RANK)")
    parser.add_argument("--server-device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="sampling servers' device (default auto: CUDA when usable)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    part_dir = args.data / "small-2"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "partitioner", "partition", "--synthetic", "small",
                    "--num-parts", "2", "--out", str(part_dir), "--overwrite", "--no-progress"],
                   check=True, timeout=300, env=env)
    metrics = args.data / "metrics.json"
    started = time.perf_counter()
    with servers(part_dir, 2, env, args.server_device) as addresses:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.trainers}", "-m", "trainer_client.train",
               "--servers", ",".join(addresses), "--epochs", str(args.epochs),
               "--fanouts", "10,5", "--batch-size", "128", "--device", args.device,
               "--metrics-json", str(metrics), "--checkpoint-dir", str(args.data / "checkpoints")]
        log.info("starting %d trainers: %s", args.trainers, " ".join(cmd))
        subprocess.run(cmd, check=True, timeout=args.timeout, env=env)
    result = json.loads(metrics.read_text())
    print(f"demo done in {time.perf_counter() - started:.0f} s: "
          f"test accuracy {result['test_acc']:.3f} (chance {1 / 6:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
