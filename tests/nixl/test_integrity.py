"""End-to-end integrity with a real service and real NIXL: a producer with `WriterConfig.integrity` sends the
digests of what it wrote, and the consumer checks its blocks before the transfer counts as arrived. Bytes that
differ (corrupted after they landed, or a producer that lies) fail the transfer with a reason on both sides and
never reach decode."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from rendezvous.clients import (
    AsyncRendezvousClient,
    CompletionSpec,
    KvLayout,
    NixlAgentInfo,
    TransferState,
    WrittenPart,
)
from rendezvous.clients.nixl.agent import NixlEndpoint, XferStatus
from rendezvous.clients.nixl.consumer import DIGESTS_AFTER_COMMIT_S, AgentReason, ConsumerAgent
from rendezvous.clients.nixl.integrity import LandedDigests, RunningDigests, block_digests
from rendezvous.clients.nixl.notifications import (
    DigestScope,
    PartsEntry,
    encode_notification,
    encode_parts,
    parse_notification,
)
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.nixl.regions import regions_from_tensors
from rendezvous.clients.nixl.writer import WriterConfig
from rendezvous.clients.testing import AsyncTestServer
from rendezvous.protocol import kvmap
from rendezvous.protocol.records import KvRegion
from tests.clients.conftest import WAIT, client, server
from tests.nixl.test_consumer_arrival import BOTH_LAYERS, progressive_match
from tests.nixl.test_consumer_arrival import hand_writer as parts_writer
from tests.nixl.test_producer_parts import LAYOUT, Pair, assert_blocks_5_6_hold_source_1_2, landed, started_pair

__all__ = ["client", "server"]

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]

PROGRESSIVE: dict[str, Any] = {"num_tokens": 32, "progressive": True}
"""RegisterTarget's options for a target of blocks 5 and 6 that accepts parts."""

xxhash = pytest.importorskip("xxhash", reason="integrity needs the nixl extra's xxhash")


@contextlib.asynccontextmanager
async def integrity_pair(
    client: AsyncRendezvousClient,
    *,
    producer_checks: bool = True,
    part_compute_ratio: float = 8.0,
    digests_after_commit_s: float = DIGESTS_AFTER_COMMIT_S,
) -> AsyncIterator[Pair]:
    """The pair of test_producer_parts with integrity on: the producer sends digests (unless told not to), the
    consumer requires them. `part_compute_ratio` 0: every part goes as soon as it is computed."""
    loop = asyncio.get_running_loop()
    arrived: asyncio.Future[Any] = loop.create_future()
    reported: asyncio.Future[Any] = loop.create_future()
    kv = [torch.arange(8 * 256, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(8, 256) for _ in range(2)]
    config = WriterConfig(integrity=producer_checks, part_compute_ratio=part_compute_ratio)
    producer = ProducerAgent(
        client, "p0", "prefill", kv, layout=LAYOUT, on_report=reported.set_result, writer_config=config
    )
    decode = [torch.zeros(8, 256, dtype=torch.uint8) for _ in range(2)]
    consumer = ConsumerAgent(
        client,
        "d0",
        "decode",
        decode,
        layout=LAYOUT,
        on_result=arrived.set_result,
        integrity=True,
        digests_after_commit_s=digests_after_commit_s,
    )
    await producer.start()
    await consumer.start()
    try:
        yield Pair(producer, consumer, kv, decode, arrived, reported)
    finally:
        await producer.close()
        await consumer.close()


@contextlib.asynccontextmanager
async def hand_writer(
    client: AsyncRendezvousClient, pair: Pair, **target: Any
) -> AsyncIterator[tuple[NixlEndpoint, str]]:
    """Target "t1" (blocks 5 and 6 of d0, `target` as RegisterTarget's options) matched with p0, and a hand-driven
    NIXL endpoint over p0's KV with d0's agent as its peer: (the endpoint, the peer's name)."""
    assert (await pair.consumer.register_target("t1", [5, 6], **target)).ok
    assert (await pair.producer.claim("t1")).state is TransferState.MATCHED
    engine = await client.get_engine("d0")
    hand = NixlEndpoint.from_tensors("hand-writer", pair.kv)
    try:
        hand.add_peer(engine.agents[0], engine.incarnation)
        yield hand, engine.agents[0].name
    finally:
        hand.close()


def test_digests_are_per_region_over_the_blocks_in_order() -> None:
    tensors = [torch.arange(4 * 8, dtype=torch.uint8).reshape(4, 8), torch.ones(4, 8, dtype=torch.uint8)]
    regions = regions_from_tensors(tensors)
    want = tuple(xxhash.xxh3_64_intdigest(t[[2, 0, 1]].numpy().tobytes()) for t in tensors)
    assert block_digests(regions, [2, 0, 1]) == want
    assert block_digests(regions, [0, 1, 2]) != want
    with pytest.raises(ValueError, match="outside"):
        block_digests(regions, [3, 4])


def test_digests_run_over_blocks_added_in_pieces_as_over_them_at_once() -> None:
    tensors = [torch.arange(6 * 8, dtype=torch.uint8).reshape(6, 8), torch.arange(6 * 8, dtype=torch.uint8).flip(0)]
    regions = regions_from_tensors(tensors)
    running = RunningDigests(regions)
    running.extend(1, [4])
    running.extend(0, [4, 0])
    assert running.digests() != block_digests(regions, [4, 0, 5])  # region 1 holds one block so far
    running.extend(0, [5])
    running.extend(1, [0, 5])
    assert running.digests() == block_digests(regions, [4, 0, 5])


def landed_digests(tokens: int = 40) -> tuple[LandedDigests, list[KvRegion], list[int], list[torch.Tensor]]:
    """A rank of layers 2 and 3 (K and V each: 4 regions of 8 blocks of 16 tokens) and a target of `tokens` in
    blocks 6, 1 and 4: (its LandedDigests, the regions, the blocks, the tensors, which the caller keeps alive while
    it reads the regions)."""
    layout = KvLayout("m", "uint8", 16, 4, pp_size=2, kv_layout="HND", num_kv_heads=1)
    tensors = [
        torch.randint(0, 256, (8, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(r)) for r in range(4)
    ]
    regions = regions_from_tensors(tensors)
    agent = NixlAgentInfo("d", b"", regions=tuple(regions), rank=1, first_layer=2, num_layers=2)
    blocks = [6, 1, 4]
    hashing = LandedDigests.of(regions, kvmap.rank_shape(layout, agent), blocks, 16, tokens)
    assert hashing is not None
    return hashing, regions, blocks, tensors


def test_landed_parts_are_hashed_per_region_once_their_blocks_are_whole() -> None:
    hashing, regions, blocks, _tensors = landed_digests()
    share = range(2, 4)
    assert hashing.land(WrittenPart(0, 20, 3, 1), share) == [(2, [6]), (3, [6])]  # layer 3: block 0 whole
    assert hashing.land(WrittenPart(32, 8, 3, 1), share) == []  # beyond what is whole from the first token
    assert hashing.land(WrittenPart(20, 12, 3, 1), share) == [(2, [1, 4]), (3, [1, 4])]  # 0-40: all, the last partial
    assert hashing.land(WrittenPart(0, 8, 0, 0), share) == []  # layer 2: half a block
    jobs = hashing.land(WrittenPart(8, 16, 0, 0), share)  # all layers: 8-24 makes 0-24, block 0 of layer 2
    assert jobs == [(0, [6]), (1, [6])]
    hashing.hash([(2, [6]), (3, [6]), (2, [1, 4]), (3, [1, 4]), *jobs])
    rest = hashing.rest()
    assert rest == [(0, [1, 4]), (1, [1, 4])] and hashing.rest() == []
    hashing.hash(rest)
    assert hashing.digests() == block_digests(regions, blocks)


def test_a_landed_part_is_walked_over_the_layers_held_only() -> None:
    """A part (or a sender's share) naming 1e20 layers was walked layer by layer on the consumer's event loop,
    which hung (found by an audit); only the layers this rank holds are, and a repeat adds nothing."""
    hashing, _regions, _blocks, _tensors = landed_digests()
    assert hashing.land(WrittenPart(32, 8, 0, 10**20), range(2, 4)) == []  # beyond the prefix: nothing whole
    assert hashing.land(WrittenPart(32, 8, 0, 10**20), range(2, 4)) == []
    assert hashing.land(WrittenPart(0, 32, 0, 0), range(0, 10**20)) == [(r, [6, 1, 4]) for r in range(4)]


def test_landed_digests_need_regions_by_layer_and_blocks_that_hold_the_target() -> None:
    _, regions, blocks, _ = landed_digests()
    shape = kvmap.rank_shape(
        KvLayout("m", "uint8", 16, 4, kv_layout="HND"), NixlAgentInfo("d", b"", regions=tuple(regions))
    )
    assert LandedDigests.of(regions, shape, blocks, 16, 40) is not None
    assert LandedDigests.of(regions, shape, blocks, 16, 48) is not None
    assert LandedDigests.of(regions, shape, blocks, 16, 49) is None  # 4 blocks' worth of tokens in 3
    assert LandedDigests.of(regions, shape, blocks, 16, 32) is None
    ungrouped = kvmap.rank_shape(
        KvLayout("m", "uint8", 16, 3, kv_layout="HND"), NixlAgentInfo("d", b"", regions=tuple(regions))
    )
    assert LandedDigests.of(regions, ungrouped, blocks, 16, 40) is None  # 4 regions for 3 layers: one group


async def test_a_checked_transfer_arrives_with_its_bytes(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    async with integrity_pair(client) as pair:
        assert (await pair.consumer.register_target("t1", [5, 6])).ok
        assert (await pair.producer.claim("t1")).state is TransferState.MATCHED
        pair.producer.ready("t1", [1, 2])
        assert (await asyncio.wait_for(pair.arrived, WAIT)).ok
        assert_blocks_5_6_hold_source_1_2(pair)


async def test_a_producer_without_checksums_fails_a_consumer_that_requires_them(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    async with integrity_pair(client, producer_checks=False) as pair:
        assert (await pair.consumer.register_target("t1", [5, 6])).ok
        assert (await pair.producer.claim("t1")).state is TransferState.MATCHED
        pair.producer.ready("t1", [1, 2])
        result = await asyncio.wait_for(pair.arrived, WAIT)
        assert not result.ok and result.reason is AgentReason.CORRUPTED and "sent no checksums" in result.message


async def test_bytes_corrupted_after_they_landed_fail_the_transfer_on_both_sides(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """A hand-driven NIXL endpoint writes the blocks without a notification; a byte of the consumer's block
    then changes; the notification with the true digests comes last. The consumer fails the transfer and aborts
    it at the service, whose record (what the producer is told) names the region."""
    async with integrity_pair(client) as pair, hand_writer(client, pair) as (hand, peer):
        await write(hand, peer, b"")
        assert torch.equal(pair.decode[1][5:7], pair.kv[1][1:3])  # landed
        pair.decode[1][6, 100] ^= 0xFF
        digests = block_digests(regions_from_tensors(pair.kv), [1, 2])
        # The notification goes with a block outside the target, so the corrupted one stays as it is.
        await write(hand, peer, encode_notification("t1", 1, digests=digests), (0,), (0,))
        result = await asyncio.wait_for(pair.arrived, WAIT)
        assert not result.ok and result.reason is AgentReason.CORRUPTED
        assert "integrity check failed: region 1 of the 2 blocks from block 5" in result.message
        info = await client.get_transfer("t1")
        assert info.state is TransferState.ABORTED and "integrity check failed: region 1" in info.abort_message


async def test_a_producer_that_lies_never_reaches_decode(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    async with integrity_pair(client) as pair, hand_writer(client, pair) as (hand, peer):
        lie = block_digests(regions_from_tensors(pair.kv), [2, 1])  # the digests of other bytes
        await write(hand, peer, encode_notification("t1", 1, digests=lie))
        result = await asyncio.wait_for(pair.arrived, WAIT)
        assert not result.ok and result.reason is AgentReason.CORRUPTED and "region 0" in result.message


async def write(
    endpoint: NixlEndpoint, peer: str, notification: bytes, src: tuple[int, ...] = (1, 2), dst: tuple[int, ...] = (5, 6)
) -> None:
    """Source blocks `src` into `dst` (the target's by default), in every region, polled until done."""
    posted = endpoint.post("WRITE", peer, src, dst, notification)
    deadline = asyncio.get_running_loop().time() + WAIT
    while endpoint.poll(posted) is XferStatus.IN_PROGRESS:  # NIXL moves the bytes while the sender polls
        assert asyncio.get_running_loop().time() < deadline, "the WRITE never finished"
        await asyncio.sleep(0.005)
    endpoint.release(posted)


async def handled(endpoint: NixlEndpoint, peer: str, consumer: ConsumerAgent) -> None:
    """Until the consumer has handled every notification `endpoint` sent it so far: one peer's notifications are
    handled in order, so once a notification for a transfer it does not expect is counted stale, the ones before
    were taken. A test whose commit must find a notification's digests waits for this first: the sender's WRITE
    being done says the notification reached the consumer's NIXL, not that its receiver thread has read it."""
    before = consumer.stale_notifications
    await write(endpoint, peer, encode_notification("fence", 1))  # the same bytes again, into the same blocks
    deadline = asyncio.get_running_loop().time() + WAIT
    while consumer.stale_notifications == before:
        assert asyncio.get_running_loop().time() < deadline, "the fence's notification was never handled"
        await asyncio.sleep(0.005)


async def test_a_checked_progressive_transfer_goes_in_parts_and_arrives_checked(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """Layer 0 goes ahead as a part; layer 1 would complete the target, so it waits for the final, which brings the
    digests of both layers: the consumer, which requires them, takes the transfer as arrived once they match."""
    async with integrity_pair(client, part_compute_ratio=0.0) as pair:
        assert (await pair.consumer.register_target("t1", [5, 6], **PROGRESSIVE)).ok
        assert (await pair.producer.claim("t1")).state is TransferState.MATCHED
        pair.producer.ready_part("t1", [1, 2], 32, (0, 1), prompt_tokens=32)
        await landed(pair.decode[0][5:7], pair.kv[0][1:3])  # the part went ahead
        pair.producer.ready_part("t1", [1, 2], 32, (1, 2), prompt_tokens=32)
        assert not pair.decode[1].any() and not pair.arrived.done()  # the completing layer waits for the final
        pair.producer.ready("t1", [1, 2])
        assert (await asyncio.wait_for(pair.arrived, WAIT)).ok
        report = await asyncio.wait_for(pair.reported, WAIT)
        assert report.ok and sorted(report.parts, key=lambda p: p.first_layer) == [
            WrittenPart(0, 32, 0, 1),
            WrittenPart(0, 32, 1, 1),
        ]
        assert_blocks_5_6_hold_source_1_2(pair)


async def test_chunks_are_hashed_as_they_go_and_their_digests_match(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """Chunked prefill: each chunk of tokens in every layer is a part (a prefix of the target's blocks per region),
    hashed as it goes; the digests of the whole target, sent with the final, match what landed."""
    async with integrity_pair(client, part_compute_ratio=0.0) as pair:
        assert (await pair.consumer.register_target("t1", [4, 5, 6], num_tokens=48, progressive=True)).ok
        assert (await pair.producer.claim("t1")).state is TransferState.MATCHED
        pair.producer.ready_part("t1", [1], 16, prompt_tokens=48)
        await landed(pair.decode[1][4:5], pair.kv[1][1:2])
        pair.producer.ready_part("t1", [1, 2], 32, prompt_tokens=48)
        await landed(pair.decode[1][4:6], pair.kv[1][1:3])
        pair.producer.ready_part("t1", [1, 2, 3], 48, prompt_tokens=48)
        pair.producer.ready("t1", [1, 2, 3])
        assert (await asyncio.wait_for(pair.arrived, WAIT)).ok
        report = await asyncio.wait_for(pair.reported, WAIT)
        assert report.ok and len(report.parts) == 3
        for d, k in zip(pair.decode, pair.kv, strict=True):
            assert torch.equal(d[4:7], k[1:4])


async def test_parts_that_tile_the_target_without_digests_fail_a_checking_consumer(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """A hand-driven producer writes both layers as parts that tile the target, with no digests: the consumer,
    which requires them, fails the transfer instead of taking the parts as arrived."""
    async with integrity_pair(client) as pair, hand_writer(client, pair, **PROGRESSIVE) as (hand, peer):
        parts = (WrittenPart(0, 32, 0, 1), WrittenPart(0, 32, 1, 1))
        await write(hand, peer, encode_parts([PartsEntry("t1", 1, 1, None, parts)]))
        result = await asyncio.wait_for(pair.arrived, WAIT)
        assert not result.ok and result.reason is AgentReason.CORRUPTED and "sent no checksums" in result.message


async def test_parts_whose_final_digests_lie_never_reach_decode(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    async with integrity_pair(client) as pair, hand_writer(client, pair, **PROGRESSIVE) as (hand, peer):
        await write(hand, peer, encode_parts([PartsEntry("t1", 1, 1, None, (WrittenPart(0, 32, 0, 1),))]))
        assert not pair.arrived.done()  # one layer of two: not arrived
        lie = block_digests(regions_from_tensors(pair.kv), [2, 1])  # the digests of other bytes
        await write(hand, peer, encode_parts([PartsEntry("t1", 1, 1, None, (WrittenPart(0, 32, 1, 1),), lie)]))
        result = await asyncio.wait_for(pair.arrived, WAIT)
        assert not result.ok and result.reason is AgentReason.CORRUPTED and "region 0" in result.message
        info = await client.get_transfer("t1")  # what the producer is told
        assert info.state is TransferState.ABORTED and "integrity check failed: region 0" in info.abort_message


WHOLE = DigestScope(range(0, 2), 0, 1, 32)
"""Scoped digests that cover every byte of the target of blocks 5 and 6: both regions, the one head, 32 tokens."""


@pytest.mark.parametrize(
    ("scope", "source", "why"),
    [
        (WHOLE, [1, 2], ""),
        (DigestScope(range(0, 1), 0, 1, 32), [1, 2], "no digests cover region 1 head 0"),
        (DigestScope(range(0, 2), 0, 1, 16), [1, 2], "digests of only 16 tokens (17 needed)"),
        (WHOLE, [2, 1], "hand-writer wrote heads +0:1 of region 0 of the 2 blocks from block 5"),
    ],
    ids=["match", "a-region-unscoped", "too-few-tokens", "a-lie"],
)
async def test_scoped_digests_must_cover_the_target_and_match_it(
    server: AsyncTestServer, client: AsyncRendezvousClient, scope: DigestScope, source: list[int], why: str
) -> None:
    """A hand-driven producer writes the target and sends digests with a scope (what a producer rank writing only
    some of the bytes sends): the transfer arrives only when the scopes cover every region and head of the target
    once and the digests match what landed."""
    async with integrity_pair(client) as pair, hand_writer(client, pair) as (hand, peer):
        digests = block_digests(regions_from_tensors(pair.kv), source)[: len(scope.regions)]
        await write(hand, peer, encode_notification("t1", 1, digests=digests, scope=scope))
        result = await asyncio.wait_for(pair.arrived, WAIT)
        if not why:
            assert result.ok
            assert_blocks_5_6_hold_source_1_2(pair)
            return
        assert not result.ok and result.reason is AgentReason.CORRUPTED and why in result.message
        info = await client.get_transfer("t1")
        assert info.state is TransferState.ABORTED and why in info.abort_message


async def test_a_consumer_that_cannot_read_its_blocks_on_the_host_takes_digests_it_did_not_ask_for_as_unchecked(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """A consumer without integrity whose KV is not in host memory (over VRAM: no host regions) cannot hash its
    blocks; digests a producer sends anyway arrive unchecked, as without them (before, the transfer failed:
    "2 digests for 0 host-memory regions here")."""
    async with started_pair(client) as pair, hand_writer(client, pair) as (hand, peer):
        pair.consumer._regions = ()  # what a consumer over VRAM has: nothing to read on the host
        await write(
            hand, peer, encode_notification("t1", 1, digests=block_digests(regions_from_tensors(pair.kv), [1, 2]))
        )
        assert (await asyncio.wait_for(pair.arrived, WAIT)).ok
        assert_blocks_5_6_hold_source_1_2(pair)


async def test_a_target_of_no_blocks_has_nothing_to_check_and_arrives_on_the_commit(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    async with integrity_pair(client) as pair:
        assert (await pair.consumer.register_target("t1", [])).ok  # decode had every block cached
        assert (await pair.producer.claim("t1")).state is TransferState.MATCHED
        pair.producer.ready("t1", [1, 2])
        assert (await asyncio.wait_for(pair.arrived, WAIT)).ok


HALVES = (DigestScope(range(0, 1), 0, 1, 32), DigestScope(range(1, 2), 0, 1, 32))
"""Two producer ranks' scopes that tile the target of blocks 5 and 6: region 0, region 1."""


@contextlib.asynccontextmanager
async def second_writer(client: AsyncRendezvousClient, pair: Pair) -> AsyncIterator[NixlEndpoint]:
    """Another hand-driven NIXL endpoint over p0's KV with d0's agent as its peer: a second producer rank."""
    engine = await client.get_engine("d0")
    hand = NixlEndpoint.from_tensors("hand-writer-2", pair.kv)
    try:
        hand.add_peer(engine.agents[0], engine.incarnation)
        yield hand
    finally:
        hand.close()


@pytest.mark.parametrize("writers", [2, 0], ids=["writers-known", "writers-unknown"])
async def test_a_commit_before_every_writer_s_digests_waits_for_them(
    server: AsyncTestServer, client: AsyncRendezvousClient, writers: int
) -> None:
    """Two producer ranks, each with the digests of its region: the commit comes between their notifications, so
    the scopes that came do not cover the target yet; the consumer waits for the second, then checks them all.
    With writers 0 (pipeline stages on both sides: the consumer cannot count its senders) the commit decides
    arrival, and before, a checking consumer waited for ever: the digests had come, but only `writers` senders
    could end the wait (found by an audit)."""
    async with integrity_pair(client) as pair, hand_writer(client, pair) as (hand, peer):
        digests = block_digests(regions_from_tensors(pair.kv), [1, 2])
        await write(hand, peer, encode_notification("t1", 1, writers, digests[:1], HALVES[0]))
        await pair.producer.session.complete_transfer(CompletionSpec("t1", 1))  # -> TRANSFER_COMMITTED
        async with second_writer(client, pair) as other:
            await write(other, peer, encode_notification("t1", 1, writers, digests[1:], HALVES[1]))
        assert (await asyncio.wait_for(pair.arrived, WAIT)).ok
        assert_blocks_5_6_hold_source_1_2(pair)


async def test_writers_unknown_scopes_that_never_cover_the_target_fail_it_after_the_wait(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """Writers 0, committed, and the second rank's digests never come (it ran without integrity): after
    `digests_after_commit_s` the consumer checks what came, and the gap fails the transfer."""
    async with integrity_pair(client, digests_after_commit_s=0.2) as pair, hand_writer(client, pair) as (hand, peer):
        digests = block_digests(regions_from_tensors(pair.kv), [1, 2])
        await write(hand, peer, encode_notification("t1", 1, 0, digests[:1], HALVES[0]))
        await handled(hand, peer, pair.consumer)  # region 0's came before the commit (its wait is 0.2 s)
        await pair.producer.session.complete_transfer(CompletionSpec("t1", 1))
        result = await asyncio.wait_for(pair.arrived, WAIT)
        assert not result.ok and result.reason is AgentReason.CORRUPTED
        assert "no digests cover region 1 head 0" in result.message


async def test_writers_unknown_scoped_digests_that_lie_are_checked_on_the_commit(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """A consumer without integrity, writers 0: scoped digests that came are checked when the commit ends the
    target, as unscoped ones are (before, only unscoped ones were, and wrong bytes reached decode)."""
    async with started_pair(client) as pair, hand_writer(client, pair) as (hand, peer):
        lie = block_digests(regions_from_tensors(pair.kv), [2, 1])
        await write(hand, peer, encode_notification("t1", 1, 0, lie, WHOLE))
        await handled(hand, peer, pair.consumer)  # the digests came before the commit
        await pair.producer.session.complete_transfer(CompletionSpec("t1", 1))
        result = await asyncio.wait_for(pair.arrived, WAIT)
        assert not result.ok and result.reason is AgentReason.CORRUPTED


async def test_a_consumer_that_cannot_read_its_blocks_takes_digests_unchecked_on_the_commit_too(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    """Over VRAM without integrity, parts disputed so the commit decides, the final carrying digests: the commit
    takes them unchecked, as a notification does (before, "2 digests for 0 host-memory regions": CORRUPTED)."""
    async with started_pair(client) as pair:
        pair.consumer._regions = ()  # what a consumer over VRAM has
        await progressive_match(pair)
        writer = await parts_writer(pair, client)
        try:
            digests = block_digests(regions_from_tensors(pair.kv), [1, 2])
            await writer.part(BOTH_LAYERS[0], layer=0)
            await writer.part(WrittenPart(16, 16, 0, 2), layer=1)  # overlaps layer 0's: disputed
            final = PartsEntry("t1", 1, 1, range(2), (WrittenPart(0, 16, 1, 1),), digests)
            await writer.write(1, encode_parts([final]))
            await writer.fence()
        finally:
            writer.close()
        assert pair.consumer.disputed_targets == 1
        done = CompletionSpec("t1", 1, parts=BOTH_LAYERS)
        assert (await pair.producer.session.complete_transfer(done)).state is TransferState.COMMITTED
        assert (await asyncio.wait_for(pair.arrived, WAIT)).ok


async def test_a_notification_the_parser_cannot_read_does_not_end_the_receiver_thread(
    server: AsyncTestServer, client: AsyncRendezvousClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever a peer's bytes make the parser raise, they count as malformed and the thread reads on (a scope of
    1e20 regions raised OverflowError and ended it: no notification was read after)."""

    def failing_once(sender: str, payload: bytes) -> Any:
        if payload.startswith(b"poison"):
            raise OverflowError("a bug the parser's checks did not foresee")
        return parse_notification(sender, payload)

    monkeypatch.setattr("rendezvous.clients.nixl.receiver.parse_notification", failing_once)
    async with started_pair(client) as pair, hand_writer(client, pair) as (hand, peer):
        await write(hand, peer, b"poison")
        await write(hand, peer, encode_notification("t1", 1))
        assert (await asyncio.wait_for(pair.arrived, WAIT)).ok
        assert_blocks_5_6_hold_source_1_2(pair)


async def test_nixl_raising_on_a_notification_poll_does_not_end_the_receiver_thread(
    server: AsyncTestServer, client: AsyncRendezvousClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NIXL's own error out of get_new_notifs (a peer's connection failing under it) ended the consumer's receiver
    thread: no notification was read after, and pushed WRITEs to it never completed. Raised by NIXL's real
    exception type from the real agent's polls, three times, then the agent answers again."""
    from nixl import _bindings

    raised: list[str] = []

    class FailingPolls:
        def __init__(self, agent: Any) -> None:
            self._agent = agent

        def get_new_notifs(self) -> Any:
            if len(raised) < 3:
                raised.append("raised")
                raise _bindings.nixlRemoteDisconnectError("a peer's connection failed")
            return self._agent.get_new_notifs()

        def __getattr__(self, name: str) -> Any:
            return getattr(self._agent, name)

    real = NixlEndpoint._nixl
    monkeypatch.setattr(NixlEndpoint, "_nixl", lambda self: FailingPolls(real(self)))
    async with started_pair(client) as pair, hand_writer(client, pair) as (hand, peer):
        await write(hand, peer, encode_notification("t1", 1))
        assert (await asyncio.wait_for(pair.arrived, WAIT)).ok
        assert_blocks_5_6_hold_source_1_2(pair)
    assert raised == ["raised"] * 3
