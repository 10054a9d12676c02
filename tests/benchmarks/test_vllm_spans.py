"""bench_vllm's span timeline: each traced request's spans placed from its router.dispatch, then the medians."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_spans import median_timeline, read_spans, timelines


def span(trace: str, name: str, start: str, end: str) -> dict[str, object]:
    return {"name": name, "context": {"trace_id": trace}, "start_time": start, "end_time": end}


def test_spans_are_placed_from_their_dispatch_and_the_medians_taken_per_name(tmp_path: Path) -> None:
    spans = [
        span("0xb", "router.dispatch", "2026-12-01T20:00:01.000000Z", "2026-12-01T20:00:01.050000Z"),
        span("0xb", "connector.claim", "2026-12-01T20:00:01.030000Z", "2026-12-01T20:00:01.032000Z"),
        span("0xa", "router.dispatch", "2026-12-01T20:00:00.000000Z", "2026-12-01T20:00:00.040000Z"),
        span("0xa", "connector.claim", "2026-12-01T20:00:00.010000Z", "2026-12-01T20:00:00.012000Z"),
        span("0xa", "connector.claim", "2026-12-01T20:00:00.020000Z", "2026-12-01T20:00:00.022000Z"),  # a 2nd: left out
        span("0xc", "connector.claim", "2026-12-01T20:00:02.000000Z", "2026-12-01T20:00:02.001000Z"),  # no dispatch
    ]
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in spans))
    traces = timelines(read_spans(path))
    assert [t["connector.claim"] for t in traces] == [
        pytest.approx((10.0, 12.0), abs=1e-3),
        pytest.approx((30.0, 32.0), abs=1e-3),
    ]
    rows = median_timeline(traces)
    assert [r[0] for r in rows] == ["router.dispatch", "connector.claim"]
    assert rows[1][1:] == pytest.approx((20.0, 22.0, 2), abs=1e-3)
    assert rows[0][1:] == pytest.approx((0.0, 45.0, 2), abs=1e-3)


def test_a_missing_file_has_no_spans(tmp_path: Path) -> None:
    assert timelines(read_spans(tmp_path / "none.jsonl")) == []
