"""The store contract (rendezvous.store.base): every backend passes the same tests unchanged.

Each test runs against the memory store and the Redis store. Tests that need two instances on
shared state (what two server replicas see) are in test_redis.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest

from rendezvous.core import engines as engine_rules
from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import (
    AbortReason,
    Addressed,
    Engine,
    Event,
    EventType,
    KvLayout,
    KvRegion,
    MemoryKind,
    Mode,
    NixlAgent,
    Role,
    State,
    Transfer,
    TransferTimes,
)
from rendezvous.core.transfers import Transition
from rendezvous.store import Store
from rendezvous.store.base import CallerView
from tests.core.helpers import engine_spec, every_engine
from tests.store.conftest import StoreFactory

NOW = 1_000_000.0
LIMITS = Limits()
TIMEOUTS = Timeouts()


def make_engine(engine_id: str, role: Role = Role.CONSUMER, now: float = NOW, **kw: Any) -> Engine:
    return engine_rules.register_engine(now, None, engine_spec(engine_id, role, **kw), LIMITS, TIMEOUTS)


async def put_engine(store: Store, engine: Engine) -> Engine:
    written = await store.update_engine(engine.engine_id, lambda _cur: engine)
    assert written is engine
    return engine


def make_transfer(
    transfer_id: str, state: State = State.TARGETED, consumer: str = "c", producer: str = "", **kw: object
) -> Transfer:
    fields: dict[str, object] = {"deadline": NOW + 60, "consumer_engine_id": consumer, "producer_engine_id": producer}
    fields.update(kw)
    return Transfer(transfer_id, state, **fields)  # type: ignore[arg-type]


def note(engine_id: str, transfer: Transfer | None = None, kind: EventType = EventType.TRANSFER_ASSIGNED) -> Addressed:
    return Addressed(engine_id, Event(kind, NOW, transfer, 1))


async def put_transfer(store: Store, transfer: Transfer, events: Sequence[Addressed] = ()) -> Transition:
    return await store.update_transfer(transfer.transfer_id, lambda _cur, _e: Transition(transfer, tuple(events)))


async def delete_transfer(store: Store, transfer_id: str) -> None:
    await store.update_transfer(transfer_id, lambda _cur, _e: Transition(None))


# Lifetime


async def test_an_open_store_answers_and_has_an_epoch(store: Store) -> None:
    assert await store.ping()
    assert store.epoch != 0


async def test_a_fresh_store_knows_nothing(store: Store) -> None:
    assert await store.get_engine("e") is None
    assert await store.get_transfer("t") is None
    assert await every_engine(store) == []
    assert await store.list_transfers() == []
    assert await store.list_transfers("e") == []
    assert await store.live_transfer_ids("e") == []
    assert await store.last_event_sequence("e") == 0
    page = await store.read_events("e", 1, 10)
    assert (list(page.events), page.last_sequence, page.resync_sequence) == ([], 0, None)
    assert await store.due_transfers(NOW + 1e6, 100) == []
    assert await store.lapsed_engines(NOW + 1e6, 0) == []
    counts = await store.counts()
    assert counts.live_engines == 0
    assert sum(counts.transfers_by_state.values()) == 0


# Engines


async def test_an_engine_record_round_trips_exactly(store: Store) -> None:
    agent = NixlAgent(
        name="rank0-\u00e9",
        metadata=bytes(range(256)),
        rank=3,
        memory_kind=MemoryKind.VRAM,
        regions=(KvRegion(1 << 62, 4096, 4000, 1 << 20, 7), KvRegion(0, 1, 1, 1)),
        first_layer=31,
        num_layers=30,
    )
    engine = Engine(
        engine_id="e:1/x",
        pool="decode",
        role=Role.CONSUMER,
        layout=KvLayout("fp", "bfloat16", 16, 61, 8, 2, "HND", 64),
        agents=(agent, replace(agent, name="rank1", rank=1, metadata=b"")),
        labels={"zone": "a", "model": "\u00fc\u4e2d"},
        incarnation=1_700_000_000_123_456,
        lease_ttl=0.1 + 0.2,
        lease_expires_at=NOW + 1 / 3,
        registered_at=NOW,
        ended_at=0.0,
        watch_start_sequence=2**40 + 1,
    )
    await put_engine(store, engine)
    assert await store.get_engine("e:1/x") == engine
    assert await every_engine(store) == [engine]


async def test_update_engine_creates_replaces_and_deletes(store: Store) -> None:
    first = await put_engine(store, make_engine("e"))
    seen: list[Engine | None] = []

    def renew(cur: Engine | None) -> Engine | None:
        seen.append(cur)
        assert cur is not None
        return engine_rules.renew_lease(NOW + 5, cur)

    renewed = await store.update_engine("e", renew)
    assert seen[-1] == first
    assert renewed is not None and renewed.lease_expires_at == NOW + 5 + first.lease_ttl
    assert await store.get_engine("e") == renewed
    assert await store.update_engine("e", lambda _cur: None) is None
    assert await store.get_engine("e") is None
    assert await every_engine(store) == []


async def test_a_failing_engine_update_changes_nothing(store: Store) -> None:
    engine = await put_engine(store, make_engine("e"))

    def refuse(_cur: Engine | None) -> Engine | None:
        raise ValueError("no")

    with pytest.raises(ValueError):
        await store.update_engine("e", refuse)
    assert await store.get_engine("e") == engine


async def test_engines_whose_lease_passed_or_whose_tombstone_aged_have_lapsed(store: Store) -> None:
    live = await put_engine(store, make_engine("live"))  # lease until NOW + 10
    await put_engine(store, make_engine("lapsing", now=NOW - 20))  # lease passed at NOW - 10
    await put_engine(store, engine_rules.end_incarnation(NOW - 100, make_engine("old", now=NOW - 200)))
    await put_engine(store, engine_rules.end_incarnation(NOW - 1, make_engine("recent", now=NOW - 2)))
    lapsed = await store.lapsed_engines(NOW, tombstone_ttl=50)
    assert sorted(e.engine_id for e in lapsed) == ["lapsing", "old"]
    assert sorted(e.engine_id for e in await store.lapsed_engines(live.lease_expires_at, 50)) == [
        "lapsing",
        "live",
        "old",
    ]
    assert [e.engine_id for e in await store.lapsed_engines(NOW - 15, 1000)] == []


async def test_page_engines_lists_by_id_after_a_key_up_to_the_limit_that_the_filter_keeps(store: Store) -> None:
    for engine_id in ("e3", "e1", "p2", "e4", "e2"):
        await put_engine(store, make_engine(engine_id, Role.PRODUCER if engine_id.startswith("p") else Role.CONSUMER))
    await put_engine(store, engine_rules.end_incarnation(NOW, make_engine("e0")))

    def ids(page: list[Engine]) -> list[str]:
        return [e.engine_id for e in page]

    assert ids(await store.page_engines("", 10, lambda _e: True)) == ["e0", "e1", "e2", "e3", "e4", "p2"]
    assert ids(await store.page_engines("e1", 2, lambda _e: True)) == ["e2", "e3"]
    assert ids(await store.page_engines("e2x", 10, lambda _e: True)) == ["e3", "e4", "p2"]
    consumers = await store.page_engines("", 3, lambda e: e.role == Role.CONSUMER and not e.ended_at)
    assert ids(consumers) == ["e1", "e2", "e3"]
    assert ids(await store.page_engines("e3", 3, lambda e: e.role == Role.CONSUMER)) == ["e4"]
    assert await store.page_engines("p2", 10, lambda _e: True) == []
    assert await store.page_engines("", 0, lambda _e: True) == []
    assert (await store.page_engines("e3", 1, lambda _e: True))[0] == await store.get_engine("e4")


async def test_page_engines_follows_new_replaced_and_deleted_records(store: Store) -> None:
    await put_engine(store, make_engine("b"))
    await put_engine(store, make_engine("d"))
    await put_engine(store, make_engine("a"))
    await put_engine(store, make_engine("c"))
    await store.update_engine("b", lambda _cur: None)
    renewed = await store.update_engine("d", lambda cur: engine_rules.renew_lease(NOW + 5, cur))  # type: ignore[arg-type]
    page = await store.page_engines("", 10, lambda _e: True)
    assert [e.engine_id for e in page] == ["a", "c", "d"]
    assert page[-1] == renewed


async def test_page_engines_pages_through_many_in_order_with_a_sparse_filter(store: Store) -> None:
    ids = [f"e{i:03d}" for i in range(200)]
    for engine_id in reversed(ids):
        await put_engine(store, make_engine(engine_id, Role.PRODUCER if int(engine_id[1:]) % 7 else Role.CONSUMER))
    seen: list[str] = []
    after = ""
    while page := await store.page_engines(after, 5, lambda e: e.role == Role.CONSUMER):
        seen += [e.engine_id for e in page]
        after = page[-1].engine_id
    assert seen == [i for i in ids if int(i[1:]) % 7 == 0]


async def test_counts_live_engines_and_live_transfers_by_state(store: Store) -> None:
    await put_engine(store, make_engine("c"))
    await put_engine(store, make_engine("p", Role.PRODUCER))
    await put_engine(store, engine_rules.end_incarnation(NOW, make_engine("gone")))
    await put_transfer(store, make_transfer("t1"))
    await put_transfer(store, make_transfer("t2"))
    await put_transfer(store, make_transfer("t3", State.MATCHED, producer="p"))
    await put_transfer(store, make_transfer("t4", State.RELEASED, producer="p"))
    await put_transfer(store, make_transfer("t2", State.ABORTED))
    counts = await store.counts()
    assert counts.live_engines == 2
    # Tombstones (released, aborted) are remembered, but they are not live transfers.
    assert dict(counts.transfers_by_state) == {State.TARGETED: 1, State.MATCHED: 1}
    await put_transfer(store, make_transfer("t3", State.RELEASED, producer="p"))
    assert dict((await store.counts()).transfers_by_state) == {State.TARGETED: 1}
    await delete_transfer(store, "t4")
    assert dict((await store.counts()).transfers_by_state) == {State.TARGETED: 1}


# Transfers


async def test_a_transfer_record_round_trips_exactly(store: Store) -> None:
    transfer = Transfer(
        transfer_id="req-\u00e9:1",
        state=State.ABORTED,
        deadline=NOW + 0.1 + 0.2,
        mode=Mode.PULL,
        generation=7,
        consumer_engine_id="c",
        consumer_incarnation=2**62,
        producer_engine_id="p",
        producer_incarnation=3,
        target_block_ids=tuple(range(1000)),
        source_block_ids=(),
        num_tokens=4095,
        abort_reason=AbortReason.BLOCK_MISMATCH,
        abort_message='1000 target blocks but only 0 source blocks \u2014 "quoted"',
        assigned_generation=6,
        revoking_generation=5,
        times=TransferTimes(NOW, NOW + 1e-6, NOW + 1 / 3, 0.0, NOW + 2, NOW + 3),
        reported_ranks=(0, 2, 7),
        progressive=True,
    )
    await put_transfer(store, transfer)
    assert await store.get_transfer(transfer.transfer_id) == transfer
    assert await store.list_transfers() == [transfer]
    no_source = replace(transfer, transfer_id="t2", source_block_ids=None)
    await put_transfer(store, no_source)
    assert (await store.get_transfer("t2")) == no_source


async def test_update_transfer_gives_the_record_and_the_engines_it_names(store: Store) -> None:
    consumer = await put_engine(store, make_engine("c"))
    ended = await put_engine(store, engine_rules.end_incarnation(NOW, make_engine("p", Role.PRODUCER)))
    seen: list[tuple[Transfer | None, Mapping[str, Engine]]] = []

    def look(cur: Transfer | None, engines: Mapping[str, Engine]) -> Transition:
        seen.append((cur, dict(engines)))
        return Transition(cur)

    await store.update_transfer("t", look)
    assert seen[-1] == (None, {})
    record = await put_transfer(store, make_transfer("t", State.MATCHED, producer="p"))
    await store.update_transfer("t", look)
    assert seen[-1] == (record.transfer, {"c": consumer, "p": ended})
    await put_transfer(store, make_transfer("u", consumer="c", producer="unknown"))
    await store.update_transfer("u", look)
    assert seen[-1][1] == {"c": consumer}


async def test_a_transition_writes_the_record_and_returns_it(store: Store) -> None:
    t = make_transfer("t")
    transition = await put_transfer(store, t)
    assert transition.transfer is t
    assert await store.get_transfer("t") == t
    await delete_transfer(store, "t")
    assert await store.get_transfer("t") is None
    assert await store.list_transfers() == []


async def test_a_failing_transition_leaves_no_trace(store: Store) -> None:
    await put_engine(store, make_engine("c"))
    before = await put_transfer(store, make_transfer("t"))
    revision = await store.revision()

    def fail(_cur: Transfer | None, _engines: Mapping[str, Engine]) -> Transition:
        raise RuntimeError("rejected")

    with pytest.raises(RuntimeError):
        await store.update_transfer("t", fail)
    assert await store.get_transfer("t") == before.transfer
    assert await store.last_event_sequence("c") == 0
    assert await store.revision() == revision


async def test_an_unchanged_transition_writes_nothing(store: Store) -> None:
    await put_transfer(store, make_transfer("t"))
    revision = await store.revision()
    await store.update_transfer("t", lambda cur, _e: Transition(cur))
    await store.update_transfer("missing", lambda cur, _e: Transition(cur))
    assert await store.revision() == revision
    assert await store.get_transfer("missing") is None


async def test_a_batch_of_updates_gives_each_its_own_answer_and_an_error_stops_no_other(store: Store) -> None:
    await put_engine(store, make_engine("c"))
    await put_transfer(store, make_transfer("old", num_tokens=1))

    def grow(cur: Transfer | None, _engines: Mapping[str, Engine]) -> Transition:
        assert cur is not None
        new = replace(cur, num_tokens=cur.num_tokens + 1)
        return Transition(new, (note("c", new, EventType.SOURCE_READY),))

    def fail(_cur: Transfer | None, _engines: Mapping[str, Engine]) -> Transition:
        raise LookupError("rejected")

    made = make_transfer("new")
    results = await store.update_transfers(
        [
            ("old", grow),
            ("bad", fail),
            ("new", lambda _cur, _e: Transition(made)),
            ("gone", lambda cur, _e: Transition(cur)),
        ]
    )
    assert isinstance(results[1], LookupError)
    assert [r.transfer for r in (results[0], results[2], results[3]) if isinstance(r, Transition)] == [
        replace(make_transfer("old", num_tokens=1), num_tokens=2),
        made,
        None,
    ]
    assert sorted(t.transfer_id for t in await store.list_transfers()) == ["new", "old"]
    assert await store.get_transfer("bad") is None
    assert [e.transfer.num_tokens for e in (await store.read_events("c", 1, 10)).events if e.transfer] == [2]


async def test_updates_of_one_transfer_in_one_batch_apply_in_order(store: Store) -> None:
    await put_transfer(store, make_transfer("t", num_tokens=1))

    def scaled(k: int, plus: int = 0) -> Callable[[Transfer | None, Mapping[str, Engine]], Transition]:
        def scale(cur: Transfer | None, _engines: Mapping[str, Engine]) -> Transition:
            assert cur is not None
            return Transition(replace(cur, num_tokens=cur.num_tokens * k + plus))

        return scale

    results = await store.update_transfers([("t", scaled(3)), ("t", scaled(1, 1)), ("t", scaled(5))])
    assert [r.transfer.num_tokens for r in results if isinstance(r, Transition) and r.transfer] == [3, 4, 20]
    final = await store.get_transfer("t")
    assert final is not None and final.num_tokens == 20


async def test_the_revision_grows_with_every_write(store: Store) -> None:
    revisions = [await store.revision()]
    await put_engine(store, make_engine("c"))
    revisions.append(await store.revision())
    await put_transfer(store, make_transfer("t"))
    revisions.append(await store.revision())
    await store.append_events([note("c")])
    revisions.append(await store.revision())
    await delete_transfer(store, "t")
    revisions.append(await store.revision())
    assert revisions == sorted(set(revisions))


async def test_the_answered_revision_covers_every_write_of_the_store(store: Store) -> None:
    """What a response header carries after a call that wrote: here the only writer, so the revision itself."""
    await put_engine(store, make_engine("c"))
    after_engine = await store.answered_revision()
    assert after_engine == await store.revision() > 0
    await put_transfer(store, make_transfer("t"), [note("c")])
    await store.append_events([note("c")])
    assert await store.answered_revision() == await store.revision() > after_engine


async def test_concurrent_transitions_of_one_transfer_are_atomic(backend: str, make_store: StoreFactory) -> None:
    # Many tasks increment one counter; with Redis they go through two stores (two replicas of one namespace).
    stores = [await make_store()] if backend == "memory" else [await make_store(), await make_store()]
    await put_engine(stores[0], make_engine("c"))
    await put_transfer(stores[0], make_transfer("t"))
    calls = 0

    def increment(cur: Transfer | None, _engines: Mapping[str, Engine]) -> Transition:
        nonlocal calls
        calls += 1
        assert cur is not None
        new = replace(cur, num_tokens=cur.num_tokens + 1)
        return Transition(new, (note("c", new, EventType.SOURCE_READY),))

    per_task = 25
    await asyncio.gather(*(s.update_transfer("t", increment) for s in stores * 8 for _ in range(per_task)))
    total = len(stores) * 8 * per_task
    final = await stores[0].get_transfer("t")
    assert final is not None and final.num_tokens == total
    page = await stores[-1].read_events("c", 1, 10 * total)
    assert [e.sequence for e in page.events] == list(range(1, total + 1))
    assert sorted(e.transfer.num_tokens for e in page.events if e.transfer) == list(range(1, total + 1))
    assert calls >= total


async def test_live_transfer_ids_follow_the_state(store: Store) -> None:
    await put_transfer(store, make_transfer("t", State.TARGETED))
    assert await store.live_transfer_ids("c") == ["t"]
    assert await store.live_transfer_ids("p") == []
    await put_transfer(store, make_transfer("t", State.MATCHED, producer="p"))
    await put_transfer(store, make_transfer("u", State.CLAIMED, consumer="", producer="p"))
    assert await store.live_transfer_ids("c") == ["t"]
    assert sorted(await store.live_transfer_ids("p")) == ["t", "u"]
    await put_transfer(store, make_transfer("t", State.COMMITTED, producer="p"))
    assert await store.live_transfer_ids("c") == ["t"]
    await put_transfer(store, make_transfer("t", State.RELEASED, producer="p"))
    assert await store.live_transfer_ids("c") == []
    assert await store.live_transfer_ids("p") == ["u"]
    await put_transfer(store, make_transfer("u", State.ABORTED, consumer="", producer="p"))
    assert await store.live_transfer_ids("p") == []


async def test_a_tombstone_awaiting_a_revocation_stays_indexed_until_it_is_confirmed(store: Store) -> None:
    await put_transfer(store, make_transfer("t", State.MATCHED, producer="p", assigned_generation=1))
    await put_transfer(store, make_transfer("t", State.ABORTED, producer="p", revoking_generation=1))
    assert await store.live_transfer_ids("p") == ["t"]
    assert await store.live_transfer_ids("c") == ["t"]
    await put_transfer(store, make_transfer("t", State.ABORTED, producer="p"))
    assert await store.live_transfer_ids("p") == []
    assert await store.live_transfer_ids("c") == []


async def test_list_transfers_includes_tombstones_and_filters_by_engine(store: Store) -> None:
    await put_transfer(store, make_transfer("t1", State.RELEASED, producer="p"))
    await put_transfer(store, make_transfer("t2", State.TARGETED, consumer="c2"))
    await put_transfer(store, make_transfer("t3", State.CLAIMED, consumer="", producer="p"))
    assert sorted(t.transfer_id for t in await store.list_transfers()) == ["t1", "t2", "t3"]
    assert sorted(t.transfer_id for t in await store.list_transfers("p")) == ["t1", "t3"]
    assert [t.transfer_id for t in await store.list_transfers("c")] == ["t1"]
    await delete_transfer(store, "t1")
    assert [t.transfer_id for t in await store.list_transfers("p")] == ["t3"]
    assert await store.list_transfers("c") == []


async def test_list_transfers_pages_through_many(store: Store) -> None:
    ids = {f"t{i:04d}" for i in range(2500)}
    for tid in ids:
        await put_transfer(store, make_transfer(tid))
    assert {t.transfer_id for t in await store.list_transfers()} == ids
    assert len(await store.list_transfers()) == len(ids)


LIVE = frozenset(s for s in State if not s.terminal)
ENDED = frozenset(s for s in State if s.terminal)
EVERY = LIVE | ENDED


async def page_ids(store: Store, engine_id: str | None, states: frozenset[State], after: str, limit: int) -> list[str]:
    return [t.transfer_id for t in await store.page_transfers(engine_id, states, after, limit)]


async def test_page_transfers_lists_by_id_from_after_up_to_limit_in_the_states_asked(store: Store) -> None:
    await put_transfer(store, make_transfer("t5"))
    await put_transfer(store, make_transfer("t1", State.RELEASED, producer="p"))
    await put_transfer(store, make_transfer("t3", State.MATCHED, producer="p"))
    await put_transfer(store, make_transfer("t2", State.CLAIMED, consumer="", producer="p"))
    await put_transfer(store, make_transfer("t4", State.ABORTED, consumer="c2"))
    assert await page_ids(store, None, EVERY, "", 10) == ["t1", "t2", "t3", "t4", "t5"]
    assert await page_ids(store, None, LIVE, "", 10) == ["t2", "t3", "t5"]
    assert await page_ids(store, None, ENDED, "", 10) == ["t1", "t4"]
    assert await page_ids(store, None, frozenset({State.MATCHED, State.ABORTED}), "", 10) == ["t3", "t4"]
    assert await page_ids(store, None, EVERY, "t2", 2) == ["t3", "t4"]
    assert await page_ids(store, None, LIVE, "t3", 10) == ["t5"]
    assert await page_ids(store, None, EVERY, "t5", 10) == []
    assert await page_ids(store, None, EVERY, "", 0) == []
    assert await page_ids(store, None, frozenset(), "", 10) == []
    assert await page_ids(store, "p", EVERY, "", 10) == ["t1", "t2", "t3"]
    assert await page_ids(store, "p", LIVE, "", 10) == ["t2", "t3"]
    assert await page_ids(store, "p", LIVE, "t2", 10) == ["t3"]
    assert await page_ids(store, "c", EVERY, "", 10) == ["t1", "t3", "t5"]
    assert await page_ids(store, "c", LIVE, "", 1) == ["t3"]
    assert await page_ids(store, "c2", LIVE, "", 10) == []
    assert await page_ids(store, "nobody", EVERY, "", 10) == []
    pages = [t async for t in _pages(store, None, EVERY, 2)]
    assert pages == ["t1", "t2", "t3", "t4", "t5"]


async def _pages(store: Store, engine_id: str | None, states: frozenset[State], size: int) -> AsyncIterator[str]:
    after = ""
    while page := await store.page_transfers(engine_id, states, after, size):
        for t in page:
            yield t.transfer_id
        after = page[-1].transfer_id


async def test_page_transfers_follows_state_changes_new_participants_and_deletes(store: Store) -> None:
    await put_transfer(store, make_transfer("t1"))
    await put_transfer(store, make_transfer("t2"))
    await put_transfer(store, make_transfer("t1", State.MATCHED, producer="p"))
    assert await page_ids(store, "p", LIVE, "", 10) == ["t1"]
    assert await page_ids(store, "p", EVERY, "", 10) == ["t1"]
    await put_transfer(store, make_transfer("t1", State.RELEASED, producer="p"))
    assert await page_ids(store, None, LIVE, "", 10) == ["t2"]
    assert await page_ids(store, "p", LIVE, "", 10) == []
    assert await page_ids(store, "p", ENDED, "", 10) == ["t1"]
    await delete_transfer(store, "t1")
    assert await page_ids(store, None, EVERY, "", 10) == ["t2"]
    assert await page_ids(store, "p", EVERY, "", 10) == []
    assert await page_ids(store, "c", EVERY, "", 10) == ["t2"]


async def test_page_transfers_pages_through_many_in_order(store: Store) -> None:
    ids = [f"t{i:04d}" for i in range(1200)]
    for i, tid in enumerate(ids):
        await put_transfer(store, make_transfer(tid, State.RELEASED if i % 3 else State.TARGETED))
    assert [t async for t in _pages(store, None, LIVE, 100)] == ids[::3]
    assert [t async for t in _pages(store, "c", EVERY, 250)] == ids
    assert await page_ids(store, None, LIVE, ids[-2], 100) == []


async def test_live_transfer_counts_answer_for_many_engines_at_once(store: Store) -> None:
    await put_transfer(store, make_transfer("t1", producer="p"))
    await put_transfer(store, make_transfer("t2"))
    await put_transfer(store, make_transfer("t3", State.RELEASED, producer="p"))
    assert await store.live_transfer_counts(["c", "p", "nobody"]) == {"c": 2, "p": 1, "nobody": 0}
    assert await store.live_transfer_counts([]) == {}


async def test_a_caller_is_its_record_its_live_count_and_its_owner_s_tallies_at_once(store: Store) -> None:
    engine = await put_engine(store, make_engine("c", owner="x"))
    await put_engine(store, make_engine("o", owner="y"))
    await put_transfer(store, make_transfer("t1", target_block_ids=(0, 1, 2)))
    await put_transfer(store, make_transfer("t2", target_block_ids=(3,)))
    await put_transfer(store, make_transfer("t3", consumer="o", target_block_ids=(4, 5)))
    view = await store.caller("c", live=True, usage=True)
    assert view == CallerView(engine, 2, await store.usage("x"))
    assert view.tally is not None and (view.tally.total.blocks, view.tally.identity.blocks) == (6, 4)
    assert await store.caller("c") == CallerView(engine)
    assert await store.caller("c", live=True) == CallerView(engine, 2)
    assert await store.caller("nobody", live=True, usage=True) == CallerView(None, 0)


async def test_due_transfers_are_those_whose_deadline_passed(store: Store) -> None:
    await put_transfer(store, make_transfer("early", deadline=NOW + 1))
    await put_transfer(store, make_transfer("exact", deadline=NOW + 2))
    await put_transfer(store, make_transfer("late", deadline=NOW + 3))
    await put_transfer(store, make_transfer("moved", deadline=NOW + 1))
    await put_transfer(store, make_transfer("moved", deadline=NOW + 100))
    await put_transfer(store, make_transfer("gone", deadline=NOW))
    await delete_transfer(store, "gone")
    assert sorted(await store.due_transfers(NOW + 2, 100)) == ["early", "exact"]


async def test_due_transfers_respects_the_limit_and_hands_each_out_once_per_sweep(store: Store) -> None:
    for i in range(10):
        await put_transfer(store, make_transfer(f"t{i}", deadline=NOW + i / 10))
    first = await store.due_transfers(NOW + 1, 4)
    second = await store.due_transfers(NOW + 1, 100)
    assert len(first) == 4
    assert sorted(first + second) == sorted(f"t{i}" for i in range(10))
    assert await store.due_transfers(NOW + 1, 100) == []


async def test_a_due_transfer_whose_deadline_moves_comes_due_again_later(store: Store) -> None:
    t = (await put_transfer(store, make_transfer("t", deadline=NOW))).transfer
    assert t is not None
    assert await store.due_transfers(NOW, 10) == ["t"]
    await put_transfer(store, replace(t, state=State.ABORTED, deadline=NOW + 300))
    assert await store.due_transfers(NOW + 299, 10) == []
    assert await store.due_transfers(NOW + 300, 10) == ["t"]


# Events


async def test_an_engine_without_a_record_reads_as_forgotten(store: Store) -> None:
    await put_engine(store, make_engine("c"))
    assert (await store.read_events("c", 1, 10)).forgotten is False
    assert (await store.read_events("nobody", 1, 10)).forgotten is True
    await store.update_engine("c", lambda _cur: None)
    assert (await store.read_events("c", 1, 10)).forgotten is True


async def test_each_engine_numbers_its_events_from_one(store: Store) -> None:
    await put_engine(store, make_engine("c"))
    await put_engine(store, make_engine("p", Role.PRODUCER))
    t = make_transfer("t", State.MATCHED, producer="p")
    await put_transfer(store, t, [note("p", t), note("c", t, EventType.SOURCE_READY), note("p", t)])
    await store.append_events([note("c", None, EventType.PEER_LOST), note("nobody")])
    assert await store.last_event_sequence("p") == 2
    assert await store.last_event_sequence("c") == 2
    assert await store.last_event_sequence("nobody") == 0
    p_page = await store.read_events("p", 1, 10)
    assert [(e.sequence, e.type) for e in p_page.events] == [
        (1, EventType.TRANSFER_ASSIGNED),
        (2, EventType.TRANSFER_ASSIGNED),
    ]
    assert p_page.last_sequence == 2 and p_page.resync_sequence is None
    c_page = await store.read_events("c", 1, 10)
    assert [(e.sequence, e.type) for e in c_page.events] == [(1, EventType.SOURCE_READY), (2, EventType.PEER_LOST)]
    assert c_page.events[0].transfer == t
    assert c_page.events[0].time == NOW and c_page.events[0].generation == 1


async def test_events_carry_their_peer_engine(store: Store) -> None:
    consumer = await put_engine(store, make_engine("c"))
    await put_engine(store, make_engine("p", Role.PRODUCER))
    t = make_transfer("t", State.MATCHED, producer="p")
    assigned = Addressed("p", Event(EventType.TRANSFER_ASSIGNED, NOW, t, 1, consumer))
    await put_transfer(store, t, [assigned])
    (event,) = (await store.read_events("p", 1, 10)).events
    assert event.peer == consumer
    assert event == replace(assigned.event, sequence=1)


async def test_read_events_starts_anywhere_and_respects_the_limit(store: Store) -> None:
    await put_engine(store, make_engine("c"))
    for _ in range(10):
        await store.append_events([note("c")])
    page = await store.read_events("c", 4, 3)
    assert [e.sequence for e in page.events] == [4, 5, 6]
    assert page.last_sequence == 10
    assert [e.sequence for e in (await store.read_events("c", 9, 100)).events] == [9, 10]
    tail = await store.read_events("c", 11, 100)
    assert (list(tail.events), tail.last_sequence, tail.resync_sequence) == ([], 10, None)


async def test_a_reader_behind_the_trimmed_log_is_told_to_resync(make_store: StoreFactory) -> None:
    store = await make_store(max_events_per_engine=5)
    await put_engine(store, make_engine("c"))
    # Redis trims whole stream nodes (MAXLEN ~), so write well past a node's worth.
    for _ in range(30):
        await store.append_events([note("c")] * 10)
    last = await store.last_event_sequence("c")
    assert last == 300
    behind = await store.read_events("c", 1, 10)
    assert (list(behind.events), behind.last_sequence, behind.resync_sequence) == ([], 300, 301)
    recent = await store.read_events("c", 296, 10)
    assert [e.sequence for e in recent.events] == [296, 297, 298, 299, 300]
    assert recent.resync_sequence is None


async def test_deleting_an_engine_drops_its_log(store: Store) -> None:
    await put_engine(store, make_engine("c"))
    await store.append_events([note("c"), note("c")])
    await store.update_engine("c", lambda _cur: None)
    assert await store.last_event_sequence("c") == 0
    await put_engine(store, make_engine("c", now=NOW + 1))
    await store.append_events([note("c")])
    assert [e.sequence for e in (await store.read_events("c", 1, 10)).events] == [1]


async def test_a_deleted_or_reowned_engines_log_leaves_the_bounds_it_counted_in(make_store: StoreFactory) -> None:
    probe = await make_store()
    await put_engine(probe, make_engine("u"))
    await probe.append_events([note("u")])
    size = await probe.event_log_bytes("u")  # one such event, as this store counts it
    store = await make_store(max_event_bytes_per_identity=3 * size, max_event_bytes_total=4 * size)
    for engine_id in ("a", "b", "c"):
        await put_engine(store, replace(make_engine(engine_id), owner="A"))
    await store.append_events([note("a"), note("a"), note("b")])  # A's 3: at its bound
    await store.update_engine("a", lambda _cur: None)  # deleted: its 2 leave A's count and the server's
    await put_engine(store, replace(make_engine("b", now=NOW + 1), owner="B"))  # b's 1 moves from A to B
    await store.append_events([note("c"), note("c"), note("c")])  # A's 3 again, 4 in all: nothing trimmed
    assert [e.sequence for e in (await store.read_events("c", 1, 10)).events] == [1, 2, 3]
    assert [e.sequence for e in (await store.read_events("b", 1, 10)).events] == [1]
    await store.append_events([note("b")])  # 5 over the server's 4: only the oldest of all (b's first) goes
    assert [e.sequence for e in (await store.read_events("c", 1, 10)).events] == [1, 2, 3]
    assert (await store.read_events("b", 1, 10)).resync_sequence is not None
    assert [e.sequence for e in (await store.read_events("b", 2, 10)).events] == [2]


async def test_wait_events_returns_once_the_log_passes_the_sequence(store: Store) -> None:
    await put_engine(store, make_engine("c"))
    await store.append_events([note("c")])
    # Already past: it returns at once, not after its own (hour-long) timeout; the 30 s only guard a hang.
    await asyncio.wait_for(store.wait_events("c", 0, timeout=3600), 30)
    waiter = asyncio.create_task(store.wait_events("c", 1, timeout=10))
    # Not a synchronisation: whenever the waiter starts, sequence 2 wakes it. This only shows it blocks.
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await store.append_events([note("c")])
    await asyncio.wait_for(waiter, 5)  # woken, well before its own 10 s timeout


async def test_wait_events_gives_up_after_the_timeout(store: Store) -> None:
    await put_engine(store, make_engine("c"))
    started = time.monotonic()
    await asyncio.wait_for(store.wait_events("c", 0, timeout=0.3), 30)  # the 30 s only guard a hang
    assert time.monotonic() - started >= 0.25


async def test_a_transition_wakes_waiters_of_the_engines_it_tells(store: Store) -> None:
    await put_engine(store, make_engine("c"))
    await put_engine(store, make_engine("p", Role.PRODUCER))
    waiters = [asyncio.create_task(store.wait_events(e, 0, timeout=10)) for e in ("c", "p")]
    await asyncio.sleep(0.05)
    t = make_transfer("t", State.MATCHED, producer="p")
    await put_transfer(store, t, [note("p", t)])
    await asyncio.wait_for(waiters[1], 5)
    assert not waiters[0].done()
    waiters[0].cancel()
    await asyncio.gather(waiters[0], return_exceptions=True)


# Responses


async def test_a_response_is_remembered_until_its_ttl(store: Store) -> None:
    # Real time (Redis expires keys by its own clock): the TTL must outlast the one call that reads the answer back,
    # on a loaded machine too (0.3 s, with another call in between, left too little).
    assert await store.get_response("k") is None
    await store.put_response("k", b"\x00answer", ttl=1.0)
    assert await store.get_response("k") == b"\x00answer"
    await store.put_response("long", b"kept", ttl=60)
    deadline = time.monotonic() + 30
    while await store.get_response("k") is not None:
        assert time.monotonic() < deadline, "the response outlived its ttl"
        await asyncio.sleep(0.05)
    assert await store.get_response("long") == b"kept"
