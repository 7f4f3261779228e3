"""Sampling servers in the test's own process, one per partition, each the others' peer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from sampling_server.config import ServerConfig
from sampling_server.server import SamplingServer, create_server

#: What every in-process test server is started with, unless a test says otherwise.
DEFAULTS: dict[str, object] = {"listen": "127.0.0.1:0", "device": "cpu", "peer_timeout": 20.0,
                               "health_interval": 0.5, "grace": 1.0}


def server_config(root: Path, partition: int, **kw: object) -> ServerConfig:
    return ServerConfig(partition_dir=root, partition=partition, **{**DEFAULTS, **kw})  # type: ignore[arg-type]


@contextlib.contextmanager
def serving(root: Path, parts: int, **kw: object) -> Iterator[tuple[list[str], list[SamplingServer]]]:
    """Started servers of ``root``'s ``parts`` partitions (``kw``: ``ServerConfig``
    fields), serving until the block ends: their addresses and the servers."""
    built = [create_server(server_config(root, p, **kw)) for p in range(parts)]
    addresses = [f"127.0.0.1:{port}" for _, port in built]
    servers = [s for s, _ in built]
    try:
        for s in servers:
            if parts > 1:
                s.set_peers(addresses)
            s.start()
        assert all(s.wait_until_serving(60) for s in servers)
        yield addresses, servers
    finally:
        for s in servers:
            s.stop(None).wait(10)


@contextlib.contextmanager
def served(root: Path, parts: int, **kw: object) -> Iterator[list[str]]:
    """:func:`serving`, yielding the addresses only."""
    with serving(root, parts, **kw) as (addresses, _):
        yield addresses
