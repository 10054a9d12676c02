"""The service's phase histograms: each phase of a transfer observed once, when its later moment happens,
for as long as the transfer's own reported times say (real transfers through an in-process server)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from rendezvous.clients import (
    AbortSpec,
    AsyncRendezvousClient,
    ClaimSpec,
    CompletionSpec,
    EngineRole,
    EngineSpec,
    ReleaseSpec,
    SourceReadySpec,
    TargetSpec,
    TransferInfo,
    TransferMode,
)
from rendezvous.clients.testing import AsyncTestServer, start_test_server
from tests.clients.conftest import LAYOUT, agent, client_config

PUSH_PHASES = ("target_to_match", "claim_to_match", "match_to_commit", "commit_to_release", "total")
PULL_ONLY_PHASES = ("match_to_source_ready", "source_ready_to_commit")


@pytest.fixture
async def server() -> AsyncIterator[AsyncTestServer]:
    async with start_test_server() as srv:
        yield srv


@pytest.fixture
async def client(server: AsyncTestServer) -> AsyncIterator[AsyncRendezvousClient]:
    async with AsyncRendezvousClient(client_config(server.address)) as c:
        for engine_id, role, pool in (("d0", EngineRole.CONSUMER, "decode"), ("p0", EngineRole.PRODUCER, "prefill")):
            await c.register_engine(EngineSpec(engine_id, pool, role, LAYOUT, (agent(f"{engine_id}-0"),)))
        yield c


PHASE = "kv_rendezvous_transfer_phase_seconds"


def assert_observed(
    server: AsyncTestServer, count: int, seconds: float, phase: str = "", histogram: str = PHASE
) -> None:
    """The histogram (the phase's, by default) was observed count times, for seconds in all (up to the
    wire's timestamp rounding)."""
    registry = server.server.metrics.registry
    labels = {"phase": phase} if phase else {}
    assert (registry.get_sample_value(f"{histogram}_count", labels) or 0) == count, phase or histogram
    assert (registry.get_sample_value(f"{histogram}_sum", labels) or 0) == pytest.approx(seconds, abs=1e-5)


async def test_a_push_lifecycle_observes_each_of_its_phases_once_for_as_long_as_its_times_say(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    released: list[TransferInfo] = []
    for i in range(4):
        tid = f"push-{i}"
        # Either half may come first: alternate, so both match phases are sometimes zero and sometimes not.
        halves = [client.register_target("d0", TargetSpec(tid, [1, 2])), client.claim_transfer("p0", ClaimSpec(tid))]
        for half in halves if i % 2 else reversed(halves):
            await half
        await client.complete_transfer("p0", CompletionSpec(tid, 1))
        await client.release_target("d0", ReleaseSpec(tid, 1))
        released.append(await client.get_transfer(tid))

    expected = {
        "target_to_match": [t.times.match_time - t.times.target_time for t in released],
        "claim_to_match": [t.times.match_time - t.times.claim_time for t in released],
        "match_to_commit": [t.times.commit_time - t.times.match_time for t in released],
        "commit_to_release": [t.times.end_time - t.times.commit_time for t in released],
        "total": [t.times.end_time - min(t.times.target_time, t.times.claim_time) for t in released],
    }
    for phase in PUSH_PHASES:
        assert_observed(server, 4, sum(expected[phase]), phase)
    assert sum(expected["target_to_match"]) > 0 and sum(expected["claim_to_match"]) > 0
    for phase in PULL_ONLY_PHASES:
        assert_observed(server, 0, 0, phase)
    waits = [max(a, b) for a, b in zip(expected["target_to_match"], expected["claim_to_match"], strict=True)]
    assert_observed(server, 4, sum(waits), histogram="kv_rendezvous_match_wait_seconds")


async def test_a_pull_source_ready_after_the_match_is_observed_when_it_comes_without_a_state_change(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    await client.register_target("d0", TargetSpec("pull", [1, 2], mode=TransferMode.PULL))
    await client.claim_transfer("p0", ClaimSpec("pull"))
    assert_observed(server, 0, 0, "match_to_source_ready")
    await client.mark_source_ready("p0", SourceReadySpec("pull", [5, 6]))
    ready = (await client.get_transfer("pull")).times
    assert_observed(server, 1, ready.source_ready_time - ready.match_time, "match_to_source_ready")
    await client.complete_transfer("d0", CompletionSpec("pull", 1))
    await client.release_target("d0", ReleaseSpec("pull", 1))
    times = (await client.get_transfer("pull")).times
    assert_observed(server, 1, ready.source_ready_time - ready.match_time, "match_to_source_ready")  # not again
    assert_observed(server, 1, times.commit_time - times.source_ready_time, "source_ready_to_commit")


async def test_a_source_ready_before_the_match_makes_match_to_source_ready_zero(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    await client.mark_source_ready("p0", SourceReadySpec("early", [5, 6]))
    await client.register_target("d0", TargetSpec("early", [1, 2], mode=TransferMode.PULL))
    times = (await client.get_transfer("early")).times
    assert 0 < times.source_ready_time < times.match_time
    assert_observed(server, 1, 0, "match_to_source_ready")
    assert_observed(server, 1, times.match_time - times.claim_time, "claim_to_match")


async def test_an_aborted_transfer_observes_no_release_phases(
    server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    await client.register_target("d0", TargetSpec("doomed", [1, 2]))
    await client.claim_transfer("p0", ClaimSpec("doomed"))
    await client.complete_transfer("p0", CompletionSpec("doomed", 1))
    await client.abort_transfer("d0", AbortSpec("doomed", "changed my mind"))
    times = (await client.get_transfer("doomed")).times
    assert_observed(server, 1, times.commit_time - times.match_time, "match_to_commit")
    assert_observed(server, 0, 0, "commit_to_release")
    assert_observed(server, 0, 0, "total")
