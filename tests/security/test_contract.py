"""The contract as an independent client and an attacker read it (issue 24, Deliver 6): signed page tokens,
an engine's agents, `Engine.live_transfers`, pre-aborts, what a non-participant learns, credits held on
another consumer, budgets exact across Redis replicas, and the ambiguous requests decided in docs/protocol.md
("Edge cases decided"). Real servers on 127.0.0.1, memory and Redis stores; sections numbered as the slice's
items."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from rendezvous.clients.testing import start_test_server
from rendezvous.core import Limits
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.redis_fixtures import fresh_prefix, redis_url, store, with_prefix
from tests.security.conftest import serving
from tests.security.test_auth import auth_file, call
from tests.security.test_transfer_bindings import AUTH, ROUTER, TOKENS, claim, engines, info, key_file, signed, target
from tests.service.conftest import engine_request
from tests.service.test_service import error_info

__all__ = ["redis_url", "store"]  # the fixtures

CONSUMER, PRODUCER = pb.ENGINE_ROLE_CONSUMER, pb.ENGINE_ROLE_PRODUCER


@contextlib.asynccontextmanager
async def servers(*stores: str, **config: Any) -> AsyncIterator[list[pb_grpc.RendezvousServiceStub]]:
    """A server per store (a Redis URL twice: two replicas of one deployment) and a stub to each."""
    async with contextlib.AsyncExitStack() as stack:
        stubs = []
        for store in stores:
            server = await stack.enter_async_context(start_test_server(store=store, **config))
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(server.address))
            stubs.append(pb_grpc.RendezvousServiceStub(channel))
        yield stubs


@pytest.fixture
async def stub(store: str) -> AsyncIterator[pb_grpc.RendezvousServiceStub]:
    async with start_test_server(store=store) as server, grpc.aio.insecure_channel(server.address) as channel:
        yield pb_grpc.RendezvousServiceStub(channel)


def reason_of(err: grpc.aio.AioRpcError) -> str:
    return str(error_info(err).reason)


async def refused(pending: Any, code: grpc.StatusCode, reason: str) -> grpc.aio.AioRpcError:
    """The call failed with code and ErrorInfo reason; its error."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await pending
    assert (caught.value.code(), reason_of(caught.value)) == (code, reason), caught.value.details()
    return caught.value


async def register(
    stub: pb_grpc.RendezvousServiceStub, engine_id: str, role: pb.EngineRole = CONSUMER, **kw: Any
) -> int:
    reply = await stub.RegisterEngine(engine_request(engine_id, role, **kw))
    return int(reply.engine.incarnation)


# 1. Page tokens are signed with the deployment's key.


def _edited(token: str) -> str:
    raw = bytearray(base64.urlsafe_b64decode(token))
    raw[-1] ^= 1  # the id the page ended at, one bit off
    return base64.urlsafe_b64encode(bytes(raw)).decode()


async def test_a_forged_or_edited_page_token_is_refused(stub: pb_grpc.RendezvousServiceStub) -> None:
    for i in range(3):
        await register(stub, f"d{i}")
    first = await stub.ListEngines(pb.ListEnginesRequest(page_size=1))
    assert first.next_page_token
    # The old format: unsigned base64 of the listing's scope and the id to continue after.
    forged = base64.urlsafe_b64encode(b"engines  \nd0").decode()
    for token in (forged, _edited(first.next_page_token)):
        await refused(
            stub.ListEngines(pb.ListEnginesRequest(page_size=1, page_token=token)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "PAGE_TOKEN_INVALID",
        )
    second = await stub.ListEngines(pb.ListEnginesRequest(page_size=1, page_token=first.next_page_token))
    assert [e.engine_id for e in second.engines] == ["d1"]


async def test_a_page_token_of_another_deployment_is_refused() -> None:
    async with servers("memory", "memory") as (first, second):
        for s in (first, second):
            for i in range(2):
                await register(s, f"d{i}")
        token = (await first.ListEngines(pb.ListEnginesRequest(page_size=1))).next_page_token
        await refused(
            second.ListEngines(pb.ListEnginesRequest(page_size=1, page_token=token)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "PAGE_TOKEN_INVALID",
        )


@pytest.mark.redis
async def test_replicas_of_one_deployment_continue_each_others_pages_and_no_other(redis_url: str) -> None:
    url, other = with_prefix(redis_url, fresh_prefix()), with_prefix(redis_url, fresh_prefix())
    async with servers(url, url, other) as (a, b, c):
        for s in (a, c):
            for i in range(2):
                await register(s, f"d{i}")
        token = (await a.ListEngines(pb.ListEnginesRequest(page_size=1))).next_page_token
        page = await b.ListEngines(pb.ListEnginesRequest(page_size=1, page_token=token))
        assert [e.engine_id for e in page.engines] == ["d1"]
        await refused(
            c.ListEngines(pb.ListEnginesRequest(page_size=1, page_token=token)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "PAGE_TOKEN_INVALID",
        )


# 2. An engine registers tp x pp agents: none is AGENTS_INVALID.


async def test_an_engine_without_agents_is_refused(stub: pb_grpc.RendezvousServiceStub) -> None:
    request = engine_request("d0", CONSUMER)
    del request.agents[:]
    err = await refused(stub.RegisterEngine(request), grpc.StatusCode.INVALID_ARGUMENT, "AGENTS_INVALID")
    assert error_info(err).metadata["field"] == "agents"
    await refused(stub.GetEngine(pb.GetEngineRequest(engine_id="d0")), grpc.StatusCode.NOT_FOUND, "ENGINE_NOT_FOUND")


# 5. TRANSFER_ENDED tells a non-participant that the transfer ended, not why.


def item_error(result: pb.ItemResult) -> tuple[str, str, dict[str, str]]:
    """(reason, message, metadata) of a refused item."""
    assert result.HasField("status"), result
    info = error_details_pb2.ErrorInfo()
    assert result.status.details[0].Unpack(info)
    return info.reason, result.status.message, dict(info.metadata)


async def test_a_non_participant_learns_no_abort_message(stub: pb_grpc.RendezvousServiceStub) -> None:
    for name, role in (("d0", CONSUMER), ("d1", CONSUMER), ("p1", PRODUCER)):
        await register(stub, name, role)
    await stub.RegisterTargets(
        pb.RegisterTargetsRequest(engine_id="d0", targets=[pb.TargetSpec(transfer_id="t", block_ids=[1])])
    )
    secret = "p0's disk at /srv/kv failed"
    await stub.AbortTransfers(
        pb.AbortTransfersRequest(engine_id="d0", aborts=[pb.AbortSpec(transfer_id="t", message=secret)])
    )
    other_target = pb.RegisterTargetsRequest(engine_id="d1", targets=[pb.TargetSpec(transfer_id="t", block_ids=[1])])
    other_claim = pb.ClaimTransfersRequest(engine_id="p1", claims=[pb.ClaimSpec(transfer_id="t")])
    for reply in (await stub.RegisterTargets(other_target), await stub.ClaimTransfers(other_claim)):
        reason, text, metadata = item_error(reply.results[0])
        assert reason == "TRANSFER_ENDED" and "/srv/kv" not in text and "REQUESTED" not in text
        assert "abort_reason" not in metadata and "state" not in metadata
    # The participant still learns why.
    own = pb.RegisterTargetsRequest(engine_id="d0", targets=[pb.TargetSpec(transfer_id="t", block_ids=[2])])
    reason, text, metadata = item_error((await stub.RegisterTargets(own)).results[0])
    assert reason == "TRANSFER_ENDED" and secret in text and metadata["abort_reason"] == "REQUESTED"


async def test_the_halves_of_a_pre_aborted_id_learn_why(stub: pb_grpc.RendezvousServiceStub) -> None:
    await register(stub, "d0")
    abort_ = pb.AbortSpec(transfer_id="t", message="the client went away")
    await stub.AbortTransfers(pb.AbortTransfersRequest(aborts=[abort_]))  # the router, before either half
    request = pb.RegisterTargetsRequest(engine_id="d0", targets=[pb.TargetSpec(transfer_id="t", block_ids=[1])])
    reason, text, metadata = item_error((await stub.RegisterTargets(request)).results[0])
    assert reason == "TRANSFER_ENDED" and "went away" in text and metadata["abort_reason"] == "REQUESTED"


# 4. Under required bindings an engine aborts only its own transfers: a pre-abort cannot poison a router's id.


@pytest.fixture
async def bound(tmp_path: Path, store: str) -> AsyncIterator[grpc.aio.Channel]:
    """A server with auth and a binding key (bindings required: the default), and a channel to it."""
    config = {"auth_file": auth_file(tmp_path, AUTH), "binding_key_file": key_file(tmp_path), "store": store}
    async with serving(**config) as server, grpc.aio.insecure_channel(server.address) as ch:
        yield ch


async def abort(channel: grpc.aio.Channel, engine: str, transfer_id: str) -> pb.ItemResult:
    request = pb.AbortTransfersRequest(engine_id=engine, aborts=[pb.AbortSpec(transfer_id=transfer_id, message="x")])
    token = TOKENS[engine] if engine else ROUTER
    result: pb.ItemResult = (await call(channel, "AbortTransfers", request, token)).results[0]
    return result


async def test_an_unbound_engine_cannot_pre_abort_a_routers_transfer(bound: grpc.aio.Channel) -> None:
    await engines(bound, "d0", "p0", "p1")
    # p1 guesses (or saw) the id the router minted for d0 and p0, before either half arrives.
    assert info(await abort(bound, "p1", "t")) == ("BINDING_REQUIRED", "")
    assert info(await target(bound, "d0", "t", signed("t"))) == ("", "")
    # The same answer once the transfer exists: no oracle, and no abort of someone else's transfer.
    assert info(await abort(bound, "p1", "t")) == ("BINDING_REQUIRED", "")
    assert info(await claim(bound, "p0", "t", signed("t"))) == ("", "")
    # A half aborts its own transfer; the router pre-aborts any id.
    assert (await abort(bound, "d0", "t")).state == pb.TRANSFER_STATE_ABORTED
    assert (await abort(bound, "", "t2")).state == pb.TRANSFER_STATE_ABORTED
    assert info(await target(bound, "d0", "t2", signed("t2")))[0] == "TRANSFER_ENDED"


# 6. MarkSourcesReady + AcknowledgeRevocations: no existence oracle.


async def test_mark_source_ready_then_acknowledge_answers_a_foreign_id_as_an_unknown_one(
    bound: grpc.aio.Channel,
) -> None:
    await engines(bound, "d0", "p0", "p1")
    assert info(await target(bound, "d0", "t-foreign", signed("t-foreign"))) == ("", "")
    assert info(await claim(bound, "p0", "t-foreign", signed("t-foreign"))) == ("", "")

    async def probe(transfer_id: str) -> list[bytes]:
        ready = pb.MarkSourcesReadyRequest(
            engine_id="p1", sources=[pb.SourceReadySpec(transfer_id=transfer_id, block_ids=[1, 2])]
        )
        ack = pb.AcknowledgeRevocationsRequest(
            engine_id="p1", acks=[pb.RevocationAck(transfer_id=transfer_id, generation=1)]
        )
        answers = []
        for method, request in (("MarkSourcesReady", ready), ("AcknowledgeRevocations", ack)):
            result: pb.ItemResult = (await call(bound, method, request, TOKENS["p1"])).results[0]
            result.transfer_id = ""
            answers.append(result.status.SerializeToString(deterministic=True).replace(transfer_id.encode(), b"<id>"))
        return answers

    assert await probe("t-foreign") == await probe("t-unknown")


# 7. A router's credit reservation on one consumer holds against the others.


async def test_a_credit_reserved_on_one_consumer_holds_against_another(stub: pb_grpc.RendezvousServiceStub) -> None:
    for name in ("d0", "d1"):
        await register(stub, name)
    reserved = await stub.ReserveCredits(
        pb.ReserveCreditsRequest(reservations=[pb.CreditSpec(transfer_id="t", engine_id="d0", blocks=1)])
    )
    assert not reserved.results[0].HasField("status")
    d1 = pb.RegisterTargetsRequest(engine_id="d1", targets=[pb.TargetSpec(transfer_id="t", block_ids=[1])])
    reason, text, _ = item_error((await stub.RegisterTargets(d1)).results[0])
    assert reason == "CREDIT_CONFLICT" and "another consumer" in text and "d0" not in text
    await stub.ReleaseCredits(pb.ReleaseCreditsRequest(transfer_ids=["t"]))
    assert (await stub.RegisterTargets(d1)).results[0].state == pb.TRANSFER_STATE_TARGETED
    # The consumer the router chose is admitted as before.
    await stub.ReserveCredits(
        pb.ReserveCreditsRequest(reservations=[pb.CreditSpec(transfer_id="t2", engine_id="d0", blocks=1)])
    )
    d0 = pb.RegisterTargetsRequest(engine_id="d0", targets=[pb.TargetSpec(transfer_id="t2", block_ids=[1])])
    assert (await stub.RegisterTargets(d0)).results[0].state == pb.TRANSFER_STATE_TARGETED


# 3. Engine.live_transfers counts unsettled transfers: an abort awaiting its revocation ack is one.


async def test_live_transfers_count_an_abort_until_its_revocation_is_acknowledged(
    stub: pb_grpc.RendezvousServiceStub,
) -> None:
    await register(stub, "d0")
    await register(stub, "p0", PRODUCER)
    await stub.RegisterTargets(
        pb.RegisterTargetsRequest(engine_id="d0", targets=[pb.TargetSpec(transfer_id="t", block_ids=[1])])
    )
    matched = await stub.ClaimTransfers(
        pb.ClaimTransfersRequest(engine_id="p0", claims=[pb.ClaimSpec(transfer_id="t")])
    )
    assert matched.results[0].state == pb.TRANSFER_STATE_MATCHED

    async def live() -> list[int]:
        listed = await stub.ListEngines(pb.ListEnginesRequest())
        got = [(await stub.GetEngine(pb.GetEngineRequest(engine_id=e))).engine.live_transfers for e in ("d0", "p0")]
        assert [e.live_transfers for e in listed.engines] == got
        return got

    assert await live() == [1, 1]
    # The consumer aborts while the producer may be writing generation 1: d0's blocks stay pinned.
    await stub.AbortTransfers(pb.AbortTransfersRequest(engine_id="d0", aborts=[pb.AbortSpec(transfer_id="t")]))
    transfer = (await stub.GetTransfer(pb.GetTransferRequest(transfer_id="t"))).transfer
    assert (transfer.state, transfer.revoking_generation) == (pb.TRANSFER_STATE_ABORTED, 1)
    assert await live() == [1, 1]
    assert not any("ABORTED" in s for s in (await stub.GetStatus(pb.GetStatusRequest())).transfers_by_state)
    await stub.AcknowledgeRevocations(
        pb.AcknowledgeRevocationsRequest(engine_id="p0", acks=[pb.RevocationAck(transfer_id="t", generation=1)])
    )
    assert await live() == [0, 0]


# 9. Ambiguous requests, decided (docs/protocol.md, "Edge cases decided").


async def test_list_engines_with_a_role_this_server_does_not_know_is_refused(
    stub: pb_grpc.RendezvousServiceStub,
) -> None:
    await register(stub, "d0")
    err = await refused(
        stub.ListEngines(pb.ListEnginesRequest(role=7)),  # type: ignore[arg-type]
        grpc.StatusCode.INVALID_ARGUMENT,
        "ROLE_UNSPECIFIED",
    )
    assert error_info(err).metadata["field"] == "role"
    assert len((await stub.ListEngines(pb.ListEnginesRequest())).engines) == 1


async def test_keep_alive_must_name_its_incarnation(stub: pb_grpc.RendezvousServiceStub) -> None:
    incarnation = await register(stub, "d0")
    stream = stub.KeepAlive()
    await stream.write(pb.KeepAliveRequest(engine_id="d0", incarnation=incarnation))
    assert (await stream.read()).engine_id == "d0"
    await stream.write(pb.KeepAliveRequest(engine_id="d0"))
    err = await refused(stream.read(), grpc.StatusCode.FAILED_PRECONDITION, "STALE_INCARNATION")
    assert error_info(err).metadata["field"] == "incarnation"


async def test_a_duration_with_mixed_signs_is_refused(stub: pb_grpc.RendezvousServiceStub) -> None:
    await register(stub, "d0")
    await register(stub, "p0", PRODUCER)
    mixed = {"seconds": 5, "nanos": -500_000_000}
    for call_, request in (
        (stub.RegisterEngine, engine_request("d1", CONSUMER, lease_ttl=mixed)),
        (
            stub.RegisterTargets,
            pb.RegisterTargetsRequest(
                engine_id="d0", targets=[pb.TargetSpec(transfer_id="t", block_ids=[1], timeout=mixed)]
            ),
        ),
        (
            stub.ClaimTransfers,
            pb.ClaimTransfersRequest(engine_id="p0", claims=[pb.ClaimSpec(transfer_id="t", timeout=mixed)]),
        ),
    ):
        await refused(call_(request), grpc.StatusCode.INVALID_ARGUMENT, "TIMEOUT_INVALID")
    # Both negative is a negative wait: refused for its item, as before.
    negative = pb.RegisterTargetsRequest(
        engine_id="d0",
        targets=[pb.TargetSpec(transfer_id="t", block_ids=[1], timeout={"seconds": -5, "nanos": -5})],
    )
    assert item_error((await stub.RegisterTargets(negative)).results[0])[0] == "TIMEOUT_INVALID"


async def test_a_target_of_no_blocks_matches_and_commits_with_nothing_to_write(
    stub: pb_grpc.RendezvousServiceStub,
) -> None:
    await register(stub, "d0")
    await register(stub, "p0", PRODUCER)
    target_ = await stub.RegisterTargets(
        pb.RegisterTargetsRequest(engine_id="d0", targets=[pb.TargetSpec(transfer_id="t")])
    )
    assert target_.results[0].state == pb.TRANSFER_STATE_TARGETED
    claim_ = await stub.ClaimTransfers(pb.ClaimTransfersRequest(engine_id="p0", claims=[pb.ClaimSpec(transfer_id="t")]))
    assert claim_.results[0].state == pb.TRANSFER_STATE_MATCHED
    done = pb.CompletionSpec(transfer_id="t", generation=1, outcome=pb.COMPLETION_OUTCOME_SUCCEEDED)
    completed = await stub.CompleteTransfers(pb.CompleteTransfersRequest(engine_id="p0", completions=[done]))
    assert completed.results[0].state == pb.TRANSFER_STATE_COMMITTED


@pytest.mark.parametrize(("field", "unstated"), [("model_fingerprint", ""), ("dtype", ""), ("block_size", 0)])
async def test_an_unstated_layout_field_matches_only_an_unstated_one(
    stub: pb_grpc.RendezvousServiceStub, field: str, unstated: object
) -> None:
    for name, role in (("d-unstated", CONSUMER), ("p-unstated", PRODUCER), ("p-stated", PRODUCER)):
        request = engine_request(name, role)
        if name.endswith("-unstated"):
            setattr(request.layout, field, unstated)
        await stub.RegisterEngine(request)
    for transfer_id, producer, state in (
        ("t-same", "p-unstated", pb.TRANSFER_STATE_MATCHED),
        ("t-differs", "p-stated", pb.TRANSFER_STATE_ABORTED),
    ):
        await stub.RegisterTargets(
            pb.RegisterTargetsRequest(
                engine_id="d-unstated", targets=[pb.TargetSpec(transfer_id=transfer_id, block_ids=[1])]
            )
        )
        claimed = await stub.ClaimTransfers(
            pb.ClaimTransfersRequest(engine_id=producer, claims=[pb.ClaimSpec(transfer_id=transfer_id)])
        )
        assert claimed.results[0].state == state
    aborted = (await stub.GetTransfer(pb.GetTransferRequest(transfer_id="t-differs"))).transfer
    assert aborted.abort_reason == pb.ABORT_REASON_LAYOUT_MISMATCH and field in aborted.abort_message


async def test_reserve_credits_reports_the_first_fault_in_the_documented_order(
    stub: pb_grpc.RendezvousServiceStub,
) -> None:
    await register(stub, "d0")
    await register(stub, "p0", PRODUCER)
    await stub.AbortTransfers(pb.AbortTransfersRequest(aborts=[pb.AbortSpec(transfer_id="t-ended")]))
    huge = 1 << 40
    cases = [
        (pb.CreditSpec(transfer_id="t-ended", engine_id="nobody", blocks=huge), "ENGINE_NOT_FOUND"),
        (pb.CreditSpec(transfer_id="t-ended", engine_id="p0", blocks=huge), "WRONG_ROLE"),
        (pb.CreditSpec(transfer_id="t-ended", engine_id="d0", blocks=huge), "TOO_MANY_BLOCKS"),
        (pb.CreditSpec(transfer_id="t-ended", engine_id="d0", blocks=1), "TRANSFER_ENDED"),
    ]
    reply = await stub.ReserveCredits(pb.ReserveCreditsRequest(reservations=[spec for spec, _ in cases]))
    assert [item_error(r)[0] for r in reply.results] == [reason for _, reason in cases]


# 8. Budgets are exact across Redis replicas: checked in the scripts that write the records.

FLEET = "tok-contract-fleet-6e1d0b9a"


def budget_config(scope: str, tmp_path: Path, **limits: int) -> tuple[dict[str, Any], Any]:
    """Server config whose budgets are `limits` (server scope: without auth; identity scope: the *_per_identity
    limits, one identity for engines e-*), and the call metadata of that identity."""
    if scope == "server":
        return {"limits": Limits(**limits)}, None
    doc = {"tokens": {FLEET: {"name": "fleet", "engines": ["e-*"]}}}
    per_identity = {f"{name}_per_identity": n for name, n in limits.items()}
    return {"limits": Limits(**per_identity), "auth_file": auth_file(tmp_path, doc)}, (
        ("authorization", f"Bearer {FLEET}"),
    )


def ten_of_sixteen(outcomes: list[Any], budget: str, scope: str) -> None:
    """Exactly 10 of 16 calls went through; the others were refused for `budget` of `scope`."""
    refusals = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert (len(outcomes) - len(refusals), len(refusals)) == (10, 6), [o for o in outcomes if o in refusals]
    for err in refusals:
        info_ = error_info(err)
        assert (err.code(), info_.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "BUDGET_EXHAUSTED")
        assert (info_.metadata["budget"], info_.metadata["scope"]) == (budget, scope)


@pytest.mark.redis
@pytest.mark.parametrize("scope", ["server", "identity"])
async def test_replicas_registering_at_once_never_pass_an_engine_budget(
    redis_url: str, tmp_path: Path, scope: str
) -> None:
    url = with_prefix(redis_url, fresh_prefix())
    config, metadata = budget_config(scope, tmp_path, max_engines=10)
    async with servers(url, url, **config) as replicas:
        calls = [
            replicas[i % 2].RegisterEngine(engine_request(f"e-{i:02d}", CONSUMER), metadata=metadata) for i in range(16)
        ]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
    ten_of_sixteen(outcomes, "engines", scope)


@pytest.mark.redis
@pytest.mark.parametrize("scope", ["server", "identity"])
async def test_replicas_targeting_at_once_never_pass_the_live_block_budget(
    redis_url: str, tmp_path: Path, scope: str
) -> None:
    url = with_prefix(redis_url, fresh_prefix())
    config, metadata = budget_config(scope, tmp_path, max_live_blocks=100)
    async with servers(url, url, **config) as replicas:
        for i in range(16):
            await replicas[i % 2].RegisterEngine(engine_request(f"e-{i:02d}", CONSUMER), metadata=metadata)

        async def target_(i: int) -> pb.RegisterTargetsResponse:
            spec = pb.TargetSpec(transfer_id=f"t-{i:02d}", block_ids=range(10))
            request = pb.RegisterTargetsRequest(engine_id=f"e-{i:02d}", targets=[spec])
            reply: pb.RegisterTargetsResponse = await replicas[i % 2].RegisterTargets(request, metadata=metadata)
            return reply

        replies = await asyncio.gather(*(target_(i) for i in range(16)))
    refused_ = [r.results[0] for r in replies if r.results[0].HasField("status")]
    assert (16 - len(refused_), len(refused_)) == (10, 6)
    for result in refused_:
        reason, _, metadata_ = item_error(result)
        assert (reason, metadata_["budget"], metadata_["scope"]) == ("BUDGET_EXHAUSTED", "live_blocks", scope)
