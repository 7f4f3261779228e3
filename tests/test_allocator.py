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


# Per batch, allocate a 64 MiB float32 tensor, touch every page, keep the last three
# alive (as a trainer's prefetch window does); print the page faults of the last 10
# allocations, with torch.empty or with protos.allocator.empty.
_BATCHES = """
import collections, resource, sys
import torch
from protos import allocator
allocator.keep_freed_memory()
make = allocator.empty if sys.argv[1] == "malloc" else (lambda s, d: torch.empty(s, dtype=d))
live = collections.deque(maxlen=3)
def batch():
    x = make((16 << 20, 1), torch.float32)
    x.view(-1)[::1024] = 1.0
    live.append(x)
for _ in range(10):
    batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    batch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _batch_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _BATCHES, mode], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_per_batch_tensors_from_malloc_reuse_the_freed_blocks() -> None:
    # 10 batches of 64 MiB: 163,840 pages if every batch got fresh ones.
    assert _batch_faults("malloc") < 1000


def test_empty_gives_the_shape_and_dtype_asked_for() -> None:
    import torch

    from protos.allocator import empty

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8,
                  torch.float64, torch.int32, torch.int16, torch.int8, torch.bool,
                  torch.complex64):
        x = empty((3, 5), dtype)
        assert x.shape == (3, 5) and x.dtype == dtype and x.is_contiguous()
        x.fill_(1)
        assert int(x.sum()) == 15
    assert empty((0, 4), torch.float32).shape == (0, 4)
    assert empty((7,), torch.bfloat16).shape == (7,)


def test_words_of_gives_the_words_of_a_bfloat16_tensor_from_empty_only() -> None:
    import numpy as np
    import torch

    from protos.allocator import empty, words_of

    x = empty((4, 3), torch.bfloat16)
    words = words_of(x)
    assert words is not None and words.dtype == np.uint16 and words.shape == (4, 3)
    x.copy_(torch.arange(12, dtype=torch.float32).view(4, 3))  # the same memory
    assert np.array_equal(words, x.view(torch.int16).numpy().view(np.uint16))
    assert words_of(x[1:]) is None and words_of(x.view(torch.int16)) is None  # views: none
    assert words_of(empty((4, 3), torch.float32)) is None  # NumPy has the dtype
    assert words_of(torch.zeros(3, dtype=torch.bfloat16)) is None  # not from empty
