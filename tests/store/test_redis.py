"""What only a shared store shows: two instances on one namespace (two replicas), the epoch kept in
Redis, data loss, an unreachable Redis, and the URL forms."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

import pytest
import redis.asyncio as redis
from redis.asyncio.connection import AbstractConnection

from rendezvous.clients.testing import FakeClock
from rendezvous.coordinator import Coordinator
from rendezvous.core import budget
from rendezvous.core.credits import Reservation
from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import Addressed, Engine, Event, EventType, Role, State, Transfer
from rendezvous.core.transfers import Transition
from rendezvous.credit_ledger import CreditOutcome
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.protocol.records import EngineCapacity
from rendezvous.protocol.requests import ClaimSpec, CreditSpec, TargetSpec
from rendezvous.store import StoreUnavailableError
from rendezvous.store.base import TransferFn
from rendezvous.store.codec import encode_event
from rendezvous.store.factory import create_store
from rendezvous.store.redis import RedisStore, parse_url
from tests.core.helpers import engine_spec
from tests.redis_fixtures import (
    START_TIMEOUT_S,
    ControlledRedis,
    LocalCluster,
    LocalRedis,
    LocalSentinel,
    fresh_prefix,
    wait_until,
    with_prefix,
)
from tests.store.test_contract import NOW, make_engine, make_transfer, note, put_engine, put_transfer

pytestmark = pytest.mark.redis


async def test_a_second_instance_sees_the_same_state_and_epoch(redis_pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = redis_pair
    assert a.epoch == b.epoch != 0
    engine = await put_engine(a, make_engine("c"))
    t = await put_transfer(a, make_transfer("t"), [note("c")])
    assert await b.get_engine("c") == engine
    assert await b.get_transfer("t") == t.transfer
    assert [e.sequence for e in (await b.read_events("c", 1, 10)).events] == [1]
    assert await b.revision() == await a.revision()


async def test_replicas_share_one_memory_budget(redis_pair: tuple[RedisStore, RedisStore]) -> None:
    """Two replicas' coordinators see (and refuse by) the same tallies: they live in Redis, beside the records."""
    a, b = redis_pair
    limits = Limits(max_engines_per_identity=1, max_live_blocks=5)
    coords = Coordinator(a, limits), Coordinator(b, limits)
    await coords[0].register_engine(engine_spec("c0", Role.CONSUMER, owner="x"))
    with pytest.raises(RendezvousError) as refused:
        await coords[1].register_engine(engine_spec("c1", Role.CONSUMER, owner="x"))
    assert refused.value.reason == Reason.BUDGET_EXHAUSTED and refused.value.metadata["scope"] == "identity"
    (ok,) = await coords[0].register_targets("c0", 0, [TargetSpec("t0", (0, 1, 2, 3))])
    assert ok.error is None
    (over,) = await coords[1].register_targets("c0", 0, [TargetSpec("t1", (0, 1))])
    assert over.error is not None and over.error.reason == Reason.BUDGET_EXHAUSTED
    usage = await b.usage("x")
    assert (usage.total.engines, usage.total.blocks, usage.identity.blocks) == (1, 4, 4)
    await coords[1].deregister_engine("c0", 0)  # its transfer aborts: every unit comes back
    usage = await a.usage("x")
    assert usage.total == usage.identity == budget.Usage()


async def test_a_waiter_on_one_instance_wakes_for_a_write_through_the_other(
    redis_pair: tuple[RedisStore, RedisStore],
) -> None:
    a, b = redis_pair
    await put_engine(a, make_engine("c"))
    waiter = asyncio.create_task(a.wait_events("c", 0, timeout=10))
    await b.append_events([note("c")])
    await asyncio.wait_for(waiter, 5)  # woken, well before its own 10 s timeout


async def test_a_transition_sees_what_another_instance_wrote_since(redis_pair: tuple[RedisStore, RedisStore]) -> None:
    a, b = redis_pair
    await put_engine(a, make_engine("c"))
    first = await put_transfer(a, make_transfer("t", num_tokens=1))  # a now remembers version 1 of t
    assert first.transfer is not None
    await put_transfer(b, replace(first.transfer, num_tokens=2))
    seen: list[Transfer | None] = []

    def grow(cur: Transfer | None, _engines: Mapping[str, Engine]) -> Transition:
        seen.append(cur)
        assert cur is not None
        return Transition(replace(cur, num_tokens=cur.num_tokens + 10))

    await a.update_transfer("t", grow)
    assert [t.num_tokens for t in seen if t] == [1, 2]  # tried on what a remembered, redone on b's write
    final = await b.get_transfer("t")
    assert final is not None and final.num_tokens == 12


async def test_a_batch_of_transitions_is_one_script_call(redis_pair: tuple[RedisStore, RedisStore]) -> None:
    a, _ = redis_pair
    await put_engine(a, make_engine("c"))
    for i in range(8):
        await put_transfer(a, make_transfer(f"t{i}"))  # a remembers every record
    counter = redis.Redis.from_url(a.target.url)
    before = await _script_calls(counter)
    results = await a.update_transfers(
        [(f"t{i}", lambda cur, _e: Transition(replace(cur, num_tokens=7) if cur else None)) for i in range(8)]
    )
    assert await _script_calls(counter) - before == 1
    await counter.aclose()
    assert all(isinstance(r, Transition) and r.transfer and r.transfer.num_tokens == 7 for r in results)


async def test_events_read_back_by_their_writer_equal_those_another_replica_decodes(
    redis_pair: tuple[RedisStore, RedisStore],
) -> None:
    """The writer keeps the events it wrote until read back (no decode then); a replica that did not write them
    decodes the same bytes, and both answer equal events, with the sequence and peer the log holds."""
    a, b = redis_pair
    consumer = await put_engine(a, make_engine("c"))
    await put_engine(a, make_engine("p"))
    transfers = [make_transfer(f"t{i}", State.MATCHED, producer="p", num_tokens=i) for i in range(3)]
    events = [
        (
            Addressed("p", Event(EventType.TRANSFER_ASSIGNED, NOW + i, t, 1, peer=consumer)),
            Addressed("c", Event(EventType.TRANSFER_ASSIGNED, NOW, None, i)),
        )
        for i, t in enumerate(transfers)
    ]

    def writes(t: Transfer, emits: tuple[Addressed, ...]) -> TransferFn:
        return lambda _cur, _engines: Transition(t, emits)

    await a.update_transfers([(t.transfer_id, writes(t, n)) for t, n in zip(transfers, events, strict=True)])
    assert len(a._written_events) == 6
    raw = redis.Redis.from_url(a.target.url)
    stored: list[tuple[bytes, dict[bytes, bytes]]] = await raw.xrange(a._prefix + "s:p")  # type: ignore[assignment]
    await raw.aclose()
    # The script put each event's record between its parts: the stored bytes are encode_event's.
    assert [fields[b"e"] for _, fields in stored] == [encode_event(e.event).encode() for e, _ in events]
    mine, theirs = await a.read_events("p", 1, 10), await b.read_events("p", 1, 10)
    assert len(a._written_events) == 3  # c's events are not read yet
    assert (
        list(mine.events)
        == list(theirs.events)
        == [replace(e.event, sequence=r + 1) for r, (e, _) in enumerate(events)]
    )
    assert [e.peer for e in mine.events] == [consumer] * 3 and mine.events[0].transfer == transfers[0]
    assert (await a.read_events("c", 1, 10)).events == (await b.read_events("c", 1, 10)).events
    assert len(a._written_events) == 0


async def test_a_batch_rpc_costs_two_redis_round_trips_once_its_records_are_known(
    redis_pair: tuple[RedisStore, RedisStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its caller's record, live count and tallies in one script, then the commit; the response header's
    revision is what the commit showed. Round trips are counted where redis-py writes to a connection."""
    a, _ = redis_pair
    coordinator = Coordinator(a)
    consumer, _ = await coordinator.register_engine(engine_spec("c", Role.CONSUMER))
    producer, _ = await coordinator.register_engine(engine_spec("p", Role.PRODUCER))
    trips = _RoundTrips(monkeypatch)
    targeted = await coordinator.register_targets(
        "c", consumer.incarnation, [TargetSpec(f"t{i}", (i,)) for i in range(4)]
    )
    assert trips.take() == 2
    claimed = await coordinator.claim_transfers("p", producer.incarnation, [ClaimSpec(f"t{i}") for i in range(4)])
    revision = await a.answered_revision()
    assert trips.take() == 2
    assert all(o.error is None and o.transfer and o.transfer.state == State.TARGETED for o in targeted)
    assert all(o.error is None and o.transfer and o.transfer.state == State.MATCHED for o in claimed)
    # The header covers the call's writes and the events they appended (the assignments): here, every write.
    assert revision == await a.revision()
    assigned = [e.transfer.transfer_id for e in (await a.read_events("p", 1, 10)).events if e.transfer]
    assert assigned == [f"t{i}" for i in range(4)]


class _RoundTrips:
    """Counts what redis-py sends on any connection (one command, or one pipeline: one round trip)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        send = AbstractConnection.send_packed_command

        async def counted(connection: AbstractConnection, *args: Any, **kwargs: Any) -> None:
            self.count += 1
            await send(connection, *args, **kwargs)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)

    def take(self) -> int:
        """The round trips since the last take."""
        n, self.count = self.count, 0
        return n


async def test_a_replica_answers_a_revision_that_covers_its_own_writes_without_asking_redis(
    redis_pair: tuple[RedisStore, RedisStore],
) -> None:
    """Not the other replicas' writes it has not seen, but the events it reads (docs/protocol.md: headers)."""
    a, b = redis_pair
    await put_engine(a, make_engine("c"))
    await put_transfer(a, make_transfer("t"), [note("c")])
    by_a = await a.answered_revision()
    await put_transfer(b, make_transfer("u"), [note("c")])
    by_b = await b.answered_revision()
    assert by_b == await b.revision() > by_a
    assert await a.answered_revision() == by_a
    page = await a.read_events("c", 2, 10)  # b's event: a Watch on a sends it with a header that covers it
    assert [e.sequence for e in page.events] == [2]
    assert await a.answered_revision() == by_b


async def test_a_batch_checks_its_caller_in_redis_not_by_a_remembered_record(
    redis_pair: tuple[RedisStore, RedisStore],
) -> None:
    """Replica a remembers c's first incarnation; b registers a second: a refuses the first, admits the second."""
    a, b = redis_pair
    on_a, on_b = Coordinator(a), Coordinator(b)
    first, _ = await on_a.register_engine(engine_spec("c", Role.CONSUMER))
    (ok,) = await on_a.register_targets("c", first.incarnation, [TargetSpec("t0", (0,))])
    assert ok.error is None
    second, _ = await on_b.register_engine(engine_spec("c", Role.CONSUMER))
    assert second.incarnation != first.incarnation
    with pytest.raises(RendezvousError) as stale:
        await on_a.register_targets("c", first.incarnation, [TargetSpec("t1", (1,))])
    assert stale.value.reason == Reason.STALE_INCARNATION
    (new,) = await on_a.register_targets("c", second.incarnation, [TargetSpec("t2", (2,))])
    assert new.error is None and new.transfer is not None
    assert new.transfer.consumer_incarnation == second.incarnation


async def test_a_caller_whose_owner_field_disagrees_with_its_record_is_tallied_by_the_record(
    redis_pair: tuple[RedisStore, RedisStore],
) -> None:
    """The engine hash's owner field (`o`, what the one-script read tallies by) is written with the record;
    should it differ (a hash edited by hand), the caller's budget is still the record's owner's."""
    a, _ = redis_pair
    engine = await put_engine(a, make_engine("c", owner="x"))
    await put_transfer(a, make_transfer("t", target_block_ids=(0, 1, 2)))
    raw = redis.Redis.from_url(a.target.url)
    await raw.hset("{" + a.options.prefix + "}:e:c", "o", "y")
    await raw.aclose()
    view = await a.caller("c", live=True, usage=True)
    assert view.engine == engine and view.live_transfers == 1
    assert view.tally is not None and view.tally.identity.blocks == 3


async def _commands(client: redis.Redis) -> int:
    """Commands Redis has run, but for INFO (how this counts them)."""
    stats = await client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k.startswith("cmdstat_") and k != "cmdstat_info")


async def _script_calls(client: redis.Redis) -> int:
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def test_a_transition_of_a_batch_that_another_instance_overtook_is_redone_alone(
    redis_pair: tuple[RedisStore, RedisStore],
) -> None:
    a, b = redis_pair
    await put_engine(a, make_engine("c"))
    first = await put_transfer(a, make_transfer("t", num_tokens=1))
    await put_transfer(a, make_transfer("u", num_tokens=1))
    assert first.transfer is not None
    await put_transfer(b, replace(first.transfer, num_tokens=2))
    seen: list[tuple[str, int]] = []

    def grow(cur: Transfer | None, _engines: Mapping[str, Engine]) -> Transition:
        assert cur is not None
        seen.append((cur.transfer_id, cur.num_tokens))
        return Transition(replace(cur, num_tokens=cur.num_tokens + 10))

    results = await a.update_transfers([("t", grow), ("u", grow)])
    assert seen == [("t", 1), ("u", 1), ("t", 2)]  # t redone on b's write, u committed at once
    assert [r.transfer.num_tokens for r in results if isinstance(r, Transition) and r.transfer] == [12, 11]
    assert [(await b.get_transfer(t)).num_tokens for t in "tu"] == [12, 11]  # type: ignore[union-attr]


async def test_a_refusal_based_on_a_remembered_state_is_checked_against_the_current_one(
    redis_pair: tuple[RedisStore, RedisStore],
) -> None:
    a, b = redis_pair
    assert await a.get_transfer("t") is None  # a remembers: no such transfer
    await put_transfer(b, make_transfer("t"))

    def require(cur: Transfer | None, _engines: Mapping[str, Engine]) -> Transition:
        if cur is None:
            raise LookupError("unknown transfer")
        return Transition(replace(cur, state=State.ABORTED))

    transition = await a.update_transfer("t", require)
    assert transition.transfer is not None and transition.transfer.state == State.ABORTED


async def test_an_engine_change_elsewhere_redoes_the_transition_with_the_new_engine(
    redis_pair: tuple[RedisStore, RedisStore],
) -> None:
    a, b = redis_pair
    consumer = await put_engine(a, make_engine("c"))
    await put_transfer(a, make_transfer("t"))
    ended = await b.update_engine("c", lambda cur: replace(cur, ended_at=NOW) if cur else None)
    seen: list[Engine] = []

    def look(cur: Transfer | None, engines: Mapping[str, Engine]) -> Transition:
        seen.append(engines["c"])
        return Transition(replace(cur, num_tokens=5) if cur else None)

    await a.update_transfer("t", look)
    assert seen == [consumer, ended]


async def test_an_engine_read_by_a_replica_that_holds_the_current_record_carries_no_record(
    redis_pair: tuple[RedisStore, RedisStore],
) -> None:
    """A multi-rank engine's following ranks poll GetEngine every sixth of the lease, and a record is mostly its agents
    (tens of KiB for TP 8): Redis answers a replica that holds the current version with the version alone, and one
    that holds an older version (a renewal through another replica) with the new record."""
    a, b = redis_pair
    r = b._redis
    assert r is not None
    engine = make_engine("e")
    engine = await put_engine(a, replace(engine, agents=tuple(replace(x, metadata=b"m" * 4096) for x in engine.agents)))

    async def sent(read: Callable[[], Awaitable[Engine | None]], expected: Engine | None) -> int:
        """The bytes Redis sent for read, which answers expected."""
        before = int((await r.info("stats"))["total_net_output_bytes"])
        assert await read() == expected
        return int((await r.info("stats"))["total_net_output_bytes"]) - before

    info = await sent(lambda: asyncio.sleep(0, engine), engine)  # an INFO's own reply
    assert await sent(lambda: b.get_engine("e"), engine) - info > 4096
    assert await sent(lambda: b.get_engine("e"), engine) - info < 100
    assert await sent(lambda: a.get_engine("e"), engine) - info < 100  # its writer holds it
    renewed = await a.update_engine("e", lambda cur: replace(cur, lease_expires_at=NOW + 50) if cur else None)
    assert await sent(lambda: b.get_engine("e"), renewed) - info > 4096
    assert await sent(lambda: b.get_engine("e"), renewed) - info < 100
    await a.update_engine("e", lambda _cur: None)
    assert await b.get_engine("e") is None


async def test_keys_carry_the_prefix_as_one_hash_tag(redis_server: ControlledRedis) -> None:
    store = RedisStore(with_prefix(redis_server.url, "ns1"))
    await store.open()
    try:
        await put_engine(store, make_engine("c"))
        await put_transfer(store, make_transfer("t"), [note("c")])
        await store.put_response("k", b"v", 60)
    finally:
        await store.close()
    with redis_server.client() as r:
        keys = sorted(k.decode() for k in r.keys("*"))
    assert keys and all(k.startswith("{ns1}:") for k in keys), keys


async def test_the_epoch_outlives_the_store_instance(redis_url: str) -> None:
    url = with_prefix(redis_url, fresh_prefix())
    first = RedisStore(url)
    await first.open()
    epoch = first.epoch
    await put_transfer(first, make_transfer("t"))
    await first.close()
    second = RedisStore(url)
    await second.open()
    try:
        assert second.epoch == epoch
        assert await second.get_transfer("t") is not None
    finally:
        await second.close()


async def test_lost_data_makes_a_new_epoch(redis_server: ControlledRedis) -> None:
    store = RedisStore(with_prefix(redis_server.url, "ns"))
    await store.open()
    try:
        old = store.epoch
        await put_engine(store, make_engine("c"))
        await put_transfer(store, make_transfer("t"))
        with redis_server.client() as r:
            r.flushall()
        # A write notices first (its script checks the epoch) ...
        await put_transfer(store, make_transfer("u"))
        assert store.epoch not in (0, old)
        assert await store.get_transfer("t") is None
        assert await store.get_transfer("u") is not None
        # ... or the health check does.
        newer = store.epoch
        with redis_server.client() as r:
            r.flushall()
        assert await store.ping()
        assert store.epoch not in (0, old, newer)
    finally:
        await store.close()


async def test_redis_going_back_in_time_starts_a_new_epoch(redis_server: ControlledRedis) -> None:
    url = with_prefix(redis_server.url, "ns")
    a, b = RedisStore(url), RedisStore(url)
    await a.open()
    await b.open()
    try:
        old = a.epoch
        await put_engine(a, make_engine("c"))
        with redis_server.client() as r:
            r.save()  # an RDB snapshot: what a restart will come back with
        await put_transfer(a, make_transfer("t"), [note("c")])
        redis_server.kill()
        redis_server.start()  # back from the snapshot: the transfer and event are gone, the epoch is not
        with redis_server.client() as r:
            assert int(r.get("{ns}:epoch")) == old
        # a saw the lost writes: its next write refuses to build on the older state and starts a new epoch.
        await put_transfer(a, make_transfer("u"))
        assert a.epoch not in (0, old)
        assert await a.get_transfer("t") is None
        assert await a.get_transfer("u") is not None
        # b saw nothing that was lost: it follows the new epoch without starting another.
        assert await b.ping()
        assert b.epoch == a.epoch
    finally:
        await a.close()
        await b.close()


async def test_an_answer_put_after_redis_lost_its_data_is_not_kept(redis_server: ControlledRedis) -> None:
    """An answer is put after its request's write: if Redis lost that write meanwhile (a new epoch), a retry must
    run again in the new epoch, not be answered for a record that no longer exists."""
    url = with_prefix(redis_server.url, "ns")
    a, b = RedisStore(url), RedisStore(url)
    await a.open()
    await b.open()
    try:
        await put_engine(a, make_engine("c"))  # the request's write, in the old epoch
        with redis_server.client() as r:
            r.flushall()
        assert await b.ping()  # another replica starts the new epoch
        await a.put_response("RegisterEngine/c/r1", b"registered", 60)
        assert await b.get_response("RegisterEngine/c/r1") is None
        assert await b.answer_bytes("") == (0, 0)
        assert a.epoch == b.epoch  # a follows the new epoch: its next answers are kept
        await a.put_response("RegisterEngine/c/r2", b"registered", 60)
        assert await b.get_response("RegisterEngine/c/r2") == b"registered"
    finally:
        await a.close()
        await b.close()


async def test_an_answer_put_after_redis_went_back_in_time_is_not_kept(redis_server: ControlledRedis) -> None:
    store = RedisStore(with_prefix(redis_server.url, "ns"))
    await store.open()
    try:
        old = store.epoch
        await put_transfer(store, make_transfer("t"))
        with redis_server.client() as r:
            r.set("{ns}:rev", 0)  # what a restart from an older snapshot shows: the writes this replica saw are gone
        await store.put_response("CreateTransfer//r1", b"created", 60)
        assert await store.get_response("CreateTransfer//r1") is None
        assert store.epoch not in (0, old)
    finally:
        await store.close()


async def test_the_health_check_notices_redis_going_back_in_time(redis_server: ControlledRedis) -> None:
    store = RedisStore(with_prefix(redis_server.url, "ns"))
    await store.open()
    try:
        old = store.epoch
        with redis_server.client() as r:
            r.save()
        await put_transfer(store, make_transfer("t"))
        assert await store.revision() > 0
        redis_server.kill()
        redis_server.start()
        assert await store.ping()
        assert store.epoch not in (0, old)
    finally:
        await store.close()


async def test_lost_scripts_are_loaded_again(redis_server: ControlledRedis) -> None:
    store = RedisStore(with_prefix(redis_server.url, "ns"))
    await store.open()
    try:
        with redis_server.client() as r:
            r.script_flush()
        await put_transfer(store, make_transfer("t"))
        assert await store.get_transfer("t") is not None
    finally:
        await store.close()


async def test_an_unreachable_redis_is_unavailable_not_a_hang(redis_server: ControlledRedis) -> None:
    store = RedisStore(with_prefix(redis_server.url, "ns") + "&op_timeout=3")
    await store.open()
    try:
        await put_engine(store, make_engine("c"))
        redis_server.stop()
        started = time.monotonic()
        assert not await store.ping()
        for call in (
            store.get_transfer("t"),
            store.update_transfer("t", lambda cur, _e: Transition(make_transfer("t"))),
            store.read_events("c", 1, 10),
            store.wait_events("c", 0, 1),
            store.counts(),
        ):
            with pytest.raises(StoreUnavailableError):
                await call
        assert time.monotonic() - started < 15
        redis_server.start()
        deadline = time.monotonic() + 10
        while not await store.ping():
            assert time.monotonic() < deadline, "the store did not come back"
            await asyncio.sleep(0.05)
        await put_transfer(store, make_transfer("t"))
        assert await store.get_transfer("t") is not None
    finally:
        await store.close()


async def test_a_redis_that_stops_answering_is_unavailable_within_the_time_limit(
    redis_server: ControlledRedis,
) -> None:
    if not isinstance(redis_server, LocalRedis):
        pytest.skip("pausing needs a local redis-server")
    store = RedisStore(with_prefix(redis_server.url, "ns") + "&op_timeout=1.5&ping_timeout=0.5&socket_timeout=0.5")
    await store.open()
    try:
        await put_transfer(store, make_transfer("t"))
        redis_server.pause()
        started = time.monotonic()
        assert not await store.ping()
        with pytest.raises(StoreUnavailableError):
            await store.get_transfer("t")
        with pytest.raises(StoreUnavailableError):
            await store.update_transfer("u", lambda cur, _e: Transition(make_transfer("u")))
        # 0.5 + 1.5 + 1.5 s of configured limits (3.5 s measured on a quiet machine); the bound only has to
        # tell a time limit from a hang, with room for a loaded CI machine (7.9 s seen once).
        assert time.monotonic() - started < 15
        redis_server.resume()
        deadline = time.monotonic() + 10
        while not await store.ping():
            assert time.monotonic() < deadline, "the store did not come back"
        assert await store.get_transfer("t") is not None
    finally:
        redis_server.resume()
        await store.close()


async def test_opening_an_unreachable_redis_fails_with_store_unavailable(redis_server: ControlledRedis) -> None:
    url = with_prefix(redis_server.url, "ns")
    redis_server.stop()
    store = RedisStore(url)
    with pytest.raises(StoreUnavailableError):
        await store.open()
    assert not await store.ping()
    with pytest.raises(StoreUnavailableError):
        await store.get_transfer("t")


async def test_a_stream_ahead_of_its_counter_is_continued_after(redis_server: ControlledRedis) -> None:
    store = RedisStore(with_prefix(redis_server.url, "ns"))
    await store.open()
    try:
        await put_engine(store, make_engine("c"))
        await store.append_events([note("c")] * 3)
        with redis_server.client() as r:
            r.hset("{ns}:e:c", "r", 1)  # as if someone restored an old copy of the engine hash
        await store.append_events([note("c")])
        assert await store.last_event_sequence("c") == 4
        assert [e.sequence for e in (await store.read_events("c", 1, 10)).events] == [1, 2, 3, 4]
    finally:
        await store.close()


# URLs


def test_the_factory_makes_a_redis_store_for_redis_urls() -> None:
    for url in ("redis://h:1", "rediss://h:1/2", "unix:///tmp/r.sock", "redis+sentinel://h:26379/mymaster"):
        assert create_store(url, Limits()).name == "redis"


def test_store_options_are_taken_from_the_query_and_the_rest_left_to_redis_py() -> None:
    target = parse_url("redis://user:pw@h:6380/2?prefix=prod&cache_size=10&socket_timeout=0.5&max_connections=9")
    assert target.url == "redis://user:pw@h:6380/2"
    assert target.options.prefix == "prod" and target.options.cache_size == 10
    assert target.connection["socket_timeout"] == 0.5
    assert target.connection["max_connections"] == 9
    unix = parse_url("unix:///run/redis.sock?db=3")
    assert unix.url == "unix:///run/redis.sock" and unix.connection["db"] == 3


def test_a_sentinel_url_names_sentinels_service_and_db() -> None:
    target = parse_url("redis+sentinel://:secret@s1:26379,[::1]:26380/mymaster/4?prefix=x&sentinel_password=sp")
    assert target.sentinels == (("s1", 26379), ("::1", 26380))
    assert target.service == "mymaster"
    assert target.connection["db"] == 4 and target.connection["password"] == "secret"
    assert target.sentinel_password == "sp"
    assert target.options.prefix == "x"


@pytest.mark.parametrize(
    "url",
    [
        "redis://",
        "unix://",
        "redis+sentinel://h:1",
        "redis+sentinel://h/svc",
        "redis+sentinel://h:1/svc/db/extra",
        "redis://h?prefix={bad}",
        "redis://h?cache_size=many",
        "memcached://h:1",
        "unix:///r.sock?cluster=true",
        "redis://h:1/3?cluster=true",
        "redis+sentinel://h:1/svc?cluster=true",
        "redis://h:1?cluster=maybe",
        "redis://[bad",
        "redis://h:port",
        "redis://h:99999",
    ],
)
def test_malformed_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):  # a port that is no port too: here, not at the first connection
        parse_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "redis://h:0",
        "redis://h:99999/0?cluster=true",
        "redis+sentinel://h:99999/svc",
        "redis+sentinel://h:0/svc",
        "redis+sentinel://s1:26379,[::1]:65536/svc",
    ],
)
def test_a_port_out_of_range_is_refused_naming_the_url(url: str) -> None:
    """Sentinel URLs (several hosts) are read by their own code: a port is refused past 65535 (and 0) there too,
    at start, not by the first connection."""
    with pytest.raises(ValueError, match=r"(?i)port") as refused:
        parse_url(url)
    assert url in str(refused.value)


async def test_a_sentinel_url_reaches_the_master(sentinel_redis: tuple[LocalRedis, LocalSentinel]) -> None:
    _, sentinel = sentinel_redis
    store = RedisStore(f"redis+sentinel://127.0.0.1:{sentinel.port}/rdvmaster?prefix=s")
    await store.open()
    try:
        engine = await put_engine(store, make_engine("c", Role.CONSUMER))
        assert await store.get_engine("c") == engine
        assert await store.ping()
    finally:
        await store.close()


# Redis Cluster


async def test_a_namespace_lives_in_one_cluster_slot(redis_cluster: LocalCluster) -> None:
    store = RedisStore(with_prefix(redis_cluster.url, "one"))
    await store.open()
    try:
        await put_engine(store, make_engine("c"))
        await put_engine(store, make_engine("p", Role.PRODUCER))
        await put_transfer(store, make_transfer("t", State.MATCHED, producer="p"), [note("p"), note("c")])
        await store.put_response("k", b"v", 60)
        await store.append_events([note("c")])
    finally:
        await store.close()
    held = redis_cluster.nodes_holding("{one}:*")
    assert len(held) == 1, held
    (keys,) = held.values()
    with redis_cluster.client(redis_cluster.ports[0]) as c:
        assert len({c.cluster("keyslot", k) for k in keys}) == 1


async def test_namespaces_spread_over_the_cluster(redis_cluster: LocalCluster) -> None:
    prefixes = [f"ns{i}" for i in range(12)]
    for prefix in prefixes:
        store = RedisStore(with_prefix(redis_cluster.url, prefix))
        await store.open()
        try:
            await put_transfer(store, make_transfer("t"))
        finally:
            await store.close()
    nodes = {port for p in prefixes for port in redis_cluster.nodes_holding("{" + p + "}:*")}
    assert len(nodes) > 1


async def test_one_undecodable_engine_record_does_not_stop_the_sweeper(redis_url: str) -> None:
    store = RedisStore(with_prefix(redis_url, fresh_prefix()))
    await store.open()
    try:
        clock = FakeClock(NOW)
        coord = Coordinator(store, timeouts=Timeouts(default_lease_ttl=10), clock=clock)
        for engine_id in ("bad", "good"):
            await coord.register_engine(engine_spec(engine_id, Role.CONSUMER))
        await coord.register_targets("good", 0, [TargetSpec("t", (1,))])
        assert store._redis is not None
        await store._redis.hset(store._prefix + "e:bad", "d", b"{not json")
        clock.advance(11)
        await coord.sweep()
        good = await store.get_engine("good")
        assert good is not None and good.ended_at, "the sweeper stopped at the undecodable record"
        record = await store.get_transfer("t")
        assert record is not None and record.state == State.ABORTED
    finally:
        await store.close()


async def test_a_write_seen_during_the_health_check_is_not_taken_for_redis_going_back_in_time(
    redis_server: ControlledRedis,
) -> None:
    """The health check reads the revision while another call's write completes with a newer one."""
    store = RedisStore(with_prefix(redis_server.url, fresh_prefix()))
    await store.open()
    try:
        epoch = store.epoch
        await put_engine(store, make_engine("c"))
        assert store._health is not None
        real_mget = store._health.mget

        async def mget_while_a_write_lands(*keys: str) -> object:
            stored = await real_mget(*keys)
            await put_transfer(store, make_transfer("t"))  # its reply shows a revision newer than `stored`
            return stored

        store._health.mget = mget_while_a_write_lands  # type: ignore[method-assign,assignment]
        assert await store.ping()
        assert store.epoch == epoch, "a concurrent write made the replica start a new epoch"
    finally:
        await store.close()


async def test_a_new_epoch_adopted_during_the_health_check_is_not_taken_for_redis_going_back_in_time(
    redis_server: ControlledRedis,
) -> None:
    """Redis lost its data: a write finds the epoch gone and starts a new one while the health check, which knew the
    old epoch's revision, reads the new epoch's (lower) one. Taking that for a regression started a second epoch:
    engines re-registered twice, and the second time aborted what they had just re-asserted."""
    store = RedisStore(with_prefix(redis_server.url, fresh_prefix()))
    await store.open()
    try:
        old = store.epoch
        for engine_id in ("c", "d", "e"):
            await put_engine(store, make_engine(engine_id))
        with redis_server.client() as r:
            r.flushall()
        assert store._health is not None
        real_mget = store._health.mget
        new: list[int] = []

        async def mget_after_a_write_started_the_new_epoch(*keys: str) -> object:
            await put_transfer(store, make_transfer("t"))
            new.append(store.epoch)
            return await real_mget(*keys)

        store._health.mget = mget_after_a_write_started_the_new_epoch  # type: ignore[method-assign,assignment]
        assert await store.ping()
        assert new[0] not in (0, old)
        assert store.epoch == new[0], "the health check started another epoch"
        assert await store.get_transfer("t") is not None
    finally:
        await store.close()


async def test_redis_losing_its_data_while_a_replica_replaces_a_regressed_epoch_makes_a_new_one(
    redis_server: ControlledRedis,
) -> None:
    store = RedisStore(with_prefix(redis_server.url, fresh_prefix()))
    await store.open()
    try:
        old = store.epoch
        await put_transfer(store, make_transfer("t"))
        assert store._health is not None
        real_mget = store._health.mget

        async def mget_then_lose_everything(*keys: str) -> object:
            stored = await real_mget(*keys)
            with redis_server.client() as r:
                r.flushall()
            return stored

        with redis_server.client() as r:
            r.set(store._prefix + "rev", 0)  # Redis went back in time ...
        store._health.mget = mget_then_lose_everything  # type: ignore[method-assign,assignment]
        assert await store.ping()  # ... and lost its epoch before this replica could replace it
        assert store.epoch not in (0, old)
        with redis_server.client() as r:
            assert int(r.get(store._prefix + "epoch")) == store.epoch
    finally:
        await store.close()


async def test_a_late_refusal_naming_the_epoch_already_adopted_keeps_the_revisions_seen_in_it(
    redis_server: ControlledRedis,
) -> None:
    """Two writes refused for one new epoch: the second refusal, handled after writes in the new epoch, must not
    forget their revisions (a Redis going back past them would then go unnoticed)."""
    url = with_prefix(redis_server.url, fresh_prefix())
    a, b = RedisStore(url), RedisStore(url)
    await a.open()
    await b.open()
    try:
        with redis_server.client() as r:
            r.flushall()
        assert await b.ping()  # b starts the new epoch
        await put_transfer(a, make_transfer("t"))  # refused, a adopts it, and writes again
        await put_transfer(a, make_transfer("u"))
        seen = a._epoch.high_rev
        assert a.epoch == b.epoch and seen > 0
        await a._epoch.refused([b"E", str(a.epoch).encode()])  # the other write's refusal, handled late
        assert a._epoch.high_rev == seen
    finally:
        await a.close()
        await b.close()


async def test_engines_listed_by_a_namespace_written_before_the_id_index_are_all_found(redis_url: str) -> None:
    """ListEngines pages come from the id index `engine_ids`; a namespace an older server wrote has only the
    `engines` set, from which the first listing builds the index."""
    store = RedisStore(with_prefix(redis_url, fresh_prefix()))
    await store.open()
    try:
        for engine_id in ("e2", "e0", "e1", "e3"):
            await put_engine(store, make_engine(engine_id))
        assert store._redis is not None
        await store._redis.delete(store._prefix + "engine_ids")  # as an older server left it
        pages = [await store.page_engines(after, 2, lambda _e: True) for after in ("", "e1", "e3")]
        assert [[e.engine_id for e in page] for page in pages] == [["e0", "e1"], ["e2", "e3"], []]
        await put_engine(store, make_engine("e05"))
        assert [e.engine_id for e in await store.page_engines("e0", 2, lambda _e: True)] == ["e05", "e1"]
    finally:
        await store.close()


async def test_transfers_of_a_namespace_written_without_the_id_indexes_are_all_listed(redis_url: str) -> None:
    """ListTransfers pages that name no engine come from the id indexes `transfer_ids` and `live_ids`. A namespace
    an older server wrote has only the `transfers` set, and during a rolling upgrade older replicas make, end and
    delete transfers without the indexes: a listing rebuilds them when they disagree with the set in size, and skips
    an indexed id by its record's state."""
    store = RedisStore(with_prefix(redis_url, fresh_prefix()))
    await store.open()
    every, live = frozenset(State), frozenset(s for s in State if not s.terminal)

    async def listed(states: frozenset[State], after: str, limit: int) -> list[str]:
        return [t.transfer_id for t in await store.page_transfers(None, states, after, limit)]

    try:
        made = (("t2", State.TARGETED), ("t0", State.ABORTED), ("t1", State.MATCHED), ("t3", State.RELEASED))
        for tid, state in made:
            await put_transfer(store, make_transfer(tid, state))
        r = store._redis
        assert r is not None
        await r.delete(store._prefix + "transfer_ids", store._prefix + "live_ids")  # as an older server left it
        assert [await listed(every, after, 2) for after in ("", "t1", "t3")] == [["t0", "t1"], ["t2", "t3"], []]
        assert await listed(live, "", 10) == ["t1", "t2"]
        # An older replica makes t05 (the set only): the indexes are one short of the set, and are rebuilt.
        await put_transfer(store, make_transfer("t05"))
        await r.zrem(store._prefix + "transfer_ids", "t05")
        await r.zrem(store._prefix + "live_ids", "t05")
        assert await listed(live, "t0", 2) == ["t05", "t1"]
        # ... ends t1 (its id stays in live_ids): skipped by its state.
        await put_transfer(store, make_transfer("t1", State.ABORTED))
        await r.zadd(store._prefix + "live_ids", {"t1": 0})
        assert await listed(live, "", 10) == ["t05", "t2"]
        assert await listed(every, "t05", 1) == ["t1"]
        # ... and deletes t3 (from the set and its record only): the indexes are one over the set, and are cleaned.
        await store.update_transfer("t3", lambda _cur, _e: Transition(None))
        await r.zadd(store._prefix + "transfer_ids", {"t3": 0})
        assert await listed(every, "t1", 10) == ["t2"]
        assert await r.zcard(store._prefix + "transfer_ids") == await r.scard(store._prefix + "transfers") == 4
        assert await r.zrange(store._prefix + "live_ids", 0, -1) == [b"t05", b"t2"]
    finally:
        await store.close()


async def test_the_sweeper_keeps_a_reservation_another_replica_renewed_after_it_looked(
    redis_pair: tuple[RedisStore, RedisStore],
) -> None:
    """Replica a's sweeper reads an expired reservation; before it drops it, a router's ReserveCredits on replica b
    takes the transfer id afresh (a new reservation in its place). The sweeper must not drop the new one: the router
    holds that credit, and without it another router's reservation would be admitted past the consumer's capacity."""
    a, b = redis_pair
    clock = FakeClock(NOW)
    coords = Coordinator(a, clock=clock), Coordinator(b, clock=clock)
    capacity = EngineCapacity(max_transfers=1)
    await coords[0].register_engine(engine_spec("d0", Role.CONSUMER, capacity=capacity))
    (first,) = await coords[0].reserve_credits([CreditSpec("t", "d0", 1)], ttl=1)
    assert first.error is None
    clock.advance(2)  # the reservation expired; the engine's lease (10 s) holds
    renewed: list[CreditOutcome] = []
    ledger = a.credits()
    read = ledger.get

    async def read_then_reserve_on_the_other_replica(transfer_id: str) -> Reservation | None:
        seen = await read(transfer_id)
        renewed.extend(await coords[1].reserve_credits([CreditSpec(transfer_id, "d0", 1)], ttl=30))
        return seen

    ledger.get = read_then_reserve_on_the_other_replica  # type: ignore[method-assign]
    await coords[0].credits.expire(clock(), 10)
    assert [o.error for o in renewed] == [None]
    assert await b.credits().get("t") == renewed[0].reservation, "the sweeper dropped a reservation renewed since"
    (other,) = await coords[1].reserve_credits([CreditSpec("t2", "d0", 1)], ttl=30)
    assert other.error is not None and other.error.reason == Reason.ENGINE_CAPACITY_EXCEEDED


async def test_a_write_retried_after_its_script_was_loaded_again_still_waits_for_a_replica() -> None:
    """wait_replicas=1: a write is acknowledged once a replica holds it (WAIT). A script Redis lacks (NOSCRIPT: a
    restart, SCRIPT FLUSH, a failover to a node that never loaded it) is loaded again and the call retried; the retry
    must WAIT too, or its write is acknowledged with no replica holding it, and the next failover loses it."""
    master = LocalRedis(tcp=True)
    replica = LocalRedis(tcp=True, extra=("--replicaof", "127.0.0.1", str(master.port)))
    try:
        master.start()
        replica.start()

        def linked() -> bool:
            with replica.client() as c:
                return bool(c.info("replication").get("master_link_status") == "up")

        wait_until(linked, START_TIMEOUT_S, "the replica to sync")
        store = RedisStore(with_prefix(master.url, fresh_prefix()) + "&wait_replicas=1&wait_timeout=0.2")
        await store.open()
        try:
            await put_engine(store, make_engine("replicated", Role.CONSUMER))
            with master.client() as c:
                c.script_flush()
            client = store._scripts.client
            load = client.script_load

            async def load_then_lose_the_replica(source: str) -> str:
                sha = await load(source)
                replica.pause()  # from here on no replica acknowledges a write
                return str(sha)

            client.script_load = load_then_lose_the_replica  # type: ignore[method-assign,assignment]
            with pytest.raises(StoreUnavailableError, match="WAIT"):
                await put_engine(store, make_engine("unreplicated", Role.CONSUMER))
        finally:
            await store.close()
    finally:
        replica.close()
        master.close()


async def test_a_whole_fleet_lapsed_at_once_is_read_a_few_records_a_script(redis_server: ControlledRedis) -> None:
    """After an outage longer than the leases, every engine has lapsed at once. The sweeper's candidates must not
    come as one script reply of every record (up to 2 MiB of agent metadata each): Redis runs one script at a time
    for every replica and builds its reply in memory. With Redis's output limit for normal clients below the
    fleet's records (a careful operator's setting), the sweeper still finds every lapsed engine."""
    store = RedisStore(with_prefix(redis_server.url, fresh_prefix()))
    await store.open()
    try:
        metadata = b"m" * 8_192
        fleet = 160  # about 11 KiB a record: 1.7 MiB in all
        for i in range(fleet):
            engine = make_engine(f"e{i:03}", now=NOW - 20)
            agents = tuple(replace(agent, metadata=metadata) for agent in engine.agents)
            await put_engine(store, replace(engine, agents=agents))
        with redis_server.client() as c:
            c.config_set("client-output-buffer-limit", "normal 1mb 0 0")
        lapsed = await store.lapsed_engines(NOW, tombstone_ttl=50)
        assert sorted(e.engine_id for e in lapsed) == [f"e{i:03}" for i in range(fleet)]
    finally:
        await store.close()


def test_a_script_an_operator_kills_is_store_unavailable(redis_server: ControlledRedis) -> None:
    """SCRIPT KILL ends a script that has not written: its caller got the plain ERR "Script killed by user...",
    which went out as INTERNAL; it is now StoreUnavailableError (retryable), as BUSY for the other callers is.
    The script runs until killed (at most 60 s by Redis's own clock); the kill is retried until Redis takes it."""
    import threading

    from rendezvous.store.redis.errors import store_errors

    spin = "local t = redis.call('TIME') repeat until tonumber(redis.call('TIME')[1]) - tonumber(t[1]) > 60 return 1"
    raised: list[BaseException] = []

    def run() -> None:
        with redis_server.client() as r:
            try:
                with store_errors(5.0):
                    r.eval(spin, 0)
            except BaseException as e:  # handed to the test's thread
                raised.append(e)

    with redis_server.client() as admin:
        admin.config_set("busy-reply-threshold", 50)  # a script is killable after 50 ms
        runner = threading.Thread(target=run)
        runner.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                admin.script_kill()
                break
            except Exception as e:  # NOTBUSY: not running yet; BUSY-threshold not reached: try again
                assert time.monotonic() < deadline, f"SCRIPT KILL never took: {e}"
                time.sleep(0.01)
        runner.join(30)
    assert len(raised) == 1 and isinstance(raised[0], StoreUnavailableError), raised


@pytest.mark.parametrize(
    "url",
    [
        "redis://h:1/0?x=1",
        "redis://h:1?decode_responses=true",  # replies as str: this store reads bytes
        "redis://h:1?ssl_certfile=/c.pem",  # TLS settings without TLS
        "redis+sentinel://h:26379/svc?socket_timeot=2",
    ],
)
def test_an_option_neither_the_store_nor_redis_py_takes_is_refused_by_name(url: str) -> None:
    """Before, any other name went to redis-py's connection, which raised a TypeError at the store's start (or,
    for `decode_responses`, answered in a form this store cannot read)."""
    with pytest.raises(ValueError, match="unknown option") as refused:
        parse_url(url)
    assert url in str(refused.value)


def test_redis_py_options_from_its_own_urls_and_tls_settings_over_rediss_are_passed_on() -> None:
    target = parse_url("rediss://h:1?ssl_cert_reqs=none&ssl_ca_certs=/ca.pem&client_name=rdv&health_check_interval=5")
    assert target.connection["ssl_cert_reqs"] == "none" and target.connection["ssl_ca_certs"] == "/ca.pem"
    assert target.connection["client_name"] == "rdv" and target.connection["health_check_interval"] == 5
