"""Who may call what: identities (rendezvous.server.authfile) checked on every request.

An engine identity may register, renew, deregister, watch, act on transfers and report KV cache events
(KvIndexService) for its own engines only, and only with the roles and in the pools it is bound to; it may read
(GetEngine) those engines, and the peer one of them moves a live transfer's bytes with (named by
GetEngineRequest.transfer_id; rendezvous.server.disclosure.peer_reader), and read (GetTransfer) the transfers they
take part in, any other id answered as an unknown one (the servicer decides, with the transfer it reads:
Caller.acts_for); the `router` role may read (GetEngine, ListEngines, GetTransfer, ListTransfers, GetStatus) and
abort as the router (an empty engine_id); any identity may query the KV index (MatchPrefixes); `admin` may do
everything. Health checks and reflection need no identity. A stream ends at its next message once its identity
leaves the auth file (or changes), and a non-participant learns nothing of a transfer
(rendezvous.server.disclosure).

`Guard` is the server interceptor that applies this and the per-caller quotas (keyed by the identity's
token, Identity.key; only calls that did not authenticate are limited by host). Tokens and metadata are
never logged; denials are logged with the identity's name. A failure of the guard's own (a bug) is answered as
any other: INTERNAL / INTERNAL_ERROR, logged under a request id (rendezvous.server.failures).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc_status import rpc_status

from rendezvous.core.model import Engine, Role, Transfer
from rendezvous.protocol import convert
from rendezvous.protocol.errors import Reason, RendezvousError
from rendezvous.server import disclosure
from rendezvous.server.authfile import (
    ADMIN,
    ANONYMOUS,
    RELOAD_CHECK,
    ROUTER,
    AuthPolicy,
    Caller,
    Identity,
)
from rendezvous.server.backoff import InvalidBackoff
from rendezvous.server.failures import as_error
from rendezvous.server.metrics import Metrics
from rendezvous.server.quotas import CallQuotas
from rendezvous.server.turns import FairTurns
from rendezvous.v1 import rendezvous_pb2 as pb

log = logging.getLogger(__name__)

# The batched transfer calls (one ItemResult per item).
_TRANSFER_CALLS = frozenset(
    {
        "RegisterTargets",
        "ClaimTransfers",
        "MarkSourcesReady",
        "CompleteTransfers",
        "AcknowledgeRevocations",
        "ReleaseTargets",
        "AbortTransfers",
    }
)
# KvIndexService's reports: only for an engine the caller may act for.
_INDEX_REPORTS = frozenset({"ReportCacheEvents", "ReplaceCachedBlocks"})
# RPCs an engine makes for itself: request.engine_id names the engine acted for.
_ENGINE_SCOPED = (
    frozenset({"RegisterEngine", "KeepAlive", "DeregisterEngine", "Watch", "ListTransfers"})
    | _TRANSFER_CALLS
    | _INDEX_REPORTS
)
# RPCs any authenticated identity may make (KvIndexService's query: what the fleet's caches hold).
_ANY_IDENTITY = frozenset({"MatchPrefixes"})
# RPCs the router role may make for any engine (AbortTransfers only as the router: empty engine_id).
_ROUTER_CALLS = frozenset(
    {"GetEngine", "ListEngines", "GetTransfer", "ListTransfers", "GetStatus", "ReserveCredits", "ReleaseCredits"}
)


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


EngineLookup = Callable[[str], Awaitable[Engine | None]]
TransferLookup = Callable[[str], Awaitable[Transfer | None]]


@dataclass
class _Admitted:
    """An admitted caller: its identity (None without auth), its key for the quotas, and the auth file's
    generation it was last found unchanged in."""

    identity: Identity | None
    key: str
    generation: int


class _Denied(Exception):
    """Raised out of a checked request stream; carries the refusal."""

    def __init__(self, error: RendezvousError) -> None:
        self.error = error


class Guard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Authenticates and authorizes every call of `services` (RendezvousService, KvIndexService; when a policy is
    set) and applies
    the per-caller quotas; unary calls are served in their caller's fair `turns`, and large ones wait out their
    caller's `backoff` after an invalid one. `engine_of` answers a registered engine, `transfer_of` a transfer
    (None if unknown)."""

    def __init__(
        self,
        services: Sequence[str],
        policy: AuthPolicy | None,
        quotas: CallQuotas,
        engine_of: EngineLookup,
        transfer_of: TransferLookup,
        metrics: Metrics,
        turns: FairTurns,
        backoff: InvalidBackoff,
    ) -> None:
        self._prefixes = tuple(f"/{service}/" for service in services)
        self._policy = policy
        self._quotas = quotas
        self._engine_of = engine_of
        self._transfer_of = transfer_of
        self._metrics = metrics
        self._turns = turns
        self._backoff = backoff

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method_path: str = handler_call_details.method
        prefix = next((p for p in self._prefixes if method_path.startswith(p)), None)
        if handler is None or prefix is None:
            return handler
        method = method_path[len(prefix) :]
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            # The request arrives as bytes (no deserializer) and is parsed in the caller's turn, after its
            # size was charged: a caller's queued requests cost nothing until their turn.
            checked, unread_first = self._unary(method, handler.unary_unary, handler.request_deserializer)
            if self._backoff.watches(method):  # some caller backs off from it: identify before reading
                return grpc.stream_unary_rpc_method_handler(
                    unread_first, response_serializer=handler.response_serializer
                )
            return grpc.unary_unary_rpc_method_handler(checked, response_serializer=handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._unary_stream(method, handler.unary_stream), **kwargs)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(self._stream_stream(method, handler.stream_stream), **kwargs)
        return handler

    # Checks

    async def _refuse(self, method: str, context: grpc.aio.ServicerContext, err: RendezvousError) -> None:
        self._metrics.rpcs.labels(method, err.code.name).inc()
        self._metrics.rejected.labels(err.reason).inc()
        await context.abort_with_status(rpc_status.to_status(convert.error_status(err)))

    async def _refuse_call(self, method: str, context: grpc.aio.ServicerContext, err: RendezvousError) -> NoReturn:
        """Refuse a unary call: `abort_with_status` raises, so this never returns."""
        await self._refuse(method, context, err)
        raise AssertionError("unreachable: abort_with_status raises")

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

    @staticmethod
    def _caller(identity: Identity | None, peer: str) -> str:
        return "id:" + identity.key if identity is not None else "peer:" + peer

    async def _authorize(self, method: str, identity: Identity | None, request: Any) -> None:
        if identity is None or identity.has_role(ADMIN) or method in _ANY_IDENTITY:
            return
        engine_id: str = getattr(request, "engine_id", "") if method in _ENGINE_SCOPED else ""
        if identity.has_role(ROUTER) and (method in _ROUTER_CALLS or (method == "AbortTransfers" and not engine_id)):
            return
        if method == "GetTransfer":
            return  # answered by the servicer for the transfers the identity's engines take part in (Caller.acts_for)
        if method == "GetEngine":
            await self._authorize_engine_read(identity, request)
            return
        if not engine_id:
            if method in _ENGINE_SCOPED and method not in ("AbortTransfers", "ListTransfers"):
                raise RendezvousError(
                    Reason.IDENTITY_MISMATCH, f"{method} needs the engine_id of an engine you may act for"
                )
            raise RendezvousError(Reason.ROLE_REQUIRED, f"{method} needs the router role", method=method)
        await self._check_acts_for(identity, method, engine_id, request)

    async def _check_acts_for(self, identity: Identity, method: str, engine_id: str, request: Any) -> None:
        """Refuse (IDENTITY_MISMATCH; a pool identity naming an unregistered engine: ENGINE_NOT_FOUND) a call of
        identity's for engine_id unless it names the engine or has its pool, and its bindings allow the engine."""
        # Pool membership and bindings are checked against the engine as registered.
        engine = await self._engine_of(engine_id) if identity.pools or identity.bound else None
        if not identity.names_engine(engine_id) and not (
            identity.pools and self._in_pools(identity, method, engine_id, engine, request)
        ):
            raise RendezvousError(
                Reason.IDENTITY_MISMATCH,
                f"identity {identity.name} may not act for engine {engine_id}",
                engine_id=engine_id,
            )
        if method == "RegisterEngine":
            identity.check_binding(engine_id, Role(request.role), request.pool)
        elif engine is not None:
            identity.check_binding(engine_id, engine.role, engine.pool)

    async def _acts_for(self, identity: Identity, engine_id: str) -> bool:
        """Whether identity may act for engine_id (as `_check_acts_for` allows it; never for no engine)."""
        if not engine_id:
            return False
        try:
            await self._check_acts_for(identity, "GetEngine", engine_id, None)
        except RendezvousError:
            return False
        return True

    async def _authorize_engine_read(self, identity: Identity, request: pb.GetEngineRequest) -> None:
        """GetEngine by an identity without the router role: of an engine it may act for (as its calls for the
        engine), or of the peer one of its engines moves request.transfer_id's bytes with (`_reads_peer`). Anything
        else is ROLE_REQUIRED, whether the transfer exists or not: no oracle of other engines' transfers."""
        engine_id = request.engine_id
        if engine_id:
            try:
                await self._check_acts_for(identity, "GetEngine", engine_id, request)
                return
            except RendezvousError as err:
                if err.reason != Reason.IDENTITY_MISMATCH:
                    raise  # a pool identity's unregistered engine: ENGINE_NOT_FOUND, as its other calls are told
            if request.transfer_id and await self._reads_peer(identity, engine_id, request.transfer_id):
                return
        raise RendezvousError(
            Reason.ROLE_REQUIRED,
            "GetEngine of an engine you do not act for needs the router role, or the transfer_id of a live "
            "transfer whose bytes one of yours moves with it",
            method="GetEngine",
        )

    async def _reads_peer(self, identity: Identity, engine_id: str, transfer_id: str) -> bool:
        """Whether identity acts for the engine that moves transfer_id's bytes with engine_id, the incarnation of it
        the transfer names (rendezvous.server.disclosure.peer_reader)."""
        transfer = await self._transfer_of(transfer_id)
        reader = disclosure.peer_reader(transfer, engine_id) if transfer is not None else None
        if reader is None:
            return False
        reader_id, incarnation = reader
        engine = await self._engine_of(engine_id)
        return engine is not None and engine.incarnation == incarnation and await self._acts_for(identity, reader_id)

    def _rights(self, identity: Identity | None) -> Caller:
        """What the servicer is told of a unary call's identity (rendezvous.server.authfile.Caller)."""
        if identity is None:
            return ANONYMOUS
        admin = identity.has_role(ADMIN)
        reads = None if identity.has_role(ROUTER) else functools.partial(self._acts_for, identity)
        return Caller(identity.key, exempt=admin, hides_non_participation=not admin, acts_for=reads)

    @staticmethod
    def _in_pools(identity: Identity, method: str, engine_id: str, engine: Engine | None, request: Any) -> bool:
        if method == "RegisterEngine":
            # A new engine joins the pool it names; an existing one must stay in one of ours.
            return request.pool in identity.pools and (engine is None or engine.pool in identity.pools)
        if engine is None:
            # Nothing to act on; say so as the service would, without a window for a later registration.
            raise RendezvousError(Reason.ENGINE_NOT_FOUND, f"engine {engine_id} is not registered", engine_id=engine_id)
        return engine.pool in identity.pools

    def _identify_caller(self, method: str, context: grpc.aio.ServicerContext, request_bytes: int) -> _Admitted:
        """Identify a call and charge its size to its caller, before its request is parsed. Only a caller
        without a known token or certificate is charged to its host's refused calls (and refused RATE_LIMITED
        once they are spent): a caller that authenticated is never refused for another's failures."""
        peer = _peer_host(context)
        identity: Identity | None = None
        try:
            identity = self._identify(context)
        except RendezvousError as err:
            self._quotas.check_refusals(peer)
            self._quotas.refused(peer)
            log.info("call denied", extra={"method": method, "identity": "-", "reason": err.reason})
            raise
        generation = self._policy.generation if self._policy is not None else 0
        key = self._caller(identity, peer)
        quotas = self._quotas
        quotas.admit(key, request_bytes if quotas.charges_by_size else 0)
        return _Admitted(identity, key, generation)

    async def _authorize_call(self, method: str, caller: _Admitted, request: Any) -> None:
        """Authorize an identified call; a denied call stays charged to its caller's own rate."""
        try:
            await self._authorize(method, caller.identity, request)
        except RendezvousError as err:
            name = caller.identity.name if caller.identity else "-"
            log.info("call denied", extra={"method": method, "identity": name, "reason": err.reason})
            raise

    async def _admit(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> _Admitted:
        """Identify, charge and authorize a call whose request is parsed (a stream's)."""
        caller = self._identify_caller(method, context, request.ByteSize())
        await self._authorize_call(method, caller, request)
        return caller

    def _charge(self, key: str, request: Any) -> None:
        quotas = self._quotas
        quotas.admit(key, request.ByteSize() if quotas.charges_by_size else 0)

    def _recheck(self, caller: _Admitted) -> None:
        """Raise _Denied once the stream's identity left the auth file or changed (checked on every message)."""
        policy = self._policy
        if policy is not None and caller.identity is not None:
            try:
                caller.generation = policy.recheck(caller.identity, caller.generation)
            except RendezvousError as err:
                raise _Denied(err) from None

    # Wrappers per RPC shape

    def _unary(
        self, method: str, behavior: Callable[..., Awaitable[Any]], parse: Callable[[bytes], Any]
    ) -> tuple[Callable[..., Awaitable[Any]], Callable[..., Awaitable[Any]]]:
        """A unary call: identified and charged by its size first (and refused unparsed while its caller backs off
        from an invalid request as large, rendezvous.server.backoff), then parsed, authorized and served in its
        caller's fair turn (rendezvous.server.turns), so a caller's backlog waits in its own queue.

        Two behaviours of one call: `checked` for gRPC's unary handler (the request read whole first), and
        `unread_first` for a request-streaming handler, used while some caller backs off from this method: the
        caller is identified before its request is read, and refused unread if it is one of them."""

        async def checked(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                caller = self._identify_caller(method, context, len(raw))
            except Exception as exc:
                await self._refuse_call(method, context, as_error(exc, method))
            return await read(caller, raw, context)

        async def unread_first(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
            try:
                caller = self._identify_caller(method, context, 0)
                await self._wait_out_backoff(caller.key, method)
            except Exception as exc:
                await self._refuse_call(method, context, as_error(exc, method))
            raw = await context.read()
            try:
                if not isinstance(raw, bytes):  # grpc.aio.EOF: a unary call sent no request
                    raise RendezvousError(Reason.MESSAGE_INVALID, f"{method} got no request message")
                self._quotas.admit_rest(caller.key, len(raw))
            except Exception as exc:
                await self._refuse_call(method, context, as_error(exc, method))
            return await read(caller, raw, context)

        async def read(caller: _Admitted, raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                self._backoff.check(caller.key, len(raw))
            except Exception as exc:
                await self._refuse_call(method, context, as_error(exc, method))
            try:
                async with self._turns.turn(caller.key, len(raw)):
                    began = time.perf_counter()
                    try:
                        response = await self._serve(method, behavior, caller, _parsed(parse, raw), context)
                    except BaseException as exc:
                        if _refused_as_invalid(exc, context):
                            self._backoff.refused(caller.key, method, len(raw), time.perf_counter() - began)
                        raise
                    self._backoff.passed(caller.key, len(raw))
                    return response
            except grpc.aio.AbortError:
                raise  # answered already (by the service, or refused by _serve)
            except Exception as exc:  # refused for its turn (before its request was parsed), unparsable, or a bug
                await self._refuse_call(method, context, as_error(exc, method))

        return checked, unread_first

    async def _wait_out_backoff(self, key: str, method: str) -> None:
        """Hold a call of a caller backing off from method, unread, until the back-off ends (at most the hold),
        then raise RATE_LIMITED if it has not."""
        backoff = self._backoff
        left = backoff.unread_wait(key, method)
        if left > 0:
            with backoff.hold(key, left) as seconds:
                if seconds:
                    await asyncio.sleep(seconds)
        backoff.check_unread(key, method)

    async def _serve(
        self, method: str, behavior: Callable[..., Awaitable[Any]], caller: _Admitted, request: Any, context: Any
    ) -> Any:
        try:
            await self._authorize_call(method, caller, request)
            self._quotas.enter(caller.key)
        except Exception as exc:
            await self._refuse_call(method, context, as_error(exc, method, getattr(request, "request_id", "")))
        try:
            return await behavior(request, context, self._rights(caller.identity))
        finally:
            self._quotas.leave(caller.key)

    def _unary_stream(self, method: str, behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
        async def checked(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                caller = await self._admit(method, request, context)
                self._quotas.open_stream(caller.key)
            except Exception as exc:
                await self._refuse(method, context, as_error(exc, method))
                return
            try:
                async for response in self._while_known(behavior(request, context), lambda: caller):
                    yield response
            except _Denied as denied:
                await self._refuse(method, context, denied.error)
            except grpc.aio.AbortError:
                raise  # answered already
            except Exception as exc:
                await self._refuse(method, context, as_error(exc, method))
            finally:
                self._quotas.close_stream(caller.key)

        return checked

    def _stream_stream(self, method: str, behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
        async def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            admitted: list[_Admitted] = []  # once the first message is admitted

            async def each_checked() -> AsyncIterator[Any]:
                async for request in requests:
                    try:
                        if not admitted:
                            caller = await self._admit(method, request, context)
                            self._quotas.open_stream(caller.key)
                            admitted.append(caller)
                        else:
                            caller = admitted[0]
                            self._recheck(caller)
                            self._charge(caller.key, request)
                            await self._authorize(method, caller.identity, request)
                    except _Denied:
                        raise  # its identity left the auth file (_recheck)
                    except Exception as exc:
                        raise _Denied(as_error(exc, method)) from None
                    yield request

            try:
                responses = behavior(each_checked(), context)
                async for response in self._while_known(responses, lambda: admitted[0] if admitted else None):
                    yield response
            except _Denied as denied:
                await self._refuse(method, context, denied.error)
            except grpc.aio.AbortError:
                raise  # answered already
            except Exception as exc:
                await self._refuse(method, context, as_error(exc, method))
            finally:
                if admitted:
                    self._quotas.close_stream(admitted[0].key)

        return checked

    async def _while_known(
        self, responses: AsyncIterator[Any], caller: Callable[[], _Admitted | None]
    ) -> AsyncIterator[Any]:
        """A stream's responses, ended with _Denied once its caller's identity leaves the auth file (or
        changes): checked before every response is sent, and every RELOAD_CHECK while the stream waits, so
        a busy stream ends at its next message and an idle one within about a second."""
        pending: asyncio.Future[Any] | None = None
        try:
            while True:
                pending = asyncio.ensure_future(anext(responses))
                while not (await asyncio.wait({pending}, timeout=RELOAD_CHECK))[0]:
                    if (waiting := caller()) is not None:
                        self._recheck(waiting)
                try:
                    response = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                if (sending := caller()) is not None:
                    self._recheck(sending)
                yield response
        finally:
            if pending is not None:
                if not pending.done():
                    pending.cancel()
                    await asyncio.wait({pending})
                if not pending.cancelled():
                    # Collected: it may have ended with the stream (StopAsyncIteration, or the call's own end) as
                    # this generator was cancelled or closed; uncollected, asyncio logs it as never retrieved.
                    pending.exception()


def _parsed(parse: Callable[[bytes], Any] | None, raw: bytes) -> Any:
    """A request from its bytes; a message that does not parse is INVALID_ARGUMENT."""
    if parse is None:
        return raw
    try:
        return parse(raw)
    except DecodeError:
        raise RendezvousError(Reason.MESSAGE_INVALID, "the request does not parse as the method's message") from None


def _refused_as_invalid(exc: BaseException, context: grpc.aio.ServicerContext) -> bool:
    """Whether a call ended refused INVALID_ARGUMENT as a whole: by the guard (a request that does not parse) or
    by the service (its shape, or a field, over a limit)."""
    if isinstance(exc, RendezvousError):
        return exc.code is grpc.StatusCode.INVALID_ARGUMENT
    return bool(context.code() == grpc.StatusCode.INVALID_ARGUMENT)


def _peer_host(context: grpc.aio.ServicerContext) -> str:
    """The caller's address without its port ("ipv4:127.0.0.1")."""
    return str(context.peer()).rpartition(":")[0]
