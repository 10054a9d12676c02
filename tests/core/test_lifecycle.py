"""The transfer lifecycle, driven through the coordinator on the memory store with a manual clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rendezvous.clients.testing import FakeClock
from rendezvous.coordinator import Coordinator, ItemOutcome
from rendezvous.core import (
    AbortReason,
    AbortSpec,
    ClaimSpec,
    CompletionSpec,
    Engine,
    Event,
    EventType,
    Limits,
    Mode,
    Outcome,
    Reason,
    ReleaseSpec,
    RendezvousError,
    RevocationAck,
    Role,
    SourceReadySpec,
    State,
    TargetSpec,
    Timeouts,
    Transfer,
)
from rendezvous.core.transfers import TOMBSTONE_BLOCK_IDS
from rendezvous.protocol.dataplane import DATA_PLANE_VERSION
from rendezvous.store import MemoryStore
from tests.core.helpers import LAYOUT, START, engine_spec, run

TIMEOUTS = Timeouts(
    default_lease_ttl=10, default_target_timeout=30, default_claim_timeout=30, release_timeout=5, tombstone_ttl=60
)


class World:
    """A coordinator with one consumer (d1) and one producer (p1) registered."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.clock = FakeClock(START)
        self.store = MemoryStore()
        self.coord = Coordinator(self.store, limits or Limits(), TIMEOUTS, self.clock)
        self.d1 = run(self.coord.register_engine(engine_spec("d1", Role.CONSUMER)))[0]
        self.p1 = run(self.coord.register_engine(engine_spec("p1", Role.PRODUCER)))[0]
        self.seen = {"d1": 0, "p1": 0}

    def events(self, engine_id: str) -> list[Event[Transfer, Engine]]:
        """Events of an engine since the last call."""
        page = run(self.store.read_events(engine_id, self.seen.get(engine_id, 0) + 1, 10_000))
        if page.events:
            self.seen[engine_id] = page.events[-1].sequence
        return list(page.events)

    def target(self, tid: str = "t1", blocks: tuple[int, ...] = (1, 2, 3), gen: int = 1, **kw: object) -> ItemOutcome:
        return run(self.coord.register_targets("d1", 0, [TargetSpec(tid, blocks, generation=gen, **kw)]))[0]  # type: ignore[arg-type]

    def claim(self, tid: str = "t1", engine: str = "p1") -> ItemOutcome:
        return run(self.coord.claim_transfers(engine, 0, [ClaimSpec(tid)]))[0]

    def complete(self, tid: str = "t1", gen: int = 1, outcome: Outcome = Outcome.SUCCEEDED) -> ItemOutcome:
        return run(self.coord.complete_transfers("p1", 0, [CompletionSpec(tid, gen, outcome)]))[0]

    def sweep(self) -> None:
        run(self.coord.sweep())


def ok(outcome: ItemOutcome) -> State:
    assert outcome.error is None, outcome.error
    assert outcome.transfer is not None
    return outcome.transfer.state


def reason(outcome: ItemOutcome) -> str:
    assert outcome.error is not None, f"expected an error, got {outcome.transfer}"
    return outcome.error.reason


def types(events: list[Event[Transfer, Engine]]) -> list[EventType]:
    return [e.type for e in events]


@pytest.mark.parametrize("consumer_first", [True, False])
def test_either_arrival_order_matches_and_assigns_to_the_producer(consumer_first: bool) -> None:
    w = World()
    first, second = (w.target, w.claim) if consumer_first else (w.claim, w.target)
    assert ok(first()) in (State.TARGETED, State.CLAIMED)
    assert ok(second()) == State.MATCHED
    (assigned,) = w.events("p1")
    assert assigned.type == EventType.TRANSFER_ASSIGNED
    assert assigned.generation == 1
    assert assigned.peer is not None and assigned.peer.engine_id == "d1"
    assert assigned.peer.agents[0].metadata == b"md-d1-rank0"
    assert assigned.transfer is not None and assigned.transfer.target_block_ids == (1, 2, 3)
    assert w.events("d1") == []


def test_full_push_lifecycle_commits_then_releases_to_a_tombstone() -> None:
    w = World()
    w.target()
    w.claim()
    assert ok(w.complete()) == State.COMMITTED
    assert types(w.events("d1")) == [EventType.TRANSFER_COMMITTED]
    assert ok(run(w.coord.release_targets("d1", 0, [ReleaseSpec("t1", 1)]))[0]) == State.RELEASED
    w.clock.advance(TIMEOUTS.tombstone_ttl + 1)
    w.sweep()
    assert run(w.store.get_transfer("t1")) is None


def test_releasing_before_the_commit_points_to_transfer_committed_not_to_an_abort() -> None:
    w = World()
    w.target()
    unmatched = run(w.coord.release_targets("d1", 0, [ReleaseSpec("t1", 1)]))[0]
    assert reason(unmatched) == Reason.INVALID_STATE and "abort it" in str(unmatched.error)
    w.claim()
    early = run(w.coord.release_targets("d1", 0, [ReleaseSpec("t1", 1)]))[0]  # on the notification, say
    assert reason(early) == Reason.INVALID_STATE
    assert early.error is not None and early.error.metadata["state"] == "MATCHED"
    assert "after its TRANSFER_COMMITTED" in str(early.error) and "abort" not in str(early.error)
    assert ok(w.complete()) == State.COMMITTED  # the refusal changed nothing
    assert ok(run(w.coord.release_targets("d1", 0, [ReleaseSpec("t1", 1)]))[0]) == State.RELEASED


@pytest.mark.parametrize("size", [3, TOMBSTONE_BLOCK_IDS])
def test_a_large_tombstone_keeps_no_block_ids_yet_answers_retries_as_before(size: int) -> None:
    w = World()
    target, source = tuple(range(size)), tuple(reversed(range(size)))
    w.target(blocks=target, mode=Mode.PULL)
    ok(run(w.coord.mark_sources_ready("p1", 0, [SourceReadySpec("t1", source)]))[0])
    ok(run(w.coord.abort_transfers("d1", 0, [AbortSpec("t1")]))[0])
    tomb = run(w.store.get_transfer("t1"))
    assert tomb is not None and tomb.state == State.ABORTED
    if size > TOMBSTONE_BLOCK_IDS // 2:  # more ids than a tombstone keeps: () for a source that had been ready
        assert (tomb.target_block_ids, tomb.source_block_ids) == ((), ())
    else:
        assert (tomb.target_block_ids, tomb.source_block_ids) == (target, source)
    # A retry with the same blocks is answered with the tombstone; other blocks are refused as before.
    assert ok(w.target(blocks=target, mode=Mode.PULL)) == State.ABORTED
    assert reason(w.target(blocks=(1, 2), mode=Mode.PULL)) == Reason.TRANSFER_ENDED
    assert ok(run(w.coord.mark_sources_ready("p1", 0, [SourceReadySpec("t1", source)]))[0]) == State.ABORTED
    again = run(w.coord.mark_sources_ready("p1", 0, [SourceReadySpec("t1", source[:-1])]))[0]
    assert reason(again) == Reason.INVALID_STATE


def test_pull_mode_sends_source_ready_to_the_consumer_who_completes() -> None:
    w = World()
    w.target(mode=Mode.PULL)
    ok(run(w.coord.mark_sources_ready("p1", 0, [SourceReadySpec("t1", (7, 8, 9))]))[0])
    (ready,) = w.events("d1")
    assert ready.type == EventType.SOURCE_READY
    assert ready.peer is not None and ready.peer.engine_id == "p1"
    assert ready.transfer is not None and ready.transfer.source_block_ids == (7, 8, 9)
    assert w.events("p1") == []
    assert reason(w.complete()) == Reason.WRONG_ROLE
    done = run(w.coord.complete_transfers("d1", 0, [CompletionSpec("t1", 1, Outcome.SUCCEEDED)]))[0]
    assert ok(done) == State.COMMITTED
    assert types(w.events("p1")) == [EventType.TRANSFER_COMMITTED]


def test_a_pull_consumer_success_before_the_source_is_ready_is_refused_and_changes_nothing() -> None:
    w = World()
    w.target(mode=Mode.PULL)
    assert ok(w.claim()) == State.MATCHED  # claimed without its source: no SOURCE_READY yet
    assert w.events("d1") == []
    before = run(w.store.get_transfer("t1"))
    for ranks in ((), (0,)):
        early = run(w.coord.complete_transfers("d1", 0, [CompletionSpec("t1", 1, Outcome.SUCCEEDED, "", ranks)]))[0]
        assert reason(early) == Reason.INVALID_STATE
        assert early.error is not None and "source is not ready" in early.error.message
        assert run(w.store.get_transfer("t1")) == before
    assert w.events("p1") == [] and w.events("d1") == []
    ok(run(w.coord.mark_sources_ready("p1", 0, [SourceReadySpec("t1", (7, 8, 9))]))[0])
    assert types(w.events("d1")) == [EventType.SOURCE_READY]
    done = run(w.coord.complete_transfers("d1", 0, [CompletionSpec("t1", 1, Outcome.SUCCEEDED)]))[0]
    assert ok(done) == State.COMMITTED


def test_a_pull_consumer_may_give_up_before_the_source_is_ready() -> None:
    w = World()
    w.target(mode=Mode.PULL)
    w.claim()
    gave_up = run(w.coord.complete_transfers("d1", 0, [CompletionSpec("t1", 1, Outcome.FAILED, "no room")]))[0]
    assert ok(gave_up) == State.ABORTED
    assert gave_up.transfer is not None and gave_up.transfer.abort_reason == AbortReason.TRANSFER_FAILED
    assert types(w.events("p1")) == [EventType.TRANSFER_ABORTED]


def test_reregistering_a_new_generation_revokes_the_old_assignment_until_acknowledged() -> None:
    w = World()
    w.target(blocks=(1, 2))
    w.claim()
    assert types(w.events("p1")) == [EventType.TRANSFER_ASSIGNED]
    assert ok(w.target(blocks=(5, 6), gen=2)) == State.MATCHED
    (revoked,) = w.events("p1")
    assert (revoked.type, revoked.generation) == (EventType.TRANSFER_REVOKED, 1)
    # No second assignment while the first may still be written.
    assert w.events("p1") == []
    assert reason(w.complete(gen=2)) == Reason.INVALID_STATE
    ok(run(w.coord.acknowledge_revocations("p1", 0, [RevocationAck("t1", 1)]))[0])
    (confirmed,) = w.events("d1")
    assert (confirmed.type, confirmed.generation) == (EventType.REVOCATION_CONFIRMED, 1)
    (assigned,) = w.events("p1")
    assert (assigned.type, assigned.generation) == (EventType.TRANSFER_ASSIGNED, 2)
    assert assigned.transfer is not None and assigned.transfer.target_block_ids == (5, 6)
    assert ok(w.complete(gen=2)) == State.COMMITTED


def test_a_new_generation_of_a_target_never_assigned_frees_the_old_blocks_at_once() -> None:
    """docs/engines.md: with `revoking_generation = 0` in the answer nothing was assigned, no confirmation comes."""
    w = World()
    w.target(blocks=(1, 2))
    again = w.target(blocks=(5, 6), gen=2)
    assert ok(again) == State.TARGETED
    assert again.transfer is not None and again.transfer.revoking_generation == 0
    assert w.events("d1") == [] and w.events("p1") == []
    w.claim()
    (assigned,) = w.events("p1")
    assert (assigned.type, assigned.generation) == (EventType.TRANSFER_ASSIGNED, 2)
    assert assigned.transfer is not None and assigned.transfer.target_block_ids == (5, 6)


def test_completing_a_revoked_generation_counts_as_the_acknowledgement() -> None:
    w = World()
    w.target()
    w.claim()
    w.target(blocks=(4, 5, 6), gen=2)
    assert ok(w.complete(gen=1)) == State.MATCHED
    assert types(w.events("d1")) == [EventType.REVOCATION_CONFIRMED]
    assert types(w.events("p1")) == [
        EventType.TRANSFER_ASSIGNED,
        EventType.TRANSFER_REVOKED,
        EventType.TRANSFER_ASSIGNED,
    ]


def test_a_stale_generation_is_rejected() -> None:
    w = World()
    w.target(gen=3)
    assert reason(w.target(gen=2)) == Reason.STALE_GENERATION
    w.claim()
    assert reason(w.complete(gen=2)) == Reason.STALE_GENERATION


def test_abort_while_the_producer_may_write_fences_the_consumer_blocks() -> None:
    w = World()
    w.target()
    w.claim()
    w.events("p1")
    aborted = run(w.coord.abort_transfers("d1", 0, [AbortSpec("t1", "client went away")]))[0]
    assert ok(aborted) == State.ABORTED
    assert aborted.transfer is not None and aborted.transfer.revoking_generation == 1
    (ev,) = w.events("p1")
    assert ev.type == EventType.TRANSFER_ABORTED
    assert w.events("d1") == []
    assert ok(w.complete(gen=1)) == State.ABORTED
    assert types(w.events("d1")) == [EventType.REVOCATION_CONFIRMED]


def test_an_abort_before_either_half_leaves_a_tombstone_that_refuses_late_halves() -> None:
    w = World()
    ok(run(w.coord.abort_transfers("", 0, [AbortSpec("t9", "router gave up")]))[0])
    assert reason(w.target("t9")) == Reason.TRANSFER_ENDED
    assert reason(w.claim("t9")) == Reason.TRANSFER_ENDED


def test_deadlines_abort_a_waiting_half_and_notify_it() -> None:
    w = World()
    w.target(timeout=5)
    w.clock.advance(4)
    w.sweep()
    assert ok(w.claim()) == State.MATCHED
    w.events("p1")
    w.clock.advance(2)
    w.sweep()
    t = run(w.store.get_transfer("t1"))
    assert t is not None and (t.state, t.abort_reason) == (State.ABORTED, AbortReason.DEADLINE_EXCEEDED)
    assert types(w.events("d1")) == [EventType.TRANSFER_ABORTED]
    assert types(w.events("p1")) == [EventType.TRANSFER_ABORTED]


def test_a_lapsed_producer_lease_aborts_its_transfers_and_tells_the_consumer() -> None:
    w = World()
    w.target()
    w.claim()
    w.clock.advance(TIMEOUTS.default_lease_ttl - 1)
    run(w.coord.keep_alive("d1", run(w.coord.get_engine("d1")).incarnation))
    w.clock.advance(2)
    w.sweep()
    t = run(w.store.get_transfer("t1"))
    assert t is not None and (t.state, t.abort_reason) == (State.ABORTED, AbortReason.PEER_LOST)
    assert t.revoking_generation == 0, "a lost producer cannot write, so the consumer need not wait"
    assert types(w.events("d1")) == [EventType.TRANSFER_ABORTED, EventType.PEER_LOST]
    with pytest.raises(RendezvousError) as err:
        run(w.coord.claim_transfers("p1", 0, [ClaimSpec("t2")]))
    assert err.value.reason == Reason.LEASE_EXPIRED


def test_reregistering_an_engine_aborts_the_previous_incarnations_transfers() -> None:
    w = World()
    w.target()
    w.claim()
    w.events("d1")
    new, _ = run(w.coord.register_engine(engine_spec("p1", Role.PRODUCER)))
    assert new.incarnation > w.p1.incarnation
    assert types(w.events("d1")) == [EventType.TRANSFER_ABORTED, EventType.PEER_LOST]
    with pytest.raises(RendezvousError) as err:
        run(w.coord.claim_transfers("p1", w.p1.incarnation, [ClaimSpec("t2")]))
    assert err.value.reason == Reason.STALE_INCARNATION


def test_layout_mismatch_aborts_at_match_with_a_clear_reason() -> None:
    w = World()
    run(w.coord.register_engine(engine_spec("p2", Role.PRODUCER, replace(LAYOUT, dtype="float16"))))
    w.target()
    claimed = w.claim(engine="p2")
    assert ok(claimed) == State.ABORTED
    assert claimed.transfer is not None
    assert claimed.transfer.abort_reason == AbortReason.LAYOUT_MISMATCH
    assert "dtype" in claimed.transfer.abort_message
    assert types(w.events("d1")) == [EventType.TRANSFER_ABORTED]


def test_a_consumer_that_cannot_read_the_producers_data_plane_version_aborts_naming_both() -> None:
    w = World()  # d1 states no version: it speaks 1, the format before versions
    run(w.coord.register_engine(engine_spec("p2", Role.PRODUCER, replace(LAYOUT, data_plane_version=2))))
    w.target()
    claimed = w.claim(engine="p2")
    assert ok(claimed) == State.ABORTED and claimed.transfer is not None
    assert claimed.transfer.abort_reason == AbortReason.DATA_PLANE_MISMATCH
    assert claimed.transfer.abort_message == "producer data-plane version 2; consumer data-plane version 1 reads 1"
    assert types(w.events("d1")) == [EventType.TRANSFER_ABORTED]


def test_a_newer_consumer_reads_an_older_producers_data_plane() -> None:
    w = World()
    run(w.coord.register_engine(engine_spec("d2", Role.CONSUMER, replace(LAYOUT, data_plane_version=2))))
    run(w.coord.register_targets("d2", 0, [TargetSpec("t1", (1, 2), generation=1)]))
    assert ok(w.claim()) == State.MATCHED  # p1 states no version (1); version 2 reads 1


def test_an_engine_of_a_data_plane_version_the_server_does_not_know_is_refused_at_registration() -> None:
    w = World()
    newer = replace(LAYOUT, data_plane_version=DATA_PLANE_VERSION + 1)
    with pytest.raises(RendezvousError) as err:
        run(w.coord.register_engine(engine_spec("p2", Role.PRODUCER, newer)))
    assert err.value.reason == Reason.DATA_PLANE_VERSION_UNSUPPORTED
    newest, unknown = DATA_PLANE_VERSION, DATA_PLANE_VERSION + 1
    assert err.value.metadata == {"data_plane_version": str(unknown), "supported": str(newest)}
    assert f"data_plane_version {unknown} is newer than this server knows ({newest})" in err.value.message


def test_fewer_source_than_target_blocks_aborts_with_block_mismatch() -> None:
    w = World()
    w.target(blocks=(1, 2, 3), mode=Mode.PULL)
    done = run(w.coord.mark_sources_ready("p1", 0, [SourceReadySpec("t1", (4, 5))]))[0]
    assert done.transfer is not None and done.transfer.abort_reason == AbortReason.BLOCK_MISMATCH


def test_retried_halves_are_idempotent_and_conflicts_are_refused() -> None:
    w = World()
    assert ok(w.target()) == State.TARGETED
    assert ok(w.target()) == State.TARGETED
    assert reason(w.target(blocks=(9,))) == Reason.TARGET_CONFLICT
    run(w.coord.register_engine(engine_spec("p2", Role.PRODUCER)))
    assert ok(w.claim()) == State.MATCHED
    assert ok(w.claim()) == State.MATCHED
    assert reason(w.claim(engine="p2")) == Reason.CLAIM_CONFLICT
    assert len(w.events("p1")) == 1


@pytest.mark.parametrize(
    ("blocks", "expected"),
    [
        ((-1, 2), Reason.BLOCK_ID_NEGATIVE),
        ((2, 2), Reason.BLOCK_ID_DUPLICATE),
        ((64,), Reason.BLOCK_ID_OUT_OF_RANGE),
        (tuple(range(9)), Reason.TOO_MANY_BLOCKS),
    ],
)
def test_bad_block_ids_are_rejected(blocks: tuple[int, ...], expected: Reason) -> None:
    w = World(Limits(max_blocks_per_target=8))
    assert reason(w.target(blocks=blocks)) == expected


@pytest.mark.parametrize(
    ("tid", "expected"), [("", Reason.ID_EMPTY), ("x" * 300, Reason.ID_TOO_LONG), ("a b", Reason.ID_INVALID)]
)
def test_bad_transfer_ids_are_rejected(tid: str, expected: Reason) -> None:
    assert reason(World().target(tid)) == expected


def test_wrong_role_and_non_participants_are_refused() -> None:
    w = World()
    assert reason(run(w.coord.register_targets("p1", 0, [TargetSpec("t1", (1,))]))[0]) == Reason.WRONG_ROLE
    w.target()
    w.claim()
    run(w.coord.register_engine(engine_spec("d2", Role.CONSUMER)))
    outcome = run(w.coord.release_targets("d2", 0, [ReleaseSpec("t1", 1)]))[0]
    assert reason(outcome) == Reason.NOT_PARTICIPANT


def test_live_transfer_limit_per_engine() -> None:
    w = World(Limits(max_live_transfers_per_engine=2))
    outcomes = run(w.coord.register_targets("d1", 0, [TargetSpec(f"t{i}", (i,)) for i in range(3)]))
    assert [o.error.reason if o.error else None for o in outcomes] == [None, None, Reason.TOO_MANY_TRANSFERS]


def test_batch_limits() -> None:
    w = World(Limits(max_batch_items=2))
    with pytest.raises(RendezvousError) as err:
        run(w.coord.register_targets("d1", 0, [TargetSpec(f"t{i}", (i,)) for i in range(3)]))
    assert err.value.reason == Reason.BATCH_TOO_LARGE
    with pytest.raises(RendezvousError) as err:
        run(w.coord.register_targets("d1", 0, []))
    assert err.value.reason == Reason.BATCH_EMPTY


def test_engine_registration_conflicts_and_validation() -> None:
    w = World()
    with pytest.raises(RendezvousError) as err:
        run(w.coord.register_engine(engine_spec("p1", Role.CONSUMER)))
    assert err.value.reason == Reason.ENGINE_CONFLICT
    with pytest.raises(RendezvousError) as err:
        run(w.coord.register_engine(replace(engine_spec("x", Role.PRODUCER), role=Role.UNSPECIFIED)))
    assert err.value.reason == Reason.ROLE_UNSPECIFIED
    with pytest.raises(RendezvousError) as err:
        run(w.coord.register_targets("nobody", 0, [TargetSpec("t1", (1,))]))
    assert err.value.reason == Reason.ENGINE_NOT_FOUND


def test_a_forgotten_commit_is_released_after_the_release_timeout() -> None:
    w = World()
    w.target()
    w.claim()
    w.complete()
    w.clock.advance(TIMEOUTS.release_timeout + 1)
    run(w.coord.keep_alive("d1", run(w.coord.get_engine("d1")).incarnation))
    run(w.coord.keep_alive("p1", run(w.coord.get_engine("p1")).incarnation))
    w.sweep()
    t = run(w.store.get_transfer("t1"))
    assert t is not None and t.state == State.RELEASED
