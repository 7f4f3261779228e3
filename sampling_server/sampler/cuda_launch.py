"""The plumbing of the CUDA kernels: where their tensors live, torch tensors as kernel
arguments without a copy (``__cuda_array_interface__``; numpy views under Numba's CUDA
simulator), pinned device-mapped host memory for UVA, and launches on PyTorch's current
stream, so kernels and torch ops stay ordered without a synchronisation."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from numba import config as numba_config
from numba import cuda

#: True when Numba runs kernels on its CUDA simulator (set before Numba is imported).
SIMULATOR = bool(getattr(numba_config, "ENABLE_CUDASIM", 0))
#: numba-cuda's driver logger, which logs every device allocation and free at INFO.
NUMBA_DRIVER_LOGGER = "numba.cuda.cudadrv.driver"
# numba-cuda leaves that logger's level unset when the application has configured logging
# before the driver starts (as the server and the benchmarks do), so a CUDA server's INFO
# log would be mostly alloc/dealloc lines: keep them at WARNING unless the user asked for
# them (NUMBA_CUDA_LOG_LEVEL).
if not getattr(numba_config, "CUDA_LOG_LEVEL", ""):
    logging.getLogger(NUMBA_DRIVER_LOGGER).setLevel(logging.WARNING)
#: Threads per block on a real GPU.
BLOCK = 256
#: Threads per block under the simulator, which runs each block's threads at once.
SIM_BLOCK = 32


# -- torch <-> numba ---------------------------------------------------------------------
def torch_device() -> torch.device:
    """Where the CUDA sampler's tensors live: the current GPU, or the CPU under the simulator."""
    if SIMULATOR:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def kernel_arg(t: torch.Tensor) -> Any:
    """A kernel argument viewing ``t``'s memory, without a copy (a Numba device array on a
    GPU, the ``.numpy()`` view under the simulator)."""
    if not t.is_contiguous():
        raise ValueError(f"kernel_arg: expected a contiguous tensor, got strides {t.stride()}")
    if SIMULATOR:
        return t.numpy()
    dtype = _NUMPY_DTYPES.get(t.dtype)
    if dtype is None or t.device.type != "cuda":
        return cuda.as_cuda_array(t)
    return _device_view(t, dtype)


#: The dtypes :func:`kernel_arg` views directly (others go through
#: ``__cuda_array_interface__``).
_NUMPY_DTYPES: dict[torch.dtype, np.dtype[Any]] = {
    torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32),
    torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_),
    torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}
#: CUDA device index -> its Numba (primary) context.
_contexts: dict[int, Any] = {}


def _device_view(t: torch.Tensor, dtype: np.dtype[Any]) -> Any:
    """The device array ``cuda.as_cuda_array(t)`` makes, built directly: without the
    interface dictionary and the context lookup of each call, which cost more than the
    launch itself when a batch launches about 20 kernels with 3 to 10 arrays each."""
    from numba.cuda.cudadrv import driver
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    context = _contexts.get(index)
    if context is None:
        context = _contexts[index] = cuda.current_context()
    pointer = driver.MemoryPointer(context, driver.binding.CUdeviceptr(t.data_ptr()),
                                   size=t.numel() * dtype.itemsize, owner=t)
    shape = tuple(t.shape)
    # C-order strides from the shape (as the interface gives for a contiguous tensor),
    # not t.stride(), which may be anything along a dimension of size 1
    strides, step = [], dtype.itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return DeviceNDArray(shape, tuple(reversed(strides)), dtype, gpu_data=pointer)


def mapped_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """Uninitialised pinned, device-mapped host memory that kernels read over UVA (numpy
    under the simulator)."""
    if SIMULATOR:
        return np.empty(shape, dtype)
    if math.prod(shape) == 0:  # nothing to map (kernels never read it)
        return cuda.device_array(shape, dtype)
    return cuda.mapped_array(shape, dtype)


def host_mapped(a: np.ndarray) -> Any:
    """A copy of ``a`` in :func:`mapped_empty` memory."""
    out = mapped_empty(a.shape, a.dtype)
    if a.size:
        np.copyto(out, a)
    return out


_streams: dict[int, Any] = {}


def _current_stream() -> Any:
    if SIMULATOR:
        return 0
    handle = torch.cuda.current_stream().cuda_stream
    if handle not in _streams:
        _streams[handle] = cuda.external_stream(handle)
    return _streams[handle]


@contextmanager
def _simulated_wraparound() -> Iterator[None]:
    # The simulator runs the RNG's uint64 arithmetic on numpy scalars, which warn on the
    # wrap-around that is intended here (compiled code wraps silently).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
        yield


def launch(kernel: Any, n: int, *args: Any) -> None:
    """Launch ``kernel`` with at least ``n`` threads on PyTorch's current stream."""
    block = min(SIM_BLOCK if SIMULATOR else BLOCK, n)
    grid = (n + block - 1) // block
    if SIMULATOR:
        with _simulated_wraparound():
            kernel[grid, block](*args)
    else:
        kernel[grid, block, _current_stream()](*args)
