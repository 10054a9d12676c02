"""One protocol vocabulary: the service and the SDK use the same reasons, enums and records, taken from the proto."""

from __future__ import annotations

import re

from rendezvous import clients, core
from rendezvous.conformance import driver as conformance_driver
from rendezvous.protocol import REASON_CODES, Reason, errors
from rendezvous.v1 import errors_pb2, rendezvous_pb2


def test_every_reason_of_the_proto_is_a_python_reason_with_a_code() -> None:
    names = {v.name.removeprefix("ERROR_REASON_") for v in errors_pb2.ErrorReason.DESCRIPTOR.values if v.number}
    assert names == {r.value for r in Reason}
    assert set(REASON_CODES) == set(Reason)
    assert {errors.REASON_CODES[r].name for r in Reason} == set(REASON_CODES.values())


def test_the_error_domain_is_the_dns_name_errors_proto_states_once() -> None:
    # The conformance suite reads it from the stubs (errors.proto's option), the packages from the generated
    # reasons module: the same one string.
    assert errors.ERROR_DOMAIN == clients.ERROR_DOMAIN == conformance_driver.ERROR_DOMAIN
    assert re.fullmatch(r"[a-z0-9-]+(\.[a-z0-9-]+)+", errors.ERROR_DOMAIN), errors.ERROR_DOMAIN


def test_service_and_sdk_share_the_same_objects() -> None:
    assert clients.Reason is errors.Reason is Reason
    assert clients.TransferState is core.State
    assert clients.EngineRole is core.Role
    assert clients.KvLayout is core.KvLayout
    assert clients.NixlAgentInfo is core.NixlAgent
    assert clients.Event is core.Event and clients.RendezvousError is core.RendezvousError
    assert clients.TargetSpec is core.TargetSpec and clients.EngineSpec is core.EngineSpec


def test_enum_numbers_equal_the_protos() -> None:
    for enum, proto in [
        (clients.EngineRole, rendezvous_pb2.EngineRole),
        (clients.MemoryKind, rendezvous_pb2.MemoryKind),
        (clients.TransferState, rendezvous_pb2.TransferState),
        (clients.TransferMode, rendezvous_pb2.TransferMode),
        (clients.EngineView, rendezvous_pb2.EngineView),
        (clients.AbortReason, rendezvous_pb2.AbortReason),
        (clients.EventType, rendezvous_pb2.EventType),
        (clients.CompletionOutcome, rendezvous_pb2.CompletionOutcome),
    ]:
        prefix = proto.DESCRIPTOR.values[0].name.removesuffix("UNSPECIFIED")
        assert {m.name: int(m) for m in enum} == {
            v.name.removeprefix(prefix): v.number for v in proto.DESCRIPTOR.values
        }


def test_a_number_from_a_newer_peer_reads_as_unspecified() -> None:
    assert clients.TransferState(42) is clients.TransferState.UNSPECIFIED
