"""Who may call what: identities from bearer tokens or client certificates, checked per request.

The auth file (JSON) binds each token, and each client-certificate name (CN or DNS/URI SAN, with
mTLS), to an identity:

    {
      "tokens": {
        "s3cret-decode-0": {"name": "decode-0", "engines": ["decode-0"]},
        "sha256:9f86d08...": {"name": "prefill-pool", "pools": ["prefill"]},
        "s3cret-router": {"name": "router", "roles": ["router"]}
      },
      "certificates": {
        "decode-1.kv.svc": {"engines": ["decode-1", "decode-1-*"]},
        "ops": {"roles": ["admin"]}
      }
    }

A token key is the token itself or `sha256:<hex digest>` of it, so the file need not hold secrets.
`engines` are engine ids or shell-style globs; `pools` admit every engine registered in those
pools. An engine identity may register, renew, deregister, watch and act on transfers for its own
engines only; the `router` role may read (GetEngine, ListEngines, GetTransfer, ListTransfers,
GetStatus) and abort as the router (an empty engine_id); `admin` may do everything. Health checks
and reflection need no identity. The file is re-read when its modification time changes.

`Guard` is the server interceptor that applies this and the per-caller quotas. Tokens and
metadata are never logged; denials are logged with the identity's name.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_status import rpc_status

from rendezvous import wire
from rendezvous.core.errors import Reason, RendezvousError
from rendezvous.server.metrics import Metrics
from rendezvous.server.quotas import CallQuotas
from rendezvous.store.base import StoreUnavailableError

log = logging.getLogger(__name__)

ROUTER = "router"
ADMIN = "admin"
_ROLES = frozenset({ROUTER, ADMIN})

# RPCs an engine makes for itself: request.engine_id names the engine acted for.
_ENGINE_SCOPED = frozenset(
    {
        "RegisterEngine",
        "KeepAlive",
        "DeregisterEngine",
        "RegisterTarget",
        "ClaimTransfer",
        "MarkSourceReady",
        "CompleteTransfer",
        "AcknowledgeRevocation",
        "ReleaseTarget",
        "AbortTransfer",
        "Watch",
        "ListTransfers",
    }
)
# RPCs the router role may make for any engine (AbortTransfer only as the router: empty engine_id).
_ROUTER_CALLS = frozenset({"GetEngine", "ListEngines", "GetTransfer", "ListTransfers", "GetStatus"})

# Re-check the auth file's modification time at most this often (seconds).
_RELOAD_CHECK = 1.0


@dataclass(frozen=True)
class Identity:
    """A caller: a name for logs, the engines it may act for, its roles."""

    name: str
    engines: tuple[str, ...] = ()
    pools: tuple[str, ...] = ()
    roles: frozenset[str] = frozenset()

    def has_role(self, role: str) -> bool:
        """Whether the identity holds role (admin holds every role)."""
        return role in self.roles or ADMIN in self.roles

    def names_engine(self, engine_id: str) -> bool:
        """Whether engine_id is one of the identity's engines (an id or a glob)."""
        return any(fnmatch.fnmatchcase(engine_id, pattern) for pattern in self.engines)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _identity(name: str, entry: Any) -> Identity:
    if not isinstance(entry, Mapping):
        raise ValueError(f"auth file: identity {name!r} must be an object")
    fields = {"name", "engines", "pools", "roles"}
    if unknown := set(entry) - fields:
        raise ValueError(f"auth file: identity {name!r} has unknown keys {sorted(unknown)}")
    lists = {k: entry.get(k, []) for k in ("engines", "pools", "roles")}
    for key, value in lists.items():
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ValueError(f"auth file: {key} of identity {name!r} must be a list of non-empty strings")
    if bad := set(lists["roles"]) - _ROLES:
        raise ValueError(f"auth file: identity {name!r} has unknown roles {sorted(bad)}; known: router, admin")
    return Identity(
        name=str(entry.get("name", name)),
        engines=tuple(lists["engines"]),
        pools=tuple(lists["pools"]),
        roles=frozenset(lists["roles"]),
    )


class AuthPolicy:
    """The identities of an auth file, by token digest and by certificate name; reloaded when it changes."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._mtime = 0
        self._checked = 0.0
        self._tokens: dict[str, Identity] = {}
        self._certificates: dict[str, Identity] = {}
        self._load()

    def _load(self) -> None:
        mtime = os.stat(self.path).st_mtime_ns
        with open(self.path, encoding="utf-8") as f:
            try:
                doc = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(f"auth file {self.path} is not JSON: {err.msg} at line {err.lineno}") from None
        if not isinstance(doc, Mapping) or set(doc) - {"tokens", "certificates"}:
            raise ValueError(f"auth file {self.path}: expected an object with 'tokens' and/or 'certificates'")
        tokens: dict[str, Identity] = {}
        for n, (key, entry) in enumerate(dict(doc.get("tokens", {})).items()):
            digest = key.removeprefix("sha256:").lower() if key.startswith("sha256:") else _digest(key)
            tokens[digest] = _identity(f"token-{n}", entry)
        certificates = {name: _identity(name, entry) for name, entry in dict(doc.get("certificates", {})).items()}
        self._tokens, self._certificates, self._mtime = tokens, certificates, mtime

    def _maybe_reload(self) -> None:
        now = self._clock()
        if now - self._checked < _RELOAD_CHECK:
            return
        with self._lock:
            self._checked = now
            try:
                if os.stat(self.path).st_mtime_ns != self._mtime:
                    self._load()
                    log.info("auth file reloaded", extra={"path": self.path})
            except (OSError, ValueError) as err:
                log.warning("auth file reload failed; keeping the current identities: %s", err)

    def by_token(self, token: str) -> Identity | None:
        """The identity a bearer token stands for, if any."""
        self._maybe_reload()
        return self._tokens.get(_digest(token))

    def by_certificate(self, names: Iterable[str]) -> Identity | None:
        """The identity of the first certificate name (CN or SAN) the file knows, if any."""
        self._maybe_reload()
        return next((self._certificates[n] for n in names if n in self._certificates), None)


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def _certificate_names(context: grpc.aio.ServicerContext) -> list[str]:
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"]:
        return []
    values = [*auth.get("x509_common_name", []), *auth.get("x509_subject_alternative_name", [])]
    return [v.decode(errors="replace") for v in values]


PoolLookup = Callable[[str], Awaitable[str | None]]


class _Denied(Exception):
    """Raised out of a checked request stream; carries the refusal."""

    def __init__(self, error: RendezvousError) -> None:
        self.error = error


class Guard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Authenticates and authorizes every RendezvousService call (when a policy is set) and applies
    the per-caller quotas (when set). `pool_of` answers an engine's registered pool (None if unknown)."""

    def __init__(
        self,
        service: str,
        policy: AuthPolicy | None,
        quotas: CallQuotas | None,
        pool_of: PoolLookup,
        metrics: Metrics,
    ) -> None:
        self._prefix = f"/{service}/"
        self._policy = policy
        self._quotas = quotas
        self._pool_of = pool_of
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method_path: str = handler_call_details.method
        if handler is None or not method_path.startswith(self._prefix):
            return handler
        method = method_path[len(self._prefix) :]
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(method, handler.unary_unary), **kwargs)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._unary_stream(method, handler.unary_stream), **kwargs)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(self._stream_stream(method, handler.stream_stream), **kwargs)
        return handler

    # Checks

    async def _refuse(self, method: str, context: grpc.aio.ServicerContext, err: RendezvousError) -> None:
        self._metrics.rpcs.labels(method, err.code.value).inc()
        self._metrics.rejected.labels(err.reason.value).inc()
        await context.abort_with_status(rpc_status.to_status(wire.error_status(err)))

    def _identify(self, context: grpc.aio.ServicerContext) -> Identity | None:
        if self._policy is None:
            return None
        token = _bearer(context.invocation_metadata())
        identity = self._policy.by_token(token) if token else None
        if identity is None and token is None:
            identity = self._policy.by_certificate(_certificate_names(context))
        if identity is None:
            raise RendezvousError(
                Reason.UNAUTHENTICATED_TOKEN,
                "an unknown bearer token" if token else "no bearer token and no known client certificate",
            )
        return identity

    def _caller(self, identity: Identity | None, context: grpc.aio.ServicerContext) -> str:
        if identity is not None:
            return "id:" + identity.name
        return "peer:" + str(context.peer()).rpartition(":")[0]

    async def _authorize(self, method: str, identity: Identity | None, request: Any) -> None:
        if identity is None or identity.has_role(ADMIN):
            return
        engine_id: str = getattr(request, "engine_id", "") if method in _ENGINE_SCOPED else ""
        if identity.has_role(ROUTER) and (method in _ROUTER_CALLS or (method == "AbortTransfer" and not engine_id)):
            return
        if not engine_id:
            if method in _ENGINE_SCOPED and method not in ("AbortTransfer", "ListTransfers"):
                raise RendezvousError(
                    Reason.IDENTITY_MISMATCH, f"{method} needs the engine_id of an engine you may act for"
                )
            raise RendezvousError(Reason.ROLE_REQUIRED, f"{method} needs the router role", method=method)
        if identity.names_engine(engine_id):
            return
        if identity.pools and await self._in_pools(identity, method, engine_id, request):
            return
        raise RendezvousError(
            Reason.IDENTITY_MISMATCH,
            f"identity {identity.name} may not act for engine {engine_id}",
            engine_id=engine_id,
        )

    async def _in_pools(self, identity: Identity, method: str, engine_id: str, request: Any) -> bool:
        pool = await self._pool_of(engine_id)
        if method == "RegisterEngine":
            # A new engine joins the pool it names; an existing one must stay in one of ours.
            return request.pool in identity.pools and (pool is None or pool in identity.pools)
        if pool is None:
            # Nothing to act on; say so as the service would, without a window for a later registration.
            raise RendezvousError(Reason.ENGINE_NOT_FOUND, f"engine {engine_id} is not registered", engine_id=engine_id)
        return pool in identity.pools

    async def _admit(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> tuple[Identity | None, str]:
        """Identify, authorize and rate-limit a call: the identity and the caller key for the quotas."""
        identity = self._identify(context)
        try:
            await self._authorize(method, identity, request)
        except RendezvousError as err:
            name = identity.name if identity else "-"
            log.info("call denied", extra={"method": method, "identity": name, "reason": err.reason.value})
            raise
        key = self._caller(identity, context)
        if self._quotas is not None:
            self._quotas.admit(key)
        return identity, key

    # Wrappers per RPC shape

    def _unary(self, method: str, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                _, key = await self._admit(method, request, context)
                if self._quotas is not None:
                    self._quotas.enter(key)
            except (RendezvousError, StoreUnavailableError) as exc:
                await self._refuse(method, context, _as_error(exc))
                raise AssertionError("unreachable: abort_with_status raises") from None
            try:
                return await behavior(request, context)
            finally:
                if self._quotas is not None:
                    self._quotas.leave(key)

        return checked

    def _unary_stream(self, method: str, behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
        async def checked(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                await self._admit(method, request, context)
            except (RendezvousError, StoreUnavailableError) as exc:
                await self._refuse(method, context, _as_error(exc))
                return
            async for response in behavior(request, context):
                yield response

        return checked

    def _stream_stream(self, method: str, behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
        async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            identity: list[Identity | None] = []

            async def each_checked() -> AsyncIterator[Any]:
                async for request in requests:
                    try:
                        if not identity:
                            identity.append((await self._admit(method, request, context))[0])
                        else:
                            await self._authorize(method, identity[0], request)
                    except (RendezvousError, StoreUnavailableError) as exc:
                        raise _Denied(_as_error(exc)) from None
                    yield request

            try:
                async for response in behavior(each_checked(), context):
                    yield response
            except _Denied as denied:
                await self._refuse(method, context, denied.error)

        return checked


def _as_error(exc: RendezvousError | StoreUnavailableError) -> RendezvousError:
    if isinstance(exc, StoreUnavailableError):
        return RendezvousError(Reason.STORE_UNAVAILABLE, f"the store is unavailable: {exc}")
    return exc
