"""A pull consumer of two ranks that registers a new generation of a transfer (preempted: new blocks) while one
rank has read the old one has every rank READ the new generation into the new blocks: the service counts only the
new generation's reports (a rank's READ of the old one no longer counts), so a rank that skipped it would leave the
generation MATCHED until its deadline. Real service and NIXL agents on 127.0.0.1: decode "d0" and prefill "p0" have
two ranks each; d0 reads t1's block 2 into its block 5 (generation 1), then into its block 6 (generation 2)."""

from __future__ import annotations

import asyncio

import pytest

from rendezvous.clients import AbortReason, AsyncRendezvousClient, EventType, SessionEvent, TransferMode, TransferState
from rendezvous.clients.nixl.consumer import AgentReason, ConsumerAgent, TransferResult
from rendezvous.clients.testing import AsyncTestServer
from tests.clients.conftest import MUST, client, server
from tests.nixl.test_pull_ends import hold_read_end, started, state_becomes, two_ranks

__all__ = ["client", "server"]

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]

UNSPECIFIED, REVOKED = AbortReason.UNSPECIFIED, AgentReason.REVOKED


def on_source_ready(agent: ConsumerAgent, generation: int) -> asyncio.Future[None]:
    """Done once the agent's handler took a SOURCE_READY of `generation`."""
    taken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    handle = agent.handle_event

    async def handle_event(item: SessionEvent) -> None:
        await handle(item)
        ready = getattr(item, "type", None) is EventType.SOURCE_READY and getattr(item, "generation", 0) == generation
        if ready and not taken.done():
            taken.set_result(None)

    agent.handle_event = handle_event  # type: ignore[method-assign]
    return taken


async def until_ok(results: asyncio.Queue[TransferResult], generation: int) -> list[TransferResult]:
    """The results up to the first ok one of `generation`."""
    got: list[TransferResult] = []
    while not got or not (got[-1].ok and got[-1].generation == generation):
        got.append(await asyncio.wait_for(results.get(), MUST))
    return got


@pytest.mark.parametrize("rank1", ["first", "after_its_source_ready"])
async def test_every_rank_reads_a_new_pull_generation_into_its_new_blocks(
    server: AsyncTestServer, client: AsyncRendezvousClient, rank1: str
) -> None:
    """Rank 0 read generation 1 (its report answered MATCHED: its share arrived); rank 1's READ of it is over, its
    end held. The engine is preempted and registers generation 2 into block 6, rank 1 before rank 0 or only once its
    handler took generation 2's SOURCE_READY (its worker lagged behind rank 0's). Both ranks read generation 2,
    which commits: each rank's block 6 holds its share. Before, a rank that heard SOURCE_READY before it expected
    the generation dropped it (its target was generation 1), never read, and generation 2 stayed MATCHED; here a rank
    asks the service only after an hour, so only the remembered SOURCE_READY can make it read in time."""
    producers, consumers, decode, results = two_ranks(client)
    held = hold_read_end(consumers[1])
    source_ready = on_source_ready(consumers[1], 2)
    async with started(producers, consumers):
        for consumer in consumers:
            assert (await consumer.register_target("t1", [5], mode=TransferMode.PULL)).ok
        assert (await producers[0].claim("t1")).ok
        producers[0].ready("t1", [2], mode=TransferMode.PULL)
        first = await asyncio.wait_for(results[0].get(), MUST)
        assert (first.transfer_id, first.generation, first.ok, first.block_ids) == ("t1", 1, True, (5,))
        end_rank1_read = await asyncio.wait_for(held, MUST)
        assert (await client.get_transfer("t1")).state is TransferState.MATCHED

        if rank1 == "first":
            assert (await consumers[1].register_target("t1", [6], 2, mode=TransferMode.PULL)).ok
        assert (await consumers[0].register_target("t1", [6], 2, mode=TransferMode.PULL)).ok
        if rank1 != "first":
            await asyncio.wait_for(source_ready, MUST)
            assert (await consumers[1].register_target("t1", [6], 2, mode=TransferMode.PULL)).ok
        end_rank1_read()  # its report of generation 1 is refused: stale

        ends = [await until_ok(results[r], 2) for r in range(2)]
        assert [(r.generation, r.ok, r.reason) for r in ends[0]] == [(1, False, REVOKED), (2, True, UNSPECIFIED)]
        assert [(r.generation, r.ok, r.block_ids) for r in ends[1]] == [(2, True, (6,))]
        assert all(bool((decode[r][0][6] == 1 + r).all()) for r in range(2))
        await state_becomes(client, "t1", TransferState.RELEASED)  # committed once both ranks read generation 2
        assert (await client.get_transfer("t1")).generation == 2
        assert not any(c.awaiting_result("t1") for c in consumers)
