"""The producer's write span: one per rank, from `ready` to the write's end, a child of the engine's span at
`ready`, and the parent of its CompleteTransfers. A producer and a consumer rank share this process here."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from rendezvous.clients import AsyncRendezvousClient, TransferState
from rendezvous.clients.testing import TEST_LAYOUT, AsyncTestServer
from rendezvous.protocol import tracing
from tests.clients.conftest import WAIT
from tests.tracing.conftest import named

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not importlib.util.find_spec("nixl"), reason="needs nixl"),
    pytest.mark.timeout(60),
]


async def test_each_write_is_a_span_of_its_rank_under_the_span_that_handed_over_the_kv(
    traced: InMemorySpanExporter, server: AsyncTestServer, client: AsyncRendezvousClient
) -> None:
    import torch

    from rendezvous.clients.nixl.consumer import ConsumerAgent
    from rendezvous.clients.nixl.producer import ProducerAgent

    loop = asyncio.get_running_loop()
    arrived: asyncio.Future[Any] = loop.create_future()
    reported: asyncio.Future[Any] = loop.create_future()
    producer = ProducerAgent(
        client,
        "p0",
        "prefill",
        [torch.ones(8, 256, dtype=torch.uint8)],
        layout=TEST_LAYOUT,
        on_report=reported.set_result,
    )
    consumer = ConsumerAgent(
        client,
        "d0",
        "decode",
        [torch.zeros(8, 256, dtype=torch.uint8)],
        layout=TEST_LAYOUT,
        on_result=arrived.set_result,
    )
    await producer.start()
    await consumer.start()
    try:
        assert (await consumer.register_target("t1", [2, 3])).state is TransferState.TARGETED
        with tracing.span("connector.send") as send:
            assert (await producer.claim("t1")).state is TransferState.MATCHED
            producer.ready("t1", [0, 1])
        assert (await asyncio.wait_for(arrived, WAIT)).ok
        assert (await asyncio.wait_for(reported, WAIT)).ok  # CompleteTransfers was answered
    finally:
        await producer.close()
        await consumer.close()

    spans = traced.get_finished_spans()
    (write,) = named(spans, "producer.write")
    sent = send.get_span_context()  # type: ignore[attr-defined]
    assert write.parent is not None and write.parent.span_id == sent.span_id
    assert dict(write.attributes or {}) == {
        "kv_rendezvous.transfer_id": "t1",
        "kv_rendezvous.engine_id": "p0",
        "kv_rendezvous.rank": 0,
        "kv_rendezvous.generation": 1,
        "kv_rendezvous.ok": True,
    }
    assert [e.name for e in write.events] == ["assigned"]
    (complete,) = [s for s in named(spans, "/CompleteTransfers") if s.kind is SpanKind.CLIENT]
    assert complete.parent is not None and complete.parent.span_id == write.context.span_id
