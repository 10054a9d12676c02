"""Closing an agent: it still hears its session's last events, which must not fail the handler; and it ends although
a call it made waits for an incarnation that never comes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from rendezvous.clients import AsyncRendezvousClient, Event, EventType, KvLayout
from rendezvous.clients.nixl.consumer import ConsumerAgent
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.nixl.rank import start_ranks
from rendezvous.clients.testing import TEST_LAYOUT
from tests.clients.conftest import (
    FAST_SESSION,
    MUST,
    WAIT,
    GrpcProxy,
    client,
    client_config,
    grpc_proxy,
    server,
    wait_until,
)
from tests.nixl.helpers import on_assignment

__all__ = ["client", "grpc_proxy", "server"]


async def test_a_peer_lost_after_the_agents_stopped_is_ignored(client: AsyncRendezvousClient) -> None:
    producer = ProducerAgent(client, "p0", "prefill", [torch.ones(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT)
    consumer = ConsumerAgent(client, "d0", "decode", [torch.zeros(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT)
    await producer.start()
    await consumer.start()
    consumer_info, producer_info = await client.get_engine("d0"), await client.get_engine("p0")
    await consumer.close()
    await producer.close()  # the threads are stopped; a session may still deliver what it read before it ended
    await producer.handle_event(Event(EventType.PEER_LOST, time.time(), peer=consumer_info, sequence=1))
    await consumer.handle_event(Event(EventType.PEER_LOST, time.time(), peer=producer_info, sequence=1))


LEASE = 3.0
TP2 = KvLayout("test-model", "uint8", 16, 1, tp_size=2, kv_layout="HND", num_kv_heads=2)
"""The producer: two ranks, a head each (256 bytes of a block)."""
TP1 = KvLayout("test-model", "uint8", 16, 1, kv_layout="HND", num_kv_heads=2)
"""The consumer: one rank, both heads (512 bytes of a block)."""


def left_running() -> list[asyncio.Task[Any]]:
    """The tasks of engine p0's session and batchers still running."""
    return [
        t
        for t in asyncio.all_tasks()
        if not t.done() and (t.get_name().endswith(" p0") or t.get_name().startswith("batch"))
    ]


@pytest.mark.nixl
@pytest.mark.timeout(120)
async def test_closing_a_following_rank_whose_report_waits_for_an_incarnation_that_never_comes_ends(
    client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """Rank 1 of a TP 2 producer wrote its half and reported it; the report reached the service only after rank 0
    closed (the engine deregistered), was refused ENGINE_NOT_FOUND, and waits for an incarnation to follow, which
    none will register. Closing rank 1 waited for its report, the report for that incarnation: close() never ended
    (found by the TP 2 write-fence test, whose first version took 100 s). Now close() ends the wait: the report
    fails with `Cancelled`, and nothing of the rank is left running."""
    async with AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied:
        ranks = [
            ProducerAgent(
                c,
                "p0",
                "prefill",
                [torch.ones(8, 256, dtype=torch.uint8)],
                layout=TP2,
                rank=r,
                lease_ttl=LEASE,
                session_config=FAST_SESSION,
            )
            for r, c in enumerate((client, proxied))
        ]
        follower = ranks[1]
        consumer = ConsumerAgent(client, "d0", "decode", [torch.zeros(8, 512, dtype=torch.uint8)], layout=TP1)
        assigned = on_assignment(follower)
        await start_ranks(ranks)
        await consumer.start()
        try:
            assert (await consumer.register_target("t1", [5], 1)).ok
            assert (await ranks[0].claim("t1")).ok
            await asyncio.wait_for(assigned, WAIT)
            grpc_proxy.delay("CompleteTransfers")
            follower.ready("t1", [2])  # rank 1 writes its half and reports it
            await grpc_proxy.wait_for(lambda: grpc_proxy.delayed["CompleteTransfers"] == 1)
            await ranks[0].close()  # the engine is deregistered: no incarnation will come
            session = follower.engine_session
            await wait_until(lambda: session._recovery is not None and not session._recovery.done(), MUST)
            grpc_proxy.let_through("CompleteTransfers")  # refused: the report waits for an incarnation to follow
            await grpc_proxy.wait_for(lambda: grpc_proxy.delayed["CompleteTransfers"] == 0)

            await asyncio.wait_for(follower.close(), MUST)

            assert left_running() == []
            assert grpc_proxy.calls["DeregisterEngine"] == 0
        finally:
            for rank in ranks:
                await rank.close()
            await consumer.close()


@pytest.mark.nixl
@pytest.mark.timeout(120)
async def test_closing_a_producer_whose_report_waits_for_a_held_re_registration_ends(
    client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """The same on rank 0 (a single-rank producer): its report was refused ENGINE_NOT_FOUND (its lease lost) and
    waits for the re-registration, which the replica leaves unanswered. close() waited for the report, the report
    for the re-registration, retried for as long as the replica answers nothing: close() never ended. Now the report
    fails with `Cancelled`, the lost incarnation is not deregistered, and nothing is left running."""
    async with AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied:
        producer = ProducerAgent(
            proxied,
            "p0",
            "prefill",
            [torch.ones(8, 256, dtype=torch.uint8)],
            layout=TEST_LAYOUT,
            lease_ttl=LEASE,
            session_config=FAST_SESSION,
        )
        consumer = ConsumerAgent(client, "d0", "decode", [torch.zeros(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT)
        assigned = on_assignment(producer)
        await producer.start()
        await consumer.start()
        try:
            assert (await consumer.register_target("t1", [5], 1)).ok
            assert (await producer.claim("t1")).ok
            await asyncio.wait_for(assigned, WAIT)
            grpc_proxy.delay("CompleteTransfers")
            producer.ready("t1", [2])
            await grpc_proxy.wait_for(lambda: grpc_proxy.delayed["CompleteTransfers"] == 1)
            grpc_proxy.hold("RegisterEngine")
            grpc_proxy.hold("DeregisterEngine")
            await client.deregister_engine("p0", producer.session.incarnation)  # its lease is gone
            await grpc_proxy.wait_for(lambda: grpc_proxy.calls["RegisterEngine"] == 2)  # the recovery's, held
            grpc_proxy.let_through("CompleteTransfers")  # refused: the report waits for the re-registration
            await grpc_proxy.wait_for(lambda: grpc_proxy.delayed["CompleteTransfers"] == 0)

            await asyncio.wait_for(producer.close(), MUST)

            assert left_running() == []
            assert grpc_proxy.calls["DeregisterEngine"] == 0
        finally:
            for method in ("RegisterEngine", "DeregisterEngine"):
                grpc_proxy.release(method)
            await producer.close()
            await consumer.close()
