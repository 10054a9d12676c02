"""The memory budget's one rule (rendezvous.core.budget): what records charge, and which changes it refuses."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rendezvous.core import budget
from rendezvous.core import engines as rules
from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import Engine, Role, State, Transfer
from rendezvous.protocol.errors import Reason, RendezvousError
from tests.core.helpers import engine_spec

NOW = 1_000_000.0
LIMITS = Limits(
    max_engines=3,
    max_engines_per_identity=2,
    max_live_blocks=10,
    max_live_blocks_per_identity=6,
    max_agent_metadata_bytes_total=100,
    max_agent_metadata_bytes_per_identity=60,
)


def engine(engine_id: str = "e", owner: str = "a") -> Engine:
    spec = engine_spec(engine_id, Role.CONSUMER, owner=owner)
    return rules.register_engine(NOW, None, spec, Limits(), Timeouts())


def refusal(fn: object, *args: object) -> dict[str, str]:
    with pytest.raises(RendezvousError) as raised:
        fn(*args)  # type: ignore[operator]
    assert raised.value.reason == Reason.BUDGET_EXHAUSTED
    return dict(raised.value.metadata)


def test_a_live_engine_charges_one_engine_and_its_metadata_and_a_tombstone_nothing() -> None:
    e = engine()
    assert budget.engine_usage(e) == budget.Usage(engines=1, metadata_bytes=len(b"md-e-rank0"))
    assert budget.engine_charges(e) == (("a", budget.engine_usage(e)),)
    ended = rules.end_incarnation(NOW + 1, e)
    assert budget.engine_usage(ended) == budget.Usage() and budget.engine_charges(ended) == ()
    # The tombstone keeps each agent's name and rank (PEER_LOST names them), not its metadata or regions.
    assert [(a.name, a.rank, a.metadata, a.regions) for a in ended.agents] == [("e-rank0", 0, b"", ())]


def test_a_live_transfer_charges_its_block_ids_to_each_side_and_an_ended_one_nothing() -> None:
    t = Transfer("t", State.MATCHED, NOW, consumer_engine_id="c", producer_engine_id="p", target_block_ids=(1, 2, 3))
    t = replace(t, source_block_ids=(4, 5))
    assert budget.transfer_blocks(t) == (3, 2)
    assert budget.transfer_charges(t, "a", "b") == (("a", budget.Usage(blocks=3)), ("b", budget.Usage(blocks=2)))
    assert budget.blocks_of(t, "c") == 3 and budget.blocks_of(t, "p") == 2 and budget.blocks_of(t, "x") == 0
    for state in (State.RELEASED, State.ABORTED):
        assert budget.transfer_blocks(replace(t, state=state)) == (0, 0)


def test_a_registration_is_charged_what_it_adds_over_what_it_replaces() -> None:
    full = budget.Tally(budget.Usage(engines=2), budget.Usage(engines=2))
    e = engine()
    budget.check_engine(LIMITS, full, e, replace(e, incarnation=e.incarnation + 1))  # a re-registration
    assert refusal(budget.check_engine, LIMITS, full, None, engine("f")) == {
        "budget": "engines",
        "scope": "identity",
        "limit": "2",
    }
    # Under another owner the new owner is charged in full; without an owner only the server's budget applies.
    assert refusal(budget.check_engine, LIMITS, full, replace(e, owner="b"), e)["scope"] == "identity"
    budget.check_engine(LIMITS, full, None, engine("f", owner=""))
    server_full = budget.Tally(budget.Usage(engines=3))
    assert refusal(budget.check_engine, LIMITS, server_full, None, engine("f", owner=""))["scope"] == "server"


def test_agent_metadata_over_budget_is_refused() -> None:
    tally = budget.Tally(budget.Usage(engines=1, metadata_bytes=55), budget.Usage(engines=1, metadata_bytes=55))
    big = engine("f")  # 10 bytes of metadata
    assert refusal(budget.check_engine, LIMITS, tally, None, big) == {
        "budget": "agent_metadata_bytes",
        "scope": "identity",
        "limit": "60",
    }


def test_the_block_budget_refuses_growth_past_room_and_lets_frees_through() -> None:
    c = engine("c")
    room = budget.BlockBudget.of(LIMITS, c, budget.Tally(budget.Usage(blocks=2), budget.Usage(blocks=2)))
    assert (room.room, room.identity_room) == (8, 4)
    assert room.allows(4) and not room.allows(5)
    four = Transfer("t", State.TARGETED, NOW, consumer_engine_id="c", target_block_ids=(0, 1, 2, 3))
    room.check(None, four)
    assert refusal(room.check, None, replace(four, target_block_ids=tuple(range(5))))["scope"] == "identity"
    after = room.after(None, four)
    assert (after.room, after.identity_room) == (4, 0)
    after.check(four, four)  # no growth
    after.check(four, replace(four, state=State.ABORTED))  # a free
    freed = after.after(four, replace(four, state=State.ABORTED))
    assert (freed.room, freed.identity_room) == (8, 4)
    # Without an owner (auth off) only the server's room counts.
    anon = budget.BlockBudget.of(LIMITS, engine("c", owner=""), budget.Tally(budget.Usage(blocks=9)))
    assert refusal(anon.check, None, replace(four, target_block_ids=(0, 1)))["scope"] == "server"
