"""Builders for core tests: engines, a controllable clock and a synchronous driver for the coordinator."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

from rendezvous.core import Engine, KvLayout, KvRegion, NixlAgent, Role
from rendezvous.protocol.requests import EngineSpec
from rendezvous.store.base import Store

T = TypeVar("T")

LAYOUT = KvLayout(model_fingerprint="tiny-llama", dtype="float32", block_size=16, num_layers=2)


def agent(name: str, num_blocks: int = 64, block_bytes: int = 4096) -> NixlAgent:
    """One rank with two regions (K and V) of num_blocks blocks."""
    regions = tuple(KvRegion(base, block_bytes, block_bytes, num_blocks) for base in (1 << 20, 1 << 30))
    return NixlAgent(name=name, metadata=b"md-" + name.encode(), regions=regions)


def engine_spec(engine_id: str, role: Role, layout: KvLayout = LAYOUT, num_blocks: int = 64, **kw: Any) -> EngineSpec:
    """A registration with one agent."""
    pool = kw.pop("pool", "decode" if role == Role.CONSUMER else "prefill")
    return EngineSpec(engine_id, pool, role, layout, (agent(f"{engine_id}-rank0", num_blocks),), **kw)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Drive a coroutine that never waits (the memory store never does) to completion.

    A bare yield (`asyncio.sleep(0)`: the pacing of long batches, taken when a step ran past its quantum, as it
    may on a loaded machine) is resumed at once; waiting on anything else is a test error."""
    while True:
        try:
            awaited = coro.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        if awaited is not None:
            coro.close()
            raise AssertionError("coroutine suspended; only non-blocking store calls may be driven synchronously")


async def every_engine(store: Store) -> list[Engine]:
    """Every engine record of a store, live or ended, by id."""
    return await store.page_engines("", 1 << 30, lambda _e: True)
