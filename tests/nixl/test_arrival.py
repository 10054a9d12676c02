"""`PartsArrival`: a consumer rank takes a progressive target as arrived once every sender's part notifications
tile its share; repeats count once, and anything that cannot tile exactly leaves the arrival to the commit."""

from __future__ import annotations

from rendezvous.clients.nixl.arrival import MAX_PARTS, PartsArrival
from rendezvous.clients.nixl.notifications import TransferNotification
from rendezvous.protocol.records import WrittenPart


def note(
    *parts: WrittenPart, sender: str = "p0", writers: int = 1, layers: range | None = None
) -> TransferNotification:
    return TransferNotification(sender, "t", 1, writers, layers, parts)


def layer(index: int, tokens: int = 32) -> WrittenPart:
    return WrittenPart(0, tokens, index, 1)


def test_layers_arrive_on_the_last_one_and_a_repeat_counts_once() -> None:
    arrival = PartsArrival(32, range(3))
    assert not arrival.add(note(layer(0)))
    assert not arrival.add(note(layer(0)))  # counted twice, layers 0 and 0 would fill 2 of 3
    assert not arrival.add(note(layer(1)))
    assert arrival.add(note(layer(2))) and arrival.disputed is None


def test_chunks_of_all_layers_arrive_once_they_cover_every_token() -> None:
    arrival = PartsArrival(20, range(4))
    assert not arrival.add(note(WrittenPart(0, 8), WrittenPart(8, 8)))
    assert arrival.add(note(WrittenPart(16, 4)))


def test_every_writer_must_tile_its_own_share() -> None:
    arrival = PartsArrival(16, range(2))  # two producer ranks (heads) write every layer here
    assert not arrival.add(note(WrittenPart(0, 16), sender="p0", writers=2))
    assert not arrival.add(note(WrittenPart(0, 16), sender="p0", writers=2))  # the same sender again
    assert arrival.add(note(WrittenPart(0, 16), sender="p1", writers=2))


def test_pipeline_stages_together_cover_the_held_layers() -> None:
    arrival = PartsArrival(16, range(4))
    assert not arrival.add(note(WrittenPart(0, 16, 0, 2), sender="stage0", writers=2, layers=range(0, 2)))
    assert arrival.add(note(WrittenPart(0, 16), sender="stage1", writers=2, layers=range(2, 4)))


def test_shares_that_leave_a_held_layer_unwritten_never_arrive() -> None:
    arrival = PartsArrival(16, range(4))
    assert not arrival.add(note(WrittenPart(0, 16), sender="a", writers=2, layers=range(0, 2)))
    assert not arrival.add(note(WrittenPart(0, 16), sender="b", writers=2, layers=range(0, 2)))
    assert arrival.disputed is None  # nothing wrong was said: layers 2 and 3 are just not written


def test_overlapping_parts_dispute_the_arrival_for_good() -> None:
    arrival = PartsArrival(32, range(2))
    assert not arrival.add(note(layer(0), WrittenPart(16, 16, 1, 1)))
    assert not arrival.add(note(WrittenPart(8, 16, 1, 1)))  # tokens 16..24 of layer 1 twice
    assert arrival.disputed is not None and "PARTS_OVERLAP" in arrival.disputed
    assert not arrival.add(note(WrittenPart(0, 8, 1, 1)))  # too late: only the commit can say now


def test_parts_outside_the_target_or_the_share_are_disputed() -> None:
    for bad in (
        note(WrittenPart(16, 32, 0, 1)),  # past the target's tokens
        note(WrittenPart(0, 0, 0, 1)),  # empty
        note(WrittenPart(0, 32, 1, 2)),  # past the layers held
        note(WrittenPart(0, 32, 0, 1), layers=range(1, 2)),  # outside the sender's share
        note(WrittenPart(0, 32), layers=range(0, 3)),  # a share past the layers held
    ):
        arrival = PartsArrival(32, range(2))
        assert not arrival.add(bad) and arrival.disputed is not None, bad


def test_a_sender_that_changes_its_share_or_the_writers_is_disputed() -> None:
    arrival = PartsArrival(32, range(2))
    arrival.add(note(layer(0), layers=range(0, 1)))
    arrival.add(note(layer(1), layers=range(1, 2)))
    assert arrival.disputed is not None and "changed its share" in arrival.disputed
    arrival = PartsArrival(32, range(2))
    arrival.add(note(layer(0), writers=2))
    arrival.add(note(layer(1), sender="p1", writers=1))
    assert arrival.disputed is not None and "producer ranks" in arrival.disputed


def test_unknown_writers_never_arrive_on_notifications() -> None:
    arrival = PartsArrival(32, range(1))
    assert not arrival.add(note(layer(0), writers=0)) and arrival.disputed is None


def test_a_sender_naming_too_many_parts_is_disputed() -> None:
    arrival = PartsArrival(MAX_PARTS + 1, range(1))
    arrival.add(note(*(WrittenPart(i, 1, 0, 1) for i in range(MAX_PARTS + 1))))
    assert arrival.disputed is not None and str(MAX_PARTS) in arrival.disputed
