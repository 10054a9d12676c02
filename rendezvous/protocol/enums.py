"""The protocol's enums, shared by the service and the SDK.

Values equal the proto's numbers (rendezvous.v1), so mapping to the wire is a cast. A number this
code does not know (sent by a newer peer) reads as UNSPECIFIED (0). They compare equal to their numbers but print
by name (`str(TransferState.COMMITTED)` is "COMMITTED"): logs and messages read in the protocol's words. Plain
Python: no protobuf import.
"""

from __future__ import annotations

from enum import IntEnum

_NUMBER_FORMATS = frozenset("bcdoxXn")
"""Format types that ask for the number (`f"{state:d}"`); any other spec formats the name."""


class _WireEnum(IntEnum):
    """An enum of the protocol: unknown numbers (added by a newer server) read as UNSPECIFIED (0); prints by name."""

    @classmethod
    def _missing_(cls, value: object) -> _WireEnum:
        return cls(0)

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        if spec[-1:] in _NUMBER_FORMATS:
            return int.__format__(self, spec)
        return format(self.name, spec)


class EngineRole(_WireEnum):
    """Which side of a transfer an engine plays."""

    UNSPECIFIED = 0
    PRODUCER = 1
    CONSUMER = 2


class MemoryKind(_WireEnum):
    """Where a NIXL region lives."""

    UNSPECIFIED = 0
    DRAM = 1
    VRAM = 2


class TransferState(_WireEnum):
    """Lifecycle state of a transfer."""

    UNSPECIFIED = 0
    TARGETED = 1
    CLAIMED = 2
    MATCHED = 3
    COMMITTED = 4
    RELEASED = 5
    ABORTED = 6

    @property
    def terminal(self) -> bool:
        """Released and aborted transfers are over; the server keeps them briefly as tombstones."""
        return self in _TERMINAL


_TERMINAL = frozenset((TransferState.RELEASED, TransferState.ABORTED))
"""`TransferState.terminal`: a set lookup, as cheap as comparing one state (asked on every transition)."""


class TransferMode(_WireEnum):
    """Which side moves the bytes. UNSPECIFIED is treated as PUSH by the server."""

    UNSPECIFIED = 0
    PUSH = 1
    PULL = 2


class AbortReason(_WireEnum):
    """Why a transfer was aborted; UNSPECIFIED when it was not."""

    UNSPECIFIED = 0
    REQUESTED = 1
    DEADLINE_EXCEEDED = 2
    PEER_LOST = 3
    LAYOUT_MISMATCH = 4
    TRANSFER_FAILED = 5
    BLOCK_MISMATCH = 6
    DATA_PLANE_MISMATCH = 7


class EventType(_WireEnum):
    """Kinds of engine events (see the protocol for who receives which)."""

    UNSPECIFIED = 0
    TRANSFER_ASSIGNED = 1
    TRANSFER_REVOKED = 2
    SOURCE_READY = 3
    TRANSFER_COMMITTED = 4
    TRANSFER_ABORTED = 5
    PEER_LOST = 6
    REVOCATION_CONFIRMED = 7


class EngineView(_WireEnum):
    """How much of each engine ListEngines returns (AIP-157); UNSPECIFIED is the default, FULL."""

    UNSPECIFIED = 0
    BASIC = 1
    """Without the NIXL agents' metadata bytes and without labels."""
    PLACEMENT = 2
    """BASIC plus labels: what a router places requests by."""
    FULL = 3
    """Everything, agent metadata and labels included."""

    @property
    def with_agent_metadata(self) -> bool:
        """The view carries the agents' metadata bytes."""
        return self in (EngineView.UNSPECIFIED, EngineView.FULL)

    @property
    def with_labels(self) -> bool:
        """The view carries the engine's labels."""
        return self is not EngineView.BASIC


class CompletionOutcome(_WireEnum):
    """Result of moving a generation's bytes."""

    UNSPECIFIED = 0
    SUCCEEDED = 1
    FAILED = 2


LIVE_STATES = (TransferState.TARGETED, TransferState.CLAIMED, TransferState.MATCHED, TransferState.COMMITTED)
"""States of a transfer that still holds both engines' attention (not a tombstone)."""
