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
_UNAVAILABLE_ERRORS = (
    rex.ConnectionError,
    rex.TimeoutError,
    rex.ClusterError,
    rex.SlotNotCoveredError,
    OSError,
    # redis-py parses these codes into their own classes and drops the code from the message, so the
    # prefixes above never see them: READONLY (a demoted master, or a URL naming a replica), OOM, TRYAGAIN.
    rex.ReadOnlyError,
    rex.OutOfMemoryError,
    rex.TryAgainError,
)


_KILLED = "Script killed by user"
"""The start of what a script's caller gets when an operator ends it with SCRIPT KILL (code ERR): Redis kills only a
script that has not written, so the call changed nothing and may be retried."""


def unavailable(err: Exception) -> bool:
    """Whether err says Redis cannot be reached or will not serve now."""
    if isinstance(err, _UNAVAILABLE_ERRORS):
        return True
    if isinstance(err, rex.ResponseError) and str(err).startswith(_KILLED):
        return True
    if type(err) is rex.RedisClusterException and "cannot be connected" in str(err):
        return True  # the cluster client reached none of the nodes it knows (not a RedisError: caught apart)
    if not isinstance(err, rex.ResponseError):
        return False
    code = getattr(err, "status_code", None) or ""
    return code.startswith(_UNAVAILABLE_PREFIXES) or str(err).startswith(_UNAVAILABLE_PREFIXES)


@contextlib.contextmanager
def store_errors(limit: float) -> Iterator[None]:
    """Report an unreachable or unwilling Redis, or a call past its time limit, as StoreUnavailableError."""
    try:
        yield
    except TimeoutError as err:
        raise StoreUnavailableError(f"Redis did not answer within {limit:g} s") from err
    except (rex.RedisError, rex.RedisClusterException, OSError) as err:
        if unavailable(err):
            raise StoreUnavailableError(f"Redis is unavailable: {err}") from err
        raise
