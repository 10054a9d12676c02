"""Fair turns: the unary calls of many callers through a few at a time, round robin by caller.

The service answers on one event loop, so calls do not run side by side: they take turns, and until now in
the order gRPC handed them over. A caller that keeps hundreds of calls in flight (or sends the largest
requests back to back) was ahead of everyone else's next call by all of them. With fair turns a call waits
for at most `slots` calls in progress plus one call of each other caller that is waiting too, whatever
those callers have queued: the work one identity can put ahead of another's call is one call per turn, not
its whole backlog (kube-apiserver's priority and fairness, reduced to one priority level and one queue per
caller). A caller's calls beyond `max_waiting` waiting, or beyond `max_waiting_bytes` of requests waiting (a
waiting request is held as its bytes: 256 of 4 MiB would be 1 GiB), are refused at once, before their request
is even parsed, with `RESOURCE_EXHAUSTED / TOO_MANY_CONCURRENT_CALLS` and a retry hint; a caller's first
waiting call is never refused for its size.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from rendezvous.protocol.errors import Reason, RendezvousError

RETRY_AFTER = 0.05
"""Seconds a caller refused for its waiting calls is told to wait before it retries."""


class FairTurns:
    """At most `slots` calls in progress; the next turn goes to the caller after the last one served (round
    robin among the callers with calls waiting), each caller's calls in their order of arrival."""

    __slots__ = ("_bytes", "_free", "_max_waiting", "_max_waiting_bytes", "_waiting")

    def __init__(self, slots: int, max_waiting: int, max_waiting_bytes: int = 0) -> None:
        if slots < 1 or max_waiting < 0 or max_waiting_bytes < 0:
            raise ValueError("fair turns need at least one slot, max_waiting >= 0 and max_waiting_bytes >= 0")
        self._free = slots
        self._max_waiting = max_waiting
        self._max_waiting_bytes = max_waiting_bytes or float("inf")
        # Callers with calls waiting, in the order they are next served; each with its calls (a future and
        # the request's size) in arrival order, and the bytes of its waiting requests.
        self._waiting: collections.OrderedDict[str, collections.deque[tuple[asyncio.Future[None], int]]] = (
            collections.OrderedDict()
        )
        self._bytes: dict[str, int] = {}

    @property
    def waiting(self) -> int:
        """Calls waiting for a turn, over all callers."""
        return sum(len(calls) for calls in self._waiting.values())

    @property
    def waiting_bytes(self) -> int:
        """Bytes of the requests waiting for a turn, over all callers."""
        return sum(self._bytes.values())

    @asynccontextmanager
    async def turn(self, caller: str, size: int = 0) -> AsyncIterator[None]:
        """Wait for this caller's turn (or be refused at once) for a request of `size` bytes, hold it for the
        block."""
        await self._acquire(caller, size)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, caller: str, size: int) -> None:
        if self._free and not self._waiting:
            self._free -= 1
            return
        calls = self._waiting.get(caller)
        if calls is None:
            calls = self._waiting[caller] = collections.deque()
        elif len(calls) >= self._max_waiting:
            raise RendezvousError(
                Reason.TOO_MANY_CONCURRENT_CALLS,
                f"this caller already has {len(calls)} calls waiting for their turn on a busy server; retry later",
                retry_after=RETRY_AFTER,
                limit=self._max_waiting,
            )
        elif self._bytes[caller] + size > self._max_waiting_bytes:
            raise RendezvousError(
                Reason.TOO_MANY_CONCURRENT_CALLS,
                f"this caller already has {self._bytes[caller]} bytes of requests waiting for their turn on a busy "
                "server; retry later",
                retry_after=RETRY_AFTER,
                limit_bytes=self._max_waiting_bytes,
            )
        ready = asyncio.get_running_loop().create_future()
        calls.append((ready, size))
        self._bytes[caller] = self._bytes.get(caller, 0) + size
        try:
            await ready
        except asyncio.CancelledError:
            if ready.done() and not ready.cancelled():
                self._release()  # the turn was handed over as the call was cancelled: pass it on
            else:
                self._forget(caller, ready)
            raise

    def _forget(self, caller: str, ready: asyncio.Future[None]) -> None:
        calls = self._waiting.get(caller)
        if calls is None:
            return
        for call in calls:
            if call[0] is ready:
                calls.remove(call)
                self._left(caller, calls, call[1])
                return

    def _left(self, caller: str, calls: collections.deque[tuple[asyncio.Future[None], int]], size: int) -> None:
        """A call of caller's, of `size` bytes, no longer waits."""
        if calls:
            self._bytes[caller] -= size
        else:
            del self._waiting[caller], self._bytes[caller]

    def _release(self) -> None:
        """Hand the freed turn to the next caller in the round (it goes to the back of it), or free it."""
        while self._waiting:
            caller, calls = next(iter(self._waiting.items()))
            ready, size = calls.popleft()
            if calls:
                self._waiting.move_to_end(caller)
            self._left(caller, calls, size)
            if not ready.done():
                ready.set_result(None)
                return
        self._free += 1


__all__ = ["RETRY_AFTER", "FairTurns"]
