"""Client configuration as small frozen objects: retries, HTTP/2 keepalive, channels, sessions."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

# A CANCELLED status reaching the client was sent by the server's side: the client's own cancellation
# raises asyncio.CancelledError instead. gRPC core sends it for a call it dropped unanswered, e.g. past
# `grpc.server.max_pending_requests` calls of one method waiting for the server to take them
# (docs/operations.md, "Calls gRPC drops before the service").
_RETRY_ALWAYS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
_RETRY_READS = _RETRY_ALWAYS | {grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter for calls that failed in a way a retry can fix.

    UNAVAILABLE and a CANCELLED sent by the server are retried for every call (mutating calls reuse
    their request id, so a retry cannot apply twice); DEADLINE_EXCEEDED only for reads. With several
    endpoints a failed call first moves on to the next endpoint at once and backs off once per round of
    endpoints.
    A call gives up after `max_attempts` attempts (None: no limit) or once `deadline` seconds have
    passed since its first attempt (None: no limit), whichever comes first.
    """

    initial_backoff: float = 0.02
    max_backoff: float = 1.0
    multiplier: float = 2.0
    jitter: float = 0.2
    max_attempts: int | None = None
    deadline: float | None = 30.0

    def __post_init__(self) -> None:
        if self.initial_backoff < 0 or self.max_backoff < self.initial_backoff or self.multiplier < 1:
            raise ValueError("backoff must satisfy 0 <= initial_backoff <= max_backoff and multiplier >= 1")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter is a fraction in [0, 1)")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("max_attempts counts the first attempt; it must be at least 1")

    def backoff(self, retry: int) -> float:
        """Seconds to wait before the retry-th backoff (1-based): exponential, capped, jittered down."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** max(0, retry - 1))
        return base * (1.0 - self.jitter * random.random())

    def retryable(self, code: grpc.StatusCode, idempotent: bool) -> bool:
        """Whether a call that failed with code may be retried."""
        return code in (_RETRY_READS if idempotent else _RETRY_ALWAYS)


NO_RETRY = RetryPolicy(max_attempts=1)
"""A policy that never retries."""


@dataclass(frozen=True, slots=True)
class KeepAliveConfig:
    """HTTP/2 keepalive pings, which detect dead connections under long-lived streams.

    The server must allow pings this often (grpc.http2.min_ping_interval_without_data_ms and
    grpc.keepalive_permit_without_calls), or it closes the connection with too_many_pings.
    """

    time: float = 30.0
    timeout: float = 10.0
    permit_without_calls: bool = True


@dataclass(frozen=True, slots=True)
class ChannelOptions:
    """gRPC channel settings: keepalive, message size and how fast to reconnect after a failure.

    `max_message_bytes` bounds what this client sends and receives; the server reads requests up to its own
    `--max-message-bytes` (4 MiB by default) and refuses larger ones with RESOURCE_EXHAUSTED.
    """

    keepalive: KeepAliveConfig = KeepAliveConfig()
    max_message_bytes: int = 64 * 1024 * 1024
    initial_reconnect_backoff: float = 0.1
    max_reconnect_backoff: float = 2.0
    extra: tuple[tuple[str, int | str], ...] = ()

    def as_grpc_options(self) -> list[tuple[str, int | str]]:
        """The settings as gRPC channel arguments."""
        k = self.keepalive
        return [
            ("grpc.keepalive_time_ms", int(k.time * 1000)),
            ("grpc.keepalive_timeout_ms", int(k.timeout * 1000)),
            ("grpc.keepalive_permit_without_calls", int(k.permit_without_calls)),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", int(self.initial_reconnect_backoff * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(self.initial_reconnect_backoff * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(self.max_reconnect_backoff * 1000)),
            *self.extra,
        ]


def _pem(value: str | bytes | None) -> bytes | None:
    """PEM bytes from PEM text or bytes, or from the file a path names."""
    if value is None or isinstance(value, bytes):
        return value
    if "-----BEGIN" in value:
        return value.encode()
    with open(value, "rb") as f:
        return f.read()


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """TLS to the server. Each of `ca`, `cert` and `key` is a file path or PEM text (or bytes).

    `ca` is the bundle that signs the server's certificate (None: the system's roots); `cert` and
    `key` are the client's certificate chain and key for mTLS. Files are read when the client opens
    its channels, so a client started after a rotation uses the new files. To check the server's
    certificate for another name than the target host, add
    `("grpc.ssl_target_name_override", name)` to `ChannelOptions.extra`.
    """

    ca: str | bytes | None = None
    cert: str | bytes | None = None
    key: str | bytes | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")

    def credentials(self) -> grpc.ChannelCredentials:
        """The gRPC channel credentials."""
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.ca), private_key=_pem(self.key), certificate_chain=_pem(self.cert)
        )


MetadataHook = Callable[[], Sequence[tuple[str, str]]]
"""Called before every call for extra metadata (e.g. a rotating token)."""


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """How a client reaches the rendezvous.

    `targets` are "host:port" endpoints tried in order: on UNAVAILABLE the client fails over to the
    next one (use it for replicas sharing a Redis store). `token` is sent as a bearer token;
    `metadata` is sent with every call and `metadata_hook`, when set, is asked for more before each
    call. `tls` (file paths or PEM) or ready-made `credentials` make the channels secure (TLS/mTLS); a
    token should only travel over TLS. `call_timeout` bounds each attempt of a
    unary call in seconds (None: no bound); `retry` says when to try again.
    """

    targets: Sequence[str]
    token: str | None = None
    metadata: Sequence[tuple[str, str]] = ()
    metadata_hook: MetadataHook | None = None
    credentials: grpc.ChannelCredentials | None = None
    tls: TLSConfig | None = None
    call_timeout: float | None = 10.0
    retry: RetryPolicy = RetryPolicy()
    channel: ChannelOptions = ChannelOptions()

    def __post_init__(self) -> None:
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        if not targets or not all(targets):
            raise ValueError("ClientConfig needs at least one non-empty target")
        object.__setattr__(self, "targets", targets)
        object.__setattr__(self, "metadata", tuple(self.metadata))
        if self.tls is not None and self.credentials is not None:
            raise ValueError("set tls or credentials, not both")

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """The credentials of secure channels (from `credentials` or `tls`); None for plaintext."""
        return self.tls.credentials() if self.tls is not None else self.credentials

    def static_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata sent with every call, before the hook's."""
        token = (("authorization", f"Bearer {self.token}"),) if self.token else ()
        return (*token, *self.metadata)


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """How an engine session keeps its registration and watch alive.

    The lease is renewed every `renew_fraction` of its TTL. Broken streams and failed
    re-registrations are retried forever with `reconnect` backoff (its limits do not apply):
    a session outlives server restarts. `watch_max_batch` caps events per Watch message (0: server
    default). `reassert_batch` caps items per call when re-asserting transfers.
    """

    renew_fraction: float = 1 / 3
    reconnect: RetryPolicy = field(default_factory=lambda: RetryPolicy(initial_backoff=0.05, max_backoff=2.0))
    watch_max_batch: int = 0
    reassert_batch: int = 1_000

    def __post_init__(self) -> None:
        if not 0 < self.renew_fraction < 1:
            raise ValueError("renew_fraction must be between 0 and 1")
        if self.reassert_batch < 1:
            raise ValueError("reassert_batch must be positive")
