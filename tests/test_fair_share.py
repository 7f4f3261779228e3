"""Fair shares of the stream slots: a client holding every slot idle cannot lock out a
newcomer, a client at its share keeps its streams, per-client limits are refused naming
their flag, the per-client usage is in the metrics, and a trainer whose stream was taken
back resumes it without losing or repeating a seed. Every server test runs on a plain
and on a typed graph."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
from protos.slots import SLOT_REFUSAL, retryable_exhaustion
from sampling_server.config import ServerConfig
from sampling_server.fair_share import ClientKey, Slot, fair_shares, peer_host, pick_victim
from sampling_server.server import SamplingServer, create_server
from trainer_client import RemoteNeighborLoader
from trainer_client.stream import resumable

TIMEOUT = 60.0
METHOD = "/graphfeed.v1.SamplingService/StreamMinibatches"
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


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


def _slot(client: ClientKey, started: float, unread_since: float | None) -> Slot:
    slot = Slot(client, None, "", started=started)  # type: ignore[arg-type]
    slot.waiting_since = unread_since
    return slot


def test_the_victim_is_the_oldest_unread_stream_of_the_client_most_over_its_share() -> None:
    hog, other, newcomer = _key("h", "hog"), _key("h", "other"), _key("h", "new")
    now = 100.0
    held = {hog: [_slot(hog, 1, 99.9), _slot(hog, 2, 90), _slot(hog, 3, 80)],
            other: [_slot(other, 0, 50), _slot(other, 0.5, 50)]}
    shares = fair_shares(5, [hog, other, newcomer])  # 5/3 each: both over
    victim = pick_victim(held, shares, now, evict_after=3.0)
    assert victim is held[hog][1]  # most over; its oldest unread for >= 3 s (not the first)
    # read streams are never taken back, however far over its share a client is
    for slot in held[hog] + held[other]:
        slot.waiting_since = None
    assert pick_victim(held, shares, now, evict_after=3.0) is None
    # nor are the streams of a client within its share
    assert pick_victim({hog: [_slot(hog, 1, 0)]}, fair_shares(2, [hog, newcomer]), now, 3.0) is None


def test_only_slot_refusals_are_retried() -> None:
    assert retryable_exhaustion(f"StreamMinibatches: {SLOT_REFUSAL}: this server already serves")
    assert not retryable_exhaustion("Received message larger than max (70000000 vs. 67108864)")
    assert not retryable_exhaustion(None)
    assert resumable(EXHAUSTED, f"x: {SLOT_REFUSAL}: stream ended to share the server")
    assert not resumable(EXHAUSTED, "StreamMinibatches on partition 0: the server ran out of memory")
    assert resumable(grpc.StatusCode.UNAVAILABLE, "")
    assert not resumable(grpc.StatusCode.INVALID_ARGUMENT, "")


# -- servers --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    """A graph kind: its partition directory and its epoch requests."""

    name: str
    root: Path
    request: Callable[..., pb.EpochRequest]


def _plain_request(**kw: Any) -> pb.EpochRequest:
    base: dict[str, Any] = {"split": "train", "fanouts": [-1, -1], "batch_size": 1,
                            "world_size": 1, "include_features": True}
    base.update(kw)
    return pb.EpochRequest(**base)


def _typed_request(**kw: Any) -> pb.EpochRequest:
    return _plain_request(typed=pb.TypedEpochOptions(seed_type="paper"), **kw)


@pytest.fixture(scope="module")
def typed1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mag-small-1")
    partition_graph(generate_typed("mag-small", progress=False), 1, root, method="random", progress=False)
    return root


@pytest.fixture(params=["plain", "typed"])
def kind(request: pytest.FixtureRequest, parts1: Path, typed1: Path) -> Kind:
    if request.param == "plain":
        return Kind("plain", parts1, _plain_request)
    return Kind("typed", typed1, _typed_request)


@contextmanager
def serving(root: Path, **kw: Any) -> Iterator[tuple[SamplingServer, str]]:
    settings: dict[str, Any] = {"listen": "127.0.0.1:0", "device": "cpu", "grace": 1.0,
                                "health_interval": 0.5, "stream_evict_after": 0.5,
                                "admit_wait": 10.0}
    settings.update(kw)
    server, port = create_server(ServerConfig(partition_dir=root, partition=0, **settings))
    server.start()
    try:
        assert server.wait_until_serving(60)
        yield server, f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait(10)


@contextmanager
def client(address: str, name: str) -> Iterator[Callable[[pb.EpochRequest], Any]]:
    """A client process of its own: a channel with its own connection (distinct options)."""
    with grpc.insecure_channel(address, options=[("grpc.primary_user_agent", name)]) as channel:
        call = channel.unary_stream(METHOD, request_serializer=pb.EpochRequest.SerializeToString,
                                    response_deserializer=lambda b: b)
        yield lambda request: call(request, timeout=TIMEOUT)


def _open_idle(open_call: Callable[[pb.EpochRequest], Any], request: pb.EpochRequest) -> Any:
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


def test_a_newcomer_is_served_while_another_client_holds_every_slot_idle(kind: Kind) -> None:
    with serving(kind.root, max_streams=3) as (server, address), \
            client(address, "hog") as hog, client(address, "newcomer") as newcomer:
        idle = [_open_idle(hog, kind.request(client_id="hog")) for _ in range(3)]
        time.sleep(0.2)
        # at the per-client limit (--max-streams by default): the hog's fourth stream is
        # refused at once, it never waits
        code, details = _status_of(hog(kind.request(client_id="hog")))
        assert code == EXHAUSTED and SLOT_REFUSAL in details, details
        started = newcomer(kind.request(client_id="newcomer", fanouts=[2]))
        next(started)  # served (within --admit-wait: the test fails otherwise)
        code, details = _status_of(idle[0])  # the hog's oldest unread stream was taken back
        assert code == EXHAUSTED, details
        assert SLOT_REFUSAL in details and "--stream-evict-after" in details
        assert "over its fair share of 1.50" in details and "hog" in details
        assert _metric(server, "graphfeed_client_streams", client="ipv4:127.0.0.1/hog") == 2
        assert _metric(server, "graphfeed_client_streams", client="ipv4:127.0.0.1/newcomer") == 1
        assert _metric(server, "graphfeed_streams_evicted_total", reason="fair_share") == 1
        assert _status_of(started) == (grpc.StatusCode.OK, "")
        for call in idle[1:]:
            call.cancel()


def test_a_client_at_its_share_keeps_its_streams(kind: Kind) -> None:
    with serving(kind.root, max_streams=2) as (server, address), \
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
    with serving(kind.root, max_streams=8, max_client_streams=1,
                 max_client_inflight_bytes=1 << 20) as (server, address), \
            client(address, "one") as one:
        first = _open_idle(one, kind.request(client_id="one"))
        code, details = _status_of(one(kind.request(client_id="one")))
        assert code == EXHAUSTED and "--max-client-streams" in details and SLOT_REFUSAL in details
        assert _metric(server, "graphfeed_client_stream_limit") == 1
        assert _metric(server, "graphfeed_client_inflight_bytes_limit") == 1 << 20
        assert _metric(server, "graphfeed_client_fair_share", client="ipv4:127.0.0.1/one") == 8
        inflight = _metric(server, "graphfeed_client_inflight_bytes", client="ipv4:127.0.0.1/one")
        assert inflight is not None and inflight >= 0
        first.cancel()


def test_a_trainer_whose_stream_was_taken_back_resumes_it_losing_nothing(kind: Kind) -> None:
    typed = kind.name == "typed"
    with serving(kind.root, max_streams=1) as (server, address), \
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
        done = newcomer(kind.request(client_id="newcomer", fanouts=[2], batch_size=64))
        assert _status_of(done) == (grpc.StatusCode.OK, "")
        seen += [_seeds(batch, typed) for batch in it]
        assert _metric(server, "graphfeed_streams_evicted_total", reason="fair_share") == 1
        assert loader.last_stats.resumes >= 1
    every = torch.cat(seen)
    assert every.numel() == every.unique().numel() == loader.num_seeds


def _seeds(batch: Any, typed: bool) -> torch.Tensor:
    store = batch["paper"] if typed else batch
    return store.n_id[: store.batch_size]
