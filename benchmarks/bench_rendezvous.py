"""Lifecycle benchmark: simulated producer and consumer engines drive full transfer lifecycles over real gRPC.

Processes: the server (`kv-rendezvous serve`), a consumer engine and a producer engine (asyncio, raw stubs),
and for the floor a bare gRPC server with an empty unary method and a server stream. One run measures:

  floor       empty unary RPCs/s (16 in flight) and server-stream messages/s: what Python gRPC allows here
  throughput  lifecycles/s with batching (target, claim, assignment event, complete, commit event, release)
  latency     at a fixed rate: time from the second half's send to the producer holding TRANSFER_ASSIGNED

plus server CPU seconds and RSS, and that no live engine or transfer remains afterwards.

    python benchmarks/bench_rendezvous.py [--batch 64] [--rate 1000] [--store memory|redis] [--replicas N]
    python benchmarks/bench_rendezvous.py --compare      # memory vs Redis vs 2 Redis replicas, one run
    python benchmarks/bench_rendezvous.py --profile benchmarks/results   # py-spy of the throughput phase

With --profile, py-spy (the dev extra) samples each server replica during the throughput phase only and writes
a speedscope profile per configuration (`profile-<config>.speedscope.json`, open it at speedscope.app).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import grpc

from rendezvous.connector.launch import free_port
from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc

RESULTS = Path(__file__).parent / "results"
LAYOUT = pb.KvLayout(model_fingerprint="bench", dtype="float16", block_size=16, num_layers=32, tp_size=1, pp_size=1)
REGION = pb.KvRegion(base_address=1 << 32, block_stride_bytes=1 << 16, block_length_bytes=1 << 16, num_blocks=100_000)


def proc_usage(pid: int) -> tuple[float, int]:
    """CPU seconds (user+system) and RSS bytes of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, rss


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# The gRPC floor: a bare server in its own process.


def _floor_server(port: int, ready: Any) -> None:
    async def main() -> None:
        server = grpc.aio.server()

        async def unary(request: bytes, context: Any) -> bytes:
            return b""

        async def stream(request: bytes, context: Any) -> Any:
            for _ in range(int(request or b"0")):
                yield b""

        handler = grpc.method_handlers_generic_handler(
            "floor.Floor",
            {
                "Unary": grpc.unary_unary_rpc_method_handler(unary),
                "Stream": grpc.unary_stream_rpc_method_handler(stream),
            },
        )
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


async def measure_floor(port: int, seconds: float) -> dict[str, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = channel.unary_unary("/floor.Floor/Unary")
        stream = channel.unary_stream("/floor.Floor/Stream")
        await unary(b"")
        count = 0
        end = time.monotonic() + seconds

        async def worker() -> None:
            nonlocal count
            while time.monotonic() < end:
                await unary(b"")
                count += 1

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(16)))
        unary_rate = count / (time.monotonic() - start)
        n = 50_000
        start = time.monotonic()
        received = 0
        async for _ in stream(str(n).encode()):
            received += 1
        stream_rate = received / (time.monotonic() - start)
    return {"unary_rpcs_per_s": unary_rate, "stream_msgs_per_s": stream_rate}


# Simulated engines.


def engine_request(engine_id: str, role: pb.EngineRole) -> pb.RegisterEngineRequest:
    agent = pb.NixlAgent(
        name=engine_id + "-0", metadata=os.urandom(400), memory_kind=pb.MEMORY_KIND_DRAM, regions=[REGION]
    )
    # A lease longer than any phase: renewals are not what this benchmark measures.
    return pb.RegisterEngineRequest(
        engine_id=engine_id,
        pool=engine_id.split("-")[0],
        role=role,
        layout=LAYOUT,
        agents=[agent],
        lease_ttl={"seconds": 300},
    )


async def _engine(role: str, address: str, plan: dict[str, Any], go: Any, out: Any) -> None:
    """One simulated engine: issues its half of every transfer and reacts to its events."""
    consumer = role == "consumer"
    engine_id = f"{role}-{os.getpid()}"
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RendezvousServiceStub(channel)
        reg = await stub.RegisterEngine(
            engine_request(engine_id, pb.ENGINE_ROLE_CONSUMER if consumer else pb.ENGINE_ROLE_PRODUCER)
        )
        inc = reg.engine.incarnation
        watch = stub.Watch(pb.WatchRequest(engine_id=engine_id, start_sequence=reg.watch_start_sequence))
        await watch.read()
        out.put(("ready", role))
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        sent: dict[str, float] = {}
        assigned_at: dict[str, float] = {}
        finished = 0
        window = asyncio.Semaphore(plan["window"])
        total, batch, rate = plan["total"], plan["batch"], plan["rate"]
        done = asyncio.Event()

        async def issue() -> None:
            start = time.monotonic()
            for first in range(0, total, batch):
                ids = [f"{plan['run']}-{i}" for i in range(first, min(total, first + batch))]
                for _ in ids:
                    await window.acquire()
                if rate:
                    delay = start + first / rate - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                now = time.monotonic()
                for t in ids:
                    sent[t] = now
                if consumer:
                    await stub.RegisterTargets(
                        pb.RegisterTargetsRequest(
                            engine_id=engine_id,
                            incarnation=inc,
                            targets=[pb.TargetSpec(transfer_id=t, block_ids=range(4), generation=1) for t in ids],
                        )
                    )
                else:
                    await stub.ClaimTransfers(
                        pb.ClaimTransfersRequest(
                            engine_id=engine_id, incarnation=inc, claims=[pb.ClaimSpec(transfer_id=t) for t in ids]
                        )
                    )

        pending: set[asyncio.Task[Any]] = set()

        def background(call: Any) -> None:
            """Send a follow-up without holding up the event stream (an engine's writer does this off-thread)."""
            task = asyncio.ensure_future(call)
            pending.add(task)
            task.add_done_callback(pending.discard)

        async def react() -> None:
            nonlocal finished
            while True:
                response = await watch.read()
                now = time.monotonic()
                if consumer:
                    committed = [
                        e.transfer.transfer_id for e in response.events if e.type == pb.EVENT_TYPE_TRANSFER_COMMITTED
                    ]
                    if committed:
                        background(
                            stub.ReleaseTargets(
                                pb.ReleaseTargetsRequest(
                                    engine_id=engine_id,
                                    incarnation=inc,
                                    releases=[pb.ReleaseSpec(transfer_id=t, generation=1) for t in committed],
                                )
                            )
                        )
                    progressed = committed
                else:
                    assigned = [e for e in response.events if e.type == pb.EVENT_TYPE_TRANSFER_ASSIGNED]
                    for e in assigned:
                        assigned_at[e.transfer.transfer_id] = now
                    if assigned:
                        background(
                            stub.CompleteTransfers(
                                pb.CompleteTransfersRequest(
                                    engine_id=engine_id,
                                    incarnation=inc,
                                    completions=[
                                        pb.CompletionSpec(
                                            transfer_id=e.transfer.transfer_id,
                                            generation=e.generation,
                                            outcome=pb.COMPLETION_OUTCOME_SUCCEEDED,
                                        )
                                        for e in assigned
                                    ],
                                )
                            )
                        )
                    progressed = [e.transfer.transfer_id for e in assigned]
                for _ in progressed:
                    window.release()
                finished += len(progressed)
                if finished >= total:
                    done.set()
                    return

        started = time.monotonic()
        reactor = asyncio.create_task(react())
        await issue()
        await asyncio.wait_for(done.wait(), plan["timeout"])
        await asyncio.gather(*pending)
        elapsed = time.monotonic() - started
        watch.cancel()
        reactor.cancel()
        await stub.DeregisterEngine(pb.DeregisterEngineRequest(engine_id=engine_id, incarnation=inc))
        out.put((role, {"sent": sent, "assigned_at": assigned_at, "elapsed": elapsed, "finished": finished}))


def _engine_process(role: str, address: str, plan: dict[str, Any], go: Any, out: Any) -> None:
    asyncio.run(_engine(role, address, plan, go, out))


def servers_usage(pids: list[int]) -> tuple[float, int]:
    """CPU seconds and RSS bytes summed over the server replicas."""
    usages = [proc_usage(pid) for pid in pids]
    return sum(u[0] for u in usages), sum(u[1] for u in usages)


def run_phase(addresses: list[str], plan: dict[str, Any], server_pids: list[int]) -> dict[str, Any]:
    """The consumer talks to the first replica, the producer to the last (the same one when there is one)."""
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_engine_process, args=(role, address, plan, go, out))
        for role, address in (("consumer", addresses[0]), ("producer", addresses[-1]))
    ]
    for p in procs:
        p.start()
    for _ in procs:
        assert out.get(timeout=60)[0] == "ready"
    cpu0, _ = servers_usage(server_pids)
    wall0 = time.monotonic()
    go.set()
    results = dict(out.get(timeout=plan["timeout"] + 60) for _ in procs)
    wall = time.monotonic() - wall0
    cpu1, rss = servers_usage(server_pids)
    for p in procs:
        p.join(timeout=30)
    consumer, producer = results["consumer"], results["producer"]
    latencies = [
        (at - max(consumer["sent"][t], producer["sent"][t])) * 1e3 for t, at in producer["assigned_at"].items()
    ]
    return {
        "transfers": plan["total"],
        "batch": plan["batch"],
        "offered_rate": plan["rate"] or None,
        "lifecycles_per_s": consumer["finished"] / consumer["elapsed"],
        "assign_latency_ms": {
            "p50": percentile(latencies, 0.50),
            "p99": percentile(latencies, 0.99),
            "mean": statistics.fmean(latencies) if latencies else float("nan"),
        },
        "server_cpu_s": cpu1 - cpu0,
        "server_cpu_util": (cpu1 - cpu0) / wall,
        "server_rss_mib": rss / 2**20,
    }


def live_state(address: str) -> dict[str, int]:
    with grpc.insecure_channel(address) as channel:
        status = pb_grpc.RendezvousServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
    live = {k: v for k, v in status.transfers_by_state.items() if k not in ("RELEASED", "ABORTED")}
    return {"live_engines": status.live_engines, "live_transfers": sum(live.values())}


def on_cpus(cpus: Collection[int] | None) -> list[str]:
    """The command prefix that runs a program, every thread it will start included, on these CPUs only
    (`taskset`, which sets the affinity before the program starts); none for None."""
    return [] if cpus is None else ["taskset", "--cpu-list", ",".join(str(cpu) for cpu in sorted(cpus))]


def start_server(store: str, *flags: str, cpus: Collection[int] | None = None) -> tuple[subprocess.Popen[str], str]:
    """`kv-rendezvous serve` on a free port with this store (and extra serve flags), on `cpus` if given."""
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            *on_cpus(cpus),
            sys.executable,
            "-m",
            "rendezvous.cli",
            "serve",
            "--listen",
            address,
            "--store",
            store,
            "--metrics-listen",
            "off",
            "--drain",
            "0",
            "--log-level",
            "warning",
            *flags,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and "serving on" in proc.stdout.readline()
    return proc, address


@contextlib.contextmanager
def local_redis(cpus: Collection[int] | None = None) -> Iterator[str]:
    """A throwaway redis-server on a unix socket (no persistence), on `cpus` if given."""
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "redis.sock"
        proc = subprocess.Popen(
            [
                *on_cpus(cpus),
                "redis-server",
                "--port",
                "0",
                "--unixsocket",
                str(sock),
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while not sock.exists():
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.01)
            yield f"unix://{sock}"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


@contextlib.contextmanager
def profiled(pids: list[int], out: Path | None, name: str) -> Iterator[None]:
    """Sample the server replicas with py-spy while the block runs (nothing when out is None)."""
    if out is None:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    spies = [
        subprocess.Popen(
            [
                str(Path(sys.executable).with_name("py-spy")),
                "record",
                "--pid",
                str(pid),
                "--rate",
                "200",
                "--nonblocking",
                "--format",
                "speedscope",
                "--output",
                str(out / f"profile-{name}{'-' + str(i) if len(pids) > 1 else ''}.speedscope.json"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i, pid in enumerate(pids)
    ]
    time.sleep(1)  # py-spy attaches
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(2)  # SIGINT: py-spy writes its profile and exits
            spy.wait(timeout=60)


def run_config(config: str, args: argparse.Namespace, redis_url: str | None) -> dict[str, Any]:
    """One store configuration, `memory`, `redis` or `redis:N` (N replicas on one Redis): both phases."""
    kind, _, replicas = config.partition(":")
    store = "memory" if kind == "memory" else redis_url
    if store is None or (kind == "memory" and replicas):
        raise SystemExit(f"unknown configuration {config!r}: use memory, redis or redis:N")
    servers = [start_server(store) for _ in range(int(replicas or 1))]
    addresses, pids = [a for _, a in servers], [p.pid for p, _ in servers]
    try:
        with profiled(pids, args.profile, config.replace(":", "-")):
            through = run_phase(
                addresses,
                {
                    "run": f"{config}-tp",
                    "total": args.transfers,
                    "batch": args.batch,
                    "window": args.window,
                    "rate": 0,
                    "timeout": 300,
                },
                pids,
            )
        latency_total = int(args.rate * args.latency_seconds)
        paced = run_phase(
            addresses,
            # One batch per 10 ms engine step.
            {
                "run": f"{config}-lat",
                "total": latency_total,
                "batch": max(1, int(args.rate / 100)),
                "window": latency_total,
                "rate": args.rate,
                "timeout": 300,
            },
            pids,
        )
        after = live_state(addresses[0])
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(timeout=30)
    return {"config": config, "replicas": len(servers), "throughput": through, "latency": paced, "after_run": after}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", default="memory", choices=["memory", "redis"], help="store of a single run")
    parser.add_argument("--replicas", type=int, default=1, help="server replicas (Redis store only)")
    parser.add_argument("--compare", action="store_true", help="run memory, redis and redis with 2 replicas")
    parser.add_argument("--redis-url", help="use this Redis instead of starting a local redis-server")
    parser.add_argument("--transfers", type=int, default=30_000, help="lifecycles in the throughput phase")
    parser.add_argument("--batch", type=int, default=64, help="items per batched RPC in the throughput phase")
    parser.add_argument("--window", type=int, default=2_048, help="unfinished transfers each engine allows")
    parser.add_argument("--rate", type=float, default=1_000, help="offered lifecycles/s in the latency phase")
    parser.add_argument("--latency-seconds", type=float, default=8, help="length of the latency phase")
    parser.add_argument("--floor-seconds", type=float, default=3, help="length of the unary floor measurement")
    parser.add_argument("--out", type=Path, default=RESULTS / "rendezvous.json", help="results file")
    parser.add_argument("--profile", type=Path, help="write py-spy profiles of the throughput phase to this folder")
    args = parser.parse_args()
    if args.compare:
        configs = ["memory", "redis", "redis:2"]
    else:
        configs = [args.store + (f":{args.replicas}" if args.replicas > 1 else "")]

    ctx = mp.get_context("spawn")
    floor_port, ready = free_port(), ctx.Event()
    floor = ctx.Process(target=_floor_server, args=(floor_port, ready), daemon=True)
    floor.start()
    ready.wait(30)
    floor_numbers = asyncio.run(measure_floor(floor_port, args.floor_seconds))
    floor.terminate()

    with contextlib.ExitStack() as stack:
        needs_redis = any(c.startswith("redis") for c in configs)
        redis_url = args.redis_url or (stack.enter_context(local_redis()) if needs_redis else None)
        runs = [run_config(c, args, redis_url) for c in configs]

    result = {
        "benchmark": "rendezvous lifecycles",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "grpcio": grpc.__version__},
        "floor": floor_numbers,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"gRPC floor: unary {floor_numbers['unary_rpcs_per_s']:,.0f}/s (16 in flight), "
        f"stream {floor_numbers['stream_msgs_per_s']:,.0f} msgs/s"
    )
    clean = True
    for run in runs:
        for name, r in (("throughput", run["throughput"]), (f"latency @ {args.rate:,.0f}/s", run["latency"])):
            lat = r["assign_latency_ms"]
            print(
                f"{run['config']:>8} {name:>18}: {r['lifecycles_per_s']:,.0f} lifecycles/s, batch {r['batch']}, "
                f"assign p50 {lat['p50']:.2f} ms p99 {lat['p99']:.2f} ms, server CPU {r['server_cpu_util']:.0%} "
                f"RSS {r['server_rss_mib']:.0f} MiB"
            )
        after = run["after_run"]
        print(
            f"{run['config']:>8} after the run: {after['live_engines']} live engines, "
            f"{after['live_transfers']} live transfers"
        )
        clean = clean and after == {"live_engines": 0, "live_transfers": 0}
    print(f"wrote {args.out}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
