"""The model fingerprint a vLLM engine publishes in its layout: the model and vLLM's own NIXL compatibility hash.

vLLM's NIXL connectors exchange `compute_nixl_compatibility_hash` in their handshake and refuse a peer whose hash
differs (vLLM PRs #50620, #52999): it covers the vLLM and NIXL-connector versions, the model's architecture and
dtype, the KV cache dtype, the attention backends and the speculative config, and leaves out what the layout
check compares itself (TP size, block size, memory layout). The rendezvous pairs only equal fingerprints, so
engines of vLLM builds that vLLM says cannot exchange KV are never matched (LAYOUT_MISMATCH; the layout check
compares the fingerprint after the fields it names, so a dtype difference is still reported as the dtype's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

TRANSFER_MODE = "kv-rendezvous"
"""The hash's transfer mode: neither of vLLM's own connectors (pull, push) speaks this one's protocol."""

HASH_CHARS = 16
"""Hex digits of vLLM's SHA-256 kept in the fingerprint (64 bits: enough to tell builds apart, short to read)."""


def model_fingerprint(vllm_config: VllmConfig) -> str:
    """ "<model>@<revision>#<vLLM compatibility hash>" for this engine's configuration."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import compute_nixl_compatibility_hash

    model = vllm_config.model_config
    backends = ",".join(sorted({b.get_name() for b in get_current_attn_backends(vllm_config)}))
    compat = compute_nixl_compatibility_hash(vllm_config, backends, transfer_mode=TRANSFER_MODE)
    return f"{model.model}@{model.revision or ''}#{compat[:HASH_CHARS]}"


__all__ = ["HASH_CHARS", "TRANSFER_MODE", "model_fingerprint"]
