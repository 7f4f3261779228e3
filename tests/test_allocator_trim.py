"""protos/allocator.py release_free_memory: the allocator's free pages go back to the system when asked,
at most once per interval."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from pathlib import Path

import pytest

from protos import allocator as heap

glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux") or heap._malloc_trim is None,
                                reason="malloc_trim is glibc's")


def _anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@glibc_only
def test_freed_heap_pages_go_back_to_the_system(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block, count = 64 << 10, 3200  # 200 MiB in blocks below the mmap threshold: from the heap
    blocks = [libc.malloc(block) for _ in range(count)]
    for address in blocks:
        ctypes.memset(address, 1, block)  # touched: resident
    for address in blocks[:-1]:  # the last one keeps the heap's top: no trim on free
        libc.free(address)
    before = _anon_bytes()
    monkeypatch.setattr(heap, "_last_trim", -heap.MIN_TRIM_INTERVAL)
    assert heap.release_free_memory()
    after = _anon_bytes()
    libc.free(blocks[-1])
    assert before - after > 150 << 20, (before, after)


@glibc_only
def test_trims_at_most_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(heap, "_malloc_trim", lambda pad: calls.append(pad) or 1)
    monkeypatch.setattr(heap, "_last_trim", -heap.MIN_TRIM_INTERVAL)
    assert heap.release_free_memory(now=100.0)
    assert not heap.release_free_memory(now=100.0 + heap.MIN_TRIM_INTERVAL / 2)
    assert heap.release_free_memory(now=100.0 + heap.MIN_TRIM_INTERVAL)
    assert calls == [0, 0]


def test_no_allocator_to_trim_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_malloc_trim", None)
    assert not heap.release_free_memory()
