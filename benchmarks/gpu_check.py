"""One command for a machine with a CUDA GPU: every GPU test and GPU figure, one report.

    make gpu-check                      # or: PYTHONPATH=. python benchmarks/gpu_check.py

First a preflight (seconds): every package the steps import, and one tiny kernel compiled
and run by numba-cuda; if any fails, the report names it and no step is run. Then the
steps, each a child process with its own deadline (the whole run fits in ``--budget``,
10 minutes by default):

1. ``pytest -m gpu``: the ``gpu``-marked tests on the real GPU (no simulator);
2. ``benchmarks/sampler.py``: the CUDA sampler with the graph in GPU memory and over UVA
   (pinned host memory), structure alone and with features, on ``--preset``; then with
   features from the server-side GPU feature cache at 100 %, 20 % and 0 % of the rows in
   GPU memory (the rest host-mapped over UVA);
3. ``benchmarks/stream.py``: a CUDA sampling server streaming to a trainer whose loader
   puts batches on the GPU, with no trainer cache (every feature row on the stream) and
   with the default ``auto`` cache on the GPU, beside bare gRPC and TCP in the same run;
4. ``benchmarks/link.py``: the CUDA sampler's link batches (binary negatives 1:1,
   fanouts [15, 10, 5], batch 1024 seed edges) on ``--link-preset``, structure alone and
   with features;
5. ``benchmarks/experiments/model_step.py``: one training step of the default model (GraphSAGE) on a
   real sampled batch of ``--preset``, in float32 and bfloat16 autocast: what a stream
   must deliver a batch within to keep this GPU busy;
6. ``benchmarks/embeddings.py --preset mag-small --device cuda``: R-GCN with the featureless
   types' embeddings held by the servers against dense ones, the rows arriving on the GPU;
7. ``benchmarks/inference.py`` on ``small`` and ``mag-small``: every node's output by
   layer-wise inference with the layer tables on CUDA sampling servers and the trainer
   ranks on the GPU, against the replicated tables and sampled inference, and each
   model's difference from a full-graph forward;
8. ``deploy/demo.py --trainers 1 --device auto``: a 1-GPU NCCL DDP run of the demo with
   CUDA sampling servers.

Writes ``benchmarks/results/gpu-check.json`` and ``gpu-check.md`` (the device name, every
step's verdict and time, and every figure), and redraws the plots docs/performance.md
shows from it (``sampler.png``, ``gpu-check-stream.png``). Exits 1 when a step fails.
Without a usable CUDA GPU it says so and exits 0, writing nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
log = logging.getLogger("gpu-check")

#: Every test file with ``gpu``-marked tests (``pytest -m gpu`` on these alone: the other
#: files import packages a GPU image may lack).
GPU_TEST_FILES = ("tests/test_sampler_cuda.py", "tests/test_gpu_feature_cache.py",
                  "tests/test_gpu_trainer.py", "tests/test_feature_cache.py",
                  "tests/test_typed_service.py", "tests/test_node_tensors.py")

PYTEST_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?)")


@dataclass
class Step:
    """One step of the check: what ran, how it ended and what it measured."""

    name: str
    command: list[str]
    #: "passed", "failed" or "timed out" (or "not run" when the budget was spent).
    status: str = "not run"
    seconds: float = 0.0
    returncode: int | None = None
    #: The last lines of the step's output (kept for every step, for the report).
    tail: str = ""
    #: What the step measured (benchmark rows, test counts, training metrics).
    figures: dict[str, Any] = field(default_factory=dict)


def gpu_info() -> dict[str, Any] | None:
    """The GPU torch and Numba would use, or None when there is no usable CUDA GPU."""
    try:
        import torch
    except ImportError:
        log.warning("torch is not importable: run `make install`, or set GPU_PYTHON")
        return None
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {
        "name": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
        "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }
    try:
        import numba
        from numba import cuda

        info["numba"] = numba.__version__
        info["numba_cuda_usable"] = bool(cuda.is_available())
    except ImportError as exc:
        info["numba"] = f"not importable: {exc}"
        info["numba_cuda_usable"] = False
    return info


#: What every step imports; a GPU image may lack some (see docs/performance.md, "GPU check").
PREFLIGHT_MODULES = ("grpc", "grpc_health.v1.health", "google.protobuf", "yaml", "tqdm",
                     "torch_geometric", "protos.sampling_pb2", "sampling_server.server",
                     "trainer_client.loader", "partitioner")
PREFLIGHT = """
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        print(f"problem: import {name}: {type(exc).__name__}: {exc}")
try:
    import numpy as np
    from numba import cuda

    @cuda.jit
    def add_one(a):
        i = cuda.grid(1)
        if i < a.size:
            a[i] += 1

    a = cuda.to_device(np.zeros(8, np.int64))
    add_one[1, 8](a)
    if a.copy_to_host().tolist() != [1] * 8:
        print("problem: a test kernel ran but wrote wrong values")
except Exception as exc:
    print(f"problem: numba-cuda cannot compile and run a kernel: {type(exc).__name__}: {exc}")
"""


def preflight(env: dict[str, str], modules: tuple[str, ...] = PREFLIGHT_MODULES) -> list[str]:
    """What would make every step fail, found in seconds: a package that does not import
    (e.g. grpcio-health-checking missing, a protobuf older than the generated code) or
    numba-cuda unable to compile and run a kernel (e.g. NumPy 2.5 with numba-cuda 0.30).
    Empty when all is well."""
    try:
        proc = subprocess.run([sys.executable, "-c", PREFLIGHT, *modules], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return ["the preflight check did not finish within 300 s"]
    problems = [line.removeprefix("problem: ") for line in proc.stdout.splitlines()
                if line.startswith("problem: ")]
    if proc.returncode and not problems:
        problems.append(f"the preflight check exited with {proc.returncode}: "
                        f"{(proc.stderr or proc.stdout)[-2000:]}")
    return problems


def run_step(step: Step, timeout: float, env: dict[str, str]) -> None:
    """Run one step in a process group of its own; at its deadline the whole group goes
    (the demo's and the stream benchmark's servers included)."""
    log.info("== %s (deadline %.0f s): %s", step.name, timeout, " ".join(step.command))
    started = time.perf_counter()
    proc = subprocess.Popen(step.command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        step.status = "timed out"
    else:
        step.returncode = proc.returncode
        step.status = "passed" if proc.returncode == 0 else "failed"
    step.tail = "\n".join((out or "").splitlines()[-40:])
    step.seconds = round(time.perf_counter() - started, 1)
    log.info("%s: %s in %.1f s", step.name, step.status, step.seconds)
    if step.status != "passed":
        log.error("last lines of %s:\n%s", step.name, step.tail)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):
        return {}


def collect_figures(step: Step, data: Path) -> None:
    if step.name == "gpu tests":
        step.figures = {kind: int(n) for n, kind in PYTEST_SUMMARY.findall(step.tail)}
    elif step.name in ("sampler", "stream", "link"):
        payload = read_json(RESULTS / f"gpu-check-{step.name}.json")
        step.figures = {"rows": payload.get("rows", []), "ratios": payload.get("ratios", {})}
    elif step.name == "embeddings":
        payload = read_json(RESULTS / "gpu-check-embeddings.json")
        step.figures = {k: payload[k] for k in ("summary", "embedding_bytes_ratio", "speedup")
                        if k in payload}
    elif step.name == "layer-wise inference":
        payload = read_json(RESULTS / "gpu-check-inference.json")
        step.figures = {k: payload[k] for k in ("runs", "exactness") if k in payload}
    elif step.name == "model step":
        payload = read_json(RESULTS / "gpu-check-model-step.json")
        keys = ("nodes_per_batch_median", "edges_per_batch_median")
        step.figures = {k: payload[k] for k in keys if k in payload}
        step.figures.update({f"{r['label']} ms per step": r["ms_median"] for r in payload.get("rows", [])})
    elif step.name == "demo (1 GPU, NCCL)":
        metrics = read_json(data / "demo" / "metrics.json")  # (the node task's demo)
        step.figures = {k: metrics[k] for k in ("test_acc", "selected_epoch", "device", "world_size",
                                                "seeds_per_second") if k in metrics}
        for key in ("train_seconds", "data_wait_seconds", "seeds_per_second"):
            step.figures[f"epoch_{key}"] = [e.get(key) for e in metrics.get("epochs", [])]


def steps_for(args: argparse.Namespace) -> list[tuple[Step, float]]:
    """(step, its share of the budget); a step never gets more than what is left."""
    py = sys.executable
    bench = ["--data", str(args.data / "bench"), "--preset", args.preset]
    return [
        (Step("gpu tests", [py, "-m", "pytest", "-q", "-m", "gpu", *GPU_TEST_FILES,
                            "-p", "no:cacheprovider"]), 0.21),
        (Step("sampler", [py, "benchmarks/sampler.py", *bench, "--devices", "cuda",
                          "--topologies", "device", "uva", "--gpu-cache-sizes", "1", "0.2", "0",
                          "--no-baselines",
                          "--results-name", "gpu-check-sampler"]), 0.20),
        (Step("stream", [py, "benchmarks/stream.py", *bench, "--gib", "1", "--passes", "3",
                         "--sizes-kib", "4096", "--server-device", "cuda", "--trainer-device", "cuda",
                         "--cache-size", "0", "auto",
                         "--results-name", "gpu-check-stream"]), 0.14),
        (Step("link", [py, "benchmarks/link.py", "--data", str(args.data / "bench"), "--preset",
                       args.link_preset, "--devices", "cuda", "--no-baselines", "--passes", "1",
                       "--batches", "10", "--results-name", "gpu-check-link"]), 0.14),
        (Step("model step", [py, "benchmarks/experiments/model_step.py", *bench, "--device", "cuda",
                             "--results-name", "gpu-check-model-step"]), 0.05),
        (Step("embeddings", [py, "benchmarks/embeddings.py", "--data", str(args.data / "bench"),
                             "--preset", "mag-small", "--device", "cuda", "--passes", "1", "--steps", "10",
                             "--results-name", "gpu-check-embeddings"]), 0.07),
        (Step("layer-wise inference", [py, "benchmarks/inference.py", "--data", str(args.data / "bench"),
                                       "--plain", "small", "--typed", "mag-small", "--quick", "--layers", "2",
                                       "--device", "cuda", "--server-device", "cuda", "--exactness",
                                       "--results-name", "gpu-check-inference"]), 0.06),
        (Step("demo (1 GPU, NCCL)", [py, "deploy/demo.py", "--data", str(args.data / "demo"),
                                     "--trainers", "1", "--device", "auto", "--server-device", "cuda",
                                     "--epochs", "3"]), 0.13),
    ]


def markdown(report: dict[str, Any]) -> str:
    gpu = report["gpu"]
    lines = [f"# gpu-check: {gpu['name']}", "",
             f"{report['date']}; torch {gpu['torch']} (CUDA {gpu['torch_cuda']}, NCCL {gpu['nccl']}), "
             f"numba {gpu.get('numba')} (threading layer "
             f"{report['machine'].get('numba_threading_layer')}); "
             f"{report['machine']['cores']} CPU cores; preset "
             f"`{report['preset']}`; {report['seconds']:.0f} s in all.", "",
             "| step | verdict | seconds |", "| --- | --- | ---: |"]
    problems = report.get("preflight_problems") or []
    if problems:
        lines[-2:-2] = ["**Preflight failed; no step was run:**", "",
                        *[f"- {p}" for p in problems], ""]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']:.1f} |" for s in report["steps"]]
    for s in report["steps"]:
        rows = s["figures"].get("rows")
        if rows:
            lines += ["", f"## {s['name']}", "", "| row | seeds/s | MiB/s | batches/s | wait |",
                      "| --- | ---: | ---: | ---: | ---: |"]
            for r in rows:
                wait = f"{r['wait_fraction']:.0%}" if "wait_fraction" in r else ""
                lines.append(f"| {r['label']} | {r.get('seeds_per_s', '')} | {r.get('mib_per_s', '')} | "
                             f"{r.get('items_per_s', '')} | {wait} |")
            lines += [f"- {k}: {v}" for k, v in s["figures"].get("ratios", {}).items()]
        elif s["figures"]:
            lines += ["", f"## {s['name']}", "", "```", json.dumps(s["figures"], indent=1), "```"]
        if s["status"] != "passed":
            lines += ["", f"### {s['name']}: last lines", "", "```", s["tail"], "```"]
    return "\n".join(lines) + "\n"


#: The plots docs/performance.md shows from this report, redrawn beside it once it is
#: written: the sampler against PyG (the CPU results beside this GPU's), and the stream
#: against the model's step. (script, the results it reads, the plot's name)
PLOTS = (("benchmarks/sampler.py", ("sampler.json", "gpu-check.json"), "sampler"),
         ("benchmarks/stream.py", ("gpu-check.json",), "gpu-check-stream"))


def redraw_plots(env: dict[str, str]) -> None:
    """Redraw :data:`PLOTS` from the results in :data:`RESULTS` (seconds, no GPU); one
    whose results are not all there is left out, one that fails is logged."""
    for script, names, name in PLOTS:
        paths = [RESULTS / n for n in names]
        if not all(p.is_file() for p in paths):
            continue
        command = [sys.executable, script, "--plot-only", *map(str, paths), "--results-name", name]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            log.warning("plot %s failed: %s", name, done.stderr[-500:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path("data/gpu-check"))
    p.add_argument("--preset", default="products-like", help="graph of the benchmarks (products-like)")
    p.add_argument("--link-preset", default="citation2-like",
                   help="graph of the link-batch rows (citation2-like; citation2-small in seconds)")
    p.add_argument("--budget", type=float, default=570.0, help="seconds for all steps together")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    gpu = gpu_info()
    if gpu is None:
        print("gpu-check: no usable CUDA GPU on this machine; nothing to check")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import machine

    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # the real GPU, never the simulator
    started = time.monotonic()
    end = started + args.budget
    planned = steps_for(args)
    steps = []
    problems = preflight(env)
    for problem in problems:
        log.error("preflight: %s", problem)
    for i, (step, _share) in enumerate([] if problems else planned):
        # Its own share plus whatever the steps before it left unused.
        later = sum(share for _, share in planned[i + 1:]) * args.budget
        left = end - time.monotonic()
        deadline = max(left - later, min(5.0, left))  # at least 5 s while the budget lasts
        if deadline > 1:
            run_step(step, deadline, env)
            collect_figures(step, args.data)
        steps.append(step)
    if problems:  # no step can pass: none is run, each is reported as not run
        steps = [step for step, _ in planned]
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu, "machine": machine(),
              "preset": args.preset, "seconds": round(time.monotonic() - started, 1),
              "preflight_problems": problems, "steps": [asdict(s) for s in steps]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gpu-check.json").write_text(json.dumps(report, indent=1) + "\n")
    (RESULTS / "gpu-check.md").write_text(markdown(report))
    redraw_plots(env)
    failed = [s.name for s in steps if s.status != "passed"]
    print(markdown(report))
    print(f"gpu-check: {len(steps) - len(failed)} of {len(steps)} steps passed; report in "
          f"{RESULTS / 'gpu-check.md'}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
