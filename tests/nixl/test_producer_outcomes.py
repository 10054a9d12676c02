"""What a ProducerAgent owes its engine whatever the order of events: a revoked generation is never written, and
every source handed over (whole or in parts) is freed, on every rank. Found by an audit of the producer side;
each test failed before its fix. Real service and NIXL agents on 127.0.0.1."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch

from rendezvous.clients import AbortSpec, AsyncRendezvousClient, ConsumerSession, EventType, KvLayout, TargetSpec
from rendezvous.clients.nixl.consumer import ConsumerAgent
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.nixl.rank import start_ranks
from rendezvous.clients.testing import TEST_LAYOUT
from rendezvous.protocol.dataplane import DATA_PLANE_VERSION
from tests.clients.conftest import FAST_SESSION, WAIT, client, next_event, of_type, server
from tests.nixl.helpers import on_assignment, unique
from tests.nixl.peer import Layout, PeerProcess

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


@pytest.mark.parametrize("first_replaced", [False, True], ids=["same-incarnation", "first-replaced"])
async def test_a_generation_revoked_twice_while_its_write_drains_is_acknowledged_once_and_forgotten(
    client: AsyncRendezvousClient, peer: PeerProcess, first_replaced: bool
) -> None:
    """Decode is preempted (generation 2: the service revokes generation 1 from the producer), then the request is
    aborted (TRANSFER_ABORTED still fences generation 1), while the producer's WRITE of generation 1 is in flight
    (the consumer's NIXL agent, in a peer process, is not polled). The writer acknowledges the two revocations of
    one generation once, as the WRITE drains; the producer noted a revoker per revocation and took one per ack, so
    the other was kept for ever (per such transfer). Now the second is not handed to the writer again, and the one
    ack answers both: the service confirms the revocation, and nothing of it is left.

    The ack goes as the newer revoker. `first_replaced` makes the first revocation look told to an incarnation
    replaced since (its `events_incarnation`, as the handler took it, is set to an older one): before, the ack went
    as that one, was dropped unsent (STALE_INCARNATION), and the service never confirmed the revocation. (With a write
    fence this cannot happen, as a re-registration drops a WRITE in flight before the new incarnation's events come;
    a following rank of a server too old to fence it is left.)"""
    dest = unique("dst")
    agent = peer.call("create", dest, Layout((256,), 8))
    producer = ProducerAgent(client, "p0", "prefill", [torch.ones(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT)
    layout = dataclasses.replace(TEST_LAYOUT, data_plane_version=DATA_PLANE_VERSION)
    consumer = ConsumerSession(client, "d0", "decode", layout=layout, agents=[agent], config=FAST_SESSION)
    assigned = on_assignment(producer)
    aborted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    handle = producer.handle_event

    async def handle_event(item: Any) -> None:
        session = producer.engine_session
        taken = session._taken_of
        if first_replaced and getattr(item, "type", None) is EventType.TRANSFER_REVOKED:
            session._taken_of = (taken[0], taken[1] - 1)
        await handle(item)
        session._taken_of = taken
        if getattr(item, "type", None) is EventType.TRANSFER_ABORTED:
            aborted.set_result(None)

    producer.handle_event = handle_event  # type: ignore[method-assign]
    await producer.start()
    try:
        async with consumer:
            events = consumer.events()
            assert (await consumer.register_target(TargetSpec("t1", [5], generation=1))).ok
            assert (await producer.claim("t1")).ok
            await asyncio.wait_for(assigned, WAIT)
            producer.ready("t1", [2])
            assert await asyncio.to_thread(producer._writer.barrier, WAIT)  # type: ignore[union-attr]
            assert producer.writes_in_flight == 1  # posted; it cannot land while the consumer does not poll

            assert (await consumer.register_target(TargetSpec("t1", [6], generation=2))).ok  # revokes generation 1
            result = await consumer.abort_transfer(AbortSpec("t1", "the request was cancelled"))
            assert result.revoking_generation == 1
            await asyncio.wait_for(aborted, WAIT)  # both revocations were taken, the write still in flight
            assert await asyncio.to_thread(producer._writer.barrier, WAIT)  # type: ignore[union-attr]
            peer.call("wait_notifications", dest, 1, WAIT)  # the consumer polls: the WRITE lands and drains

            confirmed = await next_event(events, of_type(EventType.REVOCATION_CONFIRMED, "t1"))
            assert confirmed.generation == 1  # type: ignore[union-attr]
            assert producer._revoked_by == {}  # before the fix: one revoker of generation 1 was left
    finally:
        await producer.close()
        peer.call("close", dest)
