"""The Prometheus endpoint: streams, batches, bytes, seeds, stage latencies, peer
errors and rejections, scraped over HTTP from a running pair of servers."""

from __future__ import annotations

import re
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numba
import pytest

from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.epoch_call import stream_minibatches
from sampling_server.config import ServerConfig
from sampling_server.metrics import GilProbe
from sampling_server.server import create_server


def _value(text: str, name: str, **labels: str) -> float:
    """The sample ``name{labels...}`` of a Prometheus text page (summed over the other
    labels)."""
    total, found = 0.0, False
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
            found = True
    assert found, f"{name} {labels} not in the page"
    return total


def test_the_metrics_endpoint_counts_what_the_server_did(parts2: Path) -> None:
    built = [create_server(ServerConfig(partition_dir=parts2, partition=p, listen="127.0.0.1:0",
                                        device="cpu", health_interval=0.3, metrics_port=0,
                                        structure="partition", features="partition"))  # peers asked
             for p in range(2)]
    addresses = [f"127.0.0.1:{port}" for _, port in built]
    servers = [s for s, _ in built]
    for s in servers:
        s.set_peers(addresses)
        s.start()
    try:
        assert all(s.wait_until_serving(30) for s in servers)
        with grpc.insecure_channel(addresses[0]) as channel:
            stub = pb_grpc.SamplingServiceStub(channel)
            request = pb.EpochRequest(split="train", fanouts=[5, 3], batch_size=50, world_size=1,
                                      include_features=True, include_labels=True)
            chunks = list(stream_minibatches(channel, request, timeout=30))
            info = stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=10)
            with pytest.raises(grpc.RpcError):
                list(stream_minibatches(channel, pb.EpochRequest(split="train", fanouts=[99_999],
                                                            batch_size=10, world_size=1),
                                            timeout=30))
        url = f"http://127.0.0.1:{servers[0].metrics_port}/metrics"
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        batches = len({c.batch_index for c in chunks})
        assert _value(page, "graphfeed_batches_sent_total") == batches
        assert _value(page, "graphfeed_seeds_served_total") == info.split_sizes[0].train
        assert _value(page, "graphfeed_bytes_sent_total") >= sum(c.ByteSize() for c in chunks)
        assert _value(page, "graphfeed_streams_open") == 0
        assert _value(page, "graphfeed_gil_wait_seconds_count") > 0  # probed while served
        assert _value(page, "graphfeed_threading_layer", layer=numba.threading_layer()) == 1
        part = servers[0].store.partition
        assert _value(page, "graphfeed_held_bytes", what="structure", extent="partition") == \
            part.structure.nbytes > 0
        assert _value(page, "graphfeed_held_bytes", what="features", extent="partition") == \
            part.node_data.nbytes > 0
        assert "extent=\"full\"" not in page
        for stage in ("sample", "gather", "encode", "peer_sample", "peer_fetch"):
            assert _value(page, "graphfeed_stage_seconds_count", stage=stage) > 0
        # the peer's side of those calls: one answer each, timed without its network wait
        peer_url = f"http://127.0.0.1:{servers[1].metrics_port}/metrics"
        peer_page = urllib.request.urlopen(peer_url, timeout=10).read().decode()
        for asked, answered in (("peer_sample", "answer_sample"), ("peer_fetch", "answer_fetch")):
            calls = _value(page, "graphfeed_stage_seconds_count", stage=asked)
            assert _value(peer_page, "graphfeed_stage_seconds_count", stage=answered) == calls
            assert 0 < _value(peer_page, "graphfeed_stage_seconds_sum", stage=answered) \
                < _value(page, "graphfeed_stage_seconds_sum", stage=asked)
        assert _value(page, "graphfeed_requests_rejected_total", method="StreamMinibatches",
                      code="INVALID_ARGUMENT") == 1
    finally:
        for s in servers:
            s.stop(None).wait(10)


def test_a_server_without_a_concurrent_threading_layer_warns_and_says_so_in_its_metrics(
        parts1: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Under Numba's workqueue layer a server's parallel kernels take turns: its log says
    so with the remedy, and its metrics name the layer."""
    from sampling_server import server as server_module

    monkeypatch.setattr(server_module.cpu_kernels, "threading_layer", lambda: "workqueue")
    server, _ = create_server(ServerConfig(partition_dir=parts1, partition=0, listen="127.0.0.1:0",
                                           device="cpu", metrics_port=0))
    with caplog.at_level("INFO", logger="sampling_server.server"):
        server.start()
        try:
            assert server.wait_until_loaded(30)
            deadline = time.monotonic() + 10
            while not any("threading layer" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "no threading layer in the log"
                time.sleep(0.05)
            page = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                          timeout=10).read().decode()
        finally:
            server.stop(None).wait(10)
    warning = next(r for r in caplog.records if "threading layer" in r.getMessage())
    assert warning.levelname == "WARNING"
    assert "one at a time" in warning.getMessage() and "libgomp1" in warning.getMessage()
    assert _value(page, "graphfeed_threading_layer", layer="workqueue") == 1


def _probe_waits(busy_threads: int, seconds: float = 0.6) -> list[float]:
    """The probe's waits while ``busy_threads`` threads run pure Python (holding the
    interpreter lock but for the forced switches)."""
    waits: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(5_000))

    threads = [threading.Thread(target=spin) for _ in range(busy_threads)]
    probe = GilProbe(waits.append, interval=0.002).start()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    probe.close()
    return waits


def test_the_gil_probe_tells_a_free_interpreter_lock_from_a_busy_one() -> None:
    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.02)  # a busy lock makes a waking thread wait up to 20 ms
    try:
        free = _probe_waits(0)
        busy = _probe_waits(2)
    finally:
        sys.setswitchinterval(switch)
    assert len(free) >= 20 and len(busy) >= 5
    assert all(w >= 0 for w in free + busy)
    assert statistics.median(free) < 0.005
    assert statistics.median(busy) > 0.01  # each wake waits about one switch interval


def test_the_gil_probe_refuses_a_bad_interval_and_stops_when_closed() -> None:
    with pytest.raises(ValueError, match="interval"):
        GilProbe(lambda _: None, interval=0)
    waits: list[float] = []
    probe = GilProbe(waits.append, interval=0.001).start()
    time.sleep(0.05)
    probe.close()
    seen = len(waits)
    time.sleep(0.05)
    assert seen > 0 and len(waits) == seen
