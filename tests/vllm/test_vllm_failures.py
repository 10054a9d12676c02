"""Failure paths with real engines: an aborted transfer fails the decode request cleanly (policy "fail") or
is recomputed (policy "recompute"), a request given up by its client aborts its transfer, a prefill engine
killed mid-flight costs decode the request (or a recompute), never garbage; no KV block stays held, and the
engines keep serving afterwards."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import urllib.error
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from rendezvous.clients import AbortReason, AbortSpec, TransferState
from rendezvous.clients.sync import RendezvousClient
from rendezvous.clients.testing import TestServer
from rendezvous.connector.launch import BLOCK_SIZE, Engine, connector_config, running_engine
from tests.vllm.conftest import wait_blocks_free, wait_state
from tests.vllm.test_vllm_1p1d import disaggregated, reference_text, token_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def decode_aborted_while_waiting(
    rendezvous: TestServer, decode: Engine, prompt: list[int], max_tokens: int
) -> Future[dict[str, Any]]:
    """Send a decode leg alone, abort its transfer once decode has registered its blocks, and return the leg
    once it has ended (within 60 s)."""
    transfer_id = uuid.uuid4().hex
    with ThreadPoolExecutor(1) as pool:
        leg = pool.submit(decode.complete, prompt, max_tokens, kv_transfer_params={"transfer_id": transfer_id})
        wait_state(rendezvous, transfer_id, {TransferState.TARGETED})
        with RendezvousClient(rendezvous.address) as client:
            client.abort_transfer("", AbortSpec(transfer_id, "aborted by the test"))
        wait([leg], timeout=60)
        assert leg.done()
    return leg


def test_aborted_transfer_fails_the_decode_request(
    engines: tuple[Engine, Engine, Engine], rendezvous: TestServer
) -> None:
    prefill, decode, reference = engines
    prompt = token_prompt(2 * BLOCK_SIZE + 3, seed=4242)
    started = time.monotonic()
    leg = decode_aborted_while_waiting(rendezvous, decode, prompt, 8)
    with pytest.raises(urllib.error.HTTPError) as error:
        leg.result()
    assert error.value.code == 500  # kv_load_failure_policy "fail": an error, never garbage
    assert time.monotonic() - started < 30
    wait_blocks_free(prefill, decode)
    # Both engines still serve, with correct output.
    _, text, _ = disaggregated(prefill, decode, prompt)
    assert text == reference_text(reference, prompt)


def test_client_abort_while_waiting_aborts_the_transfer(
    engines: tuple[Engine, Engine, Engine], rendezvous: TestServer
) -> None:
    prefill, decode, reference = engines
    transfer_id = uuid.uuid4().hex
    prompt = token_prompt(BLOCK_SIZE + 5, seed=4343)

    def decode_leg() -> None:  # the client gives up after 2 s: vLLM aborts the request
        with contextlib.suppress(TimeoutError, OSError, urllib.error.URLError):
            decode.complete(prompt, 8, kv_transfer_params={"transfer_id": transfer_id}, timeout_s=2.0)

    thread = threading.Thread(target=decode_leg)
    thread.start()
    thread.join(30)
    # The decode engine aborted its transfer once the request ended (no prefill ever came).
    wait_state(rendezvous, transfer_id, {TransferState.ABORTED})
    wait_blocks_free(prefill, decode)
    _, text, _ = disaggregated(prefill, decode, prompt)
    assert text == reference_text(reference, prompt)


def test_recompute_policy_recovers_from_an_aborted_transfer(
    engines: tuple[Engine, Engine, Engine], recompute_decode: Engine, rendezvous: TestServer
) -> None:
    """With kv_load_failure_policy "recompute", a failed transfer costs time, not the request: decode
    computes the prompt itself and answers exactly what a plain engine answers."""
    reference = engines[2]
    prompt = token_prompt(4 * BLOCK_SIZE + 11, seed=4444)
    response = decode_aborted_while_waiting(rendezvous, recompute_decode, prompt, 16).result()
    assert response["choices"][0]["text"] == reference_text(reference, prompt, 16)


VICTIM_LEASE_TTL = 6.0


@pytest.fixture
def victim_prefill(tiny_model: Path, rendezvous: TestServer, engine_logs: Path) -> Iterator[Engine]:
    """A prefill engine (pool "prefill-victim", short lease) for a test to kill."""
    config = partial(connector_config, "kv_producer", rendezvous.address, "prefill-victim", lease_ttl=VICTIM_LEASE_TTL)
    with running_engine("prefill-victim", tiny_model, engine_logs, config, stop_signal=signal.SIGKILL) as engine:
        yield engine


def decode_after_losing_prefill(
    decode: Engine,
    recompute_decode: Engine,
    reference: Engine,
    prompts: list[list[int]],
    transfer_ids: list[str],
    timeout: float,
) -> float:
    """Send the decode legs of two transfers whose prefill engine was lost: the "fail" decode must answer an
    error, the "recompute" decode exactly what a plain engine answers. Returns how long that took."""
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        failed = pool.submit(decode.complete, prompts[0], 8, kv_transfer_params={"transfer_id": transfer_ids[0]})
        recomputed = pool.submit(
            recompute_decode.complete, prompts[1], 16, kv_transfer_params={"transfer_id": transfer_ids[1]}
        )
        with pytest.raises(urllib.error.HTTPError) as error:
            failed.result(timeout)
        answer = recomputed.result(timeout)
    assert error.value.code == 500  # policy "fail": an error, never garbage
    assert answer["choices"][0]["text"] == reference_text(reference, prompts[1], 16)
    return time.monotonic() - started


def test_a_prefill_engine_killed_mid_flight(
    engines: tuple[Engine, Engine, Engine],
    recompute_decode: Engine,
    victim_prefill: Engine,
    rendezvous: TestServer,
) -> None:
    """Prefill computes two prompts and holds their KV for decode; then its engine is SIGKILLed (all its
    processes) and the decode legs arrive. The rendezvous declares the producer lost when its lease runs out
    and aborts both transfers (PEER_LOST): the "fail" decode answers an error, the "recompute" decode
    computes the prompt itself and answers exactly what a plain engine answers."""
    prefill, decode, reference = engines
    prompts = [token_prompt(3 * BLOCK_SIZE + 9, seed=4545), token_prompt(5 * BLOCK_SIZE + 2, seed=4646)]
    transfer_ids = [uuid.uuid4().hex, uuid.uuid4().hex]
    for prompt, transfer_id in zip(prompts, transfer_ids, strict=True):
        victim_prefill.complete(prompt, 1, kv_transfer_params={"transfer_id": transfer_id})
        wait_state(rendezvous, transfer_id, {TransferState.CLAIMED})
    victim_prefill.stop(signal.SIGKILL)
    elapsed = decode_after_losing_prefill(decode, recompute_decode, reference, prompts, transfer_ids, 120)
    assert elapsed < VICTIM_LEASE_TTL + 20, elapsed  # the lease bounds the wait, not the transfer timeout (60 s)
    with RendezvousClient(rendezvous.address) as client:
        for transfer_id in transfer_ids:
            info = client.get_transfer(transfer_id)
            assert (info.state, info.abort_reason) == (TransferState.ABORTED, AbortReason.PEER_LOST), info
    wait_blocks_free(decode, recompute_decode)
    _, text, _ = disaggregated(prefill, decode, prompts[0])
    assert text == reference_text(reference, prompts[0])


def test_decode_preemption_keeps_outputs_exact(
    engines: tuple[Engine, Engine, Engine], recompute_decode: Engine
) -> None:
    """Six requests whose KV arrives from prefill, then grows past what the decode engine can hold: vLLM
    preempts some after their KV arrived. A preempted request recomputes its tokens locally (the producer freed
    its copy once written) and must still answer exactly what a plain engine answers."""
    prefill, _, reference = engines
    prompts = [token_prompt(3 * BLOCK_SIZE + 7 * i, seed=4747 + i) for i in range(6)]
    max_tokens = 6 * BLOCK_SIZE  # each request ends up needing ~9-10 blocks; six need ~2.5x what decode has
    extra = {"ignore_eos": True}
    preemptions_before = recompute_decode.metric("vllm:num_preemptions_total")
    expected = [reference.complete(p, max_tokens, **extra)["choices"][0]["text"] for p in prompts]

    def one(prompt: list[int]) -> str:
        params: dict[str, Any] = {"kv_transfer_params": {"transfer_id": uuid.uuid4().hex}, **extra}
        with ThreadPoolExecutor(2) as pool:
            pool.submit(prefill.complete, prompt, 1, **params)
            return str(recompute_decode.complete(prompt, max_tokens, **params)["choices"][0]["text"])

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(one, prompts))
    assert recompute_decode.metric("vllm:num_preemptions_total") > preemptions_before  # it did happen
    assert texts == expected
    wait_blocks_free(prefill, recompute_decode)


def test_a_completion_with_n_children_sharing_one_transfer_id(
    engines: tuple[Engine, Engine, Engine], rendezvous: TestServer
) -> None:
    """`n` = 2 on both legs: vLLM gives both children of each leg the same kv_transfer_params. One child per
    engine carries the transfer, the other computes the prompt locally: both choices answer the plain engine's
    text, none waits for a transfer another child received, and no block stays held."""
    prefill, decode, reference = engines
    prompt = token_prompt(2 * BLOCK_SIZE + 9, seed=4545)
    # n > 1 needs a non-zero temperature in vLLM; top_k 1 keeps it greedy.
    greedy_n = {"n": 2, "temperature": 1.0, "top_k": 1}
    params: dict[str, Any] = {"kv_transfer_params": {"transfer_id": uuid.uuid4().hex}, **greedy_n}
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(prefill.complete, prompt, 1, **params)
        d = pool.submit(decode.complete, prompt, 8, **params)
        p.result()
        choices = d.result()["choices"]
    expected = reference_text(reference, prompt, 8)
    assert [choice["text"] for choice in choices] == [expected, expected]
    wait_blocks_free(prefill, decode)
