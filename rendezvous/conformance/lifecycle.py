"""Checks of the happy paths: push and pull in either arrival order, idempotency, generations, watches."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from rendezvous.conformance.driver import (
    Engine,
    Scenario,
    Watcher,
    describe_event,
    expect,
    expect_rpc_error,
    expect_state,
    is_event,
    state_name,
)
from rendezvous.conformance.registry import check
from rendezvous.v1 import rendezvous_pb2 as pb

TARGETED, CLAIMED, MATCHED = pb.TRANSFER_STATE_TARGETED, pb.TRANSFER_STATE_CLAIMED, pb.TRANSFER_STATE_MATCHED
COMMITTED, RELEASED = pb.TRANSFER_STATE_COMMITTED, pb.TRANSFER_STATE_RELEASED
ASSIGNED, SOURCE_READY = pb.EVENT_TYPE_TRANSFER_ASSIGNED, pb.EVENT_TYPE_SOURCE_READY
TRANSFER_COMMITTED, TRANSFER_ABORTED = pb.EVENT_TYPE_TRANSFER_COMMITTED, pb.EVENT_TYPE_TRANSFER_ABORTED
PULL = pb.TRANSFER_MODE_PULL
TARGET_BLOCKS = (3, 5, 7, 9)
SOURCE_BLOCKS = (10, 11, 12, 13)


def check_peer(event: pb.Event, peer: Engine) -> None:
    """The event names peer with its incarnation and its NIXL agent, metadata included."""
    what = describe_event(event)
    expect(event.HasField("peer"), f"{what} carries no peer")
    got = event.peer
    expect(got.engine_id == peer.engine_id, f"{what}: peer is {got.engine_id!r}, expected {peer.engine_id}")
    expect(
        got.incarnation == peer.incarnation,
        f"{what}: peer incarnation {got.incarnation}, expected {peer.incarnation}",
    )
    expect(len(got.agents) == 1, f"{what}: peer has {len(got.agents)} NIXL agents, expected 1")
    agent = got.agents[0]
    expect(
        agent.name == f"{peer.engine_id}-agent0"
        and agent.metadata == b"conformance-metadata-" + peer.engine_id.encode(),
        f"{what}: peer agent {agent.name!r} does not carry the registered name and metadata",
    )
    expect(len(agent.regions) == 1, f"{what}: peer agent has {len(agent.regions)} regions, expected 1")


def check_blocks(what: str, got: Sequence[int], expected: Sequence[int]) -> None:
    """Block id lists are equal, in order."""
    expect(list(got) == list(expected), f"{what} are {list(got)}, expected {list(expected)}")


async def finish_push(s: Scenario, consumer: Engine, producer: Engine, transfer_id: str, generation: int) -> None:
    """The producer completes, the consumer hears TRANSFER_COMMITTED and releases; the transfer is RELEASED."""
    expect_state(await producer.complete(transfer_id, generation), COMMITTED, "CompleteTransfers(SUCCEEDED)")
    committed = await consumer.events.expect(TRANSFER_COMMITTED, transfer_id)
    expect(committed.generation == generation, f"{describe_event(committed)}: expected generation {generation}")
    expect_state(await consumer.release(transfer_id, generation), RELEASED, "ReleaseTargets")
    transfer = await s.get_transfer(transfer_id)
    expect(transfer.state == RELEASED, f"GetTransfer after release: state {state_name(transfer.state)}")


async def push_to_release(s: Scenario, claim_first: bool) -> None:
    """A push transfer from its two halves (in the given order) to RELEASED."""
    consumer, producer = await s.pair()
    t = s.transfer_id()
    if claim_first:
        expect_state(await producer.claim(t), CLAIMED, "ClaimTransfers before any target")
        expect_state(await consumer.register_target(t, TARGET_BLOCKS), MATCHED, "RegisterTargets after the claim")
    else:
        expect_state(await consumer.register_target(t, TARGET_BLOCKS), TARGETED, "RegisterTargets before any claim")
        expect_state(await producer.claim(t), MATCHED, "ClaimTransfers after the target")
    assigned = await producer.events.expect(ASSIGNED, t)
    expect(assigned.generation == 1, f"{describe_event(assigned)}: expected generation 1")
    check_peer(assigned, consumer)
    check_blocks(f"{describe_event(assigned)} target blocks", assigned.transfer.target_block_ids, TARGET_BLOCKS)
    await finish_push(s, consumer, producer, t, 1)


async def pull_to_release(s: Scenario, source_first: bool) -> None:
    """A pull transfer from its two halves (in the given order) to RELEASED; the producer is never assigned."""
    consumer, producer = await s.pair()
    t = s.transfer_id()
    if source_first:
        expect_state(await producer.mark_source_ready(t, SOURCE_BLOCKS), CLAIMED, "MarkSourcesReady before any target")
        expect_state(
            await consumer.register_target(t, TARGET_BLOCKS, mode=PULL), MATCHED, "RegisterTargets(PULL) after it"
        )
    else:
        expect_state(await consumer.register_target(t, TARGET_BLOCKS, mode=PULL), TARGETED, "RegisterTargets(PULL)")
        expect_state(await producer.mark_source_ready(t, SOURCE_BLOCKS), MATCHED, "MarkSourcesReady after the target")
    ready = await consumer.events.expect(SOURCE_READY, t)
    expect(ready.generation == 1, f"{describe_event(ready)}: expected generation 1")
    check_peer(ready, producer)
    check_blocks(f"{describe_event(ready)} source blocks", ready.transfer.source_block_ids, SOURCE_BLOCKS)
    expect_state(await consumer.complete(t, 1), COMMITTED, "CompleteTransfers(SUCCEEDED) by the pull consumer")
    committed = await producer.events.expect(TRANSFER_COMMITTED, t)
    stray = [e for e in producer.events.before(committed) if is_event(ASSIGNED, t)(e)]
    expect(not stray, f"the producer of a pull transfer got {describe_event(stray[0])}" if stray else "")
    expect_state(await consumer.release(t, 1), RELEASED, "ReleaseTargets")


@check("lifecycle")
async def push_target_first(s: Scenario) -> None:
    """Push, target then claim: ASSIGNED(1) with the consumer's agents and blocks, COMMITTED, RELEASED."""
    await push_to_release(s, claim_first=False)


@check("lifecycle")
async def pull(s: Scenario) -> None:
    """Pull: target + MarkSourcesReady -> SOURCE_READY with the source blocks; consumer completes; COMMITTED."""
    await pull_to_release(s, source_first=False)


@check("lifecycle")
async def resend_is_noop(s: Scenario) -> None:
    """Re-sending the same target and the same claim changes nothing and emits no second assignment."""
    consumer, producer = await s.pair()
    t = s.transfer_id()
    expect_state(await consumer.register_target(t, TARGET_BLOCKS), TARGETED, "RegisterTargets")
    expect_state(await producer.claim(t), MATCHED, "ClaimTransfers")
    await producer.events.expect(ASSIGNED, t, 1)
    expect_state(await consumer.register_target(t, TARGET_BLOCKS), MATCHED, "the same RegisterTargets again")
    expect_state(await producer.claim(t), MATCHED, "the same ClaimTransfers again")
    transfer = await s.get_transfer(t)
    expect(transfer.generation == 1, f"after the re-sends the generation is {transfer.generation}, expected 1")
    assignments = [e for e in await s.barrier(producer) if is_event(ASSIGNED, t)(e)]
    expect(
        len(assignments) == 1,
        f"the producer got {len(assignments)} TRANSFER_ASSIGNED: {[describe_event(e) for e in assignments]}",
    )
    to_consumer = [e for e in await s.barrier(consumer) if e.transfer.transfer_id == t]
    expect(not to_consumer, f"the consumer got {[describe_event(e) for e in to_consumer]}")
    await finish_push(s, consumer, producer, t, 1)


@check("lifecycle")
async def request_id_retry(s: Scenario) -> None:
    """AIP-155: a retry with the same request_id (on the next target, if given) returns the first answer."""
    consumer, producer = await s.pair()
    t = s.transfer_id()
    target_request = s.driver.new_id("req")
    first = expect_state(
        await consumer.register_target(t, TARGET_BLOCKS, request_id=target_request), TARGETED, "RegisterTargets"
    )
    expect_state(await producer.claim(t), MATCHED, "ClaimTransfers")
    retry = await consumer.register_target(t, TARGET_BLOCKS, via=consumer.other_stub, request_id=target_request)
    expect(
        retry == first,
        f"RegisterTargets retried with its request_id answered {state_name(retry.state)}, "
        f"not the first answer ({state_name(first.state)})",
    )
    t2 = s.transfer_id()
    claim_request = s.driver.new_id("req")
    first = expect_state(await producer.claim(t2, request_id=claim_request), CLAIMED, "ClaimTransfers")
    expect_state(await consumer.register_target(t2, TARGET_BLOCKS), MATCHED, "RegisterTargets")
    retry = await producer.claim(t2, via=producer.other_stub, request_id=claim_request)
    expect(
        retry == first,
        f"ClaimTransfers retried with its request_id answered {state_name(retry.state)}, "
        f"not the first answer ({state_name(first.state)})",
    )
    assignments = [e for e in await s.barrier(producer) if is_event(ASSIGNED, t2)(e)]
    expect(len(assignments) == 1, f"the producer got {len(assignments)} TRANSFER_ASSIGNED for one transfer")


@check("lifecycle")
async def generation_zero_means_one(s: Scenario) -> None:
    """Generation 0 on the wire means 1: in a target, a completion and a release."""
    consumer, producer = await s.pair()
    t = s.transfer_id()
    expect_state(await consumer.register_target(t, TARGET_BLOCKS, generation=0), TARGETED, "RegisterTargets(gen 0)")
    expect_state(await producer.claim(t), MATCHED, "ClaimTransfers")
    assigned = await producer.events.expect(ASSIGNED, t)
    expect(assigned.generation == 1, f"a target of generation 0 was assigned as {describe_event(assigned)}")
    expect(assigned.transfer.generation == 1, f"the transfer's generation is {assigned.transfer.generation}")
    expect_state(await producer.complete(t, 0), COMMITTED, "CompleteTransfers(generation 0)")
    committed = await consumer.events.expect(TRANSFER_COMMITTED, t)
    expect(committed.generation == 1, f"{describe_event(committed)}: expected generation 1")
    expect_state(await consumer.release(t, 0), RELEASED, "ReleaseTargets(generation 0)")


@check("arrival")
async def push_claim_first(s: Scenario) -> None:
    """Push, claim then target: the same assignment, commit and release."""
    await push_to_release(s, claim_first=True)


@check("arrival")
async def pull_source_ready_first(s: Scenario) -> None:
    """Pull, MarkSourcesReady before the target: SOURCE_READY follows the target."""
    await pull_to_release(s, source_first=True)


async def _aborted_targets(s: Scenario, consumer: Engine, count: int) -> list[str]:
    """count transfers targeted by the consumer and aborted by the router: one TRANSFER_ABORTED each."""
    ids = [s.transfer_id() for _ in range(count)]
    for t in ids:
        expect_state(await consumer.register_target(t, (0,)), TARGETED, "RegisterTargets")
        await s.router_abort(t)
    return ids


def _check_sequence(events: Sequence[pb.Event], ids: Sequence[str], first_sequence: int, what: str) -> None:
    """events are exactly the aborts of ids, at consecutive sequences from first_sequence."""
    got = [(e.sequence, e.type, e.transfer.transfer_id) for e in events]
    expected = [(first_sequence + i, TRANSFER_ABORTED, t) for i, t in enumerate(ids)]
    expect(
        got == expected,
        f"{what}: got {[describe_event(e) for e in events]}, expected TRANSFER_ABORTED of {list(ids)} "
        f"at sequences {first_sequence}..{first_sequence + len(ids) - 1}",
    )


@check("watch")
async def resume_without_gaps(s: Scenario) -> None:
    """Watch resumes at last seen + 1 (on another target, if given) with no gap and no duplicate."""
    consumer = await s.consumer(watch=False)
    start = consumer.watch_start_sequence
    first_ids = await _aborted_targets(s, consumer, 3)
    watcher = Watcher(s.driver, consumer.stub, consumer.engine_id, start)
    await watcher.start()
    try:
        expect(not watcher.first_response_had_events, "the first Watch response carried events, not only the header")
        await watcher.expect(TRANSFER_ABORTED, first_ids[-1])
        _check_sequence(watcher.events, first_ids, start, "the first watch")
    finally:
        await watcher.close()
    last = start + len(first_ids) - 1
    later_ids = await _aborted_targets(s, consumer, 2)
    # Resume where the first watch stopped, and from the middle of what it saw, on the next target.
    for resume_at, ids in ((last + 1, later_ids), (last, [first_ids[-1], *later_ids])):
        resumed = Watcher(s.driver, consumer.other_stub, consumer.engine_id, resume_at)
        await resumed.start()
        try:
            end = await resumed.expect(TRANSFER_ABORTED, ids[-1])
            upto = [e for e in resumed.events if e.sequence <= end.sequence]
            _check_sequence(upto, ids, resume_at, f"the watch resumed at {resume_at}")
        finally:
            await resumed.close()


@check("watch")
async def future_sequence_out_of_range(s: Scenario) -> None:
    """Watch from beyond the latest sequence + 1 is OUT_OF_RANGE / SEQUENCE_INVALID; latest + 1 is fine."""
    consumer = await s.consumer()
    last = (await consumer.events.expect(TRANSFER_ABORTED, (await _aborted_targets(s, consumer, 1))[0])).sequence
    edge = Watcher(s.driver, s.driver.next_stub(), consumer.engine_id, last + 1)
    await edge.start()
    await edge.close()
    ahead = Watcher(s.driver, s.driver.next_stub(), consumer.engine_id, last + 2)
    err = await expect_rpc_error(
        ahead.start(), grpc.StatusCode.OUT_OF_RANGE, "SEQUENCE_INVALID", f"Watch(start_sequence={last + 2})"
    )
    reported = err.metadata.get("last_sequence")
    expect(
        reported in (None, str(last)),
        f"SEQUENCE_INVALID names last_sequence {reported}, the engine's latest sequence is {last}",
    )
