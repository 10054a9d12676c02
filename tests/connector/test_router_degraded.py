"""The router while the rendezvous does not answer (degraded mode): requests go to decode engines alone, which
compute the prompt themselves (no transfer, so neither the router nor the engine calls the rendezvous), picked
from the router's last engine lists while those are at most --degraded-max-age old; past it, 503 as before. A real
rendezvous server that is stopped and started again, fake vLLM HTTP engines (tests/connector/test_router.py).
Before degraded mode every request got 503 rendezvous_unavailable until the rendezvous answered again. The circuit
opens as soon as a background refresh of an engine list goes unanswered, and a decode engine that refuses a
connection meanwhile, or takes none within the connect timeout, is left out of the picks."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc
import pytest
from aiohttp import ClientSession, ClientTimeout, web

from rendezvous.clients import AsyncRendezvousClient, EngineRole
from rendezvous.clients.testing import AsyncTestServer
from rendezvous.connector.launch import free_port
from rendezvous.connector.router import (
    LOCAL_UNREACHABLE,
    PREFILL_HEADER,
    REFUSAL_HEADER,
    RENDEZVOUS_UNAVAILABLE,
    Router,
    build_parser,
    rendezvous_config,
)
from tests.clients.conftest import GrpcProxy
from tests.connector.test_router import FLEET, LAYOUT, WAIT, Cluster, FakeEngine, cluster, server
from tests.factories import sdk_engine

__all__ = ["cluster", "server"]

REQUEST = {"model": "tiny", "prompt": "hi", "kv_transfer_params": {"transfer_id": "the-client-s"}}


class Clock:
    """The clock engine lists age by: moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def served(router: Router, timeout: float = WAIT) -> AsyncIterator[tuple[ClientSession, str]]:
    """The router's real HTTP server on a free port, and an HTTP client whose calls time out after `timeout`: the
    client and the server's base URL."""
    runner = web.AppRunner(router.app(), handler_cancellation=True)
    await runner.setup()
    try:
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        async with ClientSession(timeout=ClientTimeout(total=timeout)) as http:
            yield http, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def ask(http: ClientSession, base: str) -> tuple[int, str | None, str | None]:
    """One completion: its status, X-Kv-Prefill and X-Kv-Refusal."""
    async with http.post(f"{base}/v1/completions", json=REQUEST) as response:
        await response.read()
        return response.status, response.headers.get(PREFILL_HEADER), response.headers.get(REFUSAL_HEADER)


async def polled(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def metrics(http: ClientSession, base: str) -> str:
    async with http.get(f"{base}/metrics") as response:
        return await response.text()


async def register_again(cluster: Cluster) -> None:
    """After the rendezvous restarted (a fresh store): the engines register again ("p" in prefill, the others in
    decode)."""
    for name, engine in cluster.engines.items():
        pool, role = ("prefill", EngineRole.PRODUCER) if name == "p" else ("decode", EngineRole.CONSUMER)
        labels = {"url": f"http://127.0.0.1:{engine.port}"}
        await cluster.rendezvous.register_engine(
            sdk_engine(name, role, pool=pool, layout=LAYOUT, labels=labels, lease_ttl=60)
        )


def alone(engine: FakeEngine) -> int:
    """Requests the engine was sent alone (no transfer: degraded)."""
    return sum("kv_transfer_params" not in body for body in engine.bodies)


async def test_decode_engines_serve_alone_while_the_rendezvous_is_unreachable(
    server: AsyncTestServer, cluster: Cluster
) -> None:
    """The request that finds the rendezvous gone and every one after it go to the least loaded decode engine of
    the last list, without a call, with `X-Kv-Prefill: local-unreachable`; the client's transfer id is not passed
    on (the engine would wait for KV no one sends)."""
    prefill = await cluster.add("p", "prefill", EngineRole.PRODUCER)
    decodes = [await cluster.add(f"d{i}", "decode", EngineRole.CONSUMER) for i in range(2)]
    calls = 0

    def count() -> tuple[tuple[str, str], ...]:  # asked before every call the router's client makes
        nonlocal calls
        calls += 1
        return ()

    config = dataclasses.replace(rendezvous_config((server.address,), timeout=1.0), metadata_hook=count)
    router = Router(AsyncRendezvousClient(config), FLEET, refresh_interval=0.0, retry_after=3_600.0)
    async with served(router) as (http, base):
        assert (await ask(http, base))[:2] == (200, "remote")
        await asyncio.wait_for(asyncio.gather(*router._background), WAIT)
        await server.stop()
        for decode in decodes:
            decode.gate.clear()  # each holds what it is sent: the router's in-flight counts stay up
        first = asyncio.ensure_future(ask(http, base))  # finds the rendezvous gone: the circuit opens
        await polled(lambda: first.done() or sum(d.in_flight for d in decodes) == 1, "no answer, no decode")
        assert not first.done(), first.result()
        made = calls
        second = asyncio.ensure_future(ask(http, base))
        await polled(lambda: sum(d.in_flight for d in decodes) == 2, "the second request reached no decode")
        assert [d.in_flight for d in decodes] == [1, 1]  # the least loaded: the one the first did not take
        for decode in decodes:
            decode.gate.set()
        assert [await first, await second] == [(200, LOCAL_UNREACHABLE, None)] * 2
        assert calls == made  # the second made no call
        assert len(prefill.bodies) == 1
        degraded = [body for d in decodes for body in d.bodies if "kv_transfer_params" not in body]
        assert len(degraded) == 2
        text = await metrics(http, base)
        assert 'kv_rendezvous_router_local_prefills_total{why="local-unreachable"} 2.0' in text
        assert "kv_rendezvous_router_rendezvous_unreachable 1.0" in text


async def test_past_the_max_age_requests_are_refused_and_disaggregation_resumes(
    server: AsyncTestServer, cluster: Cluster
) -> None:
    """Decode engines take requests alone while the last list is at most --degraded-max-age old, then 503
    rendezvous_unavailable; once the probe finds the rendezvous again, requests are disaggregated again."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    await cluster.add("d", "decode", EngineRole.CONSUMER)
    clock = Clock()
    router = Router(
        AsyncRendezvousClient(rendezvous_config((server.address,), timeout=1.0)),
        FLEET,
        refresh_interval=0.0,
        retry_after=0.05,
        degraded_max_age=30.0,
        clock=clock,
    )
    async with served(router) as (http, base):
        assert (await ask(http, base))[:2] == (200, "remote")  # the decode list is taken at 0
        await server.stop()
        clock.now = 30.0
        assert await ask(http, base) == (200, LOCAL_UNREACHABLE, None)
        clock.now = 30.5
        assert await ask(http, base) == (503, None, RENDEZVOUS_UNAVAILABLE)
        await server.start()  # the same port, a fresh store: the engines register again
        await register_again(cluster)
        await asyncio.wait_for(router.reachable.wait(), WAIT)
        assert await ask(http, base) == (200, "remote", None)
        assert "kv_rendezvous_router_rendezvous_unreachable 0.0" in await metrics(http, base)


def test_the_max_age_is_a_flag() -> None:
    assert build_parser().parse_args(["--address", "a:1"]).degraded_max_age == 60.0
    assert build_parser().parse_args(["--address", "a:1", "--degraded-max-age", "0"]).degraded_max_age == 0.0


async def test_a_background_refresh_the_rendezvous_does_not_answer_opens_the_circuit(
    server: AsyncTestServer, cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A list past its refresh interval (but not so old that requests wait for it) is used while it is refreshed
    in the background. Before, a refresh the rendezvous did not answer only logged: requests went on out
    disaggregated, to engines that could not reach the rendezvous either. Now it opens the circuit as a request's
    unanswered call does (one warning, the gauge, the probe): the next request goes to a decode engine alone."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    await cluster.add("d", "decode", EngineRole.CONSUMER)
    calls = 0

    def count() -> tuple[tuple[str, str], ...]:
        nonlocal calls
        calls += 1
        return ()

    clock = Clock()
    config = dataclasses.replace(rendezvous_config((server.address,), timeout=1.0), metadata_hook=count)
    router = Router(AsyncRendezvousClient(config), FLEET, refresh_interval=1.0, retry_after=3_600.0, clock=clock)
    async with served(router) as (http, base):
        assert (await ask(http, base))[:2] == (200, "remote")  # the lists are taken at 0
        await server.stop()
        clock.now = 1.5  # past one refresh interval, under WAIT_AFTER_INTERVALS: refreshed in the background
        with caplog.at_level(logging.WARNING, logger="rendezvous.connector.router"):
            assert (await ask(http, base))[:2] == (200, "remote")  # on the stale lists, no wait
            await router.engines.refreshed()  # both lists' refreshes went unanswered
        made = calls
        assert await ask(http, base) == (200, LOCAL_UNREACHABLE, None)
        assert calls == made  # no call: the circuit is open
        assert "kv_rendezvous_router_rendezvous_unreachable 1.0" in await metrics(http, base)
        opened = [r for r in caplog.records if "the rendezvous is not answering" in r.getMessage()]
        assert len(opened) == 1, opened


async def test_a_background_refresh_refused_by_an_answer_leaves_the_circuit_closed(
    server: AsyncTestServer, cluster: Cluster
) -> None:
    """An error status is an answer: the rendezvous (or a front of it) is there, the circuit stays closed and
    requests are disaggregated on the stale lists, as before (fails if any failed refresh opened the circuit)."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    await cluster.add("d", "decode", EngineRole.CONSUMER)
    proxy = GrpcProxy(server.address)
    await proxy.start()
    clock = Clock()
    client = AsyncRendezvousClient(rendezvous_config((proxy.address,), timeout=1.0))
    router = Router(client, FLEET, refresh_interval=1.0, retry_after=3_600.0, clock=clock)
    try:
        async with served(router) as (http, base):
            assert (await ask(http, base))[:2] == (200, "remote")
            proxy.refuse("ListEngines", grpc.StatusCode.PERMISSION_DENIED)
            clock.now = 1.5
            assert (await ask(http, base))[:2] == (200, "remote")
            await router.engines.refreshed()
            assert proxy.ends["ListEngines"][-1][1] == grpc.StatusCode.PERMISSION_DENIED  # refreshed, refused
            assert router.reachable.is_set()
            assert (await ask(http, base))[:2] == (200, "remote")
    finally:
        await proxy.close()


async def test_a_decode_engine_that_refuses_connections_is_left_out_until_the_circuit_closes(
    server: AsyncTestServer, cluster: Cluster
) -> None:
    """A decode engine died during the outage: it stays on the last list. Before, every request picked for it got
    502 until the list aged out. Now the request that finds its connection refused (it never reached the engine)
    goes to the next engine, and later picks leave the dead one out, even once it is back, until the circuit
    closes and the router lists the engines afresh."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    live, dead = [await cluster.add(f"d{i}", "decode", EngineRole.CONSUMER) for i in range(2)]
    client = AsyncRendezvousClient(rendezvous_config((server.address,), timeout=1.0))
    router = Router(client, FLEET, refresh_interval=0.0, retry_after=0.05, clock=Clock())
    async with served(router) as (http, base):
        assert (await ask(http, base))[:2] == (200, "remote")
        await server.stop()
        await dead.stop()
        for _ in range(4):  # in turn, the picks would alternate between the two
            assert await ask(http, base) == (200, LOCAL_UNREACHABLE, None)
        assert (alone(live), alone(dead)) == (4, 0)
        await dead.start()  # back on its port: still left out while the circuit is open
        for _ in range(2):
            assert await ask(http, base) == (200, LOCAL_UNREACHABLE, None)
        assert (alone(live), alone(dead)) == (6, 0)
        await server.start()
        await register_again(cluster)
        await asyncio.wait_for(router.reachable.wait(), WAIT)
        for _ in range(2):  # round robin over both again
            assert (await ask(http, base))[:2] == (200, "remote")
        assert len(dead.bodies) == 1


async def test_an_engine_s_error_answer_leaves_it_in_and_none_left_is_a_503(
    server: AsyncTestServer, cluster: Cluster
) -> None:
    """An engine that answers, even with an error, is not left out (its answer is passed on); once every listed
    decode engine refused a connection, requests get 503 rendezvous_unavailable as with none listed, and are not
    counted as sent to a decode engine alone (they were). Before, a refused connection was a 502."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    failing, dead = [await cluster.add(f"d{i}", "decode", EngineRole.CONSUMER) for i in range(2)]
    client = AsyncRendezvousClient(rendezvous_config((server.address,), timeout=1.0))
    router = Router(client, FLEET, refresh_interval=0.0, retry_after=3_600.0, clock=Clock())
    async with served(router) as (http, base):
        assert (await ask(http, base))[:2] == (200, "remote")
        await server.stop()
        await dead.stop()
        failing.status = 500
        for _ in range(2):
            assert await ask(http, base) == (500, LOCAL_UNREACHABLE, None)
        assert alone(failing) == 2
        await failing.stop()
        assert await ask(http, base) == (503, None, RENDEZVOUS_UNAVAILABLE)
        local = 'kv_rendezvous_router_local_prefills_total{why="local-unreachable"}'
        assert f"{local} 2.0" in await metrics(http, base)  # the 503 reached no engine: not counted


async def test_a_request_sent_on_past_a_refused_connection_is_counted_once(
    server: AsyncTestServer, cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """`local_prefills_total{why="local-unreachable"}` counts requests: before, it counted each engine a request
    was tried on, so the request that found the dead engine first counted twice (3 for 2 requests)."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    live, dead = [await cluster.add(f"d{i}", "decode", EngineRole.CONSUMER) for i in range(2)]
    client = AsyncRendezvousClient(rendezvous_config((server.address,), timeout=1.0))
    router = Router(client, FLEET, refresh_interval=0.0, retry_after=3_600.0, clock=Clock())
    async with served(router) as (http, base):
        assert (await ask(http, base))[:2] == (200, "remote")
        await server.stop()
        await dead.stop()
        with caplog.at_level(logging.WARNING, logger="rendezvous.connector.router"):
            for _ in range(2):  # in turn, one of the two tries the dead engine first
                assert await ask(http, base) == (200, LOCAL_UNREACHABLE, None)
        left_out = [r for r in caplog.records if "leaving it out" in r.getMessage()]
        assert len(left_out) == 1, left_out
        assert alone(live) == 2
        assert 'kv_rendezvous_router_local_prefills_total{why="local-unreachable"} 2.0' in await metrics(http, base)


async def test_a_decode_engine_that_takes_no_connection_is_left_out(
    server: AsyncTestServer, cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A decode engine's host went down during the outage: its packets are dropped, nothing refuses the
    connection. Before --connect-timeout, the request picked for it waited for the whole --timeout (600 s; here
    the test client's 30 s ran out first) and the engine was never left out. Now the connection not taken within
    the connect timeout is answered as a refused one: the request goes to the next engine, the dark one is left out."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    live, dark = [await cluster.add(f"d{i}", "decode", EngineRole.CONSUMER) for i in range(2)]
    client = AsyncRendezvousClient(rendezvous_config((server.address,), timeout=1.0))
    router = Router(client, FLEET, refresh_interval=0.0, retry_after=3_600.0, connect_timeout=0.2, clock=Clock())
    async with served(router, 30.0) as (http, base):  # not the router's 600 s
        assert (await ask(http, base))[:2] == (200, "remote")
        await server.stop()
        await dark.go_dark()
        with caplog.at_level(logging.WARNING, logger="rendezvous.connector.router"):
            for _ in range(2):  # in turn, one of the two tries the dark engine first
                assert await ask(http, base) == (200, LOCAL_UNREACHABLE, None)
        left_out = [r.getMessage() for r in caplog.records if "leaving it out" in r.getMessage()]
        assert len(left_out) == 1 and "decode engine d1 " in left_out[0], left_out
        assert alone(live) == 2
