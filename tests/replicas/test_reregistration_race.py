"""Two replicas on one Redis: a consumer re-registers on one replica while a producer claims its transfers on the
other. No assignment may name an incarnation other than the one that registered the target (issue 10, bug 3)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.replicas.harness import Replica
from tests.service.conftest import engine_request

pytestmark = [pytest.mark.redis, pytest.mark.timeout(90)]

TRANSFERS = 200
BATCH = 10
WAIT_S = 20.0


@pytest.fixture
async def stubs(replicas: tuple[Replica, Replica]) -> AsyncIterator[tuple[pb_grpc.RendezvousServiceStub, ...]]:
    channels = [grpc.aio.insecure_channel(r.address) for r in replicas]
    yield tuple(pb_grpc.RendezvousServiceStub(c) for c in channels)
    for channel in channels:
        await channel.close()


async def producer_events(
    stub: pb_grpc.RendezvousServiceStub, start: int, aborted_wanted: int
) -> tuple[list[pb.Event], int]:
    """The producer's events from start until aborted_wanted transfers were aborted (or WAIT_S passed)."""
    events: list[pb.Event] = []
    aborted: set[str] = set()
    call = stub.Watch(pb.WatchRequest(engine_id="p", start_sequence=start))
    try:
        async with asyncio.timeout(WAIT_S):
            async for response in call:
                events.extend(response.events)
                aborted.update(
                    e.transfer.transfer_id for e in response.events if e.type == pb.EVENT_TYPE_TRANSFER_ABORTED
                )
                if len(aborted) >= aborted_wanted:
                    break
    except TimeoutError:
        pass
    finally:
        call.cancel()
    return events, len(aborted)


async def test_a_claim_racing_a_consumer_reregistration_is_never_assigned_the_new_incarnation(
    stubs: tuple[pb_grpc.RendezvousServiceStub, pb_grpc.RendezvousServiceStub],
) -> None:
    a, b = stubs
    old = (await a.RegisterEngine(engine_request("d", pb.ENGINE_ROLE_CONSUMER))).engine.incarnation
    p = await b.RegisterEngine(engine_request("p", pb.ENGINE_ROLE_PRODUCER))
    ids = [f"t{i:03d}" for i in range(TRANSFERS)]
    for i in range(0, TRANSFERS, BATCH):
        targets = [pb.TargetSpec(transfer_id=t, block_ids=[1, 2]) for t in ids[i : i + BATCH]]
        await a.RegisterTargets(pb.RegisterTargetsRequest(engine_id="d", targets=targets))

    async def claim(batch: list[str]) -> int:
        """How many claims joined the transfer (the others found it ended: TRANSFER_ENDED)."""
        claims = [pb.ClaimSpec(transfer_id=t) for t in batch]
        response = await b.ClaimTransfers(pb.ClaimTransfersRequest(engine_id="p", claims=claims))
        return sum(not r.HasField("status") for r in response.results)

    # Replica a ends the old incarnation's transfers one by one while replica b matches claims against them.
    reregistered, *joined = await asyncio.gather(
        a.RegisterEngine(engine_request("d", pb.ENGINE_ROLE_CONSUMER)),
        *(claim(ids[i : i + BATCH]) for i in range(0, TRANSFERS, BATCH)),
    )
    new = reregistered.engine.incarnation
    assert new != old

    # Every transfer the producer joined ends aborted, and the producer hears of it.
    events, aborted = await producer_events(b, p.watch_start_sequence, sum(joined))
    assert aborted == sum(joined), f"the producer heard of {aborted} aborts for {sum(joined)} joined transfers"
    assigned = [e for e in events if e.type == pb.EVENT_TYPE_TRANSFER_ASSIGNED]
    wrong = [
        (e.transfer.transfer_id, e.peer.incarnation)
        for e in assigned
        if e.peer.incarnation != e.transfer.consumer_incarnation or e.peer.incarnation != old
    ]
    assert not wrong, f"{len(wrong)} assignments name an incarnation that did not register the target: {wrong[:5]}"
    live = await a.ListTransfers(pb.ListTransfersRequest(engine_id="d"))
    assert [t.transfer_id for t in live.transfers] == []
