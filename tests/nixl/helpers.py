"""Parent-side helpers: source/destination tensors in a given layout, byte checks, callback recorder, futures
resolved when a producer agent is assigned a transfer and when an agent took a `Reregistered`."""

from __future__ import annotations

import asyncio
import queue
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from rendezvous.clients import EventType, Reregistered, SessionEvent
from rendezvous.clients.nixl.parts import WrittenPart
from rendezvous.clients.nixl.producer import ProducerAgent
from rendezvous.clients.nixl.rank import RankAgent
from rendezvous.clients.nixl.regions import BlockIds
from tests.nixl.peer import SENTINEL, Layout


def unique(prefix: str) -> str:
    """A NIXL agent name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def region_views(layout: Layout, *, seed: int | None = None) -> list[torch.Tensor]:
    """One [num_blocks, length] uint8 view per region, laid out like `layout`: random bytes when `seed`
    is given, else the sentinel."""
    lengths, nb = layout.block_lengths, layout.num_blocks
    generator = None if seed is None else torch.Generator().manual_seed(seed)

    def buffer(*shape: int) -> torch.Tensor:
        if generator is None:
            return torch.full(shape, SENTINEL, dtype=torch.uint8)
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)

    if layout.interleaved:
        rows = buffer(nb, sum(lengths))
        offsets = np.cumsum((0, *lengths))
        return [rows[:, offsets[i] : offsets[i + 1]] for i in range(len(lengths))]
    return [buffer(nb, n + layout.pad)[:, :n] for n in lengths]


def assert_moved(
    dest: list[npt.NDArray[np.uint8]],
    src: list[npt.NDArray[np.uint8]],
    src_ids: BlockIds,
    dst_ids: BlockIds,
) -> None:
    """Each region of `dest` ([num_blocks, stride] bytes) holds `src[r][src_ids[i]]` in block `dst_ids[i]`
    and the sentinel everywhere else, padding included."""
    assert len(dest) == len(src)
    for r, (d, s) in enumerate(zip(dest, src, strict=True)):
        expected = np.full_like(d, SENTINEL)
        expected[np.asarray(dst_ids, dtype=np.int64), : s.shape[1]] = s[np.asarray(src_ids, dtype=np.int64)]
        np.testing.assert_array_equal(d, expected, err_msg=f"region {r}")


def as_numpy(views: list[torch.Tensor]) -> list[npt.NDArray[np.uint8]]:
    return [v.numpy() for v in views]


@dataclass(frozen=True)
class Event:
    kind: str  # "complete", "revoked" or "source_free"
    args: tuple[Any, ...]


class Recorder:
    """TransferWriter callbacks that queue what they are told, for the test thread to await."""

    def __init__(self) -> None:
        self.events: queue.Queue[Event] = queue.Queue()

    def on_complete(self, transfer_id: str, generation: int, ok: bool, error: str | None) -> None:
        self.events.put(Event("complete", (transfer_id, generation, ok, error)))

    def on_complete_parts(
        self, transfer_id: str, generation: int, ok: bool, error: str | None, parts: tuple[WrittenPart, ...]
    ) -> None:
        self.events.put(Event("complete", (transfer_id, generation, ok, error, parts)))

    def on_revoked(self, transfer_id: str, generation: int) -> None:
        self.events.put(Event("revoked", (transfer_id, generation)))

    def on_source_free(self, transfer_id: str) -> None:
        self.events.put(Event("source_free", (transfer_id,)))

    def next(self, timeout: float = 5.0) -> Event:
        return self.events.get(timeout=timeout)

    def pending(self) -> list[Event]:
        """Events already recorded, without waiting."""
        out = []
        while not self.events.empty():
            out.append(self.events.get_nowait())
        return out


def on_assignment(agent: ProducerAgent) -> asyncio.Future[None]:
    """Done once `agent` handled a TRANSFER_ASSIGNED."""
    assigned: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    handle = agent.handle_event

    async def handle_event(item: Any) -> None:
        await handle(item)
        if getattr(item, "type", None) is EventType.TRANSFER_ASSIGNED and not assigned.done():
            assigned.set_result(None)

    agent.handle_event = handle_event  # type: ignore[method-assign]
    return assigned


def on_reregistered(agent: RankAgent[Any]) -> asyncio.Future[Reregistered]:
    """Resolved once the agent's handler took a `Reregistered` (the session opens the fence right after)."""
    taken: asyncio.Future[Reregistered] = asyncio.get_running_loop().create_future()
    handle = agent.handle_event

    async def handle_event(item: SessionEvent) -> None:
        await handle(item)
        if isinstance(item, Reregistered) and not taken.done():
            taken.set_result(item)

    agent.handle_event = handle_event  # type: ignore[method-assign]
    return taken
