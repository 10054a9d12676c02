"""The events a multi-rank engine's other ranks learn from reach its log on every backend: the store writes what
the core's rules address, to each engine, in one write (its ranks all watch the engine's log)."""

from __future__ import annotations

import pytest

from rendezvous.clients.testing import FakeClock
from rendezvous.coordinator import Coordinator
from rendezvous.core import (
    ClaimSpec,
    CompletionSpec,
    EngineSpec,
    EventType,
    Limits,
    Mode,
    Outcome,
    Role,
    SourceReadySpec,
    State,
    TargetSpec,
)
from rendezvous.core.model import Engine, Event, Transfer
from rendezvous.store import Store
from tests.core.helpers import START
from tests.core.test_lifecycle import TIMEOUTS
from tests.core.test_ranks import TP2, TP4, ranks


async def events(store: Store, engine_id: str, after: int) -> list[Event[Transfer, Engine]]:
    return list((await store.read_events(engine_id, after + 1, 100)).events)


@pytest.mark.parametrize("last", [0, 1])
async def test_a_pull_commit_by_one_consumer_rank_s_report_is_in_the_consumer_s_log(store: Store, last: int) -> None:
    """TP 2 decode d1 reads t1 from p1; each rank reports its READ. The rank that reported first hears of the
    commit from d1's log only."""
    coord = Coordinator(store, Limits(), TIMEOUTS, clock=FakeClock(START))
    await coord.register_engine(EngineSpec("d1", "decode", Role.CONSUMER, TP2, ranks("d1", 2, 4096)))
    await coord.register_engine(EngineSpec("p1", "prefill", Role.PRODUCER, TP4, ranks("p1", 4, 2048)))
    await coord.register_targets("d1", 0, [TargetSpec("t1", (1, 2), generation=1, mode=Mode.PULL)])
    await coord.claim_transfers("p1", 0, [ClaimSpec("t1")])
    await coord.mark_sources_ready("p1", 0, [SourceReadySpec("t1", (7, 8))])
    (ready,) = await events(store, "d1", 0)
    assert ready.type is EventType.SOURCE_READY

    def report(rank: int) -> CompletionSpec:
        return CompletionSpec("t1", 1, Outcome.SUCCEEDED, "", (rank,))

    (first,) = await coord.complete_transfers("d1", 0, [report(1 - last)])
    assert first.transfer is not None and first.transfer.state is State.MATCHED
    assert await events(store, "d1", ready.sequence) == []
    (committed,) = await coord.complete_transfers("d1", 0, [report(last)])
    assert committed.transfer is not None and committed.transfer.state is State.COMMITTED
    for engine_id, after in (("d1", ready.sequence), ("p1", 0)):
        (event,) = await events(store, engine_id, after)
        assert (event.type, event.generation) == (EventType.TRANSFER_COMMITTED, 1), engine_id
        assert event.transfer is not None and event.transfer.transfer_id == "t1"
        assert event.transfer.state is State.COMMITTED
