"""Reaching the servers at start (trainer_client/connect.py, cluster.py): waiting for
servers that start after the trainer or are still loading, saying what for, giving up at
once where every server refuses connections, within the connect timeout otherwise; and
the cluster's look-up of original node IDs. Fake servers from test_loader.py."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from test_loader import TIMEOUTS, UNEVEN, Faults, fake_cluster, seeds_of

from protos.channel import ServerUnavailable
from trainer_client.loader import Cluster, RemoteNeighborLoader


def test_a_trainer_started_before_its_servers_connects_when_they_come_up(
        reserve_ports: Callable[[int], list[int]]) -> None:
    ports = reserve_ports(2)  # refused until the servers bind them
    addresses = [f"127.0.0.1:{p}" for p in ports]
    result: dict[str, object] = {}

    def connect() -> None:
        try:
            result["loader"] = RemoteNeighborLoader(addresses, "train", num_neighbors=[1], batch_size=4,
                                                    **{**TIMEOUTS, "connect_timeout": 20.0})
        except Exception as exc:
            result["error"] = exc

    thread = threading.Thread(target=connect)
    thread.start()
    time.sleep(1.0)
    loading = Faults(loading_until=time.monotonic() + 0.5)  # then "loading" for a while
    with fake_cluster(UNEVEN[:2], ports=ports, faults={0: loading, 1: loading}):
        thread.join(timeout=25)
        assert "error" not in result, result.get("error")
        loader = result["loader"]
        assert isinstance(loader, RemoteNeighborLoader)
        assert sum(len(seeds_of(b)) for b in loader) == 10
        loader.close()


def test_an_unreachable_server_fails_within_connect_timeout(
        reserve_ports: Callable[[int], list[int]]) -> None:
    address = f"127.0.0.1:{reserve_ports(1)[0]}"  # held: nothing listens there
    started = time.monotonic()
    pattern = rf"server {address}: no ClusterInfo within 1 s \(--timeout, a loader's connect_timeout; "
    with pytest.raises(ServerUnavailable, match=pattern):
        RemoteNeighborLoader([address], num_neighbors=[1], batch_size=4, connect_timeout=1.0)
    assert time.monotonic() - started < 5


def test_servers_that_refuse_connections_end_the_wait_at_once_naming_the_fix(
        caplog: pytest.LogCaptureFixture, reserve_ports: Callable[[int], list[int]]) -> None:
    addresses = [f"127.0.0.1:{p}" for p in reserve_ports(2)]  # held: nothing listens there
    started = time.monotonic()
    with pytest.raises(ServerUnavailable, match=rf"servers {addresses[0]}, {addresses[1]} refused "
                                                r"connections for 0.5 s: is a server running at each\? Start "
                                                r"it with graphfeed-server .*, or check --servers"):
        Cluster(addresses, connect_timeout=60, refused_grace=0.5)
    assert time.monotonic() - started < 10  # not the 60 s of connect_timeout
    with pytest.raises(ServerUnavailable, match=rf"server {addresses[0]} refused connections for 0.5 s: is "
                                                rf"a server running at {addresses[0]}\?"):
        Cluster(addresses[:1], connect_timeout=60, refused_grace=0.5)


def test_a_host_name_that_does_not_resolve_ends_the_wait_naming_it_and_the_flag(
        caplog: pytest.LogCaptureFixture) -> None:
    """As a refused port does: once the name has failed to resolve for the refusal grace
    (not at the connect timeout), in one line that names the address and --servers, after
    one warning (not one per try)."""
    from trainer_client.train import main

    address = "graphfeed-no-such-host.invalid:50051"  # .invalid never resolves (RFC 6761)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert main(["--servers", address, "--refused-grace", "1", "--device", "cpu"]) == 1
    assert time.monotonic() - started < 60  # not --timeout's 120 s
    pattern = rf"server {re.escape(address)}: its host name did not resolve for 1 s \(UNAVAILABLE: .+\): " \
        r"check the address in --servers"
    assert re.search(pattern, caplog.text), caplog.text
    assert "connect_timeout" not in caplog.text
    assert sum("waiting up to" in r.getMessage() for r in caplog.records) == 1, caplog.text


def test_servers_that_answer_while_loading_are_waited_for_saying_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        reserve_ports: Callable[[int], list[int]]) -> None:
    """A server that answers "still loading" is not one that refuses: the trainer waits,
    saying every few seconds what for and how long is left, also past the refusal grace."""
    from trainer_client import connect

    monkeypatch.setattr(connect, "REPORT_EVERY", 0.3)
    ports = reserve_ports(2)
    loading = Faults(loading_until=time.monotonic() + 2.0)
    with fake_cluster(UNEVEN[:2], ports=ports, faults={0: loading}) as cluster, \
            caplog.at_level(logging.INFO, "trainer_client.cluster"):
        found = Cluster(cluster.addresses, connect_timeout=20, refused_grace=0.5)
        assert found.addresses == cluster.addresses
        found.close()
    waiting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for 1 server")]
    assert waiting and all(f"{cluster.addresses[0]} is still loading (UNAVAILABLE: partition 0 is still "
                           "loading)" in m for m in waiting), caplog.text
    assert re.search(r"waiting for 1 server \(1\d s left\)", waiting[0])


def test_original_ids_that_are_not_integers_are_refused_not_truncated() -> None:
    """1.7 is no node: a Cluster's look-up refuses it rather than looking node 1 up."""
    with fake_cluster(UNEVEN) as cluster, Cluster(cluster.addresses, connect_timeout=5) as found:
        assert found.global_ids(np.array([5, 120])).tolist() == [5, 120]
        for bad in (np.array([1.7, 2.2]), np.array([1.0, 2.0]), np.array([True, False]), [1.7, 2.2]):
            with pytest.raises(ValueError, match=r"original: expected integer node IDs, got dtype "):
                found.global_ids(bad)  # type: ignore[arg-type]
