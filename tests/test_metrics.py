"""The Prometheus endpoint: streams, batches, bytes, seeds, stage latencies, peer
errors and rejections, scraped over HTTP from a running pair of servers."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import grpc
import pytest

from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from sampling_server.config import ServerConfig
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
                                        device="cpu", health_interval=0.3, metrics_port=0))
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
            chunks = list(stub.StreamMinibatches(request, timeout=30))
            info = stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=10)
            with pytest.raises(grpc.RpcError):
                list(stub.StreamMinibatches(pb.EpochRequest(split="train", fanouts=[99_999],
                                                            batch_size=10, world_size=1),
                                            timeout=30))
        url = f"http://127.0.0.1:{servers[0].metrics_port}/metrics"
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        batches = len({c.batch_index for c in chunks})
        assert _value(page, "graphfeed_batches_sent_total") == batches
        assert _value(page, "graphfeed_seeds_served_total") == info.split_sizes[0].train
        assert _value(page, "graphfeed_bytes_sent_total") >= sum(c.ByteSize() for c in chunks)
        assert _value(page, "graphfeed_streams_open") == 0
        for stage in ("sample", "gather", "encode", "peer_sample", "peer_fetch"):
            assert _value(page, "graphfeed_stage_seconds_count", stage=stage) > 0
        assert _value(page, "graphfeed_requests_rejected_total", method="StreamMinibatches",
                      code="INVALID_ARGUMENT") == 1
    finally:
        for s in servers:
            s.stop(None).wait(10)
