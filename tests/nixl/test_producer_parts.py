"""`ProducerAgent.ready_part` with a real service: parts handed over as prefill computes them, then `ready`.
A consumer that accepts parts (a progressive target) gets each as it comes and the producer reports them with its
completion, which the service checks before it commits; to any other consumer the transfer goes in one write at
`ready`. A producer and a consumer rank share this process here."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from rendezvous.clients import AsyncRendezvousClient, InvalidArgument, TransferState, WrittenPart
from rendezvous.clients._types import CompletionSpec, KvLayout
from rendezvous.clients.nixl import BlockRangeError
from rendezvous.clients.nixl.agent import NixlEndpoint
from rendezvous.clients.nixl.consumer import ConsumerAgent
from rendezvous.clients.nixl.notifications import encode_notification
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.nixl.writer import WriterConfig
from rendezvous.clients.testing import AsyncTestServer
from tests.clients.conftest import WAIT, client, server

__all__ = ["client", "server"]  # the SDK tests' real server and client, here too

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]

LAYOUT = KvLayout("m", "uint8", 16, 2, kv_layout="HND", num_kv_heads=1)


@dataclasses.dataclass
class Pair:
    """A producer rank "p0" over two layers of 8 blocks, and a consumer rank "d0" of the same shape."""

    producer: ProducerAgent
    consumer: ConsumerAgent
    kv: list[torch.Tensor]
    decode: list[torch.Tensor]
    arrived: asyncio.Future[Any]  # the consumer's first TransferResult
    reported: asyncio.Future[Any]  # the producer's first WriteReport


@contextlib.asynccontextmanager
async def started_pair(client: AsyncRendezvousClient, writer_config: WriterConfig | None = None) -> AsyncIterator[Pair]:
    loop = asyncio.get_running_loop()
    arrived: asyncio.Future[Any] = loop.create_future()
    reported: asyncio.Future[Any] = loop.create_future()
    kv = [torch.arange(8 * 256, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(8, 256) for _ in range(2)]
    producer = ProducerAgent(
        client, "p0", "prefill", kv, layout=LAYOUT, on_report=reported.set_result, writer_config=writer_config
    )
    decode = [torch.zeros(8, 256, dtype=torch.uint8) for _ in range(2)]
    consumer = ConsumerAgent(client, "d0", "decode", decode, layout=LAYOUT, on_result=arrived.set_result)
    await producer.start()
    await consumer.start()
    try:
        yield Pair(producer, consumer, kv, decode, arrived, reported)
    finally:
        await producer.close()
        await consumer.close()


def assert_blocks_5_6_hold_source_1_2(pair: Pair) -> None:
    for d, s in zip(pair.decode, pair.kv, strict=True):
        assert torch.equal(d[5:7], s[1:3]) and not d[:5].any() and not d[7:].any()


async def landed(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Wait (bounded) until a part's bytes are in the consumer's blocks."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while not torch.equal(destination, source):
        assert asyncio.get_running_loop().time() < deadline, "the part never landed"
        await asyncio.sleep(0.01)


async def test_parts_then_ready_write_the_transfer_once(server: AsyncTestServer, client: AsyncRendezvousClient) -> None:
    freed: list[str] = []
    async with started_pair(client) as pair:
        producer = pair.producer
        assert (await pair.consumer.register_target("t1", [5, 6], num_tokens=32)).state is TransferState.TARGETED
        assert (await producer.claim("t1")).state is TransferState.MATCHED
        with pytest.raises(BlockRangeError):
            producer.ready_part("t1", [0], 32, (0, 1))  # 32 tokens do not fit one block of 16
        for layer in range(2):
            producer.ready_part("t1", [1, 2], 32, (layer, layer + 1), prompt_tokens=32, on_free=freed.append)
        producer.ready("t1", [1, 2])

        assert (await asyncio.wait_for(pair.arrived, WAIT)).ok
        report = await asyncio.wait_for(pair.reported, WAIT)
        assert report.ok and report.parts == ()  # a whole assignment: one write
        assert_blocks_5_6_hold_source_1_2(pair)
    assert freed == ["t1"]  # the on_free given with the parts, once


async def test_parts_into_a_progressive_target_are_reported_and_commit(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    async with started_pair(client) as pair:
        producer, decode, kv = pair.producer, pair.decode, pair.kv
        assert (await pair.consumer.register_target("t1", [5, 6], num_tokens=32, progressive=True)).ok
        assert (await producer.claim("t1")).state is TransferState.MATCHED
        producer.ready_part("t1", [1, 2], 32, (0, 1), prompt_tokens=32)  # layer 0 is computed
        await landed(decode[0][5:7], kv[0][1:3])  # written once TRANSFER_ASSIGNED reached the writer
        assert not decode[1].any() and not pair.arrived.done()  # layer 1 waits; no arrival before the final
        producer.ready("t1", [1, 2])  # then the rest

        assert (await asyncio.wait_for(pair.arrived, WAIT)).ok
        report = await asyncio.wait_for(pair.reported, WAIT)
        assert report.ok and sorted(report.parts, key=lambda p: p.first_layer) == [
            WrittenPart(0, 32, 0, 1),
            WrittenPart(0, 32, 1, 1),
        ]
        assert (await client.get_transfer("t1")).state in (TransferState.COMMITTED, TransferState.RELEASED)
        registry = server.server.metrics.registry
        assert registry.get_sample_value("kv_rendezvous_written_parts_total") == 2
        assert_blocks_5_6_hold_source_1_2(pair)


async def test_decode_does_not_start_on_an_incomplete_progressive_transfer(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """A producer that notifies before every part landed (a rogue NIXL agent here), then reports too few parts:
    decode does not take the KV as arrived on the notification (a progressive target arrives on the commit only),
    the service refuses the incomplete report, and only a report whose parts tile the target commits it."""
    loop = asyncio.get_running_loop()
    async with started_pair(client) as pair:
        producer, consumer, arrived = pair.producer, pair.consumer, pair.arrived
        rogue = NixlEndpoint.from_tensors("rogue-producer", pair.kv)
        try:
            assert (await consumer.register_target("t1", [5, 6], num_tokens=32, progressive=True)).ok
            assert (await producer.claim("t1")).state is TransferState.MATCHED
            engine = await client.get_engine("d0")
            rogue.add_peer(engine.agents[0], engine.incarnation)
            # One of the target's two blocks, with the notification that says "all landed".
            posted = rogue.post("WRITE", engine.agents[0].name, [1], [5], encode_notification("t1", 1))
            deadline = loop.time() + WAIT
            while consumer.stale_notifications == 0:
                assert loop.time() < deadline, "the notification never came"
                rogue.poll(posted)  # NIXL moves the bytes while the sender polls
                await asyncio.sleep(0.01)
            rogue.release(posted)
            assert not arrived.done()  # ignored: decode still waits
        finally:
            rogue.close()

        incomplete = CompletionSpec("t1", 1, parts=(WrittenPart(0, 32, 0, 1),))  # layer 1 is missing
        with pytest.raises(InvalidArgument) as refused:
            await producer.session.complete_transfer(incomplete)
        assert refused.value.reason == "PARTS_INCOMPLETE"
        assert (await client.get_transfer("t1")).state is TransferState.MATCHED and not arrived.done()

        complete = CompletionSpec("t1", 1, parts=(WrittenPart(0, 32, 0, 1), WrittenPart(0, 32, 1, 1)))
        assert (await producer.session.complete_transfer(complete)).state is TransferState.COMMITTED
        assert (await asyncio.wait_for(arrived, WAIT)).ok  # on TRANSFER_COMMITTED
