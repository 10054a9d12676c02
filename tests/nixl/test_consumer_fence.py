"""A consumer rank hands an aborted target's blocks back only once the service no longer fences the generation the
producer may be writing, even when the service does not answer the agent's question about it. Real service, real
NIXL, both ranks in this process, each through a gRPC proxy that holds or fails the calls a test names."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from rendezvous.clients import AsyncRendezvousClient, ClientConfig, RetryPolicy, TransferState
from rendezvous.clients.nixl.consumer import ConsumerAgent
from rendezvous.clients.nixl.producer import ProducerAgent
from tests.clients.conftest import WAIT, GrpcProxy, client, grpc_proxy, server
from tests.nixl.test_producer_parts import LAYOUT, landed

__all__ = ["client", "grpc_proxy", "server"]

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]


async def test_an_unanswered_question_keeps_the_blocks_until_the_revocation_is_confirmed(
    client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """The consumer aborts a progressive transfer whose first part landed; the producer's acknowledgement (sent
    once its WRITEs drained) is held at the proxy, and the consumer's GetTransfer fails. The failed result waits
    for REVOCATION_CONFIRMED: before, an unanswered GetTransfer counted as "nothing fenced" and the blocks came
    back while the producer could still write into them."""
    config = ClientConfig(targets=[grpc_proxy.address], retry=RetryPolicy(deadline=None))
    loop = asyncio.get_running_loop()
    arrived: asyncio.Future[Any] = loop.create_future()
    kv = [torch.arange(8 * 256, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(8, 256) for _ in range(2)]
    decode = [torch.zeros(8, 256, dtype=torch.uint8) for _ in range(2)]
    async with AsyncRendezvousClient(config) as proxied:
        producer = ProducerAgent(proxied, "p0", "prefill", kv, layout=LAYOUT)
        consumer = ConsumerAgent(proxied, "d0", "decode", decode, layout=LAYOUT, on_result=arrived.set_result)
        await producer.start()
        await consumer.start()
        try:
            assert (await consumer.register_target("t1", [5, 6], num_tokens=32, progressive=True)).ok
            assert (await producer.claim("t1")).state is TransferState.MATCHED
            producer.ready_part("t1", [1, 2], 32, (0, 1), prompt_tokens=32)
            await landed(decode[0][5:7], kv[0][1:3])

            grpc_proxy.delay("AcknowledgeRevocations")
            grpc_proxy.drain("GetTransfer")  # answered at once with no message: the client raises, not retries
            assert (await consumer.abort("t1", "decode gave up")).ok
            await grpc_proxy.wait_for(lambda: grpc_proxy.calls["AcknowledgeRevocations"] >= 1)

            assert grpc_proxy.calls["GetTransfer"] >= 1
            assert (await client.get_transfer("t1")).revoking_generation == 1  # the producer may still write
            assert not arrived.done()

            grpc_proxy.let_through("AcknowledgeRevocations")
            result = await asyncio.wait_for(arrived, WAIT)
            assert not result.ok and result.block_ids == (5, 6)
            assert (await client.get_transfer("t1")).revoking_generation == 0
        finally:
            await producer.close()
            await consumer.close()
