"""Decode admission credits over gRPC: declared capacity, RegisterTargets refusals, ReserveCredits /
ReleaseCredits, conversion of a reservation into the live target, TTL and lease-end reclamation, bad input.
Real server on 127.0.0.1, memory and Redis stores; the server's time is a fake clock the tests move."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import grpc
import pytest

from rendezvous import cli, pacing
from rendezvous.clients import (
    AbortSpec,
    AsyncRendezvousClient,
    ClaimSpec,
    ConsumerSession,
    CreditSpec,
    EngineCapacity,
    EngineRole,
    EngineSpec,
    TargetSpec,
)
from rendezvous.clients.testing import AsyncTestServer, FakeClock, start_test_server
from rendezvous.core import Limits, Timeouts
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.factories import SDK_LAYOUT, sdk_agent, sdk_engine
from tests.redis_fixtures import fresh_prefix, redis_url, store, with_prefix

__all__ = ["redis_url", "store"]  # the fixtures


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def server(store: str, clock: FakeClock) -> AsyncIterator[AsyncTestServer]:
    timeouts = Timeouts(default_lease_ttl=2, min_lease_ttl=0.5, default_credit_ttl=30)
    limits = Limits(max_capacity_transfers=1000, max_capacity_blocks=1 << 20)
    async with start_test_server(clock, store=store, timeouts=timeouts, limits=limits) as srv:
        yield srv


@pytest.fixture
async def client(server: AsyncTestServer) -> AsyncIterator[AsyncRendezvousClient]:
    async with AsyncRendezvousClient(server.address) as c:
        yield c


def decode(engine_id: str, transfers: int = 0, blocks: int = 0, lease: float = 0.0) -> EngineSpec:
    return sdk_engine(engine_id, EngineRole.CONSUMER, capacity=EngineCapacity(transfers, blocks), lease_ttl=lease)


async def register(client: AsyncRendezvousClient, spec: EngineSpec) -> int:
    return (await client.register_engine(spec)).engine.incarnation


async def test_capacity_is_registered_and_listed(client: AsyncRendezvousClient) -> None:
    await register(client, decode("d0", 4, 64))
    info = await client.get_engine("d0")
    assert info.capacity == EngineCapacity(4, 64)
    assert (info.free_transfers, info.free_blocks) == (4, 64)
    [listed] = [e async for e in client.iter_engines("decode")]
    assert listed.capacity == EngineCapacity(4, 64) and listed.has_credit(64) and not listed.has_credit(65)


async def test_register_target_beyond_capacity_is_refused(client: AsyncRendezvousClient) -> None:
    inc = await register(client, decode("d0", transfers=2, blocks=10))
    first = await client.register_targets("d0", [TargetSpec("t1", [0, 1, 2]), TargetSpec("t2", [3])], incarnation=inc)
    assert all(r.ok for r in first)
    [third] = await client.register_targets("d0", [TargetSpec("t3", [4])], incarnation=inc)
    assert third.error is not None and third.error.reason == "ENGINE_CAPACITY_EXCEEDED"
    assert third.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert third.error.metadata["limit"] == "transfers" and third.error.metadata["max"] == "2"
    # Aborting one gives its credit back.
    await client.abort_transfer("", AbortSpec("t1"))
    [again] = await client.register_targets("d0", [TargetSpec("t3", list(range(4, 14)))], incarnation=inc)
    assert again.error is not None and again.error.metadata["limit"] == "blocks"
    [fits] = await client.register_targets("d0", [TargetSpec("t3", list(range(4, 13)))], incarnation=inc)
    assert fits.ok, fits.error
    info = await client.get_engine("d0")
    assert (info.credits.transfers_in_use, info.credits.blocks_in_use) == (2, 10)


async def test_reservation_converts_into_the_target(client: AsyncRendezvousClient) -> None:
    inc = await register(client, decode("d0", transfers=2))
    [r] = await client.reserve_credits([CreditSpec("t1", "d0", 3)], ttl=30)
    assert r.ok and r.engine_id == "d0" and r.expire_time > 0
    info = await client.get_engine("d0")
    assert (info.credits.transfers_reserved, info.credits.blocks_reserved, info.free_transfers) == (1, 3, 1)
    # Reserving again is idempotent (same engine and blocks); another engine or size is a conflict.
    [same] = await client.reserve_credits([CreditSpec("t1", "d0", 3)])
    assert same.ok
    [other] = await client.reserve_credits([CreditSpec("t1", "d0", 5)])
    assert other.error is not None and other.error.reason == "CREDIT_CONFLICT"
    # The target takes the reservation's place: counted once.
    [t] = await client.register_targets("d0", [TargetSpec("t1", [0, 1, 2])], incarnation=inc)
    assert t.ok
    info = await client.get_engine("d0")
    assert (info.credits.transfers_in_use, info.credits.transfers_reserved, info.free_transfers) == (1, 0, 1)
    [r2] = await client.reserve_credits([CreditSpec("t2", "d0")])
    assert r2.ok
    [r3] = await client.reserve_credits([CreditSpec("t3", "d0")])
    assert r3.error is not None and r3.error.reason == "ENGINE_CAPACITY_EXCEEDED"
    assert r3.error.metadata["reserved"] == "1" and r3.error.metadata["in_use"] == "1"
    # A target without a reservation finds no room either: the reserved one is admitted.
    [unreserved] = await client.register_targets("d0", [TargetSpec("t4", [9])], incarnation=inc)
    assert unreserved.error is not None and unreserved.error.reason == "ENGINE_CAPACITY_EXCEEDED"
    [reserved] = await client.register_targets("d0", [TargetSpec("t2", [9])], incarnation=inc)
    assert reserved.ok


async def test_release_abort_and_ttl_drop_reservations(
    client: AsyncRendezvousClient, server: AsyncTestServer, clock: FakeClock
) -> None:
    await register(client, decode("d0", transfers=1))
    assert (await client.reserve_credits([CreditSpec("t1", "d0")]))[0].ok
    [released] = await client.release_credits(["t1"])
    assert released.ok and released.engine_id == "d0"
    [again] = await client.release_credits(["t1"])
    assert again.ok and again.engine_id == ""  # nothing left to release: still OK
    assert (await client.reserve_credits([CreditSpec("t2", "d0")]))[0].ok
    # The router aborts a transfer no engine took part in yet: its reservation goes.
    await client.abort_transfers("", [AbortSpec("t2", "client went away")])
    assert (await client.get_engine("d0")).free_transfers == 1
    [short] = await client.reserve_credits([CreditSpec("t3", "d0")], ttl=0.2)
    assert short.ok
    assert (await client.reserve_credits([CreditSpec("t4", "d0")]))[0].error is not None
    clock.advance(0.5)
    await server.sweep()
    assert (await client.get_engine("d0")).free_transfers == 1
    assert (await client.reserve_credits([CreditSpec("t4", "d0")]))[0].ok


async def test_lease_end_reclaims_credits(
    client: AsyncRendezvousClient, server: AsyncTestServer, clock: FakeClock
) -> None:
    await register(client, decode("d0", transfers=1, lease=0.5))
    assert (await client.reserve_credits([CreditSpec("t1", "d0")]))[0].ok
    clock.advance(1.2)  # no keep-alive: the engine "crashed"
    await server.sweep()
    [gone] = await client.reserve_credits([CreditSpec("t2", "d0")])
    assert gone.error is not None and gone.error.reason == "ENGINE_NOT_FOUND"
    await register(client, decode("d0", transfers=1))
    assert (await client.get_engine("d0")).free_transfers == 1
    assert (await client.reserve_credits([CreditSpec("t2", "d0")]))[0].ok


async def test_bad_input(client: AsyncRendezvousClient, server: AsyncTestServer) -> None:
    with pytest.raises(Exception) as absurd:
        await register(client, decode("d0", transfers=10_000))
    assert getattr(absurd.value, "reason", "") == "CAPACITY_INVALID"
    with pytest.raises(ValueError):
        decode("d0", transfers=-1)
    with pytest.raises(Exception) as producer_capacity:
        await client.register_engine(sdk_engine("p0", EngineRole.PRODUCER, capacity=EngineCapacity(max_transfers=1)))
    assert getattr(producer_capacity.value, "reason", "") == "CAPACITY_INVALID"
    await client.register_engine(sdk_engine("p0", EngineRole.PRODUCER))
    await register(client, decode("d0", transfers=1))
    results = await client.reserve_credits(
        [
            CreditSpec("t1", "nobody"),
            CreditSpec("t2", "p0"),
            CreditSpec("t3", "d0", blocks=1 << 30),
            CreditSpec("", "d0"),
            CreditSpec("t4", "d0"),
        ]
    )
    reasons = [r.error.reason if r.error else "OK" for r in results]
    assert reasons == ["ENGINE_NOT_FOUND", "WRONG_ROLE", "TOO_MANY_BLOCKS", "ID_EMPTY", "OK"]
    with pytest.raises(Exception) as ttl:
        await client.reserve_credits([CreditSpec("t5", "d0")], ttl=1e9)
    assert getattr(ttl.value, "reason", "") == "TIMEOUT_INVALID"
    # A transfer that already has its target elsewhere has nothing left to reserve.
    await register(client, decode("d1"))
    await client.register_targets("d1", [TargetSpec("t6", [0])])
    [taken] = await client.reserve_credits([CreditSpec("t6", "d0")])
    assert taken.error is not None and taken.error.reason == "TARGET_CONFLICT"
    # Nothing leaked, and the server still serves.
    assert (await client.get_engine("d0")).credits.transfers_reserved == 1
    async with grpc.aio.insecure_channel(server.address) as channel:
        status = await pb_grpc.RendezvousServiceStub(channel).GetStatus(pb.GetStatusRequest())
        assert status.header.epoch


async def test_a_consumer_s_ledger_holds_at_most_max_credits_per_engine(store: str, clock: FakeClock) -> None:
    """Zero-block reservations on a consumer whose capacity limits blocks alone always fit; the ledger's own
    bound stops them (before, a router admitted thousands in one call); a release makes room again."""
    limits = Limits(max_credits_per_engine=3)
    async with start_test_server(clock, store=store, limits=limits) as srv, AsyncRendezvousClient(srv.address) as c:
        await register(c, decode("d0", blocks=100))
        results = await c.reserve_credits([CreditSpec(f"t{i}", "d0") for i in range(5)])
        assert [r.ok for r in results] == [True, True, True, False, False]
        refused = results[3].error
        assert refused is not None and refused.reason == "ENGINE_CAPACITY_EXCEEDED"
        assert refused.metadata["limit"] == "reservations"
        await c.release_credits(["t0"])
        assert (await c.reserve_credits([CreditSpec("t3", "d0")]))[0].ok


async def test_a_reservation_batch_reads_each_reserved_transfer_once_and_yields_between_items(
    server: AsyncTestServer, client: AsyncRendezvousClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each item of a ReserveCredits batch used to read the transfer of every reservation its engine held (2,048
    items held the loop 1-2 s in one step, found by an audit): a batch reads each once, and gives the loop to
    other tasks between items."""
    monkeypatch.setattr(pacing, "QUANTUM", 0.0)  # yield at every chance, so the test needs no timing
    await register(client, decode("d0", blocks=1000))
    coordinator = server.server.coordinator
    reads: list[str] = []
    ticks, seen = [0], []
    original = coordinator.store.get_transfer

    async def get_transfer(transfer_id: str) -> object:
        reads.append(transfer_id)
        seen.append(ticks[0])
        return await original(transfer_id)

    monkeypatch.setattr(coordinator.store, "get_transfer", get_transfer)

    async def tick() -> None:
        while True:
            await asyncio.sleep(0)
            ticks[0] += 1

    ticker = asyncio.create_task(tick())
    try:
        results = await client.reserve_credits([CreditSpec(f"t{i}", "d0") for i in range(100)])
    finally:
        ticker.cancel()
    assert all(r.ok for r in results)
    # Each id read for its own item, then once as a reservation the later items count (the last: no later item).
    assert Counter(reads) == {**{f"t{i}": 2 for i in range(99)}, "t99": 1}
    assert seen[-1] > seen[0]  # other tasks ran while the batch did


async def test_concurrent_reservations_never_overcommit(server: AsyncTestServer) -> None:
    """Several routers (clients) race for the same engine's credit: exactly its capacity wins."""
    clients = [AsyncRendezvousClient(server.address) for _ in range(4)]
    try:
        await register(clients[0], decode("d0", transfers=5))

        async def one(i: int) -> bool:
            [r] = await clients[i % len(clients)].reserve_credits([CreditSpec(f"t{i}", "d0")])
            return r.ok

        won = await asyncio.gather(*(one(i) for i in range(40)))
        assert sum(won) == 5
        assert (await clients[0].get_engine("d0")).credits.transfers_reserved == 5
        # Claims by producers do not spend a reservation: only the consumer's target does.
        await clients[0].register_engine(sdk_engine("p0", EngineRole.PRODUCER))
        winner = next(i for i, ok in enumerate(won) if ok)
        await clients[0].claim_transfers("p0", [ClaimSpec(f"t{winner}")])
        assert (await clients[0].get_engine("d0")).credits.transfers_reserved == 5
    finally:
        for c in clients:
            await c.close()


async def test_a_consumer_session_declares_its_capacity(client: AsyncRendezvousClient) -> None:
    """How the vLLM connector's decode side registers (kv_connector_extra_config max_transfers, max_blocks)."""
    session = ConsumerSession(
        client, "d9", "decode", layout=SDK_LAYOUT, agents=[sdk_agent("d9-0")], capacity=EngineCapacity(3, 300)
    )
    await session.start()
    try:
        assert (await client.get_engine("d9")).capacity == EngineCapacity(3, 300)
    finally:
        await session.close()


async def test_the_engines_command_shows_capacity_and_free_credits(
    client: AsyncRendezvousClient, server: AsyncTestServer, capsys: pytest.CaptureFixture[str]
) -> None:
    inc = await register(client, decode("d0", transfers=4, blocks=100))
    await client.register_engine(sdk_engine("p0", EngineRole.PRODUCER))
    await client.register_targets("d0", [TargetSpec("t1", list(range(10)))], incarnation=inc)
    await client.reserve_credits([CreditSpec("t2", "d0", 5)])
    assert await asyncio.to_thread(cli.main, ["engines", "--address", server.address]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "capacity" in out[0] and "free credits" in out[0]
    d0 = next(line for line in out if line.startswith("d0"))
    assert "4 transfers / 100 blocks" in d0 and "2 transfers (1 reserved) / 85 blocks (5 reserved)" in d0
    p0 = next(line for line in out if line.startswith("p0"))
    assert " -  " in p0


@pytest.mark.redis
async def test_replicas_share_one_ledger(redis_url: str) -> None:
    """Two replicas on one Redis namespace: routers on either never take more than the engine's capacity."""
    url = with_prefix(redis_url, fresh_prefix())
    async with start_test_server(store=url) as one, start_test_server(store=url) as two:
        clients = [AsyncRendezvousClient(one.address), AsyncRendezvousClient(two.address)]
        try:
            await register(clients[0], decode("d0", transfers=3))

            async def attempt(i: int) -> bool:
                [r] = await clients[i % 2].reserve_credits([CreditSpec(f"t{i}", "d0")])
                return r.ok

            assert sum(await asyncio.gather(*(attempt(i) for i in range(30)))) == 3
            for c in clients:
                assert (await c.get_engine("d0")).credits.transfers_reserved == 3
            # A release on one replica is seen by the other.
            held = [f"t{i}" for i in range(30)]
            await clients[1].release_credits(held)
            assert (await clients[0].get_engine("d0")).free_transfers == 3
        finally:
            for c in clients:
                await c.close()


async def test_the_service_counts_credit_items_by_outcome(
    client: AsyncRendezvousClient, server: AsyncTestServer
) -> None:
    await register(client, decode("d0", transfers=1))
    await client.reserve_credits([CreditSpec("t1", "d0"), CreditSpec("t2", "d0")])
    await client.release_credits(["t1"])
    registry = server.server.metrics.registry
    sample = registry.get_sample_value
    labels = {"method": "ReserveCredits", "outcome": "ENGINE_CAPACITY_EXCEEDED"}
    assert sample("kv_rendezvous_credit_items_total", labels) == 1
    assert sample("kv_rendezvous_credit_items_total", {"method": "ReserveCredits", "outcome": "OK"}) == 1
    assert sample("kv_rendezvous_credit_items_total", {"method": "ReleaseCredits", "outcome": "OK"}) == 1
