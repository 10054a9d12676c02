"""The SDK pages ListEngines: `iter_engines` page after page, and `list_engines` (and the router) as before,
over as many pages as the server cuts."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from rendezvous.clients import AsyncRendezvousClient, EngineRole, EngineSpec, EngineView, RendezvousClient, RouterClient
from rendezvous.clients.testing import TestServer, start_test_server
from rendezvous.core.limits import Limits
from tests.clients.conftest import client_config
from tests.factories import sdk_engine

LIMITS = Limits(default_engine_page=2, max_engine_page=3)
IDS = [f"d{i}" for i in range(7)]


def spec(engine_id: str) -> EngineSpec:
    return sdk_engine(engine_id, EngineRole.CONSUMER, labels={"zone": "a"})


@pytest.fixture
async def client() -> AsyncIterator[AsyncRendezvousClient]:
    async with (
        start_test_server(limits=LIMITS, grace=0.1) as server,
        AsyncRendezvousClient(client_config(server.address)) as c,
    ):
        for engine_id in reversed(IDS):
            await c.register_engine(spec(engine_id))
        yield c


async def test_iter_engines_asks_page_after_page_in_a_view(client: AsyncRendezvousClient) -> None:
    with_labels = [e async for e in client.iter_engines(page_size=3)]
    assert [e.engine_id for e in with_labels] == IDS and with_labels[-1].labels == {"zone": "a"}
    without = [e async for e in client.iter_engines("decode", EngineRole.CONSUMER, view=EngineView.BASIC)]
    assert [e.engine_id for e in without] == IDS and all(e.labels == {} for e in without)
    assert without[0].agents[0].metadata == b"" != with_labels[0].agents[0].metadata


async def test_list_engines_goes_through_every_page(client: AsyncRendezvousClient) -> None:
    # 7 engines: 4 pages of the server's default page size (2).
    assert [e.engine_id for e in await client.list_engines(role=EngineRole.CONSUMER)] == IDS


async def test_the_router_picks_among_the_engines_of_every_page(client: AsyncRendezvousClient) -> None:
    router = RouterClient(client)
    assert [e.engine_id for e in await router.list_engines("decode", EngineRole.CONSUMER)] == IDS
    picked = {(await router.pick_engine("decode", EngineRole.CONSUMER)).engine_id for _ in IDS}
    assert picked == set(IDS)


@pytest.fixture
def sync_client() -> Iterator[RendezvousClient]:
    with TestServer(limits=LIMITS, grace=0.1) as server, RendezvousClient(client_config(server.address)) as c:
        for engine_id in reversed(IDS):
            c.register_engine(spec(engine_id))
        yield c


def test_the_blocking_client_pages_the_same_way(sync_client: RendezvousClient) -> None:
    slim = list(sync_client.iter_engines(page_size=3, view=EngineView.PLACEMENT))
    assert [e.engine_id for e in slim] == IDS and slim[0].agents[0].metadata == b""
    assert [e.engine_id for e in sync_client.list_engines("decode", view=EngineView.BASIC)] == IDS
