"""ListTransfers paging reads about one page, not every transfer: the memory store's id indexes, the Redis
store's decoding, and the coordinator on top of them."""

from __future__ import annotations

import random
from typing import Any

import pytest

from rendezvous.coordinator import Coordinator
from rendezvous.core.model import State, Transfer
from rendezvous.core.transfers import Transition
from rendezvous.store import MemoryStore, Store
from rendezvous.store._sorted import SortedIds
from rendezvous.store.base import TransferFn
from tests.store.conftest import StoreFactory
from tests.store.test_contract import make_transfer, put_transfer

LIVE = frozenset(s for s in State if not s.terminal)
EVERY = frozenset(State)


def test_sorted_ids_agree_with_a_sorted_set_through_splits_and_removals() -> None:
    rng = random.Random(7)
    ids, reference = SortedIds(), set[str]()
    for step in range(12_000):
        key = f"t{rng.randrange(4000):05d}"
        if step < 5000 or rng.random() < 0.5:
            ids.add(key)
            reference.add(key)
        else:
            ids.discard(key)
            reference.discard(key)
        if step % 997 == 0:
            assert list(ids) == sorted(reference) and len(ids) == len(reference)
    ordered = sorted(reference)
    for after in ("", "t", ordered[0], ordered[len(ordered) // 2], "t01234x", ordered[-1], "u"):
        assert list(ids.after(after)) == [k for k in ordered if k > after]
    assert ordered[3] in ids and "t99999" not in ids
    for key in ordered:
        ids.discard(key)
    assert list(ids) == [] and len(ids) == 0 and list(ids.after("")) == []


class _CountingDict(dict[str, Transfer]):
    """The memory store's transfer table, counting record lookups."""

    lookups = 0

    def __getitem__(self, key: str) -> Transfer:
        self.lookups += 1
        return super().__getitem__(key)


async def test_a_memory_page_looks_at_about_a_page_of_records_among_many_tombstones() -> None:
    store = MemoryStore()
    for i in range(3000):
        state = State.TARGETED if i % 500 == 0 else State.RELEASED
        await put_transfer(store, make_transfer(f"t{i:05d}", state, producer="p" if i % 2 else ""))
    table = store._transfers = _CountingDict(store._transfers)
    assert [t.transfer_id for t in await store.page_transfers(None, LIVE, "", 3)] == ["t00000", "t00500", "t01000"]
    assert table.lookups == 3
    table.lookups = 0
    page = await store.page_transfers(None, EVERY, "t01000", 10)
    assert [t.transfer_id for t in page] == [f"t{i:05d}" for i in range(1001, 1011)]
    assert table.lookups == 10
    table.lookups = 0
    page = await store.page_transfers("p", EVERY, "t02000", 5)
    assert [t.transfer_id for t in page] == [f"t{i:05d}" for i in range(2001, 2011, 2)]
    assert table.lookups == 5


# The Redis backends only (the memory store decodes nothing): this overrides the `backend` fixture's params.
@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.redis) for b in ("redis", "cluster")])
async def test_a_coordinator_page_decodes_about_a_page_of_redis_records(
    backend: str, make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rendezvous.store.redis.cache as redis_store
    from rendezvous.store import codec

    store = await make_store()
    for i in range(400):
        await put_transfer(store, make_transfer(f"t{i:04d}", State.TARGETED if i % 4 == 0 else State.ABORTED))
    decoded: list[str] = []

    def counting_decode(data: Any) -> Transfer:
        transfer = decode(data)
        decoded.append(transfer.transfer_id)
        return transfer

    decode = codec.decode_transfer
    monkeypatch.setattr(redis_store, "decode_transfer", counting_decode)
    coordinator = Coordinator(store)
    first = await coordinator.list_transfers(page_size=10)
    assert [t.transfer_id for t in first.transfers] == [f"t{i:04d}" for i in range(0, 40, 4)]
    assert len(decoded) <= 11, f"one page decoded {len(decoded)} records"
    decoded.clear()
    second = await coordinator.list_transfers(page_size=10, page_token=first.next_page_token)
    assert [t.transfer_id for t in second.transfers] == [f"t{i:04d}" for i in range(40, 80, 4)]
    assert len(decoded) <= 11
    decoded.clear()
    every = await coordinator.list_transfers(states=[State.ABORTED], page_size=5)
    assert [t.transfer_id for t in every.transfers] == ["t0001", "t0002", "t0003", "t0005", "t0006"]
    assert len(decoded) <= 6


def _elements(reply: Any) -> int:
    """How many values a Redis reply holds, nested replies included."""
    if isinstance(reply, (list, tuple)):
        return sum(_elements(item) for item in reply) + 1
    return 1


# The Redis backends only, as above.
@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.redis) for b in ("redis", "cluster")])
async def test_a_redis_page_that_names_no_engine_brings_back_about_a_page_not_every_id(
    backend: str, make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ListTransfers page over all engines costs about a page: the replica gets a page's ids and records from
    Redis, not every transfer id of the namespace (read in SSCAN pages and sorted, for each page, before)."""
    store = await make_store()
    ids = [f"t{i:05d}" for i in range(3000)]

    def create(transfer: Transfer) -> TransferFn:
        return lambda _cur, _e: Transition(transfer)

    for start in range(0, len(ids), 500):
        await store.update_transfers(
            [
                (tid, create(make_transfer(tid, State.TARGETED if i % 10 == 0 else State.ABORTED)))
                for i, tid in enumerate(ids[start : start + 500], start)
            ]
        )
    received = 0
    scripts, command = store._scripts, store._command  # type: ignore[attr-defined]

    async def counted_script(name: str, /, **args: Any) -> Any:
        nonlocal received
        reply = await run(name, **args)
        received += _elements(reply)
        return reply

    async def counted_command(*args: Any) -> Any:
        nonlocal received
        reply = await command(*args)
        received += _elements(reply)
        return reply

    async def not_needed() -> None:
        raise AssertionError("the id indexes of a namespace this version wrote needed rebuilding")

    run = scripts.run
    monkeypatch.setattr(store, "_index_transfers", not_needed)
    monkeypatch.setattr(scripts, "run", counted_script)
    monkeypatch.setattr(store, "_command", counted_command)
    page = await store.page_transfers(None, LIVE, "t01000", 10)
    assert [t.transfer_id for t in page] == [f"t{i:05d}" for i in range(1010, 1110, 10)]
    assert received <= 4 * 10 + 8, f"a page of 10 live transfers brought back {received} values"
    received = 0
    page = await store.page_transfers(None, EVERY, "t02000", 10)
    assert [t.transfer_id for t in page] == [f"t{i:05d}" for i in range(2001, 2011)]
    assert received <= 4 * 10 + 8, f"a page of 10 transfers brought back {received} values"


class _CountingStore:
    """A real store, with the records its list calls hand back counted."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.calls: dict[str, int] = {}
        self.records = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in ("list_transfers", "page_transfers"):
            return attr

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            result = await attr(*args, **kwargs)
            self.records += len(result)
            return result

        return counted


async def test_each_coordinator_page_gets_about_a_page_of_records_from_the_store(store: Store) -> None:
    for i in range(300):
        await put_transfer(store, make_transfer(f"t{i:04d}", State.TARGETED if i % 3 else State.RELEASED))
    counting = _CountingStore(store)
    coordinator = Coordinator(counting)  # type: ignore[arg-type]
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        before = counting.records
        page = await coordinator.list_transfers(engine_id="c", page_size=25, page_token=token)
        assert counting.records - before <= 26
        seen += [t.transfer_id for t in page.transfers]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert seen == [f"t{i:04d}" for i in range(300) if i % 3]
    assert pages == 8
    assert "list_transfers" not in counting.calls


async def test_the_memory_deadline_heap_stays_within_twice_the_records_as_deadlines_move() -> None:
    store = MemoryStore()
    for i in range(3_000):
        tid = f"t{i:05d}"
        for step in range(4):  # a lifecycle moves its deadline: target, commit, release
            await put_transfer(store, make_transfer(tid, deadline=1_000.0 + i + step))
        if i % 3:
            await store.update_transfer(tid, lambda _cur, _e: Transition(None))
    assert len(store._deadlines) <= 2 * len(store._transfers) + 1_024
    due = await store.due_transfers(1e9, 10_000)
    assert sorted(due) == sorted(store._transfers) and len(due) == len(set(due))
