"""Which Redis failures mean "not now" (StoreUnavailableError, callers may retry) rather than "wrong"."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from redis import exceptions as rex

from rendezvous.store.base import StoreUnavailableError

# Response errors that mean "not now" rather than "wrong": loading, failover, full memory, busy.
_UNAVAILABLE_PREFIXES = (
    "LOADING",
    "MISCONF",
    "READONLY",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "TRYAGAIN",
    "OOM",
    "BUSY",
    "NOREPLICAS",
)
_UNAVAILABLE_ERRORS = (rex.ConnectionError, rex.TimeoutError, rex.ClusterError, rex.SlotNotCoveredError, OSError)


def unavailable(err: Exception) -> bool:
    """Whether err says Redis cannot be reached or will not serve now."""
    if isinstance(err, _UNAVAILABLE_ERRORS):
        return True
    return isinstance(err, rex.ResponseError) and str(err).startswith(_UNAVAILABLE_PREFIXES)


@contextlib.contextmanager
def store_errors(limit: float) -> Iterator[None]:
    """Report an unreachable or unwilling Redis, or a call past its time limit, as StoreUnavailableError."""
    try:
        yield
    except TimeoutError as err:
        raise StoreUnavailableError(f"Redis did not answer within {limit:g} s") from err
    except (rex.RedisError, OSError) as err:
        if unavailable(err):
            raise StoreUnavailableError(f"Redis is unavailable: {err}") from err
        raise
