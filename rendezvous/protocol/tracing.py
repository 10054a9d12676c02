"""OpenTelemetry tracing, off by default and a no-op without the `tracing` extra (docs/operations.md).

Both sides use this one module: the service, the SDK, the data plane, the connector and the router. Nothing of
OpenTelemetry is imported until `configure` turns tracing on; until then `span` and `start` hand out one shared
no-op span, and `carrier` adds nothing to metadata or `kv_transfer_params`.

Trace context travels as W3C `traceparent` (OpenTelemetry's configured propagators: gRPC metadata, HTTP
headers, `kv_transfer_params`). Attributes name the transfer (`kv_rendezvous.transfer_id`), the engine, the
rank and the generation; none of them is ever a metric label.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.trace import Tracer

__all__ = [
    "ENABLE_ENV",
    "FILE_ENV",
    "NO_SPAN",
    "RPC_SERVICE",
    "TRACEPARENT",
    "Attribute",
    "Span",
    "about",
    "activate",
    "carrier",
    "configure",
    "configure_from_env",
    "current",
    "disable",
    "enabled",
    "rpc_span",
    "span",
    "start",
]

logger = logging.getLogger(__name__)

ENABLE_ENV = "KV_RENDEZVOUS_TRACING"
"""Set to 1 (true, yes, on) to trace; the exporter follows the standard OTEL_* variables."""
FILE_ENV = "KV_RENDEZVOUS_TRACING_FILE"
"""A file each process appends its finished spans to, one JSON object a line, instead of exporting over OTLP."""
TRACEPARENT = "traceparent"
"""The W3C trace-context key, in gRPC metadata, HTTP headers and `kv_transfer_params`."""

RPC_SERVICE = "rendezvous.v1.RendezvousService"
"""The service whose calls `rpc_span` names `RPC_SERVICE/Method` (OpenTelemetry's RPC conventions)."""

_MISSING = "tracing asked for, but %s is not installed: pip install 'kv-rendezvous[tracing]'"

Attribute = str | bool | int | float | Sequence[str] | Sequence[int]
Carrier = Mapping[str, Any]
Kind = Literal["internal", "server", "client"]


class Span(Protocol):
    """What callers do with a span (an OpenTelemetry span, or the no-op one)."""

    def set_attribute(self, key: str, value: Attribute) -> None: ...

    def add_event(self, name: str, attributes: Mapping[str, Attribute] | None = None) -> None: ...

    def end(self) -> None: ...


class _NoSpan:
    """The span handed out while tracing is off: it records nothing."""

    def set_attribute(self, key: str, value: Attribute) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, Attribute] | None = None) -> None:
        pass

    def end(self) -> None:
        pass


NO_SPAN: Span = _NoSpan()
_NO_SPAN_CONTEXT = contextlib.nullcontext(NO_SPAN)
_tracer: Tracer | None = None
_OS_RANDOM = random.SystemRandom()


def about(
    *, transfer_id: str = "", engine_id: str = "", rank: int | None = None, generation: int | None = None
) -> dict[str, Attribute]:
    """The attributes that say which transfer, engine, rank and generation a span is about (those given)."""
    named = {"transfer_id": transfer_id, "engine_id": engine_id, "rank": rank, "generation": generation}
    return {f"kv_rendezvous.{k}": v for k, v in named.items() if v is not None and v != ""}


def enabled() -> bool:
    """Whether spans are recorded."""
    return _tracer is not None


def configure(service_name: str, provider: TracerProvider | None = None) -> bool:
    """Turn tracing on; returns False (and stays off) without OpenTelemetry installed.

    Without `provider`, the global one is used if an application (vLLM) set one, else an SDK provider is set
    globally, exporting to FILE_ENV when that is set and otherwise over OTLP (OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_PROTOCOL), sampled per OTEL_TRACES_SAMPLER.
    """
    global _tracer
    try:
        importlib.import_module("opentelemetry.trace")
    except ImportError:
        logger.warning(_MISSING, "opentelemetry-api")
        return False
    if provider is None:
        provider = _global_provider(service_name)
        if provider is None:
            return False
    _tracer = provider.get_tracer("kv_rendezvous")
    return True


def configure_from_env(service_name: str) -> bool:
    """`configure` if ENABLE_ENV says so; returns whether tracing is on."""
    if os.environ.get(ENABLE_ENV, "").lower() in ("1", "true", "yes", "on"):
        return enabled() or configure(service_name)
    return enabled()


def disable() -> None:
    """Turn tracing off again (tests)."""
    global _tracer
    _tracer = None


def _global_provider(service_name: str) -> TracerProvider | None:
    from opentelemetry import trace

    existing = trace.get_tracer_provider()
    if not isinstance(existing, trace.ProxyTracerProvider):
        return existing  # type: ignore[return-value]
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:
        logger.warning(_MISSING, "opentelemetry-sdk")
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), id_generator=_os_random_ids())
    path = os.environ.get(FILE_ENV)
    if path:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        out = open(path, "a", buffering=1)  # noqa: SIM115 - the exporter writes to it until the process ends
        exporter = ConsoleSpanExporter(out=out, formatter=lambda s: s.to_json(indent=None) + "\n")
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
    trace.set_tracer_provider(provider)
    return provider


def _os_random_ids() -> IdGenerator:
    """Span and trace ids from the OS. OpenTelemetry's default draws them from `random`, which vLLM seeds
    (`--seed`): engines started with one seed would mint the same ids."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class OsRandomIds(RandomIdGenerator):
        def generate_span_id(self) -> int:
            return _OS_RANDOM.getrandbits(64) or 1  # 0 is the invalid id

        def generate_trace_id(self) -> int:
            return _OS_RANDOM.getrandbits(128) or 1

    return OsRandomIds()


def _otlp_exporter() -> Any:
    if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc") == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    return OTLPSpanExporter()


def _context(parent: Carrier | None) -> Any:
    if parent is None or TRACEPARENT not in parent:
        return None  # the current context
    from opentelemetry import propagate

    return propagate.extract(parent)


def span(
    name: str,
    attributes: Mapping[str, Attribute] | None = None,
    *,
    parent: Carrier | None = None,
    kind: Kind = "internal",
) -> contextlib.AbstractContextManager[Span]:
    """A span around a block, current inside it; a child of `parent`'s traceparent if it has one, else of the
    current span. `kind` is "server" or "client" for an RPC's two ends."""
    if _tracer is None:
        return _NO_SPAN_CONTEXT
    from opentelemetry.trace import SpanKind

    return _tracer.start_as_current_span(name, _context(parent), SpanKind[kind.upper()], attributes)


def start(name: str, attributes: Mapping[str, Attribute] | None = None, *, parent: Carrier | None = None) -> Span:
    """A span the caller ends (it may end on another task or thread); not made current."""
    if _tracer is None:
        return NO_SPAN
    return _tracer.start_span(name, _context(parent), attributes=attributes)


@contextlib.contextmanager
def activate(active: Span) -> Iterator[None]:
    """Make a span from `start` current in a block, so what the block starts (calls, tasks) are its children."""
    if active is NO_SPAN:
        yield
        return
    from opentelemetry import trace

    with trace.use_span(active, end_on_exit=False):  # type: ignore[arg-type]
        yield


def current() -> Span:
    """The current span (the no-op one while tracing is off)."""
    if _tracer is None:
        return NO_SPAN
    from opentelemetry import trace

    return trace.get_current_span()


def carrier() -> dict[str, str]:
    """The current trace context as `traceparent` (and `tracestate`, baggage) entries; empty while off."""
    if _tracer is None:
        return {}
    from opentelemetry import propagate

    out: dict[str, str] = {}
    propagate.inject(out)
    return out


def rpc_span(
    method: str, engine_id: str, *, incoming: Iterable[tuple[str, Any]] | None = None
) -> contextlib.AbstractContextManager[Span]:
    """The span of one unary RendezvousService call: the server's, a child of the `incoming` call metadata,
    when that is given; else the client's (whose `carrier` then goes out as metadata)."""
    if _tracer is None:
        return _NO_SPAN_CONTEXT
    attributes = {"rpc.system": "grpc", "rpc.service": RPC_SERVICE, "rpc.method": method, **about(engine_id=engine_id)}
    name = f"{RPC_SERVICE}/{method}"
    if incoming is None:
        return span(name, attributes, kind="client")
    return span(name, attributes, parent=dict(incoming), kind="server")
