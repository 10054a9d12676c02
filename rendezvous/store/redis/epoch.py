"""The epoch: the store's lifetime as this process knows it, and the guard every write carries.

The epoch lives in Redis (SET NX once). If Redis loses its data, the epoch key is gone: the next
write or health check makes a new one and clients see the epoch change. If Redis goes back in time
with its epoch (a restart from an older AOF or RDB, a failover to a lagging replica), a replica
that saw a later revision notices (every write carries it) and starts a new epoch too.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis.asyncio as aioredis

from rendezvous.store.redis.scripts import Scripts

log = logging.getLogger(__name__)


class Epoch:
    """The epoch this process works in and the highest revision it has seen in it."""

    def __init__(
        self,
        epoch_key: str,
        rev_key: str,
        scripts: Scripts,
        forget: Callable[[], None],
        reconnect: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.value = 0
        self.high_rev = 0
        self._epoch_key = epoch_key
        self._rev_key = rev_key
        self._scripts = scripts
        self._forget = forget
        """Drops what was seen under another epoch (versions restart with the data, so it means nothing)."""
        self._reconnect = reconnect
        """Closes idle connections (Sentinel), so the next command goes where the Sentinels say the master is."""

    @property
    def guard(self) -> str:
        """What a write expects of Redis: this epoch, and no revision below one already seen."""
        return f"{self.value}:{self.high_rev}"

    def saw(self, rev: int) -> None:
        """A reply showed revision rev."""
        self.high_rev = max(self.high_rev, rev)

    async def check(self, client: aioredis.Redis) -> None:
        """Read the epoch, or make one if Redis has none (first start, or its data was lost)."""
        # Only a revision seen before the read, in the epoch read, can prove a regression: a write completing
        # meanwhile may show a newer one than the read returns, or may have found the data gone and adopted a new
        # epoch, whose revisions start again from 0.
        seen_epoch, seen = self.value, self.high_rev
        stored_epoch, stored_rev = await client.mget(self._epoch_key, self._rev_key)
        if stored_epoch is None:
            await client.set(self._epoch_key, secrets.randbits(63) or 1, nx=True)
            stored_epoch, stored_rev = await client.mget(self._epoch_key, self._rev_key)
            assert stored_epoch is not None
        epoch, rev = int(stored_epoch), int(stored_rev or 0)
        if epoch != self.value:
            self._adopt(epoch, rev)
        elif epoch == seen_epoch and rev < seen:
            await self._regressed(rev, epoch)
        else:
            self.saw(rev)

    async def refused(self, reply: Sequence[Any]) -> None:
        """Act on a write's E reply (another epoch, or none) or R reply (Redis went back in time)."""
        if reply[0] != b"E":
            await self._regressed(int(reply[1]), int(reply[2]))
        elif reply[1]:
            self._adopt(int(reply[1]), 0)  # another replica moved on
        else:
            await self.check(self._scripts.client)  # the data is gone

    def _adopt(self, epoch: int, rev: int) -> None:
        if epoch == self.value:
            self.saw(rev)  # another call adopted it first and may have seen later revisions since
            return
        self.value = epoch
        self._forget()
        self.high_rev = rev

    async def _regressed(self, rev: int, epoch: int) -> None:
        """Redis lost writes this process saw (it restarted from an older AOF or RDB, or failed over to a
        lagging replica) but kept its epoch. Engines may have acted on what was lost and the logs would
        reuse revisions, so start a new epoch: clients re-register and re-assert what they still want."""
        if epoch != self.value:
            return  # handled already
        if self._reconnect is not None:
            # The answer may come from a node that is no longer (or not yet again) the master: an old master that
            # resumed after a failover and still takes commands until Sentinel demotes it. Ask the master.
            await self._reconnect()
            stored_epoch, stored_rev = await self._scripts.client.mget(self._epoch_key, self._rev_key)
            if stored_epoch is not None and int(stored_epoch) == self.value and int(stored_rev or 0) >= self.high_rev:
                log.warning(
                    "a Redis node behind this replica answered (revision %d, the master has %d): not a new epoch",
                    rev,
                    int(stored_rev or 0),
                )
                return
        log.warning(
            "Redis went back in time (revision %d, this replica saw %d): starting a new epoch", rev, self.high_rev
        )
        current = await self._scripts.run("replace_epoch", lost_epoch=epoch, new_epoch=secrets.randbits(63) or 1)
        if current is None:
            await self.check(self._scripts.client)  # the data is gone meanwhile
        else:
            self._adopt(int(current), rev)
