"""The rule chain a batch item passes, as values: each step returns what it decides.

An item of a transfer call (RegisterTargets ... AbortTransfers) passes, in order: the caller's live-transfer
limit (`engines.LiveTransferLimit`), the binding of the half it takes (`bindings`; an abort's own check),
the consumer's capacity (`credits`: RegisterTargets only), the transition itself (`transfers`, one `Rule`
signature for all) and the caller's live-block budget (`budget.BlockBudget`, on the record the transition
leaves). A step refuses by raising `RendezvousError`; `Chain.decide` returns a `Decision`: the transition,
the record it was applied to, the block ids it adds and the consumer's usage after it. The coordinator
hands `decide` to the store (which may apply it more than once, on fresher records: the returned decision
is the one of the record it committed), and `Chain.after` gives the chain of the batch's next item.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from rendezvous.core import credits
from rendezvous.core.bindings import BindingRules, check_abort, check_binding
from rendezvous.core.budget import BlockBudget
from rendezvous.core.engines import LiveTransferLimit
from rendezvous.core.model import Engine, Role, Transfer, positional
from rendezvous.core.transfers import Context, Transition
from rendezvous.protocol.records import EngineCredits
from rendezvous.protocol.requests import (
    AbortSpec,
    ClaimSpec,
    CompletionSpec,
    ReleaseSpec,
    RevocationAck,
    SourceReadySpec,
    TargetSpec,
)

CallerT = TypeVar("CallerT", bound=Engine | None)
SpecT = TypeVar("SpecT", TargetSpec, ClaimSpec, SourceReadySpec, CompletionSpec, RevocationAck, ReleaseSpec, AbortSpec)

Rule = Callable[[Context, Transfer | None, CallerT, Mapping[str, Engine], SpecT], Transition]
"""A request's transition: (context, current record, caller, the record's engines by id, request)."""


@dataclass(frozen=True, slots=True)
class Decision(Transition):
    """A transition with what the chain decided on the way to it."""

    before: Transfer | None = None
    """The record the transition was applied to."""
    blocks: tuple[int, int] = (0, 0)
    """The block ids it adds to the caller's and to its identity's budget (budget.BlockBudget.change)."""
    spent: EngineCredits | None = None
    """The consumer's credit usage once it applies, where a capacity was checked."""

    @staticmethod
    def of(
        transition: Transition,
        before: Transfer | None,
        blocks: tuple[int, int] = (0, 0),
        spent: EngineCredits | None = None,
    ) -> Decision:
        """The decision that took transition on before (the sweeper's: no step but the transition decided).

        One is made per batch item, on the hot path: built without the frozen `__init__`'s cost."""
        return _decision(transition.transfer, transition.events, before, blocks, spent)


_decision = positional(Decision)


@dataclass(frozen=True)
class Binding:
    """The binding step: the caller may take `half` of the transfer (an abort, half None: may abort it)."""

    rules: BindingRules
    engine_id: str
    half: Role | None
    exempt: bool

    def check(self, now: float, cur: Transfer | None, item: SpecT) -> None:
        """Refuse the item unless its binding (or the caller's part in the transfer) admits the caller."""
        if self.half is None:
            check_abort(self.rules, cur, item.transfer_id, self.engine_id, self.exempt)
        else:
            binding = getattr(item, "binding", None)
            check_binding(self.rules, now, cur, item.transfer_id, binding, self.engine_id, self.half, self.exempt)


@dataclass(frozen=True)
class Capacity:
    """The capacity step of a RegisterTargets batch: the router's choice of consumer is honoured
    (credits.check_reserved_elsewhere), and a consumer with a capacity admits the target within it."""

    consumer: Engine
    held: Mapping[str, credits.Reservation]
    """The reservations of the batch's transfer ids, on any consumer."""
    reservations: Mapping[str, credits.Reservation]
    """Those on this consumer."""
    spent: EngineCredits | None
    """The consumer's usage before the item (None: it has no capacity)."""

    def admit(self, now: float, cur: Transfer | None, transfer_id: str, blocks: int) -> EngineCredits | None:
        """The consumer's usage once the item applies (None without a capacity), or a refusal."""
        credits.check_reserved_elsewhere(self.consumer, transfer_id, self.held.get(transfer_id), now)
        if self.spent is None:
            return None
        reservation = self.reservations.get(transfer_id)
        return credits.target_admission(self.consumer, self.spent, cur, reservation, blocks, now)


@dataclass(frozen=True, slots=True)
class Chain(Generic[CallerT, SpecT]):
    """The steps one item passes (a step left None does not apply), for one item at a time."""

    transition: Rule[CallerT, SpecT]
    caller: CallerT
    limit: LiveTransferLimit | None = None
    binding: Binding | None = None
    capacity: Capacity | None = None
    budget: BlockBudget | None = None

    def decide(self, ctx: Context, item: SpecT, cur: Transfer | None, engines: Mapping[str, Engine]) -> Decision:
        """Every step on cur, in order: the decision, or the first step's refusal."""
        if self.limit is not None:
            self.limit.check(cur)
        if self.binding is not None:
            self.binding.check(ctx.now, cur, item)
        spent = None
        if self.capacity is not None:
            spent = self.capacity.admit(ctx.now, cur, item.transfer_id, len(getattr(item, "block_ids", ())))
        transition = self.transition(ctx, cur, self.caller, engines, item)
        blocks = (0, 0)
        if self.budget is not None:
            blocks = self.budget.change(cur, transition.transfer)
            self.budget.refuse(blocks)
        return Decision.of(transition, cur, blocks, spent)

    def within(self, items: int, blocks: int) -> bool:
        """Whether that many items naming that many block ids stay within the limit and the budget whatever
        they do, and no capacity admits them in turn: then they may be decided together (`unlimited`)."""
        return (
            (self.limit is None or self.limit.allows(items))
            and (self.budget is None or self.budget.allows(blocks))
            and (self.capacity is None or self.capacity.spent is None)
        )

    def unlimited(self) -> Chain[CallerT, SpecT]:
        """The chain without the limit and the budget (for items `within` them)."""
        return replace(self, limit=None, budget=None)

    def after(self, decision: Decision | None) -> Chain[CallerT, SpecT]:
        """The chain of the next item, once this one ended with decision (None: refused)."""
        if decision is None:
            return self
        limit, budget, capacity = self.limit, self.budget, self.capacity
        next_limit = limit.after(decision.transfer) if limit is not None else None
        next_budget = budget.spent(decision.blocks) if budget is not None else None
        if capacity is not None and decision.spent is not None:
            capacity = replace(capacity, spent=decision.spent)
        if next_limit is limit and next_budget is budget and capacity is self.capacity:
            return self  # the common case (no step keeps count): nothing to build
        # As replace() would, without its per-field cost: a batch's items each make one when a step keeps count.
        chain: Chain[CallerT, SpecT] = _chain(
            self.transition, self.caller, next_limit, self.binding, capacity, next_budget
        )
        return chain


_chain = positional(Chain)
