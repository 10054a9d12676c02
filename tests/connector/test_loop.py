"""The connector's loop thread: its event loop is closed when the thread ends (the loop part needs no vLLM); a
prefill worker's claim that fails is sent again, and if that fails too the transfer is aborted."""

from __future__ import annotations

import asyncio
import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest

from rendezvous.connector import ConnectorConfig
from rendezvous.connector._loop import LoopThread

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
NOT_NEEDED: Any = None
"""Stands in for vLLM's config objects where the code under test does not reach them."""


def test_stopping_the_thread_closes_its_event_loop() -> None:
    thread = LoopThread("test-loop")

    async def answer() -> int:
        return 42

    assert thread.run(answer(), 5.0) == 42
    thread.stop()
    assert not thread.alive
    assert thread.loop.is_closed()
    thread.stop()  # a second stop is harmless


def test_tasks_still_running_when_the_thread_stops_are_cancelled_and_unwind() -> None:
    thread = LoopThread("test-loop")
    unwound: list[str] = []

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            unwound.append("task")

    async def ticks() -> Any:
        try:
            while True:
                yield 1
                await asyncio.sleep(3600)
        finally:
            unwound.append("generator")

    async def start() -> None:
        asyncio.get_running_loop().create_task(forever())
        generator = ticks()
        await generator.__anext__()
        thread.generator = generator  # type: ignore[attr-defined]  # keep it alive, suspended

    thread.run(start(), 5.0)
    thread.stop()
    assert thread.loop.is_closed()
    assert sorted(unwound) == ["generator", "task"]


@pytest.mark.vllm
@needs_vllm
def test_the_workers_shutdown_path_closes_its_loop() -> None:
    from rendezvous.connector.rendezvous_connector import _WorkerSide

    config = ConnectorConfig.from_extra_config({"rendezvous": "127.0.0.1:1"})
    worker = _WorkerSide(config, True, "p0", NOT_NEEDED, NOT_NEEDED)
    worker._thread = thread = LoopThread("test-worker")
    worker.stop()
    assert worker._thread is None
    assert not thread.alive and thread.loop.is_closed()


@pytest.mark.vllm
@needs_vllm
def test_a_worker_that_fails_to_start_closes_its_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    import rendezvous.connector.rendezvous_connector as module

    started: list[LoopThread] = []

    class Recorded(LoopThread):
        def __init__(self, name: str) -> None:
            super().__init__(name)
            started.append(self)

    monkeypatch.setattr(module, "LoopThread", Recorded)
    config = ConnectorConfig.from_extra_config({"rendezvous": "127.0.0.1:1", "start_timeout": 5})
    caches: Any = SimpleNamespace(num_blocks=1)
    worker = module._WorkerSide(config, True, "p0", NOT_NEEDED, caches)
    with pytest.raises(AttributeError):  # no vLLM config: the start-up fails on the loop
        worker.start({})
    (thread,) = started
    assert not thread.alive and thread.loop.is_closed()


def _prefill_worker(monkeypatch: pytest.MonkeyPatch, claims: list[Exception | None], aborted: list[str]) -> Any:
    """Rank 0 of a prefill engine whose ClaimTransfers answers from `claims` (an exception raises, None succeeds)."""
    from rendezvous.clients import ItemResult, TransferState
    from rendezvous.connector.rendezvous_connector import _WorkerSide

    config = ConnectorConfig.from_extra_config({"rendezvous": "127.0.0.1:1"})
    worker = _WorkerSide(config, True, "p0", NOT_NEEDED, NOT_NEEDED)

    async def claim(transfer_id: str) -> ItemResult:
        outcome = claims.pop(0)
        if outcome is not None:
            raise outcome
        return ItemResult(transfer_id, TransferState.MATCHED)

    async def abort(transfer_id: str, message: str) -> None:
        aborted.append(f"{transfer_id}: {message}")

    monkeypatch.setattr(worker, "_claim", claim)
    monkeypatch.setattr(worker, "_abort_transfer", abort)
    return worker


@pytest.mark.vllm
@needs_vllm
def test_a_claim_that_failed_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from rendezvous.clients import DeadlineExceeded

    claims: list[Exception | None] = [DeadlineExceeded("", "Deadline Exceeded"), None]
    aborted: list[str] = []
    worker = _prefill_worker(monkeypatch, claims, aborted)
    assert asyncio.run(worker._claimed("t1")) is True
    assert (claims, aborted) == ([], [])


@pytest.mark.vllm
@needs_vllm
def test_a_claim_that_fails_twice_aborts_the_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    from rendezvous.clients import DeadlineExceeded

    claims: list[Exception | None] = [DeadlineExceeded("", "Deadline Exceeded"), DeadlineExceeded("", "again")]
    aborted: list[str] = []
    worker = _prefill_worker(monkeypatch, claims, aborted)
    assert asyncio.run(worker._claimed("t1")) is False
    assert claims == [] and aborted == ["t1: prefill could not claim the transfer: DEADLINE_EXCEEDED: again"]


@pytest.mark.vllm
@needs_vllm
def test_a_step_that_computes_nothing_is_marked_idle() -> None:
    from rendezvous.connector.rendezvous_connector import _SchedulerSide

    side = _SchedulerSide(producer=True, block_size=16, engine_id="p0")
    step: Any = SimpleNamespace(total_num_scheduled_tokens=0, num_scheduled_tokens={})
    assert side.build_meta(step).idle
    step = SimpleNamespace(total_num_scheduled_tokens=5, num_scheduled_tokens={"r": 5})
    assert not side.build_meta(step).idle


@pytest.mark.vllm
@needs_vllm
def test_an_idle_step_waits_for_a_transfer_to_end_and_wakes_when_one_does() -> None:
    """What an idle step asks of the worker (`take_results` with a wait): nothing ended waits the whole wait; a
    transfer that ends meanwhile ends the wait at once."""
    import threading
    import time

    from rendezvous.connector.rendezvous_connector import _WorkerSide

    config = ConnectorConfig.from_extra_config({"rendezvous": "127.0.0.1:1"})
    worker = _WorkerSide(config, False, "d0", NOT_NEEDED, NOT_NEEDED)
    started = time.monotonic()
    assert not worker.take_results(0.05).finished_recving
    assert time.monotonic() - started >= 0.05
    reporter = threading.Thread(target=worker._report_received, args=("r1", True))
    started = time.monotonic()
    reporter.start()
    results = worker.take_results(60.0)  # woken by the report (or it came first): far sooner than 60 s
    assert results.finished_recving == {"r1"} and time.monotonic() - started < 30
    reporter.join()
    assert not worker.take_results().finished_recving  # taken once
