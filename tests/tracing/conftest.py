"""Fixtures of the tracing tests: OpenTelemetry's SDK exporting to memory, turned on for one test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rendezvous.protocol import tracing
from tests.clients.conftest import client, server

__all__ = ["client", "named", "server", "traced"]  # the SDK tests' real server and client, here too


@pytest.fixture
def traced() -> Iterator[InMemorySpanExporter]:
    """Tracing on for one test; its finished spans in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert tracing.configure("test", provider)
    yield exporter
    tracing.disable()


def named(spans: tuple[ReadableSpan, ...], suffix: str) -> list[ReadableSpan]:
    """The spans whose name ends with suffix."""
    return [s for s in spans if s.name.endswith(suffix)]
