"""How many CPU threads one sampling call may use.

Each call into a parallel Numba kernel (or a torch op) fans out over a thread pool that,
left alone, is as large as the *machine's* CPU count: a server in a container limited to
2 CPUs (``docker run --cpus 2``, a Kubernetes CPU limit) on a 64-core host would start
64 threads per call, and the kernel quota then throttles them all. :func:`kernel_threads`
picks the count from the CPUs this process may really use (its affinity mask and its
cgroup's CPU quota), and :func:`limit_kernel_threads` applies it to the calling thread
(Numba's thread count is per calling thread, so every thread that runs kernels calls it).
"""

from __future__ import annotations

from protos.cpus import usable_cpus

__all__ = ["kernel_threads", "limit_kernel_threads", "sampling_workers", "usable_cpus"]


def kernel_threads(threads: int | None) -> int:
    """Threads per sampling call: ``threads`` when given, else :func:`usable_cpus`."""
    return usable_cpus() if threads is None else threads


#: Fewest and most sampling workers chosen automatically (:func:`sampling_workers`).
MIN_AUTO_WORKERS, MAX_AUTO_WORKERS = 2, 6


def sampling_workers(workers: int | None) -> int:
    """Sampling threads of a server: ``workers`` when given, else half of
    :func:`usable_cpus`, at least :data:`MIN_AUTO_WORKERS` (a worker spends much of a
    batch waiting on peers) and at most :data:`MAX_AUTO_WORKERS` (the most measured: on
    a 16-core host 6 workers made 26 % more bfloat16 batches per second than 2, with
    every stage slower by something the threads share, not the interpreter lock, whose
    wait stayed under 1 ms)."""
    if workers is not None:
        return workers
    return max(MIN_AUTO_WORKERS, min(MAX_AUTO_WORKERS, usable_cpus() // 2))


def limit_kernel_threads(threads: int) -> None:
    """Make parallel Numba kernels called from *this thread* use at most ``threads``
    threads (capped at the size of Numba's pool). Use as a thread pool's initializer."""
    import numba

    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
