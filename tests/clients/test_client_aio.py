"""The asyncio client against a real server over loopback gRPC."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rendezvous.clients import (
    ERROR_DOMAIN,
    AsyncRendezvousClient,
    AsyncWatchStream,
    ClaimSpec,
    ClientConfig,
    CompletionSpec,
    EngineRole,
    EngineSpec,
    EngineView,
    EventType,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    Registration,
    ReleaseSpec,
    RetryPolicy,
    TargetSpec,
    TransferState,
    Unavailable,
    WatchBatch,
)
from rendezvous.clients import _commands as commands
from rendezvous.clients.testing import AsyncTestServer
from tests.clients.conftest import FAST_RETRY, LAYOUT, WAIT, GrpcProxy, agent, client_config, free_port
from tests.factories import sdk_engine


async def register(client: AsyncRendezvousClient, engine_id: str, role: EngineRole, pool: str = "") -> Registration:
    return await client.register_engine(sdk_engine(engine_id, role, **({"pool": pool} if pool else {})))


async def next_batch_with_events(stream: AsyncWatchStream) -> WatchBatch:
    async def read() -> WatchBatch:
        async for batch in stream:
            if batch.events:
                return batch
        raise AssertionError("the watch ended")

    return await asyncio.wait_for(read(), WAIT)


async def test_registration_grants_a_lease_an_incarnation_and_a_watch_start(client: AsyncRendezvousClient) -> None:
    registration = await register(client, "d0", EngineRole.CONSUMER)
    engine = registration.engine
    assert (engine.engine_id, engine.role, engine.layout) == ("d0", EngineRole.CONSUMER, LAYOUT)
    assert engine.agents == (agent("d0-0"),)
    assert engine.incarnation > 0 and engine.lease_ttl == 5.0
    assert registration.watch_start_sequence == 1
    assert registration.epoch == client.epoch != 0


async def test_an_empty_engine_id_is_an_invalid_argument_with_reason_id_empty(client: AsyncRendezvousClient) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await client.register_engine(EngineSpec("", "decode", EngineRole.CONSUMER))
    assert caught.value.reason == "ID_EMPTY"
    assert caught.value.domain == ERROR_DOMAIN
    assert caught.value.metadata == {"field": "engine_id"}


async def test_calls_for_an_unregistered_engine_raise_engine_not_found(client: AsyncRendezvousClient) -> None:
    with pytest.raises(NotFound) as caught:
        await client.register_targets("ghost", [TargetSpec("t", [1])])
    assert caught.value.reason == "ENGINE_NOT_FOUND"


async def test_a_bad_item_fails_alone_and_its_single_item_form_raises(client: AsyncRendezvousClient) -> None:
    d = (await register(client, "d0", EngineRole.CONSUMER)).engine
    good, bad = await client.register_targets(
        "d0", [TargetSpec("t1", [1, 2]), TargetSpec("t2", [3, 3])], incarnation=d.incarnation
    )
    assert good.ok and good.state == TransferState.TARGETED
    assert not bad.ok and isinstance(bad.error, InvalidArgument) and bad.error.reason == "BLOCK_ID_DUPLICATE"
    with pytest.raises(InvalidArgument) as caught:
        await client.register_target("d0", TargetSpec("t3", [4, 4]), incarnation=d.incarnation)
    assert caught.value.reason == "BLOCK_ID_DUPLICATE"
    assert (await client.register_target("d0", TargetSpec("t3", [4]))).state == TransferState.TARGETED


async def test_push_lifecycle_from_target_to_release(client: AsyncRendezvousClient) -> None:
    d = await register(client, "d0", EngineRole.CONSUMER)
    p = await register(client, "p0", EngineRole.PRODUCER)
    async with (
        client.watch("p0", p.watch_start_sequence) as producer_events,
        client.watch("d0", d.watch_start_sequence) as consumer_events,
    ):
        target = TargetSpec("t1", [5, 6], num_tokens=32)
        assert (await client.register_target("d0", target)).state == TransferState.TARGETED
        assert (await client.claim_transfer("p0", ClaimSpec("t1"))).state == TransferState.MATCHED

        (assigned,) = (await next_batch_with_events(producer_events)).events
        assert assigned.type == EventType.TRANSFER_ASSIGNED and assigned.generation == 1
        assert assigned.transfer is not None and assigned.transfer.target_block_ids == (5, 6)
        assert assigned.peer is not None and assigned.peer.agents == (agent("d0-0"),)

        done = await client.complete_transfer("p0", CompletionSpec("t1", 1))
        assert done.state == TransferState.COMMITTED
        (committed,) = (await next_batch_with_events(consumer_events)).events
        assert committed.type == EventType.TRANSFER_COMMITTED

        assert (await client.release_target("d0", ReleaseSpec("t1", 1))).state == TransferState.RELEASED
    transfer = await client.get_transfer("t1")
    assert (transfer.state, transfer.consumer_engine_id, transfer.producer_engine_id) == (
        TransferState.RELEASED,
        "d0",
        "p0",
    )
    assert transfer.times.commit_time >= transfer.times.match_time > 0


async def test_listing_transfers_pages_through_all_of_them(client: AsyncRendezvousClient) -> None:
    await register(client, "d0", EngineRole.CONSUMER)
    await client.register_targets("d0", [TargetSpec(f"t{i}", [i]) for i in range(5)])
    first = await client.list_transfers("d0", page_size=2)
    assert [t.transfer_id for t in first.transfers] == ["t0", "t1"] and first.next_page_token
    listed = [t.transfer_id async for t in client.iter_transfers("d0", page_size=2)]
    assert listed == [f"t{i}" for i in range(5)]
    assert [t async for t in client.iter_transfers("d0", [TransferState.COMMITTED])] == []


async def test_list_engines_filters_by_pool_and_role_and_takes_a_view(
    client: AsyncRendezvousClient,
) -> None:
    await register(client, "d0", EngineRole.CONSUMER)
    await register(client, "p0", EngineRole.PRODUCER)
    await register(client, "p1", EngineRole.PRODUCER, pool="other")
    producers = await client.list_engines("prefill", EngineRole.PRODUCER, view=EngineView.PLACEMENT)
    assert [e.engine_id for e in producers] == ["p0"]
    assert producers[0].agents[0].metadata == b""
    assert [e.engine_id for e in await client.list_engines()] == ["d0", "p0", "p1"]
    assert (await client.get_engine("p1")).agents[0].metadata == b"md-p1-0"


async def test_the_keep_alive_stream_renews_until_the_incarnation_ends(client: AsyncRendezvousClient) -> None:
    d = (await register(client, "d0", EngineRole.CONSUMER)).engine
    async with client.keep_alive() as stream:
        renewal = await stream.renew("d0", d.incarnation)
        assert (renewal.engine_id, renewal.lease_ttl, renewal.epoch) == ("d0", 5.0, client.epoch)
        await client.deregister_engine("d0", d.incarnation)
        with pytest.raises(FailedPrecondition) as caught:
            await stream.renew("d0", d.incarnation)
    assert caught.value.reason == "LEASE_EXPIRED"


async def test_status_counts_engines_and_transfers(client: AsyncRendezvousClient) -> None:
    await register(client, "d0", EngineRole.CONSUMER)
    await client.register_target("d0", TargetSpec("t", [1]))
    status = await client.get_status()
    assert (status.store, status.live_engines, dict(status.transfers_by_state)) == (
        "memory",
        1,
        {TransferState.TARGETED: 1},
    )
    assert status.epoch == client.epoch


async def test_a_retried_mutating_request_gets_the_first_answer(client: AsyncRendezvousClient) -> None:
    spec = sdk_engine("d0", EngineRole.CONSUMER)
    call = commands.register_engine(spec)
    first = await client._invoke(call, None)
    again = await client._invoke(call, None)
    fresh = await client.register_engine(spec)
    assert again.engine.incarnation == first.engine.incarnation
    assert fresh.engine.incarnation > first.engine.incarnation


async def test_answers_carry_the_epoch_and_a_restart_is_reported(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    heard: list[tuple[int, int]] = []
    client.add_epoch_listener(lambda old, new: heard.append((old, new)))
    await client.get_status()
    before = client.epoch
    assert before == server.epoch
    await server.restart()
    await client.get_status()
    assert client.epoch == server.epoch != before
    assert heard == [(before, server.epoch)]


async def test_a_dead_first_endpoint_fails_over_to_the_next(server: AsyncTestServer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    async with AsyncRendezvousClient(client_config(dead, server.address)) as client:
        status = await client.get_status()
        assert status.epoch == server.epoch
        assert client.target == server.address
        registration = await register(client, "d0", EngineRole.CONSUMER)
        assert registration.engine.engine_id == "d0"


async def test_streams_the_server_ends_cleanly_move_the_client_to_its_next_endpoint(
    server: AsyncTestServer, grpc_proxy: GrpcProxy
) -> None:
    """A replica shutting down gracefully (or a proxy's stream timeout) ends a stream with status OK: the Watch's
    iteration ends, a renewal raises Unavailable, and the next stream goes to the next endpoint, as after an
    UNAVAILABLE one."""
    grpc_proxy.drain("Watch")
    grpc_proxy.drain("KeepAlive")
    async with AsyncRendezvousClient(client_config(grpc_proxy.address, server.address)) as client:
        registration = await register(client, "d0", EngineRole.CONSUMER)
        async with client.watch("d0", registration.watch_start_sequence) as stream:
            assert [batch async for batch in stream] == []
        assert client.target == server.address
        async with client.watch("d0", registration.watch_start_sequence) as stream:
            assert (await anext(stream)).events == ()  # established, on the second endpoint

        client._endpoints.failover(1)  # back to the first
        async with client.keep_alive() as renewals:
            with pytest.raises(Unavailable):
                await renewals.renew("d0", registration.engine.incarnation)
        assert client.target == server.address
        async with client.keep_alive() as renewals:
            assert (await renewals.renew("d0", registration.engine.incarnation)).lease_ttl == 5.0


async def test_a_unary_call_ended_without_an_answer_raises_internal(
    server: AsyncTestServer, grpc_proxy: GrpcProxy
) -> None:
    """A proxy that ends a unary call with status OK and no message: gRPC hands the client None, which it read as an
    answer (AttributeError on its header). It is INTERNAL now, not retried (the call may have been applied), and
    the client goes on."""
    async with AsyncRendezvousClient(client_config(grpc_proxy.address)) as client:
        registration = await register(client, "d0", EngineRole.CONSUMER)
        grpc_proxy.drain("GetEngine")
        with pytest.raises(Internal, match="GetEngine ended without an answer"):
            await client.get_engine("d0")
        assert grpc_proxy.calls["GetEngine"] == 1
        await client.deregister_engine("d0", registration.engine.incarnation)


async def test_unavailable_is_raised_once_every_endpoint_failed_the_policy() -> None:
    config = ClientConfig(
        targets=[f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"],
        retry=RetryPolicy(initial_backoff=0.01, max_attempts=4),
    )
    attempts = 0

    def count() -> list[tuple[str, str]]:
        nonlocal attempts
        attempts += 1
        return []

    async with AsyncRendezvousClient(dataclasses.replace(config, metadata_hook=count)) as client:
        with pytest.raises(Unavailable):
            await client.get_status()
    assert attempts == 4


async def test_a_call_made_while_the_server_is_down_succeeds_once_it_is_back(server: AsyncTestServer) -> None:
    attempted_twice = asyncio.Event()
    attempts = 0

    def count() -> list[tuple[str, str]]:
        nonlocal attempts
        attempts += 1
        if attempts >= 2:
            attempted_twice.set()
        return []

    config = ClientConfig(targets=[server.address], retry=FAST_RETRY, metadata_hook=count)
    async with AsyncRendezvousClient(config) as client:
        await server.stop()
        call = asyncio.create_task(client.get_status())
        await asyncio.wait_for(attempted_twice.wait(), WAIT)
        await server.start()
        status = await asyncio.wait_for(call, WAIT)
    assert status.epoch == server.epoch


async def test_cancelling_a_watch_from_another_task_ends_its_iteration(client: AsyncRendezvousClient) -> None:
    await register(client, "d0", EngineRole.CONSUMER)
    stream = client.watch("d0")
    established = asyncio.Event()
    batches: list[WatchBatch] = []

    async def consume() -> None:
        async for batch in stream:
            batches.append(batch)
            established.set()

    reader = asyncio.create_task(consume())
    await asyncio.wait_for(established.wait(), WAIT)
    stream.cancel()
    await asyncio.wait_for(reader, WAIT)
    assert [b.events for b in batches] == [()]
