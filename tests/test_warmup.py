"""`python -m sampling_server.warmup` compiles the CPU kernels into NUMBA_CACHE_DIR."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_warmup_fills_the_kernel_cache(tmp_path: Path) -> None:
    cache = tmp_path / "numba-cache"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, "-m", "sampling_server.warmup"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kernels compiled and cached" in proc.stderr
    cached = {p.name.split(".")[0] + "." + p.name.split(".")[1] for p in cache.rglob("*.nbi")}
    # The server's sampling, gather and hot-order kernels, the partition job's writer and
    # assigners, a trainer's node-table look-up.
    for kernel in ("cpu_kernels.sample_uniform_parallel", "cpu_gather.gather_rows_and_labels",
                   "cpu_fused.draw_and_look_up", "cpu_fused.number_seeds", "writer._scatter_in_edges",
                   "algorithms._hash_parts", "hot_order._spread", "node_table._look_up",
                   "cpu_kernels._owners_released", "cpu_kernels._group_positions",
                   "cpu_kernels.id_min_max"):
        assert any(c.startswith(kernel) for c in cached), (kernel, sorted(cached))
    assert list(cache.rglob("*.nbc")), "no compiled code in the cache"
