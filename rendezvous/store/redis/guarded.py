"""The base of the Redis stores' side tables (credit reservations, the KV index): writes run one of the store's
Lua scripts under its epoch guard and are retried, up to a bound, while a refusal shows the epoch changed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from rendezvous.store.base import StoreUnavailableError
from rendezvous.store.redis.epoch import Epoch
from rendezvous.store.redis.scripts import Scripts

_ATTEMPTS = 5


class GuardedScripts:
    """One Redis namespace's scripts, epoch and command pipeline, as its side tables use them."""

    def __init__(self, prefix: str, scripts: Scripts, epoch: Epoch, command: Callable[..., Awaitable[Any]]) -> None:
        self._prefix = prefix
        self._scripts = scripts
        self._epoch = epoch
        self._command = command

    async def _write(self, name: str, **args: Any) -> Any:
        """Run script `name` under the epoch guard; a reply refused for the epoch ("E", "R") is retried."""
        for _ in range(_ATTEMPTS):
            reply = await self._scripts.run(name, guard=self._epoch.guard, **args)
            if reply[0] in (b"E", b"R"):
                await self._epoch.refused(reply)
                continue
            return reply
        raise StoreUnavailableError(f"{name}: the store's epoch keeps changing")
