"""A following rank of a push consumer whose worker lags behind rank 0's registration of a new generation (the
engine was preempted: new blocks) still expects the old one when the new one commits. Real service and NIXL agents
on 127.0.0.1: decode "d0" and prefill "p0" have two ranks each; d0 registers t1 into its block 5 (generation 1),
then rank 0 into block 6 (generation 2), which p0's ranks write and commit before d0's rank 1 expects it."""

from __future__ import annotations

import asyncio

import pytest

from rendezvous.clients import AbortReason, AsyncRendezvousClient, EventType, TransferState
from rendezvous.clients.nixl.consumer import AgentReason
from rendezvous.clients.testing import AsyncTestServer
from tests.clients.conftest import MUST, client, server
from tests.nixl.test_follower_fenced import on_event
from tests.nixl.test_pull_ends import started, state_becomes, two_ranks

__all__ = ["client", "server"]

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]


async def test_a_lagging_rank_takes_a_newer_generations_commit_heard_before_it_expected_it(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """Rank 1 still expects generation 1 when generation 2 is written (its notification is stale to it) and
    committed. It then expects generation 2: the commit it heard ends the expectation at once, with its share in
    block 6. Before, a rank that expected an older generation did not remember the commit (only a rank expecting
    nothing did) and waited for its periodic check with the service, here an hour away."""
    producers, consumers, decode, results = two_ranks(client, pull=False)
    committed = on_event(consumers[1], EventType.TRANSFER_COMMITTED)
    async with started(producers, consumers):
        for consumer in consumers:
            assert (await consumer.register_target("t1", [5])).state is TransferState.TARGETED
        assert (await consumers[0].register_target("t1", [6], 2)).ok  # preempted: rank 1's worker lags
        assert (await producers[0].claim("t1")).ok
        for producer in producers:
            producer.ready("t1", [2])
        await asyncio.wait_for(committed, MUST)  # rank 1 still expects generation 1
        assert consumers[1].awaiting_result("t1")

        assert (await consumers[1].register_target("t1", [6], 2)).state is TransferState.TARGETED
        got = await asyncio.wait_for(results[1].get(), MUST)
        assert (got.transfer_id, got.generation, got.ok, got.block_ids) == ("t1", 2, True, (6,))
        assert bool((decode[1][0][6] == 2).all())
        assert not decode[1][0][5].any()
        ends = [await asyncio.wait_for(results[0].get(), MUST) for _ in range(2)]
        assert sorted((r.generation, r.ok, r.reason) for r in ends) == [
            (1, False, AgentReason.REVOKED), (2, True, AbortReason.UNSPECIFIED)
        ]  # fmt: skip
        await state_becomes(client, "t1", TransferState.RELEASED)
        assert not any(c.awaiting_result("t1") for c in consumers)
