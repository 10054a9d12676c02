"""Invalid-request back-off (rendezvous.server.backoff): a caller whose large request was refused as invalid has
its next requests as large refused unread, for ten times what the refused one cost; no one else is affected.

The unit tests move a fake clock; the service test freezes the server's clock, so the back-off cannot end on
its own while the test runs, whatever the machine's speed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.core.limits import Limits
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.server import CallLimits, RendezvousServer, ServerConfig
from rendezvous.server.backoff import FACTOR, MAX_WAIT, InvalidBackoff
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
    backoff.refused("a", 5_000, cost=0.02)
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
        backoff.refused("a", 8_000, cost=0.01)
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
    backoff.refused("a", 999, cost=1.0)
    backoff.check("a", 10_000)
    backoff.refused("a", 2_000, cost=1.0)
    with pytest.raises(RendezvousError):
        backoff.check("a", 2_000)
    backoff.passed("a", 1_500)  # smaller than the refused one: proves nothing
    with pytest.raises(RendezvousError):
        backoff.check("a", 2_000)
    backoff.passed("a", 2_000)
    backoff.check("a", 2_000)
    off = InvalidBackoff(0, clock)
    off.refused("a", 10_000, cost=1.0)
    off.check("a", 10_000)


ENGINE = "tok-backoff-engine-5e1d7c"
ROUTER = "tok-backoff-router-a93b02"
AUTH = {"tokens": {ENGINE: {"name": "e", "engines": ["p0"]}, ROUTER: {"name": "router", "roles": ["router"]}}}


@pytest.fixture
async def frozen(tmp_path: Path) -> AsyncIterator[RendezvousServer]:
    """A server whose clock stands still (at the wall clock's time), parts capped at 100 per request."""
    now = time.time()
    config = ServerConfig(
        listen="127.0.0.1:0",
        grace=0.1,
        auth_file=auth_file(tmp_path, AUTH),
        limits=Limits(max_parts_per_request=100),
        call_limits=CallLimits(invalid_backoff_bytes=1_000),
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
        # As large again: refused before it is read (these bytes are no message at all), with a retry hint.
        raw = channel.unary_unary("/rendezvous.v1.RendezvousService/CompleteTransfers")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw(b"\xff" * size, metadata=engine, timeout=30)
        refused = from_rpc_error(err.value)
        assert (refused.code, refused.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED")
        assert refused.retry_after is not None and refused.retry_after > 0
        # The same caller's small requests, and every other identity's, are served.
        small = pb.CompleteTransfersRequest(
            engine_id="p0",
            incarnation=incarnation,
            completions=[pb.CompletionSpec(transfer_id="t", outcome=pb.COMPLETION_OUTCOME_SUCCEEDED)],
        )
        answer = await stub.CompleteTransfers(small, metadata=engine, timeout=30)
        assert error_reason(answer.results[0]) == "TRANSFER_NOT_FOUND"
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
