"""A bug inside the auth guard reaches the client as INTERNAL with ErrorInfo INTERNAL_ERROR, never a bare UNKNOWN.

A real server with an auth file; the failure is injected into the guard's own dependencies (the auth file's
identities: `AuthPolicy`, `Identity`), on every call shape: unary, server stream, bidi stream, and a bidi stream
already admitted.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NoReturn

import grpc
import pytest

from rendezvous.server.authfile import AuthPolicy, Identity
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.security.conftest import serving
from tests.security.test_auth import DECODE, auth_file, bearer, register
from tests.service.test_service import error_info


@pytest.fixture
async def channel(tmp_path: Path) -> AsyncIterator[grpc.aio.Channel]:
    async with serving(auth_file=auth_file(tmp_path)) as server, grpc.aio.insecure_channel(server.address) as ch:
        yield ch


def broken(*args: object, **kwargs: object) -> NoReturn:
    raise RuntimeError("a guard bug")


def stub(channel: grpc.aio.Channel) -> pb_grpc.RendezvousServiceStub:
    return pb_grpc.RendezvousServiceStub(channel)


def internal(err: grpc.aio.AioRpcError, caplog: pytest.LogCaptureFixture) -> str:
    """Check err is INTERNAL / INTERNAL_ERROR, the bug is logged (not sent) under its request id; return the id."""
    assert err.code() == grpc.StatusCode.INTERNAL, (err.code(), err.details())
    info = error_info(err)
    assert info.reason == "INTERNAL_ERROR" and info.metadata["request_id"]
    assert "a guard bug" not in (err.details() or "")
    logged = [r for r in caplog.records if getattr(r, "request_id", "") == info.metadata["request_id"]]
    assert [r.levelno for r in logged] == [logging.ERROR]
    assert logged[0].exc_info is not None and "a guard bug" in str(logged[0].exc_info[1])
    return str(info.metadata["request_id"])


async def test_a_unary_call_whose_identification_fails(
    channel: grpc.aio.Channel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(AuthPolicy, "by_token", broken)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub(channel).GetEngine(pb.GetEngineRequest(engine_id="decode-0"), metadata=bearer(DECODE), timeout=10)
    internal(caught.value, caplog)


async def test_a_unary_call_whose_authorization_fails_is_logged_under_its_request_id(
    channel: grpc.aio.Channel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(Identity, "names_engine", broken)
    request = pb.DeregisterEngineRequest(engine_id="decode-0", request_id="rid-guard-1")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub(channel).DeregisterEngine(request, metadata=bearer(DECODE), timeout=10)
    assert internal(caught.value, caplog) == "rid-guard-1"


async def test_a_watch_whose_identification_fails(
    channel: grpc.aio.Channel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(AuthPolicy, "by_token", broken)
    stream = stub(channel).Watch(pb.WatchRequest(engine_id="decode-0"), metadata=bearer(DECODE), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    internal(caught.value, caplog)


async def test_a_keepalive_whose_identification_fails(
    channel: grpc.aio.Channel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(AuthPolicy, "by_token", broken)
    stream = stub(channel).KeepAlive(metadata=bearer(DECODE), timeout=10)
    await stream.write(pb.KeepAliveRequest(engine_id="decode-0", incarnation=1))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    internal(caught.value, caplog)


async def test_an_admitted_keepalive_whose_recheck_fails(
    channel: grpc.aio.Channel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    own = await register(channel, "decode-0", DECODE)
    stream = stub(channel).KeepAlive(metadata=bearer(DECODE), timeout=10)
    renewal = pb.KeepAliveRequest(engine_id="decode-0", incarnation=own.engine.incarnation)
    await stream.write(renewal)
    assert (await stream.read()).engine_id == "decode-0"
    monkeypatch.setattr(AuthPolicy, "recheck", broken)
    await stream.write(renewal)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    internal(caught.value, caplog)


async def test_an_admitted_watch_whose_recheck_fails(
    channel: grpc.aio.Channel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    await register(channel, "decode-0", DECODE)
    stream = stub(channel).Watch(pb.WatchRequest(engine_id="decode-0"), metadata=bearer(DECODE), timeout=10)
    assert (await stream.read()).HasField("header")  # admitted: the watch is established
    monkeypatch.setattr(AuthPolicy, "recheck", broken)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()  # rechecked while the stream waits (RELOAD_CHECK), or before its next message
    internal(caught.value, caplog)
