"""The router under bad input and failing neighbours: every client gets a clear answer at once, and nothing the
router holds (credit, connections) waits on a neighbour that cannot help. Found by an audit of the router; each test
failed before its fix. A real rendezvous server, fake vLLM HTTP engines (engines are external to the router)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from typing import Any

import pytest
from aiohttp import ClientPayloadError, ClientSession, ClientTimeout, TCPConnector, web

from rendezvous.clients import (
    AsyncRendezvousClient,
    ClientConfig,
    EngineCapacity,
    EngineRole,
    KvLayout,
    RetryPolicy,
    TransferState,
)
from rendezvous.clients.testing import AsyncTestServer
from rendezvous.connector.launch import free_port
from rendezvous.connector.router import (
    LOCAL_UNREACHABLE,
    PREFILL_HEADER,
    REFUSAL_HEADER,
    Route,
    Router,
    build_parser,
    rendezvous_config,
)
from tests.clients.conftest import GrpcProxy
from tests.connector.test_router import (
    FLEET,
    LAYOUT,
    WAIT,
    Cluster,
    FakeEngine,
    cluster,
    make_router,
    server,
)
from tests.factories import sdk_engine

__all__ = ["cluster", "make_router", "server"]


async def post_raw(router: Any, data: bytes) -> tuple[int, str]:
    url = f"http://127.0.0.1:{router.port}/v1/completions"
    async with router.http.post(url, data=data, headers={"Content-Type": "application/json"}) as response:
        return response.status, await response.text()


@pytest.mark.parametrize(
    "data",
    [
        json.dumps({"model": "tiny", "prompt": "hi", "kv_transfer_params": [["a", 1]]}).encode(),
        json.dumps({"model": "tiny", "prompt": "hi", "kv_transfer_params": "abc"}).encode(),
        json.dumps({"model": "tiny", "prompt": "hi", "kv_transfer_params": 5}).encode(),
        b"[" * 100_000 + b"]" * 100_000,  # under the body limit, deeper than the parser recurses
    ],
    ids=["params-a-list", "params-a-string", "params-a-number", "nested-too-deep"],
)
async def test_a_malformed_request_is_a_400_not_a_500(cluster: Cluster, make_router: Any, data: bytes) -> None:
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    await cluster.add("d", "decode", EngineRole.CONSUMER, capacity=1)
    router = await make_router(FLEET)
    status, text = await post_raw(router, data)
    assert status == 400, text


class CuttingEngine(FakeEngine):
    """Streams one event, then drops its connection: an engine that crashed mid-answer."""

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        await stream.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        assert request.transport is not None
        request.transport.abort()  # no [DONE], no end of the chunked stream
        return stream


async def test_a_stream_decode_cuts_reaches_the_client_cut(cluster: Cluster, make_router: Any) -> None:
    """The client had its 200 and a first event; before, the router then returned a second (502) response
    nobody could send, and the client waited for the rest of a stream that neither went on nor ended."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    engine = CuttingEngine("d")
    await engine.start()
    cluster.engines["d"] = engine
    labels = {"url": f"http://127.0.0.1:{engine.port}"}
    await cluster.rendezvous.register_engine(
        sdk_engine("d", EngineRole.CONSUMER, pool="decode", layout=LAYOUT, labels=labels, lease_ttl=60)
    )
    router = await make_router(FLEET)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "stream": True}
    received = b""

    async def read() -> None:
        nonlocal received
        async with router.http.post(f"http://127.0.0.1:{router.port}/v1/completions", json=body) as response:
            assert response.status == 200
            async for chunk in response.content.iter_any():
                received += chunk

    with pytest.raises(ClientPayloadError):  # a broken stream, not a complete one, and not a wait
        await asyncio.wait_for(read(), WAIT)
    assert received.startswith(b"data: ")


async def test_a_prompt_larger_than_every_decode_engine_is_refused_at_once(cluster: Cluster, make_router: Any) -> None:
    """A prompt of 9 blocks (of the engine's 32 tokens) and decode engines that admit 8: before, it waited out the
    queue (30 s by default),
    then got 503 queue_timeout. No wait helps it: 413 too_large at once."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    engine = FakeEngine("d")
    await engine.start()
    cluster.engines["d"] = engine
    labels = {"url": f"http://127.0.0.1:{engine.port}"}
    capacity = EngineCapacity(max_transfers=4, max_blocks=8)
    await cluster.rendezvous.register_engine(
        sdk_engine(
            "d", EngineRole.CONSUMER, pool="decode", layout=LAYOUT, labels=labels, lease_ttl=60, capacity=capacity
        )
    )
    router = await make_router(FLEET, max_queued=4, queue_timeout=3_600.0)
    body = {"model": "tiny", "prompt": list(range(32 * 9)), "max_tokens": 8}
    url = f"http://127.0.0.1:{router.port}/v1/completions"
    async with router.http.post(url, json=body) as response:  # the session's timeout is WAIT, far below the queue's
        assert response.status == 413 and response.headers[REFUSAL_HEADER] == "too_large"


async def test_an_answer_is_not_held_back_by_giving_its_credit_back(server: AsyncTestServer, cluster: Cluster) -> None:
    """Decode answered while the rendezvous was unreachable: before, the answer waited for ReleaseCredits to give
    up (the client's whole retry deadline; every answer paid that round trip). The credit goes back after it."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    decode = await cluster.add("d", "decode", EngineRole.CONSUMER, capacity=1)
    slow = RetryPolicy(deadline=3_600.0)  # a release that fails keeps trying far longer than the test waits
    client = AsyncRendezvousClient(ClientConfig(targets=(server.address,), call_timeout=2.0, retry=slow))
    router = Router(client, FLEET, refresh_interval=0.0)
    runner = web.AppRunner(router.app(), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        decode.gate.clear()
        async with ClientSession(timeout=ClientTimeout(total=WAIT)) as http:
            body = {"model": "tiny", "prompt": "hi"}
            request = asyncio.ensure_future(http.post(f"http://127.0.0.1:{port}/v1/completions", json=body))
            await asyncio.wait_for(decode.received.wait(), WAIT)
            await server.stop()  # the rendezvous goes away while decode computes
            decode.gate.set()
            async with await request as response:
                assert response.status == 200
    finally:
        for task in router._background:  # a release that cannot succeed: not waited for at cleanup
            task.cancel()
        await runner.cleanup()


async def test_engine_legs_are_not_capped_by_an_http_pool_of_the_router(cluster: Cluster, make_router: Any) -> None:
    """150 requests at once to engines that declare no capacity: every decode leg reaches its engine (aiohttp's
    default pool held the router to 100 connections, the others waiting inside it after their admission)."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    decode = await cluster.add("d", "decode", EngineRole.CONSUMER)
    decode.gate.clear()  # every decode answer is held (a long generation)
    router = await make_router(FLEET)
    async with ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=3 * WAIT)) as http:

        async def one() -> int:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            async with http.post(url, json={"model": "tiny", "prompt": "hi"}) as response:
                await response.read()
                return response.status

        tasks = [asyncio.create_task(one()) for _ in range(150)]
        try:
            await asyncio.wait_for(decode.wait_bodies(150), 2 * WAIT)
        finally:
            decode.gate.set()
        assert await asyncio.gather(*tasks) == [200] * 150


async def test_a_decode_engine_that_takes_no_connection_is_a_502_and_aborts_the_transfer(
    cluster: Cluster, make_router: Any
) -> None:
    """A decode engine whose host went down (packets dropped, nothing refused): before --connect-timeout the
    request waited for the whole --timeout (600 s; here the test client's WAIT ran out first). Now the connection
    not taken within the connect timeout fails the decode leg as a refused one does: 502, the transfer aborted."""
    prefill = await cluster.add("p", "prefill", EngineRole.PRODUCER)
    decode = await cluster.add("d", "decode", EngineRole.CONSUMER)
    await decode.go_dark()
    router = await make_router(FLEET, connect_timeout=0.2)
    status, body = await router.complete("tiny")
    assert status == 502 and "Connection timeout" in body["error"]["message"], body
    await asyncio.wait_for(prefill.wait_bodies(1), WAIT)
    await cluster.transfer(prefill.bodies[0]["kv_transfer_params"]["transfer_id"], TransferState.ABORTED)


def test_the_connect_timeout_is_a_flag() -> None:
    assert build_parser().parse_args(["--address", "a:1"]).connect_timeout == 5.0
    assert build_parser().parse_args(["--address", "a:1", "--connect-timeout", "0.5"]).connect_timeout == 0.5


class OddModelsEngine(FakeEngine):
    """Answers /v1/models with `listing` instead of an OpenAI list."""

    def __init__(self, name: str, listing: Any) -> None:
        super().__init__(name)
        self.listing = listing

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(self.listing)


@pytest.mark.parametrize("listing", [[{"id": "m"}], {"data": [{"id": ["m"]}]}, {"data": 5}], ids=["list", "id", "data"])
async def test_an_engine_s_odd_model_list_leaves_the_others_listed(
    cluster: Cluster, make_router: Any, listing: Any
) -> None:
    """Before, a JSON list, or an id that cannot be a key, raised out of /v1/models: a 500 for every route."""
    await cluster.add("pa", "prefill-a", EngineRole.PRODUCER)
    await cluster.add("da", "decode-a", EngineRole.CONSUMER)
    odd = OddModelsEngine("db", listing)
    await odd.start()
    cluster.engines["db"] = odd
    labels = {"url": f"http://127.0.0.1:{odd.port}"}
    await cluster.rendezvous.register_engine(
        sdk_engine("db", EngineRole.CONSUMER, pool="decode-b", layout=LAYOUT, labels=labels, lease_ttl=60)
    )
    routes = {"a": Route(("prefill-a",), ("decode-a",)), "b": Route(("prefill-a",), ("decode-b",))}
    router = await make_router(routes)
    async with router.http.get(f"http://127.0.0.1:{router.port}/v1/models") as response:
        assert response.status == 200
        assert [m["id"] for m in (await response.json())["data"]] == ["model-of-da"]


async def decode_with_capacity(cluster: Cluster, capacity: EngineCapacity, layout: KvLayout = LAYOUT) -> FakeEngine:
    """A fake decode engine "d" in pool "decode" that declares `capacity`."""
    engine = FakeEngine("d")
    await engine.start()
    cluster.engines["d"] = engine
    labels = {"url": f"http://127.0.0.1:{engine.port}"}
    await cluster.rendezvous.register_engine(
        sdk_engine(
            "d", EngineRole.CONSUMER, pool="decode", layout=layout, labels=labels, lease_ttl=60, capacity=capacity
        )
    )
    return engine


@pytest.mark.parametrize("engine_block", [32, 8])
async def test_credit_is_counted_in_the_decode_engine_s_blocks(
    cluster: Cluster, make_router: Any, engine_block: int
) -> None:
    """The router hashes prompts in blocks of its --prefix-block (16 here), but the credit it reserves is the
    engine's: its RegisterTargets counts the engine's own KV blocks. Before, a 320-token prompt reserved 20 blocks
    whatever the engine's block size: twice too many on an engine of 32-token blocks, half too few on one of 8."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER, layout=dataclasses.replace(LAYOUT, block_size=engine_block))
    layout = dataclasses.replace(LAYOUT, block_size=engine_block)
    engine = await decode_with_capacity(cluster, EngineCapacity(max_transfers=4, max_blocks=1_000), layout)
    engine.gate.clear()  # decode holds the request, and the router its reservation
    router = await make_router(FLEET)
    assert router.router.prompts.block_tokens == 16
    body = {"model": "tiny", "prompt": list(range(320)), "max_tokens": 8}
    request = asyncio.ensure_future(router.http.post(f"http://127.0.0.1:{router.port}/v1/completions", json=body))
    try:
        await asyncio.wait_for(engine.wait_bodies(1), WAIT)
        info = await cluster.rendezvous.get_engine("d")
        assert info.credits.blocks == 320 // engine_block
    finally:
        engine.gate.set()
        async with await request as response:
            assert response.status == 200


async def test_a_prompt_that_fits_the_engine_s_blocks_is_not_too_large(cluster: Cluster, make_router: Any) -> None:
    """144 tokens are 9 blocks of the router's 16 tokens but 5 of the decode engine's 32, which admits 8: before,
    413 too_large."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    await decode_with_capacity(cluster, EngineCapacity(max_transfers=4, max_blocks=8))
    router = await make_router(FLEET)
    body = {"model": "tiny", "prompt": list(range(16 * 9)), "max_tokens": 8}
    async with router.http.post(f"http://127.0.0.1:{router.port}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()


class Relay:
    """A TCP relay in front of the rendezvous (127.0.0.1, a free port). While `mute`, what the rendezvous sends
    back is dropped: calls reach it and are applied, their answers are lost in transit. `cut` closes every
    connection (the client reconnects: a connection that lost frames cannot be trusted again) and unmutes."""

    def __init__(self, target: str) -> None:
        self.host, _, port = target.rpartition(":")
        self.target_port = int(port)
        self.mute = False
        self.port = free_port()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(self.host, self.target_port)
        self._writers += [client_writer, server_writer]

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, answers: bool) -> None:
            with contextlib.suppress(OSError):
                while data := await reader.read(65536):
                    if not (answers and self.mute):
                        writer.write(data)
                        await writer.drain()
            writer.close()

        await asyncio.gather(pipe(client_reader, server_writer, False), pipe(server_reader, client_writer, True))

    def cut(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        self.mute = False

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def reserved_transfers(cluster: Cluster, engine_id: str = "d") -> int:
    """Reservations that hold credit on the engine now (read from the rendezvous directly)."""
    return (await cluster.rendezvous.get_engine(engine_id)).credits.transfers_reserved


async def test_a_reservation_whose_answer_is_lost_is_released(server: AsyncTestServer, cluster: Cluster) -> None:
    """ReserveCredits reached the rendezvous, which granted it, but the answer was lost on the way back (the call
    timed out): the router answered the request without it (503; now on the decode engine alone, degraded mode) and
    went on, and the credit stayed held until its TTL (60 s), though nothing would use it. The router now releases
    it as soon as the rendezvous answers again."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    await decode_with_capacity(cluster, EngineCapacity(max_transfers=4))
    relay = Relay(server.address)
    await relay.start()
    quick = ClientConfig(targets=(f"127.0.0.1:{relay.port}",), call_timeout=0.5, retry=RetryPolicy(deadline=0.5))
    router = Router(AsyncRendezvousClient(quick), FLEET, refresh_interval=3_600.0, max_queued=0)
    runner = web.AppRunner(router.app(), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        async with ClientSession(timeout=ClientTimeout(total=WAIT)) as http:
            async with http.post(url, json={"model": "tiny", "prompt": "hi"}) as response:
                assert response.status == 200
            await asyncio.wait_for(asyncio.gather(*router._background), WAIT)  # its credit given back
            await router.engines.rank_engines(("decode",), EngineRole.CONSUMER)  # listed: no ListEngines next
            await router.engines.rank_engines(("prefill",), EngineRole.PRODUCER)
            assert await reserved_transfers(cluster) == 0
            relay.mute = True  # the next request's only call, ReserveCredits, is applied; its answer is lost
            async with http.post(url, json={"model": "tiny", "prompt": "hi"}) as response:
                assert response.headers[PREFILL_HEADER] == LOCAL_UNREACHABLE, await response.text()
            # It was granted at the rendezvous (before the fix it stayed held, below); the router's release may
            # have reached it already (only answers are lost), or is retried once the relay is cut.
            relay.cut()
            deadline = asyncio.get_running_loop().time() + WAIT  # far under the reservation's TTL (60 s)
            while await reserved_transfers(cluster):
                assert asyncio.get_running_loop().time() < deadline, "the lost reservation was never released"
                await asyncio.sleep(0.05)  # polled, as Cluster.transfer polls
    finally:
        await runner.cleanup()
        await relay.stop()


async def serve(router: Router) -> tuple[web.AppRunner, str]:
    """The router's real HTTP server on a free port; its completions URL."""
    runner = web.AppRunner(router.app(), handler_cancellation=True)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/v1/completions"


async def test_a_client_gone_while_its_reservation_is_in_flight_gets_its_credit_back(
    server: AsyncTestServer, cluster: Cluster
) -> None:
    """The client went away while the router's ReserveCredits was on its way to the rendezvous. Before, the router
    cancelled the call and sent ReleaseCredits at once, which reached the rendezvous first and found nothing; the
    reservation then held the engine's credit until its TTL (60 s). Now the call goes on and what it granted is
    released once it is answered."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    await decode_with_capacity(cluster, EngineCapacity(max_transfers=4))
    proxy = GrpcProxy(server.address)
    await proxy.start()
    # No deadline on the router's calls: the reservation waits at the proxy for as long as the steps below take
    # (a 2 s wait among them). With one, a loaded machine could pass it first: the call ended unanswered, its credit
    # released before the proxy let it through, and granted after that, held until its TTL.
    config = ClientConfig(targets=(proxy.address,), call_timeout=None, retry=RetryPolicy(deadline=None))
    router = Router(AsyncRendezvousClient(config), FLEET, refresh_interval=3_600.0, max_queued=0)
    runner, url = await serve(router)
    try:
        async with ClientSession(timeout=ClientTimeout(total=WAIT)) as http:

            async def ask() -> None:
                async with http.post(url, json={"model": "tiny", "prompt": "hi"}) as response:
                    await response.read()

            proxy.delay("ReserveCredits")  # held on its way: the rendezvous has not seen it yet
            asking = asyncio.ensure_future(ask())
            await proxy.wait_for(lambda: proxy.delayed["ReserveCredits"] == 1)
            asking.cancel()  # the client goes away
            with contextlib.suppress(asyncio.CancelledError):
                await asking
            deadline = asyncio.get_running_loop().time() + WAIT
            while not (router.admission._releasing or proxy.calls["ReleaseCredits"]):  # the router saw it go
                assert asyncio.get_running_loop().time() < deadline, "the router never saw the client go"
                await asyncio.sleep(0.01)
            # Before the fix its ReleaseCredits went out now, found no reservation and was answered; now none
            # goes out before the reservation is answered, so this wait ends at its bound.
            with contextlib.suppress(TimeoutError):
                await proxy.wait_for(lambda: proxy.ends["ReleaseCredits"], timeout=2.0)
            proxy.let_through("ReserveCredits")  # the reservation reaches the rendezvous, which grants it
            await asyncio.wait_for(asyncio.gather(*proxy.late), WAIT)
            await asyncio.wait_for(router.admission.settled(), WAIT)
            assert await reserved_transfers(cluster) == 0, "the credit is held until its TTL"
    finally:
        await runner.cleanup()
        await proxy.close()


async def test_an_unreachable_rendezvous_is_answered_503_at_once(server: AsyncTestServer, cluster: Cluster) -> None:
    """The rendezvous went away: before, every request waited out the SDK's retries (30 s by default, about 60 s
    measured for one request on 2026-12-07) before its 503. Now the first request's calls give up after the
    router's --rendezvous-timeout (2 s; the test's client allows 10 s, generous on a loaded machine, far under
    the old wait), and while the rendezvous is known down the next requests are answered 503 with Retry-After
    without a single call to it (with --degraded-max-age 0: no decode engine takes them alone)."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    await cluster.add("d", "decode", EngineRole.CONSUMER, capacity=1)
    calls = 0

    def count() -> tuple[tuple[str, str], ...]:  # asked before every call the router's client makes
        nonlocal calls
        calls += 1
        return ()

    config = dataclasses.replace(rendezvous_config((server.address,)), metadata_hook=count)
    router = Router(
        AsyncRendezvousClient(config), FLEET, refresh_interval=0.0, retry_after=3_600.0, degraded_max_age=0.0
    )
    runner, url = await serve(router)
    try:
        async with ClientSession(timeout=ClientTimeout(total=WAIT)) as http:
            async with http.post(url, json={"model": "tiny", "prompt": "hi"}) as response:
                assert response.status == 200
            await asyncio.wait_for(asyncio.gather(*router._background), WAIT)
            await server.stop()
            async with http.post(url, json={"model": "tiny", "prompt": "hi"}) as response:
                assert response.status == 503, await response.text()
                assert response.headers["Retry-After"] == "3600"
                assert response.headers[REFUSAL_HEADER] == "rendezvous_unavailable"
            made = calls
            for _ in range(5):
                async with http.post(url, json={"model": "tiny", "prompt": "hi"}) as response:
                    assert response.status == 503
                    assert response.headers["Retry-After"] == "3600"
                    assert response.headers[REFUSAL_HEADER] == "rendezvous_unavailable"
            assert calls == made  # no call at all while the rendezvous is known down
    finally:
        await runner.cleanup()


async def test_requests_are_served_again_once_the_probe_reaches_the_rendezvous(
    server: AsyncTestServer, cluster: Cluster
) -> None:
    """The circuit closes by itself: the router's probe finds the restarted rendezvous and requests flow again."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    await cluster.add("d", "decode", EngineRole.CONSUMER)
    router = Router(
        AsyncRendezvousClient(rendezvous_config((server.address,), timeout=1.0)),
        FLEET,
        refresh_interval=0.0,
        retry_after=0.05,
    )
    runner, url = await serve(router)
    try:
        async with ClientSession(timeout=ClientTimeout(total=WAIT)) as http:
            await server.stop()
            async with http.post(url, json={"model": "tiny", "prompt": "hi"}) as response:
                assert response.status == 503 and response.headers["Retry-After"] == "1"
            assert not router.reachable.is_set()
            await server.start()  # the same port, a fresh store: the engines register again
            for name, pool, role in (("p", "prefill", EngineRole.PRODUCER), ("d", "decode", EngineRole.CONSUMER)):
                labels = {"url": f"http://127.0.0.1:{cluster.engines[name].port}"}
                await cluster.rendezvous.register_engine(
                    sdk_engine(name, role, pool=pool, layout=LAYOUT, labels=labels, lease_ttl=60)
                )
            await asyncio.wait_for(router.reachable.wait(), WAIT)
            async with http.post(url, json={"model": "tiny", "prompt": "hi"}) as response:
                assert response.status == 200, await response.text()
    finally:
        await runner.cleanup()


def test_the_rendezvous_deadline_is_a_flag() -> None:
    args = build_parser().parse_args(["--address", "a:1", "--rendezvous-timeout", "0.5"])
    config = rendezvous_config(["a:1"], None, args.rendezvous_timeout)
    assert config.call_timeout == 0.5 and config.retry.deadline == 0.5
    assert build_parser().parse_args(["--address", "a:1"]).rendezvous_retry_after == 1.0


def padded(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (the prompt pads it)."""
    empty = json.dumps({"model": "tiny", "prompt": "", "max_tokens": 1}).encode()
    return json.dumps({"model": "tiny", "prompt": "x" * (size - len(empty)), "max_tokens": 1}).encode()


@pytest.mark.parametrize(
    ("limit", "size", "status"),
    [
        (None, 1 << 20, 200),  # the default: 1 MiB is read
        (None, (1 << 20) + 1, 413),
        (4096, 4096, 200),
        (4096, 4097, 413),
        (2 << 20, (1 << 20) + 1, 200),  # over the old hard-coded limit
    ],
)
async def test_the_body_limit_is_a_setting(
    cluster: Cluster, make_router: Any, limit: int | None, size: int, status: int
) -> None:
    """The router read at most aiohttp's default 1 MiB, hard-coded; `--max-body-bytes` sets it, refused 413."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    await cluster.add("d", "decode", EngineRole.CONSUMER)
    router = await make_router(FLEET, **({} if limit is None else {"max_body_bytes": limit}))
    got, text = await post_raw(router, padded(size))
    assert got == status, text
    if status == 413:
        assert json.loads(text)["error"]["code"] == 413


def test_the_body_limit_flag() -> None:
    assert build_parser().parse_args(["--address", "a:1"]).max_body_bytes == 1 << 20
    assert build_parser().parse_args(["--address", "a:1", "--max-body-bytes", "4096"]).max_body_bytes == 4096
