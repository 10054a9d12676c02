"""link_table's aggregation of bench_link runs: medians and spreads of per-run p50s and ratios, the WRITE bound."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from link_table import collect, link_bits_per_s, report, spread


def run(ours_ttft: float, progressive_ttft: float, load: float = 1.0) -> dict[str, Any]:
    """A bench_link result with one link (1gbit), one length (256) and two modes."""
    summary = {
        "plain": {"ok": 8, "requests": 8, "ttft_p50_ms": 80.0, "tpot_p50_ms": 9.0, "e2e_p50_ms": 360.0},
        "ours": {"ok": 8, "requests": 8, "ttft_p50_ms": ours_ttft, "tpot_p50_ms": 10.0, "e2e_p50_ms": 400.0},
        "ours-progressive": {"ok": 7, "requests": 8, "ttft_p50_ms": progressive_ttft, "tpot_p50_ms": 10.0},
    }
    return {
        "machine": {"loadavg_before": [load, 0, 0], "loadavg_after": [load + 1, 0, 0]},
        "parameters": {"kv_bytes_per_token": 32 * 1024, "prefill_chunk": 128, "model_shape": {"num_hidden_layers": 8}},
        "wall_s": 200.0,
        "links": {
            "1gbit": {
                "failed_modes": {},
                "link_bytes": {},
                "lengths": {"256": {"summary": summary, "output_mismatches": []}},
            }
        },
    }


def test_each_cell_is_the_median_of_the_runs_and_ratios_are_taken_within_a_run() -> None:
    cells = collect([run(100.0, 80.0), run(200.0, 100.0), run(150.0, 150.0)])["1gbit"][256]
    progressive = cells["ours-progressive"]
    assert progressive.p50_ms["ttft"] == [80.0, 100.0, 150.0]
    assert progressive.to_base["ttft"] == pytest.approx([0.8, 0.5, 1.0])
    assert progressive.p50_ms["e2e"] == [] and progressive.to_base["e2e"] == []
    assert (progressive.ok, progressive.requests) == (21, 24)
    assert spread(progressive.to_base["ttft"], 2) == "0.80 (0.50-1.00)"
    assert spread([1234.5, 12212.0, 1290.2], 1) == "1,290.2 (1,234.5-12,212.0)"
    assert spread([], 1) == "-"


def test_the_report_has_the_results_table_rows_the_bound_and_each_runs_load(tmp_path: Path) -> None:
    paths = []
    for i, (ours, progressive) in enumerate([(100.0, 80.0), (200.0, 100.0), (150.0, 150.0)]):
        paths.append(tmp_path / f"link-{i}.json")
        paths[-1].write_text(json.dumps(run(ours, progressive, load=2.5)))
    text = report(paths).splitlines()
    assert text[0] == "1gbit (3 runs):"
    row = "| 256 | ours-progressive (21/24) | 100.0 (80.0-150.0) | 10.0 (10.0-10.0) | - | 0.80 (0.50-1.00) |"
    assert row + " 1.00 (1.00-1.00) | - |" in text
    assert "| 256 | ours (24/24) | 150.0 (100.0-200.0) | 10.0 (10.0-10.0) | 400.0 (400.0-400.0) | 1 | 1 | 1 |" in text
    # 256 tokens x 32 KiB = 8 MiB = 67.1 ms at 1 Gbit/s; plain's 80 ms over 8 layers and 2 chunks of 128.
    assert "- 256 tokens: 8.0 MiB of KV, 67.1 ms at 1gbit; plain TTFT 80.0 ms: 10.0 ms a layer, 40.0 ms a chunk" in text
    assert "- link-0.json: load 2.50 before, 3.50 after; 200 s; 0 mismatches" in text


def test_link_rates_are_read_as_tc_writes_them() -> None:
    assert link_bits_per_s("25gbit") == 25e9
    assert link_bits_per_s("500mbit") == 500e6
    with pytest.raises(ValueError):
        link_bits_per_s("25G")
