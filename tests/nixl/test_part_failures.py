"""Progressive push that goes wrong mid-parts, with a real service and real NIXL (a producer rank and a consumer
rank in this process; the device is faked, as on a CPU there is none): a device error, a part the device never
computes, the consumer aborting or re-registering while parts are held, notifications for what the consumer no
longer expects. Each ends with a clear reason on both sides, the consumer's blocks back only once no write can
land, and decode never started on incomplete KV. Orders are observed, never timed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from rendezvous.clients import AbortReason, AsyncRendezvousClient, TransferState
from rendezvous.clients.nixl.consumer import AgentReason
from rendezvous.clients.nixl.device import KvReady
from rendezvous.clients.nixl.notifications import PartsEntry, encode_parts
from rendezvous.clients.nixl.writer import WriterConfig
from rendezvous.clients.testing import AsyncTestServer
from rendezvous.protocol.records import WrittenPart
from tests.clients.conftest import WAIT, client, server, wait_until
from tests.nixl.test_consumer_arrival import hand_writer, progressive_match
from tests.nixl.test_producer_parts import Pair, landed, started_pair

__all__ = ["client", "server"]

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]


class Stream:
    """A fake compute stream: what it records is done once the test says so, or raises once it failed."""

    def __init__(self) -> None:
        self.done = False
        self.error: str | None = None

    def record(self) -> KvReady:
        return _Point(self)


@dataclass(frozen=True)
class _Point:
    stream: Stream

    def done(self) -> bool:
        if self.stream.error is not None:
            raise RuntimeError(self.stream.error)
        return self.stream.done


async def layer_0_landed_layer_1_computing(pair: Pair, stream: Stream, freed: list[str]) -> None:
    """Layer 0 computed and landed in blocks 5-6; layer 1 handed over while the device still computes it, and
    the final behind it."""
    await progressive_match(pair)
    pair.producer.ready_part("t1", [1, 2], 32, (0, 1), prompt_tokens=32, on_free=freed.append)
    await landed(pair.decode[0][5:7], pair.kv[0][1:3])
    pair.producer.ready_part("t1", [1, 2], 32, (1, 2), kv_ready=stream.record())
    pair.producer.ready("t1", [1, 2])


async def writer_turns(pair: Pair, turns: int = 2) -> None:
    """Wait until the writer thread went round `turns` times: what waited on the device was handled."""
    writer = pair.producer._writer
    assert writer is not None
    for _ in range(turns):
        assert await asyncio.to_thread(writer.barrier, WAIT)


@pytest.mark.parametrize("fault", ["device error", "never computed"])
async def test_a_part_the_device_fails_fails_the_transfer_on_both_sides_with_the_reason(
    server: AsyncTestServer, client: AsyncRendezvousClient, fault: str
) -> None:
    config = WriterConfig(kv_ready_timeout_s=0.2) if fault == "never computed" else None
    freed: list[str] = []
    stream = Stream()
    async with started_pair(client, config) as pair:
        await layer_0_landed_layer_1_computing(pair, stream, freed)
        if fault == "device error":
            stream.error = "an illegal memory access was encountered"
        why = "the device failed computing the KV: an illegal" if fault == "device error" else "did not compute the KV"

        report = await asyncio.wait_for(pair.reported, WAIT)
        assert not report.ok and report.error is not None and why in report.error
        result = await asyncio.wait_for(pair.arrived, WAIT)
        assert not result.ok and result.block_ids == (5, 6)
        assert result.reason is AbortReason.TRANSFER_FAILED and why in result.message
        info = await client.get_transfer("t1")
        assert info.state is TransferState.ABORTED and why in info.abort_message and info.revoking_generation == 0
        await wait_until(lambda: freed == ["t1"])

        stream.done = True  # too late: nothing of layer 1 is written
        await writer_turns(pair)
        assert not pair.decode[1].any()


async def test_a_consumer_abort_while_a_part_computes_posts_no_more_and_frees_both_sides(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    freed: list[str] = []
    stream = Stream()
    async with started_pair(client) as pair:
        await layer_0_landed_layer_1_computing(pair, stream, freed)

        assert (await pair.consumer.abort("t1", "the request was cancelled")).ok
        result = await asyncio.wait_for(pair.arrived, WAIT)
        assert not result.ok and result.block_ids == (5, 6)
        assert result.reason is AbortReason.REQUESTED and result.message == "the request was cancelled"
        info = await client.get_transfer("t1")  # the producer let go of generation 1 before the blocks came back
        assert info.state is TransferState.ABORTED and info.revoking_generation == 0
        await wait_until(lambda: freed == ["t1"])

        stream.done = True  # the layer the producer computed meanwhile is not written
        await writer_turns(pair)
        assert not pair.decode[1].any() and pair.producer._writer is not None
        assert pair.producer._writer.parts_in_flight == 0
        assert not pair.reported.done()  # aborted, not reported: the producer acknowledged instead


async def test_a_revocation_while_a_part_computes_writes_the_new_generation_only_into_its_blocks(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    freed: list[str] = []
    stream = Stream()
    async with started_pair(client) as pair:
        await layer_0_landed_layer_1_computing(pair, stream, freed)

        assert (await pair.consumer.register_target("t1", [3, 4], 2, num_tokens=32, progressive=True)).ok
        retired = await asyncio.wait_for(pair.arrived, WAIT)
        assert retired == type(retired)("t1", 1, False, (5, 6), AgentReason.REVOKED)
        assert (await client.get_transfer("t1")).revoking_generation == 0  # acknowledged first

        arrived: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        pair.consumer._on_result = arrived.set_result
        stream.done = True
        result = await asyncio.wait_for(arrived, WAIT)
        assert result == type(retired)("t1", 2, True, (3, 4))
        for d, s in zip(pair.decode, pair.kv, strict=True):
            assert d[3:5].equal(s[1:3])
        assert pair.decode[0][5:7].equal(pair.kv[0][1:3]) and not pair.decode[1][5:7].any()  # g1: layer 0 only
        report = await asyncio.wait_for(pair.reported, WAIT)
        assert report.ok and report.generation == 2
        await wait_until(lambda: freed == ["t1"])


async def test_part_notifications_of_a_generation_or_transfer_not_expected_never_make_it_arrive(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """A writer's notifications that tile the target, but for generation 2 while the consumer expects 1, or for
    another transfer: counted stale, never arrival; the real write of generation 1 then arrives."""
    async with started_pair(client) as pair:
        await progressive_match(pair)
        writer = await hand_writer(pair, client)
        try:
            whole = (WrittenPart(0, 32),)
            await writer.write(0, encode_parts([PartsEntry("t1", 2, 1, None, whole)]))
            await writer.write(0, encode_parts([PartsEntry("t9", 1, 1, None, whole)]))
            await wait_until(lambda: pair.consumer.stale_notifications == 2)
            assert not pair.arrived.done()
        finally:
            writer.close()
        pair.decode[0].zero_()
        pair.producer.ready("t1", [1, 2])
        assert (await asyncio.wait_for(pair.arrived, WAIT)).ok
