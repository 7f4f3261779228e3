"""What a :class:`~trainer_client.cluster.Cluster` (only it) asks of every server at once
to fill the trainer's tables of one node type, which are plain data: the plan's hot rows
into a :class:`~trainer_client.cache.FeatureCache` (:func:`fill_feature_cache`), every
node's original ID and label into a :class:`~trainer_client.node_table.NodeTable`
(:func:`read_node_table`).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Protocol

import grpc
import numpy as np
import torch
from tqdm import tqdm

from protos import allocator, compact
from protos import sampling_pb2 as pb
from protos.channel import Backoff, GraphfeedError, RetryFailure, ServerUnavailable, error_from_rpc, retry
from protos.codec import decode_tensor, decode_tensor_torch, dtype_name, dtype_to_torch
from trainer_client import cache
from trainer_client.cache import CacheError, FeatureCache
from trainer_client.node_table import NodeTable, NodeTableError

log = logging.getLogger(__name__)


class HotRowsCall(Protocol):
    """A ``StreamHotNodes`` call in flight."""

    def __iter__(self) -> Iterator[pb.HotNodesChunk]: ...

    def cancel(self) -> bool: ...


#: Opens partition ``p``'s ``StreamHotNodes`` of its first ``count`` hot nodes with a
#: deadline of ``timeout`` seconds: ``(p, count, timeout) -> the call``.
HotRows = Callable[[int, int, float], HotRowsCall]
#: ``LookupNodes`` on partition ``p``'s server (with a deadline): ``(p, request) -> reply``.
Lookup = Callable[[int, pb.LookupNodesRequest], pb.LookupNodesReply]
#: Nodes per LookupNodes call (the servers' limit, 16 bytes each in the reply).
BLOCK = 1 << 21
#: Seconds each partition's ``StreamHotNodes`` may take (its deadline).
STREAM_DEADLINE = 600.0


def fill_feature_cache(open_stream: HotRows, addresses: Sequence[str], counts: Sequence[int],
                       book: np.ndarray, dim: int, wire_dtype: int, device: torch.device, *,
                       node_type: str, of_type: str = "", progress: bool | None = None,
                       reconnect: float = 15.0) -> FeatureCache:
    """Stream the plan's rows (``counts[p]`` hottest nodes of partition ``p``, ``dim``
    columns in ``wire_dtype``) from every server onto ``device``; ``book`` is the node
    type's partition book, ``of_type`` names it in messages (" of 'paper'").

    A partition whose stream breaks with ``UNAVAILABLE`` (its server restarting) is
    filled again from its first row, with growing pauses (:data:`cache.FILL_RETRY_PAUSE`),
    for up to ``reconnect`` seconds after the break, as the loader's streams resume; any
    other failure ends the whole fill at once."""
    counts = [int(c) for c in counts]
    # On the CPU both tables come from NumPy's allocator, which asks the kernel for
    # transparent huge pages: each batch reads rows at random, and with 4 KiB pages
    # nearly every read also misses the TLB.
    shape = (sum(counts), dim)
    rows = (allocator.empty(shape, dtype_to_torch(wire_dtype)) if device.type == "cpu" else
            torch.empty(shape, dtype=dtype_to_torch(wire_dtype), device=device))
    slot = allocator.empty((int(book[-1]),), torch.int32 if sum(counts) < 2**31 else torch.int64).fill_(-1)
    parts = [p for p, k in enumerate(counts) if k]
    show = sys.stderr.isatty() if progress is None else progress
    # every partition at once: each server gathers and sends its own rows into its own
    # slice of the table, so the fill goes at the pace of the links, not of one server
    with tqdm(total=sum(counts), desc=f"feature cache{of_type}", unit="node", unit_scale=True,
              disable=not show) as bar, \
            ThreadPoolExecutor(min(len(parts), cache.MAX_FILL_STREAMS) or 1,
                               thread_name_prefix="cache-fill") as pool:
        fill = _Fill(open_stream, addresses, counts, book, rows, slot, reconnect, bar)
        futures = [pool.submit(fill.partition, p) for p in parts]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)  # bounded: the streams' deadline
            for future in (f for f in futures if f.done()):
                future.result()  # raises the first failure
        except BaseException:  # a failure or an interrupt: end the other streams now
            fill.stop()
            for future in futures:
                future.cancel()
            raise
    filled = FeatureCache(counts, rows, slot.to(device), wire_dtype, node_type)
    log.info("feature cache%s: %d nodes (%s of %d) in %s on %s, %.1f MiB", of_type, filled.num_rows, counts,
             int(book[-1]), dtype_name(wire_dtype), device, filled.nbytes / 2**20)
    return filled


class _Fill:
    """The partitions' streams of one fill, into one table's rows and slots."""

    def __init__(self, open_stream: HotRows, addresses: Sequence[str], counts: list[int], book: np.ndarray,
                 rows: torch.Tensor, slot: torch.Tensor, reconnect: float, bar: tqdm) -> None:
        self.open_stream, self.addresses, self.book = open_stream, addresses, book
        self.rows, self.slot, self.reconnect, self.bar = rows, slot, reconnect, bar
        self.starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        self.lock = threading.Lock()
        self.calls: list[HotRowsCall] = []
        self.stopping = threading.Event()

    def started(self, call: HotRowsCall) -> None:
        with self.lock:
            self.calls.append(call)
            if self.stopping.is_set():
                call.cancel()

    def progress(self, b: int) -> None:
        with self.lock:
            self.bar.update(b)

    def stop(self) -> None:
        """End every stream (another partition failed, or the fill was interrupted)."""
        with self.lock:
            self.stopping.set()
            for call in self.calls:
                call.cancel()

    def partition(self, p: int) -> None:
        """Fill partition ``p``'s rows and slots, again after a break (see
        :func:`fill_feature_cache`)."""
        lo, hi = self.starts[p], self.starts[p + 1]
        received = [0]  # rows of the current try

        def counted(b: int) -> None:
            received[0] += b
            self.progress(b)

        def attempt(_: float) -> torch.Tensor:
            received[0] = 0
            return _fill_partition(self.open_stream, self.addresses[p], p, hi - lo, self.rows[lo:hi],
                                   STREAM_DEADLINE, self.started, counted)

        def broke(f: RetryFailure) -> None:
            log.warning("feature cache: partition %d's stream broke after %d of %d nodes (%s); filling it "
                        "again in %.1f s", p, received[0], hi - lo, f.error, f.pause)
            self.progress(-received[0])

        def give_up(f: RetryFailure) -> BaseException:
            exc = f.error
            assert isinstance(exc, ServerUnavailable)
            return ServerUnavailable(f"{exc} (the feature cache's fill of partition {p} was retried for "
                                     f"{self.reconnect:g} s)", what=exc.what, address=exc.address,
                                     code=exc.code, details=exc.details)

        first, cap = cache.FILL_RETRY_PAUSE
        order = retry(attempt, backoff=Backoff(first, 2.0, cap), window=self.reconnect,
                      retryable=lambda e: isinstance(e, ServerUnavailable), on_failure=broke,
                      on_give_up=give_up, sleep=self.stopping.wait)  # another partition failed: stop
        book = self.book
        if int(order.min()) < book[p] or int(order.max()) >= book[p + 1]:
            raise CacheError(f"StreamHotNodes at partition {p}: HotNodesChunk.n_id: "
                             f"expected IDs in {int(book[p])} .. {int(book[p + 1]) - 1}")
        self.slot[order] = torch.arange(lo, hi, dtype=self.slot.dtype)


def _fill_partition(open_stream: HotRows, address: str, p: int, k: int, out: torch.Tensor, timeout: float,
                    started: Callable[[HotRowsCall], None], progress: Callable[[int], None]) -> torch.Tensor:
    """Receive partition ``p``'s first ``k`` hot nodes' rows into ``out``; return their
    IDs. Checks every block. ``started`` gets the call (to cancel it when another
    partition's fill fails), ``progress`` each block's node count."""
    where = f"StreamHotNodes at {address}"
    order = torch.empty(k, dtype=torch.int64)
    done = 0
    try:
        responses = open_stream(p, k, timeout)
        started(responses)
        for msg in responses:
            ids = decode_tensor_torch(msg.n_id)
            x = decode_tensor_torch(msg.x)
            b = ids.numel()
            if msg.first_row != done or msg.count != k or done + b > k:
                raise CacheError(f"{where}: HotNodesChunk.first_row: expected {done} of {k} nodes, got "
                                 f"first_row {msg.first_row} with {b} nodes of count {msg.count}")
            if x.dtype != out.dtype or list(x.shape) != [b, out.shape[1]]:
                raise CacheError(f"{where}: HotNodesChunk.x: expected {out.dtype} of shape "
                                 f"[{b}, {out.shape[1]}], got {x.dtype} of shape {list(x.shape)}")
            order[done:done + b] = ids
            out[done:done + b] = x.to(out.device)
            done += b
            progress(b)
    except grpc.RpcError as err:
        raise error_from_rpc(err, "StreamHotNodes", address) from err
    if done != k:
        raise CacheError(f"{where}: expected {k} nodes, got {done}")
    return order


def read_node_table(lookup: Lookup, addresses: Sequence[str], book: np.ndarray, wire_type: str,
                    of_type: str = "") -> NodeTable | None:
    """Read every node's original ID and label of one node type (``wire_type`` as the
    requests name it: "" on a plain graph; labels -1 but for the target type) from every
    server; None when a server does not answer ``owned_range`` (a server from before it)."""
    bounds = [int(b) for b in book]
    orig, labels = np.empty(bounds[-1], dtype=np.int64), np.empty(bounds[-1], dtype=np.int64)
    for p in range(len(bounds) - 1):
        for first in range(bounds[p], bounds[p + 1], BLOCK):
            count = min(BLOCK, bounds[p + 1] - first)
            request = pb.LookupNodesRequest(owned_range=pb.NodeRange(first=first, count=count),
                                            node_type=wire_type)
            try:
                reply = lookup(p, request)
            except GraphfeedError as exc:
                if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                    log.info("node table: %s; batches carry their original IDs and labels", exc)
                    return None
                raise
            o, y = decode_tensor(reply.original_ids), decode_tensor(reply.labels)
            if o.shape != (count,) or y.shape != (count,):
                raise NodeTableError(
                    f"LookupNodes(owned_range) at {addresses[p]}: expected original_ids and labels of "
                    f"shape [{count}], got {list(o.shape)} and {list(y.shape)}")
            orig[first:first + count], labels[first:first + count] = o, y
    table = NodeTable(compact.narrowest(torch.from_numpy(orig), compact.INDEX_DTYPES),
                      compact.narrowest(torch.from_numpy(labels), compact.LABEL_DTYPES))
    log.info("node table%s: original IDs and labels of %d nodes, %.1f MiB", of_type, bounds[-1],
             table.nbytes / 2**20)
    return table
