"""The memory budget: how much the server holds in live engines, live block ids and agent metadata bytes.

One rule for every store. A stored record *charges* its owner (the identity that registered the engine;
"" without auth) and the whole server: a live engine incarnation one engine and its agents' metadata
bytes (`engine_usage`), a live transfer its target block ids to the consumer's owner and its source block
ids to the producer's (`transfer_blocks`). Stores keep the sums (`Tally`), updated in the same atomic step
that changes a record, and the coordinator asks before a change that grows them: `check_engine` for a
registration, `BlockBudget` for a batch of calls that name block ids. A change over a budget is refused with
RESOURCE_EXHAUSTED / BUDGET_EXHAUSTED (ErrorInfo metadata `budget`, `scope` server|identity, `limit`);
changes that free budget always go through. Ended engines (tombstones) keep no agent metadata
(`rendezvous.core.engines.end_incarnation`) and charge nothing, nor do ended transfers.

The tally is read before the change is applied, as the live-transfer limit is. The Redis store checks every
budget again in the script that writes the record (commit_engine.lua, commit_transfers.lua), so replicas never
pass one together; the memory store applies check_engine in the step that writes, and checks the live-block
budget again as each transfer write applies (MemoryStore._check_blocks), so batches of different requests in
flight together, which interleave between their items, never pass it either.
"""

from __future__ import annotations

from dataclasses import dataclass

from rendezvous.core.limits import Limits
from rendezvous.core.model import Engine, State, Transfer, positional
from rendezvous.protocol.errors import Reason, RendezvousError

ENGINES = "engines"
LIVE_BLOCKS = "live_blocks"
AGENT_METADATA_BYTES = "agent_metadata_bytes"

# The ended states (State.terminal), compared by identity: transfer_blocks runs on every transfer write.
_RELEASED, _ABORTED = State.RELEASED, State.ABORTED


@dataclass(frozen=True)
class Usage:
    """What records charge: live engines, block ids of live transfers, agent metadata bytes of live engines."""

    engines: int = 0
    blocks: int = 0
    metadata_bytes: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.engines + other.engines, self.blocks + other.blocks, self.metadata_bytes + other.metadata_bytes
        )

    def __sub__(self, other: Usage) -> Usage:
        return Usage(
            self.engines - other.engines, self.blocks - other.blocks, self.metadata_bytes - other.metadata_bytes
        )


@dataclass(frozen=True)
class Tally:
    """The usage of the whole server and of one identity ("" : none asked, or auth off)."""

    total: Usage = Usage()
    identity: Usage = Usage()


Charges = tuple[tuple[str, Usage], ...]
"""What one record charges, by owner ("" = nobody's identity; still counted in the server's total)."""


def engine_usage(engine: Engine | None) -> Usage:
    """What a stored engine record charges: a live (not ended) incarnation, one engine and its metadata bytes."""
    if engine is None or engine.ended_at:
        return Usage()
    return Usage(engines=1, metadata_bytes=sum(len(a.metadata) for a in engine.agents))


def engine_charges(engine: Engine | None) -> Charges:
    """An engine record's charges, to its owner."""
    usage = engine_usage(engine)
    return ((engine.owner, usage),) if engine is not None and usage != Usage() else ()


def transfer_blocks(t: Transfer | None) -> tuple[int, int]:
    """Block ids a stored transfer charges (to its consumer's owner, to its producer's): those of a live one."""
    if t is None:
        return 0, 0
    state = t.state
    if state is _RELEASED or state is _ABORTED:
        return 0, 0
    return len(t.target_block_ids), len(t.source_block_ids or ())


def transfer_charges(t: Transfer | None, consumer_owner: str, producer_owner: str) -> Charges:
    """A transfer record's charges, given the owners of its engines."""
    target, source = transfer_blocks(t)
    charges = [(owner, Usage(blocks=n)) for owner, n in ((consumer_owner, target), (producer_owner, source)) if n]
    return tuple(charges)


def blocks_of(t: Transfer | None, engine_id: str) -> int:
    """Block ids of t charged to the side engine_id holds."""
    if t is None:
        return 0
    target, source = transfer_blocks(t)
    return (target if t.consumer_engine_id == engine_id else 0) + (source if t.producer_engine_id == engine_id else 0)


def exhausted(budget: str, scope: str, limit: int, have: int, adding: int) -> RendezvousError:
    """The refusal of a change that would take a budget past its limit."""
    who = "the server" if scope == "server" else "the caller's identity"
    return RendezvousError(
        Reason.BUDGET_EXHAUSTED,
        f"{who} holds {have} of its {limit} {budget}; {adding} more would pass the budget",
        budget=budget,
        scope=scope,
        limit=limit,
    )


def _check(kind: str, have: int, adding: int, limit: int, scope: str) -> None:
    if adding > 0 and have + adding > limit:
        raise exhausted(kind, scope, limit, have, adding)


def check_usage(limits: Limits, tally: Tally, owner: str, total: Usage, identity: Usage) -> None:
    """Refuse a change that adds `total` to the server's usage and `identity` to its owner's, where any
    kind that grows would pass its budget. Without an owner (auth off) only the server's budgets apply."""
    have, mine = tally.total, tally.identity
    _check(ENGINES, have.engines, total.engines, limits.max_engines, "server")
    _check(LIVE_BLOCKS, have.blocks, total.blocks, limits.max_live_blocks, "server")
    metadata_limit = limits.max_agent_metadata_bytes_total
    _check(AGENT_METADATA_BYTES, have.metadata_bytes, total.metadata_bytes, metadata_limit, "server")
    if not owner:
        return
    _check(ENGINES, mine.engines, identity.engines, limits.max_engines_per_identity, "identity")
    _check(LIVE_BLOCKS, mine.blocks, identity.blocks, limits.max_live_blocks_per_identity, "identity")
    _check(
        AGENT_METADATA_BYTES,
        mine.metadata_bytes,
        identity.metadata_bytes,
        limits.max_agent_metadata_bytes_per_identity,
        "identity",
    )


def check_engine(limits: Limits, tally: Tally, cur: Engine | None, new: Engine) -> None:
    """Refuse a registration (new replacing the stored cur) that grows a budget past its limit.

    tally is the usage of the server and of new's owner. A re-registration replaces what cur charged;
    under another owner, the new owner is charged in full.
    """
    before, after = engine_usage(cur), engine_usage(new)
    own_before = before if cur is not None and cur.owner == new.owner else Usage()
    check_usage(limits, tally, new.owner, after - before, after - own_before)


@dataclass(frozen=True, slots=True)
class BlockBudget:
    """The live-block budget for a batch of one engine's calls (like `engines.LiveTransferLimit`).

    `room` and `identity_room` are how many more block ids the server and the engine's owner may hold.
    """

    engine_id: str
    owner: str
    limits: Limits
    room: int
    identity_room: int

    @classmethod
    def of(cls, limits: Limits, engine: Engine, tally: Tally) -> BlockBudget:
        """The budget for calls of engine, with the usage of the server and of engine's owner now."""
        identity_room = limits.max_live_blocks_per_identity - tally.identity.blocks if engine.owner else 1 << 62
        return cls(engine.engine_id, engine.owner, limits, limits.max_live_blocks - tally.total.blocks, identity_room)

    def allows(self, blocks: int) -> bool:
        """Whether calls that add at most `blocks` block ids stay within budget whatever they do."""
        return self.room >= blocks and self.identity_room >= blocks

    def change(self, cur: Transfer | None, new: Transfer | None) -> tuple[int, int]:
        """The block ids a call that turns cur into new adds: to the server, and to the engine's side."""
        if cur is new:
            return 0, 0
        target, source = transfer_blocks(new)
        was_target, was_source = transfer_blocks(cur)
        engine_id = self.engine_id
        own = 0
        if new is not None:
            own += (target if new.consumer_engine_id == engine_id else 0) + (
                source if new.producer_engine_id == engine_id else 0
            )
        if cur is not None:
            own -= (was_target if cur.consumer_engine_id == engine_id else 0) + (
                was_source if cur.producer_engine_id == engine_id else 0
            )
        return target + source - was_target - was_source, own

    def refuse(self, change: tuple[int, int]) -> None:
        """Refuse a change (see `change`) that takes more block ids than there is room for."""
        total, own = change
        if total > 0 and total > self.room:
            limit = self.limits.max_live_blocks
            raise exhausted(LIVE_BLOCKS, "server", limit, limit - self.room, total)
        if self.owner and own > 0 and own > self.identity_room:
            limit = self.limits.max_live_blocks_per_identity
            raise exhausted(LIVE_BLOCKS, "identity", limit, limit - self.identity_room, own)

    def check(self, cur: Transfer | None, new: Transfer | None) -> None:
        """Refuse a call that turns cur into new if that takes more block ids than there is room for."""
        self.refuse(self.change(cur, new))

    def spent(self, change: tuple[int, int]) -> BlockBudget:
        """The budget after a change (see `change`)."""
        total, own = change
        if not total and not own:
            return self
        # Per batch item that names block ids: built without the frozen __init__'s cost.
        return _block_budget(self.engine_id, self.owner, self.limits, self.room - total, self.identity_room - own)

    def after(self, cur: Transfer | None, new: Transfer | None) -> BlockBudget:
        """The budget after a call that turned cur into new."""
        return self.spent(self.change(cur, new))


_block_budget = positional(BlockBudget)
