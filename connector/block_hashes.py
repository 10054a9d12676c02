"""A prompt's chain of block hashes as a vLLM engine computes it, for a router that asks the KV index
(MatchPrefixes) which engine holds how much of it.

vLLM's own functions do the hashing (vllm.v1.core.kv_cache_utils.hash_block_tokens with the algorithm of
vllm.utils.hashing.get_hash_fn_by_name), from what the engine announced (BlockHashing): the algorithm, the seed
of the first parent, the block size, and whether its events carry the hashes as 64-bit integers (then the index
holds the integer's 8 bytes, `hash_of`). Only a chain of full blocks of plain token ids is computed: prompts with
LoRA adapters, multimodal inputs or a cache salt hash extra keys the router does not know.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

from rendezvous.clients import BlockHashing, hash_of

__all__ = ["chain", "computable"]

_INT64 = (1 << 64) - 1


def computable(hashing: BlockHashing) -> bool:
    """Whether a router can compute this engine's chain: a seed it announced, an algorithm vLLM knows (and can
    run here: vLLM is installed, and the xxhash package for the xxhash algorithms)."""
    return bool(hashing.seed) and _hash_function(hashing.algorithm) is not None


def chain(hashing: BlockHashing, token_ids: Sequence[int]) -> list[bytes]:
    """The hashes of the prompt's full blocks, first block first, as the engine reports them. Raises ValueError
    when the chain cannot be computed (`computable`)."""
    function = _hash_function(hashing.algorithm)
    if function is None or not hashing.seed:
        raise ValueError(f"cannot compute a chain for {hashing}")
    from vllm.v1.core.kv_cache_utils import BlockHash, hash_block_tokens

    parent = BlockHash(function(hashing.seed))  # vLLM's NONE_HASH for this seed
    size = hashing.block_size
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - size + 1, size):
        parent = hash_block_tokens(function, parent, token_ids[start : start + size])
        hashes.append(hash_of(int.from_bytes(parent, "big") & _INT64) if hashing.integer_hashes else bytes(parent))
    return hashes


@cache
def _hash_function(algorithm: str) -> Callable[[Any], bytes] | None:
    try:
        from vllm.utils.hashing import get_hash_fn_by_name  # a router without vLLM computes no chain

        function = get_hash_fn_by_name(algorithm)
        function(b"")  # xxhash's are named but need the xxhash package
    except (ValueError, ImportError):
        return None
    return function
