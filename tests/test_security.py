"""Mutual TLS and the bearer token, with certificates made in the test: the right
caller is served, every other one gets UNAUTHENTICATED (or no connection at all)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import ipaddress
import logging
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from protos import sampling_pb2 as pb
from protos import sampling_pb2_grpc as pb_grpc
from protos.channel import create_channel
from protos.codec import encode_tensor
from protos.epoch_call import stream_minibatches
from protos.security import Security, is_loopback
from sampling_server import cli
from sampling_server.config import ConfigError, ServerConfig
from sampling_server.server import SamplingServer, create_server
from trainer_client import Cluster
from trainer_client.node_tensors import RemoteNodeTensor

TOKEN = "s3cret-token-for-tests"
REPO = Path(__file__).resolve().parents[1]


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[Path, Path]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".crt")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def _cert(name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
          issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass
class Certs:
    ca: Path
    server: tuple[Path, Path]
    client: tuple[Path, Path]
    stranger: tuple[Path, Path]  # signed by another CA


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    root = tmp_path_factory.mktemp("certs")
    ca_key, other_key = _key(), _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "graphfeed test CA")])
    other_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "another CA")])
    ca_cert = _cert("graphfeed test CA", ca_key, ca_name, ca_key, ca=True)
    (root / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    made = {}
    for name, issuer, issuer_key in (("server", ca_name, ca_key), ("client", ca_name, ca_key),
                                     ("stranger", other_name, other_key)):
        key = _key()
        made[name] = _write(root / name, key, _cert(name, key, issuer, issuer_key))
    return Certs(root / "ca.crt", made["server"], made["client"], made["stranger"])


def _servers(parts: Path, **kw: object) -> tuple[list[SamplingServer], list[str]]:
    built = [create_server(ServerConfig(partition_dir=parts, partition=p, listen="127.0.0.1:0",
                                        device="cpu", peer_timeout=5.0, health_interval=0.3,
                                        **kw))  # type: ignore[arg-type]
             for p in range(2)]
    addresses = [f"127.0.0.1:{port}" for _, port in built]
    servers = [s for s, _ in built]
    for s in servers:
        s.set_peers(addresses)
        s.start()
    return servers, addresses


@pytest.fixture(scope="module")
def mtls_servers(parts2: Path, certs: Certs, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[list[SamplingServer], list[str]]]:
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    servers, addresses = _servers(parts2, tls_cert=certs.server[0], tls_key=certs.server[1],
                                  tls_ca=certs.ca, token_file=token_file)
    try:
        # the servers reach each other over mutual TLS with the token
        assert all(s.wait_until_serving(30) for s in servers)
        yield servers, addresses
    finally:
        for s in servers:
            s.stop(None).wait(10)


@pytest.fixture(scope="module")
def mtls(mtls_servers: tuple[list[SamplingServer], list[str]]) -> list[str]:
    """The addresses of two servers with mutual TLS and a token."""
    return mtls_servers[1]


def _calls(channel: grpc.Channel) -> list[grpc.StatusCode]:
    """The status of every graphfeed RPC on ``channel`` (OK when it answered)."""
    stub = pb_grpc.SamplingServiceStub(channel)
    peer = pb_grpc.PeerServiceStub(channel)
    nodes = encode_tensor(np.zeros(1, np.int64))
    calls = [
        lambda: stub.GetClusterInfo(pb.ClusterInfoRequest(), timeout=10),
        lambda: list(stream_minibatches(channel, pb.EpochRequest(
            split="train", fanouts=[2], batch_size=100, world_size=1), timeout=10)),
        lambda: list(peer.SampleNeighbors(pb.SampleNeighborsRequest(nodes=nodes, fanout=2),
                                          timeout=10)),
        lambda: list(peer.FetchNodeData(pb.FetchNodeDataRequest(nodes=nodes, want_labels=True),
                                        timeout=10)),
        lambda: list(stub.StreamHotNodes(pb.HotNodesRequest(count=5, include_features=True),
                                         timeout=10)),
        lambda: stub.LookupNodes(pb.LookupNodesRequest(split="train"), timeout=10),
    ]
    codes = []
    for call in calls:
        try:
            call()
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
    return codes


OK, UNAUTHENTICATED = grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED


def test_a_caller_with_certificate_and_token_is_served(mtls: list[str], certs: Certs) -> None:
    security = Security(ca=certs.ca, cert=certs.client[0], key=certs.client[1], token=TOKEN)
    with create_channel(mtls[0], security=security) as channel:
        assert _calls(channel) == [OK] * 6


def test_a_loader_fills_its_feature_cache_over_mutual_tls_with_the_token(
    mtls: list[str], certs: Certs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader's channels (cache fill, batch streams) carry the certificate and the
    token from the environment, as graphfeed-train's do."""
    from trainer_client.loader import RemoteNeighborLoader

    for name, value in (("GRAPHFEED_TLS_CA", certs.ca), ("GRAPHFEED_TLS_CERT", certs.client[0]),
                        ("GRAPHFEED_TLS_KEY", certs.client[1]), ("GRAPHFEED_TOKEN", TOKEN)):
        monkeypatch.setenv(name, str(value))
    with RemoteNeighborLoader(mtls, "train", num_neighbors=[3], batch_size=200, cache_size=0.3,
                              connect_timeout=30) as loader:
        assert loader.cache is not None and loader.cache.num_rows > 0
        assert sum(1 for _ in loader) == len(loader) > 0
        assert loader.last_stats.hit_rate > 0


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x"])
def test_a_caller_without_the_right_token_is_unauthenticated(
    mtls: list[str], certs: Certs, token: str | None
) -> None:
    security = Security(ca=certs.ca, cert=certs.client[0], key=certs.client[1], token=token)
    with create_channel(mtls[0], security=security) as channel:
        assert _calls(channel) == [UNAUTHENTICATED] * 6
        # health stays open, so that orchestrators can probe readiness
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate", "plaintext"])
def test_a_caller_without_a_trusted_certificate_gets_no_connection(
    mtls: list[str], certs: Certs, who: str
) -> None:
    security = {
        "no certificate": Security(ca=certs.ca, token=TOKEN),
        "another CA's certificate": Security(ca=certs.ca, cert=certs.stranger[0],
                                             key=certs.stranger[1], token=TOKEN),
        "plaintext": Security(token=TOKEN),
    }[who]
    with create_channel(mtls[0], security=security) as channel:
        codes = _calls(channel)
    assert codes == [grpc.StatusCode.UNAVAILABLE] * 6


def test_a_token_alone_guards_a_plaintext_server(parts2: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHFEED_TOKEN", TOKEN)  # the servers read it from the environment
    servers, addresses = _servers(parts2)
    monkeypatch.delenv("GRAPHFEED_TOKEN")
    try:
        assert all(s.wait_until_serving(30) for s in servers)
        with create_channel(addresses[0], security=Security(token=TOKEN)) as channel:
            assert _calls(channel) == [OK] * 6
        with create_channel(addresses[0], security=Security()) as channel:
            assert _calls(channel) == [UNAUTHENTICATED] * 6
        page = generate_latest(servers[0].metrics.registry).decode()
        assert 'method="StreamMinibatches",partition="0"} 1.0' in page
        assert 'code="UNAUTHENTICATED"' in page
    finally:
        for s in servers:
            s.stop(None).wait(10)


def test_the_token_goes_with_every_kind_of_call(parts2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Client-streaming calls (a node tensor's WriteRows) carry the token as the others do."""
    monkeypatch.setenv("GRAPHFEED_TOKEN", TOKEN)  # the servers' and the trainer's
    servers, addresses = _servers(parts2)
    try:
        assert all(s.wait_until_serving(30) for s in servers)
        with Cluster(addresses) as cluster:
            table = RemoteNodeTensor(cluster, "with-token", 3)
            nodes, rows = torch.tensor([0, 1, 5]), torch.arange(9, dtype=torch.float32).reshape(3, 3)
            table.write(nodes, rows)
            assert torch.equal(table.read(nodes), rows)
            table.drop()
    finally:
        for s in servers:
            s.stop(None).wait(10)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_the_certificates_of_make_certs_sh_secure_a_cluster(parts2: Path, tmp_path: Path) -> None:
    out = tmp_path / "certs"
    subprocess.run(["bash", str(REPO / "deploy" / "make-certs.sh"), str(out), "server0",
                    "server1", "trainer0"], check=True, capture_output=True, timeout=60)
    servers, addresses = [], []
    try:
        servers, addresses = _servers(parts2, tls_cert=out / "server0.crt",
                                      tls_key=out / "server0.key", tls_ca=out / "ca.crt",
                                      token_file=out / "token")
        assert all(s.wait_until_serving(30) for s in servers)
        token = (out / "token").read_text().strip()
        trainer = Security(ca=out / "ca.crt", cert=out / "trainer0.crt", key=out / "trainer0.key",
                           token=token)
        with create_channel(addresses[0], security=trainer) as channel:
            assert _calls(channel) == [OK] * 6
    finally:
        for s in servers:
            s.stop(None).wait(10)


# -- secure by default -------------------------------------------------------------------------
def test_loopback_is_told_from_every_other_address() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.1.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "[::]", "", "10.1.2.3",
                                            "host.invalid"))


def test_a_server_beyond_loopback_without_credentials_refuses_to_start(
    parts2: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("GRAPHFEED_TOKEN", "GRAPHFEED_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError) as refused:
        create_server(ServerConfig(partition_dir=parts2, partition=0, listen="0.0.0.0:0",
                                   device="cpu"))
    for flag in ("--tls-cert", "--token-file", "--insecure", "0.0.0.0:0"):
        assert flag in str(refused.value)
    code = cli.main(["--partition-dir", str(parts2), "--partition", "0", "--listen", "0.0.0.0:0",
                     "--device", "cpu"])
    assert code == 2 and "--insecure" in capsys.readouterr().err


def test_the_refusal_shows_the_command_that_makes_a_token_and_its_token_starts_the_server(
    parts2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("GRAPHFEED_TOKEN", "GRAPHFEED_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    config = ServerConfig(partition_dir=parts2, partition=0, listen="0.0.0.0:0", device="cpu")
    with pytest.raises(ConfigError) as refused:
        create_server(config)
    shown = re.search(r"`python (-m protos\.security new-token) FILE`", str(refused.value))
    assert shown is not None, refused.value
    token_file = tmp_path / "cluster.token"
    subprocess.run([sys.executable, *shown.group(1).split(), str(token_file)], cwd=REPO, check=True,
                   capture_output=True, timeout=120)
    assert token_file.stat().st_mode & 0o777 == 0o600
    server, port = create_server(dataclasses.replace(config, token_file=token_file))
    server.stop(None).wait(10)
    assert port > 0


def test_a_trainer_without_the_token_is_told_the_flag_that_gives_it(
    parts1: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from trainer_client.train import main

    for name in ("GRAPHFEED_TOKEN", "GRAPHFEED_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    with _token_server(parts1, tmp_path, "127.0.0.1:0") as port, caplog.at_level(logging.ERROR):
        assert main(["--servers", f"127.0.0.1:{port}", "--device", "cpu", "--timeout", "30"]) == 1
    assert re.search(r"UNAUTHENTICATED: .*--token-file FILE", caplog.text), caplog.text


@pytest.mark.parametrize("credentials", ["token", "mutual TLS", "insecure"])
def test_a_server_beyond_loopback_starts_with_credentials_or_when_told_insecure(
    parts2: Path, certs: Certs, tmp_path: Path, credentials: str
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    settings: dict[str, object] = {
        "token": {"token_file": token_file},
        "mutual TLS": {"tls_cert": certs.server[0], "tls_key": certs.server[1], "tls_ca": certs.ca},
        "insecure": {"insecure": True},
    }[credentials]
    server, port = create_server(ServerConfig(partition_dir=parts2, partition=0, device="cpu",
                                              listen="0.0.0.0:0", **settings))  # type: ignore[arg-type]
    server.stop(None).wait(10)
    assert port > 0


@contextlib.contextmanager
def _token_server(partition_dir: Path, tmp_path: Path, listen: str) -> Iterator[int]:
    """A serving server of partition 0 that requires :data:`TOKEN` of every caller; its port."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    server, port = create_server(ServerConfig(partition_dir=partition_dir, partition=0, device="cpu",
                                              listen=listen, token_file=token_file))
    server.start()
    try:
        assert server.wait_until_serving(30)
        yield port
    finally:
        server.stop(None).wait(10)


def test_a_stranger_gets_unauthenticated_from_a_server_on_every_interface(
    parts1: Path, tmp_path: Path
) -> None:
    with _token_server(parts1, tmp_path, "0.0.0.0:0") as port, \
            create_channel(f"127.0.0.1:{port}", security=Security()) as channel:
        assert _calls(channel) == [UNAUTHENTICATED] * 6


def test_fair_shares_count_a_mutual_tls_caller_by_its_certificate(
    mtls_servers: tuple[list[SamplingServer], list[str]], certs: Certs
) -> None:
    servers, addresses = mtls_servers
    security = Security(ca=certs.ca, cert=certs.client[0], key=certs.client[1], token=TOKEN)
    with create_channel(addresses[0], security=security) as channel:
        held = stream_minibatches(channel, pb.EpochRequest(
            split="test", fanouts=[-1, -1], batch_size=1, world_size=1, include_features=True,
            client_id="rank-0"), timeout=30)
        next(held)
        page = generate_latest(servers[0].metrics.registry).decode()
        held.cancel()
    assert 'graphfeed_client_streams{client="tls:client/rank-0",partition="0"} 1.0' in page
