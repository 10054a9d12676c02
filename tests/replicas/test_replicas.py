"""Replicated servers on one Redis, as real processes: transfers across replicas, a replica killed
mid-traffic, a replica restarted, Redis restarted with AOF, Redis unreachable and Redis losing its data.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from grpc_health.v1 import health_pb2

from rendezvous.clients import (
    NO_RETRY,
    AsyncRendezvousClient,
    ClaimSpec,
    ClientConfig,
    TargetSpec,
    TransferState,
    Unavailable,
)
from tests.redis_fixtures import ControlledRedis, LocalRedis, with_prefix
from tests.replicas.harness import Replica, Workload, client, eventually, health

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Short store time limits, so an unreachable Redis is reported in about a second.
QUICK = "&op_timeout=2&socket_timeout=0.5&ping_timeout=0.5"


@pytest.fixture
def start_replica() -> Iterator[object]:
    """Starts replicas on a given store URL; stops them after the test (after its workloads closed)."""
    started: list[Replica] = []

    def start(store_url: str, name: str) -> Replica:
        replica = Replica(store_url, name)
        started.append(replica)
        replica.start()
        return replica

    yield start
    for replica in started:
        replica.close()


@pytest.fixture
async def workload_of() -> AsyncIterator[object]:
    """Makes Workloads and closes them (and their clients) at the end."""
    made: list[tuple[Workload, list[AsyncRendezvousClient]]] = []

    async def make(consumer_client: AsyncRendezvousClient, producer_client: AsyncRendezvousClient) -> Workload:
        workload = Workload(consumer_client, producer_client)
        made.append((workload, [consumer_client, producer_client]))
        await workload.start()
        return workload

    yield make
    for workload, clients in made:
        await workload.close()
        for c in clients:
            await c.close()


async def test_a_consumer_on_one_replica_and_a_producer_on_the_other_complete_transfers(
    replicas: tuple[Replica, Replica], workload_of: object
) -> None:
    a, b = replicas
    work: Workload = await workload_of(client(a.address), client(b.address))  # type: ignore[operator]
    await work.send(50)
    await eventually(work.done, "every transfer to be released")
    work.check_exactly_once()
    assert not work.reregistered


@pytest.mark.parametrize("victim", ["consumer's replica", "producer's replica"])
async def test_killing_a_replica_mid_traffic_loses_and_repeats_nothing(
    replicas: tuple[Replica, Replica], workload_of: object, victim: str
) -> None:
    a, b = replicas
    # Each side prefers its own replica and fails over to the other.
    work: Workload = await workload_of(client(a.address, b.address), client(b.address, a.address))  # type: ignore[operator]
    traffic = asyncio.create_task(work.send(300))
    await eventually(lambda: sum(work.released.values()) >= 20, "traffic to flow")
    (a if victim == "consumer's replica" else b).kill()
    assert not traffic.done(), "the replica died mid-traffic"
    await traffic
    await eventually(work.done, "every transfer to be released after the failover")
    work.check_exactly_once()
    assert not work.reregistered, "the engines kept their registrations"


async def test_a_restarted_replica_has_lost_nothing(replicas: tuple[Replica, Replica], workload_of: object) -> None:
    a, _ = replicas
    work: Workload = await workload_of(client(a.address), client(a.address))  # type: ignore[operator]
    epoch = work.consumer.epoch
    # Targets registered, not yet claimed: only the store remembers them across the restart.
    pending = [f"pending-{i}" for i in range(20)]
    work.minted.extend(pending)
    await work.consumer.register_targets([TargetSpec(t, (1, 2, 3)) for t in pending])
    a.restart()
    await work.producer.claim_transfers([ClaimSpec(t) for t in pending])
    await work.send(20)
    await eventually(work.done, "every transfer to be released after the restart")
    work.check_exactly_once()
    assert not work.reregistered
    async with client(a.address) as c:
        assert (await c.get_status()).epoch == epoch


async def test_redis_restarted_with_aof_keeps_the_state(
    redis_aof_server: ControlledRedis, start_replica: object, workload_of: object
) -> None:
    replica: Replica = start_replica(with_prefix(redis_aof_server.url, "aof"), "aof")  # type: ignore[operator]
    work: Workload = await workload_of(client(replica.address), client(replica.address))  # type: ignore[operator]
    epoch = work.consumer.epoch
    await work.send(20)
    await eventually(work.done, "the first transfers to be released")
    pending = [f"pending-{i}" for i in range(20)]
    work.minted.extend(pending)
    await work.consumer.register_targets([TargetSpec(t, (1, 2, 3)) for t in pending])
    redis_aof_server.stop()  # SHUTDOWN fsyncs the AOF
    redis_aof_server.start()
    await work.producer.claim_transfers([ClaimSpec(t) for t in pending])
    await eventually(work.done, "the pending transfers to be released after Redis came back")
    work.check_exactly_once()
    assert not work.reregistered
    async with client(replica.address) as c:
        status = await c.get_status()
        released = [t async for t in c.iter_transfers(states=[TransferState.RELEASED])]
    assert status.epoch == epoch
    assert len(released) == 40  # tombstones survived the restart (GetStatus counts live transfers only)


async def test_a_hung_redis_makes_the_replica_not_serving_and_unavailable_until_it_answers(
    redis_server: ControlledRedis, start_replica: object, workload_of: object
) -> None:
    if not isinstance(redis_server, LocalRedis):
        pytest.skip("pausing needs a local redis-server")
    replica: Replica = start_replica(with_prefix(redis_server.url, "hang") + QUICK, "hang")  # type: ignore[operator]
    work: Workload = await workload_of(client(replica.address), client(replica.address))  # type: ignore[operator]
    epoch = work.consumer.epoch
    await work.send(5)
    await eventually(work.done, "the first transfers to be released")
    redis_server.pause()
    try:
        await eventually(lambda: _health_is(replica, NOT_SERVING), "the replica to report NOT_SERVING")
        async with AsyncRendezvousClient(ClientConfig(targets=[replica.address], retry=NO_RETRY)) as raw:
            with pytest.raises(Unavailable) as refused:
                await raw.get_transfer(work.minted[0])
        assert refused.value.reason == "STORE_UNAVAILABLE"
        assert replica.alive()
    finally:
        redis_server.resume()
    await eventually(lambda: _health_is(replica, SERVING), "the replica to serve again")
    await work.send(10)
    await eventually(work.done, "transfers to be released after Redis answered again")
    work.check_exactly_once()
    assert not work.reregistered
    assert work.consumer.epoch == epoch


async def test_redis_losing_its_data_makes_a_new_epoch_and_engines_reregister(
    redis_server: ControlledRedis, start_replica: object, workload_of: object
) -> None:
    replica: Replica = start_replica(with_prefix(redis_server.url, "lost") + QUICK, "lost")  # type: ignore[operator]
    work: Workload = await workload_of(client(replica.address), client(replica.address))  # type: ignore[operator]
    epoch = work.consumer.epoch
    pending = [f"pending-{i}" for i in range(10)]
    work.minted.extend(pending)
    await work.consumer.register_targets([TargetSpec(t, (1, 2, 3)) for t in pending])
    redis_server.stop()  # no persistence: everything is gone
    await eventually(lambda: _health_is(replica, NOT_SERVING), "the replica to report NOT_SERVING")
    assert replica.alive()
    redis_server.start()
    await eventually(lambda: _health_is(replica, SERVING), "the replica to serve again")
    # Both sessions are in the new epoch (a session may re-register twice on the way: once for its lost
    # registration, once for the epoch change; counting exactly two raced that).
    await eventually(
        lambda: len(work.reregistered) >= 2 and epoch != work.consumer.epoch and epoch != work.producer.epoch,
        "both engines to re-register",
    )
    assert all(r.epoch != epoch for r in work.reregistered), work.reregistered
    # The consumer re-asserted its targets; the producer's claims arrive now.
    await work.producer.claim_transfers([ClaimSpec(t) for t in pending])
    await eventually(work.done, "the re-asserted transfers to be released")
    work.check_exactly_once()


async def _health_is(replica: Replica, status: int) -> bool:
    return await health(replica.address) == status
