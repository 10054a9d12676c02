"""The memory budget (issue 17, item 3): caps on live engines, live block ids and agent metadata bytes, over
the whole server and per identity, on a real server over gRPC, with the memory and the Redis store.

Each cap refuses with RESOURCE_EXHAUSTED / BUDGET_EXHAUSTED (ErrorInfo metadata budget, scope, limit), leaves
every other engine's and transfer's state as it was and the server SERVING; releasing, aborting, deregistering
and expiring give the budget back; an ended engine (tombstone) keeps no agent metadata.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.clients.testing import FakeClock
from rendezvous.core import Limits, Timeouts
from rendezvous.server import RendezvousServer
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.factories import proto_agent, proto_engine
from tests.redis_fixtures import fresh_prefix, redis_url, with_prefix
from tests.security.conftest import serving
from tests.security.test_auth import auth_file, bearer

__all__ = ["redis_url"]

D0 = "tok-budget-d0-5c1e99a7"
D1 = "tok-budget-d1-0b4f2e61"
P0 = "tok-budget-p0-7d93aa10"
ADMIN = "tok-budget-admin-f1c2"
AUTH = {
    "tokens": {
        D0: {"name": "d0", "engines": ["d0", "d0-*"]},
        D1: {"name": "d1", "engines": ["d1", "d1-*"]},
        P0: {"name": "p0", "engines": ["p0", "p0-*"]},
        ADMIN + "-0123456789": {"name": "ops", "roles": ["admin"]},
    }
}
OPS = ADMIN + "-0123456789"
TOKENS = {"d0": D0, "d1": D1, "p0": P0}
EXHAUSTED = (grpc.StatusCode.RESOURCE_EXHAUSTED, "BUDGET_EXHAUSTED")

LIMITS = Limits(
    max_engines=6,
    max_engines_per_identity=3,
    max_live_blocks=300,
    max_live_blocks_per_identity=200,
    max_agent_metadata_bytes_total=10_000,
    max_agent_metadata_bytes_per_identity=6_000,
)


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def store_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory"
    return with_prefix(request.getfixturevalue("redis_url"), fresh_prefix())


@dataclass
class Client:
    stub: pb_grpc.RendezvousServiceStub
    health: health_pb2_grpc.HealthStub
    server: RendezvousServer

    async def call(self, method: str, request: Any, who: str | None) -> Any:
        token = TOKENS.get(who or "", OPS if who == "ops" else None)
        return await getattr(self.stub, method)(request, metadata=bearer(token) if token else None, timeout=10)

    async def register(self, engine_id: str, who: str | None, metadata: int = 8, consumer: bool = True) -> Any:
        return (await self.call("RegisterEngine", registration(engine_id, metadata, consumer), who)).engine

    async def target(self, engine: Any, transfer_id: str, blocks: int, who: str | None, timeout: float = 0) -> Any:
        request = pb.RegisterTargetsRequest(engine_id=engine.engine_id, incarnation=engine.incarnation)
        spec = request.targets.add(transfer_id=transfer_id, block_ids=range(blocks), generation=1)
        if timeout:
            spec.timeout.FromMilliseconds(int(timeout * 1000))
        return await self.call("RegisterTargets", request, who)

    def owner(self, who: str) -> str:
        """The key an identity's memory is charged under (policy.Identity.key)."""
        assert self.server.auth is not None
        identity = self.server.auth.by_token(TOKENS[who])
        assert identity is not None
        return identity.key

    async def serving(self) -> bool:
        reply = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def registration(engine_id: str, metadata: int, consumer: bool = True) -> pb.RegisterEngineRequest:
    """The test engine with 1024 blocks and `metadata` bytes of agent metadata."""
    role = pb.ENGINE_ROLE_CONSUMER if consumer else pb.ENGINE_ROLE_PRODUCER
    return proto_engine(engine_id, role, agents=[proto_agent(engine_id + "-0", 1024, b"m" * metadata)])


@contextlib.asynccontextmanager
async def client(
    store_url: str, tmp_path: Path | None, limits: Limits = LIMITS, **config: Any
) -> AsyncIterator[Client]:
    if tmp_path is not None:
        config["auth_file"] = auth_file(tmp_path, AUTH)
    async with (
        serving(store=store_url, limits=limits, sweep_interval=0.05, **config) as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        yield Client(pb_grpc.RendezvousServiceStub(channel), health_pb2_grpc.HealthStub(channel), server)


async def refused(coro: Any) -> tuple[tuple[grpc.StatusCode, str], dict[str, str]]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    converted = from_rpc_error(err.value)
    return (converted.code, converted.reason), converted.metadata


def item_error(response: Any) -> tuple[tuple[grpc.StatusCode, str], dict[str, str]] | None:
    """The error of a batch's only item, as (code, reason), metadata; None when it went through."""
    (result,) = response.results
    return status_error(result.status)


def status_error(status: Any) -> tuple[tuple[grpc.StatusCode, str], dict[str, str]] | None:
    if status.code == 0:
        return None
    info = error_details_pb2.ErrorInfo()
    assert any(detail.Unpack(info) for detail in status.details)
    code = next(c for c in grpc.StatusCode if c.value[0] == status.code)
    return (code, info.reason), dict(info.metadata)


async def engine_ids(c: Client) -> list[str]:
    page = await c.call("ListEngines", pb.ListEnginesRequest(view=pb.ENGINE_VIEW_PLACEMENT), "ops")
    return sorted(e.engine_id for e in page.engines)


async def test_the_engine_cap_of_an_identity_refuses_and_leaves_the_others(store_url: str, tmp_path: Path) -> None:
    async with client(store_url, tmp_path) as c:
        for n in range(3):
            await c.register(f"d0-{n}", "d0")
        error, meta = await refused(c.register("d0-3", "d0"))
        assert error == EXHAUSTED
        assert meta["budget"] == "engines" and meta["scope"] == "identity" and meta["limit"] == "3"
        # Re-registering one of its engines replaces it (no growth); another identity still registers.
        await c.register("d0-1", "d0")
        await c.register("d1-0", "d1")
        assert await engine_ids(c) == ["d0-0", "d0-1", "d0-2", "d1-0"]
        assert await c.serving()
        # Deregistering gives the engine back.
        first = await c.register("d0-0", "d0")
        await c.call(
            "DeregisterEngine", pb.DeregisterEngineRequest(engine_id="d0-0", incarnation=first.incarnation), "d0"
        )
        await c.register("d0-3", "d0")


async def test_the_server_engine_cap_refuses_every_identity(store_url: str, tmp_path: Path) -> None:
    async with client(store_url, tmp_path) as c:
        for who, n in (("d0", 3), ("d1", 3)):
            for i in range(n):
                await c.register(f"{who}-{i}", who)
        error, meta = await refused(c.register("p0-0", "p0", consumer=False))
        assert error == EXHAUSTED and meta["scope"] == "server" and meta["limit"] == "6"
        assert len(await engine_ids(c)) == 6
        assert await c.serving()


async def test_agent_metadata_budgets(store_url: str, tmp_path: Path) -> None:
    async with client(store_url, tmp_path) as c:
        await c.register("d0-0", "d0", metadata=4_000)
        error, meta = await refused(c.register("d0-1", "d0", metadata=2_001))
        assert error == EXHAUSTED
        assert meta == {"budget": "agent_metadata_bytes", "scope": "identity", "limit": "6000"}
        # A re-registration is charged what it adds over what it replaces.
        await c.register("d0-0", "d0", metadata=5_000)
        await c.register("d1-0", "d1", metadata=4_000)
        error, meta = await refused(c.register("d1-1", "d1", metadata=1_001))
        assert error == EXHAUSTED and meta["scope"] == "server" and meta["limit"] == "10000"
        got = await c.call("GetEngine", pb.GetEngineRequest(engine_id="d0-0"), "ops")
        assert len(got.engine.agents[0].metadata) == 5_000
        assert await engine_ids(c) == ["d0-0", "d1-0"]
        assert await c.serving()


async def test_live_block_budgets_refuse_the_item_and_free_on_abort(store_url: str, tmp_path: Path) -> None:
    async with client(store_url, tmp_path) as c:
        d0 = await c.register("d0-0", "d0")
        d1 = await c.register("d1-0", "d1")
        assert item_error(await c.target(d0, "t1", 150, "d0")) is None
        error = item_error(await c.target(d0, "t2", 51, "d0"))
        assert error is not None and error[0] == EXHAUSTED
        assert error[1] == {"budget": "live_blocks", "scope": "identity", "limit": "200"}
        # The refused item left nothing; the accepted one is as it was.
        t1 = await c.call("GetTransfer", pb.GetTransferRequest(transfer_id="t1"), "ops")
        assert len(t1.transfer.target_block_ids) == 150
        with pytest.raises(grpc.aio.AioRpcError):
            await c.call("GetTransfer", pb.GetTransferRequest(transfer_id="t2"), "ops")
        # The server's budget (300): d1 may take the 150 that d0 left, not one more.
        error = item_error(await c.target(d1, "t3", 151, "d1"))
        assert error is not None and error[0] == EXHAUSTED and error[1]["scope"] == "server"
        assert item_error(await c.target(d1, "t3", 150, "d1")) is None
        assert await c.serving()
        # Aborting gives the blocks back.
        abort = pb.AbortTransfersRequest(engine_id="d0-0", incarnation=d0.incarnation)
        abort.aborts.add(transfer_id="t1")
        await c.call("AbortTransfers", abort, "d0")
        assert item_error(await c.target(d0, "t2", 100, "d0")) is None


async def test_a_batch_stops_at_the_budget(store_url: str, tmp_path: Path) -> None:
    async with client(store_url, tmp_path) as c:
        d0 = await c.register("d0-0", "d0")
        request = pb.RegisterTargetsRequest(engine_id="d0-0", incarnation=d0.incarnation)
        for n in range(4):
            request.targets.add(transfer_id=f"b{n}", block_ids=range(60), generation=1)
        response = await c.call("RegisterTargets", request, "d0")
        errors = [status_error(r.status) for r in response.results]
        assert errors[:3] == [None, None, None]
        assert errors[3] is not None and errors[3][0] == EXHAUSTED


async def test_expiry_frees_the_budget(store_url: str, tmp_path: Path) -> None:
    limits = Limits(max_engines=2, max_live_blocks=100)
    clock = FakeClock()
    async with client(store_url, None, limits=limits, timeouts=Timeouts(min_lease_ttl=0.2), clock=clock) as c:
        short = registration("e0", 8)
        short.lease_ttl.FromMilliseconds(300)
        await c.call("RegisterEngine", short, None)
        e1 = await c.register("e1", None)
        error, meta = await refused(c.register("e2", None))
        assert error == EXHAUSTED and meta["scope"] == "server"
        assert item_error(await c.target(e1, "t0", 100, None, timeout=0.3)) is None
        assert item_error(await c.target(e1, "t1", 1, None)) is not None
        # e0's lease and t0's deadline pass: the sweeper gives both back.
        clock.advance(0.31)
        await c.server.coordinator.sweep()
        usage = await c.server.coordinator.store.usage("")
        assert (usage.total.engines, usage.total.blocks, usage.total.metadata_bytes) == (1, 0, 8)
        # The engine whose lease ended lingers as a tombstone without its agent metadata.
        tomb = await c.server.coordinator.store.get_engine("e0")
        assert tomb is not None and tomb.ended_at and [a.metadata for a in tomb.agents] == [b""]
        await c.register("e2", None)
        assert item_error(await c.target(e1, "t1", 100, None)) is None


async def test_without_auth_only_the_server_budgets_apply(store_url: str) -> None:
    async with client(store_url, None) as c:
        for n in range(6):
            await c.register(f"d0-{n}", None)
        error, meta = await refused(c.register("d0-6", None))
        assert error == EXHAUSTED and meta["scope"] == "server"


async def test_a_tombstone_holds_no_agent_metadata(store_url: str, tmp_path: Path) -> None:
    async with client(store_url, tmp_path) as c:
        d0 = await c.register("d0-0", "d0", metadata=5_000)
        await c.call("DeregisterEngine", pb.DeregisterEngineRequest(engine_id="d0-0", incarnation=d0.incarnation), "d0")
        tomb = await c.server.coordinator.store.get_engine("d0-0")
        assert tomb is not None and tomb.ended_at
        assert [(a.name, a.metadata, a.regions) for a in tomb.agents] == [("d0-0-0", b"", ())]
        usage = await c.server.coordinator.store.usage("d0")
        assert usage.identity.engines == 0 and usage.identity.metadata_bytes == 0
        # The identity's whole metadata budget is free again.
        await c.register("d0-1", "d0", metadata=6_000)
