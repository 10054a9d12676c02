"""The protocol's vocabulary, shared by the service (rendezvous) and the SDK (clients).

The generated stubs live in rendezvous.v1; here are the error reasons (generated from
proto/rendezvous/v1/errors.proto) and the one error tree (errors), the enums, the records and the requests
(requests) both sides use as they are, and the one mapping between those and the wire
(rendezvous.protocol.convert, and for the KV index rendezvous.protocol.index_wire: the only modules here that
import protobuf). The error tree (rendezvous.protocol.errors) names grpc's status codes, so it is not imported
here: the data plane (a writer loaded without the SDK, scripts/gpu_check.py) loads this package without grpc.
Imports flow one way: connector -> clients -> protocol <- rendezvous.
"""

from rendezvous.protocol.enums import (
    LIVE_STATES,
    AbortReason,
    CompletionOutcome,
    EngineRole,
    EngineView,
    EventType,
    MemoryKind,
    TransferMode,
    TransferState,
)
from rendezvous.protocol.reasons import REASON_CODES, Reason
from rendezvous.protocol.records import KvLayout, KvRegion, NixlAgent, TransferTimes, WrittenPart

__all__ = [
    "LIVE_STATES",
    "REASON_CODES",
    "AbortReason",
    "CompletionOutcome",
    "EngineRole",
    "EngineView",
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
