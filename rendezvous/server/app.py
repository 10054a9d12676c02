"""The rendezvous server process: gRPC service, health, reflection, metrics and the sweeper."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rendezvous.coordinator import Coordinator
from rendezvous.core.bindings import BindingRules
from rendezvous.core.limits import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_RECEIVE_WINDOW_BYTES, Limits, Timeouts
from rendezvous.protocol.bindings import load_keys
from rendezvous.server.auth import Guard
from rendezvous.server.authfile import DEFAULT_MIN_TOKEN_BYTES, AuthPolicy
from rendezvous.server.backoff import InvalidBackoff
from rendezvous.server.health import HealthPort
from rendezvous.server.index_servicer import KvIndexServicer
from rendezvous.server.metrics import Metrics
from rendezvous.server.quotas import CallLimits, CallQuotas
from rendezvous.server.servicer import RendezvousServicer
from rendezvous.server.settings import SettingError
from rendezvous.server.tls import CertificateReloader, TLSConfig
from rendezvous.server.turns import FairTurns
from rendezvous.server.watch_buffers import HandlerTask
from rendezvous.store.base import Store, StoreUnavailableError
from rendezvous.store.factory import create_store
from rendezvous.v1 import index_pb2 as ipb
from rendezvous.v1 import index_pb2_grpc as ipb_grpc
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RendezvousService"].full_name
INDEX_SERVICE_NAME = ipb.DESCRIPTOR.services_by_name["KvIndexService"].full_name
LIVENESS = "liveness"


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server needs; the CLI builds it from flags and environment variables.

    `tls` serves TLS (mTLS with `require_client_cert`) instead of plaintext; `auth_file` turns on
    identity-bound auth (docs/security.md); `call_limits` are per-caller rate and concurrency limits.
    `health_listen` also serves grpc.health.v1 alone in plaintext there, from threads of its own
    (rendezvous.server.health): probes should target it, since it answers however busy the serving loop is
    and needs no TLS (Kubernetes' native gRPC probes). `max_message_bytes` is the largest request (and
    response) message, in bytes: a larger request is refused by gRPC, unread, with RESOURCE_EXHAUSTED.
    `receive_window_bytes` is each call's HTTP/2 receive window: what a client may send before the server
    reads, so what a call refused before its request is read still costs (0: gRPC's window, grown by
    bandwidth-delay probing to megabytes on a fast link; a request then costs the server nearly as much to
    refuse unread as to read: 1.9-2.6 against 3.0-5.4 ms for 4 MiB here).
    """

    listen: str = "127.0.0.1:50051"
    store: str = "memory"
    metrics_listen: str | None = None
    limits: Limits = field(default_factory=Limits)
    timeouts: Timeouts = field(default_factory=Timeouts)
    sweep_interval: float = 0.05
    health_interval: float = 1.0
    grace: float = 5.0
    drain: float = 0.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    receive_window_bytes: int = DEFAULT_RECEIVE_WINDOW_BYTES
    idempotency_ttl: float = 600.0
    """Seconds the answer to a request with a request_id is kept, for its retries (AIP-155)."""
    watch_batch: int = 1024
    server_id: str = ""
    tls: TLSConfig | None = None
    auth_file: str | None = None
    min_token_bytes: int = DEFAULT_MIN_TOKEN_BYTES
    """The shortest token the auth file may name in the clear (sha256: keys are not checked)."""
    health_listen: str | None = None
    call_limits: CallLimits = field(default_factory=CallLimits)
    strict_identities: bool = False
    """Refuse an auth file with an identity that may register engines of any role or pool (else: warned)."""
    binding_key_file: str | None = None
    """The keys routers sign transfer bindings with (rendezvous.protocol.bindings); unset: bindings are
    not checked. Set, a transfer's half without a binding is refused (admin identities exempt)."""
    allow_unbound: bool = False
    """With binding_key_file: admit a half without a binding (only a presented one is checked)."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.idempotency_ttl) or self.idempotency_ttl <= 0:
            raise ValueError(f"idempotency_ttl must be a positive number of seconds, not {self.idempotency_ttl:g}")
        if self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be a positive number of bytes, not {self.max_message_bytes}")
        if self.receive_window_bytes < 0:
            raise ValueError(f"receive_window_bytes must not be negative, not {self.receive_window_bytes}")
        if self.allow_unbound and not self.binding_key_file:
            raise ValueError("allow_unbound needs binding_key_file (without keys no binding is required)")


def _split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


_T = TypeVar("_T")


class ListenError(OSError):
    """An address the server cannot listen on. `setting` names its ServerConfig field (listen, metrics_listen,
    health_listen), so that the CLI can name the flag."""

    def __init__(self, setting: str, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address}: {reason}")
        self.setting = setting
        self.address = address
        self.reason = reason


def _setting(setting: str, value: str, build: Callable[[], _T], *said: str) -> _T:
    """What build() returns; SettingError if it raises OSError or ValueError. The reason drops the words of the
    message that `said` the value (the CLI names it)."""
    try:
        return build()
    except (OSError, ValueError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        for words in said:
            reason = reason.replace(words, "", 1)
        raise SettingError(setting, value, reason) from None


def _checked_address(setting: str, address: str) -> str:
    """`address` if it is host:port with a port in 0..65535 (gRPC takes 99999 as 34463), else ListenError."""
    _, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or int(port) > 65_535:
        raise ListenError(setting, address, "not host:port with a port in 0..65535")
    return address


def _bind(setting: str, address: str, bind: Callable[[str], int]) -> int:
    """The port `bind` bound at address; ListenError, with the reason, if it bound none."""
    try:
        port = bind(_checked_address(setting, address))
    except ListenError:
        raise
    except (OSError, RuntimeError) as err:  # gRPC raises RuntimeError, prometheus_client OSError
        reason = err.strerror if isinstance(err, OSError) and err.strerror else "the address is in use or not local"
        raise ListenError(setting, address, reason) from None
    if not port:
        raise ListenError(setting, address, "the address is in use or not local")
    return port


class RendezvousServer:
    """One server replica. `start()`, then `stop()`; `address` is known once started.

    clock: the time leases, deadlines, credits and bindings are judged by, wall time by default. A test passes a
    fake one (rendezvous.clients.testing.FakeClock), moves it and calls `coordinator.sweep()` instead of sleeping; the
    memory store's kept answers and the call quotas' token buckets then run by it too (by default they run on a
    monotonic clock).
    """

    def __init__(self, config: ServerConfig | None = None, clock: Callable[[], float] | None = None) -> None:
        self.config = config or ServerConfig()
        self.clock = clock or time.time
        self._quota_clock = clock or time.monotonic
        self.metrics = Metrics()
        url = self.config.store
        self.store: Store = _setting(
            "store",
            url,
            lambda: create_store(url, self.config.limits, clock),
            f"store URL {url!r}: ",
            f" {url!r}",
        )
        key_file = self.config.binding_key_file
        bindings = (
            BindingRules(
                _setting("binding_key_file", key_file, lambda: load_keys(key_file), f"binding key file {key_file}: "),
                not self.config.allow_unbound,
            )
            if key_file
            else None
        )
        self.coordinator = Coordinator(
            self.store, self.config.limits, self.config.timeouts, self.clock, self.metrics, bindings=bindings
        )
        self.server_id = self.config.server_id or f"{socket.gethostname()}-{os.getpid()}"
        self.port = 0
        self.metrics_port: int | None = None
        self.health_port: int | None = None
        self._health_port: HealthPort | None = None
        self._stopping = asyncio.Event()
        self._drained = asyncio.Event()
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.turns: FairTurns | None = None
        """The unary calls' fair turns (rendezvous.server.turns), once started with auth or call limits."""
        self.certificates = CertificateReloader(self.config.tls) if self.config.tls else None
        auth_file = self.config.auth_file
        self.auth = (
            _setting(
                "auth_file",
                auth_file,
                lambda: AuthPolicy(
                    auth_file, min_token_bytes=self.config.min_token_bytes, strict=self.config.strict_identities
                ),
                f"auth file {auth_file}: ",
                f"auth file {auth_file} ",
            )
            if auth_file
            else None
        )

    @property
    def address(self) -> str:
        """host:port the server listens on."""
        host, _ = _split_host_port(self.config.listen)
        return f"{host}:{self.port}"

    async def start(self) -> None:
        """Open the store, bind the port, start serving and the background loops."""
        cfg = self.config
        await self.store.open()
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.so_reuseport", 0),
        ]
        if cfg.receive_window_bytes:
            options += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", cfg.receive_window_bytes)]
        interceptors: list[grpc.aio.ServerInterceptor] = [HandlerTask()]
        limits = cfg.call_limits.for_server(auth=self.auth is not None)
        if self.auth is not None or limits.enabled:
            quotas = CallQuotas(limits, self._quota_clock)
            self.turns = FairTurns(limits.turns, limits.waiting, limits.waiting_bytes)
            backoff = InvalidBackoff(limits.invalid_backoff_bytes, self.clock, limits.invalid_backoff_hold)
            interceptors.append(
                Guard(
                    (SERVICE_NAME, INDEX_SERVICE_NAME),
                    self.auth,
                    quotas,
                    self.store.get_engine,
                    self.store.get_transfer,
                    self.metrics,
                    self.turns,
                    backoff,
                )
            )
        server = grpc.aio.server(options=options, interceptors=interceptors)
        servicer = RendezvousServicer(
            self.coordinator, self.metrics, self.server_id, cfg.idempotency_ttl, cfg.watch_batch, self._stopping
        )
        pb_grpc.add_RendezvousServiceServicer_to_server(servicer, server)
        ipb_grpc.add_KvIndexServiceServicer_to_server(KvIndexServicer(servicer), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, INDEX_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        try:
            if self.certificates is not None:
                credentials = self.certificates.credentials()
                self.port = _bind("listen", cfg.listen, lambda address: server.add_secure_port(address, credentials))
            else:
                self.port = _bind("listen", cfg.listen, server.add_insecure_port)
            await server.start()
            self._server = server
            if cfg.health_listen:
                health_port = self._health_port = HealthPort(cfg.health_listen)
                self.health_port = _bind("health_listen", cfg.health_listen, lambda _: health_port.start())
            await self._set_serving(await self.store.ping())
            # "liveness" answers SERVING while the process serves at all: a store outage or a drain turns the
            # server NOT_SERVING (readiness) but must not get it restarted.
            await self._set_health(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
            if cfg.metrics_listen:
                self.metrics_port = _bind(
                    "metrics_listen", cfg.metrics_listen, lambda address: self.metrics.serve(*_split_host_port(address))
                )
        except BaseException:
            await self._abandon(server)
            raise
        self._tasks = [asyncio.create_task(self._sweep_loop()), asyncio.create_task(self._health_loop())]
        log.info(
            "serving",
            extra={
                "address": self.address,
                "store": self.store.name,
                "epoch": self.store.epoch,
                "metrics_port": self.metrics_port,
                "health_port": self.health_port,
                "tls": "mtls" if cfg.tls and cfg.tls.require_client_cert else "tls" if cfg.tls else "off",
                "auth": "on" if self.auth else "off",
            },
        )

    async def _set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self._set_health(name, status)
        self.metrics.store_up.set(1 if serving else 0)

    async def _set_health(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        """A status on both health services: the serving port's (on this loop) and the health port's."""
        await self._health.set(service, status)
        if self._health_port is not None:
            self._health_port.set(service, status)

    async def _sweep_loop(self) -> None:
        failing = False
        while not self._stopping.is_set():
            try:
                await self.coordinator.sweep()
                if failing:
                    log.info("sweeps succeed again")
                failing = False
            except StoreUnavailableError as err:
                if not failing:
                    log.warning("sweep failed: store unavailable: %s", err)
                failing = True
            except Exception:
                log.exception("sweep failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.config.sweep_interval)

    async def _health_loop(self) -> None:
        serving = True
        while not self._stopping.is_set():
            try:
                up = await self.store.ping()
                if up:
                    self.metrics.update_counts(await self.store.counts())
                    usage, index_blocks = (await self.store.usage("")).total, await self.store.index().total()
                    self.metrics.update_budget(usage, self.config.limits, index_blocks)
            except Exception:
                up = False
            if up != serving and not self._stopping.is_set():
                serving = up
                log.warning("store %s", "reachable again" if up else "unreachable: NOT_SERVING")
                await self._set_serving(up)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.config.health_interval)

    async def _abandon(self, server: grpc.aio.Server) -> None:
        """Undo a start that failed: no server, port, store connection (nor their warnings at exit) stay behind."""
        self._stopping.set()
        await server.stop(0)
        self._server = None
        if self._health_port is not None:
            await asyncio.to_thread(self._health_port.stop)
            self._health_port = None
        self.metrics.close()
        await self.store.close()

    async def stop(self, grace: float | None = None) -> None:
        """Report NOT_SERVING, keep serving for `drain` seconds (or until `end_drain`) so load balancers move
        away, then stop accepting calls, let running ones finish within grace, and close."""
        if self._server is None:
            return
        await self._set_serving(False)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._drained.wait(), self.config.drain)
        self._stopping.set()
        await self._server.stop(self.config.grace if grace is None else grace)
        if self._health_port is not None:
            await asyncio.to_thread(self._health_port.stop)
            self._health_port = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._server = None
        self.metrics.close()
        await self.store.close()
        log.info("stopped", extra={"address": self.address})

    def end_drain(self) -> None:
        """End a drain now (`stop` goes on to refuse new calls); before `stop`, makes its drain end at once."""
        self._drained.set()

    async def wait(self) -> None:
        """Until the server stops."""
        if self._server is not None:
            await self._server.wait_for_termination()
