"""Every byte counted (issue 24, item 3): what the server keeps beyond its records is bounded, on a real server
over gRPC with the memory and the Redis store.

- The idempotency cache keeps a digest of the request and a slim answer (a RegisterEngine answer without the
  agent metadata, regions and labels its request repeats), bounded in bytes over the server and per identity;
  a request_id reused for another request is refused (REQUEST_ID_REUSED).
- An engine's event log is bounded in bytes (`max_event_bytes_per_engine`); a watcher behind it resyncs.
- A tombstone keeps no labels.
- Registrations in flight together on one server cannot pass the agent metadata budget between them.

Sizes are asserted on what the stores count (`answer_bytes`, `event_log_bytes`, the stored records), not on RSS.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import grpc
import pytest

from rendezvous.core import Limits
from rendezvous.v1 import rendezvous_pb2 as pb
from tests.redis_fixtures import fresh_prefix, redis_url, with_prefix
from tests.security.test_budgets import client, refused, registration

__all__ = ["redis_url"]

MIB = 1 << 20
METADATA = MIB  # the largest one agent may carry
LABELS = {f"k{i:02d}": "v" * 250 for i in range(60)}  # 15.2 KiB: near the 16 KiB limit


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def store_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory"
    return with_prefix(request.getfixturevalue("redis_url"), fresh_prefix())


def big_registration(engine_id: str, metadata: int = METADATA) -> pb.RegisterEngineRequest:
    request = registration(engine_id, metadata)
    request.labels.update(LABELS)
    request.request_id = uuid.uuid4().hex
    return request


async def test_kept_answers_hold_no_agent_metadata_and_a_retry_gets_all_of_it(store_url: str, tmp_path: Path) -> None:
    async with client(store_url, tmp_path, Limits()) as c:
        store = c.server.store
        first = None
        for _ in range(8):  # an engine re-registering with 1 MiB of metadata and fresh request ids
            request = big_registration("d0-0")
            first = await c.call("RegisterEngine", request, "d0")
        assert first is not None
        total, mine = await store.answer_bytes("d0")
        # Eight answers of a 1 MiB registration: each kept in under 2 KiB (before: 1 MiB each).
        assert total == mine and 0 < mine < 8 * 2_048
        # The last request's retry is answered from the cache (the same incarnation), metadata and labels back.
        again = await c.call("RegisterEngine", request, "d0")
        assert again == first
        assert len(again.engine.agents[0].metadata) == METADATA and dict(again.engine.labels) == LABELS
        assert await c.serving()


async def test_a_request_id_reused_for_another_request_is_refused(store_url: str, tmp_path: Path) -> None:
    async with client(store_url, tmp_path, Limits()) as c:
        request = registration("d0-0", 64)
        request.request_id = "reused-1"
        first = await c.call("RegisterEngine", request, "d0")
        other = registration("d0-0", 65)
        other.request_id = "reused-1"
        error, meta = await refused(c.call("RegisterEngine", other, "d0"))
        assert error == (grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_REUSED")
        assert meta == {"request_id": "reused-1"}
        # The request it answered still gets its answer; the refused one changed nothing.
        assert await c.call("RegisterEngine", request, "d0") == first
        got = await c.call("GetEngine", pb.GetEngineRequest(engine_id="d0-0"), "ops")
        assert got.engine.incarnation == first.engine.incarnation


async def test_kept_answers_are_bounded_per_identity_and_over_the_server(store_url: str, tmp_path: Path) -> None:
    limits = Limits(max_answers_bytes=24_000, max_answers_bytes_per_identity=8_000, max_answer_bytes=4_000)
    async with client(store_url, tmp_path, limits) as c:
        store = c.server.store
        # d1's answer, kept before d0 floods the cache with its own.
        kept = registration("d1-0", 64)
        kept.request_id = "d1-first"
        answered = await c.call("RegisterEngine", kept, "d1")
        for n in range(40):  # fresh request ids: each answer kept (a few hundred bytes each)
            request = registration(f"d0-{n % 3}", 64)
            request.request_id = f"d0-{n}"
            await c.call("RegisterEngine", request, "d0")
            _, mine = await store.answer_bytes("d0")
            assert mine <= 8_000
        total, theirs = await store.answer_bytes("d1")
        assert theirs > 0 and total <= 24_000
        # d0's flood dropped only d0's answers: d1's retry is still answered from the cache.
        assert await c.call("RegisterEngine", kept, "d1") == answered
        # An answer larger than max_answer_bytes is not kept (a retry runs again).
        big = big_registration("d0-0", 2_000)
        big.labels.clear()
        big.labels["x"] = "y" * 3_900
        await c.call("RegisterEngine", big, "d0")
        assert (await store.answer_bytes("d0"))[1] <= 8_000


async def test_an_event_log_is_bounded_in_bytes_and_its_watcher_resyncs(store_url: str, tmp_path: Path) -> None:
    limits = Limits(max_event_bytes_per_engine=256 << 10, max_blocks_per_target=4_096)
    async with client(store_url, tmp_path, limits) as c:
        store = c.server.store
        blocks = 4_096
        d0 = (await c.call("RegisterEngine", _engine("d0-0", blocks, consumer=True), "d0")).engine
        p0 = (await c.call("RegisterEngine", _engine("p0-0", blocks, consumer=False), "p0")).engine
        for n in range(24):  # register 4,096 blocks, claim, abort, repeat
            tid = f"t{n}"
            await c.target(d0, tid, blocks, "d0")
            claim = pb.ClaimTransferRequest(engine_id=p0.engine_id, incarnation=p0.incarnation)
            claim.claims.add(transfer_id=tid)
            await c.call("ClaimTransfer", claim, "p0")
            abort = pb.AbortTransferRequest(engine_id=d0.engine_id, incarnation=d0.incarnation)
            abort.aborts.add(transfer_id=tid, message="again")
            await c.call("AbortTransfer", abort, "d0")
        # The producer's log: a TRANSFER_ASSIGNED (4,096 block ids) and a TRANSFER_ENDED per round.
        assert 0 < await store.event_log_bytes("p0-0") <= 256 << 10
        assert await store.event_log_bytes("d0-0") <= 256 << 10
        # The oldest events went: a watcher from the first revision is told to resync (and relist).
        stream = c.stub.Watch(pb.WatchRequest(engine_id="p0-0", start_revision=1), metadata=_auth("p0"), timeout=10)
        responses = [await stream.read() for _ in range(2)]
        stream.cancel()
        assert responses[1].resync_required


def _engine(engine_id: str, blocks: int, consumer: bool) -> pb.RegisterEngineRequest:
    request = registration(engine_id, 64, consumer)
    request.agents[0].regions[0].num_blocks = blocks
    return request


def _auth(who: str) -> tuple[tuple[str, str], ...]:
    from tests.security.test_auth import bearer
    from tests.security.test_budgets import TOKENS

    return bearer(TOKENS[who])


async def test_a_tombstone_keeps_no_labels(store_url: str, tmp_path: Path) -> None:
    async with client(store_url, tmp_path, Limits()) as c:
        request = registration("d0-0", 4_096)
        request.labels.update(LABELS)
        engine = (await c.call("RegisterEngine", request, "d0")).engine
        assert dict(engine.labels) == LABELS
        await c.call(
            "DeregisterEngine", pb.DeregisterEngineRequest(engine_id="d0-0", incarnation=engine.incarnation), "d0"
        )
        tombstone = await c.server.store.get_engine("d0-0")
        assert tombstone is not None and tombstone.ended_at
        assert tombstone.labels == {} and all(not a.metadata and not a.regions for a in tombstone.agents)


async def test_parallel_registrations_stay_within_the_metadata_budget(store_url: str, tmp_path: Path) -> None:
    limits = Limits(max_agent_metadata_bytes_per_identity=6_000, max_agent_metadata_bytes_total=9_000)
    async with client(store_url, tmp_path, limits) as c:
        calls = [c.call("RegisterEngine", registration(f"d0-{n}", 4_000), "d0") for n in range(10)]
        calls += [c.call("RegisterEngine", registration(f"d1-{n}", 4_000), "d1") for n in range(10)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        refusals = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert len(refusals) == 18 and all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refusals)
        for who in ("d0", "d1"):
            assert (await c.server.store.usage(who)).identity.metadata_bytes == 4_000
        assert (await c.server.store.usage("")).total.metadata_bytes == 8_000
        assert await c.serving()


async def test_an_answer_kept_whole_by_an_earlier_version_still_answers_its_retry(
    store_url: str, tmp_path: Path
) -> None:
    # Replicas sharing Redis during a rolling upgrade: the earlier version kept the serialized answer alone.
    async with client(store_url, tmp_path, Limits()) as c:
        request = registration("d0-0", 64)
        request.request_id = "from-before"
        earlier = pb.RegisterEngineResponse(engine=pb.Engine(engine_id="d0-0", incarnation=41))
        await c.server.store.put_response("RegisterEngine/d0-0/from-before", earlier.SerializeToString(), 60, "d0")
        assert await c.call("RegisterEngine", request, "d0") == earlier
