"""Sampling servers as real processes on 127.0.0.1, for the fault tests: start, kill -9,
restart on the same address, SIGTERM, and wait (bounded) for their health.

Their ports are reserved (:func:`protos.ports.reserved_ports`) for as long as the
servers may run, so a restarted server finds its address free, and each server writes
the port it bound (``--port-file``), so a server that could not bind fails the wait at
once, with its log."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.ports import read_port_file, reserved_ports

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def health_status(address: str, service: str = "", timeout: float = 2.0) -> str:
    """The health status name of ``service`` at ``address`` ("DOWN" when no answer)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return "DOWN"
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


class ServerProcs:
    """One ``python -m sampling_server`` process per partition, on ports reserved until
    :meth:`stop`."""

    def __init__(self, part_dir: Path, num_parts: int, *extra: str, log_dir: Path | None = None):
        self.part_dir = part_dir
        self.extra = extra
        self._held = contextlib.ExitStack()
        self.ports = self._held.enter_context(reserved_ports(num_parts))
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * num_parts
        self.log_dir = log_dir
        self._port_dir = Path(self._held.enter_context(tempfile.TemporaryDirectory(prefix="ports-")))
        self._starts = [0] * num_parts

    def port_file(self, p: int) -> Path:
        """Where the current process of partition ``p`` writes its bound port."""
        return self._port_dir / f"server{p}.{self._starts[p]}.port"

    def command(self, p: int) -> list[str]:
        return [sys.executable, "-m", "sampling_server", "--partition-dir", str(self.part_dir),
                "--partition", str(p), "--listen", self.addresses[p],
                "--peers", ",".join(self.addresses), "--port-file", str(self.port_file(p)),
                "--log-level", "INFO", *self.extra]

    def start(self, p: int | None = None) -> None:
        """Start partition ``p``'s server (all of them when None)."""
        for q in range(len(self.addresses)) if p is None else [p]:
            self._starts[q] += 1
            self.port_file(q).unlink(missing_ok=True)
            out = subprocess.DEVNULL
            if self.log_dir is not None:
                out = open(self.log_dir / f"server{q}.{self._starts[q]}.log", "wb")  # noqa: SIM115
            self.procs[q] = subprocess.Popen(self.command(q), cwd=REPO, env=ENV, stdout=out,
                                             stderr=subprocess.STDOUT)

    def log(self, p: int) -> str:
        """Every log line of partition ``p``'s server processes so far."""
        if self.log_dir is None:
            return ""
        return "".join((self.log_dir / f"server{p}.{i}.log").read_text(errors="replace")
                       for i in range(1, self._starts[p] + 1))

    def kill(self, p: int) -> None:
        proc = self.procs[p]
        assert proc is not None
        proc.kill()
        proc.wait(timeout=30)

    def terminate(self, p: int) -> None:
        proc = self.procs[p]
        assert proc is not None
        proc.send_signal(signal.SIGTERM)

    def wait_status(self, p: int, status: str, timeout: float, service: str = "") -> None:
        """Wait until partition ``p``'s server says ``status``; fail at once, with its log,
        when it exits without having bound its port."""
        deadline = time.monotonic() + timeout
        proc = self.procs[p]
        while time.monotonic() < deadline:
            if health_status(self.addresses[p], service) == status:
                return
            if proc is not None and proc.poll() is not None and read_port_file(self.port_file(p)) is None:
                raise AssertionError(f"server {p} exited with {proc.returncode} before binding "
                                     f"{self.addresses[p]}; log:\n{self.log(p)[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"server {p} not {status} within {timeout} s; log:\n{self.log(p)[-3000:]}")

    def stop(self) -> list[int | None]:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for proc in self.procs:
            if proc is None:
                codes.append(None)
                continue
            try:
                codes.append(proc.wait(timeout=30))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait(timeout=10))
        self._held.close()  # the ports are free again
        return codes
