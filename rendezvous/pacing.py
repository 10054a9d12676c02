"""Long work shares the event loop: a request's items are converted, applied and answered in slices.

Every call of a server runs on one event loop, and with the memory store an item never waits on I/O: a
batch of thousands of items would hold the loop for its whole run, delaying every other caller. `Pacer`
gives the loop back (`asyncio.sleep(0)`) once `QUANTUM` seconds of work have passed since it last did,
checked between items, so no request holds the loop longer than the quantum plus one item's work (an
item's size is capped: `max_blocks_per_target` block ids, `max_parts_per_completion` parts). Other calls
then interleave with a long batch; the batch's own items still apply in order (docs/security.md, "Threat
model: bounded work").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from rendezvous.core import paging

T = TypeVar("T")
R = TypeVar("R")

QUANTUM = 0.002
"""Seconds of work between two yields to the event loop."""


class Pacer:
    """Yields to the event loop when `QUANTUM` seconds have passed since it was made or last yielded."""

    __slots__ = ("_due", "_quantum")

    def __init__(self) -> None:
        self._quantum = QUANTUM
        self._due = time.perf_counter() + self._quantum

    async def tick(self) -> None:
        """One unit of work is done: yield if the quantum is spent."""
        if time.perf_counter() >= self._due:
            await asyncio.sleep(0)
            self._due = time.perf_counter() + self._quantum


async def paced_map(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """[fn(item) for item in items], yielding to the event loop between items as `Pacer` does."""
    pacer = Pacer()
    results: list[R] = []
    for item in items:
        results.append(fn(item))
        await pacer.tick()
    return results


async def paced_cut(items: Sequence[T], size: int, weigh: Callable[[T], int], budget: int) -> list[T]:
    """`paging.cut(items, size, weigh, budget)`, the items weighed in turns (weighing may build an item's whole
    response message: an engine at every limit takes 20 ms). Weighs what cut would: up to the first item that
    no longer fits."""
    weights: list[int] = []
    total = 0
    pacer = Pacer()
    for item in items[:size]:
        weight = weigh(item)
        weights.append(weight)
        await pacer.tick()
        if len(weights) > 1 and total + weight > budget:
            break  # this item starts the next page (the first one is on this page, however heavy)
        total += weight
    weighed = iter(weights)  # cut weighs each item once, in order
    return paging.cut(items[: len(weights)], size, lambda _item: next(weighed), budget)
