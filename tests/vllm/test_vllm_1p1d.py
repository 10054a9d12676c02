"""1P1D with real vLLM-CPU engines: KV pushed from prefill to decode through the rendezvous.

Both legs of a request are sent at once with the same transfer id (as the router does): prefill with
max_tokens=1, decode with the real max_tokens. Decode's greedy output must equal a plain engine's, and it must
really come from the transferred KV: a prefill leg computing a different prompt changes decode's output.
"""

from __future__ import annotations

import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from rendezvous.clients.testing import TestServer
from rendezvous.connector.launch import BLOCK_SIZE, Engine
from tests.vllm.conftest import wait_committed

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 24
VOCAB_LOW, VOCAB_HIGH = 4, 390  # skip the special tokens


def token_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]


def disaggregated(
    prefill: Engine, decode: Engine, prompt: Any, max_tokens: int = MAX_TOKENS, prefill_prompt: Any = None
) -> tuple[str, str, dict[str, Any]]:
    """Both legs at once; returns (transfer id, decode's text, prefill's response)."""
    transfer_id = uuid.uuid4().hex
    params: dict[str, Any] = {"kv_transfer_params": {"transfer_id": transfer_id}}
    with ThreadPoolExecutor(2) as pool:
        p = pool.submit(prefill.complete, prompt if prefill_prompt is None else prefill_prompt, 1, **params)
        d = pool.submit(decode.complete, prompt, max_tokens, **params)
        prefill_response, decode_response = p.result(), d.result()
    return transfer_id, decode_response["choices"][0]["text"], prefill_response


def reference_text(engine: Engine, prompt: Any, max_tokens: int = MAX_TOKENS) -> str:
    return str(engine.complete(prompt, max_tokens)["choices"][0]["text"])


# Token prompts of exact lengths: one token, within a block, block-aligned, one past, many blocks.
LENGTHS = [1, 7, BLOCK_SIZE, BLOCK_SIZE + 1, 5 * BLOCK_SIZE - 3, 12 * BLOCK_SIZE + 5]


@pytest.mark.parametrize("length", LENGTHS)
def test_greedy_output_matches_plain_engine(
    engines: tuple[Engine, Engine, Engine], rendezvous: TestServer, length: int
) -> None:
    prefill, decode, reference = engines
    prompt = token_prompt(length, seed=length)
    transfer_id, text, prefill_response = disaggregated(prefill, decode, prompt)
    assert text == reference_text(reference, prompt)
    assert prefill_response["kv_transfer_params"]["transfer_id"] == transfer_id
    wait_committed(rendezvous, transfer_id)


def test_text_prompts_match(engines: tuple[Engine, Engine, Engine]) -> None:
    prefill, decode, reference = engines
    for prompt in ["Hello, world!", "The quick brown fox jumps over the lazy dog. " * 6]:
        _, text, _ = disaggregated(prefill, decode, prompt)
        assert text == reference_text(reference, prompt)


def test_concurrent_requests_match(engines: tuple[Engine, Engine, Engine]) -> None:
    prefill, decode, reference = engines
    prompts = [token_prompt(20 + 37 * i, seed=1000 + i) for i in range(6)]
    expected = [reference_text(reference, p) for p in prompts]
    started = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: disaggregated(prefill, decode, p)[1], prompts))
    elapsed = time.monotonic() - started
    assert results == expected
    print(f"{len(prompts)} concurrent 1P1D requests in {elapsed:.2f} s")


def test_repeated_prompt_with_decode_prefix_hit(engines: tuple[Engine, Engine, Engine]) -> None:
    """The second time, decode holds a prefix of the prompt: it receives only the remaining blocks."""
    prefill, decode, reference = engines
    prompt = token_prompt(6 * BLOCK_SIZE + 9, seed=77)
    expected = reference_text(reference, prompt)
    for _ in range(2):
        _, text, _ = disaggregated(prefill, decode, prompt)
        assert text == expected


def test_output_depends_on_the_prompt(engines: tuple[Engine, Engine, Engine]) -> None:
    """The equality tests mean something: one changed early token changes the greedy output."""
    _, _, reference = engines
    for seed in range(3):
        prompt = token_prompt(3 * BLOCK_SIZE, seed=500 + seed)
        changed = [prompt[0] + 1, *prompt[1:]]
        assert reference_text(reference, prompt) != reference_text(reference, changed)


def test_decode_uses_the_transferred_kv(engines: tuple[Engine, Engine, Engine]) -> None:
    """Prefill computes a different prompt of the same length: decode's output follows prefill's KV."""
    prefill, decode, reference = engines
    prompt = token_prompt(3 * BLOCK_SIZE + 4, seed=900)
    other = [prompt[0] + 1, *prompt[1:]]
    _, text, _ = disaggregated(prefill, decode, prompt, prefill_prompt=other)
    assert text != reference_text(reference, prompt)
