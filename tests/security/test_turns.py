"""Fair turns (rendezvous.server.turns): a caller's backlog waits in its own queue, turns go round robin.

Unit tests drive FairTurns with events, not time; the service test holds the only turn on a real server and
checks which waiting calls are served first and that a caller's excess is refused before it is parsed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.server import CallLimits, RendezvousServer
from rendezvous.server.turns import FairTurns
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.replicas.harness import eventually
from tests.security.conftest import serving
from tests.security.test_auth import auth_file, bearer

ROUTER = "tok-turns-router-4d0c9a7e"
OPS = "tok-turns-ops-81b2f3c5d6"
AUTH = {"tokens": {ROUTER: {"name": "router", "roles": ["router"]}, OPS: {"name": "ops", "roles": ["admin"]}}}


async def _hold(turns: FairTurns, caller: str, log: list[str], release: asyncio.Event, size: int = 0) -> None:
    async with turns.turn(caller, size):
        log.append(caller)
        await release.wait()


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_waiting_callers_are_served_round_robin_whatever_their_backlog() -> None:
    turns = FairTurns(slots=1, max_waiting=100)
    log: list[str] = []
    gate = asyncio.Event()
    holder = asyncio.create_task(_hold(turns, "first", log, gate))
    await _settle()
    # A flooder queues 5 calls, then two light callers one each.
    done = asyncio.Event()
    done.set()
    tasks = [asyncio.create_task(_hold(turns, "flood", log, done)) for _ in range(5)]
    await _settle()
    tasks += [asyncio.create_task(_hold(turns, name, log, done)) for name in ("light-a", "light-b")]
    await _settle()
    assert turns.waiting == 7
    gate.set()
    await asyncio.gather(holder, *tasks)
    # Each light caller waits for one flood call at most, not for the flood's whole backlog.
    assert log == ["first", "flood", "light-a", "light-b", "flood", "flood", "flood", "flood"]
    assert turns.waiting == 0


async def test_a_caller_past_its_waiting_calls_is_refused_with_a_retry_hint() -> None:
    turns = FairTurns(slots=1, max_waiting=2)
    gate = asyncio.Event()
    log: list[str] = []
    holder = asyncio.create_task(_hold(turns, "x", log, gate))
    waiting = [asyncio.create_task(_hold(turns, "x", log, gate)) for _ in range(2)]
    await _settle()
    with pytest.raises(RendezvousError) as err:
        async with turns.turn("x"):
            raise AssertionError("admitted past max_waiting")
    assert err.value.reason == Reason.TOO_MANY_CONCURRENT_CALLS and err.value.retry_after
    # Another caller still queues.
    other = asyncio.create_task(_hold(turns, "y", log, gate))
    await _settle()
    assert turns.waiting == 3
    gate.set()
    await asyncio.gather(holder, *waiting, other)
    assert log == ["x", "x", "y", "x"]


async def test_a_caller_past_its_waiting_bytes_is_refused_but_its_first_waiting_call_never_is() -> None:
    turns = FairTurns(slots=1, max_waiting=100, max_waiting_bytes=1_000)
    gate = asyncio.Event()
    log: list[str] = []
    holder = asyncio.create_task(_hold(turns, "x", log, gate))
    await _settle()
    # A first waiting call larger than the bound still waits (else it could never be served on a busy server).
    big = asyncio.create_task(_hold(turns, "x", log, gate, size=5_000))
    await _settle()
    assert (turns.waiting, turns.waiting_bytes) == (1, 5_000)
    with pytest.raises(RendezvousError) as err:
        async with turns.turn("x", 1):
            raise AssertionError("admitted past max_waiting_bytes")
    assert err.value.reason == Reason.TOO_MANY_CONCURRENT_CALLS and err.value.retry_after
    assert err.value.metadata["limit_bytes"] == "1000"
    # Another caller queues whatever x holds waiting.
    other = asyncio.create_task(_hold(turns, "y", log, gate, size=900))
    await _settle()
    assert (turns.waiting, turns.waiting_bytes) == (2, 5_900)
    gate.set()
    await asyncio.gather(holder, big, other)
    assert log == ["x", "x", "y"]
    assert (turns.waiting, turns.waiting_bytes) == (0, 0)


async def test_a_cancelled_waiter_leaves_the_queue_and_a_cancelled_holder_passes_its_turn_on() -> None:
    turns = FairTurns(slots=1, max_waiting=10)
    gate = asyncio.Event()
    log: list[str] = []
    holder = asyncio.create_task(_hold(turns, "a", log, gate))
    await _settle()
    gone = asyncio.create_task(_hold(turns, "b", log, gate))
    after = asyncio.create_task(_hold(turns, "c", log, gate))
    await _settle()
    gone.cancel()
    await _settle()
    assert turns.waiting == 1
    holder.cancel()  # the turn goes to c
    await _settle()
    assert log == ["a", "c"]
    gate.set()
    await after
    # Everything released: the one slot is free again.
    async with turns.turn("d"):
        assert turns.waiting == 0


@pytest.fixture
async def one_turn(tmp_path: Path) -> AsyncIterator[RendezvousServer]:
    limits = CallLimits(turns=1, waiting=2, waiting_bytes=1_000)
    async with serving(auth_file=auth_file(tmp_path, AUTH), call_limits=limits) as server:
        yield server


async def test_on_a_server_a_caller_past_its_waiting_calls_or_bytes_is_refused_unparsed(
    one_turn: RendezvousServer,
) -> None:
    guard_turns = one_turn.turns
    assert guard_turns is not None
    router = bearer(ROUTER)
    async with grpc.aio.insecure_channel(one_turn.address) as channel:
        stub = pb_grpc.RendezvousServiceStub(channel)
        raw = channel.unary_unary("/rendezvous.v1.RendezvousService/GetStatus")

        async def refused_unparsed(junk: bytes) -> dict[str, str]:
            # Refused before it is parsed (its bytes are no message at all), with a retry hint.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw(junk, metadata=router, timeout=30)
            refused = from_rpc_error(err.value)
            assert (refused.code, refused.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_CONCURRENT_CALLS")
            assert refused.retry_after is not None
            return refused.metadata

        async with guard_turns.turn("held by the test"):  # the only turn
            first = asyncio.ensure_future(stub.GetStatus(pb.GetStatusRequest(), metadata=router, timeout=30))
            await eventually(lambda: guard_turns.waiting == 1, "the router's call waiting for its turn")
            # 2,000 bytes more would pass the router's 1,000 bytes of waiting requests.
            assert (await refused_unparsed(b"\xff" * 2_000))["limit_bytes"] == "1000"
            junk = asyncio.ensure_future(raw(b"\xff\xff not a message", metadata=router, timeout=30))
            await eventually(lambda: guard_turns.waiting == 2, "a small one waiting")
            # The router's third call finds its two waiting places taken.
            assert (await refused_unparsed(b"\xff\xff not a message"))["limit"] == "2"
            # Another identity still gets its place in the queue.
            other = asyncio.ensure_future(stub.GetStatus(pb.GetStatusRequest(), metadata=bearer(OPS), timeout=30))
            await eventually(lambda: guard_turns.waiting == 3, "the admin's call waiting too")
        assert (await first).header.server_id and (await other).header.server_id
        # In its turn, bytes that are no message are INVALID_ARGUMENT with a reason.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await junk
        assert from_rpc_error(err.value).reason == "MESSAGE_INVALID"
