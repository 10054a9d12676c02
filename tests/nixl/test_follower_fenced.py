"""A following consumer rank that asks about a target it expects (`follower_check_s`) and finds its generation still
fenced waits for REVOCATION_CONFIRMED, even one its handler takes between the service's answer and the rank's
reaction to it. Real service and NIXL agents on 127.0.0.1: decode "d0" and prefill "p0" have two ranks each, p0's
through a gRPC proxy that holds its acknowledgement of the revocation until the test lets it through."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from rendezvous.clients import (
    AbortReason,
    AbortSpec,
    AsyncRendezvousClient,
    EventType,
    SessionEvent,
    TransferInfo,
    TransferState,
)
from rendezvous.clients.nixl.consumer import ConsumerAgent, TransferResult
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.testing import AsyncTestServer
from tests.clients.conftest import FAST_SESSION, MUST, GrpcProxy, client, client_config, grpc_proxy, server, wait_until
from tests.nixl.test_pull_ends import TP2, started

__all__ = ["client", "grpc_proxy", "server"]

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]

WHY = "the router gave up"


def on_event(agent: ConsumerAgent, kind: EventType) -> asyncio.Future[None]:
    """Done once the agent's handler took an event of `kind`."""
    taken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    handle = agent.handle_event

    async def handle_event(item: SessionEvent) -> None:
        await handle(item)
        if getattr(item, "type", None) is kind and not taken.done():
            taken.set_result(None)

    agent.handle_event = handle_event  # type: ignore[method-assign]
    return taken


async def test_a_following_rank_whose_check_finds_a_fenced_abort_fails_it_once_confirmed(
    server: AsyncTestServer, grpc_proxy: GrpcProxy, client: AsyncRendezvousClient
) -> None:
    """p0 holds t1's assignment when the router aborts it: the service fences generation 1 until p0's ranks
    acknowledge, which the proxy holds. d0's rank 1 lags: it takes TRANSFER_ABORTED before it expects t1, then
    expects it and asks. The service answers ABORTED, fenced; before rank 1 reacts, p0's acknowledgement goes
    through and rank 1's handler takes REVOCATION_CONFIRMED. Before, the rank then waited for a confirmation already
    taken: its result never came (until a resync). Now it asks again, finds the fence lifted, and fails t1 as the
    abort says."""
    async with (
        AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied,
        AsyncRendezvousClient(client_config(server.address)) as rank1_client,
    ):
        producers = [
            ProducerAgent(proxied, "p0", "prefill", [torch.ones(8, 256, dtype=torch.uint8)], layout=TP2, rank=r)
            for r in range(2)
        ]
        results: list[asyncio.Queue[TransferResult]] = [asyncio.Queue(), asyncio.Queue()]
        consumers = [
            ConsumerAgent(
                c, "d0", "decode", [torch.zeros(8, 256, dtype=torch.uint8)], layout=TP2, rank=r,
                session_config=FAST_SESSION, on_result=results[r].put_nowait, follower_check_s=0.05,
            )
            for r, c in enumerate((client, rank1_client))
        ]  # fmt: skip
        aborted = on_event(consumers[1], EventType.TRANSFER_ABORTED)
        confirmed = on_event(consumers[1], EventType.REVOCATION_CONFIRMED)
        ask = rank1_client.get_transfer

        async def answered_then_confirmed(transfer_id: str, *args: Any, **kwargs: Any) -> TransferInfo:
            info = await ask(transfer_id, *args, **kwargs)
            if info.revoking_generation and not confirmed.done():
                grpc_proxy.let_through("AcknowledgeRevocations")
                await asyncio.wait_for(confirmed, MUST)
            return info

        rank1_client.get_transfer = answered_then_confirmed  # type: ignore[method-assign]
        async with started(producers, consumers):
            assert (await consumers[0].register_target("t1", [5])).state is TransferState.TARGETED
            assert (await producers[0].claim("t1")).state is TransferState.MATCHED
            await wait_until(lambda: all("t1" in p._assigned for p in producers), MUST)
            grpc_proxy.delay("AcknowledgeRevocations")
            (abort,) = await client.abort_transfers("", [AbortSpec("t1", WHY)])
            assert (abort.state, abort.revoking_generation) == (TransferState.ABORTED, 1)
            await asyncio.wait_for(aborted, MUST)  # rank 1 did not expect t1 yet
            assert (await consumers[1].register_target("t1", [5])).state is TransferState.TARGETED
            for r in range(2):
                result = await asyncio.wait_for(results[r].get(), MUST)
                assert (result.transfer_id, result.ok, result.reason, result.message) == (
                    "t1", False, AbortReason.REQUESTED, WHY
                )  # fmt: skip
            assert confirmed.done()
            assert not any(c.awaiting_result("t1") for c in consumers)
