"""Retry and configuration objects: backoff math, what is retried, failover order, validation."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from rendezvous.clients import (
    AsyncRendezvousClient,
    ChannelOptions,
    ClaimSpec,
    ClientConfig,
    DeadlineExceeded,
    EngineRole,
    FailedPrecondition,
    KeepAliveConfig,
    Reason,
    RendezvousClient,
    ResourceExhausted,
    RetryPolicy,
    SessionConfig,
    TargetSpec,
    TransferState,
    Unavailable,
)
from rendezvous.clients._retry import Attempts, Backoff, renewal_wait
from rendezvous.clients._transport import CallMetadata, EpochTracker
from rendezvous.clients.testing import AsyncTestServer, FakeClock, TestServer
from rendezvous.protocol.errors import Cancelled
from rendezvous.store.base import StoreUnavailableError
from tests.factories import sdk_engine

UNAVAILABLE = Unavailable("", "down")


def test_backoff_grows_by_the_multiplier_up_to_the_cap() -> None:
    policy = RetryPolicy(initial_backoff=0.1, max_backoff=0.5, multiplier=2.0, jitter=0.0)
    assert [policy.backoff(n) for n in range(1, 6)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])


def test_jitter_only_shortens_the_wait_by_at_most_its_fraction() -> None:
    policy = RetryPolicy(initial_backoff=1.0, max_backoff=1.0, jitter=0.25)
    waits = [policy.backoff(1) for _ in range(200)]
    assert all(0.75 <= w <= 1.0 for w in waits)
    assert len(set(waits)) > 1


def test_unavailable_is_retried_always_deadline_exceeded_only_for_reads() -> None:
    policy = RetryPolicy()
    assert policy.retryable(grpc.StatusCode.UNAVAILABLE, idempotent=False)
    assert not policy.retryable(grpc.StatusCode.DEADLINE_EXCEEDED, idempotent=False)
    assert policy.retryable(grpc.StatusCode.DEADLINE_EXCEEDED, idempotent=True)
    assert not policy.retryable(grpc.StatusCode.FAILED_PRECONDITION, idempotent=True)


def test_an_unavailable_endpoint_is_left_at_once_and_a_failed_round_backs_off() -> None:
    attempts = Attempts(RetryPolicy(initial_backoff=0.1, max_backoff=1.0, jitter=0.0), endpoints=3)
    delays = [attempts.next_delay(UNAVAILABLE, idempotent=False) for _ in range(6)]
    assert delays == pytest.approx([0.0, 0.0, 0.1, 0.0, 0.0, 0.2])


def test_a_refusal_with_a_retry_hint_is_retried_after_the_hint_and_one_without_is_not() -> None:
    policy = RetryPolicy(initial_backoff=0.01, max_backoff=0.01, jitter=0.0, deadline=None)
    hinted = ResourceExhausted(Reason.RATE_LIMITED, "slow down", retry_after=0.5)
    # Refused before any work: retried even for a call that is not idempotent, after the hint.
    assert Attempts(policy, endpoints=1).next_delay(hinted, idempotent=False) == pytest.approx(0.5)
    assert Attempts(policy, endpoints=1).next_delay(ResourceExhausted("", "full"), idempotent=True) is None
    # The policy's deadline still bounds the wait.
    bounded = Attempts(RetryPolicy(deadline=0.2), endpoints=1, started=0.0, clock=lambda: 0.0)
    assert bounded.next_delay(hinted, idempotent=False) is None


def test_a_timed_out_read_backs_off_on_the_same_endpoint() -> None:
    attempts = Attempts(RetryPolicy(initial_backoff=0.1, jitter=0.0), endpoints=3)
    assert attempts.next_delay(DeadlineExceeded("", "slow"), idempotent=True) == pytest.approx(0.1)


def test_max_attempts_counts_the_first_attempt() -> None:
    attempts = Attempts(RetryPolicy(initial_backoff=0.0, max_attempts=3), endpoints=1)
    assert [attempts.next_delay(UNAVAILABLE, idempotent=False) for _ in range(3)] == [0.0, 0.0, None]


def test_no_retry_waits_past_the_deadline() -> None:
    attempts = Attempts(RetryPolicy(initial_backoff=1.0, max_backoff=1.0, deadline=0.5), endpoints=1)
    assert attempts.next_delay(UNAVAILABLE, idempotent=False) is None


def test_errors_a_retry_cannot_fix_are_raised_at_once() -> None:
    attempts = Attempts(RetryPolicy(), endpoints=2)
    assert attempts.next_delay(FailedPrecondition(Reason.LEASE_EXPIRED, "no"), idempotent=True) is None


def test_stream_backoff_starts_over_after_a_reset() -> None:
    backoff = Backoff(RetryPolicy(initial_backoff=0.1, max_backoff=1.0, jitter=0.0))
    assert [backoff.next(), backoff.next()] == pytest.approx([0.1, 0.2])
    backoff.reset()
    assert backoff.next() == pytest.approx(0.1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_backoff": -1.0},
        {"initial_backoff": 2.0, "max_backoff": 1.0},
        {"multiplier": 0.5},
        {"jitter": 1.0},
        {"max_attempts": 0},
    ],
)
def test_nonsensical_retry_policies_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_a_single_target_string_is_one_endpoint() -> None:
    assert ClientConfig(targets="h:1").targets == ("h:1",)
    assert ClientConfig(targets=["h:1", "h:2"]).targets == ("h:1", "h:2")


def test_a_config_needs_a_target() -> None:
    with pytest.raises(ValueError):
        ClientConfig(targets=[])


def test_the_token_is_sent_as_a_bearer_before_configured_and_hooked_metadata() -> None:
    hooked = [("x-step", "1")]
    config = ClientConfig(targets="h:1", token="s3cret", metadata=[("x-a", "b")], metadata_hook=lambda: hooked)
    assert CallMetadata(config)() == (("authorization", "Bearer s3cret"), ("x-a", "b"), ("x-step", "1"))
    assert CallMetadata(ClientConfig(targets="h:1"))() is None


def test_channel_options_carry_keepalive_message_size_and_reconnect_backoff() -> None:
    options = dict(
        ChannelOptions(keepalive=KeepAliveConfig(time=20.0, timeout=5.0), max_message_bytes=1 << 20).as_grpc_options()
    )
    assert options["grpc.keepalive_time_ms"] == 20_000
    assert options["grpc.keepalive_timeout_ms"] == 5_000
    assert options["grpc.max_receive_message_length"] == options["grpc.max_send_message_length"] == 1 << 20
    assert options["grpc.initial_reconnect_backoff_ms"] == 100


def test_session_config_rejects_a_renewal_fraction_outside_the_lease() -> None:
    with pytest.raises(ValueError):
        SessionConfig(renew_fraction=1.0)


def test_epoch_listeners_hear_changes_but_not_the_first_epoch() -> None:
    tracker = EpochTracker()
    heard: list[tuple[int, int]] = []
    remove = tracker.add_listener(lambda old, new: heard.append((old, new)))
    for epoch in (5, 5, 0, 7):
        tracker.observe(epoch)
    remove()
    tracker.observe(9)
    assert heard == [(5, 7)]
    assert tracker.epoch == 9


def test_a_late_answer_from_an_epoch_already_left_changes_nothing() -> None:
    tracker = EpochTracker()
    heard: list[tuple[int, int]] = []
    tracker.add_listener(lambda old, new: heard.append((old, new)))
    for epoch in (5, 7, 5, 7, 9, 5, 7):
        tracker.observe(epoch)
    assert heard == [(5, 7), (7, 9)]
    assert tracker.epoch == 9


def test_the_deadline_counts_from_the_first_attempt_not_the_first_failure() -> None:
    clock = FakeClock(100.0)
    policy = RetryPolicy(initial_backoff=0.1, max_backoff=0.1, jitter=0.0, deadline=1.0)
    started = clock()
    clock.advance(0.95)  # the first attempt took 0.95 s before failing
    assert Attempts(policy, endpoints=1, started=started, clock=clock).next_delay(UNAVAILABLE, False) is None
    # Had it failed at once, a retry 0.1 s later would still be within the deadline.
    assert Attempts(policy, endpoints=1, clock=clock).next_delay(UNAVAILABLE, False) == pytest.approx(0.1)


# A first attempt that takes SLOW seconds and then fails UNAVAILABLE (the store behind the server gave up),
# under a policy whose deadline is shorter than that attempt plus one backoff: no retry may follow.
SLOW = 0.3
SLOW_START = RetryPolicy(initial_backoff=0.1, max_backoff=0.1, jitter=0.0, deadline=0.35)


def _slow_then_unavailable(coordinator: Any) -> list[float]:
    """Make GetStatus's first call slow and UNAVAILABLE and later ones answer; returns the call times."""
    answer = coordinator.counts
    calls: list[float] = []

    async def counts() -> Any:
        calls.append(time.monotonic())
        if len(calls) == 1:
            await asyncio.sleep(SLOW)
            raise StoreUnavailableError("slow, then gone")
        return await answer()

    coordinator.counts = counts
    return calls


async def test_a_slow_first_attempt_uses_up_the_async_clients_retry_deadline(server: AsyncTestServer) -> None:
    calls = _slow_then_unavailable(server.server.coordinator)
    config = ClientConfig(targets=server.address, retry=SLOW_START, call_timeout=5.0)
    async with AsyncRendezvousClient(config) as client:
        with pytest.raises(Unavailable):
            await client.get_status()
        assert len(calls) == 1, "retried although the first attempt used up the deadline"
        await client.get_status()  # the server answers again: the call itself was fine


def test_a_slow_first_attempt_uses_up_the_sync_clients_retry_deadline() -> None:
    with TestServer(grace=0.1) as server:
        calls = _slow_then_unavailable(server._server.server.coordinator)
        config = ClientConfig(targets=server.address, retry=SLOW_START, call_timeout=5.0)
        with RendezvousClient(config) as client:
            with pytest.raises(Unavailable):
                client.get_status()
            assert len(calls) == 1, "retried although the first attempt used up the deadline"
            client.get_status()


def test_a_cancelled_sent_by_the_server_is_retried_for_every_call() -> None:
    policy = RetryPolicy()
    assert policy.retryable(grpc.StatusCode.CANCELLED, idempotent=False)
    assert policy.retryable(grpc.StatusCode.CANCELLED, idempotent=True)


async def test_a_claim_the_server_drops_with_cancelled_is_retried_not_lost(server: AsyncTestServer) -> None:
    """gRPC core answers a call it drops before the service (past `grpc.server.max_pending_requests`
    calls of that method waiting) with CANCELLED. Stand-in for that drop (the real one needs a loaded
    server's timing): the real server answers the first ClaimTransfers CANCELLED before any work."""
    coordinator = server.server.coordinator
    caller = coordinator._caller
    calls: list[str] = []

    async def producer_dropped_once(engine_id: str, *args: Any, **kwargs: Any) -> Any:
        if engine_id == "p0":
            calls.append(engine_id)
            if len(calls) == 1:
                raise Cancelled("", "dropped before the service")
        return await caller(engine_id, *args, **kwargs)

    coordinator._caller = producer_dropped_once
    config = ClientConfig(targets=server.address, retry=RetryPolicy(initial_backoff=0.01, deadline=10.0))
    async with AsyncRendezvousClient(config) as client:
        d = await client.register_engine(sdk_engine("d0", EngineRole.CONSUMER))
        p = await client.register_engine(sdk_engine("p0", EngineRole.PRODUCER))
        await client.register_target("d0", TargetSpec("t", [1]), incarnation=d.engine.incarnation)
        claimed = await client.claim_transfer("p0", ClaimSpec("t"), incarnation=p.engine.incarnation)
    assert len(calls) == 2, "the dropped claim was not retried"
    assert claimed.state == TransferState.MATCHED


def test_a_renewal_waits_the_hint_but_not_past_the_last_moment_the_lease_allows() -> None:
    assert renewal_wait(backoff=0.05, hint=2.0, latest=8.0) == 2.0  # the hint, with time to spare
    assert renewal_wait(backoff=0.05, hint=100.0, latest=1.5) == 1.5  # the lease's last chance comes first
    assert renewal_wait(backoff=0.5, hint=0.1, latest=8.0) == 0.5  # never sooner than the backoff
    assert renewal_wait(backoff=0.05, hint=100.0, latest=-0.1) == 100.0  # nothing left to save: the hint
