"""An agent that is closing still hears its session's last events: they must not fail the handler."""

from __future__ import annotations

import time

import torch

from rendezvous.clients import AsyncRendezvousClient, Event, EventType
from rendezvous.clients.nixl.consumer import ConsumerAgent
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.testing import TEST_LAYOUT
from tests.clients.conftest import client, server

__all__ = ["client", "server"]


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
