"""A real vLLM scheduler with the rendezvous connector in it, and the requests and model outputs it steps on: the
connector's scheduler half tested in milliseconds, without an engine, a model run or a network.

Modelled on vLLM's own builders for its connectors' unit tests (tests/v1/kv_connector/unit/utils.py in vLLM's
repository, which its wheel does not ship: `create_vllm_config`, `create_scheduler`, `create_request`,
`create_model_runner_output`). The model is the project's tiny Llama (`rendezvous.connector.launch.build_tiny_model`):
vLLM reads its config, never runs it. The KV cache is a stand-in of one 1-head layer, as in vLLM's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from rendezvous.connector.config import TRANSFER_ID_KEY

BLOCK_SIZE = 16
NUM_BLOCKS = 100
EOS_TOKEN_ID = 2


def vllm_config(model: Path, kv_role: Literal["kv_producer", "kv_consumer"], **extra: Any) -> VllmConfig:
    """An engine's configuration with the rendezvous connector in `kv_role`; extra:
    kv_connector_extra_config keys beyond the rendezvous address (nothing listens there: the scheduler half
    never calls it)."""
    model_config = ModelConfig(model=str(model), dtype="float32", seed=0, max_model_len=256)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=256,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="RendezvousConnector",
            kv_connector_module_path="rendezvous.connector.rendezvous_connector",
            kv_role=kv_role,
            kv_connector_extra_config={"rendezvous": "127.0.0.1:1", **extra},
        ),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    """num_blocks blocks of a stand-in layer (the scheduler counts blocks; the worker half reads num_blocks)."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
            )
        ],
    )


def scheduler(config: VllmConfig, num_blocks: int = NUM_BLOCKS) -> Scheduler:
    """vLLM's scheduler over num_blocks blocks (one of them vLLM's null block); it builds the connector's scheduler
    half itself."""
    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config(num_blocks),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
    )


def request(request_id: str, num_tokens: int, transfer_id: str | None, max_tokens: int = 4) -> Request:
    """A prompt of num_tokens tokens; with a transfer id, one leg of a disaggregated request (what the router
    puts in kv_transfer_params)."""
    sampling = SamplingParams(max_tokens=max_tokens)
    sampling.update_from_generation_config({}, EOS_TOKEN_ID)
    prompt = [3 + (i % 200) for i in range(num_tokens)]
    made = Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=sampling, pooling_params=None)
    made.kv_transfer_params = {TRANSFER_ID_KEY: transfer_id} if transfer_id is not None else None
    return made


def model_output(
    requests: Sequence[Request],
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    token_id: int = 7,
    prefilling: Sequence[Request] = (),
) -> ModelRunnerOutput:
    """What the workers answer a step: one sampled token per request (none for those still `prefilling`: a chunk
    that leaves the prompt unfinished samples nothing), and the transfers their connector ended."""
    ids = [r.request_id for r in requests]
    chunks = {r.request_id for r in prefilling}
    connector = (
        KVConnectorOutput(finished_sending=finished_sending, finished_recving=finished_recving)
        if finished_sending is not None or finished_recving is not None
        else None
    )
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={request_id: i for i, request_id in enumerate(ids)},
        sampled_token_ids=[[] if request_id in chunks else [token_id] for request_id in ids],
        kv_connector_output=connector,
    )
