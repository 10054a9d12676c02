"""The exception tree: built from google.rpc.Status (per-item errors) and from failed gRPC calls."""

from __future__ import annotations

import pickle

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from rendezvous.clients import (
    ERROR_DOMAIN,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Reason,
    RendezvousError,
    Unavailable,
)
from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.protocol import errors as protocol_errors
from rendezvous.protocol.convert import error as from_status
from rendezvous.protocol.convert import error_status
from rendezvous.protocol.errors import error_for


def rich_status(code: grpc.StatusCode, message: str, reason: str, **metadata: str) -> status_pb2.Status:
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain=ERROR_DOMAIN, metadata=metadata))
    return status


def failed_call(code: grpc.StatusCode, details: str, status: status_pb2.Status | None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if status is not None:
        trailing.add("grpc-status-details-bin", status.SerializeToString())
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def test_a_status_with_error_info_becomes_the_subclass_of_its_code_with_the_reason() -> None:
    err = from_status(rich_status(grpc.StatusCode.FAILED_PRECONDITION, "lease gone", "LEASE_EXPIRED", engine_id="e1"))
    assert type(err) is FailedPrecondition
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert (err.reason, err.domain, err.metadata, err.message) == (
        "LEASE_EXPIRED",
        ERROR_DOMAIN,
        {"engine_id": "e1"},
        "lease gone",
    )
    assert err.reason == Reason.LEASE_EXPIRED


def test_a_status_without_error_info_has_an_empty_reason() -> None:
    err = from_status(status_pb2.Status(code=grpc.StatusCode.NOT_FOUND.value[0], message="nope"))
    assert isinstance(err, NotFound)
    assert (err.reason, err.domain, err.metadata) == ("", "", {})


def test_a_failed_call_with_rich_details_maps_to_the_reason_and_keeps_the_call_as_cause() -> None:
    status = rich_status(grpc.StatusCode.INVALID_ARGUMENT, "engine_id must not be empty", "ID_EMPTY", field="engine_id")
    call = failed_call(grpc.StatusCode.INVALID_ARGUMENT, "engine_id must not be empty", status)
    err = from_rpc_error(call)
    assert isinstance(err, InvalidArgument)
    assert (err.reason, err.metadata["field"]) == ("ID_EMPTY", "engine_id")
    assert err.__cause__ is call


def test_a_failed_call_without_details_maps_by_its_status_line() -> None:
    err = from_rpc_error(failed_call(grpc.StatusCode.UNAVAILABLE, "failed to connect", None))
    assert isinstance(err, Unavailable)
    assert (err.reason, err.message) == ("", "failed to connect")


def test_details_that_contradict_the_status_line_are_ignored() -> None:
    status = rich_status(grpc.StatusCode.NOT_FOUND, "other", "ENGINE_NOT_FOUND")
    err = from_rpc_error(failed_call(grpc.StatusCode.UNAVAILABLE, "proxy down", status))
    assert isinstance(err, Unavailable) and err.reason == ""


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c != grpc.StatusCode.OK])
def test_every_error_code_has_a_subclass_of_its_own(code: grpc.StatusCode) -> None:
    err = error_for(code, "m")
    assert type(err) is not RendezvousError
    assert err.code == code and type(err).code == code


def test_errors_survive_pickling_with_their_reason() -> None:
    err = from_status(rich_status(grpc.StatusCode.ALREADY_EXISTS, "taken", "TARGET_CONFLICT", transfer_id="t"))
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is type(err)
    assert (copy.reason, copy.metadata, copy.message, copy.code) == (err.reason, err.metadata, err.message, err.code)


def test_the_message_names_code_and_reason() -> None:
    err = from_status(rich_status(grpc.StatusCode.FAILED_PRECONDITION, "lease gone", "LEASE_EXPIRED"))
    assert str(err) == "FAILED_PRECONDITION [LEASE_EXPIRED]: lease gone"


def test_the_sdk_raises_the_services_own_error_classes() -> None:
    assert RendezvousError is protocol_errors.RendezvousError and Reason is protocol_errors.Reason
    assert FailedPrecondition is protocol_errors.FailedPrecondition


def test_an_error_raised_with_a_reason_is_of_the_subclass_of_the_reasons_code() -> None:
    err = RendezvousError(Reason.LEASE_EXPIRED, "lease gone", engine_id="e1")
    assert type(err) is FailedPrecondition and err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert (err.domain, err.metadata) == (ERROR_DOMAIN, {"engine_id": "e1"})


def test_an_error_crosses_the_wire_as_it_was_raised() -> None:
    sent = RendezvousError(Reason.TARGET_CONFLICT, "taken", transfer_id="t")
    got = from_status(error_status(sent))
    assert (type(got), got.code, got.reason, got.domain, got.metadata, got.message) == (
        type(sent),
        sent.code,
        sent.reason,
        sent.domain,
        sent.metadata,
        sent.message,
    )
    assert got.reason is Reason.TARGET_CONFLICT


def test_a_retry_hint_of_the_server_reaches_the_error_and_survives_pickling() -> None:
    refused = RendezvousError(Reason.RATE_LIMITED, "slow down", retry_after=0.25)
    err = from_status(error_status(refused))
    assert (err.code, err.reason, err.retry_after) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "RATE_LIMITED", 0.25)
    assert pickle.loads(pickle.dumps(err)).retry_after == 0.25
    unhinted = from_status(error_status(RendezvousError(Reason.RATE_LIMITED, "no")))
    assert unhinted.retry_after is None
