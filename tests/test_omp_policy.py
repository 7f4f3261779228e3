"""The server's processes wait passively at OpenMP barriers unless told otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = "import sampling_server, os; print(os.environ['OMP_WAIT_POLICY'])"


def _policy(env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env, check=True)
    return proc.stdout.strip()


def test_passive_by_default_and_the_environment_wins() -> None:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _policy(base) == "PASSIVE"
    assert _policy({**base, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
