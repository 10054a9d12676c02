"""How long one caller's large CompleteTransfers stalls the others: GetStatus latency and health probes under it.

A `kv-rendezvous serve` (memory store, health port on) from a checkout, one producer engine that sends
CompleteTransfers requests of `--completions` x `--parts` written parts for unknown transfer ids, one at a time,
while another client calls GetStatus every 10 ms and a probe checks the health port every 250 ms with a 1 s
timeout (as a Kubernetes liveness probe does). Prints each attack call's time and status, the worst and p99
GetStatus latency, and the probes that failed (docs/security.md, "Threat model: bounded work").

    python benchmarks/bench_stall.py --completions 1400 --parts 4096 --calls 2         # the 49 MiB attack
    python benchmarks/bench_stall.py --completions 16 --parts 4096 --calls 20          # the largest admitted
    python benchmarks/bench_stall.py --checkout ../main ...                            # the same against main
    PYTHONPATH=. python benchmarks/bench_stall.py --loop-gaps --completions 16 --calls 5   # longest loop steps

`--loop-gaps` runs the server in this process instead (the `rendezvous` on PYTHONPATH) beside a task that only
yields, sends the calls from a thread, and prints the longest gaps between that task's turns: how long one step
of a call held the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc

UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(checkout: Path, health: str, flags: list[str]) -> tuple[subprocess.Popen[str], str]:
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "rendezvous.cli", "serve", "--listen", address, "--health-listen", health]
    command += ["--metrics-listen", "off", "--drain", "0", "--log-level", "warning", *flags]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and "serving on" in proc.stdout.readline()
    return proc, address


def producer(stub: pb_grpc.RendezvousServiceStub) -> int:
    region = pb.KvRegion(base_address=1 << 20, block_stride_bytes=4096, block_length_bytes=4096, num_blocks=64)
    agent = pb.NixlAgent(name="p0-0", metadata=b"md", memory_kind=pb.MEMORY_KIND_DRAM, regions=[region])
    layout = pb.KvLayout(model_fingerprint="m", dtype="float16", block_size=16, num_layers=2, tp_size=1, pp_size=1)
    request = pb.RegisterEngineRequest(
        engine_id="p0", pool="prefill", role=pb.ENGINE_ROLE_PRODUCER, layout=layout, agents=[agent]
    )
    request.lease_ttl.seconds = 300  # outlives the stalls of an unbounded server, so every call reaches the work
    return int(stub.RegisterEngine(request, timeout=30).engine.incarnation)


def attack_request(incarnation: int, completions: int, parts: int) -> pb.CompleteTransfersRequest:
    written = [pb.WrittenPart(first_token=i, num_tokens=1, num_layers=1) for i in range(parts)]
    items = [
        pb.CompletionSpec(transfer_id=f"unknown-{i}", outcome=pb.COMPLETION_OUTCOME_SUCCEEDED, parts=written)
        for i in range(completions)
    ]
    return pb.CompleteTransfersRequest(engine_id="p0", incarnation=incarnation, completions=items)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def loop_gaps(completions: int, parts: int, calls: int) -> dict[str, object]:
    """The longest gaps between turns of a task that only yields, while calls run in a server in this process."""
    from rendezvous.server import RendezvousServer, ServerConfig

    async def run() -> dict[str, object]:
        server = RendezvousServer(ServerConfig(listen="127.0.0.1:0", metrics_listen=None))
        await server.start()
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        def attack() -> list[str]:
            with grpc.insecure_channel(server.address, options=UNLIMITED) as channel:
                request = attack_request(producer(pb_grpc.RendezvousServiceStub(channel)), completions, parts)
                complete = pb_grpc.RendezvousServiceStub(channel).CompleteTransfers
                codes = []
                for _ in range(calls):
                    try:
                        complete(request, timeout=120)
                        codes.append("OK")
                    except grpc.RpcError as err:
                        codes.append(err.code().name)
                return codes

        task = asyncio.create_task(ticker())
        try:
            codes = await asyncio.to_thread(attack)
        finally:
            done.set()
            await task
            await server.stop(0)
        longest = sorted(gaps)[-8:]
        return {"statuses": codes, "longest_loop_steps_ms": [round(1e3 * g, 1) for g in reversed(longest)]}

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--completions", type=int, default=1_400)
    parser.add_argument("--parts", type=int, default=4_096)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--serve-flag", action="append", default=[], help="an extra `serve` flag (repeatable)")
    parser.add_argument("--loop-gaps", action="store_true", help="measure loop steps in this process (see above)")
    args = parser.parse_args()
    if args.loop_gaps:
        print(json.dumps(loop_gaps(args.completions, args.parts, args.calls)))
        return
    health = f"127.0.0.1:{free_port()}"
    proc, address = start_server(args.checkout.resolve(), health, args.serve_flag)
    try:
        with grpc.insecure_channel(address, options=UNLIMITED) as channel:
            stub = pb_grpc.RendezvousServiceStub(channel)
            request = attack_request(producer(stub), args.completions, args.parts)
            # Serialized once here: the attack then holds no lock of this process the probes need.
            payload = request.SerializeToString()
            complete = channel.unary_unary(
                "/rendezvous.v1.RendezvousService/CompleteTransfers",
                request_serializer=None,
                response_deserializer=pb.CompleteTransfersResponse.FromString,
            )
            done = threading.Event()
            latencies: list[float] = []
            probes: list[bool] = []

            def get_status() -> None:
                with grpc.insecure_channel(address) as own:
                    other = pb_grpc.RendezvousServiceStub(own)
                    while not done.is_set():
                        started = time.perf_counter()
                        other.GetStatus(pb.GetStatusRequest(), timeout=60)
                        latencies.append(time.perf_counter() - started)
                        time.sleep(0.01)

            def probe() -> None:
                with grpc.insecure_channel(health) as own:
                    check = health_pb2_grpc.HealthStub(own).Check
                    while not done.is_set():
                        try:
                            check(health_pb2.HealthCheckRequest(service="liveness"), timeout=1.0)
                            probes.append(True)
                        except grpc.RpcError:
                            probes.append(False)
                        time.sleep(0.25)

            threads = [threading.Thread(target=get_status), threading.Thread(target=probe)]
            for t in threads:
                t.start()
            calls: list[dict[str, object]] = []
            for _ in range(args.calls):
                started = time.perf_counter()
                try:
                    complete(payload, timeout=120)
                    code = "OK"
                except grpc.RpcError as err:
                    code = err.code().name
                calls.append({"seconds": round(time.perf_counter() - started, 3), "status": code})
            done.set()
            for t in threads:
                t.join()
    finally:
        proc.terminate()
        proc.wait(30)
    result = {
        "request_mib": round(len(payload) / (1 << 20), 2),
        "parts": args.completions * args.parts,
        "calls": calls,
        "get_status_max_ms": round(1e3 * max(latencies, default=0.0), 1),
        "get_status_p99_ms": round(1e3 * percentile(latencies, 0.99), 1),
        "get_status_calls": len(latencies),
        "health_failed": f"{probes.count(False)} of {len(probes)}",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
