"""Per-key queues for this process's updates, so they wait here instead of conflicting in Redis."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Sequence
from types import TracebackType


class KeyLocks:
    """Queues this process's updates of one key, so they wait here instead of conflicting in Redis.

    Conflicts then only come from other replicas. A key is held while it has a queue (of the futures of
    those waiting for it, first come first served); a free key costs a dict entry and no awaits, so a batch
    of 64 free keys takes them in one pass. Releasing hands the key to the first waiter still waiting.
    """

    def __init__(self) -> None:
        self._held: dict[str, deque[asyncio.Future[None]]] = {}

    def hold(self, key: str) -> Held:
        """Hold one key's lock."""
        return Held(self, (key,))

    def hold_all(self, keys: Iterable[str]) -> Held:
        """Hold the locks of several keys (a batch's), taken in key order so that holders of overlapping
        sets cannot wait on each other in a circle."""
        return Held(self, sorted(set(keys)))

    def __len__(self) -> int:
        """Keys held now."""
        return len(self._held)

    async def _acquire(self, keys: Sequence[str]) -> None:
        taken = 0
        try:
            for key in keys:
                waiters = self._held.get(key)
                if waiters is None:
                    self._held[key] = deque()
                else:
                    handed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                    waiters.append(handed)
                    try:
                        await handed
                    except asyncio.CancelledError:
                        if not handed.cancelled():
                            taken += 1  # handed over just as this task was cancelled: it is ours to pass on
                        raise
                taken += 1
        except BaseException:
            self._release(keys[:taken])
            raise

    def _release(self, keys: Sequence[str]) -> None:
        for key in keys:
            waiters = self._held[key]
            while waiters:
                handed = waiters.popleft()
                if not handed.done():  # (a cancelled waiter's future is done: it left)
                    handed.set_result(None)
                    break
            else:
                del self._held[key]


class Held:
    """`async with` holds its keys (KeyLocks.hold, hold_all)."""

    __slots__ = ("_keys", "_locks")

    def __init__(self, locks: KeyLocks, keys: Sequence[str]) -> None:
        self._locks = locks
        self._keys = keys

    async def __aenter__(self) -> None:
        await self._locks._acquire(self._keys)

    async def __aexit__(
        self, kind: type[BaseException] | None, err: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._locks._release(self._keys)
