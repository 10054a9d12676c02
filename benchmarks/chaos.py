"""Chaos under load: two replicas on one Redis, engines doing push transfers, everything failing at random.

    .venv/bin/python benchmarks/chaos.py                      # 180 s, seed 1
    .venv/bin/python benchmarks/chaos.py --seed 2 --duration 60 --rate 40
    .venv/bin/python benchmarks/chaos.py --duration 25 --replica-kills 1 --redis-kills 1   # what the test runs
    .venv/bin/python benchmarks/chaos.py --topology sentinel --master-fault kill --duration 90   # failover
    .venv/bin/python benchmarks/chaos.py --topology cluster --master-fault stop --duration 90

`--topology sentinel` (a master, a replica, three Sentinels, quorum 2) and `--topology cluster` (3 primaries with
a replica each) replace the single Redis: each Redis fault SIGKILLs (`--master-fault kill`) or SIGSTOPs (`stop`)
the namespace's master, waits for a replica to be promoted, and brings the old one back as a replica after its
downtime. The JSON's `failovers` has, per fault: time to promotion, time to the first completed lifecycle,
lifecycles in the next 10 s, revisions the promoted master lacks, and whether the epoch changed.

What runs, all on 127.0.0.1 (the servers as processes, everything else in this one):
- redis-server with AOF (`--redis-fsync`, default `always`: a SIGKILL loses no acknowledged write) on a unix
  socket (`tests/redis_fixtures.py` LocalRedis), and two `kv-rendezvous serve` replicas on random free ports
  sharing it (`tests/replicas/harness.py` Replica);
- `--consumers` decode and `--producers` prefill engines, each an SDK session (ConsumerSession/ProducerSession)
  over its own client listing both replicas (half of the engines prefer each);
- a router minting transfers at `--rate` per second (Poisson). It sends the consumer leg (RegisterTargets) and
  the producer leg (ClaimTransfers) each after its own random delay, so either may come first, and aborts the
  transfer when a leg cannot be delivered;
- producers "write" each TRANSFER_ASSIGNED for a random time, then CompleteTransfers (a few report a failure or
  abort instead). On TRANSFER_REVOKED, or TRANSFER_ABORTED with a revoking_generation, they stop and
  AcknowledgeRevocations after a random drain time (sometimes seconds). Consumers release after
  TRANSFER_COMMITTED; some abort after the assignment, some re-register the target with the next generation
  (preemption) and reuse the old blocks only after REVOCATION_CONFIRMED;
- chaos, on schedules drawn from `--seed`: engines crash (the session is cancelled without DeregisterEngine; a
  fraction restart gracefully, deregistering first) and come back as a new incarnation after a random delay
  (some before their lease lapses, some after); replicas are SIGKILLed and restarted on the same port; Redis is
  SIGKILLed and restarted, a fraction `--redis-wipe-fraction` of the restarts coming back empty (a new epoch:
  every engine re-registers). One infrastructure fault at a time: a replica or Redis is down, never both.

After `--duration` seconds the chaos stops; surviving engines get `--drain-grace` seconds to finish, then abort
what they still hold, and the checks wait at most lease TTL + sweep interval + `--margin` for:
1. no live transfer in the store (ListTransfers of the live states, over all engines);
2. no pinned consumer blocks: every block set a consumer registered was freed by a documented path: released
   after TRANSFER_COMMITTED, TRANSFER_ABORTED without revoking_generation (or with another one),
   REVOCATION_CONFIRMED of its generation, or the end of the consumer process (a crash). A transfer the store
   forgot (TRANSFER_NOT_FOUND after an epoch change) counts as freed, and counted apart;
3. every TRANSFER_ASSIGNED names as `peer` a consumer incarnation that sent RegisterTargets for that
   (transfer, generation), as the consumer's client recorded it (sent, not answered: a crash can lose the answer
   to a call the server applied), the same incarnation the transfer record in the event names, and was made
   (event time) before that incarnation ended: the answer to the next incarnation's registration, or a crash
   plus the lease TTL (+1 s). A lease that lapsed while the process lived is not seen (the SDK does not say
   when), so that check only errs on the lenient side.

Check 3 is the oracle in tests/oracle.py (the engines' clients record into its `Ledger`), where tests own it.
It prints a table, writes `benchmarks/results/chaos-<seed>.json` (`--out`), and exits 1 when an invariant fails.
Each violation comes with the transfer's event sequence as the engines saw it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import io
import json
import logging
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rendezvous.clients import (  # noqa: E402
    AbortSpec,
    AsyncRendezvousClient,
    Cancelled,
    ClaimSpec,
    ClientConfig,
    CompletionOutcome,
    CompletionSpec,
    ConsumerSession,
    EngineSession,
    EngineSpec,
    EventType,
    ItemResult,
    KvRegion,
    NixlAgentInfo,
    ProducerSession,
    Reason,
    Registration,
    ReleaseSpec,
    RendezvousError,
    Reregistered,
    Resynced,
    RevocationAck,
    ServerEvent,
    SessionEvent,
    TargetSpec,
    TransferInfo,
    TransferState,
)
from tests.factories import SDK_LAYOUT as LAYOUT  # noqa: E402
from tests.oracle import Assignment, Ledger  # noqa: E402
from tests.redis_fixtures import REDIS_SERVER, LocalCluster, LocalRedis, SentinelTopology, wait_until, with_prefix  # noqa: E402
from tests.replicas.harness import FAST_RETRY, FAST_SESSION, Replica  # noqa: E402

RESULTS = Path(__file__).parent / "results"
LIVE_STATES = (TransferState.TARGETED, TransferState.CLAIMED, TransferState.MATCHED, TransferState.COMMITTED)
# Quick store limits, so a dead Redis is reported in a second or two rather than five.
STORE_OPTIONS = "&op_timeout=2&ping_timeout=0.5"
CLOSE_TIMEOUT_S = 30.0
"""How long an engine crash waits for EngineSession.close() (it has been seen to hang)."""
TRACE_LIMIT = 25
"""Violations reported with their full event sequence (the rest by id only)."""

log = logging.getLogger("chaos")


@dataclass
class ChaosConfig:
    """Everything a run depends on; the defaults are the 3-minute benchmark."""

    seed: int = 1
    duration: float = 180.0
    consumers: int = 4
    producers: int = 4
    rate: float = 25.0
    lease_ttl: float = 3.0
    sweep_interval: float = 0.05
    crash_every: float = 4.0
    quick_restart_fraction: float = 0.5
    graceful_fraction: float = 0.15
    replica_kill_every: float = 20.0
    replica_kills: int | None = None
    redis_kill_every: float = 30.0
    redis_kills: int | None = None
    redis_fsync: str = "always"
    topology: str = "standalone"
    """standalone: one Redis, SIGKILLed and restarted in place; sentinel: a master, a replica and three
    Sentinels (quorum 2), the master failed and a replica promoted; cluster: 3 primaries with a replica each,
    the namespace's primary failed and its replica promoted."""
    master_fault: str = "kill"
    """How an HA topology's master fails: kill (SIGKILL, restarted as a replica after its downtime), stop
    (SIGSTOP: hung, partitioned; SIGCONT after the promotion and its downtime: it comes back claiming master) or
    lag (the replica is cut off first, SIGSTOP and CLIENT KILL, while the master acknowledges writes alone for
    0.5 s; then the master is SIGKILLed and the replica resumed: the promoted one lacks those writes)."""
    down_after_ms: int = 1000
    store_options: str = ""
    redis_args: str = ""
    """More redis-server arguments for an HA topology's data nodes, e.g. "--min-replicas-to-write 1"."""
    """More store URL options for the replicas, e.g. `&wait_replicas=1` (WAIT after each pipeline)."""
    """Sentinel's down-after-milliseconds, the cluster's cluster-node-timeout."""
    redis_wipe_fraction: float = 0.2
    abort_fraction: float = 0.1
    bump_fraction: float = 0.08
    fail_fraction: float = 0.03
    producer_abort_fraction: float = 0.02
    slow_drain_fraction: float = 0.25
    blocks_per_consumer: int = 512
    drain_grace: float = 10.0
    margin: float = 5.0
    out: Path | None = None
    keep_logs: Path | None = None
    note: str = ""
    quiet: bool = False

    def output(self) -> Path:
        return self.out if self.out is not None else RESULTS / f"chaos-{self.seed}.json"


@dataclass(frozen=True)
class Plan:
    """What the router and the two engines will do with one transfer (drawn when it is minted)."""

    kind: str  # normal | abort (consumer aborts after assignment) | bump (consumer re-registers g+1)
    blocks: int
    consumer_delay: float
    producer_delay: float
    write_time: float
    drain_time: float
    outcome: str  # ok | fail (CompleteTransfers FAILED) | abort (producer aborts instead of completing)
    misbehave_delay: float


class ChaosClient(AsyncRendezvousClient):
    """The client of one engine process: records each registration and each registered target."""

    def __init__(self, config: ClientConfig, ledger: Ledger) -> None:
        super().__init__(config)
        self._ledger = ledger

    async def register_engine(self, spec: EngineSpec, *, timeout: float | None = None) -> Registration:
        registration = await super().register_engine(spec, timeout=timeout)
        self._ledger.registered_engine(registration, time.time())
        return registration

    async def register_targets(
        self, engine_id: str, targets: Sequence[TargetSpec], *, incarnation: int = 0, timeout: float | None = None
    ) -> list[ItemResult]:
        self._ledger.registering_targets(incarnation, targets)
        results = await super().register_targets(engine_id, targets, incarnation=incarnation, timeout=timeout)
        self._ledger.registered_targets(engine_id, incarnation, targets, results)
        return results


# Engines


class Life:
    """One process of an engine: its client, session and tasks. A crash ends it."""

    def __init__(self, client: ChaosClient, ledger: Ledger) -> None:
        self.client = client
        self.ledger = ledger
        self.session: EngineSession | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.alive = True

    @property
    def incarnation(self) -> int:
        return self.session.incarnation if self.session is not None else 0

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run work as this process's task: a crash cancels it; an exception is recorded."""
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if task.cancelled() or task.exception() is None or not self.alive:
            return
        error = task.exception()
        self.ledger.task_errors.append(repr(error)[:300])
        log.error("engine task failed", exc_info=error)


@dataclass
class BlockSet:
    transfer_id: str
    generation: int
    blocks: tuple[int, ...]
    state: str = "in_use"  # in_use | pending | waiting | free (see Consumer)
    done_at: float = 0.0  # monotonic: when the consumer stopped needing these blocks
    incarnation: int = 0  # the consumer incarnation that registered them
    registering: bool = False  # a RegisterTargets for them is in flight: its answer decides their fate


@dataclass
class Held:
    """A transfer as one consumer process sees it."""

    transfer_id: str
    plan: Plan
    sets: dict[int, BlockSet] = field(default_factory=dict)
    confirmed: set[int] = field(default_factory=set)
    generation: int = 1
    over: bool = False
    epoch: int = 0  # the store epoch it was registered in


class ConsumerLife(Life):
    def __init__(self, client: ChaosClient, ledger: Ledger, blocks: int) -> None:
        super().__init__(client, ledger)
        self.free_blocks = list(range(blocks))
        self.held: dict[str, Held] = {}

    def allocate(self, n: int) -> tuple[int, ...] | None:
        if len(self.free_blocks) < n:
            return None
        taken, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        return tuple(taken)


class ProducerLife(Life):
    def __init__(self, client: ChaosClient, ledger: Ledger) -> None:
        super().__init__(client, ledger)
        self.writes: dict[str, tuple[int, asyncio.Task[None]]] = {}


class SimEngine:
    """An engine that crashes and comes back; `life` is its current process (None while down)."""

    role = ""

    def __init__(self, chaos: Chaos, engine_id: str, targets: tuple[str, ...]) -> None:
        self.chaos = chaos
        self.ledger = chaos.ledger
        self.engine_id = engine_id
        self.targets = targets
        self.life: Life | None = None
        self.agent = NixlAgentInfo(
            name=f"{engine_id}-agent", metadata=b"md", regions=(KvRegion(1 << 20, 4096, 4096, 4096),)
        )

    @property
    def up(self) -> bool:
        return self.life is not None and self.life.alive

    def _new_life(self, client: ChaosClient) -> Life:
        raise NotImplementedError

    def _session(self, life: Life) -> EngineSession:
        raise NotImplementedError

    async def start(self) -> bool:
        """Start a new process (a new incarnation); retried while the service is unreachable."""
        config = ClientConfig(targets=self.targets, retry=FAST_RETRY, call_timeout=5.0)
        while not self.chaos.engines_stopped:
            life = self._new_life(ChaosClient(config, self.ledger))
            life.session = self._session(life)
            try:
                await life.session.start()
            except RendezvousError as err:
                self.ledger.count("engine_start_retries")
                log.info("%s did not start: %s", self.engine_id, err)
                life.alive = False
                with contextlib.suppress(Exception):
                    await life.session.close(deregister=False)
                await life.client.close()
                await asyncio.sleep(0.2)
                continue
            self.life = life
            return True
        return False

    async def crash(self, graceful: bool = False, why: str = "") -> None:
        """End the process: abruptly (no DeregisterEngine; the lease runs out) or gracefully."""
        life = self.life
        if life is None:
            return
        self.life = None
        life.alive = False
        incarnation = life.incarnation
        for task in list(life.tasks):
            task.cancel()
        assert life.session is not None
        try:
            await asyncio.wait_for(life.session.close(deregister=graceful), CLOSE_TIMEOUT_S)
        except RendezvousError as err:
            self.ledger.count("graceful_deregister_failed")
            log.info("%s deregistration failed: %s", self.engine_id, err)
        except TimeoutError:
            await self._close_hung(life.session)
        await life.client.close()
        self.ledger.crashed(self.engine_id, incarnation, graceful, self.chaos.config.lease_ttl)
        self._ended(life)
        log.info("%s#%d %s %s", self.engine_id, incarnation, "stopped" if graceful else "crashed", why)

    async def _close_hung(self, session: EngineSession) -> None:
        """EngineSession.close() did not return: record where its tasks are, and cancel them again."""
        self.ledger.count("sdk_close_hung")
        names = ("_keepalive_task", "_watch_task", "_recovery", "_dispatch_task")
        stuck = [t for t in (getattr(session, n, None) for n in names) if isinstance(t, asyncio.Task) and not t.done()]
        for task in stuck:
            stack = io.StringIO()
            task.print_stack(limit=15, file=stack)
            self.ledger.task_errors.append(
                f"{self.engine_id}: EngineSession.close() waited {CLOSE_TIMEOUT_S} s for task {task.get_name()!r}"
                f" (cancelling={task.cancelling()}): {stack.getvalue()}"
            )
            task.cancel()
        if stuck:
            await asyncio.wait(stuck, timeout=5.0)

    def _ended(self, life: Life) -> None:
        """The process is gone: whatever it held is gone with it."""

    async def drain(self) -> None:
        """End what the process still holds, once the chaos stopped and the grace period passed."""

    def _seen(self, life: Life, item: SessionEvent) -> ServerEvent | None:
        """Count a session item; the server event it is, if one."""
        if isinstance(item, Reregistered):
            self.ledger.reregistrations[item.cause] += 1
            self.ledger.count("sdk_reregistrations")
            return None
        if isinstance(item, Resynced):
            self.ledger.count("resyncs")
            return None
        self.ledger.events[item.type.name] += 1
        if item.transfer is not None:
            info = item.transfer
            extra = f" revoking=g{info.revoking_generation}" if info.revoking_generation else ""
            if item.type == EventType.TRANSFER_ABORTED:
                extra += f" reason={info.abort_reason.name}"
            if item.peer is not None:
                extra += (
                    f" peer={item.peer.engine_id}#{item.peer.incarnation} record_consumer#{info.consumer_incarnation}"
                )
            self.ledger.trace(
                info.transfer_id, f"{self.engine_id}#{life.incarnation}", f"{item.type.name} g{item.generation}{extra}"
            )
        return item


class Consumer(SimEngine):
    """A decode engine: registers blocks, releases them after the commit, sometimes aborts or preempts.

    Each block set is in_use, then (once the consumer is done with it) pending while it learns whether the
    producer may still write there, waiting when the service fences it (until REVOCATION_CONFIRMED), free.
    """

    role = "consumer"

    def _new_life(self, client: ChaosClient) -> Life:
        return ConsumerLife(client, self.ledger, self.chaos.config.blocks_per_consumer)

    def _session(self, life: Life) -> EngineSession:
        async def handler(item: SessionEvent) -> None:
            assert isinstance(life, ConsumerLife)
            self._on_event(life, item)

        return ConsumerSession(
            life.client, self.engine_id, "decode", layout=LAYOUT, agents=(self.agent,),
            lease_ttl=self.chaos.config.lease_ttl, config=FAST_SESSION, handler=handler,
        )  # fmt: skip

    def _held(self) -> list[Held]:
        life = self.life
        return list(life.held.values()) if isinstance(life, ConsumerLife) else []

    def pinned(self, ended_incarnations: bool = False) -> list[BlockSet]:
        """Block sets of the live process that are not free, registered by its current incarnation (or not).

        Sets registered by an incarnation that has ended since (the SDK re-registered) count as freed: the
        protocol ties them to that incarnation. They are reported apart.
        """
        life = self.life
        current = life.incarnation if life is not None else 0
        return [
            s
            for h in self._held()
            for s in h.sets.values()
            if s.state != "free" and (s.incarnation != current) == ended_incarnations
        ]

    def unfinished(self) -> list[Held]:
        """Transfers with blocks in use, or whose end the consumer has not learnt yet."""
        return [h for h in self._held() if any(s.state in ("in_use", "pending") for s in h.sets.values())]

    # Block sets

    def _free(self, life: ConsumerLife, bs: BlockSet, path: str) -> None:
        if bs.state == "free":
            return
        waited = time.monotonic() - bs.done_at if bs.done_at else 0.0
        if path != "process_ended":
            self.ledger.waits.append(waited)
            if bs.state == "waiting":
                self.ledger.fenced_waits.append(waited)
            if waited > self.ledger.longest_wait[0]:
                self.ledger.longest_wait = (waited, bs.transfer_id)
        bs.state = "free"
        life.free_blocks.extend(bs.blocks)
        self.ledger.freed[path] += 1
        self.ledger.trace(
            bs.transfer_id, f"{self.engine_id}#{life.incarnation}", f"g{bs.generation} blocks free: {path}"
        )

    def _done(self, bs: BlockSet) -> None:
        """The consumer no longer needs bs; whether the producer may still write there is not known yet."""
        if bs.state == "in_use":
            bs.state = "pending"
            bs.done_at = time.monotonic()

    def _fence(self, life: ConsumerLife, held: Held, bs: BlockSet) -> None:
        """The service fences bs (the producer may be writing): free only on REVOCATION_CONFIRMED."""
        if bs.state == "free":
            return
        bs.done_at = bs.done_at or time.monotonic()
        if bs.generation in held.confirmed:
            self._free(life, bs, "revocation_confirmed")
        elif bs.state != "waiting":
            bs.state = "waiting"
            self.ledger.trace(
                held.transfer_id, f"{self.engine_id}#{life.incarnation}", f"g{bs.generation} waits for confirmation"
            )

    def _end(self, life: ConsumerLife, held: Held, revoking: int, path: str, from_read: bool = False) -> None:
        """The transfer ended: free every block set but the fenced generation's.

        A set the service already fenced (waiting) is freed by an event only, never by a read: a read cannot
        tell a confirmation in flight from one that was lost, and a lost one is what the check looks for.
        """
        held.over = True
        for bs in held.sets.values():
            if bs.registering:
                continue  # the registration may land after this end (a new epoch has no tombstone to refuse it)
            if bs.generation == revoking:
                self._fence(life, held, bs)
            elif not (from_read and bs.state == "waiting"):
                self._free(life, bs, path)

    def _ended(self, life: Life) -> None:
        assert isinstance(life, ConsumerLife)
        for held in life.held.values():
            held.over = True
            for bs in held.sets.values():
                self._free(life, bs, "process_ended")

    # The consumer leg

    async def accept(self, transfer_id: str, plan: Plan) -> bool:
        """The router's decode leg: allocate blocks and register them. False: the router should abort."""
        life = self.life
        if not isinstance(life, ConsumerLife) or not life.alive or life.session is None:
            return False
        blocks = life.allocate(plan.blocks)
        if blocks is None:
            self.ledger.count("legs_refused_no_blocks")
            return False
        held = Held(transfer_id, plan, epoch=life.session.epoch)
        held.sets[1] = BlockSet(transfer_id, 1, blocks)
        life.held[transfer_id] = held
        session = life.session
        assert isinstance(session, ConsumerSession)
        first = held.sets[1]
        first.incarnation, first.registering = session.incarnation, True
        try:
            result = (await session.register_targets([TargetSpec(transfer_id, blocks)]))[0]
            first.incarnation = session.incarnation
        except RendezvousError as err:
            first.registering = False
            if life.alive:  # it may or may not have been registered: the router aborts, the record tells
                self.ledger.count(f"register_call_failed_{err.reason or err.code.name}")
                self.ledger.note(transfer_id, f"RegisterTargets raised {err!r}"[:200])
                self.ledger.trace(transfer_id, self.engine_id, f"RegisterTargets raised {err.reason or err.code}")
                life.spawn(self._settle(life, held))
            return False
        first.registering = False
        if not result.ok:
            self._end(life, held, 0, "not_registered")
            return False
        if result.state.terminal or held.over:
            life.spawn(self._settle(life, held, abort_first=held.over))
        elif plan.kind != "normal":
            life.spawn(self._misbehave(life, held))
        return True

    # Events

    def _on_event(self, life: ConsumerLife, item: SessionEvent) -> None:
        if not life.alive:
            return
        if isinstance(item, Reregistered):
            # The old incarnation's transfers were aborted; those re-asserted (in a new epoch) go on. Events sent
            # to the engine before the new incarnation's watch began are not delivered to it, a confirmation
            # included: like a resync, re-read the transfers with fenced blocks.
            results = {r.transfer_id: r for r in item.results}
            for held in life.held.values():
                result = results.get(held.transfer_id)
                epoch_changed = held.epoch != item.epoch
                if result is not None and result.ok and not result.state.terminal:
                    held.epoch = item.epoch
                elif result is not None and not held.over:
                    life.spawn(self._settle(life, held, resync=True))
                    continue
                if any(bs.state == "waiting" for bs in held.sets.values()):
                    life.spawn(self._recheck(life, held, epoch_changed))
        elif isinstance(item, Resynced):
            live = {t.transfer_id for t in item.transfers if not t.state.terminal}
            for held in life.held.values():
                if held.transfer_id not in live and not held.over:
                    life.spawn(self._settle(life, held))
        event = self._seen(life, item)
        if event is None or event.transfer is None:
            return
        info = event.transfer
        if event.type == EventType.TRANSFER_ABORTED:
            self.ledger.aborted(info.transfer_id, info.abort_reason.name)
        if event.type == EventType.REVOCATION_CONFIRMED:
            self.ledger.count("revocations_confirmed")
        known = life.held.get(info.transfer_id)
        if known is None:
            self.ledger.count("consumer_events_for_unknown_transfers")
            return
        held = known
        match event.type:
            case EventType.TRANSFER_COMMITTED:
                bs = held.sets.get(event.generation)
                if bs is not None and bs.state == "in_use":
                    life.spawn(self._release(life, held, event.generation))
            case EventType.TRANSFER_ABORTED:
                self._end(life, held, info.revoking_generation, "aborted")
            case EventType.REVOCATION_CONFIRMED:
                held.confirmed.add(event.generation)
                bs = held.sets.get(event.generation)
                if bs is not None and bs.state in ("pending", "waiting"):
                    self._free(life, bs, "revocation_confirmed")

    # Actions

    async def _release(self, life: ConsumerLife, held: Held, generation: int) -> None:
        held.over = True
        self._done(held.sets[generation])
        session = life.session
        assert isinstance(session, ConsumerSession)
        result = await _retrying(lambda: session.release_targets([ReleaseSpec(held.transfer_id, generation)]))
        if result is None:
            self.ledger.note(held.transfer_id, "ReleaseTargets kept failing")
            return  # pending: the drain settles it
        who = f"{self.engine_id}#{life.incarnation}"
        self.ledger.trace(held.transfer_id, who, f"ReleaseTargets g{generation} -> {_outcome(result)}")
        if result.ok and result.state == TransferState.RELEASED:
            self.ledger.completed.add(held.transfer_id)
            self.ledger.completed_at.append(time.monotonic())
            self._end(life, held, 0, "released")
        elif result.error is not None and result.error.reason == Reason.TRANSFER_NOT_FOUND:
            self.ledger.count("released_but_forgotten")
            self._end(life, held, 0, "forgotten")
        else:
            await self._settle(life, held)

    async def _misbehave(self, life: ConsumerLife, held: Held) -> None:
        """Abort, or re-register the next generation, once the producer holds the assignment."""
        try:
            await asyncio.wait_for(self.ledger.assigned_signal(held.transfer_id).wait(), timeout=3.0)
        except TimeoutError:
            self.ledger.count(f"{held.plan.kind}_before_assignment")
        await asyncio.sleep(held.plan.misbehave_delay)
        if held.over or not life.alive or held.sets[held.generation].state != "in_use":
            return
        if held.plan.kind == "abort":
            self.ledger.count("consumer_aborts")
            await self._settle(life, held, abort_first=True)
        else:
            await self._bump(life, held)

    async def _bump(self, life: ConsumerLife, held: Held) -> None:
        """Preemption: the request gets new blocks under the next generation; the old ones wait for the fence."""
        blocks = life.allocate(held.plan.blocks)
        if blocks is None:
            self.ledger.count("bumps_skipped_no_blocks")
            return
        old = held.sets[held.generation]
        new = BlockSet(held.transfer_id, held.generation + 1, blocks, incarnation=life.incarnation)
        held.sets[new.generation] = new
        held.generation = new.generation
        session = life.session
        assert isinstance(session, ConsumerSession)
        spec = TargetSpec(held.transfer_id, blocks, generation=new.generation)
        new.registering = True
        try:
            result = (await session.register_targets([spec]))[0]
            new.incarnation = session.incarnation
        except RendezvousError:
            new.registering = False
            if life.alive:
                await self._settle(life, held, abort_first=True)
            return
        new.registering = False
        if held.over and result.ok:
            # The transfer ended (e.g. committed, then forgotten by a new epoch) while this was in flight, and the
            # registration still landed: end what it made, and learn whether the new blocks are fenced.
            self.ledger.count("bumps_landed_after_the_end")
            await self._settle(life, held, abort_first=True)
            return
        if not result.ok:  # committed or ended meanwhile: the old generation stays what it was
            self.ledger.count("bumps_refused")
            held.generation = old.generation
            self._free(life, new, "not_registered")
            return
        if result.state.terminal:
            await self._settle(life, held)
            return
        self.ledger.count("bumps")
        self._done(old)
        info = await self._read(life, held.transfer_id)
        if not isinstance(info, TransferInfo) or old.state != "pending":
            return  # unread: the drain settles it; or confirmed / ended meanwhile
        if info.state.terminal:
            self._end(life, held, info.revoking_generation, "aborted_read", from_read=True)
        elif info.revoking_generation == old.generation:
            self.ledger.count("bumps_fenced")
            self._fence(life, held, old)
        else:
            self._free(life, old, "bump_unfenced")

    async def _read(self, life: ConsumerLife, transfer_id: str) -> TransferInfo | str | None:
        """The transfer record; "forgotten" if the store has none; None if it could not be read."""
        for attempt in range(10):
            if not life.alive:
                return None
            try:
                return await life.client.get_transfer(transfer_id)
            except RendezvousError as err:
                if err.reason == Reason.TRANSFER_NOT_FOUND:
                    return "forgotten"
                await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
        return None

    async def _recheck(self, life: ConsumerLife, held: Held, epoch_changed: bool) -> None:
        """After a re-registration: free the fenced sets whose fence the record no longer shows."""
        info = await self._read(life, held.transfer_id)
        if info is None:
            return
        suffix = "_new_epoch" if epoch_changed else ""
        for bs in held.sets.values():
            if bs.state != "waiting":
                continue
            if info == "forgotten":
                self._free(life, bs, "forgotten_new_epoch" if epoch_changed else "not_found")
            elif isinstance(info, TransferInfo) and info.consumer_engine_id != self.engine_id:
                self._free(life, bs, f"not_in_record{suffix}")
            elif isinstance(info, TransferInfo) and info.revoking_generation != bs.generation:
                self._free(life, bs, f"read_after_reregistration{suffix}")

    async def _settle(self, life: ConsumerLife, held: Held, abort_first: bool = False, resync: bool = False) -> None:
        """Make sure the transfer is over and learn how: abort it if live, then free by its record.

        Blocks are marked done first, then the record is read (as the SDK's ConsumerAgent does): a confirmation
        arriving meanwhile frees them; a record that fences none of them frees them. Sets already fenced wait
        for the confirmation event, unless this follows a re-registration (`resync`: the event may have gone to
        the previous incarnation's log position).
        """
        held.over = True
        for bs in held.sets.values():
            self._done(bs)
        session = life.session
        assert isinstance(session, ConsumerSession)
        who = f"{self.engine_id}#{life.incarnation}"
        for _ in range(5):
            if abort_first:
                result = await _retrying(lambda: session.abort_transfers([AbortSpec(held.transfer_id, "chaos")]))
                self.ledger.trace(
                    held.transfer_id, who, f"AbortTransfers -> {_outcome(result) if result else 'failed'}"
                )
                self.ledger.aborted(held.transfer_id, "REQUESTED")
            info = await self._read(life, held.transfer_id)
            if info is None:
                return  # could not read: pending until the drain settles it again
            new_epoch = session.epoch != held.epoch
            trusted = resync or new_epoch
            if info == "forgotten":
                # Not found in the same epoch: never registered (the leg failed), or the tombstone expired (which
                # confirms by an event); in a new epoch the store lost it, and nothing will ever confirm.
                self._end(life, held, 0, "forgotten_new_epoch" if new_epoch else "not_found", from_read=not trusted)
                return
            assert isinstance(info, TransferInfo)
            self.ledger.trace(
                held.transfer_id, who, f"read {info.state.name} g{info.generation} revoking=g{info.revoking_generation}"
            )
            if info.consumer_engine_id != self.engine_id:
                path = "not_in_record_new_epoch" if new_epoch else "not_registered"
                self._end(life, held, 0, path, from_read=not trusted)
                return
            if info.state.terminal:
                if abort_first and info.revoking_generation:
                    self.ledger.count("consumer_aborts_fenced")
                path = "aborted_read" if info.state == TransferState.ABORTED else "released_read"
                self._end(life, held, info.revoking_generation, path, from_read=not trusted)
                return
            if info.state == TransferState.COMMITTED:
                await self._release(life, held, info.generation)
                return
            abort_first = True  # still live: end it
        self.ledger.count("settle_gave_up")
        self.ledger.note(held.transfer_id, "still live after five aborts")

    async def drain(self) -> None:
        """End what this process still holds (after the grace period)."""
        life = self.life
        if not isinstance(life, ConsumerLife):
            return
        unfinished = self.unfinished()
        self.ledger.count("drain_settles", len(unfinished))
        await asyncio.gather(*(self._settle(life, h, abort_first=True) for h in unfinished))
        # What the session still asserts although this consumer is done with it (a call that landed late).
        session = life.session
        assert session is not None
        leftover = list(session.live_transfers.targets)
        if leftover:
            self.ledger.count("drain_leftover_targets", len(leftover))
            for transfer_id in leftover:
                self.ledger.note(transfer_id, "still asserted by the session at the drain")
            await _retrying(lambda: session.abort_transfers([AbortSpec(t, "chaos: drain") for t in leftover]))


class Producer(SimEngine):
    """A prefill engine: claims, writes what it is assigned, completes; acknowledges revocations after a drain."""

    role = "producer"

    def _new_life(self, client: ChaosClient) -> Life:
        return ProducerLife(client, self.ledger)

    def _session(self, life: Life) -> EngineSession:
        async def handler(item: SessionEvent) -> None:
            assert isinstance(life, ProducerLife)
            self._on_event(life, item)

        return ProducerSession(
            life.client, self.engine_id, "prefill", layout=LAYOUT, agents=(self.agent,),
            lease_ttl=self.chaos.config.lease_ttl, config=FAST_SESSION, handler=handler,
        )  # fmt: skip

    async def claim(self, transfer_id: str) -> bool:
        """The router's prefill leg. False: the router should abort."""
        life = self.life
        if not isinstance(life, ProducerLife) or not life.alive or life.session is None:
            return False
        session = life.session
        assert isinstance(session, ProducerSession)
        try:
            result = (await session.claim_transfers([ClaimSpec(transfer_id)]))[0]
        except RendezvousError as err:
            self.ledger.trace(transfer_id, self.engine_id, f"ClaimTransfers raised {err.reason or err.code}")
            return False
        self.ledger.trace(transfer_id, f"{self.engine_id}#{life.incarnation}", f"ClaimTransfers -> {_outcome(result)}")
        return result.ok and not result.state.terminal

    def _on_event(self, life: ProducerLife, item: SessionEvent) -> None:
        if not life.alive:
            return
        if isinstance(item, Reregistered):
            # The old incarnation's assignments are void: the service took them as stopped.
            for result in item.results:
                if not result.ok or result.state.terminal:
                    self._stop_writing(life, result.transfer_id)
        event = self._seen(life, item)
        if event is None or event.transfer is None:
            return
        info = event.transfer
        match event.type:
            case EventType.TRANSFER_ASSIGNED:
                peer = event.peer
                self.ledger.assignments.append(
                    Assignment(
                        transfer_id=info.transfer_id,
                        generation=event.generation,
                        producer=self.engine_id,
                        producer_incarnation=life.incarnation,
                        consumer=peer.engine_id if peer else info.consumer_engine_id,
                        peer_incarnation=peer.incarnation if peer else 0,
                        record_incarnation=info.consumer_incarnation,
                        made_at=event.time,
                        received_at=time.time(),
                        sequence=event.sequence,
                    )
                )
                self.ledger.assigned_signal(info.transfer_id).set()
                self._stop_writing(life, info.transfer_id)
                task = life.spawn(self._write(life, info.transfer_id, event.generation))
                life.writes[info.transfer_id] = (event.generation, task)
            case EventType.TRANSFER_REVOKED:
                self.ledger.count("revocations_received")
                self._stop_writing(life, info.transfer_id)
                life.spawn(self._acknowledge(life, info.transfer_id, event.generation))
            case EventType.TRANSFER_ABORTED:
                self.ledger.aborted(info.transfer_id, info.abort_reason.name)
                self._stop_writing(life, info.transfer_id)
                if info.revoking_generation:
                    life.spawn(self._acknowledge(life, info.transfer_id, info.revoking_generation))

    def _stop_writing(self, life: ProducerLife, transfer_id: str) -> None:
        write = life.writes.pop(transfer_id, None)
        if write is not None:
            write[1].cancel()

    async def _write(self, life: ProducerLife, transfer_id: str, generation: int) -> None:
        plan = self.chaos.plans[transfer_id]
        try:
            await asyncio.sleep(plan.write_time)
        except asyncio.CancelledError:
            return
        if life.writes.get(transfer_id, (0,))[0] == generation:
            del life.writes[transfer_id]
        session = life.session
        assert isinstance(session, ProducerSession)
        who = f"{self.engine_id}#{life.incarnation}"
        if plan.outcome == "abort":
            result = await _retrying(lambda: session.abort_transfers([AbortSpec(transfer_id, "chaos: producer")]))
            self.ledger.aborted(transfer_id, "REQUESTED")
            self.ledger.count("producer_aborts")
            what = "AbortTransfers"
        else:
            outcome = CompletionOutcome.FAILED if plan.outcome == "fail" else CompletionOutcome.SUCCEEDED
            spec = CompletionSpec(
                transfer_id, generation, outcome, "chaos: write failed" if plan.outcome == "fail" else ""
            )
            result = await _retrying(lambda: session.complete_transfers([spec]))
            what = f"CompleteTransfers g{generation} {outcome.name}"
            if plan.outcome == "fail":
                self.ledger.count("producer_failures")
        self.ledger.trace(transfer_id, who, f"{what} -> {_outcome(result) if result else 'failed'}")

    async def _acknowledge(self, life: ProducerLife, transfer_id: str, generation: int) -> None:
        plan = self.chaos.plans.get(transfer_id)
        await asyncio.sleep(plan.drain_time if plan else 0.0)
        session = life.session
        assert isinstance(session, ProducerSession)
        result = await _retrying(lambda: session.acknowledge_revocations([RevocationAck(transfer_id, generation)]))
        self.ledger.count("revocation_acks")
        outcome = _outcome(result) if result else "failed"
        self.ledger.trace(
            transfer_id, f"{self.engine_id}#{life.incarnation}", f"AcknowledgeRevocations g{generation} -> {outcome}"
        )

    async def drain(self) -> None:
        """Abort the claims this process still holds (a transfer whose consumer is gone or never came)."""
        life = self.life
        if not isinstance(life, ProducerLife) or life.session is None:
            return
        session = life.session
        claims = list(session.live_transfers.claims)
        if not claims:
            return
        self.ledger.count("drain_aborts", len(claims))
        specs = [AbortSpec(t, "chaos: drain") for t in claims]
        for t in claims:
            self.ledger.aborted(t, "REQUESTED")
        await _retrying(lambda: session.abort_transfers(specs))


async def _retrying(call: Callable[[], Awaitable[list[ItemResult]]], attempts: int = 3) -> ItemResult | None:
    """The first item's result of a batched call, retried while the call itself fails (not its item).

    None when it kept failing (the client already retried each attempt for up to its deadline) or the
    session was closed (the engine crashed).
    """
    for attempt in range(attempts):
        try:
            return (await call())[0]
        except Cancelled:
            return None
        except RendezvousError as err:
            log.info("call failed (attempt %d): %s", attempt + 1, err)
            await asyncio.sleep(min(2.0, 0.2 * 2**attempt))
    return None


async def _wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll predicate until it holds or timeout seconds passed (a bounded wait); whether it held."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)
    return True


def _outcome(result: ItemResult) -> str:
    return result.state.name if result.ok else f"error {result.error.reason if result.error else '?'}"


# Highly available Redis: a master that fails and a replica that takes over


@dataclass
class Failover:
    """One master failure and what followed (times in seconds from the fault)."""

    at: float
    fault: str
    old: int
    new: int = 0
    promoted_s: float = math.nan
    first_lifecycle_s: float = math.nan
    last_rev_before: int = 0
    first_rev_after: int = -1
    epoch_before: int = 0
    epoch_after: int = 0
    completed_before: int = 0
    completed_after_10s: int = 0

    @property
    def writes_lost(self) -> int:
        """Revisions the old master had (as last read) that the promoted one did not: a lower bound of the
        acknowledged writes lost (reads every 20 ms see most, not all, of the last ones)."""
        return max(0, self.last_rev_before - self.first_rev_after) if self.first_rev_after >= 0 else 0


class HaRedis:
    """The sentinel or cluster topology of a run: where the namespace's master is, failing it, restoring it."""

    KEY_PREFIX = "{chaos}:"

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.sentinel: SentinelTopology | None = None
        self.cluster: LocalCluster | None = None
        persistence = ("--appendonly", "yes", "--appendfsync", config.redis_fsync, *config.redis_args.split())
        if config.topology == "sentinel":
            self.sentinel = SentinelTopology(
                replicas=1, sentinels=3, quorum=2, down_after_ms=config.down_after_ms,
                failover_timeout_ms=max(3000, 5 * config.down_after_ms), extra=persistence,
            )  # fmt: skip
        elif config.topology == "cluster":
            self.cluster = LocalCluster(nodes=3, replicas=1, node_timeout_ms=config.down_after_ms)
        else:
            raise ValueError(f"topology {config.topology!r}")

    @property
    def url(self) -> str:
        base = self.sentinel.url if self.sentinel is not None else self.cluster.url  # type: ignore[union-attr]
        return with_prefix(base, "chaos")

    def start(self) -> None:
        if self.sentinel is not None:
            self.sentinel.start()
        else:
            assert self.cluster is not None
            self.cluster.start()

    def _client_of(self, port: int) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5)

    def master_port(self) -> int:
        if self.sentinel is not None:
            port = self.sentinel.sentinels[0].master_port()
            assert port is not None
            return port
        assert self.cluster is not None
        return self.cluster.master_of(self.KEY_PREFIX + "rev")

    def read(self, port: int) -> tuple[int, int]:
        """(epoch, revision) as the node on port has them."""
        with self._client_of(port) as c:
            epoch, rev = c.mget(self.KEY_PREFIX + "epoch", self.KEY_PREFIX + "rev")
        return int(epoch or 0), int(rev or 0)

    def cut_replica(self, master: int) -> int:
        """SIGSTOP a replica of master and have the master drop its link; returns the replica's port."""
        if self.sentinel is not None:
            node = next(n for n in self.sentinel.nodes if n.port != master)
            node.pause()
            replica = node.port
        else:
            assert self.cluster is not None
            replica = self.cluster.replicas_of(master)[0]
            self.cluster.kill(replica, pause=True)
        with self._client_of(master) as c:
            c.execute_command("CLIENT", "KILL", "TYPE", "replica")
        return replica

    def resume(self, port: int) -> None:
        if self.sentinel is not None:
            next(n for n in self.sentinel.nodes if n.port == port).resume()
        else:
            assert self.cluster is not None
            self.cluster.resume(port)

    def fail(self, port: int, stop: bool) -> None:
        if self.sentinel is not None:
            node = next(n for n in self.sentinel.nodes if n.port == port)
            if stop:
                node.pause()
            else:
                node.kill()
        else:
            assert self.cluster is not None
            self.cluster.kill(port, pause=stop)

    def wait_promoted(self, old: int, timeout: float = 120.0) -> int:
        if self.sentinel is not None:
            node = next(n for n in self.sentinel.nodes if n.port == old)
            return self.sentinel.wait_promoted(node, timeout).port
        assert self.cluster is not None
        return self.cluster.wait_promoted(self.KEY_PREFIX + "rev", old, timeout)

    def restore(self, old: int, new: int, stopped: bool) -> None:
        """Bring the failed node back: SIGCONT, or restart it as a replica of the new master."""
        if self.sentinel is not None:
            node = next(n for n in self.sentinel.nodes if n.port == old)
            if stopped:
                node.resume()
            else:
                base = _without_replicaof(node.extra)
                node.extra = (*base, "--replicaof", "127.0.0.1", str(new))
                node.start()
        else:
            assert self.cluster is not None
            if stopped:
                self.cluster.resume(old)
            else:
                self.cluster.restart(old)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        """Until the master has a synced replica again (so the next failure can fail over)."""
        if self.sentinel is not None:
            topology = self.sentinel

            def healthy() -> bool:
                master = topology.master()
                return (
                    topology.role(master) == "master"
                    and all(
                        topology.role(n) == "slave" and topology._linked(n) for n in topology.nodes if n is not master
                    )
                    and topology._ready()
                )

            wait_until(healthy, timeout, "the Sentinel topology to have a synced replica again", interval=0.1)
        else:
            assert self.cluster is not None
            cluster = self.cluster
            key = self.KEY_PREFIX + "rev"

            def healthy() -> bool:
                master = cluster.master_of(key)
                replicas = cluster.replicas_of(master)
                return bool(replicas) and all(cluster._ok(p) for p in [master, *replicas])

            wait_until(healthy, timeout, "the cluster shard to have a synced replica again", interval=0.1)

    def logs(self) -> dict[str, Path]:
        found: dict[str, Path] = {}
        if self.sentinel is not None:
            for node in self.sentinel.nodes:
                found[f"redis-{node.port}"] = node.dir / "redis.log"
            for sentinel in self.sentinel.sentinels:
                found[f"sentinel-{sentinel.port}"] = sentinel.dir / "sentinel.log"
        elif self.cluster is not None:
            for port in self.cluster.ports:
                found[f"redis-{port}"] = self.cluster.dir / str(port) / "redis.log"
        return found

    def close(self) -> None:
        if self.sentinel is not None:
            self.sentinel.close()
        if self.cluster is not None:
            self.cluster.close()


def _without_replicaof(args: tuple[str, ...]) -> tuple[str, ...]:
    out: list[str] = []
    skip = 0
    for arg in args:
        if skip:
            skip -= 1
            continue
        if arg == "--replicaof":
            skip = 2
            continue
        out.append(arg)
    return tuple(out)


# The run


class Chaos:
    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.ledger = Ledger()
        self.plans: dict[str, Plan] = {}
        self.redis: LocalRedis | None = None
        self.ha: HaRedis | None = None
        self.failovers: list[Failover] = []
        self.replicas: list[Replica] = []
        self.consumers: list[Consumer] = []
        self.producers: list[Producer] = []
        self.router: AsyncRendezvousClient | None = None
        self.traffic_stopped = False
        self.engines_stopped = False
        self.chaos_stopped = False
        self.routes: set[asyncio.Task[None]] = set()
        self.background: list[asyncio.Task[None]] = []
        self.restarts: set[asyncio.Task[None]] = set()
        self.infra_log: list[str] = []
        self.stopping: asyncio.Event | None = None

    async def _pause(self, seconds: float) -> bool:
        """Sleep, unless the chaos stops first; True when it did (nothing more should start)."""
        assert self.stopping is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), max(0.0, seconds))
        return self.stopping.is_set()

    @property
    def engines(self) -> list[SimEngine]:
        return [*self.consumers, *self.producers]

    # Schedules, drawn up front from the seed

    def _times(self, rng: random.Random, every: float, exact: int | None) -> list[float]:
        duration = self.config.duration
        if exact is not None:
            return sorted(rng.uniform(0.15, 0.75) * duration for _ in range(exact))
        times: list[float] = []
        at = 0.0
        while True:
            at += rng.uniform(0.5, 1.5) * every
            if at > duration - 2.0:
                return times
            times.append(at)

    def infra_schedule(self) -> list[tuple[float, str, int, float, bool]]:
        """(time, "replica" | "redis", which replica, downtime, wipe) sorted by time."""
        rng = random.Random(f"{self.config.seed}-infra")
        c = self.config
        events = [
            (t, "replica", rng.randrange(2), rng.uniform(0.2, 2.0), False)
            for t in self._times(rng, c.replica_kill_every, c.replica_kills)
        ]
        events += [
            (t, "redis", 0, rng.uniform(0.2, 1.5), rng.random() < c.redis_wipe_fraction)
            for t in self._times(rng, c.redis_kill_every, c.redis_kills)
        ]
        return sorted(events)

    def crash_schedule(self) -> list[tuple[float, int, float, bool]]:
        """(time, engine index, restart delay, graceful) sorted by time."""
        rng = random.Random(f"{self.config.seed}-crash")
        c = self.config
        schedule: list[tuple[float, int, float, bool]] = []
        at = 0.0
        while True:
            at += rng.expovariate(1.0 / c.crash_every)
            if at > c.duration - 1.0:
                return schedule
            quick = rng.random() < c.quick_restart_fraction
            delay = rng.uniform(0.05, 0.5) if quick else rng.uniform(c.lease_ttl, 2 * c.lease_ttl)
            schedule.append((at, rng.randrange(c.consumers + c.producers), delay, rng.random() < c.graceful_fraction))

    def plan(self, rng: random.Random) -> Plan:
        c = self.config
        r = rng.random()
        kind = "abort" if r < c.abort_fraction else "bump" if r < c.abort_fraction + c.bump_fraction else "normal"
        r = rng.random()
        outcome = (
            "fail" if r < c.fail_fraction else "abort" if r < c.fail_fraction + c.producer_abort_fraction else "ok"
        )
        slow = rng.random() < c.slow_drain_fraction
        return Plan(
            kind=kind,
            blocks=rng.randint(1, 8),
            consumer_delay=rng.uniform(0.0, 0.3),
            producer_delay=rng.uniform(0.0, 0.3),
            write_time=rng.uniform(0.02, 0.4),
            drain_time=rng.uniform(0.5, 2.0) if slow else rng.uniform(0.0, 0.1),
            outcome=outcome,
            misbehave_delay=rng.uniform(0.0, 0.1),
        )

    # Background tasks

    async def route_traffic(self) -> None:
        rng = random.Random(f"{self.config.seed}-router")
        n = 0
        while not self.traffic_stopped:
            await asyncio.sleep(rng.expovariate(self.config.rate))
            plan = self.plan(rng)
            consumers = [e for e in self.consumers if e.up]
            producers = [e for e in self.producers if e.up]
            if not consumers or not producers:
                self.ledger.count("router_no_engines")
                continue
            consumer, producer = rng.choice(consumers), rng.choice(producers)
            transfer_id = f"chaos{self.config.seed}-{n:06d}"
            n += 1
            self.plans[transfer_id] = plan
            self.ledger.count("transfers_minted")
            task = asyncio.create_task(self.route(transfer_id, plan, consumer, producer))
            self.routes.add(task)
            task.add_done_callback(self.routes.discard)

    async def route(self, transfer_id: str, plan: Plan, consumer: Consumer, producer: Producer) -> None:
        """Both legs at once (each after its delay); abort the transfer when one could not be delivered."""

        async def leg(delay: float, send: Callable[[], Awaitable[bool]]) -> bool:
            await asyncio.sleep(delay)
            return await send()

        self.ledger.trace(
            transfer_id, "router", f"{consumer.engine_id} <- {producer.engine_id} plan={plan.kind}/{plan.outcome}"
        )
        delivered = await asyncio.gather(
            leg(plan.consumer_delay, lambda: consumer.accept(transfer_id, plan)),
            leg(plan.producer_delay, lambda: producer.claim(transfer_id)),
            return_exceptions=True,
        )
        if all(d is True for d in delivered):
            return
        self.ledger.count("router_aborts")
        self.ledger.aborted(transfer_id, "REQUESTED")
        assert self.router is not None
        router = self.router
        result = await _retrying(lambda: router.abort_transfers("", [AbortSpec(transfer_id, "router: a leg failed")]))
        self.ledger.trace(transfer_id, "router", f"AbortTransfers -> {_outcome(result) if result else 'failed'}")

    async def crash_engines(self) -> None:
        start = time.monotonic()
        for at, index, delay, graceful in self.crash_schedule():
            if await self._pause(start + at - time.monotonic()):
                return
            engine = self.engines[index]
            if not engine.up:
                self.ledger.count("crashes_skipped_engine_down")
                continue
            self.ledger.count(f"crashes_{engine.role}")
            self.ledger.count("restarts_graceful" if graceful else "crashes")
            await engine.crash(graceful, "(scheduled)")
            task = asyncio.create_task(self._restart(engine, delay))
            self.restarts.add(task)
            task.add_done_callback(self.restarts.discard)

    async def _restart(self, engine: SimEngine, delay: float) -> None:
        if not await self._pause(delay) and await engine.start():
            self.ledger.count("new_incarnations_after_crash")

    async def break_infrastructure(self) -> None:
        """Replica SIGKILLs and Redis SIGKILLs, one at a time, each restarted after its downtime."""
        start = time.monotonic()
        redis = self.redis
        for at, kind, which, downtime, wipe in self.infra_schedule():
            if await self._pause(start + at - time.monotonic()):
                return
            t = self.ledger.now()
            if kind == "replica":
                replica = self.replicas[which]
                await asyncio.to_thread(replica.kill)
                self.ledger.count("replica_kills")
                await asyncio.sleep(downtime)
                await self._start_replica(replica)
                self.infra_log.append(f"{t:7.2f} SIGKILL replica {replica.name}, restarted after {downtime:.2f} s")
            elif self.ha is not None:
                await self._fail_master(downtime)
            else:
                assert redis is not None
                await asyncio.to_thread(redis.kill)
                self.ledger.count("redis_kills")
                if wipe:
                    shutil.rmtree(redis.dir / "appendonlydir", ignore_errors=True)
                    self.ledger.count("redis_wipes")
                await asyncio.sleep(downtime)
                await asyncio.to_thread(redis.start)
                what = "empty (AOF deleted)" if wipe else "from its AOF"
                self.infra_log.append(f"{t:7.2f} SIGKILL Redis, restarted {what} after {downtime:.2f} s")

    async def _fail_master(self, downtime: float) -> None:
        """Fail the namespace's master (SIGKILL or SIGSTOP), wait for a replica to be promoted, restore the old
        one after its downtime (as a replica) and wait until the new master has a synced replica again."""
        ha = self.ha
        assert ha is not None
        stop = self.config.master_fault == "stop"
        lag = self.config.master_fault == "lag"
        old = await asyncio.to_thread(ha.master_port)
        cut = await asyncio.to_thread(ha.cut_replica, old) if lag else 0
        epoch_before, rev_before = await asyncio.to_thread(ha.read, old)
        # Sample the master's revision until the fault: the last read is what it had acknowledged (or nearly).
        sampling = True

        async def sample() -> None:
            nonlocal rev_before, epoch_before
            while sampling:
                with contextlib.suppress(Exception):
                    epoch_before, rev_before = await asyncio.to_thread(ha.read, old)
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        await asyncio.sleep(0.5)
        sampling = False
        await sampler
        failover = Failover(
            at=self.ledger.now(), fault="SIGSTOP" if stop else "SIGKILL after lag" if lag else "SIGKILL", old=old,
            last_rev_before=rev_before, epoch_before=epoch_before, completed_before=len(self.ledger.completed_at),
        )  # fmt: skip
        fault_time = time.monotonic()
        await asyncio.to_thread(ha.fail, old, stop)
        if lag:
            await asyncio.to_thread(ha.resume, cut)
        self.ledger.count("redis_kills")
        self.ledger.count("master_stops" if stop else "master_kills")
        self.failovers.append(failover)
        failover.new = await asyncio.to_thread(ha.wait_promoted, old)
        failover.promoted_s = time.monotonic() - fault_time
        with contextlib.suppress(Exception):
            _, failover.first_rev_after = await asyncio.to_thread(ha.read, failover.new)
        await asyncio.sleep(downtime)
        await asyncio.to_thread(ha.restore, old, failover.new, stop)
        await asyncio.to_thread(ha.wait_healthy)
        with contextlib.suppress(Exception):
            failover.epoch_after, _ = await asyncio.to_thread(ha.read, await asyncio.to_thread(ha.master_port))
        self.infra_log.append(
            f"{failover.at:7.2f} {failover.fault} master {old}: {failover.new} promoted after "
            f"{failover.promoted_s:.2f} s; old one back as a replica after {downtime:.2f} s more"
        )

    def _failover_report(self) -> list[dict[str, Any]]:
        done = self.ledger.completed_at
        t0 = time.monotonic() - (time.time() - self.ledger.t0)  # ledger.now() 0 in monotonic time
        report = []
        for f in self.failovers:
            fault_time = t0 + f.at
            after = [t for t in done if t > fault_time]
            f.first_lifecycle_s = round(after[0] - fault_time, 3) if after else math.nan
            f.completed_after_10s = sum(1 for t in after if t <= fault_time + 10.0)
            row = asdict(f)
            row["writes_lost"] = f.writes_lost
            row["new_epoch"] = f.epoch_after != f.epoch_before
            row["lost_without_new_epoch"] = f.writes_lost > 0 and f.epoch_after == f.epoch_before
            row["promoted_s"] = round(f.promoted_s, 3)
            report.append(row)
        return report

    async def _start_replica(self, replica: Replica) -> None:
        for attempt in range(5):
            try:
                await asyncio.to_thread(replica.start)
                return
            except RuntimeError as err:
                self.ledger.count("replica_start_failures")
                log.warning("replica %s did not start (attempt %d): %s", replica.name, attempt + 1, str(err)[-500:])
                await asyncio.sleep(0.5)
        raise RuntimeError(f"replica {replica.name} did not start five times")

    async def watch_sessions(self) -> None:
        """An SDK session that stopped itself is a finding; restart its engine so the run goes on."""
        while not self.engines_stopped:
            await asyncio.sleep(0.5)
            for engine in self.engines:
                life = engine.life
                if life is not None and life.session is not None and life.session.failure is not None:
                    failure = life.session.failure
                    self.ledger.count("sdk_session_failures")
                    self.ledger.task_errors.append(f"{engine.engine_id} session stopped: {failure!r}"[:300])
                    await engine.crash(False, f"(session failed: {failure})")
                    if not self.chaos_stopped:
                        await engine.start()

    # Checks

    async def live_transfers(self) -> list[TransferInfo]:
        assert self.router is not None
        return [t async for t in self.router.iter_transfers("", LIVE_STATES)]

    def pinned(self) -> list[BlockSet]:
        return [bs for c in self.consumers for bs in c.pinned()]

    async def settled(self) -> tuple[list[TransferInfo], list[BlockSet]]:
        try:
            live = await self.live_transfers()
        except RendezvousError as err:
            log.warning("cannot list transfers: %s", err)
            live = [TransferInfo("?", TransferState.UNSPECIFIED)]
        return live, self.pinned()

    # The whole run

    async def run(self) -> dict[str, Any]:
        c = self.config
        started = time.time()
        load_before = os.getloadavg()
        if c.topology == "standalone":
            self.redis = LocalRedis(appendonly=True, extra=("--appendfsync", c.redis_fsync))
            await asyncio.to_thread(self.redis.start)
            url = with_prefix(self.redis.url, "chaos") + STORE_OPTIONS
        else:
            self.ha = HaRedis(c)
            await asyncio.to_thread(self.ha.start)
            url = self.ha.url + STORE_OPTIONS + c.store_options
        extra = ("--sweep-interval", str(c.sweep_interval))
        self.replicas = [Replica(url, "a", extra), Replica(url, "b", extra)]
        try:
            for replica in self.replicas:
                await self._start_replica(replica)
            a, b = (r.address for r in self.replicas)
            self.router = AsyncRendezvousClient(ClientConfig(targets=(a, b), retry=FAST_RETRY, call_timeout=5.0))
            for i in range(c.consumers):
                self.consumers.append(Consumer(self, f"decode-{i}", (a, b) if i % 2 == 0 else (b, a)))
            for i in range(c.producers):
                self.producers.append(Producer(self, f"prefill-{i}", (b, a) if i % 2 == 0 else (a, b)))
            await asyncio.gather(*(e.start() for e in self.engines))
            self.ledger.t0 = time.time()
            self.stopping = asyncio.Event()
            chaos_start = time.monotonic()
            self.background = [
                asyncio.create_task(self.route_traffic()),
                asyncio.create_task(self.crash_engines()),
                asyncio.create_task(self.break_infrastructure()),
                asyncio.create_task(self.watch_sessions()),
            ]
            self._say(f"chaos for {c.duration:.0f} s (seed {c.seed})")
            await asyncio.sleep(c.duration)
            return await self._finish(started, chaos_start, load_before)
        finally:
            await self._close()

    async def _finish(self, started: float, chaos_start: float, load_before: tuple[float, ...]) -> dict[str, Any]:
        c = self.config
        # 1. Stop: no new transfers, crashes or faults; a fault in progress is repaired, a crash in progress ends,
        #    engines that are down stay down.
        self.traffic_stopped = True
        self.chaos_stopped = True
        assert self.stopping is not None
        self.stopping.set()
        router, crasher, infra, watcher = self.background
        router.cancel()
        await asyncio.gather(router, return_exceptions=True)
        await self._bounded("crash scheduler", [crasher], 60.0)
        await self._bounded("infrastructure faults", [infra], 120.0)
        if infra.done() and not infra.cancelled() and infra.exception() is not None:
            raise infra.exception()  # type: ignore[misc]
        await self._bounded("engine restarts", list(self.restarts), 30.0)
        chaos_s = time.monotonic() - chaos_start
        await self._bounded("routed transfers", list(self.routes), 60.0)
        # 2. Surviving engines finish (bounded), then abort what they still hold.
        self._say("draining")
        await _wait_until(lambda: not any(e.unfinished() for e in self.consumers), c.drain_grace)
        await asyncio.gather(*(e.drain() for e in self.engines))
        # 3. Wait (bounded) for leases of crashed engines to lapse and the sweepers to end their transfers.
        wait_s = c.lease_ttl + c.sweep_interval + c.margin
        deadline = time.monotonic() + wait_s
        live, pinned = await self.settled()
        while (live or pinned) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            live, pinned = await self.settled()
        self.engines_stopped = True
        watcher.cancel()
        return await self._report(started, chaos_s, load_before, live, pinned, wait_s)

    async def _bounded(self, what: str, tasks: Sequence[asyncio.Task[None]], timeout: float) -> None:
        """Wait for tasks at most timeout seconds; cancel the stragglers, recording where they were."""
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        if not pending:
            return
        self.ledger.count(f"stuck_{what.replace(' ', '_')}", len(pending))
        for task in pending:
            stack = io.StringIO()
            task.print_stack(limit=12, file=stack)
            self.ledger.task_errors.append(f"{what}: still running after {timeout} s, cancelled: {stack.getvalue()}")
            task.cancel()
        await asyncio.wait(pending, timeout=10.0)

    async def _report(
        self,
        started: float,
        chaos_s: float,
        load_before: tuple[float, ...],
        live: list[TransferInfo],
        pinned: list[BlockSet],
        wait_s: float,
    ) -> dict[str, Any]:
        c, ledger = self.config, self.ledger
        assert self.router is not None
        status = None
        server_aborts: Counter[str] = Counter()
        try:
            status = await self.router.get_status()
            async for t in self.router.iter_transfers("", (TransferState.ABORTED,)):
                server_aborts[t.abort_reason.name] += 1
        except RendezvousError as err:
            log.warning("cannot read the final status: %s", err)
        records: dict[str, str] = {}
        for transfer_id in sorted({bs.transfer_id for bs in pinned})[:TRACE_LIMIT]:
            try:
                records[transfer_id] = repr(await self.router.get_transfer(transfer_id))
            except RendezvousError as err:
                records[transfer_id] = f"{err.reason or err.code}"
        bad_assignments = ledger.assignment_violations()
        ended = [bs for consumer in self.consumers for bs in consumer.pinned(ended_incarnations=True)]
        violating = [t.transfer_id for t in live] + [bs.transfer_id for bs in pinned]
        violating += [v["transfer_id"] for v in bad_assignments]
        traces = {t: ledger.traces.get(t, []) for t in list(dict.fromkeys(violating))[:TRACE_LIMIT]}
        waits = sorted(ledger.waits)
        invariants = {
            "no_live_transfers": {
                "ok": not live,
                "live": [{"transfer_id": t.transfer_id, "state": t.state.name, "record": repr(t)} for t in live],
            },
            "no_pinned_blocks": {
                "ok": not pinned,
                "pinned": [
                    {
                        "transfer_id": bs.transfer_id,
                        "generation": bs.generation,
                        "state": bs.state,
                        "waited_s": round(time.monotonic() - bs.done_at, 3) if bs.done_at else None,
                        "record": records.get(bs.transfer_id),
                    }
                    for bs in pinned
                ],
                "not_free_but_their_incarnation_ended": [
                    {"transfer_id": bs.transfer_id, "generation": bs.generation, "state": bs.state} for bs in ended
                ],
            },
            "assignments_name_live_registering_incarnation": {
                "ok": not bad_assignments,
                "checked": len(ledger.assignments),
                "violations": bad_assignments,
            },
        }
        counts = {
            "transfers_minted": ledger.counts["transfers_minted"],
            "lifecycles_completed": len(ledger.completed),
            "aborts_by_reason": dict(Counter(ledger.abort_reasons.values()).most_common()),
            "server_aborted_by_reason": dict(server_aborts.most_common()),
            "crashes": ledger.counts["crashes"],
            "graceful_restarts": ledger.counts["restarts_graceful"],
            "crashes_by_role": {r: ledger.counts[f"crashes_{r}"] for r in ("consumer", "producer")},
            "reregistrations": {
                "new_incarnations_after_crash": ledger.counts["new_incarnations_after_crash"],
                "sdk": dict(ledger.reregistrations),
            },
            "replica_kills": ledger.counts["replica_kills"],
            "redis_kills": ledger.counts["redis_kills"],
            "redis_wipes": ledger.counts["redis_wipes"],
            "epochs_seen": len(ledger.epochs),
            "revocations_confirmed": ledger.counts["revocations_confirmed"],
            "sdk_session_failures": ledger.counts["sdk_session_failures"],
            "sdk_close_hung": ledger.counts["sdk_close_hung"],
            "events_seen": sum(ledger.events.values()),
            "events_by_type": dict(ledger.events.most_common()),
            "assignments": len(ledger.assignments),
            "consumer_aborts": ledger.counts["consumer_aborts"],
            "consumer_aborts_fenced": ledger.counts["consumer_aborts_fenced"],
            "bumps": ledger.counts["bumps"],
            "bumps_fenced": ledger.counts["bumps_fenced"],
            "max_block_wait_s": round(waits[-1], 3) if waits else 0.0,
            "p99_block_wait_s": round(waits[int(0.99 * (len(waits) - 1))], 3) if waits else 0.0,
            "max_fenced_block_wait_s": round(max(ledger.fenced_waits, default=0.0), 3),
            "blocks_freed_by_path": dict(ledger.freed.most_common()),
            "other": {k: v for k, v in sorted(ledger.counts.items())},
        }
        result = {
            "benchmark": "chaos",
            "seed": c.seed,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(c).items()},
            "ok": all(v["ok"] for v in invariants.values()),
            "invariants": invariants,
            "counts": counts,
            "final_status": None if status is None else {
                "epoch": status.epoch,
                "live_engines": status.live_engines,
                "transfers_by_state": dict(status.transfers_by_state),
            },
            "timing": {
                "chaos_s": round(chaos_s, 1),
                "final_wait_bound_s": round(wait_s, 2),
                "total_s": round(time.time() - started, 1),
            },
            "infrastructure_events": self.infra_log,
            "failovers": self._failover_report(),
            "engine_task_errors": ledger.task_errors[:50],
            "replica_log_errors": self._replica_errors(),
            "traces": traces,
            "notable": {
                t: {"why": why, "trace": ledger.traces.get(t, [])} for t, why in list(ledger.notable.items())[:10]
            },
            "longest_block_wait": {
                "transfer_id": ledger.longest_wait[1],
                "waited_s": round(ledger.longest_wait[0], 3),
                "trace": ledger.traces.get(ledger.longest_wait[1], []),
            },
            "incarnations": {
                engine: [
                    [i.incarnation, i.epoch, round(i.register_time - ledger.t0, 3), round(i.ended_by - ledger.t0, 3)
                     if i.ended_by < math.inf else None, i.how]
                    for i in sorted(known.values(), key=lambda i: i.incarnation)
                ]
                for engine, known in sorted(ledger.incarnations.items())
            },
            "machine": _machine(load_before),
        }  # fmt: skip
        return result

    def _replica_errors(self) -> dict[str, Any]:
        """ERROR lines and tracebacks the replicas logged (their logs are deleted when the run ends)."""
        found: dict[str, Any] = {}
        for replica in self.replicas:
            try:
                lines = replica.log.read_text(errors="replace").splitlines()
            except FileNotFoundError:
                continue
            errors = [line for line in lines if " ERROR " in line or " CRITICAL " in line]
            messages = Counter(line.split(": ", 1)[-1][:160] for line in errors)
            found[replica.name] = {
                "error_lines": len(errors),
                "tracebacks": sum(1 for line in lines if line.startswith("Traceback")),
                "warning_lines": sum(1 for line in lines if " WARNING " in line),
                "top_errors": dict(messages.most_common(10)),
            }
        return found

    async def _close(self) -> None:
        self.traffic_stopped = self.chaos_stopped = self.engines_stopped = True
        for task in [*self.background, *self.routes, *self.restarts]:
            task.cancel()
        await asyncio.gather(*self.background, *self.routes, *self.restarts, return_exceptions=True)
        for engine in self.engines:
            with contextlib.suppress(Exception):
                await engine.crash(False, "(end of run)")
        if self.router is not None:
            await self.router.close()
        for replica in self.replicas:
            if self.config.keep_logs is not None and replica.log.exists():
                self.config.keep_logs.mkdir(parents=True, exist_ok=True)
                shutil.copy(replica.log, self.config.keep_logs / f"chaos-{self.config.seed}-replica-{replica.name}.log")
            replica.close()
        if self.ha is not None:
            if self.config.keep_logs is not None:
                for name, path in self.ha.logs().items():
                    if path.exists():
                        shutil.copy(path, self.config.keep_logs / f"chaos-{self.config.seed}-{name}.log")
            self.ha.close()
        if self.redis is not None:
            if self.config.keep_logs is not None and (self.redis.dir / "redis.log").exists():
                shutil.copy(self.redis.dir / "redis.log", self.config.keep_logs / f"chaos-{self.config.seed}-redis.log")
            self.redis.close()

    def _say(self, message: str) -> None:
        if not self.config.quiet:
            print(f"[chaos {self.ledger.now():7.1f} s] {message}", flush=True)


def _machine(load_before: tuple[float, ...]) -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    diff = git("diff", "HEAD", "--", "rendezvous", "clients")
    return {
        "cpus": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_head": git("rev-parse", "HEAD").strip(),
        "uncommitted_service_changes": sorted(
            git("diff", "HEAD", "--name-only", "--", "rendezvous", "clients").split()
        ),
        "uncommitted_diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else "",
    }


async def run(config: ChaosConfig) -> dict[str, Any]:
    """One chaos run; writes the JSON result and returns it."""
    if REDIS_SERVER is None:
        raise RuntimeError("needs a redis-server binary on PATH (make system-deps)")
    result = await Chaos(config).run()
    out = config.output()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def summary(result: dict[str, Any]) -> str:
    """The run as a table."""
    counts = result["counts"]
    rows: list[tuple[str, object]] = [
        ("seed / chaos seconds", f"{result['seed']} / {result['timing']['chaos_s']}"),
        ("transfers minted", counts["transfers_minted"]),
        ("lifecycles completed", counts["lifecycles_completed"]),
        ("aborts by reason (seen by engines)", _inline(counts["aborts_by_reason"])),
        ("aborted records by reason (store, last epoch)", _inline(counts["server_aborted_by_reason"])),
        (
            "consumer aborts (after assignment: fenced)",
            f"{counts['consumer_aborts']} ({counts['consumer_aborts_fenced']})",
        ),
        ("generation bumps (fenced)", f"{counts['bumps']} ({counts['bumps_fenced']})"),
        ("engine crashes / graceful restarts", f"{counts['crashes']} / {counts['graceful_restarts']}"),
        ("new incarnations after a crash", counts["reregistrations"]["new_incarnations_after_crash"]),
        ("SDK re-registrations by cause", _inline(counts["reregistrations"]["sdk"])),
        ("replica kills", counts["replica_kills"]),
        ("Redis kills (came back empty)", f"{counts['redis_kills']} ({counts['redis_wipes']})"),
        ("epochs seen", counts["epochs_seen"]),
        ("revocations confirmed", counts["revocations_confirmed"]),
        ("SDK sessions that stopped themselves", counts["sdk_session_failures"]),
        ("EngineSession.close() that hung (30 s)", counts["sdk_close_hung"]),
        ("events seen", counts["events_seen"]),
        ("assignments checked", result["invariants"]["assignments_name_live_registering_incarnation"]["checked"]),
        ("max / p99 block wait", f"{counts['max_block_wait_s']} s / {counts['p99_block_wait_s']} s"),
        ("max wait for REVOCATION_CONFIRMED", f"{counts['max_fenced_block_wait_s']} s"),
        ("blocks freed by path", _inline(counts["blocks_freed_by_path"])),
    ]
    for f in result.get("failovers", []):
        rows.append(
            (
                f"{f['fault']} master at {f['at']:.1f} s",
                f"promoted {f['promoted_s']} s, first lifecycle {f['first_lifecycle_s']} s, "
                f"{f['completed_after_10s']} lifecycles in 10 s, revisions lost {f['writes_lost']}, "
                f"new epoch {f['new_epoch']}",
            )
        )
    for name, check in result["invariants"].items():
        size = len(check.get("live", check.get("pinned", check.get("violations", []))))
        rows.append((f"INVARIANT {name}", "ok" if check["ok"] else f"FAILED ({size})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _inline(mapping: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in mapping.items()) or "-"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = ChaosConfig()
    for name, value in asdict(defaults).items():
        if name in ("out", "keep_logs", "note", "quiet"):
            continue
        if name == "redis_args":
            parser.add_argument("--redis-args", default="", help="more redis-server arguments (Sentinel data nodes)")
            continue
        if name == "store_options":
            parser.add_argument("--store-options", default="", help="appended to the store URL (HA topologies)")
            continue
        flag = "--" + name.replace("_", "-")
        kind = int if name in ("seed", "consumers", "producers", "blocks_per_consumer") else float
        if name in ("replica_kills", "redis_kills"):
            parser.add_argument(flag, type=int, default=None, help="exactly this many, at random times")
        elif name == "redis_fsync":
            parser.add_argument(flag, choices=("always", "everysec"), default=value)
        elif name == "topology":
            parser.add_argument(flag, choices=("standalone", "sentinel", "cluster"), default=value)
        elif name == "master_fault":
            parser.add_argument(flag, choices=("kill", "stop", "lag"), default=value)
        elif name == "down_after_ms":
            parser.add_argument(flag, type=int, default=value, help=f"default {value}")
        else:
            parser.add_argument(flag, type=kind, default=value, help=f"default {value}")
    parser.add_argument("--out", type=Path, help="JSON result (default benchmarks/results/chaos-<seed>.json)")
    parser.add_argument("--keep-logs", type=Path, help="copy the replicas' and Redis's logs into this directory")
    parser.add_argument("--note", default="", help="recorded in the JSON (e.g. which build of the service ran)")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the engines' SDK warnings")
    args = vars(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO if args.pop("verbose") else logging.ERROR, stream=sys.stderr)
    config = ChaosConfig(**args)
    result = asyncio.run(run(config))
    print(summary(result))
    print(f"written to {config.output()}")
    if not result["ok"]:
        for name, check in result["invariants"].items():
            if not check["ok"]:
                print(f"\n{name} FAILED:\n{json.dumps(check, indent=1)[:4000]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
