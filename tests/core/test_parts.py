"""Progressive push in the core: the parts a success reports must tile the reporting ranks' share (every target
token x every layer they hold) exactly, or the completion is refused and the transfer stays as it was."""

from __future__ import annotations

import time
from dataclasses import replace
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rendezvous.clients.testing import FakeClock
from rendezvous.coordinator import Coordinator
from rendezvous.core import (
    ClaimSpec,
    CompletionSpec,
    EventType,
    KvRegion,
    Limits,
    Mode,
    Outcome,
    Reason,
    RendezvousError,
    Role,
    State,
    TargetSpec,
)
from rendezvous.core.parts import check_parts, held_layers
from rendezvous.protocol.records import WrittenPart
from rendezvous.protocol.requests import EngineSpec
from rendezvous.store import MemoryStore
from tests.core.helpers import LAYOUT, START, agent, engine_spec, run
from tests.core.test_lifecycle import TIMEOUTS, ok, reason, types

W = WrittenPart
LAYERS = (range(32),)


def fault(parts: list[WrittenPart], num_tokens: int = 64, held: tuple[range, ...] = LAYERS) -> str | None:
    """The reason check_parts refuses the parts for, or None when they tile the share."""
    try:
        check_parts(parts, num_tokens, held)
    except RendezvousError as err:
        return err.reason
    return None


# The rule


@pytest.mark.parametrize(
    "parts",
    [
        [W(0, 64)],
        [W(0, 16), W(16, 48)],
        [W(0, 64, layer, 1) for layer in range(32)],
        [W(c * 16, 16, layer * 8, 8) for c in range(4) for layer in range(4)],
        [W(0, 64, 0, 8), W(0, 10, 8, 24), W(10, 54, 8, 24)],
    ],
    ids=["whole", "chunks", "layers", "grid", "mixed"],
)
def test_parts_that_tile_the_share_are_accepted(parts: list[WrittenPart]) -> None:
    assert fault(parts) is None
    assert fault(list(reversed(parts))) is None


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        ([W(0, 32)], "PARTS_INCOMPLETE"),
        ([W(0, 64, layer, 1) for layer in range(31)], "PARTS_INCOMPLETE"),
        ([W(0, 64, 1, 31)], "PARTS_INCOMPLETE"),
        ([W(0, 64), W(63, 1, 5, 1)], "PARTS_OVERLAP"),
        ([W(0, 40, 0, 16), W(32, 32, 8, 24)], "PARTS_OVERLAP"),
        ([W(0, 64), W(0, 64)], "PARTS_OVERLAP"),
        ([W(0, 65)], "PART_OUT_OF_RANGE"),
        ([W(0, 64, 0, 33)], "PART_OUT_OF_RANGE"),
        ([W(0, 64, 1, 0)], "PART_OUT_OF_RANGE"),
        ([W(0, 0), W(0, 64)], "PART_OUT_OF_RANGE"),
    ],
    ids=["tokens-missing", "layer-missing", "first-layer-missing", "one-token-twice", "layer-ranges-cross",
         "same-part-twice", "past-the-tokens", "past-the-layers", "first-layer-without-layers", "empty"],
)  # fmt: skip
def test_parts_that_do_not_tile_the_share_are_refused(parts: list[WrittenPart], expected: str) -> None:
    assert fault(parts) == expected


def test_a_refusal_names_where_the_parts_fall_short() -> None:
    with pytest.raises(RendezvousError) as caught:
        check_parts([W(0, 64, 0, 5), W(0, 20, 5, 27), W(30, 34, 5, 27)], 64, LAYERS)
    assert caught.value.reason == Reason.PARTS_INCOMPLETE
    assert caught.value.metadata == {"layer": "5", "token": "20"}
    with pytest.raises(RendezvousError) as caught:
        check_parts([W(0, 64, 0, 5), W(0, 20, 5, 27), W(19, 45, 9, 23)], 64, LAYERS)
    assert caught.value.reason == Reason.PARTS_OVERLAP
    assert caught.value.metadata == {"part": "2", "other": "1"}


def test_a_pipeline_stage_tiles_its_own_layers_only() -> None:
    stage1 = (range(16, 32),)
    assert fault([W(0, 64, 16, 16)], held=stage1) is None
    assert fault([W(0, 64)], held=stage1) is None  # num_layers 0: every layer the ranks hold
    assert fault([W(0, 64, 0, 16)], held=stage1) == "PART_OUT_OF_RANGE"
    assert fault([W(0, 64, 16, 8)], held=stage1) == "PARTS_INCOMPLETE"
    # Stages 0 and 2 reporting together: their layers, not the gap between them.
    apart = (range(0, 8), range(16, 24))
    assert fault([W(0, 64, 0, 8), W(0, 64, 16, 8)], held=apart) is None
    assert fault([W(0, 64, 0, 24)], held=apart) == "PART_OUT_OF_RANGE"
    assert fault([W(0, 64, 0, 8)], held=apart) == "PARTS_INCOMPLETE"


def test_a_layout_without_layers_takes_only_parts_of_every_layer() -> None:
    assert fault([W(0, 30), W(30, 34)], held=()) is None
    assert fault([W(0, 64, 0, 1)], held=()) == "PART_OUT_OF_RANGE"


def test_held_layers_are_those_of_the_reporting_ranks() -> None:
    pp = replace(LAYOUT, num_layers=8, pp_size=2, tp_size=2)
    regions = tuple(KvRegion((i + 1) << 20, 4096, 4096, 64) for i in range(8))  # K and V of 4 layers
    stages = tuple(
        replace(agent(f"p-rank{r}"), rank=r, first_layer=4 * (r // 2), num_layers=4, regions=regions) for r in range(4)
    )
    engine, _ = run(Coordinator(MemoryStore()).register_engine(EngineSpec("p", "prefill", Role.PRODUCER, pp, stages)))
    assert held_layers(engine, [0, 1]) == (range(0, 4),)
    assert held_layers(engine, [3]) == (range(4, 8),)
    assert held_layers(engine, [0, 3]) == (range(0, 8),)


@st.composite
def grids(draw: st.DrawFn) -> tuple[int, int, list[WrittenPart]]:
    """Random parts on a small target: tiles of a random grid, some dropped, some duplicated, some moved."""
    tokens, layers = draw(st.integers(1, 12)), draw(st.integers(1, 6))
    token_cuts = sorted(draw(st.sets(st.integers(1, tokens - 1), max_size=3))) if tokens > 1 else []
    layer_cuts = sorted(draw(st.sets(st.integers(1, layers - 1), max_size=3))) if layers > 1 else []
    t_edges, l_edges = [0, *token_cuts, tokens], [0, *layer_cuts, layers]
    parts = [W(t0, t1 - t0, l0, l1 - l0) for t0, t1 in pairwise(t_edges) for l0, l1 in pairwise(l_edges)]
    for _ in range(draw(st.integers(0, 2))):
        i = draw(st.integers(0, len(parts) - 1))
        move = draw(st.sampled_from(("drop", "copy", "shift", "grow")))
        if move == "drop" and len(parts) > 1:
            parts.pop(i)
        elif move == "copy":
            parts.append(parts[i])
        elif move == "shift":
            parts[i] = replace(parts[i], first_token=max(parts[i].first_token - 1, 0))
        elif move == "grow":
            parts[i] = replace(parts[i], num_layers=parts[i].num_layers + 1)
    return tokens, layers, draw(st.permutations(parts))


@given(grids())
def test_the_sweep_agrees_with_counting_every_cell(grid: tuple[int, int, list[WrittenPart]]) -> None:
    tokens, layers, parts = grid
    cells = [
        (t, lay)
        for p in parts
        for t in range(p.first_token, p.first_token + p.num_tokens)
        for lay in range(p.first_layer, p.first_layer + p.num_layers)
    ]
    if any(t >= tokens or lay >= layers for t, lay in cells):
        expected = "PART_OUT_OF_RANGE"
    elif len(set(cells)) < len(cells):
        expected = "PARTS_OVERLAP"
    elif len(cells) < tokens * layers:
        expected = "PARTS_INCOMPLETE"
    else:
        expected = None
    assert fault(parts, tokens, (range(layers),)) == expected


def test_the_check_of_the_most_parts_allowed_takes_milliseconds() -> None:
    limit = Limits().max_parts_per_completion
    grid = [W(c * 16, 16, layer, 1) for layer in range(64) for c in range(limit // 64)]
    start = time.process_time()
    check_parts(grid, 16 * (limit // 64), (range(64),))
    # Measured at 4 to 6 ms on the 2-core CI machine; a pairwise check of 4,096 parts is 8 M comparisons, seconds.
    assert time.process_time() - start < 0.5


# In the lifecycle

TP2 = replace(LAYOUT, tp_size=2, num_kv_heads=8, kv_layout="HND")
LIMITS = Limits()


class World:
    """A coordinator with a consumer d1 and a producer p1 (one rank each; the layout has 2 layers), and a TP 2
    pair d2 / p2."""

    def __init__(self, limits: Limits = LIMITS) -> None:
        self.clock = FakeClock(START)
        self.store = MemoryStore()
        self.coord = Coordinator(self.store, limits, TIMEOUTS, self.clock)
        run(self.coord.register_engine(engine_spec("d1", Role.CONSUMER)))
        run(self.coord.register_engine(engine_spec("p1", Role.PRODUCER)))
        for engine_id, role in (("d2", Role.CONSUMER), ("p2", Role.PRODUCER)):
            ranks = tuple(replace(agent(f"{engine_id}-rank{r}", block_bytes=2048), rank=r) for r in range(2))
            run(self.coord.register_engine(EngineSpec(engine_id, "pool", role, TP2, ranks)))
        self.seen: dict[str, int] = {}

    def events(self, engine_id: str) -> list[EventType]:
        page = run(self.store.read_events(engine_id, self.seen.get(engine_id, 0) + 1, 10_000))
        if page.events:
            self.seen[engine_id] = page.events[-1].sequence
        return types(list(page.events))

    def matched(self, progressive: bool = True, pair: str = "1", gen: int = 1) -> None:
        spec = TargetSpec("t1", (1, 2), generation=gen, num_tokens=32, progressive=progressive)
        ok(run(self.coord.register_targets(f"d{pair}", 0, [spec]))[0])
        run(self.coord.claim_transfers(f"p{pair}", 0, [ClaimSpec("t1")]))
        assert self.events(f"p{pair}") == [EventType.TRANSFER_ASSIGNED]
        t = run(self.store.get_transfer("t1"))
        assert t is not None and t.state == State.MATCHED and t.progressive == progressive

    def complete(self, *parts: WrittenPart, ranks: tuple[int, ...] = (), pair: str = "1", gen: int = 1) -> State:
        spec = CompletionSpec("t1", gen, Outcome.SUCCEEDED, "", ranks, parts)
        return ok(run(self.coord.complete_transfers(f"p{pair}", 0, [spec]))[0])

    def refused(self, *parts: WrittenPart, ranks: tuple[int, ...] = (), pair: str = "1", gen: int = 1) -> str:
        spec = CompletionSpec("t1", gen, Outcome.SUCCEEDED, "", ranks, parts)
        return reason(run(self.coord.complete_transfers(f"p{pair}", 0, [spec]))[0])

    def state(self) -> tuple[State, tuple[int, ...]]:
        t = run(self.store.get_transfer("t1"))
        assert t is not None
        return t.state, t.reported_ranks


def test_layer_by_layer_parts_commit_the_transfer() -> None:
    w = World()
    w.matched()
    assert w.complete(W(0, 32, 0, 1), W(0, 32, 1, 1)) == State.COMMITTED
    assert w.events("d1") == [EventType.TRANSFER_COMMITTED]


def test_a_progressive_target_may_still_be_written_whole() -> None:
    w = World()
    w.matched()
    assert w.complete() == State.COMMITTED


def test_incomplete_parts_leave_the_transfer_matched_until_a_complete_report() -> None:
    w = World()
    w.matched()
    assert w.refused(W(0, 32, 0, 1)) == "PARTS_INCOMPLETE"
    assert w.refused(W(0, 16), W(16, 15)) == "PARTS_INCOMPLETE"
    assert w.state() == (State.MATCHED, ())
    assert w.events("d1") == []
    assert w.complete(W(0, 16), W(16, 16)) == State.COMMITTED
    assert w.events("d1") == [EventType.TRANSFER_COMMITTED]


def test_overlapping_and_out_of_range_parts_are_refused() -> None:
    w = World()
    w.matched()
    assert w.refused(W(0, 32), W(8, 8, 1, 1)) == "PARTS_OVERLAP"
    assert w.refused(W(0, 33)) == "PART_OUT_OF_RANGE"
    assert w.refused(W(0, 32, 0, 3)) == "PART_OUT_OF_RANGE"
    assert w.state() == (State.MATCHED, ())
    assert w.events("d1") == []


def test_parts_for_a_target_that_did_not_accept_them_are_refused() -> None:
    w = World()
    w.matched(progressive=False)
    assert w.refused(W(0, 32)) == "PROGRESSIVE_NOT_ACCEPTED"
    assert w.state() == (State.MATCHED, ())
    assert w.complete() == State.COMMITTED


def test_more_parts_than_the_limit_are_refused() -> None:
    w = World(Limits(max_parts_per_completion=2))
    w.matched()
    assert w.refused(W(0, 10), W(10, 10), W(20, 12)) == "TOO_MANY_PARTS"
    assert w.complete(W(0, 10), W(10, 22)) == State.COMMITTED


def test_a_progressive_target_needs_tokens_and_push() -> None:
    w = World()
    cases = [
        (TargetSpec("a", (1,), progressive=True), "PROGRESSIVE_NEEDS_TOKENS"),
        (TargetSpec("b", (1,), num_tokens=16, mode=Mode.PULL, progressive=True), "PROGRESSIVE_NEEDS_PUSH"),
    ]
    for spec, expected in cases:
        assert reason(run(w.coord.register_targets("d1", 0, [spec]))[0]) == expected
        assert run(w.store.get_transfer(spec.transfer_id)) is None


def test_each_rank_of_a_multi_rank_producer_is_checked_on_its_own() -> None:
    w = World()
    w.matched(pair="2")
    assert w.complete(W(0, 16), W(16, 16), ranks=(0,), pair="2") == State.MATCHED
    assert w.refused(W(0, 16), ranks=(1,), pair="2") == "PARTS_INCOMPLETE"
    assert w.state() == (State.MATCHED, (0,))
    assert w.events("d2") == []
    assert w.complete(W(0, 32, 0, 1), W(0, 32, 1, 1), ranks=(1,), pair="2") == State.COMMITTED
    assert w.events("d2") == [EventType.TRANSFER_COMMITTED]


def test_a_stale_or_revoked_generation_keeps_its_answers_whatever_its_parts() -> None:
    w = World()
    w.matched()
    # The consumer re-registers with generation 2: the producer's generation 1 is revoked.
    ok(
        run(
            w.coord.register_targets("d1", 0, [TargetSpec("t1", (3, 4), generation=2, num_tokens=32, progressive=True)])
        )[0]
    )
    assert w.events("p1") == [EventType.TRANSFER_REVOKED]
    # Completing the revoked generation lets go of it (its parts are not checked: nothing commits from it).
    assert w.complete(W(0, 1), gen=1) == State.MATCHED
    assert w.events("d1") == [EventType.REVOCATION_CONFIRMED]
    assert w.events("p1") == [EventType.TRANSFER_ASSIGNED]
    assert w.refused(W(0, 1), gen=1) == "STALE_GENERATION"
    assert w.refused(W(0, 1), gen=2) == "PARTS_INCOMPLETE"
    assert w.complete(W(0, 32), gen=2) == State.COMMITTED


def test_a_failure_with_parts_aborts_as_any_failure() -> None:
    w = World()
    w.matched()
    spec = CompletionSpec("t1", 1, Outcome.FAILED, "nixl error", (), (W(0, 1),))
    assert ok(run(w.coord.complete_transfers("p1", 0, [spec]))[0]) == State.ABORTED
