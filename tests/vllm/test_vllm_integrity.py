"""End-to-end integrity with real vLLM-CPU engines and progressive push: a prefill engine that hands each layer's KV
over as the forward pass computes it, with `integrity` on, writes into a decode engine that requires the digests
(`kv_load_failure_policy` "fail": a transfer without them, or whose bytes differ, answers an error). Decode answers
exactly what a plain engine answers, the KV went out in parts, and the digests came with it and matched."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from rendezvous.clients.testing import TestServer
from rendezvous.connector.launch import BLOCK_SIZE, Engine, connector_config, running_engine
from tests.vllm.conftest import wait_blocks_free
from tests.vllm.test_vllm_progressive import CHUNK, answers_in_parts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

pytest.importorskip("xxhash", reason="integrity needs the nixl extra's xxhash")


@pytest.fixture(scope="module")
def checked_pair(tiny_model: Path, rendezvous: TestServer, engine_logs: Path) -> Iterator[tuple[Engine, Engine]]:
    """A layer-wise producer (pool "prefill-checked") and a decode engine (pool "decode-checked"), both with
    progressive push and integrity on."""
    producer = partial(
        connector_config,
        "kv_producer",
        rendezvous.address,
        "prefill-checked",
        progressive=True,
        progressive_layers=True,
        integrity=True,
    )
    consumer = partial(
        connector_config, "kv_consumer", rendezvous.address, "decode-checked", progressive=True, integrity=True
    )
    chunked = ["--max-num-batched-tokens", str(4 * CHUNK)]
    with (
        running_engine("prefill-checked", tiny_model, engine_logs, producer, extra_args=chunked) as prefill,
        running_engine("decode-checked", tiny_model, engine_logs, consumer) as decode,
    ):
        yield prefill, decode


def test_checked_layers_go_out_as_parts_and_decode_answers_as_a_plain_engine(
    engines: tuple[Engine, Engine, Engine], checked_pair: tuple[Engine, Engine], rendezvous: TestServer
) -> None:
    """Each prompt in parts (then again as one write of the blocks decode lacks): a digest missing or wrong would
    fail decode's request, so a plain engine's answer says the digests came and matched."""
    prefill, decode = checked_pair
    lengths = (9 * BLOCK_SIZE + 17, 14 * BLOCK_SIZE + 3)  # 3 and 4 steps of 4 blocks
    answers_in_parts(prefill, decode, engines[2], rendezvous, lengths, seed=16700)
    wait_blocks_free(prefill, decode)
