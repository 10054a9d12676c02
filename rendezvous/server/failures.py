"""What a failure the service did not refuse on purpose becomes on the wire (docs/protocol.md, "Errors").

One mapping for every path a call takes (the auth guard, unary handlers, stream handlers): a `RendezvousError`
is itself, a store outage is STORE_UNAVAILABLE (retry), and anything else is a bug: INTERNAL with ErrorInfo
INTERNAL_ERROR, never a bare UNKNOWN, logged with its traceback under a request id the client is told.
"""

from __future__ import annotations

import logging
import uuid

from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.store.base import StoreUnavailableError

log = logging.getLogger(__name__)


def as_error(exc: Exception, method: str, request_id: str = "") -> RendezvousError:
    """A failure as the domain error the client sees. A bug is logged with its traceback under the call's own
    request_id, else a fresh one, which the client is told (ErrorInfo metadata `request_id`), so an operator can
    find it from the client's report."""
    if isinstance(exc, RendezvousError):
        return exc
    if isinstance(exc, StoreUnavailableError):
        return RendezvousError(Reason.STORE_UNAVAILABLE, f"the store is unavailable: {exc}")
    request_id = request_id or uuid.uuid4().hex
    log.error(
        "%s failed unexpectedly (request id %s)",
        method,
        request_id,
        exc_info=exc,
        extra={"method": method, "request_id": request_id},
    )
    return RendezvousError(
        Reason.INTERNAL_ERROR, f"internal error; logged with request id {request_id}", request_id=request_id
    )
