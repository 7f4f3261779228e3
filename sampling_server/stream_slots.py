"""Fair shares of a server's stream slots: who may open a trainer stream, who waits, and
whose stream is taken back when others wait.

A server runs at most ``--max-streams`` trainer streams at once. Without more rules, one
client that opens that many streams and never reads them holds every slot, and every
other trainer is refused until it goes away. :class:`StreamSlots` shares the slots:

* **Who is a client** (:class:`ClientKey`): a *principal* (the common name of the client
  certificate where mutual TLS authenticates one, else the peer's host) and the
  ``client_id`` it sends (a trainer sends one per rank).
* **Shares** (:func:`fair_shares`): the slots are split evenly among the principals that
  hold or wait for one, and each principal's part evenly among its clients. Shares only
  matter while someone waits: a client may use free slots beyond its share.
* **Waiting**: a new stream takes a free slot at once. When none is free, a client below
  its share waits (up to ``admit_wait`` seconds; one call per client, at most
  :data:`MAX_WAITERS` in all, so waiting calls cannot take the server's handler threads),
  and the next free slot goes to the waiting client furthest below its share. Anyone
  else is refused at once with ``RESOURCE_EXHAUSTED``.
* **Taking back**: once a waiting client has waited ``evict_after`` seconds (less than
  ``admit_wait``) with no slot come free, a client holding more than its share loses one
  stream, whatever its transport does: of the clients most over their share, the stream
  furthest ahead of what its client has acknowledged (the one it reads least; then the
  one left unacknowledged longest, then the oldest). It ends with ``RESOURCE_EXHAUSTED``
  naming the share and the flag; the trainer resumes it from its next batch, losing and
  doubling nothing.
* **What a client took** is what it acknowledged (``BatchesTaken``, :class:`Slot`), never
  what gRPC's transport accepted: a client that stops reading is seen at once, however
  large its HTTP/2 windows.
* **Per-client limits**: at most ``max_client_streams`` streams and
  ``max_client_inflight_bytes`` bytes sent and not yet acknowledged by the client; a
  new stream over either is refused with ``RESOURCE_EXHAUSTED`` naming the flag.
* **Idle streams**: a stream whose client left sent batches unacknowledged for
  ``idle_timeout`` seconds is cancelled, whoever waits (``--stream-idle-timeout``).

Every refusal's details contain :data:`protos.channel.SLOT_REFUSAL`, the mark by which
a trainer tells a busy server (retry) from a ``RESOURCE_EXHAUSTED`` that retrying cannot
cure (a message over the size limit).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from protos.channel import SLOT_REFUSAL
from sampling_server.config import ServerConfig
from sampling_server.errors import RequestError, printable

log = logging.getLogger(__name__)

#: Most calls waiting for a slot at once (each holds a gRPC handler thread while it waits).
MAX_WAITERS = 8
#: Longest pause of a waiting call between two looks at the slots.
WAIT_POLL_S = 0.25
#: Clients whose streams taken back are counted (the most recent ones).
MAX_COUNTED_CLIENTS = 1024
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class ClientKey:
    """One client of the server, as fair shares count them."""

    #: Who is calling: ``tls:<common name>`` where mutual TLS authenticated the caller,
    #: else the peer's host (``ipv4:10.0.0.7``).
    principal: str
    #: The ``client_id`` of the request (a trainer's names its rank).
    client_id: str

    def __str__(self) -> str:
        return f"{printable(self.principal)}/{printable(self.client_id)}"


def peer_host(peer: str) -> str:
    """``ipv4:10.0.0.7:51234`` -> ``ipv4:10.0.0.7``; ``ipv6:[::1]:5`` -> ``ipv6:[::1]``;
    anything without a port (``unix:/path``) as it is."""
    kind, sep, rest = peer.partition(":")
    if not sep or kind not in ("ipv4", "ipv6"):
        return peer
    host, colon, port = rest.rpartition(":")
    return f"{kind}:{host}" if colon and port.isdigit() else peer


def client_of(context: grpc.ServicerContext, client_id: str) -> ClientKey:
    """The :class:`ClientKey` of a call: its certificate's common name where mutual TLS
    authenticated one, else its peer's host; and its ``client_id``."""
    try:
        names = context.auth_context().get("x509_common_name") or ()
    except (AttributeError, ValueError):  # no transport security
        names = ()
    if names:
        principal = "tls:" + b",".join(names).decode("utf-8", "backslashreplace")
    else:
        principal = peer_host(context.peer() or "")
    return ClientKey(principal, client_id)


def fair_shares(max_streams: int, clients: Iterable[ClientKey]) -> dict[ClientKey, float]:
    """Each client's share of ``max_streams`` slots: an equal part per principal, split
    equally among the principal's clients (fractions: 32 slots among 3 clients are
    10.67 each)."""
    by_principal: dict[str, set[ClientKey]] = defaultdict(set)
    for client in clients:
        by_principal[client.principal].add(client)
    if not by_principal:
        return {}
    per_principal = max_streams / len(by_principal)
    return {c: per_principal / len(members) for members in by_principal.values() for c in members}


@dataclass(frozen=True)
class SlotLimits:
    """The limits :class:`StreamSlots` keeps (``ServerConfig`` fields of the same names)."""

    #: Streams served at once (``--max-streams``).
    max_streams: int = 32
    #: Streams one client may hold (``--max-client-streams``).
    max_client_streams: int = 32
    #: Bytes sent to one client and not yet acknowledged by it (``--max-client-inflight-bytes``).
    max_client_inflight_bytes: int = 1 << 30
    #: Seconds a client below its share waits for a slot to come free before one is taken
    #: back from a client over its share (``--stream-evict-after``; less than ``admit_wait``).
    evict_after: float = 1.0
    #: Seconds a new stream waits for a slot (``--admit-wait``).
    admit_wait: float = 5.0
    #: Seconds a stream's client may leave sent batches unacknowledged before the stream
    #: is cancelled (``--stream-idle-timeout``).
    idle_timeout: float = 120.0


def slot_limits(config: ServerConfig) -> SlotLimits:
    """The :class:`SlotLimits` of a server's configuration."""
    return SlotLimits(max_streams=config.max_streams,
                      max_client_streams=config.max_client_streams or config.max_streams,
                      max_client_inflight_bytes=config.max_client_inflight_bytes,
                      evict_after=config.stream_evict_after, admit_wait=config.admit_wait,
                      idle_timeout=config.stream_idle_timeout)


@dataclass(eq=False)
class Slot:
    """One running stream: whose it is, what it sent and what its client acknowledged
    having taken (``BatchesTaken``). The stream's handler counts what it sends
    (:meth:`handing`), the reader of the client's acknowledgements what was taken
    (:meth:`took`); both under the slot's own lock."""

    #: The client the stream is for.
    client: ClientKey
    #: The call (cancelled to end the stream from another thread).
    context: grpc.ServicerContext
    #: The stream's log fields (partition, client, rank, epoch).
    fields: str
    #: When the stream started (monotonic seconds).
    started: float = field(default_factory=time.monotonic)
    #: Batches sent (their last message handed to gRPC), and their messages' bytes
    #: (with the messages of a batch not sent in full yet).
    sent: int = 0
    sent_bytes: int = 0
    #: Batches the client acknowledged, and the bytes of their messages.
    taken: int = 0
    taken_bytes: int = 0
    #: Since when the client has left sent messages unacknowledged, made no progress
    #: counting as none (None: it acknowledged everything sent).
    waiting_since: float | None = None
    #: Set once the slot was taken back (the stream is being ended).
    ended: bool = False
    _batch_ends: deque[int] = field(default_factory=deque, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def handing(self, nbytes: int, ends_batch: bool) -> None:
        """A message of ``nbytes`` is handed to gRPC, the last of its batch when
        ``ends_batch`` (call before ``yield``, so that the client can never acknowledge
        a batch not yet counted as sent)."""
        with self._lock:
            if self.waiting_since is None:
                self.waiting_since = time.monotonic()
            self.sent_bytes += nbytes
            if ends_batch:
                self.sent += 1
                self._batch_ends.append(self.sent_bytes)

    def took(self, batches: int) -> str | None:
        """The client says it has taken ``batches`` batches of this stream in all; why
        that cannot be (naming the field), or None once counted."""
        with self._lock:
            if not self.taken <= batches <= self.sent:
                return (f"BatchesTaken.batches: expected {self.taken} .. {self.sent} (at least the "
                        f"count acknowledged before, at most the batches sent on this call), got "
                        f"{batches}")
            while self.taken < batches:
                self.taken_bytes = self._batch_ends.popleft()
                self.taken += 1
            self.waiting_since = time.monotonic() if self.sent_bytes > self.taken_bytes else None
            return None

    @property
    def unacknowledged_bytes(self) -> int:
        """Bytes sent that the client has not acknowledged."""
        return self.sent_bytes - self.taken_bytes

    @property
    def ahead(self) -> int:
        """Batches sent that the client has not acknowledged."""
        return self.sent - self.taken

    def unread_for(self, now: float) -> float:
        """Seconds the client has left sent messages unacknowledged (0: none are)."""
        since = self.waiting_since
        return 0.0 if since is None else max(0.0, now - since)


def pick_victim(held: Mapping[ClientKey, Sequence[Slot]], shares: Mapping[ClientKey, float],
                now: float) -> Slot | None:
    """The stream to take back for a waiting client: of the clients over their share,
    most over first, the stream furthest ahead of what its client acknowledged, then the
    one unacknowledged longest, then the oldest; None when no client is over its share."""
    over = sorted((c for c, slots in held.items() if len(slots) > shares.get(c, 0.0)),
                  key=lambda c: len(held[c]) - shares.get(c, 0.0), reverse=True)
    for client in over:
        live = [s for s in held[client] if not s.ended]
        if live:
            return max(live, key=lambda s: (s.ahead, s.unread_for(now), -s.started))
    return None


def end_call(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End a running call from another thread with ``code`` and ``details`` (the client
    sees them), even while its handler waits for the client to read. Falls back to a
    plain cancel (CANCELLED) where gRPC offers no way to give a status."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        call.cancel(code.value[0], details)  # type: ignore[union-attr]
    except Exception:  # another gRPC: no such handle; the client still sees the call end
        context.cancel()


@dataclass(eq=False)
class _Waiter:
    client: ClientKey
    arrived: float = field(default_factory=time.monotonic)


class StreamSlots:
    """The stream slots of one server, shared fairly (see the module's docstring)."""

    def __init__(self, limits: SlotLimits, on_evict: Callable[[str], None] | None = None) -> None:
        self.limits = limits
        self._held: dict[ClientKey, list[Slot]] = defaultdict(list)
        self._waiting: list[_Waiter] = []
        self._cond = threading.Condition()
        self._on_evict = on_evict
        #: Streams taken back per client (the most recent :data:`MAX_COUNTED_CLIENTS`).
        self._taken_back: OrderedDict[ClientKey, int] = OrderedDict()
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch_idle, name="idle-streams", daemon=True)
        self._watcher.start()

    # -- admission ---------------------------------------------------------------------
    def admit(self, client: ClientKey, context: grpc.ServicerContext, fields: str,
              stopping: Callable[[], str | None] = lambda: None) -> Slot:
        """A slot for ``client``'s new stream, waiting (bounded) where fair shares say it
        may; raises :class:`RequestError` (RESOURCE_EXHAUSTED naming the limit and its
        flag) when there is none. ``stopping`` says why the server no longer admits
        (UNAVAILABLE), or None."""
        with self._cond:
            self._check_client_limits(client)
            if self._free() > len(self._waiting):  # one left over for every waiting call
                return self._take(client, context, fields)
            self._check_may_wait(client)
            waiter = _Waiter(client)
            self._waiting.append(waiter)
            try:
                return self._wait(waiter, context, fields, stopping)
            finally:
                self._waiting.remove(waiter)
                self._cond.notify_all()

    def _wait(self, waiter: _Waiter, context: grpc.ServicerContext, fields: str,
              stopping: Callable[[], str | None]) -> Slot:
        """Wait (holding the lock but while in ``wait``) until a slot is this waiter's:
        one that comes free, or after ``evict_after`` seconds one taken back."""
        deadline = waiter.arrived + self.limits.admit_wait
        take_back_at = waiter.arrived + self.limits.evict_after
        while True:
            why = stopping()
            if why:
                raise RequestError(why, grpc.StatusCode.UNAVAILABLE)
            if not context.is_active():
                raise RequestError("StreamMinibatches: the client went away while waiting for a "
                                   "slot", grpc.StatusCode.CANCELLED)
            if self._free() > 0 and self._first_waiter() is waiter:
                return self._take(waiter.client, context, fields)
            now = time.monotonic()
            if self._free() == 0 and now >= take_back_at and self._evict_for(waiter):
                continue  # the slot is free now: take it before the deadline is looked at
            if now >= deadline:
                raise self._busy(waiter.client, f"no slot came free within {self.limits.admit_wait:g} s "
                                 "(--admit-wait) and no client holds more than its fair share")
            wake = take_back_at if now < take_back_at else deadline
            self._cond.wait(min(wake - now, WAIT_POLL_S))

    def _check_client_limits(self, client: ClientKey) -> None:
        mine = self._held.get(client, [])
        limit = self.limits.max_client_streams
        if len(mine) >= limit and limit < self.limits.max_streams:  # else: --max-streams says
            raise RequestError(f"StreamMinibatches: {SLOT_REFUSAL}: client {client} already holds "
                               f"{len(mine)} streams here; expected at most {limit} per client "
                               "(server limit --max-client-streams); retry once one ends", _EXHAUSTED)
        inflight = sum(s.unacknowledged_bytes for s in mine)
        byte_limit = self.limits.max_client_inflight_bytes
        if inflight >= byte_limit:
            raise RequestError(f"StreamMinibatches: {SLOT_REFUSAL}: client {client} has {inflight} "
                               f"bytes sent and not yet acknowledged; expected less than {byte_limit} "
                               "per client (server limit --max-client-inflight-bytes); read the open "
                               "streams, then retry", _EXHAUSTED)

    def _check_may_wait(self, client: ClientKey) -> None:
        """Raise unless ``client`` may wait: below its share, not waiting already, and
        fewer than :data:`MAX_WAITERS` waiting."""
        shares = self._shares(extra=client)
        held = len(self._held.get(client, ()))
        if held >= shares[client]:
            raise self._busy(client, f"it holds {held}, its fair share is {shares[client]:.2f}")
        if any(w.client == client for w in self._waiting):
            raise self._busy(client, "another stream of the same client waits for a slot already")
        if len(self._waiting) >= MAX_WAITERS:
            raise self._busy(client, f"{len(self._waiting)} calls wait for a slot already")

    def _busy(self, client: ClientKey, why: str) -> RequestError:
        return RequestError(f"StreamMinibatches: {SLOT_REFUSAL}: this server already serves "
                            f"{self._used()} streams (--max-streams {self.limits.max_streams}) and "
                            f"client {client} gets none now: {why}; retry later", _EXHAUSTED)

    def _take(self, client: ClientKey, context: grpc.ServicerContext, fields: str) -> Slot:
        slot = Slot(client, context, fields)
        self._held[client].append(slot)
        return slot

    def release(self, slot: Slot) -> None:
        """The stream of ``slot`` ended; its slot is free (a no-op for one taken back)."""
        with self._cond:
            slot.ended = True
            self._drop(slot)
            self._cond.notify_all()

    def _drop(self, slot: Slot) -> None:
        mine = self._held.get(slot.client)
        if mine is not None and slot in mine:
            mine.remove(slot)
            if not mine:
                del self._held[slot.client]

    # -- taking back -------------------------------------------------------------------
    def _evict_for(self, waiter: _Waiter) -> bool:
        """Take back one stream of a client over its share for ``waiter`` (under the
        lock); whether one was."""
        shares = self._shares()
        if len(self._held.get(waiter.client, ())) >= shares[waiter.client]:
            return False
        now = time.monotonic()
        victim = pick_victim(self._held, shares, now)
        if victim is None:
            return False
        details = (f"StreamMinibatches: {SLOT_REFUSAL}: stream ended to share the server: client "
                   f"{victim.client} held {len(self._held[victim.client])} of "
                   f"{self.limits.max_streams} stream slots (--max-streams), over its fair share "
                   f"of {shares[victim.client]:.2f}, while client {waiter.client} waited "
                   f"{now - waiter.arrived:.1f} s for one (--stream-evict-after "
                   f"{self.limits.evict_after:g}); {victim.taken} of the {victim.sent} batches "
                   f"sent on this call were acknowledged; resume it from the next batch")
        self._drop(victim)
        victim.ended = True
        self._taken_back[victim.client] = self._taken_back.pop(victim.client, 0) + 1
        while len(self._taken_back) > MAX_COUNTED_CLIENTS:
            self._taken_back.popitem(last=False)
        log.warning("%s: %s", victim.fields, details)
        if self._on_evict is not None:
            self._on_evict("fair_share")
        end_call(victim.context, _EXHAUSTED, details)
        self._cond.notify_all()
        return True

    def _watch_idle(self) -> None:
        """Cancel streams whose client left sent batches unacknowledged for
        ``idle_timeout`` s."""
        timeout = self.limits.idle_timeout
        while not self._closed.wait(min(1.0, timeout / 4)):
            now = time.monotonic()
            with self._cond:
                idle = [s for slots in self._held.values() for s in slots
                        if not s.ended and s.unread_for(now) > timeout]
                for slot in idle:
                    slot.ended = True  # counted until its handler ends; cancelled once
            for slot in idle:
                log.warning("%s: nothing sent was acknowledged for %g s (--stream-idle-timeout); "
                            "cancelling the stream", slot.fields, timeout)
                if self._on_evict is not None:
                    self._on_evict("idle")
                end_call(slot.context, grpc.StatusCode.CANCELLED,
                         f"StreamMinibatches: the client acknowledged none of the batches sent for "
                         f"{timeout:g} s (server limit --stream-idle-timeout); the stream was "
                         "cancelled")

    # -- state -------------------------------------------------------------------------
    def _used(self) -> int:
        return sum(len(slots) for slots in self._held.values())

    def _free(self) -> int:
        return self.limits.max_streams - self._used()

    def _shares(self, extra: ClientKey | None = None) -> dict[ClientKey, float]:
        clients = {*self._held, *(w.client for w in self._waiting)}
        if extra is not None:
            clients.add(extra)
        return fair_shares(self.limits.max_streams, clients)

    def _first_waiter(self) -> _Waiter | None:
        """The waiter the next free slot goes to: furthest below its share, then first come."""
        if not self._waiting:
            return None
        shares = self._shares()
        return min(self._waiting, key=lambda w: (len(self._held.get(w.client, ())) / shares[w.client],
                                                 w.arrived))

    @property
    def active(self) -> int:
        """Streams holding a slot now."""
        with self._cond:
            return self._used()

    def usage(self) -> tuple[list[ClientUsage], int]:
        """Per client holding a slot or with streams taken back: its usage; and the
        number of calls waiting for a slot."""
        with self._cond:
            shares = self._shares()
            rows = [ClientUsage(c, len(slots), sum(s.unacknowledged_bytes for s in slots), shares[c],
                                self._taken_back.get(c, 0))
                    for c, slots in self._held.items()]
            rows += [ClientUsage(c, 0, 0, 0.0, n) for c, n in self._taken_back.items()
                     if c not in self._held]
            return rows, len(self._waiting)

    def close(self) -> None:
        """Stop the idle watcher (the server stops)."""
        self._closed.set()


@dataclass(frozen=True)
class ClientUsage:
    """What one client holds of a server's stream slots (:meth:`StreamSlots.usage`)."""

    client: ClientKey
    #: Streams it holds.
    streams: int
    #: Bytes sent to it and not yet acknowledged.
    unacknowledged_bytes: int
    #: Its fair share of the slots.
    share: float
    #: Its streams taken back for other clients since the server started.
    taken_back: int


class SlotCollector(Collector):
    """Per-client metrics of one server's :class:`StreamSlots`, read at scrape time:
    streams, unacknowledged bytes, fair share and streams taken back of every client
    holding a slot (or taken back from), the per-client limits, and the calls waiting
    for a slot."""

    def __init__(self, slots: StreamSlots, partition: int) -> None:
        self._slots = slots
        self._partition = str(partition)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        rows, waiting = self._slots.usage()
        p, limits = self._partition, self._slots.limits
        labels = ["partition", "client"]
        streams = GaugeMetricFamily("graphfeed_client_streams", "Trainer streams a client holds",
                                    labels=labels)
        inflight = GaugeMetricFamily("graphfeed_client_inflight_bytes",
                                     "Stream message bytes sent to a client and not yet "
                                     "acknowledged by it", labels=labels)
        share = GaugeMetricFamily("graphfeed_client_fair_share", "A client's fair share of the "
                                  "stream slots (enforced while others wait)", labels=labels)
        taken_back = CounterMetricFamily("graphfeed_client_streams_taken_back",
                                         "Streams of a client taken back for a client below its "
                                         "fair share", labels=labels)
        for row in rows:
            name = [p, str(row.client)]
            taken_back.add_metric(name, row.taken_back)
            if row.streams:
                streams.add_metric(name, row.streams)
                inflight.add_metric(name, row.unacknowledged_bytes)
                share.add_metric(name, row.share)
        yield from (streams, inflight, share, taken_back)
        for metric, help_text, value in (
            ("graphfeed_client_stream_limit", "Streams one client may hold (--max-client-streams)",
             limits.max_client_streams),
            ("graphfeed_client_inflight_bytes_limit",
             "Unacknowledged bytes one client may have before its new streams are refused "
             "(--max-client-inflight-bytes)", limits.max_client_inflight_bytes),
            ("graphfeed_streams_waiting", "Calls waiting for a stream slot", waiting),
        ):
            family = GaugeMetricFamily(metric, help_text, labels=["partition"])
            family.add_metric([p], value)
            yield family
