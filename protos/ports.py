"""Ports that are bound before anyone is told them.

A port picked free (bound to port 0, then closed) and bound again later by a server can
be taken in between by any other process. Two ways round that, both here:

* a server that needs no known address binds port 0 and reports the port it got:
  :func:`create_server <sampling_server.server.create_server>` returns it, and
  ``graphfeed-server --port-file PATH`` writes it (:func:`write_port_file`) for the
  process that started it (:func:`wait_port_file`);
* servers that must know each other's addresses before they start (``--peers``) get
  ports from :func:`reserved_ports`, which stay bound by the caller until the block
  ends: the kernel gives them to no other ``bind`` to port 0 and to no outgoing
  connection, nothing listens on them (a connection is refused), and a server started
  meanwhile binds them all the same, as gRPC servers and PyTorch's ``TCPStore`` set
  ``SO_REUSEADDR`` (Linux; elsewhere a server on a reserved port may fail to bind, and
  the caller retries on others).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Seconds between two looks at a port file that has not appeared yet.
POLL_S = 0.05


@contextlib.contextmanager
def reserved_ports(count: int, host: str = "127.0.0.1") -> Iterator[list[int]]:
    """``count`` distinct ports of ``host``, held bound (not listening) until the block
    ends; servers started inside the block bind them (see the module docstring)."""
    if count < 0:
        raise ValueError(f"count: expected >= 0, got {count}")
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
            sock = stack.enter_context(socket.socket(family, socket.SOCK_STREAM))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        yield ports


def write_port_file(path: Path | str, port: int) -> None:
    """Write ``port`` (a line of digits) to ``path`` atomically: a reader sees no file
    or the whole number, never part of it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(f"{int(port)}\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_port_file(path: Path | str) -> int | None:
    """The port in ``path``, or None while there is no such file."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{path}: expected a port number, got {text[:40]!r}") from None


def wait_port_file(path: Path | str, timeout: float, process: subprocess.Popen[Any] | None = None,
                   what: str = "the server") -> int:
    """Wait until ``path`` holds the port ``process`` bound; TimeoutError after ``timeout``
    seconds, RuntimeError at once when ``process`` exits first (both name ``what``)."""
    deadline = time.monotonic() + timeout
    while True:
        port = read_port_file(path)
        if port is not None:
            return port
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode} before binding its port "
                               f"(no {path})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not bind its port within {timeout:g} s (no {path})")
        time.sleep(POLL_S)
