"""Checks of refusals: each mistake an engine can make gets its documented status code and ErrorInfo reason.

Per-item errors come back in `ItemResult.status`; request-level ones as the call's status.
"""

from __future__ import annotations

import grpc

from rendezvous.conformance.driver import (
    BLOCK_BYTES,
    CONSUMER,
    Engine,
    Scenario,
    code_name,
    describe_status,
    engine_request,
    error_reason,
    expect,
    expect_item_error,
    expect_ok,
    expect_rpc_error,
    expect_state,
    state_name,
)
from rendezvous.conformance.failures import assigned_transfer
from rendezvous.conformance.registry import check
from rendezvous.v1 import rendezvous_pb2 as pb

Code = grpc.StatusCode
TARGETED, CLAIMED, MATCHED = pb.TRANSFER_STATE_TARGETED, pb.TRANSFER_STATE_CLAIMED, pb.TRANSFER_STATE_MATCHED
COMMITTED = pb.TRANSFER_STATE_COMMITTED


@check("errors")
async def producer_registers_target(s: Scenario) -> None:
    """RegisterTargets by a producer: FAILED_PRECONDITION / WRONG_ROLE."""
    producer = await s.producer(watch=False)
    result = await producer.register_target(s.transfer_id())
    expect_item_error(result, Code.FAILED_PRECONDITION, "WRONG_ROLE", "RegisterTargets by a producer")


@check("errors")
async def producer_releases(s: Scenario) -> None:
    """ReleaseTargets by the producer of a committed transfer: FAILED_PRECONDITION / WRONG_ROLE."""
    consumer, producer = await s.pair()
    t = await assigned_transfer(s, consumer, producer)
    expect_state(await producer.complete(t, 1), COMMITTED, "CompleteTransfers")
    result = await producer.release(t, 1)
    expect_item_error(result, Code.FAILED_PRECONDITION, "WRONG_ROLE", "ReleaseTargets by the transfer's producer")


@check("errors")
async def consumer_acknowledges(s: Scenario) -> None:
    """AcknowledgeRevocations by the consumer of a transfer: FAILED_PRECONDITION / WRONG_ROLE."""
    consumer, producer = await s.pair()
    t = await assigned_transfer(s, consumer, producer)
    result = await consumer.acknowledge(t, 1)
    expect_item_error(
        result, Code.FAILED_PRECONDITION, "WRONG_ROLE", "AcknowledgeRevocations by the transfer's consumer"
    )


@check("errors")
async def outsider_not_participant(s: Scenario) -> None:
    """Engines acting on a transfer they take no part in: PERMISSION_DENIED / NOT_PARTICIPANT, nothing changes."""
    consumer, producer = await s.pair()
    t = await assigned_transfer(s, consumer, producer)
    other_consumer = await s.consumer(watch=False)
    other_producer = await s.producer(watch=False)
    denied, reason = Code.PERMISSION_DENIED, "NOT_PARTICIPANT"
    expect_item_error(await other_producer.complete(t, 1), denied, reason, "CompleteTransfers by another producer")
    expect_item_error(
        await other_producer.acknowledge(t, 1), denied, reason, "AcknowledgeRevocations by another producer"
    )
    expect_item_error(await other_consumer.release(t, 1), denied, reason, "ReleaseTargets by another consumer")
    expect_item_error(await other_consumer.abort(t), denied, reason, "AbortTransfers by another consumer")
    transfer = await s.get_transfer(t)
    expect(
        transfer.state == MATCHED,
        f"after the refused calls the transfer is {state_name(transfer.state)}, expected MATCHED",
    )


@check("errors")
async def complete_unassigned(s: Scenario) -> None:
    """CompleteTransfers of a claimed, never assigned transfer: FAILED_PRECONDITION / INVALID_STATE."""
    producer = await s.producer(watch=False)
    t = s.transfer_id()
    expect_state(await producer.claim(t), CLAIMED, "ClaimTransfers")
    result = await producer.complete(t, 1)
    expect_item_error(result, Code.FAILED_PRECONDITION, "INVALID_STATE", "CompleteTransfers of an unassigned transfer")


@check("errors")
async def pull_success_before_source_ready(s: Scenario) -> None:
    """A pull consumer's SUCCEEDED before MarkSourcesReady: FAILED_PRECONDITION / INVALID_STATE, nothing changes."""
    consumer, producer = await s.pair()
    t = s.transfer_id()
    expect_state(await consumer.register_target(t, mode=pb.TRANSFER_MODE_PULL), TARGETED, "RegisterTargets(PULL)")
    expect_state(await producer.claim(t), MATCHED, "ClaimTransfers without the source")
    result = await consumer.complete(t, 1)
    what = "CompleteTransfers(SUCCEEDED) of a pull transfer before its source is ready"
    expect_item_error(result, Code.FAILED_PRECONDITION, "INVALID_STATE", what)
    transfer = await s.get_transfer(t)
    expect(
        transfer.state == MATCHED,
        f"after the refused report the transfer is {state_name(transfer.state)}, expected MATCHED",
    )


async def _assigned_generation_two(s: Scenario) -> tuple[str, Engine]:
    """A transfer whose first target has generation 2, assigned; and its producer."""
    consumer, producer = await s.pair()
    t = s.transfer_id()
    expect_state(await consumer.register_target(t, generation=2), TARGETED, "RegisterTargets(generation 2)")
    expect_state(await producer.claim(t), MATCHED, "ClaimTransfers")
    await producer.events.expect(pb.EVENT_TYPE_TRANSFER_ASSIGNED, t, 2)
    return t, producer


@check("errors")
async def complete_older_generation(s: Scenario) -> None:
    """CompleteTransfers of a generation older than the current: FAILED_PRECONDITION / STALE_GENERATION."""
    t, producer = await _assigned_generation_two(s)
    result = await producer.complete(t, 1)
    expect_item_error(result, Code.FAILED_PRECONDITION, "STALE_GENERATION", "CompleteTransfers(1) while 2 is current")


@check("errors")
async def complete_newer_generation(s: Scenario) -> None:
    """CompleteTransfers of a generation newer than the current: FAILED_PRECONDITION / INVALID_STATE."""
    t, producer = await _assigned_generation_two(s)
    result = await producer.complete(t, 3)
    expect_item_error(result, Code.FAILED_PRECONDITION, "INVALID_STATE", "CompleteTransfers(3) while 2 is current")


def _registration(s: Scenario) -> pb.RegisterEngineRequest:
    return engine_request(s.driver.new_id("d"), CONSUMER)


@check("errors")
async def tp_size_zero(s: Scenario) -> None:
    """RegisterEngine with tp_size 0: INVALID_ARGUMENT / LAYOUT_INVALID."""
    request = _registration(s)
    request.layout.tp_size = 0
    await expect_rpc_error(s.register_raw(request), Code.INVALID_ARGUMENT, "LAYOUT_INVALID", "tp_size 0")


@check("errors")
async def engine_without_agents(s: Scenario) -> None:
    """RegisterEngine with no NIXL agent (tp_size x pp_size are needed): INVALID_ARGUMENT / AGENTS_INVALID."""
    request = _registration(s)
    del request.agents[:]
    await expect_rpc_error(s.register_raw(request), Code.INVALID_ARGUMENT, "AGENTS_INVALID", "an engine without agents")


@check("errors")
async def agent_without_regions(s: Scenario) -> None:
    """RegisterEngine with an agent that has no regions: INVALID_ARGUMENT / AGENTS_INVALID."""
    request = _registration(s)
    del request.agents[0].regions[:]
    await expect_rpc_error(s.register_raw(request), Code.INVALID_ARGUMENT, "AGENTS_INVALID", "an agent without regions")


@check("errors")
async def memory_kind_unspecified(s: Scenario) -> None:
    """RegisterEngine with memory_kind UNSPECIFIED: INVALID_ARGUMENT / AGENTS_INVALID."""
    request = _registration(s)
    request.agents[0].memory_kind = pb.MEMORY_KIND_UNSPECIFIED
    await expect_rpc_error(
        s.register_raw(request), Code.INVALID_ARGUMENT, "AGENTS_INVALID", "an agent of memory kind UNSPECIFIED"
    )


@check("errors")
async def overlapping_regions(s: Scenario) -> None:
    """RegisterEngine with two regions whose address ranges overlap: INVALID_ARGUMENT / AGENTS_INVALID."""
    request = _registration(s)
    first = request.agents[0].regions[0]
    second = request.agents[0].regions.add()
    second.CopyFrom(first)
    second.base_address = first.base_address + 8 * BLOCK_BYTES
    await expect_rpc_error(
        s.register_raw(request), Code.INVALID_ARGUMENT, "AGENTS_INVALID", "two overlapping regions of one agent"
    )


@check("errors")
async def unknown_transfer_mode(s: Scenario) -> None:
    """A target with an unknown TransferMode value (7): per item INVALID_ARGUMENT / MODE_INVALID."""
    consumer = await s.consumer(watch=False)
    result = await consumer.register_target(s.transfer_id(), mode=7)
    expect_item_error(result, Code.INVALID_ARGUMENT, "MODE_INVALID", "RegisterTargets(mode 7)")


@check("errors")
async def stale_incarnation(s: Scenario) -> None:
    """Calls and keep-alives for a replaced incarnation, and a keep-alive naming none (0): FAILED_PRECONDITION /
    STALE_INCARNATION."""
    consumer = await s.consumer(watch=False)
    old = consumer.incarnation
    await consumer.register()
    expect(consumer.incarnation != old, f"re-registering kept incarnation {old}")
    await expect_rpc_error(
        consumer.register_target(s.transfer_id(), incarnation=old),
        Code.FAILED_PRECONDITION,
        "STALE_INCARNATION",
        "RegisterTargets with the replaced incarnation",
    )
    await expect_rpc_error(
        consumer.keep_alive_once(old),
        Code.FAILED_PRECONDITION,
        "STALE_INCARNATION",
        "KeepAlive with the replaced incarnation",
    )
    await expect_rpc_error(
        consumer.keep_alive_once(0),
        Code.FAILED_PRECONDITION,
        "STALE_INCARNATION",
        "KeepAlive naming no incarnation (0)",
    )


def _credit_refused(result: pb.CreditResult, what: str) -> None:
    got = (code_name(result.status.code), error_reason(result.status))
    expect(
        got == (Code.RESOURCE_EXHAUSTED.name, "ENGINE_CAPACITY_EXCEEDED"),
        f"{what}: expected RESOURCE_EXHAUSTED/ENGINE_CAPACITY_EXCEEDED, got "
        + (describe_status(result.status) if result.status.code else "OK"),
    )


@check("errors")
async def beyond_declared_capacity(s: Scenario) -> None:
    """ReserveCredits and RegisterTargets beyond a consumer's capacity: RESOURCE_EXHAUSTED /
    ENGINE_CAPACITY_EXCEEDED; the reserved target is admitted and takes its reservation's place."""
    consumer = Engine(s, 0, s.driver.new_id("d"), CONSUMER)
    consumer.capacity = pb.EngineCapacity(max_transfers=1)
    s.engines.append(consumer)
    await consumer.register()
    reserved, other = s.transfer_id(), s.transfer_id()
    held = await s.reserve_credit(reserved, consumer, 4)
    expect(not held.status.code, f"ReserveCredits on a free consumer: {describe_status(held.status)}")
    _credit_refused(await s.reserve_credit(other, consumer), "ReserveCredits on a consumer with no credit left")
    expect_item_error(
        await consumer.register_target(other),
        Code.RESOURCE_EXHAUSTED,
        "ENGINE_CAPACITY_EXCEEDED",
        "RegisterTargets without a reservation on a consumer with no credit left",
    )
    expect_state(await consumer.register_target(reserved), TARGETED, "RegisterTargets of the reserved transfer")
    _credit_refused(await s.reserve_credit(other, consumer), "ReserveCredits while the target holds the credit")
    expect_ok(await s.router_abort(reserved), "AbortTransfers of the target")
    again = await s.reserve_credit(other, consumer)
    expect(not again.status.code, f"ReserveCredits after the abort freed the credit: {describe_status(again.status)}")
    released = await s.release_credit(other)
    expect(released.engine_id == consumer.engine_id, "ReleaseCredits names the engine it released on")
