"""Where one disaggregated request's time goes, from its trace: bench_vllm's `--trace` timeline.

With tracing on (`KV_RENDEZVOUS_TRACING=1`, `KV_RENDEZVOUS_TRACING_FILE`), the router, both engines' connectors
and the service append their spans, one JSON object per line, to one file; a request through the router is one
trace under its `router.dispatch` span. `timeline` places each span of each such trace by its start and end in
milliseconds from the dispatch's start; `median_timeline` takes the median over the traces, per span name (a
name that occurs several times in a trace, e.g. the RPCs, counts its first occurrence).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = "router.dispatch"


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def read_spans(path: Path) -> list[dict[str, Any]]:
    """The spans in a tracing file (a missing file has none)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def timelines(spans: Iterable[Mapping[str, Any]]) -> list[dict[str, tuple[float, float]]]:
    """Per trace with a `router.dispatch` span: each span name's (start, end) in ms from the dispatch's start,
    the first occurrence of a name, in the order the dispatches started."""
    by_trace: dict[str, list[Mapping[str, Any]]] = {}
    for span in spans:
        by_trace.setdefault(span["context"]["trace_id"], []).append(span)
    out: list[tuple[float, dict[str, tuple[float, float]]]] = []
    for members in by_trace.values():
        roots = [s for s in members if s["name"] == ROOT]
        if not roots:
            continue
        t0 = _seconds(roots[0]["start_time"])
        placed: dict[str, tuple[float, float]] = {}
        for span in sorted(members, key=lambda s: _seconds(s["start_time"])):
            placed.setdefault(
                span["name"], ((_seconds(span["start_time"]) - t0) * 1e3, (_seconds(span["end_time"]) - t0) * 1e3)
            )
        out.append((t0, placed))
    return [placed for _, placed in sorted(out, key=lambda item: item[0])]


def median_timeline(traces: Sequence[Mapping[str, tuple[float, float]]]) -> list[tuple[str, float, float, int]]:
    """(name, median start ms, median end ms, traces that have it) per span name, by median start."""
    names = {name for trace in traces for name in trace}
    rows = []
    for name in names:
        placed = [trace[name] for trace in traces if name in trace]
        starts, ends = [p[0] for p in placed], [p[1] for p in placed]
        rows.append((name, statistics.median(starts), statistics.median(ends), len(placed)))
    return sorted(rows, key=lambda row: (row[1], row[2]))


def format_timeline(rows: Sequence[tuple[str, float, float, int]]) -> str:
    """The median timeline as a table."""
    lines = [f"{'span':58s} {'start':>8s} {'end':>8s} {'traces':>6s}"]
    lines += [f"{name:58s} {start:8.1f} {end:8.1f} {n:6d}" for name, start, end, n in rows]
    return "\n".join(lines)
