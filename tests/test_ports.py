"""Ports bound before anyone is told them (protos/ports.py) and ``graphfeed-server
--port-file``: a server started on port 0 reports the port it got."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from server_procs import ENV, REPO, health_status

from protos.channel import server_options
from protos.ports import read_port_file, reserved_ports, wait_port_file, write_port_file


def test_reserved_ports_are_distinct_refuse_connections_and_no_one_else_binds_them() -> None:
    with reserved_ports(3) as ports:
        assert len(set(ports)) == 3
        for port in ports:
            with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
                probe.connect(("127.0.0.1", port))
            with socket.socket() as other, pytest.raises(OSError, match="in use"):
                other.bind(("127.0.0.1", port))
        assert not {_bind_zero() for _ in range(200)} & set(ports)


def _bind_zero() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_grpc_server_binds_a_reserved_port_and_keeps_it_after_the_block() -> None:
    with reserved_ports(1) as (port,):
        server = grpc.server(ThreadPoolExecutor(1), options=server_options())
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        server.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # listening: the server holds the port on its own now
    finally:
        server.stop(0).wait(5)


def test_port_files_are_written_whole_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "port"
    assert read_port_file(path) is None
    write_port_file(path, 50051)
    assert path.read_text() == "50051\n" and read_port_file(path) == 50051
    assert [p.name for p in tmp_path.iterdir()] == ["port"]  # no temporary file left
    path.write_text("fifty")
    with pytest.raises(ValueError, match=r"port: expected a port number, got 'fifty'"):
        read_port_file(path)


def test_waiting_for_a_port_file_ends_when_the_process_exits_or_the_time_is_up(tmp_path: Path) -> None:
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    done.wait(30)
    with pytest.raises(RuntimeError, match=r"server 1 exited with 3 before binding its port"):
        wait_port_file(tmp_path / "never", 30, done, what="server 1")
    with pytest.raises(TimeoutError, match=r"did not bind its port within 0.2 s"):
        wait_port_file(tmp_path / "never", 0.2)


@pytest.mark.slow
def test_graphfeed_server_on_port_0_writes_the_port_it_serves_on(parts1: Path, tmp_path: Path) -> None:
    port_file = tmp_path / "server.port"
    cmd = [sys.executable, "-m", "sampling_server", "--partition-dir", str(parts1), "--partition", "0",
           "--listen", "127.0.0.1:0", "--port-file", str(port_file), "--device", "cpu"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        port = wait_port_file(port_file, 120, proc, what="graphfeed-server")
        deadline = time.monotonic() + 120
        while health_status(f"127.0.0.1:{port}") != "SERVING":
            assert proc.poll() is None and time.monotonic() < deadline, "not SERVING on its port"
            time.sleep(0.2)
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
