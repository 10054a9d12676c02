"""`Batcher`: items submitted in one loop turn go out as one call, in chunks, with per-item results."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from rendezvous.clients import CompletionSpec, ItemResult, SourceReadySpec, TransferState, Unavailable, WrittenPart
from rendezvous.clients.nixl.batching import Batcher
from rendezvous.v1 import rendezvous_pb2 as pb


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
        raise Unavailable("", "down")

    batcher = Batcher("test", send)
    future = batcher.submit("t")
    batcher.submit_logged("u")  # logged, not raised
    with pytest.raises(Unavailable):
        await future
    await batcher.close()


async def test_calls_stay_far_under_the_servers_request_limits() -> None:
    completion_calls: list[list[CompletionSpec]] = []
    source_calls: list[list[SourceReadySpec]] = []

    async def complete(items: Sequence[CompletionSpec]) -> list[ItemResult]:
        completion_calls.append(list(items))
        return [ItemResult(c.transfer_id, TransferState.COMMITTED) for c in items]

    async def ready(items: Sequence[SourceReadySpec]) -> list[ItemResult]:
        source_calls.append(list(items))
        return [ItemResult(s.transfer_id, TransferState.MATCHED) for s in items]

    parts = tuple(WrittenPart(first_token=i, num_tokens=1) for i in range(1_000))
    completions = Batcher("CompleteTransfers", complete)
    await asyncio.gather(*(completions.submit(CompletionSpec(f"t{i}", 1, parts=parts)) for i in range(40)))
    # 40 x 1,000 parts in one turn: 16,384 parts a call at most, a quarter of the server's 65,536.
    assert [len(c) for c in completion_calls] == [16, 16, 8]
    sources = Batcher("MarkSourcesReady", ready)
    blocks = range(1 << 40, (1 << 40) + 20_000)  # 6-byte varints: 117 KiB a source, 29 MiB in all
    await asyncio.gather(*(sources.submit(SourceReadySpec(f"t{i}", blocks)) for i in range(256)))
    requests = [
        pb.MarkSourcesReadyRequest(
            sources=[pb.SourceReadySpec(transfer_id=s.transfer_id, block_ids=s.block_ids) for s in c]
        )
        for c in source_calls
    ]
    assert sum(len(c) for c in source_calls) == 256
    assert len(requests) > 1 and all(r.ByteSize() <= 1 << 20 for r in requests)  # the server takes 4 MiB
    await completions.close()
    await sources.close()
