"""protos/channel.py: channel and server options, error translation, deadlines, retries."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos import codec
from protos.assembler import TensorAssembler
from protos.channel import (
    Backoff,
    DeadlineExceeded,
    FailedPrecondition,
    GraphfeedError,
    InvalidRequest,
    ProtocolError,
    ResourceExhausted,
    RetryFailure,
    ServerError,
    ServerUnavailable,
    channel_options,
    create_channel,
    retry,
    rpc_errors,
    server_options,
    status_in,
    wait_ready,
)

SERVICE = "test.Probe"


def _identity(data: bytes) -> bytes:
    return data


class ProbeServer:
    """A tiny gRPC server: ``Fail`` aborts with the status named by the request,
    ``Slow`` waits (until released), ``Echo`` returns the request, ``Stream`` sends two
    messages then fails with INTERNAL."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.release = threading.Event()
        handlers = {
            "Fail": grpc.unary_unary_rpc_method_handler(self.fail, _identity, _identity),
            "Slow": grpc.unary_unary_rpc_method_handler(self.slow, _identity, _identity),
            "Echo": grpc.unary_unary_rpc_method_handler(lambda r, c: r, _identity, _identity),
            "Stream": grpc.unary_stream_rpc_method_handler(self.stream, _identity, _identity),
        }
        self.server = grpc.server(ThreadPoolExecutor(8), options=server_options())
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def fail(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        code = grpc.StatusCode[request.decode()]
        self.calls[code.name] += 1
        context.abort(code, f"probe says {code.name.lower()}")
        return b""

    def slow(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.release.wait(10)
        return request

    def stream(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"one"
        yield b"two"
        context.abort(grpc.StatusCode.INTERNAL, "stream broke after two messages")

    def stop(self) -> None:
        self.release.set()
        self.server.stop(None)


@pytest.fixture(scope="module")
def probe() -> Iterator[ProbeServer]:
    server = ProbeServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def channel(probe: ProbeServer) -> Iterator[grpc.Channel]:
    ch = create_channel(probe.address)
    wait_ready(ch, 5, address=probe.address)
    yield ch
    ch.close()


def _call(channel: grpc.Channel, method: str, request: bytes, timeout: float = 5) -> bytes:
    fn = channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=_identity,
                             response_deserializer=_identity)
    result: bytes = fn(request, timeout=timeout)
    return result


@pytest.mark.parametrize(("code", "error"), [
    ("INVALID_ARGUMENT", InvalidRequest),
    ("FAILED_PRECONDITION", FailedPrecondition),
    ("RESOURCE_EXHAUSTED", ResourceExhausted),
    ("DEADLINE_EXCEEDED", DeadlineExceeded),
    ("UNAVAILABLE", ServerUnavailable),
    ("INTERNAL", ServerError),
    ("NOT_FOUND", ServerError),
])
def test_status_becomes_our_exception_with_a_clear_message(
    probe: ProbeServer, channel: grpc.Channel, code: str, error: type[GraphfeedError]
) -> None:
    with pytest.raises(error) as info, rpc_errors("Probe.Fail", probe.address):
        _call(channel, "Fail", code.encode())
    message = str(info.value)
    assert "Probe.Fail" in message and probe.address in message and code in message
    assert f"probe says {code.lower()}" in message
    assert info.value.code == grpc.StatusCode[code] and info.value.address == probe.address
    assert isinstance(info.value.__cause__, grpc.RpcError)


def test_an_unauthenticated_call_names_the_flag_that_gives_the_token(
        probe: ProbeServer, channel: grpc.Channel) -> None:
    with pytest.raises(ServerError, match=r"UNAUTHENTICATED: probe says unauthenticated; every server and "
                                          r"trainer of a cluster reads the same token: --token-file FILE"), \
            rpc_errors("Probe.Fail", probe.address):
        _call(channel, "Fail", b"UNAUTHENTICATED")
    with pytest.raises(ServerError) as other, rpc_errors("Probe.Fail", probe.address):
        _call(channel, "Fail", b"PERMISSION_DENIED")
    assert "--token-file" not in str(other.value)


def test_the_channel_never_retries_by_itself(probe: ProbeServer, channel: grpc.Channel) -> None:
    before = Counter(probe.calls)
    for code in ("UNAVAILABLE", "INVALID_ARGUMENT", "INTERNAL"):
        with pytest.raises(GraphfeedError), rpc_errors("Probe.Fail"):
            _call(channel, "Fail", code.encode())
    attempts = probe.calls - before
    assert attempts == Counter({"UNAVAILABLE": 1, "INVALID_ARGUMENT": 1, "INTERNAL": 1})


def test_a_call_to_a_server_that_is_down_fails_at_once(reserve_ports: Callable[[int], list[int]]) -> None:
    address = f"127.0.0.1:{reserve_ports(1)[0]}"  # held: nothing listens there
    ch = create_channel(address)
    started = time.monotonic()
    with pytest.raises(ServerUnavailable, match=r"Connection refused|failed to connect"), \
            rpc_errors("Probe.Echo", address):
        _call(ch, "Echo", b"x", timeout=10)
    assert time.monotonic() - started < 5  # not the whole deadline
    ch.close()


def test_deadline_is_exceeded_quickly(probe: ProbeServer, channel: grpc.Channel) -> None:
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="DEADLINE_EXCEEDED"), rpc_errors("Probe.Slow"):
        _call(channel, "Slow", b"x", timeout=0.2)
    assert time.monotonic() - started < 10  # Slow waits until teardown; 10 s is far below that


def test_stream_errors_are_translated_while_iterating(probe: ProbeServer,
                                                      channel: grpc.Channel) -> None:
    fn = channel.unary_stream(f"/{SERVICE}/Stream", request_serializer=_identity,
                              response_deserializer=_identity)
    got = []
    with pytest.raises(ServerError, match="stream broke after two messages"), \
            rpc_errors("Probe.Stream", probe.address):
        got.extend(fn(b"", timeout=5))
    assert got == [b"one", b"two"]


def test_dead_server_is_unavailable_quickly() -> None:
    server = ProbeServer()
    address = server.address
    server.stop()
    ch = create_channel(address)
    started = time.monotonic()
    with pytest.raises(ServerUnavailable, match=address), rpc_errors("Probe.Echo", address):
        _call(ch, "Echo", b"x", timeout=10)
    assert time.monotonic() - started < 5
    with pytest.raises(ServerUnavailable, match="not reachable within"):
        wait_ready(ch, 0.3, address=address)
    ch.close()


def test_messages_above_grpc_default_limit_pass(channel: grpc.Channel) -> None:
    payload = b"\x01" * (8 << 20)  # gRPC's default receive limit is 4 MiB
    assert _call(channel, "Echo", payload) == payload


def test_messages_above_the_wire_limit_are_refused(channel: grpc.Channel) -> None:
    with pytest.raises(ResourceExhausted), rpc_errors("Probe.Echo"):
        _call(channel, "Echo", b"\x00" * (codec.MAX_MESSAGE_BYTES + 1))


def test_codec_errors_become_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match=r"malformed reply.*TensorChunk\.name"), \
            rpc_errors("Peer.Fetch", "h:1"):
        TensorAssembler().add(codec.pb.TensorChunk())


def test_options() -> None:
    opts = dict(channel_options())
    assert opts["grpc.max_send_message_length"] == codec.MAX_MESSAGE_BYTES
    assert opts["grpc.max_receive_message_length"] == codec.MAX_MESSAGE_BYTES
    assert opts["grpc.keepalive_permit_without_calls"] == 1
    assert opts["grpc.enable_retries"] == 0 and "grpc.service_config" not in opts
    server = dict(server_options())
    # the server must accept the clients' keepalive pings
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= opts["grpc.keepalive_time_ms"]
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.so_reuseport"] == 0
    with pytest.raises(ValueError, match="host:port"):
        create_channel("no-port")


# ---- retry ------------------------------------------------------------------------------


class _Clock:
    """A clock that only moves when told: by a pause, or by a try's own duration."""

    def __init__(self) -> None:
        self.now = 100.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


class _Status(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name.lower()


def _failing(clock: _Clock, errors: list[BaseException], cost: float = 0.0,
             seen: list[float] | None = None) -> object:
    """A try that raises ``errors`` one after the other (each ``cost`` seconds), then
    returns "done"; ``seen`` gets the seconds left it was given."""
    def attempt(left: float) -> str:
        if seen is not None:
            seen.append(left)
        clock.now += cost
        if errors:
            raise errors.pop(0)
        return "done"
    return attempt


UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def test_retry_pauses_grow_up_to_the_cap_and_the_callback_sees_every_failure() -> None:
    clock = _Clock()
    failures: list[RetryFailure] = []
    errors: list[BaseException] = [_Status(UNAVAILABLE) for _ in range(6)]
    got = retry(_failing(clock, errors), backoff=Backoff(0.1, 3.0, cap=2.0),  # type: ignore[arg-type]
                retryable=status_in(UNAVAILABLE), on_failure=failures.append,
                clock=clock, sleep=clock.sleep)
    assert got == "done"
    assert clock.pauses == pytest.approx([0.1, 0.3, 0.9, 2.0, 2.0, 2.0])
    assert [f.attempts for f in failures] == [1, 2, 3, 4, 5, 6]
    assert [f.pause for f in failures] == clock.pauses
    assert failures[-1].elapsed == pytest.approx(sum(clock.pauses[:-1]))
    assert all(f.left == float("inf") for f in failures)


def test_retry_raises_what_it_may_not_retry_at_once() -> None:
    clock = _Clock()
    errors: list[BaseException] = [_Status(UNAVAILABLE), _Status(grpc.StatusCode.INVALID_ARGUMENT)]
    with pytest.raises(grpc.RpcError) as info:
        retry(_failing(clock, errors), backoff=Backoff(0.5), retryable=status_in(UNAVAILABLE),
              clock=clock, sleep=clock.sleep)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert clock.pauses == [0.5]
    with pytest.raises(KeyError):  # not a gRPC failure at all
        retry(_failing(clock, [KeyError("x")]), backoff=Backoff(0.5),
              retryable=status_in(UNAVAILABLE), clock=clock, sleep=clock.sleep)


def test_retry_gives_each_try_the_time_left_and_stops_at_the_deadline() -> None:
    clock = _Clock()
    seen: list[float] = []
    gave_up: list[RetryFailure] = []

    def give_up(failure: RetryFailure) -> BaseException:
        gave_up.append(failure)
        return ServerUnavailable(f"gave up after {failure.attempts} tries")

    errors: list[BaseException] = [_Status(UNAVAILABLE) for _ in range(50)]
    with pytest.raises(ServerUnavailable, match="gave up after 4 tries") as info:
        retry(_failing(clock, errors, cost=0.25, seen=seen), backoff=Backoff(0.5, 2.0),
              retryable=status_in(UNAVAILABLE), deadline=clock.now + 3.0, on_give_up=give_up,
              clock=clock, sleep=clock.sleep)
    assert isinstance(info.value.__cause__, grpc.RpcError)
    # tries at 0, 0.75, 2.0 and 3.0 (the last pause cut short at the deadline)
    assert seen == pytest.approx([3.0, 2.25, 1.0, 1e-3])
    assert clock.pauses == pytest.approx([0.5, 1.0, 0.75])
    assert gave_up[0].pause == 0.0 and gave_up[0].left == 0.0


def test_retry_window_starts_at_the_first_failure_and_again_after_progress() -> None:
    clock = _Clock()
    clock.now += 50  # a try that ran long before it failed: the window counts from there
    got_further = [False, True, False, False, False]  # asked from the second failure on
    errors: list[BaseException] = [ServerUnavailable("down", code=UNAVAILABLE) for _ in range(20)]
    failures: list[RetryFailure] = []
    with pytest.raises(ServerUnavailable, match="down"):
        retry(_failing(clock, errors, cost=0.1), backoff=Backoff(0.2), retryable=status_in(UNAVAILABLE),
              window=1.0, progressed=lambda: got_further.pop(0), on_failure=failures.append,
              clock=clock, sleep=clock.sleep)
    assert [f.attempts for f in failures] == [1, 2, 1, 2, 3]  # the third try got further
    assert clock.pauses == pytest.approx([0.2, 0.4, 0.2, 0.4, 0.2])  # the last cut short


def test_retry_stops_after_max_attempts_or_when_its_sleep_is_interrupted() -> None:
    clock = _Clock()
    errors: list[BaseException] = [_Status(UNAVAILABLE) for _ in range(10)]
    with pytest.raises(grpc.RpcError):
        retry(_failing(clock, errors), backoff=Backoff(0.1), retryable=status_in(UNAVAILABLE),
              max_attempts=3, clock=clock, sleep=clock.sleep)
    assert len(clock.pauses) == 2 and len(errors) == 7
    stop = threading.Event()
    stop.set()
    started = time.monotonic()
    with pytest.raises(grpc.RpcError):
        retry(_failing(clock, errors), backoff=Backoff(30.0), retryable=status_in(UNAVAILABLE),
              sleep=stop.wait)
    assert time.monotonic() - started < 5 and len(errors) == 6


def test_backoff_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"Backoff.first: expected seconds > 0, got 0"):
        Backoff(0)
    with pytest.raises(ValueError, match=r"Backoff.growth: expected a factor >= 1, got 0.5"):
        Backoff(1.0, 0.5)
    with pytest.raises(ValueError, match=r"Backoff.cap: expected seconds >= first \(1.0\), got 0.5"):
        Backoff(1.0, cap=0.5)
