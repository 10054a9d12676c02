"""A transfer's halves bound to the router's choice (issue 17, item 5): the router signs (transfer id, consumer,
producer, expiry) and the service admits only those engines to the halves. Real servers on 127.0.0.1, memory
and Redis stores."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from rendezvous.cli import _config_from, build_parser
from rendezvous.clients import (
    AsyncRendezvousClient,
    ClaimSpec,
    ClientConfig,
    ConsumerSession,
    EngineRole,
    ProducerSession,
    RouterClient,
    TargetSpec,
    TransferState,
)
from rendezvous.clients.testing import FakeClock
from rendezvous.protocol import bindings
from rendezvous.protocol.bindings import Binding
from rendezvous.protocol.convert import binding_message as message
from rendezvous.server import RendezvousServer, ServerConfig
from rendezvous.v1 import rendezvous_pb2 as pb
from tests.clients.conftest import LAYOUT, agent
from tests.redis_fixtures import redis_url, store
from tests.security.conftest import serving
from tests.security.test_auth import auth_file, call
from tests.security.test_bindings import register

KEY = b"k" * 16 + b"binding-key-0123456789"  # 38 bytes
OTHER_KEY = b"another-binding-key-9876543210abcdef"

D0 = "tok-d0-consumer-a81f02"
D1 = "tok-d1-consumer-5b93e7"
P0 = "tok-p0-producer-c4d611"
P1 = "tok-p1-producer-0fe2a8"
ADMIN = "tok-admin-binding-7d3c19"
ROUTER = "tok-router-binding-e24b5a"
AUTH = {
    "tokens": {
        D0: {"name": "d0", "engines": ["d0"], "engine_roles": ["consumer"]},
        D1: {"name": "d1", "engines": ["d1"], "engine_roles": ["consumer"]},
        P0: {"name": "p0", "engines": ["p0"], "engine_roles": ["producer"]},
        P1: {"name": "p1", "engines": ["p1"], "engine_roles": ["producer"]},
        ADMIN: {"name": "ops", "roles": ["admin"]},
        ROUTER: {"name": "router", "roles": ["router"]},
    }
}
TOKENS = {"d0": D0, "d1": D1, "p0": P0, "p1": P1}
__all__ = ["redis_url", "store"]  # the fixtures


def key_file(tmp_path: Path, *keys: bytes) -> str:
    path = tmp_path / "binding.key"
    path.write_bytes(b"# routers sign with the first key\n" + b"\n".join(keys or (KEY,)) + b"\n")
    return str(path)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def server(tmp_path: Path, store: str, clock: FakeClock) -> AsyncIterator[RendezvousServer]:
    config = {"auth_file": auth_file(tmp_path, AUTH), "binding_key_file": key_file(tmp_path), "store": store}
    async with serving(clock=clock, **config) as srv:  # a key requires bindings by default
        yield srv


def signed(transfer_id: str, consumer: str = "d0", producer: str = "p0", ttl: float = 600, key: bytes = KEY) -> Binding:
    return bindings.sign(key, transfer_id, consumer, producer, int(time.time() + ttl))


def info(result: pb.ItemResult) -> tuple[str, str]:
    """(reason, field) of a failed item; ("", "") for an OK one."""
    if not result.HasField("status"):
        return "", ""
    detail = error_details_pb2.ErrorInfo()
    result.status.details[0].Unpack(detail)
    assert result.status.code == grpc.StatusCode.PERMISSION_DENIED.value[0] or not detail.reason.startswith("BIND")
    return detail.reason, detail.metadata.get("field", "")


async def engines(channel: grpc.aio.Channel, *names: str) -> dict[str, int]:
    """Register the named engines (d*: consumers, p*: producers) with their own tokens: name -> incarnation."""
    incarnations = {}
    for name in names:
        role = pb.ENGINE_ROLE_CONSUMER if name.startswith("d") else pb.ENGINE_ROLE_PRODUCER
        incarnations[name] = await register(channel, name, role, TOKENS[name])
    return incarnations


async def target(
    channel: grpc.aio.Channel, engine: str, transfer_id: str, binding: Binding | None, token: str | None = None
) -> pb.ItemResult:
    spec = pb.TargetSpec(transfer_id=transfer_id, block_ids=[1, 2], binding=message(binding))
    request = pb.RegisterTargetsRequest(engine_id=engine, targets=[spec])
    result: pb.ItemResult = (await call(channel, "RegisterTargets", request, token or TOKENS[engine])).results[0]
    return result


async def claim(
    channel: grpc.aio.Channel, engine: str, transfer_id: str, binding: Binding | None, token: str | None = None
) -> pb.ItemResult:
    request = pb.ClaimTransfersRequest(
        engine_id=engine, claims=[pb.ClaimSpec(transfer_id=transfer_id, binding=message(binding))]
    )
    result: pb.ItemResult = (await call(channel, "ClaimTransfers", request, token or TOKENS[engine])).results[0]
    return result


async def mark_ready(
    channel: grpc.aio.Channel, engine: str, transfer_id: str, binding: Binding | None
) -> pb.ItemResult:
    spec = pb.SourceReadySpec(transfer_id=transfer_id, block_ids=[1, 2], binding=message(binding))
    request = pb.MarkSourcesReadyRequest(engine_id=engine, sources=[spec])
    result: pb.ItemResult = (await call(channel, "MarkSourcesReady", request, TOKENS[engine])).results[0]
    return result


async def state_of(channel: grpc.aio.Channel, transfer_id: str) -> pb.Transfer:
    request = pb.GetTransferRequest(transfer_id=transfer_id)
    transfer: pb.Transfer = (await call(channel, "GetTransfer", request, ADMIN)).transfer
    return transfer


# Other engines cannot take a bound half


async def test_another_consumer_with_a_valid_token_cannot_take_the_bound_target_half(
    channel: grpc.aio.Channel,
) -> None:
    await engines(channel, "d0", "d1", "p0")
    bound = signed("t-1")
    assert info(await target(channel, "d1", "t-1", bound)) == ("BINDING_MISMATCH", "consumer_engine_id")
    assert info(await target(channel, "d1", "t-1", None)) == ("BINDING_REQUIRED", "")
    # d1's own binding for another transfer does not open this one.
    assert info(await target(channel, "d1", "t-1", signed("t-2", consumer="d1"))) == ("BINDING_INVALID", "mac")
    result = await target(channel, "d0", "t-1", bound)
    assert info(result) == ("", "") and result.state == pb.TRANSFER_STATE_TARGETED
    assert (await claim(channel, "p0", "t-1", bound)).state == pb.TRANSFER_STATE_MATCHED
    transfer = await state_of(channel, "t-1")
    assert (transfer.consumer_engine_id, transfer.producer_engine_id) == ("d0", "p0")


async def test_another_producer_cannot_take_the_bound_claim_half_by_claim_or_by_mark_source_ready(
    channel: grpc.aio.Channel,
) -> None:
    await engines(channel, "d0", "p0", "p1")
    bound = signed("t-1")
    assert info(await claim(channel, "p1", "t-1", bound)) == ("BINDING_MISMATCH", "producer_engine_id")
    assert info(await claim(channel, "p1", "t-1", None)) == ("BINDING_REQUIRED", "")
    assert info(await mark_ready(channel, "p1", "t-1", None)) == ("BINDING_REQUIRED", "")
    assert info(await mark_ready(channel, "p1", "t-1", bound)) == ("BINDING_MISMATCH", "producer_engine_id")
    with pytest.raises(grpc.aio.AioRpcError):
        await state_of(channel, "t-1")  # nothing was created
    assert (await claim(channel, "p0", "t-1", bound)).state == pb.TRANSFER_STATE_CLAIMED
    assert (await target(channel, "d0", "t-1", bound)).state == pb.TRANSFER_STATE_MATCHED
    # The refusal is the same now that the transfer exists.
    assert info(await claim(channel, "p1", "t-1", None)) == ("BINDING_REQUIRED", "")
    assert info(await mark_ready(channel, "p1", "t-1", None)) == ("BINDING_REQUIRED", "")


@pytest.mark.parametrize(
    ("case", "binding", "field"),
    [
        ("forged", Binding("d0", "p0", int(time.time()) + 600, bytes(32)), "mac"),
        ("another key", signed("t-1", key=OTHER_KEY), "mac"),
        ("another transfer", signed("t-other"), "mac"),
        ("a changed engine", Binding("d1", "p0", signed("t-1").expires_at, signed("t-1").mac), "mac"),
        ("a changed expiry", Binding("d0", "p0", signed("t-1").expires_at + 60, signed("t-1").mac), "mac"),
        ("a short mac", Binding("d0", "p0", int(time.time()) + 600, b"x"), "mac"),
        ("expired", signed("t-1", ttl=-5), "expire_time"),
    ],
)
async def test_an_invalid_binding_is_refused_with_its_reason_and_field(
    channel: grpc.aio.Channel, case: str, binding: Binding, field: str
) -> None:
    await engines(channel, "d0", "p0")
    assert info(await target(channel, "d0", "t-1", binding)) == ("BINDING_INVALID", field), case
    assert info(await claim(channel, "p0", "t-1", binding)) == ("BINDING_INVALID", field), case


async def test_batched_items_each_carry_their_own_binding(
    channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "rendezvous.coordinator")
    await engines(channel, "d0")
    specs = [
        pb.TargetSpec(transfer_id="t-a", block_ids=[1], binding=message(signed("t-a"))),
        pb.TargetSpec(transfer_id="t-b", block_ids=[2], binding=message(signed("t-a"))),
        pb.TargetSpec(transfer_id="t-c", block_ids=[3]),
        pb.TargetSpec(transfer_id="t-d", block_ids=[4], binding=message(signed("t-d"))),
    ]
    response = await call(channel, "RegisterTargets", pb.RegisterTargetsRequest(engine_id="d0", targets=specs), D0)
    assert [info(r)[0] for r in response.results] == ["", "BINDING_INVALID", "BINDING_REQUIRED", ""]
    refused = [r for r in caplog.records if r.getMessage() == "transfer half refused"]
    assert sorted((r.__dict__["transfer_id"], r.__dict__["reason"]) for r in refused) == [
        ("t-b", "BINDING_INVALID"),
        ("t-c", "BINDING_REQUIRED"),
    ]


async def test_an_engine_holding_its_half_needs_no_live_binding_to_re_register(
    channel: grpc.aio.Channel, clock: FakeClock
) -> None:
    await engines(channel, "d0", "p0")
    soon = signed("t-1", ttl=1.5)
    assert info(await target(channel, "d0", "t-1", soon)) == ("", "")
    assert info(await claim(channel, "p0", "t-1", soon)) == ("", "")
    clock.advance(2.1)  # the binding expires (whole seconds): a new half with it is refused
    assert info(await target(channel, "d0", "t-2", signed("t-2", ttl=1.5))) == ("BINDING_INVALID", "expire_time")
    spec = pb.TargetSpec(transfer_id="t-1", block_ids=[3, 4], generation=2, binding=message(soon))
    result = await call(channel, "RegisterTargets", pb.RegisterTargetsRequest(engine_id="d0", targets=[spec]), D0)
    assert info(result.results[0]) == ("", "")
    spec = pb.TargetSpec(transfer_id="t-1", block_ids=[5, 6], generation=3)
    result = await call(channel, "RegisterTargets", pb.RegisterTargetsRequest(engine_id="d0", targets=[spec]), D0)
    assert info(result.results[0]) == ("", "")
    assert info(await claim(channel, "p0", "t-1", None)) == ("", "")
    # Still nobody else.
    await engines(channel, "d1")
    assert info(await target(channel, "d1", "t-1", soon)) == ("BINDING_MISMATCH", "consumer_engine_id")


async def test_an_admin_identity_is_exempt_from_the_binding_requirement_but_not_from_a_bad_binding(
    channel: grpc.aio.Channel,
) -> None:
    await engines(channel, "d0", "p0")
    assert info(await target(channel, "d0", "t-1", None, token=ADMIN)) == ("", "")
    assert info(await claim(channel, "p0", "t-1", None, token=ADMIN)) == ("", "")
    assert info(await claim(channel, "p0", "t-2", signed("t-2", producer="p1"), token=ADMIN)) == (
        "BINDING_MISMATCH",
        "producer_engine_id",
    )


# With --allow-unbound, and without a key


async def test_with_allow_unbound_unbound_halves_match_as_before_and_a_presented_binding_is_checked(
    tmp_path: Path, store: str
) -> None:
    config = {
        "auth_file": auth_file(tmp_path, AUTH),
        "binding_key_file": key_file(tmp_path),
        "allow_unbound": True,
        "store": store,
    }
    async with serving(**config) as srv, grpc.aio.insecure_channel(srv.address) as channel:
        await engines(channel, "d0", "d1", "p0")
        assert info(await target(channel, "d0", "t-1", None)) == ("", "")
        assert (await claim(channel, "p0", "t-1", None)).state == pb.TRANSFER_STATE_MATCHED
        assert info(await target(channel, "d1", "t-2", signed("t-2"))) == ("BINDING_MISMATCH", "consumer_engine_id")


async def test_without_a_key_nothing_changes_and_bindings_are_ignored(tmp_path: Path, store: str) -> None:
    async with (
        serving(auth_file=auth_file(tmp_path, AUTH), store=store) as srv,
        grpc.aio.insecure_channel(srv.address) as channel,
    ):
        await engines(channel, "d0", "d1", "p0")
        forged = Binding("d0", "p0", 1, bytes(32))
        assert info(await target(channel, "d1", "t-1", forged)) == ("", "")
        assert (await claim(channel, "p0", "t-1", None)).state == pb.TRANSFER_STATE_MATCHED


# Configuration


def test_the_key_file_holds_one_key_a_line_and_refuses_short_ones(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# comment\n\n  {KEY.decode()}  \n{OTHER_KEY.decode()}\n")
    assert bindings.load_keys(str(path)) == (KEY, OTHER_KEY)
    path.write_text(f"{KEY.decode()}\nshort-key\n")
    with pytest.raises(ValueError, match="line 2 is 9 bytes, shorter than 32") as err:
        bindings.load_keys(str(path))
    assert "short-key" not in str(err.value)
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no key"):
        bindings.load_keys(str(path))


def test_a_server_with_a_short_key_or_allow_unbound_without_a_key_refuses_to_start(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("too-short\n")
    with pytest.raises(ValueError, match="shorter than 32"):
        RendezvousServer(ServerConfig(binding_key_file=str(path)))
    with pytest.raises(ValueError, match="allow_unbound needs binding_key_file"):
        ServerConfig(allow_unbound=True)
    with pytest.raises(ValueError, match="--allow-unbound needs --binding-key-file"):
        _config_from(build_parser().parse_args(["serve", "--allow-unbound"]))


def test_the_serve_flags_read_their_environment_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_RENDEZVOUS_BINDING_KEY_FILE", key_file(tmp_path))
    config = _config_from(build_parser().parse_args(["serve"]))
    assert (config.binding_key_file, config.allow_unbound) == (key_file(tmp_path), False)
    monkeypatch.setenv("KV_RENDEZVOUS_ALLOW_UNBOUND", "1")
    config = _config_from(build_parser().parse_args(["serve"]))
    assert (config.binding_key_file, config.allow_unbound) == (key_file(tmp_path), True)


def test_a_binding_travels_in_kv_transfer_params_as_plain_data() -> None:
    binding = signed("t-1")
    params = binding.to_params()
    assert params == {"consumer": "d0", "producer": "p0", "expires": binding.expires_at, "mac": binding.mac.hex()}
    assert Binding.from_params(params) == binding
    assert Binding.from_params({**params, "mac": "zz"}) is None
    assert Binding.from_params({**params, "expires": "1"}) is None
    assert Binding.from_params(None) is None


# The SDK, end to end


def client(srv: RendezvousServer, token: str) -> AsyncRendezvousClient:
    return AsyncRendezvousClient(ClientConfig(targets=(srv.address,), token=token))


async def test_a_router_minted_binding_through_the_sdk_end_to_end(server: RendezvousServer) -> None:
    clients = {name: client(server, token) for name, token in {**TOKENS, "router": ROUTER}.items()}
    try:
        kw: dict[str, Any] = {"layout": LAYOUT}
        d0 = ConsumerSession(clients["d0"], "d0", "decode", agents=[agent("d0-0")], **kw)
        d1 = ConsumerSession(clients["d1"], "d1", "decode", agents=[agent("d1-0")], **kw)
        p0 = ProducerSession(clients["p0"], "p0", "prefill", agents=[agent("p0-0")], **kw)
        for session in (d0, d1, p0):
            await session.start()
        router = RouterClient(clients["router"], binding_key=KEY)
        producer = await router.pick_engine("prefill", EngineRole.PRODUCER)
        consumer = await router.pick_engine("decode", EngineRole.CONSUMER)
        transfer_id = router.mint_transfer_id()
        binding = router.bind(transfer_id, producer, consumer)
        assert binding is not None and binding.expires_at > time.time() + 500
        # Through kv_transfer_params (JSON) to the engines.
        params = Binding.from_params(binding.to_params())
        chosen, other = (d0, d1) if consumer.engine_id == "d0" else (d1, d0)
        refused = await other.register_targets([TargetSpec(transfer_id, [1, 2], binding=params)])
        assert refused[0].error is not None and refused[0].error.reason == "BINDING_MISMATCH"
        claimed = await p0.claim_transfer(ClaimSpec(transfer_id, binding=params))
        assert claimed.state is TransferState.CLAIMED
        matched = await chosen.register_target(TargetSpec(transfer_id, [1, 2], binding=params))
        assert matched.state is TransferState.MATCHED
        assert RouterClient(clients["router"]).bind(transfer_id, producer, consumer) is None
        for session in (d0, d1, p0):
            await session.close()
    finally:
        for c in clients.values():
            await c.close()


def test_a_router_refuses_a_short_binding_key() -> None:
    with pytest.raises(ValueError, match="at least 32 bytes"):
        RouterClient(AsyncRendezvousClient("127.0.0.1:1"), binding_key=b"short")


def test_the_mac_covers_the_documented_bytes() -> None:
    """The MAC input as proto/rendezvous/v1/rendezvous.proto spells it out, for routers in other languages."""
    import hashlib
    import hmac
    import struct

    def field(text: str) -> bytes:
        return struct.pack(">I", len(text.encode())) + text.encode()

    expected = b"kv-rendezvous.binding.v1" + field("t-1") + field("d0") + field("p0") + struct.pack(">q", 1_700_000_000)
    assert bindings.mac_input("t-1", "d0", "p0", 1_700_000_000) == expected
    mac = hmac.new(KEY, expected, hashlib.sha256).digest()
    assert bindings.sign(KEY, "t-1", "d0", "p0", 1_700_000_000).mac == mac
    assert bindings.verifies((OTHER_KEY, KEY), "t-1", Binding("d0", "p0", 1_700_000_000, mac))
