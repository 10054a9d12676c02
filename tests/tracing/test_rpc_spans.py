"""RPC spans: the SDK's client span and the service's server span of each call share the caller's trace."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from rendezvous.clients import AsyncRendezvousClient, ClientConfig
from rendezvous.clients._transport import CallMetadata
from rendezvous.protocol import tracing
from tests.tracing.conftest import named
from tests.tracing.lifecycle import CYCLE, cycle

REPO = Path(__file__).resolve().parents[2]


async def test_a_transfer_cycle_is_one_trace_parented_through_grpc_metadata(
    traced: InMemorySpanExporter, client: AsyncRendezvousClient
) -> None:
    with tracing.span("request"):
        await cycle(client)
    spans = traced.get_finished_spans()
    (root,) = named(spans, "request")
    assert {s.context.trace_id for s in spans} == {root.context.trace_id}
    for method in CYCLE:
        client_spans = [s for s in named(spans, f"RendezvousService/{method}") if s.kind is SpanKind.CLIENT]
        server_spans = [s for s in named(spans, f"RendezvousService/{method}") if s.kind is SpanKind.SERVER]
        assert client_spans and len(server_spans) == len(client_spans), method
        for sent, served in zip(client_spans, server_spans, strict=True):
            assert sent.parent is not None and sent.parent.span_id == root.context.span_id
            # The server's parent came over the wire: it is remote, and it is the client's span.
            assert served.parent is not None and served.parent.is_remote
            assert served.parent.span_id == sent.context.span_id
            assert served.attributes is not None and served.attributes["rpc.method"] == method


async def test_the_service_span_of_a_batch_tells_each_transfer_and_its_state(
    traced: InMemorySpanExporter, client: AsyncRendezvousClient
) -> None:
    await cycle(client)
    (claim,) = [s for s in named(traced.get_finished_spans(), "/ClaimTransfers") if s.kind is SpanKind.SERVER]
    assert claim.attributes is not None and claim.attributes["kv_rendezvous.engine_id"] == "p0"
    (item,) = claim.events
    assert item.name == "transfer"
    assert dict(item.attributes or {}) == {
        "kv_rendezvous.transfer_id": "t1",
        "kv_rendezvous.state": "MATCHED",
        "kv_rendezvous.generation": 1,
    }


def test_the_trace_context_goes_out_as_traceparent_metadata(traced: InMemorySpanExporter) -> None:
    metadata = CallMetadata(ClientConfig(targets=("127.0.0.1:1",), token="secret"))
    assert metadata() == (("authorization", "Bearer secret"),)
    with tracing.span("request") as span:
        keys = dict(metadata() or ())
    context = span.get_span_context()  # type: ignore[attr-defined]
    assert keys["traceparent"].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")


async def test_off_no_span_is_recorded_and_every_span_is_the_shared_no_op(client: AsyncRendezvousClient) -> None:
    assert not tracing.enabled()
    with tracing.span("request") as outer, tracing.rpc_span("ClaimTransfers", "p0") as rpc:
        await cycle(client)
    assert outer is rpc is tracing.NO_SPAN is tracing.start("write") is tracing.current()
    assert tracing.carrier() == {}
    assert CallMetadata(ClientConfig(targets=("127.0.0.1:1",)))() is None


def test_off_nothing_of_opentelemetry_is_imported_by_a_transfer_cycle() -> None:
    code = (
        "import asyncio, sys\n"
        "from rendezvous.clients import AsyncRendezvousClient\n"
        "from rendezvous.clients.testing import start_test_server\n"
        "from tests.tracing.lifecycle import cycle\n"
        "async def main():\n"
        "    async with start_test_server() as server, AsyncRendezvousClient(server.address) as client:\n"
        "        await cycle(client)\n"
        "asyncio.run(main())\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(tracing.ENABLE_ENV, None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_without_opentelemetry_installed_tracing_stays_off_and_spans_are_no_ops() -> None:
    code = (
        "import sys\n"
        "sys.modules['opentelemetry'] = None  # as if the tracing extra were not installed\n"
        "from rendezvous.protocol import tracing\n"
        "import clients, rendezvous.server\n"
        "assert not tracing.configure('test')\n"
        "with tracing.span('request', tracing.about(transfer_id='t1')) as span:\n"
        "    span.set_attribute('kv_rendezvous.rank', 0)\n"
        "assert span is tracing.NO_SPAN and tracing.carrier() == {}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "opentelemetry-api is not installed" in done.stderr  # said once, at configure
