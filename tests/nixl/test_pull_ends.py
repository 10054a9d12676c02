"""How a pull-mode ConsumerAgent's target ends once its READ is over: a committed target is dropped (and released by
rank 0) on every rank, whichever rank's report committed it. Real service and NIXL agents on 127.0.0.1: decode "d0"
reads t1's block 2 from prefill "p0" into its block 5."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rendezvous.clients import AsyncRendezvousClient, KvLayout, TransferMode, TransferState
from rendezvous.clients.nixl.consumer import ConsumerAgent, TransferResult
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.nixl.rank import start_ranks
from rendezvous.clients.testing import AsyncTestServer
from tests.clients.conftest import FAST_SESSION, MUST, WAIT, client, server, wait_until
from tests.nixl.test_read_outcomes import decode_agent, prefill

__all__ = ["client", "server"]

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]


def hold_read_end(agent: ConsumerAgent) -> asyncio.Future[Callable[[], None]]:
    """Resolved once the agent's first READ ended on its receiver thread, with what hands that end to the agent
    (held until then). Set before the agent opens: the thread is given the callback then."""
    held: asyncio.Future[Callable[[], None]] = asyncio.get_running_loop().create_future()
    read_done = agent._read_done

    def hold_the_first(*args: Any) -> None:
        if held.done():
            read_done(*args)
        else:
            held.set_result(lambda: read_done(*args))

    agent._read_done = hold_the_first  # type: ignore[method-assign, assignment]
    return held


async def state_becomes(client: AsyncRendezvousClient, transfer_id: str, state: TransferState) -> None:
    """Until the service has the transfer in `state` (a release is sent in the background)."""

    async def poll() -> None:
        while (await client.get_transfer(transfer_id)).state is not state:  # noqa: ASYNC110 (no event says so)
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), MUST)


async def test_a_committed_pull_target_leaves_the_receiver_expecting_nothing(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """The READ's report commits t1: the target is dropped and released. Before the fix the receiver thread was not
    told, and went on polling NIXL as fast as when writes are expected."""
    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    consumer = decode_agent(client, decode, results)
    producer = prefill(client, "p0", 1)
    await producer.start()
    await consumer.start()
    try:
        assert (await consumer.register_target("t1", [5], mode=TransferMode.PULL)).ok
        assert consumer._thread is not None and consumer._thread._expecting.is_set()
        assert (await producer.claim("t1")).ok
        producer.ready("t1", [2], mode=TransferMode.PULL)
        result = await asyncio.wait_for(results.get(), MUST)
        assert (result.transfer_id, result.ok) == ("t1", True) and bool((decode[0][5] == 1).all())
        assert not consumer.awaiting_result("t1")
        assert not consumer._thread._expecting.is_set()
        await state_becomes(client, "t1", TransferState.RELEASED)
    finally:
        await consumer.close()
        await producer.close()


TP2 = KvLayout("m", "uint8", 16, 1, tp_size=2, kv_layout="HND", num_kv_heads=2)


@pytest.mark.parametrize("last", [0, 1])
async def test_every_rank_drops_a_pull_target_once_committed(
    server: AsyncTestServer, client: AsyncRendezvousClient, last: int
) -> None:
    """Decode d0 has two ranks (one process each in production, the agents of rank 1 following rank 0's
    registration), reading their shares from p0's ranks. Each reports its own READ; the last report commits t1.
    Before the fix the other rank never dropped its target (no event tells a pull consumer of a commit): rank 0
    kept it for ever and never released t1 (the service did, after `release_timeout`), rank 1 until the service
    forgot t1, asking about it every `follower_check_s` meanwhile. Now both drop it and rank 0 releases t1,
    whichever rank's report committed it."""
    producers = [
        ProducerAgent(
            client, "p0", "prefill", [torch.full((8, 256), 1 + r, dtype=torch.uint8)], layout=TP2, rank=r,
            serve_reads=True,
        )
        for r in range(2)
    ]  # fmt: skip
    decode = [[torch.zeros(8, 256, dtype=torch.uint8)] for _ in range(2)]
    results: list[asyncio.Queue[TransferResult]] = [asyncio.Queue(), asyncio.Queue()]
    consumers = [
        ConsumerAgent(
            client, "d0", "decode", decode[r], layout=TP2, rank=r, session_config=FAST_SESSION,
            on_result=results[r].put_nowait, follower_check_s=0.05,
        )
        for r in range(2)
    ]  # fmt: skip
    held = hold_read_end(consumers[last])
    await start_ranks(producers)
    await start_ranks(consumers)
    try:
        for consumer in consumers:
            assert (await consumer.register_target("t1", [5], mode=TransferMode.PULL)).ok
        assert (await producers[0].claim("t1")).ok
        producers[0].ready("t1", [2], mode=TransferMode.PULL)
        first = await asyncio.wait_for(results[1 - last].get(), MUST)  # its share: its report answered MATCHED
        assert (first.transfer_id, first.ok) == ("t1", True)
        assert (await client.get_transfer("t1")).state is TransferState.MATCHED
        (await asyncio.wait_for(held, WAIT))()  # the last rank's READ ends: its report commits t1
        assert (await asyncio.wait_for(results[last].get(), MUST)).ok
        assert all(bool((decode[r][0][5] == 1 + r).all()) for r in range(2))

        await wait_until(lambda: not any(c.awaiting_result("t1") for c in consumers), MUST)
        await state_becomes(client, "t1", TransferState.RELEASED)  # rank 0 released it
        assert not any(c._thread is not None and c._thread._expecting.is_set() for c in consumers)
        assert all(r.empty() for r in results)
    finally:
        for consumer in reversed(consumers):
            await consumer.close()
        for producer in reversed(producers):
            await producer.close()
