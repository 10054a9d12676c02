"""The service's event and transfer messages: times set in place as Timestamp.FromNanoseconds would, and peer
engine messages reused only for the very record an event carries."""

from __future__ import annotations

import dataclasses

from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import given
from hypothesis import strategies as st

from rendezvous import wire
from rendezvous.core import paging
from rendezvous.core.model import (
    Engine,
    Event,
    EventType,
    KvLayout,
    KvRegion,
    MemoryKind,
    NixlAgent,
    Role,
    State,
    Transfer,
    TransferTimes,
)
from rendezvous.protocol import convert
from rendezvous.server import servicer

moments = st.one_of(st.just(0.0), st.floats(min_value=1e-9, max_value=4e9, allow_nan=False))


def _engine(engine_id: str = "consumer-1", metadata: bytes = b"m" * 400, lease: float = 1.7e9) -> Engine:
    region = KvRegion(1 << 32, 1 << 16, 1 << 16, 1_000)
    agent = NixlAgent(engine_id + "-0", metadata, 0, MemoryKind.DRAM, (region,))
    layout = KvLayout("fp", "float16", 16, 32)
    return Engine(engine_id, "consumer", Role.CONSUMER, layout, (agent,), {"zone": "a"}, 3, 10.0, lease, 1.6e9)


def _stamp(t: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(round(t * 1e9))
    return ts


@given(deadline=moments, times=st.lists(moments, min_size=6, max_size=6), at=moments)
def test_times_are_the_timestamps_of_their_nanoseconds(deadline: float, times: list[float], at: float) -> None:
    t = Transfer("t-1", State.MATCHED, deadline, times=TransferTimes(*times))
    m = convert.transfer_message(t)
    assert m.HasField("times")
    assert m.HasField("deadline_time") == bool(deadline)
    if deadline:
        assert m.deadline_time == _stamp(deadline)
    fields = ("target_time", "claim_time", "match_time", "source_ready_time", "commit_time", "end_time")
    for name, value in zip(fields, times, strict=True):
        assert m.times.HasField(name) == bool(value)
        if value:
            assert getattr(m.times, name) == _stamp(value)
    event = wire.event_message(Event(EventType.TRANSFER_COMMITTED, at, t, 1, sequence=4))
    assert event.HasField("event_time") == bool(at)
    if at:
        assert event.event_time == _stamp(at)


def test_a_peer_message_follows_the_record_the_event_carries() -> None:
    first = _engine()
    renewed = dataclasses.replace(first, lease_expires_at=first.lease_expires_at + 10)
    t = Transfer("t-1", State.MATCHED, 1.0)
    for engine in (first, first, renewed, first):
        message = wire.event_message(Event(EventType.TRANSFER_ASSIGNED, 1.0, t, 1, engine, 1)).peer
        assert message == wire.engine_message(engine)
    # A message handed out is the event's own: changing it leaves the next event's peer as it was.
    message = wire.event_message(Event(EventType.TRANSFER_ASSIGNED, 1.0, t, 1, first, 1)).peer
    message.pool = "changed"
    assert wire.event_message(Event(EventType.TRANSFER_ASSIGNED, 1.0, t, 1, first, 1)).peer.pool == "consumer"


def test_peers_with_large_metadata_are_built_every_time() -> None:
    large = _engine("consumer-large", metadata=b"x" * (1 << 20))
    t = Transfer("t-1", State.MATCHED, 1.0)
    message = wire.event_message(Event(EventType.TRANSFER_ASSIGNED, 1.0, t, 1, large, 1)).peer
    assert message == wire.engine_message(large)
    assert "consumer-large" not in wire._peers


@given(sizes=st.lists(st.integers(min_value=0, max_value=3_000), min_size=1, max_size=12), budget=st.integers(1, 9_000))
def test_watch_responses_are_cut_as_paging_chunks_cuts_the_messages(sizes: list[int], budget: int) -> None:
    t = Transfer("t-1", State.MATCHED, 1.0)
    events = [
        Event(EventType.TRANSFER_ASSIGNED, 1.0, t, 1, _engine(f"c-{i}", metadata=b"m" * size), sequence=i + 1)
        for i, size in enumerate(sizes)
    ]
    expected = list(paging.chunks((wire.event_message(e) for e in events), servicer._weigh, budget))
    got = [list(r.events) for r in servicer._event_responses(events, budget)]
    assert got == expected
