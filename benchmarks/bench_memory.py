"""Server memory: RSS per live transfer, and RSS over a soak of completed lifecycles (flat = no leak).

    python benchmarks/bench_memory.py live [--transfers 200000] [--blocks 16] [--pairs 4]
    python benchmarks/bench_memory.py soak [--lifecycles 1000000] [--tombstone-ttl 10] [--samples 20]

live   --pairs consumer/producer engine pairs (so no engine passes the default 100,000 live transfers) hold
       --transfers transfers of --blocks blocks each, targeted and claimed: MATCHED and assigned, the
       assignment event in the producer's log. Reports the server's RSS before and after, per live transfer.
soak   one pair runs --lifecycles full lifecycles (target, claim, complete, release) in batches, several in
       flight, and the server's RSS is sampled --samples times. Released transfers stay as tombstones for
       --tombstone-ttl seconds (default in serve: 300 s, which a soak shorter than that never outlives) and
       each engine's event log holds up to 100,000 events, so RSS rises to a plateau first: the report
       compares the second half's samples.

The server is `kv-rendezvous serve --store memory` in its own process, driven over loopback gRPC with raw
stubs; block ids are spread over the engine's 100,000 blocks (ids above 256 are not CPython's shared small
ints, as in a real engine). Results go to benchmarks/results/memory-<mode>.json (--out to change).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from bench_rendezvous import RESULTS, engine_request, proc_usage, start_server

from rendezvous.v1 import rendezvous_pb2 as pb
from rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc

NUM_BLOCKS = 100_000  # bench_rendezvous.REGION's


def blocks(i: int, count: int) -> list[int]:
    """Distinct block ids of transfer i, spread over the pool like a real engine's free list."""
    first = (i * 7919 * count) % (NUM_BLOCKS - count)
    return list(range(first, first + count))


def rss_mib(pid: int) -> float:
    return proc_usage(pid)[1] / 2**20


async def register(stub: Any, engine_id: str, role: Any) -> int:
    reply = await stub.RegisterEngine(engine_request(engine_id, role))
    return int(reply.engine.incarnation)


async def keep_alive(stub: Any, engines: list[tuple[str, int]], every: float = 20.0) -> None:
    """Renew the engines' leases (300 s) until cancelled: a soak on a slow machine outlasts one."""

    async def requests() -> Any:
        while True:
            for engine_id, incarnation in engines:
                yield pb.KeepAliveRequest(engine_id=engine_id, incarnation=incarnation)
            await asyncio.sleep(every)

    async for _ in stub.KeepAlive(requests()):
        pass


@contextlib.asynccontextmanager
async def renewed(stub: Any, engines: list[tuple[str, int]]) -> AsyncIterator[None]:
    """The engines' leases renewed while the block runs."""
    task = asyncio.create_task(keep_alive(stub, engines))
    try:
        yield
    finally:
        task.cancel()


def ok(reply: Any) -> None:
    bad = [r for r in reply.results if r.HasField("status")]
    if bad:
        raise RuntimeError(f"{len(bad)} items failed, first: {bad[0].status.message}")


async def live(args: argparse.Namespace) -> dict[str, Any]:
    proc, address = start_server("memory")
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.RendezvousServiceStub(channel)
            pairs = []
            for p in range(args.pairs):
                c, d = f"consumer-{p}", f"producer-{p}"
                pairs.append(
                    (
                        c,
                        await register(stub, c, pb.ENGINE_ROLE_CONSUMER),
                        d,
                        await register(stub, d, pb.ENGINE_ROLE_PRODUCER),
                    )
                )
            engines = [(c, ci) for c, ci, _, _ in pairs] + [(d, di) for _, _, d, di in pairs]
            async with renewed(stub, engines):
                # Warm up every path once (and let the allocator settle) before the baseline.
                await lifecycle_batch(stub, pairs[0], "warm", range(args.batch), args.blocks)
                await asyncio.sleep(1)
                before = rss_mib(proc.pid)
                started = time.monotonic()
                sem = asyncio.Semaphore(4)

                async def hold(p: int, first: int) -> None:
                    c, ci, d, di = pairs[p]
                    ids = range(first, min(args.transfers, first + args.batch))
                    async with sem:
                        targets = [
                            pb.TargetSpec(transfer_id=f"live-{i:09d}", block_ids=blocks(i, args.blocks), generation=1)
                            for i in ids
                        ]
                        ok(
                            await stub.RegisterTargets(
                                pb.RegisterTargetsRequest(engine_id=c, incarnation=ci, targets=targets)
                            )
                        )
                        claims = [pb.ClaimSpec(transfer_id=f"live-{i:09d}") for i in ids]
                        ok(
                            await stub.ClaimTransfers(
                                pb.ClaimTransfersRequest(engine_id=d, incarnation=di, claims=claims)
                            )
                        )

                await asyncio.gather(
                    *(hold((first // args.batch) % args.pairs, first) for first in range(0, args.transfers, args.batch))
                )
                elapsed = time.monotonic() - started
                await asyncio.sleep(1)
                status = await stub.GetStatus(pb.GetStatusRequest())
                after = rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    matched = status.transfers_by_state.get("MATCHED", 0)
    if matched != args.transfers:
        raise RuntimeError(f"{matched} transfers MATCHED, not {args.transfers}")
    per = (after - before) * 2**20 / args.transfers
    return {
        "transfers": args.transfers,
        "blocks": args.blocks,
        "pairs": args.pairs,
        "rss_before_mib": before,
        "rss_after_mib": after,
        "rss_bytes_per_live_transfer": per,
        "seconds": elapsed,
    }


async def lifecycle_batch(stub: Any, pair: tuple[str, int, str, int], run: str, ids: range, count: int) -> None:
    """Target, claim, complete and release a batch of transfers (the assignment is in the reply's state)."""
    c, ci, d, di = pair
    names = [f"{run}-{i}" for i in ids]
    targets = [
        pb.TargetSpec(transfer_id=t, block_ids=blocks(i, count), generation=1) for t, i in zip(names, ids, strict=True)
    ]
    ok(await stub.RegisterTargets(pb.RegisterTargetsRequest(engine_id=c, incarnation=ci, targets=targets)))
    ok(
        await stub.ClaimTransfers(
            pb.ClaimTransfersRequest(engine_id=d, incarnation=di, claims=[pb.ClaimSpec(transfer_id=t) for t in names])
        )
    )
    completions = [
        pb.CompletionSpec(transfer_id=t, generation=1, outcome=pb.COMPLETION_OUTCOME_SUCCEEDED) for t in names
    ]
    ok(await stub.CompleteTransfers(pb.CompleteTransfersRequest(engine_id=d, incarnation=di, completions=completions)))
    releases = [pb.ReleaseSpec(transfer_id=t, generation=1) for t in names]
    ok(await stub.ReleaseTargets(pb.ReleaseTargetsRequest(engine_id=c, incarnation=ci, releases=releases)))


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    proc, address = start_server("memory", "--tombstone-ttl", str(args.tombstone_ttl))
    samples: list[dict[str, float]] = []
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.RendezvousServiceStub(channel)
            pair = (
                "consumer-0",
                await register(stub, "consumer-0", pb.ENGINE_ROLE_CONSUMER),
                "producer-0",
                await register(stub, "producer-0", pb.ENGINE_ROLE_PRODUCER),
            )
            async with renewed(stub, [(pair[0], pair[1]), (pair[2], pair[3])]):
                total, batch = args.lifecycles, args.batch
                every = max(batch, total // args.samples // batch * batch)
                started = time.monotonic()
                samples.append({"lifecycles": 0, "seconds": 0.0, "rss_mib": rss_mib(proc.pid)})
                done = 0
                next_first = 0

                async def worker() -> None:
                    nonlocal done, next_first
                    while next_first < total:
                        first = next_first
                        next_first += batch
                        await lifecycle_batch(stub, pair, "soak", range(first, min(total, first + batch)), args.blocks)
                        before, done = done, done + min(batch, total - first)
                        if before // every != done // every or done == total:
                            samples.append(
                                {
                                    "lifecycles": done,
                                    "seconds": time.monotonic() - started,
                                    "rss_mib": rss_mib(proc.pid),
                                }
                            )
                            at = samples[-1]
                            print(f"  {done:>9,} lifecycles  {at['seconds']:6.0f} s  RSS {at['rss_mib']:.0f} MiB")

                await asyncio.gather(*(worker() for _ in range(4)))
                status = await stub.GetStatus(pb.GetStatusRequest())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    live = sum(n for s, n in status.transfers_by_state.items() if s not in ("RELEASED", "ABORTED"))
    second = [s["rss_mib"] for s in samples[len(samples) // 2 :]]
    return {
        "lifecycles": args.lifecycles,
        "tombstone_ttl_s": args.tombstone_ttl,
        "lifecycles_per_s": args.lifecycles / samples[-1]["seconds"],
        "samples": samples,
        "second_half_rss_mib": {"min": min(second), "max": max(second), "median": statistics.median(second)},
        "second_half_growth_mib": second[-1] - second[0],
        "live_transfers_after": live,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["live", "soak"])
    parser.add_argument("--transfers", type=int, default=200_000, help="live: transfers held at once")
    parser.add_argument("--pairs", type=int, default=4, help="live: consumer/producer engine pairs")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per transfer")
    parser.add_argument("--batch", type=int, default=256, help="items per batched call")
    parser.add_argument("--lifecycles", type=int, default=1_000_000, help="soak: completed lifecycles")
    parser.add_argument("--tombstone-ttl", type=float, default=10.0, help="soak: serve --tombstone-ttl (seconds)")
    parser.add_argument("--samples", type=int, default=20, help="soak: RSS samples")
    parser.add_argument("--out", type=Path, help="results file (default benchmarks/results/memory-<mode>.json)")
    args = parser.parse_args()
    result = asyncio.run(live(args) if args.mode == "live" else soak(args))
    result = {
        "benchmark": f"rendezvous memory ({args.mode})",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "grpcio": grpc.__version__},
        **result,
    }
    out = args.out or RESULTS / f"memory-{args.mode}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if args.mode == "live":
        print(
            f"{result['transfers']:,} live {result['blocks']}-block transfers: RSS {result['rss_before_mib']:.0f} -> "
            f"{result['rss_after_mib']:.0f} MiB, {result['rss_bytes_per_live_transfer']:,.0f} bytes per live transfer"
        )
    else:
        half = result["second_half_rss_mib"]
        print(
            f"{result['lifecycles']:,} lifecycles at {result['lifecycles_per_s']:,.0f}/s: second-half RSS "
            f"{half['min']:.0f}-{half['max']:.0f} MiB (growth {result['second_half_growth_mib']:+.1f} MiB), "
            f"{result['live_transfers_after']} live transfers after"
        )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
