"""A transfer that ended while an agent's watch was away is absent from the listing it resyncs from (which holds live
transfers only): the agent asks the service about it and ends it as the service's record says. Real service and
NIXL agents; the agent under test connects through a loopback proxy the test cuts while six events pass its event
log's bound of four. Where its counterpart reports a transfer, that agent's engine session does, moving no byte: only
the service's word ends the transfer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

import pytest
import torch

from rendezvous.clients import (
    AbortReason,
    AbortSpec,
    AsyncRendezvousClient,
    ClaimSpec,
    CompletionSpec,
    TargetSpec,
    TransferMode,
    TransferState,
)
from rendezvous.clients._types import Resynced, SessionEvent
from rendezvous.clients.nixl.consumer import AgentReason, ConsumerAgent, TransferResult
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.nixl.rank import start_ranks
from rendezvous.clients.testing import TEST_LAYOUT, AsyncTestServer, start_test_server
from rendezvous.core.limits import Limits, Timeouts
from rendezvous.protocol.errors import NotFound
from tests.clients.conftest import FAST_SESSION, MUST, TcpProxy, client_config, wait_until
from tests.nixl.test_pull_ends import TP2
from tests.nixl.test_read_outcomes import decode_agent, prefill
from tests.nixl.test_resync import IDS, eventually_ready

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]

WHY = "the router gave up"


@dataclasses.dataclass
class Away:
    """A service whose event logs keep 4 events; `client` reaches it directly, `proxied` through `proxy`."""

    server: AsyncTestServer
    client: AsyncRendezvousClient
    proxied: AsyncRendezvousClient
    proxy: TcpProxy

    def cut(self) -> None:
        """The proxied watch is away (its connections cut, new ones refused) until `back`."""
        self.proxy.refuse(True)
        self.proxy.cut()

    def back(self) -> None:
        self.proxy.refuse(False)

    async def states_become(self, state: TransferState) -> None:
        """Until the service holds every transfer in `state` (a sweep ends them in the background)."""

        async def poll() -> None:
            while any([(await self.client.get_transfer(t)).state is not state for t in IDS]):  # noqa: ASYNC110
                await asyncio.sleep(0.01)  # no event says so

        await asyncio.wait_for(poll(), MUST)

    async def forgotten(self) -> None:
        """Until the service forgot every transfer (their tombstones aged)."""

        async def poll() -> None:
            for t in IDS:
                with contextlib.suppress(NotFound):
                    while await self.client.get_transfer(t):  # noqa: ASYNC110 (no event says so)
                        await asyncio.sleep(0.01)

        await asyncio.wait_for(poll(), MUST)


@contextlib.asynccontextmanager
async def away(**timeouts: float) -> AsyncIterator[Away]:
    async with (
        start_test_server(
            limits=Limits(max_events_per_engine=4), timeouts=Timeouts(**timeouts), sweep_interval=0.02, grace=0.1
        ) as server,
        AsyncRendezvousClient(client_config(server.address)) as client,
    ):
        proxy = TcpProxy(server.port)
        await proxy.start()
        try:
            async with AsyncRendezvousClient(client_config(proxy.address)) as proxied:
                yield Away(server, client, proxied, proxy)
        finally:
            await proxy.close()


def on_resynced(agent: ConsumerAgent | ProducerAgent) -> asyncio.Event:
    """Set once the agent handled a Resynced."""
    resynced = asyncio.Event()
    handle_event = agent.handle_event

    async def seen(item: SessionEvent) -> None:
        await handle_event(item)
        if isinstance(item, Resynced):
            resynced.set()

    agent.handle_event = seen  # type: ignore[method-assign]
    return resynced


@pytest.mark.parametrize("how", ["released", "aborted", "forgotten"])
async def test_targets_whose_transfers_ended_while_the_watch_was_away_end_as_the_service_says(how: str) -> None:
    """d0's watch is away while each of its six push targets ends: committed by p0 (which moved no byte here, so
    only the commit tells d0 the bytes are in) and then released by `release_timeout`; aborted by the router; or
    aborted and forgotten. None is in the listing d0 resyncs from. Before, each failed LOST, "the service no longer
    has this transfer", whatever had ended it: committed bytes were thrown away, and an abort's reason lost. Now
    d0 asks: a released one arrives ok, an aborted one fails as the abort says, a forgotten one fails LOST; and no
    target is left expected."""
    timeouts = {"released": {"release_timeout": 0.1}, "forgotten": {"tombstone_ttl": 0.1}}.get(how, {})
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    async with away(**timeouts) as env:
        decode = [torch.zeros(8, 256, dtype=torch.uint8)]
        consumer = decode_agent(env.proxied, decode, results)
        resynced = on_resynced(consumer)
        producer = prefill(env.client, "p0", 1)
        await producer.start()
        await consumer.start()
        try:
            for i, t in enumerate(IDS):
                assert (await consumer.register_target(t, [i])).state is TransferState.TARGETED
            env.cut()
            if how == "released":
                claims = await producer.session.claim_transfers([ClaimSpec(t) for t in IDS])
                assert all(c.state is TransferState.MATCHED for c in claims)
                done = await producer.session.complete_transfers([CompletionSpec(t, 1) for t in IDS])
                assert all(c.state is TransferState.COMMITTED for c in done)
                await env.states_become(TransferState.RELEASED)
            else:
                aborts = await env.client.abort_transfers("", [AbortSpec(t, WHY) for t in IDS])
                assert all(a.state is TransferState.ABORTED for a in aborts)
                if how == "forgotten":
                    await env.forgotten()
            env.back()
            await asyncio.wait_for(resynced.wait(), MUST)
            ended = {r.transfer_id: r for r in [await asyncio.wait_for(results.get(), MUST) for _ in IDS]}
            assert sorted(ended) == IDS
            for i, t in enumerate(IDS):
                assert ended[t].block_ids == (i,)
                expected = {
                    "released": (True, AbortReason.UNSPECIFIED, ""),
                    "aborted": (False, AbortReason.REQUESTED, WHY),
                    "forgotten": (False, AgentReason.LOST, ended[t].message),
                }[how]
                assert (ended[t].ok, ended[t].reason, ended[t].message) == expected
                assert not consumer.awaiting_result(t)
            assert consumer._thread is not None and not consumer._thread._expecting.is_set()
            assert results.empty()
        finally:
            env.back()
            await consumer.close()
            await producer.close()


async def test_pull_sources_committed_while_the_watch_was_away_are_freed_after_the_resync() -> None:
    """p0's watch is away while d0 reports each of six pull transfers read (d0's engine session reports, not
    releasing them): the listing p0 resyncs from shows them COMMITTED. Before, p0 kept their sources (only
    TRANSFER_COMMITTED, lost with the watch, freed them): no event would come for them again. Now they are freed."""
    freed: asyncio.Queue[str] = asyncio.Queue()
    async with away() as env:
        producer = prefill(env.proxied, "p0", 1)
        resynced = on_resynced(producer)
        consumer = ConsumerAgent(
            env.client, "d0", "decode", [torch.zeros(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT,
            session_config=FAST_SESSION,
        )  # fmt: skip
        await producer.start()
        await consumer.start()
        try:
            targets = [TargetSpec(t, (i,), mode=TransferMode.PULL) for i, t in enumerate(IDS)]
            assert all(r.ok for r in await consumer.session.register_targets(targets))  # the agent reads none
            for i, t in enumerate(IDS):
                assert (await producer.claim(t)).state is TransferState.MATCHED
                producer.ready(t, [i], freed.put_nowait, mode=TransferMode.PULL)
            await eventually_ready(env.client)
            env.cut()
            done = await consumer.session.complete_transfers([CompletionSpec(t, 1) for t in IDS])
            assert all(r.state is TransferState.COMMITTED for r in done)
            assert freed.empty()
            env.back()
            await asyncio.wait_for(resynced.wait(), MUST)
            assert sorted([await asyncio.wait_for(freed.get(), MUST) for _ in IDS]) == IDS
        finally:
            env.back()
            await consumer.close()
            await producer.close()


async def test_an_abort_lost_with_the_watch_is_acknowledged_after_the_resync() -> None:
    """p0 holds six push assignments (their KV not computed yet) when its watch goes away, and the router aborts
    them: the service fences each generation until p0 says no WRITE of it can land, and d0's results wait for that.
    Before, p0's resync left them as they were (it ended only the sources the listing lacked, and acknowledged
    nothing): the generations stayed fenced, and d0's results never came. Now p0 asks, acknowledges, and d0's
    results come, failed as the abort says."""
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    async with away() as env:
        producer = prefill(env.proxied, "p0", 1)
        resynced = on_resynced(producer)
        consumer = decode_agent(env.client, [torch.zeros(8, 256, dtype=torch.uint8)], results)
        await producer.start()
        await consumer.start()
        try:
            for i, t in enumerate(IDS):
                assert (await consumer.register_target(t, [i])).state is TransferState.TARGETED
                assert (await producer.claim(t)).state is TransferState.MATCHED
            await wait_until(lambda: all(t in producer._assigned for t in IDS), MUST)
            env.cut()
            aborts = await env.client.abort_transfers("", [AbortSpec(t, WHY) for t in IDS])
            assert all((a.state, a.revoking_generation) == (TransferState.ABORTED, 1) for a in aborts)
            env.back()
            await asyncio.wait_for(resynced.wait(), MUST)
            ended = [await asyncio.wait_for(results.get(), MUST) for _ in IDS]
            assert sorted(r.transfer_id for r in ended) == IDS
            assert all((r.ok, r.reason, r.message) == (False, AbortReason.REQUESTED, WHY) for r in ended)
            assert all([(await env.client.get_transfer(t)).revoking_generation == 0 for t in IDS])
        finally:
            env.back()
            await consumer.close()
            await producer.close()


async def test_a_target_aborted_while_fenced_ends_once_no_write_can_land() -> None:
    """Both watches are away while the router aborts six push transfers p0 holds assignments of: the service fences
    each generation until p0 acknowledges. d0 comes back first. Before, its resync failed each at once (LOST), while
    p0 might still write into its blocks. Now d0 asks, sees the generation fenced, and reports nothing until p0,
    back too, acknowledged it; then each fails as the abort says."""
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    async with away() as env:
        p0_proxy = TcpProxy(env.server.port)
        await p0_proxy.start()
        async with AsyncRendezvousClient(client_config(p0_proxy.address)) as p0_client:
            producer = prefill(p0_client, "p0", 1)
            consumer = decode_agent(env.proxied, [torch.zeros(8, 256, dtype=torch.uint8)], results)
            resynced = on_resynced(consumer)
            await producer.start()
            await consumer.start()
            try:
                for i, t in enumerate(IDS):
                    assert (await consumer.register_target(t, [i])).state is TransferState.TARGETED
                    assert (await producer.claim(t)).state is TransferState.MATCHED
                await wait_until(lambda: all(t in producer._assigned for t in IDS), MUST)
                env.cut()
                p0_proxy.refuse(True)
                p0_proxy.cut()
                aborts = await env.client.abort_transfers("", [AbortSpec(t, WHY) for t in IDS])
                assert all((a.state, a.revoking_generation) == (TransferState.ABORTED, 1) for a in aborts)
                env.back()
                await asyncio.wait_for(resynced.wait(), MUST)  # d0 asked about each while handling it
                assert results.empty() and all(consumer.awaiting_result(t) for t in IDS)
                p0_proxy.refuse(False)
                for _ in IDS:
                    result = await asyncio.wait_for(results.get(), MUST)
                    assert (result.ok, result.reason, result.message) == (False, AbortReason.REQUESTED, WHY)
                    assert (await env.client.get_transfer(result.transfer_id)).revoking_generation == 0
                assert not any(consumer.awaiting_result(t) for t in IDS)
            finally:
                env.back()
                p0_proxy.refuse(False)
                await consumer.close()
                await producer.close()
                await p0_proxy.close()


@pytest.mark.parametrize("how", ["matched", "claimed"])
async def test_a_claim_that_ended_while_the_watch_was_away_is_acknowledged_and_its_source_freed(how: str) -> None:
    """p0 claimed six push transfers at admission (CLAIMED: no target yet) and holds nothing of them: no source (its
    KV is still being computed), no assignment. Its watch goes away while the router aborts them: once d0 targeted
    them ("matched": assigned to p0, and so fenced until p0 acknowledges), or before ("claimed"). The listing p0
    resyncs from lacks them, and nothing p0 held named them. Before, p0 asked nothing: d0's results waited for the
    tombstone's lifetime (300 s by default), and the sources `ready` handed over later were held for ever (no event
    would end them). Now p0 asks about the claims the listing lacks too: it acknowledges, d0's results come failed
    as the abort says, and a later `ready` frees each source at once."""
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    freed: asyncio.Queue[str] = asyncio.Queue()
    async with away() as env:
        producer = prefill(env.proxied, "p0", 1)
        resynced = on_resynced(producer)
        consumer = decode_agent(env.client, [torch.zeros(8, 256, dtype=torch.uint8)], results)
        await producer.start()
        await consumer.start()
        try:
            for t in IDS:
                assert (await producer.claim(t)).state is TransferState.CLAIMED
            env.cut()
            if how == "matched":
                for i, t in enumerate(IDS):
                    assert (await consumer.register_target(t, [i])).state is TransferState.MATCHED
            aborts = await env.client.abort_transfers("", [AbortSpec(t, WHY) for t in IDS])
            fenced = 1 if how == "matched" else 0
            assert all((a.state, a.revoking_generation) == (TransferState.ABORTED, fenced) for a in aborts)
            env.back()
            await asyncio.wait_for(resynced.wait(), MUST)
            if how == "matched":
                ended = [await asyncio.wait_for(results.get(), MUST) for _ in IDS]
                assert sorted(r.transfer_id for r in ended) == IDS
                assert all((r.ok, r.reason, r.message) == (False, AbortReason.REQUESTED, WHY) for r in ended)
                assert all([(await env.client.get_transfer(t)).revoking_generation == 0 for t in IDS])
            for i, t in enumerate(IDS):
                producer.ready(t, [i], freed.put_nowait)
            assert sorted([await asyncio.wait_for(freed.get(), MUST) for _ in IDS]) == IDS
            assert results.empty()
        finally:
            env.back()
            await consumer.close()
            await producer.close()


async def test_a_following_rank_that_held_nothing_of_an_abort_lost_with_its_watch_acknowledges_it_at_ready() -> None:
    """A producer of two ranks: rank 0 claimed six push transfers, and neither rank holds anything of them (KV still
    being computed) when both watches go away and the router aborts them once d0 targeted them. The service fences
    each generation until both ranks acknowledge. Rank 0 asks about its claims after its resync and acknowledges;
    rank 1 claimed nothing, holds nothing, and has nothing to ask about. Once the engine hands rank 1 the sources,
    it asks the service (`follower_check_s`) and frees them. Before, that check freed the source without
    acknowledging the generation the service still fenced for rank 1: d0's results waited for the tombstone's
    lifetime (300 s by default). Now it acknowledges, and d0's results come, failed as the abort says."""
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    freed: list[asyncio.Queue[str]] = [asyncio.Queue(), asyncio.Queue()]
    async with away() as env:
        producers = [
            ProducerAgent(
                env.proxied, "p0", "prefill", [torch.ones(8, 256, dtype=torch.uint8)], layout=TP2, rank=r,
                session_config=FAST_SESSION, follower_check_s=0.05,
            )
            for r in range(2)
        ]  # fmt: skip
        resynced = [on_resynced(p) for p in producers]
        consumers = [
            ConsumerAgent(
                env.client, "d0", "decode", [torch.zeros(8, 256, dtype=torch.uint8)], layout=TP2, rank=r,
                session_config=FAST_SESSION, on_result=results.put_nowait,
            )
            for r in range(2)
        ]  # fmt: skip
        await start_ranks(producers)
        await start_ranks(consumers)
        try:
            for t in IDS:
                assert (await producers[0].claim(t)).state is TransferState.CLAIMED
            env.cut()
            for i, t in enumerate(IDS):
                assert (await consumers[0].register_target(t, [i])).state is TransferState.MATCHED
            aborts = await env.client.abort_transfers("", [AbortSpec(t, WHY) for t in IDS])
            assert all((a.state, a.revoking_generation) == (TransferState.ABORTED, 1) for a in aborts)
            env.back()
            for done in resynced:
                await asyncio.wait_for(done.wait(), MUST)
            for producer, queue in zip(producers, freed, strict=True):
                for i, t in enumerate(IDS):
                    producer.ready(t, [i], queue.put_nowait)
            for queue in freed:
                assert sorted([await asyncio.wait_for(queue.get(), MUST) for _ in IDS]) == IDS
            ended = [await asyncio.wait_for(results.get(), MUST) for _ in IDS]
            assert sorted(r.transfer_id for r in ended) == IDS
            assert all((r.ok, r.reason, r.message) == (False, AbortReason.REQUESTED, WHY) for r in ended)
            assert all([(await env.client.get_transfer(t)).revoking_generation == 0 for t in IDS])
        finally:
            env.back()
            for consumer in reversed(consumers):
                await consumer.close()
            for producer in reversed(producers):
                await producer.close()
