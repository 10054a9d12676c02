"""Random interleavings of every operation, clock advances and engine deaths, checked against invariants.

Invariants:
- a transfer reaches exactly one terminal state and never leaves it (until its tombstone is dropped);
- a producer never holds two generations of a transfer: no assignment arrives while it still holds one;
- a consumer is told a revoked generation is free only once the producer let go of it (acknowledged,
  completed or died), or when the tombstone's lifetime ran out; a producer of several ranks (p1 has two) has
  let go only once every rank did, and the server stops fencing a generation only then;
- an assignment only ever pairs the incarnations the transfer recorded, both still current, even while an
  engine has been replaced and the store has not yet applied the loss of its previous incarnation;
- every event goes to an engine taking part in its transfer, in the role the event is for, and each
  engine hears of a transfer's abort at most once;
- once every deadline and lease has passed, nothing is left: no transfer, no engine;
- a generation commits only once every rank of the engine moving the bytes (the producer in push, the consumer
  in pull; p1 and c1 have two ranks) reported it a success while it was in flight;
- each commit tells the side that did not move the bytes once; a pull consumer is told too (once) when the
  report that committed named only some of its ranks, and never otherwise: its answer says so;
- a pull consumer's success is refused (and changes nothing) until the producer's source is ready: the
  consumer cannot have read it;
- a report of written parts that does not tile the rank's share (or for a target that did not accept parts)
  is refused and changes nothing: a generation never commits with bytes missing.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, MultipleResults, RuleBasedStateMachine, initialize, invariant, multiple, rule

from rendezvous.clients.testing import FakeClock
from rendezvous.coordinator import Coordinator
from rendezvous.core import (
    AbortSpec,
    ClaimSpec,
    CompletionSpec,
    Engine,
    Event,
    EventType,
    Mode,
    Outcome,
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
from rendezvous.core.engines import end_incarnation, register_engine
from rendezvous.protocol.records import WrittenPart
from rendezvous.protocol.requests import EngineSpec
from rendezvous.store import MemoryStore
from tests.ci import examples
from tests.core.helpers import LAYOUT, START, agent, engine_spec, every_engine, run

CONSUMERS = ("c0", "c1")
PRODUCERS = ("p0", "p1")
ENGINES = CONSUMERS + PRODUCERS
RANKS = {"p1": 2, "c1": 2}  # TP 2 engines: each rank of a producer (push) or consumer (pull) reports its share
HEADED = replace(LAYOUT, num_kv_heads=2, kv_layout="HND")
TIMEOUTS = Timeouts(
    default_lease_ttl=20,
    min_lease_ttl=1,
    default_target_timeout=60,
    default_claim_timeout=60,
    release_timeout=30,
    tombstone_ttl=40,
)
PRODUCER_EVENTS = {EventType.TRANSFER_ASSIGNED, EventType.TRANSFER_REVOKED}
CONSUMER_EVENTS = {EventType.SOURCE_READY, EventType.REVOCATION_CONFIRMED}

RANK = (None, None, 0, 1)  # a report for every rank (no rank named), or for one
PREEMPTED = "preempted"  # a step of pulled_by_ranks: the consumer registers the next generation

blocks = st.lists(st.integers(0, 15), min_size=0, max_size=4, unique=True).map(tuple)
TOKENS = 32
"""Tokens of a progressive target; the layout has LAYOUT.num_layers (2) layers."""
PARTS = {
    "chunks": (WrittenPart(0, 16), WrittenPart(16, 16)),
    "layers": (WrittenPart(0, TOKENS, 0, 1), WrittenPart(0, TOKENS, 1, 1)),
    "incomplete": (WrittenPart(0, TOKENS, 1, 1),),
    "overlap": (WrittenPart(0, TOKENS), WrittenPart(0, 1, 1, 1)),
}
TILING = {"chunks", "layers"}
TARGET, SOURCE, NEXT_TARGET = (1, 2, 3), (4, 5, 6), (7, 8)
"""The blocks of a transfer's two halves, and of the next generation of a preempted consumer."""


@dataclass(frozen=True)
class Step:
    """How `advance_transfers` takes a transfer ready for its next step one step on."""

    pick: int  # which of the transfers ready for a step (by id)
    consumer: str  # who joins a claimed transfer
    producer: str  # who joins a targeted one
    pull: bool  # the mode of a target registered for a claimed transfer
    progressive: bool  # whether such a push target accepts parts
    rank: int | None  # a mover of two ranks reports for all (None) or for one of the ranks yet to report
    failed: bool  # the mover reports a failure (the consumer of a committed transfer aborts it)
    parts: str  # the parts a progressive push reports (PARTS; "" none)
    preempted: bool  # the consumer of a matched transfer registers the next generation instead
    ack: bool  # a producer lets go of a revoked generation by AcknowledgeRevocations (else CompleteTransfers)
    restart: str  # the engine to take the step restarts instead: "reregister" or "replaced" (those rules; "" not)


steps = st.builds(
    Step,
    pick=st.integers(0, 100),
    consumer=st.sampled_from(CONSUMERS),
    producer=st.sampled_from(PRODUCERS),
    pull=st.booleans(),
    progressive=st.booleans(),
    rank=st.sampled_from(RANK),
    failed=st.sampled_from((False,) * 9 + (True,)),
    parts=st.sampled_from(("", "chunks", "layers", *sorted(set(PARTS) - TILING))),
    preempted=st.sampled_from((False,) * 4 + (True,)),
    ack=st.booleans(),
    restart=st.sampled_from(("",) * 8 + ("reregister", "replaced")),
)


class Reached:
    """Tells hypothesis (`event`, shown by `pytest --hypothesis-show-statistics`) which states of interest an
    example reached, so that a change of the model shows what it exercises."""

    def on_transition(self, before: Transfer | None, after: Transfer | None, now: float) -> None:
        was = before.state if before is not None else None
        if after is None or after.state == was:
            return
        if after.state == State.MATCHED:
            hypothesis_event("matched")
        elif after.state == State.COMMITTED:
            hypothesis_event("committed")
            hypothesis_event(f"committed {after.mode.name} {'g1' if after.generation == 1 else 'a later generation'}")
            mover = _mover(after)
            if RANKS.get(mover, 1) > 1:
                hypothesis_event(f"committed {after.mode.name} by the two ranks of {mover}")
                if before is not None and before.reported_ranks:
                    hypothesis_event(f"committed {after.mode.name} by the two ranks of {mover}, one at a time")
        elif after.state == State.RELEASED and was == State.COMMITTED:
            hypothesis_event("released")
        elif after.state == State.ABORTED and was is not None and not was.terminal:
            hypothesis_event(f"aborted from {was.name}")
            if after.revoking_generation:
                hypothesis_event("aborted with a revocation pending")


class Lifecycle(RuleBasedStateMachine):
    transfers = Bundle("transfers")

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock(START)
        self.store = MemoryStore(max_events_per_engine=1_000_000)
        self.coord = Coordinator(self.store, timeouts=TIMEOUTS, clock=self.clock, observer=Reached())
        self.seen: dict[str, int] = defaultdict(int)
        # (producer, transfer) -> generations the producer was assigned and has not let go of (some rank holds).
        self.held: dict[tuple[str, str], set[int]] = defaultdict(set)
        # (producer, transfer, generation) -> ranks that have not reported it.
        self.unreported: dict[tuple[str, str, int], set[int]] = {}
        self.terminal: dict[str, State] = {}
        self.aborts_heard: dict[tuple[str, str, float], int] = defaultdict(int)
        # (engine, transfer, commit time) -> TRANSFER_COMMITTED events it heard.
        self.commits_heard: dict[tuple[str, str, float], int] = defaultdict(int)
        # (transfer, generation) -> ranks of the mover that reported it a success while it was in flight.
        self.moved: dict[tuple[str, int], set[int]] = defaultdict(set)
        self.minted: list[str] = []
        # Incarnations replaced by a registration whose loss the coordinator has not applied yet.
        self.pending_loss: list[Engine] = []
        for e in ENGINES:
            self._register(e)

    @initialize(target=transfers)
    def first_transfer(self) -> str:
        return self._mint()

    @rule(target=transfers)
    def mint(self) -> str:
        """A router mints a fresh transfer id."""
        return self._mint()

    def _mint(self) -> str:
        self.minted.append(f"t{len(self.minted)}")
        return self.minted[-1]

    @staticmethod
    def _spec(engine_id: str) -> EngineSpec:
        role = Role.CONSUMER if engine_id in CONSUMERS else Role.PRODUCER
        ranks = RANKS.get(engine_id, 1)
        spec = engine_spec(engine_id, role, HEADED, num_blocks=16)
        if ranks == 1:
            return spec
        agents = tuple(replace(agent(f"{engine_id}-rank{r}", 16, 4096 // ranks), rank=r) for r in range(ranks))
        return EngineSpec(engine_id, spec.pool, role, replace(HEADED, tp_size=ranks), agents)

    def _register(self, engine_id: str) -> None:
        self._note_live(engine_id)
        run(self.coord.register_engine(self._spec(engine_id)))
        self.seen[engine_id] = run(self.store.last_event_sequence(engine_id))
        self._forget_holdings(engine_id)

    def _note_live(self, engine_id: str) -> None:
        """Tell hypothesis what an engine that registers anew leaves behind."""
        left = run(self.store.list_transfers(engine_id))
        states = {t.state for t in left}
        if states & {State.TARGETED, State.CLAIMED, State.MATCHED, State.COMMITTED}:
            hypothesis_event("re-registered with live transfers")
        for state in states & {State.MATCHED, State.COMMITTED}:
            hypothesis_event(f"re-registered with a {state.name} transfer")
        if any(t.revoking_generation and t.producer_engine_id == engine_id for t in left):
            hypothesis_event("re-registered holding a revoked generation")

    def _forget_holdings(self, producer: str) -> None:
        for key in [k for k in self.held if k[0] == producer]:
            self._forget_holdings_of(*key)

    def _call(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        """fn's answer, or None when it refused."""
        try:
            return run(fn(*args))
        except RendezvousError:
            return None

    def _after(self) -> None:
        """Sweep, then deliver every new event and check it."""
        run(self.coord.sweep())
        for engine_id in ENGINES:
            page = run(self.store.read_events(engine_id, self.seen[engine_id] + 1, 1_000_000))
            assert page.resync_sequence is None
            for event in page.events:
                self.seen[engine_id] = event.sequence
                self._check_event(engine_id, event)
        gone = {t for t, _ in self.moved if run(self.store.get_transfer(t)) is None}
        for key in [k for k in self.moved if k[0] in gone]:
            del self.moved[key]  # a dropped id may be registered afresh, from generation 1

    def _check_event(self, engine_id: str, event: Event[Transfer, Engine]) -> None:
        t = event.transfer
        if t is not None:
            assert engine_id in t.participants(), f"{event.type.name} for {t.transfer_id} sent to outsider {engine_id}"
            if event.type in PRODUCER_EVENTS:
                assert engine_id == t.producer_engine_id
            if event.type in CONSUMER_EVENTS:
                assert engine_id == t.consumer_engine_id
        if event.type == EventType.TRANSFER_ASSIGNED:
            assert t is not None and event.peer is not None
            key = (engine_id, t.transfer_id)
            consumer = run(self.store.get_engine(t.consumer_engine_id))
            producer = run(self.store.get_engine(t.producer_engine_id))
            assert event.peer.incarnation == t.consumer_incarnation, f"{t.transfer_id} assigned another incarnation"
            assert consumer is not None and consumer.incarnation == t.consumer_incarnation, (
                f"{t.transfer_id} assigned for consumer incarnation {t.consumer_incarnation}, now replaced"
            )
            assert producer is not None and producer.incarnation == t.producer_incarnation
            assert not self.held[key], f"{engine_id} assigned {event.generation} while holding {self.held[key]}"
            self.held[key].add(event.generation)
            self.unreported[(*key, event.generation)] = set(range(RANKS.get(engine_id, 1)))
        elif event.type == EventType.TRANSFER_REVOKED:
            hypothesis_event("revoked")
        elif event.type == EventType.REVOCATION_CONFIRMED:
            assert t is not None
            hypothesis_event(f"revocation confirmed ({t.state.name})")
            producer_key = (t.producer_engine_id, t.transfer_id)
            still_held = event.generation in self.held.get(producer_key, set())
            tombstone_dropped = run(self.store.get_transfer(t.transfer_id)) is None
            producer = run(self.store.get_engine(t.producer_engine_id))
            producer_gone = (
                producer is None or producer.incarnation != t.producer_incarnation or not producer.alive(self.clock.now)
            )
            assert not still_held or tombstone_dropped or producer_gone, (
                f"{t.transfer_id} g{event.generation} freed while held"
            )
            if still_held:
                self._let_go(*producer_key, event.generation)
        elif event.type == EventType.TRANSFER_COMMITTED:
            assert t is not None
            if engine_id == _mover(t):
                assert t.mode == Mode.PULL and RANKS.get(engine_id, 1) > 1, (
                    f"{t.transfer_id} ({t.mode.name}): its mover {engine_id} told of the commit"
                )
            commit_key = (engine_id, t.transfer_id, t.times.commit_time)
            self.commits_heard[commit_key] += 1
            assert self.commits_heard[commit_key] == 1, f"{engine_id} told twice of the commit of {t.transfer_id}"
        elif event.type == EventType.TRANSFER_ABORTED:
            assert t is not None
            abort_key = (engine_id, t.transfer_id, t.times.end_time)
            self.aborts_heard[abort_key] += 1
            assert self.aborts_heard[abort_key] == 1, f"{engine_id} told twice of the abort of {t.transfer_id}"
            if engine_id == t.producer_engine_id and not t.revoking_generation:
                self._forget_holdings_of(engine_id, t.transfer_id)
            if engine_id == t.consumer_engine_id and not t.revoking_generation and t.producer_engine_id:
                # The consumer may reuse its blocks at once: the producer must hold nothing, or be gone.
                producer = run(self.store.get_engine(t.producer_engine_id))
                gone = producer is None or producer.incarnation != t.producer_incarnation or producer.ended_at
                held = self.held.get((t.producer_engine_id, t.transfer_id))
                assert gone or not held, f"{t.transfer_id} aborted without fencing generations {held}"

    def _forget_holdings_of(self, producer: str, transfer_id: str) -> None:
        for gen in self.held.pop((producer, transfer_id), set()):
            self.unreported.pop((producer, transfer_id, gen), None)

    def _let_go(self, producer: str, transfer_id: str, gen: int) -> None:
        self.held[(producer, transfer_id)].discard(gen)
        self.unreported.pop((producer, transfer_id, gen), None)

    @rule(
        t=transfers,
        c=st.sampled_from(CONSUMERS),
        p=st.sampled_from(PRODUCERS),
        consumer_first=st.booleans(),
        pull=st.booleans(),
    )
    def both_halves(self, t: str, c: str, p: str, consumer_first: bool, pull: bool) -> None:
        """The common case: a router sent both legs; they arrive in either order."""
        if consumer_first:
            self.register_target(c, t, 1, (1, 2, 3), pull, not pull)
            self.source_ready(p, t, (4, 5, 6)) if pull else self.claim(p, t)
        else:
            self.source_ready(p, t, (4, 5, 6)) if pull else self.claim(p, t)
            self.register_target(c, t, 1, (1, 2, 3), pull, not pull)

    # Consumer operations

    @rule(pick=st.integers(0, 100), b=blocks)
    def consumer_preempted(self, pick: int, b: tuple[int, ...]) -> None:
        """A consumer re-registers a live transfer with the next generation and new blocks."""
        live = sorted(
            (r.consumer_engine_id, r.transfer_id, r.generation, r.mode == Mode.PULL)
            for r in run(self.store.list_transfers())
            if r.consumer_engine_id and r.state in (State.TARGETED, State.MATCHED)
        )
        if live:
            c, t, gen, pull = live[pick % len(live)]
            self.register_target(c, t, gen + 1, b, pull)

    @rule(
        c=st.sampled_from(CONSUMERS),
        t=transfers,
        gen=st.integers(1, 3),
        b=blocks,
        pull=st.booleans(),
        progressive=st.booleans(),
    )
    def register_target(
        self, c: str, t: str, gen: int, b: tuple[int, ...], pull: bool, progressive: bool = False
    ) -> None:
        mode = Mode.PULL if pull else Mode.PUSH
        tokens = TOKENS if progressive else 0
        self._call(
            self.coord.register_targets,
            c,
            0,
            [TargetSpec(t, b, generation=gen, num_tokens=tokens, mode=mode, progressive=progressive)],
        )
        self._after()

    @rule(c=st.sampled_from(CONSUMERS), t=transfers, gen=st.integers(1, 3))
    def release(self, c: str, t: str, gen: int) -> None:
        self._call(self.coord.release_targets, c, 0, [ReleaseSpec(t, gen)])
        self._after()

    # Producer operations

    @rule(p=st.sampled_from(PRODUCERS), t=transfers)
    def claim(self, p: str, t: str) -> None:
        self._call(self.coord.claim_transfers, p, 0, [ClaimSpec(t)])
        self._after()

    @rule(p=st.sampled_from(PRODUCERS), t=transfers, b=blocks)
    def source_ready(self, p: str, t: str, b: tuple[int, ...]) -> None:
        self._call(self.coord.mark_sources_ready, p, 0, [SourceReadySpec(t, b)])
        self._after()

    @rule(
        e=st.sampled_from(ENGINES), t=transfers, gen=st.integers(1, 3), failed=st.booleans(), rank=st.sampled_from(RANK)
    )
    def complete(self, e: str, t: str, gen: int, failed: bool, rank: int | None = None) -> None:
        outcome = Outcome.FAILED if failed else Outcome.SUCCEEDED
        ranks = () if rank is None else (rank,)
        self._report(e, CompletionSpec(t, gen, outcome, "", ranks))

    def _report(self, e: str, spec: CompletionSpec) -> bool:
        """e reports spec; whether it was accepted. Checks what a commit needs and whom it tells."""
        t, gen = spec.transfer_id, spec.generation
        before = run(self.store.get_transfer(t))
        outcomes = self._call(self.coord.complete_transfers, e, 0, [spec])
        if outcomes and outcomes[0].error is not None:
            assert run(self.store.get_transfer(t)) == before, f"a refused report of {t} changed it"
        accepted = bool(outcomes) and outcomes[0].error is None
        in_flight = (
            before is not None
            and before.state == State.MATCHED
            and before.generation == gen
            and _mover(before) == e
            and (before.mode == Mode.PULL or before.assigned_generation == gen)
            and self._joined(e, before)
        )
        every_rank = set(range(RANKS.get(e, 1)))
        reporting = set(spec.ranks) or every_rank
        if accepted and in_flight and spec.outcome == Outcome.SUCCEEDED:
            assert before is not None and (before.mode == Mode.PUSH or before.source_block_ids is not None), (
                f"{t} g{gen}: {e}'s success was taken before the producer's source was ready"
            )
            self.moved[(t, gen)] |= reporting
        if accepted:
            self._release_holding(e, t, gen, spec.ranks)
        self._after()
        after = run(self.store.get_transfer(t))
        if before is None or before.state != State.MATCHED or after is None or after.state != State.COMMITTED:
            return accepted
        if spec.parts:
            hypothesis_event("committed by written parts")
        assert self.moved[(t, gen)] == every_rank, (
            f"{t} g{gen} committed by {e} ranks {sorted(reporting)}; only {sorted(self.moved[(t, gen)])} of "
            f"{sorted(every_rank)} reported it"
        )
        told = self.commits_heard[(after.counterpart(e), t, after.times.commit_time)]
        assert told == 1, f"the commit of {t} g{gen} was told to {after.counterpart(e)} {told} times"
        consumer_told = after.mode == Mode.PULL and reporting != every_rank
        heard = self.commits_heard[(e, t, after.times.commit_time)]
        assert heard == consumer_told, (
            f"{t} g{gen} ({after.mode.name}) committed by {e} ranks {sorted(reporting)}: {e} told {heard} times"
        )
        return accepted

    @rule(p=st.sampled_from(PRODUCERS), t=transfers, gen=st.integers(1, 3), rank=st.sampled_from(RANK))
    def acknowledge(self, p: str, t: str, gen: int, rank: int | None = None) -> None:
        ranks = () if rank is None else (rank,)
        outcomes = self._call(self.coord.acknowledge_revocations, p, 0, [RevocationAck(t, gen, ranks)])
        if outcomes and outcomes[0].error is None:
            self._release_holding(p, t, gen, ranks)
        self._after()

    def _joined(self, e: str, t: Transfer) -> bool:
        """Whether e's current incarnation is the one that joined t (a later one's call about t applies the
        earlier one's loss instead, if the store has not yet)."""
        engine = run(self.store.get_engine(e))
        recorded = t.producer_incarnation if e == t.producer_engine_id else t.consumer_incarnation
        return engine is not None and engine.incarnation == recorded

    def _release_holding(self, engine_id: str, t: str, gen: int, ranks: tuple[int, ...]) -> None:
        record = run(self.store.get_transfer(t))
        if record is None or record.producer_engine_id != engine_id:
            return
        remaining = self.unreported.get((engine_id, t, gen), set())
        remaining.difference_update(ranks or range(RANKS.get(engine_id, 1)))
        # The server let go of it only if it is no longer assigned nor being revoked, and only once every rank did.
        if gen not in (record.assigned_generation, record.revoking_generation):
            assert not remaining, f"{t} g{gen} released while ranks {remaining} of {engine_id} still hold it"
            self._let_go(engine_id, t, gen)

    # Anyone

    @rule(e=st.sampled_from((*ENGINES, "")), t=transfers, dice=st.integers(0, 2))
    def abort(self, e: str, t: str, dice: int) -> None:
        if dice == 0 and self._call(self.coord.abort_transfers, e, 0, [AbortSpec(t, "test")]):
            # A producer that aborts promises not to write the transfer any more.
            self._forget_holdings_of(e, t)
        self._after()

    @rule(pick=st.integers(0, 100), by_consumer=st.booleans())
    def abort_a_matched_transfer(self, pick: int, by_consumer: bool) -> None:
        """The consumer (or the router) gives up on a transfer the producer may be writing."""
        matched = sorted(
            (r.consumer_engine_id, r.transfer_id) for r in run(self.store.list_transfers()) if r.state == State.MATCHED
        )
        if not matched:
            return
        c, t = matched[pick % len(matched)]
        outcomes = self._call(self.coord.abort_transfers, c if by_consumer else "", 0, [AbortSpec(t, "test")])
        record = outcomes[0].transfer if outcomes else None
        if by_consumer and record is not None and not record.revoking_generation:
            held = self.held.get((record.producer_engine_id, t))
            assert not held, f"{t} aborted by its consumer without fencing generations {held}"
        self._after()

    @rule(pick=st.integers(0, 100), failed=st.booleans(), rank=st.sampled_from(RANK))
    def producer_finishes_a_held_generation(self, pick: int, failed: bool, rank: int | None) -> None:
        held = sorted((k, g) for k, gens in self.held.items() for g in gens)
        if held:
            (p, t), gen = held[pick % len(held)]
            self.complete(p, t, gen, failed, rank)

    @rule(pick=st.integers(0, 100), kind=st.sampled_from(sorted(PARTS)), rank=st.sampled_from(RANK))
    def producer_reports_written_parts(self, pick: int, kind: str, rank: int | None) -> None:
        """A producer reports a held generation as written in parts: only parts that tile the share of the
        reporting ranks, for a target that accepted parts, may move the transfer on."""
        held = sorted((k, g) for k, gens in self.held.items() for g in gens)
        if held:
            (p, t), gen = held[pick % len(held)]
            self._report_parts(p, t, gen, kind, () if rank is None else (rank,))

    def _report_parts(self, p: str, t: str, gen: int, kind: str, ranks: tuple[int, ...]) -> None:
        before = run(self.store.get_transfer(t))
        spec = CompletionSpec(t, gen, Outcome.SUCCEEDED, "", ranks, PARTS[kind])
        checked = (
            before is not None
            and before.state == State.MATCHED
            and before.assigned_generation == gen
            and before.revoking_generation != gen
            and self._joined(p, before)
        )
        if self._report(p, spec):
            assert not checked or (before is not None and before.progressive and kind in TILING), (
                f"{t} g{gen} took {kind} parts (progressive: {before.progressive if before else None})"
            )

    @rule(
        target=transfers,
        c=st.sampled_from(CONSUMERS),
        p=st.sampled_from(PRODUCERS),
        steps=st.lists(st.sampled_from((None, 0, 1, PREEMPTED)), min_size=1, max_size=6),
        failing=st.integers(0, 11),
        b=st.lists(st.integers(0, 15), max_size=3, unique=True).map(tuple),
        ready_at=st.one_of(st.just(0), st.integers(1, 3)),
    )
    def pulled_by_ranks(
        self, c: str, p: str, steps: list[int | str | None], failing: int, b: tuple[int, ...], ready_at: int
    ) -> str:
        """A router mints a pull transfer and sends both legs; then, step by step, a rank of the consumer (None:
        every rank) reports its READ of the current generation (the step numbered `failing` a failure), or the
        consumer is preempted and registers the next generation with blocks b. The producer's source is ready
        from the start (`ready_at` 0), or it claims first and marks its source ready before step `ready_at`."""
        t = self._mint()
        if ready_at:
            self.register_target(c, t, 1, (1, 2, 3), pull=True)
            self.claim(p, t)
        else:
            self.both_halves(t, c, p, consumer_first=True, pull=True)
        for i, step in enumerate(steps):
            if ready_at and i == ready_at:
                self.source_ready(p, t, (4, 5, 6))
            record = run(self.store.get_transfer(t))
            if record is None or record.state != State.MATCHED:
                break
            if isinstance(step, str):  # PREEMPTED
                self.register_target(c, t, record.generation + 1, b, pull=True)
            else:
                self.complete(c, t, record.generation, i == failing, step)
        return t

    @rule(
        target=transfers,
        c=st.sampled_from(CONSUMERS),
        p=st.sampled_from(PRODUCERS),
        steps=st.lists(st.sampled_from((None, 0, 1, PREEMPTED)), min_size=1, max_size=6),
        failing=st.integers(0, 11),
        parts=st.sampled_from(("", *sorted(TILING))),
        consumer_first=st.booleans(),
    )
    def pushed_by_ranks(
        self, c: str, p: str, steps: list[int | str | None], failing: int, parts: str, consumer_first: bool
    ) -> str:
        """pulled_by_ranks in push: a router mints a push transfer (progressive when its producer reports `parts`)
        and sends both legs; then, step by step, a rank of the producer (None: every rank) reports the generation
        it was assigned (the step numbered `failing` a failure) or lets go of a revoked one, or the consumer is
        preempted and registers the next generation."""
        t = self._mint()
        for half in (True, False) if consumer_first else (False, True):
            self.register_target(c, t, 1, TARGET, False, bool(parts)) if half else self.claim(p, t)
        for i, step in enumerate(steps):
            record = run(self.store.get_transfer(t))
            if record is None or record.state != State.MATCHED:
                break
            ranks = () if step is None or isinstance(step, str) else (step,)
            if isinstance(step, str):  # PREEMPTED
                self.register_target(c, t, record.generation + 1, NEXT_TARGET, False, bool(parts))
            elif record.revoking_generation:
                self.acknowledge(p, t, record.revoking_generation, step)
            elif parts and i != failing:
                self._report_parts(p, t, record.assigned_generation, parts, ranks)
            else:
                self.complete(p, t, record.assigned_generation, i == failing, step)
        return t

    @rule(pick=st.integers(0, 100), rank=st.sampled_from(RANK))
    def producer_acknowledges_a_revocation(self, pick: int, rank: int | None) -> None:
        revoked = sorted(
            (r.producer_engine_id, r.transfer_id, r.revoking_generation)
            for r in run(self.store.list_transfers())
            if r.revoking_generation
        )
        if revoked:
            self.acknowledge(*revoked[pick % len(revoked)], rank)

    @rule(target=transfers, moves=st.lists(steps, min_size=1, max_size=6))
    def advance_transfers(self, moves: list[Step]) -> MultipleResults[str]:
        """Engines take transfers that are ready for their next step one step on (the step each move picks):
        a producer joins a targeted transfer, a consumer a claimed one, the mover reports the generation in
        flight (or the consumer is preempted first), a producer lets go of a revoked generation, a consumer
        releases (or aborts) a committed transfer. An engine a step needs that is dead registers again instead, and one
        that is alive may restart instead (re-registers, or is replaced by another replica); with no
        transfer ready, a router mints one and sends its first half."""
        minted = []
        for move in moves:
            ready = sorted(
                (r for r in run(self.store.list_transfers()) if r.unsettled and r.participants()),
                key=lambda r: r.transfer_id,
            )
            if ready:
                self._step(ready[move.pick % len(ready)], move)
                continue
            minted.append(self._mint())
            if move.pull or move.progressive:  # a pull target never accepts parts
                self.register_target(move.consumer, minted[-1], 1, TARGET, move.pull, not move.pull)
            else:
                self.claim(move.producer, minted[-1])
        return multiple(*minted)

    def _step(self, t: Transfer, move: Step) -> None:
        """One step of t's lifecycle, as `advance_transfers` describes it."""
        tid, pull = t.transfer_id, t.mode == Mode.PULL
        actor = _next_actor(t, move)
        engine = run(self.store.get_engine(actor))
        if engine is None or not engine.alive(self.clock.now):
            self.reregister(actor)
            return
        if move.restart == "reregister":
            self.reregister(actor)
            return
        if move.restart == "replaced":
            self.replaced_loss_not_yet_applied(actor)
            return
        every_rank = range(RANKS.get(actor, 1))
        unreported = sorted(set(every_rank) - set(t.reported_ranks)) or list(every_rank)
        rank = None if move.rank is None or len(every_rank) == 1 else unreported[move.rank % len(unreported)]
        if t.state == State.TARGETED:
            self.source_ready(actor, tid, SOURCE) if pull else self.claim(actor, tid)
        elif t.state == State.CLAIMED:
            self.register_target(actor, tid, 1, TARGET, move.pull, move.progressive and not move.pull)
        elif t.state == State.COMMITTED and move.failed:
            self.abort(actor, tid, 0)  # the consumer cannot use what arrived, and gives it up
        elif t.state == State.COMMITTED:
            self.release(actor, tid, t.generation)
        elif t.state == State.MATCHED and move.preempted:
            self.register_target(actor, tid, t.generation + 1, NEXT_TARGET, pull, t.progressive)
        elif t.revoking_generation and move.ack:
            self.acknowledge(actor, tid, t.revoking_generation, rank)
        elif t.revoking_generation:
            self.complete(actor, tid, t.revoking_generation, move.failed, rank)
        elif pull and t.source_block_ids is None:
            self.source_ready(actor, tid, SOURCE)
        elif t.progressive and move.parts and not move.failed:
            self._report_parts(actor, tid, t.generation, move.parts, () if rank is None else (rank,))
        else:
            self.complete(actor, tid, t.generation, move.failed, rank)

    # Engines and time

    @rule(e=st.sampled_from(ENGINES))
    def reregister(self, e: str) -> None:
        self._register(e)
        self._after()

    @rule(e=st.sampled_from(ENGINES))
    def replaced_loss_not_yet_applied(self, e: str) -> None:
        """Another replica registered a new incarnation of e and has not yet aborted the old one's transfers."""
        self._note_live(e)
        spec = self._spec(e)
        previous = run(self.store.get_engine(e))
        now = self.clock.now
        run(self.store.update_engine(e, lambda cur: register_engine(now, cur, spec, self.coord.limits, TIMEOUTS)))
        if previous is None:  # its record, and its event log with it, had been dropped: a new log starts at 1
            self.seen[e] = run(self.store.last_event_sequence(e))
        elif not previous.ended_at:
            self.pending_loss.append(end_incarnation(now, previous))
        self._forget_holdings(e)

    @rule()
    def apply_pending_losses(self) -> None:
        while self.pending_loss:
            run(self.coord.lose_engine(self.pending_loss.pop(0)))
        self._after()

    @rule(e=st.sampled_from(ENGINES), restart=st.booleans())
    def deregister(self, e: str, restart: bool) -> None:
        if self._call(self.coord.deregister_engine, e, 0) is not None and e in PRODUCERS:
            self._forget_holdings(e)
        if restart:
            self._register(e)
        self._after()

    @rule()
    def revive_dead_engines(self) -> None:
        for e in ENGINES:
            engine = run(self.store.get_engine(e))
            if engine is None or not engine.alive(self.clock.now):
                self._register(e)
        self._after()

    @rule(dt=st.sampled_from((0.5, 3.0, 15.0, 45.0)), neglected=st.sets(st.sampled_from(ENGINES), max_size=1))
    def advance(self, dt: float, neglected: set[str]) -> None:
        for e in set(ENGINES) - neglected:
            self._call(self.coord.keep_alive, e, 0)
        self.clock.advance(dt)
        before = {e: run(self.store.get_engine(e)) for e in PRODUCERS}
        self._after()
        for e, engine in before.items():
            if engine is not None and not engine.ended_at and not engine.alive(self.clock.now):
                self._forget_holdings(e)

    @invariant()
    def no_live_transfer_waits_on_an_ended_incarnation(self) -> None:
        for record in run(self.store.list_transfers()):
            if record.state not in (State.TARGETED, State.CLAIMED, State.MATCHED):
                continue
            for engine_id, incarnation in (
                (record.consumer_engine_id, record.consumer_incarnation),
                (record.producer_engine_id, record.producer_incarnation),
            ):
                if (engine_id, incarnation) in {(e.engine_id, e.incarnation) for e in self.pending_loss}:
                    continue  # its loss is still to be applied
                if engine_id:
                    engine = run(self.store.get_engine(engine_id))
                    assert engine is not None and engine.incarnation == incarnation and not engine.ended_at, (
                        f"{record.transfer_id} is {record.state.name} but {engine_id}/{incarnation} has ended"
                    )

    @invariant()
    def terminal_states_are_final(self) -> None:
        for t in self.minted:
            record = run(self.store.get_transfer(t))
            if record is None:
                self.terminal.pop(t, None)
                continue
            if t in self.terminal:
                assert record.state == self.terminal[t], f"{t} left terminal state {self.terminal[t].name}"
            elif record.state.terminal:
                self.terminal[t] = record.state

    def teardown(self) -> None:
        """Nothing lives once every deadline, lease and tombstone has passed."""
        self.apply_pending_losses()
        for _ in range(4):
            self.clock.advance(TIMEOUTS.max_lease_ttl + TIMEOUTS.tombstone_ttl + TIMEOUTS.max_timeout)
            self._after()
        assert run(self.store.list_transfers()) == []
        assert run(every_engine(self.store)) == []


def _next_actor(t: Transfer, move: Step) -> str:
    """The engine that takes t's next step (`Lifecycle.advance_transfers`)."""
    if t.state == State.TARGETED:
        return move.producer
    if t.state == State.CLAIMED:
        return move.consumer
    if t.state == State.COMMITTED or (t.state == State.MATCHED and move.preempted):
        return t.consumer_engine_id
    if t.revoking_generation or t.mode == Mode.PUSH or t.source_block_ids is None:
        return t.producer_engine_id
    return t.consumer_engine_id  # reads a ready source


def _mover(t: Transfer) -> str:
    """The engine that moves t's bytes and reports them: the producer in push, the consumer in pull."""
    return t.producer_engine_id if t.mode == Mode.PUSH else t.consumer_engine_id


Lifecycle.TestCase.settings = settings(
    max_examples=int(os.environ.get("STATEFUL_EXAMPLES", examples(150))),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLifecycle = Lifecycle.TestCase
