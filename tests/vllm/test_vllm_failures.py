"""Failure paths with real engines: an aborted transfer fails the decode request cleanly (policy "fail"),
a request given up by its client aborts its transfer, and both engines keep serving afterwards."""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.error
import uuid

import pytest

from clients import AbortSpec, TransferState
from clients.sync import RendezvousClient
from clients.testing import TestServer
from tests.vllm.conftest import BLOCK_SIZE, Engine
from tests.vllm.test_vllm_1p1d import disaggregated, reference_text, token_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def wait_state(server: TestServer, transfer_id: str, states: set[TransferState], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    with RendezvousClient(server.address) as client:
        while True:
            try:
                state = client.get_transfer(transfer_id).state
            except Exception:
                state = None
            if state in states:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"transfer {transfer_id} is {state}, not one of {states}")
            time.sleep(0.1)


def test_aborted_transfer_fails_the_decode_request(
    engines: tuple[Engine, Engine, Engine], rendezvous: TestServer
) -> None:
    prefill, decode, reference = engines
    transfer_id = uuid.uuid4().hex
    prompt = token_prompt(2 * BLOCK_SIZE + 3, seed=4242)
    outcome: dict[str, object] = {}

    def decode_leg() -> None:
        try:
            outcome["response"] = decode.complete(prompt, 8, kv_transfer_params={"transfer_id": transfer_id})
        except urllib.error.HTTPError as e:
            outcome["status"] = e.code

    thread = threading.Thread(target=decode_leg)
    started = time.monotonic()
    thread.start()
    wait_state(rendezvous, transfer_id, {TransferState.TARGETED})
    with RendezvousClient(rendezvous.address) as client:
        client.abort_transfer("", AbortSpec(transfer_id, "aborted by the test"))
    thread.join(60)
    assert not thread.is_alive()
    assert outcome.get("status") == 500, outcome  # kv_load_failure_policy "fail": an error, never garbage
    assert time.monotonic() - started < 30
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
    _, text, _ = disaggregated(prefill, decode, prompt)
    assert text == reference_text(reference, prompt)


def test_recompute_policy_recovers_from_an_aborted_transfer(
    engines: tuple[Engine, Engine, Engine], recompute_decode: Engine, rendezvous: TestServer
) -> None:
    """With kv_load_failure_policy "recompute", a failed transfer costs time, not the request: decode
    computes the prompt itself and answers exactly what a plain engine answers."""
    reference = engines[2]
    transfer_id = uuid.uuid4().hex
    prompt = token_prompt(4 * BLOCK_SIZE + 11, seed=4444)
    outcome: dict[str, object] = {}

    def decode_leg() -> None:
        outcome["response"] = recompute_decode.complete(prompt, 16, kv_transfer_params={"transfer_id": transfer_id})

    thread = threading.Thread(target=decode_leg)
    thread.start()
    wait_state(rendezvous, transfer_id, {TransferState.TARGETED})
    with RendezvousClient(rendezvous.address) as client:
        client.abort_transfer("", AbortSpec(transfer_id, "aborted by the test"))
    thread.join(60)
    assert not thread.is_alive()
    response = outcome["response"]
    assert isinstance(response, dict)
    assert response["choices"][0]["text"] == reference_text(reference, prompt, 16)
