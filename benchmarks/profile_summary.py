"""Where a server's CPU went, from a py-spy speedscope profile (bench_rendezvous.py --profile): each sample
is charged to the first category (in RULES order) with a frame anywhere on its stack, so what metrics,
logging or tracing call is theirs, what serialization calls under the Watch loop is serialization, and so on
down to grpc.aio and the event loop, which every stack passes through.

    python benchmarks/profile_summary.py benchmarks/results/profile-memory.speedscope.json [--per-lifecycle-us 145]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

# (category, tests on "file:function"), by priority.
RULES: list[tuple[str, tuple[str, ...]]] = [
    ("metrics (prometheus_client, server/metrics.py)", ("prometheus_client/", "server/metrics.py")),
    ("logging", ("/logging/", ":_log_transition")),
    ("tracing hooks", ("protocol/tracing.py", ":_trace_items")),
    (
        "serialization: records <-> messages (wire, convert, item results)",
        ("rendezvous/wire.py", "protocol/convert.py", ":_weigh", ":RendezvousServicer._results", "_pb2"),
    ),
    (
        "event fan-out (Watch loop, event logs, byte-cut batches)",
        (
            ":RendezvousServicer.Watch",
            "core/paging.py:chunks",
            ":_EventLog",
            "MemoryStore.read_events",
            "MemoryStore._append",
            "MemoryStore.wait_events",
        ),
    ),
    ("state machine (rendezvous/core)", ("rendezvous/core/",)),
    ("store (rendezvous/store)", ("rendezvous/store/",)),
    ("coordinator (batches, observer)", ("rendezvous/coordinator.py",)),
    ("servicer glue (_rpc, handlers)", ("rendezvous/server/",)),
    ("grpc.aio, asyncio and the event loop", ("grpc/", "/asyncio/", "selectors.py", "threading.py", "<frozen runpy>")),
]


def summarize(path: Path) -> tuple[Counter[str], float]:
    data = json.loads(path.read_text())
    frames = [f"{f.get('file', '')}:{f['name']}" for f in data["shared"]["frames"]]
    charged: Counter[str] = Counter()
    total = 0.0
    for profile in data["profiles"]:
        for stack, weight in zip(profile["samples"], profile["weights"], strict=True):
            total += weight
            on_stack = [frames[index] for index in stack]
            category = next(
                (name for name, tests in RULES if any(t in frame for frame in on_stack for t in tests)), "other"
            )
            charged[category] += weight
    return charged, total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profiles", type=Path, nargs="+")
    parser.add_argument("--per-lifecycle-us", type=float, nargs="*", help="server CPU per lifecycle, one per profile")
    args = parser.parse_args()
    per = args.per_lifecycle_us or []
    columns = [summarize(p) for p in args.profiles]
    names = [name for name, _ in RULES] + ["other"]
    header = " | ".join(p.name for p in args.profiles)
    print(f"| category | {header} |\n|---|" + "---|" * len(columns))
    for name in names:
        cells = []
        for i, (charged, total) in enumerate(columns):
            share = charged[name] / total if total else 0.0
            cells.append(f"{share:.0%}" + (f" ({share * per[i]:.0f} us)" if i < len(per) else ""))
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
