"""Safe defaults (issue 24, item 5): what a fresh `kv-rendezvous serve` with an auth file enforces.

- A binding key requires bindings: a transfer half without the router's binding is refused
  (`--allow-unbound` relaxes that, for the rollout step where routers do not sign yet).
- An engine identity without `engine_roles` (or, for `engines`, `engine_pools`) is named in a warning at
  start and at each reload; `--strict-identities` refuses such a file instead.
- A rate limit is on: 10,000 calls/s per identity, above what one replica serves, so that a legitimate
  load never meets it; KeepAlive messages are counted against it. Without auth the caller is the peer's
  host, which a whole fleet behind one address shares: there it stays off unless set.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rendezvous.cli import _config_from, build_parser, main
from rendezvous.server import CallLimits, RendezvousServer, ServerConfig, quotas
from rendezvous.server.authfile import AuthPolicy
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.security.conftest import serving
from tests.security.test_auth import auth_file, bearer
from tests.security.test_transfer_bindings import AUTH, D0, claim, engines, info, key_file, target

BOUND = {"name": "d0", "engines": ["d0", "d0-*"], "engine_roles": ["consumer"], "engine_pools": ["decode"]}
POOL = {"name": "prefill", "pools": ["prefill"], "engine_roles": ["producer"]}
ROUTER = {"name": "router", "roles": ["router"]}
ADMIN = {"name": "ops", "roles": ["admin"]}
NO_ROLE = {"name": "loose", "engines": ["x0"], "engine_pools": ["decode"]}
NO_POOL = {"name": "roaming", "engines": ["x1"], "engine_roles": ["producer"]}
POOL_NO_ROLE = {"name": "any-role-pool", "pools": ["decode"]}


def doc(*entries: dict[str, Any]) -> dict[str, Any]:
    return {"tokens": {f"tok-defaults-{n:02d}-7f1c0e92": entry for n, entry in enumerate(entries)}}


def served(*flags: str) -> ServerConfig:
    """The configuration `kv-rendezvous serve FLAGS` runs with, on a free port and no metrics port."""
    config: ServerConfig = _config_from(
        build_parser().parse_args(["serve", "--listen=127.0.0.1:0", "--metrics-listen=off", *flags])
    )
    return config


@contextlib.asynccontextmanager
async def channel_to(config: ServerConfig) -> AsyncIterator[grpc.aio.Channel]:
    server = RendezvousServer(config)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield channel
    finally:
        await server.stop(0)


# Bindings


async def test_a_binding_key_requires_bindings_by_default(tmp_path: Path) -> None:
    config = served("--auth-file", auth_file(tmp_path, AUTH), "--binding-key-file", key_file(tmp_path))
    async with channel_to(config) as channel:
        await engines(channel, "d0", "p0")
        assert info(await target(channel, "d0", "t-1", None)) == ("BINDING_REQUIRED", "")
        assert info(await claim(channel, "p0", "t-2", None)) == ("BINDING_REQUIRED", "")


async def test_allow_unbound_admits_a_half_without_a_binding(tmp_path: Path) -> None:
    flags = ("--auth-file", auth_file(tmp_path, AUTH), "--binding-key-file", key_file(tmp_path), "--allow-unbound")
    async with channel_to(served(*flags)) as channel:
        await engines(channel, "d0", "p0")
        assert info(await target(channel, "d0", "t-1", None)) == ("", "")


# Unbound engine identities


def test_unbound_engine_identities_are_named_in_a_warning_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="rendezvous.server.authfile"):
        AuthPolicy(auth_file(tmp_path, doc(BOUND, POOL, ROUTER, ADMIN, NO_ROLE, NO_POOL, POOL_NO_ROLE)))
    warned = {str(r.args[0]): r.getMessage() for r in caplog.records if isinstance(r.args, tuple) and r.args}
    assert sorted(warned) == ["any-role-pool", "loose", "roaming"]
    assert "any role (no engine_roles)" in warned["loose"]
    assert "any pool (no engine_pools)" in warned["roaming"]
    assert "any role (no engine_roles)" in warned["any-role-pool"]


def test_strict_identities_refuses_an_unbound_engine_identity_at_start_and_on_reload(tmp_path: Path) -> None:
    path = auth_file(tmp_path, doc(NO_ROLE, NO_POOL))
    with pytest.raises(ValueError, match=r"loose \(no engine_roles\), roaming \(no engine_pools\)"):
        RendezvousServer(served("--auth-file", path, "--strict-identities"))
    bound = auth_file(tmp_path, doc(BOUND, POOL, ROUTER, ADMIN))
    policy = AuthPolicy(bound, strict=True)
    Path(bound).write_text(json.dumps(doc(BOUND, NO_ROLE)))
    assert not policy.reload()  # kept: the previous identities still stand
    assert policy.by_token("tok-defaults-01-7f1c0e92") is not None  # POOL, from the first file


def test_serve_with_strict_identities_and_an_unbound_identity_exits_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = auth_file(tmp_path, doc(NO_ROLE))
    assert (
        main(["serve", "--listen=127.0.0.1:0", "--metrics-listen=off", "--auth-file", path, "--strict-identities"]) == 2
    )
    assert "loose (no engine_roles)" in capsys.readouterr().err


# The rate limit


def test_a_rate_limit_is_on_by_default_with_auth_and_the_cli_agrees() -> None:
    assert CallLimits().for_server(auth=True).rate == quotas.DEFAULT_RATE == 10_000
    assert CallLimits().for_server(auth=False).rate == 0
    assert CallLimits(rate=50).for_server(auth=True).rate == CallLimits(rate=50).for_server(auth=False).rate == 50
    assert served().call_limits == CallLimits()


def test_the_default_rate_counts_every_message_and_refuses_past_a_second_s_worth() -> None:
    now = [0.0]
    limiter = quotas.CallQuotas(CallLimits().for_server(auth=True), lambda: now[0])
    for _ in range(10_000):  # one second's worth: a burst above any replica's serving rate
        limiter.admit("id:engine")
    with pytest.raises(Exception, match="more than 10000 calls/s"):
        limiter.admit("id:engine")
    limiter.admit("id:another-engine")
    now[0] += 0.001
    limiter.admit("id:engine")


async def test_without_auth_callers_behind_one_address_are_not_capped_by_default(tmp_path: Path) -> None:
    """With auth, `--max-streams` caps an identity's streams; without, every caller is 127.0.0.1 here (as a
    fleet behind a NAT would be), and no default limit lumps them together."""
    for auth, opened in ((True, 1), (False, 3)):
        config = {"auth_file": auth_file(tmp_path, AUTH)} if auth else {}
        async with (
            serving(call_limits=CallLimits(streams=1), **config) as server,
            grpc.aio.insecure_channel(server.address) as channel,
        ):
            await engines(channel, "d0")  # its token is ignored without auth
            stub = pb_grpc.RendezvousServiceStub(channel)
            watches = [
                stub.Watch(pb.WatchRequest(engine_id="d0"), metadata=bearer(D0) if auth else None) for _ in range(3)
            ]
            outcomes = await asyncio.gather(*(w.read() for w in watches), return_exceptions=True)
            assert sum(not isinstance(o, BaseException) for o in outcomes) == opened
            for watch in watches:
                watch.cancel()
