"""What a ProducerAgent owes its engine whatever the order of events: a revoked generation is never written, and
every source handed over (whole or in parts) is freed, on every rank. Found by an audit of the producer side;
each test failed before its fix. Real service and NIXL agents on 127.0.0.1."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from rendezvous.clients import AbortSpec, AsyncRendezvousClient, EventType, KvLayout
from rendezvous.clients.nixl.consumer import ConsumerAgent
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.nixl.rank import start_ranks
from rendezvous.clients.testing import TEST_LAYOUT
from tests.clients.conftest import WAIT, client, server
from tests.nixl.helpers import on_assignment

__all__ = ["client", "server"]

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]

P16 = KvLayout("m", "uint8", 16, 2, kv_layout="HND", num_kv_heads=1)
D32 = KvLayout("m", "uint8", 32, 2, kv_layout="HND", num_kv_heads=1)


async def test_an_assignment_held_for_the_prompt_s_length_is_not_written_once_revoked(
    client: AsyncRendezvousClient,
) -> None:
    """Blocks of other sizes pair by token, so the agent holds TRANSFER_ASSIGNED until `ready` tells the prompt's
    length. Its TRANSFER_REVOKED (decode preempted: generation 2) left it held, and a `ready` that came before
    the next assignment wrote generation 1 into blocks decode had been told it may reuse."""
    loop = asyncio.get_running_loop()
    reports: list[Any] = []
    second: asyncio.Future[None] = loop.create_future()
    kv = [torch.ones(8, 256, dtype=torch.uint8) for _ in range(2)]

    def reported(report: Any) -> None:
        reports.append(report)
        if report.generation == 2 and not second.done():
            second.set_result(None)

    producer = ProducerAgent(client, "p0", "prefill", kv, layout=P16, on_report=reported)
    decode = [torch.zeros(8, 512, dtype=torch.uint8) for _ in range(2)]
    consumer = ConsumerAgent(client, "d0", "decode", decode, layout=D32)
    assigned = on_assignment(producer)  # then held for the prompt's length
    handle = producer.handle_event

    async def handle_event(item: Any) -> None:
        await handle(item)
        if getattr(item, "type", None) is EventType.TRANSFER_REVOKED:
            producer.ready("t1", [1, 2], prompt_tokens=32)  # prefill finishes right then

    producer.handle_event = handle_event  # type: ignore[method-assign]
    await producer.start()
    await consumer.start()
    try:
        assert (await consumer.register_target("t1", [5], 1, num_tokens=32)).ok
        assert (await producer.claim("t1")).ok
        await asyncio.wait_for(assigned, WAIT)
        assert (await consumer.register_target("t1", [6], 2, num_tokens=32)).ok  # preempted: generation 2
        await asyncio.wait_for(second, WAIT)
        assert [r.generation for r in reports] == [2]
    finally:
        await producer.close()
        await consumer.close()


async def test_a_part_handed_over_after_its_transfer_ended_is_freed(client: AsyncRendezvousClient) -> None:
    """`ready_part(..., on_free=...)` promises the free "also when the transfer ends before `ready`": a part handed
    over after an abort (the request was cancelled mid-prefill, and no `ready` follows) was dropped unfreed."""
    loop = asyncio.get_running_loop()
    freed: asyncio.Future[str] = loop.create_future()
    producer = ProducerAgent(client, "p0", "prefill", [torch.ones(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT)
    await producer.start()
    try:
        assert (await producer.claim("t1")).ok
        assert (await producer.abort("t1", "cancelled")).ok
        producer.ready_part("t1", [0], 16, prompt_tokens=32, on_free=freed.set_result)
        assert await asyncio.wait_for(freed, WAIT) == "t1"
    finally:
        await producer.close()


TP2 = KvLayout("m", "uint8", 16, 1, tp_size=2, kv_layout="HND", num_kv_heads=2)


async def test_a_following_rank_frees_its_source_when_rank_0_s_claim_was_refused(
    client: AsyncRendezvousClient,
) -> None:
    """The connector hands `ready` to every TP rank; only rank 0 claims. When the claim is refused (the transfer
    ended before prefill claimed it), rank 0 frees at once, but rank 1 heard of the transfer from nobody: its
    blocks, and vLLM's finished_sending for the request (which waits for every rank), were held for ever. It
    asks the service every `follower_check_s` and frees them."""
    ranks = [
        ProducerAgent(
            client, "p0", "prefill", [torch.ones(8, 256, dtype=torch.uint8)], layout=TP2, rank=r, follower_check_s=0.05
        )
        for r in range(2)
    ]
    await start_ranks(ranks)
    loop = asyncio.get_running_loop()
    freed: list[asyncio.Future[str]] = [loop.create_future(), loop.create_future()]
    try:
        await client.abort_transfer("", AbortSpec("t1", "the router gave up"))  # before any half arrived
        assert (await ranks[0].claim("t1")).error is not None  # TRANSFER_ENDED
        for rank, done in zip(ranks, freed, strict=True):
            rank.ready("t1", [0, 1], done.set_result)
        assert await asyncio.wait_for(freed[0], WAIT) == "t1"
        assert await asyncio.wait_for(freed[1], WAIT) == "t1"
    finally:
        for agent in reversed(ranks):
            await agent.close()
