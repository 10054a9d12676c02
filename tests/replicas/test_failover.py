"""A Redis master failure under load, as a deployment sees it: two `kv-rendezvous serve` replicas on a Sentinel
topology (one master, one replica, three Sentinels, quorum 2) or on a Redis Cluster whose namespace's shard
primary has a replica; transfers flowing; the master SIGKILLed; a replica promoted by Sentinel or the cluster.

Asserted afterwards:
- the service serves again: a lifecycle started after the promotion completes within RECOVERY_BOUND_S;
- no live transfer is left once the engines have finished or aborted what they hold;
- no pinned consumer block: every target the consumer registered was released after its commit, or its
  transfer ended (aborted), or the store forgot it in a new epoch;
- every assignment names the consumer's live incarnation, the one that registered the target;
- no acknowledged write lost without a new epoch: every transfer acknowledged before the kill is still
  known to the store afterwards, unless the epoch changed (and the engines then re-registered);
- without a new epoch, no transfer was assigned, committed or released twice.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from rendezvous.clients import (
    AbortSpec,
    Event,
    EventType,
    RendezvousError,
    Reregistered,
    SessionEvent,
    TransferState,
)
from tests.redis_fixtures import (
    REDIS_CLI,
    REDIS_SERVER,
    LocalCluster,
    LocalRedis,
    SentinelTopology,
    wait_until,
    with_prefix,
)
from tests.replicas.harness import Replica, Workload, client, eventually, two_replicas

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

RECOVERY_BOUND_S = 60.0
"""From the kill to a completed lifecycle (measured 2-4 s on a quiet machine; CI machines have 2 busy cores)."""
SETTLE_S = 60.0
QUICK = "&op_timeout=2&socket_timeout=0.5&socket_connect_timeout=0.5&ping_timeout=0.5"
LIVE = (TransferState.TARGETED, TransferState.CLAIMED, TransferState.MATCHED, TransferState.COMMITTED)


@dataclass
class Topology:
    """A Redis deployment the test can fail: its store URL, how to kill the master, how to see it replaced."""

    name: str
    url: str
    kill_master: Callable[[], object]
    wait_promoted: Callable[[object], object]


def _lose_writes_and_kill_master(sentinel: SentinelTopology) -> LocalRedis:
    """Cut the replica off (SIGSTOP it, the master drops its link), let the master acknowledge writes alone,
    then SIGKILL the master and resume the replica: the one left to promote lacks those writes."""
    master = sentinel.master()
    (replica,) = (n for n in sentinel.nodes if n is not master)
    replica.pause()
    try:
        with master.client() as c:
            c.execute_command("CLIENT", "KILL", "TYPE", "replica")
            start = int(c.get("{ha}:rev") or 0)
        wait_until(lambda: int(master.client().get("{ha}:rev") or 0) >= start + 20, 30, "writes the replica misses")
        master.kill()
    finally:
        replica.resume()
    return master


@pytest.fixture(params=["sentinel", "sentinel-lagging", "cluster"])
def topology(request: pytest.FixtureRequest) -> Iterator[Topology]:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("needs redis-server and redis-cli binaries (Sentinel and Cluster)")
    if request.param.startswith("sentinel"):
        sentinel = SentinelTopology(replicas=1, sentinels=3, quorum=2, down_after_ms=1000, failover_timeout_ms=5000)
        lagging = request.param == "sentinel-lagging"
        try:
            sentinel.start()
            yield Topology(
                request.param,
                with_prefix(sentinel.url, "ha") + QUICK,
                (lambda: _lose_writes_and_kill_master(sentinel)) if lagging else sentinel.kill_master,
                lambda old: sentinel.wait_promoted(old, timeout=RECOVERY_BOUND_S),  # type: ignore[arg-type]
            )
        finally:
            sentinel.close()
    else:
        cluster = LocalCluster(nodes=3, replicas=1, node_timeout_ms=1000)
        try:
            cluster.start()
            key = "{ha}:rev"

            def kill() -> int:
                primary = cluster.master_of(key)
                cluster.kill(primary)
                return primary

            yield Topology(
                "cluster",
                with_prefix(cluster.url, "ha") + QUICK,
                kill,
                lambda old: cluster.wait_promoted(key, old, timeout=RECOVERY_BOUND_S),  # type: ignore[arg-type]
            )
        finally:
            cluster.close()


class FailoverWorkload(Workload):
    """The harness workload, also recording which consumer incarnation each assignment names."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.peers: list[tuple[str, int, int, float]] = []
        """(transfer id, peer incarnation, record's consumer incarnation, when the assignment was made)."""
        self.consumer_ended: dict[int, float] = {}
        """Consumer incarnation -> an upper bound of when it ended (when its successor was reported; inf: live)."""

    async def start(self) -> None:
        await super().start()
        self.consumer_ended[self.consumer.incarnation] = math.inf

    async def _on_consumer_event(self, item: SessionEvent) -> None:
        if isinstance(item, Reregistered):
            self.consumer_ended[item.incarnation] = math.inf
            if item.previous_incarnation in self.consumer_ended:
                self.consumer_ended[item.previous_incarnation] = time.time()
        await super()._on_consumer_event(item)

    async def _on_producer_event(self, item: SessionEvent) -> None:
        if isinstance(item, Event) and item.type == EventType.TRANSFER_ASSIGNED and item.transfer is not None:
            peer = item.peer.incarnation if item.peer is not None else -1
            self.peers.append((item.transfer.transfer_id, peer, item.transfer.consumer_incarnation, item.time))
        await super()._on_producer_event(item)


@pytest.fixture
def replicas(topology: Topology) -> Iterator[tuple[Replica, Replica]]:
    with two_replicas(topology.url) as pair:
        yield pair


async def _send_until_accepted(work: Workload, count: int) -> None:
    """Send transfers, retrying a batch the service refused while Redis failed over."""
    deadline = time.monotonic() + RECOVERY_BOUND_S
    while True:
        try:
            await work.send(count)
            return
        except RendezvousError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_the_service_survives_a_redis_master_failure_under_load(
    topology: Topology, replicas: tuple[Replica, Replica]
) -> None:
    a, b = replicas
    router = client(a.address, b.address)
    engine_clients = client(a.address, b.address), client(b.address, a.address)
    work = FailoverWorkload(*engine_clients)
    try:
        await work.start()
        epoch = work.consumer.epoch
        await work.send(20)
        await eventually(work.done, "the first transfers to be released", timeout=SETTLE_S)
        acknowledged = list(work.minted)

        # Traffic in flight across the kill.
        traffic = asyncio.create_task(work.send(300))
        await eventually(lambda: sum(work.released.values()) >= 40, "traffic to flow", timeout=SETTLE_S)
        assert not traffic.done(), "the master died mid-traffic"
        killed_at = time.monotonic()
        old = await asyncio.to_thread(topology.kill_master)
        await asyncio.gather(traffic, return_exceptions=True)  # batches refused while Redis fails over
        await asyncio.to_thread(topology.wait_promoted, old)
        promoted_s = time.monotonic() - killed_at

        # The service serves again: a lifecycle begun now completes within the bound.
        before = len(work.minted)
        await _send_until_accepted(work, 5)
        after = work.minted[before:]
        await eventually(
            lambda: all(work.released[t] for t in after), "a lifecycle after the failover", timeout=RECOVERY_BOUND_S
        )
        recovered_s = time.monotonic() - killed_at
        assert recovered_s < RECOVERY_BOUND_S + 5

        # Engines finish what they can, then abort what they still hold (as a router would on a lost leg).
        await _wait_quiet(work)
        pending = [t for t in work.minted if not work.released[t]]
        for i in range(0, len(pending), 50):
            await router.abort_transfers("", [AbortSpec(t, "test: lost in the failover") for t in pending[i : i + 50]])

        async def no_live() -> bool:
            return not [t async for t in router.iter_transfers("", LIVE)]

        await eventually(no_live, "no live transfer", timeout=SETTLE_S)

        new_epoch = work.consumer.epoch != epoch or work.producer.epoch != epoch
        if topology.name == "sentinel-lagging":
            assert new_epoch, "the promoted replica lacks acknowledged writes: the service must start a new epoch"
            assert work.consumer.epoch == work.producer.epoch != epoch
        # No acknowledged write lost without a new epoch; no pinned block.
        forgotten = []
        for transfer_id in work.minted:
            if work.released[transfer_id]:
                continue
            try:
                info = await router.get_transfer(transfer_id)
            except RendezvousError as err:
                assert err.reason == "TRANSFER_NOT_FOUND", err
                forgotten.append(transfer_id)
                continue
            assert info.state in (TransferState.ABORTED, TransferState.RELEASED), info
        for transfer_id in acknowledged:
            try:
                await router.get_transfer(transfer_id)
            except RendezvousError as err:
                assert new_epoch, f"{transfer_id} was acknowledged before the kill and lost in the same epoch: {err}"
        if forgotten:
            assert new_epoch, f"the store forgot {len(forgotten)} registered transfers without a new epoch"

        # Assignments name a consumer incarnation that registered (the record's) and was live when the assignment
        # was made: before its successor's registration was reported (after a new epoch the engines re-register;
        # until then the old incarnation is the live one).
        for transfer_id, peer, record, made_at in work.peers:
            assert peer == record, (transfer_id, peer, record)
            assert peer in work.consumer_ended, (transfer_id, peer, work.consumer_ended)
            assert made_at <= work.consumer_ended[peer], (transfer_id, peer, made_at, work.consumer_ended)
        if not new_epoch:
            assert not work.reregistered, work.reregistered
            assert {p for _, p, _, _ in work.peers} == {work.consumer.incarnation}
            for name, seen in (("assigned", work.assigned), ("committed", work.committed), ("released", work.released)):
                twice = {t: n for t, n in seen.items() if n > 1}
                assert not twice, f"{name} twice: {twice}"
        print(
            f"\n{topology.name}: promoted {promoted_s:.2f} s, lifecycle done {recovered_s:.2f} s after the kill; "
            f"{sum(1 for t in work.minted if work.released[t])} released, {len(pending)} aborted, "
            f"{len(forgotten)} forgotten, new epoch: {new_epoch}"
        )
    finally:
        await work.close()
        await router.close()
        for c in engine_clients:
            await c.close()


async def _wait_quiet(work: Workload) -> None:
    """Until no transfer was released for a second (bounded): what can still finish has finished."""
    deadline = time.monotonic() + 20
    last = -1
    while time.monotonic() < deadline:
        now = sum(work.released.values())
        if now == last:
            return
        last = now
        await asyncio.sleep(1.0)
