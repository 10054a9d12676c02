"""What an engine identity reads: its own engines (GetEngine), the peer it moves a live transfer's bytes with
(GetEngine through the transfer) and the transfers they take part in (GetTransfer), which the SDK's sessions and
agents read under auth; any other transfer answered exactly as an unknown id. Real servers on 127.0.0.1 with an
auth file, memory and Redis stores."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rendezvous.clients import AsyncRendezvousClient, ClientConfig, ProducerSession, RankSession
from rendezvous.core import engines as engine_rules
from rendezvous.core.model import Engine, Role
from rendezvous.server import RendezvousServer
from rendezvous.v1 import rendezvous_pb2 as pb
from tests.clients.conftest import FAST_SESSION, LAYOUT, agent
from tests.factories import core_engine
from tests.redis_fixtures import redis_url, store
from tests.security.conftest import serving
from tests.security.test_auth import auth_file, call, refusal
from tests.security.test_bindings import register
from tests.service.conftest import engine_request

D0 = "tok-d0-reads-consumer-3c1e"
D1 = "tok-d1-reads-consumer-9a0b"
P0 = "tok-p0-reads-producer-77d2"
POOL = "tok-prefill-pool-reads-5e81"
ROUTER = "tok-router-reads-0f4c"
ADMIN = "tok-admin-reads-a6d3"
AUTH = {
    "tokens": {
        D0: {"name": "d0", "engines": ["d0", "d0-*"], "engine_roles": ["consumer"], "engine_pools": ["decode"]},
        D1: {"name": "d1", "engines": ["d1"], "engine_roles": ["consumer"], "engine_pools": ["decode"]},
        P0: {"name": "p0", "engines": ["p0"], "engine_roles": ["producer"], "engine_pools": ["prefill"]},
        POOL: {"name": "prefill-b", "pools": ["prefill-b"], "engine_roles": ["producer"]},
        ROUTER: {"name": "router", "roles": ["router"]},
        ADMIN: {"name": "ops", "roles": ["admin"]},
    }
}
ROLE_REQUIRED = (grpc.StatusCode.PERMISSION_DENIED, "ROLE_REQUIRED")
ENGINE_NOT_FOUND = (grpc.StatusCode.NOT_FOUND, "ENGINE_NOT_FOUND")
PUSH, PULL = pb.TRANSFER_MODE_PUSH, pb.TRANSFER_MODE_PULL

__all__ = ["redis_url", "store"]  # the fixtures


@pytest.fixture
async def server(tmp_path: Path, store: str) -> AsyncIterator[RendezvousServer]:
    async with serving(store=store, auth_file=auth_file(tmp_path, AUTH)) as srv:
        yield srv


async def get_engine(channel: grpc.aio.Channel, engine_id: str, token: str, **fields: Any) -> pb.Engine:
    engine: pb.Engine = (
        await call(channel, "GetEngine", pb.GetEngineRequest(engine_id=engine_id, **fields), token)
    ).engine
    return engine


async def get_transfer(channel: grpc.aio.Channel, transfer_id: str, token: str) -> pb.Transfer:
    transfer: pb.Transfer = (
        await call(channel, "GetTransfer", pb.GetTransferRequest(transfer_id=transfer_id), token)
    ).transfer
    return transfer


async def pool_engine(channel: grpc.aio.Channel, engine_id: str) -> int:
    """Register a producer in the pool identity's pool, prefill-b."""
    request = engine_request(engine_id, pb.ENGINE_ROLE_PRODUCER, pool="prefill-b")
    incarnation: int = (await call(channel, "RegisterEngine", request, POOL)).engine.incarnation
    return incarnation


async def matched(
    channel: grpc.aio.Channel, transfer_id: str, producer: str = "p0", mode: pb.TransferMode = PUSH
) -> int:
    """d0 (registered anew) targets transfer_id in mode and producer (p0, or an engine of pool prefill-b, registered
    anew) claims it, each with its token; the producer's incarnation."""
    token = P0 if producer == "p0" else POOL
    consumer_incarnation = await register(channel, "d0", pb.ENGINE_ROLE_CONSUMER, D0)
    if producer == "p0":
        producer_incarnation = await register(channel, producer, pb.ENGINE_ROLE_PRODUCER, token)
    else:
        producer_incarnation = await pool_engine(channel, producer)
    target = pb.RegisterTargetsRequest(
        engine_id="d0",
        incarnation=consumer_incarnation,
        targets=[pb.TargetSpec(transfer_id=transfer_id, block_ids=[1, 2], mode=mode)],
    )
    claim = pb.ClaimTransfersRequest(
        engine_id=producer, incarnation=producer_incarnation, claims=[pb.ClaimSpec(transfer_id=transfer_id)]
    )
    assert not (await call(channel, "RegisterTargets", target, D0)).results[0].HasField("status")
    assert not (await call(channel, "ClaimTransfers", claim, token)).results[0].HasField("status")
    return producer_incarnation


async def source_ready(channel: grpc.aio.Channel, transfer_id: str, incarnation: int, producer: str = "p0") -> None:
    """The producer (p0, or an engine of pool prefill-b) of a pull transfer says its source is ready."""
    request = pb.MarkSourcesReadyRequest(
        engine_id=producer,
        incarnation=incarnation,
        sources=[pb.SourceReadySpec(transfer_id=transfer_id, block_ids=[5, 6])],
    )
    token = P0 if producer == "p0" else POOL
    assert not (await call(channel, "MarkSourcesReady", request, token)).results[0].HasField("status")


async def answer(coro: Any, transfer_id: str) -> tuple[grpc.StatusCode, str, bytes]:
    """A refusal as the caller sees all of it, transfer_id written as <id>: its code, its message and its
    status details (the ErrorInfo)."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    details = dict(err.value.trailing_metadata() or ()).get("grpc-status-details-bin", b"")
    assert isinstance(details, bytes)
    message = (err.value.details() or "").replace(transfer_id, "<id>")
    return err.value.code(), message, details.replace(transfer_id.encode(), b"<id>")


# GetEngine: an engine identity's own engines


async def test_an_engine_reads_its_own_engine(channel: grpc.aio.Channel) -> None:
    incarnation = await register(channel, "d0", pb.ENGINE_ROLE_CONSUMER, D0)
    engine = await get_engine(channel, "d0", D0)
    assert (engine.engine_id, engine.incarnation) == ("d0", incarnation) and engine.agents[0].metadata
    basic = await get_engine(channel, "d0", D0, view=pb.ENGINE_VIEW_BASIC)
    assert basic.lease_remaining.ToTimedelta() and not basic.agents[0].metadata


async def test_an_engine_of_its_ids_not_registered_yet_is_not_found(channel: grpc.aio.Channel) -> None:
    assert await refusal(get_engine(channel, "d0-1", D0)) == ENGINE_NOT_FOUND


async def test_an_engine_cannot_read_another_engine(channel: grpc.aio.Channel) -> None:
    await register(channel, "d1", pb.ENGINE_ROLE_CONSUMER, D1)
    assert await refusal(get_engine(channel, "d1", D0)) == ROLE_REQUIRED
    assert await refusal(get_engine(channel, "d-unknown", D0)) == ROLE_REQUIRED  # no oracle of which ids exist


async def test_a_bound_identity_cannot_read_an_engine_of_its_ids_registered_with_another_role(
    channel: grpc.aio.Channel,
) -> None:
    await register(channel, "d0-x", pb.ENGINE_ROLE_PRODUCER, ADMIN)
    assert await refusal(get_engine(channel, "d0-x", D0)) == ROLE_REQUIRED


async def test_a_pool_identity_reads_the_engines_of_its_pool(channel: grpc.aio.Channel) -> None:
    await pool_engine(channel, "p7")
    await register(channel, "d1", pb.ENGINE_ROLE_CONSUMER, D1)
    assert (await get_engine(channel, "p7", POOL)).pool == "prefill-b"
    assert await refusal(get_engine(channel, "d1", POOL)) == ROLE_REQUIRED
    # As its other calls for an engine it would act for are: nothing is registered yet.
    assert await refusal(get_engine(channel, "p8", POOL)) == ENGINE_NOT_FOUND


async def test_the_router_and_admin_read_every_engine(channel: grpc.aio.Channel) -> None:
    await register(channel, "d1", pb.ENGINE_ROLE_CONSUMER, D1)
    assert (await get_engine(channel, "d1", ROUTER)).engine_id == "d1"
    assert (await get_engine(channel, "d1", ADMIN)).engine_id == "d1"


# GetEngine of a peer: through a live transfer of one of the identity's engines, the engine that moves its bytes reads
# the other half, as the service's events hand it over (push: TRANSFER_ASSIGNED's consumer to the producer; pull:
# SOURCE_READY's producer to the consumer)


async def test_a_push_producer_reads_its_consumer_through_their_transfer(channel: grpc.aio.Channel) -> None:
    await matched(channel, "t-peers")
    consumer = await get_engine(channel, "d0", P0, transfer_id="t-peers")
    assert consumer.engine_id == "d0" and consumer.agents[0].metadata
    assert await refusal(get_engine(channel, "d0", P0)) == ROLE_REQUIRED  # not without the transfer


async def test_a_pull_consumer_reads_its_producer_once_the_source_is_ready(channel: grpc.aio.Channel) -> None:
    incarnation = await matched(channel, "t-pull", mode=PULL)
    # Matched, but SOURCE_READY has not handed the producer over: the consumer has nothing to read yet.
    assert await refusal(get_engine(channel, "p0", D0, transfer_id="t-pull")) == ROLE_REQUIRED
    await source_ready(channel, "t-pull", incarnation)
    producer = await get_engine(channel, "p0", D0, transfer_id="t-pull")
    assert producer.engine_id == "p0" and producer.agents[0].metadata


@pytest.mark.parametrize("mode", [PUSH, PULL], ids=["push", "pull"])
async def test_the_half_that_moves_no_bytes_does_not_read_its_peer(
    channel: grpc.aio.Channel, mode: pb.TransferMode
) -> None:
    """Its peer's agents (region addresses, with which whoever reaches the engine's UCX endpoint reads and writes its
    KV memory) are never handed to it: a push consumer is written to, a pull producer read from."""
    incarnation = await matched(channel, "t-still", mode=mode)
    if mode == PULL:
        await source_ready(channel, "t-still", incarnation)
    peer, token = ("p0", D0) if mode == PUSH else ("d0", P0)
    assert await refusal(get_engine(channel, peer, token, transfer_id="t-still")) == ROLE_REQUIRED


async def test_a_pool_identity_reads_the_peer_of_its_pools_engine(channel: grpc.aio.Channel) -> None:
    await matched(channel, "t-pool-peer", producer="p7")
    assert (await get_engine(channel, "d0", POOL, transfer_id="t-pool-peer")).engine_id == "d0"
    # And, pulling from it, a consumer reads that engine of a pool it may not act in.
    incarnation = await matched(channel, "t-pool-pull", producer="p7", mode=PULL)
    await source_ready(channel, "t-pool-pull", incarnation, producer="p7")
    assert (await get_engine(channel, "p7", D0, transfer_id="t-pool-pull")).pool == "prefill-b"


async def test_no_peer_is_read_through_an_ended_transfer(channel: grpc.aio.Channel) -> None:
    """Its peer restarted: the transfer aborted, and the new incarnation's agents were never handed to this producer."""
    await matched(channel, "t-ended")
    await register(channel, "d0", pb.ENGINE_ROLE_CONSUMER, D0)
    assert (await get_transfer(channel, "t-ended", P0)).state == pb.TRANSFER_STATE_ABORTED
    assert await refusal(get_engine(channel, "d0", P0, transfer_id="t-ended")) == ROLE_REQUIRED


async def test_a_re_registered_peer_is_not_read_through_its_old_incarnation_s_transfer(
    server: RendezvousServer, channel: grpc.aio.Channel
) -> None:
    """A re-registration whose call was cut off before it applied the old incarnation's loss (the next keep-alive
    applies it) leaves that incarnation's transfer live: the new incarnation's agents are not read through it."""
    await matched(channel, "t-stale")
    now, limits, timeouts = server.coordinator.clock(), server.config.limits, server.config.timeouts

    def reregistered(cur: Engine | None) -> Engine:
        assert cur is not None
        spec = dataclasses.replace(core_engine("d0", Role.CONSUMER), owner=cur.owner)
        return engine_rules.register_engine(now, cur, spec, limits, timeouts)

    await server.store.update_engine("d0", reregistered)
    assert (await get_transfer(channel, "t-stale", P0)).state == pb.TRANSFER_STATE_MATCHED
    assert await refusal(get_engine(channel, "d0", P0, transfer_id="t-stale")) == ROLE_REQUIRED


async def test_a_non_participant_reading_an_engine_through_a_transfer_learns_nothing_of_it(
    channel: grpc.aio.Channel,
) -> None:
    await matched(channel, "t-live-00")
    await register(channel, "d1", pb.ENGINE_ROLE_CONSUMER, D1)
    through_live = await answer(get_engine(channel, "p0", D1, transfer_id="t-live-00"), "t-live-00")
    through_unknown = await answer(get_engine(channel, "p0", D1, transfer_id="t-none-00"), "t-none-00")
    assert through_live == through_unknown and through_live[0] == grpc.StatusCode.PERMISSION_DENIED
    assert b"ROLE_REQUIRED" in through_live[2]
    # Its own engine in the transfer is no way to another engine, nor a half targeted alone to anyone.
    assert await refusal(get_engine(channel, "d1", P0, transfer_id="t-live-00")) == ROLE_REQUIRED
    incarnation = await register(channel, "d0-2", pb.ENGINE_ROLE_CONSUMER, D0)
    target = pb.RegisterTargetsRequest(
        engine_id="d0-2", incarnation=incarnation, targets=[pb.TargetSpec(transfer_id="t-half", block_ids=[1])]
    )
    assert not (await call(channel, "RegisterTargets", target, D0)).results[0].HasField("status")
    assert await refusal(get_engine(channel, "p0", D0, transfer_id="t-half")) == ROLE_REQUIRED


# GetTransfer: the transfers an engine identity's engines take part in


async def test_each_half_reads_its_transfer(channel: grpc.aio.Channel) -> None:
    await matched(channel, "t-1")
    for token in (D0, P0):
        transfer = await get_transfer(channel, "t-1", token)
        assert (transfer.consumer_engine_id, transfer.producer_engine_id) == ("d0", "p0")
        assert transfer.state == pb.TRANSFER_STATE_MATCHED


async def test_a_pool_identity_reads_the_transfers_of_its_pools_engines(channel: grpc.aio.Channel) -> None:
    await matched(channel, "t-pool", producer="p7")
    assert (await get_transfer(channel, "t-pool", POOL)).producer_engine_id == "p7"


async def test_a_half_targeted_alone_is_read_by_its_consumer(channel: grpc.aio.Channel) -> None:
    incarnation = await register(channel, "d0", pb.ENGINE_ROLE_CONSUMER, D0)
    target = pb.RegisterTargetsRequest(
        engine_id="d0", incarnation=incarnation, targets=[pb.TargetSpec(transfer_id="t-alone", block_ids=[1])]
    )
    assert not (await call(channel, "RegisterTargets", target, D0)).results[0].HasField("status")
    assert (await get_transfer(channel, "t-alone", D0)).state == pb.TRANSFER_STATE_TARGETED


@pytest.mark.parametrize("token", [D1, POOL], ids=["another-engine", "another-pool"])
async def test_a_non_participant_reading_a_transfer_is_answered_exactly_as_for_an_unknown_id(
    channel: grpc.aio.Channel, token: str
) -> None:
    await matched(channel, "t-live-00")
    await register(channel, "d1", pb.ENGINE_ROLE_CONSUMER, D1)
    await pool_engine(channel, "p7")
    live = await answer(get_transfer(channel, "t-live-00", token), "t-live-00")
    unknown = await answer(get_transfer(channel, "t-none-00", token), "t-none-00")  # the same length
    assert live == unknown
    assert live[:2] == (grpc.StatusCode.NOT_FOUND, "transfer <id> is unknown") and b"TRANSFER_NOT_FOUND" in live[2]
    # Nor its tombstone, which its halves still read.
    await register(channel, "d0", pb.ENGINE_ROLE_CONSUMER, D0)  # d0 restarts: the transfer aborts
    assert (await get_transfer(channel, "t-live-00", P0)).state == pb.TRANSFER_STATE_ABORTED
    assert await answer(get_transfer(channel, "t-live-00", token), "t-live-00") == unknown


async def test_the_router_and_admin_read_every_transfer(channel: grpc.aio.Channel) -> None:
    await matched(channel, "t-2")
    assert (await get_transfer(channel, "t-2", ROUTER)).consumer_engine_id == "d0"
    assert (await get_transfer(channel, "t-2", ADMIN)).producer_engine_id == "p0"


# The SDK under auth


async def test_a_following_rank_follows_its_engine_with_the_engines_token(server: RendezvousServer) -> None:
    """A multi-rank engine's other ranks (their own processes, so their own clients) find rank 0's incarnation and
    read its lease with GetEngine (rendezvous.clients.RankSession); before, ROLE_REQUIRED ended them."""
    agents = tuple(dataclasses.replace(agent(f"p0-{rank}"), rank=rank) for rank in range(2))
    layout = dataclasses.replace(LAYOUT, tp_size=2)
    async with (
        AsyncRendezvousClient(ClientConfig(server.address, token=P0)) as rank_0,
        AsyncRendezvousClient(ClientConfig(server.address, token=P0)) as rank_1,
        ProducerSession(rank_0, "p0", "prefill", layout=layout, agents=agents, config=FAST_SESSION) as leader,
        RankSession(rank_1, "p0", config=FAST_SESSION) as follower,
    ):
        assert follower.incarnation == leader.incarnation
        assert follower.writable_until > 0  # the lease it read
