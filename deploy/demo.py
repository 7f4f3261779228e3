"""The local demo: partition the embedded `small` graph in 2 (or take your own partition
directory), then train on this machine with `graphfeed-local`: one sampling server per
partition and a 2-process DDP trainer (CPU, gloo), a few epochs, everything stopped.

    python deploy/demo.py [--epochs 5] [--data data/demo] [--partition-dir parts/]

Every child process has a deadline; on any failure everything started is stopped and
the exit code is non-zero.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("demo")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("data/demo"))
    parser.add_argument("--partition-dir", type=Path, default=None,
                        help="train on this partitioned graph instead of partitioning `small`")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--trainers", type=int, default=2, help="DDP processes (default 2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="deadline for training (s)")
    parser.add_argument("--device", default="cpu",
                        help="trainers' device: cpu (gloo, default), cuda or auto (NCCL on cuda:LOCAL_RANK)")
    parser.add_argument("--server-device", choices=["auto", "cpu", "cuda"], default="cpu",
                        help="sampling servers' device (default cpu)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    part_dir = args.partition_dir
    if part_dir is None:
        part_dir = args.data / "small-2"
        subprocess.run([sys.executable, "-m", "partitioner", "partition", "--synthetic", "small",
                        "--num-parts", "2", "--out", str(part_dir), "--overwrite", "--no-progress"],
                       check=True, timeout=300, env=env)
    metrics = args.data / "metrics.json"
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "trainer_client.local", "--partition-dir", str(part_dir),
           "--nproc-per-node", str(args.trainers), "--server-device", args.server_device,
           "--log-dir", str(args.data / "logs"), "--",
           "--epochs", str(args.epochs), "--fanouts", "10,5", "--batch-size", "128", "--device", args.device,
           "--metrics-json", str(metrics), "--checkpoint-dir", str(args.data / "checkpoints")]
    log.info("training: %s", " ".join(cmd))
    subprocess.run(cmd, check=True, timeout=args.timeout, env=env)
    result = json.loads(metrics.read_text())
    chance = f" (chance {1 / 6:.3f})" if args.partition_dir is None else ""
    print(f"demo done in {time.perf_counter() - started:.0f} s: epoch {result['selected_epoch']} selected "
          f"by validation, test accuracy {result['test_acc']:.3f}{chance}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
