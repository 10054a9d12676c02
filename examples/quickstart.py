"""The README's quickstart: one push transfer between a consumer and a producer session.

python examples/quickstart.py [ADDRESS]     # default 127.0.0.1:50051 (start it with `make serve`)
"""

from __future__ import annotations

import asyncio
import sys

from rendezvous.clients import (
    AsyncRendezvousClient,
    ClaimSpec,
    CompletionSpec,
    ConsumerSession,
    Event,
    EventType,
    KvLayout,
    ProducerSession,
    ReleaseSpec,
    TargetSpec,
    mint_transfer_id,
)
from rendezvous.clients.testing import stand_in_agent  # a real engine registers its NIXL agents (one per rank)


async def main(address: str) -> None:
    layout = KvLayout(model_fingerprint="llama-3-8b", dtype="bfloat16", block_size=16, num_layers=32)
    async with AsyncRendezvousClient(address) as client:
        decode = ConsumerSession(client, "decode-0", "decode", layout=layout, agents=[stand_in_agent("decode-0")])
        prefill = ProducerSession(client, "prefill-0", "prefill", layout=layout, agents=[stand_in_agent("prefill-0")])
        async with decode, prefill:
            transfer_id = mint_transfer_id()  # the router does this and sends both legs at once
            await decode.register_target(TargetSpec(transfer_id, block_ids=[7, 8, 9]))
            await prefill.claim_transfer(ClaimSpec(transfer_id))  # either order works
            async for event in prefill.events():  # the producer's writer receives the assignment
                if isinstance(event, Event) and event.type == EventType.TRANSFER_ASSIGNED:
                    assert event.peer is not None and event.transfer is not None  # an assignment names both
                    print("write into", event.peer.engine_id, "blocks", list(event.transfer.target_block_ids))
                    await prefill.complete_transfer(CompletionSpec(transfer_id, event.generation))
                    break
            async for event in decode.events():
                if isinstance(event, Event) and event.type == EventType.TRANSFER_COMMITTED:
                    print("committed generation", event.generation)
                    await decode.release_target(ReleaseSpec(transfer_id, event.generation))
                    break


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"))
