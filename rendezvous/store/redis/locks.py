"""Per-key queues for this process's updates, so they wait here instead of conflicting in Redis."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable


class KeyLocks:
    """Queues this process's updates of one key, so they wait here instead of conflicting in Redis.

    Conflicts then only come from other replicas; the lock of a key lives while someone holds or awaits it.
    """

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    def hold(self, key: str) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold one key's lock."""
        return self.hold_all((key,))

    @contextlib.asynccontextmanager
    async def hold_all(self, keys: Iterable[str]) -> AsyncIterator[None]:
        """Hold the locks of several keys (a batch's), taken in key order so that holders of overlapping
        sets cannot wait on each other in a circle."""
        entries = []
        for key in sorted(set(keys)):
            entry = self._locks.get(key)
            if entry is None:
                entry = self._locks[key] = (asyncio.Lock(), [0])
            entry[1][0] += 1
            entries.append((key, entry))
        taken = 0
        try:
            for _, (lock, _users) in entries:
                await lock.acquire()
                taken += 1
            yield
        finally:
            for n, (key, (lock, users)) in enumerate(entries):
                if n < taken:
                    lock.release()
                users[0] -= 1
                if not users[0]:
                    del self._locks[key]
