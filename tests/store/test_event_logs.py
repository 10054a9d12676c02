"""The memory store's event logs (rendezvous.store._event_logs): each bound trims the oldest events under it
first, the event just appended stays, and the tallies follow an engine's deletion and a change of owner.

Events without a transfer or peer are counted as 512 bytes each (`event_bytes`), so the bounds below are in
events of 512 bytes."""

from __future__ import annotations

from rendezvous.core.model import Engine, Event, EventType, Transfer
from rendezvous.store._event_logs import EventLogs, event_bytes

EVENT: Event[Transfer, Engine] = Event(EventType.PEER_LOST, 0.0)
SIZE = event_bytes(EVENT)


def logs(per_identity: int = 1_000, total: int = 1_000) -> EventLogs:
    return EventLogs(1_000, 1_000 * SIZE, per_identity * SIZE, total * SIZE)


def kept(event_logs: EventLogs, engine_id: str) -> tuple[int, int]:
    """An engine's log as (first sequence kept, last sequence)."""
    log = event_logs.get(engine_id)
    assert log is not None
    return log.last_sequence - len(log.events) + 1, log.last_sequence


def test_an_identitys_bound_trims_the_oldest_of_its_engines_events_first() -> None:
    event_logs = logs(per_identity=4)
    for engine_id, owner in (("a0", "A"), ("a1", "A"), ("b0", "B")):
        event_logs.open(engine_id, owner)
    for engine_id in ("a0", "a0", "b0", "a1", "a1", "a1"):
        event_logs.append(engine_id, EVENT)
    # A's 5 events passed its 4: A's oldest (a0's first) went; B's older event is not A's to trim.
    assert kept(event_logs, "a0") == (2, 2)
    assert kept(event_logs, "a1") == (1, 3)
    assert kept(event_logs, "b0") == (1, 1)
    event_logs.append("a1", EVENT)
    assert kept(event_logs, "a0") == (3, 2)  # emptied: a watcher from any kept sequence resyncs
    assert event_logs.bytes == 5 * SIZE


def test_the_servers_bound_trims_the_oldest_of_all_and_keeps_the_event_just_appended() -> None:
    event_logs = EventLogs(1_000, 1_000 * SIZE, 1_000 * SIZE, 2 * SIZE + 1)
    event_logs.open("a0", "A")
    event_logs.open("n0", "")  # no owner (no auth): only the server's bound applies
    for engine_id in ("a0", "n0", "a0"):
        event_logs.append(engine_id, EVENT)
    assert kept(event_logs, "a0") == (2, 2) and kept(event_logs, "n0") == (1, 1)
    big = EventLogs(1_000, 1_000 * SIZE, 1_000 * SIZE, SIZE - 1)
    big.open("a0", "A")
    big.append("a0", EVENT)
    assert kept(big, "a0") == (1, 1)  # over the bound alone, yet it stays


def test_a_deleted_engine_or_a_new_owner_takes_its_bytes_along() -> None:
    event_logs = logs(per_identity=3)
    for engine_id in ("a0", "a1"):
        event_logs.open(engine_id, "A")
    for engine_id in ("a0", "a0", "a1"):
        event_logs.append(engine_id, EVENT)
    event_logs.drop("a0")
    assert event_logs.bytes == SIZE
    # a1 moves to B: A's bound no longer counts it, B's does.
    event_logs.open("a1", "B")
    event_logs.open("a2", "A")
    for _ in range(3):
        event_logs.append("a2", EVENT)
    assert kept(event_logs, "a1") == (1, 1) and kept(event_logs, "a2") == (1, 3)
    event_logs.open("b1", "B")
    for _ in range(3):
        event_logs.append("b1", EVENT)
    assert kept(event_logs, "a1") == (2, 1)  # B's oldest, now that a1 is B's
    assert event_logs.bytes == 6 * SIZE
