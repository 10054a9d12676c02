"""Bounded work per request: no request can stall the service or its health checks.

A request is refused unread past `max_message_bytes` (4 MiB); its items and parts are counted on the message
before any is converted or any record looked up; long batches give the event loop back between items
(rendezvous.pacing); and the health port answers from threads of its own, however long the loop is held.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvous import pacing
from rendezvous.cli import _config_from, build_parser
from rendezvous.core import paging
from rendezvous.core.limits import DEFAULT_MAX_MESSAGE_BYTES, Limits
from rendezvous.core.model import Engine, Transfer
from rendezvous.core.transfers import Transition
from rendezvous.protocol import convert
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.server import RendezvousServer, ServerConfig
from rendezvous.server.app import LIVENESS
from rendezvous.store.redis import RedisStore
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.redis_fixtures import fresh_prefix, redis_url, with_prefix
from tests.security.conftest import serving
from tests.security.test_sizes import largest_engine_request
from tests.service.conftest import engine_request
from tests.service.test_service import error_info

Stub = pb_grpc.RendezvousServiceStub
CONSUMER = pb.ENGINE_ROLE_CONSUMER
SERVING = health_pb2.HealthCheckResponse.SERVING
__all__ = ["redis_url"]  # the fixture


@pytest.fixture
async def server() -> AsyncIterator[RendezvousServer]:
    limits = Limits(max_batch_items=8, max_parts_per_request=100, max_parts_per_completion=8, max_blocks_per_target=8)
    async with serving(limits=limits) as srv:
        yield srv


@pytest.fixture
async def stub(server: RendezvousServer) -> AsyncIterator[Stub]:
    async with grpc.aio.insecure_channel(server.address) as channel:  # no send limit of its own
        yield pb_grpc.RendezvousServiceStub(channel)


def counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Count the calls of module.name from now on (one entry per call)."""
    calls: list[int] = []
    original: Callable[..., Any] = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


async def refused(call: Any, code: grpc.StatusCode, reason: Reason) -> dict[str, str]:
    """The ErrorInfo metadata of a call that must fail with code and reason."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    info = error_info(caught.value)
    assert info.reason == reason.value, caught.value.details()
    return dict(info.metadata)


# Message size


def test_the_default_message_size_admits_the_largest_registration_and_target() -> None:
    assert ServerConfig().max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES == 4 << 20
    limits = Limits()
    engine = largest_engine_request("d", CONSUMER)
    assert engine.ByteSize() < DEFAULT_MAX_MESSAGE_BYTES
    assert engine.ByteSize() > limits.max_engine_agent_metadata_bytes  # every field at its limit is in it
    top = (1 << 63) - 1  # the longest varint a block id takes
    target = pb.TargetSpec(
        transfer_id="t" * limits.max_id_length, block_ids=range(top - limits.max_blocks_per_target, top)
    )
    request = pb.RegisterTargetsRequest(engine_id="d" * limits.max_id_length, targets=[target])
    assert request.ByteSize() < DEFAULT_MAX_MESSAGE_BYTES // 4


def test_serve_flags_set_the_message_size_and_the_parts_cap() -> None:
    defaults = _config_from(build_parser().parse_args(["serve"]))
    assert defaults.max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES
    args = build_parser().parse_args(["serve", "--max-message-bytes=1048576", "--max-parts-per-request=512"])
    config = _config_from(args)
    assert (config.max_message_bytes, config.limits.max_parts_per_request) == (1 << 20, 512)


def test_the_message_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_message_bytes"):
        ServerConfig(max_message_bytes=0)


async def test_a_request_over_the_message_size_is_refused_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving() as server, grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.RendezvousServiceStub(channel)
        converted = counting(monkeypatch, convert, "block_ids")
        blocks = range(1 << 40, (1 << 40) + 65_536)  # 6 bytes a block id: 384 KiB a target
        targets = [pb.TargetSpec(transfer_id=f"t{i}", block_ids=blocks) for i in range(12)]
        request = pb.RegisterTargetsRequest(engine_id="d0", incarnation=1, targets=targets)
        assert request.ByteSize() > DEFAULT_MAX_MESSAGE_BYTES
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.RegisterTargets(request)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value.details()
        assert not converted


# Items and parts, counted before anything is converted


async def test_a_batch_over_the_item_cap_is_refused_before_any_item_is_converted(
    stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    converted = counting(monkeypatch, convert, "block_ids")
    targets = [pb.TargetSpec(transfer_id=f"t{i}", block_ids=[i]) for i in range(9)]
    metadata = await refused(
        stub.RegisterTargets(pb.RegisterTargetsRequest(engine_id="d0", incarnation=1, targets=targets)),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.BATCH_TOO_LARGE,
    )
    assert metadata["limit"] == "8"
    assert not converted


async def test_a_completion_batch_over_the_parts_cap_is_refused_before_any_part_is_converted(
    stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    converted = counting(monkeypatch, convert, "part")
    parts = [pb.WrittenPart(first_token=i, num_tokens=1, num_layers=1) for i in range(34)]
    completions = [
        pb.CompletionSpec(transfer_id=f"t{i}", outcome=pb.COMPLETION_OUTCOME_SUCCEEDED, parts=parts) for i in range(3)
    ]
    metadata = await refused(
        stub.CompleteTransfers(pb.CompleteTransfersRequest(engine_id="d0", incarnation=1, completions=completions)),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.TOO_MANY_PARTS,
    )
    assert (metadata["field"], metadata["limit"]) == ("parts", "100")
    assert not converted


async def test_an_item_over_its_own_limit_is_refused_alone_converting_one_past_the_limit(
    stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    consumer = (await stub.RegisterEngine(engine_request("d0", CONSUMER))).engine
    producer = (await stub.RegisterEngine(engine_request("p0", pb.ENGINE_ROLE_PRODUCER))).engine
    converted_parts = counting(monkeypatch, convert, "part")
    converted_blocks: list[int] = []
    original_ids = convert.block_ids

    def block_ids(values: Any) -> tuple[int, ...]:
        ids = original_ids(values)
        converted_blocks.append(len(ids))
        return ids

    monkeypatch.setattr(convert, "block_ids", block_ids)
    targets = [pb.TargetSpec(transfer_id="long", block_ids=range(50)), pb.TargetSpec(transfer_id="t", block_ids=[1])]
    registered = await stub.RegisterTargets(
        pb.RegisterTargetsRequest(engine_id="d0", incarnation=consumer.incarnation, targets=targets)
    )
    assert converted_blocks == [9, 1]
    assert [error_reason(r) for r in registered.results] == ["TOO_MANY_BLOCKS", ""]
    parts = [pb.WrittenPart(first_token=i, num_tokens=1) for i in range(50)]
    completion = pb.CompletionSpec(transfer_id="t", outcome=pb.COMPLETION_OUTCOME_SUCCEEDED, parts=parts)
    completed = await stub.CompleteTransfers(
        pb.CompleteTransfersRequest(engine_id="p0", incarnation=producer.incarnation, completions=[completion])
    )
    assert len(converted_parts) == 9
    assert [error_reason(r) for r in completed.results] == ["TOO_MANY_PARTS"]


def error_reason(result: pb.ItemResult) -> str:
    """The ErrorInfo reason of a batch item's status ("" when it succeeded)."""
    for detail in result.status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    return ""


async def test_a_huge_page_token_is_refused_unread(stub: Stub, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded = counting(monkeypatch, base64, "b64decode")
    token = "A" * (paging.MAX_TOKEN_CHARS + 4)
    metadata = await refused(
        stub.ListEngines(pb.ListEnginesRequest(page_token=token)),
        grpc.StatusCode.INVALID_ARGUMENT,
        Reason.PAGE_TOKEN_INVALID,
    )
    assert (metadata["field"], metadata["limit"]) == ("page_token", str(paging.MAX_TOKEN_CHARS))
    assert not decoded


def test_a_token_this_server_issues_is_far_under_the_token_cap() -> None:
    longest_id = "x" * Limits().max_id_length
    key = bytes(32)
    scope = f"transfers {longest_id} ALL"
    assert len(paging.encode_token(key, scope, longest_id)) < paging.MAX_TOKEN_CHARS // 2
    with pytest.raises(RendezvousError):
        paging.decode_token(key, scope, "A" * (paging.MAX_TOKEN_CHARS + 1))


# Long work yields to the event loop


async def test_a_long_batch_gives_the_loop_to_other_tasks_between_items(
    stub: Stub, server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pacing, "QUANTUM", 0.0)  # yield at every chance, so the test needs no timing
    engine = (await stub.RegisterEngine(engine_request("d0", CONSUMER))).engine
    ticks = [0]
    seen_at_conversion: list[int] = []
    seen_at_apply: list[int] = []
    original_ids = convert.block_ids
    store = server.coordinator.store
    original_update = store.update_transfer

    def block_ids(values: Any) -> tuple[int, ...]:
        seen_at_conversion.append(ticks[0])
        return original_ids(values)

    async def update_transfer(transfer_id: str, fn: Any) -> Any:
        seen_at_apply.append(ticks[0])
        return await original_update(transfer_id, fn)

    monkeypatch.setattr(convert, "block_ids", block_ids)
    monkeypatch.setattr(store, "update_transfer", update_transfer)

    ticker = asyncio.create_task(_tick(ticks))
    try:
        targets = [pb.TargetSpec(transfer_id=f"t{i}", block_ids=[i]) for i in range(8)]
        response = await stub.RegisterTargets(
            pb.RegisterTargetsRequest(engine_id="d0", incarnation=engine.incarnation, targets=targets)
        )
    finally:
        ticker.cancel()
    assert [r.status.code for r in response.results] == [0] * 8
    # Without yields a memory-store batch runs from its first item to its last in one go: no tick between.
    assert len(seen_at_conversion) == len(seen_at_apply) == 8
    assert seen_at_conversion[-1] > seen_at_conversion[0]
    assert seen_at_apply[-1] > seen_at_apply[0]


@pytest.mark.parametrize("budget", [0, 5, 10, 25, 1_000])
@pytest.mark.parametrize("size", [0, 1, 3, 10])
async def test_a_paced_page_is_the_page_paging_cuts_weighing_the_same_items(budget: int, size: int) -> None:
    items = [7, 1, 12, 3, 3, 9, 2, 30, 1, 4]

    def weighing(log: list[int]) -> Callable[[int], int]:
        def weigh(item: int) -> int:
            log.append(item)
            return item

        return weigh

    cut_log: list[int] = []
    paced_log: list[int] = []
    expected = paging.cut(items, size, weighing(cut_log), budget)
    assert await pacing.paced_cut(items, size, weighing(paced_log), budget) == expected
    assert paced_log == cut_log


@pytest.mark.redis
async def test_a_redis_batch_gives_the_loop_to_other_tasks_between_items(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pacing, "QUANTUM", 0.0)
    store = RedisStore(with_prefix(redis_url, fresh_prefix()))
    await store.open()
    ticks = [0]
    seen: list[int] = []

    def unchanged(cur: Transfer | None, _engines: Mapping[str, Engine]) -> Transition:
        seen.append(ticks[0])
        return Transition(cur)

    ticker = asyncio.create_task(_tick(ticks))
    try:
        await store.update_transfers([(f"t{i}", unchanged) for i in range(8)])
    finally:
        ticker.cancel()
        await store.close()
    assert len(seen) == 8 and seen[-1] > seen[0]  # planned in turns, not in one go


# Health off the serving loop


def probe(port: int, service: str) -> int:
    """A health check of service on the health port, from this thread."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return int(health_pb2_grpc.HealthStub(channel).Check(request, timeout=60).status)


async def test_the_health_port_answers_while_the_serving_loop_is_blocked() -> None:
    async with serving(health_listen="127.0.0.1:0") as server:
        assert server.health_port
        answers: list[int | BaseException] = []
        answered = threading.Event()

        def check() -> None:
            try:
                answers.append(probe(server.health_port or 0, LIVENESS))
            except BaseException as exc:  # reported below, on the test's thread
                answers.append(exc)
            finally:
                answered.set()

        thread = threading.Thread(target=check)
        thread.start()
        # Hold the serving loop (this test's loop) until the probe is answered: a health service on the loop
        # could answer only after it, so the probe would time out first.
        answered.wait(timeout=120)
        thread.join()
        assert answers == [SERVING]


async def test_the_health_port_follows_the_status_the_loop_sets() -> None:
    async with serving(health_listen="127.0.0.1:0") as server:
        port = server.health_port or 0
        assert await asyncio.to_thread(probe, port, "") == SERVING
        await server._set_serving(False)
        assert await asyncio.to_thread(probe, port, "") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await asyncio.to_thread(probe, port, LIVENESS) == SERVING


async def test_open_watches_on_the_health_port_do_not_hold_its_threads() -> None:
    async with serving(health_listen="127.0.0.1:0") as server:
        port = server.health_port or 0

        def watch_many_then_check() -> int:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                watches = [stub.Watch(health_pb2.HealthCheckRequest(service=LIVENESS)) for _ in range(64)]
                try:
                    assert all(next(w).status == SERVING for w in watches)  # every stream is open
                    return probe(port, LIVENESS)
                finally:
                    for w in watches:
                        w.cancel()

        assert await asyncio.to_thread(watch_many_then_check) == SERVING


async def _tick(ticks: list[int]) -> None:
    """Count the loop's turns a concurrent task gets (ticks[0]) until cancelled."""
    while True:
        ticks[0] += 1
        await asyncio.sleep(0)
