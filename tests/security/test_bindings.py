"""Identities bound to role and pool, streams that end with their identity, and transfers that
reveal nothing to engines that take no part in them (issue 17, item 5)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.server import RendezvousServer
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.security.conftest import serving
from tests.security.test_auth import auth_file, bearer, call, refusal
from tests.service.conftest import engine_request

BOUND = "tok-d0-bound-6a2f94c1"
DECODE_1 = "tok-d1-consumer-0c77e3"
PREFILL = "tok-p0-producer-91d4b8"
PREFILL_1 = "tok-p1-producer-5e0a2c"
ADMIN = "tok-admin-bindings-e61b9f"

AUTH = {
    "tokens": {
        BOUND: {"name": "d0", "engines": ["d0", "d0-*"], "engine_roles": ["consumer"], "engine_pools": ["decode"]},
        DECODE_1: {"name": "d1", "engines": ["d1"]},
        PREFILL: {"name": "p0", "engines": ["p0"]},
        PREFILL_1: {"name": "p1", "engines": ["p1"]},
        ADMIN: {"name": "ops", "roles": ["admin"]},
    }
}
DENIED = (grpc.StatusCode.PERMISSION_DENIED, "IDENTITY_MISMATCH")
UNAUTHENTICATED = (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED_TOKEN")


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RendezvousServer]:
    async with serving(auth_file=auth_file(tmp_path, AUTH)) as srv:
        yield srv


async def register(channel: grpc.aio.Channel, engine_id: str, role: pb.EngineRole, token: str) -> int:
    response = await call(channel, "RegisterEngine", engine_request(engine_id, role), token)
    incarnation: int = response.engine.incarnation
    return incarnation


async def item(channel: grpc.aio.Channel, method: str, request: Any, token: str) -> pb.ItemResult:
    result: pb.ItemResult = (await call(channel, method, request, token)).results[0]
    return result


def reason(result: pb.ItemResult) -> str:
    info = error_details_pb2.ErrorInfo()
    result.status.details[0].Unpack(info)
    return str(info.reason)


async def targeted_transfer(
    channel: grpc.aio.Channel, transfer_id: str, mode: pb.TransferMode = pb.TRANSFER_MODE_PUSH
) -> None:
    """d0 (the bound consumer) targets transfer_id in mode."""
    incarnation = await register(channel, "d0", pb.ENGINE_ROLE_CONSUMER, BOUND)
    target = pb.RegisterTargetsRequest(
        engine_id="d0",
        incarnation=incarnation,
        targets=[pb.TargetSpec(transfer_id=transfer_id, block_ids=[1, 2], mode=mode)],
    )
    assert not (await item(channel, "RegisterTargets", target, BOUND)).HasField("status")


# Identities bound to role and pool


@pytest.mark.parametrize(
    ("role", "pool", "field"),
    [
        (pb.ENGINE_ROLE_PRODUCER, "prefill", "role"),
        (pb.ENGINE_ROLE_PRODUCER, "decode", "role"),
        (pb.ENGINE_ROLE_CONSUMER, "prefill", "pool"),
    ],
)
async def test_a_bound_identity_cannot_register_another_role_or_pool_so_cannot_claim_its_transfer(
    channel: grpc.aio.Channel, role: pb.EngineRole, pool: str, field: str
) -> None:
    await targeted_transfer(channel, "t-d0")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(channel, "RegisterEngine", engine_request("d0-evil", role, pool=pool), BOUND)
    refused = from_rpc_error(err.value)
    assert (refused.code, refused.reason, refused.metadata["field"]) == (*DENIED, field)
    claim = pb.ClaimTransfersRequest(engine_id="d0-evil", claims=[pb.ClaimSpec(transfer_id="t-d0")])
    assert await refusal(call(channel, "ClaimTransfers", claim, BOUND)) == (
        grpc.StatusCode.NOT_FOUND,
        "ENGINE_NOT_FOUND",
    )
    transfer = (await call(channel, "GetTransfer", pb.GetTransferRequest(transfer_id="t-d0"), ADMIN)).transfer
    assert transfer.state == pb.TRANSFER_STATE_TARGETED and not transfer.producer_engine_id


async def test_a_bound_identity_registers_its_engines_with_its_role_and_pool(channel: grpc.aio.Channel) -> None:
    await register(channel, "d0", pb.ENGINE_ROLE_CONSUMER, BOUND)
    assert await register(channel, "d0-2", pb.ENGINE_ROLE_CONSUMER, BOUND)


async def test_a_bound_identity_cannot_act_for_an_engine_of_its_ids_registered_with_another_role(
    channel: grpc.aio.Channel,
) -> None:
    await register(channel, "d0-x", pb.ENGINE_ROLE_PRODUCER, ADMIN)
    claim = pb.ClaimTransfersRequest(engine_id="d0-x", claims=[pb.ClaimSpec(transfer_id="t-any")])
    assert await refusal(call(channel, "ClaimTransfers", claim, BOUND)) == DENIED
    watch = pb_grpc.RendezvousServiceStub(channel).Watch(pb.WatchRequest(engine_id="d0-x"), metadata=bearer(BOUND))
    assert await refusal(watch.read()) == DENIED


# Non-participants


def without_id(result: pb.ItemResult, transfer_id: str) -> tuple[int, str, str]:
    return result.status.code, reason(result), result.status.message.replace(transfer_id, "<id>")


def participant_call(method: str, engine_id: str, incarnation: int, transfer_id: str) -> Any:
    """A one-item request of a transfer-scoped call for transfer_id."""
    request = getattr(pb, f"{method}Request")(engine_id=engine_id, incarnation=incarnation)
    if method == "ReleaseTargets":
        request.releases.append(pb.ReleaseSpec(transfer_id=transfer_id, generation=1))
    elif method == "CompleteTransfers":
        outcome = pb.COMPLETION_OUTCOME_SUCCEEDED
        request.completions.append(pb.CompletionSpec(transfer_id=transfer_id, generation=1, outcome=outcome))
    elif method == "AcknowledgeRevocations":
        request.acks.append(pb.RevocationAck(transfer_id=transfer_id, generation=1))
    elif method == "AbortTransfers":
        request.aborts.append(pb.AbortSpec(transfer_id=transfer_id, message="mine now"))
    else:
        request.sources.append(pb.SourceReadySpec(transfer_id=transfer_id, block_ids=[1, 2]))
    return request


async def matched_transfer(
    channel: grpc.aio.Channel, transfer_id: str, mode: pb.TransferMode = pb.TRANSFER_MODE_PUSH
) -> None:
    await targeted_transfer(channel, transfer_id, mode)
    incarnation = await register(channel, "p0", pb.ENGINE_ROLE_PRODUCER, PREFILL)
    claim = pb.ClaimTransfersRequest(
        engine_id="p0", incarnation=incarnation, claims=[pb.ClaimSpec(transfer_id=transfer_id)]
    )
    assert not (await item(channel, "ClaimTransfers", claim, PREFILL)).HasField("status")


@pytest.mark.parametrize(
    ("method", "engine_id", "token"),
    [
        ("ReleaseTargets", "d1", DECODE_1),
        ("CompleteTransfers", "p1", PREFILL_1),
        ("AcknowledgeRevocations", "p1", PREFILL_1),
    ],
)
async def test_a_non_participant_is_answered_as_for_an_unknown_id(
    channel: grpc.aio.Channel, method: str, engine_id: str, token: str
) -> None:
    await matched_transfer(channel, "t-live")
    role = pb.ENGINE_ROLE_CONSUMER if engine_id.startswith("d") else pb.ENGINE_ROLE_PRODUCER
    incarnation = await register(channel, engine_id, role, token)

    async def answer(transfer_id: str, as_token: str) -> pb.ItemResult:
        request = participant_call(method, engine_id, incarnation, transfer_id)
        return await item(channel, method, request, as_token)

    live, unknown = await answer("t-live", token), await answer("t-none", token)
    assert without_id(live, "t-live") == without_id(unknown, "t-none")
    assert reason(live) == "TRANSFER_NOT_FOUND"
    assert "d0" not in live.status.message and "p0" not in live.status.message
    assert reason(await answer("t-live", ADMIN)) == "NOT_PARTICIPANT"


async def test_a_non_participant_s_pull_success_before_the_source_is_ready_is_answered_as_for_an_unknown_id(
    channel: grpc.aio.Channel,
) -> None:
    """The consumer of a pull transfer whose source is not ready is refused such a report INVALID_STATE
    (docs/protocol.md); another consumer must not learn so that the id exists."""
    await matched_transfer(channel, "t-pull", pb.TRANSFER_MODE_PULL)
    incarnation = await register(channel, "d1", pb.ENGINE_ROLE_CONSUMER, DECODE_1)

    async def answer(transfer_id: str) -> pb.ItemResult:
        request = participant_call("CompleteTransfers", "d1", incarnation, transfer_id)
        return await item(channel, "CompleteTransfers", request, DECODE_1)

    live, unknown = await answer("t-pull"), await answer("t-none")
    assert without_id(live, "t-pull") == without_id(unknown, "t-none") and reason(live) == "TRANSFER_NOT_FOUND"


@pytest.mark.parametrize(
    ("method", "engine_id", "token"),
    [("AbortTransfers", "d1", DECODE_1), ("AbortTransfers", "p1", PREFILL_1)],
)
async def test_a_non_participant_aborting_is_answered_as_for_an_unknown_id(
    channel: grpc.aio.Channel, method: str, engine_id: str, token: str
) -> None:
    await matched_transfer(channel, "t-live")
    role = pb.ENGINE_ROLE_CONSUMER if engine_id.startswith("d") else pb.ENGINE_ROLE_PRODUCER
    incarnation = await register(channel, engine_id, role, token)

    async def answer(transfer_id: str, as_token: str) -> pb.ItemResult:
        request = participant_call(method, engine_id, incarnation, transfer_id)
        return await item(channel, method, request, as_token)

    def seen(result: pb.ItemResult) -> bytes:
        result.transfer_id = ""
        return result.SerializeToString(deterministic=True)

    live, unknown = await answer("t-live", token), await answer("t-none", token)
    assert not live.HasField("status") and seen(live) == seen(unknown)
    # A second try at the id it just took (a tombstone or a claim of its own) is no different either.
    assert seen(await answer("t-live", token)) == seen(await answer("t-none", token))
    transfer = (await call(channel, "GetTransfer", pb.GetTransferRequest(transfer_id="t-live"), ADMIN)).transfer
    assert transfer.state == pb.TRANSFER_STATE_MATCHED and transfer.producer_engine_id == "p0"
    assert reason(await answer("t-live", ADMIN)) == "NOT_PARTICIPANT"


async def test_a_claim_conflict_names_no_other_engine(channel: grpc.aio.Channel) -> None:
    await matched_transfer(channel, "t-live")
    incarnation = await register(channel, "p1", pb.ENGINE_ROLE_PRODUCER, PREFILL_1)
    claim = pb.ClaimTransfersRequest(
        engine_id="p1", incarnation=incarnation, claims=[pb.ClaimSpec(transfer_id="t-live")]
    )
    ready = participant_call("MarkSourcesReady", "p1", incarnation, "t-live")
    for result in (
        await item(channel, "ClaimTransfers", claim, PREFILL_1),
        await item(channel, "MarkSourcesReady", ready, PREFILL_1),
    ):
        assert reason(result) == "CLAIM_CONFLICT" and "p0" not in result.status.message


# Removing an identity


def rewrite(path: str, doc: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(doc))
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


async def test_removing_an_identity_ends_its_open_streams(channel: grpc.aio.Channel, tmp_path: Path) -> None:
    stub = pb_grpc.RendezvousServiceStub(channel)
    d0 = await register(channel, "d0", pb.ENGINE_ROLE_CONSUMER, BOUND)
    p0 = await register(channel, "p0", pb.ENGINE_ROLE_PRODUCER, PREFILL)
    watch = stub.Watch(pb.WatchRequest(engine_id="d0"), metadata=bearer(BOUND), timeout=30)
    assert (await watch.read()).header.epoch
    keep_alive = stub.KeepAlive(metadata=bearer(BOUND), timeout=30)
    await keep_alive.write(pb.KeepAliveRequest(engine_id="d0", incarnation=d0))
    assert (await keep_alive.read()).engine_id == "d0"
    kept = stub.KeepAlive(metadata=bearer(PREFILL), timeout=30)

    rewrite(str(tmp_path / "auth.json"), {"tokens": {k: v for k, v in AUTH["tokens"].items() if k != BOUND}})

    assert await refusal(watch.read()) == UNAUTHENTICATED
    assert await refusal(keep_alive.read()) == UNAUTHENTICATED
    await kept.write(pb.KeepAliveRequest(engine_id="p0", incarnation=p0))
    assert (await kept.read()).engine_id == "p0"
    kept.cancel()
