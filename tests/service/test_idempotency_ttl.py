"""`kv-rendezvous serve --idempotency-ttl`: how long a request_id's answer is kept for its retries."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import grpc
import pytest

from rendezvous.cli import _config_from, build_parser
from rendezvous.clients.testing import FakeClock
from rendezvous.server import RendezvousServer, ServerConfig
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.service.conftest import engine_request


def test_the_flag_and_its_variable_set_the_servers_idempotency_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _config_from(build_parser().parse_args(["serve"])).idempotency_ttl == 600.0
    assert _config_from(build_parser().parse_args(["serve", "--idempotency-ttl", "30"])).idempotency_ttl == 30.0
    monkeypatch.setenv("KV_RENDEZVOUS_IDEMPOTENCY_TTL", "45.5")
    assert _config_from(build_parser().parse_args(["serve"])).idempotency_ttl == 45.5


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_an_idempotency_ttl_that_is_not_a_positive_number_of_seconds_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="--idempotency-ttl must be a positive number of seconds"):
        _config_from(build_parser().parse_args(["serve", f"--idempotency-ttl={value}"]))
    with pytest.raises(ValueError, match="idempotency_ttl"):
        ServerConfig(idempotency_ttl=float(value))


def test_the_cli_reports_a_bad_idempotency_ttl_and_exits_2() -> None:
    cli = [sys.executable, "-m", "rendezvous.cli"]
    bad = subprocess.run(
        [*cli, "serve", "--idempotency-ttl", "0", "--listen", "127.0.0.1:0", "--metrics-listen", "off"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "kv-rendezvous: --idempotency-ttl must be a positive number of seconds, not 0" in bad.stderr


async def test_a_retry_after_the_idempotency_ttl_is_answered_afresh(server_config: ServerConfig) -> None:
    clock = FakeClock()
    server = RendezvousServer(replace(server_config, idempotency_ttl=0.3), clock)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.RendezvousServiceStub(channel)
            await stub.RegisterEngine(engine_request("d1", pb.ENGINE_ROLE_CONSUMER))
            await stub.RegisterEngine(engine_request("p1", pb.ENGINE_ROLE_PRODUCER))
            claim = pb.ClaimTransfersRequest(request_id="r-1", engine_id="p1", claims=[pb.ClaimSpec(transfer_id="t1")])
            first = await stub.ClaimTransfers(claim)
            assert first.results[0].state == pb.TRANSFER_STATE_CLAIMED
            await stub.AbortTransfers(pb.AbortTransfersRequest(aborts=[pb.AbortSpec(transfer_id="t1")]))
            assert await stub.ClaimTransfers(claim) == first  # within the TTL: the first answer
            clock.advance(0.29)
            assert await stub.ClaimTransfers(claim) == first  # still within it
            clock.advance(0.02)
            again = await stub.ClaimTransfers(claim)  # past it: the request runs again
            assert again.results[0].state == pb.TRANSFER_STATE_ABORTED
    finally:
        await server.stop(0)
