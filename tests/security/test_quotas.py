"""Per-caller quotas: a token bucket for the call rate and a cap on calls in flight."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from clients._exceptions import from_rpc_error
from rendezvous.core.errors import Reason, RendezvousError
from rendezvous.server import CallLimits, RendezvousServer, ServerConfig
from rendezvous.server.quotas import CallQuotas
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc


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
