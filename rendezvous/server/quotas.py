"""Per-caller call quotas: a token bucket for the request rate and a cap on unary calls in flight.

The caller is the authenticated identity when auth is on, else the peer's host. Watch and KeepAlive
streams are long-lived and count against the rate when they open, not against concurrency (the
watcher limit bounds them).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from rendezvous.core.errors import Reason, RendezvousError

# Beyond this many remembered callers, idle (full) buckets are forgotten.
_MAX_BUCKETS = 10_000


@dataclass(frozen=True)
class CallLimits:
    """`rate` calls per second with bursts of `burst` (0: no rate limit), and at most `concurrency`
    unary calls in flight (0: no limit), per caller."""

    rate: float = 0.0
    burst: int = 0
    concurrency: int = 0

    def __post_init__(self) -> None:
        if self.rate < 0 or self.burst < 0 or self.concurrency < 0:
            raise ValueError("call limits must not be negative")

    @property
    def enabled(self) -> bool:
        """Whether any limit is set."""
        return bool(self.rate or self.concurrency)

    @property
    def bucket_size(self) -> float:
        """Tokens a full bucket holds: `burst`, or one second's worth of calls (at least one)."""
        return float(self.burst) if self.burst else max(1.0, self.rate)


class _Bucket:
    __slots__ = ("stamp", "tokens")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp


class CallQuotas:
    """Admits or refuses calls per caller key."""

    def __init__(self, limits: CallLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._in_flight: Counter[str] = Counter()

    def admit(self, key: str) -> None:
        """Take one token from key's bucket, or raise RATE_LIMITED."""
        rate = self.limits.rate
        if not rate:
            return
        now, size = self._clock(), self.limits.bucket_size
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= _MAX_BUCKETS:
                self._forget_idle(now)
            bucket = self._buckets[key] = _Bucket(size, now)
        bucket.tokens = min(size, bucket.tokens + (now - bucket.stamp) * rate)
        bucket.stamp = now
        if bucket.tokens < 1:
            raise RendezvousError(
                Reason.RATE_LIMITED, f"more than {rate:g} calls/s (burst {size:g}); back off", limit=rate
            )
        bucket.tokens -= 1

    def _forget_idle(self, now: float) -> None:
        size, rate = self.limits.bucket_size, self.limits.rate
        for key in [k for k, b in self._buckets.items() if b.tokens + (now - b.stamp) * rate >= size]:
            del self._buckets[key]

    def enter(self, key: str) -> None:
        """Count a unary call in flight, or raise TOO_MANY_CONCURRENT_CALLS."""
        limit = self.limits.concurrency
        if limit and self._in_flight[key] >= limit:
            raise RendezvousError(
                Reason.TOO_MANY_CONCURRENT_CALLS, f"more than {limit} calls in flight; wait for some", limit=limit
            )
        self._in_flight[key] += 1

    def leave(self, key: str) -> None:
        """A counted call ended."""
        self._in_flight[key] -= 1
        if not self._in_flight[key]:
            del self._in_flight[key]
