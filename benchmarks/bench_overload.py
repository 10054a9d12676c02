"""Overload benchmark: what the others see while load far beyond one replica's capacity arrives.

One `kv-rendezvous serve` with an auth file, a health port and metrics. Four *flood* identities, each an
engine of its own, send ClaimTransfers batches (64 re-claims of the same ids: real per-item work, no state
growth) from h2load (nghttp2-client), which offers HTTP/2 gRPC calls far faster than the server can answer at
little CPU of its own. First a closed-loop phase measures what the server serves (capacity, calls/s), a second
one what is left of it beside the others' paced load (below; the most the flood can be admitted); then each
phase offers 1x, 2x and 5x the capacity (h2load's streams scaled with the multiple, so that the excess reaches
the server instead of waiting in the client for a free stream), while, side by side in the same phase:

  others   a consumer and a producer engine (their own identities) run paced lifecycles (RegisterTargets,
           ClaimTransfers, TRANSFER_ASSIGNED, CompleteTransfers, TRANSFER_COMMITTED, ReleaseTargets) and a
           router reads GetStatus: their goodput, p99 and every error code
  heavy    one more identity sends maximum-size CompleteTransfers requests (completions with parts, for
           unknown ids) back to back, as a buggy engine or an attacker would (serialized once, so that its
           own CPU takes little from the server on a shared machine; refused RESOURCE_EXHAUSTED, it waits
           50 ms, not the retry hint)
  health   a prober asks grpc.health.v1 on the health port (and on the serving port) every 100 ms with a
           1 s timeout
  memory   the server's RSS, sampled every 100 ms
  sampler  one more call of a flood identity every 50 ms, from a client that reads the answer: whether a
           refusal carries a retry hint (h2load does not say)

The flood's calls are counted by the server (its /metrics, by status code): `admitted` is every call that
was answered by the service (not refused, nor cancelled by h2load as it ends), `shed` every RESOURCE_EXHAUSTED,
both per second of the flood's own phase. Over capacity three ways: `of_capacity` (the flood's alone),
`of_capacity_beside_others` (over what the closed-loop flood gets beside the others), and
`of_capacity_others_included` (the flood's plus the others' share of the server, capacity less capacity beside
them, over capacity: the load admitted in all; with a front, capacity beside them is measured once more on the
server directly, as the front holds back a closed-loop flood). `server_cpus_busy` is how busy the server's CPUs
were, whoever ran there (what else ran on them: less the server's own `server_cpu_util`), `server_cpus_steal`
the time the hypervisor took from them, `client_cpus_busy` how busy every other CPU was (the clients', the
front's and the heavy sender's, who start before the phase); each over the flood's own seconds
(`cpu_window_s`), not the phase's tail while the last lifecycles and the heavy sender's held call end. No
transfer of the others may be lost: each lifecycle ends released, or its error is counted.

    python benchmarks/bench_overload.py [--store memory|redis] [--seconds 8] [--factors 1,2,5]
    python benchmarks/bench_overload.py --compare     # memory and Redis, one run
    python benchmarks/bench_overload.py --serve-flag=--rate-limit=0   # flags passed to serve
    python benchmarks/bench_overload.py --front haproxy   # every phase after capacity through deploy/haproxy
    python benchmarks/bench_overload.py --front haproxy --front-option max_calls=64   # a field of render.Front

With `--front haproxy` (apt-get install haproxy) the capacity phase still measures the server itself; the
other phases go through an HAProxy admission front rendered from deploy/haproxy (its per-caller rate share
sized from that capacity), the health port is still probed directly, and `refused_at_front` counts the calls
HAProxy answered itself (RESOURCE_EXHAUSTED that never reached the server).

    python benchmarks/bench_overload.py --server-cpus 0 [--client-cpus 1] [--redis-cpus server|clients]

With `--server-cpus` the server runs on those CPUs only (taskset, before it starts: its threads too) and
everything else the benchmark starts on `--client-cpus` (by default every other CPU it may use): h2load, the
HAProxy front, the others' clients, the probers, the sampler and the heavy sender (this process pins itself, and
its children inherit it). redis-server goes with the server (`--redis-cpus server`, the default: it is the
server's backend, and the clients' CPU is the front's and the load's) or with the clients. The capacity phases
run under the same pinning, so admitted over capacity compares the server with the same CPU; the results record
the pinning asked for and the affinity the server's threads had.

Needs h2load (`apt-get install nghttp2-client`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rendezvous import LAYOUT, REGION, local_redis, percentile, proc_usage, start_server

from rendezvous.clients._exceptions import from_rpc_error
from rendezvous.connector.launch import free_port
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc

RESULTS = Path(__file__).parent / "results"
FRONT = Path(__file__).resolve().parents[1] / "deploy" / "haproxy"
FLOODERS = 4
FLOOD_BATCH = 64
GOOD_RATE = 100.0  # the others' lifecycles per second
ROUTER_RATE = 20.0  # the router's GetStatus per second
STREAMS = 16
"""Streams per h2load connection at 1x (4 connections per flood identity): at 5x, 80, so an identity's 320 calls
in flight pass what the server lets it have in progress and waiting (32 + --max-waiting-calls, 256)."""
SAMPLE_INTERVAL_S = 0.05


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as taskset and /proc write it ("0", "0,2", "1-3,6"): its CPUs. ValueError if empty or
    malformed."""
    cpus: set[int] = set()
    for item in text.split(","):
        first, dash, last = item.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (e.g. 0 or 0,2 or 1-3)")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"not a CPU range: {item!r}")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


@dataclass(frozen=True)
class Pinning:
    """The server on `server`; every other process the benchmark starts on `clients`; redis-server with the
    server or with the clients (`redis`: "server" or "clients")."""

    server: frozenset[int]
    clients: frozenset[int]
    redis: str

    @property
    def redis_cpus(self) -> frozenset[int]:
        return self.server if self.redis == "server" else self.clients

    def describe(self) -> dict[str, Any]:
        return {
            "server_cpus": sorted(self.server),
            "client_cpus": sorted(self.clients),
            "redis_with": self.redis,
            "redis_cpus": sorted(self.redis_cpus),
            "front_cpus": sorted(self.clients),
        }


def pinning(server: str | None, clients: str | None, redis: str, allowed: frozenset[int]) -> Pinning | None:
    """The pinning that --server-cpus, --client-cpus and --redis-cpus ask for, among the CPUs this process may
    use (`allowed`); None without --server-cpus. The clients default to every allowed CPU but the server's; the
    two sets must not share a CPU (the point is a server with CPU of its own)."""
    if server is None:
        if clients is not None:
            raise ValueError("--client-cpus needs --server-cpus")
        return None
    if redis not in ("server", "clients"):
        raise ValueError(f"--redis-cpus is server or clients, not {redis!r}")
    server_cpus = parse_cpus(server)
    client_cpus = parse_cpus(clients) if clients is not None else allowed - server_cpus
    for name, cpus in (("--server-cpus", server_cpus), ("--client-cpus", client_cpus)):
        if not cpus:
            raise ValueError(f"{name}: no CPU left for it")
        if not cpus <= allowed:
            raise ValueError(f"{name}: CPUs {sorted(cpus - allowed)} are not among this process's {sorted(allowed)}")
    if server_cpus & client_cpus:
        raise ValueError(f"the server's and the clients' CPUs overlap: {sorted(server_cpus & client_cpus)}")
    return Pinning(server_cpus, client_cpus, redis)


def pin_this_process(cpus: frozenset[int]) -> None:
    """This process, each of its threads, and so every process and thread it starts from now on, on `cpus`."""
    for task in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(task), cpus)


def cpu_ticks(cpus: frozenset[int] | None) -> tuple[int, int, int]:
    """Busy, stolen and total ticks of these CPUs (every CPU for None) so far, from /proc/stat."""
    busy = steal = total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or (cpus is not None and int(name[3:]) not in cpus):
            continue
        user, nice, system, idle, iowait, irq, softirq, stolen = (int(f) for f in fields[:8])
        busy += user + nice + system + irq + softirq
        steal += stolen
        total += user + nice + system + idle + iowait + irq + softirq + stolen
    return busy, steal, total


def affinity(pid: int) -> list[int]:
    """The CPUs any thread of process `pid` may run on."""
    cpus: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            cpus |= os.sched_getaffinity(int(task))
    return sorted(cpus)


def token(name: str) -> str:
    return f"{name}-token-0123456789abcdef"


def auth_file(folder: Path) -> Path:
    """Every identity bound to its engines, role and pool, as docs/deploy.md asks."""
    tokens: dict[str, Any] = {
        token("router"): {"name": "router", "roles": ["router"]},
        token("good-d"): {"name": "good-d", "engines": ["good-d"], "engine_roles": ["consumer"], "engine_pools": ["d"]},
        token("good-p"): {"name": "good-p", "engines": ["good-p"], "engine_roles": ["producer"], "engine_pools": ["p"]},
        token("heavy"): {"name": "heavy", "engines": ["heavy"], "engine_roles": ["producer"], "engine_pools": ["p"]},
    }
    for i in range(FLOODERS):
        name = f"flood-{i}"
        tokens[token(name)] = {"name": name, "engines": [name], "engine_roles": ["producer"], "engine_pools": ["p"]}
    path = folder / "auth.json"
    path.write_text(json.dumps({"tokens": tokens}))
    return path


def credentials(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token(name)}"),)


def engine_request(engine_id: str, role: pb.EngineRole, pool: str) -> pb.RegisterEngineRequest:
    agent = pb.NixlAgent(
        name=engine_id + "-0", metadata=os.urandom(400), memory_kind=pb.MEMORY_KIND_DRAM, regions=[REGION]
    )
    return pb.RegisterEngineRequest(
        engine_id=engine_id, pool=pool, role=role, layout=LAYOUT, agents=[agent], lease_ttl={"seconds": 300}
    )


def grpc_frame(message: Any) -> bytes:
    """A message as one gRPC length-prefixed frame (uncompressed)."""
    body: bytes = message.SerializeToString()
    return struct.pack(">BI", 0, len(body)) + body


# The server and what it reports.


@dataclass
class Server:
    proc: subprocess.Popen[str]
    address: str  # where clients call: the server, or the front before it
    health: str
    metrics: str
    front_stats: Path | None = None  # the HAProxy front's stats socket, when there is one
    cpus: frozenset[int] | None = None  # the server's CPUs when it is pinned
    front_pid: int | None = None

    def refused_at_front(self) -> int:
        return 0 if self.front_stats is None else _front_renderer().refused(self.front_stats)

    def rpc_counts(self) -> Counter[tuple[str, str]]:
        """Answered calls by (method, code), and calls refused before the service as (REJECTED, reason)."""
        text = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=30).read().decode()
        counts: Counter[tuple[str, str]] = Counter()
        for line in text.splitlines():
            if line.startswith("kv_rendezvous_rpcs_total{"):
                labels, value = line[len("kv_rendezvous_rpcs_total{") :].rsplit("} ", 1)
                parsed = dict(part.split("=", 1) for part in labels.split(","))
                counts[(parsed["method"].strip('"'), parsed["code"].strip('"'))] += int(float(value))
            elif line.startswith("kv_rendezvous_rejected_calls_total{"):
                labels, value = line[len("kv_rendezvous_rejected_calls_total{") :].rsplit("} ", 1)
                reason = labels.split("=", 1)[1].strip('"')
                counts[("REJECTED", reason)] += int(float(value))
        return counts


@contextlib.contextmanager
def serving(store: str, auth: Path, flags: list[str], cpus: frozenset[int] | None) -> Iterator[Server]:
    """`kv-rendezvous serve` (bench_rendezvous.start_server) with auth, a health port and metrics, on `cpus`."""
    health, metrics = (f"127.0.0.1:{free_port()}" for _ in range(2))
    proc, address = start_server(
        store, "--health-listen", health, "--metrics-listen", metrics, "--auth-file", str(auth), *flags, cpus=cpus
    )
    try:
        yield Server(proc, address, health, metrics, cpus=cpus)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _front_renderer() -> Any:
    spec = importlib.util.spec_from_file_location("haproxy_render", FRONT / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves its annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def fronted(server: Server, folder: Path, rate_per_caller: int, options: dict[str, int]) -> Iterator[Server]:
    """The server behind an HAProxy admission front (deploy/haproxy), as clients see it."""
    render = _front_renderer()
    listen = f"127.0.0.1:{free_port()}"
    front = render.Front(listen, server.address, **{"rate_per_caller": rate_per_caller, **options})
    config = render.render(front, folder / "front")
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(config)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (folder / "front" / "stats.sock").exists():  # listening once its socket is bound
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"haproxy did not start: {proc.communicate()[1]}")
            time.sleep(0.05)
        stats = folder / "front" / "stats.sock"
        yield dataclasses.replace(server, address=listen, front_stats=stats, front_pid=proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# The flood: h2load offering ClaimTransfers batches.


async def register_flooders(address: str) -> list[bytes]:
    """Register each flood engine; the ClaimTransfers body each of them sends."""
    bodies = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RendezvousServiceStub(channel)
        for i in range(FLOODERS):
            name = f"flood-{i}"
            reg = await stub.RegisterEngine(
                engine_request(name, pb.ENGINE_ROLE_PRODUCER, "p"), metadata=credentials(name)
            )
            claims = [pb.ClaimSpec(transfer_id=f"{name}-t{j}") for j in range(FLOOD_BATCH)]
            request = pb.ClaimTransfersRequest(engine_id=name, incarnation=reg.engine.incarnation, claims=claims)
            bodies.append(grpc_frame(request))
    return bodies


def h2load(
    address: str, name: str, body: Path, seconds: float, rate: float | None, factor: float = 1.0
) -> subprocess.Popen[str]:
    """One flood identity: 4 connections of 16 streams each, closed loop, or `rate` calls/s in all with the
    streams scaled with the offered multiple (`factor`): h2load waits for a free stream, so with the same
    streams at every multiple the excess would wait in the client; scaled, it reaches the server."""
    clients = 4
    streams = math.ceil(STREAMS * max(factor, 1.0))
    command = [
        "h2load",
        f"http://{address}/rendezvous.v1.RendezvousService/ClaimTransfers",
        "-d",
        str(body),
        "-H",
        "content-type: application/grpc",
        "-H",
        "te: trailers",
        "-H",
        f"authorization: Bearer {token(name)}",
        "-c",
        str(clients),
        "-m",
        str(streams),
        "-D",
        str(round(seconds)),
    ]
    if rate is not None:
        command += ["--rps", f"{max(rate / clients, 0.1):.2f}"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# The others: paced lifecycles and a router, with every error counted.


@dataclass
class Others:
    lifecycle_ms: list[float] = field(default_factory=list)
    router_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    started: int = 0
    released: int = 0
    retries: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # the retried RESOURCE_EXHAUSTED, by ErrorInfo reason
    dropped: int = 0  # CANCELLED by the server (gRPC core's backlog drop), retried


async def call(others: Others, what: str, method: Any, request: Any, name: str) -> Any:
    """A unary call; RESOURCE_EXHAUSTED is retried after its hint and a CANCELLED sent by the server (gRPC
    core dropping a call past `grpc.server.max_pending_requests` of its method) after a back-off, as the SDK
    does; anything else counted."""
    while True:
        try:
            return await method(request, metadata=credentials(name), timeout=30)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                others.retries += 1
                refusal = from_rpc_error(err)
                by = " by the front" if refusal.metadata.get("refused_by") == "front" else ""
                others.refused[f"{what}:{refusal.reason}{by}"] += 1
                await asyncio.sleep(0.05)
                continue
            if err.code() == grpc.StatusCode.CANCELLED:
                others.dropped += 1
                await asyncio.sleep(0.05)
                continue
            others.errors[f"{what}:{err.code().name}"] += 1
            return None


async def run_others(address: str, seconds: float, run: str) -> Others:
    others = Others()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RendezvousServiceStub(channel)
        # Retried as any other call: through a front a closed-loop flood may have every slot at this moment.
        d, p = [
            await call(others, "RegisterEngine", stub.RegisterEngine, engine_request(name, role, pool), name)
            for name, role, pool in (("good-d", pb.ENGINE_ROLE_CONSUMER, "d"), ("good-p", pb.ENGINE_ROLE_PRODUCER, "p"))
        ]
        if d is None or p is None:
            raise RuntimeError(f"the others could not register: {dict(others.errors)}")
        d_inc, p_inc = d.engine.incarnation, p.engine.incarnation
        d_watch = stub.Watch(
            pb.WatchRequest(engine_id="good-d", start_sequence=d.watch_start_sequence), metadata=credentials("good-d")
        )
        p_watch = stub.Watch(
            pb.WatchRequest(engine_id="good-p", start_sequence=p.watch_start_sequence), metadata=credentials("good-p")
        )
        await d_watch.read()
        await p_watch.read()
        sent: dict[str, float] = {}  # lifecycles not yet committed or aborted
        drained = asyncio.Event()  # set once every lifecycle was issued and none is left in `sent`
        issuing = True

        def ended(transfer_id: str) -> float | None:
            began = sent.pop(transfer_id, None)
            if not sent and not issuing:
                drained.set()
            return began

        pending: set[asyncio.Task[Any]] = set()

        def background(coro: Any) -> None:
            task = asyncio.ensure_future(coro)
            pending.add(task)
            task.add_done_callback(pending.discard)

        async def producer_events() -> None:
            while True:
                response = await p_watch.read()
                if response is grpc.aio.EOF:
                    return
                done = [e for e in response.events if e.type == pb.EVENT_TYPE_TRANSFER_ASSIGNED]
                if done:
                    request = pb.CompleteTransfersRequest(
                        engine_id="good-p",
                        incarnation=p_inc,
                        completions=[
                            pb.CompletionSpec(
                                transfer_id=e.transfer.transfer_id,
                                generation=e.generation,
                                outcome=pb.COMPLETION_OUTCOME_SUCCEEDED,
                            )
                            for e in done
                        ],
                    )
                    background(call(others, "CompleteTransfers", stub.CompleteTransfers, request, "good-p"))

        async def consumer_events() -> None:
            while True:
                response = await d_watch.read()
                if response is grpc.aio.EOF:
                    return
                now = time.monotonic()
                committed = [e for e in response.events if e.type == pb.EVENT_TYPE_TRANSFER_COMMITTED]
                for e in committed:
                    began = ended(e.transfer.transfer_id)
                    if began is not None:
                        others.lifecycle_ms.append((now - began) * 1e3)
                for e in response.events:
                    if e.type == pb.EVENT_TYPE_TRANSFER_ABORTED:
                        others.errors["aborted:" + pb.AbortReason.Name(e.transfer.abort_reason)] += 1
                        ended(e.transfer.transfer_id)
                if committed:
                    request = pb.ReleaseTargetsRequest(
                        engine_id="good-d",
                        incarnation=d_inc,
                        releases=[
                            pb.ReleaseSpec(transfer_id=e.transfer.transfer_id, generation=e.generation)
                            for e in committed
                        ],
                    )

                    async def release(request: pb.ReleaseTargetsRequest = request, n: int = len(committed)) -> None:
                        if await call(others, "ReleaseTargets", stub.ReleaseTargets, request, "good-d") is not None:
                            others.released += n

                    background(release())

        async def lifecycle(transfer_id: str) -> None:
            sent[transfer_id] = time.monotonic()
            others.started += 1
            target = pb.RegisterTargetsRequest(
                engine_id="good-d",
                incarnation=d_inc,
                targets=[pb.TargetSpec(transfer_id=transfer_id, block_ids=range(4), generation=1)],
            )
            claim = pb.ClaimTransfersRequest(
                engine_id="good-p", incarnation=p_inc, claims=[pb.ClaimSpec(transfer_id=transfer_id)]
            )
            await asyncio.gather(
                call(others, "RegisterTargets", stub.RegisterTargets, target, "good-d"),
                call(others, "ClaimTransfers", stub.ClaimTransfers, claim, "good-p"),
            )

        async def router() -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                began = time.monotonic()
                if await call(others, "GetStatus", stub.GetStatus, pb.GetStatusRequest(), "router") is not None:
                    others.router_ms.append((time.monotonic() - began) * 1e3)
                await asyncio.sleep(max(0.0, began + 1 / ROUTER_RATE - time.monotonic()))

        readers = [asyncio.create_task(producer_events()), asyncio.create_task(consumer_events())]
        routing = asyncio.create_task(router())
        start = time.monotonic()
        for i in range(int(GOOD_RATE * seconds)):
            await asyncio.sleep(max(0.0, start + i / GOOD_RATE - time.monotonic()))
            background(lifecycle(f"{run}-{i}"))
        await routing
        issuing = False
        if not sent:
            drained.set()
        # Every lifecycle ends committed or aborted (a half whose call failed is aborted at its deadline).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(drained.wait(), 90)
        await asyncio.gather(*pending)
        others.errors["unfinished"] += len(sent)
        for task in readers:
            task.cancel()
        d_watch.cancel()
        p_watch.cancel()
        for name, incarnation in (("good-d", d_inc), ("good-p", p_inc)):
            request = pb.DeregisterEngineRequest(engine_id=name, incarnation=incarnation)
            await call(others, "DeregisterEngine", stub.DeregisterEngine, request, name)
    return others


# The heavy identity: maximum-size CompleteTransfers requests, back to back.


@dataclass(frozen=True)
class Usage:
    """CPU used so far: by the server's and the front's processes (seconds), on the server's and the clients' CPUs
    (busy, stolen and total ticks)."""

    at: float
    server_s: float
    front_s: float
    server_cpus: tuple[int, int, int]
    client_cpus: tuple[int, int, int]

    def since(self, start: Usage) -> dict[str, float]:
        """Utilizations from `start` to this one, as the results name them."""
        seconds = self.at - start.at
        busy, steal, total = (now - then for now, then in zip(self.server_cpus, start.server_cpus, strict=True))
        client_busy, _, client_total = (
            now - then for now, then in zip(self.client_cpus, start.client_cpus, strict=True)
        )
        return {
            "cpu_window_s": seconds,
            "server_cpu_util": (self.server_s - start.server_s) / seconds,
            "front_cpu_util": (self.front_s - start.front_s) / seconds,
            "server_cpus_busy": busy / max(total, 1),
            "server_cpus_steal": steal / max(total, 1),
            # The CPUs of the clients, the front and the heavy sender (every CPU when the server is not pinned).
            "client_cpus_busy": client_busy / max(client_total, 1),
        }


def _ticks_since(now: tuple[int, int, int], then: tuple[int, int, int]) -> tuple[int, int, int]:
    busy, steal, total = (a - b for a, b in zip(now, then, strict=True))
    return busy, steal, total


def usage(server: Server, clients: frozenset[int] | None) -> Usage:
    return Usage(
        at=time.monotonic(),
        server_s=proc_usage(server.proc.pid)[0],
        front_s=0.0 if server.front_pid is None else proc_usage(server.front_pid)[0],
        server_cpus=cpu_ticks(server.cpus),
        client_cpus=cpu_ticks(clients),
    )


def heavy_request(incarnation: int, max_bytes: int) -> pb.CompleteTransfersRequest:
    """Completions of 4,096 parts each for unknown ids, as many as fit in max_bytes."""
    parts = [pb.WrittenPart(first_layer=layer, num_layers=1, first_token=0, num_tokens=16) for layer in range(4096)]
    one = pb.CompletionSpec(transfer_id="heavy-x", generation=1, outcome=pb.COMPLETION_OUTCOME_SUCCEEDED, parts=parts)
    count = max(1, (max_bytes - 64) // (one.ByteSize() + 8))
    completions = [
        pb.CompletionSpec(transfer_id=f"heavy-{i}", generation=1, outcome=pb.COMPLETION_OUTCOME_SUCCEEDED, parts=parts)
        for i in range(count)
    ]
    return pb.CompleteTransfersRequest(engine_id="heavy", incarnation=incarnation, completions=completions)


async def run_heavy(address: str, ready: Any, go: Any, stop: Any, max_bytes: int) -> dict[str, Any]:
    """The heavy identity: registers and builds its request, says it is ready, and sends from `go` until `stop`
    (multiprocessing Events)."""
    codes: Counter[str] = Counter()
    hints = 0  # RESOURCE_EXHAUSTED answers with a google.rpc.RetryInfo
    call_s: list[float] = []
    options = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = pb_grpc.RendezvousServiceStub(channel)
        # Registered (and deregistered) with the others' retry: through a front the flood may hold every slot.
        setup = Others()
        reg = await call(
            setup, "RegisterEngine", stub.RegisterEngine, engine_request("heavy", pb.ENGINE_ROLE_PRODUCER, "p"), "heavy"
        )
        if reg is None:
            raise RuntimeError(f"the heavy identity could not register: {dict(setup.errors)}")
        request = heavy_request(reg.engine.incarnation, max_bytes)
        # Serialized once: on a shared machine, serializing 4 MiB of parts per call (~20 ms) would take CPU
        # from the server and be counted as the server's cost.
        body = request.SerializeToString()
        complete = channel.unary_unary("/rendezvous.v1.RendezvousService/CompleteTransfers")
        ready.set()
        await asyncio.to_thread(go.wait)
        while not stop.is_set():  # a multiprocessing Event: read between calls only
            began = time.monotonic()
            try:
                await complete(body, metadata=credentials("heavy"), timeout=60)
                codes["OK"] += 1
            except grpc.aio.AioRpcError as err:
                codes[err.code().name] += 1
                if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    hints += from_rpc_error(err).retry_after is not None
                    await asyncio.sleep(0.05)  # not the hint: the worst case, a sender that ignores it
            call_s.append(time.monotonic() - began)
        leave = pb.DeregisterEngineRequest(engine_id="heavy", incarnation=reg.engine.incarnation)
        await call(setup, "DeregisterEngine", stub.DeregisterEngine, leave, "heavy")
    return {
        "request_mib": len(body) / 2**20,
        "codes": dict(codes),
        "retry_hints": hints,
        "max_call_s": max(call_s, default=0.0),
    }


def heavy_main(address: str, ready: Any, go: Any, stop: Any, max_bytes: int, out: Any) -> None:
    """The heavy identity in a process of its own, so that building its requests slows no one else here."""
    out.put(asyncio.run(run_heavy(address, ready, go, stop, max_bytes)))


def sample_flood(address: str, body: bytes, until: float, out: dict[str, Any]) -> None:
    """A flood identity's call every SAMPLE_INTERVAL_S, read by a client that sees its answer (h2load does not):
    whether a refusal carries a retry hint (google.rpc.RetryInfo). Its calls queue with that identity's flood."""
    codes: Counter[str] = Counter()
    with grpc.insecure_channel(address) as channel:
        claim = channel.unary_unary("/rendezvous.v1.RendezvousService/ClaimTransfers")
        while time.monotonic() < until:
            try:
                claim(body, metadata=credentials("flood-0"), timeout=10)
                codes["OK"] += 1
            except grpc.RpcError as err:
                error = from_rpc_error(err)
                hint = " with retry hint" if error.retry_after is not None else " without retry hint"
                codes[error.code.name + (hint if error.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "")] += 1
            time.sleep(SAMPLE_INTERVAL_S)
    out.update(codes)


# Health and memory, from threads of their own.


def probe_health(address: str, stop: threading.Event, out: dict[str, Any]) -> None:
    failures, probes, worst = 0, 0, 0.0
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            began = time.monotonic()
            probes += 1
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=1.0)
                failures += answer.status != health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                failures += 1
            worst = max(worst, time.monotonic() - began)
            stop.wait(0.1)
    out.update(probes=probes, failures=failures, worst_ms=worst * 1e3)


def sample_rss(pid: int, stop: threading.Event, out: dict[str, Any]) -> None:
    peak = 0
    while not stop.is_set():
        peak = max(peak, proc_usage(pid)[1])
        stop.wait(0.1)
    out["peak_rss_mib"] = peak / 2**20


def phase(
    server: Server,
    bodies: list[Path],
    seconds: float,
    rate: float | None,
    heavy_bytes: int,
    run: str,
    others_too: bool,
    factor: float = 1.0,
) -> dict[str, Any]:
    """One phase: the flood at `rate` calls/s in all (None: closed loop), the others (if others_too), heavy (if
    heavy_bytes), probes."""
    heavy_process: Any = None
    if others_too and heavy_bytes:
        # Started, registered and its request built before the phase: a process's start-up and a 4 MiB request's
        # building take ~0.5 s of CPU, which the flood's clients and the front (pinned beside it) would lose.
        ctx = mp.get_context("spawn")
        heavy_ready, heavy_go, heavy_stop, heavy_out = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
        heavy_process = ctx.Process(
            target=heavy_main, args=(server.address, heavy_ready, heavy_go, heavy_stop, heavy_bytes, heavy_out)
        )
        heavy_process.start()
        if not heavy_ready.wait(timeout=120):
            heavy_process.kill()
            raise RuntimeError("the heavy identity did not get ready")
    before = server.rpc_counts()
    refused_before = server.refused_at_front()
    clients = None if server.cpus is None else frozenset(os.sched_getaffinity(0))
    stop = threading.Event()
    health: dict[str, Any] = {}
    serving_health: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    sampled: dict[str, Any] = {}
    threads = [
        threading.Thread(target=probe_health, args=(server.health, stop, health), daemon=True),
        threading.Thread(target=probe_health, args=(server.address, stop, serving_health), daemon=True),
        threading.Thread(target=sample_rss, args=(server.proc.pid, stop, memory), daemon=True),
    ]
    if rate is not None:
        body = bodies[0].read_bytes()[5:]  # the message, without its gRPC frame header
        threads.append(
            threading.Thread(
                target=sample_flood, args=(server.address, body, time.monotonic() + seconds, sampled), daemon=True
            )
        )
    for t in threads:
        t.start()
    floods = [
        h2load(server.address, f"flood-{i}", body, seconds, None if rate is None else rate / len(bodies), factor)
        for i, body in enumerate(bodies)
    ]
    began = time.monotonic()
    # CPU use over the flood's own seconds: the phase lasts longer while the others' last lifecycles and the heavy
    # sender's last call (held up to a second) end, when the server has little left to do.
    start = usage(server, clients)
    ends: list[Usage] = []
    window = threading.Timer(seconds, lambda: ends.append(usage(server, clients)))
    window.start()
    heavy: dict[str, Any] = {"request_mib": 0.0, "codes": {}, "retry_hints": 0, "max_call_s": 0.0}
    others: Others | None = None
    if others_too:
        if heavy_process is not None:
            heavy_go.set()
        others = asyncio.run(run_others(server.address, seconds, run))
        if heavy_process is not None:
            heavy_stop.set()
            heavy = heavy_out.get(timeout=120)
            heavy_process.join(timeout=30)
    clients_saw = [flood.communicate(timeout=seconds + 120)[0] for flood in floods]
    elapsed = time.monotonic() - began
    stop.set()
    for t in threads:
        t.join()
    window.join()
    used = (ends[0] if ends else usage(server, clients)).since(start)
    after = server.rpc_counts()
    refused_at_front = server.refused_at_front() - refused_before
    delta = Counter({k: after[k] - before[k] for k in after if after[k] != before[k]})
    flood_codes = {code: n for (method, code), n in delta.items() if method == "ClaimTransfers"}
    rejected = {reason: n for (method, reason), n in delta.items() if method == "REJECTED"}
    shed = flood_codes.get("RESOURCE_EXHAUSTED", 0)
    # Answered by the service: not refused, nor given up by the client (h2load cancels what is in flight as it ends).
    admitted = sum(n for code, n in flood_codes.items() if code not in ("RESOURCE_EXHAUSTED", "CANCELLED"))
    result: dict[str, Any] = {
        "offered_calls_per_s": rate,
        "seconds": elapsed,
        # Over the flood's own seconds: the phase lasts longer while the others' last lifecycles end.
        "flood_admitted_per_s": admitted / seconds,
        "flood_shed_per_s": shed / seconds,
        "flood_codes": flood_codes,
        "rejected_before_service": rejected,
        "refused_at_front": refused_at_front,
        "flood_sampled": sampled,
        "h2load_requests": [
            next((ln.strip() for ln in out.splitlines() if ln.startswith("requests:")), "") for out in clients_saw
        ],
        **used,
        "health_port": health,
        "serving_port_health": serving_health,
        **memory,
    }
    if others is not None:
        result["others"] = {
            "lifecycles_started": others.started,
            "lifecycles_released": others.released,
            "lifecycle_p50_ms": percentile(others.lifecycle_ms, 0.5),
            "lifecycle_p99_ms": percentile(others.lifecycle_ms, 0.99),
            "router_p99_ms": percentile(others.router_ms, 0.99),
            "retried_after_resource_exhausted": others.retries,
            "refused_by_reason": dict(others.refused),
            "retried_after_cancelled": others.dropped,
            "errors": dict(others.errors),
        }
        result["heavy"] = heavy
    return result


def run_store(store: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    auth = auth_file(folder)
    pinned: Pinning | None = args.pinning
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(serving(store, auth, args.serve_flag, None if pinned is None else pinned.server))
        server_affinity = affinity(server.proc.pid)
        bodies = []
        for i, body in enumerate(asyncio.run(register_flooders(server.address))):
            path = folder / f"flood-{i}.bin"
            path.write_bytes(body)
            bodies.append(path)
        capacity = phase(server, bodies, args.seconds, None, 0, "capacity", others_too=False)
        calls_per_s = capacity["flood_admitted_per_s"]
        print(f"{store_name(store):>6} capacity: {calls_per_s:,.0f} ClaimTransfers calls/s of {FLOOD_BATCH} items")
        # The others' share of the server, measured on the server itself (the front limits a closed-loop flood).
        beside_direct = beside = phase(server, bodies, args.seconds, None, 0, "beside", others_too=True)
        if args.front == "haproxy":
            print(f"{store_name(store):>6} capacity beside the others, direct: {beside['flood_admitted_per_s']:,.0f}")
            # A caller past twice a flood identity's share of capacity, or 4x the others' pace, waits behind the rest.
            share = max(2 * calls_per_s / FLOODERS, 4 * GOOD_RATE)
            server = stack.enter_context(fronted(server, folder, round(share), front_options(args.front_option)))
            # What is left of it beside the others' paced load (and no heavy sender): the most the flood can get.
            beside = phase(server, bodies, args.seconds, None, 0, "beside-front", others_too=True)
        beside_per_s = beside["flood_admitted_per_s"]
        print(f"{store_name(store):>6} capacity beside the others: {beside_per_s:,.0f} calls/s")
        phases = []
        for factor in args.factors:
            result = phase(
                server,
                bodies,
                args.seconds,
                factor * calls_per_s,
                args.heavy_bytes,
                f"x{factor:g}",
                others_too=True,
                factor=factor,
            )
            result["factor"] = factor
            result["of_capacity"] = result["flood_admitted_per_s"] / calls_per_s
            result["of_capacity_beside_others"] = result["flood_admitted_per_s"] / beside_per_s
            result["of_capacity_others_included"] = admitted_in_all(
                result["flood_admitted_per_s"], calls_per_s, beside_direct["flood_admitted_per_s"]
            )
            phases.append(result)
            report(store, result)
    return {
        "store": store_name(store),
        "front": args.front,
        "server_affinity": server_affinity,
        "capacity_calls_per_s": calls_per_s,
        "capacity_beside_others_calls_per_s": beside_per_s,
        "capacity": capacity,
        "capacity_beside_others": beside,
        "capacity_beside_others_direct": beside_direct,
        "phases": phases,
    }


def front_options(options: list[str]) -> dict[str, int]:
    """--front-option max_calls=64 ...: fields of deploy/haproxy/render.py's Front, integers."""
    parsed = {}
    for option in options:
        name, equals, value = option.partition("=")
        if not equals or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"not NAME=INTEGER: {option!r}")
        parsed[name.strip().replace("-", "_")] = int(value)
    return parsed


def admitted_in_all(flood_per_s: float, capacity_per_s: float, beside_per_s: float) -> float:
    """The load admitted in all, the others' included, as a share of capacity: the flood's admitted calls/s plus
    what the others' paced load takes of the server, counted in flood calls/s as the capacity it leaves the flood
    (capacity alone less capacity beside them, both closed loop on the server itself), over capacity."""
    return (flood_per_s + capacity_per_s - beside_per_s) / capacity_per_s


def store_name(store: str) -> str:
    """memory, or redis for a Redis URL (a local unix socket included)."""
    return "memory" if store == "memory" else "redis"


def report(store: str, r: dict[str, Any]) -> None:
    o = r["others"]
    print(
        f"{store_name(store):>6} x{r['factor']:g}: flood admitted {r['flood_admitted_per_s']:,.0f}/s "
        f"({r['of_capacity']:.0%} of capacity, {r['of_capacity_beside_others']:.0%} beside the others, "
        f"{r['of_capacity_others_included']:.0%} with the others' share), shed "
        f"{r['flood_shed_per_s']:,.0f}/s {r['rejected_before_service']}, refused at the front "
        f"{r['refused_at_front'] / r['seconds']:,.0f}/s, sampled {r['flood_sampled']}; "
        f"others {o['lifecycles_released']}/{o['lifecycles_started']} released, "
        f"p50 {o['lifecycle_p50_ms']:.1f} ms p99 {o['lifecycle_p99_ms']:.1f} ms, "
        f"router p99 {o['router_p99_ms']:.1f} ms, "
        f"dropped by gRPC (CANCELLED) and retried {o['retried_after_cancelled']}, "
        f"errors {o['errors'] or 'none'}; health failures {r['health_port']['failures']}/{r['health_port']['probes']} "
        f"(serving port {r['serving_port_health']['failures']}/{r['serving_port_health']['probes']}); heavy "
        f"{r['heavy']['request_mib']:.1f} MiB x {sum(r['heavy']['codes'].values())} {r['heavy']['codes']} "
        f"({r['heavy']['retry_hints']} retry hints); "
        f"server CPU {r['server_cpu_util']:.0%} (its CPUs busy {r['server_cpus_busy']:.0%}, stolen "
        f"{r['server_cpus_steal']:.0%}; front {r['front_cpu_util']:.0%}; the clients' CPUs busy "
        f"{r['client_cpus_busy']:.0%}), peak RSS {r['peak_rss_mib']:.0f} MiB"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default="memory", choices=["memory", "redis"])
    parser.add_argument("--compare", action="store_true", help="memory, then Redis")
    parser.add_argument("--seconds", type=int, default=8, help="length of each phase")
    parser.add_argument("--factors", default="1,2,5", help="offered load as multiples of the measured capacity")
    parser.add_argument(
        "--heavy-bytes",
        type=int,
        default=4 << 20,
        help="size of the heavy identity's requests (the server's maximum); 0: no heavy identity",
    )
    parser.add_argument("--serve-flag", action="append", default=[], help="a flag passed to serve (repeatable)")
    parser.add_argument(
        "--front", default="none", choices=["none", "haproxy"], help="an admission front before the server"
    )
    parser.add_argument(
        "--front-option",
        action="append",
        default=[],
        help="NAME=INTEGER, a field of deploy/haproxy/render.py's Front (e.g. max_calls=64; repeatable)",
    )
    parser.add_argument("--server-cpus", help="CPU list for the server alone (taskset syntax: 0, 0-1, 0,2)")
    parser.add_argument("--client-cpus", help="CPU list for everything else (default: every CPU but the server's)")
    parser.add_argument(
        "--redis-cpus", default="server", choices=["server", "clients"], help="redis-server beside the server or not"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "overload.json", help="results file")
    args = parser.parse_args()
    args.factors = [float(f) for f in args.factors.split(",")]
    try:
        front_options(args.front_option)
        args.pinning = pinning(args.server_cpus, args.client_cpus, args.redis_cpus, frozenset(os.sched_getaffinity(0)))
    except ValueError as err:
        parser.error(str(err))
    if args.pinning is not None:
        if shutil.which("taskset") is None:
            raise SystemExit("taskset not found: apt-get install util-linux")
        pin_this_process(args.pinning.clients)
    if shutil.which("h2load") is None:
        raise SystemExit("h2load not found: apt-get install nghttp2-client")
    if args.front == "haproxy" and shutil.which("haproxy") is None:
        raise SystemExit("haproxy not found: apt-get install haproxy")
    stores = ["memory", "redis"] if args.compare else [args.store]
    runs = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        for store in stores:
            redis_cpus = None if args.pinning is None else args.pinning.redis_cpus
            url = stack.enter_context(local_redis(redis_cpus)) if store == "redis" else "memory"
            runs.append(run_store(url, args, Path(tmp)))
    result = {
        "benchmark": "overload",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
        "serve_flags": args.serve_flag,
        "front": args.front,
        "front_options": front_options(args.front_option),
        "pinning": None if args.pinning is None else args.pinning.describe(),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    lost = sum(p["others"]["errors"].get("unfinished", 0) for run in runs for p in run["phases"])
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
