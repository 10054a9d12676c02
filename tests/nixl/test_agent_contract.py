"""What the agents refuse at once rather than leak or accept unchecked (issue 29's footguns)."""

from __future__ import annotations

import asyncio
import inspect
import re
import threading
from pathlib import Path

import pytest
import torch

from rendezvous.clients import AbortSpec, AsyncRendezvousClient, KvLayout, Reason, TransferState
from rendezvous.clients.nixl.consumer import ConsumerAgent
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.nixl.rank import RankOptions
from rendezvous.clients.testing import TEST_LAYOUT
from tests.clients.conftest import WAIT, client, server

__all__ = ["client", "server"]


@pytest.mark.parametrize("agent", [ConsumerAgent, ProducerAgent])
@pytest.mark.parametrize(
    "layout",
    [None, KvLayout(), KvLayout(model_fingerprint="", num_layers=2), KvLayout(model_fingerprint="m", num_layers=0)],
)
async def test_an_agent_without_a_stated_layout_is_refused_at_construction(
    client: AsyncRendezvousClient, agent: type[ConsumerAgent | ProducerAgent], layout: KvLayout | None
) -> None:
    with pytest.raises(ValueError, match=f"{agent.__name__} needs .* model_fingerprint and num_layers"):
        agent(client, "e0", "pool", [torch.zeros(8, 256, dtype=torch.uint8)], layout=layout)


async def test_ready_for_a_transfer_never_claimed_is_refused(client: AsyncRendezvousClient) -> None:
    freed: list[str] = []
    producer = ProducerAgent(client, "p0", "prefill", [torch.ones(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT)
    await producer.start()
    try:
        with pytest.raises(ValueError, match="never claimed"):
            producer.ready("t1", [0, 1], freed.append)
        assert (await producer.claim("t2")).state is TransferState.CLAIMED
        producer.ready("t2", [0, 1], freed.append)  # claimed: accepted, waiting for its assignment
        assert freed == []
    finally:
        await producer.close()
    assert freed == ["t2"]  # closing frees what waited; "t1" was never taken


async def test_parts_of_a_transfer_never_claimed_are_freed_when_its_ready_is_refused(
    client: AsyncRendezvousClient,
) -> None:
    freed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    producer = ProducerAgent(client, "p0", "prefill", [torch.ones(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT)
    await producer.start()
    try:
        producer.ready_part("t1", [0], 16, prompt_tokens=32, on_free=freed.set_result)  # before any claim
        with pytest.raises(ValueError, match="never claimed"):
            producer.ready("t1", [0, 1])
        assert await asyncio.wait_for(freed, WAIT) == "t1"
    finally:
        await producer.close()


async def test_ready_after_a_refused_claim_frees_the_blocks_at_once(client: AsyncRendezvousClient) -> None:
    freed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    producer = ProducerAgent(client, "p0", "prefill", [torch.ones(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT)
    await producer.start()
    try:
        await client.abort_transfer("", AbortSpec("t1", "the router gave up"))  # before any half arrived
        claim = await producer.claim("t1")
        assert claim.error is not None and claim.error.reason == "TRANSFER_ENDED"
        producer.ready("t1", [0, 1], freed.set_result)
        assert await asyncio.wait_for(freed, WAIT) == "t1"
    finally:
        await producer.close()


async def test_every_callback_runs_on_the_agents_event_loop(client: AsyncRendezvousClient) -> None:
    threads: list[int] = []
    all_three = asyncio.Event()

    def called(_: object) -> None:  # as on_result, on_report and on_free
        threads.append(threading.get_ident())
        if len(threads) == 3:
            all_three.set()

    producer = ProducerAgent(
        client, "p0", "prefill", [torch.ones(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT, on_report=called
    )
    consumer = ConsumerAgent(
        client, "d0", "decode", [torch.zeros(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT, on_result=called
    )
    await producer.start()
    await consumer.start()
    try:
        await consumer.register_target("t1", [2, 3])
        await producer.claim("t1")
        producer.ready("t1", [0, 1], called)
        await asyncio.wait_for(all_three.wait(), WAIT)
    finally:
        await producer.close()
        await consumer.close()
    assert threads == [threading.get_ident()] * 3  # the loop's thread, never the writer's or the receiver's


async def test_the_agents_abort_returns_a_refused_item_rather_than_raising(client: AsyncRendezvousClient) -> None:
    """Item calls return their errors, session calls raise (docs/architecture.md): `abort` is an item call."""
    tensors = [torch.ones(8, 256, dtype=torch.uint8)]
    producer = ProducerAgent(client, "p0", "prefill", tensors, layout=TEST_LAYOUT)
    consumer = ConsumerAgent(client, "d0", "decode", [torch.zeros(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT)
    await producer.start()
    await consumer.start()
    try:
        for agent in (producer, consumer):
            refused = await agent.abort("not an id", "whitespace is refused")
            assert not refused.ok and refused.error is not None and refused.error.reason == Reason.ID_INVALID
        assert (await producer.abort("t1")).ok  # an unknown id: aborted (a tombstone tells a late half)
    finally:
        await consumer.close()
        await producer.close()


def test_every_agent_option_is_in_the_architecture_options_table() -> None:
    """Options found only by introspection were a footgun (issue 29): each keyword an agent takes has a row."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    first_cells = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    documented = {name for cell in first_cells for name in re.findall(r"`(\w+)`", cell)}
    keywords = set(RankOptions.__annotations__)
    for agent in (ProducerAgent, ConsumerAgent):
        parameters = inspect.signature(agent.__init__).parameters.values()
        keywords |= {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords - documented == set()
