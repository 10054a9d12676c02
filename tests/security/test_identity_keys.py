"""What an identity is charged under is its token, not its name (issue 24, item 6: renaming an identity reset its
budget): the memory budget and the call rate survive a rename in the auth file, on memory and Redis."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rendezvous.core import Limits
from rendezvous.server import CallLimits, RendezvousServer
from rendezvous.v1 import rendezvous_pb2 as pb
from tests.redis_fixtures import redis_url, store
from tests.security.conftest import serving
from tests.security.test_auth import auth_file, call, refusal, request_for

__all__ = ["redis_url", "store"]

TOKEN = "tok-keys-decode-4e8a0d7c"
ENTRY = {"name": "decode", "engines": ["decode-*"], "engine_roles": ["consumer"], "engine_pools": ["decode"]}
AUTH: dict[str, Any] = {"tokens": {TOKEN: ENTRY}}
RENAMED: dict[str, Any] = {"tokens": {TOKEN: {**ENTRY, "name": "decode-renamed"}}}
EXHAUSTED = (grpc.StatusCode.RESOURCE_EXHAUSTED, "BUDGET_EXHAUSTED")
RATE_LIMITED = (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED")


def rename(server: RendezvousServer) -> None:
    assert server.auth is not None
    Path(server.auth.path).write_text(json.dumps(RENAMED))
    assert server.auth.reload()


def registration(engine_id: str) -> pb.RegisterEngineRequest:
    request: pb.RegisterEngineRequest = request_for("RegisterEngine", engine_id)
    request.pool = "decode"
    return request


@pytest.fixture
async def channel_and_server(
    tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[grpc.aio.Channel, RendezvousServer]]:
    config: dict[str, Any] = getattr(request, "param", {})
    async with (
        serving(auth_file=auth_file(tmp_path, AUTH), store=store, **config) as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        yield channel, server


@pytest.mark.parametrize("channel_and_server", [{"limits": Limits(max_engines_per_identity=2)}], indirect=True)
async def test_a_renamed_identity_keeps_its_memory_budget(
    channel_and_server: tuple[grpc.aio.Channel, RendezvousServer],
) -> None:
    channel, server = channel_and_server
    for engine_id in ("decode-0", "decode-1"):
        await call(channel, "RegisterEngine", registration(engine_id), TOKEN)
    rename(server)
    assert await refusal(call(channel, "RegisterEngine", registration("decode-2"), TOKEN)) == EXHAUSTED


@pytest.mark.parametrize("channel_and_server", [{"call_limits": CallLimits(rate=0.001, burst=3)}], indirect=True)
async def test_a_renamed_identity_keeps_its_call_rate(
    channel_and_server: tuple[grpc.aio.Channel, RendezvousServer],
) -> None:
    channel, server = channel_and_server
    for _ in range(3):
        await call(channel, "RegisterEngine", registration("decode-0"), TOKEN)
    rename(server)
    assert await refusal(call(channel, "RegisterEngine", registration("decode-0"), TOKEN)) == RATE_LIMITED
