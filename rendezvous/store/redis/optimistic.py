"""The optimistic update both record kinds go through: compute on the record as last seen, commit if its
versions still hold, else compute again on what the commit script answered.

A computation that fails, or changes nothing, on a record not read in this call is computed again on a
fresh read before its answer counts (the cache may be stale). A refused write (another epoch, or Redis
went back in time) reads afresh once the epoch is settled. A conflict answers the current record, so the
next attempt needs no read; after a few in a row, attempts back off with jitter.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rendezvous.store.redis.epoch import Epoch

SnapshotT = TypeVar("SnapshotT")
ResultT = TypeVar("ResultT")

Reply = Sequence[Any]
"""A commit script's answer: OK + revision, N (nothing to write), E/R (refused by the guard), or a conflict."""


@dataclass(frozen=True, slots=True)
class Attempt(Generic[ResultT]):
    """One computed update: its answer, whether it changes nothing, how to commit it, what to remember once done."""

    result: ResultT
    unchanged: bool
    commit: Callable[[], Awaitable[Reply]]
    written: Callable[[Reply], None]


async def _after_conflict(attempt: int) -> None:
    """Back off a little (with jitter) once a record keeps changing under us; the first retries are immediate."""
    if attempt >= 2:
        await asyncio.sleep(random.uniform(0, min(0.05, 0.0005 * 2**attempt)))


async def update(
    epoch: Epoch,
    snapshot: SnapshotT,
    fresh: bool,
    read: Callable[[], Awaitable[SnapshotT]],
    compute: Callable[[SnapshotT], Attempt[ResultT] | None],
    conflicted: Callable[[Reply], SnapshotT],
) -> ResultT:
    """Apply compute to snapshot (fresh: read in this call) until its commit holds; compute answers None
    when the snapshot is not enough to compute on (read it again)."""
    for n in itertools.count():
        try:
            attempt = compute(snapshot)
        except Exception:
            if fresh:
                raise
            snapshot, fresh = await read(), True
            continue
        if attempt is None:
            snapshot, fresh = await read(), True
            continue
        if attempt.unchanged and fresh:
            return attempt.result
        reply = await attempt.commit()
        status = reply[0]
        if status == b"OK":
            epoch.saw(reply[1])
            attempt.written(reply)
            return attempt.result
        if status == b"N":
            return attempt.result
        if status in (b"E", b"R"):
            await epoch.refused(reply)
            snapshot, fresh = await read(), True
            continue
        snapshot, fresh = conflicted(reply), True
        await _after_conflict(n)
    raise AssertionError("unreachable")
