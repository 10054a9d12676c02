"""The in-process test harness that engine authors use."""

from __future__ import annotations

import pytest

from clients import AsyncRendezvousClient, EngineRole, EngineSpec, NotFound
from clients.testing import AsyncTestServer, TestServer, stand_in_agent, start_test_server
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


def test_the_harness_chooses_its_own_address() -> None:
    with pytest.raises(ValueError):
        AsyncTestServer(listen="0.0.0.0:1")
    with pytest.raises(ValueError):
        TestServer(listen="0.0.0.0:1")


def test_a_stopped_sync_server_refuses_to_restart() -> None:
    server = TestServer()
    with pytest.raises(RuntimeError):
        server.restart()
