"""Progressive push through the SDK: a consumer session declares it, the producer session's assignment says so,
parts that do not tile the target raise with their reason and the consumer session hears of nothing until a
complete report commits the transfer."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from rendezvous.clients import (
    AbortSpec,
    AsyncRendezvousClient,
    ClaimSpec,
    CompletionSpec,
    ConsumerSession,
    Event,
    EventType,
    FailedPrecondition,
    InvalidArgument,
    OutOfRange,
    ProducerSession,
    Reason,
    TargetSpec,
    TransferState,
    WrittenPart,
)
from tests.clients.conftest import LAYOUT, consumer_session, next_event, of_type, producer_session


@pytest.fixture
async def consumer(client: AsyncRendezvousClient) -> AsyncIterator[ConsumerSession]:
    async with consumer_session(client) as session:
        yield session


@pytest.fixture
async def producer(client: AsyncRendezvousClient) -> AsyncIterator[ProducerSession]:
    async with producer_session(client) as session:
        yield session


async def test_parts_commit_only_once_they_tile_the_target(
    consumer: ConsumerSession, producer: ProducerSession
) -> None:
    producer_events, consumer_events = producer.events(), consumer.events()
    await consumer.register_target(TargetSpec("t1", [1, 2], num_tokens=32, progressive=True))
    await producer.claim_transfer(ClaimSpec("t1"))
    assigned = await next_event(producer_events, of_type(EventType.TRANSFER_ASSIGNED, "t1"))
    assert isinstance(assigned, Event) and assigned.transfer is not None and assigned.transfer.progressive

    first_layer = WrittenPart(0, 32, first_layer=0, num_layers=1)
    with pytest.raises(InvalidArgument) as caught:
        await producer.complete_transfer(CompletionSpec("t1", 1, parts=(first_layer,)))
    assert caught.value.reason == Reason.PARTS_INCOMPLETE
    with pytest.raises(OutOfRange) as out_of_range:
        await producer.complete_transfer(CompletionSpec("t1", 1, parts=(WrittenPart(16, 17),)))
    assert out_of_range.value.reason == Reason.PART_OUT_OF_RANGE
    assert "t1" in producer.live_transfers.claims

    # Another transfer's abort comes after anything the refused reports could have caused: no commit came.
    await consumer.register_target(TargetSpec("t2", [3]))
    await producer.claim_transfer(ClaimSpec("t2"))
    await producer.abort_transfer(AbortSpec("t2"))
    seen = await next_event(consumer_events, of_type(EventType.TRANSFER_ABORTED, "t2"))
    assert isinstance(seen, Event)
    assert "t1" in consumer.live_transfers.targets

    layers = tuple(WrittenPart(0, 32, layer, 1) for layer in range(LAYOUT.num_layers))
    assert (await producer.complete_transfer(CompletionSpec("t1", 1, parts=layers))).state == TransferState.COMMITTED
    committed = await next_event(consumer_events, lambda _event: True)
    assert isinstance(committed, Event) and committed.type == EventType.TRANSFER_COMMITTED
    assert committed.transfer is not None and committed.transfer.transfer_id == "t1"


async def test_parts_for_a_whole_write_target_raise(consumer: ConsumerSession, producer: ProducerSession) -> None:
    await consumer.register_target(TargetSpec("t1", [1], num_tokens=16))
    await producer.claim_transfer(ClaimSpec("t1"))
    with pytest.raises(FailedPrecondition) as caught:
        await producer.complete_transfer(CompletionSpec("t1", 1, parts=(WrittenPart(0, 16),)))
    assert caught.value.reason == Reason.PROGRESSIVE_NOT_ACCEPTED
