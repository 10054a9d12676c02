"""TransferWriter (this process) pushing into a consumer endpoint in a peer process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from rendezvous.clients.nixl import (
    BlockRangeError,
    KvRegion,
    NixlAgentInfo,
    NixlEndpoint,
    OnWritten,
    TransferNotification,
    TransferWriter,
)
from rendezvous.clients.nixl.regions import BlockIds
from tests.nixl.helpers import Event, Recorder, as_numpy, assert_moved, region_views, unique
from tests.nixl.peer import Layout, PeerProcess

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(30)]

LAYOUT = Layout((1024, 512), 16)


@dataclass
class Pair:
    """A started (or not yet started) writer over random source blocks, and a consumer endpoint `dest`."""

    writer: TransferWriter
    recorder: Recorder
    agent: NixlAgentInfo
    dest: str
    views: list[torch.Tensor]

    def notifications(self, peer: PeerProcess, count: int) -> list[tuple[str, int]]:
        """Let the consumer poll until `count` notifications arrived; their (transfer_id, generation)."""
        received, _ = peer.call("wait_notifications", self.dest, count, 5.0)
        assert all(n.sender == self.writer.agent_info().name for n in received)
        return [(n.transfer_id, n.generation) for n in received]

    def landed(self, peer: PeerProcess, src_ids: BlockIds, dst_ids: BlockIds) -> None:
        assert_moved(peer.call("blocks", self.dest), as_numpy(self.views), src_ids, dst_ids)

    def settled(self) -> list[Event]:
        """Callbacks so far, once every queued command was handled."""
        assert self.writer.barrier(5)
        return self.recorder.pending()


MakePair = Callable[..., Pair]


@pytest.fixture
def make_pair(peer: PeerProcess) -> Iterator[Callable[..., Pair]]:
    pairs: list[Pair] = []

    def make(
        layout: Layout = LAYOUT, *, start: bool = True, on_written: OnWritten | None = None, keep_written: bool = False
    ) -> Pair:
        dest = unique("dst")
        agent = peer.call("create", dest, layout)
        views = region_views(layout, seed=len(pairs) + 11)
        recorder = Recorder()
        writer = TransferWriter(
            NixlEndpoint.from_tensors(unique("src"), views),
            on_complete=recorder.on_complete,
            on_revoked=recorder.on_revoked,
            on_source_free=recorder.on_source_free,
            on_written=on_written,
            keep_written=keep_written,
        )
        if start:
            writer.start()
        pairs.append(Pair(writer, recorder, agent, dest, views))
        return pairs[-1]

    yield make
    for pair in pairs:
        assert pair.writer.stop(10)
        peer.call("close", pair.dest)


def complete(transfer_id: str, generation: int) -> Event:
    return Event("complete", (transfer_id, generation, True, None))


def test_assignment_first_then_source_writes_the_last_source_blocks(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair()
    p.writer.assign("t1", 1, p.agent, 1, [9, 2, 5])
    assert p.settled() == []

    p.writer.source_ready("t1", [0, 1, 7, 3, 11])  # the consumer already holds the first two blocks

    assert p.notifications(peer, 1) == [("t1", 1)]
    assert p.recorder.next() == complete("t1", 1)
    assert p.recorder.next() == Event("source_free", ("t1",))
    p.landed(peer, [7, 3, 11], [9, 2, 5])


def test_source_first_then_assignment_writes(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair()
    p.writer.source_ready("t1", [4, 6])
    assert p.settled() == []

    p.writer.assign("t1", 7, p.agent, 1, [15, 0])

    assert p.notifications(peer, 1) == [("t1", 7)]
    assert [p.recorder.next(), p.recorder.next()] == [complete("t1", 7), Event("source_free", ("t1",))]
    p.landed(peer, [4, 6], [15, 0])


def test_each_generation_written_reports_its_write_time_once(peer: PeerProcess, make_pair: MakePair) -> None:
    written: list[tuple[float, bool]] = []
    p = make_pair(on_written=lambda seconds, ok: written.append((seconds, ok)))
    for i in range(3):
        p.writer.assign(f"t{i}", 1, p.agent, 1, [i])
        p.writer.source_ready(f"t{i}", [i + 4])
    assert sorted(p.notifications(peer, 3)) == [("t0", 1), ("t1", 1), ("t2", 1)]
    events = [p.recorder.next() for _ in range(6)]  # complete and source_free of each; on_written comes before
    assert sorted(e.args[0] for e in events if e.kind == "complete") == ["t0", "t1", "t2"]
    assert len(written) == 3
    assert all(ok and 0 < seconds < 5 for seconds, ok in written)


def test_many_transfers_in_flight_land_byte_exact(peer: PeerProcess, make_pair: MakePair) -> None:
    layout = Layout((4096, 4096, 4096), 64)
    p = make_pair(layout)
    rng = np.random.default_rng(3)
    dst = np.array_split(rng.permutation(64)[:48], 8)
    src = [rng.choice(64, len(d) + 1, replace=False) for d in dst]
    for i in range(8):
        p.writer.assign(f"t{i}", 1, p.agent, 1, dst[i])
    for i in reversed(range(8)):
        p.writer.source_ready(f"t{i}", src[i])

    assert sorted(p.notifications(peer, 8)) == [(f"t{i}", 1) for i in range(8)]
    events = [p.recorder.next() for _ in range(16)]
    assert sorted(e.args for e in events if e.kind == "complete") == [(f"t{i}", 1, True, None) for i in range(8)]
    assert sorted(e.args for e in events if e.kind == "source_free") == [(f"t{i}",) for i in range(8)]
    p.landed(peer, np.concatenate([s[1:] for s in src]), np.concatenate(dst))


def test_empty_destination_completes_at_once_without_writing(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair()
    p.writer.source_ready("t0", [1, 2])
    p.writer.assign("t0", 1, p.agent, 1, [])
    assert p.settled() == [complete("t0", 1), Event("source_free", ("t0",))]

    p.writer.assign("t1", 1, p.agent, 1, [3])
    p.writer.source_ready("t1", [4])

    assert p.notifications(peer, 1) == [("t1", 1)]
    p.landed(peer, [4], [3])


def test_repeated_assignment_of_a_generation_writes_once(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair()
    p.writer.assign("t1", 2, p.agent, 1, [8])
    p.writer.assign("t1", 2, p.agent, 1, [9])
    p.writer.assign("t1", 1, p.agent, 1, [10])
    p.writer.source_ready("t1", [1])

    assert p.notifications(peer, 1) == [("t1", 2)]
    assert [p.recorder.next(), p.recorder.next()] == [complete("t1", 2), Event("source_free", ("t1",))]
    assert p.settled() == []
    p.landed(peer, [1], [8])


def test_a_generation_revoked_before_its_assignment_came_is_never_written(
    peer: PeerProcess, make_pair: MakePair
) -> None:
    """A revocation of a transfer the writer holds nothing of is acknowledged at once; the revoked generation's
    assignment, if it comes after (ProducerAgent held it for the prompt's length), is stale. Before, the writer
    kept no fence for it and wrote it into blocks the consumer had been told it may reuse (found by an audit)."""
    p = make_pair()
    p.writer.revoke("t1", 1)
    p.writer.assign("t1", 1, p.agent, 1, [3])  # late
    p.writer.assign("t2", 1, p.agent, 1, [5])
    p.writer.revoke("t2", 1)  # dropped: nothing of t2 is held after it
    p.writer.assign("t2", 1, p.agent, 1, [6])  # late again
    p.writer.source_ready("t1", [4])
    p.writer.assign("t1", 2, p.agent, 1, [8])

    assert p.notifications(peer, 1) == [("t1", 2)]
    events = [p.recorder.next() for _ in range(4)]
    assert events == [
        Event("revoked", ("t1", 1)),
        Event("revoked", ("t2", 1)),
        complete("t1", 2),
        Event("source_free", ("t1",)),
    ]
    p.landed(peer, [4], [8])  # blocks 3, 5 and 6 still hold the sentinel


def test_dropped_assignments_are_never_written_and_the_same_generation_assigned_again_is(
    peer: PeerProcess, make_pair: MakePair
) -> None:
    """The engine re-registered: its assignments were the replaced incarnation's, and are dropped unreported; the
    new incarnation's assignment of the same generation is taken as new (before, the writer kept the old one and
    ignored the new as repeated, so the old one was written once the source was ready); a revocation is kept."""
    p = make_pair()
    p.writer.assign("t1", 1, p.agent, 1, [3])
    p.writer.assign("t2", 1, p.agent, 1, [5])
    p.writer.revoke("t2", 1)
    assert p.settled() == [Event("revoked", ("t2", 1))]

    assert p.writer.drop_assignments("the engine re-registered", 5)
    p.writer.source_ready("t1", [4])
    p.writer.source_ready("t2", [6])
    assert p.settled() == []  # nothing written, nothing reported: the sources wait for an assignment
    p.landed(peer, [], [])

    p.writer.assign("t2", 1, p.agent, 1, [7])  # still revoked
    p.writer.assign("t1", 1, p.agent, 1, [8])  # the new incarnation's

    assert p.notifications(peer, 1) == [("t1", 1)]
    assert [p.recorder.next(), p.recorder.next()] == [complete("t1", 1), Event("source_free", ("t1",))]
    assert p.settled() == []
    p.landed(peer, [4], [8])  # blocks 3, 5 and 7 still hold the sentinel


def test_a_written_source_kept_until_released_is_written_again_for_the_next_incarnation(
    peer: PeerProcess, make_pair: MakePair
) -> None:
    """`keep_written` (ProducerAgent): a successful write keeps its source until `release` says its report was
    answered. Until then the same generation assigned again is a repeat; after `drop_assignments` (the report was the
    replaced incarnation's, dropped unsent) it is the new incarnation's, written again from the kept source, and a
    late release of the old write frees nothing. Before, the source was freed as the first write ended, and the
    new incarnation's assignment ignored: the transfer had ended."""
    p = make_pair(keep_written=True)
    p.writer.assign("t1", 1, p.agent, 1, [3])
    p.writer.source_ready("t1", [4])
    assert p.notifications(peer, 1) == [("t1", 1)]
    assert p.recorder.next() == complete("t1", 1)
    p.writer.assign("t1", 1, p.agent, 1, [6])  # a repeat (from a resync's listing): not written
    assert p.settled() == []  # the source is kept

    assert p.writer.drop_assignments("the engine re-registered", 5)
    p.writer.release("t1", 1)  # the old report's answer, late: the source waits for the new incarnation's
    p.writer.assign("t1", 1, p.agent, 1, [5])

    assert p.notifications(peer, 1) == [("t1", 1)]
    assert p.recorder.next() == complete("t1", 1)
    assert p.settled() == []
    p.landed(peer, [4, 4], [3, 5])  # block 6 still holds the sentinel
    p.writer.release("t1", 1)  # the new report was answered
    assert p.settled() == [Event("source_free", ("t1",))]
    p.writer.assign("t1", 2, p.agent, 1, [7])  # ended: ignored
    assert p.settled() == []


def test_revoke_before_the_write_drops_it_and_keeps_the_source_for_the_next_generation(
    peer: PeerProcess, make_pair: MakePair
) -> None:
    p = make_pair()
    p.writer.assign("t1", 1, p.agent, 1, [1, 2])
    p.writer.revoke("t1", 1)
    assert p.settled() == [Event("revoked", ("t1", 1))]
    p.writer.source_ready("t1", [5, 6])
    assert p.settled() == []
    p.landed(peer, [], [])  # nothing landed: every byte is still the sentinel

    p.writer.assign("t1", 2, p.agent, 1, [3, 4])

    assert p.notifications(peer, 1) == [("t1", 2)]
    assert [p.recorder.next(), p.recorder.next()] == [complete("t1", 2), Event("source_free", ("t1",))]
    p.landed(peer, [5, 6], [3, 4])


def test_revoke_during_the_write_is_acknowledged_only_after_it_drains(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair(start=False)
    p.writer.assign("t1", 1, p.agent, 1, [0, 1, 2])
    p.writer.source_ready("t1", [3, 4, 5])
    p.writer.revoke("t1", 1)
    p.writer.start()
    # The consumer is not polling, so the WRITE cannot complete: the revocation must wait for it.
    assert p.settled() == []

    assert p.notifications(peer, 1) == [("t1", 1)]

    assert p.recorder.next() == Event("revoked", ("t1", 1))
    p.landed(peer, [3, 4, 5], [0, 1, 2])  # the write had drained when the revocation was acknowledged
    assert p.settled() == []  # no completion for a revoked generation, and the source stays held


def test_abort_during_the_write_frees_the_source_after_it_drains(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair(start=False)
    p.writer.assign("t1", 1, p.agent, 1, [7])
    p.writer.source_ready("t1", [8])
    p.writer.abort("t1")
    p.writer.start()
    assert p.settled() == []

    assert p.notifications(peer, 1) == [("t1", 1)]

    assert p.recorder.next() == Event("source_free", ("t1",))
    assert p.settled() == []


def test_an_aborted_transfer_frees_its_source_and_ignores_late_commands(make_pair: MakePair) -> None:
    p = make_pair()
    p.writer.source_ready("t1", [1])
    p.writer.abort("t1")
    assert p.settled() == [Event("source_free", ("t1",))]

    p.writer.assign("t1", 1, p.agent, 1, [2])
    p.writer.source_ready("t1", [3])
    p.writer.revoke("t1", 1)

    assert p.settled() == [Event("source_free", ("t1",)), Event("revoked", ("t1", 1))]


def test_out_of_range_blocks_fail_without_writing(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair()
    with pytest.raises(BlockRangeError):
        p.writer.source_ready("t1", [16])
    p.writer.assign("t1", 1, p.agent, 1, [0, 16])
    p.writer.source_ready("t1", [1, 2])
    [event] = p.settled()
    assert event.kind == "complete" and event.args[:3] == ("t1", 1, False)
    assert "block ids" in event.args[3]

    p.writer.assign("t2", 1, p.agent, 1, [5])
    p.writer.source_ready("t2", [6])

    assert p.notifications(peer, 1) == [("t2", 1)]
    p.landed(peer, [6], [5])


def test_bad_peers_fail_their_assignments(make_pair: MakePair) -> None:
    p = make_pair()
    garbage = NixlAgentInfo("ghost", b"not metadata", regions=p.agent.regions)
    one_region = NixlAgentInfo(p.agent.name, p.agent.metadata, regions=p.agent.regions[:1])
    misaligned = NixlAgentInfo(p.agent.name, p.agent.metadata, regions=(p.agent.regions[0], KvRegion(4096, 64, 64, 8)))
    # A uint64 the service passes on but no process maps: its int64 column overflowed, the writer logged the
    # OverflowError and dropped the assignment without an outcome (found by an audit).
    far = tuple(replace(r, base_address=2**63 + r.base_address) for r in p.agent.regions)
    beyond = NixlAgentInfo(p.agent.name, p.agent.metadata, regions=far)
    for i, agent in enumerate([garbage, one_region, misaligned, beyond]):
        p.writer.assign(f"t{i}", 1, agent, 1, [0])

    events = p.settled()

    assert [(e.kind, e.args[:3]) for e in events] == [("complete", (f"t{i}", 1, False)) for i in range(4)]
    assert "unreadable" in events[0].args[3]
    assert "regions" in events[1].args[3] and "block length" in events[2].args[3]
    assert "beyond 2**63" in events[3].args[3]


def test_a_new_peer_incarnation_is_loaded_for_later_assignments(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair()
    p.writer.assign("t1", 1, p.agent, 1, [1])
    p.writer.source_ready("t1", [2])
    assert p.notifications(peer, 1) == [("t1", 1)]
    assert p.recorder.next() == complete("t1", 1)
    peer.call("close", p.dest)
    restarted = peer.call("create", p.dest, LAYOUT)  # same agent name, new memory and metadata

    p.writer.assign("t2", 1, restarted, 2, [3])
    p.writer.source_ready("t2", [4])
    assert p.notifications(peer, 1) == [("t2", 1)]
    p.writer.assign("t3", 1, p.agent, 1, [5])  # the old incarnation is stale now

    events = p.settled()
    assert events[:3] == [Event("source_free", ("t1",)), complete("t2", 1), Event("source_free", ("t2",))]
    assert events[3].args[:3] == ("t3", 1, False) and "older" in events[3].args[3]
    p.landed(peer, [4], [3])


def test_a_write_to_a_peer_that_dies_fails(make_pair: MakePair) -> None:
    p = make_pair()
    doomed = PeerProcess()
    try:
        agent = doomed.call("create", unique("doomed"), LAYOUT)
        p.writer.assign("t1", 1, agent, 1, [1])
        p.writer.source_ready("t1", [2])
        assert p.settled() == []  # in flight: the consumer never polls

        doomed.kill()

        event = p.recorder.next()
    finally:
        doomed.kill()
    assert event.kind == "complete" and event.args[:3] == ("t1", 1, False)
    assert "DISCONNECT" in event.args[3]
    p.writer.abort("t1")
    assert p.settled() == [Event("source_free", ("t1",))]


def test_forgetting_a_peer_fails_its_assignments_not_started(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair()
    p.writer.assign("t1", 1, p.agent, 1, [1])
    p.writer.forget_peer(p.agent.name, incarnation=1)
    [event] = p.settled()
    assert event.args[:3] == ("t1", 1, False) and "gone" in event.args[3]

    p.writer.assign("t2", 1, p.agent, 2, [2])  # the peer came back as incarnation 2
    p.writer.forget_peer(p.agent.name, incarnation=1)  # a late word about incarnation 1 spares it
    p.writer.source_ready("t2", [3])

    assert p.notifications(peer, 1) == [("t2", 1)]
    assert [p.recorder.next(), p.recorder.next()] == [complete("t2", 1), Event("source_free", ("t2",))]
    p.landed(peer, [3], [2])


def test_stop_fails_assignments_not_started_and_frees_held_sources(make_pair: MakePair) -> None:
    p = make_pair()
    p.writer.assign("t1", 1, p.agent, 1, [1])
    p.writer.source_ready("t2", [2])

    assert p.writer.stop(5)

    assert p.recorder.pending() == [
        Event("complete", ("t1", 1, False, "writer stopped")),
        Event("source_free", ("t2",)),
    ]
    with pytest.raises(RuntimeError, match="stopped"):
        p.writer.assign("t3", 1, p.agent, 1, [3])


def test_stop_lets_a_write_in_flight_drain(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair()
    p.writer.assign("t1", 1, p.agent, 1, [1])
    p.writer.source_ready("t1", [2])
    assert p.settled() == []
    peer.send("wait_notifications", p.dest, 1, 5.0)

    assert p.writer.stop(10)

    assert p.recorder.pending() == [complete("t1", 1), Event("source_free", ("t1",))]
    assert [n.transfer_id for n in peer.result()[0]] == ["t1"]
    p.landed(peer, [2], [1])


def test_notifications_name_the_writer(peer: PeerProcess, make_pair: MakePair) -> None:
    p = make_pair()
    peer.send("wait_notifications", p.dest, 1, 5.0)
    p.writer.assign("req:42", 3, p.agent, 1, [1])
    p.writer.source_ready("req:42", [1])

    received, malformed = peer.result()

    assert received == [TransferNotification(p.writer.agent_info().name, "req:42", 3)] and malformed == 0
