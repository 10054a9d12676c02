"""The router's spans: one trace per request, continued from the caller's traceparent, handed to both legs."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from rendezvous.clients import EngineRole
from rendezvous.connector.router import ANY_MODEL, Route
from rendezvous.protocol import tracing
from tests.clients.conftest import wait_until
from tests.connector.test_router import Cluster, cluster, make_router, server
from tests.tracing.conftest import named

__all__ = ["cluster", "make_router", "server"]  # the router tests' fixtures

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
"""A traceparent the router's caller sent (W3C trace-context's example)."""


async def test_a_request_is_one_trace_from_the_callers_traceparent_to_both_legs(
    traced: InMemorySpanExporter, cluster: Cluster, make_router: Any
) -> None:
    prefill = await cluster.add("p0", "prefill", EngineRole.PRODUCER)
    decode = await cluster.add("d0", "decode", EngineRole.CONSUMER)
    router = await make_router({ANY_MODEL: Route(("prefill",), ("decode",))})
    body = {"model": "m", "prompt": "hi", "max_tokens": 8}
    url = f"http://127.0.0.1:{router.port}/v1/completions"
    async with router.http.post(url, json=body, headers={tracing.TRACEPARENT: CALLER}) as response:
        assert response.status == 200
    await wait_until(lambda: named(traced.get_finished_spans(), "router.prefill"))  # the leg may end after

    spans = traced.get_finished_spans()
    (dispatch,) = named(spans, "router.dispatch")
    assert dispatch.kind is SpanKind.SERVER and dispatch.parent is not None and dispatch.parent.is_remote
    assert f"{dispatch.context.trace_id:032x}" == CALLER.split("-")[1]
    assert f"{dispatch.parent.span_id:016x}" == CALLER.split("-")[2]
    params = decode.bodies[0]["kv_transfer_params"]
    assert dispatch.attributes is not None and dispatch.attributes["kv_rendezvous.transfer_id"] == params["transfer_id"]
    # Both legs carry the dispatch span as their engines' parent.
    for engine in (prefill, decode):
        parent = engine.bodies[0]["kv_transfer_params"][tracing.TRACEPARENT]
        assert parent.split("-")[1:3] == [f"{dispatch.context.trace_id:032x}", f"{dispatch.context.span_id:016x}"]
    for leg, engine_id in (("router.prefill", "p0"), ("router.decode", "d0")):
        (span,) = named(spans, leg)
        assert span.parent is not None and span.parent.span_id == dispatch.context.span_id
        assert span.attributes is not None and span.attributes["kv_rendezvous.engine_id"] == engine_id
    # Picking the engines asked the service, in the same trace.
    served = [s for s in named(spans, "/ListEngines") if s.kind is SpanKind.SERVER]
    assert served and {s.context.trace_id for s in served} == {dispatch.context.trace_id}
