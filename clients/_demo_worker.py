"""One engine of `kv-rendezvous demo`, in its own process: a producer or consumer agent over a DRAM KV pool.

Commands arrive on a queue: ("transfer", transfer_id, num_blocks, seed, mode) or ("stop",), mode "push", "pull"
or "progressive". A producer fills blocks with `pattern(seed)`, claims and marks them ready (progressive: hands
them over as one part first, as chunked prefill would, then ready); a consumer registers destination blocks
(progressive: a target that accepts parts, one token per block) and checks every byte that lands. Both post
reports to the controller's queue and queue work until blocks free up.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import queue
import time
from collections.abc import Coroutine
from typing import Any

import numpy as np
import numpy.typing as npt

from rendezvous.clients import KvLayout


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What one demo engine hosts."""

    role: str  # "producer" or "consumer"
    engine_id: str
    address: str
    num_blocks: int
    block_lengths: tuple[int, ...]


_NOISE_BYTES = 16 << 20
MAX_TRANSFER_REGION_BYTES = _NOISE_BYTES // 2
"""The most bytes a demo transfer holds per region (`pattern`'s window of the shared noise)."""
LAYOUT = KvLayout(model_fingerprint="kv-rendezvous-demo", dtype="uint8", block_size=1, num_layers=1)
"""Every demo engine's: its blocks are opaque bytes, the same on both sides."""


@functools.cache
def _noise() -> npt.NDArray[np.uint8]:
    """Random bytes both sides generate identically, once (the same seed in every process)."""
    return np.random.default_rng(20240601).integers(0, 256, _NOISE_BYTES, dtype=np.uint8)


def pattern(seed: int, region: int, count: int, length: int) -> npt.NDArray[np.uint8]:
    """The bytes of a transfer's `count` blocks in `region`, derived from its seed: a window of shared noise
    that starts at a seed-dependent odd offset (so blocks and transfers differ), cheap enough to fill and
    check gigabytes per second."""
    size = count * length
    if size > MAX_TRANSFER_REGION_BYTES:
        raise ValueError("a demo transfer is limited to 8 MiB per region")
    start = (seed * 2654435761 + region * 40503) % (_NOISE_BYTES - size) | 1
    return _noise()[start : start + size].reshape(count, length)


class _Engine:
    def __init__(self, spec: WorkerSpec, reports: Any) -> None:
        import torch

        from rendezvous.clients import AsyncRendezvousClient

        self.spec = spec
        self.reports = reports
        self.tensors = [torch.zeros((spec.num_blocks, n), dtype=torch.uint8) for n in spec.block_lengths]
        self.client = AsyncRendezvousClient(spec.address)
        self.free = list(range(spec.num_blocks))
        self.waiting: collections.deque[tuple[str, int, int, str]] = collections.deque()
        self.held: dict[str, tuple[list[int], int, float]] = {}
        self.handed: dict[str, float] = {}  # producer: transfer id -> when its blocks first went to the agent
        self.agent: Any = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        from rendezvous.clients.nixl.consumer import ConsumerAgent
        from rendezvous.clients.nixl.producer import ProducerAgent

        s = self.spec
        if s.role == "producer":
            self.agent = ProducerAgent(
                self.client, s.engine_id, "prefill", self.tensors, layout=LAYOUT, serve_reads=True,
                on_report=self._on_report,
            )  # fmt: skip
        else:
            self.agent = ConsumerAgent(
                self.client, s.engine_id, "decode", self.tensors, layout=LAYOUT, on_result=self._on_result
            )
        await self.agent.start()
        _noise()  # generate it before the clock starts

    def submit(self, transfer_id: str, num_blocks: int, seed: int, mode: str) -> None:
        self.waiting.append((transfer_id, num_blocks, seed, mode))
        self._admit()

    def _admit(self) -> None:
        while self.waiting and len(self.free) >= self.waiting[0][1]:
            transfer_id, n, seed, mode = self.waiting.popleft()
            blocks, self.free = self.free[:n], self.free[n:]
            self.held[transfer_id] = (blocks, seed, time.monotonic())
            if self.spec.role == "producer":
                work = self._produce(transfer_id, blocks, seed, mode)
            else:
                work = self._consume(transfer_id, blocks, mode)
            self._spawn(work)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _release(self, transfer_id: str) -> tuple[list[int], int, float]:
        held = self.held.pop(transfer_id)
        self.free.extend(held[0])
        self._admit()
        return held

    def _fill(self, blocks: list[int], seed: int) -> None:
        import torch

        for r, t in enumerate(self.tensors):
            t[blocks] = torch.from_numpy(pattern(seed, r, len(blocks), t.shape[1]))

    def _check(self, blocks: list[int], seed: int) -> tuple[int, str]:
        verified = 0
        for r, t in enumerate(self.tensors):
            expected = pattern(seed, r, len(blocks), t.shape[1])
            if not np.array_equal(t[blocks].numpy(), expected):
                return 0, f"region {r}: bytes differ"
            verified += expected.nbytes
        return verified, ""

    async def _produce(self, transfer_id: str, blocks: list[int], seed: int, mode: str) -> None:
        from rendezvous.clients import TransferMode

        await asyncio.to_thread(self._fill, blocks, seed)  # off the loop, which serves the agent
        if mode != "pull":
            await self.agent.claim(transfer_id)
        # Before any WRITE of it can be posted (progressive: its part goes before `ready`, which stamps ready_time).
        self.handed[transfer_id] = time.monotonic()
        if mode == "progressive":
            self.agent.ready_part(transfer_id, blocks, len(blocks), prompt_tokens=len(blocks))
        transfer_mode = TransferMode.PULL if mode == "pull" else TransferMode.PUSH
        self.agent.ready(transfer_id, blocks, self._on_free, mode=transfer_mode)

    async def _consume(self, transfer_id: str, blocks: list[int], mode: str) -> None:
        from rendezvous.clients import TransferMode

        transfer_mode = TransferMode.PULL if mode == "pull" else TransferMode.PUSH
        progressive = mode == "progressive"
        result = await self.agent.register_target(
            transfer_id,
            blocks,
            mode=transfer_mode,
            num_tokens=len(blocks) if progressive else 0,
            progressive=progressive,
        )
        if not result.ok:
            self._release(transfer_id)
            self.reports.put(("done", transfer_id, False, 0, 0.0, str(result.error), 0.0))

    def _on_free(self, transfer_id: str) -> None:
        self.handed.pop(transfer_id, None)
        self._release(transfer_id)
        self.reports.put(("freed", transfer_id))

    def _on_report(self, r: Any) -> None:
        handed = self.handed.pop(r.transfer_id, r.ready_time)
        self.reports.put(("write", r.transfer_id, r.ok, handed, r.assigned_time, r.written_time, r.completed_time))

    def _on_result(self, result: Any) -> None:
        now = time.monotonic()
        self._spawn(self._verify(result, now - self.held[result.transfer_id][2], now))

    async def _verify(self, result: Any, elapsed: float, arrived: float) -> None:
        blocks, seed, _ = self.held[result.transfer_id]
        verified, error = 0, "" if result.ok else str(result.reason)
        if result.ok:
            verified, error = await asyncio.to_thread(self._check, blocks, seed)
        self._release(result.transfer_id)  # only now may the blocks be registered again
        ok = result.ok and not error
        self.reports.put(("done", result.transfer_id, ok, verified if ok else 0, elapsed, error, arrived))

    async def close(self) -> None:
        await self.agent.close()
        await self.client.close()


async def _serve(spec: WorkerSpec, commands: Any, reports: Any) -> None:
    engine = _Engine(spec, reports)
    await engine.start()
    reports.put(("started", spec.engine_id))
    loop = asyncio.get_running_loop()
    while True:
        try:
            command = await loop.run_in_executor(None, commands.get, True, 0.5)
        except queue.Empty:
            continue
        if command[0] == "stop":
            await engine.close()
            return
        engine.submit(*command[1:])


def serve(spec: WorkerSpec, commands: Any, reports: Any) -> None:
    """Process entry point: run one demo engine until told to stop."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_serve(spec, commands, reports))
