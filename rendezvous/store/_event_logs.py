"""The memory store's event logs: one per engine, bounded per engine, per identity and over the store.

Each bound trims oldest first: an engine's own bound its log's oldest events, an identity's the oldest events of
the logs of its engines (the engines it registered), the store's the oldest of all. An event's age is the order
the store appended it in (a sequence number); each bound finds its oldest event through a list of logs sorted by
their oldest event's number (what the Redis store keeps in a sorted set, rendezvous/store/redis/scripts/_append.lua).
The event just appended always stays, whatever its size; a watcher behind a trimmed event resyncs.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left, insort
from collections import deque

from rendezvous.core.model import Engine, Event, Transfer

StoredEvent = Event[Transfer, Engine]
"""An event as the core makes it and a log keeps it."""


def event_bytes(event: StoredEvent) -> int:
    """What an event kept in a log is counted as (an upper estimate, as if nothing it names were shared):
    its fixed part, the block ids of its transfer and the agent metadata and labels of its peer."""
    size = _EVENT_BYTES
    t = event.transfer
    if t is not None:
        size += _BLOCK_ID_BYTES * (len(t.target_block_ids) + len(t.source_block_ids or ()))
    peer = event.peer
    if peer is not None:
        size += sum(len(a.metadata) for a in peer.agents)
        size += sum(len(k) + len(v) for k, v in peer.labels.items())
    return size


_EVENT_BYTES = 512
"""An event's own objects, its transfer's and its peer's (records, ids, tuples), before block ids and metadata."""
_BLOCK_ID_BYTES = 48
"""A block id in a tuple (a pointer and an int object; rendezvous.core.limits measures 40-48)."""


class EventLog:
    """One engine's event log and the waiters for its next event.

    Events are kept as the core made them: an event's sequence follows from its place in the log (the
    oldest kept is last_sequence - len(events) + 1), so it is set when the event is read, not stored."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.events: deque[StoredEvent] = deque()
        self.sizes: deque[int] = deque()
        self.numbers: deque[int] = deque()  # each event's sequence number in the store (its age)
        self.bytes = 0
        self.last_sequence = 0
        self._changed: asyncio.Event | None = None  # made by the first waiter, set by the next append

    def changed(self) -> asyncio.Event:
        """Set once the next event is appended."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None


class EventLogs:
    """The event logs of a store's engines, with the bounds of rendezvous.core.limits (`max_events_per_engine`,
    `max_event_bytes_per_engine`, `max_event_bytes_per_identity`, `max_event_bytes_total`)."""

    def __init__(self, max_events: int, max_bytes: int, max_bytes_per_identity: int, max_bytes_total: int) -> None:
        self._logs: dict[str, EventLog] = {}
        self._max_events = max_events
        self._max_bytes = max_bytes
        self._max_owner_bytes = max_bytes_per_identity
        self._max_total_bytes = max_bytes_total
        self._number = 0
        self.bytes = 0
        self._owner_bytes: dict[str, int] = {}
        # (oldest event's number, engine id) of every non-empty log, sorted: over the store and by owner.
        self._oldest: list[tuple[int, str]] = []
        self._oldest_by_owner: dict[str, list[tuple[int, str]]] = {}

    def get(self, engine_id: str) -> EventLog | None:
        return self._logs.get(engine_id)

    def open(self, engine_id: str, owner: str) -> None:
        """Make an engine's log if it has none; charge its bytes to `owner` (an engine re-registered by another)."""
        log = self._logs.get(engine_id)
        if log is None:
            self._logs[engine_id] = EventLog(owner)
        elif log.owner != owner:
            self._unlist(engine_id, log)
            self._count(log.owner, -log.bytes)
            log.owner = owner
            self._count(owner, log.bytes)
            self._list(engine_id, log)

    def drop(self, engine_id: str) -> None:
        """Forget an engine's log (its record is deleted)."""
        log = self._logs.pop(engine_id, None)
        if log is not None:
            self._unlist(engine_id, log)
            self._count(log.owner, -log.bytes)

    def append(self, engine_id: str, event: StoredEvent) -> None:
        """Add an event to an engine's log (none: nothing), then trim to the bounds, oldest first."""
        log = self._logs.get(engine_id)
        if log is None:
            return
        self._number += 1
        size = event_bytes(event)
        log.last_sequence += 1
        log.events.append(event)
        log.sizes.append(size)
        log.numbers.append(self._number)
        log.bytes += size
        self._count(log.owner, size)
        if len(log.events) == 1:
            self._list(engine_id, log)
        while len(log.events) > 1 and (len(log.events) > self._max_events or log.bytes > self._max_bytes):
            self._trim(engine_id, log)
        owner = log.owner
        while owner and self._owner_bytes.get(owner, 0) > self._max_owner_bytes:
            if not self._trim_oldest(self._oldest_by_owner[owner]):
                break
        while self.bytes > self._max_total_bytes:
            if not self._trim_oldest(self._oldest):
                break
        log.notify()

    def _trim_oldest(self, oldest: list[tuple[int, str]]) -> bool:
        """Drop the oldest event these logs hold, unless it is the one just appended."""
        number, engine_id = oldest[0]
        if number == self._number:
            return False
        self._trim(engine_id, self._logs[engine_id])
        return True

    def _trim(self, engine_id: str, log: EventLog) -> None:
        """Drop a log's oldest event."""
        self._unlist(engine_id, log)
        log.events.popleft()
        log.numbers.popleft()
        size = log.sizes.popleft()
        log.bytes -= size
        self._count(log.owner, -size)
        self._list(engine_id, log)

    def _count(self, owner: str, n: int) -> None:
        self.bytes += n
        if owner:
            left = self._owner_bytes.get(owner, 0) + n
            if left:
                self._owner_bytes[owner] = left
            else:
                del self._owner_bytes[owner]

    def _lists(self, log: EventLog) -> list[list[tuple[int, str]]]:
        if not log.owner:
            return [self._oldest]
        return [self._oldest, self._oldest_by_owner.setdefault(log.owner, [])]

    def _list(self, engine_id: str, log: EventLog) -> None:
        """Put a non-empty log in the sorted lists, by its oldest event."""
        if log.events:
            for oldest in self._lists(log):
                insort(oldest, (log.numbers[0], engine_id))

    def _unlist(self, engine_id: str, log: EventLog) -> None:
        """Take a log out of the sorted lists (before its oldest event changes)."""
        if not log.events:
            return
        key = (log.numbers[0], engine_id)
        for oldest in self._lists(log):
            del oldest[bisect_left(oldest, key)]
        if log.owner and not self._oldest_by_owner[log.owner]:
            del self._oldest_by_owner[log.owner]


__all__ = ["EventLog", "EventLogs", "event_bytes"]
