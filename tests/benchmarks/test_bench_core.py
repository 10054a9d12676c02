"""bench_core at a small size: two checkouts (here the same tree twice) measured in their own interpreters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import bench_core


def test_a_small_comparison_measures_each_checkout_and_writes_its_ratios(tmp_path: Path) -> None:
    out = tmp_path / "core.json"
    repo = str(bench_core.REPO)
    argv = [sys.executable, bench_core.__file__, "--checkouts", repo, repo, "--rounds", "2", "--lifecycles", "128"]
    subprocess.run([*argv, "--out", str(out)], check=True, capture_output=True, timeout=120)
    results = json.loads(out.read_text())
    first, second = results["checkouts"]
    assert first["checkout"] == second["checkout"] == repo and first["commit"] == second["commit"] != ""
    for figures in (first, second):
        assert len(figures["runs"]["lifecycle_us"]) == 2 and all(v > 0 for v in figures["runs"]["lifecycle_us"])
        assert set(figures["median"]) == {"lifecycle_us", "evolve_ns", "encode_ns", "decode_ns", "message_ns"}
    assert set(first["ratio_to_first"].values()) == {1.0}
    ratio = second["ratio_to_first"]["lifecycle_us"]
    assert ratio == second["median"]["lifecycle_us"] / first["median"]["lifecycle_us"]


def test_a_checkout_that_imports_other_code_is_refused(tmp_path: Path) -> None:
    # A folder without the package: its interpreter finds the installed tree instead, which must not count.
    run = subprocess.run(
        [sys.executable, bench_core.__file__, "--checkouts", str(tmp_path), "--rounds", "1", "--lifecycles", "64"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0 and "imported rendezvous from" in run.stderr


def test_a_checkout_that_is_no_folder_is_a_usage_error(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, bench_core.__file__, "--checkouts", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "not a folder" in run.stderr
