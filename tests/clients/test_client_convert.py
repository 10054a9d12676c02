"""The wire mapping: SDK records to protocol messages and back, without a server."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import error_details_pb2, status_pb2
from hypothesis import given
from hypothesis import strategies as st

from rendezvous.clients import (
    ERROR_DOMAIN,
    AbortReason,
    ClaimSpec,
    CompletionOutcome,
    CompletionSpec,
    EngineRole,
    EngineSpec,
    EventType,
    InvalidArgument,
    TargetSpec,
    TransferMode,
    TransferState,
    WrittenPart,
    _convert,
)
from rendezvous.clients import _commands as commands
from rendezvous.protocol import convert
from rendezvous.v1 import rendezvous_pb2 as pb
from tests.clients.conftest import LAYOUT, agent


def test_sdk_enums_share_the_protocol_numbers() -> None:
    pairs = [
        (EngineRole.CONSUMER, pb.ENGINE_ROLE_CONSUMER),
        (TransferState.COMMITTED, pb.TRANSFER_STATE_COMMITTED),
        (TransferMode.PULL, pb.TRANSFER_MODE_PULL),
        (AbortReason.BLOCK_MISMATCH, pb.ABORT_REASON_BLOCK_MISMATCH),
        (EventType.REVOCATION_CONFIRMED, pb.EVENT_TYPE_REVOCATION_CONFIRMED),
        (CompletionOutcome.FAILED, pb.COMPLETION_OUTCOME_FAILED),
    ]
    for ours, wire in pairs:
        assert int(ours) == wire


def test_enum_numbers_unknown_to_this_client_read_as_unspecified() -> None:
    assert TransferState(99) is TransferState.UNSPECIFIED
    assert EventType(42) is EventType.UNSPECIFIED


def test_registration_request_carries_the_whole_engine_spec() -> None:
    spec = EngineSpec("d0", "decode", EngineRole.CONSUMER, LAYOUT, (agent("d0-0"),), {"zone": "a"}, lease_ttl=2.5)
    request = convert.register_engine_request(spec, "rid")
    assert request.request_id == "rid"
    assert (request.engine_id, request.pool, request.role) == ("d0", "decode", pb.ENGINE_ROLE_CONSUMER)
    assert convert.layout(request.layout) == LAYOUT
    assert convert.agent(request.agents[0]) == spec.agents[0]
    assert dict(request.labels) == {"zone": "a"}
    assert convert.seconds(request.lease_ttl) == 2.5


def test_zero_durations_are_left_unset_so_the_server_default_applies() -> None:
    target = convert.target_message(TargetSpec("t", [1], timeout=0.0))
    assert not target.HasField("timeout")
    claim = convert.claim_message(ClaimSpec("t", timeout=1.25))
    assert claim.timeout == Duration(seconds=1, nanos=250_000_000)


@given(st.floats(min_value=0.001, max_value=3600.0, allow_nan=False))
def test_durations_round_trip_to_the_nanosecond(seconds: float) -> None:
    duration = convert.duration(seconds)
    assert duration is not None
    assert abs(convert.seconds(duration) - seconds) < 1e-9


@given(
    st.text(min_size=1, max_size=32),
    st.lists(st.integers(min_value=0, max_value=2**40), max_size=64),
    st.integers(min_value=0, max_value=2**31),
    st.integers(min_value=1, max_value=2**40),
    st.sampled_from([TransferMode.PUSH, TransferMode.PULL]),
)
def test_targets_reach_the_wire_unchanged_and_read_back_as_sent(
    transfer_id: str, block_ids: list[int], num_tokens: int, generation: int, mode: TransferMode
) -> None:
    spec = TargetSpec(transfer_id, tuple(block_ids), generation=generation, num_tokens=num_tokens, mode=mode)
    m = convert.target_message(spec)
    assert (m.transfer_id, list(m.block_ids), m.num_tokens, m.generation, m.mode) == (
        transfer_id,
        block_ids,
        num_tokens,
        generation,
        int(mode),
    )
    assert convert.target_spec(m, max_blocks=64) == spec


def test_a_transfer_message_becomes_a_record_with_its_times() -> None:
    message = pb.Transfer(
        transfer_id="t",
        state=pb.TRANSFER_STATE_ABORTED,
        mode=pb.TRANSFER_MODE_PULL,
        generation=3,
        consumer_engine_id="d",
        consumer_incarnation=7,
        target_block_ids=[4, 5],
        source_block_ids=[9],
        abort_reason=pb.ABORT_REASON_PEER_LOST,
        abort_message="gone",
        deadline_time=Timestamp(seconds=100, nanos=500_000_000),
        times=pb.TransferTimes(target_time=Timestamp(seconds=90)),
    )
    record = _convert.transfer(message)
    assert record.state is TransferState.ABORTED and record.state.terminal
    assert record.mode is TransferMode.PULL
    assert (record.target_block_ids, record.source_block_ids) == ((4, 5), (9,))
    assert (record.abort_reason, record.abort_message) == (AbortReason.PEER_LOST, "gone")
    assert record.deadline == 100.5
    assert (record.times.target_time, record.times.commit_time) == (90.0, 0.0)


def test_progressive_targets_and_their_parts_cross_the_wire_both_ways() -> None:
    target = convert.target_message(TargetSpec("t", [1], num_tokens=32, progressive=True))
    assert target.progressive and not convert.target_message(TargetSpec("u", [1])).progressive
    parts = (WrittenPart(0, 16), WrittenPart(16, 16, first_layer=3, num_layers=2))
    completion = convert.completion_message(CompletionSpec("t", 1, parts=parts))
    assert convert.completion_spec(completion, max_parts=8) == CompletionSpec("t", 1, parts=parts)
    assert tuple(convert.part(p) for p in completion.parts) == parts
    assert [(p.first_token, p.num_tokens, p.first_layer, p.num_layers) for p in completion.parts] == [
        (0, 16, 0, 0),
        (16, 16, 3, 2),
    ]
    assert _convert.transfer(pb.Transfer(transfer_id="t", progressive=True)).progressive
    assert not _convert.transfer(pb.Transfer(transfer_id="t")).progressive


def test_an_event_without_transfer_or_peer_has_none_for_them() -> None:
    event = _convert.event(pb.Event(sequence=4, type=pb.EVENT_TYPE_PEER_LOST, generation=0))
    assert (event.sequence, event.type, event.transfer, event.peer) == (4, EventType.PEER_LOST, None, None)


def test_an_item_with_an_error_status_carries_the_exception() -> None:
    status = status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="bad")
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason="ID_EMPTY", domain=ERROR_DOMAIN))
    ok, failed = _convert.item_results(
        pb.RegisterTargetsResponse(
            results=[
                pb.ItemResult(transfer_id="a", state=pb.TRANSFER_STATE_TARGETED),
                pb.ItemResult(transfer_id="b", status=status),
            ]
        )
    )
    assert ok.ok and ok.state is TransferState.TARGETED and ok.raise_for_error() is ok
    assert not failed.ok
    assert isinstance(failed.error, InvalidArgument) and failed.error.reason == "ID_EMPTY"


def test_mutating_calls_get_a_fresh_request_id_each_and_reads_none() -> None:
    first = commands.complete_transfers("p", 1, [CompletionSpec("t", 1)])
    second = commands.complete_transfers("p", 1, [CompletionSpec("t", 1)])
    assert first.request.request_id and second.request.request_id  # type: ignore[attr-defined]
    assert first.request.request_id != second.request.request_id  # type: ignore[attr-defined]
    assert not first.idempotent
    assert commands.get_transfer("t").idempotent


def test_single_item_calls_keep_the_request_and_raise_the_item_error() -> None:
    batch = commands.register_targets("d", 1, [TargetSpec("t", [1])])
    single = batch.one()
    assert single.request is batch.request and single.method == "RegisterTargets"
    status = status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="bad")
    response = pb.RegisterTargetsResponse(results=[pb.ItemResult(transfer_id="t", status=status)])
    with pytest.raises(InvalidArgument, match="bad"):
        single.parse(response)


def test_status_counts_transfers_by_state_enum_and_an_unknown_state_as_unspecified() -> None:
    message = pb.GetStatusResponse(transfers_by_state={"TARGETED": 2, "MATCHED": 1, "PAUSED": 3, "PARKED": 1})
    counts = _convert.server_status(message).transfers_by_state
    assert counts == {TransferState.TARGETED: 2, TransferState.MATCHED: 1, TransferState.UNSPECIFIED: 4}
    assert all(isinstance(state, TransferState) for state in counts)
