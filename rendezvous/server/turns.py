"""Fair turns: the unary calls of many callers through a few at a time, round robin by caller.

The service answers on one event loop, so calls do not run side by side: they take turns, and until now in
the order gRPC handed them over. A caller that keeps hundreds of calls in flight (or sends the largest
requests back to back) was ahead of everyone else's next call by all of them. With fair turns a call waits
for at most `slots` calls in progress plus one call of each other caller that is waiting too, whatever
those callers have queued: the work one identity can put ahead of another's call is one call per turn, not
its whole backlog (kube-apiserver's priority and fairness, reduced to one priority level and one queue per
caller). A caller's calls beyond `max_waiting` waiting are refused at once, before their request is even
parsed, with `RESOURCE_EXHAUSTED / TOO_MANY_CONCURRENT_CALLS` and a retry hint.
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

    __slots__ = ("_free", "_max_waiting", "_waiting")

    def __init__(self, slots: int, max_waiting: int) -> None:
        if slots < 1 or max_waiting < 0:
            raise ValueError("fair turns need at least one slot and max_waiting >= 0")
        self._free = slots
        self._max_waiting = max_waiting
        # Callers with calls waiting, in the order they are next served; each with its calls in arrival order.
        self._waiting: collections.OrderedDict[str, collections.deque[asyncio.Future[None]]] = collections.OrderedDict()

    @property
    def waiting(self) -> int:
        """Calls waiting for a turn, over all callers."""
        return sum(len(calls) for calls in self._waiting.values())

    @asynccontextmanager
    async def turn(self, caller: str) -> AsyncIterator[None]:
        """Wait for this caller's turn (or be refused at once), hold it for the block."""
        await self._acquire(caller)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, caller: str) -> None:
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
        ready = asyncio.get_running_loop().create_future()
        calls.append(ready)
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
        if calls is not None and ready in calls:
            calls.remove(ready)
            if not calls:
                del self._waiting[caller]

    def _release(self) -> None:
        """Hand the freed turn to the next caller in the round (it goes to the back of it), or free it."""
        while self._waiting:
            caller, calls = next(iter(self._waiting.items()))
            ready = calls.popleft()
            if calls:
                self._waiting.move_to_end(caller)
            else:
                del self._waiting[caller]
            if not ready.done():
                ready.set_result(None)
                return
        self._free += 1


__all__ = ["RETRY_AFTER", "FairTurns"]
