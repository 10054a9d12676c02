"""Fuzzing every RPC of a real server: messages generated from the proto descriptors, then raw bytes.

No call crashes the server or hangs (each is bounded by a deadline), every refusal of a well-formed
message carries an ErrorInfo reason, and the server still answers afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.clients.testing import TestServer
from rendezvous.core import Limits
from rendezvous.v1 import index_pb2 as ipb
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.ci import examples
from tests.service.conftest import engine_request

SERVICE = pb.DESCRIPTOR.services_by_name["RendezvousService"]
METHODS = [*SERVICE.methods, *ipb.DESCRIPTOR.services_by_name["KvIndexService"].methods]
DEADLINE = 10.0
KNOWN_IDS = ["decode-0", "prefill-0", "t-1", ""]
HUGE = 70_000

_T = FieldDescriptor
_INTS = {
    _T.TYPE_INT64: (-(2**63), 2**63 - 1),
    _T.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _T.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _T.TYPE_INT32: (-(2**31), 2**31 - 1),
    _T.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _T.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _T.TYPE_ENUM: (-(2**31), 2**31 - 1),
    _T.TYPE_UINT64: (0, 2**64 - 1),
    _T.TYPE_FIXED64: (0, 2**64 - 1),
    _T.TYPE_UINT32: (0, 2**32 - 1),
    _T.TYPE_FIXED32: (0, 2**32 - 1),
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INTS:
        low, high = _INTS[kind]
        edges = st.sampled_from([low, high, 0, 1, -1 if low < 0 else 2])
        if kind == _T.TYPE_ENUM:
            assert field.enum_type is not None  # an enum field has its enum type
            return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), edges)
        return st.one_of(st.integers(low, high), edges)
    if kind == _T.TYPE_STRING:
        return st.one_of(st.sampled_from(KNOWN_IDS), st.text(max_size=40), st.just("x" * HUGE))
    if kind == _T.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.just(b"\0" * HUGE))
    if kind == _T.TYPE_BOOL:
        return st.booleans()
    if kind == _T.TYPE_FLOAT:
        return st.floats(width=32)
    if kind == _T.TYPE_DOUBLE:
        return st.floats()
    raise AssertionError(f"unhandled field type {kind} of {field.full_name}")


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == _T.TYPE_MESSAGE:
        assert field.message_type is not None  # a message field has its message type
        return messages(field.message_type, depth + 1)
    return _scalar(field)


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of this type: each field absent or random, repeated fields short lists, maps small dicts."""
    cls = GetMessageClass(descriptor)
    if depth > 3:
        return st.just(cls())
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        entry = field.message_type if field.type == _T.TYPE_MESSAGE else None
        if entry is not None and entry.GetOptions().map_entry:
            key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
            optional[field.name] = st.dictionaries(_value(key, depth), _value(value, depth), max_size=3)
        elif field.is_repeated:
            optional[field.name] = st.lists(_value(field, depth), max_size=4)
        else:
            optional[field.name] = _value(field, depth)
    return st.fixed_dictionaries({}, optional=optional).map(lambda kw: cls(**kw))


@pytest.fixture(scope="module")
def channel() -> Iterator[grpc.Channel]:
    limits = Limits(max_events_per_engine=64, max_watchers_per_engine=4)
    with TestServer(limits=limits) as server, grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.RendezvousServiceStub(ch)
        stub.RegisterEngine(engine_request("decode-0", pb.ENGINE_ROLE_CONSUMER), timeout=DEADLINE)
        stub.RegisterEngine(engine_request("prefill-0", pb.ENGINE_ROLE_PRODUCER), timeout=DEADLINE)
        yield ch


def _assert_healthy(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=DEADLINE)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert pb_grpc.RendezvousServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=DEADLINE).store


def _call(channel: grpc.Channel, method: Any, request: Message) -> None:
    stub = pb_grpc.RendezvousServiceStub(channel)
    if method.client_streaming:
        stream = stub.KeepAlive(iter([request]), timeout=DEADLINE)
        try:
            next(stream, None)
        finally:
            stream.cancel()
    elif method.server_streaming:
        stream = stub.Watch(request, timeout=DEADLINE)
        try:
            next(stream)
        finally:
            stream.cancel()
    else:
        path = f"/{method.containing_service.full_name}/{method.name}"
        channel.unary_unary(path, request_serializer=type(request).SerializeToString)(request, timeout=DEADLINE)


_SETTINGS = settings(
    max_examples=examples(200),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_SETTINGS
@given(data=st.data())
def test_generated_requests_are_answered_or_refused_with_a_reason(channel: grpc.Channel, data: st.DataObject) -> None:
    method = data.draw(st.sampled_from(METHODS), label="method")
    request = data.draw(messages(method.input_type), label="request")
    try:
        _call(channel, method, request)
    except grpc.RpcError as err:
        converted = from_rpc_error(err)
        assert converted.code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{method.name} hung"
        if converted.code == grpc.StatusCode.CANCELLED:
            return  # a stream we cancelled ourselves
        assert converted.reason, f"{method.name} refused without a reason: {converted.code} {converted}"


@_SETTINGS
@given(method=st.sampled_from(METHODS), payload=st.binary(max_size=256))
def test_random_bytes_never_hang_or_break_the_server(channel: grpc.Channel, method: Any, payload: bytes) -> None:
    path = f"/{method.containing_service.full_name}/{method.name}"
    try:
        if method.server_streaming:
            open_stream = channel.stream_stream(path) if method.client_streaming else channel.unary_stream(path)
            stream = open_stream(iter([payload]) if method.client_streaming else payload, timeout=DEADLINE)
            try:
                next(stream, None)
            finally:
                stream.cancel()
        else:
            channel.unary_unary(path)(payload, timeout=DEADLINE)
    except grpc.RpcError as err:
        assert err.code() != grpc.StatusCode.DEADLINE_EXCEEDED, f"{method.name} hung"
        assert err.code() != grpc.StatusCode.UNAVAILABLE, f"{method.name} broke the server"


def test_the_server_is_healthy_after_fuzzing(channel: grpc.Channel) -> None:
    _assert_healthy(channel)
