"""Invalid-request back-off: a caller whose large request was refused as invalid waits before the next is read.

Every cap on a request's shape (items, parts, block ids, a message that does not parse) is checked once the
request is parsed, and parsing a large request is the dearest step of a call that is then refused: 15-30 ms
for a 4 MiB CompleteTransfers of 466,944 parts on the 2-core VM, more than twenty admitted calls of another
caller. A well-behaved client sends such a request once (it is a bug); a buggy or hostile one sends it back to
back and, refused at once, takes most of the loop. So a request of at least `min_bytes` that is refused
INVALID_ARGUMENT as a whole charges its caller what it cost: for `FACTOR` times the seconds it took, that
caller's requests at least as large are refused before they are parsed (RESOURCE_EXHAUSTED / RATE_LIMITED with
a google.rpc.RetryInfo for the rest of the wait); each further such refusal in a row doubles the wait, up to
`MAX_WAIT`. Every other caller is not affected; a large request that then passes ends the back-off.

Receiving a request costs too (4 MiB: 3-5 ms of the server's CPU directly, 12-13 ms through an HAProxy front),
and gRPC hands a unary request over only whole, so its size is not known before it is read. So while a caller
backs off, its calls to the method that was refused are refused before their request is read, whatever their
size (`check_unread`; the server's small HTTP/2 receive window keeps what arrives anyway to a few hundred KiB);
its calls to other methods are read, and refused unparsed if as large (`check`). Such a call is first held,
unread, until the back-off ends or for at most `max_hold` seconds (`hold`), then served if it ended, refused
if not: a client that waits out the retry hint loses nothing, and one that retries at once (or cannot read the
hint: an HAProxy 2.6 front turns the early answer into CANCELLED) calls at most once per hold. At most
`HELD_PER_CALLER` calls of a caller, and `HELD` in all, are held (each holds up to the receive window, 256 KiB
by default); the rest are refused at once.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rendezvous.protocol.errors import Reason, RendezvousError

FACTOR = 10.0
"""A caller waits this many times what its refused request cost (so such requests take at most ~1/11 of the
loop)."""
MAX_WAIT = 10.0
"""The longest back-off, in seconds."""
HELD_PER_CALLER = 4
"""The most calls of one caller held unread at once."""
HELD = 64
"""The most calls held unread at once, over all callers."""
_MAX_CALLERS = 10_000
"""Beyond this many callers in back-off, those whose wait is over are forgotten."""


@dataclass
class _Wait:
    until: float
    seconds: float
    min_bytes: int
    method: str


class InvalidBackoff:
    """Per caller: after a large invalid request, its calls to that method refused unread (`check_unread`, after
    a `hold`) and its requests as large refused unparsed (`check`), fed by `refused` and `passed` once a call is
    served. min_bytes 0: off."""

    __slots__ = ("_callers", "_clock", "_held", "_methods", "max_hold", "min_bytes")

    def __init__(self, min_bytes: int, clock: Callable[[], float] = time.monotonic, max_hold: float = 1.0) -> None:
        if min_bytes < 0 or max_hold < 0:
            raise ValueError("min_bytes and max_hold must not be negative")
        self.min_bytes = min_bytes
        self.max_hold = max_hold
        self._clock = clock
        self._callers: dict[str, _Wait] = {}
        self._methods: Counter[str] = Counter()  # the callers whose back-off names each method
        self._held: Counter[str] = Counter()  # calls held unread, per caller

    def watches(self, method: str) -> bool:
        """Whether some caller's back-off names method (its calls are then checked before they are read)."""
        return method in self._methods

    def unread_wait(self, caller: str, method: str) -> float:
        """The seconds left of caller's back-off from calls to method (0: its calls are read)."""
        wait = self._callers.get(caller)
        if wait is None or wait.method != method:
            return 0.0
        now = self._clock()
        if now >= wait.until + wait.seconds:  # over, and no longer "in a row": forgotten
            self._forget(caller)
            return 0.0
        return max(0.0, wait.until - now)

    def check_unread(self, caller: str, method: str) -> None:
        """Raise RATE_LIMITED if caller is backing off from calls to method (checked before the request is read)."""
        if self.unread_wait(caller, method) > 0:
            what = f"{method} calls from this caller are not read"
            self._raise_if_waiting(self._callers[caller], self._clock(), what)

    @contextmanager
    def hold(self, caller: str, left: float) -> Iterator[float]:
        """The seconds to hold one of caller's calls unread while the block runs: the `left` of its back-off and a
        millisecond (so that it is over on waking), at most max_hold; 0 past the caps."""
        if not self.max_hold or self._held[caller] >= HELD_PER_CALLER or self._held.total() >= HELD:
            yield 0.0
            return
        self._held[caller] += 1
        try:
            yield min(left + 0.001, self.max_hold)
        finally:
            self._held[caller] -= 1
            if not self._held[caller]:
                del self._held[caller]

    def check(self, caller: str, size: int) -> None:
        """Raise RATE_LIMITED if caller is backing off from requests of this size."""
        wait = self._callers.get(caller)
        if wait is None or size < wait.min_bytes:
            return
        self._raise_if_waiting(wait, self._clock(), "such requests are not parsed")

    @staticmethod
    def _raise_if_waiting(wait: _Wait, now: float, what: str) -> None:
        left = wait.until - now
        if left > 0:
            raise RendezvousError(
                Reason.RATE_LIMITED,
                f"a {wait.method} request of {wait.min_bytes} bytes or more from this caller was refused as "
                f"invalid; {what} for {wait.seconds:.3g} s",
                retry_after=left,
                min_bytes=wait.min_bytes,
            )

    def refused(self, caller: str, method: str, size: int, cost: float) -> None:
        """A `method` request of `size` bytes that took `cost` seconds was refused as invalid."""
        if not self.min_bytes or size < self.min_bytes:
            return
        now = self._clock()
        last = self._callers.get(caller)
        seconds = FACTOR * cost
        if last is not None and now < last.until + last.seconds:  # again, right after its last wait
            seconds = max(seconds, 2 * last.seconds)
            size = min(size, last.min_bytes)
        seconds = min(seconds, MAX_WAIT)
        if last is None and len(self._callers) >= _MAX_CALLERS:
            self._forget_over(now)
        self._forget(caller)
        self._callers[caller] = _Wait(now + seconds, seconds, size, method)
        self._methods[method] += 1

    def passed(self, caller: str, size: int) -> None:
        """A request of `size` bytes was not refused as invalid: a large one ends the caller's back-off."""
        wait = self._callers.get(caller)
        if wait is not None and size >= wait.min_bytes:
            self._forget(caller)

    def _forget(self, caller: str) -> None:
        wait = self._callers.pop(caller, None)
        if wait is not None:
            self._methods[wait.method] -= 1
            if not self._methods[wait.method]:
                del self._methods[wait.method]

    def _forget_over(self, now: float) -> None:
        for caller in [c for c, w in self._callers.items() if w.until + w.seconds <= now]:
            self._forget(caller)


__all__ = ["FACTOR", "HELD", "HELD_PER_CALLER", "MAX_WAIT", "InvalidBackoff"]
