"""Request ids belong to their caller (found by an audit): the router's calls (ReserveCredits, ReleaseCredits,
AbortTransfers as the router) name no engine, so their answers were kept under the method and request id alone,
and one router identity's request id answered, or refused REQUEST_ID_REUSED, another's call with the same id."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from rendezvous.v1 import rendezvous_pb2 as pb
from tests.security.conftest import serving
from tests.security.test_auth import AUTH, DECODE, ROUTER, auth_file, call, refusal, register

OTHER_ROUTER = "tok-router-b-51f0e7"
REUSED = (grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_ID_REUSED")


@pytest.fixture
async def channel(tmp_path: Path) -> AsyncIterator[grpc.aio.Channel]:
    tokens = {**AUTH["tokens"], OTHER_ROUTER: {"name": "router-b", "roles": ["router"]}}  # type: ignore[dict-item]
    async with (
        serving(auth_file=auth_file(tmp_path, {**AUTH, "tokens": tokens})) as server,
        grpc.aio.insecure_channel(server.address) as ch,
    ):
        yield ch


def release(request_id: str, *transfer_ids: str) -> pb.ReleaseCreditsRequest:
    return pb.ReleaseCreditsRequest(request_id=request_id, transfer_ids=transfer_ids)


async def test_one_router_s_request_id_does_not_refuse_another_s_call(channel: grpc.aio.Channel) -> None:
    first = await call(channel, "ReleaseCredits", release("r-1", "t-1"), ROUTER)
    other = await call(channel, "ReleaseCredits", release("r-1", "t-2", "t-3"), OTHER_ROUTER)
    assert [len(first.results), len(other.results)] == [1, 2]  # each its own answer
    # Within one identity a request id still names one request.
    assert await refusal(call(channel, "ReleaseCredits", release("r-1", "t-9"), ROUTER)) == REUSED
    assert await refusal(call(channel, "ReleaseCredits", release("r-1", "t-9"), OTHER_ROUTER)) == REUSED


async def test_a_router_s_retry_gets_its_kept_answer_and_only_it_does(channel: grpc.aio.Channel) -> None:
    """A release answers the engine it released on; run again it would answer none (nothing left to release)."""
    await register(channel, "decode-0", DECODE)
    reserve = pb.ReserveCreditsRequest(reservations=[pb.CreditSpec(transfer_id="t-1", engine_id="decode-0")])
    assert (await call(channel, "ReserveCredits", reserve, ROUTER)).results[0].engine_id == "decode-0"
    first = await call(channel, "ReleaseCredits", release("r-2", "t-1"), ROUTER)
    assert first.results[0].engine_id == "decode-0"
    assert await call(channel, "ReleaseCredits", release("r-2", "t-1"), ROUTER) == first  # the kept answer
    other = await call(channel, "ReleaseCredits", release("r-2", "t-1"), OTHER_ROUTER)  # runs: its own id
    assert other.results[0].engine_id == ""
