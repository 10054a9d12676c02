"""The write fence: a producer cut off from the service, while it still reaches the consumer over NIXL, writes
nothing once its lease may have lapsed (`EngineSession.writable_until`, checked by the `TransferWriter` before every
post). Real service and NIXL agents on 127.0.0.1; the producer's client goes through a `GrpcProxy` that cuts it off."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from rendezvous.clients import AbortReason, AsyncRendezvousClient, EventType
from rendezvous.clients.nixl.consumer import ConsumerAgent, TransferResult
from rendezvous.clients.nixl.producer import ProducerAgent, WriteReport
from rendezvous.clients.testing import TEST_LAYOUT
from tests.clients.conftest import FAST_SESSION, MUST, WAIT, GrpcProxy, client, client_config, grpc_proxy, server

__all__ = ["client", "grpc_proxy", "server"]

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]

LEASE = 3.0
"""The producer's lease: the consumer is told PEER_LOST about this long after the cut."""
METHODS = (
    "AbortTransfers", "AcknowledgeRevocations", "ClaimTransfers", "CompleteTransfers", "DeregisterEngine", "GetEngine",
    "GetStatus", "GetTransfer", "KeepAlive", "ListEngines", "ListTransfers", "MarkSourcesReady", "RegisterEngine",
    "RegisterTargets", "ReleaseCredits", "ReleaseTargets", "ReserveCredits", "Watch",
)  # fmt: skip


async def test_a_producer_cut_off_from_the_service_does_not_write_into_blocks_the_consumer_was_told_are_free(
    client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """The producer holds an assignment whose source is not ready; then it is cut off from the service (every call
    held, its KeepAlive and Watch streams ended), not from the consumer. Its lease lapses at the service, which
    aborts the transfer with PEER_LOST: the consumer may reuse its blocks at once. Then prefill finishes. Before the
    fence, the writer (which never heard of the abort) WROTE into those blocks; now it posts nothing and the
    generation fails, reported with the reason once the service can be reached again.

    Deterministic whatever the load, with no sleep: the service lapses the lease no earlier than its TTL after it
    got the producer's last renewal that it answered, which the producer sent before that (or, unanswered, the
    producer did not count it), while the producer's fence is two thirds of the TTL after that send. The test makes
    the source ready only once the consumer was told PEER_LOST, so the writer looks at the fence after the lapse,
    after the fence: a slow machine only makes it look later. (Both clocks are this machine's: the service's wall
    clock and the session's monotonic one run at the same rate; the third of a TTL between them is the margin.)"""
    loop = asyncio.get_running_loop()
    assigned: asyncio.Future[None] = loop.create_future()
    lost: asyncio.Future[TransferResult] = loop.create_future()
    reported: asyncio.Future[WriteReport] = loop.create_future()

    def on_result(result: TransferResult) -> None:
        if not lost.done():
            lost.set_result(result)

    def on_report(report: WriteReport) -> None:
        if not reported.done():
            reported.set_result(report)

    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    async with AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied:
        producer = ProducerAgent(
            proxied,
            "p0",
            "prefill",
            [torch.ones(8, 256, dtype=torch.uint8)],
            layout=TEST_LAYOUT,
            lease_ttl=LEASE,
            session_config=FAST_SESSION,
            on_report=on_report,
        )
        consumer = ConsumerAgent(client, "d0", "decode", decode, layout=TEST_LAYOUT, on_result=on_result)
        handle = producer.handle_event

        async def handle_event(item: Any) -> None:
            await handle(item)
            if getattr(item, "type", None) is EventType.TRANSFER_ASSIGNED and not assigned.done():
                assigned.set_result(None)

        producer.handle_event = handle_event  # type: ignore[method-assign]
        await producer.start()
        await consumer.start()
        try:
            assert (await consumer.register_target("t1", [5], 1)).ok
            assert (await producer.claim("t1")).ok
            await asyncio.wait_for(assigned, WAIT)  # the writer holds the assignment; prefill is still computing

            for method in METHODS:  # the partition: the producer reaches the consumer, not the service
                grpc_proxy.hold(method)
            grpc_proxy.end_streams("KeepAlive")
            grpc_proxy.end_streams("Watch")
            result = await asyncio.wait_for(lost, MUST)
            assert (result.ok, result.reason) == (False, AbortReason.PEER_LOST)  # its blocks are free now

            producer.ready("t1", [2])  # prefill finished
            assert await asyncio.to_thread(producer._writer.barrier, WAIT)  # type: ignore[union-attr]
            for method in METHODS:  # the service can be reached again: it is told the write failed
                grpc_proxy.release(method)
            report = await asyncio.wait_for(reported, MUST)

            assert not report.ok and "lease" in (report.error or "") and "not writing" in (report.error or "")
            assert int(torch.count_nonzero(decode[0])) == 0  # the consumer's memory is untouched
        finally:
            await producer.close()
            await consumer.close()
