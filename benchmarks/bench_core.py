"""The service's own CPU per lifecycle, without gRPC: the coordinator over the memory store, in one process.

    python benchmarks/bench_core.py [--checkouts DIR ...] [--rounds 5] [--lifecycles 19200] [--batch 64]

A lifecycle is what bench_rendezvous drives over the wire (RegisterTargets, ClaimTransfers, TRANSFER_ASSIGNED,
CompleteTransfers, TRANSFER_COMMITTED, ReleaseTargets), here as coordinator calls in batches of --batch, with
each event built into its message as the servicer does. Also timed: the record operations every transition
or Redis round trip pays (`evolve`, the codec's encode and decode, a transfer's message).

With --checkouts, each round runs every checkout once, alternating, each in a fresh interpreter with that
checkout first on sys.path (this script's own code measures them all); the report gives medians, ranges and
each checkout's ratio to the first. Without it, the current tree alone. Process CPU time, so other load
moves the figures less than wall time; still compare within one run. Results go to
benchmarks/results/core.json (--out to change).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parents[1]


async def lifecycles(count: int, batch: int) -> float:
    """CPU seconds per lifecycle of `count` lifecycles in batches of `batch`."""
    from rendezvous import wire
    from rendezvous.coordinator import Coordinator
    from rendezvous.core.model import KvLayout, KvRegion, NixlAgent, Outcome, Role
    from rendezvous.store.memory import MemoryStore

    try:
        from rendezvous.protocol.requests import ClaimSpec, CompletionSpec, EngineSpec, ReleaseSpec, TargetSpec
    except ImportError:  # a checkout before issue 26 keeps them in rendezvous.core.specs
        from rendezvous.core.specs import (  # type: ignore[import-not-found,no-redef]
            ClaimSpec,
            CompletionSpec,
            EngineSpec,
            ReleaseSpec,
            TargetSpec,
        )

    layout = KvLayout(model_fingerprint="bench", dtype="float32", block_size=16, num_layers=2)
    regions = (KvRegion(1 << 20, 4096, 4096, 100_000),)
    coordinator = Coordinator(MemoryStore())
    for engine_id, role in (("c", Role.CONSUMER), ("p", Role.PRODUCER)):
        agents = (NixlAgent(name=f"{engine_id}-0", metadata=b"md", regions=regions),)
        await coordinator.register_engine(EngineSpec(engine_id, engine_id, role, layout, agents))
    after = {"c": 0, "p": 0}

    async def deliver(engine_id: str) -> None:
        page = await coordinator.read_events(engine_id, after[engine_id] + 1, 100_000)
        for event in page.events:
            wire.event_message(event)
            after[engine_id] = event.sequence

    started = time.process_time()
    for first in range(0, count, batch):
        ids = [f"t-{i}" for i in range(first, first + batch)]
        blocks = [tuple((i * 16 + b) % 100_000 for b in range(16)) for i in range(first, first + batch)]
        targets = [TargetSpec(t, b, generation=1, num_tokens=256) for t, b in zip(ids, blocks, strict=True)]
        await coordinator.register_targets("c", 0, targets)
        await coordinator.claim_transfers("p", 0, [ClaimSpec(t) for t in ids])
        await deliver("p")
        await coordinator.complete_transfers("p", 0, [CompletionSpec(t, 1, Outcome.SUCCEEDED) for t in ids])
        await deliver("c")
        await coordinator.release_targets("c", 0, [ReleaseSpec(t, 1) for t in ids])
    return (time.process_time() - started) / count


def record_costs() -> dict[str, float]:
    """Nanoseconds per call of the record operations, best of 5 repeats."""
    from rendezvous import wire
    from rendezvous.core.model import Mode, State, Transfer, TransferTimes, evolve
    from rendezvous.store.codec import decode_transfer, encode_transfer

    t = Transfer("t-1", State.MATCHED, 1.7e9, Mode.PUSH, 1, "c", 3, "p", 4, tuple(range(256, 272)), None, 256)
    t = evolve(t, times=TransferTimes(1.7e9, 1.7e9, 1.7e9, 0.0, 0.0, 0.0))
    data = encode_transfer(t)
    message: Callable[[Transfer], object]
    try:
        from rendezvous.protocol.convert import transfer_message as message
    except ImportError:  # a checkout before b2bfbef keeps it in rendezvous.wire
        message = wire.__dict__["transfer_message"]
    calls = {
        "evolve": lambda: evolve(t, state=State.COMMITTED, assigned_generation=0),
        "encode": lambda: encode_transfer(t),
        "decode": lambda: decode_transfer(data),
        "message": lambda: message(t),
    }
    number = 50_000
    return {name: min(timeit.repeat(f, number=number, repeat=5)) / number * 1e9 for name, f in calls.items()}


def measure(count: int, batch: int) -> dict[str, Any]:
    """One measurement of the code on sys.path."""
    import rendezvous

    return {
        "code": str(Path(rendezvous.__file__).resolve().parents[1]),
        "lifecycle_us": asyncio.run(lifecycles(count, batch)) * 1e6,
        "record_ns": record_costs(),
    }


def run_checkout(checkout: Path, count: int, batch: int) -> dict[str, Any]:
    """measure() in a fresh interpreter with `checkout` first on sys.path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, __file__, "--worker", "--lifecycles", str(count), "--batch", str(batch)]
    run = subprocess.run(argv, env=env, cwd=checkout, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{checkout}: the measurement failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(run.stdout)
    if Path(result["code"]) != checkout.resolve():
        raise SystemExit(f"{checkout}: its interpreter imported rendezvous from {result['code']}")
    return result


def commit(checkout: Path) -> str:
    """The checkout's commit, "+" when its tree has changes; "" outside git."""

    def git(*args: str) -> str:
        run = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True)
        return run.stdout.strip() if run.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    return head + ("+" if head and git("status", "--porcelain", "--untracked-files=no") else "")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} ({min(values):.1f}-{max(values):.1f})"


def report(checkouts: list[Path], rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Print medians, ranges and ratios to the first checkout; return them, a checkout each, in order."""
    summary: list[dict[str, Any]] = []
    first: dict[str, float] = {}
    for i, checkout in enumerate(checkouts):
        runs = [r[i] for r in rounds]
        figures = {"lifecycle_us": [r["lifecycle_us"] for r in runs]}
        for name in runs[0]["record_ns"]:
            figures[f"{name}_ns"] = [r["record_ns"][name] for r in runs]
        medians = {k: statistics.median(v) for k, v in figures.items()}
        first = first or medians
        summary.append(
            {
                "checkout": str(checkout.resolve()),
                "commit": commit(checkout),
                "runs": figures,
                "median": medians,
                "ratio_to_first": {k: medians[k] / first[k] for k in medians},
            }
        )
        print(f"{checkout} ({summary[-1]['commit'] or 'not git'}):")
        for name, values in figures.items():
            print(f"  {name:13} {spread(values)}   x{medians[name] / first[name]:.3f} of the first")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkouts", type=Path, nargs="+", default=[REPO], help="trees to compare (default: this)")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each checkout, alternating")
    parser.add_argument("--lifecycles", type=int, default=19_200, help="lifecycles per run")
    parser.add_argument("--batch", type=int, default=64, help="items per coordinator call")
    parser.add_argument("--out", type=Path, default=RESULTS / "core.json", help="results file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lifecycles < args.batch or args.batch < 1 or args.rounds < 1:
        parser.error("--batch and --rounds must be at least 1, and --lifecycles at least --batch")
    if missing := [str(c) for c in args.checkouts if not c.is_dir()]:
        parser.error(f"not a folder: {', '.join(missing)}")
    if args.worker:
        print(json.dumps(measure(args.lifecycles, args.batch)))
        return
    rounds = []
    for r in range(args.rounds):
        rounds.append([run_checkout(c, args.lifecycles, args.batch) for c in args.checkouts])
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{x['lifecycle_us']:.1f}" for x in rounds[-1]) + " us")
    results = {
        "benchmark": "core lifecycles in process",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "lifecycles": args.lifecycles,
        "batch": args.batch,
        "checkouts": report(args.checkouts, rounds),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
