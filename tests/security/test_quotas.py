"""Per-caller quotas: the call rate charged by size, KeepAlive messages and Watch opens; refused calls per
host; caps on calls in flight and on open streams."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.server import CallLimits, RendezvousServer, ServerConfig
from rendezvous.server.quotas import CallQuotas
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.redis_fixtures import fresh_prefix, redis_url, with_prefix
from tests.replicas.harness import eventually
from tests.security.conftest import serving
from tests.security.test_auth import DECODE, UNAUTHENTICATED, auth_file, bearer, call, refusal, register, request_for

__all__ = ["redis_url"]

RATE_LIMITED = (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED")
TOO_MANY = (grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_CONCURRENT_CALLS")


def fake_clock() -> tuple[list[float], Callable[[], float]]:
    now = [0.0]
    return now, lambda: now[0]


def test_a_burst_is_admitted_then_the_rate_applies() -> None:
    now, clock = fake_clock()
    quotas = CallQuotas(CallLimits(rate=2, burst=3), clock)
    for _ in range(3):
        quotas.admit("a")
    with pytest.raises(RendezvousError) as err:
        quotas.admit("a")
    assert err.value.reason == Reason.RATE_LIMITED
    now[0] += 0.5  # one token back at 2/s
    quotas.admit("a")
    with pytest.raises(RendezvousError):
        quotas.admit("a")


def test_callers_have_separate_buckets() -> None:
    _, clock = fake_clock()
    quotas = CallQuotas(CallLimits(rate=1, burst=1), clock)
    quotas.admit("a")
    quotas.admit("b")
    with pytest.raises(RendezvousError):
        quotas.admit("a")


def test_calls_in_flight_are_capped_per_caller() -> None:
    quotas = CallQuotas(CallLimits(concurrency=2))
    quotas.enter("a")
    quotas.enter("a")
    quotas.enter("b")
    with pytest.raises(RendezvousError) as err:
        quotas.enter("a")
    assert err.value.reason == Reason.TOO_MANY_CONCURRENT_CALLS
    quotas.leave("a")
    quotas.enter("a")


def test_negative_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        CallLimits(rate=-1)


async def test_a_caller_over_its_rate_is_told_to_back_off() -> None:
    server = RendezvousServer(ServerConfig(listen="127.0.0.1:0", call_limits=CallLimits(rate=0.001, burst=2)))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.RendezvousServiceStub(channel)
            for _ in range(2):
                await stub.GetStatus(pb.GetStatusRequest(), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    finally:
        await server.stop(0)
    converted = from_rpc_error(err.value)
    assert (converted.code, converted.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED")


def test_a_call_is_charged_by_its_size() -> None:
    _, clock = fake_clock()
    quotas = CallQuotas(CallLimits(rate=1, burst=10, cost_bytes=100), clock)
    assert quotas.cost(99) == 1 and quotas.cost(100) == 2 and quotas.cost(950) == 10
    quotas.admit("a", 950)  # ten calls' worth: the bucket is empty
    with pytest.raises(RendezvousError):
        quotas.admit("a")


def test_a_call_dearer_than_the_bucket_is_admitted_from_a_full_one_and_leaves_a_debt() -> None:
    now, clock = fake_clock()
    quotas = CallQuotas(CallLimits(rate=1, burst=2, cost_bytes=100), clock)
    quotas.admit("a", 499)  # costs 5 of a bucket of 2: 3 tokens owed
    now[0] += 3.5
    with pytest.raises(RendezvousError):
        quotas.admit("a")  # half a token
    now[0] += 0.5
    quotas.admit("a")


def test_refused_calls_are_counted_per_host() -> None:
    now, clock = fake_clock()
    quotas = CallQuotas(CallLimits(refusal_rate=1, refusal_burst=2), clock)
    quotas.refused("h1")
    quotas.check_refusals("h1")
    quotas.refused("h1")
    with pytest.raises(RendezvousError) as err:
        quotas.check_refusals("h1")
    assert err.value.reason == Reason.RATE_LIMITED
    quotas.check_refusals("h2")
    now[0] += 1
    quotas.check_refusals("h1")


def test_open_streams_are_capped_per_caller() -> None:
    quotas = CallQuotas(CallLimits(streams=1))
    quotas.open_stream("a")
    quotas.open_stream("b")
    with pytest.raises(RendezvousError) as err:
        quotas.open_stream("a")
    assert err.value.reason == Reason.TOO_MANY_CONCURRENT_CALLS
    quotas.close_stream("a")
    quotas.open_stream("a")


async def test_guessing_tokens_is_rate_limited_per_host(tmp_path: Path) -> None:
    """Past the refusal burst a host's unauthenticated calls are refused RATE_LIMITED before they are
    logged; a right token from the same host is still admitted (tests/security/test_refusal_limiter.py);
    the server stays SERVING."""
    limits = CallLimits(refusal_rate=0.001, refusal_burst=3)
    async with (
        serving(auth_file=auth_file(tmp_path), call_limits=limits) as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        for guess in range(3):
            outcome = await refusal(call(channel, "GetStatus", pb.GetStatusRequest(), f"guess-{guess:016d}"))
            assert outcome == UNAUTHENTICATED
        assert await refusal(call(channel, "GetStatus", pb.GetStatusRequest(), "guess-4")) == RATE_LIMITED
        assert (await register(channel, "decode-0", DECODE)).engine.engine_id == "decode-0"
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_every_keepalive_message_is_charged(tmp_path: Path) -> None:
    """A KeepAlive stream is not a way around the rate: each message costs a call, and the stream ends
    when the caller's bucket is empty."""
    async with (
        serving(auth_file=auth_file(tmp_path), call_limits=CallLimits(rate=0.001, burst=4)) as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        own = await register(channel, "decode-0", DECODE)  # 1
        stream = pb_grpc.RendezvousServiceStub(channel).KeepAlive(metadata=bearer(DECODE), timeout=10)
        renewal = pb.KeepAliveRequest(engine_id="decode-0", incarnation=own.engine.incarnation)
        for _ in range(3):  # 2, 3, 4
            await stream.write(renewal)
            assert (await stream.read()).engine_id == "decode-0"
        await stream.write(renewal)
        assert await refusal(stream.read()) == RATE_LIMITED


async def test_open_streams_per_identity_are_capped(tmp_path: Path) -> None:
    async with (
        serving(auth_file=auth_file(tmp_path), call_limits=CallLimits(streams=2)) as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        await register(channel, "decode-0", DECODE)
        stub = pb_grpc.RendezvousServiceStub(channel)

        def watch() -> grpc.aio.UnaryStreamCall:
            return stub.Watch(pb.WatchRequest(engine_id="decode-0"), metadata=bearer(DECODE), timeout=10)

        first, second = watch(), watch()
        for stream in (first, second):
            assert (await stream.read()).HasField("header")
        assert await refusal(watch().read()) == TOO_MANY
        second.cancel()
        # A closed stream gives its place back once the server sees the cancellation.
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            third = watch()
            try:
                assert (await third.read()).HasField("header")
                break
            except grpc.aio.AioRpcError as err:
                assert from_rpc_error(err).reason == "TOO_MANY_CONCURRENT_CALLS"
                assert asyncio.get_running_loop().time() < deadline, "the cancelled stream kept its place"
                await asyncio.sleep(0.02)
        first.cancel()
        third.cancel()


async def test_a_large_request_costs_more_than_a_small_one(tmp_path: Path) -> None:
    limits = CallLimits(rate=0.001, burst=20, cost_bytes=65_536)
    request = request_for("RegisterEngine", "decode-0")
    request.agents[0].metadata = bytes(1 << 20)
    cost = 1 + request.ByteSize() // 65_536
    assert 1 < cost < 20
    async with (
        serving(auth_file=auth_file(tmp_path), call_limits=limits) as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        await call(channel, "RegisterEngine", request, DECODE)
        listing = pb.ListTransfersRequest(engine_id="decode-0")
        for _ in range(20 - cost):
            await call(channel, "ListTransfers", listing, DECODE)
        assert await refusal(call(channel, "ListTransfers", listing, DECODE)) == RATE_LIMITED


async def test_calls_waiting_on_redis_are_capped_per_caller(redis_url: str) -> None:
    """With the memory store a call never waits, so nothing is ever in flight; with Redis, calls wait on
    its answers, and past the cap a caller's further calls are refused instead of queued. Redis holds the
    writes until the test has seen the refusals: a pause of a fixed time could end (on a loaded machine,
    before the last calls reached the server) with the first two answered and the rest admitted."""
    url = with_prefix(redis_url, fresh_prefix()) + "&socket_timeout=10&op_timeout=10"
    async with (
        serving(store=url, call_limits=CallLimits(concurrency=2)) as server,
        grpc.aio.insecure_channel(server.address) as channel,
    ):
        admin = redis.Redis.from_url(redis_url)
        admin.client_pause(9_000, all=False)  # every write waits until unpaused (at most 9 s), the server's too
        try:
            requests = [request_for("RegisterEngine", f"decode-{i}") for i in range(6)]
            calls = [asyncio.ensure_future(call(channel, "RegisterEngine", r, None)) for r in requests]
            await eventually(lambda: sum(c.done() for c in calls) >= 4, "four calls answered while two wait")
            assert sum(c.done() for c in calls) == 4  # the two admitted still wait on Redis
        finally:
            admin.client_unpause()
            admin.close()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
    refused = [from_rpc_error(o) for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert [(e.code, e.reason) for e in refused] == [TOO_MANY] * 4
    assert sum(isinstance(o, pb.RegisterEngineResponse) for o in outcomes) == 2
