"""`kv-rendezvous router`: a reference OpenAI-compatible proxy for disaggregated vLLM engines.

    python -m rendezvous.connector.router --listen 127.0.0.1:8000 --address 127.0.0.1:50051 \
        --route 'llama:prefill-a,prefill-b:decode-a' --route '*:prefill:decode' --policy least-loaded

Per request (`POST /v1/completions`, `POST /v1/chat/completions`) it looks up the request's model in its routes
(`MODEL:PREFILL_POOLS:DECODE_POOLS`, pools comma-separated; `*` routes any other model; an unrouted model gets
404), picks a decode engine, then a prefill engine whose KV layout matches it (503 with the difference if none
does), mints a fresh transfer id and sends both legs at once with `kv_transfer_params = {"transfer_id"}`:
prefill with max_tokens=1, decode with the client's request, whose answer (streamed or not) goes back to the
client. Engines are picked round-robin or least-loaded (fewest legs in flight from this router) among the live
engines of the route's pools; an engine's OpenAI base URL is its `url` label. If one leg fails, or the client
goes away before decode answered, the transfer is aborted so the other side lets go of its blocks at once.
With `--binding-key-file` (the rendezvous's own key file, whose first key signs) both legs also carry
`kv_transfer_params["kv_rendezvous_binding"]`, the router's signed binding of the transfer to the two engines it
picked, so that no other engine can take either half (docs/security.md, Bindings); no call is added.
With tracing on (KV_RENDEZVOUS_TRACING=1, docs/operations.md) each request is a `router.dispatch` span, continued
from the caller's `traceparent` header, whose context both legs carry in `kv_transfer_params["traceparent"]`.
Decode admission credits (connector/admission.py): a decode engine that declared a capacity is only sent a
request once the router holds a reservation on it (`ReserveCredits`, atomic at the rendezvous, so several routers
never overcommit it); when no decode engine has credit the request waits in a bounded queue (`--max-queued`,
`--queue-timeout`) or is answered 503 naming why (`X-Kv-Refusal`); the reservation is released when the request
ends. `GET /metrics` serves the router's Prometheus metrics (queue, waits, refusals, pools' free credit, prefix-aware
placements by source).
With `--policy prefix-aware` engines are placed by what the fleet's KV index says they hold of the prompt
(engines that report their cache, connector `kv_index`; rendezvous.connector.prefix_view), by the router's own memory of
what it sent where while the index cannot answer (or with --no-kv-index); `--local-prefill-below` then counts
only the tokens the decode engine does not hold.
While the rendezvous does not answer, requests do not wait on it: each of the router's rendezvous calls has a
deadline of `--rendezvous-timeout` seconds (2), retries included. A request whose call finds the rendezvous
unreachable (UNAVAILABLE, DEADLINE_EXCEEDED), or a background refresh of an engine list that does, opens the
circuit: that request and every one after it, at once and without a call, go to a decode engine alone, which
computes the prompt itself (`X-Kv-Prefill: local-unreachable`; no transfer, so the engine's connector calls nothing
either), the least loaded of the route's decode engines in the last engine list the router got, while that list is
at most `--degraded-max-age` seconds old (60; 0: never). A decode engine that does not take a connection meanwhile
(refused, or not taken within `--connect-timeout`) is left out until the circuit closes (the request, which never
reached it, goes to the next). Past the age, or with no such engine, requests are answered 503 with `Retry-After`
and `X-Kv-Refusal: rendezvous_unavailable`. A background probe (GetStatus every `--rendezvous-retry-after` seconds)
closes the circuit once the rendezvous answers again, and requests are disaggregated again.
A request body over `--max-body-bytes` (1 MiB) is refused 413 unread. An engine that takes no connection within
`--connect-timeout` seconds (5; a host that went down drops the packets, refusing nothing) fails its leg as a
refused connection does (a decode leg: 502), not after the whole `--timeout`.
`GET /health` answers 200; `GET /v1/models` lists the models of every route's decode engines.

Needs aiohttp (installed with vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import (
    ClientConnectorError,
    ClientError,
    ClientSession,
    ClientTimeout,
    ConnectionTimeoutError,
    TCPConnector,
    web,
)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rendezvous.clients import (
    AsyncRendezvousClient,
    ClientConfig,
    EngineInfo,
    EngineRole,
    IndexedPrefix,
    NotFound,
    PickPolicy,
    RendezvousError,
    RetryPolicy,
    RouterClient,
)
from rendezvous.clients._router import DEFAULT_BINDING_TTL
from rendezvous.connector.admission import (
    TOO_LARGE,
    Admission,
    DecodeAdmission,
    Refused,
    RouterMetrics,
    unanswered,
)
from rendezvous.connector.config import TRANSFER_ID_KEY
from rendezvous.connector.prefix_view import PrefixView
from rendezvous.connector.prompts import PromptReader, Tokenizer
from rendezvous.protocol import bindings, flags, tracing
from rendezvous.protocol.bindings import PARAMS_KEY as BINDING_KEY

__all__ = ["ANY_MODEL", "LocalPrefill", "Route", "Router", "main", "parse_route", "rendezvous_config"]

logger = logging.getLogger(__name__)

ANY_MODEL = "*"
_LEG_HEADERS = {"Content-Type": "application/json"}
TRANSFER_ID_HEADER = "X-Transfer-Id"
"""Response header naming the transfer the router minted for a request (`kv-rendezvous transfers --timeline`)."""
PREFILL_HEADER = "X-Kv-Prefill"
"""Response header saying where the prompt was computed: `remote` (a prefill engine, KV pushed to decode),
`local-short` (on the decode engine: the prompt is below --local-prefill-below), `local-busy` (on the decode
engine: every prefill engine had --local-prefill-when-busy requests in flight) or `local-unreachable` (on the
decode engine: the rendezvous does not answer, --degraded-max-age)."""
REFUSAL_HEADER = "X-Kv-Refusal"
"""On a 503 for want of decode credit: why (`queue_full`, `queue_timeout`, `no_capacity`; on a 413, `too_large`;
rendezvous.connector.admission); `rendezvous_unavailable` on a 503 while the rendezvous does not answer."""
RENDEZVOUS_UNAVAILABLE = "rendezvous_unavailable"
"""X-Kv-Refusal of a 503 while the rendezvous does not answer (with Retry-After)."""
DEFAULT_RENDEZVOUS_TIMEOUT = 2.0
"""Seconds one rendezvous call of the router may take, retries included (`--rendezvous-timeout`)."""
DEFAULT_RETRY_AFTER = 1.0
"""Seconds between probes of an unreachable rendezvous, and the 503's Retry-After (`--rendezvous-retry-after`)."""
DEFAULT_DEGRADED_MAX_AGE = 60.0
"""How old an engine list may be for requests to go to its decode engines alone while the rendezvous does not
answer (`--degraded-max-age`)."""
DEFAULT_CONNECT_TIMEOUT = 5.0
"""Seconds the router waits for an engine to take a connection (`--connect-timeout`)."""
DEFAULT_MAX_BODY_BYTES = 1 << 20
"""The largest request body the router reads (`--max-body-bytes`); larger ones are answered 413."""
LOCAL_SHORT = "local-short"
LOCAL_BUSY = "local-busy"
LOCAL_UNREACHABLE = "local-unreachable"
_ENGINE_KEEPALIVE = 2.0
_NOT_CONNECTED = (ClientConnectorError, ConnectionTimeoutError)
"""An engine call that failed before anything was sent: its connection was refused, unreachable, or not taken within
the connect timeout (a host that went down drops the packets and refuses nothing). The request never reached the
engine."""


@dataclass(frozen=True)
class Route:
    """Where a model's requests go: its prefill pools and its decode pools."""

    prefill_pools: tuple[str, ...]
    decode_pools: tuple[str, ...]


@dataclass(frozen=True)
class LocalPrefill:
    """Conditional disaggregation: when the decode engine computes the prompt itself instead of a prefill engine.

    A prompt shorter than `below_tokens` (0: never) costs less to compute in place than to hand over (two HTTP
    legs, a claim, a WRITE); when every prefill engine of the route already has `when_busy` requests in flight
    from this router (0: never), prefill is the bottleneck and an idle decode engine does better to start now.
    """

    below_tokens: int = 0
    when_busy: int = 0

    def __post_init__(self) -> None:
        if self.below_tokens < 0 or self.when_busy < 0:
            raise ValueError("local prefill thresholds must not be negative")


def parse_route(text: str) -> tuple[str, Route]:
    """`MODEL:PREFILL_POOLS:DECODE_POOLS` (pools comma-separated; MODEL may itself contain ':')."""
    model, sep, pools = text.rpartition(":")
    model, sep2, prefill = model.rpartition(":")
    prefill_pools = tuple(p.strip() for p in prefill.split(",") if p.strip())
    decode_pools = tuple(p.strip() for p in pools.split(",") if p.strip())
    if not (sep and sep2 and model and prefill_pools and decode_pools):
        raise ValueError(f"route {text!r} is not MODEL:PREFILL_POOLS:DECODE_POOLS")
    return model, Route(prefill_pools, decode_pools)


def rendezvous_config(
    targets: Sequence[str], token: str | None = None, timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT
) -> ClientConfig:
    """The router's client configuration: every call gives up after `timeout` seconds, retries and failover
    included (the SDK's default retries UNAVAILABLE for 30 s, which a waiting client would pay per request)."""
    if timeout <= 0:
        raise ValueError(f"the rendezvous timeout must be positive, not {timeout:g}")
    retry = RetryPolicy(max_backoff=min(1.0, max(0.02, timeout / 4)), deadline=timeout)
    return ClientConfig(targets=tuple(targets), token=token, call_timeout=timeout, retry=retry)


def _engine_url(engine: EngineInfo) -> str:
    url = engine.labels.get("url", "")
    if not url:
        raise NotFound("", f"engine {engine.engine_id} has no 'url' label")
    return url.rstrip("/")


class Router:
    """The proxy's state: a rendezvous client, an HTTP client session, the routes to pick engines from."""

    def __init__(
        self,
        rendezvous: AsyncRendezvousClient,
        routes: Mapping[str, Route],
        *,
        policy: PickPolicy = PickPolicy.ROUND_ROBIN,
        refresh_interval: float = 1.0,
        timeout: float = 600.0,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        load_weight: float = 1.0,
        prompts: PromptReader | None = None,
        local_prefill: LocalPrefill | None = None,
        binding_key: bytes | None = None,
        binding_ttl: float = DEFAULT_BINDING_TTL,
        max_queued: int = 100,
        queue_timeout: float = 30.0,
        credit_ttl: float = 60.0,
        kv_index: bool = True,
        retry_after: float = DEFAULT_RETRY_AFTER,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        degraded_max_age: float = DEFAULT_DEGRADED_MAX_AGE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not routes:
            raise ValueError("the router needs at least one route")
        if max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, not {max_body_bytes}")
        self.max_body_bytes = max_body_bytes
        if retry_after <= 0:
            raise ValueError(f"retry_after must be positive, not {retry_after:g}")
        if connect_timeout <= 0:
            raise ValueError(f"connect_timeout must be positive, not {connect_timeout:g}")
        if degraded_max_age < 0:
            raise ValueError(f"degraded_max_age must not be negative, not {degraded_max_age:g}")
        self.rendezvous = rendezvous
        self.engines = RouterClient(
            rendezvous,
            refresh_interval=refresh_interval,
            policy=policy,
            load_weight=load_weight,
            binding_key=binding_key,
            binding_ttl=binding_ttl,
            clock=clock,  # what engine lists age by (degraded_max_age)
            on_refresh_error=self._refresh_failed,
        )
        self.routes = dict(routes)
        self.metrics = RouterMetrics()
        self.prompts = prompts or PromptReader()
        self.admission = DecodeAdmission(
            self.engines,
            self.metrics,
            max_queued=max_queued,
            queue_timeout=queue_timeout,
            credit_ttl=credit_ttl,
            retry_interval=refresh_interval,
            block_tokens=self.prompts.block_tokens,
        )
        self.local_prefill = local_prefill or LocalPrefill()
        self.index = PrefixView(self.engines, self.prompts, retry_interval=refresh_interval) if kv_index else None
        """Prefix-aware: the fleet's KV index (None: this router's memory only)."""
        # connect: getting a connection to an engine (resolving, connecting, TLS); the pool never waits (limit 0).
        self._timeout = ClientTimeout(total=timeout, connect=connect_timeout)
        self._http: ClientSession | None = None
        self._background: set[asyncio.Task[None]] = set()  # work after an answer (credit releases)
        self.retry_after = retry_after
        self.reachable = asyncio.Event()
        """Clear while the rendezvous is known not to answer (the circuit is open): requests go to decode engines
        alone, or are refused, at once; a probe runs."""
        self.reachable.set()
        self.degraded_max_age = degraded_max_age
        """While the circuit is open: how old an engine list may be to send requests to its decode engines alone
        (0: refuse them)."""
        self._refusing = False  # the circuit is open and no listed decode engine is left to take requests (logged)
        self._refused: set[str] = set()
        """While the circuit is open: the decode engines that took no connection, left out of degraded picks."""
        self._probe: asyncio.Task[None] | None = None

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        # Engines (uvicorn) close idle connections after 5 s; reusing one they are closing resets the request.
        # No pool limit of its own (aiohttp's is 100 connections): credits and the queue bound what goes out.
        connector = TCPConnector(limit=0, keepalive_timeout=_ENGINE_KEEPALIVE)
        self._http = ClientSession(timeout=self._timeout, connector=connector)

    async def _close(self, app: web.Application) -> None:
        if self._background:  # credits given back before the client to the rendezvous closes
            await asyncio.wait(self._background)
        await self.admission.close()  # releases still retried while the rendezvous was unreachable
        await self.engines.stop_refreshing()  # no background ListEngines outlives its channel, or opens a probe
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
        await self.rendezvous.close()

    @property
    def http(self) -> ClientSession:
        assert self._http is not None, "the router is not started"
        return self._http

    def route(self, model: str) -> Route | None:
        """The route for a model: its own, else the `*` route, else None."""
        return self.routes.get(model) or self.routes.get(ANY_MODEL)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics_page(self, request: web.Request) -> web.Response:
        """Prometheus text: queued requests, queue waits, refusals by reason, pools' capacity and free credit."""
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        """The union of what one decode engine of each route serves."""
        models: dict[str, Any] = {}
        for route in {*self.routes.values()}:
            try:
                decode = await self.engines.pick_engine(route.decode_pools, EngineRole.CONSUMER)
                async with self.http.get(f"{_engine_url(decode)}/v1/models") as response:
                    listed = await response.json() if response.status == 200 else {}
            except (RendezvousError, ClientError, OSError, TimeoutError, ValueError) as e:
                logger.warning("no models from pools %s: %s", ",".join(route.decode_pools), e)
                continue
            data = listed.get("data") if isinstance(listed, dict) else None  # an engine's answer: check its shape
            if not isinstance(data, list):
                logger.warning("pools %s listed no models: %.200r", ",".join(route.decode_pools), listed)
                continue
            models.update({m["id"]: m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)})
        return web.json_response({"object": "list", "data": list(models.values())})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "/v1/completions", ("max_tokens",))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "/v1/chat/completions", ("max_tokens", "max_completion_tokens"))

    async def _proxy(self, request: web.Request, path: str, limit_keys: Sequence[str]) -> web.StreamResponse:
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the request body is over {self.max_body_bytes} bytes (--max-body-bytes)")
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            return _error(400, "the request body must be JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        if not isinstance(body.get("kv_transfer_params") or {}, dict):
            return _error(400, "kv_transfer_params must be a JSON object")
        model = body.get("model")
        route = self.route(model) if isinstance(model, str) else None
        if route is None:
            return _error(404, f"model {model!r} is not routed by this router")
        with tracing.span("router.dispatch", parent=request.headers, kind="server") as span:
            if not self.reachable.is_set():  # known down: no call would do better, and the probe is on it
                return await self._degraded(request, path, body, route, span, "the rendezvous is not answering")
            return await self._dispatch(request, path, limit_keys, body, route, span)

    async def _dispatch(
        self,
        request: web.Request,
        path: str,
        limit_keys: Sequence[str],
        body: dict[str, Any],
        route: Route,
        span: tracing.Span,
    ) -> web.StreamResponse:
        engines = self.engines
        prefix_aware = engines.policy is PickPolicy.PREFIX_AWARE
        prefix = self.prompts.block_hashes(body) if prefix_aware else []
        indexed = None
        if prefix_aware and self.index is not None:
            indexed = await self.index.lookup(body, (*route.prefill_pools, *route.decode_pools))
        if prefix_aware:
            source = "index" if indexed is not None else "memory"
            span.set_attribute("kv_rendezvous.prefix_source", source)
            self.metrics.placements.labels(source).inc()
        transfer_id = self.engines.mint_transfer_id()
        tokens = self.prompts.tokens(body)  # credit is counted in the decode engine's blocks (admission.py)
        try:
            admission = await self.admission.admit(route.decode_pools, transfer_id, tokens, prefix, indexed)
        except Refused as e:
            span.set_attribute("kv_rendezvous.refused", e.reason)
            status = 413 if e.reason == TOO_LARGE else 503  # too large: no wait would help
            return _error(status, f"no decode credit ({e.reason}): {e}", headers={REFUSAL_HEADER: e.reason})
        except RendezvousError as e:
            return await self._no_engines(e, request, path, body, route, span)
        try:
            return await self._admitted(request, path, limit_keys, body, route, span, admission, prefix, indexed)
        finally:
            # However the request ended (answered, failed, the client gone): its decode credit goes back, after
            # the answer (a slow or unreachable rendezvous must not hold it; the credit's TTL bounds a failure).
            self._in_background(self.admission.release(admission))

    async def _admitted(
        self,
        request: web.Request,
        path: str,
        limit_keys: Sequence[str],
        body: dict[str, Any],
        route: Route,
        span: tracing.Span,
        admission: Admission,
        prefix: Sequence[int],
        indexed: IndexedPrefix | None,
    ) -> web.StreamResponse:
        """The request, once a decode engine admitted it (with credit reserved on it)."""
        engines = self.engines
        decode, transfer_id = admission.engine, admission.transfer_id
        try:
            decode_url = _engine_url(decode)
            local = await self._prefill_locally(body, route, decode, indexed)
            if local:
                self._alone(span, local)
                return await self._local(request, decode, decode_url + path, body, prefix, indexed, local)
            prefill = await engines.pick_engine(
                route.prefill_pools, EngineRole.PRODUCER, layout=decode.layout, prefix=prefix, indexed=indexed
            )
            prefill_url = _engine_url(prefill)
        except RendezvousError as e:
            return await self._no_engines(e, request, path, body, route, span)
        span.set_attribute("kv_rendezvous.prefill", "remote")
        span.set_attribute("kv_rendezvous.transfer_id", transfer_id)
        # Both legs' engines make their spans children of this one (the connector reads kv_transfer_params).
        params = {**(body.get("kv_transfer_params") or {}), TRANSFER_ID_KEY: transfer_id, **tracing.carrier()}
        # A binding the client sent is never passed on: the router's own replaces it, or none goes.
        params.pop(BINDING_KEY, None)
        binding = self.engines.bind(transfer_id, prefill, decode)
        if binding is not None:
            params[BINDING_KEY] = binding.to_params()
        decode_body = {**body, "kv_transfer_params": params}
        prefill_body = {**body, "kv_transfer_params": params, "stream": False}
        prefill_body.pop("stream_options", None)
        for key in limit_keys:
            prefill_body[key] = 1
        prefill_leg = asyncio.create_task(
            self._prefill(prefill, prefill_url + path, prefill_body, transfer_id, prefix, indexed)
        )
        answer = _Answer()
        try:
            with self.engines.in_flight(decode, prefix, indexed):
                return await self._decode(request, decode, decode_url + path, decode_body, transfer_id, answer)
        except asyncio.CancelledError:
            # The client went away. Before decode answered, let both engines go at once. After, decode had the
            # KV (its first token needs it): the transfer was delivered, and decode drops the request when its
            # leg is closed, so an abort would only end a delivered transfer ABORTED.
            if not answer.started:
                await asyncio.shield(self._abort(transfer_id, "the client went away"))
            raise
        finally:
            if not prefill_leg.done():
                # The client is answered; let prefill finish in the background (its blocks are freed by then).
                prefill_leg.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _no_engines(
        self,
        error: RendezvousError,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        route: Route,
        span: tracing.Span,
    ) -> web.StreamResponse:
        """A request that found no engine: 503; if the rendezvous did not answer, the circuit opens and the request
        goes to a decode engine alone (`_degraded`)."""
        if not unanswered(error):
            return _error(503, f"no engines: {error}")
        self._open_circuit(error)
        return await self._degraded(request, path, body, route, span, f"the rendezvous is not answering: {error}")

    def _refresh_failed(self, error: BaseException) -> None:
        """A background refresh of an engine list failed: if the rendezvous did not answer it, the circuit opens
        now, before a request goes out disaggregated to engines that cannot reach it either."""
        if isinstance(error, RendezvousError) and unanswered(error):
            self._open_circuit(error)

    def _open_circuit(self, error: RendezvousError) -> None:
        """The rendezvous did not answer a call (`error`): unless the circuit is open already, open it (one warning),
        and probe until the rendezvous answers again."""
        if not self.reachable.is_set():
            return
        if self.degraded_max_age:
            logger.warning(
                "the rendezvous is not answering (%s): sending requests to decode engines alone, from engine "
                "lists at most %g s old (--degraded-max-age), until it does",
                error,
                self.degraded_max_age,
            )
        else:
            logger.warning("the rendezvous is not answering (%s): refusing requests until it does", error)
        self.reachable.clear()
        self.metrics.unreachable.set(1)
        self._probe = asyncio.ensure_future(self._probe_until_reachable())

    async def _degraded(
        self, request: web.Request, path: str, body: dict[str, Any], route: Route, span: tracing.Span, why: str
    ) -> web.StreamResponse:
        """While the rendezvous does not answer: the request to the least loaded decode engine of the route in
        the router's last engine lists, if they are at most degraded_max_age old, which computes the prompt itself
        (no transfer, no call); else the 503 saying `why`. An engine that does not take the connection (refused, or
        not taken within the connect timeout: the request never reached it) is left out until the circuit closes,
        and the request goes to the next; it is counted once it reached one, however many it tried."""
        if not self.degraded_max_age:
            return self._unreachable(why)
        while True:
            try:
                engine = self.engines.rank_listed(
                    route.decode_pools, EngineRole.CONSUMER, self.degraded_max_age, self._refused
                )[0]
                url = _engine_url(engine)
            except NotFound as e:
                if not self._refusing:
                    logger.warning("%s: refusing requests until the rendezvous answers", e)
                    self._refusing = True
                return self._unreachable(f"{why}, and {e}")
            reached = True
            try:
                return await self._local(
                    request, engine, url + path, body, (), None, LOCAL_UNREACHABLE, refused=_NOT_CONNECTED
                )
            except _NOT_CONNECTED as e:
                reached = False
                if engine.engine_id not in self._refused:  # another request may have found it first
                    logger.warning(
                        "decode engine %s took no connection (%s): leaving it out until the rendezvous answers",
                        engine.engine_id,
                        e,
                    )
                    self._refused.add(engine.engine_id)
            finally:
                if reached:
                    self._alone(span, LOCAL_UNREACHABLE)

    def _unreachable(self, message: str) -> web.Response:
        self.metrics.refusals.labels(RENDEZVOUS_UNAVAILABLE).inc()
        headers = {REFUSAL_HEADER: RENDEZVOUS_UNAVAILABLE, "Retry-After": str(math.ceil(self.retry_after))}
        return _error(503, message, headers=headers)

    async def _probe_until_reachable(self) -> None:
        """Ask the rendezvous for its status every retry_after seconds until it answers; then close the circuit."""
        while True:
            await asyncio.sleep(self.retry_after)
            try:
                await self.rendezvous.get_status()
            except RendezvousError as e:
                logger.debug("the rendezvous is still not answering: %s", e)
                continue
            logger.warning("the rendezvous answers again: disaggregating requests again")
            self.engines.invalidate()
            self.reachable.set()
            self.metrics.unreachable.set(0)
            self._refusing = False
            self._refused.clear()
            return

    async def _prefill_locally(
        self, body: Mapping[str, Any], route: Route, decode: EngineInfo, indexed: IndexedPrefix | None
    ) -> str:
        """Why the decode engine should compute this request's prompt itself, or "" (disaggregate). The tokens
        to compute are the prompt's, less those the KV index says the decode engine holds already."""
        rule = self.local_prefill
        if rule.below_tokens and self._uncached_tokens(body, decode, indexed) < rule.below_tokens:
            return LOCAL_SHORT
        if rule.when_busy:
            lightest = await self.engines.lightest_load(route.prefill_pools, EngineRole.PRODUCER)
            if lightest >= rule.when_busy:
                return LOCAL_BUSY
        return ""

    def _uncached_tokens(self, body: Mapping[str, Any], decode: EngineInfo, indexed: IndexedPrefix | None) -> int:
        tokens = self.prompts.tokens(body)
        if indexed is None:
            return tokens
        return max(0, tokens - indexed.matched.get(decode.engine_id, 0) * indexed.block_size)

    def _alone(self, span: tracing.Span, why: str) -> None:
        """A request goes to a decode engine alone, `why`: counted once, whichever engines it is then sent to."""
        span.set_attribute("kv_rendezvous.prefill", why)
        self.metrics.local_prefills.labels(why).inc()

    async def _local(
        self,
        request: web.Request,
        engine: EngineInfo,
        url: str,
        body: dict[str, Any],
        prefix: Sequence[int],
        indexed: IndexedPrefix | None,
        why: str,
        *,
        refused: type[Exception] | tuple[type[Exception], ...] = (),
    ) -> web.StreamResponse:
        """The whole request to the decode engine, which computes the prompt itself (no transfer: a transfer id or
        binding the client sent is not passed on, or the engine would wait for KV no prefill engine sends). An
        error of type `refused` is raised, not answered 502, for the caller to send the request elsewhere; the
        caller counts the request (`_alone`)."""
        named = {PREFILL_HEADER: why}
        try:
            with self.engines.in_flight(engine, prefix, indexed), _leg_span("router.decode", engine, "") as headers:
                return await self._relay(request, url, _without_transfer(body), headers, named)
        except refused:
            raise
        except _StreamCut as cut:
            self.engines.invalidate()
            return cut.response
        except (ClientError, OSError, TimeoutError) as e:
            self.engines.invalidate()
            return _error(502, f"decode engine failed: {e}")

    async def _prefill(
        self,
        engine: EngineInfo,
        url: str,
        body: dict[str, Any],
        transfer_id: str,
        prefix: Sequence[int],
        indexed: IndexedPrefix | None,
    ) -> None:
        with (
            self.engines.in_flight(engine, prefix, indexed),
            _leg_span("router.prefill", engine, transfer_id) as headers,
        ):
            try:
                async with self.http.post(url, json=body, headers=headers) as response:
                    await response.read()
                    if response.status == 200:
                        return
                    logger.warning("prefill leg of %s answered %d", transfer_id, response.status)
            except Exception as e:
                logger.warning("prefill leg of %s failed: %s", transfer_id, e)
        self.engines.invalidate()
        await self._abort(transfer_id, "the prefill leg failed")

    async def _decode(
        self,
        request: web.Request,
        engine: EngineInfo,
        url: str,
        body: dict[str, Any],
        transfer_id: str,
        answer: _Answer,
    ) -> web.StreamResponse:
        named = {TRANSFER_ID_HEADER: transfer_id, PREFILL_HEADER: "remote"}
        try:
            with _leg_span("router.decode", engine, transfer_id) as headers:
                response = await self._relay(request, url, body, headers, named, answer)
        except _StreamCut as cut:  # decode had the KV (it was answering): the transfer was delivered
            self.engines.invalidate()
            return cut.response
        except (ClientError, OSError, TimeoutError) as e:
            self.engines.invalidate()
            await self._abort(transfer_id, "the decode leg failed")
            return _error(502, f"decode engine failed: {e}")
        if response.status != 200:
            await self._abort(transfer_id, "the decode leg failed")
        return response

    async def _relay(
        self,
        request: web.Request,
        url: str,
        body: dict[str, Any],
        headers: Mapping[str, str],
        named: dict[str, str],
        answer: _Answer | None = None,
    ) -> web.StreamResponse:
        """POST body to url and relay the answer (streamed or not), with the `named` response headers;
        `answer.started` is set once the engine's answer has begun (a whole 200 body, or a first chunk)."""
        async with self.http.post(url, json=body, headers=headers) as response:
            if response.status != 200 or not body.get("stream"):
                payload = await response.read()
                if answer is not None and response.status == 200:
                    answer.started = True
                return web.Response(
                    status=response.status, body=payload, content_type="application/json", headers=named
                )
            out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", **named})
            await out.prepare(request)
            try:
                async for chunk in response.content.iter_any():
                    if answer is not None:
                        answer.started = True
                    await _write(out, chunk)
                await _write(out, None)
            except _ClientGone:  # the client hung up (as it does once it has `[DONE]`): not the engine's failure
                pass
            except (ClientError, OSError, TimeoutError) as e:
                # The engine's stream broke after the answer began: the client must see it cut, not complete
                # (and not wait for more): its connection is closed without the stream's end.
                if request.transport is not None:
                    request.transport.abort()
                raise _StreamCut(out) from e
            return out

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` after the answer, kept until it is done (and awaited at close)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, transfer_id: str, message: str) -> None:
        with contextlib.suppress(RendezvousError):  # ended already: nothing to abort
            await self.engines.abort_transfer(transfer_id, message)


class _ClientGone(Exception):
    """Writing to the client failed: it went away."""


class _StreamCut(Exception):
    """The engine's streamed answer broke after it began; the client's stream (`response`) was cut."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("the engine's stream broke")
        self.response = response


async def _write(out: web.StreamResponse, chunk: bytes | None) -> None:
    """Write a chunk (None: the end) of the answer to the client; raise _ClientGone if it went away."""
    try:
        await (out.write(chunk) if chunk is not None else out.write_eof())
    except ConnectionResetError as e:  # aiohttp's ClientConnectionResetError: the transport is closing
        raise _ClientGone from e


@dataclass
class _Answer:
    """Whether an engine's answer to a leg has begun."""

    started: bool = False


@contextlib.contextmanager
def _leg_span(name: str, engine: EngineInfo, transfer_id: str) -> Iterator[Mapping[str, str]]:
    """The span of one leg; yields the leg's HTTP headers, which carry it (vLLM's own tracing may join)."""
    with tracing.span(name, tracing.about(transfer_id=transfer_id, engine_id=engine.engine_id), kind="client"):
        yield {**_LEG_HEADERS, **tracing.carrier()}


def _without_transfer(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request for a decode engine alone: its `kv_transfer_params` without a transfer id or binding (left out
    when nothing else remains)."""
    params = {
        k: v for k, v in (body.get("kv_transfer_params") or {}).items() if k not in (TRANSFER_ID_KEY, BINDING_KEY)
    }
    local = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params:
        local["kv_transfer_params"] = params
    return local


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "router_error", "code": status}}, status=status, headers=headers
    )


class _DeprecatedAddressFlag(argparse.Action):
    """`--rendezvous`, the router's name for `--address` before every command said `--address`: still accepted,
    with a warning, until the release. (Conformance keeps its own for `--target`: it speaks only the wire.)"""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        print(f"kv-rendezvous router: {option_string} is deprecated, use --address", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _route_arg(text: str) -> tuple[str, Route]:
    try:
        return parse_route(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")
"""gRPC target URIs `--address` takes besides host:port (a port alone is not a scheme)."""


def _targets(text: str) -> str:
    """`--address`: comma-separated rendezvous targets, each host:port (port 1..65535) or a gRPC target URI."""
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    if not targets:
        raise argparse.ArgumentTypeError(f"no address in {text!r}")
    for target in targets:
        if target.startswith(_SCHEMES):
            continue
        _, colon, port = target.rpartition(":")
        if not colon or not port.isdigit() or not 0 < int(port) <= 65_535:
            raise argparse.ArgumentTypeError(f"{target!r} is not host:port with a port in 1..65535")
    return text


def _pool(text: str) -> str:
    """A pool's name: not empty (an empty pool would route to every pool's engines)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"not a pool name: {text!r}")
    return text.strip()


BINDING_KEY_FILE_ENV = "KV_RENDEZVOUS_BINDING_KEY_FILE"


class _DefaultsHelp(argparse.HelpFormatter):
    """`--help` names each flag's default, as `serve --help` does; a flag without one (or an on/off one) says none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if text and action.default not in (None, [], argparse.SUPPRESS) and not isinstance(action.default, bool):
            text += " (default %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = flags.Parser(
        prog="kv-rendezvous router", description=__doc__.splitlines()[0], formatter_class=_DefaultsHelp
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:8000",
        type=flags.host_port,
        help="host:port to serve on; port 0..65535 (0: any free port)",
    )
    parser.add_argument(
        "--address",
        type=_targets,
        metavar="HOST:PORT[,HOST:PORT]",
        help="rendezvous server address(es), comma-separated (required)",
    )
    parser.add_argument(
        "--rendezvous", dest="address", type=_targets, action=_DeprecatedAddressFlag, help=argparse.SUPPRESS
    )
    parser.add_argument("--token", default=None, help="bearer token for the rendezvous")
    parser.add_argument(
        "--route",
        action="append",
        type=_route_arg,
        default=[],
        metavar="MODEL:PREFILL_POOLS:DECODE_POOLS",
        help="send MODEL's requests to these pools (comma-separated); MODEL '*' matches any model; repeatable",
    )
    parser.add_argument(
        "--prefill-pool", type=_pool, default="prefill", help="the '*' route's prefill pool without --route"
    )
    parser.add_argument(
        "--decode-pool", type=_pool, default="decode", help="the '*' route's decode pool without --route"
    )
    parser.add_argument(
        "--policy",
        choices=[p.value for p in PickPolicy],
        default=PickPolicy.ROUND_ROBIN.value,
        help="how engines are picked among a route's live engines",
    )
    parser.add_argument(
        "--load-weight",
        type=flags.seconds(what="weight"),
        default=1.0,
        help="prefix-aware: what one request in flight weighs, in whole prompts of uncached blocks; >= 0",
    )
    parser.add_argument(
        "--no-kv-index",
        dest="kv_index",
        action="store_false",
        help="prefix-aware: place by this router's memory only, never by the fleet's KV index",
    )
    parser.add_argument(
        "--prefix-block", type=flags.count(1), default=16, help="tokens per KV block, for prompt block hashes; >= 1"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="Hugging Face tokenizer (path or name) to count prompt tokens exactly; default: estimate",
    )
    parser.add_argument(
        "--local-prefill-below",
        type=flags.count(0),
        default=0,
        metavar="TOKENS",
        help="send prompts shorter than this to a decode engine alone (no transfer); 0: never; >= 0",
    )
    parser.add_argument(
        "--local-prefill-when-busy",
        type=flags.count(0),
        default=0,
        metavar="N",
        help="prefill on the decode engine when every prefill engine has N requests in flight; 0: never; >= 0",
    )
    parser.add_argument(
        "--refresh-interval",
        type=flags.seconds(),
        default=1.0,
        help="seconds engine lists are cached (0: every request lists the engines); >= 0",
    )
    parser.add_argument(
        "--timeout", type=flags.seconds(positive=True), default=600.0, help="seconds per engine request; > 0"
    )
    parser.add_argument(
        "--connect-timeout",
        type=flags.seconds(positive=True),
        default=DEFAULT_CONNECT_TIMEOUT,
        metavar="SECONDS",
        help="how long an engine may take to accept a connection; one that does not fails its leg as a refused "
        "connection does; > 0",
    )
    parser.add_argument(
        "--binding-key-file",
        default=None,
        help="sign each transfer to the engines picked for it with this file's first key (the rendezvous's "
        f"--binding-key-file; env {BINDING_KEY_FILE_ENV})",
    )
    parser.add_argument(
        "--max-queued",
        type=flags.count(0),
        default=100,
        metavar="N",
        help="requests that may wait for decode credit at once (more are answered 503 queue_full); 0: none wait; >= 0",
    )
    parser.add_argument(
        "--queue-timeout",
        type=flags.seconds(),
        default=30.0,
        metavar="SECONDS",
        help="how long a request waits for decode credit before it is answered 503 queue_timeout; >= 0",
    )
    parser.add_argument(
        "--credit-ttl",
        type=flags.seconds(positive=True),
        default=60.0,
        metavar="SECONDS",
        help="how long a decode credit reservation lasts unless the engine registers the target or the request "
        "ends; > 0",
    )
    parser.add_argument(
        "--rendezvous-timeout",
        type=flags.seconds(positive=True),
        default=DEFAULT_RENDEZVOUS_TIMEOUT,
        metavar="SECONDS",
        help="how long one rendezvous call may take, retries included; past it the rendezvous counts as not "
        "answering (--degraded-max-age); > 0",
    )
    parser.add_argument(
        "--rendezvous-retry-after",
        type=flags.seconds(positive=True),
        default=DEFAULT_RETRY_AFTER,
        metavar="SECONDS",
        help="while the rendezvous does not answer: it is probed this often, and requests that no decode engine "
        "can take alone (--degraded-max-age) get 503 with this Retry-After at once; > 0",
    )
    parser.add_argument(
        "--degraded-max-age",
        type=flags.seconds(),
        default=DEFAULT_DEGRADED_MAX_AGE,
        metavar="SECONDS",
        help="while the rendezvous does not answer: requests go to a decode engine alone (it computes the prompt) "
        "from an engine list at most this old; 0: they get 503; >= 0",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=flags.count(1),
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help="the largest request body the router reads; larger ones are answered 413; >= 1",
    )
    parser.add_argument(
        "--binding-ttl",
        type=flags.seconds(positive=True),
        default=DEFAULT_BINDING_TTL,
        help="seconds a binding admits the engines it names; > 0",
    )
    return parser


def _tokenizer(name: str) -> Tokenizer:
    from transformers import AutoTokenizer  # installed with vLLM

    tokenizer: Tokenizer = AutoTokenizer.from_pretrained(name)
    return tokenizer


def _listening(address: tuple[str, int]) -> socket.socket:
    """A socket listening on --listen's (host, port), bound before the application starts so that an address in
    use or not local is refused naming the flag; OSError if it cannot be bound."""
    host, port = address
    family, kind, proto, _, where = socket.getaddrinfo(
        host or "127.0.0.1", port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's own sites do
        sock.bind(where)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `kv-rendezvous router`: a flag out of its range, a file that cannot be read or an address
    that cannot be listened on is one line naming the flag, exit 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.address:
        parser.error("the following arguments are required: --address")
    routes = dict(args.route) or {ANY_MODEL: Route((args.prefill_pool,), (args.decode_pool,))}
    if len(routes) != len(args.route) and args.route:
        parser.error("a model is routed twice")
    if (enable := os.environ.get(tracing.ENABLE_ENV)) is not None:
        try:
            flags.boolean(enable)
        except argparse.ArgumentTypeError as err:
            parser.error(f"{tracing.ENABLE_ENV}={enable!r}: {err}")
    key_file, key_source = args.binding_key_file, "--binding-key-file"
    if key_file is None and os.environ.get(BINDING_KEY_FILE_ENV):
        key_file, key_source = os.environ[BINDING_KEY_FILE_ENV], f"{BINDING_KEY_FILE_ENV} (--binding-key-file)"
    try:
        binding_key = bindings.load_keys(key_file)[0] if key_file else None
    except (OSError, ValueError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        reason = reason.removeprefix(f"binding key file {key_file}: ")
        parser.error(f"{key_source} {key_file}: {reason}")
    try:
        tokenizer = _tokenizer(args.tokenizer) if args.tokenizer else None
    except (OSError, ValueError, ImportError) as err:
        parser.error(f"--tokenizer {args.tokenizer}: {(str(err) or type(err).__name__).splitlines()[0]}")
    try:
        sock = _listening(args.listen)
    except OSError as err:
        host, port = args.listen
        listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        parser.error(f"--listen {listen}: {err.strerror or err}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tracing.configure_from_env("kv-rendezvous-router")
    targets = [t.strip() for t in args.address.split(",") if t.strip()]

    async def app() -> web.Application:
        client = AsyncRendezvousClient(rendezvous_config(targets, args.token, args.rendezvous_timeout))
        router = Router(
            client,
            routes,
            policy=PickPolicy(args.policy),
            refresh_interval=args.refresh_interval,
            timeout=args.timeout,
            connect_timeout=args.connect_timeout,
            load_weight=args.load_weight,
            prompts=PromptReader(args.prefix_block, tokenizer),
            local_prefill=LocalPrefill(args.local_prefill_below, args.local_prefill_when_busy),
            binding_key=binding_key,
            binding_ttl=args.binding_ttl,
            max_queued=args.max_queued,
            queue_timeout=args.queue_timeout,
            credit_ttl=args.credit_ttl,
            kv_index=args.kv_index,
            retry_after=args.rendezvous_retry_after,
            max_body_bytes=args.max_body_bytes,
            degraded_max_age=args.degraded_max_age,
        )
        return router.app()

    host, port = sock.getsockname()[:2]
    banner = (
        f"kv-rendezvous router serving on http://{f'[{host}]' if ':' in host else host}:{port}"
        f" (rendezvous {', '.join(targets)})"
    )

    def serving(_: str) -> None:
        """Called once the app serves, instead of aiohttp's own lines: `--listen` port 0 is named here."""
        print(banner, flush=True)

    # handler_cancellation: a client that goes away cancels its request, which aborts the transfer.
    web.run_app(app(), sock=sock, print=serving, handler_cancellation=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
