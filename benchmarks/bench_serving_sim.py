"""Simulated disaggregated serving with real gRPC and real NIXL bytes: pull vs push vs ideal.

One producer (prefill) and one consumer (decode) engine run as separate processes with DRAM KV pools and the
data-plane agents; the rendezvous service runs in this process, which is also the router. Requests arrive as
a Poisson process at each `--rates` value. Prefill compute is simulated (`--prefill-us-per-token`, one request
at a time); the KV bytes are real and sized like `--model` (bytes per token from its shape, divided by
`--kv-scale` to fit memory). Decode is a step loop (`--decode-step-ms` per step, every active request gets a
token per step).

  pull   as vLLM's default connector does it, paying each of its costs (named parameters, all on the path
         after prefill finished):
         - relay (`--pull-relay-ms`): the router learns prefill is done and sends the decode leg, one HTTP
           hop later;
         - admission at a step boundary: decode's scheduler allocates the request's blocks when its running
           step ends (push pays this too, but while prefill still computes);
         - handshake on first contact (`--pull-handshake-ms`): decode fetches prefill's NIXL metadata before
           its first READ from that engine;
         - the READ on the step loop: issued in the step that admitted the request, it is seen done at the next
           step boundary (the request then decodes); its setup stalls that step by `--pull-setup-ms`, which
           shows in the TPOT of requests already decoding.
  push   both legs at once through the rendezvous: the consumer registers its blocks while the producer
         computes; the producer's writer thread WRITEs as soon as the KV is ready.
  ideal  push's compute and raw WRITE time with no coordination: the KV lands at prefill done + the WRITE's
         own duration, and the decode side takes as long as it did in push to emit the first token (the wait
         for the running step, then one step).

TTFT = first token at the consumer - arrival; TPOT = mean time between a request's later tokens.

`--tp P:D` gives the producer engine P ranks and the consumer engine D (tensor parallel; `--tp 4:4,4:2,2:4`
runs each pair in turn, with only that pair's engines alive). Each rank has its own agent (its own NIXL agent,
writer or receiver thread, and rendezvous client); an engine's ranks share one process. The KV bytes per token
are split across ranks by KV heads (HND blocks), and every producer rank writes its heads into the consumer
ranks that hold them. A request's KV has arrived once every consumer rank has its share; ideal's WRITE
duration is the slowest producer rank's. Pull (the consumer READs rank to rank) runs at 1:1 only.

    python benchmarks/bench_serving_sim.py [--rates 10,20,35] [--requests 60] [--tp 1:1] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import multiprocessing
import os
import platform
import queue
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODELS = {
    # layers x KV heads x head dim x (K and V) x bytes (bf16)
    "qwen3-32b": 64 * 8 * 128 * 2 * 2,
    "llama-3.1-8b": 32 * 8 * 128 * 2 * 2,
}
KV_HEADS = 8  # both models; TP ranks split them
BLOCK_TOKENS = 16
REGIONS = 2  # K and V


@dataclass(frozen=True)
class Sim:
    """The simulated engines' timing and sizes."""

    prefill_s_per_token: float
    decode_step_s: float
    pull_setup_s: float
    pull_relay_s: float
    pull_handshake_s: float
    output_tokens: int
    block_bytes: int  # per region, whole engine (each of `ranks` ranks holds 1/ranks of it)
    pool_blocks: int
    model: str
    producer_ranks: int = 1
    consumer_ranks: int = 1

    def layout(self, ranks: int) -> Any:
        from clients import KvLayout

        return KvLayout(self.model, "bf16", BLOCK_TOKENS, 0, ranks, 1, "HND", KV_HEADS)

    @property
    def pull(self) -> bool:
        """Pull runs rank to rank, so only between single-rank engines."""
        return self.producer_ranks == self.consumer_ranks == 1

    @property
    def label(self) -> str:
        return f"{self.producer_ranks}x{self.consumer_ranks}"


# Engine processes


def rank_tensors(sim: Sim, ranks: int) -> list[Any]:
    """One rank's KV regions: its share (1/ranks) of each block of the pool."""
    import torch

    return [torch.zeros((sim.pool_blocks, sim.block_bytes // ranks), dtype=torch.uint8) for _ in range(REGIONS)]


async def _producer(address: str, sim: Sim, commands: Any, reports: Any) -> None:
    from clients import AsyncRendezvousClient, TransferMode
    from clients.nixl.producer import ProducerAgent
    from clients.nixl.rank import start_ranks

    ranks = sim.producer_ranks
    free = list(range(sim.pool_blocks))
    work: asyncio.Queue[tuple[str, int, int, bool]] = asyncio.Queue()
    writes: dict[str, list[float]] = {}  # each rank's WRITE duration, until every rank reported
    frees: dict[str, int] = {}

    def on_report(r: Any) -> None:
        durations = writes.setdefault(r.transfer_id, [])
        durations.append(r.written_time - max(r.ready_time, r.assigned_time))
        if len(durations) == ranks:
            reports.put(("write", r.transfer_id, max(durations)))
            del writes[r.transfer_id]

    def on_free(blocks: list[int]) -> Any:
        def freed(transfer_id: str) -> None:  # the blocks are free once every rank let go of them
            frees[transfer_id] = frees.get(transfer_id, 0) + 1
            if frees[transfer_id] == ranks:
                del frees[transfer_id]
                free.extend(blocks)

        return freed

    engine_id = f"sim-prefill-{sim.label}"
    clients = [AsyncRendezvousClient(address) for _ in range(ranks)]
    agents = [
        ProducerAgent(
            client,
            engine_id,
            "prefill",
            rank_tensors(sim, ranks),
            rank=rank,
            layout=sim.layout(ranks),
            serve_reads=sim.pull,
            on_report=on_report,
        )
        for rank, client in enumerate(clients)
    ]
    agent = agents[0]
    await start_ranks(agents)
    reports.put(("started", "producer"))
    try:

        async def compute() -> None:  # one prefill at a time, like one GPU
            while True:
                transfer_id, tokens, num_blocks, pull = await work.get()
                while len(free) < num_blocks:  # noqa: ASYNC110 (a scheduler step looking for free blocks)
                    await asyncio.sleep(0.001)
                blocks, free[:] = free[:num_blocks], free[num_blocks:]
                await asyncio.sleep(tokens * sim.prefill_s_per_token)
                mode = TransferMode.PULL if pull else TransferMode.PUSH
                for a in agents:
                    a.ready(transfer_id, blocks, on_free(blocks), mode=mode)
                reports.put(("prefilled", transfer_id, time.monotonic()))

        computing = asyncio.create_task(compute())
        loop = asyncio.get_running_loop()
        while (command := await loop.run_in_executor(None, commands.get))[0] != "stop":
            _, transfer_id, tokens, num_blocks, pull = command
            if not pull:
                await agent.claim(transfer_id)
            work.put_nowait((transfer_id, tokens, num_blocks, pull))
        computing.cancel()
    finally:
        for a in reversed(agents):
            await a.close()
        for client in clients:
            await client.close()


async def _consumer(address: str, sim: Sim, commands: Any, reports: Any) -> None:
    from clients import AsyncRendezvousClient, TransferMode
    from clients.nixl.consumer import ConsumerAgent, TransferResult
    from clients.nixl.rank import start_ranks

    ranks = sim.consumer_ranks
    free = list(range(sim.pool_blocks))
    arrived: asyncio.Queue[tuple[float, TransferResult]] = asyncio.Queue()
    admissions: list[tuple[str, int, bool]] = []  # decode legs the scheduler admits at the next step
    shares: dict[str, int] = {}  # consumer ranks whose share of a transfer arrived
    wake = asyncio.Event()

    def on_result(result: TransferResult) -> None:
        if result.ok:  # the request's KV is in once every rank has its share
            shares[result.transfer_id] = shares.get(result.transfer_id, 0) + 1
            if shares[result.transfer_id] < ranks:
                return
            del shares[result.transfer_id]
        arrived.put_nowait((time.monotonic(), result))
        wake.set()

    engine_id = f"sim-decode-{sim.label}"
    clients = [AsyncRendezvousClient(address) for _ in range(ranks)]
    agents = [
        ConsumerAgent(
            client,
            engine_id,
            "decode",
            rank_tensors(sim, ranks),
            rank=rank,
            layout=sim.layout(ranks),
            on_result=on_result,
        )
        for rank, client in enumerate(clients)
    ]
    agent = agents[0]
    await start_ranks(agents)
    registering: set[asyncio.Task[Any]] = set()
    reports.put(("started", "consumer"))

    first_contact: list[asyncio.Task[None]] = []  # pull: fetching prefill's NIXL metadata, once

    async def register(transfer_id: str, target: list[int], mode: TransferMode) -> None:
        if mode is TransferMode.PULL:  # no READ before decode holds the metadata
            if not first_contact:
                first_contact.append(asyncio.create_task(asyncio.sleep(sim.pull_handshake_s)))
            await first_contact[0]
        for follower in agents[1:]:  # they expect their shares before rank 0 registers the target
            await follower.register_target(transfer_id, target, mode=mode)
        await agent.register_target(transfer_id, target, mode=mode)

    try:

        async def step_loop() -> None:
            active: dict[str, list[float]] = {}  # transfer id -> KV arrival, then token times
            blocks: dict[str, tuple[int, ...]] = {}
            while True:
                if not active and not admissions:
                    await wake.wait()
                    wake.clear()
                stall = 0.0
                while admissions and len(free) >= admissions[0][1]:  # the scheduler allocates at a step boundary
                    transfer_id, num_blocks, pull = admissions.pop(0)
                    target, free[:] = free[:num_blocks], free[num_blocks:]
                    mode = TransferMode.PULL if pull else TransferMode.PUSH
                    registering.add(asyncio.create_task(register(transfer_id, target, mode)))
                    stall += sim.pull_setup_s if pull else 0.0
                while not arrived.empty():
                    kv_time, result = arrived.get_nowait()
                    if result.ok:
                        active[result.transfer_id], blocks[result.transfer_id] = [kv_time], result.block_ids
                    else:
                        free.extend(result.block_ids)
                        reports.put(("failed", result.transfer_id, result.reason))
                await asyncio.sleep(sim.decode_step_s + stall)
                registering.difference_update([t for t in registering if t.done()])
                now = time.monotonic()
                for transfer_id, tokens in list(active.items()):
                    tokens.append(now)
                    if len(tokens) == sim.output_tokens + 1:
                        del active[transfer_id]
                        free.extend(blocks.pop(transfer_id))
                        gaps = [b - a for a, b in itertools.pairwise(tokens[1:])]
                        tpot = statistics.fmean(gaps) if gaps else 0.0
                        reports.put(("decoded", transfer_id, tokens[0], tokens[1], tpot))

        stepping = asyncio.create_task(step_loop())
        loop = asyncio.get_running_loop()

        def admit(leg: tuple[str, int, bool]) -> None:
            admissions.append(leg)
            wake.set()

        while (command := await loop.run_in_executor(None, commands.get))[0] != "stop":
            leg = command[1:]
            if leg[2]:  # pull: the leg reaches decode one router hop after prefill finished
                loop.call_later(sim.pull_relay_s, admit, leg)
            else:
                admit(leg)
        stepping.cancel()
    finally:
        for a in reversed(agents):
            await a.close()
        for client in clients:
            await client.close()


def _engine(role: str, address: str, sim: Sim, commands: Any, reports: Any) -> None:
    run = _producer if role == "producer" else _consumer
    asyncio.run(run(address, sim, commands, reports))


# Router


@dataclass
class _Request:
    transfer_id: str
    arrival: float
    tokens: int
    num_blocks: int
    prefilled: float = 0.0
    write_s: float = 0.0
    kv_arrived: float = 0.0
    first_token: float = 0.0
    tpot: float = 0.0


def _drain(reports: Any, requests: dict[str, _Request], on_prefilled: Any) -> int:
    """Apply the engines' reports; the number of requests that finished decoding."""
    finished = 0
    while True:
        try:
            report = reports.get_nowait()
        except queue.Empty:
            return finished
        kind, transfer_id = report[0], report[1]
        request = requests.get(transfer_id)
        if request is None:
            continue
        if kind == "prefilled":
            request.prefilled = report[2]
            on_prefilled(request)
        elif kind == "write":
            request.write_s = report[2]
        elif kind == "decoded":
            request.kv_arrived, request.first_token, request.tpot = report[2:5]
            finished += 1
        elif kind == "failed":
            raise RuntimeError(f"transfer {transfer_id} failed: {report[2]}")


def _run_load(
    engines: dict[str, Any], reports: Any, rate: float, args: argparse.Namespace, pull: bool, label: str
) -> list[_Request]:
    rng = random.Random(args.seed)
    requests: dict[str, _Request] = {}

    def relay(request: _Request) -> None:  # pull: the decode leg goes out once prefill is done
        if pull:
            engines["consumer"].put(("decode", request.transfer_id, request.num_blocks, True))

    start = time.monotonic()
    arrival = start
    finished = 0
    for i in range(args.requests):
        arrival += rng.expovariate(rate)
        tokens = rng.randint(args.prompt_tokens // 2, args.prompt_tokens * 3 // 2)
        request = _Request(f"sim-{'pull' if pull else 'push'}-{label}-{rate}-{i}-{os.getpid()}", arrival, tokens, 0)
        request.num_blocks = math.ceil(tokens / BLOCK_TOKENS)
        while time.monotonic() < arrival:
            finished += _drain(reports, requests, relay)
            time.sleep(min(0.0005, max(0.0, arrival - time.monotonic())))
        requests[request.transfer_id] = request
        engines["producer"].put(("prefill", request.transfer_id, tokens, request.num_blocks, pull))
        if not pull:
            engines["consumer"].put(("decode", request.transfer_id, request.num_blocks, False))
    deadline = time.monotonic() + 60
    while finished < args.requests and time.monotonic() < deadline:
        finished += _drain(reports, requests, relay)
        time.sleep(0.001)
    if finished < args.requests:
        raise TimeoutError(f"{args.requests - finished} requests did not finish")
    return list(requests.values())


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "mean_ms": statistics.fmean(values) * 1e3,
        "p50_ms": statistics.median(values) * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
    }


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    rates = [r["rate"] for r in results]
    for mode in ("pull", "push", "ideal"):
        ttft.plot(rates, [r[mode]["ttft"]["mean_ms"] for r in results], marker="o", label=mode)
        if mode != "ideal":
            tpot.plot(rates, [r[mode]["tpot"]["mean_ms"] for r in results], marker="o", label=mode)
    ttft.set(xlabel="request rate (req/s)", ylabel="TTFT mean (ms)", title="time to first token")
    tpot.set(xlabel="request rate (req/s)", ylabel="TPOT mean (ms)", title="time per output token")
    ttft.legend()
    tpot.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


def _run_pair(server_address: str, sim: Sim, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start one producer/consumer engine pair, run every rate against it, stop it; a row per rate."""
    ctx = multiprocessing.get_context("spawn")
    reports: Any = ctx.Queue()
    engines: dict[str, Any] = {role: ctx.Queue() for role in ("producer", "consumer")}
    rows: list[dict[str, Any]] = []
    processes = [
        ctx.Process(target=_engine, args=(role, server_address, sim, q, reports), daemon=True)
        for role, q in engines.items()
    ]
    for p in processes:
        p.start()
    try:
        for _ in processes:
            assert reports.get(timeout=120)[0] == "started"
        tp = f"{sim.producer_ranks}:{sim.consumer_ranks}"
        modes = ("pull", "push") if sim.pull else ("push",)
        for rate in (float(r) for r in args.rates.split(",")):
            row: dict[str, Any] = {"tp": tp, "rate": rate}
            for mode in modes:
                done = _run_load(engines, reports, rate, args, mode == "pull", sim.label)
                row[mode] = {
                    "ttft": _stats([r.first_token - r.arrival for r in done]),
                    "tpot": _stats([r.tpot for r in done]),
                }
                if mode == "push":
                    ideal = [r.prefilled + r.write_s + (r.first_token - r.kv_arrived) - r.arrival for r in done]
                    row["ideal"] = {"ttft": _stats(ideal)}
                    row["write"] = _stats([r.write_s for r in done])
            push, ideal_ttft = row["push"], row["ideal"]["ttft"]["mean_ms"]
            row["push_over_ideal_ttft"] = push["ttft"]["mean_ms"] / ideal_ttft
            line = f"tp {tp}  rate {rate:5.1f}/s  TTFT mean push {push['ttft']['mean_ms']:7.1f} ms"
            line += f"  ideal {ideal_ttft:7.1f}"
            if "pull" in row:
                pull = row["pull"]
                row["pull_over_push_ttft"] = pull["ttft"]["mean_ms"] / push["ttft"]["mean_ms"]
                line += (
                    f"  pull {pull['ttft']['mean_ms']:7.1f}  (p99 pull {pull['ttft']['p99_ms']:.1f}, "
                    f"push {push['ttft']['p99_ms']:.1f})  TPOT pull {pull['tpot']['mean_ms']:.1f} "
                    f"push {push['tpot']['mean_ms']:.1f} ms  pull/push {row['pull_over_push_ttft']:.2f}x"
                )
            rows.append(row)
            print(
                f"{line}  WRITE p50 {row['write']['p50_ms']:.2f} ms  push/ideal {row['push_over_ideal_ttft']:.2f}x",
                flush=True,
            )
    finally:
        for q in engines.values():
            q.put(("stop",))
        for p in processes:
            p.join(15)
            if p.is_alive():
                p.kill()
    return rows


def _tp_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        producer, _, consumer = item.partition(":")
        pair = int(producer), int(consumer or producer)
        if min(pair) < 1 or KV_HEADS % pair[0] or KV_HEADS % pair[1]:
            raise argparse.ArgumentTypeError(f"--tp {item}: each side's ranks must divide the {KV_HEADS} KV heads")
        pairs.append(pair)
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="10,20,35", help="request rates to run, req/s")
    parser.add_argument("--requests", type=int, default=60, help="requests per rate and mode")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="mean prompt length (uniform +-50%%)")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens decoded per request")
    parser.add_argument("--prefill-us-per-token", type=float, default=40.0, help="simulated prefill compute")
    parser.add_argument("--decode-step-ms", type=float, default=20.0, help="simulated decode step")
    parser.add_argument("--pull-setup-ms", type=float, default=2.0, help="pull setup on the decode step loop")
    parser.add_argument("--pull-relay-ms", type=float, default=1.0, help="pull: the router's hop to decode")
    parser.add_argument(
        "--pull-handshake-ms", type=float, default=50.0, help="pull: decode's first contact with prefill"
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-32b", help="KV bytes per token")
    parser.add_argument("--kv-scale", type=int, default=32, help="divide the model's KV bytes per token by this")
    parser.add_argument("--pool-blocks", type=int, default=1024, help="KV blocks per engine")
    parser.add_argument("--tp", type=_tp_pairs, default="1:1", help="producer:consumer ranks, e.g. 4:4,4:2,2:4")
    parser.add_argument("--name", default="serving_sim", help="results file name (without .json)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    os.environ.setdefault("UCX_TLS", "shm,tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")

    bytes_per_token = MODELS[args.model] // args.kv_scale
    print(f"{args.model} KV / {args.kv_scale}: {bytes_per_token} B/token, {args.prompt_tokens} tokens mean")
    from clients.testing import TestServer

    results: list[dict[str, Any]] = []
    with TestServer() as server:
        for producer_ranks, consumer_ranks in args.tp:
            sim = Sim(
                prefill_s_per_token=args.prefill_us_per_token * 1e-6,
                decode_step_s=args.decode_step_ms * 1e-3,
                pull_setup_s=args.pull_setup_ms * 1e-3,
                pull_relay_s=args.pull_relay_ms * 1e-3,
                pull_handshake_s=args.pull_handshake_ms * 1e-3,
                output_tokens=args.output_tokens,
                block_bytes=bytes_per_token * BLOCK_TOKENS // REGIONS,
                pool_blocks=args.pool_blocks,
                model=args.model,
                producer_ranks=producer_ranks,
                consumer_ranks=consumer_ranks,
            )
            results.extend(_run_pair(server.address, sim, args))
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "serving_sim",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average": os.getloadavg()},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "bytes_per_token": bytes_per_token,
        "results": results,
    }
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results: {path}")
    with_pull = [r for r in results if "pull" in r]
    if with_pull:
        _plot(with_pull, args.out / f"{args.name}.png")


if __name__ == "__main__":
    main()
