"""`python -m sampling_server.warmup` and `python -m trainer_client.warmup` compile the
server's and the trainer's CPU kernels into NUMBA_CACHE_DIR."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _warm(module: str, cache: Path) -> set[str]:
    """Run ``module``'s warm-up; the kernels whose machine code it left in ``cache``."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, "-m", module], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kernels compiled and cached" in proc.stderr
    assert list(cache.rglob("*.nbc")), "no compiled code in the cache"
    return {p.name.split(".")[0] + "." + p.name.split(".")[1] for p in cache.rglob("*.nbi")}


@pytest.mark.slow
def test_the_servers_warmup_fills_the_kernel_cache(tmp_path: Path) -> None:
    cached = _warm("sampling_server.warmup", tmp_path / "numba-cache")
    # The server's sampling, gather and hot-order kernels, the partition job's writer and
    # assigners; nothing of the trainer's.
    for kernel in ("cpu_kernels.sample_uniform_parallel", "cpu_gather.gather_rows_and_labels",
                   "cpu_fused.draw_and_look_up", "cpu_fused.number_seeds", "writer._scatter_in_edges",
                   "algorithms._hash_parts", "hot_order._spread", "cpu_glue._owners_released",
                   "cpu_glue._group_positions", "cpu_glue.id_min_max"):
        assert any(c.startswith(kernel) for c in cached), (kernel, sorted(cached))
    assert not any(c.startswith(("node_table.", "cache.")) for c in cached), sorted(cached)


@pytest.mark.slow
def test_the_trainers_warmup_fills_the_kernel_cache(tmp_path: Path) -> None:
    cached = _warm("trainer_client.warmup", tmp_path / "numba-cache")
    # a trainer's node-table look-up and its feature cache's assembly of x
    for kernel in ("node_table._look_up", "cache._assemble_rows"):
        assert any(c.startswith(kernel) for c in cached), (kernel, sorted(cached))
