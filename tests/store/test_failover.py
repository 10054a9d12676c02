"""The Redis store across a master failure: Sentinel promoting a replica after the master is SIGKILLed, a
demoted master that still answers (READONLY), a Sentinel naming a master that is down, Sentinels unreachable at
start-up, a store pointed at a replica, and a Redis Cluster shard whose primary dies. Every failure the store
reports on the way is StoreUnavailableError (the servicer's STORE_UNAVAILABLE, gRPC UNAVAILABLE: retryable);
afterwards it serves again, and what it wrote before is still there or the epoch changed.

Each test owns its Redis processes (local redis-server binaries). Bounds are generous (a loaded 2-core CI
machine): a failover takes about down-after-milliseconds + an election, 2-3 s here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
import redis

from rendezvous.core.model import Role
from rendezvous.store.base import StoreUnavailableError
from rendezvous.store.redis import RedisStore
from tests.redis_fixtures import (
    REDIS_CLI,
    REDIS_SERVER,
    LocalCluster,
    LocalRedis,
    LocalSentinel,
    SentinelTopology,
    free_port,
    wait_until,
    with_prefix,
)
from tests.store.test_contract import make_engine, put_engine

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

RECOVERY_BOUND_S = 60.0
"""How long a store may take to serve again after its master died (measured: 2-3 s on a quiet machine)."""
QUICK = "&op_timeout=2&socket_timeout=0.5&socket_connect_timeout=0.5"


def _needs_redis() -> None:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("needs redis-server and redis-cli binaries (Sentinel and Cluster)")


@pytest.fixture
def topology() -> Iterator[SentinelTopology]:
    """One master, one replica, three Sentinels (quorum 2, master down after 1 s)."""
    _needs_redis()
    topology = SentinelTopology(replicas=1, sentinels=3, quorum=2, down_after_ms=1000, failover_timeout_ms=5000)
    try:
        topology.start()
        yield topology
    finally:
        topology.close()


async def _until_served(call: Callable[[], Awaitable[object]], bound: float = RECOVERY_BOUND_S) -> list[str]:
    """Retry call until it succeeds (within bound); every failure on the way must be StoreUnavailableError.
    Returns the failures' messages."""
    failures: list[str] = []
    deadline = time.monotonic() + bound
    while True:
        try:
            await call()
            return failures
        except StoreUnavailableError as err:
            failures.append(str(err))
        if time.monotonic() > deadline:
            raise AssertionError(f"the store did not serve again within {bound} s: {failures[-5:]}")
        await asyncio.sleep(0.05)


async def test_after_the_master_is_killed_sentinel_promotes_the_replica_and_the_store_serves_again(
    topology: SentinelTopology,
) -> None:
    store = RedisStore(with_prefix(topology.url, "kill") + QUICK)
    await store.open()
    try:
        await put_engine(store, make_engine("before", Role.CONSUMER))
        # The replica has it before the kill (replication is asynchronous: wait, or this test is about loss).
        replica = topology.nodes[1]
        wait_until(lambda: replica.client().exists("{kill}:e:before"), 30, "the replica to have the write")
        epoch = store.epoch
        old = topology.kill_master()
        failures = await _until_served(lambda: put_engine(store, make_engine("after", Role.CONSUMER)))
        new = topology.wait_promoted(old)
        assert new is replica
        assert failures, "a write right after the kill reached no master"
        assert await store.get_engine("before") is not None
        assert await store.get_engine("after") is not None
        assert store.epoch == epoch, "nothing was lost: the epoch stays"
        assert await store.ping()
    finally:
        await store.close()


async def test_a_failover_to_a_replica_that_missed_acknowledged_writes_starts_a_new_epoch(
    topology: SentinelTopology,
) -> None:
    """Asynchronous replication loses what the replica had not received: the store must say so with a new epoch."""
    master, replica = topology.nodes
    store = RedisStore(with_prefix(topology.url, "lag") + QUICK)
    await store.open()
    try:
        await put_engine(store, make_engine("replicated", Role.CONSUMER))
        wait_until(lambda: replica.client().exists("{lag}:e:replicated"), 30, "the replica to have the write")
        epoch = store.epoch
        # The replica stops, and the master drops its link (else the kernel would still buffer what follows
        # for the stopped replica): the master acknowledges alone.
        replica.pause()
        try:
            with master.client() as c:
                c.execute_command("CLIENT", "KILL", "TYPE", "replica")
            await put_engine(store, make_engine("acknowledged", Role.CONSUMER))
            with master.client() as c:
                assert c.exists("{lag}:e:acknowledged")
            old = topology.kill_master()
        finally:
            replica.resume()
        assert topology.wait_promoted(old) is replica
        await _until_served(lambda: put_engine(store, make_engine("after", Role.CONSUMER)))
        assert store.epoch != epoch, "an acknowledged write was lost without a new epoch"
        assert await store.get_engine("acknowledged") is None  # lost, and said so
        assert await store.get_engine("after") is not None
        # A second replica (a restarted one, say) that never saw the lost write joins the new epoch.
        other = RedisStore(with_prefix(topology.url, "lag") + QUICK)
        await other.open()
        try:
            assert other.epoch == store.epoch
        finally:
            await other.close()
    finally:
        await store.close()


async def test_a_hung_master_that_resumes_after_the_failover_gets_no_writes(topology: SentinelTopology) -> None:
    """Split brain: the master hangs (SIGSTOP), a replica is promoted, the old master resumes still claiming to be
    master until Sentinel demotes it. Idle pooled connections to it must not carry writes there (they would be
    acknowledged, then discarded by its resync)."""
    store = RedisStore(with_prefix(topology.url, "split") + QUICK)
    await store.open()
    try:
        # Several idle connections to the master in each pool.
        await asyncio.gather(*(put_engine(store, make_engine(f"c{i}", Role.CONSUMER)) for i in range(16)))
        old = topology.master()
        old.pause()
        try:
            await _until_served(lambda: put_engine(store, make_engine("first", Role.CONSUMER)))
        finally:
            old.resume()  # before Sentinel has told it that it is a replica now
        new = topology.master()
        assert new is not old
        written = [f"after{i}" for i in range(32)]
        for i in range(0, 32, 8):
            await asyncio.gather(*(put_engine(store, make_engine(e, Role.CONSUMER)) for e in written[i : i + 8]))
        epoch = store.epoch
        wait_until(lambda: topology.role(old) == "slave", 60, "the old master to be demoted")
        with new.client() as c:
            missing = [e for e in written if not c.exists(f"{{split}}:e:{e}")]
        assert not missing, f"acknowledged writes landed on the old master and were lost: {missing}"
        assert store.epoch == epoch
    finally:
        await store.close()


async def test_a_demoted_master_that_still_answers_readonly_is_unavailable_until_the_store_finds_the_new_one(
    topology: SentinelTopology,
) -> None:
    store = RedisStore(with_prefix(topology.url, "demoted") + QUICK)
    await store.open()
    try:
        # Connections to the master in the pool, then a failover that leaves the old master up as a replica.
        await asyncio.gather(*(put_engine(store, make_engine(f"c{i}", Role.CONSUMER)) for i in range(8)))
        old = topology.master()
        with topology.sentinels[0].client() as sentinel:
            sentinel.execute_command("SENTINEL", "FAILOVER", topology.service)
        new = topology.wait_promoted(old)
        wait_until(lambda: topology.role(old) == "slave", 60, "the old master to be demoted")
        with old.client() as demoted, pytest.raises(redis.exceptions.ReadOnlyError):
            demoted.set("{demoted}:probe", 1)
        epoch = store.epoch
        # Writes on pooled connections to the demoted master answer READONLY: reported as unavailable, and
        # redis-py's Sentinel pool asks the Sentinels again.
        for i in range(8):
            await _until_served(lambda i=i: put_engine(store, make_engine(f"after{i}", Role.CONSUMER)))  # type: ignore[misc]
        with new.client() as c:
            assert c.exists("{demoted}:e:after7")
        assert await store.get_engine("c0") is not None
        assert store.epoch == epoch
    finally:
        await store.close()


async def test_a_sentinel_naming_a_master_that_is_down_is_store_unavailable() -> None:
    _needs_redis()
    server = LocalRedis(tcp=True)
    server.start()
    sentinel = LocalSentinel(server)  # quorum 1, Sentinel's default 30 s down-after: it keeps naming the dead one
    try:
        store = RedisStore(f"redis+sentinel://127.0.0.1:{sentinel.port}/rdvmaster?prefix=down" + QUICK)
        await store.open()
        try:
            await put_engine(store, make_engine("c", Role.CONSUMER))
            server.kill()
            assert sentinel.master_port() == server.port
            with pytest.raises(StoreUnavailableError):
                await put_engine(store, make_engine("d", Role.CONSUMER))
            with pytest.raises(StoreUnavailableError):
                await store.get_engine("c")
            assert not await store.ping()
        finally:
            await store.close()
        with pytest.raises(StoreUnavailableError):
            await RedisStore(f"redis+sentinel://127.0.0.1:{sentinel.port}/rdvmaster?prefix=down" + QUICK).open()
    finally:
        sentinel.close()
        server.close()


async def test_sentinels_unreachable_at_start_up_are_store_unavailable() -> None:
    nobody = ",".join(f"127.0.0.1:{free_port()}" for _ in range(3))
    store = RedisStore(f"redis+sentinel://{nobody}/rdvmaster?prefix=none" + QUICK)
    with pytest.raises(StoreUnavailableError):
        await store.open()
    with pytest.raises(StoreUnavailableError):
        await store.get_engine("c")


async def test_a_store_pointed_at_a_replica_refuses_writes_as_unavailable(topology: SentinelTopology) -> None:
    """A plain redis:// URL naming a node that is (or became) a replica: READONLY is "not now", not "wrong"."""
    master, replica = topology.nodes
    writer = RedisStore(f"redis://127.0.0.1:{master.port}?prefix=ro" + QUICK)
    await writer.open()
    try:
        await put_engine(writer, make_engine("c", Role.CONSUMER))
    finally:
        await writer.close()
    wait_until(lambda: replica.client().exists("{ro}:e:c"), 30, "the replica to have the write")
    store = RedisStore(f"redis://127.0.0.1:{replica.port}?prefix=ro" + QUICK)
    await store.open()  # the epoch is there to read
    try:
        assert await store.get_engine("c") is not None
        with pytest.raises(StoreUnavailableError, match="read only replica"):
            await put_engine(store, make_engine("d", Role.CONSUMER))
    finally:
        await store.close()


async def test_a_cluster_shard_whose_primary_is_killed_fails_over_and_the_store_serves_again() -> None:
    _needs_redis()
    cluster = LocalCluster(nodes=3, replicas=1, node_timeout_ms=1000)
    try:
        cluster.start()
        store = RedisStore(with_prefix(cluster.url, "shard") + QUICK)
        await store.open()
        try:
            await put_engine(store, make_engine("before", Role.CONSUMER))
            primary = cluster.master_of("{shard}:rev")
            (replica,) = cluster.replicas_of(primary)
            wait_until(lambda: cluster.replica_has(replica, "{shard}:e:before"), 30, "the replica to have it")
            epoch = store.epoch
            cluster.kill(primary)
            failures = await _until_served(lambda: put_engine(store, make_engine("after", Role.CONSUMER)))
            assert cluster.wait_promoted("{shard}:rev", primary) == replica
            assert failures, "a write right after the kill reached no primary"
            assert await store.get_engine("before") is not None
            assert store.epoch == epoch
            pings = [await store.ping() for _ in range(40)]
            assert pings[-1], pings
        finally:
            await store.close()
    finally:
        cluster.close()


async def test_wait_replicas_acknowledges_a_write_once_a_replica_has_it(topology: SentinelTopology) -> None:
    """wait_replicas=1: a write returns once the replica holds it; with the replica hung, writes are unavailable.
    The writes that must be acknowledged wait up to 20 s for the replica (0.2 s was a race with a loaded machine
    scheduling the replica's process); those that must not be, 0.2 s (a hung replica never acknowledges)."""
    replica = topology.nodes[1]
    patient = RedisStore(
        with_prefix(topology.url, "wait") + "&op_timeout=30&socket_timeout=25&wait_replicas=1&wait_timeout=20"
    )
    await patient.open()
    try:
        for i in range(5):
            await put_engine(patient, make_engine(f"c{i}", Role.CONSUMER))
            with replica.client() as c:
                assert c.exists(f"{{wait}}:e:c{i}"), "acknowledged before the replica had it"
    finally:
        await patient.close()
    store = RedisStore(with_prefix(topology.url, "wait") + QUICK + "&wait_replicas=1&wait_timeout=0.2")
    await store.open()
    try:
        replica.pause()
        try:
            with pytest.raises(StoreUnavailableError, match="WAIT"):
                await put_engine(store, make_engine("unreplicated", Role.CONSUMER))
        finally:
            replica.resume()
        await _until_served(lambda: put_engine(store, make_engine("later", Role.CONSUMER)))
        with replica.client() as c:
            assert c.exists("{wait}:e:later")
    finally:
        await store.close()


def test_wait_replicas_is_refused_on_cluster() -> None:
    from rendezvous.store.redis import parse_url

    assert parse_url("redis://h:1?wait_replicas=1&wait_timeout=0.2").options.wait_replicas == 1
    with pytest.raises(ValueError, match="Cluster"):
        parse_url("redis://h:1?cluster=true&wait_replicas=1")
