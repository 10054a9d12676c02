"""1P1D through the reference router (`rendezvous.connector.router`): one OpenAI request in, both legs dispatched at
once."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from rendezvous.connector.launch import BLOCK_SIZE, MAX_MODEL_LEN, Engine, RouterProcess, post_json
from tests.vllm.conftest import wait_blocks_free
from tests.vllm.test_vllm_1p1d import reference_text, token_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 24
ATTEMPTS = 3


def test_health(router: RouterProcess) -> None:
    with urllib.request.urlopen(f"{router.url}/health", timeout=5) as response:
        assert response.status == 200


@pytest.mark.parametrize("length", [5, BLOCK_SIZE + 1, 9 * BLOCK_SIZE + 2])
def test_router_output_matches_plain_engine(
    router: RouterProcess, engines: tuple[Engine, Engine, Engine], length: int
) -> None:
    reference = engines[2]
    prompt = token_prompt(length, seed=7000 + length)
    response = router.complete(prompt, MAX_TOKENS)
    assert response["choices"][0]["text"] == reference_text(reference, prompt, MAX_TOKENS)


def test_router_concurrent_requests(router: RouterProcess, engines: tuple[Engine, Engine, Engine]) -> None:
    reference = engines[2]
    prompts = [token_prompt(10 + 41 * i, seed=8000 + i) for i in range(8)]
    expected = [reference_text(reference, p, MAX_TOKENS) for p in prompts]
    started = time.monotonic()
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: router.complete(p, MAX_TOKENS)["choices"][0]["text"], prompts))
    print(f"{len(prompts)} concurrent requests through the router in {time.monotonic() - started:.2f} s")
    assert texts == expected


def test_router_chat_completion(router: RouterProcess, engines: tuple[Engine, Engine, Engine]) -> None:
    reference = engines[2]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12}
    body["temperature"] = 0.0
    via_router = post_json(f"{router.url}/v1/chat/completions", body)
    plain = post_json(f"{reference.url}/v1/chat/completions", body)
    assert via_router["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def test_router_streaming(router: RouterProcess, engines: tuple[Engine, Engine, Engine]) -> None:
    reference = engines[2]
    prompt = token_prompt(3 * BLOCK_SIZE, seed=9100)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True}
    request = urllib.request.Request(
        f"{router.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    text = ""
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == reference_text(reference, prompt, MAX_TOKENS)


def test_a_client_that_goes_away_mid_stream_frees_both_sides(
    router: RouterProcess, engines: tuple[Engine, Engine, Engine]
) -> None:
    """The client reads the first tokens of a long stream and hangs up: the router drops the decode leg, vLLM
    aborts the request, and neither engine holds a KV block afterwards.

    The tiny model writes its longest answer in about a second, which a starved CI machine can spend before the
    abort arrives; a request that ran to its end proves nothing either way, so the test tries again, up to
    ATTEMPTS times, and fails if no hang-up ever aborted the decode request."""
    prefill, decode, _ = engines
    for attempt in range(ATTEMPTS):
        finished_before = decode.finished_requests()
        prompt = token_prompt(2 * BLOCK_SIZE + 3, seed=9200 + attempt)
        body = {"model": "tiny", "prompt": prompt, "temperature": 0.0, "stream": True, "ignore_eos": True}
        body["max_tokens"] = MAX_MODEL_LEN - len(prompt)
        request = urllib.request.Request(
            f"{router.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            first = response.readline()
        assert first.startswith(b"data: ")
        deadline = time.monotonic() + 30
        while decode.metric("vllm:num_requests_running"):
            assert time.monotonic() < deadline, "the decode request still runs"
            time.sleep(0.1)
        wait_blocks_free(prefill, decode)
        # An aborted request is not counted as finished; one that ran to max_tokens is.
        if decode.finished_requests() == finished_before:
            break
    else:
        pytest.fail(f"the decode request ran to its end in all {ATTEMPTS} attempts: the hang-up never aborted it")
