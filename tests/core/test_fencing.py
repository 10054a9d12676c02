"""Regressions for races and loss (issue 10): every path frees the consumer's blocks, no assignment ever names
an incarnation other than the one that registered, and each mistake gets one answer."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rendezvous.coordinator import Coordinator
from rendezvous.core import (
    AbortReason,
    AbortSpec,
    CompletionSpec,
    Engine,
    EventType,
    Mode,
    Outcome,
    Reason,
    ReleaseSpec,
    RevocationAck,
    Role,
    SourceReadySpec,
    State,
    TargetSpec,
)
from rendezvous.core.engines import register_engine
from rendezvous.store import MemoryStore
from rendezvous.store.base import EngineFn
from tests.core.helpers import engine_spec, run
from tests.core.test_lifecycle import TIMEOUTS, World, ok, reason, types


def assigned_then_aborted_by_consumer(w: World) -> None:
    """RegisterTargets(d1, t1), ClaimTransfers(p1, t1) -> ASSIGNED(1), then the consumer aborts: revocation pending."""
    w.target()
    w.claim()
    assert types(w.events("p1")) == [EventType.TRANSFER_ASSIGNED]
    (aborted,) = run(w.coord.abort_transfers("d1", 0, [AbortSpec("t1", "client went away")]))
    assert aborted.transfer is not None and aborted.transfer.revoking_generation == 1


def lease_lapses(w: World) -> None:
    half = TIMEOUTS.default_lease_ttl / 2 + 1
    w.clock.advance(half)
    run(w.coord.keep_alive("d1", run(w.coord.get_engine("d1")).incarnation))
    w.clock.advance(half)
    w.sweep()


def deregisters(w: World) -> None:
    run(w.coord.deregister_engine("p1", 0))


def reregisters(w: World) -> None:
    run(w.coord.register_engine(engine_spec("p1", Role.PRODUCER)))


@pytest.mark.parametrize("producer_goes", [lease_lapses, deregisters, reregisters])
def test_a_revocation_pending_after_an_abort_ends_when_the_producer_goes(
    producer_goes: Callable[[World], None],
) -> None:
    w = World()
    assigned_then_aborted_by_consumer(w)
    w.events("d1")
    producer_goes(w)
    confirmed = [e for e in w.events("d1") if e.type == EventType.REVOCATION_CONFIRMED]
    assert [(e.generation, e.transfer.transfer_id if e.transfer else "") for e in confirmed] == [(1, "t1")]
    record = run(w.store.get_transfer("t1"))
    assert record is not None and record.revoking_generation == 0
    assert run(w.store.live_transfer_ids("d1")) == []


def test_a_pending_revocation_counts_as_unsettled_until_acknowledged() -> None:
    w = World()
    assigned_then_aborted_by_consumer(w)
    assert run(w.store.live_transfer_ids("p1")) == ["t1"]
    assert ok(run(w.coord.acknowledge_revocations("p1", 0, [RevocationAck("t1", 1)]))[0]) == State.ABORTED
    assert types(w.events("d1")) == [EventType.REVOCATION_CONFIRMED]
    assert run(w.store.live_transfer_ids("p1")) == []


def test_source_ready_with_too_few_blocks_aborts_without_assigning() -> None:
    w = World()
    w.target(blocks=(1, 2, 3))
    (item,) = run(w.coord.mark_sources_ready("p1", 0, [SourceReadySpec("t1", (5, 6))]))
    assert ok(item) == State.ABORTED
    assert item.transfer is not None and item.transfer.abort_reason == AbortReason.BLOCK_MISMATCH
    assert item.transfer.revoking_generation == 0
    assert types(w.events("p1")) == [EventType.TRANSFER_ABORTED]
    (aborted,) = w.events("d1")
    assert aborted.transfer is not None and aborted.transfer.revoking_generation == 0


def replace_without_loss(w: World, engine_id: str, role: Role) -> Engine:
    """Another replica registers a new incarnation and has not yet aborted the old one's transfers."""
    spec = engine_spec(engine_id, role)
    now = w.clock.now
    new = run(w.store.update_engine(engine_id, lambda cur: register_engine(now, cur, spec, w.coord.limits, TIMEOUTS)))
    assert new is not None
    return new


def test_a_claim_never_matches_a_target_of_the_consumers_previous_incarnation() -> None:
    w = World()
    w.target()
    replace_without_loss(w, "d1", Role.CONSUMER)
    item = w.claim()
    assert ok(item) == State.ABORTED
    assert item.transfer is not None and item.transfer.abort_reason == AbortReason.PEER_LOST
    assert EventType.TRANSFER_ASSIGNED not in types(w.events("p1"))


def test_a_target_never_matches_a_claim_of_the_producers_previous_incarnation() -> None:
    w = World()
    w.claim()
    replace_without_loss(w, "p1", Role.PRODUCER)
    item = w.target()
    assert ok(item) == State.ABORTED
    assert item.transfer is not None and item.transfer.abort_reason == AbortReason.PEER_LOST
    assert item.transfer.revoking_generation == 0
    assert w.events("p1") == []


def test_a_revocation_confirmed_after_the_consumer_was_replaced_assigns_nothing() -> None:
    """Found by the stateful test: the consumer re-registered (loss not applied yet) while its generation 1 was
    being revoked for 2; the producer's acknowledgement must not hand generation 2 to anyone."""
    w = World()
    w.target()
    w.claim()
    assert ok(w.target(blocks=(4, 5), gen=2)) == State.MATCHED
    assert types(w.events("p1")) == [EventType.TRANSFER_ASSIGNED, EventType.TRANSFER_REVOKED]
    replace_without_loss(w, "d1", Role.CONSUMER)
    (item,) = run(w.coord.acknowledge_revocations("p1", 0, [RevocationAck("t1", 1)]))
    assert ok(item) == State.ABORTED
    assert item.transfer is not None and item.transfer.abort_reason == AbortReason.PEER_LOST
    assert types(w.events("p1")) == [EventType.TRANSFER_ABORTED]
    assert types(w.events("d1")) == [EventType.REVOCATION_CONFIRMED]


def test_a_new_incarnation_resending_its_predecessors_target_ends_it() -> None:
    w = World()
    w.target()
    replace_without_loss(w, "d1", Role.CONSUMER)
    assert ok(w.target()) == State.ABORTED


def test_a_loss_the_registering_replica_never_applied_is_applied_by_the_next_keep_alive() -> None:
    """A replica re-registered the consumer and died before aborting the old incarnation's transfers."""
    w = World()
    w.target("t-old")
    new = replace_without_loss(w, "d1", Role.CONSUMER)
    assert new.unlost_incarnation == w.d1.incarnation
    record = run(w.store.get_transfer("t-old"))
    assert record is not None and record.state == State.TARGETED
    renewed = run(w.coord.keep_alive("d1", new.incarnation))
    assert renewed.unlost_incarnation == 0
    record = run(w.store.get_transfer("t-old"))
    assert record is not None and record.state == State.ABORTED
    assert record.abort_reason == AbortReason.PEER_LOST


def test_losing_an_incarnation_also_ends_what_earlier_ones_left_behind() -> None:
    w = World()
    w.claim("t-first")
    replace_without_loss(w, "p1", Role.PRODUCER)
    run(w.coord.deregister_engine("p1", 0))
    record = run(w.store.get_transfer("t-first"))
    assert record is not None and record.state == State.ABORTED


class RacingStore(MemoryStore):
    """A memory store in which another replica registers the engine just before this replica's update."""

    def __init__(self) -> None:
        super().__init__()
        self.race: Callable[[], None] | None = None

    async def update_engine(self, engine_id: str, fn: EngineFn) -> Engine | None:
        race, self.race = self.race, None
        if race is not None:
            race()
        return await super().update_engine(engine_id, fn)


def test_the_middle_incarnation_of_two_racing_reregistrations_loses_its_transfers() -> None:
    w = World()
    store = RacingStore()
    w.store, w.coord = store, Coordinator(store, w.coord.limits, TIMEOUTS, w.clock)
    run(w.coord.register_engine(engine_spec("d1", Role.CONSUMER)))
    run(w.coord.register_engine(engine_spec("p1", Role.PRODUCER)))
    w.clock.advance(1)

    def middle_registers_and_claims() -> None:
        replace_without_loss(w, "p1", Role.PRODUCER)
        assert ok(w.claim("t-middle")) == State.CLAIMED

    store.race = middle_registers_and_claims
    w.clock.advance(1)
    run(w.coord.register_engine(engine_spec("p1", Role.PRODUCER)))
    record = run(w.store.get_transfer("t-middle"))
    assert record is not None and record.state == State.ABORTED, record


class TestOneAnswerPerMistake:
    def test_a_producer_releasing_is_the_wrong_role(self) -> None:
        w = World()
        w.target()
        w.claim()
        w.complete()
        (item,) = run(w.coord.release_targets("p1", 0, [ReleaseSpec("t1", 1)]))
        assert reason(item) == Reason.WRONG_ROLE

    def test_a_consumer_acknowledging_is_the_wrong_role(self) -> None:
        w = World()
        w.target()
        w.claim()
        (item,) = run(w.coord.acknowledge_revocations("d1", 0, [RevocationAck("t1", 1)]))
        assert reason(item) == Reason.WRONG_ROLE

    def test_an_outsider_is_not_a_participant(self) -> None:
        w = World()
        run(w.coord.register_engine(engine_spec("p2", Role.PRODUCER)))
        w.target()
        w.claim()
        for item in (
            run(w.coord.acknowledge_revocations("p2", 0, [RevocationAck("t1", 1)]))[0],
            run(w.coord.complete_transfers("p2", 0, [CompletionSpec("t1", 1, Outcome.SUCCEEDED)]))[0],
        ):
            assert reason(item) == Reason.NOT_PARTICIPANT

    def test_completing_a_claimed_never_assigned_transfer_is_an_invalid_state(self) -> None:
        w = World()
        w.claim()
        assert reason(w.complete(gen=1)) == Reason.INVALID_STATE

    def test_an_older_generation_is_stale_and_a_newer_one_never_existed(self) -> None:
        w = World()
        w.target(gen=2)
        w.claim()
        assert reason(w.complete(gen=1)) == Reason.STALE_GENERATION
        assert reason(w.complete(gen=3)) == Reason.INVALID_STATE
        assert ok(w.complete(gen=2)) == State.COMMITTED
        releases = run(w.coord.release_targets("d1", 0, [ReleaseSpec("t1", 1), ReleaseSpec("t1", 3)]))
        assert [reason(i) for i in releases] == [Reason.STALE_GENERATION, Reason.INVALID_STATE]

    def test_generation_zero_is_invalid_in_every_core_call(self) -> None:
        w = World()
        w.target()
        w.claim()
        assert reason(w.target(gen=0)) == Reason.GENERATION_INVALID
        assert reason(w.complete(gen=0)) == Reason.GENERATION_INVALID
        assert reason(run(w.coord.acknowledge_revocations("p1", 0, [RevocationAck("t1", 0)]))[0]) == (
            Reason.GENERATION_INVALID
        )
        assert reason(run(w.coord.release_targets("d1", 0, [ReleaseSpec("t1", 0)]))[0]) == Reason.GENERATION_INVALID

    def test_an_unknown_mode_is_refused(self) -> None:
        w = World()
        (item,) = run(w.coord.register_targets("d1", 0, [TargetSpec("t1", (1,), mode=Mode.UNSPECIFIED)]))
        assert reason(item) == Reason.MODE_INVALID
