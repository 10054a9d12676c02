"""A real rendezvous server on a free loopback port, and a raw stub to talk to it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from rendezvous.core import Limits, Timeouts
from rendezvous.server import RendezvousServer, ServerConfig
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.factories import PROTO_LAYOUT as LAYOUT
from tests.factories import proto_agent as agent
from tests.factories import proto_engine as engine_request

__all__ = ["LAYOUT", "agent", "engine_request"]  # the raw-proto suites' names for tests/factories.py's builders


@pytest.fixture
def server_config() -> ServerConfig:
    return ServerConfig(
        listen="127.0.0.1:0",
        limits=Limits(max_events_per_engine=64, max_batch_items=128, max_watchers_per_engine=2),
        timeouts=Timeouts(default_lease_ttl=5),
        sweep_interval=0.02,
        grace=0.2,
    )


@pytest.fixture
async def server(server_config: ServerConfig) -> AsyncIterator[RendezvousServer]:
    srv = RendezvousServer(server_config)
    await srv.start()
    yield srv
    await srv.stop(0)


@pytest.fixture
async def stub(server: RendezvousServer) -> AsyncIterator[pb_grpc.RendezvousServiceStub]:
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield pb_grpc.RendezvousServiceStub(channel)
