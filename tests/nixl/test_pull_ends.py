"""How a pull-mode ConsumerAgent's target ends once its READ is over: its bytes arrive only when the service took the
READ's report, never when it refused it (the transfer ended while it was read), whichever decode hears of first; a
committed target is dropped (and released by rank 0) on every rank, whichever rank's report committed it. Real
service and NIXL agents on 127.0.0.1: decode "d0" reads t1's block 2 from prefill "p0" into its block 5."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
import torch

from rendezvous.clients import (
    AbortReason,
    AbortSpec,
    AsyncRendezvousClient,
    ClientConfig,
    EventType,
    ItemResult,
    KvLayout,
    RetryPolicy,
    SessionEvent,
    TransferMode,
    TransferState,
)
from rendezvous.clients.nixl.consumer import AgentReason, ConsumerAgent, TransferResult
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.nixl.rank import start_ranks
from rendezvous.clients.testing import TEST_LAYOUT, AsyncTestServer, start_test_server
from rendezvous.core.limits import Timeouts
from rendezvous.protocol.errors import NotFound, Unavailable
from tests.clients.conftest import (
    FAST_SESSION,
    MUST,
    WAIT,
    GrpcProxy,
    client,
    client_config,
    grpc_proxy,
    server,
    wait_until,
)
from tests.nixl.test_read_outcomes import decode_agent, prefill

__all__ = ["client", "grpc_proxy", "server"]

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]

WHY = "the router gave up"


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


def hold_aborts(agent: ConsumerAgent) -> tuple[asyncio.Future[None], asyncio.Future[None]]:
    """The agent's handler takes a TRANSFER_ABORTED only once the first future is done; the second is done once
    it took one."""
    loop = asyncio.get_running_loop()
    go: asyncio.Future[None] = loop.create_future()
    taken: asyncio.Future[None] = loop.create_future()
    handle = agent.handle_event

    async def handle_event(item: SessionEvent) -> None:
        aborted = getattr(item, "type", None) is EventType.TRANSFER_ABORTED
        if aborted:
            await go
        await handle(item)
        if aborted and not taken.done():
            taken.set_result(None)

    agent.handle_event = handle_event  # type: ignore[method-assign]
    return go, taken


def on_read_reported(agent: ConsumerAgent) -> asyncio.Future[None]:
    """Done once the agent took the answer to a READ's report."""
    answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    read_reported = agent._read_reported

    def took(*args: Any) -> None:
        read_reported(*args)
        if not answered.done():
            answered.set_result(None)

    agent._read_reported = took  # type: ignore[method-assign, assignment]
    return answered


async def state_becomes(client: AsyncRendezvousClient, transfer_id: str, state: TransferState) -> None:
    """Until the service has the transfer in `state` (a release is sent in the background)."""

    async def poll() -> None:
        while (await client.get_transfer(transfer_id)).state is not state:  # noqa: ASYNC110 (no event says so)
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), MUST)


async def forgotten(client: AsyncRendezvousClient, transfer_id: str) -> None:
    """Until the service forgot the transfer (its tombstone aged)."""

    async def poll() -> None:
        while True:
            try:
                await client.get_transfer(transfer_id)
            except NotFound:
                return
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), MUST)


@pytest.mark.parametrize("first", ["answer", "event"])
async def test_a_read_of_a_transfer_aborted_meanwhile_fails_whichever_decode_hears_of_first(
    server: AsyncTestServer, client: AsyncRendezvousClient, first: str
) -> None:
    """The router aborts t1 while decode READs it: p0 frees its source, which it may reuse before the READ is over,
    so the bytes read are not to be trusted. The READ's SUCCEEDED is answered "already ABORTED". Before the fix,
    when that answer reached the agent before the TRANSFER_ABORTED event, decode was told t1 arrived ok (and the
    event was then ignored, t1 having arrived); the other way round, it failed. Now it fails either way, with the
    abort's reason and message."""
    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    consumer = decode_agent(client, decode, results)
    read_end, (event_go, event_taken) = hold_read_end(consumer), hold_aborts(consumer)
    answered = on_read_reported(consumer)
    producer = prefill(client, "p0", 1)
    await producer.start()
    await consumer.start()
    try:
        assert (await consumer.register_target("t1", [5], mode=TransferMode.PULL)).ok
        assert (await producer.claim("t1")).ok
        producer.ready("t1", [2], mode=TransferMode.PULL)
        release = await asyncio.wait_for(read_end, WAIT)  # the READ is over; the agent hears of it later
        assert bool((decode[0][5] == 1).all())
        assert (await client.abort_transfer("", AbortSpec("t1", WHY))).state is TransferState.ABORTED
        if first == "event":
            event_go.set_result(None)
            await asyncio.wait_for(event_taken, WAIT)
            release()
        else:
            release()
            await asyncio.wait_for(answered, WAIT)  # the report's answer: t1 is ABORTED
            event_go.set_result(None)
        result = await asyncio.wait_for(results.get(), MUST)
        assert (result.transfer_id, result.ok) == ("t1", False)
        assert (result.reason, result.message) == (AbortReason.REQUESTED, WHY)
        await asyncio.wait_for(event_taken, WAIT)
        assert results.empty() and not consumer.awaiting_result("t1")
    finally:
        await consumer.close()
        await producer.close()


@pytest.fixture
async def forgetful() -> AsyncIterator[AsyncTestServer]:
    """A service that forgets an ended transfer a tenth of a second after it ended."""
    async with start_test_server(
        timeouts=Timeouts(default_lease_ttl=5.0, tombstone_ttl=0.1), sweep_interval=0.02, grace=0.1
    ) as srv:
        yield srv


async def test_a_read_whose_report_is_refused_fails_lost(forgetful: AsyncTestServer) -> None:
    """The router aborts t1 while decode READs it, and the service forgets t1 before the READ's SUCCEEDED reaches it
    (its TRANSFER_ABORTED held on the way): the report is refused TRANSFER_NOT_FOUND. Before the fix decode was told
    t1 arrived ok. Now it fails at once, LOST, saying what the service answered; the event changes nothing."""
    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    async with AsyncRendezvousClient(client_config(forgetful.address)) as client:
        consumer = decode_agent(client, decode, results)
        read_end, (event_go, event_taken) = hold_read_end(consumer), hold_aborts(consumer)
        producer = prefill(client, "p0", 1)
        await producer.start()
        await consumer.start()
        try:
            assert (await consumer.register_target("t1", [5], mode=TransferMode.PULL)).ok
            assert (await producer.claim("t1")).ok
            producer.ready("t1", [2], mode=TransferMode.PULL)
            release = await asyncio.wait_for(read_end, WAIT)
            assert (await client.abort_transfer("", AbortSpec("t1", WHY))).state is TransferState.ABORTED
            await forgotten(client, "t1")
            release()
            result = await asyncio.wait_for(results.get(), MUST)
            assert (result.transfer_id, result.ok, result.reason) == ("t1", False, AgentReason.LOST)
            assert "refused the READ's report" in result.message and "TRANSFER_NOT_FOUND" in result.message
            event_go.set_result(None)
            await asyncio.wait_for(event_taken, WAIT)
            assert results.empty() and not consumer.awaiting_result("t1")
        finally:
            await consumer.close()
            await producer.close()


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


def lose_report_answers(agent: ConsumerAgent) -> None:
    """The answers to the agent's READ reports are lost on the way back: the service took each report, and the
    agent sees its call fail."""
    read_reported = agent._read_reported

    def lost(transfer_id: str, generation: int, arrived: float, future: asyncio.Future[ItemResult]) -> None:
        failed: asyncio.Future[ItemResult] = asyncio.get_running_loop().create_future()
        failed.set_exception(Unavailable("UNAVAILABLE", "the answer was lost"))
        read_reported(transfer_id, generation, arrived, failed)

    agent._read_reported = lost  # type: ignore[method-assign]


async def test_a_pull_commit_whose_answer_was_lost_is_released_on_asking(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """d0's one rank reports its READ, which commits t1 (naming every rank: no event tells d0 of it), and the
    answer is lost. The bytes arrive all the same, and rank 0 asks about t1 (`follower_check_s`): it finds t1
    committed, drops it and releases it. The one case left where rank 0 asks."""
    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    consumer = ConsumerAgent(
        client, "d0", "decode", decode, layout=TEST_LAYOUT, session_config=FAST_SESSION,
        on_result=results.put_nowait, follower_check_s=0.05,
    )  # fmt: skip
    lose_report_answers(consumer)
    producer = prefill(client, "p0", 1)
    await producer.start()
    await consumer.start()
    try:
        assert (await consumer.register_target("t1", [5], mode=TransferMode.PULL)).ok
        assert (await producer.claim("t1")).ok
        producer.ready("t1", [2], mode=TransferMode.PULL)
        result = await asyncio.wait_for(results.get(), MUST)
        assert (result.transfer_id, result.ok) == ("t1", True) and bool((decode[0][5] == 1).all())
        await state_becomes(client, "t1", TransferState.RELEASED)
        await wait_until(lambda: not consumer.awaiting_result("t1"), MUST)
        assert results.empty()
    finally:
        await consumer.close()
        await producer.close()


TP2 = KvLayout("m", "uint8", 16, 1, tp_size=2, kv_layout="HND", num_kv_heads=2)
HOUR = 3600.0


def two_ranks(
    client: AsyncRendezvousClient, *, pull: bool = True
) -> tuple[list[ProducerAgent], list[ConsumerAgent], list[list[torch.Tensor]], list[asyncio.Queue[TransferResult]]]:
    """Prefill p0 and decode d0 of two ranks each, not started: p0's ranks hold blocks filled with 1 + rank (and
    serve READs of them, `pull`), d0's zeroed blocks take them, and its ranks report their results to a queue each
    and ask the service only after an hour."""
    producers = [
        ProducerAgent(
            client, "p0", "prefill", [torch.full((8, 256), 1 + r, dtype=torch.uint8)], layout=TP2, rank=r,
            serve_reads=pull,
        )
        for r in range(2)
    ]  # fmt: skip
    decode = [[torch.zeros(8, 256, dtype=torch.uint8)] for _ in range(2)]
    results: list[asyncio.Queue[TransferResult]] = [asyncio.Queue(), asyncio.Queue()]
    consumers = [
        ConsumerAgent(
            client, "d0", "decode", decode[r], layout=TP2, rank=r, session_config=FAST_SESSION,
            on_result=results[r].put_nowait, follower_check_s=HOUR,
        )
        for r in range(2)
    ]  # fmt: skip
    return producers, consumers, decode, results


@asynccontextmanager
async def started(producers: list[ProducerAgent], consumers: list[ConsumerAgent]) -> AsyncIterator[None]:
    """Both engines' ranks started (`start_ranks`), and closed in reverse on the way out."""
    await start_ranks(producers)
    await start_ranks(consumers)
    try:
        yield
    finally:
        for consumer in reversed(consumers):
            await consumer.close()
        for producer in reversed(producers):
            await producer.close()


@pytest.mark.parametrize("last", [0, 1])
async def test_every_rank_drops_a_pull_target_once_committed(
    server: AsyncTestServer, client: AsyncRendezvousClient, last: int
) -> None:
    """Decode d0 has two ranks (one process each in production, the agents of rank 1 following rank 0's
    registration), reading their shares from p0's ranks. Each reports its own READ; the last report commits t1.
    The other rank, answered MATCHED before, hears of the commit from the TRANSFER_COMMITTED the service sends d0:
    both drop t1 and rank 0 releases it at once, whichever rank's report committed it. Before, no event told a
    pull consumer of a commit: that rank asked every `follower_check_s` (5 s by default), so rank 0 released t1
    that late (one GetTransfer each); here a rank asks only after an hour, so only the event can end t1 in time,
    and rank 0 no longer asks at all."""
    producers, consumers, decode, results = two_ranks(client)
    held = hold_read_end(consumers[last])
    async with started(producers, consumers):
        for consumer in consumers:
            assert (await consumer.register_target("t1", [5], mode=TransferMode.PULL)).ok
        assert (await producers[0].claim("t1")).ok
        producers[0].ready("t1", [2], mode=TransferMode.PULL)
        first = await asyncio.wait_for(results[1 - last].get(), MUST)  # its share: its report answered MATCHED
        assert (first.transfer_id, first.ok) == ("t1", True)
        assert (await client.get_transfer("t1")).state is TransferState.MATCHED
        assert not consumers[0]._checks  # rank 0 asks nothing: the commit's event is to come
        (await asyncio.wait_for(held, WAIT))()  # the last rank's READ ends: its report commits t1
        assert (await asyncio.wait_for(results[last].get(), MUST)).ok
        assert all(bool((decode[r][0][5] == 1 + r).all()) for r in range(2))

        await wait_until(lambda: not any(c.awaiting_result("t1") for c in consumers), MUST)
        await state_becomes(client, "t1", TransferState.RELEASED)  # rank 0 released it
        assert not any(c._thread is not None and c._thread._expecting.is_set() for c in consumers)
        assert all(r.empty() for r in results)


async def test_a_pull_report_the_service_never_got_is_sent_again(
    server: AsyncTestServer, grpc_proxy: GrpcProxy, client: AsyncRendezvousClient
) -> None:
    """d0's one rank READs t1 and reports it, and every attempt of that CompleteTransfers is refused UNAVAILABLE on
    the way (the service never hears of it): the bytes arrive all the same, and rank 0 asks about t1. Before the
    fix it found t1 MATCHED and only waited: t1 stayed MATCHED, p0's source held, until its deadline aborted it (an
    hour here). Now it sends the same report again once the service answers: t1 commits and is released."""
    decode = [torch.zeros(8, 256, dtype=torch.uint8)]
    results: asyncio.Queue[TransferResult] = asyncio.Queue()
    retry = RetryPolicy(initial_backoff=0.01, max_backoff=0.01, max_attempts=2)
    async with AsyncRendezvousClient(ClientConfig(targets=(grpc_proxy.address,), retry=retry)) as proxied:
        consumer = ConsumerAgent(
            proxied, "d0", "decode", decode, layout=TEST_LAYOUT, session_config=FAST_SESSION,
            on_result=results.put_nowait, follower_check_s=0.05,
        )  # fmt: skip
        producer = prefill(client, "p0", 1)
        await producer.start()
        await consumer.start()
        try:
            grpc_proxy.refuse("CompleteTransfers", grpc.StatusCode.UNAVAILABLE)
            assert (await consumer.register_target("t1", [5], mode=TransferMode.PULL, timeout=HOUR)).ok
            assert (await producer.claim("t1")).ok
            producer.ready("t1", [2], mode=TransferMode.PULL)
            result = await asyncio.wait_for(results.get(), MUST)
            assert (result.transfer_id, result.ok) == ("t1", True) and bool((decode[0][5] == 1).all())
            assert (await client.get_transfer("t1")).state is TransferState.MATCHED  # the report never got there
            assert consumer.awaiting_result("t1")
            grpc_proxy.release("CompleteTransfers")
            await state_becomes(client, "t1", TransferState.RELEASED)  # committed, then released by rank 0
            await wait_until(lambda: not consumer.awaiting_result("t1"), MUST)
            assert results.empty()
        finally:
            await consumer.close()
            await producer.close()
