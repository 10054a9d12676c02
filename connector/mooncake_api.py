"""Mooncake Conductor's indexer query API over the rendezvous's KV index, for routers written against it.

    python -m rendezvous.connector.mooncake_api --listen 127.0.0.1:9000 --address 127.0.0.1:50051

`POST /query {token_ids, block_size, instance_id?, tenant_id?}` computes the prompt's chain as the engines do
(rendezvous.connector.block_hashes, with the hashing the engines announced) and `POST /query_by_hash {seq_hashes,
block_size, instance_id?, tenant_id?}` takes it as given (64-bit integers: the engines' own hashes, vLLM's with
integer KV-event hashes, not Conductor's XXH3 ones); both ask MatchPrefixes once and answer in Conductor's shape,
`{tenant_id: {instance_id: {"longest_matched": tokens, "GPU": tokens, "DP": {"0": tokens}}}}`, an instance being
an indexed engine (one medium, the engine's own cache; one DP rank per engine). A LoRA adapter or a cache salt
changes vLLM's hashes in ways this service does not compute: such a query is refused (400), as is a block size no
indexed engine uses. `/register` and `/unregister` answer 501: engines feed the index themselves (the connector's
`kv_index`). docs/vllm.md, "From Mooncake's indexer and Dynamo's KV events", has the whole mapping.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from rendezvous.clients import (
    AsyncRendezvousClient,
    BlockHashing,
    ClientConfig,
    InvalidArgument,
    PrefixQuery,
    RendezvousError,
    hash_of,
)
from rendezvous.connector.block_hashes import chain, computable

__all__ = ["MooncakeApi", "main"]

_ANY_CHAIN = (b"\0",)
_INT64 = (1 << 64) - 1


class _BadQuery(Exception):
    """A query this service refuses (400)."""


class MooncakeApi:
    """The HTTP application: Conductor's /query and /query_by_hash, answered from the KV index."""

    def __init__(self, client: AsyncRendezvousClient) -> None:
        self.client = client

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/query", self.query)
        app.router.add_post("/query_by_hash", self.query_by_hash)
        app.router.add_post("/register", self.not_here)
        app.router.add_post("/unregister", self.not_here)
        return app

    async def not_here(self, request: web.Request) -> web.Response:
        return _error(501, "engines feed the rendezvous's KV index themselves (kv_connector_extra_config kv_index)")

    async def query(self, request: web.Request) -> web.Response:
        return await self._answer(request, by_hash=False)

    async def query_by_hash(self, request: web.Request) -> web.Response:
        return await self._answer(request, by_hash=True)

    async def _answer(self, request: web.Request, *, by_hash: bool) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise _BadQuery("the request body must be a JSON object")
            block_size = _positive_int(body, "block_size")
            if body.get("lora_name") or body.get("lora_id") or body.get("cache_salt"):
                raise _BadQuery("LoRA adapters and cache salts are not supported: their chains are not computed here")
            engines = (str(body["instance_id"]),) if body.get("instance_id") else ()
            if by_hash:
                hashes = [hash_of(h & _INT64) for h in _ints(body, "seq_hashes", "block_hash")]
            else:
                hashing = await self._hashing(engines, block_size)
                hashes = chain(hashing, _ints(body, "token_ids"))
            matches = await self.client.match_prefixes(PrefixQuery(tuple(hashes), engine_ids=engines)) if hashes else []
        except _BadQuery as e:
            return _error(400, str(e))
        except ValueError as e:  # not JSON
            return _error(400, f"the request body must be JSON: {e}")
        except InvalidArgument as e:  # e.g. INDEX_QUERY_TOO_LARGE
            return _error(400, str(e))
        except RendezvousError as e:
            return _error(503, str(e))
        tenant = str(body.get("tenant_id") or "default")
        answer = {}
        for m in matches:
            if m.hashing.block_size != block_size:
                continue
            tokens = m.matched_blocks * block_size
            answer[m.engine_id] = {"longest_matched": tokens, "GPU": tokens, "DP": {"0": tokens}}
        return web.json_response({tenant: answer})

    async def _hashing(self, engines: Sequence[str], block_size: int) -> BlockHashing:
        """The hashing of the indexed engines asked about, of this block size, that a chain can be computed for."""
        answers = await self.client.match_prefixes(PrefixQuery(_ANY_CHAIN, engine_ids=tuple(engines)))
        for answer in answers:
            if answer.hashing.block_size == block_size and computable(answer.hashing):
                return answer.hashing
        raise _BadQuery(f"no indexed engine hashes blocks of {block_size} tokens in a way this service computes")


def _positive_int(body: dict[str, Any], key: str) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _BadQuery(f"{key} must be a positive integer")
    return value


def _ints(body: dict[str, Any], *keys: str) -> list[int]:
    for key in keys:
        if key in body:
            values = body[key]
            if not isinstance(values, list) or not all(isinstance(v, int) and v >= 0 for v in values):
                raise _BadQuery(f"{key} must be a list of non-negative integers")
            return values
    raise _BadQuery(f"{keys[0]} is required")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rendezvous.connector.mooncake_api", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--listen", default="127.0.0.1:9000", help="host:port to serve on")
    parser.add_argument("--address", required=True, help="rendezvous server address(es), comma-separated")
    parser.add_argument("--token", default=None, help="bearer token for the rendezvous")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    targets = [t.strip() for t in args.address.split(",") if t.strip()]

    async def app() -> web.Application:
        return MooncakeApi(AsyncRendezvousClient(ClientConfig(targets=targets, token=args.token))).app()

    web.run_app(app(), host=host or "127.0.0.1", port=int(port), print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
