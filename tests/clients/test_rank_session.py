"""A multi-rank engine over the SDK: rank 0 registers every rank's agent, the other ranks follow with a
`RankSession`, see every event from the incarnation's start, report their own share, and follow a new
incarnation after a server restart."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest

from rendezvous.clients import (
    AsyncRendezvousClient,
    ClaimSpec,
    CompletionSpec,
    ConsumerSession,
    Event,
    EventType,
    KvLayout,
    ProducerSession,
    RankSession,
    Reregistered,
    TargetSpec,
    TransferState,
)
from rendezvous.clients.testing import AsyncTestServer
from tests.clients.conftest import FAST_SESSION, LAYOUT, agent, consumer_session, next_event, of_type

TP2 = dataclasses.replace(LAYOUT, tp_size=2, num_kv_heads=2, kv_layout="HND")
HEADED = dataclasses.replace(LAYOUT, num_kv_heads=2, kv_layout="HND")


def tp2_producer(client: AsyncRendezvousClient, layout: KvLayout = TP2) -> ProducerSession:
    """Rank 0's session: it registers both ranks (each rank's block is half of a TP 1 block)."""
    ranks = [agent(f"p0-{r}") for r in range(2)]
    ranks = [
        dataclasses.replace(a, rank=r, regions=(dataclasses.replace(a.regions[0], block_length_bytes=2048),))
        for r, a in enumerate(ranks)
    ]
    return ProducerSession(client, "p0", "prefill", layout=layout, agents=ranks, config=FAST_SESSION)


@pytest.fixture
async def consumer(client: AsyncRendezvousClient) -> AsyncIterator[ConsumerSession]:
    async with consumer_session(client, layout=HEADED) as session:
        yield session


async def test_the_other_rank_sees_the_assignment_and_the_transfer_commits_once_both_ranks_reported(
    client: AsyncRendezvousClient, consumer: ConsumerSession
) -> None:
    async with tp2_producer(client) as leader, RankSession(client, "p0", config=FAST_SESSION) as follower:
        assert follower.incarnation == leader.incarnation
        assert follower.engine.watch_start_sequence == leader.engine.watch_start_sequence > 0
        await consumer.register_target(TargetSpec("t1", [1, 2]))
        assert (await leader.claim_transfer(ClaimSpec("t1"))).state == TransferState.MATCHED
        for session in (leader, follower):
            assigned = await next_event(session.events(), of_type(EventType.TRANSFER_ASSIGNED, "t1"))
            assert isinstance(assigned, Event) and assigned.peer is not None and assigned.peer.engine_id == "d0"
        assert (await leader.complete_transfer(CompletionSpec("t1", 1, ranks=(0,)))).state == TransferState.MATCHED
        assert (await client.get_transfer("t1")).reported_ranks == (0,)
        done = await follower.complete_transfer(CompletionSpec("t1", 1, ranks=(1,)))
        assert done.state == TransferState.COMMITTED
        await next_event(consumer.events(), of_type(EventType.TRANSFER_COMMITTED, "t1"))


async def test_a_rank_session_follows_the_new_incarnation_after_a_server_restart(
    server: AsyncTestServer, client: AsyncRendezvousClient, consumer: ConsumerSession
) -> None:
    async with tp2_producer(client) as leader, RankSession(client, "p0", config=FAST_SESSION) as follower:
        old = leader.incarnation
        await server.restart()
        event = await next_event(follower.events(), lambda e: isinstance(e, Reregistered))
        assert isinstance(event, Reregistered) and event.previous_incarnation == old
        assert follower.incarnation == leader.incarnation != old
        await consumer.register_target(TargetSpec("t2", [3]))
        await leader.claim_transfer(ClaimSpec("t2"))
        await next_event(follower.events(), of_type(EventType.TRANSFER_ASSIGNED, "t2"))
        await leader.complete_transfer(CompletionSpec("t2", 1, ranks=(0,)))
        assert (await follower.complete_transfer(CompletionSpec("t2", 1, ranks=(1,)))).state == TransferState.COMMITTED


async def test_closing_a_rank_session_leaves_the_engine_registered(client: AsyncRendezvousClient) -> None:
    async with tp2_producer(client) as leader:
        async with RankSession(client, "p0", config=FAST_SESSION):
            pass
        assert (await client.get_engine("p0")).incarnation == leader.incarnation
