"""Bounded requests: limits answered INVALID_ARGUMENT naming the flag, bounded status
details, escaped log lines, idle streams cancelled, and a fuzz of mutated and random
requests to every RPC that never gets INTERNAL or UNKNOWN."""

from __future__ import annotations

import logging
import random
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import sampling_pb2 as pb
from protos.codec import encode_tensor
from protos.epoch_call import stream_minibatches
from sampling_server.config import ServerConfig
from sampling_server.errors import printable
from sampling_server.limits import worst_case_edges
from sampling_server.server import SamplingServer, create_server

TIMEOUT = 10.0
#: Each method's path and how it streams: "unary", "stream" (replies) or "bidi" (both ways).
METHODS = {
    "GetClusterInfo": ("/graphfeed.v1.SamplingService/GetClusterInfo", "unary"),
    "LookupNodes": ("/graphfeed.v1.SamplingService/LookupNodes", "unary"),
    "StreamMinibatches": ("/graphfeed.v1.SamplingService/StreamMinibatches", "bidi"),
    "SampleNeighbors": ("/graphfeed.v1.PeerService/SampleNeighbors", "stream"),
    "FetchNodeData": ("/graphfeed.v1.PeerService/FetchNodeData", "stream"),
    "StreamHotNodes": ("/graphfeed.v1.SamplingService/StreamHotNodes", "stream"),
    "Health": ("/grpc.health.v1.Health/Check", "unary"),
}


def _servers(root: Path, **kw: object) -> tuple[list[SamplingServer], list[str]]:
    settings: dict[str, object] = {"listen": "127.0.0.1:0", "device": "cpu", "peer_timeout": 5.0,
                                   "health_interval": 0.5, "grace": 1.0, **kw}
    built = [create_server(ServerConfig(partition_dir=root, partition=p, **settings))  # type: ignore[arg-type]
             for p in range(2)]
    addresses = [f"127.0.0.1:{port}" for _, port in built]
    servers = [s for s, _ in built]
    for s in servers:
        s.set_peers(addresses)
        s.start()
    assert all(s.wait_until_serving(30) for s in servers)
    return servers, addresses


@pytest.fixture(scope="module")
def cluster(parts2: Path) -> Iterator[list[str]]:
    servers, addresses = _servers(parts2)
    yield addresses
    for s in servers:
        s.stop(None).wait(10)


def _identity(b: bytes) -> bytes:
    return b


def _invoke(channel: grpc.Channel, method: str, payload: bytes) -> Any:
    """Call ``method`` with the raw bytes ``payload`` as its (first) message: its answer,
    or its stream of messages."""
    path, kind = METHODS[method]
    if kind == "unary":
        return channel.unary_unary(path, request_serializer=_identity,
                                   response_deserializer=_identity)(payload, timeout=TIMEOUT)
    if kind == "stream":
        return channel.unary_stream(path, request_serializer=_identity,
                                    response_deserializer=_identity)(payload, timeout=TIMEOUT)
    return channel.stream_stream(path, request_serializer=_identity,
                                 response_deserializer=_identity)(iter([payload]), timeout=TIMEOUT)


def call_raw(channel: grpc.Channel, method: str, payload: bytes, max_messages: int = 3) -> grpc.StatusCode:
    """Send raw bytes to ``method``; the status (OK after ``max_messages`` messages)."""
    try:
        call = _invoke(channel, method, payload)
        if METHODS[method][1] != "unary":
            for i, _ in enumerate(call):
                if i + 1 >= max_messages:
                    call.cancel()
                    break
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
        details = exc.details() or ""
        assert len(details) < 1200, f"{method}: {len(details)} characters of details"
        if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            raise AssertionError(f"{method}: {code.name}: {details[:500]}") from exc
        return code


def _status(address: str, method: str, request: Any) -> tuple[grpc.StatusCode, str]:
    """The status of one whole call (an epoch stream read to its end, acknowledged)."""
    with grpc.insecure_channel(address) as channel:
        try:
            if method == "StreamMinibatches":
                list(stream_minibatches(channel, request, timeout=TIMEOUT))
            elif METHODS[method][1] == "stream":
                list(_invoke(channel, method, request.SerializeToString()))
            else:
                _invoke(channel, method, request.SerializeToString())
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _epoch(**kw: object) -> pb.EpochRequest:
    base: dict[str, object] = {"split": "train", "fanouts": [5, 3], "batch_size": 10,
                               "world_size": 1}
    base.update(kw)
    return pb.EpochRequest(**base)  # type: ignore[arg-type]


EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(("method", "request_", "flag"), [
    ("StreamMinibatches", _epoch(fanouts=[2147483647]), "--max-fanout"),
    ("StreamMinibatches", _epoch(fanouts=[1] * 200_000), "--max-hops"),
    ("StreamMinibatches", _epoch(fanouts=[1_000_000], sampling=pb.SamplingOptions(replace=True)),
     "--max-fanout"),
    ("StreamMinibatches", _epoch(fanouts=[10_000], batch_size=1000,
                                 sampling=pb.SamplingOptions(replace=True)), "--max-batch-edges"),
    ("StreamMinibatches", _epoch(batch_size=2**31 - 1), "--max-batch-size"),
    ("SampleNeighbors", pb.SampleNeighborsRequest(
        nodes=encode_tensor(np.zeros(10, np.int64)), fanout=1_000_000, replace=True), "--max-fanout"),
    ("FetchNodeData", pb.FetchNodeDataRequest(
        nodes=encode_tensor(np.zeros(5_000_000, np.int64)), want_features=True), "--max-peer-nodes"),
])
def test_requests_over_a_limit_are_refused_naming_the_flag(
    cluster: list[str], method: str, request_: object, flag: str
) -> None:
    code, details = _status(cluster[0], method, request_)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert flag in details and "expected at most" in details


def test_error_details_quote_request_text_only_so_far(cluster: list[str]) -> None:
    code, details = _status(cluster[0], "StreamMinibatches", _epoch(split="s" * 10_000))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("EpochRequest.split: expected one of") and len(details) < 1100


def test_client_strings_are_escaped_in_logs(cluster: list[str],
                                            caplog: pytest.LogCaptureFixture) -> None:
    forged = "x\n2026-01-01 00:00:00 ERROR forged line"
    with caplog.at_level(logging.INFO, logger="sampling_server"):
        code, _ = _status(cluster[0], "StreamMinibatches", _epoch(client_id=forged))
    assert code == grpc.StatusCode.OK
    lines = [r.getMessage() for r in caplog.records if "forged" in r.getMessage()]
    assert lines and all("\n" not in line for line in lines)
    assert printable("a\nb\x00é" * 100).startswith("a\\nb\\x00\\xe9")
    assert len(printable("y" * 10_000)) < 150


def test_worst_case_edges_bounds_the_sampler() -> None:
    assert worst_case_edges(10, [5, 3], 4000, 40_000) == 10 * 5 + 60 * 3
    assert worst_case_edges(10, [-1], 4000, 40_000) == 40_000
    assert worst_case_edges(10, [100_000], 4000, 40_000) == 40_000
    assert worst_case_edges(10, [100_000], 4000, 40_000, replace=True) == 1_000_000


def test_an_idle_stream_is_cancelled_and_frees_its_slot(
    parts2: Path, caplog: pytest.LogCaptureFixture
) -> None:
    servers, addresses = _servers(parts2, max_streams=1, stream_idle_timeout=1.0)
    caplog.set_level(logging.WARNING, logger="sampling_server")
    try:
        with grpc.insecure_channel(addresses[0]) as channel:
            request = _epoch(split="test", fanouts=[-1, -1], batch_size=1, include_features=True)
            # one message read, nothing ever acknowledged: the server waits on it
            idle = stream_minibatches(channel, request, timeout=60, parse=None, acknowledge=None)
            next(idle)
            deadline = time.monotonic() + 30
            code = EXHAUSTED
            while code == EXHAUSTED and time.monotonic() < deadline:
                time.sleep(0.5)
                code, details = _status(addresses[0], "StreamMinibatches", _epoch(fanouts=[1]))
            assert code == grpc.StatusCode.OK, details
            assert any("--stream-idle-timeout" in r.getMessage() for r in caplog.records)
            idle.cancel()
    finally:
        for s in servers:
            s.stop(None).wait(10)


# -- fuzz -----------------------------------------------------------------------------------
_INTS = [-(2**31), -2, -1, 0, 1, 2, 7, 1000, 10**6, 2**31 - 1]
_STRINGS = ["", "train", "val", "nope", "s" * 10_000, "a\nb\x00", "é" * 300]


def _random_tensor(rng: random.Random) -> pb.Tensor:
    shape = rng.choice([[4], [0], [2, 2], [0, 2**62], [0] * 65, [1] * 64, [-1], [2**40], [3, 0]])
    dtype = rng.choice([0, 1, 6, 6, 6, 9, 99])
    data = np.arange(rng.choice([0, 4, 5, 40]), dtype=np.int64).tobytes()
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


def _expectation(rng: random.Random) -> pb.ServerExpectation:
    return pb.ServerExpectation(graph_fingerprint=rng.choice(_STRINGS),
                                partition_id=rng.choice(_INTS), hot_order=rng.choice(_STRINGS))


def _structured(rng: random.Random, method: str) -> bytes:
    """A well-formed message of ``method`` with values drawn from edge cases."""
    if method == "StreamMinibatches":
        epoch = pb.EpochRequest(
            fanouts=[rng.choice(_INTS) for _ in range(rng.choice([0, 1, 2, 3, 20, 5000]))],
            batch_size=rng.choice(_INTS), world_size=rng.choice(_INTS), rank=rng.choice(_INTS),
            epoch=rng.choice([-1, 0, 2**62]), resume_from=rng.choice([-1, 0, 3, 2**62]),
            steps_done=rng.choice([-1, 0, 0, 3, 2**62]), seeds_done=rng.choice([-1, 0, 0, 5, 2**62]),
            feature_dtype=rng.choice([0, 7, 8, 9, 6, 99]), include_features=rng.random() < 0.5,
            include_labels=rng.random() < 0.5, shuffle=rng.random() < 0.5,
            sampling=pb.SamplingOptions(replace=rng.random() < 0.3, weighted=rng.random() < 0.2),
            client_id=rng.choice(_STRINGS), compact_indices=rng.random() < 0.5,
            include_original_ids=rng.random() < 0.5,
            cache_counts=[rng.choice([*_INTS, 10, 50]) for _ in range(rng.choice([0, 0, 1, 2, 3]))])
        if rng.random() < 0.3:
            epoch.expect.CopyFrom(_expectation(rng))
        if rng.random() < 0.5:
            epoch.split = rng.choice(_STRINGS)
        elif rng.random() < 0.8:
            epoch.seeds.CopyFrom(_random_tensor(rng))
        return pb.StreamMinibatchesRequest(epoch=epoch).SerializeToString()
    if method == "SampleNeighbors":
        return pb.SampleNeighborsRequest(
            nodes=_random_tensor(rng), fanout=rng.choice(_INTS), random_seed=rng.getrandbits(64),
            replace=rng.random() < 0.3, weighted=rng.random() < 0.2, hop=rng.choice(_INTS),
            client_id=rng.choice(_STRINGS)).SerializeToString()
    if method == "FetchNodeData":
        return pb.FetchNodeDataRequest(
            nodes=_random_tensor(rng), want_features=rng.random() < 0.5,
            want_labels=rng.random() < 0.5, feature_dtype=rng.choice([0, 7, 8, 9, 99]),
            want_original_ids=rng.random() < 0.3, node_type=rng.choice(["", "", "paper"]),
            client_id=rng.choice(_STRINGS)).SerializeToString()
    if method == "StreamHotNodes":
        return pb.HotNodesRequest(
            count=rng.choice([*_INTS, 50, 2**62]), include_features=rng.random() < 0.5,
            feature_dtype=rng.choice([0, 6, 7, 8, 9, 99]), client_id=rng.choice(_STRINGS),
            expect=_expectation(rng) if rng.random() < 0.3 else None).SerializeToString()
    if method == "LookupNodes":
        lookup = pb.LookupNodesRequest(client_id=rng.choice(_STRINGS))
        if rng.random() < 0.5:
            lookup.split = rng.choice(_STRINGS)
        elif rng.random() < 0.6:
            lookup.original_ids.CopyFrom(_random_tensor(rng))
        elif rng.random() < 0.8:
            lookup.owned_range.CopyFrom(pb.NodeRange(first=rng.choice(_INTS), count=rng.choice(_INTS)))
        return lookup.SerializeToString()
    if method == "Health":
        return health_pb2.HealthCheckRequest(service=rng.choice(_STRINGS)).SerializeToString()
    return pb.ClusterInfoRequest(client_id=rng.choice(_STRINGS)).SerializeToString()


def fuzzed_request(rng: random.Random, method: str) -> bytes:
    return mutated(rng, lambda: _structured(rng, method))


def mutated(rng: random.Random, structured: Callable[[], bytes]) -> bytes:
    """Random bytes, or the ``structured()`` message as it is or with bytes flipped,
    dropped or inserted."""
    kind = rng.random()
    if kind < 0.2:
        return rng.randbytes(rng.choice([0, 1, 7, 64, 1000]))
    payload = bytearray(structured())
    if kind < 0.6 and payload:
        for _ in range(rng.randint(1, 4)):  # flip, drop or insert a byte
            i = rng.randrange(len(payload))
            op = rng.random()
            if op < 0.5:
                payload[i] = rng.randrange(256)
            elif op < 0.75:
                del payload[i]
            else:
                payload.insert(i, rng.randrange(256))
    return bytes(payload)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fuzz(channels: Sequence[grpc.Channel], calls: int, threads: int = 4, seed: int = 0,
         timeout: float = 1800.0) -> Counter[str]:
    """``calls`` fuzzed requests (:func:`fuzzed_request`, every method) from ``threads``
    threads, each on a channel drawn from ``channels``: how many got each status, by
    name; ``FAILED: ...`` for an INTERNAL or UNKNOWN answer (or details over the bound)."""
    codes: Counter[str] = Counter()
    lock = threading.Lock()

    def worker(thread: int) -> None:
        rng = random.Random(seed * 1000 + thread)
        for _ in range(calls // threads):
            method = rng.choice(list(METHODS))
            try:
                code = call_raw(rng.choice(channels), method, fuzzed_request(rng, method)).name
            except AssertionError as exc:
                code = f"FAILED: {exc}"[:200]
            with lock:
                codes[code] += 1

    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(worker, t) for t in range(threads)]:
            f.result(timeout=timeout)
    return codes


def test_fuzzed_requests_never_get_internal_or_unknown(cluster: list[str]) -> None:
    before = _rss_mib()
    calls = 4000
    channels = [grpc.insecure_channel(address) for address in cluster]
    started = time.monotonic()
    try:
        codes = fuzz(channels, calls, timeout=300)
    finally:
        for channel in channels:
            channel.close()
    elapsed = time.monotonic() - started
    grown = _rss_mib() - before
    assert sum(codes.values()) == calls // 4 * 4
    assert not [c for c in codes if c.startswith("FAILED:")], codes
    assert codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0, codes
    assert grown < 256, f"peak RSS grew {grown:.0f} MiB"
    for address in cluster:  # still healthy
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{sum(codes.values())} calls in {elapsed:.1f} s: {dict(codes)}; "
          f"peak RSS +{grown:.0f} MiB")
