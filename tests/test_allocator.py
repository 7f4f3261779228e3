"""The allocator tuning the server applies at start-up."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocate, free, and allocate again a 64 MiB block; print the page faults of the second.
_PROBE = """
import resource, sys
import numpy as np
if sys.argv[1] == "tuned":
    from protos.allocator import keep_freed_memory
    assert keep_freed_memory() and keep_freed_memory()
a = np.ones(1 << 23); del a
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
b = np.ones(1 << 23)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _second_block_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_keep_freed_memory_reuses_large_blocks_without_page_faults() -> None:
    plain, tuned = _second_block_faults("plain"), _second_block_faults("tuned")
    # Without the tuning glibc unmaps the freed block and the new one faults its pages
    # in again (hundreds of faults even with huge pages); with it, the block is reused.
    assert plain > 16
    assert tuned <= plain // 8
