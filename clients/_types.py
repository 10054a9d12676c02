"""What SDK users see: enums and frozen records of engines, transfers and events.

No protobuf here; `rendezvous.clients._convert` maps these from the wire. The requests (`TargetSpec`, ...) are the
protocol's (rendezvous.protocol.requests), re-exported. Enum values equal the
protocol's numbers; a value this client does not know (a newer server) reads as UNSPECIFIED.
Times are seconds since the Unix epoch as floats, 0.0 meaning "not set"; durations are seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from rendezvous.protocol.bindings import Binding
from rendezvous.protocol.cache_index import (
    AllBlocksCleared,
    BlockHashing,
    BlocksRemoved,
    BlocksStored,
    CacheEvent,
    CacheReport,
    CacheSnapshot,
    IndexPosition,
    PrefixMatch,
    PrefixQuery,
    hash_of,
)
from rendezvous.protocol.enums import (
    AbortReason,
    CompletionOutcome,
    EngineRole,
    EngineView,
    EventType,
    MemoryKind,
    TransferMode,
    TransferState,
)
from rendezvous.protocol.errors import RendezvousError
from rendezvous.protocol.events import Event
from rendezvous.protocol.incarnation import EngineInfo
from rendezvous.protocol.pages import EnginePage, TransferPage
from rendezvous.protocol.reasons import Reason
from rendezvous.protocol.records import (
    EngineCapacity,
    EngineCredits,
    KvLayout,
    KvRegion,
    NixlAgent,
    TransferTimes,
    WrittenPart,
)
from rendezvous.protocol.requests import (
    AbortSpec,
    ClaimSpec,
    CompletionSpec,
    CreditSpec,
    EngineSpec,
    ReleaseSpec,
    RevocationAck,
    SourceReadySpec,
    TargetSpec,
)
from rendezvous.protocol.transfer import TransferRecord

NixlAgentInfo = NixlAgent
"""The SDK's name for a rank's NIXL agent record (the protocol's NixlAgent)."""


@dataclass(frozen=True, slots=True)
class Registration:
    """The answer to RegisterEngine: the new incarnation and where its event log starts."""

    engine: EngineInfo
    watch_start_sequence: int
    epoch: int


@dataclass(frozen=True, slots=True)
class LeaseRenewal:
    """The answer to one KeepAlive message."""

    engine_id: str
    lease_ttl: float
    epoch: int


# Transfers


@dataclass(frozen=True, slots=True)
class TransferInfo(TransferRecord):
    """The state of one transfer as the server reports it (its fields: `TransferRecord`)."""

    source_block_ids: tuple[int, ...] = ()
    """The producer's source blocks (pull); () while it has not said them."""


@dataclass(frozen=True, slots=True)
class ItemResult:
    """The outcome of one item of a batched call: the transfer's state after it, or an error."""

    transfer_id: str
    state: TransferState
    error: RendezvousError | None = None
    # A generation the producer may still be writing: wait for REVOCATION_CONFIRMED before reusing its blocks.
    revoking_generation: int = 0

    @property
    def ok(self) -> bool:
        """True when the item was applied (or was already in effect)."""
        return self.error is None

    def raise_for_error(self) -> ItemResult:
        """Raise the item's error, if any; otherwise return self."""
        if self.error is not None:
            raise self.error
        return self


# Events


ServerEvent = Event[TransferInfo, EngineInfo]
"""An event as the SDK reads it from a Watch: the protocol's `Event` (one type with the service's) over the SDK's
views of transfers and engines. `sequence` is its position in the engine's log (1, 2, 3, ...; resume a Watch from
the last one + 1), not the store-wide header revision."""


@dataclass(frozen=True, slots=True)
class WatchBatch:
    """One message of a Watch stream: events in sequence order, or a request to resync."""

    events: tuple[ServerEvent, ...]
    resync_required: bool
    resync_sequence: int
    epoch: int


@dataclass(frozen=True, slots=True)
class Resynced:
    """Synthetic session notification: events were lost, here is the engine's view instead.

    The watch fell behind what the server retains; `transfers` are the engine's live transfers
    now, and the events that follow start at `sequence`. `unlisted` names what the session re-asserted for this
    engine (targets, claims, ready sources) that `transfers` lacks: ended while the watch was away (or forgotten
    since), its end among the events lost; the session re-asserts them no more. Only the server's record
    (`GetTransfer`) tells how each ended.
    """

    sequence: int
    transfers: tuple[TransferInfo, ...]
    unlisted: tuple[str, ...] = ()


class SessionCause(StrEnum):
    """A `Reregistered.cause` that is no error's reason."""

    EPOCH_CHANGED = "EPOCH_CHANGED"
    """The server restarted (its epoch changed): the engine registers again."""


@dataclass(frozen=True, slots=True)
class Reregistered:
    """Synthetic session notification: the engine registered a new incarnation.

    `cause` is the ErrorInfo `Reason` that forced it (ENGINE_NOT_FOUND, LEASE_EXPIRED,
    STALE_INCARNATION) or `SessionCause.EPOCH_CHANGED` after a server restart. `results` are the outcomes of
    re-asserting the session's live transfers; a failed item means that transfer is gone.
    """

    cause: Reason | SessionCause
    previous_incarnation: int
    incarnation: int
    epoch: int
    results: tuple[ItemResult, ...]


SessionEvent = ServerEvent | Resynced | Reregistered
"""What an engine session delivers: server events and the two synthetic notifications."""


@dataclass(frozen=True, slots=True)
class ServerStatus:
    """The operator summary of GetStatus."""

    version: str
    store: str
    live_engines: int
    transfers_by_state: Mapping[TransferState, int]
    watchers: int
    start_time: float
    epoch: int


# Credits


@dataclass(frozen=True, slots=True)
class CreditResult:
    """The outcome of one reservation or release: where the credit is held and until when, or an error."""

    transfer_id: str
    engine_id: str = ""
    expire_time: float = 0.0
    error: RendezvousError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def raise_for_error(self) -> CreditResult:
        """Raise the item's error, if any; otherwise return self."""
        if self.error is not None:
            raise self.error
        return self


__all__ = [
    "AbortReason",
    "AbortSpec",
    "AllBlocksCleared",
    "Binding",
    "BlockHashing",
    "BlocksRemoved",
    "BlocksStored",
    "CacheEvent",
    "CacheReport",
    "CacheSnapshot",
    "ClaimSpec",
    "CompletionOutcome",
    "CompletionSpec",
    "CreditResult",
    "CreditSpec",
    "EngineCapacity",
    "EngineCredits",
    "EngineInfo",
    "EnginePage",
    "EngineRole",
    "EngineSpec",
    "EngineView",
    "Event",
    "EventType",
    "IndexPosition",
    "ItemResult",
    "KvLayout",
    "KvRegion",
    "LeaseRenewal",
    "MemoryKind",
    "NixlAgent",
    "NixlAgentInfo",
    "PrefixMatch",
    "PrefixQuery",
    "Registration",
    "ReleaseSpec",
    "Reregistered",
    "Resynced",
    "RevocationAck",
    "ServerStatus",
    "SourceReadySpec",
    "TargetSpec",
    "TransferInfo",
    "TransferMode",
    "TransferPage",
    "TransferState",
    "TransferTimes",
    "WatchBatch",
    "WrittenPart",
    "hash_of",
]
