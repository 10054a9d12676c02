"""KvIndexService over real gRPC, on the memory store and on Redis, through the SDK: reports, snapshots, queries,
and every refusal of the issue's "Bad input" with its status and reason."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest

from rendezvous.clients import (
    AllBlocksCleared,
    AsyncRendezvousClient,
    BlockHashing,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    CacheReport,
    CacheSnapshot,
    EngineRole,
    PrefixQuery,
    Reason,
    RendezvousClient,
    RendezvousError,
    hash_of,
)
from rendezvous.clients.testing import AsyncTestServer, FakeClock, TestServer, start_test_server
from rendezvous.core import Limits, Timeouts
from rendezvous.v1 import index_pb2 as ipb
from rendezvous.v1 import index_pb2_grpc as ipb_grpc
from tests.factories import sdk_engine
from tests.redis_fixtures import redis_url, store

__all__ = ["redis_url", "store"]  # the fixtures

HASHING = BlockHashing("sha256_cbor", "0", 16)
CHAIN = tuple(bytes([i]) * 32 for i in range(1, 9))
"""Eight blocks of one request's chain (sha256-sized hashes)."""
LIMITS = Limits(max_index_blocks_per_engine=64, max_index_blocks_total=100, max_index_query_blocks=16)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def server(store: str, clock: FakeClock) -> AsyncIterator[AsyncTestServer]:
    async with start_test_server(clock, store=store, limits=LIMITS, timeouts=Timeouts(default_lease_ttl=2)) as srv:
        yield srv


@pytest.fixture
async def client(server: AsyncTestServer) -> AsyncIterator[AsyncRendezvousClient]:
    async with AsyncRendezvousClient(server.address) as c:
        yield c


async def register(client: AsyncRendezvousClient, engine_id: str, role: EngineRole = EngineRole.PRODUCER) -> int:
    return (await client.register_engine(sdk_engine(engine_id, role))).engine.incarnation


def report(sequence: int, *events: CacheEvent, engine_id: str = "p0", first: bool = False) -> CacheReport:
    return CacheReport(engine_id, sequence, events, HASHING if first else None)


def stored(first: int, last: int, group: int = 0) -> BlocksStored:
    """CHAIN[first:last], linked to the block before first."""
    return BlocksStored(CHAIN[first:last], CHAIN[first - 1] if first else b"", group, (last - first) * 16)


async def matched(client: AsyncRendezvousClient, chain: tuple[bytes, ...] = CHAIN, **kw: object) -> dict[str, int]:
    return {m.engine_id: m.matched_blocks for m in await client.match_prefixes(PrefixQuery(chain, **kw))}  # type: ignore[arg-type]


async def refused(call: object, code: grpc.StatusCode, reason: Reason) -> RendezvousError:
    with pytest.raises(RendezvousError) as caught:
        await call  # type: ignore[misc]
    assert (caught.value.code, caught.value.reason) == (code, reason), caught.value
    return caught.value


async def test_routers_see_what_engines_reported_and_never_a_removed_block(client: AsyncRendezvousClient) -> None:
    await register(client, "p0")
    await register(client, "d0", EngineRole.CONSUMER)
    at = await client.report_cache_events(report(0, stored(0, 6), engine_id="p0", first=True))
    assert (at.sequence, at.block_count, at.duplicate) == (0, 6, False)
    await client.report_cache_events(report(10, stored(0, 3), engine_id="d0", first=True))
    assert await matched(client) == {"p0": 6, "d0": 3}
    await client.report_cache_events(report(1, BlocksRemoved((CHAIN[2],)), engine_id="p0"))
    assert await matched(client) == {"p0": 2, "d0": 3}
    assert await matched(client, role=EngineRole.CONSUMER) == {"d0": 3}
    [answer] = await client.match_prefixes(PrefixQuery(CHAIN, engine_ids=("p0",)))
    assert (answer.hashing, answer.sequence, answer.role, answer.pool) == (HASHING, 1, EngineRole.PRODUCER, "prefill")
    await client.report_cache_events(report(2, AllBlocksCleared(), engine_id="p0"))
    assert await matched(client) == {"p0": 0, "d0": 3}


async def test_a_query_past_its_lookups_is_answered_cut_at_one_depth(store: str, clock: FakeClock) -> None:
    """max_index_query_lookups bounds a query's work: 3 engines, 10 lookups reach depth 3 of the chain (3 a level,
    then the 1 left is too few for a level), so the two holding the whole chain answer 3 and the one holding 2
    blocks its exact 2. Not an error: a router still places by the longest prefix it can tell apart."""
    limits = replace(LIMITS, max_index_query_lookups=10)
    async with (
        start_test_server(clock, store=store, limits=limits, timeouts=Timeouts(default_lease_ttl=2)) as srv,
        AsyncRendezvousClient(srv.address) as client,
    ):
        for engine_id, n in (("p0", 8), ("p1", 8), ("p2", 2)):
            await register(client, engine_id)
            await client.report_cache_events(report(0, stored(0, n), engine_id=engine_id, first=True))
        assert await matched(client) == {"p0": 3, "p1": 3, "p2": 2}
        # The answer says which counts are "at least" (before, a cut answer looked exact).
        assert {m.engine_id for m in await client.match_prefixes(PrefixQuery(CHAIN)) if m.at_least} == {"p0", "p1"}
        assert await matched(client, engine_ids=("p0",)) == {"p0": 8}  # 1 engine: 8 lookups, exact
        assert not (await client.match_prefixes(PrefixQuery(CHAIN, engine_ids=("p0",))))[0].at_least


async def test_an_answer_past_max_response_bytes_keeps_the_engines_that_match_most(
    store: str, clock: FakeClock
) -> None:
    """A MatchPrefixes answer lists every selected engine: with thousands indexed it could pass a client's 4 MiB
    receive limit (found by an audit). It is cut like any response at `max_response_bytes`: best first, so the
    engines left out are those that match least."""
    one = len(ipb.PrefixMatch(engine_id="p0", pool="prefill", matched_blocks=8).SerializeToString()) + 40
    limits = replace(LIMITS, max_response_bytes=2 * one)
    async with (
        start_test_server(clock, store=store, limits=limits, timeouts=Timeouts(default_lease_ttl=2)) as srv,
        AsyncRendezvousClient(srv.address) as client,
    ):
        for engine_id, n in (("p0", 2), ("p1", 8), ("p2", 5), ("p3", 1)):
            await register(client, engine_id)
            await client.report_cache_events(report(0, stored(0, n), engine_id=engine_id, first=True))
        best = list((await matched(client)).items())
        assert 1 <= len(best) < 4 and best == [("p1", 8), ("p2", 5), ("p0", 2)][: len(best)]
        async with grpc.aio.insecure_channel(srv.address) as channel:  # the count left out, for any client
            answer = await ipb_grpc.KvIndexServiceStub(channel).MatchPrefixes(
                ipb.MatchPrefixesRequest(block_hashes=CHAIN)
            )
        assert (len(answer.matches), answer.left_out) == (len(best), 4 - len(best))


async def test_kv_cache_groups_are_matched_apart(client: AsyncRendezvousClient) -> None:
    await register(client, "p0")
    await client.report_cache_events(report(0, stored(0, 4, group=0), stored(0, 2, group=1), first=True))
    assert await matched(client, group=0) == {"p0": 4}
    assert await matched(client, group=1) == {"p0": 2}


async def test_a_gap_is_refused_with_the_expected_sequence_and_a_snapshot_repairs_it(
    client: AsyncRendezvousClient,
) -> None:
    await register(client, "p0")
    await client.report_cache_events(report(0, stored(0, 2), first=True))
    gapped = client.report_cache_events(report(5, stored(2, 4)))
    err = await refused(gapped, grpc.StatusCode.FAILED_PRECONDITION, Reason.INDEX_SEQUENCE_GAP)
    assert err.metadata["expected_sequence"] == "1"
    assert await matched(client) == {"p0": 2}
    at = await client.replace_cached_blocks(CacheSnapshot("p0", 5, HASHING, ((0, CHAIN[:5]),)))
    assert (at.sequence, at.block_count) == (5, 5)
    await client.report_cache_events(report(6, stored(5, 8)))
    assert await matched(client) == {"p0": 8}


async def test_a_duplicate_is_a_no_op_and_an_older_batch_is_refused(client: AsyncRendezvousClient) -> None:
    """A sequence names one batch of the incarnation: the same sequence again is the same batch retried, answered
    as done and applied once. The events are not compared, so another batch at the entry's sequence is not applied
    either; a feeder that does not know where its entry stands (it restarted) sends a snapshot, taken at the entry's
    own sequence (docs/protocol.md, "The KV index")."""
    await register(client, "p0")
    await client.report_cache_events(report(0, stored(0, 2), first=True))
    await client.report_cache_events(report(1, stored(2, 3)))
    again = await client.report_cache_events(report(1, BlocksRemoved(CHAIN[:3])))
    assert (again.duplicate, again.sequence, again.block_count) == (True, 1, 3)
    await refused(
        client.report_cache_events(report(0, BlocksRemoved(CHAIN[:1]))),
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.INDEX_SEQUENCE_STALE,
    )
    assert await matched(client) == {"p0": 3}
    at = await client.replace_cached_blocks(CacheSnapshot("p0", 1, HASHING, ((0, CHAIN[:1]),)))
    assert (at.sequence, at.block_count) == (1, 1)  # at the entry's sequence: replaced, not a duplicate
    # A report at a snapshot's sequence is a duplicate too: the snapshot holds the events up to it.
    assert (await client.report_cache_events(report(1, stored(1, 2)))).duplicate
    assert await matched(client) == {"p0": 1}
    await client.report_cache_events(report(2, stored(1, 2)))
    assert await matched(client) == {"p0": 2}


async def test_a_chain_that_does_not_link_is_refused_whole(client: AsyncRendezvousClient) -> None:
    await register(client, "p0")
    await client.report_cache_events(report(0, stored(0, 2), first=True))
    unlinked = report(1, stored(2, 3), stored(5, 6))
    await refused(
        client.report_cache_events(unlinked), grpc.StatusCode.FAILED_PRECONDITION, Reason.INDEX_PARENT_UNKNOWN
    )
    assert await matched(client) == {"p0": 2}


async def test_reports_for_unknown_or_replaced_engines_are_refused(client: AsyncRendezvousClient) -> None:
    await refused(
        client.report_cache_events(report(0, stored(0, 1), first=True)),
        grpc.StatusCode.NOT_FOUND,
        Reason.ENGINE_NOT_FOUND,
    )
    old = await register(client, "p0")
    await register(client, "p0")
    stale = replace(report(0, stored(0, 1), first=True), incarnation=old)
    await refused(client.report_cache_events(stale), grpc.StatusCode.FAILED_PRECONDITION, Reason.STALE_INCARNATION)


async def test_the_first_report_must_say_how_blocks_are_hashed(client: AsyncRendezvousClient) -> None:
    await register(client, "p0")
    await refused(
        client.report_cache_events(report(0, stored(0, 1))),
        grpc.StatusCode.FAILED_PRECONDITION,
        Reason.INDEX_HASHING_MISSING,
    )


async def test_floods_past_the_bounds_are_refused(client: AsyncRendezvousClient) -> None:
    many = tuple(hash_of(i) for i in range(65))
    await register(client, "p0")
    # Reports past an engine's bound are refused (a snapshot past it is cut: the test below).
    await client.report_cache_events(CacheReport("p0", 0, (BlocksStored(many[:64]),), HASHING))
    err = await refused(
        client.report_cache_events(CacheReport("p0", 1, (BlocksStored(many[64:], many[63]),))),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        Reason.INDEX_FULL,
    )
    assert err.metadata["scope"] == "engine"
    await client.replace_cached_blocks(CacheSnapshot("p0", 0, HASHING, ((0, many[:60]),)))
    await register(client, "p1")
    await client.report_cache_events(CacheReport("p1", 0, (BlocksStored(many[:40]),), HASHING))
    err = await refused(
        client.report_cache_events(CacheReport("p1", 1, (BlocksStored(many[40:41], many[39]),))),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        Reason.INDEX_FULL,
    )
    assert (err.metadata["scope"], err.metadata["limit"]) == ("server", "100")


async def test_a_snapshot_past_the_servers_bound_is_cut_and_drops_what_the_engine_no_longer_holds(
    client: AsyncRendezvousClient,
) -> None:
    """A snapshot the server's bound (max_index_blocks_total, 100 here) has no room for is cut to its first blocks,
    as one past the engine's bound is. Before, it was refused with INDEX_FULL (scope server) and the entry kept the
    blocks the engine had evicted since: routers were sent to them."""
    await register(client, "p0")
    await register(client, "p1")
    stale = tuple(hash_of(1_000 + i) for i in range(8))
    await client.report_cache_events(CacheReport("p0", 0, (BlocksStored(stale),), HASHING))
    others = tuple(hash_of(2_000 + i) for i in range(60))
    await client.report_cache_events(CacheReport("p1", 0, (BlocksStored(others),), HASHING))
    held = tuple(hash_of(i) for i in range(50))  # p0's cache now: the stale blocks were evicted
    at = await client.replace_cached_blocks(CacheSnapshot("p0", 1, HASHING, ((0, held),)))
    assert (at.sequence, at.block_count, at.left_out) == (1, 40, 10)  # 100 - 60: what p1 leaves
    assert at.cut_by == "server"  # shared: room p1 frees is p0's to take
    assert await matched(client, stale) == {"p0": 0, "p1": 0}
    assert await matched(client, held[24:40]) == {"p0": 16, "p1": 0}
    assert await matched(client, held[40:]) == {"p0": 0, "p1": 0}
    # Past both bounds (70 blocks: the engine's 64, the server's room 40): the tighter one, the server's, is named.
    both = await client.replace_cached_blocks(CacheSnapshot("p0", 2, HASHING, ((0, held + stale + others[:12]),)))
    assert (both.block_count, both.left_out, both.cut_by) == (40, 30, "server")


async def test_malformed_requests_and_queries_over_the_limit_are_invalid(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    await register(client, "p0")
    too_long = PrefixQuery(tuple(hash_of(i) for i in range(17)))
    await refused(client.match_prefixes(too_long), grpc.StatusCode.INVALID_ARGUMENT, Reason.INDEX_QUERY_TOO_LARGE)
    bad_hash = report(0, BlocksStored((b"x" * 33,)), first=True)
    await refused(client.report_cache_events(bad_hash), grpc.StatusCode.INVALID_ARGUMENT, Reason.BLOCK_HASH_INVALID)
    # An event of no kind (a newer client's) is refused, not skipped.
    async with grpc.aio.insecure_channel(server.address) as channel:
        request = ipb.ReportCacheEventsRequest(engine_id="p0", events=[ipb.CacheEvent()])
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await ipb_grpc.KvIndexServiceStub(channel).ReportCacheEvents(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # A role this server does not know is refused, not read as "any role".
        query = ipb.MatchPrefixesRequest(block_hashes=[b"a"], role=7)  # type: ignore[arg-type]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await ipb_grpc.KvIndexServiceStub(channel).MatchPrefixes(query)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_an_entry_goes_with_its_engine(
    server: AsyncTestServer, client: AsyncRendezvousClient, clock: FakeClock
) -> None:
    inc = await register(client, "p0")
    await register(client, "p1")
    for engine_id in ("p0", "p1"):
        await client.report_cache_events(report(0, stored(0, 2), engine_id=engine_id, first=True))
    await client.deregister_engine("p0", inc)
    assert await matched(client) == {"p1": 2}
    clock.advance(3)  # past p1's lease
    await server.sweep()
    assert await matched(client) == {}


async def test_a_reregistered_engine_starts_a_fresh_entry(client: AsyncRendezvousClient) -> None:
    await register(client, "p0")
    await client.report_cache_events(report(7, stored(0, 4), first=True))
    await register(client, "p0")
    assert await matched(client) == {}
    await client.report_cache_events(report(0, stored(0, 1), first=True))
    assert await matched(client) == {"p0": 1}


def test_the_blocking_client_reports_and_queries() -> None:
    with TestServer() as server, RendezvousClient(server.address) as client:
        client.register_engine(sdk_engine("p0", EngineRole.PRODUCER))
        at = client.report_cache_events(report(0, stored(0, 3), first=True))
        assert at.block_count == 3
        assert client.replace_cached_blocks(CacheSnapshot("p0", 1, HASHING, ((0, CHAIN[:2]),))).sequence == 1
        assert [m.matched_blocks for m in client.match_prefixes(PrefixQuery(CHAIN))] == [2]


async def test_an_engine_with_integer_hashes_sends_eight_bytes_a_hash(client: AsyncRendezvousClient) -> None:
    """integer_hashes announces 64-bit integers (8 bytes big-endian): a hash or parent of another size is refused
    whole, in the first report, a later one (hashing announced before) and a snapshot."""
    await register(client, "p0")
    ints = replace(HASHING, integer_hashes=True)
    first = CacheReport("p0", 0, (BlocksStored((hash_of(1), b"x" * 32)),), ints)
    await refused(client.report_cache_events(first), grpc.StatusCode.INVALID_ARGUMENT, Reason.BLOCK_HASH_INVALID)
    await client.report_cache_events(CacheReport("p0", 0, (BlocksStored((hash_of(1),)),), ints))
    later = CacheReport("p0", 1, (BlocksStored((hash_of(2),), b"\x01"),))
    await refused(client.report_cache_events(later), grpc.StatusCode.INVALID_ARGUMENT, Reason.BLOCK_HASH_INVALID)
    removed = CacheReport("p0", 1, (BlocksRemoved((b"x" * 7,)),))
    await refused(client.report_cache_events(removed), grpc.StatusCode.INVALID_ARGUMENT, Reason.BLOCK_HASH_INVALID)
    snapshot = CacheSnapshot("p0", 1, ints, ((0, (hash_of(1), b"x" * 9)),))
    await refused(client.replace_cached_blocks(snapshot), grpc.StatusCode.INVALID_ARGUMENT, Reason.BLOCK_HASH_INVALID)
    assert await matched(client, (hash_of(1), hash_of(2))) == {"p0": 1}
    await client.report_cache_events(CacheReport("p0", 1, (BlocksStored((hash_of(2),), hash_of(1)),)))
    assert await matched(client, (hash_of(1), hash_of(2))) == {"p0": 2}


@pytest.mark.parametrize("lookups", [LIMITS.max_index_query_lookups, 5], ids=["one-script", "paced"])
async def test_an_engine_whose_lease_lapsed_is_left_out_before_the_sweep(
    store: str, clock: FakeClock, lookups: int
) -> None:
    """A lapsed lease that no sweep has ended yet: ListEngines leaves the engine out, and so does MatchPrefixes, on
    the one-script path and (5 lookups: too few for one script) the paced one."""
    limits = replace(LIMITS, max_index_query_lookups=lookups)
    async with (
        start_test_server(clock, store=store, limits=limits, timeouts=Timeouts(default_lease_ttl=2)) as srv,
        AsyncRendezvousClient(srv.address) as client,
    ):
        incarnations = {engine_id: await register(client, engine_id) for engine_id in ("p0", "p1")}
        for engine_id in incarnations:
            await client.report_cache_events(report(0, stored(0, 2), engine_id=engine_id, first=True))
        assert set(await matched(client)) == {"p0", "p1"}
        clock.advance(1.5)
        async with client.keep_alive() as stream:
            await stream.renew("p1", incarnations["p1"])
        clock.advance(1)  # p0's lease (2 s) has lapsed, p1's (renewed) has not; no sweep ran
        assert [e.engine_id for e in await client.list_engines()] == ["p1"]
        assert set(await matched(client)) == {"p1"}
        assert set(await matched(client, engine_ids=("p0", "p1"))) == {"p1"}


async def test_a_snapshot_past_the_engines_bound_is_cut_and_drops_what_the_engine_no_longer_holds(
    client: AsyncRendezvousClient,
) -> None:
    """An engine caching more blocks than max_index_blocks_per_engine (64 here): its snapshot keeps the first 64
    blocks in the order sent and says how many it left out. Before, it was refused with INDEX_FULL, every time,
    and the entry kept blocks the engine had evicted since (shown to routers for good)."""
    await register(client, "p0")
    stale = tuple(hash_of(1_000 + i) for i in range(8))
    await client.report_cache_events(CacheReport("p0", 0, (BlocksStored(stale),), HASHING))
    assert await matched(client, stale) == {"p0": 8}
    held = tuple(hash_of(i) for i in range(70))  # the engine's cache now: the stale blocks were evicted
    at = await client.replace_cached_blocks(CacheSnapshot("p0", 5, HASHING, ((0, held[:40]), (1, held[40:]))))
    assert (at.sequence, at.block_count, at.left_out, at.cut_by) == (5, 64, 6, "engine")
    assert await matched(client, stale) == {"p0": 0}
    assert await matched(client, held[24:40]) == {"p0": 16}  # a query carries at most 16 blocks here
    assert await matched(client, held[48:64], group=1) == {"p0": 16}
    assert await matched(client, held[64:], group=1) == {"p0": 0}
    # A snapshot within the bound is whole again.
    whole = await client.replace_cached_blocks(CacheSnapshot("p0", 6, HASHING, ((0, held[:10] + held[:10]),)))
    assert (whole.block_count, whole.left_out, whole.cut_by) == (10, 0, "")
