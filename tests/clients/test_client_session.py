"""Engine sessions against a real server: lifecycle, lease renewal, watch resume, resync, restarts."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from rendezvous.clients import (
    NO_RETRY,
    AbortSpec,
    AsyncKeepAliveStream,
    AsyncRendezvousClient,
    Cancelled,
    ClaimSpec,
    ClientConfig,
    CompletionOutcome,
    CompletionSpec,
    ConsumerSession,
    EngineRole,
    EngineSession,
    EngineSpec,
    Event,
    EventType,
    FailedPrecondition,
    InvalidArgument,
    ItemResult,
    LiveTransfers,
    NotFound,
    ProducerSession,
    Reason,
    ReleaseSpec,
    Reregistered,
    ResourceExhausted,
    Resynced,
    RetryPolicy,
    RevocationAck,
    ServerEvent,
    SessionCause,
    SessionConfig,
    SessionEvent,
    SourceReadySpec,
    TargetSpec,
    TransferInfo,
    TransferMode,
    TransferState,
)
from rendezvous.clients._session import RankSession, follow_fence, follow_period, write_fence
from rendezvous.clients.testing import AsyncTestServer, FakeClock, start_test_server
from rendezvous.core.limits import Limits
from rendezvous.server.quotas import CallLimits
from tests.clients.conftest import (
    FAST_SESSION,
    LAYOUT,
    MUST,
    WAIT,
    GrpcProxy,
    TcpProxy,
    agent,
    client_config,
    consumer_session,
    next_event,
    of_type,
    producer_session,
    wait_until,
)


def is_reregistered(event: SessionEvent) -> bool:
    return isinstance(event, Reregistered)


async def collect_assignments(events: AsyncIterator[SessionEvent], transfer_ids: set[str]) -> list[ServerEvent]:
    """Events up to the assignment of every one of transfer_ids."""
    seen: list[ServerEvent] = []

    async def run() -> None:
        async for event in events:
            assert isinstance(event, Event), f"unexpected {event!r}"
            seen.append(event)
            assigned = {e.transfer.transfer_id for e in seen if e.type == EventType.TRANSFER_ASSIGNED and e.transfer}
            if transfer_ids <= assigned:
                return

    await asyncio.wait_for(run(), WAIT)
    return seen


@pytest.fixture
async def consumer(client: AsyncRendezvousClient) -> AsyncIterator[ConsumerSession]:
    async with consumer_session(client) as session:
        yield session


@pytest.fixture
async def producer(client: AsyncRendezvousClient) -> AsyncIterator[ProducerSession]:
    async with producer_session(client) as session:
        yield session


async def test_push_lifecycle_between_a_consumer_and_a_producer_session(
    client: AsyncRendezvousClient, consumer: ConsumerSession, producer: ProducerSession
) -> None:
    producer_events, consumer_events = producer.events(), consumer.events()
    await consumer.register_target(TargetSpec("t1", [1, 2], num_tokens=32))
    assert set(consumer.live_transfers.targets) == {"t1"}
    assert (await producer.claim_transfer(ClaimSpec("t1"))).state == TransferState.MATCHED

    assigned = await next_event(producer_events, of_type(EventType.TRANSFER_ASSIGNED, "t1"))
    assert isinstance(assigned, Event) and assigned.transfer is not None and assigned.peer is not None
    assert assigned.transfer.target_block_ids == (1, 2)
    assert (assigned.peer.engine_id, assigned.peer.incarnation) == ("d0", consumer.incarnation)

    await producer.complete_transfer(CompletionSpec("t1", assigned.generation))
    assert len(producer.live_transfers) == 0
    await next_event(consumer_events, of_type(EventType.TRANSFER_COMMITTED, "t1"))
    assert len(consumer.live_transfers) == 0
    assert (await consumer.release_target(ReleaseSpec("t1", 1))).state == TransferState.RELEASED
    assert (await client.get_transfer("t1")).state == TransferState.RELEASED


async def test_an_outcome_reported_as_its_incarnation_ends_the_claim_it_answers(
    consumer: ConsumerSession, producer: ProducerSession
) -> None:
    """`complete_transfers(..., assigned_to=...)` (what the NIXL producer sends) noted nothing of its results: a push
    producer hears no TRANSFER_COMMITTED, so every claim it ever made stayed live, and was re-asserted at each
    re-registration."""
    producer_events = producer.events()
    await consumer.register_target(TargetSpec("t1", [1, 2], num_tokens=32))
    assert (await producer.claim_transfer(ClaimSpec("t1"))).state == TransferState.MATCHED
    assigned = await next_event(producer_events, of_type(EventType.TRANSFER_ASSIGNED, "t1"))
    assert isinstance(assigned, Event)

    (result,) = await producer.complete_transfers(
        (CompletionSpec("t1", assigned.generation),), assigned_to=producer.incarnation_id
    )
    assert result.state == TransferState.COMMITTED
    assert len(producer.live_transfers) == 0


async def test_pull_lifecycle_tells_the_consumer_where_to_read(
    consumer: ConsumerSession, producer: ProducerSession
) -> None:
    producer_events, consumer_events = producer.events(), consumer.events()
    await consumer.register_target(TargetSpec("t1", [1], mode=TransferMode.PULL))
    await producer.mark_source_ready(SourceReadySpec("t1", [7, 8]))
    assert set(producer.live_transfers.sources) == {"t1"}

    ready = await next_event(consumer_events, of_type(EventType.SOURCE_READY, "t1"))
    assert isinstance(ready, Event) and ready.transfer is not None and ready.peer is not None
    assert (ready.transfer.source_block_ids, ready.peer.engine_id) == ((7, 8), "p0")

    assert (await consumer.complete_transfer(CompletionSpec("t1", 1))).state == TransferState.COMMITTED
    await next_event(producer_events, of_type(EventType.TRANSFER_COMMITTED, "t1"))
    assert len(producer.live_transfers) == 0 and len(consumer.live_transfers) == 0


async def test_the_session_renews_a_short_lease_past_its_ttl() -> None:
    # The server's time moves only after each renewal is seen, a third of the lease at a time, so however late a
    # loaded machine runs the keep-alive the lease never lapses; four moves take it past one whole lease.
    clock = FakeClock()
    async with (
        start_test_server(clock) as server,
        AsyncRendezvousClient(client_config(server.address)) as client,
        consumer_session(client, lease_ttl=3.0) as session,
    ):
        incarnation = session.incarnation

        async def renewed() -> None:
            while True:
                if (await client.get_engine("d0")).lease_expire_time >= clock() + 3.0:
                    return
                await asyncio.sleep(0.05)

        for _ in range(4):
            clock.advance(1.0)
            await asyncio.wait_for(renewed(), WAIT)  # a renewal after the move (about a second of real time)
            await server.sweep()
        engine = await client.get_engine("d0")
        assert engine.lease_expire_time > engine.register_time + 3.0  # past its first lease
        assert engine.incarnation == incarnation == session.incarnation


async def test_events_go_to_the_handler_when_one_is_given(
    client: AsyncRendezvousClient, consumer: ConsumerSession
) -> None:
    received: list[SessionEvent] = []
    assigned = asyncio.Event()

    async def handler(event: SessionEvent) -> None:
        received.append(event)
        if of_type(EventType.TRANSFER_ASSIGNED)(event):
            assigned.set()

    async with producer_session(client, handler=handler) as producer:
        with pytest.raises(RuntimeError):
            await anext(producer.events())
        await producer.claim_transfer(ClaimSpec("t1"))
        await consumer.register_target(TargetSpec("t1", [1]))
        await asyncio.wait_for(assigned.wait(), WAIT)
    assert [type(e) for e in received] == [Event]


async def test_closing_deregisters_the_engine(client: AsyncRendezvousClient) -> None:
    async with consumer_session(client) as session:
        assert (await client.get_engine("d0")).incarnation == session.incarnation
    with pytest.raises(NotFound):
        await client.get_engine("d0")


async def test_a_registration_the_server_refuses_raises_from_start(client: AsyncRendezvousClient) -> None:
    session = EngineSession(client, EngineSpec("", "decode", EngineRole.CONSUMER))
    with pytest.raises(InvalidArgument):
        await session.start()


async def test_the_watch_resumes_after_a_disconnect_without_loss_or_repeats(
    client: AsyncRendezvousClient, proxy: TcpProxy
) -> None:
    async with (
        AsyncRendezvousClient(client_config(proxy.address)) as proxied,
        producer_session(proxied) as producer,
        consumer_session(client) as consumer,
    ):
        events = producer.events()
        await producer.claim_transfers([ClaimSpec(f"t{i}") for i in range(3)])
        await consumer.register_target(TargetSpec("t0", [0]))
        first = await collect_assignments(events, {"t0"})

        proxy.refuse(True)
        proxy.cut()
        await consumer.register_targets([TargetSpec("t1", [1]), TargetSpec("t2", [2])])
        proxy.refuse(False)
        after = await collect_assignments(events, {"t1", "t2"})

        assert [e.sequence for e in first] == [1]
        assert [e.sequence for e in after] == [2, 3]
        assert proxy.accepted >= 2, "the session never reconnected"
        assert producer.incarnation == (await client.get_engine("p0")).incarnation


async def test_streams_the_server_ends_cleanly_are_reopened_and_the_watch_resumes_without_a_gap(
    client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """A Watch or KeepAlive stream ended with status OK (a proxy's stream timeout) is reopened as a broken one is:
    the lease is renewed on the new stream, the watch resumes after the last event delivered."""
    async with (
        AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied,
        producer_session(proxied, lease_ttl=3.0) as producer,
        consumer_session(client) as consumer,
    ):
        events = producer.events()
        await producer.claim_transfers([ClaimSpec(f"t{i}") for i in range(3)])
        await consumer.register_target(TargetSpec("t0", [0]))
        first = await collect_assignments(events, {"t0"})
        await grpc_proxy.wait_for(lambda: grpc_proxy.requests["KeepAlive"])

        assert grpc_proxy.end_streams("Watch") == 1 and grpc_proxy.end_streams("KeepAlive") == 1
        renewed = len(grpc_proxy.requests["KeepAlive"])
        await consumer.register_targets([TargetSpec("t1", [1]), TargetSpec("t2", [2])])
        after = await collect_assignments(events, {"t1", "t2"})
        await grpc_proxy.wait_for(lambda: grpc_proxy.answers["KeepAlive"] > renewed)

        assert [e.sequence for e in first] == [1] and [e.sequence for e in after] == [2, 3]
        assert grpc_proxy.calls["Watch"] >= 2 and grpc_proxy.calls["KeepAlive"] >= 2
        assert producer.incarnation == (await client.get_engine("p0")).incarnation and producer.failure is None


async def test_streams_a_replica_ends_cleanly_fail_over_to_the_next_endpoint(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """Two endpoints; the first ends its KeepAlive and Watch streams with status OK and every new one at once (a
    replica shutting down gracefully). The session reopened them on the same endpoint, again and again: its lease
    was never renewed and its watch delivered nothing more (found by an audit). A stream the server ends cleanly
    now moves the client to its next endpoint, as an UNAVAILABLE one does, and the watch resumes there."""
    first, second = GrpcProxy(server.address), GrpcProxy(server.address)
    await first.start()
    await second.start()
    try:
        async with (
            AsyncRendezvousClient(client_config(first.address, second.address)) as proxied,
            producer_session(proxied, lease_ttl=3.0) as producer,
            consumer_session(client) as consumer,
        ):
            events = producer.events()
            await producer.claim_transfers([ClaimSpec(f"t{i}") for i in range(3)])
            await consumer.register_target(TargetSpec("t0", [0]))
            before = await collect_assignments(events, {"t0"})

            first.drain("Watch")
            first.drain("KeepAlive")
            await consumer.register_targets([TargetSpec("t1", [1]), TargetSpec("t2", [2])])
            after = await collect_assignments(events, {"t1", "t2"})
            await second.wait_for(lambda: second.answers["KeepAlive"])

            assert [e.sequence for e in before] == [1] and [e.sequence for e in after] == [2, 3]
            assert second.calls["Watch"] >= 1
            assert producer.incarnation == (await client.get_engine("p0")).incarnation and producer.failure is None
    finally:
        await first.close()
        await second.close()


async def test_closing_while_re_registering_ends_within_a_lease_and_leaves_nothing_running(
    client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """The lease was lost and the re-registration is held: the replica answers no RegisterEngine nor
    DeregisterEngine. close() cancelled the recovery, then deregistered the lost incarnation, waiting for that
    unanswered call for the client's whole call timeout (here 60 s; by default 10 s, 30 s of retries against a
    replica that refuses connections) and raising its error (found by an audit). An incarnation being replaced is
    gone already: close() now deregisters nothing but what the recovery's RegisterEngine registered, whose answer it
    waits for up to a lease TTL (here 3 s, not the call's 60 s), and ends with no task of the session left and
    nothing registered."""
    config = ClientConfig(targets=[grpc_proxy.address], retry=RetryPolicy(deadline=None), call_timeout=60.0)
    async with AsyncRendezvousClient(config) as proxied:
        session = consumer_session(proxied, lease_ttl=3.0)
        await session.start()
        grpc_proxy.hold("RegisterEngine")
        grpc_proxy.hold("DeregisterEngine")
        await client.deregister_engine("d0", session.incarnation)  # the session learns its lease is gone
        await grpc_proxy.wait_for(lambda: grpc_proxy.calls["RegisterEngine"] == 2)  # the recovery's, held

        await asyncio.wait_for(session.close(), MUST)

        assert grpc_proxy.calls["DeregisterEngine"] == 0
        assert [t for t in asyncio.all_tasks() if t.get_name().endswith(" d0") and not t.done()] == []
        with pytest.raises(NotFound):
            await client.get_engine("d0")
        with pytest.raises(Cancelled):
            await session.register_target(TargetSpec("t1", [1]))


async def test_closing_while_re_registering_deregisters_the_incarnation_a_register_in_flight_made(
    client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """The lease was lost and the re-registration's RegisterEngine is on its way to the server (delayed at the proxy,
    which forwards it even if its caller gives up) when the session starts closing. close() cancelled the recovery
    with its call and deregistered nothing, while the RegisterEngine still landed: an incarnation nobody renews nor
    deregisters, live (a consumer the router places on) until its lease lapsed. Now close() waits for the call's
    answer (up to a lease TTL) and deregisters the incarnation it registered."""
    async with AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied:
        session = consumer_session(proxied, lease_ttl=WAIT)
        await session.start()
        lost = session.incarnation
        grpc_proxy.delay("RegisterEngine")
        await client.deregister_engine("d0", lost)  # the session learns its lease is gone at its next renewal
        await grpc_proxy.wait_for(lambda: grpc_proxy.delayed["RegisterEngine"] == 1)  # the recovery's
        (register,) = grpc_proxy.late

        session.begin_close()  # the recovery is cancelled: no new incarnation after close...
        grpc_proxy.let_through("RegisterEngine")  # ...but its RegisterEngine reaches the server all the same
        await asyncio.wait_for(session.close(), MUST)
        await asyncio.wait_for(register, MUST)  # the server answered it (to the proxy, if not to the session)

        with pytest.raises(NotFound):
            await client.get_engine("d0")
        assert grpc_proxy.calls["DeregisterEngine"] == 1
        assert [t for t in asyncio.all_tasks() if t.get_name().endswith(" d0") and not t.done()] == []


async def test_closing_waits_for_a_call_in_flight_while_the_lease_holds_then_cuts_it_before_deregistering(
    client: AsyncRendezvousClient, consumer: ConsumerSession, grpc_proxy: GrpcProxy
) -> None:
    """A completion is on its way (held at the proxy: a replica that stopped answering) when the producer closes.
    close() deregistered the engine at once, while the completion was still unanswered: had it been answered a moment
    later, it came after the engine it reports for was gone (a healthy engine's last report lost); unanswered, it ran
    on for its whole deadline (here 60 s) after close. Now close() waits for it while the lease it renewed last
    certainly holds (its write fence, two thirds of the 3 s TTL), then cuts it (`Cancelled`), and only then
    deregisters; nothing of the session is left running."""
    config = ClientConfig(targets=[grpc_proxy.address], retry=RetryPolicy(deadline=None), call_timeout=60.0)
    async with AsyncRendezvousClient(config) as proxied:
        producer = producer_session(proxied, lease_ttl=3.0)
        await producer.start()
        await consumer.register_target(TargetSpec("t1", [1]))
        await producer.claim_transfer(ClaimSpec("t1"))
        grpc_proxy.hold("CompleteTransfers")
        call = asyncio.create_task(producer.complete_transfer(CompletionSpec("t1", 1)))
        await grpc_proxy.wait_for(lambda: grpc_proxy.calls["CompleteTransfers"] == 1)

        closing = asyncio.create_task(producer.close())
        await grpc_proxy.wait_for(lambda: call.done() or grpc_proxy.calls["DeregisterEngine"] > 0)

        assert call.done() and grpc_proxy.calls["DeregisterEngine"] == 0  # the call ended first
        with pytest.raises(Cancelled):
            await call
        await asyncio.wait_for(closing, MUST)
        assert grpc_proxy.calls["DeregisterEngine"] == 1
        assert [t for t in asyncio.all_tasks() if t.get_name().endswith(" p0") and not t.done()] == []
        with pytest.raises(NotFound):
            await client.get_engine("p0")


async def test_closing_a_healthy_session_sends_its_last_completion_before_it_deregisters(
    client: AsyncRendezvousClient, consumer: ConsumerSession, grpc_proxy: GrpcProxy
) -> None:
    """The completion is slow (delayed at the proxy) when the producer closes: it is answered, the transfer commits,
    and the engine is deregistered after. (Kept behaviour: close() once raced the deregistration against it.)"""
    async with AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied:
        producer = producer_session(proxied, lease_ttl=30.0)
        await producer.start()
        await consumer.register_target(TargetSpec("t1", [1]))
        await producer.claim_transfer(ClaimSpec("t1"))
        grpc_proxy.delay("CompleteTransfers")
        call = asyncio.create_task(producer.complete_transfer(CompletionSpec("t1", 1)))
        await grpc_proxy.wait_for(lambda: grpc_proxy.delayed["CompleteTransfers"] == 1)
        loop = asyncio.get_running_loop()

        closing = asyncio.create_task(producer.close())
        await wait_until(lambda: producer.writable_until <= loop.time())  # close() began
        grpc_proxy.let_through("CompleteTransfers")

        assert (await asyncio.wait_for(call, MUST)).state == TransferState.COMMITTED
        await asyncio.wait_for(closing, MUST)
        with pytest.raises(NotFound):
            await client.get_engine("p0")
        await next_event(consumer.events(), of_type(EventType.TRANSFER_COMMITTED, "t1"))


async def test_a_watch_that_fell_behind_resyncs_from_the_transfer_list() -> None:
    async with (
        start_test_server(limits=Limits(max_events_per_engine=4), grace=0.1) as server,
        AsyncRendezvousClient(client_config(server.address)) as client,
    ):
        proxy = TcpProxy(server.port)
        await proxy.start()
        try:
            async with (
                AsyncRendezvousClient(client_config(proxy.address)) as proxied,
                producer_session(proxied) as producer,
                consumer_session(client) as consumer,
            ):
                events = producer.events()
                ids = [f"t{i}" for i in range(8)]
                await producer.claim_transfers([ClaimSpec(t) for t in ids])
                proxy.refuse(True)
                proxy.cut()
                await consumer.register_targets([TargetSpec(t, [i]) for i, t in enumerate(ids)])
                proxy.refuse(False)

                resynced = await next_event(events, lambda e: isinstance(e, Resynced))
                assert isinstance(resynced, Resynced)
                assert sorted(t.transfer_id for t in resynced.transfers) == ids
                assert {t.state for t in resynced.transfers} == {TransferState.MATCHED}
                assert set(producer.live_transfers.claims) == set(ids)
        finally:
            await proxy.close()


async def test_a_resync_names_the_claims_that_ended_while_the_watch_was_away() -> None:
    """Six of eight claims are aborted while the producer's watch is away (their TRANSFER_ABORTED lost past a log of
    four events): the listing lacks them, and `Resynced.unlisted` names them, the claims the session stops
    re-asserting, so that an agent holding nothing of them yet can ask how they ended. Before, nothing said they
    had been claimed."""
    async with (
        start_test_server(limits=Limits(max_events_per_engine=4), grace=0.1) as server,
        AsyncRendezvousClient(client_config(server.address)) as client,
    ):
        proxy = TcpProxy(server.port)
        await proxy.start()
        try:
            async with (
                AsyncRendezvousClient(client_config(proxy.address)) as proxied,
                producer_session(proxied) as producer,
            ):
                events = producer.events()
                ids = [f"t{i}" for i in range(8)]
                await producer.claim_transfers([ClaimSpec(t) for t in ids])
                proxy.refuse(True)
                proxy.cut()
                aborts = await client.abort_transfers("", [AbortSpec(t, "the router gave up") for t in ids[:6]])
                assert all(a.state is TransferState.ABORTED for a in aborts)
                proxy.refuse(False)

                resynced = await next_event(events, lambda e: isinstance(e, Resynced))
                assert isinstance(resynced, Resynced)
                assert sorted(t.transfer_id for t in resynced.transfers) == ids[6:]
                assert resynced.unlisted == tuple(ids[:6])
                assert sorted(producer.live_transfers.claims) == ids[6:]
        finally:
            await proxy.close()


async def test_an_outcome_answering_a_replaced_incarnation_is_not_sent_as_the_new_one(
    server: AsyncTestServer, client: AsyncRendezvousClient, consumer: ConsumerSession, producer: ProducerSession
) -> None:
    """A FAILED report answering an assignment of the incarnation a server restart replaced: sent as the new
    incarnation, it would abort the new epoch's match of the same transfer and generation, which both sides
    re-asserted. Named by the incarnation it answers (`assigned_to`), it is refused in the client with
    STALE_INCARNATION, unsent, and the new match lives on; the new incarnation's own report commits it."""
    producer_events, consumer_events = producer.events(), consumer.events()
    await consumer.register_target(TargetSpec("t1", [2]))
    await producer.claim_transfer(ClaimSpec("t1"))
    await collect_assignments(producer_events, {"t1"})
    old = producer.incarnation_id
    assert producer.events_incarnation == old and producer.is_current(old)

    await server.restart()
    for events in (producer_events, consumer_events):
        await next_event(events, is_reregistered)
    await collect_assignments(producer_events, {"t1"})  # matched again in the new epoch, generation 1 again
    assert not producer.is_current(old)

    failed = CompletionSpec("t1", 1, CompletionOutcome.FAILED, "the replaced incarnation's write failed")
    (result,) = await producer.complete_transfers([failed], assigned_to=old)
    assert result.error is not None and result.error.reason == Reason.STALE_INCARNATION, result
    assert (await client.get_transfer("t1")).state == TransferState.MATCHED
    (result,) = await producer.complete_transfers([CompletionSpec("t1", 1)], assigned_to=producer.incarnation_id)
    assert result.state == TransferState.COMMITTED, result


async def test_a_read_s_outcome_answering_a_replaced_incarnation_is_not_sent_as_the_new_one(
    server: AsyncTestServer, client: AsyncRendezvousClient, consumer: ConsumerSession, producer: ProducerSession
) -> None:
    """Pull mode: the consumer reports its READ. A SUCCEEDED answering the SOURCE_READY of the incarnation a server
    restart replaced: sent as the new incarnation, it would commit the new epoch's match of the same transfer and
    generation without reading its source. Named by the incarnation the SOURCE_READY was sent to (`assigned_to`),
    it is refused in the client with STALE_INCARNATION, unsent; the new incarnation's own report commits it."""
    producer_events, consumer_events = producer.events(), consumer.events()
    await consumer.register_target(TargetSpec("t1", [1], mode=TransferMode.PULL))
    await producer.mark_source_ready(SourceReadySpec("t1", [7]))
    await next_event(consumer_events, of_type(EventType.SOURCE_READY, "t1"))
    old = consumer.events_incarnation

    await server.restart()
    for events in (producer_events, consumer_events):
        await next_event(events, is_reregistered)
    await next_event(consumer_events, of_type(EventType.SOURCE_READY, "t1"))  # re-asserted: ready again, generation 1
    assert not consumer.is_current(old) and consumer.events_incarnation == consumer.incarnation_id

    (result,) = await consumer.complete_transfers([CompletionSpec("t1", 1)], assigned_to=old)
    assert result.error is not None and result.error.reason == Reason.STALE_INCARNATION, result
    assert (await client.get_transfer("t1")).state == TransferState.MATCHED
    (result,) = await consumer.complete_transfers([CompletionSpec("t1", 1)], assigned_to=consumer.incarnation_id)
    assert result.state == TransferState.COMMITTED, result


async def test_a_revocation_ack_answering_a_replaced_incarnation_is_not_sent_as_the_new_one(
    server: AsyncTestServer, client: AsyncRendezvousClient, consumer: ConsumerSession, producer: ProducerSession
) -> None:
    """An ack of a revocation made to the incarnation a server restart replaced: the new epoch matched the
    transfer again (generation 1 again) and revokes that generation from the new incarnation, whose WRITE of it
    may still be in flight. Sent as the new incarnation, the old ack would confirm the new revocation and let the
    consumer free blocks that WRITE can land in. Named by the incarnation it answers (`revoked_to`), it is refused
    in the client with STALE_INCARNATION, unsent, and the revocation stays pending; the new one's ack confirms it."""
    producer_events, consumer_events = producer.events(), consumer.events()
    await consumer.register_target(TargetSpec("t1", [2]))
    await producer.claim_transfer(ClaimSpec("t1"))
    await collect_assignments(producer_events, {"t1"})
    old = producer.incarnation_id

    await server.restart()
    for events in (producer_events, consumer_events):
        await next_event(events, is_reregistered)
    await collect_assignments(producer_events, {"t1"})  # matched again in the new epoch, generation 1 again
    await consumer.register_target(TargetSpec("t1", [3], generation=2))  # preempted: generation 1 is revoked
    revoked = await next_event(producer_events, of_type(EventType.TRANSFER_REVOKED, "t1"))
    assert isinstance(revoked, Event) and revoked.generation == 1, revoked
    assert (await client.get_transfer("t1")).revoking_generation == 1

    (result,) = await producer.acknowledge_revocations([RevocationAck("t1", 1)], revoked_to=old)
    assert result.error is not None and result.error.reason == Reason.STALE_INCARNATION, result
    assert (await client.get_transfer("t1")).revoking_generation == 1  # not confirmed: the blocks stay fenced
    ack = RevocationAck("t1", 1)
    (result,) = await producer.acknowledge_revocations([ack], revoked_to=producer.incarnation_id)
    assert result.ok, result
    confirmed = await next_event(consumer_events, of_type(EventType.REVOCATION_CONFIRMED, "t1"))
    assert isinstance(confirmed, Event) and confirmed.generation == 1, confirmed
    assert (await client.get_transfer("t1")).revoking_generation == 0


async def test_after_a_server_restart_sessions_reregister_and_their_transfers_still_match(
    server: AsyncTestServer, client: AsyncRendezvousClient, consumer: ConsumerSession, producer: ProducerSession
) -> None:
    producer_events, consumer_events = producer.events(), consumer.events()
    old = (consumer.incarnation, producer.incarnation)
    await consumer.register_target(TargetSpec("targeted-before", [1]))
    await producer.claim_transfer(ClaimSpec("claimed-before"))
    await consumer.register_target(TargetSpec("matched-before", [2]))
    await producer.claim_transfer(ClaimSpec("matched-before"))
    await collect_assignments(producer_events, {"matched-before"})

    await server.restart()

    for session_events in (producer_events, consumer_events):
        event = await next_event(session_events, is_reregistered)
        assert isinstance(event, Reregistered)
        assert event.cause in (SessionCause.EPOCH_CHANGED, Reason.ENGINE_NOT_FOUND)
        assert isinstance(event.cause, SessionCause | Reason)  # an enum, not a bare string
        assert event.epoch == server.epoch and all(r.ok for r in event.results)
    assert consumer.incarnation != old[0] and producer.incarnation != old[1]

    await producer.claim_transfer(ClaimSpec("targeted-before"))
    await consumer.register_target(TargetSpec("claimed-before", [3]))
    await collect_assignments(producer_events, {"targeted-before", "claimed-before", "matched-before"})

    await producer.complete_transfer(CompletionSpec("matched-before", 1))
    await next_event(consumer_events, of_type(EventType.TRANSFER_COMMITTED, "matched-before"))
    transfer = await client.get_transfer("matched-before")
    assert (transfer.state, transfer.consumer_incarnation) == (TransferState.COMMITTED, consumer.incarnation)


async def test_re_asserting_more_targets_than_the_server_s_batch_limit_splits_them(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """The fixture's server takes 128 items a batch; re-assertion sent up to `reassert_batch` (1,000) at once, the
    server refused BATCH_TOO_LARGE, and the session stopped after a restart it should survive (found by an
    audit). It now takes the limit the refusal names."""
    async with consumer_session(client) as consumer:
        events = consumer.events()
        for start in (0, 100):
            await consumer.register_targets([TargetSpec(f"t{i}", [i % 64]) for i in range(start, start + 100)])
        await server.restart()
        event = await next_event(events, is_reregistered)
        assert isinstance(event, Reregistered) and consumer.failure is None
        assert len([r for r in event.results if r.ok]) == 200


async def test_a_replica_gone_silent_is_given_up_within_the_renewal_interval() -> None:
    """Two endpoints; the first stops answering without closing its connections (a node lost without a reset).
    A renewal had no deadline and waited for gRPC's own keepalive (30 s + 10 s), while the lease (3 s here)
    lapsed and the server aborted the engine's transfers (found by an audit). A renewal unanswered for the
    interval between renewals is given up like an UNAVAILABLE endpoint: the next goes to the second replica.
    The server's clock stands still, so the lease cannot lapse while the test looks (on the wall clock the failover
    had the second of the lease left after the given-up renewal, which a loaded machine could use up)."""
    async with start_test_server(FakeClock()) as server:
        first, second = TcpProxy(server.port), TcpProxy(server.port)
        await first.start()
        await second.start()
        config = client_config(first.address, second.address)
        try:
            async with (
                AsyncRendezvousClient(server.address) as direct,
                AsyncRendezvousClient(config) as client,
                consumer_session(client, lease_ttl=3.0) as session,
            ):
                await session.register_target(TargetSpec("t1", [1]))
                first.freeze()
                deadline = asyncio.get_running_loop().time() + WAIT
                while not second.accepted:  # the first renewal after the freeze fails over
                    assert asyncio.get_running_loop().time() < deadline, "the session never left the replica"
                    await asyncio.sleep(0.05)
                assert (await direct.get_engine("d0")).incarnation == session.incarnation
        finally:
            await first.close()
            await second.close()


def renewal_refused(proxy: GrpcProxy) -> float | None:
    """When the proxy ended the first KeepAlive refused RESOURCE_EXHAUSTED (None: none was yet)."""
    refused = [at for at, code in proxy.ends["KeepAlive"] if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    return refused[0] if refused else None


async def spend_every_token(server: AsyncTestServer) -> None:
    """Call until refused RATE_LIMITED: the bucket of 127.0.0.1 (the proxy's host too) is empty, and stays so
    while the server's fake clock stands still."""
    async with AsyncRendezvousClient(ClientConfig(targets=[server.address], retry=NO_RETRY)) as direct:
        with pytest.raises(ResourceExhausted) as refused:
            for _ in range(1_000):
                await direct.get_status()
        assert refused.value.reason == Reason.RATE_LIMITED


async def test_a_renewal_refused_rate_limited_waits_the_server_s_retry_hint() -> None:
    """A renewal refused RESOURCE_EXHAUSTED / RATE_LIMITED was retried after the reconnect backoff (tens of ms),
    whatever the RetryInfo said: a rate-limited engine hammered the server (found by an audit). It now waits the
    hint, bounded by the lease. The quotas run on the server's fake clock: an empty bucket stays empty, and the
    hint is exact (1 token at 0.5/s: 2 s)."""
    clock = FakeClock()
    config = SessionConfig(renew_fraction=0.1, reconnect=FAST_SESSION.reconnect)  # every 1 s of a 10 s lease
    async with start_test_server(clock, call_limits=CallLimits(rate=0.5, burst=20)) as server:
        proxy = GrpcProxy(server.address)
        await proxy.start()
        try:
            async with AsyncRendezvousClient(client_config(proxy.address)) as client:
                session = ConsumerSession(
                    client, "d0", "decode", layout=LAYOUT, agents=[agent("d0-0")], lease_ttl=10.0, config=config
                )
                await session.start()
                try:
                    await proxy.wait_for(lambda: proxy.answers["Watch"])  # the watch was admitted
                    await spend_every_token(server)
                    await proxy.wait_for(lambda: renewal_refused(proxy) is not None)
                    ended = renewal_refused(proxy)
                    assert ended is not None
                    renewals = proxy.requests["KeepAlive"]
                    refused_at = max(at for at in renewals if at <= ended)
                    answered = proxy.answers["KeepAlive"]
                    clock.advance(2.0)  # a token again: the next renewal passes, whenever it comes
                    await proxy.wait_for(lambda: proxy.answers["KeepAlive"] > answered)

                    retried_at = min(at for at in renewals if at > ended)
                    assert retried_at - refused_at >= 2.0, "the renewal did not wait the server's retry hint"
                    assert session.failure is None
                finally:
                    await session.close(deregister=False)  # the bucket is empty again
        finally:
            await proxy.close()


@contextlib.asynccontextmanager
async def rate_limited_session(
    clock: FakeClock, rate: float, lease_ttl: float
) -> AsyncIterator[tuple[GrpcProxy, ConsumerSession]]:
    """A consumer session through a GrpcProxy to a server whose quotas (`rate` calls/s, burst 20) run on `clock`:
    once its watch is admitted, every token of 127.0.0.1 is spent (and stays so while the clock stands still)."""
    async with start_test_server(clock, call_limits=CallLimits(rate=rate, burst=20)) as server:
        proxy = GrpcProxy(server.address)
        await proxy.start()
        try:
            async with (
                AsyncRendezvousClient(client_config(proxy.address)) as client,
                consumer_session(client, lease_ttl=lease_ttl) as session,
            ):
                await proxy.wait_for(lambda: proxy.answers["Watch"])
                await spend_every_token(server)
                yield proxy, session
                assert session.failure is None
                await session.close(deregister=False)  # the bucket is empty: no DeregisterEngine would pass
        finally:
            await proxy.close()


async def test_a_watch_refused_rate_limited_reopens_after_the_server_s_retry_hint() -> None:
    """A Watch reopen refused RESOURCE_EXHAUSTED / RATE_LIMITED was tried again after the reconnect backoff (tens of
    ms), whatever the RetryInfo said, and refused again, over and over. It now waits the hint (1 token at 0.5/s on
    the server's fake clock: 2 s)."""
    clock = FakeClock()
    async with rate_limited_session(clock, 0.5, lease_ttl=600.0) as (proxy, _):
        opened = proxy.calls["Watch"]
        proxy.end_streams("Watch")  # the session reopens it: refused, the bucket is empty

        def refused() -> list[float]:
            return [at for at, code in proxy.ends["Watch"] if code == grpc.StatusCode.RESOURCE_EXHAUSTED]

        await proxy.wait_for(lambda: refused())
        first = refused()[0]
        answered = proxy.answers["Watch"]
        clock.advance(2.0)  # a token again: the next open passes, whenever it comes
        await proxy.wait_for(lambda: proxy.answers["Watch"] > answered)
        assert proxy.calls["Watch"] - opened == 2, "the refused watch was opened again before the hint"
        assert max(proxy.requests["Watch"]) - first >= 2.0


async def test_a_retry_hint_longer_than_the_lease_still_leaves_the_lease_a_renewal() -> None:
    """A hint of 1,000 s against a 3 s lease: the session does not sit the lease out; it tries again at the last
    moment a renewal still has its answer time (`renewal_wait`)."""
    async with rate_limited_session(FakeClock(), 0.001, lease_ttl=3.0) as (proxy, _):
        await proxy.wait_for(lambda: renewal_refused(proxy) is not None)
        ended = renewal_refused(proxy)
        await proxy.wait_for(lambda: any(at > (ended or 0) for at in proxy.requests["KeepAlive"]))


async def test_a_re_assertion_longer_than_the_lease_keeps_the_new_incarnation_renewed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The keep-alive waited for the whole recovery, so a re-assertion that outlasted the lease (a slow server,
    many transfers) lost the new incarnation's lease: the session registered again, aborting what it had
    re-asserted, round after round, and the Reregistered event carried only the last round's results (found by an
    audit: 14 of 20 targets dropped unreported). It now renews the new incarnation from its registration on.
    The server's clock is a fake one: the lease lapses only when the test moves it."""
    clock = FakeClock()
    renewed, refused = asyncio.Event(), asyncio.Event()
    renew = AsyncKeepAliveStream.renew

    async def renew_and_tell(self: AsyncKeepAliveStream, *args: Any, **kwargs: Any) -> Any:
        try:
            renewal = await renew(self, *args, **kwargs)
        except NotFound:  # the old incarnation, on the restarted server
            refused.set()
            raise
        renewed.set()
        return renewal

    monkeypatch.setattr(AsyncKeepAliveStream, "renew", renew_and_tell)
    config = SessionConfig(reconnect=FAST_SESSION.reconnect, reassert_batch=1)
    async with start_test_server(clock) as server, AsyncRendezvousClient(client_config(server.address)) as client:
        session = ConsumerSession(
            client, "d0", "decode", layout=LAYOUT, agents=[agent("d0-0")], lease_ttl=3.0, config=config
        )
        await session.start()
        try:
            events = session.events()
            await session.register_targets([TargetSpec(f"t{i}", [i]) for i in range(3)])
            held, calls = asyncio.Event(), []
            register_targets = client.register_targets

            async def slow_second_chunk(*args: Any, **kwargs: Any) -> Any:
                calls.append(args)
                if len(calls) == 2:
                    await held.wait()  # the re-assertion's second chunk waits while the lease's time passes
                return await register_targets(*args, **kwargs)

            register_engine = client.register_engine

            async def after_a_refused_renewal(*args: Any, **kwargs: Any) -> Any:
                await asyncio.wait_for(refused.wait(), WAIT)  # the keep-alive meets the recovery first
                return await register_engine(*args, **kwargs)

            monkeypatch.setattr(client, "register_targets", slow_second_chunk)
            monkeypatch.setattr(client, "register_engine", after_a_refused_renewal)
            await server.restart()
            deadline = asyncio.get_running_loop().time() + WAIT
            while len(calls) < 2:
                assert asyncio.get_running_loop().time() < deadline, "the re-assertion never started"
                await asyncio.sleep(0.01)
            incarnation = session.incarnation
            for _ in range(2):  # 4 s in all, past the 3 s lease: it lives only if renewed meanwhile
                renewed.clear()
                clock.advance(2.0)
                await asyncio.wait_for(renewed.wait(), WAIT)
                await server.sweep()
            held.set()
            event = await next_event(events, is_reregistered)
            assert isinstance(event, Reregistered) and event.incarnation == incarnation
            assert sorted(r.transfer_id for r in event.results if r.ok) == ["t0", "t1", "t2"]
        finally:
            await session.close(deregister=False)


async def test_a_late_answer_from_the_epoch_before_a_restart_does_not_register_again(
    server: AsyncTestServer, client: AsyncRendezvousClient, consumer: ConsumerSession
) -> None:
    events = consumer.events()
    before = client.epoch
    await server.restart()
    await next_event(events, is_reregistered)
    incarnation = consumer.incarnation
    # What an answer sent before the restart and received after it does (calls and streams answer out of order):
    client._epochs.observe(before)
    # A call waits for any re-registration under way: it lands on the same incarnation, its target kept.
    await consumer.register_target(TargetSpec("after", [1]))
    assert consumer.incarnation == incarnation
    assert (await client.get_transfer("after")).consumer_incarnation == incarnation
    assert client.epoch == server.epoch != before


async def test_a_call_made_right_after_a_restart_lands_on_the_new_incarnation(
    server: AsyncTestServer, client: AsyncRendezvousClient, consumer: ConsumerSession
) -> None:
    old = consumer.incarnation
    await server.restart()
    result = await consumer.register_target(TargetSpec("t1", [1]))
    assert result.state == TransferState.TARGETED
    transfer = await client.get_transfer("t1")
    assert transfer.consumer_incarnation == consumer.incarnation != old


async def test_a_lost_lease_is_reregistered_and_the_aborted_transfers_are_dropped() -> None:
    # The server's clock stands still: only the deregistration ends the lease. On the wall clock a loaded machine
    # that held up the renewals of this 1 s lease for two thirds of it lost the lease once more, by time: the
    # session registered again after the event, or before the deregistration.
    async with (
        start_test_server(FakeClock()) as server,
        AsyncRendezvousClient(client_config(server.address)) as client,
        consumer_session(client, lease_ttl=1.0) as consumer,
    ):
        events = consumer.events()
        await consumer.register_target(TargetSpec("t1", [1]))
        await client.deregister_engine("d0", consumer.incarnation)

        event = await next_event(events, is_reregistered)
        assert isinstance(event, Reregistered) and event.cause is Reason.LEASE_EXPIRED
        (result,) = event.results
        assert (result.transfer_id, result.state) == ("t1", TransferState.ABORTED)
        assert len(consumer.live_transfers) == 0
        assert (await client.get_engine("d0")).incarnation == consumer.incarnation == event.incarnation


def test_live_transfers_keep_what_was_asserted_until_it_is_over() -> None:
    live = LiveTransfers()
    targets = [TargetSpec("kept", [1]), TargetSpec("over", [2]), TargetSpec("gone", [3]), TargetSpec("bad", [4])]
    results = [
        ItemResult("kept", TransferState.MATCHED),
        ItemResult("over", TransferState.ABORTED),
        ItemResult("gone", TransferState.UNSPECIFIED, FailedPrecondition(Reason.TRANSFER_ENDED, "ended")),
        ItemResult("bad", TransferState.UNSPECIFIED, InvalidArgument(Reason.BLOCK_ID_DUPLICATE, "dup")),
    ]
    live.record(live.targets, targets, results)
    assert list(live.targets) == ["kept"]
    live.record(None, [CompletionSpec("kept", 1)], [ItemResult("kept", TransferState.MATCHED)])
    assert "kept" in live, "a completion that leaves the transfer matched (a revocation) ends nothing"
    live.record(None, [CompletionSpec("kept", 1)], [ItemResult("kept", TransferState.COMMITTED)])
    assert len(live) == 0


def test_live_transfers_end_on_commit_or_abort_events_and_follow_a_resync() -> None:
    live = LiveTransfers()
    live.claims.update({t: ClaimSpec(t) for t in ("a", "b", "c")})
    live.sources["a"] = SourceReadySpec("a", [1])
    committed: ServerEvent = Event(
        EventType.TRANSFER_COMMITTED, 0.0, TransferInfo("a", TransferState.COMMITTED), 1, sequence=1
    )
    live.on_event(committed)
    assert "a" not in live and len(live) == 2
    live.retain(["c"])
    assert list(live.claims) == ["c"]


def test_a_resync_keeps_what_a_call_asserted_while_the_server_s_view_was_read() -> None:
    """A resync lists the engine's transfers page by page while the engine's calls go on: a target registered
    after the listing read its page is missing from it, and `retain` dropped it, so the next incarnation did not
    re-assert it (lost on the next failover)."""
    live = LiveTransfers()
    live.record(live.targets, [TargetSpec("old", [1]), TargetSpec("ended", [2])], [
        ItemResult("old", TransferState.TARGETED), ItemResult("ended", TransferState.TARGETED)
    ])  # fmt: skip
    since = live.records()  # the listing starts
    live.record(live.targets, [TargetSpec("new", [3])], [ItemResult("new", TransferState.TARGETED)])
    live.retain(["old"], since)  # read before "new" was written; "ended" is over on the server
    assert sorted(live.targets) == ["new", "old"]
    live.retain(["old"], live.records())  # a later resync's listing, read after: it decides
    assert sorted(live.targets) == ["old"]


def test_a_result_in_flight_while_an_event_ended_its_transfer_does_not_bring_it_back() -> None:
    live = LiveTransfers()
    before = live.mark()
    committed: ServerEvent = Event(
        EventType.TRANSFER_COMMITTED, 0.0, TransferInfo("a", TransferState.COMMITTED), 1, sequence=1
    )
    live.on_event(committed)
    # MarkSourcesReady answered MATCHED on the server before the commit; its answer arrives after the event.
    live.record(live.sources, [SourceReadySpec("a", [1])], [ItemResult("a", TransferState.MATCHED)], before)
    assert "a" not in live
    # A call sent after the end may assert the id again (a new target under the same id).
    live.record(live.targets, [TargetSpec("a", [2])], [ItemResult("a", TransferState.TARGETED)], live.mark())
    assert list(live.targets) == ["a"]


def test_the_write_fence_leaves_a_renewal_period_for_writes_in_flight_and_room_for_the_next_renewal() -> None:
    assert write_fence(10.0, 3.0, 1 / 3) == pytest.approx(12.0)  # a third of the lease for writes in flight
    assert write_fence(10.0, 10.0, 0.1) == pytest.approx(19.0)  # one renewal period
    assert write_fence(10.0, 10.0, 0.6) == pytest.approx(18.0)  # renewed at 6 s: half of what is left


def test_a_following_rank_s_fence_is_what_the_server_said_is_left_less_the_same_margin() -> None:
    # sent + remaining - margin x TTL, with write_fence's margin: a third, a renewal period, half of what is left.
    assert follow_fence(10.0, 2.5, 3.0, 1 / 3) == pytest.approx(11.5)
    assert follow_fence(10.0, 10.0, 10.0, 1 / 3) == write_fence(10.0, 10.0, 1 / 3)  # a read as fresh as a renewal
    assert follow_fence(10.0, 9.0, 10.0, 0.1) == pytest.approx(18.0)
    assert follow_fence(10.0, 5.0, 10.0, 0.6) == pytest.approx(13.0)
    assert follow_fence(10.0, 2.0, 10.0, 1 / 3) < 10.0  # less left than the margin: closed at once


@pytest.mark.parametrize("fraction", [0.1, 1 / 3, 0.5, 0.9])
def test_a_following_rank_reads_the_lease_before_its_fence_can_pass_while_rank_0_renews(fraction: float) -> None:
    """The least a read finds left is what rank 0's renewal period leaves; the next read goes out one period later
    and has as long again to be answered before that read's fence."""
    ttl, sent = 6.0, 100.0
    least_left = ttl * (1 - fraction)  # rank 0 renews every fraction of the TTL
    period = follow_period(ttl, fraction)
    assert period > 0
    assert sent + 2 * period == pytest.approx(follow_fence(sent, least_left, ttl, fraction))
    assert follow_period(6.0, 1 / 3) == pytest.approx(1.0)  # a sixth of the TTL by default


async def test_the_write_fence_follows_the_lease_and_a_new_incarnation_s_once_its_notification_was_taken(
    client: AsyncRendezvousClient,
) -> None:
    """`writable_until` is the last answered registration's or renewal's send time + 2/3 of the TTL; a lost
    registration closes it, and the new incarnation's lease opens it only once the handler took `Reregistered`
    (until then the engine does not know which of its transfers live on)."""
    loop = asyncio.get_running_loop()
    taken: list[tuple[float, float]] = []  # the fence, and the time, as the handler took Reregistered

    async def handler(item: SessionEvent) -> None:
        if isinstance(item, Reregistered):
            taken.append((session.writable_until, loop.time()))

    session = producer_session(client, lease_ttl=3.0, handler=handler)
    assert session.writable_until == 0.0
    before = loop.time()
    await session.start()
    first = session.writable_until
    assert before + 2.0 <= first <= loop.time() + 2.0
    try:
        await wait_until(lambda: session.writable_until > first, MUST)  # renewed

        await client.deregister_engine("p0", session.incarnation)  # the session learns its lease is gone
        await wait_until(lambda: taken, MUST)
        ((fence, at),) = taken
        assert fence <= at  # closed while the handler looked at what lives on
        await wait_until(lambda: session.writable_until > at, WAIT)  # opened on the new lease, sent before `at`
    finally:
        await session.close()
    assert session.writable_until <= loop.time()
    assert RankSession(client, "p0").writable_until == 0.0  # closed until it read rank 0's lease
    assert RankSession(client, "p0", fenced=False).writable_until == math.inf  # a rank that writes nothing


def answered(proxy: GrpcProxy, watches: int) -> bool:
    return proxy.answers["Watch"] >= watches


async def test_a_watch_ended_right_after_it_opened_is_reopened_ever_later(
    client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """Every Watch opening is answered with a header first. That answer reset the reconnect backoff, so a replica
    or proxy that ends each Watch as soon as it has opened it was retried at the initial backoff (50 ms) for ever.
    Only a batch with events (or a resync), or a stream that lasted the longest backoff, resets it now."""
    reconnect = RetryPolicy(initial_backoff=0.05, max_backoff=60.0)  # no stream here lives long enough to reset it
    async with AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied:
        session = ConsumerSession(
            proxied, "d0", "decode", layout=LAYOUT, agents=[agent("d0-0")], config=SessionConfig(reconnect=reconnect)
        )
        await session.start()
        try:
            for opened in range(1, 7):
                await grpc_proxy.wait_for(functools.partial(answered, grpc_proxy, opened))  # its header came
                assert grpc_proxy.end_streams("Watch") == 1
            await grpc_proxy.wait_for(functools.partial(answered, grpc_proxy, 7))
        finally:
            await session.close()
    opens = grpc_proxy.requests["Watch"]
    # The sixth wait is at least 0.05 s x 2^5, less 20% of jitter: 1.28 s (before: 0.04-0.05 s each time).
    assert opens[6] - opens[5] >= 1.0, [round(b - a, 3) for a, b in itertools.pairwise(opens)]
