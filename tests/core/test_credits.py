"""The credit rule (rendezvous.core.credits) as pure functions, and the coordinator driving it on a memory store."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rendezvous.clients.testing import FakeClock
from rendezvous.coordinator import Coordinator
from rendezvous.core import credits
from rendezvous.core.credits import EngineCapacity, Reservation
from rendezvous.core.engines import register_engine
from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import Engine, Role, State, Transfer
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.protocol.records import EngineCredits
from rendezvous.protocol.requests import AbortSpec, CreditSpec, TargetSpec
from rendezvous.store.memory import MemoryStore
from tests.core.helpers import engine_spec, run

NOW = 1_000_000.0
LIMITS = Limits()


def consumer(max_transfers: int = 0, max_blocks: int = 0, engine_id: str = "d0") -> Engine:
    spec = engine_spec(engine_id, Role.CONSUMER, capacity=EngineCapacity(max_transfers, max_blocks))
    return register_engine(NOW, None, spec, LIMITS, Timeouts())


def target(transfer_id: str, engine: Engine, blocks: int, state: State = State.TARGETED) -> Transfer:
    return Transfer(
        transfer_id,
        state,
        NOW + 60,
        consumer_engine_id=engine.engine_id,
        consumer_incarnation=engine.incarnation,
        target_block_ids=tuple(range(blocks)),
    )


def held(engine: Engine, transfer_id: str, blocks: int = 0, expires: float = NOW + 30) -> Reservation:
    return Reservation(transfer_id, engine.engine_id, engine.incarnation, blocks, expires)


def test_usage_counts_live_targets_and_reservations_that_still_hold_credit() -> None:
    d = consumer(4)
    other = consumer(engine_id="d1")
    targets = [target("a", d, 3), target("b", d, 2, State.RELEASED), target("c", other, 9)]
    reservations = [
        held(d, "r1", 5),
        held(d, "r2", 7, expires=NOW),  # expired
        Reservation("r3", "d0", d.incarnation - 1, 1, NOW + 30),  # an older incarnation's
        held(d, "a", 3),  # spent: its transfer has a target
        held(d, "r4", 1),  # void: its transfer was aborted
    ]
    aborted = Transfer("r4", State.ABORTED, NOW)
    u = credits.usage(d, targets, reservations, {"a": targets[0], "r4": aborted}, NOW)
    assert u == EngineCredits(transfers_in_use=1, blocks_in_use=3, transfers_reserved=1, blocks_reserved=5)


def test_usage_by_count_reads_no_targets() -> None:
    d = consumer(4)
    u = credits.usage_by_count(d, 3, [held(d, "r1", 5), held(d, "r2", expires=NOW)], {}, NOW)
    assert u == EngineCredits(transfers_in_use=3, blocks_in_use=0, transfers_reserved=1, blocks_reserved=5)


def test_reserve_refuses_beyond_capacity_naming_the_limit() -> None:
    d = consumer(max_transfers=2, max_blocks=10)
    r = credits.reserve(NOW, d, CreditSpec("t", "d0", 4), None, None, EngineCredits(1, 6), 30, LIMITS)
    assert (r.engine_id, r.blocks, r.expires_at) == ("d0", 4, NOW + 30)
    with pytest.raises(RendezvousError) as full:
        credits.reserve(NOW, d, CreditSpec("t", "d0", 1), None, None, EngineCredits(1, 1, 1, 1), 30, LIMITS)
    assert full.value.reason == Reason.ENGINE_CAPACITY_EXCEEDED
    assert full.value.metadata == {
        "engine_id": "d0",
        "limit": "transfers",
        "max": "2",
        "in_use": "1",
        "reserved": "1",
        "requested": "1",
    }
    with pytest.raises(RendezvousError) as blocks:
        credits.reserve(NOW, d, CreditSpec("t", "d0", 5), None, None, EngineCredits(1, 6), 30, LIMITS)
    assert blocks.value.metadata["limit"] == "blocks"


def test_an_engine_holds_at_most_max_credits_per_engine_reservations_whatever_its_capacity() -> None:
    """Zero-block reservations always fit a capacity of blocks alone, and any fits an engine without a capacity:
    the ledger's own bound refuses them once full (found by an audit: 2,048 such items were admitted in one call,
    and every later item read them all). Expired ones and the id's own do not count."""
    limits = replace(LIMITS, max_credits_per_engine=2)
    for d in (consumer(max_blocks=10), consumer()):
        full = [held(d, "a"), held(d, "b")]
        with pytest.raises(RendezvousError) as refused:
            credits.reserve(NOW, d, CreditSpec("c", "d0", 0), None, None, EngineCredits(), 30, limits, full)
        assert refused.value.reason == Reason.ENGINE_CAPACITY_EXCEEDED
        assert refused.value.metadata == {"engine_id": "d0", "limit": "reservations", "max": "2"}
        lapsed = [held(d, "a"), held(d, "b", expires=NOW)]
        assert credits.reserve(NOW, d, CreditSpec("c", "d0", 0), None, None, EngineCredits(), 30, limits, lapsed)
        before = replace(full[0], incarnation=d.incarnation - 1)  # the id's own, of the engine's last incarnation
        again = credits.reserve(NOW, d, CreditSpec("a", "d0", 3), before, None, EngineCredits(), 30, limits, full)
        assert again.blocks == 3  # it replaces that one: no more room taken


def test_reserve_is_idempotent_and_conflicts_are_named() -> None:
    d = consumer(max_transfers=1)
    mine = held(d, "t", 2)
    spent = EngineCredits(0, 0, 1, 2)  # the existing reservation itself
    again = credits.reserve(NOW + 5, d, CreditSpec("t", "d0", 2), mine, None, spent, 30, LIMITS)
    assert again.expires_at == NOW + 35  # renewed, without needing room
    for request in (CreditSpec("t", "d0", 3), CreditSpec("t", "d1", 2)):
        engine = d if request.engine_id == "d0" else consumer(engine_id="d1")
        with pytest.raises(RendezvousError) as conflict:
            credits.reserve(NOW, engine, request, mine, None, spent, 30, LIMITS)
        assert conflict.value.reason == Reason.CREDIT_CONFLICT
    expired = held(d, "t", 9, expires=NOW)
    assert credits.reserve(NOW, d, CreditSpec("t", "d0", 2), expired, None, EngineCredits(), 30, LIMITS).blocks == 2


@pytest.mark.parametrize(
    ("engine", "request_", "transfer", "reason"),
    [
        (None, CreditSpec("t", "nobody"), None, Reason.ENGINE_NOT_FOUND),
        (
            register_engine(NOW, None, engine_spec("p0", Role.PRODUCER), LIMITS, Timeouts()),
            CreditSpec("t", "p0"),
            None,
            Reason.WRONG_ROLE,
        ),
        (consumer(), CreditSpec("t", "d0", LIMITS.max_blocks_per_target + 1), None, Reason.TOO_MANY_BLOCKS),
        (consumer(), CreditSpec("t", "d0"), Transfer("t", State.ABORTED, NOW), Reason.TRANSFER_ENDED),
    ],
)
def test_reserve_refuses_bad_input(
    engine: Engine | None, request_: CreditSpec, transfer: Transfer | None, reason: Reason
) -> None:
    with pytest.raises(RendezvousError) as err:
        credits.reserve(NOW, engine, request_, None, transfer, EngineCredits(), 30, LIMITS)
    assert err.value.reason == reason


def test_capacity_bounds_and_roles() -> None:
    credits.check_capacity(Role.CONSUMER, EngineCapacity(LIMITS.max_capacity_transfers, 0), LIMITS)
    for role, capacity in (
        (Role.CONSUMER, EngineCapacity(LIMITS.max_capacity_transfers + 1)),
        (Role.CONSUMER, EngineCapacity(0, LIMITS.max_capacity_blocks + 1)),
        (Role.CONSUMER, EngineCapacity(-1)),
        (Role.PRODUCER, EngineCapacity(1)),
    ):
        with pytest.raises(RendezvousError) as err:
            credits.check_capacity(role, capacity, LIMITS)
        assert err.value.reason == Reason.CAPACITY_INVALID
    with pytest.raises(RendezvousError):
        credits.credit_ttl(Timeouts().max_timeout + 1, Timeouts())
    assert credits.credit_ttl(0, Timeouts()) == Timeouts().default_credit_ttl


def test_a_target_takes_its_reservations_place() -> None:
    d = consumer(max_transfers=1, max_blocks=4)
    r = held(d, "t", 3)
    spent = EngineCredits(0, 0, 1, 3)
    after = credits.target_admission(d, spent, None, r, 3, NOW)
    assert after == EngineCredits(1, 3, 0, 0)
    # Without a reservation there is no room; with one that asked for fewer blocks, only the excess counts.
    with pytest.raises(RendezvousError):
        credits.target_admission(d, spent, None, None, 1, NOW)
    with pytest.raises(RendezvousError):
        credits.target_admission(d, spent, None, r, 5, NOW)
    assert credits.target_admission(d, spent, None, r, 4, NOW) == EngineCredits(1, 4, 0, 0)
    # A re-registration (a later generation) gives back the blocks of the one it replaces.
    cur = target("t", d, 4)
    assert credits.target_admission(d, EngineCredits(1, 4), cur, None, 2, NOW) == EngineCredits(1, 2)


def test_the_coordinator_spends_reservations_and_reclaims_them() -> None:
    clock = FakeClock(NOW)
    coordinator = Coordinator(MemoryStore(), clock=clock)
    d, _ = run(coordinator.register_engine(engine_spec("d0", Role.CONSUMER, capacity=EngineCapacity(2), lease_ttl=300)))
    [r1, r2, r3] = run(coordinator.reserve_credits([CreditSpec(f"t{i}", "d0", 1) for i in (1, 2, 3)], ttl=10))
    assert r1.reservation and r2.reservation and r3.error and r3.error.reason == Reason.ENGINE_CAPACITY_EXCEEDED
    [target_1] = run(coordinator.register_targets("d0", d.incarnation, [TargetSpec("t1", (0,))]))
    assert target_1.error is None
    assert run(coordinator.store.credits().get("t1")) is None  # spent: the target holds the credit now
    # Without a block limit the target's blocks are not counted (nothing limits them).
    assert run(coordinator.engine_tallies([d]))[1]["d0"] == EngineCredits(1, 0, 1, 1)
    run(coordinator.abort_transfers("", 0, [AbortSpec("t2")]))  # only a reservation: it goes
    assert run(coordinator.engine_tallies([d]))[1]["d0"] == EngineCredits(1, 0, 0, 0)
    [r4] = run(coordinator.reserve_credits([CreditSpec("t4", "d0")], ttl=10))
    assert r4.reservation is not None
    clock.advance(11)
    run(coordinator.sweep())
    assert run(coordinator.store.credits().get("t4")) is None  # past its TTL
    [r5] = run(coordinator.reserve_credits([CreditSpec("t5", "d0")], ttl=100))
    assert r5.reservation is not None
    run(coordinator.deregister_engine("d0", d.incarnation))
    assert run(coordinator.store.credits().get("t5")) is None  # the incarnation ended: credit reclaimed
