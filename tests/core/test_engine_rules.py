"""The engine rules the sweeper and the coordinator apply, each one core function: lapse, the sweep step,
the live-transfer limit."""

from __future__ import annotations

import pytest

from rendezvous.core import engines as rules
from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import Engine, Role, State, Transfer
from rendezvous.protocol.errors import Reason, RendezvousError
from tests.core.helpers import engine_spec

NOW = 1_000_000.0
TTL = 50.0


def engine(engine_id: str = "e", registered: float = NOW) -> Engine:
    return rules.register_engine(registered, None, engine_spec(engine_id, Role.CONSUMER), Limits(), Timeouts())


def test_a_live_engine_lapses_once_its_lease_passed() -> None:
    e = engine()  # lease until NOW + 10
    assert rules.lapse(e, NOW + 9.9, TTL) is None
    assert rules.lapse(e, e.lease_expires_at, TTL) is rules.Lapse.LEASE_PASSED


def test_a_tombstone_lapses_once_it_aged_tombstone_ttl() -> None:
    ended = rules.end_incarnation(NOW, engine())
    assert rules.lapse(ended, NOW + TTL - 0.1, TTL) is None
    assert rules.lapse(ended, NOW + TTL, TTL) is rules.Lapse.TOMBSTONE_AGED


def test_the_sweep_step_ends_a_lapsed_lease_and_forgets_an_aged_tombstone() -> None:
    e = engine()
    later = e.lease_expires_at
    assert rules.sweep_engine(later, TTL, e, e) == rules.end_incarnation(later, e)
    ended = rules.end_incarnation(NOW, e)
    assert rules.sweep_engine(NOW + TTL, TTL, ended, ended) is None


def test_the_sweep_step_leaves_a_record_that_changed_since_it_lapsed() -> None:
    e = engine()
    later = e.lease_expires_at
    renewed = rules.renew_lease(later, e)
    assert rules.sweep_engine(later, TTL, e, renewed) is renewed
    replaced = engine(registered=NOW + 5)
    assert replaced.incarnation != e.incarnation
    assert rules.sweep_engine(later, TTL, e, replaced) is replaced
    ended_meanwhile = rules.end_incarnation(later - 1, e)
    assert rules.sweep_engine(later, TTL, e, ended_meanwhile) is ended_meanwhile
    assert rules.sweep_engine(later, TTL, e, None) is None
    assert rules.sweep_engine(NOW, TTL, e, e) is e  # it never lapsed


def test_the_live_transfer_limit_refuses_joining_once_full_but_not_calls_on_own_transfers() -> None:
    e = engine("c")
    limit = rules.LiveTransferLimit.of(Limits(max_live_transfers_per_engine=2), e, 1)
    assert limit.room == 1 and limit.allows(1) and not limit.allows(2)
    limit.check(None)
    mine = Transfer("t", State.TARGETED, NOW + 10, consumer_engine_id="c")
    full = limit.after(mine)
    assert full.room == 0
    full.check(mine)
    with pytest.raises(RendezvousError) as raised:
        full.check(None)
    assert raised.value.reason == Reason.TOO_MANY_TRANSFERS
    with pytest.raises(RendezvousError):
        full.check(Transfer("u", State.CLAIMED, NOW + 10, producer_engine_id="p"))
    assert full.after(None) is full
    assert full.after(Transfer("v", State.ABORTED, NOW)) is full
