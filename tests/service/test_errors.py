"""Bad input gets a specific status code and ErrorInfo reason, never a crash or a hang."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import NoReturn

import grpc
import pytest

from rendezvous.server import RendezvousServer, ServerConfig, servicer
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.service.conftest import LAYOUT, engine_request
from tests.service.test_service import CONSUMER, PRODUCER, error_info, expect_error, item_reason, register_pair

Stub = pb_grpc.RendezvousServiceStub
Code = grpc.StatusCode


async def target(stub: Stub, *specs: pb.TargetSpec, engine_id: str = "d1") -> list[pb.ItemResult]:
    return list((await stub.RegisterTargets(pb.RegisterTargetsRequest(engine_id=engine_id, targets=specs))).results)


@pytest.mark.parametrize(
    ("engine_id", "reason"), [("", "ID_EMPTY"), ("e" * 257, "ID_TOO_LONG"), ("bad id", "ID_INVALID")]
)
async def test_bad_engine_ids(stub: Stub, engine_id: str, reason: str) -> None:
    await expect_error(stub.RegisterEngine(engine_request(engine_id, CONSUMER)), Code.INVALID_ARGUMENT, reason)


async def test_unspecified_role(stub: Stub) -> None:
    await expect_error(
        stub.RegisterEngine(engine_request("x", pb.ENGINE_ROLE_UNSPECIFIED)), Code.INVALID_ARGUMENT, "ROLE_UNSPECIFIED"
    )


async def test_overlapping_regions_are_invalid_agents(stub: Stub) -> None:
    request = engine_request("x", CONSUMER)
    request.agents[0].regions[0].block_stride_bytes = 1
    await expect_error(stub.RegisterEngine(request), Code.INVALID_ARGUMENT, "AGENTS_INVALID")


async def test_conflicting_reregistration(stub: Stub) -> None:
    await register_pair(stub)
    await expect_error(stub.RegisterEngine(engine_request("p1", CONSUMER)), Code.ALREADY_EXISTS, "ENGINE_CONFLICT")


async def test_unknown_engine_and_transfer(stub: Stub) -> None:
    await expect_error(
        stub.RegisterTargets(pb.RegisterTargetsRequest(engine_id="ghost", targets=[pb.TargetSpec(transfer_id="t")])),
        Code.NOT_FOUND,
        "ENGINE_NOT_FOUND",
    )
    await expect_error(stub.GetEngine(pb.GetEngineRequest(engine_id="ghost")), Code.NOT_FOUND, "ENGINE_NOT_FOUND")
    await expect_error(stub.GetTransfer(pb.GetTransferRequest(transfer_id="t")), Code.NOT_FOUND, "TRANSFER_NOT_FOUND")
    await register_pair(stub)
    result = await stub.ReleaseTargets(
        pb.ReleaseTargetsRequest(engine_id="d1", releases=[pb.ReleaseSpec(transfer_id="t")])
    )
    assert item_reason(result.results[0].status) == "TRANSFER_NOT_FOUND"


async def test_wrong_role(stub: Stub) -> None:
    await register_pair(stub)
    (result,) = await target(stub, pb.TargetSpec(transfer_id="t", block_ids=[1]), engine_id="p1")
    assert result.status.code == Code.FAILED_PRECONDITION.value[0]
    assert item_reason(result.status) == "WRONG_ROLE"


@pytest.mark.parametrize(
    ("blocks", "code", "reason"),
    [
        ([-1], Code.INVALID_ARGUMENT, "BLOCK_ID_NEGATIVE"),
        ([3, 3], Code.INVALID_ARGUMENT, "BLOCK_ID_DUPLICATE"),
        ([64], Code.OUT_OF_RANGE, "BLOCK_ID_OUT_OF_RANGE"),
    ],
)
async def test_bad_block_ids(stub: Stub, blocks: list[int], code: grpc.StatusCode, reason: str) -> None:
    await register_pair(stub)
    (result,) = await target(stub, pb.TargetSpec(transfer_id="t", block_ids=blocks))
    assert (result.status.code, item_reason(result.status)) == (code.value[0], reason)


async def test_one_bad_item_does_not_fail_the_batch(stub: Stub) -> None:
    await register_pair(stub)
    good, bad = await target(stub, pb.TargetSpec(transfer_id="a", block_ids=[1]), pb.TargetSpec(transfer_id=""))
    assert good.state == pb.TRANSFER_STATE_TARGETED and good.status.code == 0
    assert item_reason(bad.status) == "ID_EMPTY"


async def test_layout_mismatch_is_reported_to_both(stub: Stub) -> None:
    await stub.RegisterEngine(engine_request("d1", CONSUMER))
    other = engine_request("p1", PRODUCER)
    other.layout.CopyFrom(
        pb.KvLayout(
            model_fingerprint="other-model", dtype=LAYOUT.dtype, block_size=16, num_layers=2, tp_size=1, pp_size=1
        )
    )
    await stub.RegisterEngine(other)
    await target(stub, pb.TargetSpec(transfer_id="t", block_ids=[1]))
    claimed = await stub.ClaimTransfers(
        pb.ClaimTransfersRequest(engine_id="p1", claims=[pb.ClaimSpec(transfer_id="t")])
    )
    assert claimed.results[0].state == pb.TRANSFER_STATE_ABORTED
    t = (await stub.GetTransfer(pb.GetTransferRequest(transfer_id="t"))).transfer
    assert t.abort_reason == pb.ABORT_REASON_LAYOUT_MISMATCH and "model_fingerprint" in t.abort_message


async def test_data_plane_versions_are_checked_at_registration_and_match(stub: Stub) -> None:
    newer = engine_request("p9", PRODUCER)
    newer.layout.data_plane_version = 99
    await expect_error(stub.RegisterEngine(newer), Code.FAILED_PRECONDITION, "DATA_PLANE_VERSION_UNSUPPORTED")
    await stub.RegisterEngine(engine_request("d1", CONSUMER))  # states no version: 1
    producer = engine_request("p1", PRODUCER)
    producer.layout.data_plane_version = 2
    await stub.RegisterEngine(producer)
    await target(stub, pb.TargetSpec(transfer_id="t", block_ids=[1]))
    claimed = await stub.ClaimTransfers(
        pb.ClaimTransfersRequest(engine_id="p1", claims=[pb.ClaimSpec(transfer_id="t")])
    )
    assert claimed.results[0].state == pb.TRANSFER_STATE_ABORTED
    t = (await stub.GetTransfer(pb.GetTransferRequest(transfer_id="t"))).transfer
    assert t.abort_reason == pb.ABORT_REASON_DATA_PLANE_MISMATCH
    assert t.abort_message == "producer data-plane version 2; consumer data-plane version 1 reads 1"


async def test_conflicting_target_and_stale_generation(stub: Stub) -> None:
    await register_pair(stub)
    await target(stub, pb.TargetSpec(transfer_id="t", block_ids=[1], generation=2))
    (conflict,) = await target(stub, pb.TargetSpec(transfer_id="t", block_ids=[2], generation=2))
    assert item_reason(conflict.status) == "TARGET_CONFLICT"
    (stale,) = await target(stub, pb.TargetSpec(transfer_id="t", block_ids=[2], generation=1))
    assert item_reason(stale.status) == "STALE_GENERATION"


async def test_limits_exceeded(stub: Stub) -> None:
    await register_pair(stub)
    too_many = [pb.TargetSpec(transfer_id=f"t{i}", block_ids=[1]) for i in range(129)]
    await expect_error(
        stub.RegisterTargets(pb.RegisterTargetsRequest(engine_id="d1", targets=too_many)),
        Code.INVALID_ARGUMENT,
        "BATCH_TOO_LARGE",
    )
    watches = [stub.Watch(pb.WatchRequest(engine_id="d1")) for _ in range(2)]
    for w in watches:
        await w.read()
    await expect_error(stub.Watch(pb.WatchRequest(engine_id="d1")).read(), Code.RESOURCE_EXHAUSTED, "TOO_MANY_WATCHERS")
    for w in watches:
        w.cancel()


async def test_malformed_watch_sequence(stub: Stub) -> None:
    await register_pair(stub)
    await expect_error(
        stub.Watch(pb.WatchRequest(engine_id="d1", start_sequence=10**9)).read(), Code.OUT_OF_RANGE, "SEQUENCE_INVALID"
    )
    await expect_error(stub.Watch(pb.WatchRequest(engine_id="ghost")).read(), Code.NOT_FOUND, "ENGINE_NOT_FOUND")


async def test_bad_page_token_and_state_filter(stub: Stub) -> None:
    await expect_error(
        stub.ListTransfers(pb.ListTransfersRequest(page_token="%%%")), Code.INVALID_ARGUMENT, "PAGE_TOKEN_INVALID"
    )
    bad_state = pb.ListTransfersRequest(states=[42])  # type: ignore[list-item]  # not a state: that is the test
    await expect_error(stub.ListTransfers(bad_state), Code.INVALID_ARGUMENT, "STATE_INVALID")


async def test_unspecified_completion_outcome(stub: Stub) -> None:
    await register_pair(stub)
    result = await stub.CompleteTransfers(
        pb.CompleteTransfersRequest(engine_id="p1", completions=[pb.CompletionSpec(transfer_id="t", generation=1)])
    )
    assert item_reason(result.results[0].status) == "OUTCOME_UNSPECIFIED"


def _no_regions(r: pb.RegisterEngineRequest) -> None:
    del r.agents[0].regions[:]


def _same_region_twice(r: pb.RegisterEngineRequest) -> None:
    r.agents[0].regions.append(r.agents[0].regions[0])


def _interleaved_overlap(r: pb.RegisterEngineRequest) -> None:
    first = r.agents[0].regions[0]
    r.agents[0].regions.append(
        pb.KvRegion(
            base_address=first.base_address + 2048,
            block_stride_bytes=first.block_stride_bytes,
            block_length_bytes=4096,
            num_blocks=4,
        )
    )


def _memory_kind(value: int) -> Callable[[pb.RegisterEngineRequest], None]:
    def change(r: pb.RegisterEngineRequest) -> None:
        r.agents[0].memory_kind = value  # type: ignore[assignment]

    return change


def _layout(**sizes: int) -> Callable[[pb.RegisterEngineRequest], None]:
    def change(r: pb.RegisterEngineRequest) -> None:
        for name, value in sizes.items():
            setattr(r.layout, name, value)

    return change


def _labels(r: pb.RegisterEngineRequest) -> None:
    r.labels.update({f"k{i}": "v" for i in range(1000)})


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (_no_regions, "AGENTS_INVALID"),
        (_same_region_twice, "AGENTS_INVALID"),
        (_interleaved_overlap, "AGENTS_INVALID"),
        (_memory_kind(pb.MEMORY_KIND_UNSPECIFIED), "AGENTS_INVALID"),
        (_memory_kind(7), "AGENTS_INVALID"),
        (_layout(tp_size=0), "LAYOUT_INVALID"),
        (_layout(pp_size=0), "LAYOUT_INVALID"),
        (_labels, "LABELS_INVALID"),
    ],
)
async def test_registrations_the_protocol_rejects(
    stub: Stub, change: Callable[[pb.RegisterEngineRequest], None], reason: str
) -> None:
    request = engine_request("x", CONSUMER)
    change(request)
    await expect_error(stub.RegisterEngine(request), Code.INVALID_ARGUMENT, reason)


async def test_interleaved_k_and_v_regions_are_accepted(stub: Stub) -> None:
    """Views kv[:, 0] and kv[:, 1] of one [blocks, 2, ...] tensor share a stride and no byte."""
    request = engine_request("x", CONSUMER)
    del request.agents[0].regions[:]
    for offset in (0, 4096):
        request.agents[0].regions.append(
            pb.KvRegion(base_address=(1 << 20) + offset, block_stride_bytes=8192, block_length_bytes=4096, num_blocks=8)
        )
    assert (await stub.RegisterEngine(request)).engine.incarnation


async def test_an_unknown_transfer_mode_is_refused_per_item(stub: Stub) -> None:
    await register_pair(stub)
    bad, good = await target(
        stub,
        pb.TargetSpec(transfer_id="t-bad", block_ids=[1], mode=7),  # type: ignore[arg-type]
        pb.TargetSpec(transfer_id="t-good", block_ids=[1]),
    )
    assert (bad.status.code, item_reason(bad.status)) == (Code.INVALID_ARGUMENT.value[0], "MODE_INVALID")
    assert good.state == pb.TRANSFER_STATE_TARGETED


async def test_generation_zero_means_one_in_every_call(stub: Stub) -> None:
    await register_pair(stub)
    await target(stub, pb.TargetSpec(transfer_id="t", block_ids=[1]))
    await stub.ClaimTransfers(pb.ClaimTransfersRequest(engine_id="p1", claims=[pb.ClaimSpec(transfer_id="t")]))
    completed = await stub.CompleteTransfers(
        pb.CompleteTransfersRequest(
            engine_id="p1",
            completions=[pb.CompletionSpec(transfer_id="t", outcome=pb.COMPLETION_OUTCOME_SUCCEEDED)],
        )
    )
    assert completed.results[0].state == pb.TRANSFER_STATE_COMMITTED
    released = await stub.ReleaseTargets(
        pb.ReleaseTargetsRequest(engine_id="d1", releases=[pb.ReleaseSpec(transfer_id="t")])
    )
    assert released.results[0].state == pb.TRANSFER_STATE_RELEASED


async def test_a_bug_in_a_handler_is_internal_with_a_reason_and_a_request_id_in_the_log(
    server: RendezvousServer, stub: Stub, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(*args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.coordinator, "get_transfer", broken)
    monkeypatch.setattr(server.coordinator, "deregister_engine", broken)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetTransfer(pb.GetTransferRequest(transfer_id="t"))
    assert caught.value.code() == Code.INTERNAL
    info = error_info(caught.value)
    assert info.reason == "INTERNAL_ERROR" and info.metadata["request_id"]
    assert "a bug" not in (caught.value.details() or "")  # the bug stays in the server's log
    (record,) = [r for r in caplog.records if getattr(r, "request_id", "") == info.metadata["request_id"]]
    assert record.exc_info is not None and "a bug" in str(record.exc_info[1])
    # A call with a request_id is logged under that one.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.DeregisterEngine(pb.DeregisterEngineRequest(engine_id="d1", request_id="rid-1"))
    assert (caught.value.code(), error_info(caught.value).metadata["request_id"]) == (Code.INTERNAL, "rid-1")


async def test_a_bug_while_answering_a_keepalive_is_internal_with_a_reason(
    stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, _ = await register_pair(stub)

    def broken(*args: object) -> NoReturn:
        raise RuntimeError("a bug")

    monkeypatch.setattr(servicer, "duration", broken)  # the response's lease_ttl
    stream = stub.KeepAlive()
    await stream.write(pb.KeepAliveRequest(engine_id="d1", incarnation=d.engine.incarnation))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stream.read()
    assert caught.value.code() == Code.INTERNAL
    assert error_info(caught.value).reason == "INTERNAL_ERROR"


async def test_an_open_watch_is_told_the_server_is_shutting_down(server_config: ServerConfig) -> None:
    server = RendezvousServer(replace(server_config, grace=30.0))  # a grace the watch ends well within
    await server.start()
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = Stub(channel)
        await stub.RegisterEngine(engine_request("d1", CONSUMER))
        watch = stub.Watch(pb.WatchRequest(engine_id="d1"))
        assert (await watch.read()).header.epoch  # established
        stopping = asyncio.create_task(server.stop())
        await expect_error(watch.read(), Code.UNAVAILABLE, "SHUTTING_DOWN")
        await stopping
