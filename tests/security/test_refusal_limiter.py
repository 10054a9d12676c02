"""Limits after authentication (issue 24, item 4): wrong-token calls are limited by host only for callers
that did not authenticate, so a caller with a valid token is never refused because of other callers'
failures, even behind one address (SNAT, an ingress, a sidecar: here every client is 127.0.0.1)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.clients.testing import FakeClock
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.server import CallLimits, RendezvousServer
from rendezvous.server.quotas import CallQuotas
from rendezvous.v1 import rendezvous_pb2 as pb
from tests.security.conftest import serving
from tests.security.test_auth import DECODE, ROUTER, UNAUTHENTICATED, auth_file, call, refusal, register

RATE_LIMITED = (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED")
DENIED = (grpc.StatusCode.PERMISSION_DENIED, "IDENTITY_MISMATCH")


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RendezvousServer]:
    async with serving(auth_file=auth_file(tmp_path)) as srv:  # the default refusal limit: 5/s, burst 50
        yield srv


async def guess(channel: grpc.aio.Channel, n: int) -> tuple[grpc.StatusCode, str]:
    return await refusal(call(channel, "GetStatus", pb.GetStatusRequest(), f"wrong-token-{n:016d}"))


async def test_wrong_token_calls_from_one_host_do_not_lock_out_valid_tokens(channel: grpc.aio.Channel) -> None:
    """The issue's case: 300 wrong-token calls made the router's and an engine's next correct calls
    RATE_LIMITED. The guesser itself is still limited."""
    outcomes = [await guess(channel, n) for n in range(300)]
    assert outcomes[:50] == [UNAUTHENTICATED] * 50
    assert RATE_LIMITED in outcomes[50:]
    assert (await call(channel, "GetStatus", pb.GetStatusRequest(), ROUTER)).version
    assert (await register(channel, "decode-0", DECODE)).engine.engine_id == "decode-0"


async def test_a_steady_guesser_refuses_no_legitimate_call(tmp_path: Path) -> None:
    """A guesser at ten calls per legitimate call (the issue: 38 of 48 legitimate calls were refused): 100
    guesses a second against the refusal limit of 5/s, on a clock the test moves (on the wall clock a slow
    machine's pace decided whether a refill fell just before the last guess)."""
    clock = FakeClock()
    async with (
        serving(auth_file=auth_file(tmp_path), clock=clock) as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        outcomes = []
        for n in range(48):
            outcomes += [await guess(channel, n * 10 + g) for g in range(10)]
            assert (await call(channel, "GetStatus", pb.GetStatusRequest(), ROUTER)).version
            clock.advance(0.1)
        assert outcomes[:50] == [UNAUTHENTICATED] * 50
        tokens = 50 + 5 * 4.7  # the burst and 5/s over the 4.7 s the clock moved while guessing
        assert tokens - 1 <= outcomes.count(UNAUTHENTICATED) <= tokens
        assert set(outcomes) == {UNAUTHENTICATED, RATE_LIMITED}
        assert await guess(channel, 480) == RATE_LIMITED


async def test_an_identity_s_denied_calls_are_not_charged_to_its_host(channel: grpc.aio.Channel) -> None:
    """An authenticated caller acting for another engine is denied; its denials do not spend the host's
    refusal bucket (which would then refuse an unauthenticated caller there, or anyone, RATE_LIMITED)."""
    for _ in range(100):
        assert await refusal(register(channel, "decode-1", DECODE)) == DENIED
    assert await guess(channel, 0) == UNAUTHENTICATED


async def test_an_identity_s_denied_calls_are_charged_to_its_own_rate(tmp_path: Path) -> None:
    async with (
        serving(auth_file=auth_file(tmp_path), call_limits=CallLimits(rate=0.001, burst=5)) as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        for _ in range(5):
            assert await refusal(register(channel, "decode-1", DECODE)) == DENIED
        assert await refusal(register(channel, "decode-0", DECODE)) == RATE_LIMITED
        assert (await call(channel, "GetStatus", pb.GetStatusRequest(), ROUTER)).version


def test_a_rate_limited_refusal_says_when_to_retry() -> None:
    now = [0.0]
    quotas = CallQuotas(CallLimits(rate=4, burst=1, refusal_rate=2, refusal_burst=1), lambda: now[0])
    quotas.admit("id:a")
    with pytest.raises(RendezvousError) as err:
        quotas.admit("id:a")
    assert err.value.retry_after == pytest.approx(0.25)
    now[0] += 0.1
    with pytest.raises(RendezvousError) as err:
        quotas.admit("id:a")
    assert err.value.retry_after == pytest.approx(0.15)
    quotas.refused("ipv4:10.0.0.1")
    with pytest.raises(RendezvousError) as err:
        quotas.check_refusals("ipv4:10.0.0.1")
    assert err.value.reason == Reason.RATE_LIMITED
    assert err.value.retry_after == pytest.approx(0.5)


async def test_the_retry_hint_reaches_the_client(tmp_path: Path) -> None:
    """On a clock that stands still: on the wall clock a machine that took half a second between the two calls
    (the bucket's refill at 2/s) had the second one admitted."""
    async with (
        serving(auth_file=auth_file(tmp_path), call_limits=CallLimits(rate=2, burst=1), clock=FakeClock()) as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        await call(channel, "GetStatus", pb.GetStatusRequest(), ROUTER)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(channel, "GetStatus", pb.GetStatusRequest(), ROUTER)
    refused = from_rpc_error(err.value)
    assert refused.reason == "RATE_LIMITED"
    assert refused.retry_after == pytest.approx(0.5)  # a whole token at 2/s: the clock did not move
