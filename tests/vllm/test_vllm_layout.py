"""Engines whose KV layouts differ. Block sizes where one divides the other pair: a decode engine with 64-token
blocks takes prefill's 32-token blocks token by token (vLLM-CPU's blocks keep each head's keys transposed: HKTV),
and answers exactly what a plain engine answers, with legs sent straight to the engines and through the router,
also when a prompt sent twice hits decode's prefix cache. A
decode engine of another dtype gets a clear error, never garbage: the router refuses the pair before sending
anything, and two legs sent straight to the engines (as an engine API client may) are stopped by the rendezvous
at match time (LAYOUT_MISMATCH), both sides let go of their blocks, and decode answers an error."""

from __future__ import annotations

import urllib.error
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from rendezvous.clients import AbortReason, TransferState
from rendezvous.clients.sync import RendezvousClient
from rendezvous.clients.testing import TestServer
from rendezvous.connector.launch import BLOCK_SIZE, Engine, connector_config, running_engine
from tests.vllm.conftest import running_router, wait_blocks_free, wait_committed
from tests.vllm.test_vllm_1p1d import disaggregated, reference_text, token_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

OTHER_BLOCK_SIZE = 2 * BLOCK_SIZE  # CPU attention needs multiples of 32
MISMATCH = "dtype differs: producer 'float32', consumer 'bfloat16'"


@pytest.fixture(scope="module")
def big_block_decode(tiny_model: Path, rendezvous: TestServer, engine_logs: Path) -> Iterator[Engine]:
    """A decode engine (pool "decode-big-blocks") with 64-token KV blocks."""
    config = partial(connector_config, "kv_consumer", rendezvous.address, "decode-big-blocks")
    extra = ["--block-size", str(OTHER_BLOCK_SIZE)]
    with running_engine("decode-big-blocks", tiny_model, engine_logs, config, extra_args=extra) as engine:
        yield engine


@pytest.fixture(scope="module")
def bf16_decode(tiny_model: Path, rendezvous: TestServer, engine_logs: Path) -> Iterator[Engine]:
    """A decode engine (pool "decode-bf16") whose KV cache is bfloat16: no producer here can write into it."""
    config = partial(connector_config, "kv_consumer", rendezvous.address, "decode-bf16")
    with running_engine("decode-bf16", tiny_model, engine_logs, config, extra_args=["--dtype", "bfloat16"]) as engine:
        yield engine


def test_bigger_decode_blocks_take_prefill_kv_token_by_token(
    engines: tuple[Engine, Engine, Engine], big_block_decode: Engine, rendezvous: TestServer
) -> None:
    prefill, _, reference = engines
    for length in (7, OTHER_BLOCK_SIZE, 3 * BLOCK_SIZE + 5, 5 * OTHER_BLOCK_SIZE + 1):
        prompt = token_prompt(length, seed=13200 + length)
        for _ in range(2):  # the second time, decode holds the prompt's first full blocks already
            transfer_id, text, _ = disaggregated(prefill, big_block_decode, prompt)
            assert text == reference_text(reference, prompt), length
            wait_committed(rendezvous, transfer_id)
    wait_blocks_free(prefill, big_block_decode)


def test_through_the_router_bigger_decode_blocks_answer_as_a_plain_engine(
    engines: tuple[Engine, Engine, Engine], big_block_decode: Engine, rendezvous: TestServer, engine_logs: Path
) -> None:
    prefill, _, reference = engines
    args = ["--address", rendezvous.address, "--route", "tiny:prefill:decode-big-blocks"]
    with running_router(engine_logs, args, "router-big-blocks") as router:
        for length in (9, 3 * OTHER_BLOCK_SIZE + 2):
            prompt = token_prompt(length, seed=13300 + length)
            text = router.complete(prompt, 16)["choices"][0]["text"]
            assert text == reference_text(reference, prompt, 16), length
    wait_blocks_free(prefill, big_block_decode)


def test_the_router_refuses_a_pair_with_different_layouts(
    engines: tuple[Engine, Engine, Engine], bf16_decode: Engine, rendezvous: TestServer, engine_logs: Path
) -> None:
    args = ["--address", rendezvous.address, "--route", "tiny:prefill:decode-bf16"]
    with running_router(engine_logs, args, "router-layout") as router, pytest.raises(urllib.error.HTTPError) as error:
        router.complete(token_prompt(40, seed=13000), 8)
    assert error.value.code == 503
    message = error.value.read().decode()
    assert MISMATCH in message, message


def test_legs_sent_straight_to_mismatched_engines_fail_cleanly(
    engines: tuple[Engine, Engine, Engine], bf16_decode: Engine, rendezvous: TestServer
) -> None:
    prefill, _, reference = engines
    prompt = token_prompt(3 * BLOCK_SIZE + 5, seed=13100)
    transfer_id = uuid.uuid4().hex
    params: dict[str, Any] = {"kv_transfer_params": {"transfer_id": transfer_id}}
    with ThreadPoolExecutor(2) as pool:
        prefill_leg = pool.submit(prefill.complete, prompt, 1, **params)
        decode_leg = pool.submit(bf16_decode.complete, prompt, 8, **params)
        with pytest.raises(urllib.error.HTTPError) as error:
            decode_leg.result(120)
        prefill_leg.result(120)
    assert error.value.code == 500  # kv_load_failure_policy "fail"
    with RendezvousClient(rendezvous.address) as client:
        info = client.get_transfer(transfer_id)
    assert (info.state, info.abort_reason) == (TransferState.ABORTED, AbortReason.LAYOUT_MISMATCH), info
    assert MISMATCH in info.abort_message, info.abort_message
    wait_blocks_free(prefill, bf16_decode)
    # Both still serve: the bfloat16 engine on its own, the prefill engine with its own decode pool.
    assert bf16_decode.complete(prompt, 8)["choices"][0]["text"]
    _, text, _ = disaggregated(prefill, engines[1], prompt)
    assert text == reference_text(reference, prompt)
