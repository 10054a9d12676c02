"""A RegisterTargets whose call fails in transit may still have been applied, and a producer may then write into
its blocks. The consumer agent sends it once more; should that fail too, it aborts the transfer and reports the
blocks free only once the service heard the abort. Here the service waits on a paused Redis, so a call times out
at the client while the service applies it afterwards: a registration in doubt for real, over real NIXL.

Redis holds the writes until the calls a test needs timed out, not for a fixed time: a pause of 2.5 s for two
1 s calls left half a second for the first call to be sent, which a loaded machine could spend, and then the
second call was answered instead of timing out."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis

from rendezvous.clients import AbortReason, AsyncRendezvousClient, DeadlineExceeded, TransferState
from rendezvous.clients.testing import TEST_LAYOUT, start_test_server
from tests.clients.conftest import WAIT, client_config
from tests.redis_fixtures import fresh_prefix, redis_url, with_prefix

__all__ = ["redis_url"]

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not importlib.util.find_spec("nixl"), reason="needs nixl"),
    pytest.mark.timeout(120),
]

CALL_TIMEOUT = 1.0


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[AsyncRendezvousClient]:
    store = with_prefix(redis_url, fresh_prefix()) + "&socket_timeout=10&op_timeout=10"
    async with start_test_server(store=store, grace=0.1) as server:
        config = dataclasses.replace(client_config(server.address), call_timeout=CALL_TIMEOUT)
        async with AsyncRendezvousClient(config) as c:
            yield c


HoldWrites = Callable[[int], list[DeadlineExceeded]]


@pytest.fixture
def hold_writes(client: AsyncRendezvousClient, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[HoldWrites]:
    """hold_writes(n): from now on Redis holds every write, the service's too (at most 9 s, within the store's
    10 s op_timeout), until n of the client's RegisterTargets calls timed out; it lets them go before the n-th
    timeout reaches the caller. Returns the timeouts seen (a list that grows)."""
    admin = redis.Redis.from_url(redis_url)
    register_targets = client.register_targets

    def hold(n: int) -> list[DeadlineExceeded]:
        timeouts: list[DeadlineExceeded] = []

        async def counted(*args: Any, **kwargs: Any) -> Any:
            try:
                return await register_targets(*args, **kwargs)
            except DeadlineExceeded as e:
                timeouts.append(e)
                if len(timeouts) == n:
                    admin.client_unpause()
                raise

        monkeypatch.setattr(client, "register_targets", counted)
        admin.client_pause(9_000, all=False)  # writes only: the unpause (no write) is served
        return timeouts

    try:
        yield hold
    finally:
        admin.client_unpause()
        admin.close()


async def test_a_registration_that_timed_out_is_sent_again_and_the_kv_arrives(
    client: AsyncRendezvousClient, hold_writes: HoldWrites
) -> None:
    import torch

    from rendezvous.clients.nixl.consumer import ConsumerAgent
    from rendezvous.clients.nixl.producer import ProducerAgent

    arrived: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    destination = torch.zeros(8, 256, dtype=torch.uint8)
    producer = ProducerAgent(client, "p0", "prefill", [torch.ones(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT)
    consumer = ConsumerAgent(client, "d0", "decode", [destination], layout=TEST_LAYOUT, on_result=arrived.set_result)
    await producer.start()
    await consumer.start()
    try:
        assert (await producer.claim("t1")).state is TransferState.CLAIMED
        timeouts = hold_writes(1)  # the first call times out; the second is answered
        result = await consumer.register_target("t1", [2, 3])
        assert result.ok and result.state is TransferState.MATCHED and len(timeouts) == 1
        producer.ready("t1", [0, 1])
        assert (await asyncio.wait_for(arrived, WAIT)).ok
        assert bool(destination[2:4].eq(1).all()) and not bool(destination[:2].any())
    finally:
        await producer.close()
        await consumer.close()


async def test_a_registration_that_timed_out_twice_is_aborted_before_its_blocks_go_back(
    client: AsyncRendezvousClient, hold_writes: HoldWrites
) -> None:
    import torch

    from rendezvous.clients.nixl.consumer import ConsumerAgent
    from rendezvous.clients.nixl.producer import ProducerAgent

    arrived: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    producer = ProducerAgent(client, "p0", "prefill", [torch.ones(8, 256, dtype=torch.uint8)], layout=TEST_LAYOUT)
    consumer = ConsumerAgent(
        client,
        "d0",
        "decode",
        [torch.zeros(8, 256, dtype=torch.uint8)],
        layout=TEST_LAYOUT,
        on_result=arrived.set_result,
    )
    await producer.start()
    await consumer.start()
    try:
        assert (await producer.claim("t1")).state is TransferState.CLAIMED
        timeouts = hold_writes(2)  # both calls time out; the abort is answered
        result = await consumer.register_target("t1", [2, 3])
        assert result.state is TransferState.ABORTED and isinstance(result.error, DeadlineExceeded)
        assert len(timeouts) == 2
        failed = await asyncio.wait_for(arrived, WAIT)
        assert not failed.ok and failed.reason is AbortReason.REQUESTED and failed.block_ids == (2, 3)
        assert not consumer.awaiting_result("t1")
        info = await client.get_transfer("t1")  # the abort ended it, or the registration never stood
        assert info.state is TransferState.ABORTED or info.consumer_engine_id == ""  # either way no write can land
    finally:
        await producer.close()
        await consumer.close()
