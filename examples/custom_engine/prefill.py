"""The prefill engine: claims each request at admission, computes its KV, hands the blocks to its agent.

The SDK's `ProducerAgent` does the protocol: it registers the KV cache with NIXL and the engine with the
service, batches claims, and runs a background writer thread that owns NIXL: once it holds both the service's
assignment (TRANSFER_ASSIGNED: decode's agent and block ids) and the engine's `ready`, it WRITEs the blocks,
sends the notification "4 T:g" and reports CompleteTransfers. `on_free` (on this event loop) gives the source
blocks back once written and that report answered (a round trip after the write: a report lost to a
re-registration leaves the source to be written again), or once the transfer ended otherwise (aborted, decode
lost).
"""

from __future__ import annotations

import asyncio

import torch

from rendezvous.clients import AsyncRendezvousClient, Binding, ClientConfig
from rendezvous.clients.nixl import ProducerAgent

from .decode import Reply
from .model import LAYOUT, blocks_needed, kv_cache, prompt_kv


class PrefillEngine:
    """Computes each request's KV into its pool; the agent pushes it to the decode engine the service named."""

    def __init__(
        self, address: str, engine_id: str, num_blocks: int, reply: Reply, lease_ttl: float, token: str | None = None
    ) -> None:
        self.cache = kv_cache(num_blocks)
        self.free = list(range(num_blocks))
        self.sources: dict[str, list[int]] = {}  # each request's blocks, until the agent frees them
        self.reply = reply
        self.client = AsyncRendezvousClient(ClientConfig([address], token=token))  # token: with --auth
        # lease_ttl: how soon the service gives up on this engine if it dies (and tells its peers PEER_LOST).
        self.agent = ProducerAgent(self.client, engine_id, "prefill", self.cache, layout=LAYOUT, lease_ttl=lease_ttl)

    async def start(self) -> None:
        await self.agent.start()

    async def close(self) -> None:
        await self.agent.close()
        await self.client.close()

    async def request(self, transfer_id: str, prompt: str, hold: bool, binding: Binding | None) -> None:
        """The router's prefill leg, with its binding (None: the router does not sign). `hold`: compute, then wait
        for `finish` (a long prefill, for the example)."""
        # Early: the service matches it with decode's target meanwhile.
        claim = await self.agent.claim(transfer_id, binding=binding)
        if not claim.ok:
            assert claim.error is not None
            self.reply(("claimed", transfer_id, claim.error.reason))
            return
        n = blocks_needed(prompt)
        assert n <= len(self.free), "the router keeps what is in flight within the pools"
        blocks, self.free = self.free[:n], self.free[n:]
        await asyncio.to_thread(self.compute, prompt, blocks)  # off the loop, which serves the agent
        self.sources[transfer_id] = blocks
        self.reply(("claimed", transfer_id, claim.state.name))
        if not hold:
            self.agent.ready(transfer_id, blocks, on_free=self.freed)

    async def finish(self, transfer_id: str) -> None:
        """A held request's prefill ends: its blocks go to the writer (freed at once if the transfer ended)."""
        self.agent.ready(transfer_id, self.sources[transfer_id], on_free=self.freed)

    def compute(self, prompt: str, blocks: list[int]) -> None:
        for region, kv in zip(self.cache, prompt_kv(prompt), strict=True):
            region[blocks] = torch.from_numpy(kv)

    def freed(self, transfer_id: str) -> None:
        """The agent is done with the transfer's source blocks."""
        self.free.extend(self.sources.pop(transfer_id))
        self.reply(("freed", transfer_id))

    async def pool(self) -> None:
        self.reply(("pool", "prefill", len(self.free)))
