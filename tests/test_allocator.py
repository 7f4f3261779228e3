"""The allocator tuning the server applies at start-up."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocate, free, and allocate again a block of argv[2] MiB, in the main thread or in a
# thread of its own; print the page faults of the second.
_PROBE = """
import resource, sys, threading
import numpy as np
if sys.argv[1] == "tuned":
    from protos.allocator import keep_freed_memory
    assert keep_freed_memory() and keep_freed_memory()
words = int(sys.argv[2]) << 17  # float64 entries of argv[2] MiB
faults = []
def probe():
    a = np.ones(words); del a
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    b = np.ones(words)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
if sys.argv[3] == "thread":
    t = threading.Thread(target=probe); t.start(); t.join()
else:
    probe()
print(faults[0])
"""


def _second_block_faults(mode: str, mib: int = 64, where: str = "main") -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode, str(mib), where],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_keep_freed_memory_reuses_large_blocks_without_page_faults() -> None:
    plain, tuned = _second_block_faults("plain"), _second_block_faults("tuned")
    # Without the tuning glibc unmaps the freed block and the new one faults its pages
    # in again (hundreds of faults even with huge pages); with it, the block is reused.
    assert plain > 16
    assert tuned <= plain // 8


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_keep_freed_memory_reuses_large_blocks_in_other_threads() -> None:
    # A thread's own arena maps any block over 64 MiB afresh, whatever the thresholds;
    # with one arena the block comes from (and goes back to) the main heap.
    plain = _second_block_faults("plain", 160, "thread")
    tuned = _second_block_faults("tuned", 160, "thread")
    assert plain > 16
    assert tuned <= plain // 8


def test_keep_freed_memory_names_a_value_mallopt_cannot_take() -> None:
    from protos.allocator import keep_freed_memory

    with pytest.raises(ValueError,
                       match=r"trim_threshold: expected an integer in \[1, 2147483647\].*got 4294967296"):
        keep_freed_memory(trim_threshold=1 << 32)
