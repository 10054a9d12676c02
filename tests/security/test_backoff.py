"""Invalid-request back-off (rendezvous.server.backoff): a caller whose large request was refused as invalid has
its next calls to that method refused before they are read, and its other requests as large refused unparsed,
for ten times what the refused one cost; no one else is affected.

The unit tests move a fake clock; the service test freezes the server's clock, so the back-off cannot end on
its own while the test runs, whatever the machine's speed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.core.limits import Limits
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.server import CallLimits, RendezvousServer, ServerConfig
from rendezvous.server.backoff import FACTOR, HELD, HELD_PER_CALLER, MAX_WAIT, InvalidBackoff
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.security.test_auth import auth_file, bearer
from tests.security.test_stall import error_reason
from tests.service.conftest import engine_request


def fake_clock() -> tuple[list[float], Callable[[], float]]:
    now = [100.0]
    return now, lambda: now[0]


def test_a_large_invalid_request_holds_back_its_callers_requests_as_large() -> None:
    now, clock = fake_clock()
    backoff = InvalidBackoff(1_000, clock)
    backoff.refused("a", "M", 5_000, cost=0.02)
    with pytest.raises(RendezvousError) as err:
        backoff.check("a", 5_000)
    assert err.value.reason == Reason.RATE_LIMITED
    assert err.value.retry_after == pytest.approx(FACTOR * 0.02)
    assert err.value.metadata["min_bytes"] == "5000"
    backoff.check("a", 4_999)  # smaller requests of the same caller are read
    backoff.check("b", 5_000)  # and every other caller's
    now[0] += FACTOR * 0.02
    backoff.check("a", 5_000)


def test_repeated_invalid_requests_double_the_wait_up_to_the_cap() -> None:
    now, clock = fake_clock()
    backoff = InvalidBackoff(1_000, clock)
    waits = []
    for _ in range(12):
        backoff.refused("a", "M", 8_000, cost=0.01)
        with pytest.raises(RendezvousError) as err:
            backoff.check("a", 8_000)
        assert err.value.retry_after is not None
        waits.append(err.value.retry_after)
        now[0] += err.value.retry_after  # the caller retries as soon as it may, and is refused again
    assert waits[:3] == pytest.approx([0.1, 0.2, 0.4])
    assert waits[-1] == MAX_WAIT


def test_small_requests_start_no_back_off_and_a_large_valid_one_ends_it() -> None:
    _, clock = fake_clock()
    backoff = InvalidBackoff(1_000, clock)
    backoff.refused("a", "M", 999, cost=1.0)
    backoff.check("a", 10_000)
    backoff.refused("a", "M", 2_000, cost=1.0)
    with pytest.raises(RendezvousError):
        backoff.check("a", 2_000)
    backoff.passed("a", 1_500)  # smaller than the refused one: proves nothing
    with pytest.raises(RendezvousError):
        backoff.check("a", 2_000)
    backoff.passed("a", 2_000)
    backoff.check("a", 2_000)
    off = InvalidBackoff(0, clock)
    off.refused("a", "M", 10_000, cost=1.0)
    off.check("a", 10_000)
    assert not off.watches("M")


def test_calls_to_the_refused_method_are_refused_unread_until_the_back_off_is_over() -> None:
    now, clock = fake_clock()
    backoff = InvalidBackoff(1_000, clock)
    assert not backoff.watches("M")
    backoff.refused("a", "M", 5_000, cost=0.02)
    assert backoff.watches("M") and not backoff.watches("N")
    with pytest.raises(RendezvousError) as err:
        backoff.check_unread("a", "M")  # whatever its size: it is not known before the request is read
    assert err.value.reason == Reason.RATE_LIMITED and "not read" in err.value.message
    assert err.value.retry_after == pytest.approx(FACTOR * 0.02)
    backoff.check_unread("a", "N")  # its other methods are read
    backoff.check_unread("b", "M")  # and every other caller's calls
    now[0] += FACTOR * 0.02
    backoff.check_unread("a", "M")  # the wait is over
    assert backoff.watches("M")  # a refusal now would still double it
    now[0] += FACTOR * 0.02
    backoff.check_unread("a", "M")  # no longer in a row: forgotten
    assert not backoff.watches("M")
    backoff.refused("a", "M", 5_000, cost=0.02)
    backoff.refused("a", "N", 5_000, cost=0.02)  # the latest method is the one refused unread
    assert backoff.watches("N") and not backoff.watches("M")
    backoff.passed("a", 5_000)
    assert not backoff.watches("N")


def test_calls_are_held_up_to_the_hold_and_the_caps_then_at_once() -> None:
    backoff = InvalidBackoff(1_000, max_hold=1.0)
    assert backoff.unread_wait("a", "M") == 0.0
    with contextlib.ExitStack() as held:
        assert held.enter_context(backoff.hold("a", 0.25)) == pytest.approx(0.251)  # the rest of the back-off
        assert [held.enter_context(backoff.hold("a", 5.0)) for _ in range(HELD_PER_CALLER)] == [1.0] * (
            HELD_PER_CALLER - 1
        ) + [0.0]
        callers = [f"c{i}" for i in range(HELD)]
        grants = [held.enter_context(backoff.hold(c, 5.0)) for c in callers]
        assert grants.count(1.0) == HELD - HELD_PER_CALLER and grants.count(0.0) == HELD_PER_CALLER
    with backoff.hold("a", 5.0) as seconds:  # all released
        assert seconds == 1.0
    with InvalidBackoff(1_000, max_hold=0.0).hold("a", 5.0) as seconds:
        assert seconds == 0.0


ENGINE = "tok-backoff-engine-5e1d7c"
ROUTER = "tok-backoff-router-a93b02"
AUTH = {"tokens": {ENGINE: {"name": "e", "engines": ["p0"]}, ROUTER: {"name": "router", "roles": ["router"]}}}


@pytest.fixture
async def frozen(tmp_path: Path) -> AsyncIterator[RendezvousServer]:
    """A server whose clock stands still (at the wall clock's time), parts capped at 100 per request; a call held
    unread is held 10 ms (the back-off never ends on this clock), then refused."""
    now = time.time()
    config = ServerConfig(
        listen="127.0.0.1:0",
        grace=0.1,
        auth_file=auth_file(tmp_path, AUTH),
        limits=Limits(max_parts_per_request=100),
        call_limits=CallLimits(invalid_backoff_bytes=1_000, invalid_backoff_hold=0.01),
    )
    server = RendezvousServer(config, clock=lambda: now)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0)


async def test_on_a_server_a_caller_backs_off_unread_after_a_large_invalid_request(
    frozen: RendezvousServer,
) -> None:
    engine, router = bearer(ENGINE), bearer(ROUTER)
    async with grpc.aio.insecure_channel(frozen.address) as channel:
        stub = pb_grpc.RendezvousServiceStub(channel)
        reg = await stub.RegisterEngine(engine_request("p0", pb.ENGINE_ROLE_PRODUCER), metadata=engine)
        incarnation = reg.engine.incarnation
        parts = [pb.WrittenPart(first_layer=i, num_layers=1, num_tokens=16) for i in range(150)]
        over = pb.CompleteTransfersRequest(
            engine_id="p0",
            incarnation=incarnation,
            completions=[pb.CompletionSpec(transfer_id="t", outcome=pb.COMPLETION_OUTCOME_SUCCEEDED, parts=parts)],
        )
        size = over.ByteSize()
        assert size >= 1_000
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.CompleteTransfers(over, metadata=engine, timeout=30)
        assert from_rpc_error(err.value).reason == "TOO_MANY_PARTS"
        # Its CompleteTransfers calls, however small, are refused before they are read, with a retry hint.
        small = pb.CompleteTransfersRequest(
            engine_id="p0",
            incarnation=incarnation,
            completions=[pb.CompletionSpec(transfer_id="t", outcome=pb.COMPLETION_OUTCOME_SUCCEEDED)],
        )
        raw = channel.unary_unary("/rendezvous.v1.RendezvousService/CompleteTransfers")
        for body in (b"\xff" * size, small.SerializeToString()):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw(body, metadata=engine, timeout=30)
            refused = from_rpc_error(err.value)
            assert (refused.code, refused.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED")
            assert "are not read" in refused.message
            assert refused.retry_after is not None and refused.retry_after > 0
        # Its other methods are read: as large, refused unparsed; small, served.
        other = channel.unary_unary("/rendezvous.v1.RendezvousService/ClaimTransfers")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await other(b"\xff" * size, metadata=engine, timeout=30)
        refused = from_rpc_error(err.value)
        assert refused.reason == "RATE_LIMITED" and "are not parsed" in refused.message
        claims = [pb.ClaimSpec(transfer_id="c")]
        claim = pb.ClaimTransfersRequest(engine_id="p0", incarnation=incarnation, claims=claims)
        assert (await stub.ClaimTransfers(claim, metadata=engine, timeout=30)).results[0].transfer_id == "c"
        # Every other identity's CompleteTransfers are read (the router's then refused for what it asks).
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.CompleteTransfers(small, metadata=router, timeout=30)
        assert from_rpc_error(err.value).reason == "IDENTITY_MISMATCH"
        assert (await stub.GetStatus(pb.GetStatusRequest(), metadata=router, timeout=30)).header.server_id


async def test_while_a_method_is_read_unread_first_a_call_without_a_request_message_is_invalid(
    frozen: RendezvousServer,
) -> None:
    """While the engine backs off from GetStatus, that method is served as request-streaming (so that a caller is
    identified before its request is read): a call of another identity that sends no request message gets
    MESSAGE_INVALID, not a crash or a hang; one that sends two is served the first (the rest is never read, so a
    caller that never half-closes holds nothing), and the service goes on serving."""
    engine, router = bearer(ENGINE), bearer(ROUTER)
    path = "/rendezvous.v1.RendezvousService/GetStatus"
    async with grpc.aio.insecure_channel(frozen.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await channel.unary_unary(path)(b"\xff" * 2_000, metadata=engine, timeout=30)
        assert from_rpc_error(err.value).reason == "MESSAGE_INVALID"  # the engine now backs off from GetStatus
        streamed = channel.stream_unary(path, response_deserializer=pb.GetStatusResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await streamed(iter([]), metadata=router, timeout=30)
        refused = from_rpc_error(err.value)
        assert (refused.code, refused.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "MESSAGE_INVALID")
        assert "got no request message" in refused.message
        empty = pb.GetStatusRequest().SerializeToString()
        assert (await streamed(iter([empty, b"\xff" * 10]), metadata=router, timeout=30)).header.server_id
        stub = pb_grpc.RendezvousServiceStub(channel)
        assert (await stub.GetStatus(pb.GetStatusRequest(), metadata=router, timeout=30)).header.server_id


async def test_on_a_server_a_large_request_that_does_not_parse_starts_a_back_off_too(
    frozen: RendezvousServer,
) -> None:
    engine, router = bearer(ENGINE), bearer(ROUTER)
    async with grpc.aio.insecure_channel(frozen.address) as channel:
        raw = channel.unary_unary("/rendezvous.v1.RendezvousService/GetStatus")
        junk = b"\xff" * 2_000
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw(junk, metadata=engine, timeout=30)
        assert from_rpc_error(err.value).reason == "MESSAGE_INVALID"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw(junk, metadata=engine, timeout=30)
        refused = from_rpc_error(err.value)
        assert (refused.code, refused.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED")
        assert refused.metadata["min_bytes"] == "2000" and refused.retry_after is not None
        # The same junk from another identity is read (and refused for what it is).
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw(junk, metadata=router, timeout=30)
        assert from_rpc_error(err.value).reason == "MESSAGE_INVALID"


async def test_a_call_held_while_its_caller_backs_off_is_served_once_the_back_off_ends(tmp_path: Path) -> None:
    """On the real clock, with a hold longer than the longest back-off: the call waits unread, then is served."""
    config = ServerConfig(
        listen="127.0.0.1:0",
        grace=0.1,
        auth_file=auth_file(tmp_path, AUTH),
        limits=Limits(max_parts_per_request=100),
        call_limits=CallLimits(invalid_backoff_bytes=1_000, invalid_backoff_hold=10 * MAX_WAIT),
    )
    server = RendezvousServer(config)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.RendezvousServiceStub(channel)
            engine = bearer(ENGINE)
            reg = await stub.RegisterEngine(engine_request("p0", pb.ENGINE_ROLE_PRODUCER), metadata=engine)
            parts = [pb.WrittenPart(first_layer=i, num_layers=1, num_tokens=16) for i in range(150)]
            done = pb.COMPLETION_OUTCOME_SUCCEEDED
            over = pb.CompleteTransfersRequest(
                engine_id="p0",
                incarnation=reg.engine.incarnation,
                completions=[pb.CompletionSpec(transfer_id="t", outcome=done, parts=parts)],
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.CompleteTransfers(over, metadata=engine, timeout=60)
            assert from_rpc_error(err.value).reason == "TOO_MANY_PARTS"
            small = pb.CompleteTransfersRequest(
                engine_id="p0",
                incarnation=reg.engine.incarnation,
                completions=[pb.CompletionSpec(transfer_id="t", outcome=done)],
            )
            answer = await stub.CompleteTransfers(small, metadata=engine, timeout=60)
            assert error_reason(answer.results[0]) == "TRANSFER_NOT_FOUND"
    finally:
        await server.stop(0)
