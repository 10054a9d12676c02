"""Tracing through real vLLM-CPU engines: one request through the router is one trace, from the router's
dispatch to the connector's claim, the WRITE and decode's completion notice, and the service's handling.

The router and engines are processes: with KV_RENDEZVOUS_TRACING_FILE they append their spans to one file,
read here; the rendezvous runs in this process, so its spans go to the in-memory exporter.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from rendezvous.clients.testing import TestServer
from rendezvous.connector.launch import (
    Engine,
    RouterProcess,
    connector_config,
    free_port,
    post_json,
    start_engine,
    start_router,
    wait_healthy,
)
from rendezvous.protocol import tracing
from tests.tracing.conftest import traced
from tests.vllm.conftest import warm_up
from tests.vllm.test_vllm_1p1d import token_prompt

__all__ = ["traced"]  # the in-memory exporter of the tracing tests

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
WAIT = 30.0


@pytest.fixture(scope="module")
def spans_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spans") / "spans.jsonl"


@pytest.fixture(scope="module")
def traced_router(
    tiny_model: Path, rendezvous: TestServer, engine_logs: Path, spans_file: Path
) -> Iterator[RouterProcess]:
    """A router in front of a 1P1D pair (pools traced-prefill, traced-decode), all started at once, all
    exporting their spans to `spans_file`."""
    env = {tracing.ENABLE_ENV: "1", tracing.FILE_ENV: str(spans_file)}
    pools = ("traced-prefill", "traced-decode")
    engines: list[Engine] = []
    router = None
    try:
        for name, role in zip(pools, ("kv_producer", "kv_consumer"), strict=True):
            port = free_port()
            config = connector_config(role, rendezvous.address, name, port)
            engines.append(start_engine(name, tiny_model, engine_logs, port, config, env=env))
        args = ["--address", rendezvous.address, "--prefill-pool", pools[0], "--decode-pool", pools[1]]
        router = start_router(engine_logs, free_port(), args, "traced-router", env)
        wait_healthy([*engines, router])
        warm_up(rendezvous, engines)
        yield router
    finally:
        for process in (*engines, *([router] if router else [])):
            process.stop()


def file_spans(path: Path, trace_id: str, names: set[str]) -> dict[str, dict[str, Any]]:
    """The spans of one trace in the file, by name, once every one of `names` is there (fails after WAIT s)."""
    deadline = time.monotonic() + WAIT
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        spans = [json.loads(line) for line in lines]
        in_trace = [s for s in spans if s["context"]["trace_id"] == f"0x{trace_id}"]
        found = {s["name"]: s for s in in_trace}
        if names <= set(found):
            # Engines seed `random` alike (vLLM's --seed): their span ids must differ all the same.
            assert len({s["context"]["span_id"] for s in in_trace}) == len(in_trace)
            return found
        assert time.monotonic() < deadline, f"missing {names - set(found)}; got {sorted(found)}"
        time.sleep(0.2)


def server_spans(traced: InMemorySpanExporter, methods: set[str]) -> set[str]:
    """The methods of the service's finished spans in the trace, once `methods` are among them (fails after WAIT s)."""
    deadline = time.monotonic() + WAIT
    while True:
        finished = [s for s in traced.get_finished_spans() if s.kind is SpanKind.SERVER]
        in_trace = {s.name.rsplit("/")[-1] for s in finished if f"{s.context.trace_id:032x}" == TRACE_ID}
        if methods <= in_trace:
            return in_trace
        assert time.monotonic() < deadline, (methods - in_trace, {s.name for s in finished})
        time.sleep(0.2)


def test_a_request_through_the_router_is_one_trace_across_every_process(
    traced: InMemorySpanExporter, traced_router: RouterProcess, spans_file: Path
) -> None:
    body = {"model": "tiny", "prompt": token_prompt(40, seed=11), "max_tokens": 4, "temperature": 0.0}
    post_json(f"{traced_router.url}/v1/completions", body, headers={tracing.TRACEPARENT: CALLER})
    names = {"router.dispatch", "router.prefill", "router.decode", "connector.claim", "connector.send"}
    spans = file_spans(spans_file, TRACE_ID, names | {"producer.write", "connector.receive", "connector.first_step"})

    dispatch = spans["router.dispatch"]
    assert dispatch["parent_id"] == "0x00f067aa0ba902b7"  # the caller's span
    transfer_id = dispatch["attributes"]["kv_rendezvous.transfer_id"]
    for name in ("connector.claim", "connector.send", "connector.receive", "connector.first_step"):
        assert spans[name]["parent_id"] == dispatch["context"]["span_id"], name  # via kv_transfer_params
        assert spans[name]["attributes"]["kv_rendezvous.transfer_id"] == transfer_id
    write = spans["producer.write"]
    assert write["parent_id"] == spans["connector.send"]["context"]["span_id"]
    assert write["attributes"]["kv_rendezvous.rank"] == 0 and write["attributes"]["kv_rendezvous.ok"] is True
    assert spans["connector.receive"]["attributes"]["kv_rendezvous.ok"] is True
    # Decode's first step starts once the completion notice reached its scheduler, after the receive ended.
    first_step = spans["connector.first_step"]
    assert first_step["attributes"]["kv_rendezvous.ok"] is True
    assert first_step["start_time"] >= spans["connector.receive"]["end_time"]
    # The service's spans of the claim and the target are in the same trace, children of the engines' calls.
    # (The producer reports its WRITE after producer.write ends: its CompleteTransfers may still be on its way.)
    server_spans(traced, {"ClaimTransfers", "RegisterTargets", "CompleteTransfers", "ListEngines"})
