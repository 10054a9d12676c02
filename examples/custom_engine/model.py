"""The stand-in model both engines serve: its KV layout, its KV cache tensors and the KV of a prompt.

A real engine has these already: its KV cache (one tensor per layer for K and one for V, each shaped
[num_blocks, ...] with a contiguous block `t[b]`) and a layout saying what is in it. The service matches a
prefill and a decode engine only when their layouts agree, and the agents WRITE block b of region r into block
b' of the peer's region r: both engines must list their tensors in the same order.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt
import torch

from rendezvous.clients import KvLayout

NUM_LAYERS = 2
BLOCK_SIZE = 16
"""Tokens per block. The stand-in tokenizer makes one token of each byte of the prompt."""
TOKEN_BYTES = 64
"""KV bytes of one token in one region (a real model: heads x head_dim x dtype size)."""
LAYOUT = KvLayout(model_fingerprint="stand-in-model-v1", dtype="uint8", block_size=BLOCK_SIZE, num_layers=NUM_LAYERS)
"""What the engines register. A field left unstated matches only an engine that leaves it unstated too: a real
engine states every field it has (docs/engines.md); the agents add `data_plane_version`. The stand-in model has no
attention heads, so `num_kv_heads` and `kv_layout` stay unstated here, on both sides."""


def kv_cache(num_blocks: int) -> list[torch.Tensor]:
    """The engine's KV cache in DRAM: K and V of each layer, layer-major, one [num_blocks, block bytes] tensor each."""
    return [torch.zeros((num_blocks, BLOCK_SIZE * TOKEN_BYTES), dtype=torch.uint8) for _ in range(2 * NUM_LAYERS)]


def blocks_needed(prompt: str) -> int:
    """The blocks a prompt's KV takes."""
    return -(-len(prompt.encode()) // BLOCK_SIZE)


def prompt_kv(prompt: str) -> npt.NDArray[np.uint8]:
    """What "prefill" computes: [region, block, bytes], deterministic in the prompt, so decode can check it."""
    seed = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little")
    shape = (2 * NUM_LAYERS, blocks_needed(prompt), BLOCK_SIZE * TOKEN_BYTES)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
