"""A multi-rank engine over the SDK: rank 0 registers every rank's agent, the other ranks follow with a
`RankSession`, see every event from the incarnation's start, report their own share, and follow a new
incarnation after a server restart; and its write fence, which follows the lease rank 0 holds."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from rendezvous.clients import (
    AsyncRendezvousClient,
    Cancelled,
    ClaimSpec,
    ClientConfig,
    CompletionSpec,
    ConsumerSession,
    EngineRole,
    EngineSpec,
    Event,
    EventType,
    KvLayout,
    NixlAgentInfo,
    ProducerSession,
    RankSession,
    Reregistered,
    RetryPolicy,
    SessionEvent,
    TargetSpec,
    TransferState,
)
from rendezvous.clients.testing import AsyncTestServer, FakeClock, start_test_server
from rendezvous.core import Timeouts
from tests.clients.conftest import (
    FAST_SESSION,
    LAYOUT,
    MUST,
    GrpcProxy,
    agent,
    client_config,
    consumer_session,
    grpc_proxy,
    next_event,
    of_type,
    wait_until,
)

__all__ = ["grpc_proxy"]  # the fixture

TP2 = dataclasses.replace(LAYOUT, tp_size=2, num_kv_heads=2, kv_layout="HND")
HEADED = dataclasses.replace(LAYOUT, num_kv_heads=2, kv_layout="HND")


def tp2_agents() -> tuple[NixlAgentInfo, ...]:
    """Both ranks' agents (each rank's block is half of a TP 1 block)."""
    ranks = [agent(f"p0-{r}") for r in range(2)]
    return tuple(
        dataclasses.replace(a, rank=r, regions=(dataclasses.replace(a.regions[0], block_length_bytes=2048),))
        for r, a in enumerate(ranks)
    )


def tp2_producer(client: AsyncRendezvousClient, layout: KvLayout = TP2) -> ProducerSession:
    """Rank 0's session: it registers both ranks."""
    return ProducerSession(client, "p0", "prefill", layout=layout, agents=tp2_agents(), config=FAST_SESSION)


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


async def test_closing_a_rank_session_whose_call_waits_on_a_gone_engine_ends_it_and_leaves_nothing_running(
    client: AsyncRendezvousClient, consumer: ConsumerSession, grpc_proxy: GrpcProxy
) -> None:
    """Rank 1 sent its CompleteTransfers (held at the proxy: a replica that stopped answering), then rank 0 closed:
    no incarnation will come, and rank 1 waits for one to follow. close() cancelled that wait but left the call
    running after it for its whole deadline (here 60 s): an agent's close, which waits for its calls, hung as long
    (found by the TP 2 write-fence test). The call now fails with `Cancelled` as close() ends; nothing of the
    session is left running, and the follower deregistered nothing."""
    config = ClientConfig(targets=[grpc_proxy.address], retry=RetryPolicy(deadline=None), call_timeout=60.0)
    async with AsyncRendezvousClient(config) as proxied:
        leader = tp2_producer(client)
        await leader.start()
        follower = RankSession(proxied, "p0", config=FAST_SESSION)
        await follower.start()
        await consumer.register_target(TargetSpec("t1", [1, 2]))
        await leader.claim_transfer(ClaimSpec("t1"))
        grpc_proxy.hold("CompleteTransfers")
        call = asyncio.create_task(follower.complete_transfers([CompletionSpec("t1", 1, ranks=(1,))]))
        await grpc_proxy.wait_for(lambda: grpc_proxy.calls["CompleteTransfers"] == 1)
        await leader.close()
        await wait_until(lambda: follower._recovery is not None and not follower._recovery.done(), MUST)  # following

        await asyncio.wait_for(follower.close(), MUST)

        with pytest.raises(Cancelled):
            await asyncio.wait_for(call, MUST)
        assert grpc_proxy.calls["DeregisterEngine"] == 0
        assert [t for t in asyncio.all_tasks() if t.get_name().endswith(" p0") and not t.done()] == []


async def test_a_rank_session_s_fence_is_a_read_s_send_time_plus_what_was_left_of_the_lease_less_the_margin() -> None:
    """With the server's clock standing still (a fake one, and no keep-alive: rank 0 registered by hand), what is
    left of the lease is known exactly: 3 s - 1.2 s. The fence is the read's send time plus that, less a third of
    the TTL (the margin); each later read moves it on by as long as the reads are apart. Once the lease lapsed by the
    server's clock, the read finds the engine gone: the fence closes; the next incarnation's lease opens it only
    once the handler took its `Reregistered`."""
    clock = FakeClock()
    loop = asyncio.get_running_loop()
    taken: list[tuple[float, float]] = []  # the fence, and the time, as the handler took Reregistered

    async def handler(item: SessionEvent) -> None:
        if isinstance(item, Reregistered):
            taken.append((follower.writable_until, loop.time()))

    spec = EngineSpec("p0", "prefill", EngineRole.PRODUCER, layout=TP2, agents=tp2_agents(), lease_ttl=3.0)
    async with (
        start_test_server(clock, timeouts=Timeouts(default_lease_ttl=3.0)) as server,
        AsyncRendezvousClient(client_config(server.address)) as client,
    ):
        await client.register_engine(spec)
        clock.advance(1.2)
        follower = RankSession(client, "p0", config=FAST_SESSION, handler=handler)
        before = loop.time()
        await follower.start()
        first = follower.writable_until  # read before any later read could move it
        try:
            assert before + 1.8 - 1.0 <= first <= loop.time() + 1.8 - 1.0
            await wait_until(lambda: follower.writable_until > first, MUST)  # read again, sent later

            clock.advance(2.0)  # the lease lapsed by the server's clock
            await server.sweep()
            await wait_until(lambda: follower.writable_until <= loop.time(), MUST)
            await client.register_engine(spec)  # rank 0 registered again
            await wait_until(lambda: taken, MUST)
            ((fence, at),) = taken
            assert fence <= at  # closed while the handler looked at what lives on
            await wait_until(lambda: follower.writable_until > at, MUST)  # opened on the new lease
        finally:
            await follower.close()
        assert follower.writable_until <= loop.time()


async def test_a_rank_session_cut_off_from_the_service_does_not_move_its_fence(
    client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """Rank 0 keeps the lease; the following rank's reads of it stop being answered: its fence stays where the last
    answered read put it, and so closes by itself, before the lease could lapse had rank 0 lost it too."""
    async with (
        tp2_producer(client),
        AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied,
        RankSession(proxied, "p0", config=FAST_SESSION) as follower,
    ):
        first = follower.writable_until
        await wait_until(lambda: follower.writable_until > first, MUST)  # rank 0 renews; each read moves it on

        grpc_proxy.hold("GetEngine")
        held = grpc_proxy.calls["GetEngine"]
        await wait_until(lambda: grpc_proxy.calls["GetEngine"] > held, MUST)  # sent after the earlier ones ended
        fence = follower.writable_until
        await wait_until(lambda: grpc_proxy.calls["GetEngine"] > held + 1, MUST)  # that one failed, and was retried
        assert follower.writable_until == fence
        grpc_proxy.release("GetEngine")
        await wait_until(lambda: follower.writable_until > fence, MUST)  # answered again: moved on
