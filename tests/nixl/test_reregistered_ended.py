"""A transfer that committed (or aborted) while an engine's lease lapsed is re-asserted by the new incarnation and
answered ok, COMMITTED or RELEASED (or ABORTED): the agent ends it as its TRANSFER_COMMITTED (or TRANSFER_ABORTED,
sent to the replaced incarnation) would have. Real service (on a fake clock) and NIXL agents; the engine under test
connects through a gRPC proxy that refuses its Watch and KeepAlive calls while the transfers end and its lease
lapses. The other engine's session reports the transfers, moving no byte: only the service's word ends them."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from rendezvous.clients import (
    AbortReason,
    AbortSpec,
    AsyncRendezvousClient,
    ClaimSpec,
    CompletionSpec,
    ReleaseSpec,
    TargetSpec,
    TransferMode,
    TransferState,
)
from rendezvous.clients.nixl.consumer import ConsumerAgent, TransferResult
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.testing import TEST_LAYOUT, FakeClock, start_test_server
from rendezvous.core.limits import Timeouts
from tests.clients.conftest import FAST_SESSION, MUST, GrpcProxy, client_config, wait_until
from tests.nixl.helpers import on_reregistered
from tests.nixl.test_read_outcomes import prefill
from tests.nixl.test_resync import IDS, eventually_ready

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]

LEASE = 9.0
"""The lease of the engine under test, in the service's (fake) seconds; its peer's is three times as long."""
STREAMS = ("Watch", "KeepAlive")
ABORTED = ["t0", "t1", "t2"]
WHY = "the router gave up"


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


@pytest.mark.parametrize("state", [TransferState.COMMITTED, TransferState.RELEASED])
async def test_pull_sources_committed_while_the_lease_lapsed_are_freed_once_re_registered(state: TransferState) -> None:
    """p0's Watch and KeepAlive are refused while d0 reports each of six pull transfers read (d0's engine session
    reports, not reading), and maybe releases them: their TRANSFER_COMMITTED waits in the log of a p0 incarnation
    whose lease then lapses (a lost producer leaves a committed transfer as it is). Its KeepAlive let through again,
    p0 re-registers and re-asserts each claim and ready source, answered ok, COMMITTED or RELEASED: it frees every
    source while its handler takes Reregistered."""
    clock = FakeClock()
    freed: asyncio.Queue[str] = asyncio.Queue()
    async with (
        start_test_server(clock, timeouts=Timeouts(default_lease_ttl=LEASE), sweep_interval=0.02, grace=0.1) as server,
        AsyncRendezvousClient(client_config(server.address)) as client,
    ):
        proxy = GrpcProxy(server.address)
        await proxy.start()
        try:
            async with AsyncRendezvousClient(client_config(proxy.address)) as proxied:
                producer = prefill(proxied, "p0", 1)
                reregistered = on_reregistered(producer)
                consumer = ConsumerAgent(
                    client, "d0", "decode", [torch.zeros(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT,
                    session_config=FAST_SESSION, lease_ttl=3 * LEASE,
                )  # fmt: skip
                await producer.start()
                await consumer.start()
                try:
                    targets = [TargetSpec(t, (i,), mode=TransferMode.PULL) for i, t in enumerate(IDS)]
                    assert all(r.ok for r in await consumer.session.register_targets(targets))  # the agent reads none
                    for i, t in enumerate(IDS):
                        assert (await producer.claim(t)).state is TransferState.MATCHED
                        producer.ready(t, [i], freed.put_nowait, mode=TransferMode.PULL)
                    await eventually_ready(client)
                    for method in STREAMS:
                        proxy.refuse(method, grpc.StatusCode.UNAVAILABLE)
                        proxy.end_streams(method)
                    done = await consumer.session.complete_transfers([CompletionSpec(t, 1) for t in IDS])
                    assert all(r.state is TransferState.COMMITTED for r in done)
                    if state is TransferState.RELEASED:
                        released = await consumer.session.release_targets([ReleaseSpec(t, 1) for t in IDS])
                        assert all(r.state is TransferState.RELEASED for r in released)
                    clock.advance(LEASE)
                    await server.sweep()  # p0's lease lapsed
                    assert all([(await client.get_transfer(t)).state is state for t in IDS])
                    assert freed.empty()
                    proxy.release("KeepAlive")  # refused LEASE_EXPIRED: p0 re-registers; its Watch stays refused
                    taken = await asyncio.wait_for(reregistered, MUST)
                    assert [(r.transfer_id, r.ok, r.state) for r in taken.results] == [(t, True, state) for t in IDS]
                    assert sorted([freed.get_nowait() for _ in range(freed.qsize())]) == IDS
                finally:
                    for method in STREAMS:
                        proxy.release(method)
                    await consumer.close()
                    await producer.close()
        finally:
            await proxy.close()


async def test_targets_aborted_while_the_lease_lapsed_fail_as_the_abort_says_once_unfenced() -> None:
    """d0's Watch and KeepAlive are refused while the router aborts t1 and p0 holds t2's assignment; d0's lease
    then lapses, which aborts t0 and t2 (PEER_LOST; t2 fenced until p0 acknowledges, which its own proxy holds).
    Its KeepAlive let through again, d0 re-registers and re-asserts each target, answered ok and ABORTED. Before,
    the agent failed each LOST ("did not survive re-registration"), losing why it ended. Now it asks the service:
    t0 and t1 fail as their abort says while the handler takes Reregistered, t2 once its REVOCATION_CONFIRMED
    comes."""
    clock = FakeClock()
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    timeouts = Timeouts(default_lease_ttl=LEASE)
    async with (
        start_test_server(clock, timeouts=timeouts, sweep_interval=0.02, grace=0.1) as server,
        AsyncRendezvousClient(client_config(server.address)) as client,
    ):
        proxy, producer_proxy = GrpcProxy(server.address), GrpcProxy(server.address)
        await proxy.start()
        await producer_proxy.start()
        try:
            async with (
                AsyncRendezvousClient(client_config(proxy.address)) as proxied,
                AsyncRendezvousClient(client_config(producer_proxy.address)) as producer_client,
            ):
                consumer = ConsumerAgent(
                    proxied, "d0", "decode", [torch.zeros(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT,
                    session_config=FAST_SESSION, on_result=results.put_nowait,
                )  # fmt: skip
                reregistered = on_reregistered(consumer)
                producer = ProducerAgent(
                    producer_client, "p0", "prefill", [torch.ones(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT,
                    lease_ttl=3 * LEASE,
                )  # fmt: skip
                await producer.start()
                await consumer.start()
                try:
                    for i, t in enumerate(ABORTED):
                        assert (await consumer.register_target(t, [i])).state is TransferState.TARGETED
                    assert (await producer.claim("t2")).state is TransferState.MATCHED
                    await wait_until(lambda: "t2" in producer._assigned, MUST)
                    for method in STREAMS:
                        proxy.refuse(method, grpc.StatusCode.UNAVAILABLE)
                        proxy.end_streams(method)
                    producer_proxy.delay("AcknowledgeRevocations")
                    (abort,) = await client.abort_transfers("", [AbortSpec("t1", WHY)])
                    assert abort.state is TransferState.ABORTED
                    clock.advance(LEASE)
                    await server.sweep()  # d0's lease lapsed: t0 and t2 are aborted, t2 fenced
                    assert [(await client.get_transfer(t)).revoking_generation for t in ABORTED] == [0, 0, 1]
                    await producer_proxy.wait_for(lambda: producer_proxy.delayed["AcknowledgeRevocations"])
                    assert results.empty()
                    proxy.release("KeepAlive")  # refused LEASE_EXPIRED: d0 re-registers; its Watch stays refused
                    taken = await asyncio.wait_for(reregistered, MUST)
                    assert [(r.transfer_id, r.ok, r.state) for r in taken.results] == [
                        (t, True, TransferState.ABORTED) for t in ABORTED
                    ]
                    ended = {r.transfer_id: r for r in [results.get_nowait() for _ in range(results.qsize())]}
                    assert sorted(ended) == ["t0", "t1"]
                    assert (ended["t0"].ok, ended["t0"].reason, ended["t0"].block_ids) == (
                        False, AbortReason.PEER_LOST, (0,)
                    )  # fmt: skip
                    assert (ended["t1"].ok, ended["t1"].reason, ended["t1"].message) == (
                        False, AbortReason.REQUESTED, WHY
                    )  # fmt: skip
                    assert consumer.awaiting_result("t2")  # p0 may still be writing into block 2
                    proxy.release("Watch")
                    producer_proxy.let_through("AcknowledgeRevocations")
                    fenced = await asyncio.wait_for(results.get(), MUST)
                    assert (fenced.transfer_id, fenced.ok, fenced.reason, fenced.block_ids) == (
                        "t2", False, AbortReason.PEER_LOST, (2,)
                    )  # fmt: skip
                    assert not any(consumer.awaiting_result(t) for t in ABORTED)
                finally:
                    for method in STREAMS:
                        proxy.release(method)
                    await consumer.close()
                    await producer.close()
        finally:
            await producer_proxy.close()
            await proxy.close()
