"""``SamplingService``: what trainers call. Thin: each handler validates its request into
a job or an answer (:mod:`sampling_server.jobs`), hands a job to the pipeline and streams
its messages. Every failure becomes a status naming the problem, and the server goes on
serving other calls."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from protos import sampling_pb2 as pb
from protos.allocator import release_free_memory
from sampling_server.errors import MalformedRequest, RequestError, abort_on_error, bounded, printable
from sampling_server.expectation import check_expectation
from sampling_server.fields import wire_feature_dtype
from sampling_server.jobs import epoch_job, hot_node_type, lookup_nodes
from sampling_server.metrics import ServerMetrics
from sampling_server.pipeline import IN_TRANSIT_BATCHES, Pace, SamplingPipeline
from sampling_server.produce import node_tensors_of
from sampling_server.store import PartitionStore
from sampling_server.stream_slots import Slot, SlotLimits, StreamSlots, client_of, end_call, slot_limits

log = logging.getLogger(__name__)

_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


class SamplingServicer:
    """``SamplingService``: cluster facts and epoch streams."""

    def __init__(self, store: PartitionStore, pipeline: SamplingPipeline,
                 limits: SlotLimits | None = None):
        self.store = store
        self.pipeline = pipeline
        #: The stream slots, shared fairly among clients (sampling_server/stream_slots.py).
        self.slots = StreamSlots(limits or slot_limits(store.config), self._evicted)
        #: Streams running now.
        self.active = 0
        self._active_lock = threading.Condition()
        #: Set while the server drains: new streams are refused (UNAVAILABLE).
        self.draining = threading.Event()
        #: Why the peers are the wrong ones (None when they are right): streams are
        #: refused with it (FAILED_PRECONDITION) until it is fixed.
        self.peer_problem: Callable[[], str | None] = lambda: None
        #: Where streams and rejections are counted (None: nowhere).
        self.metrics: ServerMetrics | None = None

    def _rejected(self, method: str) -> Callable[[str], None] | None:
        metrics = self.metrics
        return None if metrics is None else lambda code: metrics.rejected(method, code)

    def _evicted(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.evicted(reason)

    def _draining(self) -> str | None:
        if self.draining.is_set():
            return (f"StreamMinibatches: partition {self.store.partition_id}'s server is shutting "
                    "down; retry on its restarted server")
        return None

    def wait_streams_done(self, timeout: float, poll: float | None = None) -> bool:
        """Wait until no stream runs; False when ``timeout`` passed first. ``poll``: wake
        at least this often (the main thread must, to run signal handlers)."""
        deadline = time.monotonic() + timeout
        with self._active_lock:
            while self.active:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._active_lock.wait(remaining if poll is None else min(remaining, poll))
            return True

    def GetClusterInfo(
        self, request: pb.ClusterInfoRequest, context: grpc.ServicerContext
    ) -> pb.ClusterInfo:
        with abort_on_error(context, "GetClusterInfo", self.store.partition_id,
                            self._rejected("GetClusterInfo")):
            info = self.store.cluster_info()
        log.debug("partition=%d client=%s: cluster info", self.store.partition_id,
                  printable(request.client_id))
        return info

    def LookupNodes(
        self, request: pb.LookupNodesRequest, context: grpc.ServicerContext
    ) -> pb.LookupNodesReply:
        with abort_on_error(context, "LookupNodes", self.store.partition_id):
            self.store.partition  # noqa: B018 - raises NotLoaded (UNAVAILABLE) while loading
            return lookup_nodes(request, self.store)

    def StreamHotNodes(
        self, request: pb.HotNodesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.HotNodesChunk]:
        """The hottest nodes of this partition and their features (feature cache fill)."""
        p = self.store.partition_id
        with abort_on_error(context, "StreamHotNodes", p, self._rejected("StreamHotNodes")):
            self.store.partition  # noqa: B018 - raises NotLoaded (UNAVAILABLE) while loading
            node_type = hot_node_type(request, self.store)
            check_expectation(request, self.store, hot_order=True)
            stored = self.store.feature_dtypes.get(node_type, pb.FLOAT32)
            dtype = wire_feature_dtype(request.feature_dtype, stored, "HotNodesRequest.feature_dtype")
            log.info("partition=%d client=%s: hot nodes: %d%s%s", p, printable(request.client_id),
                     request.count, f" of {node_type!r}" if self.store.typed else "",
                     " with features" if request.include_features else "")
            yield from self.pipeline.hot_of(node_type).blocks(request, dtype)

    def StreamMinibatches(
        self, requests: Iterator[Any], context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        """The epoch stream: the call's first message is the epoch request, the later
        ones the client's acknowledgements, read on a thread of their own
        (:meth:`_read_acknowledgements`) and pacing what the stream produces."""
        p = self.store.partition_id
        with abort_on_error(context, "StreamMinibatches", p, self._rejected("StreamMinibatches")):
            try:
                first = next(requests, None)
            except grpc.RpcError:  # the client went away before its request arrived
                return
            request = epoch_request_of(first)
            self.store.partition  # noqa: B018 - raises NotLoaded (UNAVAILABLE) while loading
            draining = self._draining()
            if draining:
                raise RequestError(draining, grpc.StatusCode.UNAVAILABLE)
            # before the peers: it is about this server
            check_expectation(request, self.store,
                              hot_order=bool(request.cache_counts or request.typed_cache_counts))
            problem = self.peer_problem()
            if problem:
                raise RequestError(f"StreamMinibatches: partition {p}'s server is NOT_SERVING: "
                                   f"{problem}", _PRECONDITION)
            job = epoch_job(request, self.store)
            node_tensors_of(self.pipeline.node_tensors, job.node_tensors, "EpochRequest.node_tensors")
            client = client_of(context, job.client_id)
            fields = (f"partition={p} client={printable(job.client_id)} "
                      f"peer={printable(client.principal)} rank={job.rank}/{request.world_size} "
                      f"epoch={job.epoch}")
            slot = self.slots.admit(client, context, fields, self._draining)
        started, sent = time.perf_counter(), 0
        with self._active_lock:
            self.active += 1
        if self.metrics is not None:
            self.metrics.streams_open.inc()
        try:
            stop = threading.Event()
            pace = Pace(self.pipeline.prefetch + IN_TRANSIT_BATCHES)

            def ended() -> None:
                stop.set()
                pace.close()

            if not context.add_callback(ended):  # the call has ended already
                ended()
            threading.Thread(target=_read_acknowledgements, args=(requests, slot, pace),
                             name=f"acks-p{p}", daemon=True).start()
            log.info("%s: stream start: %d of %d batches here, resume_from=%d", fields,
                     len(job.batches), job.num_batches, request.resume_from)
            # Response headers tell the trainer the stream was accepted; a stream that
            # fails after this point (a peer lost mid-epoch) is resumed by the trainer
            # from the next batch it lacks.
            context.send_initial_metadata(())
            with abort_on_error(context, f"StreamMinibatches ({fields})", p):
                for message, done in self.pipeline.stream(job, stop, client, pace, client.principal):
                    slot.handing(len(message), done is not None)
                    yield message
                    sent += done is not None
        finally:
            self.slots.release(slot)
            with self._active_lock:
                self.active -= 1
                idle = self.active == 0
                self._active_lock.notify_all()
            if idle:  # the batches' buffers are free now: give them back (protos/allocator.py)
                release_free_memory()
            if self.metrics is not None:
                self.metrics.streams_open.dec()
            state = "done" if sent == len(job.batches) else "ended early"
            log.info("%s: stream %s: %d batches sent (%d acknowledged) in %.2f s", fields, state,
                     sent, slot.taken, time.perf_counter() - started)


def epoch_request_of(first: Any) -> pb.EpochRequest:
    """The epoch request of a ``StreamMinibatches`` call's first message; raises
    :class:`RequestError` (INVALID_ARGUMENT) naming the field when it is not one."""
    if isinstance(first, MalformedRequest):
        raise RequestError(first.describe())
    if first is None or not first.HasField("epoch"):
        got = "no message" if first is None else \
            f"a message with {first.WhichOneof('kind') or 'no field'} set"
        raise RequestError(f"StreamMinibatchesRequest.epoch: expected the epoch request as the "
                           f"call's first message, got {got}")
    epoch: pb.EpochRequest = first.epoch
    return epoch


def _acknowledgement_problem(message: Any, slot: Slot) -> str | None:
    """Why ``message`` is not an acknowledgement the stream of ``slot`` can take (naming
    the field), or None once counted."""
    if isinstance(message, MalformedRequest):
        return message.describe()
    if not message.HasField("taken"):
        kind = message.WhichOneof("kind")
        got = "a second epoch request" if kind == "epoch" else "a message with no field set"
        return f"StreamMinibatchesRequest.taken: expected acknowledgements after the epoch request, got {got}"
    return slot.took(message.taken.batches)


def _read_acknowledgements(requests: Iterator[Any], slot: Slot, pace: Pace) -> None:
    """Count what the client of ``slot``'s stream acknowledges taking, and let its
    producer run that much further, until the call ends; a message that is not such an
    acknowledgement ends the call with INVALID_ARGUMENT naming the field."""
    try:
        for message in requests:
            problem = _acknowledgement_problem(message, slot)
            if problem is not None:
                log.info("%s: acknowledgement refused: %s", slot.fields, problem)
                end_call(slot.context, grpc.StatusCode.INVALID_ARGUMENT,
                         bounded(f"StreamMinibatches: {problem}"))
                return
            pace.took(message.taken.batches)
    except grpc.RpcError:  # the call ended
        pass
