"""The store interface: where engines, transfers, per-engine event logs and request results live.

A store applies transitions atomically: `update_transfer` reads a record, calls a pure function
(from rendezvous.core) and writes its result together with the events it emits, or nothing at all.
The function may be called more than once (optimistic concurrency in shared stores), so it must be
pure. Each engine has an event log whose positions start at 1 and grow by one per event (an event's
`sequence`, on the wire and in the code; not `revision()`, the store-wide counter of the response headers);
the log is bounded, and a reader asking for a trimmed position is told to resync.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from rendezvous.core.budget import Tally
from rendezvous.core.engines import lapse
from rendezvous.core.model import Addressed, Engine, Event, State, Transfer
from rendezvous.core.transfers import Transition
from rendezvous.store.cache_index import IndexStore
from rendezvous.store.credits import CreditStore

TransferFn = Callable[[Transfer | None, Mapping[str, Engine]], Transition]
"""A transition: gets the current record and the engines it names (consumer, producer), if known."""

EngineFn = Callable[[Engine | None], Engine | None]
"""An engine update: gets the current record (live or ended), returns the new one (None deletes)."""

EngineFilter = Callable[[Engine], bool]
"""Which engine records a listing wants (pure: a backend may call it on records it then drops)."""


@dataclass(frozen=True)
class EventPage:
    """Events read from an engine's log.

    `resync_sequence` is set when the requested sequence is no longer retained: the reader must
    rebuild its view (list its transfers) and continue from that sequence. `forgotten`: the engine has
    no record (never registered, or its tombstone was dropped), so it has no log either.
    """

    events: Sequence[Event[Transfer, Engine]]
    last_sequence: int
    resync_sequence: int | None = None
    forgotten: bool = False


@dataclass(frozen=True)
class StoreCounts:
    """Sizes for status and metrics: tombstones (released, aborted) are not counted."""

    live_engines: int
    transfers_by_state: Mapping[State, int]
    """Live transfers by state; states without any are left out."""


@dataclass(frozen=True)
class CallerView:
    """What a batch RPC reads about its caller before it applies (Store.caller): the engine record, and on
    request its unsettled-transfer count and the memory budget's tallies (the server's and its owner's)."""

    engine: Engine | None
    live_transfers: int | None = None
    """How many ids `live_transfer_ids` would list; None when not asked for."""
    tally: Tally | None = None
    """`usage` of the record's owner; None when not asked for (or there is no record)."""


class StoreUnavailableError(Exception):
    """The store cannot be reached; callers may retry later."""


class Store(ABC):
    """Backend for the coordinator. All methods are coroutines; none blocks the event loop."""

    name: str = "abstract"
    concurrent: bool = False
    """Whether calls gain from being made together (a networked store sends them in one round trip); the
    coordinator then applies the items of a batch with one update_transfers call."""

    @property
    @abstractmethod
    def epoch(self) -> int:
        """Identifies the store's lifetime; a change means soft state was lost."""

    @abstractmethod
    async def open(self) -> None:
        """Connect and load or create the epoch."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections."""

    @abstractmethod
    async def ping(self) -> bool:
        """True when the store answers."""

    @abstractmethod
    async def revision(self) -> int:
        """Monotonically increasing revision of the whole store."""

    async def answered_revision(self) -> int:
        """The revision a response header carries after store calls that showed one: at least the revision
        of every write this process has made (so of every event its calls appended) and of every event
        `read_events` gave it, and never below what it answered before in this epoch.

        Backends that track it answer without a store call; this default reads `revision`.
        """
        return await self.revision()

    @abstractmethod
    async def get_engine(self, engine_id: str) -> Engine | None:
        """An engine record, live or ended (tombstone), or None."""

    async def caller(self, engine_id: str, live: bool = False, usage: bool = False) -> CallerView:
        """An engine record with, if live, its `live_transfer_counts` entry and, if usage, the `usage` of its
        owner: what a batch RPC checks its caller by, as of one instant.

        Backends override this with one round trip; this default reads one after the other.
        """
        engine = await self.get_engine(engine_id)
        count = (await self.live_transfer_counts([engine_id]))[engine_id] if live else None
        tally = await self.usage(engine.owner) if usage and engine is not None else None
        return CallerView(engine, count, tally)

    @abstractmethod
    async def page_engines(self, after: str, limit: int, keep: EngineFilter) -> list[Engine]:
        """Up to limit engine records (live or ended) with ids above after, by id, that keep accepts.

        One page of ListEngines: backends read about a page's worth of records where keep accepts most,
        never every record at once.
        """

    @abstractmethod
    async def update_engine(self, engine_id: str, fn: EngineFn) -> Engine | None:
        """Atomically replace an engine record by fn(current); returns the new record."""

    @abstractmethod
    async def lapse_candidates(self, now: float, tombstone_ttl: float) -> list[Engine]:
        """Engine records that may have lapsed by now: at least every one whose lease passed without
        ending, or whose tombstone outlived tombstone_ttl; maybe more.

        Backends narrow the candidates cheaply by an index (lease expiry, end time); whether a record
        has lapsed is the core's decision (rendezvous.core.engines.lapse), which the sweeper applies.
        """

    async def lapsed_engines(self, now: float, tombstone_ttl: float) -> list[Engine]:
        """The candidates that have lapsed, by the core's rule."""
        return [e for e in await self.lapse_candidates(now, tombstone_ttl) if lapse(e, now, tombstone_ttl)]

    @abstractmethod
    async def get_transfer(self, transfer_id: str) -> Transfer | None:
        """A transfer record, live or tombstone, or None."""

    @abstractmethod
    async def update_transfer(self, transfer_id: str, fn: TransferFn) -> Transition:
        """Atomically apply fn to a transfer and append its events; errors from fn leave no trace."""

    async def update_transfers(self, updates: Sequence[tuple[str, TransferFn]]) -> list[Transition | Exception]:
        """Apply each (transfer id, fn) as update_transfer does, in one call: a result per update, its
        transition or the error it ended with (raised by its fn, or by its record), which does not stop the
        others; the store's own failures (StoreUnavailableError) raise. Updates of one transfer apply in order.

        Backends override this to send a batch in about one round trip; this default applies them in turn.
        """
        results: list[Transition | Exception] = []
        for transfer_id, fn in updates:
            try:
                results.append(await self.update_transfer(transfer_id, fn))
            except StoreUnavailableError:
                raise
            except Exception as err:
                results.append(err)
        return results

    @abstractmethod
    async def list_transfers(self, engine_id: str | None = None) -> list[Transfer]:
        """Transfers (live and tombstones) of one engine, or all, in no particular order."""

    @abstractmethod
    async def live_transfer_ids(self, engine_id: str) -> list[str]:
        """Ids of the unsettled transfers an engine takes part in (live, or awaiting a revocation)."""

    async def live_transfer_counts(self, engine_ids: Sequence[str]) -> dict[str, int]:
        """For each engine, how many ids `live_transfer_ids` would list; one store call for all of them.

        Backends override this with one round trip; this default asks engine by engine.
        """
        return {engine_id: len(await self.live_transfer_ids(engine_id)) for engine_id in engine_ids}

    async def page_transfers(
        self, engine_id: str | None, states: AbstractSet[State], after: str, limit: int
    ) -> list[Transfer]:
        """Up to limit transfers (of one engine, or all) in one of states, with ids above after, by id.

        One page of ListTransfers: backends override this to read about one page's worth of records,
        not every transfer; this default lists them all.
        """
        found = [t for t in await self.list_transfers(engine_id) if t.state in states and t.transfer_id > after]
        return sorted(found, key=lambda t: t.transfer_id)[:limit]

    @abstractmethod
    async def due_transfers(self, now: float, limit: int) -> list[str]:
        """Ids of transfers whose deadline is at or before now (at most limit)."""

    @abstractmethod
    async def append_events(self, events: Sequence[Addressed]) -> None:
        """Append events to the logs of the engines they address (unknown engines are skipped)."""

    @abstractmethod
    async def read_events(self, engine_id: str, start_sequence: int, limit: int) -> EventPage:
        """Up to limit events of an engine from start_sequence on."""

    @abstractmethod
    async def wait_events(self, engine_id: str, after_sequence: int, timeout: float) -> None:
        """Return when the engine's log passes after_sequence, or after timeout seconds."""

    @abstractmethod
    async def last_event_sequence(self, engine_id: str) -> int:
        """The sequence of the engine's latest event (0 when none)."""

    @abstractmethod
    async def get_response(self, key: str) -> bytes | None:
        """A stored response of an idempotent request (AIP-155), or None."""

    @abstractmethod
    async def put_response(self, key: str, value: bytes, ttl: float, owner: str = "") -> None:
        """Remember a response for ttl seconds, charged to owner (the caller's identity; "": none).

        Kept responses are bounded in bytes over the store and per owner: past a bound the owner's oldest go,
        then the oldest of all, and a response larger than a bound is not kept (rendezvous.store._answers).
        """

    @abstractmethod
    async def answer_bytes(self, owner: str) -> tuple[int, int]:
        """What the kept responses are counted as (bytes): in all, and owner's (0 for "")."""

    @abstractmethod
    async def event_log_bytes(self, engine_id: str) -> int:
        """What an engine's kept events are counted as (bytes; 0 for an unknown engine)."""

    @abstractmethod
    async def usage(self, owner: str) -> Tally:
        """What the stored records charge the memory budget (rendezvous.core.budget), in all and to owner.

        Backends keep the sums exact, updated in the same atomic step that writes a record; owner "" asks
        for the server's total only.
        """

    @abstractmethod
    async def page_token_key(self) -> bytes:
        """The key that signs page tokens (rendezvous.core.paging): random, made once per deployment and
        shared by everything that shares the store's state, so any replica continues another's listing and
        another deployment's tokens do not verify."""

    @abstractmethod
    async def counts(self) -> StoreCounts:
        """Live engines and live transfers by state (no tombstones)."""

    def credits(self) -> CreditStore:
        """The store's credit reservations (rendezvous.store.credits), shared as the store is."""
        raise NotImplementedError(f"the {self.name} store keeps no credit reservations")

    def index(self) -> IndexStore:
        """The store's KV index (rendezvous.store.cache_index), shared as the store is."""
        raise NotImplementedError(f"the {self.name} store keeps no KV index")
