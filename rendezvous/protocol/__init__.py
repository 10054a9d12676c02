"""The protocol's vocabulary, shared by the service (rendezvous) and the SDK (clients).

The generated stubs live in rendezvous.v1; here are the error reasons (generated from
proto/rendezvous/v1/errors.proto), the enums and the records both sides use as they are, and the one
mapping between those and the wire (rendezvous.protocol.convert, the only module here that imports
protobuf). Imports flow one way: connector -> clients -> protocol <- rendezvous.
"""

from rendezvous.protocol.enums import (
    LIVE_STATES,
    AbortReason,
    CompletionOutcome,
    EngineRole,
    EventType,
    MemoryKind,
    TransferMode,
    TransferState,
)
from rendezvous.protocol.reasons import REASON_CODES, Reason
from rendezvous.protocol.records import KvLayout, KvRegion, NixlAgent, TransferTimes, WrittenPart

ERROR_DOMAIN = "kv-rendezvous"
"""The google.rpc.ErrorInfo domain of the service's errors."""

__all__ = [
    "ERROR_DOMAIN",
    "LIVE_STATES",
    "REASON_CODES",
    "AbortReason",
    "CompletionOutcome",
    "EngineRole",
    "EventType",
    "KvLayout",
    "KvRegion",
    "MemoryKind",
    "NixlAgent",
    "Reason",
    "TransferMode",
    "TransferState",
    "TransferTimes",
    "WrittenPart",
]
