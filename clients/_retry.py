"""Retry bookkeeping: when to try a failed call again, and how long to wait first."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from rendezvous.clients._config import RetryPolicy
from rendezvous.protocol.errors import RendezvousError


def retry_hint(error: RendezvousError) -> float | None:
    """The server's retry hint, in seconds, of a refusal made before any of its call's work: a RESOURCE_EXHAUSTED
    that carries a google.rpc.RetryInfo (e.g. RATE_LIMITED: when the caller's bucket holds a token again); None for
    any other error."""
    return error.retry_after if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED else None


def renewal_wait(backoff: float, hint: float, latest: float) -> float:
    """Seconds to wait before renewing a lease again after a renewal refused with the retry hint `hint`.

    At least the backoff, and the hint (renewing sooner is refused the same way), but no later than `latest`
    seconds from now: the last moment a renewal still has its answer time before the lease lapses, so a long hint
    still leaves the lease one try. Once that moment has passed there is no lease left to save: the hint.
    """
    if latest <= 0:
        return max(backoff, hint)
    return max(backoff, min(hint, latest))


class Attempts:
    """The retries of one unary call under a policy, across `endpoints` endpoints.

    An UNAVAILABLE endpoint is left for the next one at once; the client backs off only after a
    whole round of endpoints failed, so a dead first endpoint costs one connection attempt.
    The policy's deadline counts from `started`, the `clock()` reading taken just before the
    call's first attempt (default: now), so the time a slow first attempt took counts too.
    """

    __slots__ = ("_clock", "_endpoints", "_policy", "_retries", "_started")

    def __init__(
        self,
        policy: RetryPolicy,
        endpoints: int,
        started: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy = policy
        self._endpoints = endpoints
        self._retries = 0
        self._clock = clock
        self._started = clock() if started is None else started

    def next_delay(self, error: RendezvousError, idempotent: bool) -> float | None:
        """Seconds to wait before retrying after error, or None to give up and raise it.

        A RESOURCE_EXHAUSTED that carries the server's retry hint (google.rpc.RetryInfo: a call refused
        before any of its work, e.g. RATE_LIMITED) is retried after at least that hint, whatever the call.
        """
        policy = self._policy
        hint = retry_hint(error)
        if hint is None and not policy.retryable(error.code, idempotent):
            return None
        self._retries += 1
        if policy.max_attempts is not None and self._retries >= policy.max_attempts:
            return None
        if error.code == grpc.StatusCode.UNAVAILABLE:
            rounds, within_round = divmod(self._retries, self._endpoints)
            delay = policy.backoff(rounds) if not within_round else 0.0
        else:
            delay = policy.backoff(self._retries)
        if hint is not None:
            delay = max(delay, hint)
        if policy.deadline is not None and self._clock() - self._started + delay > policy.deadline:
            return None
        return delay


class Backoff:
    """Growing waits between reconnections of a long-lived stream; reset once it works again."""

    __slots__ = ("_policy", "_retries")

    def __init__(self, policy: RetryPolicy) -> None:
        self._policy = policy
        self._retries = 0

    def next(self) -> float:
        """Seconds to wait before the next attempt."""
        self._retries += 1
        return self._policy.backoff(self._retries)

    def after(self, error: RendezvousError | None) -> float:
        """Seconds to wait before the next attempt after `error` (None: the stream just ended): the backoff, or
        the server's retry hint when that is longer (trying sooner is refused the same way)."""
        hint = retry_hint(error) if error is not None else None
        return max(self.next(), hint or 0.0)

    def reset(self) -> None:
        """The stream works again: start over from the initial backoff."""
        self._retries = 0
