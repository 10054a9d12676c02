"""The router helper: transfer ids, engine picking, aborts."""

from __future__ import annotations

import re

import pytest

from rendezvous.clients import (
    AbortReason,
    AsyncRendezvousClient,
    ClaimSpec,
    EngineRole,
    Event,
    EventType,
    NotFound,
    RouterClient,
    TargetSpec,
    TransferState,
    mint_transfer_id,
)
from rendezvous.clients._router import WAIT_AFTER_INTERVALS
from tests.clients.conftest import consumer_session, next_event, of_type, producer_session
from tests.factories import sdk_engine


async def register(client: AsyncRendezvousClient, engine_id: str, role: EngineRole) -> None:
    await client.register_engine(sdk_engine(engine_id, role))


def test_minted_transfer_ids_are_fresh_uuid_hex() -> None:
    ids = {mint_transfer_id() for _ in range(1000)} | {RouterClient.mint_transfer_id()}
    assert len(ids) == 1001
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)


async def test_engines_are_picked_round_robin_per_pool_and_role(client: AsyncRendezvousClient) -> None:
    for engine_id in ("p0", "p1"):
        await register(client, engine_id, EngineRole.PRODUCER)
    await register(client, "d0", EngineRole.CONSUMER)
    router = RouterClient(client)
    picked = [(await router.pick_engine("prefill", EngineRole.PRODUCER)).engine_id for _ in range(4)]
    assert picked == ["p0", "p1", "p0", "p1"]
    producer, consumer = await router.pick_pair("prefill", "decode")
    assert (producer.engine_id, consumer.engine_id) == ("p0", "d0")
    assert producer.agents[0].metadata == b""


async def test_an_empty_pool_raises_not_found(client: AsyncRendezvousClient) -> None:
    with pytest.raises(NotFound):
        await RouterClient(client).pick_engine("decode", EngineRole.CONSUMER)


async def test_engine_lists_are_cached_until_invalidated(client: AsyncRendezvousClient) -> None:
    await register(client, "d0", EngineRole.CONSUMER)
    router = RouterClient(client, refresh_interval=3600.0)
    assert (await router.pick_engine("decode", EngineRole.CONSUMER)).engine_id == "d0"
    await register(client, "d1", EngineRole.CONSUMER)
    assert [(await router.pick_engine("decode", EngineRole.CONSUMER)).engine_id for _ in range(2)] == ["d0", "d0"]
    router.invalidate()
    assert {(await router.pick_engine("decode", EngineRole.CONSUMER)).engine_id for _ in range(2)} == {"d0", "d1"}


async def test_a_stale_engine_list_is_used_while_it_is_refreshed_in_the_background(
    client: AsyncRendezvousClient,
) -> None:
    """A request does not wait for ListEngines once the router has a list: a stale one serves it and a refresh
    goes out behind it; only a list WAIT_AFTER_INTERVALS intervals old (an idle router's) is waited for."""
    now = [0.0]
    router = RouterClient(client, refresh_interval=1.0, clock=lambda: now[0])
    await register(client, "d0", EngineRole.CONSUMER)
    assert (await router.pick_engine("decode", EngineRole.CONSUMER)).engine_id == "d0"  # the first list: waited for
    await register(client, "d1", EngineRole.CONSUMER)
    now[0] = 1.5  # stale: d1 is not in the list that answers, but the refresh that starts now has it
    assert [e.engine_id for e in await router.rank_engines("decode", EngineRole.CONSUMER)] == ["d0"]
    await router.refreshed()
    assert {e.engine_id for e in await router.rank_engines("decode", EngineRole.CONSUMER)} == {"d0", "d1"}
    await register(client, "d2", EngineRole.CONSUMER)
    now[0] = 1.5 + WAIT_AFTER_INTERVALS * 1.0  # too old to use: waited for
    assert {e.engine_id for e in await router.rank_engines("decode", EngineRole.CONSUMER)} == {"d0", "d1", "d2"}


async def test_stopping_cancels_a_background_refresh(client: AsyncRendezvousClient) -> None:
    now = [0.0]
    router = RouterClient(client, refresh_interval=1.0, clock=lambda: now[0])
    await register(client, "d0", EngineRole.CONSUMER)
    await router.rank_engines("decode", EngineRole.CONSUMER)
    await register(client, "d1", EngineRole.CONSUMER)
    now[0] = 1.5
    await router.rank_engines("decode", EngineRole.CONSUMER)  # starts a refresh
    await router.stop_refreshing()
    now[0] = 1.6  # the cancelled refresh left the old list, still young enough to use (and refresh again)
    assert [e.engine_id for e in await router.rank_engines("decode", EngineRole.CONSUMER)] == ["d0"]
    await router.refreshed()
    assert {e.engine_id for e in await router.rank_engines("decode", EngineRole.CONSUMER)} == {"d0", "d1"}


async def test_with_refresh_interval_0_every_request_lists_the_engines(client: AsyncRendezvousClient) -> None:
    router = RouterClient(client, refresh_interval=0.0)
    await register(client, "d0", EngineRole.CONSUMER)
    assert [e.engine_id for e in await router.rank_engines("decode", EngineRole.CONSUMER)] == ["d0"]
    await register(client, "d1", EngineRole.CONSUMER)
    assert {e.engine_id for e in await router.rank_engines("decode", EngineRole.CONSUMER)} == {"d0", "d1"}


async def test_a_router_abort_reaches_both_sides(client: AsyncRendezvousClient) -> None:
    router = RouterClient(client)
    async with consumer_session(client) as consumer, producer_session(client) as producer:
        transfer_id = router.mint_transfer_id()
        await consumer.register_target(TargetSpec(transfer_id, [1]))
        await producer.claim_transfer(ClaimSpec(transfer_id))
        result = await router.abort_transfer(transfer_id, "client went away")
        assert result.state == TransferState.ABORTED
        for session in (consumer, producer):
            event = await next_event(session.events(), of_type(EventType.TRANSFER_ABORTED, transfer_id))
            assert isinstance(event, Event) and event.transfer is not None
            assert (event.transfer.abort_reason, event.transfer.abort_message) == (
                AbortReason.REQUESTED,
                "client went away",
            )
            assert len(session.live_transfers) == 0
    assert (await router.get_transfer(transfer_id)).state == TransferState.ABORTED
