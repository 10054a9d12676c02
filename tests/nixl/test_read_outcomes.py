"""A pull-mode ConsumerAgent reports each READ as the incarnation whose SOURCE_READY it answers: a READ that ends
after the engine re-registered, or whose report is refused for it, is not reported as the new incarnation, and the
new incarnation's match of the same transfer and generation is read again. Real service and NIXL agents on
127.0.0.1: decode "d0" reads t1 from prefill "p0", which dies; the service restarts, and in its new epoch prefill
"p1" makes its own blocks t1's source."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from rendezvous.clients import (
    AsyncRendezvousClient,
    EventType,
    Reregistered,
    SessionEvent,
    SourceReadySpec,
    TransferMode,
    TransferState,
)
from rendezvous.clients.nixl.consumer import ConsumerAgent, TransferResult
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.testing import TEST_LAYOUT, AsyncTestServer
from tests.clients.conftest import FAST_SESSION, MUST, WAIT, GrpcProxy, client, client_config, grpc_proxy, server
from tests.nixl.helpers import on_reregistered

__all__ = ["client", "grpc_proxy", "server"]

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]


def prefill(client: AsyncRendezvousClient, engine_id: str, fill: int) -> ProducerAgent:
    """A pull-mode producer whose 8 blocks of 256 bytes all hold `fill`."""
    kv = [torch.full((8, 256), fill, dtype=torch.uint8)]
    return ProducerAgent(client, engine_id, "prefill", kv, layout=TEST_LAYOUT, serve_reads=True)


def decode_agent(
    client: AsyncRendezvousClient, decode: list[torch.Tensor], results: asyncio.Queue[TransferResult]
) -> ConsumerAgent:
    return ConsumerAgent(
        client, "d0", "decode", decode, layout=TEST_LAYOUT, session_config=FAST_SESSION, on_result=results.put_nowait
    )


async def p1_takes_over(
    server: AsyncTestServer, consumer_back: asyncio.Future[Reregistered], p1: ProducerAgent
) -> None:
    """The service restarts; decode re-asserts t1 in the new epoch, and p1 claims it and makes its block 3 the
    source: t1 is matched again, generation 1 again."""
    await server.restart()
    taken = await asyncio.wait_for(consumer_back, MUST)
    assert [(r.transfer_id, r.state) for r in taken.results] == [("t1", TransferState.TARGETED)]
    await p1.start()
    assert (await p1.claim("t1")).state is TransferState.MATCHED
    p1.ready("t1", [3], mode=TransferMode.PULL)


async def read_from_p1(
    client: AsyncRendezvousClient, decode: list[torch.Tensor], results: asyncio.Queue[TransferResult]
) -> None:
    """t1's one result is ok, with p1's bytes, once that READ's report committed the new match."""
    result = await asyncio.wait_for(results.get(), MUST)
    assert (result.transfer_id, result.generation, result.ok) == ("t1", 1, True), result
    assert bool((decode[0][5] == 2).all()) and int(torch.count_nonzero(decode[0])) == 256  # p1's bytes
    assert (await client.get_transfer("t1")).state in (TransferState.COMMITTED, TransferState.RELEASED)
    assert results.empty()


def on_source_ready(agent: ConsumerAgent, count: int, first: asyncio.Future[None] | None) -> asyncio.Future[None]:
    """Done once the agent's handler took its `count`th SOURCE_READY; the first waits for `first`, when given."""
    taken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    handle, seen = agent.handle_event, 0

    async def handle_event(item: SessionEvent) -> None:
        nonlocal seen
        if getattr(item, "type", None) is EventType.SOURCE_READY and seen == 0 and first is not None:
            await first
        await handle(item)
        if getattr(item, "type", None) is EventType.SOURCE_READY:
            seen += 1
            if seen == count and not taken.done():
                taken.set_result(None)

    agent.handle_event = handle_event  # type: ignore[method-assign]
    return taken


@pytest.mark.parametrize("first_read", ["succeeded", "failed"])
async def test_a_read_that_ends_after_a_restart_is_read_again_for_the_new_incarnation(
    server: AsyncTestServer, client: AsyncRendezvousClient, first_read: str
) -> None:
    """Decode reads t1 from prefill p0; the READ ends (its bytes landed, or it failed: p0 died first) but reaches
    the agent's loop only after the service restarted, decode re-registered and re-asserted t1, and another prefill
    engine, p1, made its own blocks the source of t1: the new epoch matched t1 again, generation 1 again, and sent
    the new incarnation SOURCE_READY, with other source blocks. Before the fix the old READ's outcome went to the
    service as the new incarnation: a SUCCEEDED committed p1's match without reading p1's blocks (decode kept p0's
    bytes), a FAILED aborted it; and the new SOURCE_READY was ignored as a read under way. Now the old outcome is not
    sent (it answers the replaced incarnation's SOURCE_READY), and the target is read again from p1 once the old READ
    is over: decode is told t1 arrived only with p1's bytes, once that READ's report committed the new match."""
    loop = asyncio.get_running_loop()
    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    consumer = decode_agent(client, decode, results)
    held: asyncio.Future[tuple[Any, ...]] = loop.create_future()
    read_done = consumer._read_done

    def hold_the_first(*args: Any) -> None:
        if held.done():
            read_done(*args)
        else:
            held.set_result(args)  # the first READ ended on the receiver thread; its end reaches the agent later

    consumer._read_done = hold_the_first  # type: ignore[method-assign, assignment]
    gone: asyncio.Future[None] | None = None if first_read == "succeeded" else loop.create_future()
    consumer_back, second_ready = on_reregistered(consumer), on_source_ready(consumer, 2, gone)
    old, new = prefill(client, "p0", 1), prefill(client, "p1", 2)
    await old.start()
    await consumer.start()
    try:
        assert (await consumer.register_target("t1", [5], mode=TransferMode.PULL)).ok
        assert (await old.claim("t1")).ok
        assert (await old.session.mark_source_ready(SourceReadySpec("t1", [2]))).ok
        if gone is not None:  # p0 dies before decode READs its blocks: the READ fails
            await old.close(deregister=False)
            gone.set_result(None)
        _, generation, ok, error, *_ = await asyncio.wait_for(held, WAIT)
        assert (generation, ok) == (1, first_read == "succeeded"), error
        assert ok or "p0-rank0" in (error or ""), error  # failed: p0's agent cannot be reached
        assert bool((decode[0][5] == (1 if ok else 0)).all())
        if gone is None:
            await old.close(deregister=False)  # p0 dies: the new epoch will not hear of it

        await p1_takes_over(server, consumer_back, new)
        await asyncio.wait_for(second_ready, MUST)  # the new incarnation's SOURCE_READY, with p1's blocks
        read_done(*held.result())  # the old READ's end reaches the agent now
        await read_from_p1(client, decode, results)
    finally:
        await new.close()
        await consumer.close()
        await old.close()


async def test_a_read_whose_report_is_refused_after_a_restart_does_not_arrive_and_is_read_again(
    server: AsyncTestServer, client: AsyncRendezvousClient, grpc_proxy: GrpcProxy
) -> None:
    """Decode reads t1 from p0 and reports it, but the report is held at a proxy while p0 dies, the service restarts,
    decode re-registers and p1 takes t1 over. Let through, it reaches the new epoch as the replaced incarnation's,
    and is refused (STALE_INCARNATION). Before the fix decode was told t1 arrived as soon as the READ ended, with
    p0's bytes, and the SDK sent the report again as the new incarnation, committing p1's match unread. Now the bytes
    arrive only once the report is taken: refused, it is not sent again, and t1 is read again from p1."""
    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    async with AsyncRendezvousClient(client_config(grpc_proxy.address)) as proxied:
        consumer = decode_agent(proxied, decode, results)
        consumer_back, second_ready = on_reregistered(consumer), on_source_ready(consumer, 2, None)
        old, new = prefill(client, "p0", 1), prefill(client, "p1", 2)
        await old.start()
        await consumer.start()
        try:
            assert (await consumer.register_target("t1", [5], mode=TransferMode.PULL)).ok
            assert (await old.claim("t1")).ok
            grpc_proxy.delay("CompleteTransfers")
            old.ready("t1", [2], mode=TransferMode.PULL)
            await grpc_proxy.wait_for(lambda: grpc_proxy.delayed["CompleteTransfers"] == 1)  # the READ's report
            assert bool((decode[0][5] == 1).all())  # p0's bytes are in, but the report was not answered:
            assert results.empty()  # before the fix, decode was told t1 arrived
            await old.close(deregister=False)  # p0 dies: the new epoch will not hear of it

            await p1_takes_over(server, consumer_back, new)
            await asyncio.wait_for(second_ready, MUST)  # the new incarnation's SOURCE_READY, with p1's blocks
            grpc_proxy.let_through("CompleteTransfers")
            await read_from_p1(client, decode, results)
        finally:
            await new.close()
            await consumer.close()
            await old.close()
