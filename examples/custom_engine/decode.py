"""The decode engine: a DRAM KV pool, destination blocks registered per request, every arrival checked.

The SDK's `ConsumerAgent` does the protocol: it registers the pool with NIXL and the engine with the service
(lease renewed in the background), batches `register_target` calls, watches the engine's events and the NIXL
notifications, and reports how each transfer ended through `on_result` (on this event loop): ok once the KV
is in the blocks, failed with the abort reason otherwise, and in both cases only once no write can land in the
blocks any more. It also releases a committed transfer itself (ReleaseTargets): the engine never does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rendezvous.clients import AsyncRendezvousClient, Binding, ClientConfig
from rendezvous.clients.nixl import ConsumerAgent, TransferResult

from .model import LAYOUT, blocks_needed, kv_cache, prompt_kv

Reply = Callable[[tuple[object, ...]], None]


class DecodeEngine:
    """Admits requests into its KV pool; a request's KV arrives while prefill computes it."""

    def __init__(self, address: str, engine_id: str, num_blocks: int, reply: Reply, token: str | None = None) -> None:
        self.cache = kv_cache(num_blocks)
        self.free = list(range(num_blocks))
        self.prompts: dict[str, str] = {}
        self.reply = reply
        self.client = AsyncRendezvousClient(ClientConfig([address], token=token))  # token: with --auth
        self.agent = ConsumerAgent(self.client, engine_id, "decode", self.cache, layout=LAYOUT, on_result=self.arrived)

    async def start(self) -> None:
        await self.agent.start()

    async def close(self) -> None:
        await self.agent.close()
        await self.client.close()

    async def request(self, transfer_id: str, prompt: str, binding: Binding | None) -> None:
        """The router's decode leg: take blocks from the pool and register them as the transfer's target, with the
        router's binding of the transfer to this engine (None: the router does not sign)."""
        n = blocks_needed(prompt)
        if n > len(self.free):
            self.reply(("done", transfer_id, False, "KV pool full"))
            return
        blocks, self.free = self.free[:n], self.free[n:]
        for region in self.cache:
            region[blocks] = 0  # a block nobody wrote then shows
        self.prompts[transfer_id] = prompt
        result = await self.agent.register_target(transfer_id, blocks, binding=binding)
        if not result.ok:  # refused, with a reason (e.g. BINDING_REQUIRED): nothing is registered
            assert result.error is not None
            self.prompts.pop(transfer_id)
            self.free.extend(blocks)
            self.reply(("done", transfer_id, False, result.error.reason))
            return
        self.reply(("registered", transfer_id, result.state.name))

    async def abort(self, transfer_id: str) -> None:
        """The client went away: tell the service. The blocks come back through `arrived` (reason REQUESTED)
        once no write can land in them: a producer already writing is first told to stop."""
        await self.agent.abort(transfer_id, "the client went away")

    def arrived(self, result: TransferResult) -> None:
        """How a transfer ended; from now on `result.block_ids` are the engine's again."""
        prompt = self.prompts.pop(result.transfer_id)
        ok = result.ok and self.holds(prompt, result.block_ids)
        # A real engine decodes here when ok, then frees the blocks; a failed request is retried or refused.
        self.free.extend(result.block_ids)
        self.reply(("done", result.transfer_id, ok, "" if ok else str(result.reason or "BYTES_DIFFER")))

    def holds(self, prompt: str, block_ids: tuple[int, ...]) -> bool:
        """Whether the blocks hold exactly the prompt's KV, in every region."""
        expected = prompt_kv(prompt)
        return all(np.array_equal(region[list(block_ids)].numpy(), expected[r]) for r, region in enumerate(self.cache))

    async def pool(self) -> None:
        self.reply(("pool", "decode", len(self.free)))
