"""What this process last saw of Redis: engine and transfer records with their versions, event peers, and
the events it wrote.

update_transfer and update_engine compute a transition on the records as last seen and send the
versions along; Redis refuses the write if they moved on (see store.py). The caches are bounded
(least recently stored goes first) and cleared when the epoch changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from rendezvous.core.model import Engine, Event, Transfer, evolve
from rendezvous.store.codec import decode_engine, decode_event, decode_transfer, encode_engine

ABSENT = b"0"
"""The version of a record that does not exist."""

_PEER_CACHE = 256
# Events written and not yet read back: a few batches' worth (one read each, by the engine's Watch).
_WRITTEN_EVENTS = 4096


class EngineEntry:
    """An engine record as last seen, with its version and (lazily) its encoded form."""

    __slots__ = ("encoded", "engine", "version")

    def __init__(self, version: bytes, engine: Engine | None) -> None:
        self.version = version
        self.engine = engine
        self.encoded: str | None = None


class Snapshot(NamedTuple):
    """A transfer record as last seen; engines is set when the engines it names were read with it (a named
    tuple: one is made for every write, and a tuple is made in a third of a frozen dataclass's time)."""

    version: bytes
    transfer: Transfer | None
    engines: Mapping[str, EngineEntry] | None = None


NEVER_SEEN = Snapshot(ABSENT, None, None)


def _bounded_put(cache: dict[str, Any], key: str, value: Any, size: int) -> None:
    cache.pop(key, None)
    cache[key] = value
    if len(cache) > size:
        del cache[next(iter(cache))]


class RecordCache:
    """Engine and transfer records as last seen, up to size of each."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._transfers: dict[str, Snapshot] = {}
        self._engines: dict[str, EngineEntry] = {}

    def clear(self) -> None:
        self._transfers.clear()
        self._engines.clear()

    # Transfers

    def transfer(self, transfer_id: str) -> Snapshot:
        """The transfer as last seen, or NEVER_SEEN."""
        return self._transfers.get(transfer_id, NEVER_SEEN)

    def remember_transfer(self, transfer_id: str, snapshot: Snapshot) -> None:
        # Engines are kept in their own cache, which newer reads update.
        kept = Snapshot(snapshot.version, snapshot.transfer) if snapshot.engines else snapshot
        _bounded_put(self._transfers, transfer_id, kept, self._size)

    def seen_transfer(self, version: bytes | None, data: bytes | None, transfer_id: str = "") -> Transfer | None:
        """The transfer of a reply (version, record; None or empty when absent), remembered."""
        transfer = decode_transfer(data) if data else None
        key = transfer.transfer_id if transfer is not None else transfer_id
        if key:
            self.remember_transfer(key, Snapshot(version or ABSENT, transfer))
        return transfer

    def snapshot(self, transfer_id: str, reply: Sequence[Any], offset: int) -> Snapshot:
        """The (transfer, engines) snapshot in a read_transfer or conflict reply, remembered."""
        version, data = reply[offset], reply[offset + 1]
        engines = {}
        for i in range(offset + 2, len(reply), 3):
            engine_id = reply[i].decode()
            engines[engine_id] = self.seen_engine(engine_id, reply[i + 1], reply[i + 2])
        snapshot = Snapshot(version, decode_transfer(data) if data else None, engines)
        self.remember_transfer(transfer_id, snapshot)
        return snapshot

    def engines_of(self, snapshot: Snapshot) -> Mapping[str, EngineEntry] | None:
        """The engines a snapshot's transfer names, as last seen; None when one was never seen."""
        if snapshot.engines is not None or snapshot.transfer is None:
            return snapshot.engines or {}
        entries = {}
        for engine_id in snapshot.transfer.participants():
            entry = self._engines.get(engine_id)
            if entry is None:
                return None
            entries[engine_id] = entry
        return entries

    # Engines

    def engine(self, engine_id: str) -> EngineEntry | None:
        """The engine as last seen, if it was."""
        return self._engines.get(engine_id)

    def remember_engine(self, engine_id: str, entry: EngineEntry) -> EngineEntry:
        _bounded_put(self._engines, engine_id, entry, self._size)
        return entry

    def seen_engine(self, engine_id: str, version: bytes, data: bytes) -> EngineEntry:
        """The engine of a reply, decoded unless the cache holds that version already."""
        entry = self._engines.get(engine_id)
        if entry is not None and entry.version == version:
            return entry
        return self.remember_engine(engine_id, EngineEntry(version, decode_engine(data) if data else None))

    def engine_json(self, engine: Engine | None) -> str:
        """An engine's encoded record ("" for None), encoded once per cached record."""
        if engine is None:
            return ""
        entry = self._engines.get(engine.engine_id)
        if entry is None or entry.engine is not engine:
            return encode_engine(engine)
        if entry.encoded is None:
            entry.encoded = encode_engine(engine)
        return entry.encoded


class PeerCache:
    """Event peers (engine records carried by events), decoded once per distinct record."""

    def __init__(self, size: int = _PEER_CACHE) -> None:
        self._size = size
        self._peers: dict[bytes, Engine] = {}

    def peer(self, data: bytes) -> Engine:
        peer = self._peers.get(data)
        if peer is None:
            peer = self._peers[data] = decode_engine(data)
            if len(self._peers) > self._size:
                del self._peers[next(iter(self._peers))]
        return peer


class WrittenEvents:
    """Events this process wrote, by their encoded bytes, until read back: reading one then costs a lookup
    instead of a decode (~5 us; the codec round-trips exactly, so the decoded event would equal the written
    one). An event read elsewhere (another replica, a Watch that moved on) leaves in turn, the oldest first."""

    def __init__(self, size: int = _WRITTEN_EVENTS) -> None:
        self._size = size
        self._events: dict[bytes, Event[Transfer, Engine]] = {}

    def __len__(self) -> int:
        return len(self._events)

    def wrote(self, encoded: str, event: Event[Transfer, Engine]) -> None:
        """event went out as encoded (codec.encode_event)."""
        events = self._events
        events[encoded.encode()] = event
        if len(events) > self._size:
            del events[next(iter(events))]

    def read(self, data: bytes, sequence: int, peer: Engine | None) -> Event[Transfer, Engine]:
        """The event stored as data, at sequence, with its peer (codec.decode_event's answer)."""
        written = self._events.pop(data, None)
        if written is None:
            return decode_event(data, sequence, peer)
        return evolve(written, peer=peer, sequence=sequence)
