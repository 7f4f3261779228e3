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
    DeadlineExceeded,
    FailedPrecondition,
    GraphfeedError,
    InvalidRequest,
    ProtocolError,
    ResourceExhausted,
    ServerError,
    ServerUnavailable,
    channel_options,
    create_channel,
    rpc_errors,
    server_options,
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
