"""The connector's layout carries vLLM's own NIXL compatibility hash in its model fingerprint, so engines that
vLLM says cannot exchange KV (another vLLM build, KV dtype, attention backend) are never paired."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from rendezvous.connector.compat import HASH_CHARS, TRANSFER_MODE, model_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def _config(model: Path, cache_dtype: Any = "auto") -> VllmConfig:
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=512),
        cache_config=CacheConfig(cache_dtype=cache_dtype),
    )


def test_the_fingerprint_is_the_model_and_vllms_compatibility_hash(tiny_model: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import compute_nixl_compatibility_hash

    config = _config(tiny_model)
    backends = ",".join(sorted({b.get_name() for b in get_current_attn_backends(config)}))
    expected = compute_nixl_compatibility_hash(config, backends, transfer_mode=TRANSFER_MODE)
    assert model_fingerprint(config) == f"{tiny_model}@#{expected[:HASH_CHARS]}"


def test_another_vllm_build_or_kv_dtype_gives_another_fingerprint(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm

    config = _config(tiny_model)
    mine = model_fingerprint(config)
    assert model_fingerprint(_config(tiny_model)) == mine
    assert model_fingerprint(_config(tiny_model, cache_dtype="fp8")) != mine
    monkeypatch.setattr(vllm, "__version__", "0.0.0+another-build")
    assert model_fingerprint(config) != mine
