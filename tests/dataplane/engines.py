"""A multi-rank engine in one spawned process: every rank its own `ProducerAgent`/`ConsumerAgent` (its own NIXL
agent and thread) and its own `AsyncRendezvousClient`; rank 0 registers the engine with every rank's agent, the
other ranks follow that registration (`start(follow=...)`), as separate rank processes would.

The KV of a transfer is a model: `kv(seed, ...)[layer, kind, head, token, unit]`, K and V regions per layer.
A producer rank fills its source blocks with its heads and layers of it; `expected` says, from first principles
(destination slot -> prompt token -> model head), what every byte of a consumer rank holds afterwards.
Destination memory starts as `SENTINEL`, so a stray write shows.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from tests.dataplane.worker import SENTINEL, Spec, WorkerProcess

KINDS = 2
"""Regions per layer: K and V."""
UNIT = 4
"""Bytes of one token of one head."""


@dataclass(frozen=True)
class EngineSpec(Spec):
    """An engine of `tp * pp` ranks hosted in one process (role, server address and engine id as `Spec`)."""

    tp: int = 1
    pp: int = 1
    block_size: int = 16
    heads: int = 4
    layers: int = 2
    kv_layout: str = "HND"
    follower_check_s: float = 5.0
    """How often a following consumer rank asks the service about a transfer it has heard nothing of."""
    integrity: bool = False
    """End-to-end integrity: producer ranks send digests of what they wrote, consumer ranks require them."""

    def worker(self, events: Any) -> Any:
        return _EngineWorker(self, events)

    @property
    def ranks(self) -> int:
        return self.tp * self.pp

    def layout(self) -> Any:
        from rendezvous.clients import KvLayout

        return KvLayout("tiny", "u8", self.block_size, self.layers, self.tp, self.pp, self.kv_layout, self.heads)

    def rank_heads(self, rank: int) -> range:
        per_rank = self.heads // self.tp
        return range(rank % self.tp * per_rank, (rank % self.tp + 1) * per_rank)

    def rank_layers(self, rank: int) -> range:
        per_stage = self.layers // self.pp
        return range(rank // self.tp * per_stage, (rank // self.tp + 1) * per_stage)

    def block_length(self) -> int:
        return self.heads // self.tp * self.block_size * UNIT

    def to_blocks(self, canonical: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
        """[blocks, heads, tokens, unit] as the rows of a region ([blocks, bytes]) in this engine's layout."""
        if self.kv_layout == "NHD":
            canonical = canonical.transpose(0, 2, 1, 3)
        return np.ascontiguousarray(canonical).reshape(len(canonical), -1)


def kv(seed: int, layers: int, heads: int, tokens: int) -> npt.NDArray[np.uint8]:
    """The model's KV of one transfer: [layer, kind, head, token, unit]."""
    return np.random.default_rng(seed).integers(0, 256, (layers, KINDS, heads, tokens, UNIT), dtype=np.uint8)


def expected(
    producer: EngineSpec, consumer: EngineSpec, seed: int, num_src: int, dst: list[int], prompt: int, target: int
) -> list[list[npt.NDArray[np.uint8]]]:
    """Every consumer rank's regions after the transfer: destination block j, slot t holds prompt token
    `prompt - target + j * Bd + t` of its heads (sentinel past the prompt's end and outside `dst`)."""
    model = kv(seed, producer.layers, producer.heads, num_src * producer.block_size)
    start, bd = prompt - target, consumer.block_size
    out = []
    for rank in range(consumer.ranks):
        heads = consumer.rank_heads(rank)
        regions = []
        for layer in consumer.rank_layers(rank):
            for kind in range(KINDS):
                region = np.full((consumer.num_blocks, len(heads), bd, UNIT), SENTINEL, dtype=np.uint8)
                for j, block in enumerate(dst):
                    for t in range(bd):
                        if start + j * bd + t < prompt:
                            region[block, :, t] = model[layer, kind, heads.start : heads.stop, start + j * bd + t]
                regions.append(consumer.to_blocks(region))
        out.append(regions)
    return out


class _EngineWorker:
    def __init__(self, spec: EngineSpec, events: Any) -> None:
        import torch

        self.spec = spec
        self.events = events
        self.tensors = [
            [
                torch.full((spec.num_blocks, spec.block_length()), SENTINEL, dtype=torch.uint8)
                for _ in range(len(spec.rank_layers(rank)) * KINDS)
            ]
            for rank in range(spec.ranks)
        ]
        self.clients: list[Any] = []
        self.agents: list[Any] = []
        self.gates: list[asyncio.Event] = []
        self.heard: list[list[Any]] = []  # each rank's session events, once handled

    async def start(self) -> tuple[str, int, str]:
        from rendezvous.clients import AsyncRendezvousClient
        from rendezvous.clients.nixl.consumer import ConsumerAgent
        from rendezvous.clients.nixl.producer import ProducerAgent
        from rendezvous.clients.nixl.rank import start_ranks
        from rendezvous.clients.nixl.writer import WriterConfig

        s, put = self.spec, self.events.put
        for rank in range(s.ranks):
            client = AsyncRendezvousClient(s.address)
            self.clients.append(client)
            if s.role == "producer":

                def report(r: Any, rank: int = rank) -> None:
                    put(("report", rank, r.transfer_id, r.generation, r.ok, r.error, time.monotonic()))

                layers = s.rank_layers(rank) if s.pp > 1 else range(0)  # layers are stated with PP only
                agent: Any = ProducerAgent(
                    client, s.engine_id, "prefill", self.tensors[rank], rank=rank, layout=s.layout(),
                    lease_ttl=s.lease_ttl, on_report=report, first_layer=layers.start, num_layers=len(layers),
                    writer_config=WriterConfig(integrity=s.integrity),
                )  # fmt: skip
            else:

                def result(r: Any, rank: int = rank) -> None:
                    put(("result", rank, r.transfer_id, r.generation, r.ok, r.block_ids, r.reason, time.monotonic()))

                agent = ConsumerAgent(
                    client, s.engine_id, "decode", self.tensors[rank], rank=rank, layout=s.layout(),
                    lease_ttl=s.lease_ttl, on_result=result, follower_check_s=s.follower_check_s,
                    integrity=s.integrity,
                )  # fmt: skip
            gate, heard = asyncio.Event(), list[Any]()
            gate.set()
            agent.handle_event = _gated(agent.handle_event, gate, heard)  # before start: the session takes it then
            self.gates.append(gate)
            self.heard.append(heard)
            self.agents.append(agent)
        await start_ranks(self.agents)
        return s.engine_id, self.agents[0].session.incarnation, self.agents[0].agent_name

    def hold(self, rank: int) -> None:
        """Rank `rank` handles no more events until `release` (as a rank that lags behind its peers)."""
        self.gates[rank].clear()

    def release(self, rank: int) -> None:
        self.gates[rank].set()

    def events_of(self, rank: int, transfer_id: str) -> list[str]:
        """The types of the events of `transfer_id` that rank `rank` handled so far, in order."""
        of = [e for e in self.heard[rank] if getattr(getattr(e, "transfer", None), "transfer_id", "") == transfer_id]
        return [e.type.name for e in of]

    # Producer commands

    def fill(self, seed: int, src: list[int]) -> None:
        """Source blocks `src` hold the model's KV of transfer `seed`, each rank its heads and layers."""
        import torch

        s = self.spec
        model = kv(seed, s.layers, s.heads, len(src) * s.block_size)
        for rank, tensors in enumerate(self.tensors):
            heads = s.rank_heads(rank)
            for i, layer in enumerate(s.rank_layers(rank)):
                for kind in range(KINDS):
                    blocks = model[layer, kind, heads.start : heads.stop].reshape(
                        len(heads), len(src), s.block_size, UNIT
                    )
                    rows = s.to_blocks(blocks.transpose(1, 0, 2, 3))
                    tensors[i * KINDS + kind][src] = torch.from_numpy(rows)

    async def claim(self, transfer_id: str) -> str:
        return _outcome(await self.agents[0].claim(transfer_id))

    def ready(self, transfer_id: str, src: list[int], prompt_tokens: int, ranks: list[int] | None = None) -> None:
        """Every rank (or those of `ranks`) says its KV of the transfer is computed in `src`."""
        put = self.events.put
        for rank in range(self.spec.ranks) if ranks is None else ranks:

            def free(t: str, rank: int = rank) -> None:
                put(("free", rank, t, time.monotonic()))

            self.agents[rank].ready(transfer_id, src, free, prompt_tokens=prompt_tokens)

    # Consumer commands

    async def register(self, transfer_id: str, dst: list[int], num_tokens: int = 0, followers: bool = True) -> str:
        """The other ranks expect their shares first (their notifications may come as soon as rank 0 registers),
        unless not `followers` (then `follow` has them expect it later), then rank 0 registers the target with
        the service."""
        if followers:
            await self.follow(transfer_id, dst, num_tokens)
        return _outcome(await self.agents[0].register_target(transfer_id, dst, num_tokens=num_tokens))

    async def follow(self, transfer_id: str, dst: list[int], num_tokens: int = 0) -> None:
        """The other ranks expect their shares of `transfer_id`."""
        for agent in self.agents[1:]:
            await agent.register_target(transfer_id, dst, num_tokens=num_tokens)

    def memory(self) -> list[list[npt.NDArray[np.uint8]]]:
        return [[t.numpy().copy() for t in tensors] for tensors in self.tensors]

    async def close(self) -> None:
        for agent in reversed(self.agents):
            await agent.close()
        await asyncio.gather(*(client.close() for client in self.clients))


def _gated(
    handle: Callable[[Any], Awaitable[None]], gate: asyncio.Event, heard: list[Any]
) -> Callable[[Any], Awaitable[None]]:
    async def handle_when_open(item: Any) -> None:
        await gate.wait()
        await handle(item)
        heard.append(item)

    return handle_when_open


def _outcome(result: Any) -> str:
    return str(result.state.name if result.ok else result.error.reason)


class EngineProcess(WorkerProcess):
    """An engine of several ranks in a spawned process; reports carry the rank."""

    spec: EngineSpec

    def __init__(self, spec: EngineSpec, start_timeout: float = 60.0) -> None:
        super().__init__(spec, start_timeout)

    def each_rank(self, kind: str, transfer_id: str, timeout: float) -> list[tuple[Any, ...]]:
        """Every rank's report of `kind` ("result", "free", "report") for `transfer_id`, in rank order."""
        return [self.expect(_report_of(kind, rank, transfer_id), timeout) for rank in range(self.spec.ranks)]

    def all_results(self, transfer_id: str, timeout: float = 15.0) -> list[tuple[Any, ...]]:
        """Every consumer rank's result for `transfer_id`, in rank order: (rank, ok, block_ids, reason, time)."""
        return [(e[1], e[4], e[5], e[6], e[7]) for e in self.each_rank("result", transfer_id, timeout)]

    def all_freed(self, transfer_id: str, timeout: float = 15.0) -> list[float]:
        """When each producer rank freed its source of `transfer_id`, in rank order."""
        return [e[3] for e in self.each_rank("free", transfer_id, timeout)]

    def all_reports(self, transfer_id: str, timeout: float = 15.0) -> list[tuple[Any, ...]]:
        """Each producer rank's write report: (rank, ok, error, time), in rank order."""
        return [(e[1], e[4], e[5], e[6]) for e in self.each_rank("report", transfer_id, timeout)]


def _report_of(kind: str, rank: int, transfer_id: str) -> Callable[[tuple[Any, ...]], bool]:
    return lambda e: e[:3] == (kind, rank, transfer_id)
