"""deploy/haproxy: a real `haproxy` rendered from the template, in front of a real server with auth.

A caller past its share of open streams is refused by the front, in C, with the answer the service itself
would give (RESOURCE_EXHAUSTED, ErrorInfo TOO_MANY_CONCURRENT_CALLS in the service's domain, a RetryInfo), as
the SDK's error tree reads it; another identity's calls and streams still pass. A call that gets no slot of the
service is refused RATE_LIMITED with a retry hint (the queue's refusal, HAProxy's 503 rewritten). Driven by
concurrency (streams held open) and by a service nobody listens on, not by time."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.connector.launch import free_port
from rendezvous.protocol.errors import ERROR_DOMAIN, Reason, ResourceExhausted
from rendezvous.server import RendezvousServer
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.replicas.harness import eventually
from tests.security.conftest import serving
from tests.security.test_auth import auth_file, bearer
from tests.service.conftest import engine_request

if shutil.which("haproxy") is None:
    pytest.skip("haproxy is not installed (apt-get install haproxy)", allow_module_level=True)

FRONT = Path(__file__).resolve().parents[2] / "deploy" / "haproxy"
HOG = "tok-front-hog-5c1e0a9b7d"
GOOD = "tok-front-good-2f8d4b6a1c"
AUTH = {
    "tokens": {
        HOG: {"name": "hog", "engines": ["hog"], "engine_roles": ["producer"], "engine_pools": ["prefill"]},
        GOOD: {"name": "good", "engines": ["good"], "engine_roles": ["producer"], "engine_pools": ["prefill"]},
    }
}
STREAMS_PER_CALLER = 2


def _renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("haproxy_render", FRONT / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves its annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RendezvousServer]:
    async with serving(auth_file=auth_file(tmp_path, AUTH)) as srv:
        yield srv


@pytest.fixture
def front(server: RendezvousServer, tmp_path: Path) -> Iterator[str]:
    """haproxy in the foreground on a free port, in front of the server; its address."""
    with _haproxy(server.address, tmp_path) as listen:
        yield listen


@contextlib.contextmanager
def _haproxy(server: str, tmp_path: Path) -> Iterator[str]:
    render = _renderer()
    listen = f"127.0.0.1:{free_port()}"
    config = render.render(render.Front(listen, server, streams_per_caller=STREAMS_PER_CALLER), tmp_path / "front")
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(config)], stderr=subprocess.PIPE, text=True)
    try:
        yield listen
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=10)
        assert "ALERT" not in stderr, stderr


async def _channel(address: str) -> grpc.aio.Channel:
    channel = grpc.aio.insecure_channel(address)
    await asyncio.wait_for(channel.channel_ready(), 30)
    return channel


async def _open_watch(stub: pb_grpc.RendezvousServiceStub, engine: str, token: str) -> Any:
    """A registered engine's Watch stream, read once: admitted and open."""
    reg = await stub.RegisterEngine(engine_request(engine, pb.ENGINE_ROLE_PRODUCER), metadata=bearer(token))
    watch = stub.Watch(
        pb.WatchRequest(engine_id=engine, start_sequence=reg.watch_start_sequence), metadata=bearer(token)
    )
    await watch.read()
    return watch


async def _wait_listening(front: str) -> None:
    """Connection refused until haproxy listens: poll gRPC health through it (health bypasses every limit)."""

    async def ready() -> bool:
        async with grpc.aio.insecure_channel(front) as probe:
            answer = await health_pb2_grpc.HealthStub(probe).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    await eventually(ready, "the front to listen")


async def test_a_caller_past_its_streams_is_refused_by_the_front_with_a_reason_and_a_retry_hint(front: str) -> None:
    await _wait_listening(front)
    channel = await _channel(front)
    stub = pb_grpc.RendezvousServiceStub(channel)
    held = [await _open_watch(stub, "hog", HOG) for _ in range(STREAMS_PER_CALLER)]

    extra = stub.Watch(pb.WatchRequest(engine_id="hog"), metadata=bearer(HOG), timeout=30)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await extra.read()
    error = from_rpc_error(refused.value)
    assert isinstance(error, ResourceExhausted)
    assert error.reason == Reason.TOO_MANY_CONCURRENT_CALLS and error.domain == ERROR_DOMAIN
    assert error.retry_after is not None and error.retry_after > 0
    assert error.metadata == {"refused_by": "front"}

    # Another identity's streams and calls pass; so do the hog's unary calls (its streams are what it spent).
    good = [await _open_watch(stub, "good", GOOD) for _ in range(STREAMS_PER_CALLER)]
    again = await stub.RegisterEngine(engine_request("hog", pb.ENGINE_ROLE_PRODUCER), metadata=bearer(HOG))
    assert again.engine.engine_id == "hog"
    for watch in held + good:
        watch.cancel()
    await channel.close()


async def test_a_call_that_gets_no_slot_of_the_service_is_refused_rate_limited_with_a_retry_hint(
    tmp_path: Path,
) -> None:
    # The queue's refusal (HAProxy's 503, rewritten as a gRPC answer) is what a call gets when no slot of the
    # service is reachable; a service nobody listens on gives no slot at all, whatever the timing.
    nobody = f"127.0.0.1:{free_port()}"
    with _haproxy(nobody, tmp_path) as front:
        async with grpc.aio.insecure_channel(front) as channel:
            stub = pb_grpc.RendezvousServiceStub(channel)
            request = engine_request("good", pb.ENGINE_ROLE_PRODUCER)

            async def refused() -> bool:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.RegisterEngine(request, metadata=bearer(GOOD), timeout=30)
                assert err.value.code() != grpc.StatusCode.UNAVAILABLE  # not yet listening: poll again
                error = from_rpc_error(err.value)
                assert isinstance(error, ResourceExhausted), error
                assert error.reason == Reason.RATE_LIMITED and error.domain == ERROR_DOMAIN
                assert error.retry_after is not None and error.retry_after > 0
                return True

            await eventually(refused, "the front's refusal")
