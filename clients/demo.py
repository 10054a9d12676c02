"""`kv-rendezvous demo`: the whole system on one machine, with every byte checked.

It starts the rendezvous service in this process and producer and consumer engines as separate processes,
each with a DRAM KV pool and a NIXL agent (UCX on loopback). It then acts as the router: for each of N
transfers of random size it sends both legs at once (the consumer registers destination blocks, the producer
fills source blocks, claims and marks them ready), keeps up to `--concurrency` in flight, and waits for every
consumer to verify its bytes. It prints progress, throughput and where the time went.

The CLI calls `add_demo_arguments(parser)` for the subcommand's flags and `run_demo(args)` to run it.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import queue
import random
import statistics
import sys
import time
import uuid
from typing import Any

from rendezvous.clients._demo_worker import MAX_TRANSFER_REGION_BYTES, WorkerSpec, serve
from rendezvous.protocol.flags import count

__all__ = ["DemoSummary", "add_demo_arguments", "demo_argument_error", "run_demo"]


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags, each with its range (`demo_argument_error` checks how they go together)."""
    parser.add_argument("--transfers", type=count(1), default=200, help="transfers to run; >= 1 (default 200)")
    parser.add_argument("--producers", type=count(1), default=2, help="producer engines; >= 1 (default 2)")
    parser.add_argument("--consumers", type=count(1), default=2, help="consumer engines; >= 1 (default 2)")
    parser.add_argument("--min-blocks", type=count(1), default=1, help="smallest transfer, in blocks; >= 1 (default 1)")
    parser.add_argument(
        "--max-blocks",
        type=count(1),
        default=32,
        help="largest transfer, in blocks; --min-blocks..--pool-blocks, at most 8 MiB per region (default 32)",
    )
    parser.add_argument("--block-kib", type=count(1), default=64, help="KiB per block per region; >= 1 (default 64)")
    parser.add_argument(
        "--regions", type=count(1), default=2, help="KV regions per engine, e.g. K and V; >= 1 (default 2)"
    )
    parser.add_argument(
        "--pool-blocks", type=count(1), default=256, help="blocks in each engine's pool; >= 1 (default 256)"
    )
    parser.add_argument("--concurrency", type=count(1), default=8, help="transfers in flight; >= 1 (default 8)")
    parser.add_argument(
        "--mode",
        choices=("push", "pull", "progressive"),
        default="push",
        help="who moves the bytes; progressive: pushed as a part into a target that accepts parts",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def demo_argument_error(args: argparse.Namespace) -> str | None:
    """Why the demo's flags do not go together (each is in its range), or None."""
    if not args.min_blocks <= args.max_blocks <= args.pool_blocks:
        return (
            f"--min-blocks ({args.min_blocks}) <= --max-blocks ({args.max_blocks}) <= --pool-blocks "
            f"({args.pool_blocks}) does not hold"
        )
    if args.max_blocks * args.block_kib * 1024 > MAX_TRANSFER_REGION_BYTES:
        return (
            f"--max-blocks ({args.max_blocks}) x --block-kib ({args.block_kib}) is over the "
            f"{MAX_TRANSFER_REGION_BYTES >> 20} MiB a demo transfer holds per region"
        )
    return None


@dataclasses.dataclass
class DemoSummary:
    """What a demo run did."""

    transfers: int = 0
    verified: int = 0
    failed: int = 0
    bytes_verified: int = 0
    seconds: float = 0.0
    latencies: list[float] = dataclasses.field(default_factory=list)
    match_wait: list[float] = dataclasses.field(default_factory=list)
    write: list[float] = dataclasses.field(default_factory=list)
    commit: list[float] = dataclasses.field(default_factory=list)
    arrival: list[float] = dataclasses.field(default_factory=list)
    """Push: from the producer holding its blocks and the assignment (it posts the WRITE after) to the consumer's
    result, stamped in two processes with time.monotonic() (system-wide). Not from "write done": the producer's
    writer sees its WRITE done after the consumer may have seen the notification (such a figure came out < 0)."""
    errors: list[str] = dataclasses.field(default_factory=list)


class _Engines:
    """The spawned engine processes, their command queues and the shared report queue."""

    def __init__(self, address: str, args: argparse.Namespace) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.reports: Any = ctx.Queue()
        self.commands: dict[str, Any] = {}
        self.processes: list[Any] = []
        lengths = tuple([args.block_kib * 1024] * args.regions)
        run = uuid.uuid4().hex[:6]
        roles = [("producer", i) for i in range(args.producers)] + [("consumer", i) for i in range(args.consumers)]
        for role, i in roles:
            engine_id = f"demo-{run}-{role}-{i}"
            spec = WorkerSpec(role, engine_id, address, args.pool_blocks, lengths)
            self.commands[engine_id] = ctx.Queue()
            process = ctx.Process(target=serve, args=(spec, self.commands[engine_id], self.reports), daemon=True)
            process.start()
            self.processes.append(process)
        self.producers = [e for e in self.commands if "-producer-" in e]
        self.consumers = [e for e in self.commands if "-consumer-" in e]

    def wait_started(self, timeout: float) -> None:
        started = 0
        while started < len(self.processes):
            kind = self.reports.get(timeout=timeout)[0]
            if kind == "started":
                started += 1

    def stop(self) -> None:
        for commands in self.commands.values():
            commands.put(("stop",))
        for process in self.processes:
            process.join(15)
            if process.is_alive():
                process.kill()


def _route(engines: _Engines, args: argparse.Namespace, summary: DemoSummary) -> None:
    """Dispatch the transfers, keeping `concurrency` in flight, and collect the reports."""
    rng = random.Random(args.seed)
    pending: dict[str, int] = {}  # transfer id -> reports still expected (consumer "done", producer "freed")
    step = max(1, args.transfers // 10)
    write_start: dict[str, float] = {}  # transfer id -> when the producer could post its WRITE, until arrival comes
    arrived: dict[str, float] = {}  # transfer id -> the consumer's result, until its write report comes
    sent = 0
    start = time.monotonic()
    while sent < args.transfers or pending:
        while sent < args.transfers and len(pending) < args.concurrency:
            transfer_id = f"demo-{uuid.uuid4().hex}"
            n, seed = rng.randint(args.min_blocks, args.max_blocks), rng.getrandbits(31)
            producer, consumer = engines.producers[sent % len(engines.producers)], rng.choice(engines.consumers)
            for engine in (consumer, producer):  # both legs at once
                engines.commands[engine].put(("transfer", transfer_id, n, seed, args.mode))
            pending[transfer_id] = 2
            sent += 1
        report = engines.reports.get(timeout=60)
        kind, transfer_id = report[0], report[1]
        if kind == "write":
            _, _, ok, ready, assigned, written, completed = report
            if ok:
                posted_after = max(ready, assigned)  # "ready": the blocks handed over (the part, if progressive)
                summary.match_wait.append(max(0.0, assigned - ready))
                summary.write.append(written - posted_after)
                summary.commit.append(completed - written)
                if transfer_id in arrived:
                    summary.arrival.append(arrived.pop(transfer_id) - posted_after)
                else:
                    write_start[transfer_id] = posted_after
            continue
        if kind == "done":
            _, _, ok, nbytes, elapsed, error, at = report
            summary.transfers += 1
            if ok and transfer_id in write_start:
                summary.arrival.append(at - write_start.pop(transfer_id))
            elif ok:
                arrived[transfer_id] = at
            if ok:
                summary.verified += 1
                summary.bytes_verified += nbytes
                summary.latencies.append(elapsed)
            else:
                summary.failed += 1
                summary.errors.append(f"{transfer_id}: {error}")
            if not args.quiet and summary.transfers % step == 0:
                rate = summary.bytes_verified / (time.monotonic() - start) / 2**20
                print(f"  {summary.transfers}/{args.transfers} transfers verified, {rate:.0f} MiB/s", flush=True)
        pending[transfer_id] -= 1
        if pending[transfer_id] == 0:
            del pending[transfer_id]
    summary.seconds = time.monotonic() - start


def _ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    mean, p50 = statistics.fmean(values), statistics.median(values)
    return f"mean {mean * 1e3:7.2f} ms  p50 {p50 * 1e3:7.2f}  p99 {p99 * 1e3:7.2f}"


def _print_summary(summary: DemoSummary, args: argparse.Namespace) -> None:
    mib = summary.bytes_verified / 2**20
    print(f"{summary.verified}/{summary.transfers} transfers verified byte for byte ({summary.failed} failed)")
    print(f"{mib:.1f} MiB in {summary.seconds:.2f} s: {mib / max(summary.seconds, 1e-9):.0f} MiB/s, "
          f"{summary.transfers / max(summary.seconds, 1e-9):.0f} transfers/s")  # fmt: skip
    print(f"consumer register -> verified   {_ms(summary.latencies)}")
    if args.mode != "pull":
        print(f"match wait (ready -> assigned)  {_ms(summary.match_wait)}")
        print(f"assigned/ready -> write done    {_ms(summary.write)}")
        print(f"write done -> commit            {_ms(summary.commit)}")
        print(f"assigned/ready -> arrived       {_ms(summary.arrival)}")
    for error in summary.errors[:10]:
        print(f"  failed: {error}")


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; 0 if every transfer was verified, 1 otherwise."""
    os.environ.setdefault("UCX_TLS", "shm,tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if (error := demo_argument_error(args)) is not None:
        print(f"kv-rendezvous demo: error: {error}", file=sys.stderr)
        return 2
    from rendezvous.clients.testing import TestServer

    with TestServer() as server:
        shape = f"{args.regions} x {args.block_kib} KiB blocks, {args.mode}"
        print(f"rendezvous service on {server.address}; starting {args.producers} producers and "
              f"{args.consumers} consumers ({shape})", flush=True)  # fmt: skip
        engines = _Engines(server.address, args)
        try:
            engines.wait_started(timeout=120)
            summary = DemoSummary()
            _route(engines, args, summary)
        except queue.Empty:
            print("an engine stopped answering", file=sys.stderr)
            return 1
        finally:
            engines.stop()
    _print_summary(summary, args)
    return 0 if summary.verified == args.transfers else 1
