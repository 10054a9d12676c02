"""The connector's settings, read from vLLM's `kv_connector_extra_config` (see docs/vllm.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rendezvous.protocol import tracing
from rendezvous.protocol.bindings import PARAMS_KEY as BINDING_KEY

__all__ = ["BINDING_KEY", "TRACE_KEYS", "TRANSFER_ID_KEY", "ConnectorConfig", "binding_params", "trace_context"]

TRANSFER_ID_KEY = "transfer_id"
"""The `kv_transfer_params` key that carries a request's transfer id (minted by the router)."""
TRACE_KEYS = (tracing.TRACEPARENT, "tracestate")
"""The `kv_transfer_params` keys that carry the router's trace context (W3C trace-context), when it traces."""


def trace_context(params: Mapping[str, Any] | None) -> dict[str, str]:
    """The trace context in a request's `kv_transfer_params`; empty when the router sent none."""
    return {key: str(params[key]) for key in TRACE_KEYS if key in params} if params else {}


def binding_params(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The router's binding in a request's `kv_transfer_params` (`Binding.to_params`), as plain data; None when
    the router sent none. The engine presents it with its half; the rendezvous judges it."""
    value = params.get(BINDING_KEY) if params else None
    return dict(value) if isinstance(value, Mapping) else None


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """What `kv_connector_extra_config` may set; every key is optional except `rendezvous`."""

    rendezvous: tuple[str, ...]
    """"host:port" endpoints of the rendezvous service (failover order). Key `rendezvous`: a string,
    comma-separated string or list."""
    pool: str = "default"
    """The engine pool this engine registers in."""
    engine_id: str = ""
    """The engine id; "" = "<pool>-<role>-<vLLM's kv engine_id>", shared by the engine's processes."""
    lease_ttl: float = 0.0
    """Seconds of lease per renewal; 0 = the server's default."""
    transfer_timeout: float = 0.0
    """Seconds a target (decode) or claim (prefill) waits for its other half; 0 = the server's default."""
    call_timeout: float = 10.0
    """Seconds per attempt of a unary call to the rendezvous."""
    start_timeout: float = 60.0
    """Seconds the worker waits at start-up for NIXL and the engine registration."""
    token: str | None = None
    """A bearer token sent with every call."""
    tls_ca: str | None = None
    """TLS to the rendezvous: the CA bundle (file path) that signs the server's certificate. Setting any `tls_*`
    key turns TLS on; with none of them the channel is plaintext."""
    tls_cert: str | None = None
    """mTLS: this engine's certificate chain (file path)."""
    tls_key: str | None = None
    """mTLS: this engine's private key (file path)."""
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Engine labels; the router reads `url` (the engine's OpenAI base URL) from them."""
    max_transfers: int = 0
    """Decode engines: the requests (live targets) the engine admits at once, declared at registration
    (`EngineCapacity`); the rendezvous refuses targets beyond it and routers reserve credit within it.
    0 = no limit. Set it to what the engine can hold, e.g. vLLM's --max-num-seqs."""
    max_blocks: int = 0
    """Decode engines: the target KV blocks admitted at once (e.g. the engine's GPU block count); 0 = no limit."""
    progressive: bool = False
    """Progressive push (docs/protocol.md). Decode: accept KV written in parts while prefill computes. Prefill:
    write each finished chunk of a chunked prefill before the next chunk is computed, into a decode that
    accepts it (else the KV goes in one write at the end, as without it). Decode starts once the parts' NIXL
    notifications tile the prompt's KV (or on the commit when they cannot say)."""
    progressive_layers: bool = False
    """Prefill, with `progressive`: hand each layer's KV over as the forward pass computes it (`save_kv_layer`),
    so a layer is written while the next ones compute, in every chunk including the last."""
    integrity: bool = False
    """End-to-end integrity (rendezvous.clients.nixl.integrity): prefill sends the xxh3 digests of each write, decode
    checks its blocks against them before the KV counts as arrived and fails the request's transfer on a mismatch (and
    on a prefill that sent none). Turn it on for both pools. With `progressive` the layers are hashed as they are
    written and the digests go with the last write. DRAM KV only (vLLM-CPU); a GPU engine refuses it at start."""
    kv_index: bool = False
    """Feed the rendezvous's KV index with this engine's prefix cache (rendezvous.connector.kv_feed): the engine-core
    process subscribes to vLLM's KV events (--kv-events-config, publisher zmq, a bound endpoint) and reports
    them for this engine, so every router can place requests by what the engine really holds."""
    idle_wait_ms: float = 2.0
    """How long a step that computes nothing waits for a transfer to end. vLLM steps without pause while a
    request waits for its KV (decode) or its KV is being sent (prefill), and such steps only ask the connector
    what ended; without a wait they spin a core and the GIL that the other engine, the connector's own thread
    and the network need. A transfer that ends wakes the step at once; a request that arrives meanwhile waits
    at most this long to be scheduled. 0 = no wait."""

    @property
    def uses_tls(self) -> bool:
        """Whether any `tls_*` key is set."""
        return any((self.tls_ca, self.tls_cert, self.tls_key))

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse and check `kv_connector_extra_config`; unknown keys are an error (typos must not pass)."""
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        raw = extra.pop("rendezvous", None)
        if isinstance(raw, str):
            targets = tuple(t.strip() for t in raw.split(",") if t.strip())
        elif isinstance(raw, list | tuple):
            targets = tuple(str(t).strip() for t in raw if str(t).strip())
        else:
            targets = ()
        if not targets:
            raise ValueError('kv_connector_extra_config needs "rendezvous": "host:port" (or a list of them)')
        labels = {str(k): str(v) for k, v in dict(extra.pop("labels", None) or {}).items()}
        floats = {
            k: float(extra.pop(k))
            for k in ("lease_ttl", "transfer_timeout", "call_timeout", "start_timeout", "idle_wait_ms")
            if k in extra
        }
        for key, value in floats.items():
            if value < 0:
                raise ValueError(f"{key} must not be negative, got {value}")
        ints = {k: int(extra.pop(k)) for k in ("max_transfers", "max_blocks") if k in extra}
        for name, count in ints.items():
            if count < 0:
                raise ValueError(f"{name} must not be negative, got {count}")
        flags = {
            k: _flag(k, extra.pop(k))
            for k in ("progressive", "progressive_layers", "integrity", "kv_index")
            if k in extra
        }
        if flags.get("progressive_layers") and not flags.get("progressive"):
            raise ValueError("progressive_layers needs progressive")
        strings = {k: str(v) for k, v in extra.items()}
        if ("tls_cert" in strings) != ("tls_key" in strings):
            raise ValueError("tls_cert and tls_key go together (mTLS)")
        return cls(rendezvous=targets, labels=labels, **floats, **ints, **flags, **strings)  # type: ignore[arg-type]


def _flag(key: str, value: Any) -> bool:
    """A JSON boolean, or "true"/"false" as a command line may pass it."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"{key} must be true or false, got {value!r}")
