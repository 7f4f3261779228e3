"""The local demo: partition an embedded synthetic graph in 2 (or take your own partition
directory), then train on this machine with `graphfeed-local`: one sampling server per
partition and a 2-process DDP trainer (CPU, gloo), a few epochs, everything stopped.

    python deploy/demo.py [--epochs 5] [--data data/demo] [--partition-dir parts/]
    python deploy/demo.py --typed [--data data/demo-typed]    # R-GCN on mag-small
    python deploy/demo.py --link [--data data/demo-link]      # link prediction on citation2-small

The default graph is the homogeneous `small` (GraphSAGE); `--typed` partitions the
ogbn-mag-shaped `mag-small` (papers, authors, institutions, fields of study, reverse
relations; format v2) and trains R-GCN on typed minibatches; `--link` partitions
`citation2-small` with its link splits (held-out citations, 100 negatives each) and
trains a GraphSAGE + dot-product link predictor on link batches (binary negatives drawn
by the servers), reporting validation and test MRR (OGB's ogbl-citation2 protocol).
Every child process has a
deadline; on any failure everything started is stopped, the cause is printed and the
exit code is non-zero.
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

#: Per graph kind: the preset, partitioner flags, trainer flags, and chance accuracy.
GRAPHS: dict[str, tuple[str, list[str], list[str], float]] = {
    "small": ("small", [], ["--fanouts", "10,5", "--batch-size", "128"], 1 / 6),
    "typed": ("mag-small", ["--add-reverse"],
              ["--model", "rgcn", "--fanouts", "10,5", "--batch-size", "256", "--hidden", "64",
               "--lr", "0.01"], 1 / 8),
    # chance: a random scorer's MRR against 100 negatives, sum(1/r for r in 1..101) / 101
    "link": ("citation2-small", [],
             ["--task", "link", "--fanouts", "10,5", "--batch-size", "256", "--hidden", "64",
              "--eval-batch-size", "32"], sum(1 / r for r in range(1, 102)) / 101),
}


def _partition(kind: str, out: Path, env: dict[str, str]) -> None:
    preset, flags, _, _ = GRAPHS[kind]
    subprocess.run([sys.executable, "-m", "partitioner", "partition", "--synthetic", preset, *flags,
                    "--num-parts", "2", "--out", str(out), "--overwrite", "--no-progress"],
                   check=True, timeout=300, env=env)


def _server_failure(log_dir: Path) -> str | None:
    """The last error line of a server log that has one (a server that did not serve)."""
    for path in sorted(log_dir.glob("server-*.log")):
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()]
        if errors:
            return f"{path}: {errors[-1].strip()}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=None, help="default data/demo (data/demo-typed)")
    parser.add_argument("--partition-dir", type=Path, default=None,
                        help="train on this partitioned graph instead of partitioning the preset")
    parser.add_argument("--typed", action="store_true",
                        help="the typed graph mag-small and R-GCN instead of small and GraphSAGE")
    parser.add_argument("--link", action="store_true",
                        help="link prediction on citation2-small (validation and test MRR)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--trainers", type=int, default=2, help="DDP processes (default 2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="deadline for training (s)")
    parser.add_argument("--device", default="cpu",
                        help="trainers' device: cpu (gloo, default), cuda or auto (NCCL on cuda:LOCAL_RANK)")
    parser.add_argument("--server-device", choices=["auto", "cpu", "cuda"], default="cpu",
                        help="sampling servers' device (default cpu)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.typed and args.link:
        parser.error("--typed, --link: expected one of them")
    kind = "typed" if args.typed else "link" if args.link else "small"
    data = args.data or Path({"typed": "data/demo-typed", "link": "data/demo-link"}.get(kind, "data/demo"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    part_dir = args.partition_dir
    if part_dir is None:
        part_dir = data / f"{GRAPHS[kind][0]}-2"
        _partition(kind, part_dir, env)
    metrics = data / "metrics.json"
    metrics.unlink(missing_ok=True)
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "trainer_client.local", "--partition-dir", str(part_dir),
           "--nproc-per-node", str(args.trainers), "--server-device", args.server_device,
           "--log-dir", str(data / "logs"), "--",
           "--epochs", str(args.epochs), *GRAPHS[kind][2], "--device", args.device,
           "--metrics-json", str(metrics), "--checkpoint-dir", str(data / "checkpoints")]
    log.info("training: %s", " ".join(cmd))
    code = subprocess.run(cmd, timeout=args.timeout, env=env).returncode
    if code != 0:
        cause = _server_failure(data / "logs")
        sys.stderr.write(f"demo failed: graphfeed-local exited with {code}"
                         + (f"; a sampling server failed: {cause}" if cause else "") + "\n")
        return 1
    result = json.loads(metrics.read_text())
    chance = f" (chance {GRAPHS[kind][3]:.3f})" if args.partition_dir is None else ""
    if kind == "link":
        print(f"demo done in {time.perf_counter() - started:.0f} s: link prediction, "
              f"{result['model']['model']} + {result['model']['decoder']} decoder, epoch "
              f"{result['selected_epoch']} selected by validation MRR {result['selected_val_mrr']:.3f}; test "
              f"MRR {result['test_mrr']:.3f}{chance}, hits@10 {result['test_hits@10']:.3f}")
        return 0
    print(f"demo done in {time.perf_counter() - started:.0f} s: {result['model']['model']}, epoch "
          f"{result['selected_epoch']} selected by validation, test accuracy "
          f"{result['test_acc']:.3f}{chance}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
