"""The transfer lifecycle: every state transition of a transfer, as pure functions.

    TARGETED ─┐                      ┌─> RELEASED   (consumer done; tombstone)
              ├─> MATCHED ─> COMMITTED
    CLAIMED  ─┘                      └─> (auto-released after release_timeout)
    any live state ─> ABORTED (requested, deadline, peer lost, layout/block mismatch, failure)

Every request's transition has one signature, `Rule` (rendezvous.core.rules): the context, the current
record (None if unknown), the calling engine, the engines the record names (as the store read them, by id)
and the request. It returns a `Transition`: the new record and the events to append, or raises
`RendezvousError` leaving the record untouched. Stores apply a transition atomically. The sweeper's two
(`expire`, `engine_lost`) answer no caller and take only what they need.

Fencing: a producer holds at most one generation of a transfer (`assigned_generation`).
When the consumer re-registers with a newer generation, or the transfer is aborted while
the producer may be writing, that generation becomes `revoking_generation`: the producer
gets TRANSFER_REVOKED (or TRANSFER_ABORTED) and must acknowledge (AcknowledgeRevocations,
or CompleteTransfers of that generation) before the consumer gets REVOCATION_CONFIRMED and
may reuse those blocks. A lost producer, or the tombstone's expiry, confirms too.

Ranks: an engine of several ranks (one NIXL agent each) moves a generation's bytes from every rank. Each
rank reports its share (CompleteTransfers / AcknowledgeRevocations naming its ranks; none named = all), and the
record collects them in `reported_ranks` for the one generation in flight: the generation commits, or its
revocation is confirmed, once every rank has reported. A failure of any rank aborts the transfer; until the
other ranks have reported, the generation stays fenced and the mover is told TRANSFER_ABORTED too, so its
other ranks stop. A pull consumer whose last report did not name every rank is told TRANSFER_COMMITTED too (as
the producer is), so that its ranks that reported earlier end their targets and rank 0 releases.

Progressive push: a target may accept parts (`progressive`); a producer's success may then list the parts its
ranks wrote, and `rendezvous.core.parts` refuses a set that does not tile their share before anything changes.
Parts change nothing else: the generation commits, is revoked or aborts as a whole, and covers every part.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rendezvous.core.engines import layout_mismatch
from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import (
    AbortReason,
    Addressed,
    Engine,
    Event,
    EventType,
    Mode,
    Outcome,
    Role,
    State,
    Transfer,
    TransferTimes,
    blocks_digest,
    evolve,
    keywords,
    positional,
)
from rendezvous.core.parts import check_part_count, check_parts, check_progressive_target, held_layers
from rendezvous.core.validation import check_block_ids, check_id, resolve_timeout
from rendezvous.protocol.dataplane import data_plane_mismatch
from rendezvous.protocol.errors import Reason, RendezvousError, clip, transfer_not_found
from rendezvous.protocol.requests import (
    AbortSpec,
    ClaimSpec,
    CompletionSpec,
    ReleaseSpec,
    RevocationAck,
    SourceReadySpec,
    TargetSpec,
)


@dataclass(frozen=True, slots=True)
class Context:
    """What every transition may consult: the time and the policy."""

    now: float
    limits: Limits
    timeouts: Timeouts


@dataclass(frozen=True, slots=True)
class Transition:
    """A transition's result: the new record (None deletes it) and the events it emits."""

    transfer: Transfer | None
    events: tuple[Addressed, ...] = ()


# The records a transition makes new (a transfer's first half, its events), without the frozen __init__'s cost.
_new_transfer, _new_times = keywords(Transfer), keywords(TransferTimes)
_new_event, _addressed = positional(Event), positional(Addressed)


def _event(
    ctx: Context, engine_id: str, kind: EventType, t: Transfer | None, generation: int = 0, peer: Engine | None = None
) -> Addressed:
    return _addressed(engine_id, _new_event(kind, ctx.now, t, generation, peer, 0))


def _times(t: Transfer, **changes: float) -> TransferTimes:
    return evolve(t.times, **changes)


TOMBSTONE_BLOCK_IDS = 64
"""Block ids a tombstone keeps as they are (about the size of the rest of its record); above, digests."""


def _tombstone(ctx: Context, t: Transfer, state: State) -> Transfer:
    """t ended in state (RELEASED or ABORTED) now: kept as a tombstone for tombstone_ttl, so late halves
    and retried calls learn the outcome; then `expire` forgets it.

    A tombstone of more than TOMBSTONE_BLOCK_IDS block ids keeps digests of them, not the ids (`_same_blocks`
    compares a retry with them; source_block_ids stays () where the source was ready, None where not): a
    65,536-block target's ids are 2.6 MiB, which the memory budget no longer counts once the transfer ended.
    """
    deadline, times = ctx.now + ctx.timeouts.tombstone_ttl, _times(t, end_time=ctx.now)
    if t.block_digests or len(t.target_block_ids) + len(t.source_block_ids or ()) <= TOMBSTONE_BLOCK_IDS:
        return evolve(t, state=state, deadline=deadline, times=times)
    return evolve(
        t,
        state=state,
        deadline=deadline,
        times=times,
        target_block_ids=(),
        source_block_ids=None if t.source_block_ids is None else (),
        block_digests=f"{blocks_digest(t.target_block_ids)}:{blocks_digest(t.source_block_ids)}",
    )


def _same_blocks(t: Transfer, blocks: tuple[int, ...], source: bool) -> bool:
    """Whether blocks are t's target (or source) block ids, on a live record or a tombstone's digests."""
    if not t.block_digests:
        return (t.source_block_ids if source else t.target_block_ids) == blocks
    return t.block_digests.split(":")[1 if source else 0] == blocks_digest(blocks)


def _release(ctx: Context, t: Transfer) -> Transition:
    """The release step, the one way a committed transfer ends: its consumer is done with the blocks
    (ReleaseTargets), release_timeout passed without a release, or the consumer's engine is gone."""
    return Transition(_tombstone(ctx, t, State.RELEASED))


def _require_role(engine: Engine, role: Role) -> None:
    if engine.role != role:
        raise RendezvousError(
            Reason.WRONG_ROLE,
            f"engine {engine.engine_id} is a {engine.role.name}; this call needs a {role.name}",
            engine_id=engine.engine_id,
        )


def _ended(t: Transfer, engine_id: str) -> RendezvousError:
    """TRANSFER_ENDED for engine_id; only a half of the transfer learns why it was aborted (the abort reason
    and message a peer gave are its participants' business), or, for a pre-aborted id that no half had joined,
    any half that arrives (the abort was meant for it)."""
    halves = {t.consumer_engine_id, t.producer_engine_id} - {""}
    if halves and engine_id not in halves:
        return RendezvousError(
            Reason.TRANSFER_ENDED,
            f"transfer {t.transfer_id} already ended; mint a new transfer id",
            transfer_id=t.transfer_id,
        )
    return RendezvousError(
        Reason.TRANSFER_ENDED,
        f"transfer {t.transfer_id} already ended ({t.state.name}"
        + (f": {t.abort_reason.name} {t.abort_message}".rstrip() if t.state == State.ABORTED else "")
        + "); mint a new transfer id",
        transfer_id=t.transfer_id,
        state=t.state.name,
        abort_reason=t.abort_reason.name,
    )


def _not_participant(t: Transfer, engine_id: str) -> RendezvousError:
    return RendezvousError(
        Reason.NOT_PARTICIPANT,
        f"engine {engine_id} takes no part in transfer {t.transfer_id}",
        transfer_id=t.transfer_id,
        engine_id=engine_id,
    )


def _abort(
    ctx: Context,
    t: Transfer,
    reason: AbortReason,
    message: str,
    notify: Iterable[str],
    producer_stopped: bool = False,
) -> Transition:
    """Abort t. Unless the producer has stopped, a generation it may be writing stays fenced.

    The message (a caller's, from AbortSpec or a failed CompletionSpec) is clipped: it travels to the peer.
    """
    revoking = 0 if producer_stopped else (t.revoking_generation or t.assigned_generation)
    aborted = evolve(
        _tombstone(ctx, t, State.ABORTED),
        abort_reason=reason,
        abort_message=clip(message, ctx.limits.max_abort_message_bytes),
        assigned_generation=0,
        revoking_generation=revoking,
        reported_ranks=t.reported_ranks if revoking else (),
    )
    return Transition(aborted, tuple(_event(ctx, e, EventType.TRANSFER_ABORTED, aborted) for e in notify))


def _block_mismatch(t: Transfer) -> str | None:
    """Consumers may need fewer blocks than the source (prefix-cache hits), never more."""
    if t.source_block_ids is not None and len(t.source_block_ids) < len(t.target_block_ids):
        return f"{len(t.target_block_ids)} target blocks but only {len(t.source_block_ids)} source blocks"
    return None


def _assign(ctx: Context, t: Transfer, consumer: Engine) -> Transition:
    """Hand the current generation to the producer (push), unless a revocation is pending."""
    if t.mode != Mode.PUSH or t.revoking_generation or t.assigned_generation:
        return Transition(t)
    assigned = evolve(t, assigned_generation=t.generation, reported_ranks=())
    return Transition(
        assigned,
        (_event(ctx, t.producer_engine_id, EventType.TRANSFER_ASSIGNED, assigned, t.generation, consumer),),
    )


def _source_ready(ctx: Context, t: Transfer, producer: Engine) -> Transition:
    """Tell the consumer (pull) where to read the current generation from."""
    if t.mode != Mode.PULL or t.source_block_ids is None:
        return Transition(t)
    return Transition(t, (_event(ctx, t.consumer_engine_id, EventType.SOURCE_READY, t, t.generation, producer),))


def _consumer_of(cur: Transfer | None, engines: Mapping[str, Engine]) -> Engine | None:
    """The transfer's consumer as the store read it, if it has one."""
    return engines.get(cur.consumer_engine_id) if cur and cur.consumer_engine_id else None


def _current(engine: Engine | None, incarnation: int, now: float) -> bool:
    """Whether engine is the live incarnation a transfer recorded for one of its sides."""
    return engine is not None and engine.incarnation == incarnation and engine.alive(now)


def _side_lost(ctx: Context, t: Transfer, producer_side: bool) -> Transition:
    """The incarnation recorded for one side of t has ended: what that means for t and the other side."""
    other = t.consumer_engine_id if producer_side else t.producer_engine_id
    if t.state.terminal:
        if producer_side and t.revoking_generation and other:
            # A lost producer writes no more: the consumer's revoked blocks are free.
            confirmed = evolve(t, revoking_generation=0, reported_ranks=())
            return Transition(
                confirmed, (_event(ctx, other, EventType.REVOCATION_CONFIRMED, confirmed, t.revoking_generation),)
            )
        return Transition(t)
    if t.state == State.COMMITTED:
        return Transition(t) if producer_side else _release(ctx, t)
    side = "producer" if producer_side else "consumer"
    engine_id = t.producer_engine_id if producer_side else t.consumer_engine_id
    incarnation = t.producer_incarnation if producer_side else t.consumer_incarnation
    message = f"{side} {engine_id} incarnation {incarnation} is gone"
    return _abort(ctx, t, AbortReason.PEER_LOST, message, (other,) if other else (), producer_stopped=producer_side)


def _fenced(ctx: Context, t: Transfer, consumer: Engine | None, producer: Engine | None) -> Transition | None:
    """Apply the loss of a side whose recorded incarnation is no longer the live one, if any.

    Matching and assignment only ever pair the incarnations a transfer recorded: an engine that
    re-registered (or whose lease lapsed) before the store applied its loss is treated as lost here,
    so no producer is handed blocks that its consumer's current incarnation never registered.
    """
    if t.state.terminal:
        return None
    if t.producer_engine_id and not _current(producer, t.producer_incarnation, ctx.now):
        return _side_lost(ctx, t, producer_side=True)
    if t.consumer_engine_id and not _current(consumer, t.consumer_incarnation, ctx.now):
        return _side_lost(ctx, t, producer_side=False)
    return None


def _replaced(ctx: Context, t: Transfer, caller: Engine) -> Transition | None:
    """A participant calls about a live transfer that an earlier incarnation of it joined: that
    incarnation is gone (the store may not have applied its loss yet), so apply the loss now."""
    if t.state.terminal:
        return None
    producer_side = caller.engine_id == t.producer_engine_id
    recorded = t.producer_incarnation if producer_side else t.consumer_incarnation
    return None if recorded == caller.incarnation else _side_lost(ctx, t, producer_side)


def _wrong_side(t: Transfer, engine: Engine, call: str, side: str) -> RendezvousError:
    return RendezvousError(
        Reason.WRONG_ROLE,
        f"engine {engine.engine_id} is the {'producer' if side == 'consumer' else 'consumer'} of transfer "
        f"{t.transfer_id}; only the {side} calls {call}",
        transfer_id=t.transfer_id,
        engine_id=engine.engine_id,
    )


def _check_generation(t: Transfer, generation: int) -> None:
    """A generation a call names must be the transfer's current one: older is stale, newer never existed."""
    if generation < t.generation:
        raise RendezvousError(
            Reason.STALE_GENERATION,
            f"generation {generation} is older than the current {t.generation}",
            transfer_id=t.transfer_id,
            current_generation=t.generation,
        )
    if generation > t.generation:
        raise RendezvousError(
            Reason.INVALID_STATE,
            f"generation {generation} of transfer {t.transfer_id} was never registered (current {t.generation})",
            transfer_id=t.transfer_id,
            current_generation=t.generation,
        )


def _deliver(ctx: Context, t: Transfer, consumer: Engine | None, producer: Engine | None) -> Transition:
    """Emit what the side moving the bytes needs for the current generation of a matched transfer."""
    gone = _fenced(ctx, t, consumer, producer)
    if gone:
        return gone
    assert consumer is not None and producer is not None
    mismatch = _block_mismatch(t)
    if mismatch:
        return _abort(ctx, t, AbortReason.BLOCK_MISMATCH, mismatch, t.participants())
    return _assign(ctx, t, consumer) if t.mode == Mode.PUSH else _source_ready(ctx, t, producer)


def _match(ctx: Context, t: Transfer, consumer: Engine | None, producer: Engine | None) -> Transition:
    """Both halves now exist: check compatibility, then deliver. The consumer's deadline applies."""
    gone = _fenced(ctx, t, consumer, producer)
    if gone:
        return gone
    assert consumer is not None and producer is not None
    versions = producer.layout.data_plane_version, consumer.layout.data_plane_version
    mismatch = None if versions[0] == versions[1] else data_plane_mismatch(*versions)  # a version reads itself
    if mismatch:
        return _abort(ctx, t, AbortReason.DATA_PLANE_MISMATCH, mismatch, t.participants(), True)
    mismatch = layout_mismatch(producer, consumer)
    if mismatch:
        return _abort(ctx, t, AbortReason.LAYOUT_MISMATCH, mismatch, t.participants(), True)
    return _deliver(ctx, evolve(t, state=State.MATCHED, times=_times(t, match_time=ctx.now)), consumer, producer)


def register_target(
    ctx: Context, cur: Transfer | None, consumer: Engine, engines: Mapping[str, Engine], spec: TargetSpec
) -> Transition:
    """A consumer registers destination blocks for a generation of a transfer."""
    producer = engines.get(cur.producer_engine_id) if cur and cur.producer_engine_id else None
    check_id("transfer_id", spec.transfer_id, ctx.limits)
    check_block_ids(spec.block_ids, ctx.limits, consumer.num_blocks())
    if spec.generation < 1:
        raise RendezvousError(Reason.GENERATION_INVALID, "generation starts at 1")
    if spec.mode is Mode.UNSPECIFIED:
        raise RendezvousError(Reason.MODE_INVALID, "mode must be PUSH or PULL", field="mode")
    check_progressive_target(spec)
    timeout = resolve_timeout(spec.timeout, ctx.timeouts.default_target_timeout, ctx.timeouts)
    _require_role(consumer, Role.CONSUMER)
    blocks = tuple(spec.block_ids)
    if cur is None:
        return Transition(
            _new_transfer(
                transfer_id=spec.transfer_id,
                state=State.TARGETED,
                deadline=ctx.now + timeout,
                mode=spec.mode,
                generation=spec.generation,
                consumer_engine_id=consumer.engine_id,
                consumer_incarnation=consumer.incarnation,
                target_block_ids=blocks,
                num_tokens=spec.num_tokens,
                times=_new_times(target_time=ctx.now),
                progressive=spec.progressive,
            )
        )
    same_target = (cur.consumer_engine_id, cur.generation) == (consumer.engine_id, spec.generation) and _same_blocks(
        cur, blocks, source=False
    )
    if cur.state.terminal:
        if same_target:
            return Transition(cur)
        raise _ended(cur, consumer.engine_id)
    if cur.consumer_engine_id and cur.consumer_engine_id != consumer.engine_id:
        raise RendezvousError(
            Reason.TARGET_CONFLICT,
            f"transfer {spec.transfer_id} is targeted by another engine",
            transfer_id=spec.transfer_id,
        )
    gone = _fenced(ctx, cur, consumer, producer)
    if gone:
        return gone
    retarget = evolve(
        cur,
        generation=spec.generation,
        target_block_ids=blocks,
        num_tokens=spec.num_tokens,
        progressive=spec.progressive,
        mode=spec.mode,
        deadline=ctx.now + timeout,
        times=_times(cur, target_time=ctx.now),
        # Push: the producer ranks' reports stay with the generation they revoke. Pull: the consumer's ranks read
        # the superseded generation; each reads the new one (into the new blocks) before it commits.
        reported_ranks=cur.reported_ranks if cur.mode == Mode.PUSH else (),
    )
    if not cur.consumer_engine_id:
        claimed = evolve(retarget, consumer_engine_id=consumer.engine_id, consumer_incarnation=consumer.incarnation)
        return _match(ctx, claimed, consumer, producer)
    if spec.generation == cur.generation:
        if same_target:
            return Transition(cur)
        raise RendezvousError(
            Reason.TARGET_CONFLICT,
            f"generation {spec.generation} of transfer {spec.transfer_id} has other blocks; use a new generation",
            transfer_id=spec.transfer_id,
        )
    if spec.generation < cur.generation:
        _check_generation(cur, spec.generation)
    if spec.mode != cur.mode:
        raise RendezvousError(Reason.INVALID_STATE, "a transfer keeps its mode across generations")
    if cur.state == State.COMMITTED:
        raise RendezvousError(
            Reason.INVALID_STATE,
            f"transfer {spec.transfer_id} already committed; release it and recompute",
            transfer_id=spec.transfer_id,
        )
    if cur.state == State.TARGETED:
        return Transition(retarget)
    if cur.assigned_generation:
        revoked = cur.assigned_generation
        fenced = evolve(retarget, assigned_generation=0, revoking_generation=revoked)
        return Transition(fenced, (_event(ctx, cur.producer_engine_id, EventType.TRANSFER_REVOKED, fenced, revoked),))
    return _deliver(ctx, retarget, consumer, producer)


def claim(
    ctx: Context, cur: Transfer | None, producer: Engine, engines: Mapping[str, Engine], spec: ClaimSpec
) -> Transition:
    """A producer claims a transfer: it will provide the KV."""
    consumer = _consumer_of(cur, engines)
    check_id("transfer_id", spec.transfer_id, ctx.limits)
    timeout = resolve_timeout(spec.timeout, ctx.timeouts.default_claim_timeout, ctx.timeouts)
    _require_role(producer, Role.PRODUCER)
    return _claim(ctx, cur, producer, consumer, spec.transfer_id, timeout, None)


def _claim(
    ctx: Context,
    cur: Transfer | None,
    producer: Engine,
    consumer: Engine | None,
    transfer_id: str,
    timeout: float,
    source: tuple[int, ...] | None,
) -> Transition:
    """The producer joins the transfer, with its source blocks when they are already computed.

    The source blocks are part of the record before any match, so a transfer that cannot be
    served (fewer source than target blocks) aborts without ever being assigned.
    """
    ready = ctx.now if source is not None else 0.0
    if cur is None:
        return Transition(
            _new_transfer(
                transfer_id=transfer_id,
                state=State.CLAIMED,
                deadline=ctx.now + timeout,
                producer_engine_id=producer.engine_id,
                producer_incarnation=producer.incarnation,
                source_block_ids=source,
                times=_new_times(claim_time=ctx.now, source_ready_time=ready),
            )
        )
    if cur.producer_engine_id == producer.engine_id:
        return _fenced(ctx, cur, consumer, producer) or Transition(cur)
    if cur.state.terminal:
        raise _ended(cur, producer.engine_id)
    if cur.producer_engine_id:
        raise RendezvousError(
            Reason.CLAIM_CONFLICT,
            f"transfer {transfer_id} is claimed by another engine",
            transfer_id=transfer_id,
        )
    claimed = evolve(
        cur,
        producer_engine_id=producer.engine_id,
        producer_incarnation=producer.incarnation,
        source_block_ids=source,
        times=_times(cur, claim_time=ctx.now, source_ready_time=ready),
    )
    return _match(ctx, claimed, consumer, producer)


def mark_source_ready(
    ctx: Context, cur: Transfer | None, producer: Engine, engines: Mapping[str, Engine], spec: SourceReadySpec
) -> Transition:
    """A producer's blocks are computed. Claims the transfer if the producer had not."""
    consumer = _consumer_of(cur, engines)
    check_id("transfer_id", spec.transfer_id, ctx.limits)
    check_block_ids(spec.block_ids, ctx.limits, producer.num_blocks())
    _require_role(producer, Role.PRODUCER)
    blocks = tuple(spec.block_ids)
    if cur is None or cur.producer_engine_id != producer.engine_id:
        # Claims the transfer as ClaimTransfers would, and is refused as it would be (TRANSFER_ENDED,
        # CLAIM_CONFLICT): never an answer that another call on the same id would contradict.
        timeout = ctx.timeouts.default_claim_timeout
        return _claim(ctx, cur, producer, consumer, spec.transfer_id, timeout, blocks)
    gone = _fenced(ctx, cur, consumer, producer)
    if gone:
        return gone
    if cur.source_block_ids is not None:
        if _same_blocks(cur, blocks, source=True):
            return Transition(cur)
        raise RendezvousError(Reason.INVALID_STATE, "the source was already marked ready with other blocks")
    if cur.state.terminal:
        return Transition(cur)
    ready = evolve(cur, source_block_ids=blocks, times=_times(cur, source_ready_time=ctx.now))
    if ready.state != State.MATCHED:
        return Transition(ready)
    mismatch = _block_mismatch(ready)
    if mismatch:
        return _abort(ctx, ready, AbortReason.BLOCK_MISMATCH, mismatch, ready.participants())
    return _source_ready(ctx, ready, producer)


def _confirm_revocation(ctx: Context, t: Transfer, consumer: Engine | None, producer: Engine) -> Transition:
    """The producer will not write the revoked generation: free it, then assign the current one, unless a
    side's recorded incarnation has gone meanwhile (then that loss applies instead of an assignment)."""
    revoked = t.revoking_generation
    confirmed = evolve(t, revoking_generation=0, reported_ranks=())
    events = (_event(ctx, t.consumer_engine_id, EventType.REVOCATION_CONFIRMED, confirmed, revoked),)
    if confirmed.state != State.MATCHED or consumer is None:
        return Transition(confirmed, events)
    after = _fenced(ctx, confirmed, consumer, producer) or _assign(ctx, confirmed, consumer)
    return Transition(after.transfer, events + after.events)


def _reporting_ranks(engine: Engine, ranks: tuple[int, ...]) -> frozenset[int]:
    """The ranks a report names (all of the engine's when it names none); an unknown rank is refused."""
    count = max(len(engine.agents), 1)
    unknown = [r for r in ranks if not 0 <= r < count]
    if unknown:
        raise RendezvousError(
            Reason.RANK_INVALID,
            f"rank {unknown[0]} is not one of engine {engine.engine_id}'s {count} ranks",
            engine_id=engine.engine_id,
            num_ranks=count,
        )
    return frozenset(ranks) if ranks else frozenset(range(count))


def _reported(t: Transfer, engine: Engine, ranks: frozenset[int]) -> tuple[tuple[int, ...], bool]:
    """The ranks that reported the generation in flight once `ranks` have, and whether all have."""
    reported = tuple(sorted(ranks.union(t.reported_ranks)))
    return reported, len(reported) == max(len(engine.agents), 1)


def _report(t: Transfer, engine: Engine, ranks: frozenset[int]) -> tuple[Transfer, bool]:
    """t with `ranks` added to the ranks that reported the generation in flight, and whether all have."""
    reported, everyone = _reported(t, engine, ranks)
    return evolve(t, reported_ranks=reported), everyone


def _revocation_reported(
    ctx: Context, t: Transfer, consumer: Engine | None, producer: Engine, ranks: frozenset[int]
) -> Transition:
    """Producer ranks will not write the revoked generation; once all have said so, the consumer is told."""
    reported, everyone = _report(t, producer, ranks)
    return _confirm_revocation(ctx, t, consumer, producer) if everyone else Transition(reported)


def complete(
    ctx: Context, cur: Transfer | None, engine: Engine, engines: Mapping[str, Engine], spec: CompletionSpec
) -> Transition:
    """The side moving the bytes (producer in push, consumer in pull) reports a generation's outcome."""
    consumer = _consumer_of(cur, engines)
    check_id("transfer_id", spec.transfer_id, ctx.limits)
    if spec.outcome is Outcome.UNSPECIFIED:
        raise RendezvousError(Reason.OUTCOME_UNSPECIFIED, "outcome must be SUCCEEDED or FAILED")
    if spec.generation < 1:
        raise RendezvousError(Reason.GENERATION_INVALID, "generation starts at 1")
    ranks = _reporting_ranks(engine, spec.ranks)
    check_part_count(spec.parts, ctx.limits)
    if cur is None:
        raise transfer_not_found(spec.transfer_id)
    if engine.engine_id not in cur.participants():
        raise _not_participant(cur, engine.engine_id)
    mover = cur.producer_engine_id if cur.mode == Mode.PUSH else cur.consumer_engine_id
    if engine.engine_id != mover:
        side = "producer" if cur.mode == Mode.PUSH else "consumer"
        raise _wrong_side(cur, engine, f"CompleteTransfers in {cur.mode.name} mode", side)
    replaced = _replaced(ctx, cur, engine)
    if replaced:
        return replaced
    if cur.revoking_generation and spec.generation == cur.revoking_generation:
        return _revocation_reported(ctx, cur, consumer, engine, ranks)
    if cur.state.terminal or (cur.state == State.COMMITTED and spec.generation == cur.generation):
        return Transition(cur)
    _check_generation(cur, spec.generation)
    if cur.state != State.MATCHED or (cur.mode == Mode.PUSH and cur.assigned_generation != spec.generation):
        raise RendezvousError(
            Reason.INVALID_STATE,
            f"transfer {cur.transfer_id} generation {spec.generation} was not assigned (state {cur.state.name})",
            transfer_id=cur.transfer_id,
        )
    if spec.outcome == Outcome.SUCCEEDED and cur.mode == Mode.PULL and cur.source_block_ids is None:
        # Nothing could have been read yet: a FAILED (the consumer gives up) is still taken.
        raise RendezvousError(
            Reason.INVALID_STATE,
            f"transfer {cur.transfer_id}'s source is not ready: report a success only after SOURCE_READY",
            transfer_id=cur.transfer_id,
        )
    if spec.parts and spec.outcome == Outcome.SUCCEEDED:
        _check_written_parts(cur, engine, ranks, spec)
    other = cur.counterpart(engine.engine_id)
    reported_ranks, everyone = _reported(cur, engine, ranks)
    if spec.outcome == Outcome.FAILED:
        # The mover's other ranks may still be writing: they are told, and fence the generation until they report.
        notify = (other,) if everyone else (other, engine.engine_id)
        stopped = everyone or cur.mode == Mode.PULL
        reported = evolve(cur, reported_ranks=reported_ranks)
        return _abort(ctx, reported, AbortReason.TRANSFER_FAILED, spec.message, notify, producer_stopped=stopped)
    if not everyone:
        return Transition(evolve(cur, reported_ranks=reported_ranks))
    committed = evolve(
        cur,
        state=State.COMMITTED,
        assigned_generation=0,
        reported_ranks=(),
        deadline=ctx.now + ctx.timeouts.release_timeout,
        times=_times(cur, commit_time=ctx.now),
    )
    # Pull: the consumer's ranks whose shares came in earlier calls learn of the commit only so (and rank 0
    # releases on it); when this call reported every rank, its answer says so, as in push.
    told = (other,) if cur.mode == Mode.PUSH or ranks.issuperset(reported_ranks) else (other, engine.engine_id)
    return Transition(
        committed, tuple(_event(ctx, e, EventType.TRANSFER_COMMITTED, committed, cur.generation) for e in told)
    )


def _check_written_parts(t: Transfer, engine: Engine, ranks: frozenset[int], spec: CompletionSpec) -> None:
    """The parts a success reports tile the ranks' share of t's target, and t accepted parts at all."""
    if not t.progressive:
        raise RendezvousError(
            Reason.PROGRESSIVE_NOT_ACCEPTED,
            f"transfer {t.transfer_id} generation {t.generation} was not registered progressive; report no parts",
            transfer_id=t.transfer_id,
        )
    check_parts(spec.parts, t.num_tokens, held_layers(engine, ranks))


def acknowledge_revocation(
    ctx: Context, cur: Transfer | None, producer: Engine, engines: Mapping[str, Engine], spec: RevocationAck
) -> Transition:
    """The producer will not write the revoked generation (never started, or drained)."""
    consumer = _consumer_of(cur, engines)
    check_id("transfer_id", spec.transfer_id, ctx.limits)
    if spec.generation < 1:
        raise RendezvousError(Reason.GENERATION_INVALID, "generation starts at 1")
    if cur is None:
        raise transfer_not_found(spec.transfer_id)
    if producer.engine_id not in cur.participants():
        raise _not_participant(cur, producer.engine_id)
    if producer.engine_id != cur.producer_engine_id:
        raise _wrong_side(cur, producer, "AcknowledgeRevocations", "producer")
    ranks = _reporting_ranks(producer, spec.ranks)
    replaced = _replaced(ctx, cur, producer)
    if replaced:
        return replaced
    if cur.revoking_generation and spec.generation == cur.revoking_generation:
        return _revocation_reported(ctx, cur, consumer, producer, ranks)
    if spec.generation < cur.generation or cur.state.terminal:
        return Transition(cur)
    raise RendezvousError(
        Reason.INVALID_STATE,
        f"generation {spec.generation} of transfer {cur.transfer_id} is not revoked",
        transfer_id=cur.transfer_id,
    )


def release(
    ctx: Context, cur: Transfer | None, consumer: Engine, _engines: Mapping[str, Engine], spec: ReleaseSpec
) -> Transition:
    """The consumer is done with a committed transfer (or acknowledges an abort)."""
    check_id("transfer_id", spec.transfer_id, ctx.limits)
    if spec.generation < 1:
        raise RendezvousError(Reason.GENERATION_INVALID, "generation starts at 1")
    if cur is None:
        raise transfer_not_found(spec.transfer_id)
    if consumer.engine_id not in cur.participants():
        raise _not_participant(cur, consumer.engine_id)
    if consumer.engine_id != cur.consumer_engine_id:
        raise _wrong_side(cur, consumer, "ReleaseTargets", "consumer")
    replaced = _replaced(ctx, cur, consumer)
    if replaced:
        return replaced
    if cur.state.terminal:
        return Transition(cur)
    if cur.state == State.MATCHED:
        # Usually a consumer that released on the NIXL notification, before the producer's CompleteTransfers: the
        # bytes may well be in, so this must not send it to AbortTransfers.
        raise RendezvousError(
            Reason.INVALID_STATE,
            f"transfer {cur.transfer_id} is MATCHED, not committed yet: release it after its TRANSFER_COMMITTED "
            "event (the data-plane notification comes before the commit); nothing changed",
            transfer_id=cur.transfer_id,
            state=cur.state.name,
        )
    if cur.state != State.COMMITTED:
        raise RendezvousError(
            Reason.INVALID_STATE,
            f"transfer {cur.transfer_id} is {cur.state.name}: nothing was assigned, so there is nothing to release; "
            "abort it to give it up",
            transfer_id=cur.transfer_id,
            state=cur.state.name,
        )
    _check_generation(cur, spec.generation)
    return _release(ctx, cur)


def abort(
    ctx: Context, cur: Transfer | None, caller: Engine | None, _engines: Mapping[str, Engine], spec: AbortSpec
) -> Transition:
    """An engine (or, with caller None, a router or operator) aborts a transfer.

    Aborting an unknown id leaves a tombstone, so halves that arrive later learn of the abort.
    """
    check_id("transfer_id", spec.transfer_id, ctx.limits)
    if cur is None:
        unknown = Transfer(
            transfer_id=spec.transfer_id,
            state=State.ABORTED,
            deadline=0.0,
            abort_reason=AbortReason.REQUESTED,
            abort_message=clip(spec.message, ctx.limits.max_abort_message_bytes),
        )
        return Transition(_tombstone(ctx, unknown, State.ABORTED))
    caller_id = caller.engine_id if caller else ""
    if caller is not None and caller_id not in cur.participants():
        raise _not_participant(cur, caller_id)
    if cur.state.terminal:
        return Transition(cur)
    notify = [e for e in cur.participants() if e != caller_id]
    return _abort(
        ctx, cur, AbortReason.REQUESTED, spec.message, notify, producer_stopped=caller_id == cur.producer_engine_id
    )


def expire(ctx: Context, cur: Transfer | None) -> Transition:
    """A deadline passed: waiting halves abort, forgotten commits release, tombstones go."""
    if cur is None or cur.deadline > ctx.now:
        return Transition(cur)
    if cur.state == State.COMMITTED:
        return _release(ctx, cur)
    if not cur.state.terminal:
        return _abort(ctx, cur, AbortReason.DEADLINE_EXCEEDED, "deadline exceeded", cur.participants())
    if cur.revoking_generation and cur.consumer_engine_id:
        # A live producer that never acknowledged: the tombstone's lifetime bounds the consumer's wait.
        confirm = _event(ctx, cur.consumer_engine_id, EventType.REVOCATION_CONFIRMED, cur, cur.revoking_generation)
        return Transition(None, (confirm,))
    return Transition(None)


def engine_lost(ctx: Context, cur: Transfer | None, lost: Engine) -> Transition:
    """A participant's incarnation ended: abort what it was part of and tell the other side."""
    if cur is None or lost.engine_id not in cur.participants():
        return Transition(cur)
    is_producer = lost.engine_id == cur.producer_engine_id
    if (cur.producer_incarnation if is_producer else cur.consumer_incarnation) > lost.incarnation:
        # A later incarnation's transfer. Earlier ones are gone too: incarnations only grow, and a loss
        # that was never applied (a replica died between re-registration and loss) is applied now.
        return Transition(cur)
    return _side_lost(ctx, cur, is_producer)
