"""`Engine.lease_remaining`: what is left of an engine's lease as the server answers, by the clock that lapses it (the
fence of a rank that follows another's registration, whose clock is not the server's); and GetEngine's view.
Real server on 127.0.0.1, memory and Redis stores; the server's time is a fake clock the tests move."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from rendezvous.clients import (
    AsyncRendezvousClient,
    ClaimSpec,
    EngineRole,
    EngineView,
    EventType,
    TargetSpec,
)
from rendezvous.clients.testing import AsyncTestServer, FakeClock, start_test_server
from rendezvous.core import Timeouts
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.factories import sdk_engine
from tests.redis_fixtures import redis_url, store
from tests.service.test_service import expect_error

__all__ = ["redis_url", "store"]  # the fixtures

TTL = 10.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def server(store: str, clock: FakeClock) -> AsyncIterator[AsyncTestServer]:
    async with start_test_server(clock, store=store, timeouts=Timeouts(default_lease_ttl=TTL)) as srv:
        yield srv


@pytest.fixture
async def client(server: AsyncTestServer) -> AsyncIterator[AsyncRendezvousClient]:
    async with AsyncRendezvousClient(server.address) as c:
        yield c


async def test_every_answer_says_what_is_left_of_the_lease_by_the_server_s_clock(
    client: AsyncRendezvousClient, clock: FakeClock
) -> None:
    registered = await client.register_engine(sdk_engine("d0", EngineRole.CONSUMER, labels={"zone": "a"}))
    assert registered.engine.lease_remaining == pytest.approx(TTL)
    clock.advance(3)
    assert (await client.get_engine("d0")).lease_remaining == pytest.approx(TTL - 3)
    for view in EngineView.BASIC, EngineView.PLACEMENT, EngineView.FULL:
        (listed,) = await client.list_engines(view=view)
        assert listed.lease_remaining == pytest.approx(TTL - 3)
    async with client.keep_alive() as stream:
        await stream.renew("d0", registered.engine.incarnation)
    clock.advance(1)
    assert (await client.get_engine("d0", view=EngineView.BASIC)).lease_remaining == pytest.approx(TTL - 1)


async def test_get_engine_s_basic_view_leaves_out_the_agents_metadata_and_the_labels(
    client: AsyncRendezvousClient,
) -> None:
    await client.register_engine(sdk_engine("d0", EngineRole.CONSUMER, labels={"zone": "a"}))
    full = await client.get_engine("d0")
    assert full.agents[0].metadata and full.labels == {"zone": "a"}
    basic = await client.get_engine("d0", view=EngineView.BASIC)
    assert basic.agents[0].metadata == b"" and basic.labels == {}
    assert basic.agents[0].name == full.agents[0].name and basic.incarnation == full.incarnation
    placement = await client.get_engine("d0", view=EngineView.PLACEMENT)
    assert placement.agents[0].metadata == b"" and placement.labels == {"zone": "a"}


async def test_get_engine_refuses_a_view_it_does_not_know(server: AsyncTestServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.RendezvousServiceStub(channel)
        request = pb.GetEngineRequest(engine_id="d0", view=99)  # type: ignore[arg-type]
        await expect_error(stub.GetEngine(request), grpc.StatusCode.INVALID_ARGUMENT, "VIEW_INVALID")


async def test_an_event_s_peer_says_nothing_of_its_lease(client: AsyncRendezvousClient) -> None:
    """An event's peer is the record of when the event happened, delivered any time later: what was left of the
    lease then is no bound now, so it is not said."""
    await client.register_engine(sdk_engine("d0", EngineRole.CONSUMER))
    producer = await client.register_engine(sdk_engine("p0", EngineRole.PRODUCER))
    await client.register_target("d0", TargetSpec("t1", [1]))
    await client.claim_transfer("p0", ClaimSpec("t1"))
    async with client.watch("p0", producer.watch_start_sequence) as stream:
        async for batch in stream:
            assigned = [e for e in batch.events if e.type is EventType.TRANSFER_ASSIGNED]
            if assigned:
                break
    assert assigned[0].peer is not None and assigned[0].peer.engine_id == "d0"
    assert assigned[0].peer.lease_remaining is None
