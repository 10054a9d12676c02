"""bench_index at a small size: both stores measured, every phase reported, a results file written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import bench_index
import pytest


@pytest.mark.redis
def test_a_small_run_measures_both_stores_and_writes_its_results(tmp_path: Path) -> None:
    argv = [sys.executable, bench_index.__file__, "--runs", "1", "--engines", "2", "--blocks", "128"]
    argv += ["--batches", "20", "--queries", "20", "--out-dir", str(tmp_path), "--tag", "t"]
    env = {**os.environ, "PYTHONPATH": str(Path(bench_index.__file__).resolve().parents[1])}
    subprocess.run(argv, check=True, capture_output=True, timeout=120, env=env)
    results = json.loads((tmp_path / "index-t-1.json").read_text())
    phases = {"report", "query", "report_service", "query_service"}
    for store in ("memory", "redis"):
        summary = results["stores"][store]["summary"]
        assert set(summary) == phases
        assert all(summary[p]["cpu_us"]["median"] > 0 for p in phases)
    assert results["stores"]["redis"]["summary"]["query_service"]["redis_cpu_us"]["median"] > 0
    assert set(results["footprint"]) == {"memory_bytes_per_block", "redis_bytes_per_block"}
