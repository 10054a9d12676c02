"""TLS and mTLS: secured clients get through, plaintext and certificate-less clients do not, and a
rotated certificate is served to new connections without a restart."""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvous.cli import _config_from, build_parser, main
from rendezvous.clients import NO_RETRY, AsyncRendezvousClient, ClientConfig, TLSConfig
from rendezvous.clients.testing import TestServer
from rendezvous.server import CallLimits, RendezvousServer, ServerConfig
from rendezvous.server import TLSConfig as ServerTLS
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.security.certs import CertificateAuthority, Pair
from tests.security.conftest import serving


async def status_over(address: str, credentials: grpc.ChannelCredentials | None) -> pb.GetStatusResponse:
    channel = grpc.aio.secure_channel(address, credentials) if credentials else grpc.aio.insecure_channel(address)
    async with channel:
        status: pb.GetStatusResponse = await pb_grpc.RendezvousServiceStub(channel).GetStatus(
            pb.GetStatusRequest(), timeout=10
        )
        return status


async def test_a_tls_client_reaches_a_tls_server(server_files: tuple[str, str], ca: CertificateAuthority) -> None:
    async with serving(tls=ServerTLS(*server_files)) as server:
        config = ClientConfig(server.address, tls=TLSConfig(ca=ca.pem), retry=NO_RETRY)
        async with AsyncRendezvousClient(config) as client:
            status = await client.get_status(timeout=10)
    assert status.store == "memory"


async def test_a_plaintext_client_is_refused_by_a_tls_server(server_files: tuple[str, str]) -> None:
    async with serving(tls=ServerTLS(*server_files)) as server:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await status_over(server.address, None)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mtls_refuses_a_client_without_a_certificate(
    server_files: tuple[str, str], ca: CertificateAuthority
) -> None:
    async with serving(tls=ServerTLS(*server_files, client_ca=ca.pem, require_client_cert=True)) as server:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await status_over(server.address, grpc.ssl_channel_credentials(ca.pem.encode()))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mtls_refuses_a_certificate_from_another_ca(
    server_files: tuple[str, str], ca: CertificateAuthority
) -> None:
    stranger = CertificateAuthority("stranger").issue("decode-0")
    async with serving(tls=ServerTLS(*server_files, client_ca=ca.pem, require_client_cert=True)) as server:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await status_over(server.address, TLSConfig(ca.pem, stranger.cert, stranger.key).credentials())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_mtls_admits_a_client_certificate_given_as_pem(server_pair: Pair, ca: CertificateAuthority) -> None:
    client = ca.issue("decode-0")
    tls = ServerTLS(server_pair.cert, server_pair.key, client_ca=ca.pem, require_client_cert=True)
    async with serving(tls=tls) as server:
        status = await status_over(server.address, TLSConfig(ca.pem, client.cert, client.key).credentials())
    assert status.store == "memory"


async def test_a_rotated_certificate_is_served_to_new_connections_without_restart(
    tmp_path: Path, server_files: tuple[str, str], ca: CertificateAuthority
) -> None:
    cert_path, key_path = server_files
    new_ca = CertificateAuthority("rotated-ca")
    async with serving(tls=ServerTLS(cert_path, key_path)) as server:
        assert (await status_over(server.address, grpc.ssl_channel_credentials(ca.pem.encode()))).store
        rotated = new_ca.issue("kv-rendezvous", server=True)
        rotated.write(tmp_path, "server")
        for path in (cert_path, key_path):  # a distinct mtime, however coarse the filesystem's clock
            stat = os.stat(path)
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        status = await status_over(server.address, grpc.ssl_channel_credentials(new_ca.pem.encode()))
        assert status.store == "memory"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await status_over(server.address, grpc.ssl_channel_credentials(ca.pem.encode()))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert server.certificates is not None and server.certificates.loads == 2


def test_client_tls_config_reads_files_and_pem(tmp_path: Path, ca: CertificateAuthority) -> None:
    pair = ca.issue("decode-0")
    cert, key = pair.write(tmp_path, "client")
    assert TLSConfig(ca=ca.pem, cert=cert, key=key).credentials() is not None
    with pytest.raises(ValueError, match="key"):
        TLSConfig(ca=ca.pem, cert=cert)
    with pytest.raises(ValueError, match="not both"):
        ClientConfig("127.0.0.1:1", tls=TLSConfig(), credentials=grpc.ssl_channel_credentials())


def test_client_ca_and_require_client_cert_go_together(server_pair: Pair, ca: CertificateAuthority) -> None:
    with pytest.raises(ValueError, match="client_ca"):
        ServerTLS(server_pair.cert, server_pair.key, require_client_cert=True)
    with pytest.raises(ValueError, match="require_client_cert"):
        ServerTLS(server_pair.cert, server_pair.key, client_ca=ca.pem)


async def test_the_health_port_answers_probes_in_plaintext_beside_a_tls_port(server_files: tuple[str, str]) -> None:
    server = RendezvousServer(
        ServerConfig(listen="127.0.0.1:0", tls=ServerTLS(*server_files), health_listen="127.0.0.1:0", grace=0.1)
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
            check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:  # the health port serves nothing else
                await pb_grpc.RendezvousServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(0)


def test_the_cli_checks_health_and_status_over_tls_with_a_token(
    tmp_path: Path, server_files: tuple[str, str], ca: CertificateAuthority, capsys: pytest.CaptureFixture[str]
) -> None:
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"tokens": {"tok-ops-91ab-5c7e2d": {"roles": ["router"]}}}))
    ca_file = tmp_path / "ca.crt"
    ca_file.write_text(ca.pem)
    with TestServer(tls=ServerTLS(*server_files), auth_file=str(auth)) as server:
        common = ["--address", server.address, "--ca", str(ca_file)]
        assert main(["health", *common]) == 0
        assert main(["status", *common, "--token", "tok-ops-91ab-5c7e2d"]) == 0
        assert main(["status", *common]) == 1
    out = capsys.readouterr()
    assert "SERVING" in out.out and "memory" in out.out
    assert "UNAUTHENTICATED" in out.err


async def test_liveness_stays_serving_while_readiness_reports_draining() -> None:
    server = RendezvousServer(ServerConfig(listen="127.0.0.1:0", health_listen="127.0.0.1:0", grace=0.1))
    await server.start()
    try:
        await server._set_serving(False)  # what a store outage or a drain does
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            ready = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            alive = await health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=10)
        assert ready.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert alive.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)


def test_serve_flags_configure_tls_auth_and_quotas() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--tls-cert=c.pem",
            "--tls-key=k.pem",
            "--tls-client-ca=ca.pem",
            "--tls-require-client-cert",
            "--auth-file=auth.json",
            "--rate-limit=50",
            "--rate-burst=100",
            "--max-concurrent-calls=8",
            "--health-listen=0.0.0.0:8080",
        ]
    )
    config = _config_from(args)
    assert config.tls == ServerTLS("c.pem", "k.pem", "ca.pem", require_client_cert=True)
    assert config.auth_file == "auth.json" and config.health_listen == "0.0.0.0:8080"
    assert config.call_limits == CallLimits(rate=50, burst=100, concurrency=8)


@pytest.mark.parametrize(
    "flags",
    [["--tls-cert=c.pem"], ["--tls-cert=c.pem", "--tls-key=k.pem", "--tls-client-ca=ca.pem"], ["--tls-key=k.pem"]],
)
def test_incomplete_tls_flags_are_refused(flags: list[str]) -> None:
    with pytest.raises(ValueError):
        _config_from(build_parser().parse_args(["serve", *flags]))
