"""The conversion of a failed gRPC call into the protocol's one error tree (rendezvous.protocol.errors).

Every failure the clients raise is a `RendezvousError` (re-exported by `rendezvous.clients`), of the subclass of
its gRPC status code (`ResourceExhausted`, `Unavailable`, ...); `reason` is the ErrorInfo reason that says what
exactly went wrong. The same classes describe per-item failures of batched calls (`ItemResult.error`), and are what
the service raises.
"""

from __future__ import annotations

import grpc
from grpc_status import rpc_status

from rendezvous.protocol.convert import error
from rendezvous.protocol.errors import RendezvousError, error_for


def from_rpc_error(rpc_error: grpc.RpcError) -> RendezvousError:
    """The exception for a failed gRPC call (sync or asyncio), keeping the call's error as cause."""
    call: grpc.Call = rpc_error  # grpc's errors are also their calls
    try:
        status = rpc_status.from_call(call)
    except ValueError:
        status = None  # details that contradict the status line: trust the status line
    converted = error(status) if status is not None else error_for(call.code(), call.details() or "")
    converted.__cause__ = rpc_error
    return converted
