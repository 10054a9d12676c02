"""Who may use the KV index with auth on: only an engine's own identity (by id or pool) reports for it; any
authenticated identity queries; a caller without a known token does neither."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from rendezvous.clients import (
    AsyncRendezvousClient,
    BlockHashing,
    BlocksStored,
    CacheReport,
    CacheSnapshot,
    ClientConfig,
    PrefixQuery,
    RendezvousError,
)
from rendezvous.server import RendezvousServer
from tests.security.conftest import serving
from tests.security.test_auth import ADMIN, DECODE, POOL, PREFILL, ROUTER, auth_file, register

HASHING = BlockHashing("sha256", "0", 16)
CHAIN = (b"a" * 32, b"b" * 32)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RendezvousServer]:
    async with serving(auth_file=auth_file(tmp_path)) as srv:
        async with grpc.aio.insecure_channel(srv.address) as channel:
            await register(channel, "prefill-0", PREFILL)
            await register(channel, "prefill-7", POOL)
        yield srv


def client(server: RendezvousServer, token: str) -> AsyncRendezvousClient:
    return AsyncRendezvousClient(ClientConfig(server.address, token=token))


def report(engine_id: str) -> CacheReport:
    return CacheReport(engine_id, 0, (BlocksStored(CHAIN),), HASHING)


async def refused(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(RendezvousError) as caught:
        await call  # type: ignore[misc]
    return caught.value.code, caught.value.reason


async def test_an_engine_identity_reports_for_its_own_engines_only(server: RendezvousServer) -> None:
    async with client(server, PREFILL) as own, client(server, DECODE) as other:
        assert (await own.report_cache_events(report("prefill-0"))).block_count == 2
        denied = (grpc.StatusCode.PERMISSION_DENIED, "IDENTITY_MISMATCH")
        assert await refused(other.report_cache_events(report("prefill-0"))) == denied
        assert await refused(own.report_cache_events(report("prefill-7"))) == denied
        snapshot = CacheSnapshot("prefill-0", 1, HASHING, ((0, CHAIN[:1]),))
        assert await refused(other.replace_cached_blocks(snapshot)) == denied


async def test_a_pool_identity_reports_for_the_engines_of_its_pools(server: RendezvousServer) -> None:
    async with client(server, POOL) as pool:
        assert (await pool.report_cache_events(report("prefill-7"))).sequence == 0


async def test_a_router_may_query_but_not_report(server: RendezvousServer) -> None:
    async with client(server, PREFILL) as own, client(server, ROUTER) as router:
        await own.report_cache_events(report("prefill-0"))
        [match] = await router.match_prefixes(PrefixQuery(CHAIN))
        assert (match.engine_id, match.matched_blocks) == ("prefill-0", 2)
        assert await refused(router.report_cache_events(report("prefill-0"))) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "IDENTITY_MISMATCH",
        )


@pytest.mark.parametrize("token", [DECODE, ADMIN])
async def test_any_identity_may_query(server: RendezvousServer, token: str) -> None:
    async with client(server, token) as caller:
        assert await caller.match_prefixes(PrefixQuery(CHAIN)) == []


async def test_a_caller_without_a_known_token_may_not_query(server: RendezvousServer) -> None:
    async with client(server, "not-a-known-token") as stranger:
        assert await refused(stranger.match_prefixes(PrefixQuery(CHAIN))) == (
            grpc.StatusCode.UNAUTHENTICATED,
            "UNAUTHENTICATED_TOKEN",
        )
