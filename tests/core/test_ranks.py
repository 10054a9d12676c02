"""Multi-rank engines in the lifecycle: registration checks every rank, a generation commits once every producer
rank reported its share, a failure of any rank aborts and keeps the generation fenced until the other ranks
stopped, and revocations are confirmed only when every rank let go."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rendezvous.clients.testing import FakeClock
from rendezvous.coordinator import Coordinator
from rendezvous.core import (
    AbortReason,
    ClaimSpec,
    CompletionSpec,
    EventType,
    KvLayout,
    KvRegion,
    Mode,
    NixlAgent,
    Outcome,
    Reason,
    RendezvousError,
    RevocationAck,
    Role,
    SourceReadySpec,
    State,
    TargetSpec,
)
from rendezvous.core.limits import Limits
from rendezvous.protocol.requests import EngineSpec
from rendezvous.store import MemoryStore
from tests.core.helpers import LAYOUT, START, agent, run
from tests.core.test_lifecycle import TIMEOUTS, ok, reason, types

TP4 = replace(LAYOUT, tp_size=4, num_kv_heads=8, kv_layout="HND")
TP2 = replace(LAYOUT, tp_size=2, num_kv_heads=8, kv_layout="HND")


def ranks(engine_id: str, count: int, block_bytes: int = 4096) -> tuple[NixlAgent, ...]:
    """`count` ranks; a block holds 8 / count heads of 16 tokens, so `block_bytes` must scale with 1 / count."""
    return tuple(replace(agent(f"{engine_id}-rank{r}", block_bytes=block_bytes), rank=r) for r in range(count))


class RankedWorld:
    """A coordinator with a TP 2 consumer (d1) and a TP 4 producer (p1): 4 and 2 heads per rank, 64 bytes per
    token of a head."""

    def __init__(self) -> None:
        self.clock = FakeClock(START)
        self.store = MemoryStore()
        self.coord = Coordinator(self.store, Limits(), TIMEOUTS, self.clock)
        run(self.coord.register_engine(EngineSpec("d1", "decode", Role.CONSUMER, TP2, ranks("d1", 2, 4096))))
        run(self.coord.register_engine(EngineSpec("p1", "prefill", Role.PRODUCER, TP4, ranks("p1", 4, 2048))))
        self.seen: dict[str, int] = {}

    def events(self, engine_id: str) -> list[EventType]:
        page = run(self.store.read_events(engine_id, self.seen.get(engine_id, 0) + 1, 10_000))
        if page.events:
            self.seen[engine_id] = page.events[-1].sequence
        return types(list(page.events))

    def matched(self) -> None:
        ok(run(self.coord.register_targets("d1", 0, [TargetSpec("t1", (1, 2), generation=1)]))[0])
        (claimed,) = run(self.coord.claim_transfers("p1", 0, [ClaimSpec("t1")]))
        assert claimed.transfer is not None and claimed.transfer.state == State.MATCHED, claimed.transfer
        assert self.events("p1") == [EventType.TRANSFER_ASSIGNED]

    def complete(self, *ranks: int, outcome: Outcome = Outcome.SUCCEEDED, gen: int = 1) -> State:
        (result,) = run(self.coord.complete_transfers("p1", 0, [CompletionSpec("t1", gen, outcome, "", ranks)]))
        return ok(result)

    def ack(self, *ranks: int, gen: int = 1) -> State:
        return ok(run(self.coord.acknowledge_revocations("p1", 0, [RevocationAck("t1", gen, ranks)]))[0])

    def transfer_state(self) -> tuple[State, tuple[int, ...], int]:
        t = run(self.store.get_transfer("t1"))
        assert t is not None
        return t.state, t.reported_ranks, t.revoking_generation


def test_a_generation_commits_only_when_every_producer_rank_reported() -> None:
    w = RankedWorld()
    w.matched()
    assert w.complete(0) == State.MATCHED
    assert w.complete(2, 1) == State.MATCHED
    assert w.complete(1) == State.MATCHED  # a repeated report changes nothing
    assert w.transfer_state() == (State.MATCHED, (0, 1, 2), 0)
    assert w.events("d1") == []
    assert w.complete(3) == State.COMMITTED
    assert w.events("d1") == [EventType.TRANSFER_COMMITTED]
    assert w.transfer_state() == (State.COMMITTED, (), 0)


def test_a_completion_naming_no_rank_reports_all_of_them() -> None:
    w = RankedWorld()
    w.matched()
    assert w.complete() == State.COMMITTED


def pulled(w: RankedWorld) -> None:
    """t1 in pull mode: d1's target and p1's source are ready; d1 was told SOURCE_READY."""
    ok(run(w.coord.register_targets("d1", 0, [TargetSpec("t1", (1, 2), generation=1, mode=Mode.PULL)]))[0])
    ok(run(w.coord.claim_transfers("p1", 0, [ClaimSpec("t1")]))[0])
    assert ok(run(w.coord.mark_sources_ready("p1", 0, [SourceReadySpec("t1", (7, 8))]))[0]) == State.MATCHED
    assert w.events("d1") == [EventType.SOURCE_READY]


def read(w: RankedWorld, *ranks: int, gen: int = 1) -> State:
    """d1's ranks report their READs of t1's generation gen."""
    (result,) = run(w.coord.complete_transfers("d1", 0, [CompletionSpec("t1", gen, Outcome.SUCCEEDED, "", ranks)]))
    return ok(result)


@pytest.mark.parametrize("last", [0, 1])
def test_a_pull_commit_by_one_consumer_rank_s_report_is_told_to_the_consumer_too(last: int) -> None:
    """The rank that reported first (answered MATCHED) hears of the commit only so; rank 0 releases on it."""
    w = RankedWorld()
    pulled(w)
    assert read(w, 1 - last) == State.MATCHED
    assert (w.events("d1"), w.events("p1")) == ([], [])
    assert read(w, last) == State.COMMITTED
    assert w.events("p1") == [EventType.TRANSFER_COMMITTED]
    assert w.events("d1") == [EventType.TRANSFER_COMMITTED]
    assert read(w, 1 - last) == State.COMMITTED  # a late repeat tells no one again
    assert (w.events("d1"), w.events("p1")) == ([], [])


@pytest.mark.parametrize("earlier", [(), (1,)])
def test_a_pull_commit_reported_for_every_consumer_rank_at_once_is_told_to_the_producer_only(
    earlier: tuple[int, ...],
) -> None:
    """The call that commits names every rank (none named): its answer says so; nothing else waits."""
    w = RankedWorld()
    pulled(w)
    if earlier:
        assert read(w, *earlier) == State.MATCHED
    assert read(w) == State.COMMITTED
    assert (w.events("d1"), w.events("p1")) == ([], [EventType.TRANSFER_COMMITTED])


def test_a_pull_generation_commits_only_once_every_consumer_rank_read_it_not_an_earlier_one() -> None:
    """A rank's READ of a generation the consumer then replaced (preempted: new blocks) is no READ of the new one."""
    w = RankedWorld()
    pulled(w)
    assert read(w, 0) == State.MATCHED
    preempted = TargetSpec("t1", (3, 4), generation=2, mode=Mode.PULL)
    assert ok(run(w.coord.register_targets("d1", 0, [preempted]))[0]) == State.MATCHED
    assert w.events("d1") == [EventType.SOURCE_READY]
    assert read(w, 1, gen=2) == State.MATCHED
    assert w.transfer_state() == (State.MATCHED, (1,), 0)
    assert read(w, 0, gen=2) == State.COMMITTED


def test_one_failed_rank_aborts_and_fences_until_the_other_ranks_stopped() -> None:
    w = RankedWorld()
    w.matched()
    w.complete(0)
    assert w.complete(1, outcome=Outcome.FAILED) == State.ABORTED
    # The consumer learns of the abort; the producer too, so its ranks 2 and 3 stop writing.
    assert w.events("d1") == [EventType.TRANSFER_ABORTED]
    assert w.events("p1") == [EventType.TRANSFER_ABORTED]
    assert w.transfer_state() == (State.ABORTED, (0, 1), 1)
    w.ack(2)
    assert w.events("d1") == []
    w.complete(3)  # a late completion of the fenced generation counts as letting go
    assert w.events("d1") == [EventType.REVOCATION_CONFIRMED]
    assert w.transfer_state() == (State.ABORTED, (), 0)
    t = run(w.store.get_transfer("t1"))
    assert t is not None and t.abort_reason == AbortReason.TRANSFER_FAILED


def test_a_failure_reported_for_every_rank_frees_the_consumer_at_once() -> None:
    w = RankedWorld()
    w.matched()
    assert w.complete(outcome=Outcome.FAILED) == State.ABORTED
    assert w.events("p1") == []
    assert w.transfer_state() == (State.ABORTED, (), 0)


def test_a_revocation_is_confirmed_once_every_rank_acknowledged() -> None:
    w = RankedWorld()
    w.matched()
    w.complete(0)  # rank 0 wrote generation 1 before the consumer moved on: it has drained
    assert ok(run(w.coord.register_targets("d1", 0, [TargetSpec("t1", (3, 4), generation=2)]))[0]) == State.MATCHED
    assert w.events("p1") == [EventType.TRANSFER_REVOKED]
    w.ack(1, 2)
    assert w.events("d1") == []
    w.ack(3)
    assert w.events("d1") == [EventType.REVOCATION_CONFIRMED]
    assert w.events("p1") == [EventType.TRANSFER_ASSIGNED]  # generation 2, reported afresh
    assert w.transfer_state() == (State.MATCHED, (), 0)
    assert w.complete(0, 1, 2, gen=2) == State.MATCHED
    assert w.complete(3, gen=2) == State.COMMITTED


def test_a_rank_the_engine_does_not_have_is_refused() -> None:
    w = RankedWorld()
    w.matched()
    (result,) = run(w.coord.complete_transfers("p1", 0, [CompletionSpec("t1", 1, Outcome.SUCCEEDED, "", (4,))]))
    assert reason(result) == Reason.RANK_INVALID
    (result,) = run(w.coord.acknowledge_revocations("p1", 0, [RevocationAck("t1", 1, (7,))]))
    assert reason(result) == Reason.RANK_INVALID
    assert w.transfer_state() == (State.MATCHED, (), 0)


@pytest.mark.parametrize(
    ("layout", "agents", "reason_", "field"),
    [
        (TP4, ranks("e", 3), Reason.AGENTS_INVALID, "rank"),
        (TP4, (*ranks("e", 3), replace(agent("e-x"), rank=2)), Reason.AGENTS_INVALID, "rank"),
        (TP4, ranks("e", 5), Reason.AGENTS_INVALID, "rank"),
        (replace(TP4, num_kv_heads=6), ranks("e", 4), Reason.LAYOUT_INVALID, "num_kv_heads"),
        (replace(LAYOUT, pp_size=2), ranks("e", 2), Reason.AGENTS_INVALID, "num_layers"),
    ],
    ids=["rank-missing", "rank-twice", "rank-too-high", "heads-not-divisible", "pp-without-layers"],
)
def test_a_registration_whose_ranks_do_not_add_up_is_refused(
    layout: KvLayout, agents: tuple[NixlAgent, ...], reason_: Reason, field: str
) -> None:
    coord = Coordinator(MemoryStore(), Limits(), TIMEOUTS, FakeClock(START))
    with pytest.raises(RendezvousError) as error:
        run(coord.register_engine(EngineSpec("e", "prefill", Role.PRODUCER, layout, agents)))
    assert error.value.reason == reason_
    assert error.value.metadata.get("field") == field, error.value


def test_a_pipeline_parallel_producer_registers_its_stages_and_matches_a_single_rank_consumer() -> None:
    coord = Coordinator(MemoryStore(), Limits(), TIMEOUTS, FakeClock(START))
    layout = replace(LAYOUT, num_layers=4, pp_size=2)

    def regions(n: int) -> tuple[KvRegion, ...]:
        return tuple(KvRegion((i + 1) << 24, 4096, 4096, 64) for i in range(n))

    stage = (
        NixlAgent("p-0", b"m", rank=0, regions=regions(2), first_layer=0, num_layers=2),
        NixlAgent("p-1", b"m", rank=1, regions=regions(2), first_layer=2, num_layers=2),
    )
    run(coord.register_engine(EngineSpec("p", "prefill", Role.PRODUCER, layout, stage)))
    whole = (NixlAgent("d-0", b"m", regions=regions(4)),)
    run(coord.register_engine(EngineSpec("d", "decode", Role.CONSUMER, replace(layout, pp_size=1), whole)))
    ok(run(coord.register_targets("d", 0, [TargetSpec("t", (1,), generation=1)]))[0])
    assert ok(run(coord.claim_transfers("p", 0, [ClaimSpec("t")]))[0]) == State.MATCHED
