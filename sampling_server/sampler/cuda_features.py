"""The CUDA sampler's feature table: hot rows in GPU memory, the rest in pinned host
memory read over UVA (see :mod:`sampling_server.feature_placement`).

Both tables hold their rows in the in-degree order of their nodes
(:func:`~sampling_server.sampler.hot_order.in_degree_order`, as GLT ranks its cache): the
device table the first ``cached`` nodes, the mapped host table the others. Two int32
maps on the GPU give each owned node its row in one of them (-1 in the other), and
:func:`gather_split_rows_kernel` reads a batch's rows from either table in one launch
on PyTorch's current stream, so gathering needs no host round trip. Under Numba's CUDA
simulator the same code runs on CPU tensors and numpy arrays.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from numba import cuda
from numba import types as nbt

from sampling_server.feature_placement import (
    GpuCacheSize,
    describe,
    parse_gpu_cache_size,
    rows_on_device,
    slot_maps,
)
from sampling_server.sampler import cuda_kernels as K
from sampling_server.sampler.cuda_launch import SIMULATOR, kernel_arg, launch, mapped_empty
from sampling_server.sampler.rows import torch_dtype

log = logging.getLogger(__name__)

#: Rows copied per step while the tables fill (bounds the host memory the load takes).
FILL_BYTES = 64 << 20


@cuda.jit
def gather_split_rows_kernel(nodes, node_start, slot, host_slot, cached, host, out):  # type: ignore[no-untyped-def]
    """out[r, c] = row of nodes[r], column c: from the device table ``cached`` when the
    node has a slot there, else from the mapped host table; one thread per element."""
    i = cuda.grid(1)
    width = out.shape[1]
    if i >= nodes.size * width:
        return
    r = i // width
    c = i - r * width
    v = nodes[r] - node_start
    s = slot[v]
    if s >= 0:
        out[r, c] = cached[s, c]
    else:
        out[r, c] = host[host_slot[v], c]


_I32 = nbt.int32[::1]
K.register(gather_split_rows_kernel, *[(K.I64, K.S64, _I32, _I32, dt[:, ::1], dt[:, ::1], dt[:, ::1])
                                       for dt in K.FEATURE_DTYPES])


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` (None under the simulator, which has no GPU memory)."""
    if SIMULATOR or device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


class FeatureTable:
    """One node type's features split between GPU memory and mapped host memory.

    Shared by every sampler of one partition (the samplers for other sampling options
    take the first one's tables), so the rows are placed once.
    """

    def __init__(self, x: np.ndarray, order: np.ndarray, node_start: int, device: torch.device,
                 size: GpuCacheSize | str | float = "auto"):
        """``x``: the rows of the nodes ``node_start ..`` (one per node); ``order``: their
        global IDs, hottest first (the tables' row order)."""
        if not isinstance(size, GpuCacheSize):
            size = parse_gpu_cache_size(size)
        if x.ndim != 2:
            raise ValueError(f"x: expected a 2-d feature matrix, got shape {list(x.shape)}")
        self.device = device
        self.node_start = int(node_start)
        #: Stored feature dtype (the gather's output dtype).
        self.dtype = torch_dtype(x.dtype)
        self.num_rows, self.width = int(x.shape[0]), int(x.shape[1])
        self.row_bytes = self.width * np.dtype(x.dtype).itemsize
        #: Global IDs of the nodes, hottest first (the tables' row order).
        self.order = np.asarray(order, dtype=np.int64)
        #: Rows in GPU memory: the first ``cached`` nodes of :attr:`order`.
        self.cached = rows_on_device(size, self.num_rows, self.row_bytes, device_free_bytes(device))
        slot, host_slot = slot_maps(self.order, node_start, self.cached)
        #: int32 ``[n_p]``: device-table row of each owned node, -1 when not cached.
        self.slot = torch.from_numpy(slot).to(device)
        #: int32 ``[n_p]``: host-table row of each owned node, -1 when cached.
        self.host_slot = torch.from_numpy(host_slot).to(device)
        local = self.order - node_start
        # At least one row each, so no kernel argument is ever empty (the extra row is never read).
        self.device_rows = torch.empty((max(self.cached, 1), self.width), dtype=self.dtype,
                                       device=device)
        self.host_rows = mapped_empty((max(self.num_rows - self.cached, 1), self.width), x.dtype)
        self._fill(x, local)
        log.info("features: %s", describe(self.cached, self.num_rows, self.row_bytes))

    def _fill(self, x: np.ndarray, local: np.ndarray) -> None:
        """Copy the rows of ``x`` in the order ``local`` into both tables, a step at a time."""
        if self.width == 0:  # nothing to copy (and no mapped memory behind an empty table)
            return
        # a plain ndarray over the same pinned host memory (numba-cuda's MappedNDArray.view
        # takes a dtype, not an array class)
        host = np.asarray(self.host_rows)
        step = max(1, FILL_BYTES // max(self.row_bytes, 1))
        for lo in range(0, self.cached, step):
            hi = min(lo + step, self.cached)
            self.device_rows[lo:hi].copy_(torch.from_numpy(np.asarray(x[local[lo:hi]])))
        for lo in range(self.cached, self.num_rows, step):
            hi = min(lo + step, self.num_rows)
            host[lo - self.cached:hi - self.cached] = x[local[lo:hi]]

    def gather(self, nodes: torch.Tensor) -> torch.Tensor:
        """``[len(nodes), F]`` rows of owned nodes (int64 global IDs on the device, checked
        by the caller), in the stored dtype."""
        out = torch.empty((nodes.numel(), self.width), dtype=self.dtype, device=nodes.device)
        if out.numel():
            launch(gather_split_rows_kernel, out.numel(), kernel_arg(nodes),
                     np.int64(self.node_start), kernel_arg(self.slot),
                     kernel_arg(self.host_slot), kernel_arg(self.device_rows),
                     self.host_rows, kernel_arg(out))
        return out
