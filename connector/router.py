"""`kv-rendezvous router`: a reference OpenAI-compatible proxy for disaggregated vLLM engines.

    python -m connector.router --listen 127.0.0.1:8000 --rendezvous 127.0.0.1:50051 \
        --prefill-pool prefill --decode-pool decode

Per request (`POST /v1/completions`, `POST /v1/chat/completions`) it mints a fresh transfer id, picks a
prefill and a decode engine from the rendezvous (round-robin over the live engines of each pool; an engine's
OpenAI base URL is its `url` label), and sends both legs at once with `kv_transfer_params = {"transfer_id"}`:
prefill with max_tokens=1, decode with the client's request, whose answer (streamed or not) goes back to the
client. If one leg fails, the transfer is aborted so the other side lets go of its blocks at once.
`GET /health` answers 200; `GET /v1/models` is forwarded to a decode engine.

Needs aiohttp (installed with vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, web

from clients import (
    AsyncRendezvousClient,
    ClientConfig,
    EngineInfo,
    EngineRole,
    NotFound,
    RendezvousError,
    RouterClient,
)
from connector.config import TRANSFER_ID_KEY

__all__ = ["Router", "main"]

logger = logging.getLogger(__name__)

_LEG_HEADERS = {"Content-Type": "application/json"}


def _engine_url(engine: EngineInfo) -> str:
    url = engine.labels.get("url", "")
    if not url:
        raise NotFound(f"engine {engine.engine_id} has no 'url' label")
    return url.rstrip("/")


class Router:
    """The proxy's state: a rendezvous client, an HTTP client session, the pools to pick from."""

    def __init__(
        self,
        rendezvous: AsyncRendezvousClient,
        *,
        prefill_pool: str = "prefill",
        decode_pool: str = "decode",
        refresh_interval: float = 1.0,
        timeout: float = 600.0,
    ) -> None:
        self.rendezvous = rendezvous
        self.engines = RouterClient(rendezvous, refresh_interval=refresh_interval)
        self.prefill_pool = prefill_pool
        self.decode_pool = decode_pool
        self._timeout = ClientTimeout(total=timeout)
        self._http: ClientSession | None = None

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, app: web.Application) -> None:
        self._http = ClientSession(timeout=self._timeout)

    async def _close(self, app: web.Application) -> None:
        if self._http is not None:
            await self._http.close()
        await self.rendezvous.close()

    @property
    def http(self) -> ClientSession:
        assert self._http is not None, "the router is not started"
        return self._http

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        try:
            decode = await self.engines.pick_engine(self.decode_pool, EngineRole.CONSUMER)
        except RendezvousError as e:
            return _error(503, str(e))
        async with self.http.get(f"{_engine_url(decode)}/v1/models") as response:
            return web.Response(status=response.status, body=await response.read(), content_type="application/json")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "/v1/completions", ("max_tokens",))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "/v1/chat/completions", ("max_tokens", "max_completion_tokens"))

    async def _proxy(self, request: web.Request, path: str, limit_keys: Sequence[str]) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body must be JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        try:
            prefill, decode = await self.engines.pick_pair(self.prefill_pool, self.decode_pool)
            prefill_url, decode_url = _engine_url(prefill), _engine_url(decode)
        except RendezvousError as e:
            return _error(503, f"no engines: {e}")
        transfer_id = self.engines.mint_transfer_id()
        params = {**(body.get("kv_transfer_params") or {}), TRANSFER_ID_KEY: transfer_id}
        decode_body = {**body, "kv_transfer_params": params}
        prefill_body = {**body, "kv_transfer_params": params, "stream": False}
        prefill_body.pop("stream_options", None)
        for key in limit_keys:
            prefill_body[key] = 1
        prefill_leg = asyncio.create_task(self._prefill(prefill_url + path, prefill_body, transfer_id))
        try:
            return await self._decode(request, decode_url + path, decode_body, transfer_id)
        finally:
            if not prefill_leg.done():
                # The client is answered; let prefill finish in the background (its blocks are freed by then).
                prefill_leg.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _prefill(self, url: str, body: dict[str, Any], transfer_id: str) -> None:
        try:
            async with self.http.post(url, json=body, headers=_LEG_HEADERS) as response:
                await response.read()
                if response.status == 200:
                    return
                logger.warning("prefill leg of %s answered %d", transfer_id, response.status)
        except Exception as e:
            logger.warning("prefill leg of %s failed: %s", transfer_id, e)
        self.engines.invalidate()
        await self._abort(transfer_id, "the prefill leg failed")

    async def _decode(
        self, request: web.Request, url: str, body: dict[str, Any], transfer_id: str
    ) -> web.StreamResponse:
        try:
            async with self.http.post(url, json=body, headers=_LEG_HEADERS) as response:
                if response.status != 200 or not body.get("stream"):
                    payload = await response.read()
                    if response.status != 200:
                        await self._abort(transfer_id, "the decode leg failed")
                    return web.Response(status=response.status, body=payload, content_type="application/json")
                out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                async for chunk in response.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (ClientError, OSError, TimeoutError) as e:
            self.engines.invalidate()
            await self._abort(transfer_id, "the decode leg failed")
            return _error(502, f"decode engine failed: {e}")

    async def _abort(self, transfer_id: str, message: str) -> None:
        with contextlib.suppress(RendezvousError):  # ended already: nothing to abort
            await self.engines.abort_transfer(transfer_id, message)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "router_error", "code": status}}, status=status)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kv-rendezvous router", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:8000", help="host:port to serve on")
    parser.add_argument("--rendezvous", required=True, help="rendezvous endpoint(s), comma-separated host:port")
    parser.add_argument("--token", default=None, help="bearer token for the rendezvous")
    parser.add_argument("--prefill-pool", default="prefill")
    parser.add_argument("--decode-pool", default="decode")
    parser.add_argument("--refresh-interval", type=float, default=1.0, help="seconds engine lists are cached")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per engine request")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, _, port = args.listen.rpartition(":")
    targets = [t.strip() for t in args.rendezvous.split(",") if t.strip()]

    async def app() -> web.Application:
        client = AsyncRendezvousClient(ClientConfig(targets=targets, token=args.token))
        router = Router(
            client,
            prefill_pool=args.prefill_pool,
            decode_pool=args.decode_pool,
            refresh_interval=args.refresh_interval,
            timeout=args.timeout,
        )
        return router.app()

    web.run_app(app(), host=host or "127.0.0.1", port=int(port), print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
