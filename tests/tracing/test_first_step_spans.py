"""`connector.first_step`: decode's step that computes a request's first token after its KV arrived, one span
per traced request, a child of the router's span, from the arrival to the end of that step."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rendezvous.connector.first_step import FirstSteps
from rendezvous.protocol import tracing

ROUTER = {tracing.TRACEPARENT: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


def test_the_span_runs_from_the_arrival_to_the_end_of_the_step_that_schedules_the_request(
    traced: InMemorySpanExporter,
) -> None:
    steps = FirstSteps("decode-0")
    steps.expect("r1", "t1", ROUTER)
    steps.expect("r2", "t2", ROUTER)
    steps.scheduled(set())
    steps.stepped(["r1", "r2"])  # both arrive in this step
    steps.scheduled({"r1"})  # the next step runs r1 only
    steps.stepped([])
    [first] = traced.get_finished_spans()
    assert first.name == "connector.first_step"
    assert first.attributes is not None and first.attributes["kv_rendezvous.transfer_id"] == "t1"
    assert first.attributes["kv_rendezvous.schedule_wait_steps"] == 0
    assert first.attributes["kv_rendezvous.ok"] is True
    assert first.parent is not None and first.parent.span_id == 0x00F067AA0BA902B7
    assert first.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    steps.scheduled({"r1", "r2"})  # r2 waited one step
    steps.stepped([])
    second = traced.get_finished_spans()[1]
    assert second.attributes is not None and second.attributes["kv_rendezvous.transfer_id"] == "t2"
    assert second.attributes["kv_rendezvous.schedule_wait_steps"] == 1


def test_a_request_that_ends_before_its_first_step_ends_its_span_not_ok(traced: InMemorySpanExporter) -> None:
    steps = FirstSteps("decode-0")
    steps.expect("r1", "t1", ROUTER)
    steps.stepped(["r1"])
    steps.forget("r1")  # aborted by its client
    steps.scheduled({"r1"})
    steps.stepped([])
    [span] = traced.get_finished_spans()
    assert span.attributes is not None and span.attributes["kv_rendezvous.ok"] is False


def test_a_request_that_finishes_in_its_first_step_ends_its_span_ok(traced: InMemorySpanExporter) -> None:
    """vLLM frees a request that finishes (max_tokens 1) before the step's connector output is handed over."""
    steps = FirstSteps("decode-0")
    steps.expect("r1", "t1", ROUTER)
    steps.stepped(["r1"])
    steps.scheduled({"r1"})
    steps.forget("r1")
    steps.stepped([])
    [span] = traced.get_finished_spans()
    assert span.attributes is not None and span.attributes["kv_rendezvous.ok"] is True


def test_untraced_requests_and_requests_without_a_transfer_open_no_span(traced: InMemorySpanExporter) -> None:
    steps = FirstSteps("decode-0")
    steps.expect("r1", "t1", {})  # the router did not trace it
    steps.stepped(["r1", "r9"])  # r9: never expected
    steps.scheduled({"r1", "r9"})
    steps.stepped([])
    assert traced.get_finished_spans() == ()
