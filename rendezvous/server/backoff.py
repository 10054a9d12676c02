"""Invalid-request back-off: a caller whose large request was refused as invalid waits before the next is read.

Every cap on a request's shape (items, parts, block ids, a message that does not parse) is checked once the
request is parsed, and parsing a large request is the dearest step of a call that is then refused: 15-30 ms
for a 4 MiB CompleteTransfers of 466,944 parts on the 2-core VM, more than twenty admitted calls of another
caller. A well-behaved client sends such a request once (it is a bug); a buggy or hostile one sends it back to
back and, refused at once, takes most of the loop. So a request of at least `min_bytes` that is refused
INVALID_ARGUMENT as a whole charges its caller what it cost: for `FACTOR` times the seconds it took, that
caller's requests at least as large are refused before they are parsed (RESOURCE_EXHAUSTED / RATE_LIMITED with
a google.rpc.RetryInfo for the rest of the wait); each further such refusal in a row doubles the wait, up to
`MAX_WAIT`. Smaller requests of the same caller, and every other caller, are not affected; a large request
that then passes ends the back-off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rendezvous.protocol.errors import Reason, RendezvousError

FACTOR = 10.0
"""A caller waits this many times what its refused request cost (so such requests take at most ~1/11 of the
loop)."""
MAX_WAIT = 10.0
"""The longest back-off, in seconds."""
_MAX_CALLERS = 10_000
"""Beyond this many callers in back-off, those whose wait is over are forgotten."""


@dataclass
class _Wait:
    until: float
    seconds: float
    min_bytes: int


class InvalidBackoff:
    """Per caller: the requests refused unread after a large invalid one (`check`), fed by `refused` and
    `passed` once a call is served. min_bytes 0: off."""

    __slots__ = ("_callers", "_clock", "min_bytes")

    def __init__(self, min_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        if min_bytes < 0:
            raise ValueError("min_bytes must not be negative")
        self.min_bytes = min_bytes
        self._clock = clock
        self._callers: dict[str, _Wait] = {}

    def check(self, caller: str, size: int) -> None:
        """Raise RATE_LIMITED if caller is backing off from requests of this size."""
        wait = self._callers.get(caller)
        if wait is None or size < wait.min_bytes:
            return
        left = wait.until - self._clock()
        if left > 0:
            raise RendezvousError(
                Reason.RATE_LIMITED,
                f"a request of {wait.min_bytes} bytes or more from this caller was refused as invalid; such "
                f"requests are not read for {wait.seconds:.3g} s",
                retry_after=left,
                min_bytes=wait.min_bytes,
            )

    def refused(self, caller: str, size: int, cost: float) -> None:
        """A request of `size` bytes that took `cost` seconds was refused as invalid."""
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
        self._callers[caller] = _Wait(now + seconds, seconds, size)

    def passed(self, caller: str, size: int) -> None:
        """A request of `size` bytes was not refused as invalid: a large one ends the caller's back-off."""
        wait = self._callers.get(caller)
        if wait is not None and size >= wait.min_bytes:
            del self._callers[caller]

    def _forget_over(self, now: float) -> None:
        for caller in [c for c, w in self._callers.items() if w.until + w.seconds <= now]:
            del self._callers[caller]


__all__ = ["FACTOR", "MAX_WAIT", "InvalidBackoff"]
