"""A target whose transfer committed while its engine's lease lapsed is re-asserted by the new incarnation and answered
ok, RELEASED (the lapse released it): the agent asks the service and ends it as a commit does. Real service (on a
fake clock) and NIXL agents; decode connects through a gRPC proxy that refuses its Watch and KeepAlive calls while
the transfers commit and its lease lapses. Prefill's engine session reports the transfers written, moving no byte:
only the service's word ends them."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from rendezvous.clients import AsyncRendezvousClient, ClaimSpec, CompletionSpec, TransferState
from rendezvous.clients.nixl.consumer import ConsumerAgent, TransferResult
from rendezvous.clients.testing import TEST_LAYOUT, FakeClock, start_test_server
from rendezvous.core.limits import Timeouts
from tests.clients.conftest import FAST_SESSION, MUST, GrpcProxy, client_config
from tests.nixl.helpers import on_reregistered
from tests.nixl.test_read_outcomes import prefill
from tests.nixl.test_resync import IDS

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]

LEASE = 9.0
"""The engines' lease, in the service's (fake) seconds."""
STREAMS = ("Watch", "KeepAlive")


async def test_targets_committed_while_the_lease_lapsed_end_ok_once_re_registered() -> None:
    """d0's Watch and KeepAlive are refused while p0 reports its six push targets written: they commit, and their
    TRANSFER_COMMITTED waits in the log of an incarnation whose lease then lapses, which releases them. Its KeepAlive
    let through again, d0 re-registers and re-asserts each target, answered ok and RELEASED; the new incarnation's
    watch starts after the commits. Before, the agent ended only the re-asserted targets that failed or aborted:
    these stayed expected for ever, and decode never had a result. Now it asks the service, and each arrives ok
    while the handler takes Reregistered."""
    clock = FakeClock()
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    timeouts = Timeouts(default_lease_ttl=LEASE)
    async with (
        start_test_server(clock, timeouts=timeouts, sweep_interval=0.02, grace=0.1) as server,
        AsyncRendezvousClient(client_config(server.address)) as client,
    ):
        proxy = GrpcProxy(server.address)
        await proxy.start()
        try:
            async with AsyncRendezvousClient(client_config(proxy.address)) as proxied:
                consumer = ConsumerAgent(
                    proxied, "d0", "decode", [torch.zeros(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT,
                    session_config=FAST_SESSION, on_result=results.put_nowait,
                )  # fmt: skip
                reregistered = on_reregistered(consumer)
                producer = prefill(client, "p0", 1)
                await producer.start()
                await consumer.start()
                try:
                    for i, t in enumerate(IDS):
                        assert (await consumer.register_target(t, [i])).state is TransferState.TARGETED
                    for method in STREAMS:
                        proxy.refuse(method, grpc.StatusCode.UNAVAILABLE)
                        proxy.end_streams(method)
                    claims = await producer.session.claim_transfers([ClaimSpec(t) for t in IDS])
                    assert all(c.state is TransferState.MATCHED for c in claims)
                    done = await producer.session.complete_transfers([CompletionSpec(t, 1) for t in IDS])
                    assert all(c.state is TransferState.COMMITTED for c in done)
                    await producer.close()  # its lease is not the one to lapse
                    clock.advance(LEASE)
                    await server.sweep()  # d0's lease lapsed: its committed transfers are released
                    assert all([(await client.get_transfer(t)).state is TransferState.RELEASED for t in IDS])
                    assert results.empty()
                    proxy.release("KeepAlive")  # refused LEASE_EXPIRED: d0 re-registers; its Watch stays refused
                    taken = await asyncio.wait_for(reregistered, MUST)
                    assert [(r.transfer_id, r.ok, r.state) for r in taken.results] == [
                        (t, True, TransferState.RELEASED) for t in IDS
                    ]
                    ended = {r.transfer_id: r for r in [results.get_nowait() for _ in range(results.qsize())]}
                    assert sorted(ended) == IDS
                    for i, t in enumerate(IDS):
                        assert (ended[t].ok, ended[t].generation, ended[t].block_ids) == (True, 1, (i,))
                        assert not consumer.awaiting_result(t)
                    assert consumer._thread is not None and not consumer._thread._expecting.is_set()
                finally:
                    for method in STREAMS:
                        proxy.release(method)
                    await consumer.close()
                    await producer.close()
        finally:
            await proxy.close()
