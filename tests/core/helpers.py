"""Helpers of the core tests: the test engine (tests/factories.py), a controllable clock and a synchronous driver
for the coordinator."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

from rendezvous.core import Engine
from rendezvous.store.base import Store
from tests.factories import CORE_LAYOUT as LAYOUT
from tests.factories import core_agent as agent
from tests.factories import core_engine as engine_spec

__all__ = [
    "LAYOUT",
    "START",
    "agent",
    "engine_spec",
    "every_engine",
    "run",
]  # the core suites' names for tests/factories.py's builders

T = TypeVar("T")


START = 1_000_000.0
"""Where the core tests' fake clocks (rendezvous.clients.testing.FakeClock) start: a fixed time, the same for clocks
that are compared side by side (the core's rules only ever look at differences)."""


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Drive a coroutine that never waits (the memory store never does) to completion. A bare yield to the event
    loop (`asyncio.sleep(0)`: the coordinator's Pacer gives the loop back after 2 ms of work, which a loaded
    machine reaches in any batch) is resumed at once; a wait on a future fails."""
    try:
        while coro.send(None) is None:
            pass
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise AssertionError("coroutine suspended; only non-blocking store calls may be driven synchronously")


async def every_engine(store: Store) -> list[Engine]:
    """Every engine record of a store, live or ended, by id."""
    return await store.page_engines("", 1 << 30, lambda _e: True)
