"""Every byte counted (issue 24, item 3): what the server keeps beyond its records is bounded, on a real server
over gRPC with the memory and the Redis store.

- The idempotency cache keeps a digest of the request and a slim answer (a RegisterEngine answer without the
  agent metadata, regions and labels its request repeats), bounded in bytes over the server and per identity;
  a request_id reused for another request is refused (REQUEST_ID_REUSED).
- An engine's event log is bounded in bytes (`max_event_bytes_per_engine`); a watcher behind it resyncs. So are
  the logs of an identity's engines together (`max_event_bytes_per_identity`) and all of them
  (`max_event_bytes_total`), each trimming its oldest events first.
- A tombstone keeps no labels.
- Registrations in flight together on one server cannot pass the agent metadata budget between them, nor
  target batches in flight together the live-block budget (memory store; Redis checks it in its script).
- A Watch reader that stops reading is dropped once the responses readers have not taken pass
  `max_watch_buffer_bytes` (RESOURCE_EXHAUSTED / BUDGET_EXHAUSTED), and resumes from its sequence.

Sizes are asserted on what the stores count (`answer_bytes`, `event_log_bytes`, the stored records), not on RSS.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from rendezvous import pacing
from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.coordinator import Coordinator, ItemOutcome
from rendezvous.core import Limits
from rendezvous.core.model import Role
from rendezvous.protocol.errors import Reason
from rendezvous.protocol.requests import TargetSpec
from rendezvous.store.memory import MemoryStore
from rendezvous.v1 import rendezvous_pb2 as pb
from tests.core.helpers import engine_spec
from tests.redis_fixtures import fresh_prefix, redis_url, with_prefix
from tests.security.test_budgets import Client, client, refused, registration

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
        total, mine = await store.answer_bytes(c.owner("d0"))
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
            _, mine = await store.answer_bytes(c.owner("d0"))
            assert mine <= 8_000
        total, theirs = await store.answer_bytes(c.owner("d1"))
        assert theirs > 0 and total <= 24_000
        # d0's flood dropped only d0's answers: d1's retry is still answered from the cache.
        assert await c.call("RegisterEngine", kept, "d1") == answered
        # An answer larger than max_answer_bytes is not kept (a retry runs again).
        big = big_registration("d0-0", 2_000)
        big.labels.clear()
        big.labels["x"] = "y" * 3_900
        await c.call("RegisterEngine", big, "d0")
        assert (await store.answer_bytes(c.owner("d0")))[1] <= 8_000


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
            claim = pb.ClaimTransfersRequest(engine_id=p0.engine_id, incarnation=p0.incarnation)
            claim.claims.add(transfer_id=tid)
            await c.call("ClaimTransfers", claim, "p0")
            abort = pb.AbortTransfersRequest(engine_id=d0.engine_id, incarnation=d0.incarnation)
            abort.aborts.add(transfer_id=tid, message="again")
            await c.call("AbortTransfers", abort, "d0")
        # The producer's log: a TRANSFER_ASSIGNED (4,096 block ids) and a TRANSFER_ENDED per round.
        assert 0 < await store.event_log_bytes("p0-0") <= 256 << 10
        assert await store.event_log_bytes("d0-0") <= 256 << 10
        # The oldest events went: a watcher from the first sequence is told to resync (and relist).
        stream = c.stub.Watch(pb.WatchRequest(engine_id="p0-0", start_sequence=1), metadata=_auth("p0"), timeout=10)
        responses = [await stream.read() for _ in range(2)]
        stream.cancel()
        assert responses[1].resync_required


async def _assign_rounds(c: Client, consumer: str, producers: list[str], blocks: int, rounds: int) -> None:
    """Rounds of: the consumer registers a target of `blocks` block ids, the next producer claims it (a
    TRANSFER_ASSIGNED to the producer with the block ids and the consumer's record), the consumer aborts it."""
    who = consumer.split("-")[0]
    d = (await c.call("RegisterEngine", _engine(consumer, blocks, consumer=True), who)).engine
    engines = [(await c.call("RegisterEngine", _engine(p, blocks, consumer=False), "p0")).engine for p in producers]
    for n in range(rounds):
        tid = f"{consumer}-t{n}"
        producer = engines[n % len(engines)]
        await c.target(d, tid, blocks, who)
        claim = pb.ClaimTransfersRequest(engine_id=producer.engine_id, incarnation=producer.incarnation)
        claim.claims.add(transfer_id=tid)
        await c.call("ClaimTransfers", claim, "p0")
        abort = pb.AbortTransfersRequest(engine_id=d.engine_id, incarnation=d.incarnation)
        abort.aborts.add(transfer_id=tid, message="again")
        await c.call("AbortTransfers", abort, who)


async def _watch_first(c: Client, engine_id: str, who: str) -> pb.WatchResponse:
    """What a watcher from sequence 1 hears after the snapshot: events from 1, or resync_required."""
    stream = c.stub.Watch(pb.WatchRequest(engine_id=engine_id, start_sequence=1), metadata=_auth(who), timeout=10)
    responses: list[pb.WatchResponse] = [await stream.read() for _ in range(2)]
    stream.cancel()
    return responses[1]


async def test_an_identitys_event_logs_are_bounded_together_oldest_first(store_url: str, tmp_path: Path) -> None:
    # Each of p0's 4 engines stays under its own bound (64 MiB); together they would pass p0's (Redis: 48 events
    # of about 6 KiB, memory: of about 50 KiB).
    limits = Limits(max_event_bytes_per_identity=128 << 10, max_blocks_per_target=4_096)
    async with client(store_url, tmp_path, limits) as c:
        store = c.server.store
        producers = [f"p0-{i}" for i in range(4)]
        await _assign_rounds(c, "d0-0", producers, 1_024, 48)
        sizes = [await store.event_log_bytes(p) for p in producers]
        assert sum(sizes) <= 128 << 10 and sizes[3] > 0
        # The oldest of p0's events went first (p0-0's first TRANSFER_ASSIGNED): its watcher resyncs; the newest
        # stays: p0-3's last event is the newest of the identity.
        assert (await _watch_first(c, "p0-0", "p0")).resync_required
        # Another identity's log is not p0's to trim: d0's consumer still has every event from sequence 1. Its
        # events are the revocations of its aborts, confirmed once the producers end: they end now (the test
        # waited for their leases to lapse, 10 s of wall clock, racing the watch's own 10 s deadline).
        for p in producers:
            await c.call("DeregisterEngine", pb.DeregisterEngineRequest(engine_id=p), "p0")
        first = await _watch_first(c, "d0-0", "d0")
        assert not first.resync_required and first.events[0].sequence == 1
        assert await c.serving()


async def test_all_event_logs_are_bounded_over_the_server_oldest_first(store_url: str, tmp_path: Path) -> None:
    limits = Limits(max_event_bytes_total=320 << 10, max_blocks_per_target=4_096)
    async with client(store_url, tmp_path, limits) as c:
        store = c.server.store
        await _assign_rounds(c, "d0-0", ["p0-0"], 4_096, 16)  # the oldest events of the server
        await _assign_rounds(c, "d1-0", ["p0-1"], 4_096, 16)
        engines = ["d0-0", "p0-0", "d1-0", "p0-1"]
        sizes = [await store.event_log_bytes(e) for e in engines]
        assert sum(sizes) <= 320 << 10 and sizes[3] > 0
        # The server's oldest events (d0's rounds, on p0-0) went first; the newest log keeps its latest event.
        assert (await _watch_first(c, "p0-0", "p0")).resync_required
        assert await c.serving()


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
            assert (await c.server.store.usage(c.owner(who))).identity.metadata_bytes == 4_000
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


def _gauge(c: Client, name: str) -> float:
    return c.server.metrics.registry.get_sample_value(name) or 0.0


async def _until(condition: Callable[[], bool]) -> None:
    """Poll a condition of the server's state (no time bound of its own: the test's timeout is the limit)."""
    while True:
        if condition():
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("with_auth", [True, False], ids=["auth", "no-auth"])
async def test_a_stalled_watch_reader_is_dropped_past_the_output_buffer_limit(
    store_url: str, tmp_path: Path, with_auth: bool
) -> None:
    # Each TRANSFER_ASSIGNED a producer is sent carries its consumer, with 1 MiB of agent metadata.
    limits = Limits(max_watch_buffer_bytes=3 * MIB // 2)
    async with client(store_url, tmp_path if with_auth else None, limits) as c:
        who = {"d0": "d0", "p0": "p0"} if with_auth else {"d0": None, "p0": None}
        d0 = (await c.call("RegisterEngine", registration("d0-0", METADATA), who["d0"])).engine
        producers = [(await c.call("RegisterEngine", _engine(f"p0-{n}", 64, False), who["p0"])).engine for n in (0, 1)]
        metadata = _auth("p0") if with_auth else None
        # Two readers that stop after the first response (a SIGSTOPped client): nothing more is taken.
        streams = []
        for p in producers:
            stream = c.stub.Watch(pb.WatchRequest(engine_id=p.engine_id), metadata=metadata, timeout=60)
            await stream.read()
            streams.append(stream)

        async def assign(p: pb.Engine, n: int) -> None:
            tid = f"{p.engine_id}-t{n}"
            await c.target(d0, tid, 4, who["d0"])
            claim = pb.ClaimTransfersRequest(engine_id=p.engine_id, incarnation=p.incarnation)
            claim.claims.add(transfer_id=tid)
            await c.call("ClaimTransfers", claim, who["p0"])

        # The first reader's window fills: a response stays handed to gRPC and not taken.
        for n in range(8):
            await assign(producers[0], n)
        await _until(lambda: _gauge(c, "kv_rendezvous_watch_buffer_bytes") >= MIB)
        # The second stalls too: together past the limit, the stream that waited longest is dropped.
        for n in range(8):
            await assign(producers[1], n)
        await _until(lambda: _gauge(c, "kv_rendezvous_watch_dropped_total") == 1)
        assert _gauge(c, "kv_rendezvous_watch_buffer_bytes") <= 3 * MIB // 2
        # Its handler ends at once (the events it read and its response freed), without its reader.
        await _until(lambda: _gauge(c, "kv_rendezvous_watchers") == 1)
        # The dropped reader gets what was on its way, then RESOURCE_EXHAUSTED / BUDGET_EXHAUSTED; it resumes
        # from the sequence after the last event it received.
        last = 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                response = await streams[0].read()
                if response.events:
                    last = response.events[-1].sequence
        converted = from_rpc_error(err.value)
        assert (converted.code, converted.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "BUDGET_EXHAUSTED")
        assert converted.metadata["budget"] == "watch_buffer_bytes"
        resumed = c.stub.Watch(pb.WatchRequest(engine_id="p0-0", start_sequence=last + 1), metadata=metadata)
        await resumed.read()
        await assign(producers[0], 8)  # at least one event after those it received
        rest = await resumed.read()
        assert rest.events and rest.events[0].sequence == last + 1
        resumed.cancel()
        streams[1].cancel()
        assert await c.serving()


@pytest.mark.parametrize(("scope", "owner"), [("server", ""), ("identity", "x")])
async def test_memory_store_batches_in_flight_together_never_pass_the_live_block_budget(
    monkeypatch: pytest.MonkeyPatch, scope: str, owner: str
) -> None:
    """Each batch alone fits the budget it reads as it starts; interleaved item by item (a pacing quantum of 0
    yields after every item), the write that would pass the budget is refused, whichever batch it is in."""
    monkeypatch.setattr(pacing, "QUANTUM", 0.0)
    limits = Limits(max_live_blocks=10, max_live_blocks_per_identity=8)
    coordinator = Coordinator(MemoryStore(limits=limits), limits)
    await coordinator.register_engine(engine_spec("c0", Role.CONSUMER, owner=owner))

    async def targets(batch: str) -> list[ItemOutcome]:
        specs = [TargetSpec(f"{batch}-{i}", (2 * i, 2 * i + 1)) for i in range(3)]
        return await coordinator.register_targets("c0", 0, specs)

    outcomes = [o for batch in await asyncio.gather(targets("a"), targets("b")) for o in batch]
    refused_ = [o.error for o in outcomes if o.error is not None]
    most = limits.max_live_blocks if scope == "server" else limits.max_live_blocks_per_identity
    assert len(outcomes) - len(refused_) == most // 2
    for err in refused_:
        assert (err.reason, err.metadata["budget"], err.metadata["scope"]) == (
            Reason.BUDGET_EXHAUSTED,
            "live_blocks",
            scope,
        )
    usage = await coordinator.store.usage(owner)
    assert usage.total.blocks == most
