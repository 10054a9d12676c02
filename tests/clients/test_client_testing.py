"""The in-process test harness that engine authors use."""

from __future__ import annotations

import pytest

from rendezvous.clients import AsyncRendezvousClient, EngineRole, EngineSpec, NotFound, RendezvousClient
from rendezvous.clients.testing import AsyncTestServer, FakeClock, TestServer, stand_in_agent, start_test_server
from rendezvous.core.limits import Timeouts


async def test_a_restart_keeps_the_address_and_forgets_everything() -> None:
    async with start_test_server() as server, AsyncRendezvousClient(server.address) as client:
        await client.register_engine(EngineSpec("d0", "decode", EngineRole.CONSUMER, agents=(stand_in_agent("d0"),)))
        address, epoch = server.address, server.epoch
        await server.restart()
        assert server.address == address and server.epoch != epoch
        with pytest.raises(NotFound):
            await client.get_engine("d0")


async def test_server_settings_reach_the_server() -> None:
    async with start_test_server(timeouts=Timeouts(default_lease_ttl=7.0)) as server:
        async with AsyncRendezvousClient(server.address) as client:
            registration = await client.register_engine(
                EngineSpec("d0", "decode", EngineRole.CONSUMER, agents=(stand_in_agent("d0"),))
            )
        assert registration.engine.lease_ttl == 7.0
        assert server.address.startswith("127.0.0.1:") and server.port > 0


async def test_a_lease_lapses_when_the_fake_clock_passes_it_and_the_server_sweeps() -> None:
    clock = FakeClock()
    async with start_test_server(clock) as server, AsyncRendezvousClient(server.address) as client:
        spec = EngineSpec("d0", "decode", EngineRole.CONSUMER, agents=(stand_in_agent("d0"),), lease_ttl=2.0)
        await client.register_engine(spec)  # and never renewed
        clock.advance(1.9)
        await server.sweep()
        assert (await client.get_engine("d0")).engine_id == "d0"  # not yet
        clock.advance(0.2)
        await server.sweep()
        with pytest.raises(NotFound):
            await client.get_engine("d0")


def test_the_sync_server_sweeps_by_its_fake_clock_too() -> None:
    clock = FakeClock(start=1_000.0)
    with TestServer(clock) as server, RendezvousClient(server.address) as client:
        client.register_engine(
            EngineSpec("d0", "decode", EngineRole.CONSUMER, agents=(stand_in_agent("d0"),), lease_ttl=2.0)
        )
        clock.advance(2.1)
        server.sweep()
        with pytest.raises(NotFound):
            client.get_engine("d0")


def test_a_fake_clock_only_moves_forward() -> None:
    clock = FakeClock(start=5.0)
    clock.advance(0.5)
    assert clock() == 5.5
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError):
            clock.advance(bad)


def test_the_harness_chooses_its_own_address() -> None:
    with pytest.raises(ValueError):
        AsyncTestServer(listen="0.0.0.0:1")
    with pytest.raises(ValueError):
        TestServer(listen="0.0.0.0:1")


def test_a_stopped_sync_server_refuses_to_restart() -> None:
    server = TestServer()
    with pytest.raises(RuntimeError):
        server.restart()
