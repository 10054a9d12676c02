"""`Batcher`: items submitted in one loop turn go out as one call, in chunks, with per-item results."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from clients import ItemResult, TransferState, Unavailable
from clients.nixl.batching import Batcher


async def test_one_call_per_turn_in_chunks() -> None:
    calls: list[list[str]] = []

    async def send(items: Sequence[str]) -> list[ItemResult]:
        calls.append(list(items))
        return [ItemResult(i, TransferState.CLAIMED) for i in items]

    batcher = Batcher("test", send, max_items=3)
    futures = [batcher.submit(f"t{i}") for i in range(7)]
    results = await asyncio.gather(*futures)
    assert [r.transfer_id for r in results] == [f"t{i}" for i in range(7)]
    assert calls == [["t0", "t1", "t2"], ["t3", "t4", "t5"], ["t6"]]
    assert (await batcher.submit("later")).transfer_id == "later"
    assert len(calls) == 4
    await batcher.close()


async def test_a_failed_call_fails_its_items() -> None:
    async def send(items: Sequence[str]) -> list[ItemResult]:
        raise Unavailable("down")

    batcher = Batcher("test", send)
    future = batcher.submit("t")
    batcher.submit_logged("u")  # logged, not raised
    with pytest.raises(Unavailable):
        await future
    await batcher.close()
