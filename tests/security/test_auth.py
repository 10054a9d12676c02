"""Identity-bound auth: every call names who makes it, and no identity acts for another's engines.

Engine identities act only for their own engines (by id, glob or pool) and read only those and their
transfers; the router role reads and aborts as the router; admin does everything; tokens and metadata never
reach the logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvous.cli import _config_from, build_parser
from rendezvous.clients import (
    AsyncRendezvousClient,
    ClaimSpec,
    ClientConfig,
    CompletionSpec,
    ConsumerSession,
    Event,
    EventType,
    KvLayout,
    ProducerSession,
    ReleaseSpec,
    TargetSpec,
    TLSConfig,
    mint_transfer_id,
)
from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.clients.testing import stand_in_agent
from rendezvous.server import RendezvousServer, ServerConfig
from rendezvous.server import TLSConfig as ServerTLS
from rendezvous.server.authfile import AuthPolicy
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.security.certs import CertificateAuthority
from tests.security.conftest import serving
from tests.service.conftest import engine_request

DECODE = "tok-decode-0-3f9a1c"
PREFILL = "tok-prefill-0-77be20"
POOL = "tok-prefill-pool-5d1e0b"
ROUTER = "tok-router-a0c4d2"
ADMIN = "tok-admin-e61b9f"

AUTH = {
    "tokens": {
        DECODE: {"name": "decode-0", "engines": ["decode-0"]},
        PREFILL: {"name": "prefill-0", "engines": ["prefill-0"]},
        "sha256:" + hashlib.sha256(POOL.encode()).hexdigest(): {"name": "prefill-pool", "pools": ["prefill"]},
        ROUTER: {"name": "router", "roles": ["router"]},
        ADMIN: {"name": "ops", "roles": ["admin"]},
    },
    "certificates": {"decode-9": {"engines": ["decode-9"]}},
}

# Every RPC that acts for the engine named in request.engine_id, as (method, request type).
UNARY_ENGINE_CALLS = [
    "RegisterEngine",
    "DeregisterEngine",
    "RegisterTargets",
    "ClaimTransfers",
    "MarkSourcesReady",
    "CompleteTransfers",
    "AcknowledgeRevocations",
    "ReleaseTargets",
    "AbortTransfers",
    "ListTransfers",
]
ROUTER_CALLS = [
    ("GetStatus", pb.GetStatusRequest()),
    ("ListEngines", pb.ListEnginesRequest()),
    ("GetEngine", pb.GetEngineRequest(engine_id="decode-0")),
    ("GetTransfer", pb.GetTransferRequest(transfer_id="t-1")),
    ("ListTransfers", pb.ListTransfersRequest()),
    ("AbortTransfers", pb.AbortTransfersRequest(aborts=[pb.AbortSpec(transfer_id="t-1")])),
    ("ReserveCredits", pb.ReserveCreditsRequest(reservations=[pb.CreditSpec(transfer_id="t-1", engine_id="decode-0")])),
    ("ReleaseCredits", pb.ReleaseCreditsRequest(transfer_ids=["t-1"])),
]


def auth_file(tmp_path: Path, doc: dict[str, Any] | None = None) -> str:
    path = tmp_path / "auth.json"
    path.write_text(json.dumps(doc or AUTH))
    return str(path)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RendezvousServer]:
    async with serving(auth_file=auth_file(tmp_path)) as srv:
        yield srv


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def request_for(method: str, engine_id: str) -> Any:
    if method == "RegisterEngine":
        pool_role = pb.ENGINE_ROLE_PRODUCER if engine_id.startswith("prefill") else pb.ENGINE_ROLE_CONSUMER
        return engine_request(engine_id, pool_role)
    return getattr(pb, f"{method}Request")(engine_id=engine_id)


async def call(channel: grpc.aio.Channel, method: str, request: Any, token: str | None) -> Any:
    stub = pb_grpc.RendezvousServiceStub(channel)
    metadata = bearer(token) if token else None
    return await getattr(stub, method)(request, metadata=metadata, timeout=10)


async def refusal(coro: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    converted = from_rpc_error(err.value)
    return converted.code, converted.reason


async def first_watch_message(channel: grpc.aio.Channel, engine_id: str, token: str | None) -> Any:
    stream = pb_grpc.RendezvousServiceStub(channel).Watch(
        pb.WatchRequest(engine_id=engine_id), metadata=bearer(token) if token else None, timeout=10
    )
    try:
        return await stream.read()
    finally:
        stream.cancel()


DENIED = (grpc.StatusCode.PERMISSION_DENIED, "IDENTITY_MISMATCH")
ROLE_REQUIRED = (grpc.StatusCode.PERMISSION_DENIED, "ROLE_REQUIRED")
UNAUTHENTICATED = (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED_TOKEN")


async def register(channel: grpc.aio.Channel, engine_id: str, token: str) -> pb.RegisterEngineResponse:
    response: pb.RegisterEngineResponse = await call(
        channel, "RegisterEngine", request_for("RegisterEngine", engine_id), token
    )
    return response


# Authentication


@pytest.mark.parametrize("token", [None, "not-a-known-token"])
async def test_a_call_without_a_known_token_is_unauthenticated(channel: grpc.aio.Channel, token: str | None) -> None:
    assert await refusal(call(channel, "GetStatus", pb.GetStatusRequest(), token)) == UNAUTHENTICATED
    assert await refusal(first_watch_message(channel, "decode-0", token)) == UNAUTHENTICATED


async def test_a_token_in_another_scheme_is_unauthenticated(channel: grpc.aio.Channel) -> None:
    stub = pb_grpc.RendezvousServiceStub(channel)
    coro = stub.GetStatus(pb.GetStatusRequest(), metadata=(("authorization", f"Basic {ADMIN}"),), timeout=10)
    assert await refusal(coro) == UNAUTHENTICATED


async def test_health_checks_need_no_token(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    response = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_token_listed_by_its_sha256_digest_is_known(channel: grpc.aio.Channel) -> None:
    response = await register(channel, "prefill-3", POOL)
    assert response.engine.engine_id == "prefill-3"


# Engine identities


@pytest.mark.parametrize("method", UNARY_ENGINE_CALLS)
async def test_an_engine_cannot_act_for_another_engine(channel: grpc.aio.Channel, method: str) -> None:
    await register(channel, "prefill-0", PREFILL)
    assert await refusal(call(channel, method, request_for(method, "prefill-0"), DECODE)) == DENIED


async def test_an_engine_cannot_watch_another_engine(channel: grpc.aio.Channel) -> None:
    await register(channel, "prefill-0", PREFILL)
    assert await refusal(first_watch_message(channel, "prefill-0", DECODE)) == DENIED


async def test_every_keepalive_message_is_checked(channel: grpc.aio.Channel) -> None:
    own = await register(channel, "decode-0", DECODE)
    await register(channel, "prefill-0", PREFILL)
    stream = pb_grpc.RendezvousServiceStub(channel).KeepAlive(metadata=bearer(DECODE), timeout=10)
    await stream.write(pb.KeepAliveRequest(engine_id="decode-0", incarnation=own.engine.incarnation))
    assert (await stream.read()).engine_id == "decode-0"
    await stream.write(pb.KeepAliveRequest(engine_id="prefill-0"))
    assert await refusal(stream.read()) == DENIED


async def test_a_keepalive_opening_with_another_engine_is_denied(channel: grpc.aio.Channel) -> None:
    await register(channel, "prefill-0", PREFILL)
    stream = pb_grpc.RendezvousServiceStub(channel).KeepAlive(metadata=bearer(DECODE), timeout=10)
    await stream.write(pb.KeepAliveRequest(engine_id="prefill-0"))
    assert await refusal(stream.read()) == DENIED


# GetEngine and GetTransfer of its own engines and their transfers are an engine's too (test_engine_reads.py).
ROUTER_ONLY_CALLS = [(m, r) for m, r in ROUTER_CALLS if m not in ("GetEngine", "GetTransfer")]


@pytest.mark.parametrize(("method", "request_"), ROUTER_ONLY_CALLS, ids=[m for m, _ in ROUTER_ONLY_CALLS])
async def test_an_engine_cannot_make_router_calls(channel: grpc.aio.Channel, method: str, request_: Any) -> None:
    assert await refusal(call(channel, method, request_, DECODE)) == ROLE_REQUIRED


async def test_an_engine_can_list_its_own_transfers(channel: grpc.aio.Channel) -> None:
    await register(channel, "decode-0", DECODE)
    response = await call(channel, "ListTransfers", pb.ListTransfersRequest(engine_id="decode-0"), DECODE)
    assert list(response.transfers) == []


# Pools


async def test_a_pool_identity_registers_engines_in_its_pool_only(channel: grpc.aio.Channel) -> None:
    assert (await register(channel, "prefill-7", POOL)).engine.pool == "prefill"
    in_other_pool = engine_request("prefill-8", pb.ENGINE_ROLE_PRODUCER)
    in_other_pool.pool = "decode"
    assert await refusal(call(channel, "RegisterEngine", in_other_pool, POOL)) == DENIED
    assert await refusal(register(channel, "decode-7", POOL)) == DENIED


async def test_a_pool_identity_cannot_act_for_engines_of_other_pools(channel: grpc.aio.Channel) -> None:
    await register(channel, "decode-0", DECODE)
    request = pb.RegisterTargetsRequest(engine_id="decode-0", targets=[pb.TargetSpec(transfer_id="t", block_ids=[1])])
    assert await refusal(call(channel, "RegisterTargets", request, POOL)) == DENIED
    assert await refusal(first_watch_message(channel, "decode-0", POOL)) == DENIED


async def test_a_pool_identity_cannot_take_over_an_engine_of_another_pool(channel: grpc.aio.Channel) -> None:
    await register(channel, "shared-1", ADMIN)  # a consumer in pool "decode"
    takeover = engine_request("shared-1", pb.ENGINE_ROLE_PRODUCER)
    assert await refusal(call(channel, "RegisterEngine", takeover, POOL)) == DENIED


async def test_a_pool_identity_acting_for_an_unknown_engine_is_told_it_is_not_found(
    channel: grpc.aio.Channel,
) -> None:
    code, reason = await refusal(call(channel, "DeregisterEngine", request_for("DeregisterEngine", "ghost"), POOL))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "ENGINE_NOT_FOUND")


# Router and admin


@pytest.mark.parametrize(("method", "request_"), ROUTER_CALLS, ids=[m for m, _ in ROUTER_CALLS])
async def test_the_router_makes_router_calls(channel: grpc.aio.Channel, method: str, request_: Any) -> None:
    await register(channel, "decode-0", DECODE)
    try:
        await call(channel, method, request_, ROUTER)
    except grpc.aio.AioRpcError as err:  # e.g. an unknown transfer: the service answered, auth let it through
        assert from_rpc_error(err).reason not in ("IDENTITY_MISMATCH", "ROLE_REQUIRED", "UNAUTHENTICATED_TOKEN")


@pytest.mark.parametrize("method", [m for m in UNARY_ENGINE_CALLS if m != "ListTransfers"])
async def test_the_router_cannot_act_for_an_engine(channel: grpc.aio.Channel, method: str) -> None:
    await register(channel, "decode-0", DECODE)
    assert await refusal(call(channel, method, request_for(method, "decode-0"), ROUTER)) == DENIED


async def test_the_router_cannot_watch_an_engine(channel: grpc.aio.Channel) -> None:
    await register(channel, "decode-0", DECODE)
    assert await refusal(first_watch_message(channel, "decode-0", ROUTER)) == DENIED


async def test_admin_may_do_everything(channel: grpc.aio.Channel) -> None:
    await register(channel, "decode-0", ADMIN)
    await register(channel, "prefill-0", ADMIN)
    assert (await call(channel, "GetStatus", pb.GetStatusRequest(), ADMIN)).live_engines == 2
    assert (await first_watch_message(channel, "prefill-0", ADMIN)).header.epoch


# The SDK under auth


async def test_a_push_transfer_completes_with_one_token_per_engine(server: RendezvousServer) -> None:
    layout = KvLayout(model_fingerprint="m", dtype="bfloat16", block_size=16, num_layers=2)
    async with (
        AsyncRendezvousClient(ClientConfig(server.address, token=DECODE)) as decode_client,
        AsyncRendezvousClient(ClientConfig(server.address, token=PREFILL)) as prefill_client,
    ):
        decode = ConsumerSession(
            decode_client, "decode-0", "decode", layout=layout, agents=[stand_in_agent("decode-0")]
        )
        prefill = ProducerSession(
            prefill_client, "prefill-0", "prefill", layout=layout, agents=[stand_in_agent("prefill-0")]
        )
        async with decode, prefill:
            transfer_id = mint_transfer_id()
            await decode.register_target(TargetSpec(transfer_id, block_ids=[1, 2]))
            await prefill.claim_transfer(ClaimSpec(transfer_id))
            async for event in prefill.events():
                if isinstance(event, Event) and event.type == EventType.TRANSFER_ASSIGNED:
                    await prefill.complete_transfer(CompletionSpec(transfer_id, event.generation))
                    break
            async for event in decode.events():
                if isinstance(event, Event) and event.type == EventType.TRANSFER_COMMITTED:
                    await decode.release_target(ReleaseSpec(transfer_id, event.generation))
                    break


# Client certificates


async def test_a_client_certificate_name_serves_as_identity(tmp_path: Path) -> None:
    ca = CertificateAuthority()
    server_cert, server_key = ca.issue("kv-rendezvous", server=True).write(tmp_path, "server")
    client = ca.issue("decode-9")
    tls = ServerTLS(server_cert, server_key, client_ca=ca.pem, require_client_cert=True)
    server = RendezvousServer(ServerConfig(listen="127.0.0.1:0", tls=tls, auth_file=auth_file(tmp_path), grace=0.1))
    await server.start()
    try:
        credentials = TLSConfig(ca.pem, client.cert, client.key).credentials()
        async with grpc.aio.secure_channel(server.address, credentials) as channel:
            stub = pb_grpc.RendezvousServiceStub(channel)
            response = await stub.RegisterEngine(request_for("RegisterEngine", "decode-9"), timeout=10)
            assert response.engine.engine_id == "decode-9"
            assert await refusal(stub.RegisterEngine(request_for("RegisterEngine", "decode-0"), timeout=10)) == DENIED
            # A token beside the certificate is the call's identity alone (docs/security.md).
            with_token = stub.RegisterEngine(request_for("RegisterEngine", "decode-9"), metadata=bearer(DECODE))
            assert await refusal(with_token) == DENIED
            stranger = bearer("tok-unknown-0f3e9d")
            unknown = stub.RegisterEngine(request_for("RegisterEngine", "decode-9"), metadata=stranger)
            assert await refusal(unknown) == UNAUTHENTICATED
    finally:
        await server.stop(0)


# Secrets stay out of logs


async def test_no_token_or_metadata_value_reaches_the_logs(
    channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "META-7c1d-SECRET"
    caplog.set_level(logging.DEBUG)
    stub = pb_grpc.RendezvousServiceStub(channel)
    for token in (DECODE, "tok-unknown-0f3e9d", ROUTER):
        metadata = (*bearer(token), ("x-api-key", secret))
        for coro in (
            stub.RegisterEngine(request_for("RegisterEngine", "decode-0"), metadata=metadata, timeout=10),
            stub.RegisterEngine(request_for("RegisterEngine", "prefill-0"), metadata=metadata, timeout=10),
            stub.GetStatus(pb.GetStatusRequest(), metadata=metadata, timeout=10),
        ):
            with contextlib.suppress(grpc.aio.AioRpcError):
                await coro
    assert any(r.getMessage() == "call denied" for r in caplog.records)
    logged = caplog.text + "".join(repr(vars(r)) for r in caplog.records)
    for value in (DECODE, ROUTER, "tok-unknown-0f3e9d", secret):
        assert value not in logged


# The policy file


def test_the_policy_reloads_a_changed_file_and_keeps_the_old_one_when_the_new_is_broken(tmp_path: Path) -> None:
    now = [0.0]
    clock: Callable[[], float] = lambda: now[0]  # noqa: E731
    path = auth_file(tmp_path)
    policy = AuthPolicy(path, clock)
    assert policy.by_token(DECODE) is not None

    def rewrite(text: str) -> None:
        Path(path).write_text(text)
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        now[0] += 2

    rewrite(json.dumps({"tokens": {"tok-new-identity-9d2e": {"engines": ["decode-0"]}}}))
    assert policy.by_token(DECODE) is None
    identity = policy.by_token("tok-new-identity-9d2e")
    assert identity is not None and identity.names_engine("decode-0")
    rewrite("{not json")
    assert policy.by_token("tok-new-identity-9d2e") is not None


@pytest.mark.parametrize(
    "doc",
    [
        {"tokens": {DECODE: {"roles": ["root"]}}},
        {"tokens": {DECODE: {"engines": "decode-0"}}},
        {"tokens": {DECODE: {"colour": "red"}}},
        {"users": {}},
    ],
)
def test_a_malformed_policy_is_refused_at_start(tmp_path: Path, doc: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        AuthPolicy(auth_file(tmp_path, doc))


@pytest.mark.parametrize("key", ["sha256:abc", "sha256:" + "z" * 64, "sha256:" + "0" * 63, "sha256:"])
def test_a_malformed_sha256_key_is_refused_at_start(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match="64 hex digits"):
        AuthPolicy(auth_file(tmp_path, {"tokens": {key: {"engines": ["decode-0"]}}}))


def test_a_token_shorter_than_the_minimum_is_refused_at_start_without_showing_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shorter than 16") as err:
        AuthPolicy(auth_file(tmp_path, {"tokens": {"short-tok": {"engines": ["decode-0"]}}}))
    assert "short-tok" not in str(err.value)


def test_the_minimum_token_length_is_configurable(tmp_path: Path) -> None:
    path = auth_file(tmp_path, {"tokens": {"abcd": {"engines": ["decode-0"]}}})
    assert AuthPolicy(path, min_token_bytes=4).by_token("abcd") is not None
    with pytest.raises(ValueError, match="shorter than 32"):
        RendezvousServer(ServerConfig(auth_file=auth_file(tmp_path), min_token_bytes=32))


def test_serve_reads_the_minimum_token_length_from_its_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _config_from(build_parser().parse_args(["serve", "--min-token-bytes=24"])).min_token_bytes == 24
    monkeypatch.setenv("KV_RENDEZVOUS_MIN_TOKEN_BYTES", "40")
    assert _config_from(build_parser().parse_args(["serve"])).min_token_bytes == 40


def test_identity_globs_match_engine_ids(tmp_path: Path) -> None:
    policy = AuthPolicy(auth_file(tmp_path, {"tokens": {DECODE: {"engines": ["decode-*"]}}}))
    identity = policy.by_token(DECODE)
    assert identity is not None
    assert identity.names_engine("decode-12") and not identity.names_engine("prefill-1")


async def test_without_an_auth_file_no_token_is_needed() -> None:
    server = RendezvousServer(ServerConfig(listen="127.0.0.1:0", grace=0.1))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            assert (await call(channel, "GetStatus", pb.GetStatusRequest(), None)).store == "memory"
    finally:
        await server.stop(0)


# Streams that end


@pytest.mark.parametrize("ending", ["cancelled", "half-closed"])
async def test_a_stream_s_end_leaves_no_task_exception_unretrieved(tmp_path: Path, ending: str) -> None:
    """The guard waits for a stream's next response in a task of its own; a stream that ended (its caller
    cancelled it, or stopped sending) while the guard waited left that task's StopAsyncIteration unretrieved,
    logged by asyncio as "Task exception was never retrieved"."""
    loop = asyncio.get_running_loop()
    unretrieved: list[BaseException | None] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context.get("exception")))
    try:
        async with (
            serving(auth_file=auth_file(tmp_path)) as server,
            grpc.aio.insecure_channel(server.address) as channel,
        ):
            incarnation = (await register(channel, "decode-0", DECODE)).engine.incarnation
            for _ in range(3):
                stream = pb_grpc.RendezvousServiceStub(channel).KeepAlive(metadata=bearer(DECODE), timeout=10)
                await stream.write(pb.KeepAliveRequest(engine_id="decode-0", incarnation=incarnation))
                assert (await stream.read()).engine_id == "decode-0"
                if ending == "cancelled":
                    stream.cancel()
                else:
                    await stream.done_writing()
                    assert await stream.read() is grpc.aio.EOF
            await server.stop(1.0)  # every call's handler ended
        gc.collect()
    finally:
        loop.set_exception_handler(previous)
    assert unretrieved == []
