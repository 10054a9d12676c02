"""Per-caller quotas: token buckets for the request rate and for refusals, caps on calls in flight and
on open streams.

The caller is the authenticated identity when auth is on (its key, which a rename keeps), else the peer's
host: each identity has buckets and caps of its own, so no identity's load spends another's allowance. A
call is charged by its size (one call per started `cost_bytes` of request), so one large batch costs what
many small calls would. Every message of a KeepAlive stream and every Watch open is charged like a call,
and so is an identified caller's call that is then denied. A RATE_LIMITED refusal says when the caller's
bucket holds a token again (a google.rpc.RetryInfo, which the SDK waits out before it retries). A call that
did not authenticate (no known token or certificate) is charged to its peer's host in a bucket of its own:
once that is empty, that host's unauthenticated calls are refused RATE_LIMITED, unlogged; a caller with a
valid token from the same host (behind the same NAT) is never refused for them. Calls in flight are counted
while they wait on the store: with the memory store a call never waits (it runs to its answer on the event
loop), so that cap bites with Redis.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from rendezvous.protocol.errors import Reason, RendezvousError

# Beyond this many remembered callers, idle (full) buckets are forgotten.
_MAX_BUCKETS = 10_000

DEFAULT_RATE = 10_000.0
"""Calls per second per identity by default (with auth): above what one replica serves at all
(benchmarks/RESULTS.md: 2,200-7,400 empty unary calls/s, 11,000-15,000 stream messages/s on the 2-core VM), so
a legitimate load never meets it, while one identity cannot take more than a replica's worth."""


@dataclass(frozen=True)
class CallLimits:
    """Per caller: `rate` calls per second with bursts of `burst` (0: no rate limit; None: DEFAULT_RATE
    with auth, none without, see `for_server`), each call
    costing one more per started `cost_bytes` of request (0: every call costs one); at most
    `concurrency` unary calls in flight (0: no limit) and `streams` open Watch and KeepAlive streams
    (0: no limit). Per peer host: `refusal_rate` unauthenticated calls per second with bursts of
    `refusal_burst` (0: not limited). Over all callers: `turns` unary calls in progress at once, the next
    turn going round robin among the callers with calls waiting, at most `waiting` of them and
    `waiting_bytes` of their requests per caller (rendezvous.server.turns; 0 bytes: no bound). Per caller:
    after a request of at least `invalid_backoff_bytes` is refused as invalid, its requests as large wait out
    a back-off unread (rendezvous.server.backoff; 0: off), a call to the refused method held unread for at
    most `invalid_backoff_hold` seconds first (0: refused at once)."""

    rate: float | None = None
    burst: int = 0
    concurrency: int = 0
    cost_bytes: int = 65_536
    streams: int = 1_024
    refusal_rate: float = 5.0
    refusal_burst: int = 50
    turns: int = 32
    waiting: int = 256
    invalid_backoff_bytes: int = 65_536
    waiting_bytes: int = 16 << 20
    invalid_backoff_hold: float = 1.0

    def __post_init__(self) -> None:
        numbers = (self.rate or 0, self.burst, self.concurrency, self.cost_bytes, self.streams, self.waiting)
        sizes = (self.invalid_backoff_bytes, self.waiting_bytes)
        if min(*numbers, *sizes, self.refusal_rate, self.refusal_burst, self.invalid_backoff_hold) < 0:
            raise ValueError("call limits must not be negative")
        if self.turns < 1:
            raise ValueError("turns (unary calls in progress at once) must be at least 1")

    @property
    def enabled(self) -> bool:
        """Whether a per-call limit is set (without auth, the guard is installed only then)."""
        return bool(self.rate or self.concurrency)

    def for_server(self, auth: bool) -> CallLimits:
        """These limits with the default rate decided: DEFAULT_RATE per identity with auth; none without,
        where the caller is the peer's host and a whole fleet behind one address (a NAT, a benchmark's
        loopback) would share one bucket."""
        if self.rate is not None:
            return self
        return replace(self, rate=DEFAULT_RATE if auth else 0.0)


class TokenBucket:
    """Tokens refilled at `rate` per second up to `size`; a call is admitted while the bucket holds at
    least one token and then pays its whole cost, so a call dearer than the bucket is admitted from a
    full bucket and leaves a debt."""

    __slots__ = ("_buckets", "_clock", "rate", "size")

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.size = float(burst) if burst else max(1.0, rate)
        self._buckets: dict[str, list[float]] = {}  # key -> [tokens, stamp]
        self._clock = clock

    def _refilled(self, key: str) -> list[float]:
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= _MAX_BUCKETS:
                self._forget_full(now)
            bucket = self._buckets[key] = [self.size, now]
        bucket[0] = min(self.size, bucket[0] + (now - bucket[1]) * self.rate)
        bucket[1] = now
        return bucket

    def has_token(self, key: str) -> bool:
        """Whether key may make a call now."""
        return self._refilled(key)[0] >= 1

    def wait(self, key: str) -> float:
        """Seconds until key has a token again (0 if it has one now)."""
        return max(0.0, 1 - self._refilled(key)[0]) / self.rate

    def take(self, key: str, cost: float = 1.0) -> bool:
        """Charge key `cost` tokens if it has one now; whether it had."""
        bucket = self._refilled(key)
        if bucket[0] < 1:
            return False
        bucket[0] -= cost
        return True

    def _forget_full(self, now: float) -> None:
        full = [k for k, (tokens, stamp) in self._buckets.items() if tokens + (now - stamp) * self.rate >= self.size]
        for key in full:
            del self._buckets[key]


class CallQuotas:
    """Admits or refuses calls per caller key (and refused calls per peer host)."""

    def __init__(self, limits: CallLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._rate = limits.rate or 0.0  # undecided (None): no rate; RendezvousServer decides it (for_server)
        self._calls = TokenBucket(self._rate, limits.burst, clock) if self._rate else None
        self._refusals = TokenBucket(limits.refusal_rate, limits.refusal_burst, clock) if limits.refusal_rate else None
        self._in_flight = _Cap(limits.concurrency, "calls in flight")
        self._streams = _Cap(limits.streams, "open streams")

    def cost(self, request_bytes: int) -> int:
        """What a request of request_bytes costs, in calls."""
        unit = self.limits.cost_bytes
        return 1 + request_bytes // unit if unit else 1

    @property
    def charges_by_size(self) -> bool:
        """Whether admit() wants the request's size (a rate is set and calls cost by size)."""
        return self._calls is not None and bool(self.limits.cost_bytes)

    def admit(self, key: str, request_bytes: int = 0) -> None:
        """Charge one call (more for a large request) to key's bucket, or raise RATE_LIMITED."""
        self._take(key, self.cost(request_bytes))

    def admit_rest(self, key: str, request_bytes: int) -> None:
        """Charge what a request of request_bytes costs beyond the one call admitted before it was read."""
        if self.charges_by_size:
            self._take(key, self.cost(request_bytes) - 1)

    def _take(self, key: str, cost: int) -> None:
        calls = self._calls
        if calls is not None and cost and not calls.take(key, cost):
            rate = self._rate
            raise RendezvousError(
                Reason.RATE_LIMITED,
                f"more than {rate:g} calls/s (burst {calls.size:g}); back off",
                limit=rate,
                retry_after=calls.wait(key),
            )

    def check_refusals(self, peer: str) -> None:
        """Raise RATE_LIMITED if peer has used up its unauthenticated calls."""
        refusals = self._refusals
        if refusals is not None and not refusals.has_token(peer):
            rate = self.limits.refusal_rate
            raise RendezvousError(
                Reason.RATE_LIMITED,
                f"more than {rate:g} unauthenticated calls/s from this host (burst {refusals.size:g}); back off",
                limit=rate,
                retry_after=refusals.wait(peer),
            )

    def refused(self, peer: str) -> None:
        """Charge a call that did not authenticate to its peer host."""
        if self._refusals is not None:
            self._refusals.take(peer)

    def enter(self, key: str) -> None:
        """Count a unary call in flight, or raise TOO_MANY_CONCURRENT_CALLS."""
        self._in_flight.enter(key)

    def leave(self, key: str) -> None:
        """A counted call ended."""
        self._in_flight.leave(key)

    def open_stream(self, key: str) -> None:
        """Count an open stream, or raise TOO_MANY_CONCURRENT_CALLS."""
        self._streams.enter(key)

    def close_stream(self, key: str) -> None:
        """A counted stream ended."""
        self._streams.leave(key)


class _Cap:
    """At most `limit` (0: no limit) of something at once per key."""

    __slots__ = ("_counts", "_limit", "_what")

    def __init__(self, limit: int, what: str) -> None:
        self._limit = limit
        self._what = what
        self._counts: Counter[str] = Counter()

    def enter(self, key: str) -> None:
        limit = self._limit
        if limit and self._counts[key] >= limit:
            raise RendezvousError(
                Reason.TOO_MANY_CONCURRENT_CALLS, f"more than {limit} {self._what}; wait for some", limit=limit
            )
        self._counts[key] += 1

    def leave(self, key: str) -> None:
        counts = self._counts
        counts[key] -= 1
        if not counts[key]:
            del counts[key]
