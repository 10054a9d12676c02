"""Revocation reaches every stream at once (issue 24, item 2): an identity removed from the auth file, or
changed, loses its open Watch and KeepAlive streams at their next message, however busy they are; a file
rewritten to an empty or smaller identity set is enforced the same way.

The reload is triggered with `AuthPolicy.reload()` (what SIGHUP does) so that no test waits for the file's
modification-time check; a busy stream is one whose next message comes before any idle re-check would.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.server import RendezvousServer
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.security.conftest import serving
from tests.security.test_auth import auth_file, bearer, call, refusal
from tests.service.conftest import engine_request

D0 = "tok-revoke-d0-3c9e51aa"
P0 = "tok-revoke-p0-8b02d7f4"
P0_NEXT = "tok-revoke-p0-next-51e0c2"
AUTH: dict[str, Any] = {
    "tokens": {
        D0: {"name": "d0", "engines": ["d0"], "engine_roles": ["consumer"], "engine_pools": ["decode"]},
        P0: {"name": "p0", "engines": ["p0"], "engine_roles": ["producer"], "engine_pools": ["prefill"]},
    }
}
UNAUTHENTICATED = (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED_TOKEN")
TRANSFERS = 20


def without(*tokens: str) -> dict[str, Any]:
    return {"tokens": {k: v for k, v in AUTH["tokens"].items() if k not in tokens}}


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RendezvousServer]:
    async with serving(auth_file=auth_file(tmp_path, AUTH)) as srv:
        yield srv


def revoke(server: RendezvousServer, doc: dict[str, Any]) -> None:
    """Rewrite the server's auth file and reload it now."""
    assert server.auth is not None
    Path(server.auth.path).write_text(json.dumps(doc))
    assert server.auth.reload()


async def register(channel: grpc.aio.Channel, engine_id: str, token: str) -> int:
    role = pb.ENGINE_ROLE_CONSUMER if engine_id.startswith("d") else pb.ENGINE_ROLE_PRODUCER
    request = engine_request(engine_id, role)
    request.pool = "decode" if role == pb.ENGINE_ROLE_CONSUMER else "prefill"
    incarnation: int = (await call(channel, "RegisterEngine", request, token)).engine.incarnation
    return incarnation


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param(without(P0), id="removed"),
        pytest.param({"tokens": {}}, id="emptied"),
        pytest.param(
            {"tokens": {**without(P0)["tokens"], P0: {**AUTH["tokens"][P0], "engines": ["p0", "p0-*"]}}},
            id="changed",
        ),
    ],
)
async def test_a_busy_keepalive_ends_at_its_next_message_once_its_identity_goes(
    server: RendezvousServer, channel: grpc.aio.Channel, doc: dict[str, Any]
) -> None:
    incarnation = await register(channel, "p0", P0)
    stream = pb_grpc.RendezvousServiceStub(channel).KeepAlive(metadata=bearer(P0), timeout=30)
    renewal = pb.KeepAliveRequest(engine_id="p0", incarnation=incarnation)
    for _ in range(50):  # far faster than the once-a-second idle re-check
        await stream.write(renewal)
        assert (await stream.read()).engine_id == "p0"
    revoke(server, doc)
    await stream.write(renewal)
    assert await refusal(stream.read()) == UNAUTHENTICATED


async def test_a_revoked_producer_s_watch_delivers_no_assignment(
    server: RendezvousServer, channel: grpc.aio.Channel
) -> None:
    """The issue's case: after removal, the producer's Watch kept receiving TRANSFER_ASSIGNED events with the
    consumer's NIXL metadata. Every assignment here is made after the reload: none may be delivered."""
    p0 = await register(channel, "p0", P0)
    d0 = await register(channel, "d0", D0)
    ids = [f"t-{i}" for i in range(TRANSFERS)]
    claims = pb.ClaimTransfersRequest(engine_id="p0", incarnation=p0, claims=[pb.ClaimSpec(transfer_id=t) for t in ids])
    assert not [r for r in (await call(channel, "ClaimTransfers", claims, P0)).results if r.HasField("status")]
    watch = pb_grpc.RendezvousServiceStub(channel).Watch(
        pb.WatchRequest(engine_id="p0"), metadata=bearer(P0), timeout=30
    )
    assert (await watch.read()).header.epoch

    revoke(server, without(P0))
    for t in ids:  # one assignment after another, each its own Watch message
        target = pb.RegisterTargetsRequest(
            engine_id="d0", incarnation=d0, targets=[pb.TargetSpec(transfer_id=t, block_ids=[1, 2])]
        )
        assert not (await call(channel, "RegisterTargets", target, D0)).results[0].HasField("status")

    assigned = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while (response := await watch.read()) is not grpc.aio.EOF:
            assigned += [e for e in response.events if e.type == pb.EVENT_TYPE_TRANSFER_ASSIGNED]
    assert assigned == []
    ended = from_rpc_error(err.value)
    assert (ended.code, ended.reason) == UNAUTHENTICATED


async def test_a_removed_token_loses_its_streams_while_another_token_keeps_the_same_entry(
    server: RendezvousServer, channel: grpc.aio.Channel
) -> None:
    """Rotation: two tokens for one identity; removing the old one ends the streams opened with it (an
    identity is its token and its entry, not its entry alone), and those of the new one go on."""
    revoke(server, {"tokens": {**AUTH["tokens"], P0_NEXT: AUTH["tokens"][P0]}})
    incarnation = await register(channel, "p0", P0)
    stub = pb_grpc.RendezvousServiceStub(channel)
    old, new = (stub.KeepAlive(metadata=bearer(token), timeout=30) for token in (P0, P0_NEXT))
    renewal = pb.KeepAliveRequest(engine_id="p0", incarnation=incarnation)
    for stream in (old, new):
        await stream.write(renewal)
        assert (await stream.read()).engine_id == "p0"
    revoke(server, {"tokens": {**without(P0)["tokens"], P0_NEXT: AUTH["tokens"][P0]}})
    await old.write(renewal)
    assert await refusal(old.read()) == UNAUTHENTICATED
    await new.write(renewal)
    assert (await new.read()).engine_id == "p0"
    new.cancel()


async def test_a_reload_that_leaves_an_identity_unchanged_keeps_its_streams(
    server: RendezvousServer, channel: grpc.aio.Channel
) -> None:
    incarnation = await register(channel, "p0", P0)
    stream = pb_grpc.RendezvousServiceStub(channel).KeepAlive(metadata=bearer(P0), timeout=30)
    renewal = pb.KeepAliveRequest(engine_id="p0", incarnation=incarnation)
    revoke(server, without(D0))
    for _ in range(3):
        await stream.write(renewal)
        assert (await stream.read()).engine_id == "p0"
    stream.cancel()


def test_sighup_reloads_the_auth_file_of_a_serving_process(tmp_path: Path) -> None:
    """`kill -HUP` re-reads the file at once, whatever its modification time: here the rewrite keeps the old
    one, so only the signal can make the busy KeepAlive end (within a bounded number of messages)."""
    path = auth_file(tmp_path, AUTH)
    serve = subprocess.Popen(
        [sys.executable, "-m", "rendezvous.cli", "serve", "--listen=127.0.0.1:0", "--metrics-listen=off"],
        env={**os.environ, "KV_RENDEZVOUS_AUTH_FILE": path, "KV_RENDEZVOUS_DRAIN": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert serve.stdout is not None
        address = serve.stdout.readline().split("serving on ")[1].split(" ")[0]
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.RendezvousServiceStub(channel)
            request = engine_request("p0", pb.ENGINE_ROLE_PRODUCER)
            request.pool = "prefill"
            incarnation = stub.RegisterEngine(request, metadata=bearer(P0), timeout=30).engine.incarnation
            renewals: queue.Queue[pb.KeepAliveRequest | None] = queue.Queue()
            responses = stub.KeepAlive(iter(renewals.get, None), metadata=bearer(P0), timeout=60)
            renewal = pb.KeepAliveRequest(engine_id="p0", incarnation=incarnation)
            renewals.put(renewal)
            assert next(responses).engine_id == "p0"
            mtime = os.stat(path).st_mtime_ns
            Path(path).write_text(json.dumps(without(P0)))
            os.utime(path, ns=(mtime, mtime))
            serve.send_signal(signal.SIGHUP)
            with pytest.raises(grpc.RpcError) as err:
                for _ in range(100_000):
                    renewals.put(renewal)
                    next(responses)
            renewals.put(None)
            ended = from_rpc_error(err.value)
            assert (ended.code, ended.reason) == UNAUTHENTICATED
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=30)
