"""A progressive target arrives on the part notification that completes its tiling, before the service's commit,
with a real service and real NIXL (a producer rank, a consumer rank and, where a test needs a writer that
misbehaves, a hand-driven NIXL endpoint, all in this process). Orders are observed (the transfer's state when
the result comes), never timed."""

from __future__ import annotations

import asyncio

import pytest

from rendezvous.clients import AsyncRendezvousClient, InvalidArgument, TransferState, WrittenPart
from rendezvous.clients._types import CompletionSpec
from rendezvous.clients.nixl.agent import NixlEndpoint, XferStatus
from rendezvous.clients.nixl.notifications import PartsEntry, encode_notification, encode_parts
from rendezvous.clients.testing import AsyncTestServer
from tests.clients.conftest import WAIT, client, server
from tests.nixl.test_producer_parts import Pair, landed, started_pair

__all__ = ["client", "server"]

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]

BOTH_LAYERS = (WrittenPart(0, 32, 0, 1), WrittenPart(0, 32, 1, 1))


class HandWriter:
    """A NIXL endpoint over the producer's KV that writes what a test says, with the notification it says."""

    def __init__(self, pair: Pair, consumer_agent: str) -> None:
        self.endpoint = NixlEndpoint.from_tensors("hand-writer", pair.kv)
        self.consumer = pair.consumer
        self.peer = consumer_agent
        self.fences = 0

    async def write(self, layer: int, notification: bytes) -> None:
        """Source blocks 1-2 of `layer` into target blocks 5-6, then wait until NIXL says they landed."""
        posted = self.endpoint.post("WRITE", self.peer, [1, 2], [5, 6], notification, regions=range(layer, layer + 1))
        deadline = asyncio.get_running_loop().time() + WAIT
        while self.endpoint.poll(posted) is XferStatus.IN_PROGRESS:  # NIXL moves the bytes while the sender polls
            assert asyncio.get_running_loop().time() < deadline, "the WRITE never finished"
            await asyncio.sleep(0.005)
        self.endpoint.release(posted)

    async def part(self, *parts: WrittenPart, layer: int = 0) -> None:
        await self.write(layer, encode_parts([PartsEntry("t1", 1, 1, range(2), parts)]))

    async def fence(self) -> None:
        """Wait until the consumer handled every notification this writer sent so far: they come in order, so
        once a notification for a transfer it does not expect is counted stale, the ones before were handled."""
        self.fences += 1
        before = self.consumer.stale_notifications
        await self.write(0, encode_notification(f"fence-{self.fences}", 1))
        deadline = asyncio.get_running_loop().time() + WAIT
        while self.consumer.stale_notifications == before:
            assert asyncio.get_running_loop().time() < deadline, "the fence never came"
            await asyncio.sleep(0.005)

    def close(self) -> None:
        self.endpoint.close()


async def hand_writer(pair: Pair, client: AsyncRendezvousClient) -> HandWriter:
    engine = await client.get_engine("d0")
    writer = HandWriter(pair, engine.agents[0].name)
    writer.endpoint.add_peer(engine.agents[0], engine.incarnation)
    return writer


async def progressive_match(pair: Pair) -> None:
    assert (await pair.consumer.register_target("t1", [5, 6], num_tokens=32, progressive=True)).ok
    assert (await pair.producer.claim("t1")).state is TransferState.MATCHED


async def test_a_progressive_target_arrives_on_its_last_part_before_the_commit(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    async with started_pair(client) as pair:
        await progressive_match(pair)
        writer = await hand_writer(pair, client)
        try:
            await writer.part(BOTH_LAYERS[0], layer=0)
            await writer.part(BOTH_LAYERS[0], layer=0)  # a repeat: counted twice it would fill the target
            await writer.fence()
            assert not pair.arrived.done()
            await writer.part(BOTH_LAYERS[1], layer=1)
            result = await asyncio.wait_for(pair.arrived, WAIT)
        finally:
            writer.close()
        assert result.ok and (await client.get_transfer("t1")).state is TransferState.MATCHED  # nobody reported
        for d, s in zip(pair.decode, pair.kv, strict=True):
            assert bytes(d[5:7].flatten().tolist()) == bytes(s[1:3].flatten().tolist())

        # The producer's report confirms it; the consumer releases the committed transfer itself.
        done = CompletionSpec("t1", 1, parts=BOTH_LAYERS)
        assert (await pair.producer.session.complete_transfer(done)).state is TransferState.COMMITTED
        deadline = asyncio.get_running_loop().time() + WAIT
        while (await client.get_transfer("t1")).state is not TransferState.RELEASED:
            assert asyncio.get_running_loop().time() < deadline, "the consumer never released the transfer"
            await asyncio.sleep(0.01)
        assert pair.consumer.disputed_targets == 0


async def test_the_real_writer_s_parts_make_the_target_arrive(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    async with started_pair(client) as pair:
        await progressive_match(pair)
        for layer in range(2):
            pair.producer.ready_part("t1", [1, 2], 32, (layer, layer + 1), prompt_tokens=32)
        assert (await asyncio.wait_for(pair.arrived, WAIT)).ok  # no `ready`: the producer has not reported
        assert (await client.get_transfer("t1")).state is TransferState.MATCHED
        pair.producer.ready("t1", [1, 2])
        report = await asyncio.wait_for(pair.reported, WAIT)
        # Both layers in one part when both were computed by the time the assignment reached the writer.
        assert report.ok and sorted(report.parts, key=lambda p: p.first_layer) in (
            [WrittenPart(0, 32)],
            list(BOTH_LAYERS),
        )


async def test_overlapping_part_notifications_leave_the_arrival_to_the_commit(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    async with started_pair(client) as pair:
        await progressive_match(pair)
        writer = await hand_writer(pair, client)
        try:
            await writer.part(BOTH_LAYERS[0], layer=0)
            await writer.part(WrittenPart(16, 16, 0, 2), layer=1)  # tokens 16..32 of layer 0 a second time
            await writer.part(WrittenPart(0, 16, 1, 1), layer=1)
            await writer.fence()
        finally:
            writer.close()
        assert not pair.arrived.done() and pair.consumer.disputed_targets == 1

        done = CompletionSpec("t1", 1, parts=BOTH_LAYERS)
        assert (await pair.producer.session.complete_transfer(done)).state is TransferState.COMMITTED
        assert (await asyncio.wait_for(pair.arrived, WAIT)).ok  # on TRANSFER_COMMITTED


async def test_a_writer_that_skips_a_part_never_starts_decode(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """The producer's writer writes layer 0 and never layer 1; its report of layer 0 alone is refused. Decode
    never starts: the target's only result is the failure, and it comes once the service no longer fences the
    generation (the producer drained its writes), so no write can land in the blocks given back."""
    async with started_pair(client) as pair:
        producer, consumer = pair.producer, pair.consumer
        await progressive_match(pair)
        producer.ready_part("t1", [1, 2], 32, (0, 1), prompt_tokens=32)
        await landed(pair.decode[0][5:7], pair.kv[0][1:3])

        skipped = CompletionSpec("t1", 1, parts=(BOTH_LAYERS[0],))
        with pytest.raises(InvalidArgument) as refused:
            await producer.session.complete_transfer(skipped)
        assert refused.value.reason == "PARTS_INCOMPLETE"
        assert not pair.arrived.done()

        assert (await consumer.abort("t1", "decode gave up")).ok
        result = await asyncio.wait_for(pair.arrived, WAIT)
        assert not result.ok and result.block_ids == (5, 6)
        info = await client.get_transfer("t1")
        assert info.state is TransferState.ABORTED and info.revoking_generation == 0
