"""The transfer state machine and leases: pure logic, no I/O, no gRPC."""

from rendezvous.core.limits import Limits, Timeouts
from rendezvous.core.model import (
    AbortReason,
    Addressed,
    Engine,
    Event,
    EventType,
    KvLayout,
    KvRegion,
    MemoryKind,
    Mode,
    NixlAgent,
    Outcome,
    Role,
    State,
    Transfer,
    TransferTimes,
)
from rendezvous.core.transfers import Context, Transition
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.protocol.requests import (
    AbortSpec,
    ClaimSpec,
    CompletionSpec,
    EngineSpec,
    ReleaseSpec,
    RevocationAck,
    SourceReadySpec,
    TargetSpec,
)

__all__ = [
    "AbortReason",
    "AbortSpec",
    "Addressed",
    "ClaimSpec",
    "CompletionSpec",
    "Context",
    "Engine",
    "EngineSpec",
    "Event",
    "EventType",
    "KvLayout",
    "KvRegion",
    "Limits",
    "MemoryKind",
    "Mode",
    "NixlAgent",
    "Outcome",
    "Reason",
    "ReleaseSpec",
    "RendezvousError",
    "RevocationAck",
    "Role",
    "SourceReadySpec",
    "State",
    "TargetSpec",
    "Timeouts",
    "Transfer",
    "TransferTimes",
    "Transition",
]
