"""One transfer's whole cycle through the SDK; importing it loads nothing of OpenTelemetry."""

from __future__ import annotations

from rendezvous.clients import (
    AsyncRendezvousClient,
    ClaimSpec,
    CompletionSpec,
    EngineRole,
    ReleaseSpec,
    TargetSpec,
    TransferState,
)
from tests.clients.test_client_aio import register

CYCLE = ("RegisterEngine", "RegisterTargets", "ClaimTransfers", "CompleteTransfers", "ReleaseTargets")
"""The RPCs of `cycle`."""


async def cycle(client: AsyncRendezvousClient) -> None:
    """Register both engines, then target, claim (the match), commit and release one transfer."""
    await register(client, "d0", EngineRole.CONSUMER)
    await register(client, "p0", EngineRole.PRODUCER)
    assert (await client.register_target("d0", TargetSpec("t1", [5, 6], num_tokens=32))).state == TransferState.TARGETED
    assert (await client.claim_transfer("p0", ClaimSpec("t1"))).state == TransferState.MATCHED
    assert (await client.complete_transfer("p0", CompletionSpec("t1", 1))).state == TransferState.COMMITTED
    assert (await client.release_target("d0", ReleaseSpec("t1", 1))).state == TransferState.RELEASED
