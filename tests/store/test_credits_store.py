"""The CreditStore contract (rendezvous/store/credits.py), the same on every backend: compare-and-set on an
engine's ledger version and on the transfer id's holder, drops, the expiry index; replicas share it."""

from __future__ import annotations

import asyncio

from rendezvous.core.credits import Reservation
from rendezvous.store.base import Store
from tests.store.conftest import StoreFactory


async def replicas(make_store: StoreFactory, backend: str, n: int) -> list[Store]:
    """n stores of one namespace (Redis), or one memory store n times (it is one process's)."""
    if backend == "memory":
        return [await make_store()] * n
    return [await make_store() for _ in range(n)]


def res(transfer_id: str, engine_id: str = "d0", blocks: int = 1, expires: float = 100.0) -> Reservation:
    return Reservation(transfer_id, engine_id, 7, blocks, expires)


async def test_put_is_compare_and_set_on_the_ledger(make_store: StoreFactory, backend: str) -> None:
    one, two = await replicas(make_store, backend, 2)
    a, b = one.credits(), two.credits()
    empty = await a.ledger("d0")
    assert (empty.version, empty.reservations) == (0, ())
    assert await a.put(res("t1"), empty.version, None)
    # The other replica decided on the version before that write: refused, nothing written.
    assert not await b.put(res("t2"), empty.version, None)
    seen = await b.ledger("d0")
    assert seen.reservations == (res("t1"),) and seen.version > 0
    assert await b.put(res("t2"), seen.version, None)
    # A holder that changed meanwhile is a conflict too; the right one moves the reservation.
    latest = await a.ledger("d0")
    assert not await a.put(res("t1", blocks=2), latest.version, None)
    assert await a.put(res("t1", blocks=2), latest.version, res("t1"))
    assert await b.get("t1") == res("t1", blocks=2)
    moved_to = await a.ledger("d1")
    assert await a.put(res("t1", "d1"), moved_to.version, res("t1", blocks=2))
    assert {r.transfer_id for r in (await b.ledger("d0")).reservations} == {"t2"}
    assert (await b.ledger("d1")).reservations == (res("t1", "d1"),)
    assert set(await b.ledgers(["d0", "d1"])) == {"d0", "d1"}


async def test_racing_puts_on_one_version_let_one_win(make_store: StoreFactory, backend: str) -> None:
    stores = await replicas(make_store, backend, 3)
    version = (await stores[0].credits().ledger("d0")).version
    won = await asyncio.gather(*(s.credits().put(res(f"t{i}"), version, None) for i, s in enumerate(stores)))
    assert sorted(won) == [False, False, True]


async def test_drop_and_due(make_store: StoreFactory) -> None:
    credits = (await make_store()).credits()
    for i, expires in enumerate((10.0, 20.0, 30.0)):
        assert await credits.put(res(f"t{i}", expires=expires), (await credits.ledger("d0")).version, None)
    assert sorted(await credits.due(20.0, 10)) == ["t0", "t1"]
    assert len(await credits.due(20.0, 1)) == 1
    before = (await credits.ledger("d0")).version
    assert await credits.drop("t0") == res("t0", expires=10.0)
    assert await credits.drop("t0") is None
    assert (await credits.ledger("d0")).version > before
    assert await credits.due(20.0, 10) == ["t1"]
    assert await credits.get("t0") is None


async def test_a_drop_of_an_expected_reservation_leaves_another_in_its_place(
    make_store: StoreFactory, backend: str
) -> None:
    one, two = await replicas(make_store, backend, 2)
    a, b = one.credits(), two.credits()
    assert await a.put(res("t", expires=10.0), 0, None)
    seen = await a.get("t")
    assert seen == res("t", expires=10.0)
    # Another replica puts a new reservation for the id in place of the one a read.
    assert await b.put(res("t", expires=50.0), (await b.ledger("d0")).version, seen)
    assert await a.drop("t", expected=seen) is None
    assert await b.get("t") == res("t", expires=50.0)
    assert (await b.ledger("d0")).reservations == (res("t", expires=50.0),)
    assert await a.drop("t", expected=res("t", expires=50.0)) == res("t", expires=50.0)
    assert await b.get("t") is None and (await b.ledger("d0")).reservations == ()
