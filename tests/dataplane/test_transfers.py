"""Push and pull between a producer and a consumer process: byte-exact, either arrival order, fencing,
and assignments the producer must refuse without writing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest

from rendezvous.clients import (
    AbortReason,
    AsyncRendezvousClient,
    ConsumerSession,
    Event,
    EventType,
    KvRegion,
    MemoryKind,
    NixlAgentInfo,
    ServerEvent,
    TargetSpec,
)
from rendezvous.clients.nixl import AgentReason
from rendezvous.clients.testing import TEST_LAYOUT, TestServer
from rendezvous.protocol.dataplane import DATA_PLANE_VERSION
from tests.dataplane.checks import Landed, assert_pool, chunks, reset_pool, transfer_id
from tests.dataplane.worker import WorkerProcess

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def clean_pool(consumer: WorkerProcess) -> Iterator[None]:
    reset_pool(consumer)
    yield


@pytest.mark.parametrize("order", ["consumer_first", "producer_first"])
def test_push_is_byte_exact_over_random_blocks(order: str, producer: WorkerProcess, consumer: WorkerProcess) -> None:
    rng = np.random.default_rng(abs(hash(order)) % 2**32)
    sizes = [1, 2, 5, 17, 39]
    sources, targets = chunks(rng, 64, sizes), chunks(rng, 64, sizes)
    ids = [transfer_id(order) for _ in sizes]
    seeds = [int(s) for s in rng.integers(0, 2**31, len(sizes))]

    def consumer_half() -> None:
        for tid, dst in zip(ids, targets, strict=True):
            assert consumer.call("register", tid, dst) in ("TARGETED", "MATCHED")

    def producer_half() -> None:
        for tid, src, seed in zip(ids, sources, seeds, strict=True):
            producer.call("fill", seed, src)
            assert producer.call("claim", tid) in ("CLAIMED", "MATCHED")
            producer.call("ready", tid, src)

    first, second = (consumer_half, producer_half) if order == "consumer_first" else (producer_half, consumer_half)
    first()
    second()
    for tid, dst in zip(ids, targets, strict=True):
        assert consumer.result(tid) == ("result", tid, 1, True, tuple(dst), AbortReason.UNSPECIFIED)
        producer.freed(tid)
        assert producer.report(tid)[3] is True
    assert_pool(consumer, [Landed(s, len(d), d) for s, d in zip(seeds, targets, strict=True)])


def test_prefix_hit_gets_the_last_source_blocks(producer: WorkerProcess, consumer: WorkerProcess) -> None:
    tid, src, dst = transfer_id("prefix"), [9, 3, 40, 41, 7, 60, 2, 11], [30, 1, 22]
    producer.call("fill", 77, src)
    consumer.call("register", tid, dst)
    producer.call("claim", tid)
    producer.call("ready", tid, src)
    assert consumer.result(tid)[3] is True
    producer.freed(tid)
    assert_pool(consumer, [Landed(77, len(src), dst)])


def test_pull_is_byte_exact(producer: WorkerProcess, consumer: WorkerProcess) -> None:
    rng = np.random.default_rng(5)
    src, dst = chunks(rng, 64, [23])[0], chunks(rng, 64, [23])[0]
    tid = transfer_id("pull")
    producer.call("fill", 123, src)
    assert consumer.call("register", tid, dst, 1, True) == "TARGETED"
    producer.call("ready", tid, src, True)
    assert consumer.result(tid) == ("result", tid, 1, True, tuple(dst), AbortReason.UNSPECIFIED)
    producer.freed(tid)  # once the consumer committed
    assert_pool(consumer, [Landed(123, len(src), dst)])


def test_reregistered_target_fences_the_old_blocks(producer: WorkerProcess, consumer: WorkerProcess) -> None:
    tid, old, new, src = transfer_id("fence"), [4, 5, 6], [50, 51, 52], [1, 2, 3]
    consumer.call("register", tid, old, 1)
    assert producer.call("claim", tid) == "MATCHED"  # generation 1 is assigned; its source is not ready
    consumer.call("register", tid, new, 2)
    # The producer acknowledged the revocation: only now are the old blocks reported free.
    assert consumer.result(tid) == ("result", tid, 1, False, tuple(old), AgentReason.REVOKED)
    producer.call("fill", 9, src)
    producer.call("ready", tid, src)
    assert consumer.result(tid) == ("result", tid, 2, True, tuple(new), AbortReason.UNSPECIFIED)
    producer.freed(tid)
    assert_pool(consumer, [Landed(9, len(src), new)])  # not a byte in the old blocks


def test_consumer_abort_frees_both_sides(producer: WorkerProcess, consumer: WorkerProcess) -> None:
    tid = transfer_id("abort")
    consumer.call("register", tid, [8, 9])
    producer.call("claim", tid)
    consumer.call("abort", tid)
    assert consumer.result(tid) == ("result", tid, 1, False, (8, 9), AbortReason.REQUESTED)
    producer.call("fill", 3, [20, 21])
    producer.call("ready", tid, [20, 21])
    producer.freed(tid)
    assert_pool(consumer, [])


def test_out_of_range_assignment_is_refused_without_a_write(producer: WorkerProcess, consumer: WorkerProcess) -> None:
    tid = transfer_id("range")
    producer.call("fill", 5, [1, 2, 3])
    producer.call("claim", tid)
    producer.call("ready", tid, [1, 2, 3])  # the source is waiting: a valid assignment would be written at once
    producer.call("inject", tid, 1, consumer.engine_id, [10, 11, consumer.spec.num_blocks])
    report = producer.report(tid)
    assert report[3] is False and "block ids must be in" in report[4]
    producer.freed(tid)
    assert_pool(consumer, [])


def test_unknown_agent_fails_the_transfer_without_a_write(server: TestServer, producer: WorkerProcess) -> None:
    """A consumer whose announced NIXL agent cannot be loaded: the producer fails the transfer, and the
    consumer learns it from the service."""
    tid = transfer_id("ghost")
    regions = tuple(KvRegion(0x100000 * (i + 1), n, n, 64) for i, n in enumerate(producer.spec.block_lengths))
    ghost = NixlAgentInfo("ghost-agent", b"not nixl metadata", 0, MemoryKind.DRAM, regions)
    # It states the producer's data-plane version (rendezvous.clients.nixl's), or the service would not pair them.
    layout = replace(TEST_LAYOUT, data_plane_version=DATA_PLANE_VERSION)

    async def consumer_side() -> ServerEvent:
        async with (
            AsyncRendezvousClient(server.address) as client,
            ConsumerSession(client, "ghost-decode", "decode", layout=layout, agents=[ghost]) as session,
        ):
            await session.register_target(TargetSpec(tid, [0, 1]))
            await asyncio.to_thread(producer.call, "claim", tid)
            await asyncio.to_thread(producer.call, "ready", tid, [5, 6])
            async for event in session.events():
                if isinstance(event, Event) and event.type is EventType.TRANSFER_ABORTED:
                    return event
        raise AssertionError("the session ended")

    event = asyncio.run(asyncio.wait_for(consumer_side(), 15))
    assert event.transfer is not None and event.transfer.abort_reason.name == "TRANSFER_FAILED"
    assert "ghost-agent" in event.transfer.abort_message
    assert producer.report(tid)[3] is False
    producer.freed(tid)
