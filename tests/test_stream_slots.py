"""Fair shares of the stream slots and of the sampling threads: a client holding every
slot cannot lock out a newcomer, however it reads (never, slowly, without acknowledging,
over one channel or many); a stream produces only a bounded number of batches past what
its client acknowledged; a client at its share keeps its streams; per-client limits are
refused naming their flag; per-client slots and take-backs are in the metrics; and a
trainer whose stream was taken back resumes it without losing or repeating a seed. Every
server test runs on a plain and on a typed graph."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from prometheus_client import generate_latest

from partitioner.synthetic import generate_typed
from partitioner.writer import partition_graph
from protos import sampling_pb2 as pb
from protos.channel import SLOT_REFUSAL, retryable_exhaustion
from protos.epoch_call import METHOD, EpochCall, last_chunk, stream_minibatches
from sampling_server.config import ConfigError, ServerConfig
from sampling_server.pipeline import IN_TRANSIT_BATCHES
from sampling_server.server import SamplingServer, create_server
from sampling_server.stream_slots import ClientKey, Slot, fair_shares, peer_host, pick_victim
from trainer_client import Cluster, RemoteNeighborLoader
from trainer_client.stream import resumable

TIMEOUT = 60.0
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
#: The servers' --admit-wait and --prefetch in these tests (the defaults).
ADMIT_WAIT = 5.0
PREFETCH = 4


# -- pure rules -----------------------------------------------------------------------------
def _key(principal: str, client: str) -> ClientKey:
    return ClientKey(principal, client)


def test_shares_split_evenly_by_principal_then_by_client() -> None:
    a1, a2, a3, b = _key("host-a", "1"), _key("host-a", "2"), _key("host-a", "3"), _key("host-b", "1")
    shares = fair_shares(32, [a1, a2, a3, b])
    assert shares[b] == 16 and shares[a1] == shares[a2] == shares[a3] == pytest.approx(16 / 3)
    assert sum(shares.values()) == pytest.approx(32)
    assert fair_shares(32, []) == {}
    assert fair_shares(3, [a1]) == {a1: 3}


def test_peer_host_drops_the_port_only() -> None:
    assert peer_host("ipv4:10.0.0.7:51234") == "ipv4:10.0.0.7"
    assert peer_host("ipv6:[::1]:5") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"
    assert peer_host("") == ""


def _slot(client: ClientKey, started: float, sent: int = 0, taken: int = 0) -> Slot:
    slot = Slot(client, None, "", started=started)  # type: ignore[arg-type]
    for _ in range(sent):
        slot.handing(10, ends_batch=True)
    assert slot.took(taken) is None
    return slot


def test_a_slot_counts_what_was_sent_and_what_its_client_acknowledged() -> None:
    slot = _slot(_key("h", "c"), 0.0)
    assert slot.unread_for(time.monotonic()) == 0.0  # nothing sent: the client owes nothing
    slot.handing(100, ends_batch=False)
    slot.handing(50, ends_batch=True)
    slot.handing(30, ends_batch=True)
    slot.handing(7, ends_batch=False)  # a batch half sent
    assert (slot.sent, slot.ahead, slot.unacknowledged_bytes) == (2, 2, 187)
    assert slot.waiting_since is not None
    assert slot.took(1) is None
    assert (slot.taken, slot.unacknowledged_bytes) == (1, 37)
    problem = slot.took(3)
    assert problem is not None and "BatchesTaken.batches: expected 1 .. 2" in problem and "got 3" in problem
    assert "got 0" in (slot.took(0) or "")  # counts never go back
    assert slot.took(2) is None and slot.unacknowledged_bytes == 7 and slot.ahead == 0
    slot.handing(0, ends_batch=True)
    assert slot.took(3) is None and slot.waiting_since is None  # everything sent was taken


def test_the_victim_is_the_stream_its_over_share_client_reads_least() -> None:
    hog, other, newcomer = _key("h", "hog"), _key("h", "other"), _key("h", "new")
    now = time.monotonic()
    held = {hog: [_slot(hog, 1, sent=5, taken=5), _slot(hog, 2, sent=9, taken=3), _slot(hog, 3, sent=4)],
            other: [_slot(other, 0, sent=50), _slot(other, 0.5)]}
    shares = fair_shares(5, [hog, other, newcomer])  # 5/3 each: both over, the hog most
    assert pick_victim(held, shares, now) is held[hog][1]  # 6 batches unacknowledged
    # reading or not, a client over its share gives a stream back: the oldest of equals
    for slot in held[hog]:
        assert slot.took(slot.sent) is None
    assert pick_victim(held, shares, now) is held[hog][0]
    held[hog][0].ended = True  # being ended already: not taken twice
    assert pick_victim(held, shares, now) is held[hog][1]
    # never the streams of a client within its share
    assert pick_victim({hog: [_slot(hog, 1, sent=9)]}, fair_shares(2, [hog, newcomer]), now) is None


def test_only_slot_refusals_are_retried() -> None:
    assert retryable_exhaustion(f"StreamMinibatches: {SLOT_REFUSAL}: this server already serves")
    assert not retryable_exhaustion("Received message larger than max (70000000 vs. 67108864)")
    assert not retryable_exhaustion(None)
    assert resumable(EXHAUSTED, f"x: {SLOT_REFUSAL}: stream ended to share the server")
    assert not resumable(EXHAUSTED, "StreamMinibatches on partition 0: the server ran out of memory")
    assert resumable(grpc.StatusCode.UNAVAILABLE, "")
    assert not resumable(grpc.StatusCode.INVALID_ARGUMENT, "")


def test_a_take_back_must_come_before_the_admission_wait_ends(parts1: Path) -> None:
    with pytest.raises(ConfigError, match="stream_evict_after: expected seconds < admit_wait"):
        ServerConfig(partition_dir=parts1, partition=0, stream_evict_after=5.0, admit_wait=5.0)


# -- servers --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    """A graph kind: its partition directories and its epoch requests."""

    name: str
    one: Path
    two: Path
    request: Callable[..., pb.EpochRequest]
    #: The loader's arguments that choose the seeds (split "val").
    seeds: dict[str, Any]


def _plain_request(**kw: Any) -> pb.EpochRequest:
    base: dict[str, Any] = {"split": "train", "fanouts": [-1, -1], "batch_size": 1,
                            "world_size": 1, "include_features": True}
    base.update(kw)
    return pb.EpochRequest(**base)


def _typed_request(**kw: Any) -> pb.EpochRequest:
    return _plain_request(typed=pb.TypedEpochOptions(seed_type="paper"), **kw)


def _typed(tmp_path_factory: pytest.TempPathFactory, parts: int) -> Path:
    root = tmp_path_factory.mktemp(f"mag-small-{parts}")
    partition_graph(generate_typed("mag-small", progress=False), parts, root, method="random",
                    progress=False)
    return root


@pytest.fixture(scope="module")
def typed1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _typed(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def typed2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _typed(tmp_path_factory, 2)


@pytest.fixture(params=["plain", "typed"])
def kind(request: pytest.FixtureRequest, parts1: Path, parts2: Path, typed1: Path, typed2: Path) -> Kind:
    if request.param == "plain":
        return Kind("plain", parts1, parts2, _plain_request, {"split": "val"})
    return Kind("typed", typed1, typed2, _typed_request, {"split": "val"})


_SETTINGS: dict[str, Any] = {"listen": "127.0.0.1:0", "device": "cpu", "grace": 1.0,
                             "health_interval": 0.5, "stream_evict_after": 0.5, "admit_wait": 10.0}


@contextmanager
def serving(root: Path, **kw: Any) -> Iterator[tuple[SamplingServer, str]]:
    """The one server of a one-partition graph."""
    server, port = create_server(ServerConfig(partition_dir=root, partition=0, **{**_SETTINGS, **kw}))
    server.start()
    try:
        assert server.wait_until_serving(60)
        yield server, f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait(10)


@contextmanager
def cluster_of(root: Path, **kw: Any) -> Iterator[tuple[list[SamplingServer], list[str]]]:
    """The two servers of a two-partition graph, peers of each other."""
    built = [create_server(ServerConfig(partition_dir=root, partition=p, **{**_SETTINGS, **kw}))
             for p in range(2)]
    servers = [s for s, _ in built]
    addresses = [f"127.0.0.1:{port}" for _, port in built]
    for s in servers:
        s.set_peers(addresses)
        s.start()
    try:
        assert all(s.wait_until_serving(60) for s in servers)
        yield servers, addresses
    finally:
        for s in servers:
            s.stop(None).wait(10)


@contextmanager
def client(address: str, name: str) -> Iterator[Callable[..., EpochCall]]:
    """A client process of its own: a channel with its own connection (distinct options);
    its calls parse nothing and acknowledge only what the test says (default: nothing)."""
    with grpc.insecure_channel(address, options=[("grpc.primary_user_agent", name)]) as channel:
        def call(request: pb.EpochRequest, acknowledge: Callable[[Any], bool] | None = None) -> EpochCall:
            return stream_minibatches(channel, request, timeout=TIMEOUT, parse=pb.MinibatchChunk.FromString,
                                      acknowledge=acknowledge)
        yield call


def _open_idle(open_call: Callable[..., EpochCall], request: pb.EpochRequest) -> EpochCall:
    """A stream that is started (one message read) and then never read again."""
    call = open_call(request)
    next(call)
    return call


def _status_of(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _metric(server: SamplingServer, name: str, **labels: str) -> float | None:
    text = generate_latest(server.metrics.registry).decode()
    for line in text.splitlines():
        match = re.match(rf"^{name}\{{([^}}]*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            return float(match.group(2))
    return None


def _sampled(server: SamplingServer) -> float:
    """Batches this server has sampled (every client's)."""
    return _metric(server, "graphfeed_stage_seconds_count", stage="sample") or 0.0


def _settled(read: Callable[[], float], quiet: float = 1.0, timeout: float = 60.0) -> float:
    """``read()`` once it has not changed for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    value, since = read(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return value
    raise AssertionError(f"still changing after {timeout} s: {value}")


def test_a_newcomer_is_served_while_another_client_holds_every_slot_idle(kind: Kind) -> None:
    with serving(kind.one, max_streams=3) as (server, address), \
            client(address, "hog") as hog, client(address, "newcomer") as newcomer:
        idle = [_open_idle(hog, kind.request(client_id="hog")) for _ in range(3)]
        # at the per-client limit (--max-streams by default): the hog's fourth stream is
        # refused at once, it never waits
        code, details = _status_of(hog(kind.request(client_id="hog")))
        assert code == EXHAUSTED and SLOT_REFUSAL in details, details
        started = newcomer(kind.request(client_id="newcomer", fanouts=[2]), acknowledge=last_chunk)
        next(started)  # served (within --admit-wait: the test fails otherwise)
        ended = [_status_of(call) for call in idle[:1]]  # the stream it reads least went back
        code, details = ended[0]
        assert code == EXHAUSTED, details
        assert SLOT_REFUSAL in details and "--stream-evict-after" in details
        assert "over its fair share of 1.50" in details and "hog" in details
        assert "resume it from the next batch" in details
        assert _metric(server, "graphfeed_client_streams", client="ipv4:127.0.0.1/hog") == 2
        assert _metric(server, "graphfeed_client_streams", client="ipv4:127.0.0.1/newcomer") == 1
        assert _metric(server, "graphfeed_client_streams_taken_back_total",
                       client="ipv4:127.0.0.1/hog") == 1
        assert _metric(server, "graphfeed_streams_evicted_total", reason="fair_share") == 1
        assert _status_of(started) == (grpc.StatusCode.OK, "")
        for call in idle[1:]:
            call.cancel()


HOG_STYLES = ("never-reads", "never-reads-many-channels", "reads-slowly", "reads-without-acknowledging")


@pytest.mark.parametrize("style", HOG_STYLES)
def test_a_trainer_is_served_within_the_admission_wait_whatever_a_hog_does(kind: Kind, style: str) -> None:
    """One client opens --max-streams streams of one-seed batches on each of two servers
    and then reads them in one of four ways; a trainer (default settings, another client
    ID) starting an epoch gets its first batch within --admit-wait plus a second, and its
    whole epoch; the hog's sampling stops within the bound the acknowledgements set."""
    max_streams = 4
    with cluster_of(kind.two, max_streams=max_streams, stream_evict_after=1.0,
                    admit_wait=ADMIT_WAIT) as (servers, addresses), ExitStack() as stack:
        stop = threading.Event()
        calls: list[EpochCall] = []
        readers: list[threading.Thread] = []
        for address in addresses:
            if style == "never-reads-many-channels":
                opens = [stack.enter_context(client(address, f"hog-{i}")) for i in range(max_streams)]
            else:
                opens = [stack.enter_context(client(address, "hog"))] * max_streams
            for open_call in opens:
                call = open_call(kind.request(client_id="hog", split="test", fanouts=[5, 5]),
                                 acknowledge=last_chunk if style == "reads-slowly" else None)
                calls.append(call)
                if style in ("reads-slowly", "reads-without-acknowledging"):
                    pause = 3.0 if style == "reads-slowly" else 0.0
                    readers.append(threading.Thread(target=_read, args=(call, pause, stop), daemon=True))
        for reader in readers:
            reader.start()
        try:
            if style != "reads-slowly":
                # the hog has its batches past what it acknowledged, and no more
                bound = max_streams * (PREFETCH + IN_TRANSIT_BATCHES)
                for server in servers:
                    assert _settled(lambda s=server: _sampled(s)) <= bound
            loader = RemoteNeighborLoader(addresses, num_neighbors=[5, 5], batch_size=32,
                                          client_id="trainer", **kind.seeds)
            with loader:
                started = time.monotonic()
                it = iter(loader)
                seeds = [_seeds(next(it), kind.name == "typed")]
                assert time.monotonic() - started < ADMIT_WAIT + 1.0
                seeds += [_seeds(batch, kind.name == "typed") for batch in it]
            every = torch.cat(seeds)
            assert every.numel() == every.unique().numel() == loader.num_seeds
            taken_back = sum(_metric(s, "graphfeed_client_streams_taken_back_total",
                                     client="ipv4:127.0.0.1/hog") or 0 for s in servers)
            assert taken_back >= 2  # one on each server at least
        finally:
            stop.set()
            for call in calls:
                call.cancel()
            for reader in readers:
                reader.join(30)


def _read(call: EpochCall, pause: float, stop: threading.Event) -> None:
    """Read ``call`` one message every ``pause`` seconds until ``stop`` or its end."""
    try:
        for _ in call:
            if stop.wait(pause):
                return
    except grpc.RpcError:
        pass


def test_a_hog_whose_streams_were_taken_back_resumes_them_losing_nothing(kind: Kind) -> None:
    """The hog as four trainer ranks over one shared channel per server that start their
    epoch and stop reading: the trainer that comes next takes one stream back on each
    server; once it is done and the hog reads again, every rank's streams resume and the
    hog's epoch holds every seed exactly once."""
    world = 4
    with cluster_of(kind.two, max_streams=world, stream_evict_after=1.0, admit_wait=ADMIT_WAIT) \
            as (_, addresses), Cluster(addresses) as shared:
        hogs = [RemoteNeighborLoader(shared, "train", num_neighbors=[5, 5], batch_size=4, rank=r,
                                     world_size=world, client_id="hog", prefetch=1, reconnect_timeout=120.0)
                for r in range(world)]
        streams = [iter(h) for h in hogs]
        first = [_seeds(next(s), kind.name == "typed") for s in streams]  # every stream open
        trainer = RemoteNeighborLoader(addresses, num_neighbors=[5, 5], batch_size=32, client_id="trainer",
                                       **kind.seeds)
        with trainer:
            assert sum(b.numel() for b in (_seeds(x, kind.name == "typed") for x in trainer)) \
                == trainer.num_seeds
        seen = first + [_seeds(batch, kind.name == "typed") for s in streams for batch in s]
        every = torch.cat(seen)
        assert every.numel() == every.unique().numel() == hogs[0].num_seeds
        assert sum(h.last_stats.resumes for h in hogs) >= 2
        for h in hogs:
            h.close()


def test_a_client_at_its_share_keeps_its_streams(kind: Kind) -> None:
    with serving(kind.one, max_streams=2) as (server, address), \
            client(address, "a") as a, client(address, "b") as b:
        held = [_open_idle(a, kind.request(client_id="a")) for _ in range(2)]
        b_first = _open_idle(b, kind.request(client_id="b"))  # takes one of a's two back
        assert _status_of(held[0])[0] == EXHAUSTED
        # b is at its share (1 of 2) now: its second stream is refused, a keeps its last one
        code, details = _status_of(b(kind.request(client_id="b")))
        assert code == EXHAUSTED and "its fair share is 1.00" in details, details
        assert _metric(server, "graphfeed_client_streams", client="ipv4:127.0.0.1/a") == 1
        assert _metric(server, "graphfeed_streams_evicted_total", reason="fair_share") == 1
        for call in (held[1], b_first):
            call.cancel()


def test_per_client_limits_are_refused_naming_the_flag_and_exported(kind: Kind) -> None:
    with serving(kind.one, max_streams=8, max_client_streams=1,
                 max_client_inflight_bytes=1 << 20) as (server, address), \
            client(address, "one") as one:
        first = _open_idle(one, kind.request(client_id="one"))
        code, details = _status_of(one(kind.request(client_id="one")))
        assert code == EXHAUSTED and "--max-client-streams" in details and SLOT_REFUSAL in details
        assert _metric(server, "graphfeed_client_stream_limit") == 1
        assert _metric(server, "graphfeed_client_inflight_bytes_limit") == 1 << 20
        assert _metric(server, "graphfeed_client_fair_share", client="ipv4:127.0.0.1/one") == 8
        inflight = _metric(server, "graphfeed_client_inflight_bytes", client="ipv4:127.0.0.1/one")
        assert inflight is not None and inflight > 0  # sent, never acknowledged
        first.cancel()


def test_acknowledgements_that_cannot_be_are_refused_naming_the_field(kind: Kind) -> None:
    with serving(kind.one) as (_, address), grpc.insecure_channel(address) as channel:
        bidi = channel.stream_stream(METHOD, request_serializer=pb.StreamMinibatchesRequest.SerializeToString,
                                     response_deserializer=pb.MinibatchChunk.FromString)
        epoch = pb.StreamMinibatchesRequest(epoch=kind.request(client_id="c"))
        taken = pb.StreamMinibatchesRequest(taken=pb.BatchesTaken(batches=1))
        for messages, field in [
            ([taken], "StreamMinibatchesRequest.epoch: expected the epoch request as the call's first "
                      "message"),
            ([epoch, epoch], "StreamMinibatchesRequest.taken: expected acknowledgements after the epoch "
                             "request, got a second epoch request"),
            ([epoch, pb.StreamMinibatchesRequest(taken=pb.BatchesTaken(batches=10**9))],
             "BatchesTaken.batches: expected 0 .. "),
        ]:
            code, details = _status_of(bidi(iter(messages), timeout=TIMEOUT))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert field in details, details
        # and the server goes on serving
        call = stream_minibatches(channel, kind.request(client_id="c", fanouts=[2], batch_size=64),
                                  timeout=TIMEOUT)
        assert _status_of(call) == (grpc.StatusCode.OK, "")


def test_a_trainer_whose_stream_was_taken_back_resumes_it_losing_nothing(kind: Kind) -> None:
    typed = kind.name == "typed"
    with serving(kind.one, max_streams=1) as (server, address), \
            client(address, "newcomer") as newcomer:
        loader = RemoteNeighborLoader([address], num_neighbors=[-1, -1] if not typed else [8, 8],
                                      batch_size=16, shuffle=True,
                                      **({"input_nodes": "paper"} if typed else {}),
                                      client_id="trainer", prefetch=1)
        seen: list[torch.Tensor] = []
        it = iter(loader)
        for _ in range(2):
            seen.append(_seeds(next(it), typed))
        # the trainer stops reading; a newcomer (share 0.5 each) takes its slot back
        done = newcomer(kind.request(client_id="newcomer", fanouts=[2], batch_size=64),
                        acknowledge=last_chunk)
        assert _status_of(done) == (grpc.StatusCode.OK, "")
        seen += [_seeds(batch, typed) for batch in it]
        assert (_metric(server, "graphfeed_streams_evicted_total", reason="fair_share") or 0) >= 1
        assert loader.last_stats.resumes >= 1
    every = torch.cat(seen)
    assert every.numel() == every.unique().numel() == loader.num_seeds


def _seeds(batch: Any, typed: bool) -> torch.Tensor:
    store = batch["paper"] if typed else batch
    return store.n_id[: store.batch_size]
