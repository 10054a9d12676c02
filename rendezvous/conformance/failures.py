"""Checks of what goes wrong: aborts, deadlines, block mismatches, lost leases and revocations."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from rendezvous.conformance.driver import (
    LAYOUT,
    Engine,
    Scenario,
    abort_reason_name,
    describe_event,
    describe_status,
    expect,
    expect_item_error,
    expect_ok,
    expect_state,
    is_event,
    state_name,
)
from rendezvous.conformance.lifecycle import TARGET_BLOCKS, check_peer, finish_push
from rendezvous.conformance.registry import check
from rendezvous.v1 import rendezvous_pb2 as pb

TARGETED, MATCHED, ABORTED = pb.TRANSFER_STATE_TARGETED, pb.TRANSFER_STATE_MATCHED, pb.TRANSFER_STATE_ABORTED
ASSIGNED, REVOKED = pb.EVENT_TYPE_TRANSFER_ASSIGNED, pb.EVENT_TYPE_TRANSFER_REVOKED
TRANSFER_ABORTED, PEER_LOST = pb.EVENT_TYPE_TRANSFER_ABORTED, pb.EVENT_TYPE_PEER_LOST
REVOCATION_CONFIRMED = pb.EVENT_TYPE_REVOCATION_CONFIRMED


async def assigned_transfer(s: Scenario, consumer: Engine, producer: Engine) -> str:
    """A push transfer, targeted then claimed, whose producer holds TRANSFER_ASSIGNED(1)."""
    t = s.transfer_id()
    expect_state(await consumer.register_target(t, TARGET_BLOCKS), TARGETED, "RegisterTargets")
    expect_state(await producer.claim(t), MATCHED, "ClaimTransfers")
    await producer.events.expect(ASSIGNED, t, 1)
    return t


def expect_abort(event: pb.Event, reason: int, revoking_generation: int | None = None) -> None:
    """A TRANSFER_ABORTED event with this abort reason (and revoking generation)."""
    got = event.transfer.abort_reason
    expect(
        got == reason,
        f"{describe_event(event)}: abort_reason {abort_reason_name(got)}, expected {abort_reason_name(reason)}",
    )
    if revoking_generation is not None:
        expect(
            event.transfer.revoking_generation == revoking_generation,
            f"{describe_event(event)}: revoking_generation {event.transfer.revoking_generation}, "
            f"expected {revoking_generation}",
        )


# Aborts


@check("aborts")
async def consumer_abort(s: Scenario) -> None:
    """The consumer aborts an assigned transfer: the producer gets ABORTED(REQUESTED) and lets go of gen 1."""
    consumer, producer = await s.pair()
    t = await assigned_transfer(s, consumer, producer)
    expect_state(await consumer.abort(t), ABORTED, "AbortTransfers by the consumer")
    expect_abort(await producer.events.expect(TRANSFER_ABORTED, t), pb.ABORT_REASON_REQUESTED)
    transfer = await s.get_transfer(t)
    expect(
        transfer.revoking_generation == 1,
        f"the producer may still be writing generation 1, yet revoking_generation is {transfer.revoking_generation}",
    )
    expect_ok(await producer.acknowledge(t, 1), "AcknowledgeRevocations(1) of the aborted transfer")
    await consumer.events.expect(REVOCATION_CONFIRMED, t, 1)


@check("aborts")
async def producer_abort(s: Scenario) -> None:
    """The producer aborts: the consumer gets ABORTED(REQUESTED) with revoking_generation 0 (no wait)."""
    consumer, producer = await s.pair()
    t = await assigned_transfer(s, consumer, producer)
    expect_state(await producer.abort(t), ABORTED, "AbortTransfers by the producer")
    expect_abort(await consumer.events.expect(TRANSFER_ABORTED, t), pb.ABORT_REASON_REQUESTED, 0)


@check("aborts")
async def router_abort(s: Scenario) -> None:
    """A router abort (empty engine id) reaches both sides; the consumer waits for the producer to let go."""
    consumer, producer = await s.pair()
    t = await assigned_transfer(s, consumer, producer)
    expect_state(await s.router_abort(t), ABORTED, "AbortTransfers by the router")
    expect_abort(await consumer.events.expect(TRANSFER_ABORTED, t), pb.ABORT_REASON_REQUESTED, 1)
    expect_abort(await producer.events.expect(TRANSFER_ABORTED, t), pb.ABORT_REASON_REQUESTED)
    expect_ok(await producer.acknowledge(t, 1), "AcknowledgeRevocations(1) of the aborted transfer")
    await consumer.events.expect(REVOCATION_CONFIRMED, t, 1)


@check("aborts")
async def abort_unknown_leaves_tombstone(s: Scenario) -> None:
    """Aborting an unknown id leaves a tombstone: a later target or claim answers TRANSFER_ENDED."""
    consumer = await s.consumer(watch=False)
    producer = await s.producer(watch=False)
    t = s.transfer_id()
    expect_state(await s.router_abort(t), ABORTED, "AbortTransfers of an unknown transfer id")
    ended = grpc.StatusCode.FAILED_PRECONDITION
    expect_item_error(await consumer.register_target(t), ended, "TRANSFER_ENDED", "RegisterTargets after the abort")
    expect_item_error(await producer.claim(t), ended, "TRANSFER_ENDED", "ClaimTransfers after the abort")


@check("aborts")
async def target_deadline(s: Scenario) -> None:
    """A target with a 1 s timeout and no claim aborts with DEADLINE_EXCEEDED."""
    consumer = await s.consumer()
    t = s.transfer_id()
    expect_state(await consumer.register_target(t, timeout=1.0), TARGETED, "RegisterTargets(timeout 1 s)")
    aborted = await consumer.events.expect(TRANSFER_ABORTED, t, timeout=1.0 + s.options.margin)
    expect_abort(aborted, pb.ABORT_REASON_DEADLINE_EXCEEDED)


@check("aborts")
async def source_blocks_fewer_than_target(s: Scenario) -> None:
    """MarkSourcesReady with fewer blocks than the target and no claim: BLOCK_MISMATCH, never assigned."""
    consumer, producer = await s.pair()
    t = s.transfer_id()
    expect_state(await consumer.register_target(t, (0, 1, 2, 3)), TARGETED, "RegisterTargets(4 blocks)")
    result = await producer.mark_source_ready(t, (10, 11))
    expect(
        result.state == ABORTED,
        f"MarkSourcesReady(2 blocks) answered {state_name(result.state)}"
        + (f" ({describe_status(result.status)})" if result.status.code else "")
        + ", expected ABORTED",
    )
    transfer = await s.get_transfer(t)
    expect(
        transfer.abort_reason == pb.ABORT_REASON_BLOCK_MISMATCH,
        f"abort_reason is {abort_reason_name(transfer.abort_reason)}, expected BLOCK_MISMATCH",
    )
    assigned = [e for e in await s.barrier(producer) if is_event(ASSIGNED, t)(e)]
    expect(
        not assigned, f"the producer got {describe_event(assigned[0])} for a mismatched transfer" if assigned else ""
    )
    expect(
        transfer.revoking_generation == 0,
        f"revoking_generation is {transfer.revoking_generation}: the consumer would wait for a producer "
        "that was never assigned",
    )
    expect_abort(await consumer.events.expect(TRANSFER_ABORTED, t), pb.ABORT_REASON_BLOCK_MISMATCH)


@check("aborts")
async def layout_mismatch(s: Scenario) -> None:
    """A producer whose block size neither divides nor is divided by the consumer's: the match aborts with
    LAYOUT_MISMATCH naming the field, unassigned."""
    consumer = await s.consumer()
    layout = pb.KvLayout()
    layout.CopyFrom(LAYOUT)
    layout.block_size = LAYOUT.block_size * 3 // 2
    producer = await s.producer(layout=layout)
    t = s.transfer_id()
    expect_state(await consumer.register_target(t, TARGET_BLOCKS), TARGETED, "RegisterTargets")
    expect_state(await producer.claim(t), ABORTED, "ClaimTransfers by a producer of another block size")
    aborted = await consumer.events.expect(TRANSFER_ABORTED, t)
    expect_abort(aborted, pb.ABORT_REASON_LAYOUT_MISMATCH, 0)
    expect(
        "block_size" in aborted.transfer.abort_message,
        f"the abort message {aborted.transfer.abort_message!r} does not name block_size",
    )
    assigned = [e for e in await s.barrier(producer) if is_event(ASSIGNED, t)(e)]
    expect(not assigned, "the producer was assigned a transfer whose layouts differ")


# Lease loss


async def expect_peer_lost(s: Scenario, survivor: Engine, lost: Engine, transfer_id: str) -> pb.Event:
    """Within the lost engine's lease + margin the survivor gets ABORTED(PEER_LOST) and PEER_LOST(lost)."""
    bound = s.lease_bound(lost)
    aborted = await survivor.events.expect(TRANSFER_ABORTED, transfer_id, timeout=bound)
    expect_abort(aborted, pb.ABORT_REASON_PEER_LOST)
    note = await survivor.events.wait_for(
        lambda e: e.type == PEER_LOST and e.peer.engine_id == lost.engine_id,
        f"PEER_LOST for {lost.engine_id}",
        timeout=bound,
    )
    expect(
        note.peer.incarnation == lost.incarnation,
        f"{describe_event(note)} names incarnation {note.peer.incarnation}, the lost one is {lost.incarnation}",
    )
    return aborted


@check("lease_loss")
async def producer_lost_before_assignment(s: Scenario) -> None:
    """A matched pull transfer whose producer stops its keep-alives: PEER_LOST, revoking_generation 0."""
    consumer = await s.consumer()
    producer = await s.producer(lease_ttl=s.options.lease_ttl)
    t = s.transfer_id()
    expect_state(await consumer.register_target(t, TARGET_BLOCKS, mode=pb.TRANSFER_MODE_PULL), TARGETED, "target")
    expect_state(await producer.claim(t), MATCHED, "ClaimTransfers")
    await producer.stop_keepalive()
    aborted = await expect_peer_lost(s, consumer, producer, t)
    expect_abort(aborted, pb.ABORT_REASON_PEER_LOST, 0)


@check("lease_loss")
async def producer_lost_after_assignment(s: Scenario) -> None:
    """The assigned producer stops its keep-alives: PEER_LOST, revoking_generation 0 (it writes no more)."""
    consumer = await s.consumer()
    producer = await s.producer(lease_ttl=s.options.lease_ttl)
    t = await assigned_transfer(s, consumer, producer)
    await producer.stop_keepalive()
    aborted = await expect_peer_lost(s, consumer, producer, t)
    expect_abort(aborted, pb.ABORT_REASON_PEER_LOST, 0)


@check("lease_loss")
async def consumer_lost(s: Scenario) -> None:
    """The consumer stops its keep-alives: the producer gets ABORTED(PEER_LOST) and PEER_LOST."""
    consumer = await s.consumer(lease_ttl=s.options.lease_ttl)
    producer = await s.producer()
    t = await assigned_transfer(s, consumer, producer)
    await consumer.stop_keepalive()
    await expect_peer_lost(s, producer, consumer, t)


@check("lease_loss")
async def lease_remaining(s: Scenario) -> None:
    """GetEngine in ENGINE_VIEW_BASIC says what is left of the lease (within its TTL; what a rank that follows
    another's registration fences its writes by) and carries no agent metadata."""
    producer = await s.producer(lease_ttl=s.options.lease_ttl)
    request = pb.GetEngineRequest(engine_id=producer.engine_id, view=pb.ENGINE_VIEW_BASIC)
    engine = (await s.driver.call(s.driver.next_stub(), "GetEngine", request)).engine
    expect(
        engine.HasField("lease_remaining"),
        "GetEngine does not report lease_remaining: a rank that follows another's registration writes unfenced",
    )
    left = engine.lease_remaining.ToNanoseconds() / 1e9
    expect(0 < left <= producer.lease_ttl, f"lease_remaining is {left:.3f} s, not within (0, {producer.lease_ttl:g}]")
    expect(not any(a.metadata for a in engine.agents), "GetEngine in ENGINE_VIEW_BASIC returned agent metadata")


# Revocation


@check("revocation")
async def retarget_revokes_then_reassigns(s: Scenario) -> None:
    """Generation 2 revokes 1; only after AcknowledgeRevocations(1): REVOCATION_CONFIRMED(1), ASSIGNED(2)."""
    consumer, producer = await s.pair()
    t = await assigned_transfer(s, consumer, producer)
    expect_state(await consumer.register_target(t, (4, 5, 6, 7), generation=2), MATCHED, "RegisterTargets(gen 2)")
    await producer.events.expect(REVOKED, t, 1)
    early = [e for e in await s.barrier(producer) if is_event(ASSIGNED, t, 2)(e)]
    expect(not early, "generation 2 was assigned before the producer acknowledged the revocation of 1")
    expect_ok(await producer.acknowledge(t, 1), "AcknowledgeRevocations(1)")
    await consumer.events.expect(REVOCATION_CONFIRMED, t, 1)
    assigned = await producer.events.expect(ASSIGNED, t, 2)
    check_peer(assigned, consumer)
    expect(
        list(assigned.transfer.target_block_ids) == [4, 5, 6, 7],
        f"{describe_event(assigned)} target blocks are {list(assigned.transfer.target_block_ids)}, expected [4..7]",
    )
    await finish_push(s, consumer, producer, t, 2)


@check("revocation")
async def pending_revocation_then_producer_deregisters(s: Scenario) -> None:
    """Generation 2 revokes 1, then the producer deregisters: ABORTED(PEER_LOST), revoking_generation 0."""
    consumer, producer = await s.pair()
    t = await assigned_transfer(s, consumer, producer)
    expect_state(await consumer.register_target(t, (4, 5, 6, 7), generation=2), MATCHED, "RegisterTargets(gen 2)")
    await producer.events.expect(REVOKED, t, 1)
    await producer.deregister()
    aborted = await consumer.events.expect(TRANSFER_ABORTED, t)
    expect_abort(aborted, pb.ABORT_REASON_PEER_LOST, 0)


async def aborted_assignment_then(s: Scenario, let_go: Callable[[Engine], Awaitable[object]]) -> None:
    """Consumer aborts an assigned transfer (revoking_generation 1); then the producer goes away by let_go:
    the consumer must get REVOCATION_CONFIRMED(1) within the producer's lease + margin."""
    consumer = await s.consumer()
    producer = await s.producer(lease_ttl=s.options.lease_ttl)
    t = await assigned_transfer(s, consumer, producer)
    expect_state(await consumer.abort(t), ABORTED, "AbortTransfers by the consumer")
    transfer = await s.get_transfer(t)
    expect(
        transfer.revoking_generation == 1,
        f"after aborting an assigned transfer revoking_generation is {transfer.revoking_generation}, expected 1",
    )
    await producer.events.expect(TRANSFER_ABORTED, t)
    await let_go(producer)
    await consumer.events.expect(REVOCATION_CONFIRMED, t, 1, timeout=s.lease_bound(producer))


@check("revocation")
async def aborted_assignment_confirmed_on_lease_lapse(s: Scenario) -> None:
    """After the consumer aborted an assigned transfer, the producer's lapsed lease confirms the revocation."""
    await aborted_assignment_then(s, lambda producer: producer.stop_keepalive())


@check("revocation")
async def aborted_assignment_confirmed_on_deregister(s: Scenario) -> None:
    """After the consumer aborted an assigned transfer, the producer's deregistration confirms the revocation."""
    await aborted_assignment_then(s, lambda producer: producer.deregister())


@check("revocation")
async def aborted_assignment_confirmed_on_reregister(s: Scenario) -> None:
    """After the consumer aborted an assigned transfer, the producer's new incarnation confirms the revocation."""

    async def reregister(producer: Engine) -> None:
        old = producer.incarnation
        await producer.register(s.options.lease_ttl)
        expect(producer.incarnation != old, f"re-registering kept incarnation {old}")

    await aborted_assignment_then(s, reregister)
